"""A worker turned back into the EP interface of ephost.eps.base, so that sessions and the Environment use
a worker exactly as they use an in-process EP."""
from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

import numpy as np
import onnx

from ephost.eps.base import FusedGraph, NodeGroup
from ephost import values
from ephost.errors import EpInvalidArgument, EpNotFound
from ephost.memory import Buffer
from ephost.tensor import Tensor, check_copy_pairs
from ephost.types import EpDeviceInfo, MemoryInfo, desc_from_proto, desc_to_proto, nbytes_of
from ephost.client.connection import WorkerConnection
from ephost.v1 import allocator_pb2, common_pb2, data_transfer_pb2, ep_pb2, factory_pb2, stream_pb2

_EMPTY = common_pb2.Empty()
# Tensors smaller than this travel inline; larger ones through the worker's shared memory. Going through
# shared memory costs a call or two more (allocate, free) and saves copying the bytes through gRPC: on a
# 2-core machine a call costs about 1 ms and inline bytes move at about 0.15 GB/s, so they cross near here.
INLINE_LIMIT = 512 << 10


class RemoteAllocator:
    def __init__(self, conn: WorkerConnection, handle: int, memory_info: MemoryInfo):
        self._conn = conn
        self.handle = handle
        self.memory_info = memory_info
        self._regions: set[int] = set()

    def _allocate(self, method, nbytes: int) -> Buffer:
        reply = self._conn.call(method, allocator_pb2.AllocRequest(allocator=self.handle, nbytes=nbytes))
        region = None
        if reply.HasField("shm"):
            region = self._conn.map_region(reply.shm.region)
            if region is not None:
                self._regions.add(region.id)
        return Buffer(self.memory_info, reply.nbytes, reply.buffer, region, reply.shm.offset, owner=self._conn)

    def alloc(self, nbytes: int) -> Buffer:
        return self._allocate(self._conn.allocator.Alloc, nbytes)

    def reserve(self, nbytes: int) -> Buffer:
        return self._allocate(self._conn.allocator.Reserve, nbytes)

    def free(self, buffer: Buffer) -> None:
        reply = self._conn.call(self._conn.allocator.Free,
                                allocator_pb2.FreeRequest(allocator=self.handle, buffer=buffer.handle))
        for region_id in reply.released_regions:
            self._regions.discard(region_id)
            self._conn.forget_region(region_id)

    def get_stats(self) -> dict[str, int]:
        return dict(self._conn.call(self._conn.allocator.GetStats, common_pb2.Handle(id=self.handle)).stats)

    def forget_regions(self) -> None:
        for region_id in self._regions:
            self._conn.forget_region(region_id)
        self._regions.clear()


class RemoteNotification:
    def __init__(self, conn: WorkerConnection, handle: int):
        self._conn = conn
        self.handle = handle

    def activate(self) -> None:
        self._conn.call(self._conn.stream.Activate, common_pb2.Handle(id=self.handle))

    def wait_on_host(self, timeout: float | None = None) -> None:
        request = stream_pb2.WaitOnHostRequest(notification=self.handle, timeout_s=timeout or 0.0)
        self._conn.call(self._conn.stream.WaitOnHost, request, timeout=(timeout + 5.0) if timeout else None)

    def wait_on_device(self, stream: "RemoteStream") -> None:
        self._conn.call(self._conn.stream.WaitOnDevice,
                        stream_pb2.WaitOnDeviceRequest(notification=self.handle, stream=stream.handle))

    def release(self) -> None:
        self._conn.call(self._conn.stream.Release, common_pb2.Handle(id=self.handle))


class RemoteStream:
    def __init__(self, conn: WorkerConnection, handle: int):
        self._conn = conn
        self.handle = handle

    def create_notification(self) -> RemoteNotification:
        reply = self._conn.call(self._conn.stream.CreateNotification, common_pb2.Handle(id=self.handle))
        return RemoteNotification(self._conn, reply.id)

    def flush(self, timeout: float | None = None) -> None:
        self._conn.call(self._conn.stream.Flush, common_pb2.Handle(id=self.handle), timeout=timeout)

    def on_session_run_end(self) -> None:
        self._conn.call(self._conn.stream.OnSessionRunEnd, common_pb2.Handle(id=self.handle))

    def release(self) -> None:
        self._conn.call(self._conn.stream.Release, common_pb2.Handle(id=self.handle))


