"""Kept calls: Computes and CopyTensors that one fast-lane connection repeats with nothing but what changes
(the frames are described in ephost/fastlane.py).

What a kept call keeps is what its first request and reply said and the worker checked then: the handles of the
partition and of the output allocator, the types, shapes and sizes of the inputs and outputs, which inputs come in
buffers of the client's (large ones it staged there, or values already here: an IOBinding's bound inputs), which
outputs go into buffers of the client's (an IOBinding's bound outputs, `output_buffers`) and which into new buffers
of the allocator (`keep`, and those too large to go inline). Each repeat names those buffers by handle and carries
the small inputs' bytes; the reply carries the other outputs' bytes and a record for each new buffer. Every handle
is looked up on every repeat (a released partition or buffer is NOT_FOUND, as on any Compute; a buffer too small is
INVALID_ARGUMENT) and the payload's length is checked against the kept sizes before any byte is read; nothing else
a peer sends is trusted. A Compute kept with `keep_shapes` (ShapedCall) keeps the inputs' and outputs' types and
ranks only: each repeat's dimensions come first in its frame, and are checked as a request's are (nbytes_of),
before the payload's length is checked against the sizes they make. A kept CopyTensors (all its sources and
destinations buffers of the client's) keeps the data transfer, the stream and the tensors' types and shapes; each
repeat names the buffers, and its reply is empty.
"""
from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np

from ephost.errors import EpInvalidArgument, EpUnknownKeptCall
from ephost.fastlane import KEPT_ID, MAX_KEPT, PLACED
from ephost.tensor import Tensor
from ephost.types import HOST_MEMORY, checked_desc, desc_to_proto, nbytes_of
from ephost.server.clients import BufferEntry, ClientState
from ephost.server.tensors import fits, place_output, tally, write_into
from ephost.v1 import common_pb2


_VIEWED = 16  # tensors over buffers a kept call keeps made

Layout = tuple[tuple[tuple[int, ...], np.dtype, int], ...]  # (shape, dtype, nbytes) of each tensor
# (shape, dtype, nbytes, in a buffer) of each input; in a buffer: its handle comes in the frame, else its bytes
Inputs = tuple[tuple[tuple[int, ...], np.dtype, int, bool], ...]


def _output_layout(values, into) -> tuple[Layout, dict] | None:
    """The layout of the Values carried inline, and of those left in a new buffer of the allocator (those `keep`
    named, and those too large to go inline), by position; those at the positions in `into` are not looked at.
    None where one is not a tensor."""
    layout, left = [], {}
    for i, value in enumerate(values):
        if i in into:
            continue
        if value.WhichOneof("kind") != "tensor":
            return None
        if value.tensor.WhichOneof("location") == "buffer":
            left[i] = checked_desc(value.tensor.desc)
        else:
            layout.append(checked_desc(value.tensor.desc))
    return tuple(layout), left


def _into_layout(refs) -> dict | None:
    """(shape, dtype, nbytes) of the caller's buffers outputs are written into, by position; None where one
    is not named by handle."""
    into = {}
    for i, ref in sorted(refs.items()):
        if ref.WhichOneof("location") != "buffer":
            return None
        into[i] = checked_desc(ref.desc)
    return into


def _input_layout(values) -> Inputs | None:
    """The layout of inputs that are all tensors, inline or in a buffer of the caller's, else None."""
    layout = []
    for value in values:
        if value.WhichOneof("kind") != "tensor":
            return None
        ref = value.tensor
        where = ref.WhichOneof("location")
        if where not in ("inline", "buffer"):
            return None
        layout.append((*checked_desc(ref.desc), where == "buffer"))
    return tuple(layout)


