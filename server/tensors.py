"""Turning the TensorRefs a peer sends into tensors this process can address, checking everything: the
handles belong to the caller, slices lie inside their region, sizes match the described tensor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ephost import values
from ephost.errors import EpInvalidArgument, EpResourceExhausted
from ephost.memory import Buffer, check_slice
from ephost.tensor import Tensor
from ephost.types import HOST_MEMORY, checked_desc, desc_to_proto, describe
from ephost.server.clients import BufferEntry, ClientState
from ephost.server.state import WorkerState
from ephost.v1 import common_pb2


@dataclass
class Resolved:
    tensors: list[Tensor]
    entries: list[BufferEntry | None]  # the client's buffer each tensor lies in, where it names one by handle
    replies: list[int]                 # indices of InlineReply destinations
    inline_bytes: int = 0


def resolve(state: WorkerState, client: ClientState, refs, role: str, *, writable: bool) -> Resolved:
    out = Resolved([], [], [])
    for i, ref in enumerate(refs):
        tensor, entry = resolve_ref(state, client, ref, f"{role} {i}", writable=writable)
        out.tensors.append(tensor)
        out.entries.append(entry)
        where = ref.WhichOneof("location")
        if where == "inline":
            out.inline_bytes += tensor.nbytes
        elif where == "reply":
            out.replies.append(i)
    return out


def buffer_tensor(client: ClientState, handle: int, shape: tuple[int, ...], dtype: np.dtype, nbytes: int,
                  label: Callable[[], str]) -> tuple[Tensor, BufferEntry]:
    """A tensor (checked already: shape, dtype, size) over the start of one of the client's buffers."""
    entry = client.get("buffer", handle)
    buffer = entry.buffer
    fits(buffer, nbytes, label)
    return Tensor.trusted(shape, dtype, buffer.memory_info, nbytes, buffer=buffer), entry


def fits(buffer: Buffer, nbytes: int, label: Callable[[], str]) -> None:
    """Raise EpInvalidArgument where `nbytes` (of what `label()` names) do not fit `buffer`."""
    if nbytes > buffer.nbytes:
        raise EpInvalidArgument(f"{label()} does not fit its buffer of {buffer.nbytes} bytes")


def resolve_ref(state: WorkerState, client: ClientState, ref, what: str, *,
                writable: bool) -> tuple[Tensor, BufferEntry | None]:
    """One TensorRef as a tensor here, with the client's buffer entry where it names a buffer by handle."""
    shape, dtype, nbytes = checked_desc(ref.desc)
    where = ref.WhichOneof("location")

    def label() -> str:  # made only for an error: every Compute passes here
        return f"{what} ({describe(shape, dtype)}, {nbytes} bytes)"

    if where == "inline":  # first: small inputs, the common case
        data = ref.inline
        if writable:
            raise EpInvalidArgument(f"{label()}: inline bytes cannot be a destination; use an InlineReply")
        if len(data) != nbytes:
            raise EpInvalidArgument(f"{label()} came with {len(data)} inline bytes")
        return Tensor.trusted(shape, dtype, HOST_MEMORY, nbytes, host=np.frombuffer(data, dtype).reshape(shape)), None
    if where == "buffer":
        return buffer_tensor(client, ref.buffer, shape, dtype, nbytes, label)
    if where == "shm":
        owner, region = state.region(client, ref.shm.region)
        if ref.shm.nbytes != nbytes:
            raise EpInvalidArgument(f"{label()} is described by a slice of {ref.shm.nbytes} bytes")
        try:
            check_slice(ref.shm.offset, ref.shm.nbytes, region.size)  # before anything is touched
        except EpInvalidArgument as e:
            raise type(e)(f"{label()}: {e}") from None
        buffer = Buffer(owner.memory_info, nbytes, 0, region, ref.shm.offset)
        return Tensor.trusted(shape, dtype, owner.memory_info, nbytes, buffer=buffer), None
    if where == "reply":
        if not writable:
            raise EpInvalidArgument(f"{label()}: an InlineReply can only be a destination")
        if nbytes > state.limits.max_message:
            raise EpResourceExhausted(f"{label()} cannot come back inline: it is larger than a message may be "
                                      f"({state.limits.max_message} bytes); copy it into a buffer instead")
        state.check_size(nbytes, label())
        return Tensor.trusted(shape, dtype, HOST_MEMORY, nbytes, host=np.empty(shape, dtype)), None
    raise EpInvalidArgument(f"{label()} says nowhere where its bytes are (set shm, inline, buffer or reply)")


