"""Counters a worker reports through Worker.GetStats, and exports as Prometheus metrics (server/metrics.py) when
scraped: counted as calls end, read at scrape time."""
from __future__ import annotations

import threading
import time
import weakref
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass

from ephost import histogram
from ephost.histogram import BUCKETS
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


@dataclass(frozen=True)
class StatsSnapshot:
    counters: dict[str, int]
    methods: dict[str, list]                 # as WorkerStats keeps them
    failed: dict[tuple[str, str], int]       # (method, status) -> calls
    lane_bytes: tuple[int, int]              # inline tensor bytes in, out, on the fast lane


class WorkerStats:
    def __init__(self):
        self._lock = threading.Lock()  # guards counters, _methods and _answering
        self._local = threading.local()
        self._answering: "weakref.WeakSet[_Answered]" = weakref.WeakSet()  # a thread's goes when the thread ends
        # method -> [calls, errors, total s, max s, then the latency histogram's counts (ephost.histogram)]
        self._methods: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0] + [0] * histogram.SLOTS)
        self._failed: dict[tuple[str, str], int] = defaultdict(int)  # (method, status) -> calls that failed so
        self._lane_bytes = [0, 0]  # tensor bytes inline in and out on the fast lane (the rest went over gRPC)
        self.counters = dict.fromkeys(("bytes_copied", "bytes_inline_in", "bytes_inline_out", "copies",
                                       "compute_inputs_resident", "compute_inputs_transferred",
                                       "compute_outputs_in_place", "compute_outputs_copied",
                                       "fast_lane_calls", "fast_lane_connections",
                                       "partitions_compiled", "partitions_restored", "partitions_shared",
                                       "compute_input_bytes_resident", "compute_input_bytes_transferred",
                                       "files_imported", "file_bytes_imported", "blob_chunks_received",
                                       "blob_bytes_received", "blob_hits", "capability_cache_hits", "kept_calls",
                                       "early_wakes", "calls_kept"), 0)

    def record_call(self, method: str, seconds: float, failed: str = "", lane: bool = False,
                    counts: dict[str, int] | None = None) -> None:
        """One call of `method` (`lane`: on the fast lane) that took `seconds` and failed with status `failed`
        ("": it did not), and the counters it added to (`counts`), under one lock."""
        bucket = bisect_left(BUCKETS, seconds) + 4  # (the histogram's counts follow the four figures)
        with self._lock:
            counters = self.counters
            if counts:
                for key, value in counts.items():
                    counters[key] += value
            if lane:
                counters["fast_lane_calls"] += 1
                if counts:
                    lane_bytes = self._lane_bytes
                    lane_bytes[0] += counts.get("bytes_inline_in", 0)
                    lane_bytes[1] += counts.get("bytes_inline_out", 0)
            m = self._methods[method]
            m[0] += 1
            m[2] += seconds
            if seconds > m[3]:
                m[3] = seconds
            m[bucket] += 1
            if failed:
                m[1] += 1
                self._failed[(method, failed)] += 1

    def refused(self, method: str, status: str) -> None:
        """A call of `method` turned away before it ran (the worker drains, a bound is reached, an unknown
        client): counted by status only, not as a call."""
        with self._lock:
            self._failed[(method, status)] += 1

    def answering(self) -> _Answered:
        """The calling thread's tally of calls it answers before it counts them (the fast lane's: a count made
        first would delay every reply): raise `answered` before the reply goes, `counted` once recorded. A
        GetStats waits on the tallies (settle), and so does a drain, for the replies on their way."""
        mine = getattr(self._local, "answered", None)
        if mine is None:
            mine = self._local.answered = _Answered()
            with self._lock:
                self._answering.add(mine)
        return mine

    def settle(self, timeout: float = SETTLE_S) -> bool:
        """Wait until every call answered before now is counted, so that what a caller has an answer to is in
        the figures it asks for next; False where some are not after `timeout`."""
        with self._lock:
            marks = [(tally, tally.answered) for tally in self._answering]
        deadline = time.monotonic() + timeout
        for tally, answered in marks:
            while tally.counted < answered:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(50e-6)
        return True

    def add(self, amounts: dict[str, int] | None = None, /, **more: int) -> None:
        """Add to the counters: `amounts` (a call's counters, gathered as it ran) and `more`, under one lock."""
        with self._lock:
            counters = self.counters
            for key, value in (amounts or more).items():
                counters[key] += value
            if amounts and more:
                for key, value in more.items():
                    counters[key] += value

    def snapshot(self) -> "StatsSnapshot":
        """The figures as they are now, for an exporter (server/metrics.py)."""
        with self._lock:
            return StatsSnapshot(dict(self.counters), {k: list(v) for k, v in self._methods.items()},
                                 dict(self._failed), tuple(self._lane_bytes))

    def to_proto(self, **extra: int) -> worker_pb2.WorkerStats:
        with self._lock:
            methods = {name: worker_pb2.MethodStats(calls=int(m[0]), errors=int(m[1]), total_s=m[2], max_s=m[3])
                       for name, m in self._methods.items()}
            return worker_pb2.WorkerStats(methods=methods, **self.counters, **extra)
