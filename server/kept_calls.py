"""Kept calls: the prepared form of a Compute or a CopyTensors that one fast-lane connection repeats with nothing
but what changes (the frames are described in docs/wire-protocol.md).

A kept Compute keeps what its first request and reply said and the worker checked then: the partition and the
output allocator, each input's type and rank and whether it comes in a buffer of the client's (by handle) or
inline, the client's buffers outputs are written into (`output_buffers`, of fixed types and shapes), and each other
output's type and rank and whether it is left in a new buffer of the allocator. A repeat carries every input's
dimensions, checked as a request's are, then the handles of the buffers it names, then the inline inputs' bytes,
whose length is checked against the sizes the dimensions make before any byte is read; every handle is looked up
again (a released partition or buffer is NOT_FOUND, as on any Compute; a buffer too small is INVALID_ARGUMENT).
Nothing else a peer sends is trusted. The shapes may change from repeat to repeat (a decoding loop's grow every
step): one kept call serves them all.

A kept CopyTensors (all its sources and destinations buffers of the client's) keeps the data transfer, the stream
and the tensors' types and shapes; each repeat names the buffers, and its reply is empty.
"""
from __future__ import annotations

import itertools
import math
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import numpy as np

from ephost.errors import EpInvalidArgument, EpUnknownKeptCall
from ephost.fastlane import KEPT_ID, MAX_KEPT, PLACED
from ephost.tensor import Tensor
from ephost.types import MAX_TENSOR_BYTES, checked_desc, desc_to_proto, nbytes_of
from ephost.server.clients import BufferEntry, ClientState
from ephost.server.tensors import fits, place_output, write_into
from ephost.v1 import common_pb2

_VIEWED = 16  # tensors over client buffers that one kept call keeps made

Layout = tuple[tuple[tuple[int, ...], np.dtype, int], ...]  # (shape, dtype, nbytes) of each tensor


class _Views:
    """Tensors over the client's buffers that a kept call's earlier repeats named, with their arrays made: the
    same tensor again where a handle names the same buffer at the same shape (two bound tensors swapped each step,
    a thread's staging buffer: an array over shared memory is costly to make on a run's cold caches). Used by the
    connection's one thread."""

    __slots__ = ("_seen",)

    def __init__(self):
        self._seen: dict = {}  # (key, handle) -> (buffer, tensor over it)

    def tensor(self, key: int, client: ClientState, handle: int, shape, dtype, nbytes: int,
               what: str) -> tuple[Tensor, BufferEntry]:
        """A tensor in the client's buffer `handle` (looked up on every repeat: a freed one is NOT_FOUND, one too
        small INVALID_ARGUMENT), and the buffer's entry. `key` tells apart the places a call names buffers."""
        entry = client.get("buffer", handle)
        buffer = entry.buffer
        seen = self._seen.get((key, handle))
        if seen is not None and seen[0] is buffer and seen[1].shape == shape:
            return seen[1], entry
        fits(buffer, nbytes, lambda: f"a kept call's {what} ({nbytes} bytes)")
        # The buffer's own view, made once per buffer: a loop's state, a new buffer each step, was written through
        # it by the EP that made it, so its view is made already.
        view = buffer.host_view()
        host = view[:nbytes].view(dtype).reshape(shape) if view is not None else None
        tensor = Tensor.trusted(shape, dtype, buffer.memory_info, nbytes, buffer=buffer, host=host)
        if host is None:  # memory this process does not map: nothing made to find again
            return tensor, entry
        if len(self._seen) >= _VIEWED:  # a loop naming a new buffer each step: nothing to find again
            self._seen.clear()
        self._seen[(key, handle)] = (buffer, tensor)
        return tensor, entry


def _refs_layout(refs, locations: tuple[str, ...]) -> Layout | None:
    """(shape, dtype, nbytes) of TensorRefs whose locations are all among `locations`, else None."""
    layout = []
    for ref in refs:
        if ref.WhichOneof("location") not in locations:
            return None
        layout.append(checked_desc(ref.desc))
    return tuple(layout)


