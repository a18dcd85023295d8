"""The Worker service: greeting and releasing clients, info, stats, shutdown, and region export."""
from __future__ import annotations

import logging
import math
import os
import threading

from ephost.errors import (EpFailedPrecondition, EpInvalidArgument, EpNotFound, EpPermissionDenied,
                           EpResourceExhausted, quoted)
from ephost.server.blob_cache import check_digest
from ephost.server.files import FileSlot, mappable
from ephost.server.rpc import Servicer, rpc
from ephost.server.state import WorkerState
from ephost.wire import MAX_GRACE_S, PROTOCOL
from ephost.external_data import load_model
from ephost.v1 import common_pb2, ep_pb2, worker_pb2

log = logging.getLogger(__name__)

MAX_FILES = 1024  # imported files one client may hold (each holds a descriptor in the worker)


class WorkerService(Servicer):
    SERVICE = "ephost.v1.Worker"

    def __init__(self, state: WorkerState, shutdown):
        super().__init__(state)
        self._shutdown = shutdown

    @rpc(client=False)
    def Hello(self, request, call):
        if request.protocol and request.protocol != PROTOCOL:
            client = f" (ephost {quoted(request.ephost_version)})" if request.ephost_version else ""
            raise EpInvalidArgument(f"client speaks {quoted(request.protocol)}{client}; this worker speaks "
                                    f"{PROTOCOL!r} (ephost {quoted(self.state.ephost_version or 'unknown')})")
        if request.ephost_version and request.ephost_version != self.state.ephost_version:
            log.info("client %r runs ephost %s, this worker %s (both speak %s)", request.client_name,
                     request.ephost_version, self.state.ephost_version, PROTOCOL)
        if self.state.draining.is_set():
            raise EpFailedPrecondition("worker is draining and takes no new clients")
        client = self.state.clients.hello(request.client_name)
        fd_socket = self.state.fd_server.path if self.state.fd_server is not None else ""
        return worker_pb2.HelloResponse(client_id=client.client_id, info=self.state.info(), fd_socket=fd_socket)

    @rpc
    def Goodbye(self, request, call):
        client = call.client
        self.state.clients.goodbye(client)
        return common_pb2.Empty()

    @rpc
    def Renew(self, request, call):  # the lookup itself renews the lease
        return common_pb2.Empty()

    @rpc(client=False)
    def GetInfo(self, request, call):
        return self.state.info()

    @rpc(client=False)
    def GetStats(self, request, call):
        self.state.stats.settle()  # the calls the caller has answers to (the lane counts each after its reply)
        clients = self.state.clients.all()
        return self.state.stats.to_proto(buffers_live=sum(c.count("buffer") for c in clients), clients=len(clients))

    @rpc
    def Shutdown(self, request, call):
        if not self.state.launched:
            raise EpPermissionDenied("this worker serves other clients; its operator stops it (SIGTERM), "
                                     "not a client")
        if not (math.isfinite(request.grace_s) and 0 <= request.grace_s <= MAX_GRACE_S):
            raise EpInvalidArgument(f"grace_s must be between 0 and {MAX_GRACE_S:g} seconds, got {request.grace_s}")
        log.info("shutdown requested by the client that launched the worker")
        threading.Thread(target=self._shutdown, args=(request.grace_s or 5.0,), daemon=True).start()
        return common_pb2.Empty()

    @rpc
    def ProbeSharing(self, request, call):
        if self.state.fd_server is None:
            raise EpFailedPrecondition("this worker has no descriptor socket; it shares no memory")
        return worker_pb2.ExportRegionResponse(ticket=self.state.fd_server.issue_probe(owner=call.client.client_id))

    @rpc
    def ExportRegion(self, request, call):
        client = call.client
        if self.state.fd_server is None:
            raise EpFailedPrecondition("this worker shares no memory (it listens on TCP); use inline transfers")
        allocator, region = self.state.region(client, request.region)
        if not region.shareable:
            raise EpInvalidArgument(f"region {request.region} is worker-local (DEFAULT) memory and cannot be shared")
        fd = region.dup_fd()
        if fd is None:
            raise EpNotFound(f"region {request.region} was released")
        try:
            ticket = self.state.fd_server.issue(fd, region.size, owner=client.client_id, group=allocator)
        finally:
            os.close(fd)
        return worker_pb2.ExportRegionResponse(ticket=ticket, nbytes=region.size)

    @rpc
    def ImportFile(self, request, call):
        client = call.client
        if self.state.fd_server is None:
            raise EpFailedPrecondition("this worker has no descriptor socket (it listens on TCP): it cannot take "
                                       "files by descriptor")
        if client.count("file") >= MAX_FILES:
            raise EpResourceExhausted(f"this client holds {MAX_FILES} imported files, this worker's limit for one "
                                      "client")
        slot = FileSlot("an imported file")
        handle = client.add("file", slot)

        def attach(fd: int) -> None:
            f = slot.attach(mappable(fd, not self.state.launched, self.state.blobs))
            self.state.stats.add(files_imported=1, file_bytes_imported=f.size)

        try:
            ticket = self.state.fd_server.issue_import(attach, owner=client.client_id)
        except EpResourceExhausted:
            client.pop("file", handle)
            raise
        return worker_pb2.FileTicket(ticket=ticket, file=handle)

    def _blobs(self):
        if self.state.blobs is None:
            raise EpFailedPrecondition("this worker keeps no blob cache (--cache-max-mb 0)")
        return self.state.blobs

    @rpc
    def GetBlob(self, request, call):
        complete, nbytes = self._blobs().status(check_digest(request.sha256))
        self.state.stats.add(blob_hits=int(complete))
        return worker_pb2.BlobStatus(complete=complete, nbytes=nbytes)

    @rpc
    def PutBlob(self, request, call):
        complete, nbytes = self._blobs().write(check_digest(request.sha256), request.nbytes, request.offset,
                                               request.data)
        self.state.stats.add(blob_chunks_received=1, blob_bytes_received=len(request.data))
        return worker_pb2.BlobStatus(complete=complete, nbytes=nbytes)

    @rpc
    def OpenModel(self, request, call):
        root = self.state.model_dir
        path = self.state.model_dir_path(request.path, "model")
        if not os.path.isfile(path):
            raise EpNotFound(f"no model {quoted(request.path)} in the worker's model directory")
        model, external = load_model(path)  # its external data must lie beside it, inside the directory
        files = []
        if external is not None:
            for name, f in external.files.items():
                files.append(ep_pb2.ExternalFile(name=name, nbytes=f.size, model_dir_path=os.path.relpath(
                    os.path.normpath(os.path.join(os.path.dirname(path), name)), root)))
            external.close()
        return worker_pb2.ModelGraph(model=model.SerializeToString(), files=files)

    @rpc
    def OpenDataPlane(self, request, call):
        client = call.client
        lane = self.state.lane
        if lane is None:
            raise EpFailedPrecondition("this worker has no fast lane (it shares no memory with this client)")
        return worker_pb2.DataPlaneTicket(ticket=lane.issue(client.client_id), socket=lane.path)
