"""What crossed the bridge for one ORT registration name."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class BridgeStats:
    """Compute calls (one that failed too), every byte this process copied for them (ORT's input tensors into the
    worker's memory or the call, the worker's outputs into ORT's output tensors; of a tensor kept in the worker,
    the chunks that changed; of strings, their UTF-8 bytes), and the tensors that crossed without a copy (in the
    worker's shared memory, ORT's tensors on the bridged device)."""

    computes: int = 0
    bytes_in_copied: int = 0
    bytes_out_copied: int = 0
    inputs_in_place: int = 0
    outputs_in_place: int = 0
    # guards the counters
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, crossed: list[int]) -> None:
        """One Compute's: [bytes in, bytes out, inputs in place, outputs in place]."""
        with self._lock:
            self.computes += 1
            self.bytes_in_copied += crossed[0]
            self.bytes_out_copied += crossed[1]
            self.inputs_in_place += crossed[2]
            self.outputs_in_place += crossed[3]

    def snapshot(self) -> "BridgeStats":
        with self._lock:
            return BridgeStats(self.computes, self.bytes_in_copied, self.bytes_out_copied,
                               self.inputs_in_place, self.outputs_in_place)
