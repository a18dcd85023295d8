"""Keeping a worker alive for the client. WorkerLink is the current connection to one worker across its
restarts; each new connection starts a new generation, on which the client's objects re-create their handles
(EPs, allocators, streams, compiled partitions) from what they recorded. Supervision of a worker this process
launched is ProcessSupervisor's: its death is noticed at once, reported as EpWorkerCrashed, and it is restarted
with backoff until its CrashBudget is spent, when the EP is marked failed; a worker past its memory limit is
replaced between calls. A worker connected to by address is watched by a HealthWatcher.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from ephost.errors import (EpDeadlineExceeded, EpError, EpInvalidArgument, EpUnknownClient, EpWorkerCrashed,
                           EpWorkerFailed, EpWorkerUnavailable)
from ephost.client.connection import Credentials, WorkerConnection
from ephost.client.crash_budget import CrashBudget
from ephost.client.health import HealthWatcher
from ephost.client.launcher import WorkerProcess, describe_exit
from ephost.fastlane import MAX_KEPT
from ephost.wire import MAX_SPIN_S, SPIN_S

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class SupervisionPolicy:
    """How a launched worker is kept alive. Registration options of the same names set it."""

    restart: bool = True
    crash_limit: int = 3          # crashes within crash_window_s that mark the EP failed
    crash_window_s: float = 300.0
    backoff_s: float = 0.05       # first restart delay, doubled per crash in the window, at most max_backoff_s
    max_backoff_s: float = 2.0
    memory_limit_mb: int = 0      # restart the worker between calls when its resident memory exceeds this
    timeout_s: float = 60.0       # deadline of each call
    connect_timeout_s: float = 10.0
    shared_memory: bool = True    # use shared memory where the worker proves it shares this host
    fast_lane: bool = True        # Compute and CopyTensors over the data-plane socket where memory is shared
    fast_lane_spin_us: float = SPIN_S * 1e6  # each end polls this long for the next frame before it sleeps
    kept_calls: bool = True       # Computes and copies repeated on the fast lane as kept calls (what changes only)
    fast_lane_slots: bool = True  # the lane's frames through shared slots, the socket waking a sleeping end
    kept_calls_max: int = MAX_KEPT  # kept calls one thread's connection keeps (client/fastlane.py, _room)

    OPTIONS = {
        "restart": "restart a launched worker that dies (default true)",
        "crash_limit": "crashes within crash_window_s after which the EP is marked failed (default 3)",
        "crash_window_s": "the crash-limit window in seconds (default 300)",
        "memory_limit_mb": "restart a launched worker between calls when it holds more memory (default: none)",
        "timeout_s": "deadline of each call to the worker, in seconds (default 60)",
        "connect_timeout_s": "how long to wait for the worker to answer at all (default 10)",
        "shared_memory": "share memory with a worker on this host when it proves it can (default true)",
        "fast_lane": "carry Compute and CopyTensors over a unix socket where memory is shared (default true)",
        "fast_lane_spin_us": "how long each end of the fast lane polls for the next frame before it sleeps, while "
                             f"frames come that fast (default {SPIN_S * 1e6:g}; 0: never)",
        "kept_calls": "repeat a Compute, or a CopyTensors between buffers of the worker's, as a kept call on the "
                      "fast lane: only the inputs' bytes and the buffers' handles go, only the outputs' bytes "
                      "come back (default true)",
        "kept_calls_max": f"kept calls each thread's fast-lane connection keeps, 1 to {MAX_KEPT} (the default; "
                          "past it a new call takes the place of one unused during the last twice as many new "
                          "calls, else goes whole)",
        "fast_lane_slots": "pass the fast lane's frames (those that fit one packet) through shared memory between "
                           "its two ends, the socket only waking an end asleep in the kernel (default true)",
    }

    @classmethod
    def take(cls, options: dict[str, str]) -> "SupervisionPolicy":
        """The policy from (and without) its keys in a registration's options."""
        mine = {k: options.pop(k) for k in list(options) if k in cls.OPTIONS}
        values = {}
        for k, v in mine.items():
            kind = type(getattr(cls, k))
            try:
                values[k] = v.lower() not in ("0", "false", "no") if kind is bool else kind(v)
            except ValueError:
                what = "an integer" if kind is int else "a number"
                raise EpInvalidArgument(f"bad supervision option: {k} takes {what}, got {v!r}") from None
        return cls(**values)

    def __post_init__(self):
        if not 0 <= self.fast_lane_spin_us <= MAX_SPIN_S * 1e6:  # nan fails too
            raise EpInvalidArgument(f"bad supervision option: fast_lane_spin_us must be between 0 and "
                                    f"{MAX_SPIN_S * 1e6:g}, got {self.fast_lane_spin_us:g}")
        if not 1 <= self.kept_calls_max <= MAX_KEPT:
            raise EpInvalidArgument(f"bad supervision option: kept_calls_max must be between 1 and {MAX_KEPT} (a "
                                    f"worker keeps no more for a connection), got {self.kept_calls_max}")

    def crash_budget(self) -> CrashBudget:
        return CrashBudget(self.crash_limit, self.crash_window_s, self.backoff_s, self.max_backoff_s)