@dataclass(frozen=True)
class KeptCompute:
    """A kept Compute (see above): how its repeats' frames and replies are read and made."""

    method: ClassVar[str] = "Ep/Compute"
    compute_info: int
    allocator: int                                  # 0: none
    inline_limit: int
    inputs: tuple[tuple[int, np.dtype, bool], ...]  # (rank, dtype, by handle) of each input
    into: dict                                      # output position -> (shape, dtype, nbytes) of the client's buffer
    returned: tuple[int, ...]                       # the positions of the outputs not written into `into`
    outputs: tuple[tuple[int, np.dtype, bool], ...]  # (rank, dtype, left in a new buffer) of each returned output
    keep: tuple[int, ...]                           # the request's `keep` (what the EP is told)
    _views: _Views = field(default_factory=_Views, compare=False, repr=False)
    _structs: tuple = field(default=(), init=False, compare=False, repr=False)  # input dims, handles, output dims
    placed: tuple[int, ...] = field(default=(), init=False, compare=False, repr=False)  # positions left in buffers
    # What reading a frame and making a reply look up for each tensor, laid out once: each input's (position,
    # where its dimensions lie among the frame's, dtype, item size, by handle); each returned output's
    # (position, rank, dtype, left in a new buffer); how many outputs a run makes.
    _reads: tuple = field(default=(), init=False, compare=False, repr=False)
    _writes: tuple = field(default=(), init=False, compare=False, repr=False)
    _output_count: int = field(default=0, init=False, compare=False, repr=False)
    _start: int = field(default=0, init=False, compare=False, repr=False)  # where a frame's inline inputs start
    _reply_bytes: int = field(default=0, init=False, compare=False, repr=False)  # a reply's but its inline outputs

    def __post_init__(self):
        named = sum(1 for *_, by_handle in self.inputs if by_handle) + len(self.into)
        ranks = sum(r for r, _, _ in self.inputs)
        object.__setattr__(self, "_structs", (struct.Struct(f"<{ranks + named}Q"), ranks,
                                              struct.Struct(f"<{sum(r for r, _, _ in self.outputs)}Q")))
        object.__setattr__(self, "placed", tuple(i for i, (*_, left) in zip(self.returned, self.outputs) if left))
        starts = itertools.accumulate((r for r, _, _ in self.inputs), initial=0)
        object.__setattr__(self, "_reads", tuple((i, at, at + rank, dtype, dtype.itemsize, by_handle)
                                                 for i, ((rank, dtype, by_handle), at)
                                                 in enumerate(zip(self.inputs, starts))))
        object.__setattr__(self, "_writes", tuple((i, *output) for i, output in zip(self.returned, self.outputs)))
        object.__setattr__(self, "_output_count", len(self.returned) + len(self.into))
        object.__setattr__(self, "_start", KEPT_ID.size + self._structs[0].size)
        object.__setattr__(self, "_reply_bytes", self._structs[2].size + PLACED.size * len(self.placed))

    @classmethod
    def of(cls, request, reply) -> "KeptCompute | None":
        """What to keep of a Compute (its request and its reply), or None where it does not qualify: every input a
        tensor inline or in a buffer of the client's, every output a tensor written into a buffer of the client's,
        carried inline or left in a new buffer of the allocator, and no stream. A repeat leaves in the allocator
        the outputs this reply left there."""
        if request.stream:
            return None
        positions = sorted(request.output_buffers)
        into = _refs_layout([request.output_buffers[i] for i in positions], ("buffer",))
        inputs = _refs_layout([v.tensor for v in request.inputs], ("inline", "buffer")) \
            if all(v.WhichOneof("kind") == "tensor" for v in request.inputs) else None
        if into is None or inputs is None:
            return None
        returned, outputs = [], []
        for i, value in enumerate(reply.outputs):
            if i in request.output_buffers:
                continue
            if value.WhichOneof("kind") != "tensor":
                return None
            shape, dtype, _ = checked_desc(value.tensor.desc)
            left = value.tensor.WhichOneof("location") == "buffer"
            if left and not request.output_allocator:
                return None
            returned.append(i)
            outputs.append((len(shape), dtype, left))
        return cls(request.node_compute_info, request.output_allocator, request.inline_limit,
                   tuple((len(shape), dtype, v.tensor.WhichOneof("location") == "buffer")
                         for (shape, dtype, _), v in zip(inputs, request.inputs)),
                   dict(zip(positions, into)), tuple(returned), tuple(outputs),
                   tuple(i for i in dict.fromkeys(request.keep) if i not in request.output_buffers))

    def input_tensors(self, payload, client: ClientState) -> tuple[list[np.ndarray | Tensor], tuple, dict[str, int]]:
        """A repeat's inputs, as arrays over its payload (those it carries) and tensors over the client's buffers
        (no copy), the handles its payload names (its inputs' in buffers, then those outputs go into), and the
        call's counts: what the inputs are (resident: made here by an earlier Compute). Its dimensions are
        checked as a request's are, and its length against the sizes they make, before any byte is read."""
        head, ranks, _ = self._structs
        start = self._start
        size = len(payload)
        if size < start:
            raise EpInvalidArgument(f"a kept call takes at least {head.size} bytes (its inputs' dimensions, its "
                                    f"buffers' handles), got {size - KEPT_ID.size}")
        values = head.unpack_from(payload, KEPT_ID.size)
        tensors, named, offset = [], ranks, start
        resident = resident_bytes = moved = moved_bytes = 0
        for i, lo, hi, dtype, itemsize, by_handle in self._reads:
            shape = values[lo:hi]
            nbytes = math.prod(shape) * itemsize
            if not 0 < nbytes <= MAX_TENSOR_BYTES:  # a zero dimension, or one nbytes_of refuses
                nbytes = nbytes_of(shape, dtype)
            if by_handle:
                tensor, entry = self._views.tensor(i, client, values[named], shape, dtype, nbytes, "input")
                named += 1
                tensors.append(tensor)
                if entry.produced:
                    resident += 1
                    resident_bytes += nbytes
                    continue
            else:
                if offset + nbytes > size:
                    raise self._length_error(values, size)
                # An array over the payload, as a Compute's inputs may be (no tensor to make around it); one
                # constructor: frombuffer then reshape costs twice as much (the payload's length is checked).
                tensors.append(np.ndarray(shape, dtype, payload, offset))
                offset += nbytes
            moved += 1
            moved_bytes += nbytes
        if offset != size:
            raise self._length_error(values, size)
        return tensors, values[ranks:], {
            "kept_calls": 1, "compute_inputs_resident": resident, "compute_input_bytes_resident": resident_bytes,
            "compute_inputs_transferred": moved, "compute_input_bytes_transferred": moved_bytes,
            "bytes_inline_in": offset - start}

    def _length_error(self, values: tuple[int, ...], size: int) -> EpInvalidArgument:
        """The error for a frame of `size` bytes whose dimensions (`values`) make another length."""
        inline = sum(nbytes_of(values[lo:hi], dtype) for _, lo, hi, dtype, _, by_handle in self._reads if not by_handle)
        return EpInvalidArgument(f"a kept call takes {self._structs[0].size + inline} bytes (its inputs' dimensions, "
                                 f"its buffers' handles, then its inline inputs), got {size - KEPT_ID.size}")

    def into_tensors(self, handles: tuple[int, ...], client: ClientState) -> dict[int, Tensor]:
        """The client's buffers outputs are written into, by position."""
        return {i: self._views.tensor(-1 - i, client, handle, shape, dtype, nbytes, "output")[0]
                for (i, (shape, dtype, nbytes)), handle in zip(self.into.items(), self._into_handles(handles))}

    def into_refs(self, handles: tuple[int, ...]) -> dict[int, common_pb2.TensorRef]:
        """The buffers outputs go into as a request names them (for a whole reply)."""
        refs = {}
        for (i, (shape, dtype, _)), handle in zip(self.into.items(), self._into_handles(handles)):
            ref = refs[i] = common_pb2.TensorRef(buffer=handle)
            desc_to_proto(shape, dtype, ref.desc)
        return refs

    def _into_handles(self, handles: tuple[int, ...]) -> tuple[int, ...]:
        return handles[len(handles) - len(self.into):]

    def write_into(self, client: ClientState, handles: tuple[int, ...], into: dict[int, Tensor],
                   outputs: list[Any], counts: dict[str, int]) -> None:
        """The outputs that go into the client's buffers, written there (where the EP did not itself)."""
        for (i, target), handle in zip(into.items(), self._into_handles(handles)):
            write_into(client, handle, target, outputs[i], counts)

    def reply(self, outputs: list[Any]) -> tuple[list, int, int] | None:
        """A KEPT reply's parts before its records (the returned outputs' dimensions, then those carried inline,
        as arrays), the inline outputs' bytes and the whole payload's length (a record for each output left in the
        worker too); None where an output is not a tensor of its kept type and rank (the whole reply goes then)."""
        if len(outputs) != self._output_count:
            return None
        dims, parts, inline = [], [b""], 0
        for i, rank, dtype, left in self._writes:
            value = outputs[i]
            if type(value) is not Tensor or len(value.shape) != rank or value.dtype != dtype:
                return None
            dims += value.shape
            if not left:
                array = value.local_array()
                if array is None:
                    return None
                parts.append(array)
                inline += value.nbytes
        parts[0] = self._structs[2].pack(*dims)
        return parts, inline, self._reply_bytes + inline

    def place(self, client: ClientState, allocator, outputs: list[Any], counts: dict[str, int]) -> tuple[bytes, list]:
        """The outputs left in the allocator handed to the client: their PLACED records, and the shared regions
        they lie in."""
        records, regions = bytearray(), []
        for i in self.placed:
            handle, buffer = place_output(client, allocator, outputs[i], counts)
            if buffer.region is not None and buffer.region.shareable:
                regions.append(buffer.region.id)
                records += PLACED.pack(handle, buffer.region.id, buffer.offset, buffer.nbytes)
            else:
                records += PLACED.pack(handle, 0, 0, 0)
        return bytes(records), regions


