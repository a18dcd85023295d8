"""A worker turned back into the EP interface of ephost.eps.base, so that sessions and the Environment use
a worker exactly as they use an in-process EP.

Every object here names something in the worker by a handle, and remembers how it made it: when the worker
is restarted (a new generation of its WorkerLink), the handle is made again on the next use. Memory of a
dead worker that this process mapped keeps its data and is then treated as host memory.
"""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx

from ephost import values
from ephost.eps.base import FusedGraph, NodeGroup
from ephost.errors import EpNotFound
from ephost.memory import Buffer
from ephost.tensor import Tensor, check_copy_pairs
from ephost.types import EpDeviceInfo, MemoryInfo, desc_from_proto, desc_to_proto, nbytes_of
from ephost.client.supervisor import WorkerLink
from ephost.v1 import allocator_pb2, common_pb2, data_transfer_pb2, ep_pb2, factory_pb2, stream_pb2

_EMPTY = common_pb2.Empty()
# Tensors smaller than this travel inline; larger ones through the worker's shared memory. Going through
# shared memory costs a call or two more (allocate, free) and saves copying the bytes through gRPC: on a
# 2-core machine a call costs about 1 ms and inline bytes move at about 0.15 GB/s, so they cross near here.
INLINE_LIMIT = 512 << 10


class _Handle:
    """A handle in the worker, made by `_make()` and made again after the worker restarts."""

    def __init__(self, link: WorkerLink):
        self._link = link
        self._generation = -1
        self._id = 0
        self._make_lock = threading.Lock()

    def _make(self) -> int:
        raise NotImplementedError

    @property
    def handle(self) -> int:
        with self._make_lock:
            if self._generation != self._link.generation:
                generation = self._link.generation
                self._id = self._make()
                self._generation = generation
            return self._id

    @property
    def current(self) -> bool:
        """Whether the handle was made on the worker that runs now (nothing to release otherwise)."""
        return self._generation == self._link.generation

    def _call(self, method_of: Callable, request_of: Callable[[int], Any], **kw):
        conn = self._link.conn  # first: it waits out a restart, after which the handle is made again
        return self._link.call(method_of, request_of(self.handle), conn=conn, **kw)


def _owned(buffer: Buffer | None, link: WorkerLink) -> bool:
    """Whether the worker that runs now can name this buffer by its handle."""
    return buffer is not None and buffer.owner is not None and buffer.owner is link.current


class RemoteAllocator(_Handle):
    def __init__(self, link: WorkerLink, device_index: int, memory_info: MemoryInfo, options: Mapping[str, str]):
        super().__init__(link)
        self._device_index, self._options = device_index, dict(options)
        self.memory_info = memory_info
        self._regions: set[tuple[Any, int]] = set()
        self.handle  # made now, so that bad options fail here

    def _make(self) -> int:
        reply = self._link.call(lambda c: c.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest(
            device_index=self._device_index, device_mem_type=int(self.memory_info.device_mem_type),
            options=self._options))
        self.memory_info = MemoryInfo.from_proto(reply.memory_info)
        return reply.allocator

    def _allocate(self, method_of, nbytes: int) -> Buffer:
        reply = self._call(method_of, lambda h: allocator_pb2.AllocRequest(allocator=h, nbytes=nbytes))
        return self._buffer(reply.buffer, reply.nbytes, reply.shm if reply.HasField("shm") else None)

    def _buffer(self, handle: int, nbytes: int, shm, conn=None) -> Buffer:
        conn = conn or self._link.current
        region = conn.map_region(shm.region) if shm is not None else None
        if region is not None:
            self._regions.add((conn, region.id))
        return Buffer(self.memory_info, nbytes, handle, region, shm.offset if shm is not None else 0, owner=conn)

    def alloc(self, nbytes: int) -> Buffer:
        return self._allocate(lambda c: c.allocator.Alloc, nbytes)

    def reserve(self, nbytes: int) -> Buffer:
        return self._allocate(lambda c: c.allocator.Reserve, nbytes)

    def free(self, buffer: Buffer) -> None:
        if not _owned(buffer, self._link) or not self.current:
            return  # its worker is gone, and its memory with it (what this process mapped stays readable)
        reply = self._call(lambda c: c.allocator.Free,
                           lambda h: allocator_pb2.FreeRequest(allocator=h, buffer=buffer.handle))
        for region_id in reply.released_regions:
            self._regions.discard((buffer.owner, region_id))
            buffer.owner.forget_region(region_id)

    def get_stats(self) -> dict[str, int]:
        return dict(self._call(lambda c: c.allocator.GetStats, lambda h: common_pb2.Handle(id=h)).stats)

    def write(self, buffer: Buffer, data: np.ndarray) -> None:
        """Put bytes into a buffer: one memcpy where it is mapped here, else sent in chunks."""
        view = buffer.host_view()
        if view is not None:
            view[: len(data)] = data
        else:
            buffer.owner.write(self.handle, buffer.handle, data)

    def read(self, buffer: Buffer, out: np.ndarray) -> None:
        view = buffer.host_view()
        if view is not None:
            out[:] = view[: len(out)]
        else:
            buffer.owner.read(self.handle, buffer.handle, out)

    def forget_regions(self) -> None:
        for conn, region_id in self._regions:
            conn.forget_region(region_id)
        self._regions.clear()


