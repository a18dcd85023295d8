"""What a session does when an EP fails: ep_failure_policy "raise", "retry" or "fallback", applied to set-up
calls (CreateEp, GetCapability, Compile) and to each partition's Compute, with a log of what happened."""
from __future__ import annotations

import logging
from collections import Counter, deque
from typing import Any, Callable

from ephost.errors import (EpDeadlineExceeded, EpError, EpInternal, EpInvalidArgument, EpWorkerCrashed,
                           EpWorkerDraining, EpWorkerReplaced, EpWorkerUnavailable)
from ephost.eps.base import ComputeCall
from ephost.client import metrics
from ephost.client.planner import Partition

log = logging.getLogger(__name__)

POLICIES = ("raise", "retry", "fallback")
# What the policy handles: a worker that died, hung or is gone, and an EP that failed inside (a vendor bug).
# Errors about the request itself (bad input) would fail anywhere and are raised as they are.
WORKER_FAILURES = (EpWorkerUnavailable, EpDeadlineExceeded, EpInternal)
_EVENTS = {EpDeadlineExceeded: "timed out", EpInternal: "failed", EpWorkerUnavailable: "unavailable"}
# Failures the worker's supervision has logged already (its death, its end past a deadline, its loss), and what
# the policy did about a failure (logged as a warning once, as it happened): noted at INFO, so that one failure
# is one warning.
_LOGGED = frozenset({"crashed", "timed out", "unavailable", "retried", "made again", "fell back",
                     "moved to the fallback"})
# A call the worker did not run (it refused it as it drained, or no longer knew this client): made again on the
# worker that replaces it, whatever the policy.
NOT_RUN = (EpWorkerDraining, EpWorkerReplaced)


class FellBack(Exception):
    """An EP failed during set-up and the policy is to leave its nodes to the fallback."""


class FailurePolicy:
    """Guarded calls and recovery for one session. `links(registration)` gives a registration's WorkerLink (None
    for an EP in this process); `fallback` is the session's CPU fallback (a CpuFallback: ORT's CPU EP in process,
    then the reference evaluator; empty when SessionOptions.fallback is None)."""

    def __init__(self, policy: str, links: Callable[[str], Any], fallback):
        if policy not in POLICIES:
            raise EpInvalidArgument(f"ep_failure_policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._links = links
        self._fallback = fallback
        self.run_log: deque[dict] = deque(maxlen=1000)
        self.counters = Counter()

    def note(self, event: str, registration: str, what: str, error: BaseException | None = None, run: int = 0,
             level: int | None = None):
        self.counters[event] += 1
        metrics.note(registration, event)
        entry = {"run": run, "event": event, "registration": registration, "what": what,
                 "error": f"{type(error).__name__}: {error}" if error is not None else ""}
        self.run_log.append(entry)
        if level is None:
            level = logging.INFO if event in _LOGGED else logging.WARNING
        log.log(level, "%s: %s %s%s", registration, what, event, f" ({entry['error']})" if error else "")

    def guarded(self, registration: str, what: str, call: Callable[[], Any], falls_back: bool = True):
        """A set-up call to an EP under the policy; raises FellBack where its nodes go to the fallback. A call
        whose work no fallback can do (not `falls_back`: a copy out of a worker's own memory) is raised under
        "fallback" as under "raise"."""
        try:
            try:
                return call()
            except NOT_RUN as error:
                if not self._replaced(registration):
                    raise
                self.note("made again", registration, what, error)
                return call()  # on the successor; what it meets there, the policy answers
        except WORKER_FAILURES as error:
            self.note("crashed" if isinstance(error, EpWorkerCrashed) else "failed", registration, what, error)
            if self.policy == "raise" or (self.policy == "fallback" and not (self._fallback and falls_back)):
                raise
            if self.policy == "retry":
                link = self._links(registration)
                if link is not None:
                    link.wait_recovered()
                self.note("retried", registration, what)
                return call()
            self.note("fell back", registration, what)
            raise FellBack() from error

    def recover(self, run: int, p: Partition, partitions: list[Partition], call: ComputeCall,
                error: EpError) -> list:
        """The outputs of partition `p` after its Compute (`call`) failed with `error`, as the policy decides."""
        if isinstance(error, NOT_RUN) and self._replaced(p.registration):
            self.note("made again", p.registration, p.graph.name, error, run)
            try:
                return p.compute_info.compute(call)
            except EpError as again:  # what it met on the successor, the policy answers
                error = again
        if not isinstance(error, WORKER_FAILURES) or self._fallback.owns(p.placement):
            raise error
        self.note(_EVENTS.get(type(error), "crashed"), p.registration, p.graph.name, error, run)
        if self.policy == "raise":
            raise error
        link = self._links(p.registration)
        if link is not None:
            link.wait_noticed(1.0)
            if self.policy == "retry":
                link.wait_recovered()
        failed = link is not None and link.failed
        if self.policy == "retry" and not failed:
            self.note("retried", p.registration, p.graph.name, run=run)
            return p.compute_info.compute(call)
        if self.policy != "fallback" or not self._fallback:
            raise error
        if failed:  # from now on its partitions run on the fallback
            self.note("moved to the fallback", p.registration, "all its partitions", run=run)
            for q in [q for q in partitions if q.registration == p.registration]:
                self.to_fallback(q)
            return p.compute_info.compute(_on_the_host(call))
        self.note("fell back", p.registration, p.graph.name, run=run)
        return self._fallback_info(p)[1].compute(_on_the_host(call))

    def _replaced(self, registration: str) -> bool:
        """Whether a call the worker did not run (NOT_RUN) is made again on its successor, whatever the policy:
        not a failure of the EP, but its worker replaced (WorkerLink.wait_replaced)."""
        link = self._links(registration)
        return link is not None and link.wait_replaced()

    def _fallback_info(self, p: Partition):
        """(placement, compute info) of `p` on the fallback: ORT's CPU EP where it can run it."""
        if p.fallback_info is None:
            p.fallback_info = self._fallback.compile(p.graph)
        return p.fallback_info

    def to_fallback(self, p: Partition) -> None:
        """Run partition `p` on the CPU fallback from now on."""
        p.placement, p.compute_info = self._fallback_info(p)
        p.allocator, p.keep = None, ()


def _on_the_host(call: ComputeCall) -> ComputeCall:
    """The call as the CPU fallback runs it: its outputs in host memory, made for this process."""
    return ComputeCall(call.inputs, run_options=call.run_options, timeout=call.timeout)
