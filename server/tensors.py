"""Turning the TensorRefs a peer sends into tensors this process can address, checking everything: the
handles belong to the caller, slices lie inside their region, sizes match the described tensor."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ephost.errors import EpInvalidArgument
from ephost.memory import Buffer
from ephost.tensor import Tensor
from ephost.types import HOST_MEMORY, desc_from_proto, describe, nbytes_of
from ephost.server.clients import ClientState
from ephost.server.state import WorkerState
from ephost.v1 import common_pb2


@dataclass
class Resolved:
    tensors: list[Tensor]
    replies: list[int]          # indices of InlineReply destinations
    inline_bytes: int = 0


def resolve(state: WorkerState, client: ClientState, refs, role: str, *, writable: bool) -> Resolved:
    out = Resolved([], [])
    for i, ref in enumerate(refs):
        shape, dtype = desc_from_proto(ref.desc)
        nbytes = nbytes_of(shape, dtype)
        where = ref.WhichOneof("location")
        label = f"{role} {i} ({describe(shape, dtype)}, {nbytes} bytes)"
        if where == "buffer":
            _, buffer = client.get("buffer", ref.buffer)
            if nbytes > buffer.nbytes:
                raise EpInvalidArgument(f"{label} does not fit its buffer of {buffer.nbytes} bytes")
            out.tensors.append(Tensor(shape, dtype, buffer.memory_info, buffer=buffer))
        elif where == "shm":
            region = state.region(client, ref.shm.region)
            if ref.shm.nbytes != nbytes:
                raise EpInvalidArgument(f"{label} is described by a slice of {ref.shm.nbytes} bytes")
            try:
                region.view(ref.shm.offset, ref.shm.nbytes)  # bounds check before anything is touched
            except EpInvalidArgument as e:
                raise type(e)(f"{label}: {e}") from None
            owner = next(a for _, a in client.items("allocator") if a.region(region.id) is region)
            buffer = Buffer(owner.memory_info, nbytes, 0, region, ref.shm.offset)
            out.tensors.append(Tensor(shape, dtype, owner.memory_info, buffer=buffer))
        elif where == "inline":
            if writable:
                raise EpInvalidArgument(f"{label}: inline bytes cannot be a destination; use an InlineReply")
            if len(ref.inline) != nbytes:
                raise EpInvalidArgument(f"{label} came with {len(ref.inline)} inline bytes")
            host = np.frombuffer(ref.inline, dtype=dtype).reshape(shape)
            out.tensors.append(Tensor(shape, dtype, HOST_MEMORY, host=host))
            out.inline_bytes += nbytes
        elif where == "reply":
            if not writable:
                raise EpInvalidArgument(f"{label}: an InlineReply can only be a destination")
            out.tensors.append(Tensor(shape, dtype, HOST_MEMORY, host=np.empty(shape, dtype)))
            out.replies.append(i)
        else:
            raise EpInvalidArgument(f"{label} says nowhere where its bytes are (set shm, inline, buffer or reply)")
    return out


def to_ref(tensor: Tensor) -> common_pb2.TensorRef:
    """An inline TensorRef carrying a host tensor's bytes."""
    array = np.ascontiguousarray(tensor.numpy())
    return common_pb2.TensorRef(desc=common_pb2.TensorDesc(elem_type=tensor.elem_type, shape=list(tensor.shape)),
                                inline=array.tobytes())
