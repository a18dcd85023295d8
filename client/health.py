"""Watching a worker this process did not launch: it cannot be watched as a process, so grpc.health.v1's Watch
stream says whether it serves (a stream, not polling: the worker pushes every change, and the stream breaks the
moment the connection does), and the client's lease is renewed while it does."""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ephost.errors import EpError
from ephost.v1 import common_pb2

if TYPE_CHECKING:
    from ephost.client.supervisor import WorkerLink

log = logging.getLogger(__name__)

# Lease renewal period: a worker releases clients silent for --client-lease-s (60 s by default; operators and
# tests set it as low as a few seconds), so renew well within the shortest lease in use.
RENEW_S = 1.0
RETRY_S = 0.5      # between attempts to watch a worker that cannot be reached
# When the stream breaks, the channel may reach the worker again at once (a replica behind the same name, a
# blip): one check, waiting this long for a connection, before calls are turned away as unreachable.
GRACE_S = 1.0
RENEW_TIMEOUT_S = 2.0


class HealthWatcher:
    def __init__(self, link: "WorkerLink"):
        self._link = link
        self._cond = threading.Condition()
        self._closed = False
        self._call = None
        self.serving = True
        self.status = "serving"  # or "draining" (the worker said NOT_SERVING), or "unreachable"
        for target in (self._watch, self._renew):
            threading.Thread(target=target, name=f"ephost-health-{link.name}", daemon=True).start()

    def _set(self, status: str) -> None:
        with self._cond:
            serving = status == "serving"
            if status != self.status and not self._closed:
                log.warning("worker for %r at %s is %s", self._link.name, self._link.address,
                            "serving again" if serving else status)
            self.serving, self.status = serving, status
            self._cond.notify_all()

    def _watch(self) -> None:
        while not self._closed:
            conn = self._link.current
            try:
                with self._cond:
                    if self._closed:
                        return
                    self._call = health_pb2_grpc.HealthStub(conn.channel).Watch(
                        health_pb2.HealthCheckRequest(), wait_for_ready=not self.serving)
                for reply in self._call:
                    self._set("serving" if reply.status == health_pb2.HealthCheckResponse.SERVING else "draining")
                if conn is self._link.current:
                    self._set("draining")  # the worker ended the stream: it is going away
            except (grpc.RpcError, ValueError):  # unreachable, or the channel was closed under us
                if conn is not self._link.current:
                    continue  # the link moved to a new connection: watch that one, nothing was lost
                if self._answers(conn):
                    continue  # reachable again (another replica, or a blip): watch anew
                self._set("unreachable")
            with self._cond:
                self._cond.wait_for(lambda: self._closed, RETRY_S)

    def _answers(self, conn) -> bool:
        try:
            reply = health_pb2_grpc.HealthStub(conn.channel).Check(health_pb2.HealthCheckRequest(), timeout=GRACE_S,
                                                                 wait_for_ready=True)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except (grpc.RpcError, ValueError):
            return False

    def _renew(self) -> None:
        """Keep this client's lease, so that the worker keeps its handles while it is idle."""
        while True:
            with self._cond:
                if self._cond.wait_for(lambda: self._closed, RENEW_S):
                    return
                if not self.serving:
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
