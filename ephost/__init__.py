"""ephost: ONNX execution providers out of process, behind ONNX Runtime's API shape.

The module-level functions mirror `onnxruntime`'s and act on one explicit default Environment, made on
first use and closed at interpreter exit.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Mapping, Sequence

from ephost.errors import (EpAlreadyExists, EpCancelled, EpDeadlineExceeded, EpError, EpFailedPrecondition,
                           EpInternal, EpInvalidArgument, EpInvalidGraph, EpInvalidModel, EpNoSuchFile, EpNotFound,
                           EpOutOfRange, EpPermissionDenied, EpUnknownOption,
                           EpResourceExhausted, EpUnauthenticated, EpUnimplemented, EpWorkerCrashed,
                           EpTlsError, EpUnknownClient, EpWorkerDraining, EpWorkerEnvironmentFailed,
                           EpWorkerFailed, EpWorkerReplaced, EpWorkerUnavailable)
from ephost.tensor import Tensor
from ephost.types import (HOST_MEMORY, AllocatorType, DeviceMemoryType, HardwareDevice, HardwareDeviceType,
                          MemoryInfo)

if TYPE_CHECKING:
    from ephost.client import (Environment, EpDevice, InferenceSession, IOBinding, MethodStats, ModelOnWorker,
                               NodeArg, RunOptions, SessionOptions, SharedAllocator, SyncNotification, SyncStream,
                               WorkerStats)

__version__ = "0.1.0"

# The application's side (ephost.client) is imported on first use of one of its names, not with the package: a
# worker imports ephost too, and the client's modules would cost every worker start (and restart) import time and
# memory it never uses. The layers contract (pyproject.toml) allows the facade this import: it is the layers'
# container, in no layer, and a lower layer that imported it would break the contract.
_CLIENT_NAMES = frozenset({"Environment", "EpDevice", "InferenceSession", "IOBinding", "ModelOnWorker", "NodeArg",
                           "RunOptions", "SessionOptions", "SharedAllocator", "SyncNotification", "SyncStream",
                           "WorkerStats", "MethodStats"})


def __getattr__(name: str):
    if name in _CLIENT_NAMES:
        from ephost import client
        value = getattr(client, name)
        globals()[name] = value  # once
        return value
    raise AttributeError(f"module 'ephost' has no attribute {name!r}")

_default: Environment | None = None
_default_lock = threading.Lock()  # guards _default


def get_default_environment() -> Environment:
    global _default
    with _default_lock:
        if _default is None:
            from ephost.client import Environment
            _default = Environment()  # closed as the application exits, as every Environment is
        return _default


def register_execution_provider_library(name: str, target: str, options: Mapping[str, str] | None = None) -> None:
    get_default_environment().register_execution_provider_library(name, target, options)


def unregister_execution_provider_library(name: str) -> None:
    get_default_environment().unregister_execution_provider_library(name)


def get_ep_devices() -> list[EpDevice]:
    return get_default_environment().get_ep_devices()


def copy_tensors(src: Sequence[Tensor], dst: Sequence[Tensor], stream: SyncStream | None = None) -> None:
    get_default_environment().copy_tensors(src, dst, stream)


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> int:
    """Serve this application's ephost metrics (per registration: runs, their latency, failures, restarts,
    fallbacks) in Prometheus' text format at http://ADDR:PORT/metrics; the port (0: a free one)."""
    from ephost.client.metrics import start_metrics_server
    return start_metrics_server(port, addr)


def register_metrics(registry=None) -> None:
    """Report this application's ephost metrics into a prometheus_client registry it serves already (the default
    registry when None)."""
    from ephost.client.metrics import register_metrics
    register_metrics(registry)


__all__ = [
    "Environment", "EpDevice", "InferenceSession", "IOBinding", "SessionOptions", "RunOptions", "NodeArg",
    "SharedAllocator", "SyncStream", "SyncNotification", "Tensor", "MemoryInfo",
    "ModelOnWorker", "WorkerStats", "MethodStats", "HardwareDevice", "HardwareDeviceType", "DeviceMemoryType",
    "AllocatorType", "HOST_MEMORY",
    "get_default_environment", "register_execution_provider_library", "unregister_execution_provider_library",
    "get_ep_devices", "copy_tensors", "start_metrics_server", "register_metrics",
    "EpError", "EpInvalidArgument", "EpNotFound", "EpAlreadyExists", "EpResourceExhausted",
    "EpFailedPrecondition", "EpOutOfRange", "EpDeadlineExceeded", "EpUnimplemented", "EpUnauthenticated",
    "EpPermissionDenied", "EpCancelled", "EpInternal", "EpWorkerUnavailable", "EpWorkerCrashed", "EpWorkerFailed",
    "EpWorkerEnvironmentFailed", "EpUnknownClient", "EpWorkerDraining", "EpWorkerReplaced", "EpTlsError",
    "EpInvalidModel", "EpInvalidGraph", "EpNoSuchFile", "EpUnknownOption",
]
