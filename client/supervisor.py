"""Keeping a worker alive for the client: WorkerLink is the current connection to one worker across its
restarts. A worker this process launched is watched; its death is noticed at once, reported as
EpWorkerCrashed, and it is restarted with exponential backoff until it crashes more often than the crash
limit allows within the window, when it is marked failed. A worker whose memory grows past its limit is
restarted between calls. Each restart starts a new generation: the client's objects re-create their handles
(EPs, allocators, streams, compiled partitions) on the new worker from what they recorded.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping

from ephost.errors import (EpDeadlineExceeded, EpError, EpFailedPrecondition, EpInvalidArgument, EpWorkerFailed,
                           EpWorkerUnavailable)
from ephost.client.connection import Credentials, WorkerConnection
from ephost.v1 import common_pb2
from ephost.client.launcher import WorkerProcess, describe_exit

log = logging.getLogger(__name__)

_EMPTY = common_pb2.Empty()
HEALTH_INTERVAL_S = 1.0  # how often a worker not launched here is asked whether it serves
HEALTH_TIMEOUT_S = 2.0


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

    OPTIONS = {
        "restart": "restart a launched worker that dies (default true)",
        "crash_limit": "crashes within crash_window_s after which the EP is marked failed (default 3)",
        "crash_window_s": "the crash-limit window in seconds (default 300)",
        "memory_limit_mb": "restart a launched worker between calls when it holds more memory (default: none)",
        "timeout_s": "deadline of each call to the worker, in seconds (default 60)",
        "connect_timeout_s": "how long to wait for the worker to answer at all (default 10)",
        "shared_memory": "share memory with a worker on this host when it proves it can (default true)",
    }

    @classmethod
    def take(cls, options: dict[str, str]) -> "SupervisionPolicy":
        """The policy from (and without) its keys in a registration's options."""
        mine = {k: options.pop(k) for k in list(options) if k in cls.OPTIONS}
        try:
            return cls(**{k: (v.lower() not in ("0", "false", "no") if isinstance(getattr(cls, k), bool)
                              else type(getattr(cls, k))(v))
                          for k, v in mine.items()})
        except ValueError as e:
            raise EpInvalidArgument(f"bad supervision option: {e}") from None


