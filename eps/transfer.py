"""Data transfer for EPs whose memory this process can address (CPU-backed EPs): CanCopy and a batched
CopyTensors that copies bytes now, or in order on a QueueStream."""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from ephost.errors import EpInvalidArgument
from ephost.tensor import Tensor, check_copy_pairs
from ephost.types import HOST_MEMORY, MemoryInfo
from ephost.eps.streams import QueueStream


class HostDataTransfer:
    def __init__(self, memory_infos: Iterable[MemoryInfo]):
        self._memory = frozenset(memory_infos) | {HOST_MEMORY}

    def can_copy(self, src: MemoryInfo, dst: MemoryInfo) -> bool:
        return src in self._memory and dst in self._memory

    def copy_tensors(self, src: Sequence[Tensor], dst: Sequence[Tensor], stream: QueueStream | None = None) -> int:
        """Copy src[i] into dst[i]; returns the bytes copied (or queued)."""
        check_copy_pairs(src, dst)
        pairs = [(_bytes(s, "source", i), _bytes(d, "destination", i)) for i, (s, d) in enumerate(zip(src, dst))]

        def run() -> None:
            for s, d in pairs:
                np.copyto(d, s)

        if stream is None:
            run()
        else:
            stream.enqueue(run)
        return sum(s.nbytes for s, _ in pairs)


def _bytes(tensor: Tensor, role: str, i: int) -> np.ndarray:
    view = tensor.local_bytes()
    if view is None:
        raise EpInvalidArgument(f"copy {i}: the {role} is in {tensor.memory_info.name} memory, "
                                "which this data transfer cannot reach")
    return view