class _Staging:
    """A HOST_ACCESSIBLE allocator of the worker's, made on first use, through which host memory the worker
    cannot map reaches it: written once into shared memory instead of sent inline."""

    def __init__(self, conn: WorkerConnection, memory: MemoryInfo | None, create):
        self._conn, self._memory, self._create = conn, memory, create
        self._allocator: RemoteAllocator | None = None
        self._lock = threading.Lock()

    def buffer(self, nbytes: int) -> Buffer | None:
        if self._memory is None or not self._conn.fd_socket or nbytes < INLINE_LIMIT:
            return None
        with self._lock:
            if self._allocator is None:
                self._allocator = self._create(self._memory, {})
        buffer = self._allocator.alloc(nbytes)
        if buffer.region is None:
            self._allocator.free(buffer)
            return None
        return buffer

    def free(self, buffer: Buffer) -> None:
        self._allocator.free(buffer)


class RemoteDataTransfer:
    def __init__(self, conn: WorkerConnection, handle: int, staging: _Staging):
        self._conn = conn
        self.handle = handle
        self._staging = staging
        self._can_copy: dict[tuple[MemoryInfo, MemoryInfo], bool] = {}

    def can_copy(self, src: MemoryInfo, dst: MemoryInfo) -> bool:
        key = (src, dst)
        if key not in self._can_copy:
            reply = self._conn.call(self._conn.data_transfer.CanCopy, data_transfer_pb2.CanCopyRequest(
                data_transfer=self.handle, src=src.to_proto(), dst=dst.to_proto()))
            self._can_copy[key] = reply.can_copy
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
            reply = self._conn.call(self._conn.data_transfer.CopyTensors, data_transfer_pb2.CopyTensorsRequest(
                data_transfer=self.handle, stream=stream.handle if stream is not None else 0,
                src=src_refs, dst=dst_refs))
            if staged and stream is not None:
                # Like a copy from pageable memory on a device stream: host memory the worker cannot map
                # goes through a staging buffer, which must outlive the queued copy.
                stream.flush()
            for buffer, tensor in copy_back:
                np.copyto(tensor.local_bytes(), buffer.host_view())
        finally:
            for buffer in staged:
                self._staging.free(buffer)
        replies = iter(reply.replies)
        for ref, i in zip(dst_refs, remote):
            if ref.WhichOneof("location") == "reply":
                np.copyto(dst[i].local_bytes(), np.frombuffer(next(replies), np.uint8))

    def _ref(self, tensor: Tensor, role: str, staged: list, copy_back: list) -> common_pb2.TensorRef:
        desc = desc_to_proto(tensor.shape, tensor.dtype)
        if tensor.buffer is not None and tensor.buffer.owner is self._conn:
            return common_pb2.TensorRef(desc=desc, buffer=tensor.buffer.handle)
        data = tensor.local_bytes()
        if data is None:
            raise EpInvalidArgument(f"the {role} lives in {tensor.memory_info.name} memory, which this worker "
                                    "cannot reach")
        buffer = self._staging.buffer(tensor.nbytes)
        if buffer is not None:
            staged.append(buffer)
            if role == "source":
                buffer.host_view()[:] = data
            else:
                copy_back.append((buffer, tensor))
            return common_pb2.TensorRef(desc=desc, buffer=buffer.handle)
        if role == "source":
            return common_pb2.TensorRef(desc=desc, inline=data.tobytes())
        return common_pb2.TensorRef(desc=desc, reply=common_pb2.InlineReply())