class WorkerLink:
    """The connection to one worker, launched (`ep` set) or connected to (`address` set)."""

    def __init__(self, name: str, *, ep: str | None = None, ep_options: Mapping[str, str] | None = None,
                 address: str | None = None, policy: SupervisionPolicy = SupervisionPolicy(),
                 credentials: Credentials = Credentials()):
        self.name = name
        self.ep = ep
        self.ep_options = dict(ep_options or {})
        self.address = address
        self.policy = policy
        self.credentials = credentials
        self.generation = 0
        self.process: WorkerProcess | None = None
        self._conn: WorkerConnection | None = None
        self._crashes: deque[float] = deque()
        self._failed: EpError | None = None
        self._closing = False
        self._ready = threading.Condition()
        self._restarting = False
        self.serving = True  # what the last grpc.health.v1 check of a worker not launched here said
        self._start()
        if self.process is None:
            threading.Thread(target=self._watch_health, name=f"ephost-health-{name}", daemon=True).start()

    # --- the current connection -------------------------------------------------------------------

    def _start(self) -> None:
        if self.ep is not None:
            self.process = WorkerProcess(self.ep, self.ep_options, on_exit=self._on_exit)
            address = self.process.address
        else:
            address = self.address
        try:
            conn = WorkerConnection(address, name=self.name, timeout_s=self.policy.timeout_s,
                                    connect_timeout_s=self.policy.connect_timeout_s, process=self.process,
                                    credentials=self.credentials, shared_memory=self.policy.shared_memory)
        except BaseException:
            if self.process is not None:
                self.process.stop()
            raise
        with self._ready:
            self._conn = conn
            self.generation += 1
            self._ready.notify_all()

    @property
    def current(self) -> WorkerConnection | None:
        """The connection of the current generation, without waiting (for identity checks)."""
        return self._conn

    @property
    def conn(self) -> WorkerConnection:
        """The live connection; waits while a worker that died is being replaced."""
        if not self.wait_healthy(self.policy.connect_timeout_s + self.policy.max_backoff_s):
            if self._failed is None:
                raise EpWorkerUnavailable(f"worker for {self.name!r} is being restarted and is not back yet")
        if self._failed is not None:
            raise self._failed
        return self._conn

    def call(self, method_of: Callable[[WorkerConnection], object], request, *, conn: WorkerConnection | None = None,
             **kw):
        """Call `method_of(conn)` on the current connection (or the one given). Remote workers that lost this
        client (they restarted) get a new Hello; launched ones are recycled between calls past their memory
        limit."""
        conn = conn or self.conn
        if not self.serving:
            raise EpWorkerUnavailable(f"worker for {self.name!r} at {self.address} is not serving (its health "
                                      "checks fail); calls resume when it answers again")
        try:
            reply = conn.call(method_of(conn), request, **kw)
        except EpDeadlineExceeded:
            # Past its deadline a worker is stuck (a hang in vendor code): end it; supervision restarts it.
            self.kill("a call ran past its deadline")
            raise
        except EpFailedPrecondition as e:
            if "unknown client" in str(e) and self.process is None:
                self._reconnect()
                raise EpWorkerUnavailable(f"worker for {self.name!r} restarted and forgot this client; its "
                                          "handles are made again on the next call") from None
            raise
        return reply

    # --- supervision ------------------------------------------------------------------------------

    def _on_exit(self, process: WorkerProcess) -> None:
        if self._closing or process is not self.process or process.stopping:
            return
        code = process.proc.returncode
        now = time.monotonic()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self.policy.crash_window_s:
            self._crashes.popleft()
        if not self.policy.restart or len(self._crashes) >= self.policy.crash_limit:
            why = ("restarting is off" if not self.policy.restart else
                   f"it crashed {len(self._crashes)} times within {self.policy.crash_window_s:g} s")
            log.error("worker for %r (EP %s) died with %s; %s: the EP is marked failed", self.name, self.ep,
                      describe_exit(code), why)
            with self._ready:
                self._failed = EpWorkerFailed(f"EP {self.name!r} ({self.ep}) has failed: its worker died with "
                                              f"{describe_exit(code)} and {why}", ep=self.ep or "",
                                              returncode=code)
                self._ready.notify_all()
            return
        with self._ready:
            self._restarting = True
        delay = min(self.policy.backoff_s * 2 ** (len(self._crashes) - 1), self.policy.max_backoff_s)
        log.warning("worker for %r (EP %s) died with %s; restarting in %.2f s", self.name, self.ep,
                    describe_exit(code), delay)
        threading.Thread(target=self._restart, args=(delay,), name=f"ephost-restart-{self.name}",
                         daemon=True).start()

    def _restart(self, delay: float) -> None:
        time.sleep(delay)
        old = self._conn
        try:
            if not self._closing:
                self._start()
                log.info("worker for %r is back (generation %d)", self.name, self.generation)
        except EpError as e:
            log.error("restarting the worker for %r failed: %s", self.name, e)
            with self._ready:
                self._failed = EpWorkerFailed(f"EP {self.name!r} could not be restarted: {e}", ep=self.ep or "")
        finally:
            with self._ready:
                self._restarting = False
                self._ready.notify_all()
            if old is not None:
                old.close()

    def wait_noticed(self, timeout: float) -> None:
        """Wait until the death of the current worker, if it died, has been handled (restart under way, or
        the EP marked failed)."""
        deadline = time.monotonic() + timeout
        with self._ready:
            while (self.process is not None and self.process.returncode is not None and not self._restarting
                   and self._failed is None and time.monotonic() < deadline):
                self._ready.wait(0.02)

    def wait_healthy(self, timeout: float) -> bool:
        """Wait until a worker that died (or was ended) has been replaced, or the EP is marked failed."""
        deadline = time.monotonic() + timeout
        with self._ready:
            while True:
                dead = self.process is not None and self.process.returncode is not None
                if self._failed is not None or (not dead and not self._restarting):
                    return self._failed is None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._ready.wait(min(remaining, 0.05))

    def _watch_health(self) -> None:
        """A worker this process did not launch cannot be watched as a process: ask grpc.health.v1."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        while not self._closing:
            conn = self._conn
            try:
                reply = health_pb2_grpc.HealthStub(conn.channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
                serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            except Exception:  # unreachable, or the channel was closed under us
                serving = False
            if serving:
                try:  # keep this client's lease, so that the worker keeps its handles while it is idle
                    conn.call(conn.worker.Renew, _EMPTY, timeout=HEALTH_TIMEOUT_S)
                except EpError as e:
                    log.debug("renewing the lease at %s failed: %s", self.address, e)
            if serving != self.serving and not self._closing:
                log.warning("worker for %r at %s is %s", self.name, self.address,
                            "serving again" if serving else "not serving")
            self.serving = serving
            time.sleep(HEALTH_INTERVAL_S)

    def kill(self, why: str) -> None:
        """End a launched worker now (a call past its deadline); supervision restarts it."""
        process = self.process
        if process is not None and process.returncode is None:
            log.warning("killing the worker for %r: %s", self.name, why)
            process.kill()
            process.exited.wait(5)  # so that the next call waits for its replacement, not for a corpse

    def between_calls(self) -> None:
        """Called once a call's results are safely in hand: a worker past its memory limit is replaced now."""
        if self.policy.memory_limit_mb and self.process is not None and not self._restarting:
            self._check_memory()

    def _check_memory(self) -> None:
        rss = self.process.resident_bytes()
        if rss > self.policy.memory_limit_mb << 20:
            log.warning("worker for %r holds %d MiB, over its limit of %d MiB; restarting it", self.name,
                        rss >> 20, self.policy.memory_limit_mb)
            self.recycle()

    def recycle(self) -> None:
        """Replace the worker with a fresh one (not a crash: no crash is counted)."""
        with self._ready:
            self._restarting = True
        old_process, old_conn = self.process, self._conn
        try:
            old_process.stop()
            self._start()
        finally:
            with self._ready:
                self._restarting = False
                self._ready.notify_all()
            old_conn.close()

    def _reconnect(self) -> None:
        old = self._conn
        self._start()
        old.close()

    @property
    def failed(self) -> bool:
        return self._failed is not None

    def close(self) -> None:
        self._closing = True
        with self._ready:  # let a restart under way finish, so that its worker is stopped too
            self._ready.wait_for(lambda: not self._restarting, timeout=self.policy.connect_timeout_s + 5)
            if self._failed is None:
                self._failed = EpWorkerUnavailable(f"EP {self.name!r} was unregistered; its worker is closed")
            self._ready.notify_all()
        if self._conn is not None:
            self._conn.close()
        if self.process is not None:
            self.process.stop()
