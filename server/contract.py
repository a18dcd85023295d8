"""The services of the wire contract, enumerated from the generated descriptors: what the worker must serve,
and what tests (the fuzz test among them) walk without a list kept by hand."""
from __future__ import annotations

from google.protobuf.descriptor import ServiceDescriptor

from ephost import wire
from ephost.v1 import allocator_pb2, data_transfer_pb2, ep_pb2, factory_pb2, stream_pb2, worker_pb2

_MODULES = (factory_pb2, ep_pb2, allocator_pb2, stream_pb2, data_transfer_pb2, worker_pb2)

SERVICES: dict[str, ServiceDescriptor] = {
    s.full_name: s for module in _MODULES for s in module.DESCRIPTOR.services_by_name.values()}


def service_descriptor(name: str) -> ServiceDescriptor:
    """By full name ("ephost.v1.Allocator") or short name ("Allocator")."""
    return SERVICES.get(name) or SERVICES[f"{wire.PROTOCOL}.{name}"]
