"""The EP interface, with ONNX Runtime's plugin-EP names (OrtEpFactory, OrtEp, OrtNodeComputeInfo,
OrtAllocator, OrtDataTransferImpl, OrtSyncStreamImpl, OrtSyncNotificationImpl).

An in-process EP implements these directly; the worker serves any implementation over gRPC; the client
turns a worker back into the same interface. Sessions and the Environment see only these protocols.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import onnx

from ephost import ep_context
from ephost.eps.kernel_info import KernelInfo, TypeInfo, ValueInfo  # noqa: F401 (part of the EP interface)
from ephost.external_data import ExternalData, ExternalFile, external_ref
from ephost.graph import GraphIndex, extract
from ephost.memory import Buffer
from ephost.types import HOST_MEMORY, EpDeviceInfo, HardwareDeviceType, MemoryInfo

if TYPE_CHECKING:
    from ephost.tensor import Tensor


@dataclass(frozen=True)
class NodeGroup:
    """One answer of GetCapability: nodes to fuse into one partition, or a single node."""

    node_names: tuple[str, ...]
    fused: bool = True


@dataclass(frozen=True)
class FusedGraph:
    """A fused group of a model's nodes, with the values it reads and makes. `model` is the group as a
    standalone model (its nodes, inputs, outputs and the initializers it uses), cut out when first asked."""

    name: str
    source: GraphIndex = field(repr=False)
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @functools.cached_property
    def model(self) -> onnx.ModelProto:
        return extract(self.source, self.name, self.nodes, self.inputs, self.outputs)

    @property
    def ep_context_node(self) -> onnx.NodeProto | None:
        """The EPContext node this graph consists of, where it is one (a compiled partition to restore)."""
        return ep_context.single(self.source.nodes[n] for n in self.nodes)

    def kernel_info(self, options: Mapping[str, str] | None = None) -> KernelInfo:
        """What the partition's compute sees of itself (ORT's OrtKernelInfo): its inputs' and outputs' names,
        element types and shapes, in the order compute takes and returns them, and the EP's `options`."""
        return KernelInfo.of(self.model, self.name, options)

    @property
    def external(self) -> ExternalData | None:
        """The files the model's external tensors name (ephost.external_data), or None where it has none."""
        return self.source.external


@runtime_checkable
class Allocator(Protocol):
    memory_info: MemoryInfo

    def alloc(self, nbytes: int) -> Buffer: ...
    def reserve(self, nbytes: int) -> Buffer: ...
    def free(self, buffer: Buffer) -> None: ...
    def get_stats(self) -> dict[str, int]: ...


@runtime_checkable
class SyncNotification(Protocol):
    def activate(self) -> None: ...
    def wait_on_host(self, timeout: float | None = None) -> None: ...
    def wait_on_device(self, stream: "SyncStream") -> None: ...
    def release(self) -> None: ...


@runtime_checkable
class SyncStream(Protocol):
    def create_notification(self) -> SyncNotification: ...
    def flush(self, timeout: float | None = None) -> None: ...
    def on_session_run_end(self) -> None: ...
    def release(self) -> None: ...


@runtime_checkable
class DataTransfer(Protocol):
    def can_copy(self, src: MemoryInfo, dst: MemoryInfo) -> bool: ...
    def copy_tensors(self, src: Sequence["Tensor"], dst: Sequence["Tensor"],
                     stream: SyncStream | None = None) -> None: ...


# Session config entries (ONNX Runtime's names) that reach an EP among CreateEp's session options, beside its
# provider options: with ep.context_enable=1 the EP gives each compute info it compiles an `ep_context`.
EP_CONTEXT_ENABLE = ep_context.ENABLE
SESSION_CONFIG_PREFIXES = ("ep.context_", "session.")