@dataclass(frozen=True)
class KeptCopy:
    """A CopyTensors whose sources and destinations are all buffers of the caller's: what a repeat needs but
    their handles (sources, then destinations, in the frame)."""
    method: ClassVar[str] = "DataTransfer/CopyTensors"
    data_transfer: int
    stream: int                     # 0: none
    src: Layout
    dst: Layout
    _views: _Views = field(default_factory=_Views, compare=False, repr=False)
    _handles: struct.Struct | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_handles", struct.Struct(f"<{len(self.src) + len(self.dst)}Q"))

    @classmethod
    def of(cls, request, reply) -> "KeptCopy | None":
        """What to keep of a CopyTensors, or None where a source or destination is not named by handle."""
        src, dst = _refs_layout(request.src, ("buffer",)), _refs_layout(request.dst, ("buffer",))
        if src is None or dst is None:
            return None
        return cls(request.data_transfer, request.stream, src, dst)

    def tensors(self, payload, client: ClientState) -> tuple[list[Tensor], list[Tensor], list[BufferEntry],
                                                              list[BufferEntry]]:
        """The sources and destinations a KEPT frame names, as tensors over the client's buffers, and their
        buffers' entries."""
        if len(payload) != KEPT_ID.size + self._handles.size:
            raise EpInvalidArgument(f"a kept copy takes {self._handles.size} bytes (its buffers' handles), got "
                                    f"{len(payload) - KEPT_ID.size}")
        handles = iter(self._handles.unpack_from(payload, KEPT_ID.size))
        out: tuple[list, list, list, list] = ([], [], [], [])
        for side, (layout, what) in enumerate(((self.src, "source"), (self.dst, "destination"))):
            tensors, entries = out[side], out[2 + side]
            for i, (shape, dtype, nbytes) in enumerate(layout):
                tensor, entry = self._views.tensor(i if side == 0 else -1 - i, client, next(handles), shape, dtype,
                                                   nbytes, what)
                tensors.append(tensor)
                entries.append(entry)
        return out