class RemoteStream(_Handle):
    def __init__(self, link: WorkerLink, device_index: int, options: Mapping[str, str]):
        super().__init__(link)
        self._device_index, self._options = device_index, dict(options)
        self.handle

    def _make(self) -> int:
        return self._link.call(lambda c: c.factory.CreateSyncStreamForDevice, factory_pb2.CreateSyncStreamRequest(
            device_index=self._device_index, options=self._options)).id

    def create_notification(self) -> "RemoteNotification":
        return RemoteNotification(self._link, self)

    def flush(self, timeout: float | None = None) -> None:
        self._call(lambda c: c.stream.Flush, lambda h: common_pb2.Handle(id=h), timeout=timeout)

    def on_session_run_end(self) -> None:
        self._call(lambda c: c.stream.OnSessionRunEnd, lambda h: common_pb2.Handle(id=h))

    def release(self) -> None:
        if self.current:
            self._call(lambda c: c.stream.Release, lambda h: common_pb2.Handle(id=h))


class RemoteNotification(_Handle):
    def __init__(self, link: WorkerLink, stream: RemoteStream):
        super().__init__(link)
        self._stream = stream
        self.handle

    def _make(self) -> int:
        return self._link.call(lambda c: c.stream.CreateNotification, common_pb2.Handle(id=self._stream.handle)).id

    def activate(self) -> None:
        self._call(lambda c: c.stream.Activate, lambda h: common_pb2.Handle(id=h))

    def wait_on_host(self, timeout: float | None = None) -> None:
        self._call(lambda c: c.stream.WaitOnHost,
                   lambda h: stream_pb2.WaitOnHostRequest(notification=h, timeout_s=timeout or 0.0),
                   timeout=(timeout + 5.0) if timeout else None)

    def wait_on_device(self, stream: RemoteStream) -> None:
        self._call(lambda c: c.stream.WaitOnDevice,
                   lambda h: stream_pb2.WaitOnDeviceRequest(notification=h, stream=stream.handle))

    def release(self) -> None:
        if self.current:
            self._call(lambda c: c.stream.Release, lambda h: common_pb2.Handle(id=h))


class _Staging:
    """An allocator of the worker's, made on first use, through which host memory the worker cannot reach gets
    to it: written once into its shared memory where both map it, else sent in chunks (never one message)."""

    def __init__(self, link: WorkerLink, memory: MemoryInfo | None, create):
        self._link, self._memory, self._create = link, memory, create
        self._allocator: RemoteAllocator | None = None
        self._lock = threading.Lock()

    def buffer(self, nbytes: int) -> Buffer | None:
        if self._memory is None or nbytes < INLINE_LIMIT:
            return None
        with self._lock:
            if self._allocator is None:
                self._allocator = self._create(self._memory, {})
        return self._allocator.alloc(nbytes)

    def write(self, buffer: Buffer, data: np.ndarray) -> None:
        self._allocator.write(buffer, data)

    def read(self, buffer: Buffer, out: np.ndarray) -> None:
        self._allocator.read(buffer, out)

    def free(self, buffer: Buffer) -> None:
        self._allocator.free(buffer)