class ProcessSupervisor:
    """A worker this process launched: started, watched, restarted under its crash budget, killed past a
    deadline, replaced past its memory limit. The link it serves gets each new worker's address."""

    def __init__(self, link: "WorkerLink", ep: str, ep_options: Mapping[str, str], policy: SupervisionPolicy):
        self._link, self.ep, self._options, self._policy = link, ep, dict(ep_options), policy
        self._budget = policy.crash_budget()
        self.process: WorkerProcess | None = None

    def launch(self) -> str:
        """Start a worker; its address."""
        self.process = WorkerProcess(self.ep, self._options, on_exit=self._on_exit,
                                     worker_args=("--lane-spin-us", f"{self._policy.fast_lane_spin_us:g}"))
        return self.process.address

    @property
    def dead(self) -> bool:
        return self.process is not None and self.process.proc.returncode is not None  # (set by its watcher)

    def _on_exit(self, process: WorkerProcess) -> None:
        try:
            if self._link.closing or process is not self.process or process.stopping:
                return
            code = process.proc.returncode
            delay = self._delay(f"its worker died with {describe_exit(code)}", code)
            if delay is None:
                return
            log.warning("worker for %r (EP %s) died with %s; restarting in %.2f s", self._link.name, self.ep,
                        describe_exit(code), delay)
            self._link.begin_restart()
            threading.Thread(target=self._restart, args=(delay,), name=f"ephost-restart-{self._link.name}",
                             daemon=True).start()
        finally:
            self._link.notify()

    def _delay(self, what: str, code: int | None = None) -> float | None:
        """A crash counted against the budget: the delay before the next start, or None where the EP is marked
        failed (the budget is spent, or restarting is off)."""
        delay = self._budget.record(time.monotonic())
        if delay is not None and self._policy.restart:
            return delay
        why = ("restarting is off" if not self._policy.restart else
               f"it crashed {self._budget.recent} times within {self._policy.crash_window_s:g} s")
        log.error("EP %r (%s): %s; %s: the EP is marked failed", self._link.name, self.ep, what, why)
        self._link.mark_failed(EpWorkerFailed(f"EP {self._link.name!r} ({self.ep}) has failed: {what} and {why}",
                                              ep=self.ep, returncode=code))
        return None

    def _restart(self, delay: float) -> None:
        """Start the next worker after `delay`. One that dies as it starts is a crash like any other (a vendor
        library crashing now and then as it loads): counted against the budget and started again; one that
        refuses to start (options, a library it cannot load) or does not answer marks the EP failed."""
        try:
            while True:
                time.sleep(delay)
                if self._link.closing:
                    return
                try:
                    self._link.reopen()
                    log.info("worker for %r is back (generation %d)", self._link.name, self._link.generation)
                    return
                except EpWorkerCrashed as e:
                    delay = self._delay(f"its new worker died as it started ({e})", e.returncode)
                    if delay is None:
                        return
                    log.warning("the new worker for %r died as it started (%s); starting another in %.2f s",
                                self._link.name, e, delay)
        except EpError as e:
            log.error("restarting the worker for %r failed: %s", self._link.name, e)
            self._link.mark_failed(EpWorkerFailed(f"EP {self._link.name!r} could not be restarted: {e}", ep=self.ep))
        finally:
            self._link.end_restart()

    def kill(self, why: str) -> None:
        """End the worker now (a call past its deadline); it is restarted like any crashed worker."""
        process = self.process
        if process is not None and process.returncode is None:
            log.warning("killing the worker for %r: %s", self._link.name, why)
            process.kill()
            process.exited.wait(5)  # so that the next call waits for its replacement, not for a corpse

    def over_memory_limit(self) -> bool:
        limit = self._policy.memory_limit_mb
        if not limit or self.process is None:
            return False
        rss = self.process.resident_bytes()
        if rss > limit << 20:
            log.warning("worker for %r holds %d MiB, over its limit of %d MiB; replacing it", self._link.name,
                        rss >> 20, limit)
            return True
        return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