def input_value(state: WorkerState, client: ClientState, message: common_pb2.Value,
                i: int) -> tuple[Any, bool, bool]:
    """A Compute input as a graph value, whether it was already here (made by an earlier Compute), and whether
    its bytes came inside the request."""
    kind = message.WhichOneof("kind")
    if kind == "tensor":
        tensor, entry = resolve_ref(state, client, message.tensor, f"input {i}", writable=False)
        return tensor, entry is not None and entry.produced, tensor.buffer is None  # no buffer: inline bytes
    if kind == "onnx":
        return values.decode(message.onnx), False, True
    raise EpInvalidArgument(f"input {i} is empty (set tensor or onnx)")


def tally(counts: dict[str, int], key: str, amount: int = 1) -> None:
    """Add to one of a call's counters (WorkerStats takes them all at once, under one lock)."""
    counts[key] = counts.get(key, 0) + amount


def output_value(state: WorkerState, client: ClientState, allocator, inline_limit: int, value: Any,
                 out: common_pb2.Value, counts: dict[str, int]) -> None:
    """A Compute output, written into `out`: left in a buffer of `allocator` (the client's handle to it is
    returned) when it is large enough and an allocator was given, else inline."""
    if not isinstance(value, Tensor):
        out.onnx.CopyFrom(values.encode(value))
        tally(counts, "bytes_inline_out", len(out.onnx.data))
        return
    ref = out.tensor
    desc_to_proto(value.shape, value.dtype, ref.desc)
    if allocator is None or value.nbytes < inline_limit:
        tally(counts, "bytes_inline_out", value.nbytes)
        ref.inline = value.local_array().tobytes()
        return
    ref.buffer, buffer = place_output(client, allocator, value, counts)
    if buffer.region is not None and buffer.region.shareable:
        mapped = ref.mapped
        mapped.region, mapped.offset, mapped.nbytes = buffer.region.id, buffer.offset, buffer.nbytes


def place_output(client: ClientState, allocator, value: Tensor, counts: dict[str, int]) -> tuple[int, Buffer]:
    """A Compute output left in a buffer of `allocator` (where the EP put it, else copied there), handed to the
    client: its handle, and the buffer."""
    buffer = value.buffer
    in_allocator = buffer is not None and buffer.region is not None \
        and allocator.region(buffer.region.id) is buffer.region  # the EP put it there itself
    if in_allocator:
        tally(counts, "compute_outputs_in_place")
        buffer = value.detach_buffer()  # the client owns it from now on, through its handle
    else:
        # Copied into a new buffer through the buffer's own view (no tensor made of it, nor a finalizer to
        # detach: a step that leaves its output in the worker does this every run)
        buffer = allocator.alloc(value.nbytes)
        try:
            buffer.host_view()[:value.nbytes] = value.local_bytes()
        except BaseException:
            allocator.free(buffer)
            raise
        tally(counts, "compute_outputs_copied")
    return client.add("buffer", BufferEntry(allocator, buffer, produced=True)), buffer


def output_buffers(state: WorkerState, client: ClientState, refs) -> dict[int, Tensor]:
    """The caller's buffers some outputs are to be written into (ComputeRequest.output_buffers), by position."""
    into = {}
    for i, ref in sorted(refs.items()):
        if ref.WhichOneof("location") != "buffer":
            raise EpInvalidArgument(f"output {i} can only be written into a buffer of the caller's (set buffer)")
        into[i] = resolve_ref(state, client, ref, f"output {i}", writable=True)[0]
    return into


def into_value(client: ClientState, ref: common_pb2.TensorRef, target: Tensor, value: Any,
               out: common_pb2.Value, counts: dict[str, int]) -> None:
    """A Compute output written into the caller's buffer `target` (by the EP itself, or copied here); its
    reference into `out`."""
    write_into(client, ref.buffer, target, value, counts)
    out.tensor.desc.CopyFrom(ref.desc)
    out.tensor.buffer = ref.buffer


def write_into(client: ClientState, handle: int, target: Tensor, value: Any, counts: dict[str, int]) -> None:
    """A Compute output written into the caller's buffer `target` (`handle`), where the EP did not write it
    there itself; the buffer's bytes are made here from now on."""
    if not isinstance(value, Tensor) or value.dtype != target.dtype or value.shape != target.shape:
        made = describe(value.shape, value.dtype) if isinstance(value, Tensor) else type(value).__name__
        raise EpInvalidArgument(f"an output made as {made} cannot be written into a buffer of "
                                f"{describe(target.shape, target.dtype)}")
    if value is target or (value.buffer is not None and value.buffer is target.buffer):
        tally(counts, "compute_outputs_in_place")
    else:
        np.copyto(target.local_bytes(), value.local_bytes())
        tally(counts, "compute_outputs_copied")
    client.get("buffer", handle).produced = True