class _Views:
    """Tensors over the client's buffers that a kept call's earlier runs named, with their arrays made: the
    same tensor again where a handle names the same buffer (two bound tensors swapped each step, a thread's
    staging buffer: an array over shared memory costs tens of microseconds to make on a run's cold caches).
    Used by the connection's one thread."""

    __slots__ = ("_seen",)

    def __init__(self):
        self._seen: dict = {}  # (key, handle) -> (buffer, tensor over it)

    def tensor(self, key: int, client: ClientState, handle: int, shape, dtype, nbytes: int,
               what: str) -> tuple[Tensor, BufferEntry]:
        """A tensor in the client's buffer `handle` (looked up on every run: a freed one is NOT_FOUND, one too
        small INVALID_ARGUMENT), and the buffer's entry. `key` tells apart the places a call names buffers."""
        entry = client.get("buffer", handle)
        buffer = entry.buffer
        seen = self._seen.get((key, handle))
        if seen is not None and seen[0] is buffer and seen[1].shape == shape:
            return seen[1], entry
        fits(buffer, nbytes, lambda: f"a kept call's {what} ({nbytes} bytes)")
        # The buffer's own view, made once per buffer: a loop's state, a new buffer each step, was written
        # through it by the EP that made it (eps/onnxruntime.py, _in_allocator), so its view is made already.
        view = buffer.host_view()
        host = view[:nbytes].view(dtype).reshape(shape) if view is not None else None
        tensor = Tensor.trusted(shape, dtype, buffer.memory_info, nbytes, buffer=buffer, host=host)
        if host is None:  # memory this process does not map: nothing made to find again
            return tensor, entry
        if len(self._seen) >= _VIEWED:  # a loop naming a new buffer each step: nothing to find again
            self._seen.clear()
        self._seen[(key, handle)] = (buffer, tensor)
        return tensor, entry


def _unpack_handles(handles: struct.Struct, input_bytes: int, payload) -> tuple[int, ...]:
    """The handles a KEPT frame's payload names after its id, once its length is checked (they and the inline
    inputs' bytes fill it exactly)."""
    expected = handles.size + input_bytes
    if len(payload) != KEPT_ID.size + expected:
        raise EpInvalidArgument(f"a kept call takes {expected} bytes (its buffers' handles, then its inline "
                                f"inputs), got {len(payload) - KEPT_ID.size}")
    return handles.unpack_from(payload, KEPT_ID.size)


