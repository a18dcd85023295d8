"""Kept calls: Computes that one fast-lane connection repeats with nothing but the inputs' bytes (the frames are
described in ephost/fastlane.py).

What a kept call keeps is what its first request and reply said and the worker checked then: the handles of
the partition and of the output allocator, the types, shapes and sizes of the inputs and outputs, for inputs
in one of the client's buffers (large ones it staged there and writes again each run, or values already here:
an IOBinding's bound inputs) that buffer's handle, and for outputs written into the client's buffers (an
IOBinding's bound outputs, ComputeRequest.output_buffers) theirs. The frame carries only the small inputs'
bytes, the reply only the bytes of the outputs that go back. Each repeat looks every handle up again (a
released partition or buffer is NOT_FOUND, as on any Compute; a buffer too small is INVALID_ARGUMENT) and
checks the payload's length against the kept sizes before any byte is read; nothing else a peer sends is
trusted.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ephost.errors import EpInvalidArgument, EpUnknownKeptCall
from ephost.fastlane import KEPT_ID, MAX_KEPT
from ephost.tensor import Tensor
from ephost.types import HOST_MEMORY, checked_desc
from ephost.server.clients import ClientState
from ephost.server.tensors import buffer_tensor, tally, write_into


Layout = tuple[tuple[tuple[int, ...], np.dtype, int], ...]  # (shape, dtype, nbytes) of each tensor
# (shape, dtype, nbytes, buffer handle) of each input; handle 0: its bytes come in the frame
Inputs = tuple[tuple[tuple[int, ...], np.dtype, int, int], ...]


def _inline_layout(values, into) -> Layout | None:
    """The layout of Values that are all tensors carried inline, but those at the positions in `into`, else
    None."""
    layout = []
    for i, value in enumerate(values):
        if i in into:
            continue
        if value.WhichOneof("kind") != "tensor" or value.tensor.WhichOneof("location") != "inline":
            return None
        layout.append(checked_desc(value.tensor.desc))
    return tuple(layout)


def _into_layout(refs) -> Inputs | None:
    """(shape, dtype, nbytes, handle) of the caller's buffers outputs are written into, by position; None
    where one is not named by handle."""
    into = {}
    for i, ref in sorted(refs.items()):
        if ref.WhichOneof("location") != "buffer":
            return None
        into[i] = (*checked_desc(ref.desc), ref.buffer)
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
        layout.append((*checked_desc(ref.desc), ref.buffer if where == "buffer" else 0))
    return tuple(layout)


@dataclass(frozen=True)
class KeptCall:
    compute_info: int
    allocator: int        # 0: none
    inline_limit: int
    inputs: Inputs
    outputs: Layout       # the outputs that go back in the reply (all but those written into `into`)
    input_bytes: int      # the payload after its id: the bytes of every input that comes in the frame
    output_bytes: int     # a reply's payload: the bytes of `outputs`
    into: dict = field(default_factory=dict, compare=False)  # output position -> (shape, dtype, nbytes, handle)
    into_refs: dict = field(default_factory=dict, compare=False)  # position -> the request's TensorRef
    # input index -> (buffer, tensor over it) of the last run: the tensor and its array are made again only
    # when the handle names another buffer (the connection's one thread uses it)
    _viewed: dict = field(default_factory=dict, compare=False, repr=False)
    _counts: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        self._counts.update(kept_calls=1, compute_inputs_transferred=sum(1 for *_, h in self.inputs if not h),
                            compute_input_bytes_transferred=self.input_bytes, bytes_inline_in=self.input_bytes)

    @classmethod
    def of(cls, request, reply) -> "KeptCall | None":
        """What to keep of a Compute (its request and its reply), or None where it does not qualify: every
        input a tensor inline or in a buffer of the caller's, every output a tensor carried inline or written
        into a buffer of the caller's, and no keep or stream."""
        if request.keep or request.stream:
            return None
        into = _into_layout(request.output_buffers) if request.output_buffers else {}
        if into is None:
            return None
        inputs, outputs = _input_layout(request.inputs), _inline_layout(reply.outputs, into)
        if inputs is None or outputs is None:
            return None
        return cls(request.node_compute_info, request.output_allocator, request.inline_limit, inputs, outputs,
                   sum(n for _, _, n, h in inputs if not h), sum(n for _, _, n in outputs), into,
                   {i: type(ref)(desc=ref.desc, buffer=ref.buffer) for i, ref in request.output_buffers.items()})

    def input_tensors(self, payload, client: ClientState, counts: dict[str, int]) -> list[Tensor]:
        """The inputs, as tensors over a KEPT frame's payload and over the client's buffers (no copy); what
        they are counted in `counts` (resident: made here by an earlier Compute)."""
        if len(payload) != KEPT_ID.size + self.input_bytes:
            raise EpInvalidArgument(f"a kept call takes {self.input_bytes} bytes of inputs, got "
                                    f"{len(payload) - KEPT_ID.size}")
        tensors, offset = [], KEPT_ID.size
        for i, (shape, dtype, nbytes, handle) in enumerate(self.inputs):
            if handle:
                tensor, produced = self._buffered(i, client, handle, shape, dtype, nbytes, "input")
                tensors.append(tensor)
                where = "resident" if produced else "transferred"
                tally(counts, f"compute_inputs_{where}")
                tally(counts, f"compute_input_bytes_{where}", nbytes)
                continue
            array = np.frombuffer(payload, dtype, nbytes // dtype.itemsize, offset)
            tensors.append(Tensor.trusted(shape, dtype, HOST_MEMORY, nbytes, host=array.reshape(shape)))
            offset += nbytes
        return tensors

    def counts(self) -> dict[str, int]:
        """A repeat's counters, as far as they are known before it runs (its inline inputs')."""
        return dict(self._counts)

    def into_tensors(self, client: ClientState) -> dict[int, Tensor]:
        """The client's buffers outputs are written into, by position."""
        return {i: self._buffered(-1 - i, client, handle, shape, dtype, nbytes, "output")[0]
                for i, (shape, dtype, nbytes, handle) in self.into.items()}

    def _buffered(self, key: int, client: ClientState, handle: int, shape, dtype, nbytes: int,
                  what: str) -> tuple[Tensor, bool]:
        """A tensor in the client's buffer `handle` (looked up on every run: a freed one is NOT_FOUND), with
        its array made, and whether the buffer's bytes were made here: the same tensor as last run where the
        handle names the same buffer (an array over shared memory costs tens of microseconds to make on a
        run's cold caches)."""
        entry = client.get("buffer", handle)
        viewed = self._viewed.get(key)
        if viewed is not None and viewed[0] is entry.buffer:
            return viewed[1], entry.produced
        tensor, _ = buffer_tensor(client, handle, shape, dtype, nbytes,
                                  lambda: f"a kept call's {what} ({nbytes} bytes)")
        array = tensor.local_array()
        if array is not None:
            tensor = Tensor.trusted(shape, dtype, tensor.memory_info, nbytes, buffer=entry.buffer, host=array)
            self._viewed[key] = (entry.buffer, tensor)
        return tensor, entry.produced

    def write_into(self, client: ClientState, into: dict[int, Tensor], outputs: list[Any],
                   counts: dict[str, int]) -> None:
        """The outputs that go into the client's buffers, written there (where the EP did not itself)."""
        for i, target in into.items():
            write_into(client, self.into[i][3], target, outputs[i], counts)

    def output_arrays(self, outputs: list[Any]) -> list[np.ndarray] | None:
        """The outputs that go back, as arrays to send as they are, or None where one is not of its kept type
        and shape (the whole reply is sent then)."""
        if len(outputs) != len(self.outputs) + len(self.into):
            return None
        if self.into:
            outputs = [v for i, v in enumerate(outputs) if i not in self.into]
        arrays = []
        for value, (shape, dtype, _) in zip(outputs, self.outputs):
            if not isinstance(value, Tensor) or value.shape != shape or value.dtype != dtype:
                return None
            array = value.local_array()
            if array is None:
                return None
            arrays.append(array)
        return arrays


class KeptCalls:
    """The kept calls of one fast-lane connection (used by that connection's thread only)."""

    def __init__(self):
        self._calls: dict[int, KeptCall] = {}
        self._ids = itertools.count(1)

    def keep(self, request, reply) -> int:
        """Keep a Compute that asked to be kept: its id, or 0 where it does not qualify. Past MAX_KEPT the
        oldest is let go (a KEPT frame naming it is told so, and its caller sends the whole call again)."""
        kept = KeptCall.of(request, reply)
        if kept is None:
            return 0
        if len(self._calls) >= MAX_KEPT:
            del self._calls[next(iter(self._calls))]
        kid = next(self._ids)
        self._calls[kid] = kept
        return kid

    def get(self, payload) -> KeptCall:
        """The kept call a KEPT frame's payload names."""
        if len(payload) < KEPT_ID.size:
            raise EpInvalidArgument(f"a KEPT frame of {len(payload)} bytes, shorter than its {KEPT_ID.size}-byte id")
        (kid,) = KEPT_ID.unpack_from(payload)
        kept = self._calls.get(kid)
        if kept is None:
            raise EpUnknownKeptCall(f"no kept call {kid} on this connection; send the whole Compute")
        return kept

    def __len__(self) -> int:
        return len(self._calls)
