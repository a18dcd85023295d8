"""Stream over gRPC (OrtSyncStreamImpl and its notifications)."""
from __future__ import annotations

import math
import threading

from ephost.errors import EpInvalidArgument, EpNotFound
from ephost.server.rpc import Servicer, rpc
from ephost.v1 import common_pb2


class StreamService(Servicer):
    SERVICE = "ephost.v1.Stream"

    @rpc
    def CreateNotification(self, request, call):
        client = call.client
        notification = client.get("stream", request.id).create_notification()
        return common_pb2.Handle(id=client.add("notification", notification))

    @rpc
    def Activate(self, request, call):
        call.client.get("notification", request.id).activate()
        return common_pb2.Empty()

    @rpc
    def WaitOnHost(self, request, call):
        notification = call.client.get("notification", request.notification)
        if not (math.isfinite(request.timeout_s) and request.timeout_s >= 0):
            raise EpInvalidArgument(f"timeout_s must be a finite number of seconds >= 0, got {request.timeout_s}")
        remaining = call.time_remaining()
        timeout = request.timeout_s or remaining
        if remaining is not None and timeout is not None:
            timeout = min(timeout, remaining)
        if timeout is not None:
            timeout = min(timeout, threading.TIMEOUT_MAX)
        notification.wait_on_host(timeout)
        return common_pb2.Empty()

    @rpc
    def WaitOnDevice(self, request, call):
        client = call.client
        client.get("notification", request.notification).wait_on_device(client.get("stream", request.stream))
        return common_pb2.Empty()

    @rpc
    def Flush(self, request, call):
        call.client.get("stream", request.id).flush(call.time_remaining())
        return common_pb2.Empty()

    @rpc
    def OnSessionRunEnd(self, request, call):
        call.client.get("stream", request.id).on_session_run_end()
        return common_pb2.Empty()

    @rpc
    def Release(self, request, call):
        client = call.client
        for kind in ("notification", "stream"):
            try:
                obj = client.pop(kind, request.id)
            except EpNotFound:
                continue
            obj.release()
            return common_pb2.Empty()
        raise EpNotFound(f"unknown stream or notification handle {request.id}")