class RemoteComputeInfo:
    """A partition compiled in a worker. Values it makes stay in the worker's memory (mapped here when it is
    shared); values that already live in that worker are handed back by handle, without a copy."""

    def __init__(self, conn: WorkerConnection, handle: int, name: str):
        self._conn = conn
        self.handle = handle
        self.name = name
        # Staging buffers for inputs from elsewhere, kept between runs so a steady stream of runs costs one
        # call each (no allocation or free per run): (allocator, nbytes) -> idle buffers.
        self._idle: dict[tuple[Any, int], list[Buffer]] = {}
        self._idle_lock = threading.Lock()

    def compute(self, inputs: Sequence[Any], allocator: "RemoteAllocator | None" = None,
                keep: Sequence[int] = ()) -> list[Any]:
        staged: list[Buffer] = []
        try:
            request = ep_pb2.ComputeRequest(
                node_compute_info=self.handle, inputs=[self._input(v, allocator, staged) for v in inputs],
                output_allocator=allocator.handle if allocator is not None else 0, inline_limit=INLINE_LIMIT,
                keep=keep if allocator is not None else ())
            reply = self._conn.call(self._conn.ep.Compute, request)
        finally:
            with self._idle_lock:
                for buffer in staged:
                    self._idle.setdefault((allocator, buffer.nbytes), []).append(buffer)
        return [self._output(v, allocator) for v in reply.outputs]

    def _staging_buffer(self, allocator, nbytes: int) -> Buffer:
        with self._idle_lock:
            idle = self._idle.get((allocator, nbytes))
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
        buffer = value.buffer
        if buffer is not None and buffer.owner is self._conn:
            return common_pb2.Value(tensor=common_pb2.TensorRef(desc=desc, buffer=buffer.handle))
        data = value.local_bytes()
        if data is None:
            raise EpInvalidArgument(f"{self.name}: an input lives in {value.memory_info.name} memory, which "
                                    "neither this process nor the worker can read; copy it to the host first")
        if allocator is not None and value.nbytes >= INLINE_LIMIT:
            target = self._staging_buffer(allocator, value.nbytes)
            staged.append(target)
            view = target.host_view()
            if view is not None:  # written once, straight into the worker's memory
                view[:] = data
                return common_pb2.Value(tensor=common_pb2.TensorRef(desc=desc, buffer=target.handle))
        return common_pb2.Value(tensor=common_pb2.TensorRef(desc=desc, inline=data.tobytes()))

    def _output(self, message: common_pb2.Value, allocator) -> Any:
        if message.WhichOneof("kind") == "onnx":
            return values.decode(message.onnx)
        ref = message.tensor
        shape, dtype = desc_from_proto(ref.desc)
        if ref.WhichOneof("location") == "inline":
            return Tensor.from_numpy(np.frombuffer(ref.inline, dtype=dtype).reshape(shape).copy())
        region = self._conn.map_region(ref.mapped.region) if ref.HasField("mapped") else None
        buffer = Buffer(allocator.memory_info, nbytes_of(shape, dtype), ref.buffer, region, ref.mapped.offset,
                        owner=self._conn)
        return Tensor(shape, dtype, allocator.memory_info, buffer=buffer, allocator=allocator)


