"""A session's steady run: a run made again as the last one went, without the general path's walk.

Where a session is one partition in a worker on this host (the whole model on one EP), its Compute a kept call on
the calling thread's fast lane, and a run is fed numpy arrays of the types and shapes the last run had and asks
for the same outputs, nothing the general path works out (the feeds checked against the model's types, the
runner's walk of the plan, the partition's call key and staging, the connection's lookups) changes from run to
run but the arrays. That path's Python, on the caches a small CNN's run leaves cold, cost about as much as the
rest of the lane (squeezenet, 2026-11-26: a session's run 160-232 µs over ORT in process, the bare kept call
130-152). A SteadyRun keeps what the general path found, for one thread (a lane connection is its thread's), and
repeats it while the session's plan, the partition's compute and the call's connection, kept call and staging
buffers stay those it was made with; any other run takes the general path. A failed call goes to the failure
policy as the general path's does (the session's part).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ephost.tensor import Tensor
from ephost.types import HOST_MEMORY, is_plain_dtype
from ephost.client.planner import Partition


def signature(input_feed: Mapping[str, Any]) -> tuple | None:
    """What a steady run is made for: each feed's name, type and shape, where every feed is a C-contiguous
    numpy array of a plain type; else None."""
    out = []
    for name, value in input_feed.items():
        if type(value) is not np.ndarray or not value.flags.c_contiguous or not is_plain_dtype(value.dtype):
            return None
        out.append((name, value.dtype, value.shape))
    return tuple(out)


class SteadyRun:
    """One thread's steady run of a session (see above): what a run must be to be one (`arrays`), and the
    partition's call made again (`compute`)."""

    __slots__ = ("partitions", "partition", "compute", "picks", "_info", "_feeds", "_asked")

    def __init__(self, partitions: list[Partition], compute, feeds: Sequence[tuple[str, np.dtype, tuple]],
                 asked: Sequence[str] | None, picks: list[int]):
        self.partitions = partitions  # the session's plan it was made in (a new plan is a new list)
        self.partition = partitions[0]
        # The partition's outputs from the feeds (in its input order) and the call's timeout: a list, or None where
        # the call no longer repeats (RemoteComputeInfo.steady's SteadyCompute)
        self.compute = compute
        self.picks = picks  # the positions among them of the outputs the run asks for, in its order
        self._info = self.partition.compute_info
        self._feeds = feeds  # in the partition's input order
        self._asked = asked  # the output names the run asked for, as given

    @classmethod
    def of(cls, partitions: list[Partition], output_names: Sequence[str] | None, names: Sequence[str],
           input_feed: Mapping[str, Any], feeds: tuple) -> "SteadyRun | None":
        """The steady run of a run that just went the general path (`names`: the outputs it gave, `feeds`: its
        signature), where there is one."""
        if len(partitions) != 1:
            return None
        p = partitions[0]
        steady = getattr(p.compute_info, "steady", None)
        if steady is None or p.keep or set(input_feed) != set(p.graph.inputs) \
                or not set(names) <= set(p.graph.outputs):
            return None
        by_name = {name: (name, dtype, shape) for name, dtype, shape in feeds}
        compute = steady(cls.tensors([input_feed[v] for v in p.graph.inputs]), p.allocator)
        if compute is None:
            return None
        return cls(partitions, compute, [by_name[v] for v in p.graph.inputs],
                   None if output_names is None else list(output_names), [p.graph.outputs.index(n) for n in names])

    def arrays(self, partitions: list[Partition], output_names: Sequence[str] | None,
               input_feed: Mapping[str, Any]) -> list[np.ndarray] | None:
        """The feeds in the partition's input order, where this run is one this steady run makes; else None."""
        if partitions is not self.partitions or self.partition.compute_info is not self._info \
                or len(input_feed) != len(self._feeds):
            return None
        if output_names is None:
            if self._asked is not None:
                return None
        elif self._asked is None or list(output_names) != self._asked:
            return None
        arrays = []
        for name, dtype, shape in self._feeds:
            value = input_feed.get(name)
            if type(value) is not np.ndarray or value.dtype != dtype or value.shape != shape \
                    or not value.flags.c_contiguous:
                return None
            arrays.append(value)
        return arrays

    @staticmethod
    def tensors(arrays: list[np.ndarray]) -> list[Tensor]:
        """The feeds as the general path hands them to a partition (for the failure policy)."""
        return [Tensor.trusted(a.shape, a.dtype, HOST_MEMORY, a.nbytes, host=a) for a in arrays]
