"""Watching a worker this process did not launch: it cannot be watched as a process, so grpc.health.v1's Watch
stream says whether it serves (a stream, not polling: the worker pushes every change, and the stream breaks the
moment the connection does). When it says NOT_SERVING (a drain) or breaks, the link is told at once, and
reconnects (client/supervisor.py, AddressSupervisor); the client's lease is renewed while it serves."""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ephost.errors import EpError
from ephost.v1 import common_pb2

if TYPE_CHECKING:
    from ephost.client.connection import WorkerConnection
    from ephost.client.supervisor import WorkerLink

log = logging.getLogger(__name__)

# Lease renewal period: a worker releases clients silent for --client-lease-s (60 s by default; operators and
# tests set it as low as a few seconds), so renew well within the shortest lease in use.
RENEW_S = 1.0
RETRY_S = 0.5      # between attempts to watch a worker while the link is reconnecting
RENEW_TIMEOUT_S = 2.0


class HealthWatcher:
    """Watches the link's current connection; `lost(conn, why, gone, draining)` is told when that connection's
    worker drains or ends the stream (gone: it will not serve this client again) or the stream breaks, once per
    stream."""

    def __init__(self, link: "WorkerLink", lost: Callable[["WorkerConnection", str, bool, bool], None]):
        self._link = link
        self._lost = lost
        self._cond = threading.Condition()  # guards _closed and _call
        self._closed = False
        self._call = None
        for target in (self._watch, self._renew):
            threading.Thread(target=target, name=f"ephost-health-{link.name}", daemon=True).start()

    def _watch(self) -> None:
        while not self._closed:
            conn = self._link.current
            if conn is not None and self._link.serving:
                try:
                    with self._cond:
                        if self._closed:
                            return
                        self._call = health_pb2_grpc.HealthStub(conn.channel).Watch(health_pb2.HealthCheckRequest())
                    why, draining = "ended its health stream (it is going away)", False
                    for reply in self._call:
                        if reply.status != health_pb2.HealthCheckResponse.SERVING:
                            why, draining = "is draining (it says NOT_SERVING)", True
                            break
                    self._call.cancel()  # (a draining worker keeps the stream open for as long as its grace)
                    self._lost(conn, why, True, draining)
                except (grpc.RpcError, ValueError) as e:  # unreachable, or the channel was closed under us
                    if not self._closed:
                        details = e.details() if isinstance(e, grpc.RpcError) else "its connection was closed"
                        self._lost(conn, f"stopped answering ({details})", False, False)
            with self._cond:  # while the link reconnects, or once the stream has ended
                self._cond.wait_for(lambda: self._closed, RETRY_S)

    def _renew(self) -> None:
        """Keep this client's lease, so that the worker keeps its handles while it is idle."""
        while True:
            with self._cond:
                if self._cond.wait_for(lambda: self._closed, RENEW_S):
                    return
            if not self._link.serving:
                continue
            conn = self._link.current
            try:
                conn.call(conn.worker.Renew, common_pb2.Empty(), timeout=RENEW_TIMEOUT_S)
            except EpError as e:
                log.debug("renewing the lease at %s failed: %s", self._link.address, e)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            call, self._call = self._call, None
            self._cond.notify_all()
        if call is not None:
            call.cancel()