def split_session_options(options: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(provider options, session config entries) of what CreateEp was given."""
    config = {k: v for k, v in options.items() if k.startswith(SESSION_CONFIG_PREFIXES)}
    return {k: v for k, v in options.items() if k not in config}, config


_NO_TENSORS: Mapping[int, "Tensor"] = MappingProxyType({})


class ComputeCall:
    """One Compute of a partition, as a value (ORT's kernel context): what an EP reads and where its outputs go.

    `inputs`: graph values, in the order the partition takes them: a Tensor, or a C-contiguous numpy array (this
    process's memory), for plain tensors; a list, None, dict or numpy array (strings, bfloat16...) for the rest.
    `allocator`: memory outputs may be placed in (the caller can hand that memory on without a copy); None: host
    memory. `keep`: the outputs (by position) that must stay
    in `allocator`'s memory because the same EP reads them next. `into`: outputs (by position) to write into
    given tensors (an IOBinding's bound outputs): a worker writes them there and returns those tensors; an EP in
    this process may ignore it (the caller copies then). `leave`: kept outputs nobody in the calling process
    reads: a worker that shares no memory with it does not send their bytes back. `run_options`: the run's
    logid, log levels and run config entries (an `ephost.v1.ep_pb2.RunOptions`), as an ORT plugin EP reads its
    OrtRunOptions; None where the run has none. `timeout`: the call's deadline in seconds: an EP in another
    process is abandoned (and its worker ended) past it; code in this process cannot be interrupted and ignores
    it. `on_kernel_ran`: what kernel_ran() calls (set by a worker whose caller sleeps for the reply)."""

    __slots__ = ("inputs", "allocator", "keep", "into", "leave", "run_options", "timeout", "on_kernel_ran")

    def __init__(self, inputs: Sequence[Any], allocator: "Allocator | None" = None, keep: tuple[int, ...] = (),
                 into: Mapping[int, "Tensor"] = _NO_TENSORS, leave: tuple[int, ...] = (), run_options: Any = None,
                 timeout: float | None = None, on_kernel_ran: Callable[[], Any] | None = None):
        # One assignment each: tuple assignments build and unpack a tuple on every Compute.
        self.inputs = inputs
        self.allocator = allocator
        self.keep = keep
        self.into = into
        self.leave = leave
        self.run_options = run_options
        self.timeout = timeout
        self.on_kernel_ran = on_kernel_ran

    def __repr__(self) -> str:
        return (f"ComputeCall({len(self.inputs)} inputs, keep={self.keep}, into={sorted(self.into)}, "
                f"leave={self.leave}, timeout={self.timeout})")

    def kernel_ran(self) -> None:
        """Say, from inside compute, that the partition's kernel has run and what is left is making its outputs
        (copies, tensors). A worker then wakes a caller asleep for the reply at once rather than as compute
        returns, so that the caller's wake-up overlaps that work. Optional; a no-op where nobody sleeps so."""
        if self.on_kernel_ran is not None:
            self.on_kernel_ran()


@runtime_checkable
class NodeComputeInfo(Protocol):
    """A compiled partition (ORT's OrtNodeComputeInfo). `compute(call)` runs it once (see ComputeCall) and
    returns its outputs as graph values, in order.

    Optional attributes: `ep_context` (an ephost.ep_context.EpContext: the partition's compiled form, made when
    the EP was created with ep.context_enable=1; None where the EP has none) and `restored` (True where the
    EP restored the partition from an EPContext node of its own instead of compiling it)."""

    name: str

    def compute(self, call: ComputeCall) -> list[Any]: ...


@runtime_checkable
class ExternalDataLoader(Protocol):
    """ONNX Runtime's external data loader (OrtExternalDataLoader): an EP that puts initializers stored in
    external data files straight into memory of its own, asked per memory info whether it can."""

    def can_load(self, memory_info: MemoryInfo) -> bool: ...
    def load_tensor(self, file: ExternalFile, offset: int, length: int, tensor: "Tensor") -> None: ...


class MappingLoader:
    """The default: host memory gets the file's pages mapped, read-only, where they are (nothing copied;
    untouched pages are never read). `load_tensor` copies, for an EP that asks for a tensor of its own."""

    def can_load(self, memory_info: MemoryInfo) -> bool:
        return memory_info.device_type == HardwareDeviceType.CPU

    def load_tensor(self, file: ExternalFile, offset: int, length: int, tensor: "Tensor") -> None:
        np.copyto(tensor.local_bytes(), np.frombuffer(file.view(offset, length), np.uint8))


def external_initializers(graph: FusedGraph, ep: Any = None, memory_info: MemoryInfo = HOST_MEMORY,
                          allocator: Allocator | None = None) -> dict[str, Any]:
    """The partition's main-graph initializers whose bytes are external, by name. Where the EP has a loader
    (`ep.external_data_loader()`) that can load into `memory_info`, each is loaded by it into a tensor of
    `allocator` (host memory where none is given); otherwise (the default) each is an array over the file's
    mapping: no copy. Only what this partition reads is touched."""
    external = graph.external
    if external is None:
        return {}
    get_loader = getattr(ep, "external_data_loader", None)
    loader = get_loader() if get_loader is not None else None
    if loader is not None and not loader.can_load(memory_info):
        loader = None
    out: dict[str, Any] = {}
    for t in graph.model.graph.initializer:
        ref = external_ref(t)
        if ref is None:
            continue
        mapped = external.array(t)  # checks bounds and type; its pages are not touched
        if loader is None:
            out[t.name] = mapped
            continue
        from ephost import tensor as tensors  # not at the top: ephost.tensor is imported after this module
        tensor = tensors.Tensor.empty(mapped.shape, mapped.dtype, allocator) if allocator is not None \
            else tensors.Tensor.from_numpy(np.empty(mapped.shape, mapped.dtype))
        loader.load_tensor(external.file(ref), ref.offset, mapped.nbytes, tensor)
        out[t.name] = tensor
    return out


def capability(ep: "Ep", model: onnx.ModelProto, claimed: frozenset[str],
               external: ExternalData | None = None) -> list[NodeGroup]:
    """Ask `ep` which nodes it takes; the model's external data files go along where it has any (an EP that
    never sees such a model need not take the argument)."""
    if external is None:
        return ep.get_capability(model, claimed)
    return ep.get_capability(model, claimed, external=external)


@runtime_checkable
class Ep(Protocol):
    def get_name(self) -> str: ...
    # `external`: the files the model's external tensors name (given only where it has any); the EP maps
    # what it reads, never opens a path the model names.
    def get_capability(self, model: onnx.ModelProto, claimed: frozenset[str],
                       external: ExternalData | None = None) -> list[NodeGroup]: ...
    def compile(self, graphs: Sequence[FusedGraph]) -> list[NodeComputeInfo]: ...
    def release_node_compute_infos(self, infos: Sequence[NodeComputeInfo]) -> None: ...
    def get_preferred_data_layout(self) -> str: ...
    def set_dynamic_options(self, options: Mapping[str, str]) -> None: ...
    def on_run_start(self, run_options: Mapping[str, str]) -> None: ...
    def on_run_end(self, sync_stream: bool) -> None: ...
    def start_profiling(self) -> None: ...
    def end_profiling(self) -> list["ProfilingEvent"]: ...


@dataclass(frozen=True)
class ProfilingEvent:
    """What an EP recorded while profiling (a Chrome trace event): `start_ns` is a wall-clock time (time.time_ns()),
    `duration_ns` a length, both in nanoseconds."""

    name: str
    category: str
    start_ns: int
    duration_ns: int
    args: Mapping[str, str] = field(default_factory=dict)
    pid: int = 0
    tid: int = 0


class EpDefaults:
    """What an OrtEp does where the plugin leaves a function out: NCHW layout, dynamic options kept, no
    per-run hooks. EPs inherit it and override what they do differently."""

    dynamic_options: dict[str, str]

    def release_node_compute_infos(self, infos: Sequence[NodeComputeInfo]) -> None:
        pass  # a compute info holds what it uses, and goes with it

    def get_preferred_data_layout(self) -> str:
        return "NCHW"

    def set_dynamic_options(self, options: Mapping[str, str]) -> None:
        self.dynamic_options = {**getattr(self, "dynamic_options", {}), **options}

    def on_run_start(self, run_options: Mapping[str, str]) -> None:
        pass

    def on_run_end(self, sync_stream: bool) -> None:
        pass

    def start_profiling(self) -> None:
        pass  # an EP that measures nothing of its own: ORT's profile has its partitions' times

    def end_profiling(self) -> list[ProfilingEvent]:
        return []


@runtime_checkable
class EpFactory(Protocol):
    def get_name(self) -> str: ...
    def get_vendor(self) -> str: ...
    def get_vendor_id(self) -> int: ...
    def get_version(self) -> str: ...
    def get_supported_devices(self) -> list[EpDeviceInfo]: ...
    def create_ep(self, device_indices: Sequence[int], session_options: Mapping[str, str]) -> Ep: ...
    def release_ep(self, ep: Ep) -> None: ...
    def create_allocator(self, memory_info: MemoryInfo, options: Mapping[str, str]) -> Allocator: ...
    def release_allocator(self, allocator: Allocator) -> None: ...
    def create_data_transfer(self) -> DataTransfer | None: ...
    def is_stream_aware(self) -> bool: ...
    def create_sync_stream_for_device(self, device_index: int, options: Mapping[str, str]) -> SyncStream: ...
    def close(self) -> None: ...