class RemoteDataTransfer(_Handle):
    def __init__(self, link: WorkerLink, staging: _Staging):
        super().__init__(link)
        self._staging = staging
        self._can_copy: dict[tuple[MemoryInfo, MemoryInfo], bool] = {}

    def _make(self) -> int:
        return self._link.call(lambda c: c.factory.CreateDataTransfer, _EMPTY).data_transfer

    def can_copy(self, src: MemoryInfo, dst: MemoryInfo) -> bool:
        key = (src, dst)
        if key not in self._can_copy:
            self._can_copy[key] = self._call(lambda c: c.data_transfer.CanCopy, lambda h: data_transfer_pb2.CanCopyRequest(
                data_transfer=h, src=src.to_proto(), dst=dst.to_proto())).can_copy
        return self._can_copy[key]

    def copy_tensors(self, src: Sequence[Tensor], dst: Sequence[Tensor], stream: RemoteStream | None = None) -> None:
        check_copy_pairs(src, dst)
        remote: list[int] = []
        for i, (s, d) in enumerate(zip(src, dst)):
            # Without a stream, memory both processes map is copied right here: one memcpy, no call.
            s_bytes = d_bytes = None
            if stream is None:
                s_bytes, d_bytes = s.local_bytes(), d.local_bytes()
            if s_bytes is not None and d_bytes is not None:
                np.copyto(d_bytes, s_bytes)
            else:
                remote.append(i)
        if not remote:
            return
        staged: list[Buffer] = []
        copy_back: list[tuple[Buffer, Tensor]] = []
        try:
            src_refs = [self._ref(src[i], "source", staged, copy_back) for i in remote]
            dst_refs = [self._ref(dst[i], "destination", staged, copy_back) for i in remote]
            reply = self._call(lambda c: c.data_transfer.CopyTensors, lambda h: data_transfer_pb2.CopyTensorsRequest(
                data_transfer=h, stream=stream.handle if stream is not None else 0, src=src_refs, dst=dst_refs))
            if staged and stream is not None:
                # Like a copy from pageable memory on a device stream: host memory the worker cannot map
                # goes through a staging buffer, which must outlive the queued copy.
                stream.flush()
            for buffer, tensor in copy_back:
                self._staging.read(buffer, tensor.local_bytes())
        finally:
            for buffer in staged:
                self._staging.free(buffer)
        replies = iter(reply.replies)
        for ref, i in zip(dst_refs, remote):
            if ref.WhichOneof("location") == "reply":
                np.copyto(dst[i].local_bytes(), np.frombuffer(next(replies), np.uint8))

    def _ref(self, tensor: Tensor, role: str, staged: list, copy_back: list) -> common_pb2.TensorRef:
        desc = desc_to_proto(tensor.shape, tensor.dtype)
        if _owned(tensor.buffer, self._link):
            return common_pb2.TensorRef(desc=desc, buffer=tensor.buffer.handle)
        data = tensor.local_bytes()
        if data is None:
            raise EpNotFound(f"the {role} lives in {tensor.memory_info.name} memory that this process cannot "
                             "read and this worker does not have (its worker may have restarted)")
        buffer = self._staging.buffer(tensor.nbytes)
        if buffer is not None:
            staged.append(buffer)
            if role == "source":
                self._staging.write(buffer, data)
            else:
                copy_back.append((buffer, tensor))
            return common_pb2.TensorRef(desc=desc, buffer=buffer.handle)
        if role == "source":
            return common_pb2.TensorRef(desc=desc, inline=data.tobytes())
        return common_pb2.TensorRef(desc=desc, reply=common_pb2.InlineReply())


