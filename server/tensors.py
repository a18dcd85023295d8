"""Turning the TensorRefs a peer sends into tensors this process can address, checking everything: the
handles belong to the caller, slices lie inside their region, sizes match the described tensor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ephost import values
from ephost.errors import EpInvalidArgument, EpResourceExhausted
from ephost.memory import Buffer, check_slice
from ephost.tensor import Tensor
from ephost.types import HOST_MEMORY, desc_from_proto, describe, nbytes_of
from ephost.server.clients import BufferEntry, ClientState
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
            buffer = client.get("buffer", ref.buffer).buffer
            if nbytes > buffer.nbytes:
                raise EpInvalidArgument(f"{label} does not fit its buffer of {buffer.nbytes} bytes")
            out.tensors.append(Tensor(shape, dtype, buffer.memory_info, buffer=buffer))
        elif where == "shm":
            owner, region = state.region(client, ref.shm.region)
            if ref.shm.nbytes != nbytes:
                raise EpInvalidArgument(f"{label} is described by a slice of {ref.shm.nbytes} bytes")
            try:
                check_slice(ref.shm.offset, ref.shm.nbytes, region.size)  # before anything is touched
            except EpInvalidArgument as e:
                raise type(e)(f"{label}: {e}") from None
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
            if nbytes > state.limits.max_message:
                raise EpResourceExhausted(f"{label} cannot come back inline: it is larger than a message may be "
                                          f"({state.limits.max_message} bytes); copy it into a buffer instead")
            state.check_size(nbytes, label)
            out.tensors.append(Tensor(shape, dtype, HOST_MEMORY, host=np.empty(shape, dtype)))
            out.replies.append(i)
        else:
            raise EpInvalidArgument(f"{label} says nowhere where its bytes are (set shm, inline, buffer or reply)")
    return out


def input_value(state: WorkerState, client: ClientState, message: common_pb2.Value, i: int) -> tuple[Any, bool]:
    """A Compute input as a graph value, and whether it was already here (made by an earlier Compute)."""
    if message.WhichOneof("kind") == "onnx":
        return values.decode(message.onnx), False
    if message.WhichOneof("kind") != "tensor":
        raise EpInvalidArgument(f"input {i} is empty (set tensor or onnx)")
    ref = message.tensor
    resident = ref.WhichOneof("location") == "buffer" and client.get("buffer", ref.buffer).produced
    return resolve(state, client, [ref], f"input {i}", writable=False).tensors[0], resident


def output_value(state: WorkerState, client: ClientState, allocator, inline_limit: int,
                 value: Any) -> common_pb2.Value:
    """A Compute output: left in a buffer of `allocator` (the client's handle to it is returned) when it is
    large enough and an allocator was given, else inline."""
    if not isinstance(value, Tensor):
        message = common_pb2.Value(onnx=values.encode(value))
        state.stats.add(bytes_inline_out=len(message.onnx.data))
        return message
    desc = common_pb2.TensorDesc(elem_type=value.elem_type, shape=list(value.shape))
    if allocator is None or value.nbytes < inline_limit:
        state.stats.add(bytes_inline_out=value.nbytes)
        return common_pb2.Value(tensor=common_pb2.TensorRef(desc=desc, inline=value.local_bytes().tobytes()))
    buffer = value.buffer
    in_allocator = buffer is not None and buffer.region is not None \
        and allocator.region(buffer.region.id) is buffer.region  # the EP put it there itself
    if in_allocator:
        state.stats.add(compute_outputs_in_place=1)
    else:
        placed = Tensor.empty(value.shape, value.dtype, allocator)
        placed.local_bytes()[:] = value.local_bytes()
        value = placed
        state.stats.add(compute_outputs_copied=1)
    buffer = value.detach_buffer()  # the client owns it from now on, through its handle
    ref = common_pb2.TensorRef(desc=desc, buffer=client.add("buffer", BufferEntry(allocator, buffer, produced=True)))
    if buffer.region is not None and buffer.region.shareable:
        ref.mapped.CopyFrom(common_pb2.ShmSlice(region=buffer.region.id, offset=buffer.offset, nbytes=buffer.nbytes))
    return common_pb2.Value(tensor=ref)



def output_buffers(state: WorkerState, client: ClientState, refs) -> dict[int, Tensor]:
    """The caller's buffers some outputs are to be written into (ComputeRequest.output_buffers), by position."""
    into = {}
    for i, ref in sorted(refs.items()):
        if ref.WhichOneof("location") != "buffer":
            raise EpInvalidArgument(f"output {i} can only be written into a buffer of the caller's (set buffer)")
        into[i] = resolve(state, client, [ref], f"output {i}", writable=True).tensors[0]
    return into


def into_value(state: WorkerState, client: ClientState, ref: common_pb2.TensorRef, target: Tensor,
               value: Any) -> common_pb2.Value:
    """A Compute output written into the caller's buffer `target` (by the EP itself, or copied here)."""
    if not isinstance(value, Tensor) or value.dtype != target.dtype or value.shape != target.shape:
        made = describe(value.shape, value.dtype) if isinstance(value, Tensor) else type(value).__name__
        raise EpInvalidArgument(f"an output made as {made} cannot be written into a buffer of "
                                f"{describe(target.shape, target.dtype)}")
    if value is target or (value.buffer is not None and value.buffer is target.buffer):
        state.stats.add(compute_outputs_in_place=1)
    else:
        np.copyto(target.local_bytes(), value.local_bytes())
        state.stats.add(compute_outputs_copied=1)
    client.get("buffer", ref.buffer).produced = True
    return common_pb2.Value(tensor=common_pb2.TensorRef(desc=ref.desc, buffer=ref.buffer))
