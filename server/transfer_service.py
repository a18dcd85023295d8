"""DataTransfer over gRPC (OrtDataTransferImpl): CanCopy, and CopyTensors as one batched call (on the fast lane
also repeated as a kept call: server/kept_calls.py)."""
from __future__ import annotations

from typing import Sequence

from ephost.errors import EpUnimplemented
from ephost.tensor import Tensor
from ephost.types import MemoryInfo
from ephost.server.clients import BufferEntry
from ephost.server.kept_calls import KeptReply, KeptRequest
from ephost.server.rpc import Servicer, rpc
from ephost.server.tensors import resolve
from ephost.v1 import data_transfer_pb2

_NOTHING: KeptReply = ([], 0, ())


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
        copied = _copy(transfer, stream, src.tensors, dst.tensors, src.entries, dst.entries)
        if stream is not None and dst.replies:
            stream.flush(call.time_remaining())  # the reply must carry the bytes, so wait for them
        replies = [dst.tensors[i].numpy().tobytes() for i in dst.replies]
        call.counts = {"bytes_copied": copied, "copies": len(src.tensors), "bytes_inline_in": src.inline_bytes,
                       "bytes_inline_out": sum(map(len, replies))}
        return data_transfer_pb2.CopyTensorsResponse(replies=replies)

    def copy_kept(self, request: KeptRequest, call) -> KeptReply:
        """A kept CopyTensors repeated (server/kept_calls.py) -> an empty reply."""
        kept, payload, written = request
        client = call.client
        transfer = client.get("data_transfer", kept.data_transfer)
        stream = client.get("stream", kept.stream) if kept.stream else None
        src, dst, made, entries = kept.tensors(payload, client)
        if written is not None:
            written()
        call.counts = {"kept_calls": 1, "copies": len(src),
                       "bytes_copied": _copy(transfer, stream, src, dst, made, entries)}
        return _NOTHING


def _copy(transfer, stream, src: Sequence[Tensor], dst: Sequence[Tensor], made: Sequence[BufferEntry | None],
          entries: Sequence[BufferEntry | None]) -> int:
    """Copy src[i] into dst[i] (queued on `stream` where given); the bytes copied."""
    for s, d in zip(src, dst):
        if not transfer.can_copy(s.memory_info, d.memory_info):
            raise EpUnimplemented(f"this EP cannot copy from {s.memory_info.name} to {d.memory_info.name}")
    copied = transfer.copy_tensors(src, dst, stream)
    for source, entry in zip(made, entries):
        if entry is not None:  # bytes made in this worker stay so in their copy
            entry.produced = source is not None and source.produced
    return copied or 0
