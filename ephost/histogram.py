"""The latency histogram both sides export (a worker's calls, an application's runs): its bucket bounds, and the
cumulative buckets Prometheus takes from the counts kept per bucket."""
from __future__ import annotations

import bisect

# Upper bounds in seconds: from a fast-lane call of a tiny model to a long compile.
BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 0.5, 1.0,
           2.5, 5.0, 10.0, 30.0, 60.0)
SLOTS = len(BUCKETS) + 1  # counts kept: one per bound, and one past the last


def slot(seconds: float) -> int:
    """The index of the count a duration goes to."""
    return bisect.bisect_left(BUCKETS, seconds)


def cumulative(counts) -> list[tuple[str, float]]:
    """Prometheus' buckets ("le" bound, count at or under it) from the counts per slot."""
    out, running = [], 0
    for bound, count in zip((*BUCKETS, float("inf")), counts):
        running += count
        out.append(("+Inf" if bound == float("inf") else repr(bound), running))
    return out