class RemoteComputeInfo(_Handle):
    """A partition compiled in a worker. Values it makes stay in the worker's memory (mapped here when it is
    shared); values that already live in that worker are handed back by handle, without a copy."""

    def __init__(self, link: WorkerLink, ep: "RemoteEp", graph: FusedGraph, handle: int):
        super().__init__(link)
        self._ep, self._graph = ep, graph
        self.name = graph.name
        self._id, self._generation = handle, link.generation
        # Staging buffers for inputs from elsewhere, kept between runs so a steady stream of runs costs one
        # call each (no allocation or free per run): (allocator, nbytes) -> idle buffers.
        self._idle: dict[tuple[Any, int], list[Buffer]] = {}
        self._idle_lock = threading.Lock()

    def _make(self) -> int:
        return self._ep._compile([self._graph])[0]

    def compute(self, inputs: Sequence[Any], allocator: RemoteAllocator | None = None, keep: Sequence[int] = (),
                timeout: float | None = None) -> list[Any]:
        staged: list[Buffer] = []
        try:
            conn = self._link.conn
            handle = self.handle
            request = ep_pb2.ComputeRequest(
                node_compute_info=handle, inputs=[self._input(v, allocator, staged) for v in inputs],
                output_allocator=allocator.handle if allocator is not None else 0, inline_limit=INLINE_LIMIT,
                keep=keep if allocator is not None else ())
            reply = self._link.call(lambda c: c.ep.Compute, request, conn=conn, timeout=timeout)
        finally:
            with self._idle_lock:
                for buffer in staged:
                    self._idle.setdefault((allocator, buffer.nbytes), []).append(buffer)
        outputs = [self._output(v, allocator, conn) for v in reply.outputs]
        self._link.between_calls()
        return outputs

    def _staging_buffer(self, allocator, nbytes: int) -> Buffer:
        with self._idle_lock:
            idle = [b for b in self._idle.get((allocator, nbytes), ()) if _owned(b, self._link)]
            self._idle[(allocator, nbytes)] = idle
            if idle:
                return idle.pop()
        return allocator.alloc(nbytes)

    def release_staging(self) -> None:
        with self._idle_lock:
            idle = [(a, b) for (a, _), buffers in self._idle.items() for b in buffers]
            self._idle.clear()
        for allocator, buffer in idle:
            allocator.free(buffer)

    def _input(self, value: Any, allocator, staged: list[Buffer]) -> common_pb2.Value:
        if not isinstance(value, Tensor):
            return common_pb2.Value(onnx=values.encode(value))
        desc = desc_to_proto(value.shape, value.dtype)
        if _owned(value.buffer, self._link):
            return common_pb2.Value(tensor=common_pb2.TensorRef(desc=desc, buffer=value.buffer.handle))
        data = value.local_bytes()
        if data is None:
            raise EpNotFound(f"{self.name}: an input lives in {value.memory_info.name} memory, which neither this "
                             "process nor the worker can read (its worker may have restarted)")
        if allocator is not None and value.nbytes >= INLINE_LIMIT:
            target = self._staging_buffer(allocator, value.nbytes)
            staged.append(target)
            allocator.write(target, data)  # straight into the worker's memory where mapped, else in chunks
            return common_pb2.Value(tensor=common_pb2.TensorRef(desc=desc, buffer=target.handle))
        return common_pb2.Value(tensor=common_pb2.TensorRef(desc=desc, inline=data.tobytes()))

    def _output(self, message: common_pb2.Value, allocator: RemoteAllocator | None, conn) -> Any:
        if message.WhichOneof("kind") == "onnx":
            return values.decode(message.onnx)
        ref = message.tensor
        shape, dtype = desc_from_proto(ref.desc)
        if ref.WhichOneof("location") == "inline":
            return Tensor.from_numpy(np.frombuffer(ref.inline, dtype=dtype).reshape(shape).copy())
        buffer = allocator._buffer(ref.buffer, nbytes_of(shape, dtype), ref.mapped if ref.HasField("mapped") else None,
                                   conn)
        host = None
        if buffer.region is None:
            # Memory this process cannot map: fetch a copy (in chunks) for whoever reads it here or elsewhere;
            # the worker keeps its own, which a later partition there reads by handle.
            host = np.empty(shape, dtype)
            allocator.read(buffer, host.reshape(-1).view(np.uint8))
        return Tensor(shape, dtype, allocator.memory_info, buffer=buffer, host=host, allocator=allocator)


