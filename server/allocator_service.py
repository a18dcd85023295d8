"""Allocator over gRPC (OrtAllocator). Buffers are handles; HOST_ACCESSIBLE ones also say where they lie
in a region the client can map."""
from __future__ import annotations

import numpy as np

from ephost.errors import EpError, EpNotFound
from ephost.memory import check_slice
from ephost.server.clients import BufferEntry
from ephost.server.rpc import rpc
from ephost.server.state import WorkerState
from ephost.v1 import allocator_pb2, allocator_pb2_grpc, common_pb2


CHUNK_BYTES = 16 << 20  # one message of a chunked read


class AllocatorService(allocator_pb2_grpc.AllocatorServicer):
    SERVICE = "Allocator"

    def __init__(self, state: WorkerState):
        self.state = state

    def _client(self, context):
        return self.state.clients.lookup(context.invocation_metadata())

    def _allocate(self, request, context, reserve: bool):
        client = self._client(context)
        allocator = client.get("allocator", request.allocator)
        buffer = allocator.reserve(request.nbytes) if reserve else allocator.alloc(request.nbytes)
        handle = client.add("buffer", BufferEntry(allocator, buffer))
        reply = allocator_pb2.AllocResponse(buffer=handle, nbytes=buffer.nbytes)
        if buffer.region is not None and buffer.region.shareable and allocator.memory_info.host_accessible:
            reply.shm.CopyFrom(common_pb2.ShmSlice(region=buffer.region.id, offset=buffer.offset,
                                                   nbytes=buffer.nbytes))
        return reply

    @rpc
    def Alloc(self, request, context):
        return self._allocate(request, context, reserve=False)

    @rpc
    def Reserve(self, request, context):
        return self._allocate(request, context, reserve=True)

    @rpc
    def Free(self, request, context):
        client = self._client(context)
        allocator = client.get("allocator", request.allocator)
        handles = list(dict.fromkeys(([request.buffer] if request.buffer else []) + list(request.buffers)))
        for handle in handles:  # all named buffers are checked before any is freed
            if client.get("buffer", handle).allocator is not allocator:
                raise EpNotFound(f"buffer {handle} does not belong to allocator {request.allocator}")
        released = []
        for handle in handles:
            buffer = client.pop("buffer", handle).buffer
            allocator.free(buffer)
            if buffer.region is not None and allocator.region(buffer.region.id) is None:
                released.append(buffer.region.id)
        return allocator_pb2.FreeResponse(released_regions=sorted(set(released)))

    @rpc
    def GetStats(self, request, context):
        return allocator_pb2.AllocatorStats(stats=self._client(context).get("allocator", request.id).get_stats())

    @rpc
    def GetInfo(self, request, context):
        return self._client(context).get("allocator", request.id).memory_info.to_proto()

    def _view(self, context, allocator_handle: int, buffer_handle: int, offset: int, nbytes: int):
        client = self._client(context)
        allocator = client.get("allocator", allocator_handle)
        entry = client.get("buffer", buffer_handle)
        if entry.allocator is not allocator:
            raise EpNotFound(f"buffer {buffer_handle} does not belong to allocator {allocator_handle}")
        check_slice(offset, nbytes, entry.buffer.nbytes, "buffer")
        return entry.buffer.host_view()[offset:offset + nbytes]

    @rpc
    def Write(self, request_iterator, context):
        written = 0
        for chunk in request_iterator:
            view = self._view(context, chunk.allocator, chunk.buffer, chunk.offset, len(chunk.data))
            view[:] = np.frombuffer(chunk.data, np.uint8)
            written += len(chunk.data)
        self.state.stats.add(bytes_inline_in=written)
        return common_pb2.Empty()

    def Read(self, request, context):
        try:
            view = self._view(context, request.allocator, request.buffer, request.offset, request.nbytes)
        except EpError as e:
            context.abort(e.code, str(e))
        step = request.chunk_bytes if request.chunk_bytes > 0 else CHUNK_BYTES
        self.state.stats.add(bytes_inline_out=len(view))
        for start in range(0, len(view), step):
            yield allocator_pb2.BufferChunk(allocator=request.allocator, buffer=request.buffer,
                                            offset=request.offset + start, data=view[start:start + step].tobytes())