@dataclass(frozen=True)
class KeptCall:
    method: ClassVar[str] = "Ep/Compute"
    compute_info: int
    allocator: int        # 0: none
    inline_limit: int
    inputs: Inputs
    outputs: Layout       # the outputs that go back in the reply (all but those written into `into`)
    input_bytes: int      # the payload after its id: the bytes of every input that comes in the frame
    output_bytes: int     # a reply's payload: the bytes of `outputs`
    into: dict = field(default_factory=dict, compare=False)  # output position -> (shape, dtype, nbytes)
    # the outputs left in new buffers of the allocator (those `keep` names, and those too large to go inline):
    # output position -> (shape, dtype, nbytes)
    placed: dict = field(default_factory=dict, compare=False)
    keep: tuple[int, ...] = field(default=(), compare=False)  # the request's `keep` (what the EP is told)
    # tensors over the buffers earlier runs named, by input index (output i: -1 - i) and handle
    _views: _Views = field(default_factory=_Views, compare=False, repr=False)
    _counts: dict = field(default_factory=dict, compare=False, repr=False)
    _handles: struct.Struct | None = field(default=None, init=False, compare=False, repr=False)  # a frame's u64s
    _sizes: tuple[int, int] = field(default=(0, 0), init=False, compare=False, repr=False)  # see sizes()

    def __post_init__(self):
        named = sum(1 for *_, h in self.inputs if h) + len(self.into)
        object.__setattr__(self, "_handles", struct.Struct(f"<{named}Q"))
        object.__setattr__(self, "_sizes", (self.output_bytes, self.output_bytes + PLACED.size * len(self.placed)))
        self._counts.update(kept_calls=1, compute_inputs_transferred=sum(1 for *_, h in self.inputs if not h),
                            compute_input_bytes_transferred=self.input_bytes, bytes_inline_in=self.input_bytes)

    @classmethod
    def of(cls, request, reply) -> "KeptCall | None":
        """What to keep of a Compute (its request and its reply), or None where it does not qualify: every
        input a tensor inline or in a buffer of the caller's, every output a tensor carried inline, written into
        a buffer of the caller's or left in a new buffer of the allocator (`keep`, or too large to go inline),
        and no stream. A repeat leaves in the allocator the outputs this reply left there."""
        if request.stream:
            return None
        into = _into_layout(request.output_buffers) if request.output_buffers else {}
        if into is None:
            return None
        inputs, outputs = _input_layout(request.inputs), _output_layout(reply.outputs, into)
        if inputs is None or outputs is None or (outputs[1] and not request.output_allocator):
            return None
        layout, left = outputs
        keep = tuple(i for i in dict.fromkeys(request.keep) if i not in into)
        return cls(request.node_compute_info, request.output_allocator, request.inline_limit, inputs, layout,
                   sum(n for _, _, n, h in inputs if not h), sum(n for _, _, n in layout), into, left, keep)

    def sizes(self, arrays: list) -> tuple[int, int]:
        """(the inline outputs' bytes, the KEPT reply's payload: those and a record per output left in the
        worker) of a repeat whose output_arrays are `arrays`."""
        return self._sizes

    def handles(self, payload) -> tuple[int, ...]:
        """The handles of the buffers a KEPT frame's payload names (its inputs' in a buffer, in order, then the
        buffers its outputs go into, by position), once its length is checked."""
        return _unpack_handles(self._handles, self.input_bytes, payload)

    def input_tensors(self, payload, handles: tuple[int, ...], client: ClientState,
                      counts: dict[str, int]) -> list[Tensor]:
        """The inputs, as tensors over a KEPT frame's payload and over the client's buffers (no copy); what
        they are counted in `counts` (resident: made here by an earlier Compute)."""
        tensors, offset, named = [], KEPT_ID.size + self._handles.size, iter(handles)
        for i, (shape, dtype, nbytes, by_handle) in enumerate(self.inputs):
            if by_handle:
                tensor, entry = self._views.tensor(i, client, next(named), shape, dtype, nbytes, "input")
                tensors.append(tensor)
                where = "resident" if entry.produced else "transferred"
                tally(counts, f"compute_inputs_{where}")
                tally(counts, f"compute_input_bytes_{where}", nbytes)
                continue
            # One constructor: frombuffer then reshape costs twice as much (the payload's length is checked).
            tensors.append(Tensor.trusted(shape, dtype, HOST_MEMORY, nbytes,
                                          host=np.ndarray(shape, dtype, payload, offset)))
            offset += nbytes
        return tensors

    def counts(self) -> dict[str, int]:
        """A repeat's counters, as far as they are known before it runs (its inline inputs')."""
        return dict(self._counts)

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

    def output_arrays(self, outputs: list[Any]) -> list[np.ndarray] | None:
        """The outputs that go back, as arrays to send as they are, or None where one is not of its kept type
        and shape (the whole reply is sent then)."""
        if len(outputs) != len(self.outputs) + len(self.into) + len(self.placed):
            return None
        if self.placed:
            for i, (shape, dtype, _) in self.placed.items():
                value = outputs[i]
                if not isinstance(value, Tensor) or value.shape != shape or value.dtype != dtype:
                    return None
        if self.into or self.placed:
            outputs = [v for i, v in enumerate(outputs) if i not in self.into and i not in self.placed]
        arrays = []
        for value, (shape, dtype, _) in zip(outputs, self.outputs):
            if not isinstance(value, Tensor) or value.shape != shape or value.dtype != dtype:
                return None
            array = value.local_array()
            if array is None:
                return None
            arrays.append(array)
        return arrays

    def place(self, client: ClientState, allocator, outputs: list[Any], counts: dict[str, int]) -> tuple[bytes, list]:
        """The outputs left in the allocator handed to the client: their PLACED records, and the shared regions
        they lie in."""
        return _place(client, allocator, self.placed, outputs, counts)


def _place(client: ClientState, allocator, positions, outputs: list[Any],
           counts: dict[str, int]) -> tuple[bytes, list]:
    """The outputs at `positions` handed to the client in new buffers of the allocator: their PLACED records, and
    the shared regions they lie in."""
    records, regions = bytearray(), []
    for i in positions:
        handle, buffer = place_output(client, allocator, outputs[i], counts)
        if buffer.region is not None and buffer.region.shareable:
            regions.append(buffer.region.id)
            records += PLACED.pack(handle, buffer.region.id, buffer.offset, buffer.nbytes)
        else:
            records += PLACED.pack(handle, 0, 0, 0)
    return bytes(records), regions


