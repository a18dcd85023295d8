"""The Worker service: greeting and releasing clients, info, stats, shutdown, and region export."""
from __future__ import annotations

import logging
import threading

from ephost.errors import EpFailedPrecondition, EpInvalidArgument
from ephost.server.rpc import rpc
from ephost.server.state import PROTOCOL, WorkerState
from ephost.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class WorkerService(worker_pb2_grpc.WorkerServicer):
    SERVICE = "Worker"

    def __init__(self, state: WorkerState, shutdown):
        self.state = state
        self._shutdown = shutdown

    @rpc
    def Hello(self, request, context):
        if request.protocol and request.protocol != PROTOCOL:
            client = f" (ephost {request.ephost_version})" if request.ephost_version else ""
            raise EpInvalidArgument(f"client speaks {request.protocol!r}{client}; this worker speaks {PROTOCOL!r} "
                                    f"(ephost {self.state.ephost_version or 'unknown'})")
        if request.ephost_version and request.ephost_version != self.state.ephost_version:
            log.info("client %r runs ephost %s, this worker %s (both speak %s)", request.client_name,
                     request.ephost_version, self.state.ephost_version, PROTOCOL)
        if self.state.draining.is_set():
            raise EpFailedPrecondition("worker is draining and takes no new clients")
        client = self.state.clients.hello(request.client_name)
        fd_socket = self.state.fd_server.path if self.state.fd_server is not None else ""
        return worker_pb2.HelloResponse(client_id=client.client_id, info=self.state.info(), fd_socket=fd_socket)

    @rpc
    def Goodbye(self, request, context):
        client = self.state.clients.lookup(context.invocation_metadata())
        self.state.clients.goodbye(client)
        return common_pb2.Empty()

    @rpc
    def Renew(self, request, context):
        self.state.clients.lookup(context.invocation_metadata())
        return common_pb2.Empty()

    @rpc
    def GetInfo(self, request, context):
        return self.state.info()

    @rpc
    def GetStats(self, request, context):
        clients = self.state.clients.all()
        return self.state.stats.to_proto(buffers_live=sum(c.count("buffer") for c in clients), clients=len(clients))

    @rpc
    def Shutdown(self, request, context):
        log.info("shutdown requested by a client")
        threading.Thread(target=self._shutdown, args=(request.grace_s or 5.0,), daemon=True).start()
        return common_pb2.Empty()

    @rpc
    def ProbeSharing(self, request, context):
        self.state.clients.lookup(context.invocation_metadata())
        if self.state.fd_server is None:
            raise EpFailedPrecondition("this worker has no descriptor socket; it shares no memory")
        return worker_pb2.ExportRegionResponse(ticket=self.state.fd_server.issue_probe())

    @rpc
    def ExportRegion(self, request, context):
        client = self.state.clients.lookup(context.invocation_metadata())
        if self.state.fd_server is None:
            raise EpFailedPrecondition("this worker shares no memory (it listens on TCP); use inline transfers")
        _, region = self.state.region(client, request.region)
        if not region.shareable:
            raise EpInvalidArgument(f"region {request.region} is worker-local (DEFAULT) memory and cannot be shared")
        return worker_pb2.ExportRegionResponse(ticket=self.state.fd_server.issue(region.fd, region.size),
                                               nbytes=region.size)
