"""Keeping a worker alive for the client. WorkerLink is the current connection to one worker across its
restarts; each new connection starts a new generation, on which the client's objects re-create their handles
(EPs, allocators, streams, compiled partitions) from what they recorded. Supervision of a worker this process
launched is ProcessSupervisor's: its death is noticed at once, reported as EpWorkerCrashed, and it is restarted
with backoff until its CrashBudget is spent, when the EP is marked failed; a worker past its memory limit is
replaced between calls. A worker connected to by address is watched by a HealthWatcher and reconnected to by
AddressSupervisor. While a worker is away, calls wait for it, for a bounded time.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ephost.errors import (EpDeadlineExceeded, EpError, EpFailedPrecondition, EpInvalidArgument, EpUnknownClient,
                           EpWorkerCrashed, EpWorkerDraining, EpWorkerFailed, EpWorkerReplaced, EpWorkerUnavailable)
from ephost.client.connection import Credentials, WorkerConnection
from ephost.client.crash_budget import CrashBudget
from ephost.client.health import HealthWatcher
from ephost.client.reach import unreachable
from ephost.client.launcher import WorkerProcess, describe_exit
from ephost.fastlane import MAX_KEPT
from ephost.wire import MAX_SPIN_S, SPIN_S
from ephost.v1 import common_pb2

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class SupervisionPolicy:
    """How a worker is kept: restarted (one this process launched) or reconnected to (one at an address), and
    how long calls wait for it. Registration options of the same names set it."""

    restart: bool = True
    crash_limit: int = 3          # crashes within crash_window_s that mark the EP failed
    crash_window_s: float = 300.0
    backoff_s: float = 0.05       # first restart delay, doubled per crash in the window, at most max_backoff_s
    max_backoff_s: float = 2.0
    memory_limit_mb: int = 0      # restart the worker between calls when its resident memory exceeds this
    timeout_s: float = 60.0       # deadline of each call
    connect_timeout_s: float = 10.0
    recovery_timeout_s: float = 30.0  # how long calls wait for a worker that went to come back
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
        "connect_timeout_s": "how long a first connection waits for the worker to answer (default 10); an "
                             "address where nothing listens fails at once",
        "recovery_timeout_s": "how long calls wait for a worker that went (restarted, drained, or no longer "
                              "answering at its address) to come back before they fail (default 30)",
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
        self.crashes = 0  # deaths of its workers, since the registration
        self.process: WorkerProcess | None = None
        self._killed: WorkerProcess | None = None  # the worker this side ended (logged then, not as it exits)

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
            # (a worker that dies before the link's first connection fails that opening, which says so)
            if self._link.closing or not self._link.generation or process is not self.process or process.stopping:
                return
            code = process.proc.returncode
            delay = self._delay(f"its worker died with {describe_exit(code)}", code)
            if delay is None:
                return
            log.log(logging.INFO if process is self._killed else logging.WARNING, "worker %d for %r (EP %s) died "
                    "with %s; restarting in %.2f s", process.pid, self._link.name, self.ep, describe_exit(code), delay)
            self._link.begin_restart(f"died with {describe_exit(code)}")
            threading.Thread(target=self._restart, args=(delay,), name=f"ephost-restart-{self._link.name}",
                             daemon=True).start()
        finally:
            self._link.notify()

    def _delay(self, what: str, code: int | None = None) -> float | None:
        """A crash counted against the budget: the delay before the next start, or None where the EP is marked
        failed (the budget is spent, or restarting is off)."""
        self.crashes += 1
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
                self._link.starting_again()
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
            self._killed = process
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


class AddressSupervisor:
    """A worker connected to by address. When it goes (it drains, its connection breaks, or it no longer knows
    this client), the link reconnects in the background: to the same worker where it answers again with this
    client's handles (a network blip: nothing to make again), else with a new connection to the address (a
    worker restarted there, or another replica behind its name: a new generation, on which the client's
    objects make their handles again). Calls wait for it (WorkerLink.conn) up to recovery_timeout_s from the
    moment the worker went, then fail at once naming the cause, until a worker answers again."""

    RETRY_S = 0.2   # between attempts
    STEP_S = 2.0    # the longest one attempt waits for an answer

    def __init__(self, link: "WorkerLink"):
        self._link = link
        self._health = HealthWatcher(link, self.lost)

    def lost(self, conn: WorkerConnection, why: str, gone: bool, draining: bool = False) -> None:
        """`conn`'s worker no longer serves this client (`why`, said of it); `gone`: it will not again (it drains,
        or no longer knows this client), else it may (its connection broke); `draining`: it said it drains. A
        reconnection begins where `conn` is still the current connection and none is under way."""
        link = self._link
        if draining:
            conn.draining = True
        if not link.begin_outage(conn, why):
            return
        log.log(logging.INFO if draining else logging.WARNING, "worker for %r at %s %s; reconnecting (calls wait "
                "up to %g s)", link.name, link.address, why, link.policy.recovery_timeout_s)
        threading.Thread(target=self._reconnect, args=(conn, not gone), name=f"ephost-reconnect-{link.name}",
                         daemon=True).start()

    def _reconnect(self, old: WorkerConnection, same_worker_may_answer: bool) -> None:
        link = self._link
        try:
            while not link.closing:
                if same_worker_may_answer:
                    try:  # the same worker, with this client's handles, answers again: nothing to make anew
                        old.call(old.worker.Renew, common_pb2.Empty(), timeout=self.STEP_S, wait_for_ready=True)
                        log.info("worker for %r at %s answers again", link.name, link.address)
                        return
                    except (EpUnknownClient, EpWorkerDraining, EpFailedPrecondition):
                        same_worker_may_answer = False  # another worker answers there
                    except EpError as e:
                        link.note_attempt(str(unreachable(link.address, link.credentials, str(e))))
                        if not link.wait_closing(self.RETRY_S):
                            continue
                        return
                try:
                    link.reopen(stale=old, wait_s=self.STEP_S)
                    log.info("worker for %r at %s is back (generation %d)", link.name, link.address,
                             link.generation)
                    return
                except EpError as e:
                    link.note_attempt(str(e))
                if link.wait_closing(self.RETRY_S):
                    return
        finally:
            link.end_restart()

    def check(self, timeout: float) -> None:
        """Ask the current worker whether it serves (after a call failed: the health stream may not have told
        yet); one that does not is lost."""
        link = self._link
        conn = link.current
        if conn is None or not link.serving:
            return
        try:
            reply = health_pb2_grpc.HealthStub(conn.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
            self.lost(conn, "is draining (it says NOT_SERVING)", gone=True, draining=True)
        except (grpc.RpcError, ValueError) as e:
            self.lost(conn, f"stopped answering ({e.details() if isinstance(e, grpc.RpcError) else 'closed'})",
                      gone=False)

    def close(self) -> None:
        self._health.close()


class WorkerLink:
    """The connection to one worker, launched (`ep` set) or connected to (`address` set), and its generation.
    While the worker is away (restarting, reconnecting), calls wait for it (`conn`), up to the policy's
    recovery_timeout_s from the moment it went."""

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
        self._went = 0.0         # time.monotonic() when the worker went (while _restarting)
        self._away_since = 0.0   # ... or when the latest start of a new one began: calls wait from then
        self._cause = ""         # why it went ("is draining ...", "died with ...")
        self._last = ""          # what the last attempt to bring it back met
        self._retired: list[WorkerConnection] = []  # earlier generations' connections, closed once their calls end
        self._cond = threading.Condition()  # guards the fields above; notified as they change
        self._open_lock = threading.Lock()  # guards opening: one new connection at a time
        self.supervisor = ProcessSupervisor(self, ep, ep_options or {}, policy) if ep is not None else None
        with self._open_lock:
            try:
                self._open()
            except BaseException:
                self.closing = True  # nobody holds a link that never opened: nothing of it may start again
                raise
        self.remote = AddressSupervisor(self) if self.supervisor is None else None

    # --- the current connection -------------------------------------------------------------------

    def _open(self, wait_s: float = 0.0) -> None:
        """Connect to the worker (launching one first where this link launches its workers): a new generation.
        `wait_s`: how long to wait for a worker that answered before to answer again (0: fail at once where
        nothing listens). Called with `_open_lock` held."""
        address = self.supervisor.launch() if self.supervisor is not None else self.address
        try:
            conn = WorkerConnection(address, name=self.name, timeout_s=self.policy.timeout_s,
                                    connect_timeout_s=self.policy.connect_timeout_s, wait_s=wait_s,
                                    process=self.process, credentials=self.credentials,
                                    shared_memory=self.policy.shared_memory, fast_lane=self.policy.fast_lane,
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

    def reopen(self, stale: WorkerConnection | None = None, wait_s: float = 0.0) -> None:
        """Replace the connection (and, for a launched worker, the worker) with a new generation. With `stale`
        given, only if that is still the current one: two threads that both saw it fail make one generation.
        The old connection of a worker at an address is closed once no call on it can still be under way (a
        draining worker finishes them)."""
        with self._open_lock:
            old = self._conn
            if stale is not None and old is not stale:
                return
            self._open(wait_s)
        if old is None:
            return
        if self.remote is None:
            old.close()
            return
        with self._cond:
            self._retired.append(old)
        timer = threading.Timer(self.policy.timeout_s, self._close_retired, args=(old,))
        timer.daemon = True
        timer.start()

    def _close_retired(self, conn: WorkerConnection) -> None:
        with self._cond:
            if conn not in self._retired:
                return
            self._retired.remove(conn)
        conn.close()

    @property
    def process(self) -> WorkerProcess | None:
        return self.supervisor.process if self.supervisor is not None else None

    @property
    def recycles(self) -> bool:
        """Whether between_calls may replace the worker (its policy sets a memory limit)."""
        return self.policy.memory_limit_mb > 0

    @property
    def serving(self) -> bool:
        """Whether the worker is there: not being restarted or reconnected to, and not failed."""
        return not self._restarting and self._failed is None

    @property
    def health(self) -> str:
        """"serving", "away: CAUSE" (being restarted or reconnected to) or "failed"."""
        if self._failed is not None:
            return "failed"
        return f"away: {self._cause}" if self._restarting else "serving"

    @property
    def current(self) -> WorkerConnection | None:
        """The connection of the current generation, without waiting (for identity checks)."""
        return self._conn

    @property
    def conn(self) -> WorkerConnection:
        """The live connection; waits while a worker that went is being restarted or reconnected to."""
        supervisor = self.supervisor  # (_dead inline: every call reads this)
        if self._failed is None and not self._restarting and (supervisor is None or not supervisor.dead):
            return self._conn  # the common case, read without the condition's lock (each read is atomic)
        if not self.wait_recovered() and self._failed is None:
            raise self._not_back()
        if self._failed is not None:
            raise self._failed
        return self._conn

    def _not_back(self) -> EpWorkerUnavailable:
        with self._cond:
            away = time.monotonic() - self._went if self._restarting else 0.0
            cause, last = self._cause, self._last
        if not last and self.remote is not None:  # no attempt has ended yet: what is at the address now
            last = str(unreachable(self.address, self.credentials, "no answer"))
        last = f" (the last attempt: {last})" if last else ""
        where = f" at {self.address}" if self.address else ""
        return EpWorkerUnavailable(f"the worker for {self.name!r}{where} {cause or 'went'} and has not come back "
                                   f"within {away:.1f} s{last}; calls resume when it does")

    def call(self, method_of: Callable[[WorkerConnection], object], request, *, conn: WorkerConnection | None = None,
             **kw):
        """Call `method_of(conn)` on the current connection (or the one given)."""
        return self.run(lambda c: c.call(method_of(c), request, **kw), conn=conn)

    def run(self, fn: Callable[..., object], *args, conn: WorkerConnection | None = None):
        """`fn(conn, *args)` on the current connection (or the one given), with what `call` does around a call:
        a call past its deadline ends a launched worker (supervision restarts it); a worker at an address that
        refused the call as it drained, or that no longer knows this client, is reconnected to."""
        conn = conn or self.conn
        try:
            return fn(conn, *args)
        except EpError as error:
            self.raise_failure(conn, error)

    def raise_failure(self, conn: WorkerConnection, error: EpError) -> NoReturn:
        """Raise what a call on `conn` that raised `error` raises (see run), after what it asks for: a worker
        past a call's deadline ended, one at an address that refused the call or forgot this client reconnected
        to. Called where the call was made, in its `except`."""
        if self.closing:
            # Unregistered while the call was under way: whatever it met on the way (the worker forgetting
            # this client at Goodbye, its connection closed under it), that is what happened.
            raise self._unregistered() from error
        if isinstance(error, EpDeadlineExceeded):
            # Past its deadline a worker is stuck (a hang in vendor code): end it; supervision restarts it.
            self.kill("a call ran past its deadline")
        if self.remote is None:
            raise error
        if isinstance(error, EpWorkerDraining):
            self.remote.lost(conn, "is draining (it refused a call)", gone=True, draining=True)
            raise error
        if type(error) is EpWorkerUnavailable and conn.draining:
            # Its connection ended as the worker drained (a call it had not read when it closed, or one cut
            # at the drain's grace): no failure of the EP, made again on the worker that answers next.
            raise EpWorkerDraining(f"the worker for {self.name!r} at {self.address} ended the call's "
                                   f"connection as it drained ({error})") from None
        if not isinstance(error, EpUnknownClient):
            raise error
        self.remote.lost(conn, "restarted and forgot this client", gone=True)
        raise EpWorkerReplaced(f"the worker for {self.name!r} at {self.address} restarted and does not know "
                               "this client: nothing of the call ran; its handles are made again on the new "
                               "worker") from None

    # --- supervision state ------------------------------------------------------------------------

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def begin_restart(self, cause: str = "") -> None:
        """The worker went (`cause`, said of it: "died with signal SIGKILL") and is being brought back."""
        with self._cond:
            if not self._restarting:
                self._went = self._away_since = time.monotonic()
                self._cause, self._last = cause, ""
            self._restarting = True
            self._cond.notify_all()

    def begin_outage(self, conn: WorkerConnection, cause: str) -> bool:
        """Mark the worker of `conn` away (`cause`), where `conn` is the current connection and none is under
        way and the link is open; whether it did (the caller then brings the worker back, and ends it)."""
        with self._cond:  # (checked and marked at once: two threads that saw it go start one reconnection)
            if conn is not self._conn or self._restarting or self.closing or self._failed is not None:
                return False
            self.begin_restart(cause)
            return True

    def starting_again(self) -> None:
        """A new worker is being started (another attempt of a restart): calls wait for this one afresh."""
        with self._cond:
            if self._restarting:
                self._away_since = time.monotonic()
                self._cond.notify_all()

    def note_attempt(self, met: str) -> None:
        """What an attempt to bring the worker back met (calls that give up name it)."""
        with self._cond:
            self._last = met

    def end_restart(self) -> None:
        with self._cond:
            self._restarting = False
            self._cond.notify_all()

    def wait_closing(self, timeout: float) -> bool:
        """Wait `timeout` seconds, or until the link closes; whether it is closing."""
        with self._cond:
            return self._cond.wait_for(lambda: self.closing, timeout)

    def mark_failed(self, error: EpError) -> None:
        with self._cond:
            if self._failed is None:
                self._failed = error
            self._cond.notify_all()

    def _dead(self) -> bool:
        return self.supervisor is not None and self.supervisor.dead

    def wait_noticed(self, timeout: float) -> None:
        """Wait until the loss of the current worker, if it went, has been handled (restart or reconnection
        under way, or the EP marked failed). A worker at an address is asked (grpc.health.v1) whether it still
        serves."""
        if self.remote is not None:
            self.remote.check(timeout)
            return
        with self._cond:
            self._cond.wait_for(lambda: not self._dead() or self._restarting or self._failed is not None, timeout)

    def wait_healthy(self, timeout: float) -> bool:
        """Wait until a worker that went has been replaced or reconnected to, or the EP is marked failed."""
        with self._cond:
            self._cond.wait_for(lambda: self._failed is not None or (not self._dead() and not self._restarting),
                                timeout)
            return self._failed is None and not self._dead() and not self._restarting

    def wait_recovered(self) -> bool:
        """wait_healthy up to recovery_timeout_s past the worker's going, or past the latest start of a new one
        (a restart that takes several starts is waited for as a whole: each start is bounded, and their number
        by the crash budget)."""
        called = time.monotonic()
        with self._cond:
            while self._failed is None and (self._dead() or self._restarting):
                since = self._away_since if self._restarting else called
                left = since + self.policy.recovery_timeout_s - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._failed is None and not self._dead() and not self._restarting

    def wait_replaced(self) -> bool:
        """After a call that did not run (the worker refused it as it drained: EpWorkerDraining, or it no longer
        knew this client: EpWorkerReplaced): whether it is to be made again on the worker that replaces it,
        which this waits for. A launched worker drains only as this process replaces it (past its memory limit:
        recycle); one at an address, as its operator restarts it or moves its clients to another replica. A
        closing link has no successor."""
        return not self.closing and self.wait_recovered()

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
            self.begin_restart("replaced for its memory")
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
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._restarting, timeout=self.policy.connect_timeout_s + 5)
            if self._failed is None:
                self._failed = self._unregistered()
            retired, self._retired = self._retired, []
            self._cond.notify_all()
        if self.remote is not None:
            self.remote.close()
        for conn in (*retired, self._conn):
            if conn is not None:
                conn.close()
        if self.supervisor is not None:
            self.supervisor.stop()
