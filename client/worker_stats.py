"""A worker's counters as Environment.get_worker_stats returns them: a typed, immutable value made from the
wire's ephost.v1.WorkerStats (its fields, the same names, documented there)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Iterator, Mapping

from ephost.v1 import worker_pb2


@dataclass(frozen=True)
class MethodStats:
    """One method's calls since the worker started: how many, how many failed, their time in all and at most."""

    calls: int = 0
    errors: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    @property
    def mean_s(self) -> float:
        return self.total_s / self.calls if self.calls else 0.0


class Methods(Mapping[str, MethodStats]):
    """The methods called so far, by name ("Ep/Compute"); one never called reads as no calls (as the wire's map
    reads), though it is not `in` it."""

    def __init__(self, methods: dict[str, MethodStats]):
        self._methods = methods

    def __getitem__(self, name: str) -> MethodStats:
        return self._methods.get(name, _NONE)

    def __iter__(self) -> Iterator[str]:
        return iter(self._methods)

    def __len__(self) -> int:
        return len(self._methods)

    def __contains__(self, name: object) -> bool:
        return name in self._methods

    def get(self, name: str, default=None):
        return self._methods.get(name, default)

    def __repr__(self) -> str:
        return f"Methods({self._methods!r})"


_NONE = MethodStats()


@dataclass(frozen=True)
class WorkerStats:
    """Counters of one worker since it started, over all its clients."""

    methods: Methods = field(default_factory=lambda: Methods({}))  # "Ep/Compute" -> its calls
    clients: int = 0                          # clients connected now
    buffers_live: int = 0                     # buffers its clients hold now
    bytes_copied: int = 0                     # bytes moved by CopyTensors inside the worker
    bytes_inline_in: int = 0                  # tensor bytes received inline
    bytes_inline_out: int = 0                 # tensor bytes sent back inline
    copies: int = 0                           # tensors copied by CopyTensors
    compute_inputs_resident: int = 0          # Compute inputs already in the worker (an earlier Compute's)
    compute_inputs_transferred: int = 0       # Compute inputs brought in (inline, or written by the client)
    compute_input_bytes_resident: int = 0
    compute_input_bytes_transferred: int = 0
    compute_outputs_in_place: int = 0         # outputs the EP wrote straight into shared memory
    compute_outputs_copied: int = 0           # outputs copied into shared memory from the EP's own
    fast_lane_calls: int = 0                  # calls over the same-host data plane rather than gRPC
    fast_lane_connections: int = 0
    kept_calls: int = 0                       # fast-lane Computes that came as repeats of a kept call
    calls_kept: int = 0                       # calls the worker kept for their repeats
    early_wakes: int = 0                      # fast-lane callers woken as the EP finished, before the reply
    partitions_compiled: int = 0              # compiled from their nodes
    partitions_restored: int = 0              # restored from a compiled form (an EPContext node)
    partitions_shared: int = 0                # compiled once for several sessions
    capability_cache_hits: int = 0            # GetCapability answered from the worker's cache
    files_imported: int = 0                   # external data files handed over as descriptors
    file_bytes_imported: int = 0
    blob_chunks_received: int = 0             # the blob cache (external data from clients off this host)
    blob_bytes_received: int = 0
    blob_hits: int = 0

    @classmethod
    def from_proto(cls, message: worker_pb2.WorkerStats) -> "WorkerStats":
        values = {f.name: getattr(message, f.name) for f in fields(cls) if f.name != "methods"}
        methods = {name: MethodStats(m.calls, m.errors, m.total_s, m.max_s) for name, m in message.methods.items()}
        return cls(methods=Methods(methods), **values)

    def counters(self) -> dict[str, int]:
        """Every counter but the methods', by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "methods"}
