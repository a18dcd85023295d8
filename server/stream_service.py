"""Stream over gRPC (OrtSyncStreamImpl and its notifications)."""
from __future__ import annotations

from ephost.errors import EpNotFound
from ephost.server.rpc import rpc
from ephost.server.state import WorkerState
from ephost.v1 import common_pb2, stream_pb2_grpc


class StreamService(stream_pb2_grpc.StreamServicer):
    SERVICE = "Stream"

    def __init__(self, state: WorkerState):
        self.state = state

    def _client(self, context):
        return self.state.clients.lookup(context.invocation_metadata())

    @rpc
    def CreateNotification(self, request, context):
        client = self._client(context)
        notification = client.get("stream", request.id).create_notification()
        return common_pb2.Handle(id=client.add("notification", notification))

    @rpc
    def Activate(self, request, context):
        self._client(context).get("notification", request.id).activate()
        return common_pb2.Empty()

    @rpc
    def WaitOnHost(self, request, context):
        notification = self._client(context).get("notification", request.notification)
        remaining = context.time_remaining()
        timeout = request.timeout_s or remaining
        if remaining is not None and timeout is not None:
            timeout = min(timeout, remaining)
        notification.wait_on_host(timeout)
        return common_pb2.Empty()

    @rpc
    def WaitOnDevice(self, request, context):
        client = self._client(context)
        client.get("notification", request.notification).wait_on_device(client.get("stream", request.stream))
        return common_pb2.Empty()

    @rpc
    def Flush(self, request, context):
        self._client(context).get("stream", request.id).flush(context.time_remaining())
        return common_pb2.Empty()

    @rpc
    def OnSessionRunEnd(self, request, context):
        self._client(context).get("stream", request.id).on_session_run_end()
        return common_pb2.Empty()

    @rpc
    def Release(self, request, context):
        client = self._client(context)
        for kind in ("notification", "stream"):
            try:
                obj = client.pop(kind, request.id)
            except EpNotFound:
                continue
            obj.release()
            return common_pb2.Empty()
        raise EpNotFound(f"unknown stream or notification handle {request.id}")