class RemoteEp:
    def __init__(self, conn: WorkerConnection, handle: int, name: str):
        self._conn = conn
        self.handle = handle
        self._name = name

    def get_name(self) -> str:
        return self._name

    def get_capability(self, model: onnx.ModelProto, claimed: frozenset[str]) -> list[NodeGroup]:
        with self._conn.model_ref(model) as ref:
            reply = self._conn.call(self._conn.ep.GetCapability, ep_pb2.GetCapabilityRequest(
                ep=self.handle, model=ref, claimed_nodes=sorted(claimed)))
        return [NodeGroup(tuple(g.node_names), fused=g.kind == ep_pb2.NodeGroup.KIND_FUSED) for g in reply.groups]

    def compile(self, graphs: Sequence[FusedGraph]) -> list[RemoteComputeInfo]:
        infos: list[RemoteComputeInfo] = []
        for source in dict.fromkeys(g.source for g in graphs):  # one call per model they come from
            batch = [g for g in graphs if g.source is source]
            with self._conn.model_ref(source.model) as ref:
                reply = self._conn.call(self._conn.ep.Compile, ep_pb2.CompileRequest(
                    ep=self.handle, model=ref, graphs=[
                        ep_pb2.FusedGraph(name=g.name, nodes=g.nodes, inputs=g.inputs, outputs=g.outputs)
                        for g in batch]))
            infos += [RemoteComputeInfo(self._conn, h, g.name) for h, g in zip(reply.node_compute_infos, batch)]
        return infos

    def release_node_compute_infos(self, infos: Sequence[RemoteComputeInfo]) -> None:
        for info in infos:
            info.release_staging()
        self._conn.call(self._conn.ep.ReleaseNodeComputeInfos, ep_pb2.ReleaseNodeComputeInfosRequest(
            ep=self.handle, node_compute_infos=[i.handle for i in infos]))

    def get_preferred_data_layout(self) -> str:
        return self._conn.call(self._conn.ep.GetPreferredDataLayout, common_pb2.Handle(id=self.handle)).layout

    def set_dynamic_options(self, options: Mapping[str, str]) -> None:
        self._conn.call(self._conn.ep.SetDynamicOptions,
                        ep_pb2.SetDynamicOptionsRequest(ep=self.handle, options=dict(options)))

    def on_run_start(self, run_options: Mapping[str, str]) -> None:
        self._conn.call(self._conn.ep.OnRunStart, ep_pb2.RunStartRequest(ep=self.handle, run_options=dict(run_options)))

    def on_run_end(self, sync_stream: bool) -> None:
        self._conn.call(self._conn.ep.OnRunEnd, ep_pb2.RunEndRequest(ep=self.handle, sync_stream=sync_stream))


class RemoteEpFactory:
    """EpFactory of a worker, over its connection. Closing it closes the connection (and nothing else)."""

    def __init__(self, conn: WorkerConnection):
        self.conn = conn
        info = conn.call(conn.factory.GetInfo, _EMPTY)
        self._info = (info.name, info.vendor, info.vendor_id, info.version)
        self._devices = [EpDeviceInfo.from_proto(d)
                         for d in conn.call(conn.factory.GetSupportedDevices, _EMPTY).devices]

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
        reply = self.conn.call(self.conn.factory.CreateEp, factory_pb2.CreateEpRequest(
            device_indices=list(device_indices), session_options=dict(session_options)))
        return RemoteEp(self.conn, reply.id, self.get_name())

    def release_ep(self, ep: RemoteEp) -> None:
        self.conn.call(self.conn.factory.ReleaseEp, common_pb2.Handle(id=ep.handle))

    def create_allocator(self, memory_info: MemoryInfo, options: Mapping[str, str]) -> RemoteAllocator:
        for device in self._devices:
            if memory_info in device.memory_infos:
                reply = self.conn.call(self.conn.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest(
                    device_index=device.index, device_mem_type=int(memory_info.device_mem_type),
                    options=dict(options)))
                return RemoteAllocator(self.conn, reply.allocator, MemoryInfo.from_proto(reply.memory_info))
        raise EpNotFound(f"worker has no memory {memory_info.name!r}")

    def release_allocator(self, allocator: RemoteAllocator) -> None:
        self.conn.call(self.conn.factory.ReleaseAllocator, common_pb2.Handle(id=allocator.handle))
        allocator.forget_regions()

    def create_data_transfer(self) -> RemoteDataTransfer | None:
        handle = self.conn.call(self.conn.factory.CreateDataTransfer, _EMPTY).data_transfer
        if not handle:
            return None
        shared = [m for d in self._devices for m in d.memory_infos if m.host_accessible]
        return RemoteDataTransfer(self.conn, handle, _Staging(self.conn, shared[0] if shared else None,
                                                              self.create_allocator))

    def is_stream_aware(self) -> bool:
        return self.conn.call(self.conn.factory.IsStreamAware, _EMPTY).stream_aware

    def create_sync_stream_for_device(self, device_index: int, options: Mapping[str, str]) -> RemoteStream:
        reply = self.conn.call(self.conn.factory.CreateSyncStreamForDevice, factory_pb2.CreateSyncStreamRequest(
            device_index=device_index, options=dict(options)))
        return RemoteStream(self.conn, reply.id)

    def close(self) -> None:
        self.conn.close()
