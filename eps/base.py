"""The EP interface, with ONNX Runtime's plugin-EP names (OrtEpFactory, OrtEp, OrtNodeComputeInfo,
OrtAllocator, OrtDataTransferImpl, OrtSyncStreamImpl, OrtSyncNotificationImpl).

An in-process EP implements these directly; the worker serves any implementation over gRPC; the client
turns a worker back into the same interface. Sessions and the Environment see only these protocols.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

import onnx

from ephost.graph import GraphIndex, extract
from ephost.memory import Buffer
from ephost.types import EpDeviceInfo, MemoryInfo

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


@runtime_checkable
class NodeComputeInfo(Protocol):
    """A compiled partition. Inputs and outputs are graph values: a Tensor for plain tensors; a list, None,
    dict or numpy array (strings, bfloat16...) for the rest. Outputs may be placed in `allocator`'s memory
    when one is given (the caller can hand that memory on without a copy), else in host memory; `keep`
    names the outputs (by position) that must stay in `allocator`'s memory because the same EP reads them
    next. `timeout` is the call's deadline in seconds: an EP in another process is abandoned (and its worker
    ended) past it; code running in this process cannot be interrupted and ignores it. `into` names outputs
    (by position) to write into given tensors (an IOBinding's bound outputs): a worker writes them there and
    returns those tensors; an EP in this process may ignore it (the session copies then). `leave` names kept
    outputs nobody in this process reads (outputs bound in the EP's memory): a worker that shares no memory with
    this process does not send their bytes here. `into` and `leave` are only passed when not empty."""

    name: str

    def compute(self, inputs: Sequence[Any], allocator: Allocator | None = None, keep: Sequence[int] = (),
                timeout: float | None = None, into: Mapping[int, "Tensor"] | None = None,
                leave: Sequence[int] = ()) -> list[Any]: ...


@runtime_checkable
class Ep(Protocol):
    def get_name(self) -> str: ...
    def get_capability(self, model: onnx.ModelProto, claimed: frozenset[str]) -> list[NodeGroup]: ...
    def compile(self, graphs: Sequence[FusedGraph]) -> list[NodeComputeInfo]: ...
    def release_node_compute_infos(self, infos: Sequence[NodeComputeInfo]) -> None: ...
    def get_preferred_data_layout(self) -> str: ...
    def set_dynamic_options(self, options: Mapping[str, str]) -> None: ...
    def on_run_start(self, run_options: Mapping[str, str]) -> None: ...
    def on_run_end(self, sync_stream: bool) -> None: ...


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
