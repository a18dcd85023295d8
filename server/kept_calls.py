"""Kept calls: Computes that one fast-lane connection repeats with nothing but the inputs' bytes (the frames are
described in ephost/fastlane.py).

What a kept call keeps is what its first request and reply said and the worker checked then: the handles of
the partition and of the output allocator, the types, shapes and sizes of the inputs and outputs, and for
inputs the client staged in one of its buffers (large ones), that buffer's handle: the client writes each
run's bytes there again and the frame carries only the small inputs' bytes. Each repeat looks every handle up
again (a released partition or buffer is NOT_FOUND, as on any Compute; a buffer too small for its input is
INVALID_ARGUMENT) and checks the payload's length against the kept sizes before any byte is read; nothing else
a peer sends is trusted.
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
from ephost.server.tensors import buffer_tensor


Layout = tuple[tuple[tuple[int, ...], np.dtype, int], ...]  # (shape, dtype, nbytes) of each tensor
# (shape, dtype, nbytes, buffer handle) of each input; handle 0: its bytes come in the frame
Inputs = tuple[tuple[tuple[int, ...], np.dtype, int, int], ...]


def _inline_layout(values) -> Layout | None:
    """The layout of Values that are all tensors carried inline, else None."""
    layout = []
    for value in values:
        if value.WhichOneof("kind") != "tensor" or value.tensor.WhichOneof("location") != "inline":
            return None
        layout.append(checked_desc(value.tensor.desc))
    return tuple(layout)


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
    outputs: Layout
    input_bytes: int      # the payload after its id: the bytes of every input that comes in the frame
    staged_bytes: int     # the bytes of the inputs in the caller's buffers
    output_bytes: int     # a reply's payload: every output's bytes
    # input index -> (buffer, tensor over it) of the last run: the tensor and its array are made again only
    # when the handle names another buffer (the connection's one thread uses it)
    _viewed: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, request, reply) -> "KeptCall | None":
        """What to keep of a Compute (its request and its reply), or None where it does not qualify: every
        input a tensor inline or in a buffer of the caller's, every output a tensor carried inline, and no keep,
        output buffers or stream."""
        if request.keep or request.output_buffers or request.stream:
            return None
        inputs, outputs = _input_layout(request.inputs), _inline_layout(reply.outputs)
        if inputs is None or outputs is None:
            return None
        return cls(request.node_compute_info, request.output_allocator, request.inline_limit, inputs, outputs,
                   sum(n for _, _, n, h in inputs if not h), sum(n for _, _, n, h in inputs if h),
                   sum(n for _, _, n in outputs))

    def input_tensors(self, payload, client: ClientState) -> list[Tensor]:
        """The inputs, as tensors over a KEPT frame's payload and over the client's buffers (no copy)."""
        if len(payload) != KEPT_ID.size + self.input_bytes:
            raise EpInvalidArgument(f"a kept call takes {self.input_bytes} bytes of inputs, got "
                                    f"{len(payload) - KEPT_ID.size}")
        tensors, offset = [], KEPT_ID.size
        for i, (shape, dtype, nbytes, handle) in enumerate(self.inputs):
            if handle:
                tensors.append(self._buffered(i, client, handle, shape, dtype, nbytes))
                continue
            array = np.frombuffer(payload, dtype, nbytes // dtype.itemsize, offset)
            tensors.append(Tensor.trusted(shape, dtype, HOST_MEMORY, nbytes, host=array.reshape(shape)))
            offset += nbytes
        return tensors

    def _buffered(self, i: int, client: ClientState, handle: int, shape, dtype, nbytes: int) -> Tensor:
        """Input i, in the client's buffer `handle` (looked up on every run: a freed one is NOT_FOUND), as a
        tensor with its array made: the same one as last run where the handle names the same buffer (an array
        over shared memory costs tens of microseconds to make on a run's cold caches)."""
        buffer = client.get("buffer", handle).buffer
        viewed = self._viewed.get(i)
        if viewed is not None and viewed[0] is buffer:
            return viewed[1]
        tensor, _ = buffer_tensor(client, handle, shape, dtype, nbytes,
                                  lambda: f"a kept call's input ({nbytes} bytes)")
        array = tensor.local_array()
        if array is not None:
            tensor = Tensor.trusted(shape, dtype, tensor.memory_info, nbytes, buffer=buffer, host=array)
            self._viewed[i] = (buffer, tensor)
        return tensor

    def output_arrays(self, outputs: list[Any]) -> list[np.ndarray] | None:
        """The outputs as arrays to send as they are, or None where one is not of its kept type and shape (the
        whole reply is sent then)."""
        if len(outputs) != len(self.outputs):
            return None
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
