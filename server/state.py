"""Everything a worker's servicers share: the EP factory, the clients and their handles, the counters."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import itertools
import os
import platform
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

import onnx

from ephost.external_data import OPEN_FLAGS, ExternalData, model_key, path_inside
from ephost.errors import EpError, EpFailedPrecondition, EpInvalidArgument, EpNotFound, EpResourceExhausted, quoted
from ephost.graph import GraphIndex
from ephost.fdshare import DescriptorServer
from ephost.memory import Region
from ephost.types import DeviceMemoryType, EpDeviceInfo, MemoryInfo, checked_enum, refuse_external_data
from ephost.server.capabilities import CapabilityCache
from ephost.server.clients import ClientRegistry, ClientState
from ephost.server.files import FileSlot
from ephost.server.stats import WorkerStats
from ephost.v1 import worker_pb2
from ephost.wire import MAX_MESSAGE, PROTOCOL


# Models larger than this (in nodes of the main graph) are refused with RESOURCE_EXHAUSTED rather than indexed.
MAX_MODEL_NODES = 1_000_000


@dataclass(frozen=True)
class Limits:
    """What one client may ask of a worker, whatever it asks."""

    max_alloc_bytes: int = 1 << 40        # one allocation (a buffer, an arena region, an inline reply)
    max_message: int = MAX_MESSAGE        # one gRPC message (an inline reply must fit in one)


def installed_version(distribution: str) -> str:
    """The version of a distribution in this (the worker's) environment, or "" where it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _check_names(index: GraphIndex) -> None:
    """Refuse a model whose node or value names are not valid UTF-8. ONNX's messages are proto2, whose parser
    hands such a name over as bytes, which no reply can carry."""
    for i, name in enumerate(index.nodes):
        if type(name) is not str:
            raise EpInvalidArgument(f"node {i} of the model is named {quoted(name.decode('utf-8', 'replace'))}, "
                                    "which is not valid UTF-8")
    for name in itertools.chain(index.producer, index.consumers, index.graph_inputs, index.graph_outputs,
                                index.initializers):
        if type(name) is not str:
            raise EpInvalidArgument(f"the model has a value named {quoted(name.decode('utf-8', 'replace'))}, "
                                    "which is not valid UTF-8")


class WorkerState:
    def __init__(self, ep_name: str, factory, options: Mapping[str, str], fd_server: DescriptorServer | None,
                 limits: Limits = Limits(), launched: bool = False, blobs=None, model_dir: str | None = None):
        self.ep_name = ep_name
        self.limits = limits
        # Launched by one application for itself (--exit-with-parent): that application, and only it, may
        # shut the worker down. A worker serving others is stopped by its operator (SIGTERM).
        self.launched = launched
        self.factory = factory
        self.options = dict(options)
        self.ephost_version = installed_version("ephost")
        self.onnxruntime_version = installed_version("onnxruntime")
        # The ONNX Runtime a device's EP runs under is the worker's, which may not be the application's.
        self.devices: list[EpDeviceInfo] = [
            dataclasses.replace(d, ep_metadata={**d.ep_metadata, "onnxruntime_version": self.onnxruntime_version})
            if self.onnxruntime_version else d for d in factory.get_supported_devices()]
        self.fd_server = fd_server
        self.blobs = blobs  # the disk cache of external data blobs (server.blob_cache.BlobCache), or None
        # Models (and their external data) clients may name by a path relative to this directory (--model-dir)
        self.model_dir = os.path.realpath(model_dir) if model_dir else None
        self.lane = None  # the fast lane's listener (ephost.server.fastlane.LaneServer) where clients share memory
        self.stats = WorkerStats()
        self.capabilities = CapabilityCache()  # GetCapability answers, across clients (keyed by model content)
        self.clients = ClientRegistry(self._release, self._left)
        self.started_at = time.time()
        self.draining = threading.Event()
        # The one entry point of every call (server.rpc.Dispatcher), set once the servicers exist; a second
        # transport (the same-host data plane) calls dispatcher.dispatch(...) as gRPC does.
        self.dispatcher = None

    def check_size(self, nbytes: int, what: str) -> None:
        """Refuse one allocation larger than this worker allows (--max-alloc-mb)."""
        if nbytes > self.limits.max_alloc_bytes:
            raise EpResourceExhausted(f"{what} of {nbytes} bytes is over this worker's limit for one allocation "
                                      f"({self.limits.max_alloc_bytes} bytes, --max-alloc-mb)")

    def info(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(protocol=PROTOCOL, ep_name=self.ep_name, version=self.factory.get_version(),
                                     pid=os.getpid(), ep_options=self.options, started_at=self.started_at,
                                     ephost_version=self.ephost_version,
                                     onnxruntime_version=self.onnxruntime_version,
                                     python_version=platform.python_version())

    def device(self, index: int) -> EpDeviceInfo:
        if not 0 <= index < len(self.devices):
            raise EpNotFound(f"no device {index}; this worker has {len(self.devices)}")
        return self.devices[index]

    def memory_info(self, device_index: int, mem_type: int) -> MemoryInfo:
        mem_type = checked_enum(DeviceMemoryType, mem_type, "device_mem_type")
        device = self.device(device_index)
        for info in device.memory_infos:
            if info.device_mem_type == mem_type:
                return info
        raise EpNotFound(f"device {device_index} has no {DeviceMemoryType(mem_type).name} memory")

    def region(self, client: ClientState, region_id: int) -> tuple[Any, Region]:
        """(allocator, region) for a region of one of this client's allocators; another client's are NOT_FOUND."""
        for _, allocator in client.items("allocator"):
            region = allocator.region(region_id)
            if region is not None:
                return allocator, region
        raise EpNotFound(f"unknown shared-memory region {region_id} for this client")

    def export_region(self, client_id: str, region_id: int) -> tuple[int, int] | None:
        """(a duplicate of its descriptor, its size) for a shareable region of this client's; None otherwise."""
        try:
            _, region = self.region(self.clients.lookup(client_id), region_id)
        except EpError:  # an unknown client, or not its region
            return None
        fd = region.dup_fd()
        return (fd, region.size) if fd is not None else None

    def model(self, client: ClientState, ref, deadline: float | None = None) -> GraphIndex:
        """The model a ModelRef names, parsed and indexed once per client and content hash (of its bytes and of
        the files its external data names); EpDeadlineExceeded where indexing it outlasts `deadline`."""
        source = ref.WhichOneof("source")
        if source == "sha256":
            index = client.models.get(ref.sha256)
            if index is None:
                raise EpNotFound("model not known to this worker by that hash; send it inline once")
            return index
        if source == "model":
            data = bytes(ref.model)
        elif source == "buffer":
            entry = client.get("buffer", ref.buffer.buffer)
            view = entry.buffer.host_view()
            if view is None or not 0 <= ref.buffer.nbytes <= entry.buffer.nbytes:
                raise EpInvalidArgument("model buffer is not readable or is smaller than the model's size")
            data = bytes(view[: ref.buffer.nbytes])
        else:
            raise EpInvalidArgument("ModelRef says nowhere where the model is")
        handles = {f.name: (getattr(f, f.WhichOneof("source") or "file"), f.nbytes) for f in ref.files}
        if len(handles) != len(ref.files):
            raise EpInvalidArgument("ModelRef names one external data file twice")
        digest = model_key(hashlib.sha256(data).hexdigest(), handles)
        if digest not in client.models:
            try:
                model = onnx.load_model_from_string(data)
            except Exception as e:
                raise EpInvalidArgument(f"model bytes are not a valid ONNX model: {type(e).__name__}") from None
            if len(model.graph.node) > MAX_MODEL_NODES:
                raise EpResourceExhausted(f"the model has {len(model.graph.node)} nodes; this worker takes models "
                                          f"of up to {MAX_MODEL_NODES}")
            external = self._external_files(client, ref.files)
            if external is None:
                refuse_external_data(model, "the model")
            else:
                external.check(model)  # every location one of the files, every range inside it
            index = GraphIndex.of(model, deadline)
            _check_names(index)
            index.external = external
            index.digest = digest
            client.models[digest] = index
        return client.models[digest]

    def _external_files(self, client: ClientState, files) -> ExternalData | None:
        """The files a ModelRef's external data names, by name: descriptors this client handed over, or blobs
        of this worker's cache (opened here, by their digest, from the cache's own directory)."""
        if not files:
            return None
        out = {}
        for f in files:
            source = f.WhichOneof("source")
            if source == "file":
                mapped = client.get("file", f.file).get()
            elif source == "model_dir_path":
                slot = FileSlot("a model directory file")
                mapped = slot.attach(self.open_in_model_dir(f.model_dir_path, f"external data file {quoted(f.name)}"))
                client.add("file", slot)  # closed when the client goes
            elif source == "sha256":
                if self.blobs is None:
                    raise EpFailedPrecondition("this worker has no blob cache (--cache-max-mb 0)")
                slot = FileSlot("a cached blob")
                mapped = slot.attach(self.blobs.open(f.sha256, f.name))
                client.add("file", slot)  # closed when the client goes
            else:
                raise EpInvalidArgument(f"external data file {quoted(f.name)} says nowhere where its bytes are")
            if mapped.size != f.nbytes:
                raise EpInvalidArgument(f"external data file {quoted(f.name)} is {mapped.size} bytes here, not the "
                                        f"{f.nbytes} the client says (changed on disk?)")
            out[f.name] = mapped
        return ExternalData(out)

    def model_dir_path(self, path: str, what: str) -> str:
        """The path of `path` (relative) inside this worker's model directory; never one outside it."""
        if self.model_dir is None:
            raise EpFailedPrecondition("this worker has no model directory (--model-dir)")
        inside = path_inside(self.model_dir, path)
        if inside is None:
            raise EpInvalidArgument(f"{what} {quoted(path)} is not inside the worker's model directory")
        return inside

    def open_in_model_dir(self, path: str, what: str) -> int:
        """A read-only descriptor of a file in the model directory."""
        try:
            return os.open(self.model_dir_path(path, what), OPEN_FLAGS)
        except FileNotFoundError:
            raise EpNotFound(f"{what} {quoted(path)} is not in the worker's model directory") from None
        except OSError as e:
            raise EpInvalidArgument(f"{what} {quoted(path)} cannot be opened: {e.strerror}") from None

    def _release(self, kind: str, obj: Any) -> None:
        if kind in ("stream", "notification"):
            obj.release()
        elif kind == "ep":
            self.factory.release_ep(obj)
        elif kind == "allocator":
            self.release_allocator(obj)
        elif kind == "file":
            obj.close()
        # buffers go with their allocator; compute infos and data transfers hold nothing to release

    def release_allocator(self, allocator) -> None:
        """Release an allocator, and the tickets that would still hand over its regions."""
        if self.fd_server is not None:
            self.fd_server.revoke_group(allocator)
        self.factory.release_allocator(allocator)

    def _left(self, client: ClientState) -> None:
        """A client said goodbye or was released: its tickets die with it, and its fast-lane connections end (what
        they kept, kept calls over its buffers among it, goes with them)."""
        if self.fd_server is not None:
            self.fd_server.revoke(client.client_id)
        if self.lane is not None:
            self.lane.close_client(client.client_id)