# A kept call repeated, as its handler gets it: (what was kept, the KEPT frame's payload, what to call before
# any buffer it names is read). The last (None: nothing to wait for) waits until the caller has written its
# inputs (a KEPT_WRITING frame), raising EpDeadlineExceeded or FrameError. A plain tuple: one is made on every
# repeat.
KeptRequest = tuple["KeptCompute | KeptCopy", Any, "Callable[[], None] | None"]

# What a call of each method keeps, from its request and reply (None: it does not qualify).
KEEPERS = {KeptCompute.method: KeptCompute.of, KeptCopy.method: KeptCopy.of}


# A kept call's answer, as its handler returns it: (the parts of a KEPT reply's payload, their length, the regions
# its records name). A plain tuple, told from a whole reply (a message) by its type: one is made on every repeat.
KeptReply = tuple[list, int, Sequence[int]]


class KeptCalls:
    """The kept calls of one fast-lane connection (used by that connection's thread only)."""

    def __init__(self):
        self._calls: dict[int, KeptCompute | KeptCopy] = {}
        self._ids = itertools.count(1)

    def keep(self, method: str, request, reply) -> int:
        """Keep a call that asked to be kept: its id, or 0 where it does not qualify or MAX_KEPT are kept
        already. Which kept call goes to make room is the caller's to say (`replace_kept`, let_go): it knows
        which it will repeat."""
        kept = KEEPERS[method](request, reply)
        if kept is None or len(self._calls) >= MAX_KEPT:
            return 0
        kid = next(self._ids)
        self._calls[kid] = kept
        return kid

    def let_go(self, kid: int) -> None:
        """Let a kept call go (a request's `replace_kept`, as it is read); an id this connection does not keep
        is no error."""
        self._calls.pop(kid, None)

    def get(self, payload) -> KeptCompute | KeptCopy:
        """The kept call a KEPT frame's payload names."""
        if len(payload) < KEPT_ID.size:
            raise EpInvalidArgument(f"a KEPT frame of {len(payload)} bytes, shorter than its {KEPT_ID.size}-byte id")
        (kid,) = KEPT_ID.unpack_from(payload)
        kept = self._calls.get(kid)
        if kept is None:
            raise EpUnknownKeptCall(f"no kept call {kid} on this connection; send the whole call")
        return kept

    def __len__(self) -> int:
        return len(self._calls)
