"""Allocator over gRPC (OrtAllocator). Buffers are handles; HOST_ACCESSIBLE ones also say where they lie
in a region the client can map."""
from __future__ import annotations

import numpy as np

from ephost import wire
from ephost.errors import EpNotFound
from ephost.memory import check_slice
from ephost.server.clients import BufferEntry
from ephost.server.rpc import Servicer, rpc
from ephost.v1 import allocator_pb2, common_pb2


class AllocatorService(Servicer):
    SERVICE = "ephost.v1.Allocator"

    def _allocate(self, request, client, reserve: bool):
        allocator = client.get("allocator", request.allocator)
        self.state.check_size(request.nbytes, "an allocation")
        buffer = allocator.reserve(request.nbytes) if reserve else allocator.alloc(request.nbytes)
        handle = client.add("buffer", BufferEntry(allocator, buffer))
        reply = allocator_pb2.AllocResponse(buffer=handle, nbytes=buffer.nbytes)
        if buffer.region is not None and buffer.region.shareable and allocator.memory_info.host_accessible:
            reply.shm.CopyFrom(common_pb2.ShmSlice(region=buffer.region.id, offset=buffer.offset,
                                                   nbytes=buffer.nbytes))
        return reply

    @rpc
    def Alloc(self, request, call):
        return self._allocate(request, call.client, reserve=False)

    @rpc
    def Reserve(self, request, call):
        return self._allocate(request, call.client, reserve=True)

    @rpc
    def Free(self, request, call):
        client = call.client
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
    def GetStats(self, request, call):
        return allocator_pb2.AllocatorStats(stats=call.client.get("allocator", request.id).get_stats())

    @rpc
    def GetInfo(self, request, call):
        return call.client.get("allocator", request.id).memory_info.to_proto()

    @staticmethod
    def _view(client, allocator_handle: int, buffer_handle: int, offset: int, nbytes: int):
        allocator = client.get("allocator", allocator_handle)
        entry = client.get("buffer", buffer_handle)
        if entry.allocator is not allocator:
            raise EpNotFound(f"buffer {buffer_handle} does not belong to allocator {allocator_handle}")
        check_slice(offset, nbytes, entry.buffer.nbytes, "buffer")
        return entry.buffer.host_view()[offset:offset + nbytes]

    @rpc
    def Write(self, chunks, call):
        written = 0
        for chunk in chunks:
            view = self._view(call.client, chunk.allocator, chunk.buffer, chunk.offset, len(chunk.data))
            view[:] = np.frombuffer(chunk.data, np.uint8)
            written += len(chunk.data)
        self.state.stats.add(bytes_inline_in=written)
        return common_pb2.Empty()

    @rpc
    def Read(self, request, call):
        view = self._view(call.client, request.allocator, request.buffer, request.offset, request.nbytes)
        step = request.chunk_bytes if request.chunk_bytes > 0 else wire.CHUNK_BYTES
        self.state.stats.add(bytes_inline_out=len(view))
        for start in range(0, len(view), step):
            yield allocator_pb2.BufferChunk(allocator=request.allocator, buffer=request.buffer,
                                            offset=request.offset + start, data=view[start:start + step].tobytes())