@dataclass(frozen=True)
class ShapedCall:
    """A Compute kept with `keep_shapes`: its repeats may have inputs of other shapes (the same types and ranks),
    as the steps of a loop whose shapes grow do; each repeat's frame and reply carry the dimensions
    (ephost/fastlane.py). No output goes into a buffer of the caller's (`into`): a bound output has one shape."""
    method: ClassVar[str] = "Ep/Compute"
    into: ClassVar[dict] = {}
    compute_info: int
    allocator: int        # 0: none
    inline_limit: int
    inputs: tuple[tuple[int, np.dtype, bool], ...]   # (rank, dtype, in a buffer) of each input
    outputs: tuple[tuple[int, np.dtype, bool], ...]  # (rank, dtype, left in the worker) of each output
    keep: tuple[int, ...] = field(default=(), compare=False)  # the request's `keep` (what the EP is told)
    _views: _Views = field(default_factory=_Views, compare=False, repr=False)
    _structs: tuple = field(default=(), init=False, compare=False, repr=False)  # dims in, handles, dims out
    # the outputs left in new buffers of the allocator, as its first reply left them (`keep`'s, and those too large
    # to go inline then): every repeat leaves them there
    placed: tuple[int, ...] = field(default=(), init=False, compare=False, repr=False)

    def __post_init__(self):
        named = sum(1 for *_, h in self.inputs if h)
        object.__setattr__(self, "_structs", (struct.Struct(f"<{sum(r for r, _, _ in self.inputs)}Q"),
                                              struct.Struct(f"<{named}Q"),
                                              struct.Struct(f"<{sum(r for r, _, _ in self.outputs)}Q")))
        object.__setattr__(self, "placed", tuple(i for i, (*_, left) in enumerate(self.outputs) if left))

    @classmethod
    def of(cls, request, reply) -> "ShapedCall | None":
        """What to keep, or None where the call does not qualify (as KeptCall.of, and no output_buffers)."""
        if request.stream or request.output_buffers:
            return None
        inputs, outputs = _input_layout(request.inputs), _output_layout(reply.outputs, {})
        if inputs is None or outputs is None or (outputs[1] and not request.output_allocator):
            return None
        inline, left, kinds = iter(outputs[0]), outputs[1], []
        for i in range(len(reply.outputs)):
            shape, dtype, _ = left[i] if i in left else next(inline)
            kinds.append((len(shape), dtype, i in left))
        return cls(request.node_compute_info, request.output_allocator, request.inline_limit,
                   tuple((len(shape), dtype, h) for shape, dtype, _, h in inputs), tuple(kinds),
                   tuple(dict.fromkeys(request.keep)))

    def counts(self) -> dict[str, int]:
        return {"kept_calls": 1}

    def handles(self, payload) -> tuple[tuple[int, ...], list, int]:
        """(the handles a repeat's payload names, each input's (shape, dtype, nbytes), where the inline inputs'
        bytes start), its dimensions checked as a request's are and its length against the sizes they make."""
        dims, handles = self._structs[0], self._structs[1]
        head = KEPT_ID.size + dims.size + handles.size
        if len(payload) < head:
            raise EpInvalidArgument(f"a kept call of changing shapes takes at least {head - KEPT_ID.size} bytes "
                                    f"(its inputs' dimensions, its buffers' handles), got "
                                    f"{len(payload) - KEPT_ID.size}")
        values = dims.unpack_from(payload, KEPT_ID.size)
        descs, at, inline = [], 0, 0
        for rank, dtype, by_handle in self.inputs:
            shape = values[at:at + rank]
            at += rank
            nbytes = nbytes_of(shape, dtype)
            descs.append((shape, dtype, nbytes))
            if not by_handle:
                inline += nbytes
        if len(payload) != head + inline:
            raise EpInvalidArgument(f"a kept call takes {dims.size + handles.size + inline} bytes (its inputs' "
                                    f"dimensions, its buffers' handles, then its inline inputs), got "
                                    f"{len(payload) - KEPT_ID.size}")
        return handles.unpack_from(payload, KEPT_ID.size + dims.size), descs, head

    def input_tensors(self, payload, run: tuple[tuple[int, ...], list, int], client: ClientState,
                      counts: dict[str, int]) -> list[Tensor]:
        """The inputs of a repeat (`run`: what handles() made of its payload), as KeptCall.input_tensors."""
        handles, descs, offset = run
        tensors, named = [], iter(handles)
        for i, ((shape, dtype, nbytes), (_, _, by_handle)) in enumerate(zip(descs, self.inputs)):
            if by_handle:
                tensor, entry = self._views.tensor(i, client, next(named), shape, dtype, nbytes, "input")
                tensors.append(tensor)
                where = "resident" if entry.produced else "transferred"
            else:
                tensors.append(Tensor.trusted(shape, dtype, HOST_MEMORY, nbytes,
                                              host=np.ndarray(shape, dtype, payload, offset)))
                offset += nbytes
                where = "transferred"
                tally(counts, "bytes_inline_in", nbytes)
            tally(counts, f"compute_inputs_{where}")
            tally(counts, f"compute_input_bytes_{where}", nbytes)
        return tensors

    def output_arrays(self, outputs: list[Any]) -> list | None:
        """The reply's parts before the records: the outputs' dimensions, then the inline outputs as arrays; None
        where an output is not a tensor of its kept type and rank (the whole reply is sent then)."""
        if len(outputs) != len(self.outputs):
            return None
        dims, arrays = [], [None]
        for value, (rank, dtype, left) in zip(outputs, self.outputs):
            if not isinstance(value, Tensor) or len(value.shape) != rank or value.dtype != dtype:
                return None
            dims += value.shape
            if not left:
                array = value.local_array()
                if array is None:
                    return None
                arrays.append(array)
        arrays[0] = self._structs[2].pack(*dims)
        return arrays

    def sizes(self, arrays: list) -> tuple[int, int]:
        """As KeptCall.sizes."""
        inline = sum(a.nbytes for a in arrays[1:])
        return inline, len(arrays[0]) + inline + PLACED.size * len(self.placed)

    def place(self, client: ClientState, allocator, outputs: list[Any], counts: dict[str, int]) -> tuple[bytes, list]:
        """As KeptCall.place."""
        return _place(client, allocator, self.placed, outputs, counts)


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
        layouts = []
        for refs in (request.src, request.dst):
            if any(ref.WhichOneof("location") != "buffer" for ref in refs):
                return None
            layouts.append(tuple(checked_desc(ref.desc) for ref in refs))
        return cls(request.data_transfer, request.stream, *layouts)

    def tensors(self, payload, client: ClientState) -> tuple[list[Tensor], list[Tensor], list[BufferEntry],
                                                              list[BufferEntry]]:
        """The sources and destinations a KEPT frame names, as tensors over the client's buffers, and their
        buffers' entries."""
        handles = iter(_unpack_handles(self._handles, 0, payload))
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
# run.
KeptRequest = tuple["KeptCall | ShapedCall | KeptCopy", Any, "Callable[[], None] | None"]


def _keep_compute(request, reply) -> KeptCall | ShapedCall | None:
    return (ShapedCall if request.keep_shapes else KeptCall).of(request, reply)


# What a call of each method keeps, from its request and reply (None: it does not qualify).
KEEPERS = {KeptCall.method: _keep_compute, KeptCopy.method: KeptCopy.of}


@dataclass
class KeptReply:
    """A kept call's answer: the parts of a KEPT reply's payload, their length, and the regions its records
    name."""
    parts: list
    nbytes: int
    regions: list[int]


class KeptCalls:
    """The kept calls of one fast-lane connection (used by that connection's thread only)."""

    def __init__(self):
        self._calls: dict[int, KeptCall | KeptCopy] = {}
        self._ids = itertools.count(1)

    def keep(self, method: str, request, reply) -> int:
        """Keep a call that asked to be kept: its id, or 0 where it does not qualify or MAX_KEPT are kept
        already. Which kept call goes to make room is the caller's to say (`replace_kept`, let_go): it knows
        which it will repeat; letting the oldest go had a plan that cycles through more calls than the bound
        keep each anew every run."""
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

    def get(self, payload) -> KeptCall | KeptCopy:
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