class RemoteEp(_Handle):
    def __init__(self, link: WorkerLink, name: str, device_indices: Sequence[int], session_options: Mapping[str, str]):
        super().__init__(link)
        self._name, self._devices, self._options = name, list(device_indices), dict(session_options)
        self.handle

    def _make(self) -> int:
        return self._link.call(lambda c: c.factory.CreateEp, factory_pb2.CreateEpRequest(
            device_indices=self._devices, session_options=self._options)).id

    def get_name(self) -> str:
        return self._name

    def get_capability(self, model: onnx.ModelProto, claimed: frozenset[str]) -> list[NodeGroup]:
        handle, conn = self.handle, self._link.conn
        with conn.model_ref(model) as ref:
            reply = self._link.call(lambda c: c.ep.GetCapability, ep_pb2.GetCapabilityRequest(
                ep=handle, model=ref, claimed_nodes=sorted(claimed)))
        return [NodeGroup(tuple(g.node_names), fused=g.kind == ep_pb2.NodeGroup.KIND_FUSED) for g in reply.groups]

    def _compile(self, graphs: Sequence[FusedGraph]) -> list[int]:
        handles: list[int] = []
        handle, conn = self.handle, self._link.conn
        for source in dict.fromkeys(g.source for g in graphs):  # one call per model they come from
            batch = [g for g in graphs if g.source is source]
            with conn.model_ref(source.model) as ref:
                reply = self._link.call(lambda c: c.ep.Compile, ep_pb2.CompileRequest(ep=handle, model=ref, graphs=[
                    ep_pb2.FusedGraph(name=g.name, nodes=g.nodes, inputs=g.inputs, outputs=g.outputs) for g in batch]))
            handles += list(reply.node_compute_infos)
        return handles

    def compile(self, graphs: Sequence[FusedGraph]) -> list[RemoteComputeInfo]:
        return [RemoteComputeInfo(self._link, self, g, h) for g, h in zip(graphs, self._compile(graphs))]

    def release_node_compute_infos(self, infos: Sequence[RemoteComputeInfo]) -> None:
        for info in infos:
            info.release_staging()
        current = [i._id for i in infos if i.current]
        if current and self.current:
            self._call(lambda c: c.ep.ReleaseNodeComputeInfos,
                       lambda h: ep_pb2.ReleaseNodeComputeInfosRequest(ep=h, node_compute_infos=current))

    def get_preferred_data_layout(self) -> str:
        return self._call(lambda c: c.ep.GetPreferredDataLayout, lambda h: common_pb2.Handle(id=h)).layout

    def set_dynamic_options(self, options: Mapping[str, str]) -> None:
        self._options.update(options)
        self._call(lambda c: c.ep.SetDynamicOptions,
                   lambda h: ep_pb2.SetDynamicOptionsRequest(ep=h, options=dict(options)))

    def on_run_start(self, run_options: Mapping[str, str]) -> None:
        self._call(lambda c: c.ep.OnRunStart, lambda h: ep_pb2.RunStartRequest(ep=h, run_options=dict(run_options)))

    def on_run_end(self, sync_stream: bool) -> None:
        self._call(lambda c: c.ep.OnRunEnd, lambda h: ep_pb2.RunEndRequest(ep=h, sync_stream=sync_stream))


class RemoteEpFactory:
    """EpFactory of a worker, over its link. Closing it closes the link (and the worker, if launched)."""

    def __init__(self, link: WorkerLink):
        self.link = link
        info = link.call(lambda c: c.factory.GetInfo, _EMPTY)
        self._info = (info.name, info.vendor, info.vendor_id, info.version)
        self._devices = [EpDeviceInfo.from_proto(d)
                         for d in link.call(lambda c: c.factory.GetSupportedDevices, _EMPTY).devices]
        if not link.conn.shares_memory:
            # Memory this process cannot map is worker-local to it: only DEFAULT memory is offered.
            self._devices = [replace(d, memory_infos=tuple(m for m in d.memory_infos if not m.host_accessible))
                             for d in self._devices]

    @property
    def conn(self):
        return self.link.conn

    def get_name(self) -> str:
        return self._info[0]

    def get_vendor(self) -> str:
        return self._info[1]

    def get_vendor_id(self) -> int:
        return self._info[2]

    def get_version(self) -> str:
        return self._info[3]

    def get_supported_devices(self) -> list[EpDeviceInfo]:
        return list(self._devices)

    def create_ep(self, device_indices: Sequence[int], session_options: Mapping[str, str]) -> RemoteEp:
        return RemoteEp(self.link, self.get_name(), device_indices, session_options)

    def release_ep(self, ep: RemoteEp) -> None:
        if ep.current:
            ep._call(lambda c: c.factory.ReleaseEp, lambda h: common_pb2.Handle(id=h))

    def create_allocator(self, memory_info: MemoryInfo, options: Mapping[str, str]) -> RemoteAllocator:
        for device in self._devices:
            if memory_info in device.memory_infos:
                return RemoteAllocator(self.link, device.index, memory_info, options)
        raise EpNotFound(f"worker has no memory {memory_info.name!r}")

    def release_allocator(self, allocator: RemoteAllocator) -> None:
        if allocator.current:
            allocator._call(lambda c: c.factory.ReleaseAllocator, lambda h: common_pb2.Handle(id=h))
        allocator.forget_regions()

    def create_data_transfer(self) -> RemoteDataTransfer | None:
        memory = sorted((m for d in self._devices for m in d.memory_infos), key=lambda m: not m.host_accessible)
        transfer = RemoteDataTransfer(self.link, _Staging(self.link, memory[0] if memory else None,
                                                          self.create_allocator))
        return transfer if transfer.handle else None

    def is_stream_aware(self) -> bool:
        return self.link.call(lambda c: c.factory.IsStreamAware, _EMPTY).stream_aware

    def create_sync_stream_for_device(self, device_index: int, options: Mapping[str, str]) -> RemoteStream:
        return RemoteStream(self.link, device_index, options)

    def close(self) -> None:
        self.link.close()
