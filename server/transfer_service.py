"""DataTransfer over gRPC (OrtDataTransferImpl): CanCopy, and CopyTensors as one batched call."""
from __future__ import annotations

from ephost.errors import EpUnimplemented
from ephost.types import MemoryInfo
from ephost.server.rpc import Servicer, rpc
from ephost.server.tensors import resolve
from ephost.v1 import data_transfer_pb2


class DataTransferService(Servicer):
    SERVICE = "ephost.v1.DataTransfer"

    @rpc
    def CanCopy(self, request, call):
        transfer = call.client.get("data_transfer", request.data_transfer)
        ok = transfer.can_copy(MemoryInfo.from_proto(request.src), MemoryInfo.from_proto(request.dst))
        return data_transfer_pb2.CanCopyResponse(can_copy=ok)

    @rpc
    def CopyTensors(self, request, call):
        client = call.client
        transfer = client.get("data_transfer", request.data_transfer)
        stream = client.get("stream", request.stream) if request.stream else None
        src = resolve(self.state, client, request.src, "source", writable=False)
        dst = resolve(self.state, client, request.dst, "destination", writable=True)
        for s, d in zip(src.tensors, dst.tensors):
            if not transfer.can_copy(s.memory_info, d.memory_info):
                raise EpUnimplemented(f"this EP cannot copy from {s.memory_info.name} to {d.memory_info.name}")
        copied = transfer.copy_tensors(src.tensors, dst.tensors, stream)
        if stream is not None and dst.replies:
            stream.flush(call.time_remaining())  # the reply must carry the bytes, so wait for them
        for made, entry in zip(src.entries, dst.entries):
            if entry is not None:  # bytes made in this worker stay so in their copy
                entry.produced = made is not None and made.produced
        replies = [dst.tensors[i].numpy().tobytes() for i in dst.replies]
        self.state.stats.add(bytes_copied=copied or 0, copies=len(src.tensors), bytes_inline_in=src.inline_bytes,
                             bytes_inline_out=sum(map(len, replies)))
        return data_transfer_pb2.CopyTensorsResponse(replies=replies)

