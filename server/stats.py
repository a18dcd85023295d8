"""Counters a worker reports through Worker.GetStats."""
from __future__ import annotations

import threading
import time
import weakref
from collections import defaultdict

from ephost.v1 import worker_pb2


# How long a GetStats waits for calls answered before it to be counted (each is counted right after its reply is
# sent; this bounds a wait on a thread the scheduler keeps off its CPU).
SETTLE_S = 1.0


class _Answered:
    """One thread's calls answered before they were counted, and of those, counted: written by that thread
    only, read by whoever settles."""

    __slots__ = ("answered", "counted", "__weakref__")

    def __init__(self):
        self.answered = self.counted = 0


class WorkerStats:
    def __init__(self):
        self._lock = threading.Lock()
        self._local = threading.local()
        self._answering: "weakref.WeakSet[_Answered]" = weakref.WeakSet()  # a thread's goes when the thread ends
        self._methods: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0])
        self.counters = dict.fromkeys(("bytes_copied", "bytes_inline_in", "bytes_inline_out", "copies",
                                       "compute_inputs_resident", "compute_inputs_transferred",
                                       "compute_outputs_in_place", "compute_outputs_copied",
                                       "fast_lane_calls", "fast_lane_connections",
                                       "partitions_compiled", "partitions_restored", "partitions_shared",
                                       "compute_input_bytes_resident", "compute_input_bytes_transferred",
                                       "files_imported", "file_bytes_imported", "blob_chunks_received",
                                       "blob_bytes_received", "blob_hits", "capability_cache_hits", "kept_calls",
                                       "early_wakes", "calls_kept"), 0)

    def record_call(self, method: str, seconds: float, ok: bool, lane: bool = False,
                    counts: dict[str, int] | None = None) -> None:
        """One call of `method` (`lane`: on the fast lane) that took `seconds`, and the counters it added to
        (`counts`), under one lock."""
        with self._lock:
            counters = self.counters
            if lane:
                counters["fast_lane_calls"] += 1
            if counts:
                for key, value in counts.items():
                    counters[key] += value
            m = self._methods[method]
            m[0] += 1
            m[1] += 0 if ok else 1
            m[2] += seconds
            m[3] = max(m[3], seconds)

    def answering(self) -> _Answered:
        """The calling thread's tally of calls it answers before it counts them (the fast lane's: a count made
        first would delay every reply): raise `answered` before the reply goes, `counted` once recorded."""
        mine = getattr(self._local, "answered", None)
        if mine is None:
            mine = self._local.answered = _Answered()
            with self._lock:
                self._answering.add(mine)
        return mine

    def settle(self, timeout: float = SETTLE_S) -> None:
        """Wait until every call answered before now is counted, so that what a caller has an answer to is in
        the figures it asks for next."""
        with self._lock:
            marks = [(tally, tally.answered) for tally in self._answering]
        deadline = time.monotonic() + timeout
        for tally, answered in marks:
            while tally.counted < answered and time.monotonic() < deadline:
                time.sleep(50e-6)

    def add(self, amounts: dict[str, int] | None = None, /, **more: int) -> None:
        """Add to the counters: `amounts` (a call's counters, gathered as it ran) and `more`, under one lock."""
        with self._lock:
            counters = self.counters
            for key, value in (amounts or more).items():
                counters[key] += value
            if amounts and more:
                for key, value in more.items():
                    counters[key] += value

    def to_proto(self, **extra: int) -> worker_pb2.WorkerStats:
        with self._lock:
            methods = {name: worker_pb2.MethodStats(calls=int(c), errors=int(e), total_s=t, max_s=mx)
                       for name, (c, e, t, mx) in self._methods.items()}
            return worker_pb2.WorkerStats(methods=methods, **self.counters, **extra)