class WorkerLink:
    """The connection to one worker, launched (`ep` set) or connected to (`address` set), and its generation."""

    def __init__(self, name: str, *, ep: str | None = None, ep_options: Mapping[str, str] | None = None,
                 address: str | None = None, policy: SupervisionPolicy = SupervisionPolicy(),
                 credentials: Credentials = Credentials()):
        self.name = name
        self.ep = ep
        self.address = address
        self.policy = policy
        self.credentials = credentials
        self.generation = 0
        self.closing = False
        self._conn: WorkerConnection | None = None
        self._failed: EpError | None = None
        self._restarting = False
        self._cond = threading.Condition()
        self._open_lock = threading.Lock()  # one new connection at a time
        self.supervisor = ProcessSupervisor(self, ep, ep_options or {}, policy) if ep is not None else None
        with self._open_lock:
            self._open()
        self._health = HealthWatcher(self) if self.supervisor is None else None

    # --- the current connection -------------------------------------------------------------------

    def _open(self) -> None:
        """Connect to the worker (launching one first where this link launches its workers): a new generation.
        Called with `_open_lock` held."""
        address = self.supervisor.launch() if self.supervisor is not None else self.address
        try:
            conn = WorkerConnection(address, name=self.name, timeout_s=self.policy.timeout_s,
                                    connect_timeout_s=self.policy.connect_timeout_s, process=self.process,
                                    credentials=self.credentials, shared_memory=self.policy.shared_memory,
                                    fast_lane=self.policy.fast_lane,
                                    fast_lane_spin_s=self.policy.fast_lane_spin_us * 1e-6,
                                    kept_calls=self.policy.kept_calls, kept_calls_max=self.policy.kept_calls_max,
                                    fast_lane_slots=self.policy.fast_lane_slots)
        except BaseException:
            if self.supervisor is not None:
                self.supervisor.stop()
            raise
        with self._cond:
            self._conn = conn
            self.generation += 1
            self._cond.notify_all()

    def reopen(self, stale: WorkerConnection | None = None) -> None:
        """Replace the connection (and, for a launched worker, the worker) with a new generation. With `stale`
        given, only if that is still the current one: two threads that both saw it fail make one generation."""
        with self._open_lock:
            old = self._conn
            if stale is not None and old is not stale:
                return
            self._open()
        if old is not None:
            old.close()

    @property
    def process(self) -> WorkerProcess | None:
        return self.supervisor.process if self.supervisor is not None else None

    @property
    def recycles(self) -> bool:
        """Whether between_calls may replace the worker (its policy sets a memory limit)."""
        return self.policy.memory_limit_mb > 0

    @property
    def serving(self) -> bool:
        """For a worker connected to by address: what its grpc.health.v1 stream last said."""
        return self._health.serving if self._health is not None else True

    @property
    def health(self) -> str:
        """"serving", "draining" (the worker said NOT_SERVING) or "unreachable"."""
        return self._health.status if self._health is not None else "serving"

    @property
    def current(self) -> WorkerConnection | None:
        """The connection of the current generation, without waiting (for identity checks)."""
        return self._conn

    @property
    def conn(self) -> WorkerConnection:
        """The live connection; waits while a worker that died is being replaced."""
        supervisor = self.supervisor  # (_dead inline: every call reads this)
        if self._failed is None and not self._restarting and (supervisor is None or not supervisor.dead):
            return self._conn  # the common case, read without the condition's lock (each read is atomic)
        if not self.wait_healthy(self.policy.connect_timeout_s + self.policy.max_backoff_s):
            if self._failed is None:
                raise EpWorkerUnavailable(f"worker for {self.name!r} is being restarted and is not back yet")
        if self._failed is not None:
            raise self._failed
        return self._conn

    def call(self, method_of: Callable[[WorkerConnection], object], request, *, conn: WorkerConnection | None = None,
             **kw):
        """Call `method_of(conn)` on the current connection (or the one given). Remote workers that lost this
        client (they restarted) get a new Hello."""
        return self.run(lambda c: c.call(method_of(c), request, **kw), conn=conn)

    def run(self, fn: Callable[..., object], *args, conn: WorkerConnection | None = None):
        """`fn(conn, *args)` on the current connection (or the one given), with what `call` does around a call."""
        conn = conn or self.conn
        health = self._health  # (serving inline, as conn reads _dead)
        if health is not None and not health.serving:
            raise EpWorkerUnavailable(f"worker for {self.name!r} at {self.address} is not serving ({self.health}, "
                                      "says grpc.health.v1); calls resume when it answers again")
        try:
            return fn(conn, *args)
        except EpError as error:
            if self.closing:
                # Unregistered while the call was under way: whatever it met on the way (the worker forgetting
                # this client at Goodbye, its connection closed under it), that is what happened.
                raise self._unregistered() from error
            if isinstance(error, EpDeadlineExceeded):
                # Past its deadline a worker is stuck (a hang in vendor code): end it; supervision restarts it.
                self.kill("a call ran past its deadline")
            if not isinstance(error, EpUnknownClient) or self.supervisor is not None:
                raise
            self.reopen(stale=conn)
            raise EpWorkerUnavailable(f"worker for {self.name!r} restarted and forgot this client; its "
                                      "handles are made again on the next call") from None

    # --- supervision state ------------------------------------------------------------------------

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def begin_restart(self) -> None:
        with self._cond:
            self._restarting = True
            self._cond.notify_all()

    def end_restart(self) -> None:
        with self._cond:
            self._restarting = False
            self._cond.notify_all()

    def mark_failed(self, error: EpError) -> None:
        with self._cond:
            if self._failed is None:
                self._failed = error
            self._cond.notify_all()

    def _dead(self) -> bool:
        return self.supervisor is not None and self.supervisor.dead

    def wait_noticed(self, timeout: float) -> None:
        """Wait until the death of the current worker, if it died, has been handled (restart under way, or
        the EP marked failed)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._dead() or self._restarting or self._failed is not None, timeout)

    def wait_healthy(self, timeout: float) -> bool:
        """Wait until a worker that died (or was ended) has been replaced, or the EP is marked failed."""
        with self._cond:
            self._cond.wait_for(lambda: self._failed is not None or (not self._dead() and not self._restarting),
                                timeout)
            return self._failed is None and not self._dead() and not self._restarting

    def wait_recovered(self) -> bool:
        """wait_healthy with the time a restart may take under this link's policy."""
        return self.wait_healthy(self.policy.connect_timeout_s + self.policy.max_backoff_s)

    def wait_replaced(self) -> bool:
        """After a call the worker refused as it drained (EpWorkerDraining): whether it is to be made again on the
        worker's successor, which this waits for. A worker this link launched drains only as this process
        replaces it (past its memory limit: recycle), and nothing of the call ran; one connected to by address
        drains as its operator stops it (the failure policy's to answer), and a closing link has no successor."""
        return self.supervisor is not None and not self.closing and self.wait_recovered()

    def kill(self, why: str) -> None:
        if self.supervisor is not None:
            self.supervisor.kill(why)

    def between_calls(self) -> None:
        """Called once a call's results are safely in hand: a worker past its memory limit is replaced now."""
        if self.supervisor is not None and not self._restarting:
            measured = self._conn
            if self.supervisor.over_memory_limit():
                self.recycle(stale=measured)

    def recycle(self, stale: WorkerConnection | None = None) -> None:
        """Replace the worker with a fresh one (not a crash: no crash is counted). With `stale` given, only if
        that is still the current connection: threads that each found the worker over its limit replace it
        once (a second replacement would stop the new worker under the calls that had gone on to it)."""
        with self._open_lock:
            old = self._conn
            if stale is not None and old is not stale:
                return
            self.begin_restart()
            try:
                self.supervisor.stop()
                self._open()
                old.close()
            finally:
                self.end_restart()

    @property
    def failed(self) -> bool:
        return self._failed is not None

    def _unregistered(self) -> EpWorkerUnavailable:
        return EpWorkerUnavailable(f"EP {self.name!r} was unregistered; its worker is closed")

    def close(self) -> None:
        self.closing = True
        with self._cond:  # let a restart under way finish, so that its worker is stopped too
            self._cond.wait_for(lambda: not self._restarting, timeout=self.policy.connect_timeout_s + 5)
            if self._failed is None:
                self._failed = self._unregistered()
            self._cond.notify_all()
        if self._health is not None:
            self._health.close()
        if self._conn is not None:
            self._conn.close()
        if self.supervisor is not None:
            self.supervisor.stop()
