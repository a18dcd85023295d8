"""One client's connection to one worker: the channel, the stubs, the client id every call carries,
typed errors for every failed call, and the worker's regions mapped into this process."""
from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import os
import threading
from dataclasses import dataclass

import grpc
import numpy as np

from ephost.errors import (EpError, EpFailedPrecondition, EpWorkerUnavailable, error_for_status,
                           reason_of)
from ephost.client.fastlane import FastLane, LaneUnavailable
from ephost.client.reach import unreachable
from ephost.fastlane import MAX_KEPT, METHODS as LANE_METHODS
from ephost.wire import SPIN_S
from ephost.fdshare import fetch_descriptor, prove_sharing
from ephost.memory import Region
from ephost.progress import Progress
from ephost.wire import CHUNK_BYTES, MAX_MESSAGE, PROTOCOL, read_file
from ephost.wire import CLIENT_ID_KEY as METADATA_KEY
from ephost.v1 import (allocator_pb2, allocator_pb2_grpc, common_pb2, data_transfer_pb2_grpc, ep_pb2_grpc,
                       factory_pb2_grpc, stream_pb2_grpc, worker_pb2, worker_pb2_grpc)

log = logging.getLogger(__name__)

EPHOST_VERSION = importlib.metadata.version("ephost")
KEEPALIVE_MS = 20_000
HELLO_POLL_S = 0.05  # how often a Hello to a launched worker looks whether the worker died meanwhile
SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"pick_first": {"shuffleAddressList": True}}]})


@dataclass(frozen=True)
class Credentials:
    """How to reach a worker that is not on a private unix socket: TLS (grpcs://, with a CA to trust and a
    client certificate for mutual TLS) and a bearer token (also read from EPHOST_TOKEN)."""

    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None

    OPTIONS = {"token": "bearer token (default: $EPHOST_TOKEN)", "tls_ca": "PEM CA to trust (grpcs://)",
               "tls_cert": "PEM client certificate (mutual TLS)", "tls_key": "PEM client key (mutual TLS)"}

    @classmethod
    def take(cls, options: dict[str, str], tls: bool) -> "Credentials":
        mine = {k: options.pop(k) for k in list(options) if k in cls.OPTIONS}
        mine.setdefault("token", os.environ.get("EPHOST_TOKEN") or None)
        return cls(tls=tls, **mine)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        def read(path):
            return None if path is None else read_file(path)
        return grpc.ssl_channel_credentials(read(self.tls_ca), read(self.tls_key), read(self.tls_cert))

    def metadata(self) -> tuple:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


class WorkerConnection:
    def __init__(self, address: str, *, name: str = "ephost", timeout_s: float = 60.0, connect_timeout_s: float = 10.0,
                 wait_s: float = 0.0, process=None, credentials: Credentials = Credentials(),
                 shared_memory: bool = True, fast_lane: bool = True, fast_lane_spin_s: float = SPIN_S,
                 kept_calls: bool = True, fast_lane_slots: bool = True, kept_calls_max: int = MAX_KEPT):
        self.address = address
        self.name = name
        self.timeout_s = timeout_s
        self.process = process  # a WorkerProcess when this client launched the worker
        self.credentials = credentials
        make_channel = (functools.partial(grpc.secure_channel, credentials=credentials.channel_credentials())
                        if credentials.tls else grpc.insecure_channel)
        self.channel = make_channel(address, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            # Keepalives notice a worker (or a network path) that is gone while no call is under way.
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # Several replicas behind one name: one channel talks to one replica, the one that compiled this
            # client's partitions, and moves to another only when that one is gone; each channel shuffles the
            # name's addresses first (gRFC A62), so that clients spread over the replicas.
            ("grpc.service_config", SERVICE_CONFIG),
            # Its own connections: a new connection tries the address now, not after the backoff another channel
            # to the same address is in (a worker that has just come back is found at once).
            ("grpc.use_local_subchannel_pool", 1),
            # A worker that comes back is found again quickly.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2_000),
        ])
        self.factory = factory_pb2_grpc.EpFactoryStub(self.channel)
        self.ep = ep_pb2_grpc.EpStub(self.channel)
        self.allocator = allocator_pb2_grpc.AllocatorStub(self.channel)
        self.stream = stream_pb2_grpc.StreamStub(self.channel)
        self.data_transfer = data_transfer_pb2_grpc.DataTransferStub(self.channel)
        self.worker = worker_pb2_grpc.WorkerStub(self.channel)
        self._metadata: tuple = credentials.metadata()
        self._closed = False
        self.draining = False  # its worker said it drains (WorkerLink.run: a call it ends then is made again)
        self._regions: dict[int, Region | None] = {}
        self._regions_lock = threading.Lock()  # guards _regions
        self.lane: FastLane | None = None
        self.kept_calls = kept_calls  # repeat Computes and copies as kept calls on the lane (FastLane.call_kept)
        self._lane_methods: dict = {}
        # A first connection fails at once where nothing listens (one attempt); one to a worker that answered
        # before waits up to `wait_s` for it, or a successor, to answer again.
        try:
            hello = self._hello(wait_s, connect_timeout_s)
        except BaseException:
            self.channel.close()
            raise
        if hello.info.protocol != PROTOCOL:
            self.channel.close()
            raise EpFailedPrecondition(
                f"the worker at {address} speaks protocol {hello.info.protocol or 'none'!r} (ephost "
                f"{hello.info.ephost_version or 'unknown'}); this client (ephost {EPHOST_VERSION}) speaks "
                f"{PROTOCOL!r}: run a worker of a matching ephost release")
        if hello.info.ephost_version != EPHOST_VERSION:
            log.info("worker at %s runs ephost %s, this client %s (both speak %s)", address,
                     hello.info.ephost_version or "unknown", EPHOST_VERSION, PROTOCOL)
        self.info = hello.info
        self._metadata = ((METADATA_KEY, hello.client_id), *credentials.metadata())
        # Shared memory only where the worker proves it can map a segment made here (same host, same user).
        self.fd_socket = hello.fd_socket if shared_memory and self._prove_sharing(hello.fd_socket) else ""
        if not self.fd_socket:
            log.info("no shared memory with the worker at %s: tensors and models travel inline, in chunks", address)
        # The data plane: Compute, CopyTensors, Alloc and Free over the fast lane where it opens, else gRPC.
        if fast_lane and self.fd_socket:
            lane = FastLane(self._lane_ticket, self._lane_lost, self.adopt_region, fast_lane_spin_s,
                            fast_lane_slots, kept_calls_max)
            if lane.open():
                self.lane = lane
                stubs = {"Ep": self.ep, "EpFactory": self.factory, "DataTransfer": self.data_transfer,
                         "Allocator": self.allocator, "Worker": self.worker}
                self._lane_methods = {getattr(stubs[key.split("/")[0]], key.split("/")[1]): method
                                      for key, method in LANE_METHODS.items()}

    def _hello(self, wait_s: float, connect_timeout_s: float) -> worker_pb2.HelloResponse:
        request = worker_pb2.HelloRequest(client_name=self.name, protocol=PROTOCOL, ephost_version=EPHOST_VERSION)
        try:
            if self.process is not None:
                return self._hello_launched(request, connect_timeout_s)
            return self.worker.Hello(request, timeout=wait_s or connect_timeout_s, metadata=self._metadata,
                                     wait_for_ready=wait_s > 0)
        except grpc.RpcError as e:
            code = e.code()
            # (a worker this process launched that does not answer died, or is stuck: _error says which)
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or self.process:
                raise self._error(e, self.worker.Hello) from None
            said = e.details() if code == grpc.StatusCode.UNAVAILABLE else \
                f"no answer within {wait_s or connect_timeout_s:g} s"
            raise unreachable(self.address, self.credentials, said) from None

    def _hello_launched(self, request, connect_timeout_s: float) -> worker_pb2.HelloResponse:
        """Hello to a worker this process launched, which said it listens: a first attempt that fails (a loaded
        machine, the connection not set up in time) is tried again up to `connect_timeout_s` while the worker
        lives; its death ends the wait at once, as a crash."""
        call = self.worker.Hello.future(request, timeout=connect_timeout_s, metadata=self._metadata,
                                        wait_for_ready=True)
        answered = threading.Event()
        call.add_done_callback(lambda _: answered.set())
        while not answered.wait(HELLO_POLL_S):
            if self.process.exited.is_set():
                call.cancel()
                raise self.process.crashed_error(_method_name(self.worker.Hello))
        return call.result()

    def call(self, method, request, *, timeout: float | None = None, wait_for_ready: bool = False):
        """Make one call with a deadline; any failure becomes an EpError (EpWorkerCrashed if the worker died)."""
        if self._closed:
            raise self._closed_error()
        lane_method = self._lane_methods.get(method)
        if lane_method is not None:
            try:
                return self.lane.call(lane_method, request, timeout or self.timeout_s)
            except LaneUnavailable:
                pass  # nothing was sent: the same call goes over gRPC
        try:
            return method(request, timeout=timeout or self.timeout_s, metadata=self._metadata,
                          wait_for_ready=wait_for_ready)
        except (grpc.RpcError, ValueError) as e:
            raise self._failed(e, method) from None

    def call_kept(self, method, key, parts: list, nbytes: int, request_of, timeout: float | None = None,
                  write=None):
        """A Compute or CopyTensors (`method`: the stub's method) the calling thread repeats (FastLane.call_kept),
        over the fast lane where it opens, else a plain call over gRPC: what came back (see call_kept), or the
        reply."""
        lane_method = self._lane_methods.get(method)
        if lane_method is not None and self.kept_calls and not self._closed:
            try:
                return self.lane.call_kept(lane_method, key, parts, nbytes, request_of, timeout or self.timeout_s,
                                           write)
            except LaneUnavailable:
                pass  # nothing was sent
        return self.call(method, request_of(), timeout=timeout)

    @property
    def keeps_calls(self) -> bool:
        """Whether calls made on this connection may be kept (call_kept, kept, repeat): a fast lane, kept calls on."""
        return self.lane is not None and self.kept_calls and not self._closed

    def kept(self, method, key):
        """The call this thread keeps for `key` on the lane (call_kept's), to be repeated with `repeat`; None where
        none is kept (no lane, kept calls off, or not kept yet on this thread's connection)."""
        lane_method = self._lane_methods.get(method)
        if lane_method is None or not self.kept_calls or self._closed:
            return None
        return self.lane.kept(lane_method, key)

    def repeat(self, kept, parts: list, nbytes: int, timeout: float | None = None, write=None):
        """A kept call (kept()'s) repeated: what came back (see call_kept); None where it no longer applies
        (nothing was sent)."""
        if self._closed:
            return None
        return self.lane.repeat(kept, parts, nbytes, timeout or self.timeout_s, write)

    def _failed(self, e: grpc.RpcError | ValueError, method) -> EpError:
        """The EpError for a gRPC call that raised `e`: a status, or gRPC's ValueError for a channel that another
        thread closed (its worker replaced, its EP unregistered) as the call began; any other ValueError is
        raised as it is."""
        if isinstance(e, grpc.RpcError):
            return self._error(e, method)
        if not self._closed:
            raise e
        return self._closed_error()

    def _error(self, e: grpc.RpcError, method) -> EpError:
        code, details = e.code(), e.details() or ""
        call = _method_name(method)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.UNKNOWN):
            crashed = self._crashed(call)
            if crashed is not None:
                return crashed
        if code == grpc.StatusCode.UNAVAILABLE:
            return EpWorkerUnavailable(f"worker at {self.address} is unavailable during {call}: {details}")
        if code == grpc.StatusCode.CANCELLED:  # this end cancels no call: its channel closed under it, or the worker
            return EpWorkerUnavailable(f"{call} was cancelled: the connection to the worker at {self.address} "
                                       f"closed, or the worker is shutting down ({details})")
        return error_for_status(code, details, reason_of(e.trailing_metadata()))

    def _closed_error(self) -> EpWorkerUnavailable:
        return EpWorkerUnavailable(f"connection to the worker at {self.address} is closed")

    def _lane_ticket(self) -> tuple[bytes, str]:
        reply = self.call(self.worker.OpenDataPlane, common_pb2.Empty())
        return reply.ticket, reply.socket

    def _crashed(self, call: str) -> EpError | None:
        """EpWorkerCrashed naming `call`, where this is a launched worker that died; else None."""
        return self.process.crashed_error(call) if self.process is not None else None

    def _lane_lost(self, call: str) -> EpError:
        """The error for a fast-lane call whose connection ended: the worker died, or closed it."""
        return self._crashed(call) or EpWorkerUnavailable(f"worker at {self.address} closed the fast lane during "
                                                          f"{call}")

    # --- shared memory ----------------------------------------------------------------------------

    @property
    def shares_memory(self) -> bool:
        return bool(self.fd_socket)

    def _prove_sharing(self, fd_socket: str) -> bool:
        if not fd_socket:
            return False
        try:
            ticket = self.call(self.worker.ProbeSharing, common_pb2.Empty()).ticket
        except EpError:
            return False
        return prove_sharing(fd_socket, ticket)

    def map_region(self, region_id: int) -> Region | None:
        """Map one of the worker's regions into this process, once; None where memory cannot be shared."""
        with self._regions_lock:
            if region_id in self._regions:
                return self._regions[region_id]
            region = None
            if self.fd_socket:
                try:
                    reply = self.call(self.worker.ExportRegion, worker_pb2.ExportRegionRequest(region=region_id))
                    fd, size = fetch_descriptor(self.fd_socket, reply.ticket)
                    region = Region.from_fd(fd, size, region_id)
                except EpError as e:
                    log.warning("cannot map a region of the worker at %s; using copies instead: %s", self.address, e)
            self._regions[region_id] = region
            return region

    def adopt_region(self, region_id: int, size: int, fd: int) -> None:
        """A region's descriptor the worker handed over unasked (with the first fast-lane reply naming it):
        mapped now, so that no ExportRegion call is needed. Owns `fd`."""
        with self._regions_lock:
            if self._regions.get(region_id) is not None:
                os.close(fd)
                return
            try:
                self._regions[region_id] = Region.from_fd(fd, size, region_id)  # it owns fd, mapped or not
            except (OSError, EpError) as e:  # the region is fetched by ticket when it is used
                log.debug("a region the worker handed over cannot be mapped: %s", e)

    def forget_region(self, region_id: int) -> None:
        # Tensors this process still holds keep the mapping (and so their data) alive; the rest goes with GC.
        with self._regions_lock:
            region = self._regions.pop(region_id, None)
        if region is not None:
            region.close(unmap=False)

    def write(self, allocator: int, buffer: int, data) -> None:
        """Send bytes into a worker buffer in chunks (for memory this process cannot map)."""
        view = memoryview(data).cast("B")
        progress = Progress(f"writing a tensor into the worker at {self.address}", len(view))

        def chunks():
            for start in range(0, len(view), CHUNK_BYTES):
                yield allocator_pb2.BufferChunk(allocator=allocator, buffer=buffer, offset=start,
                                                data=bytes(view[start:start + CHUNK_BYTES]))
                progress.advance(min(CHUNK_BYTES, len(view) - start))

        self.call(self.allocator.Write, chunks())
        progress.finish()

    def read(self, allocator: int, buffer: int, out: np.ndarray) -> None:
        """Fetch a worker buffer's bytes into `out` (a flat uint8 array) in chunks."""
        progress = Progress(f"reading a tensor from the worker at {self.address}", len(out))
        try:
            for chunk in self.allocator.Read(allocator_pb2.ReadRequest(
                    allocator=allocator, buffer=buffer, nbytes=len(out), chunk_bytes=CHUNK_BYTES),
                    timeout=self.timeout_s, metadata=self._metadata):
                out[chunk.offset:chunk.offset + len(chunk.data)] = np.frombuffer(chunk.data, np.uint8)
                progress.advance(len(chunk.data))
        except (grpc.RpcError, ValueError) as e:
            raise self._failed(e, self.allocator.Read) from None
        progress.finish()

    def close(self) -> None:
        try:
            if self._metadata and (self.process is None or self.process.returncode is None):
                self.call(self.worker.Goodbye, common_pb2.Empty(), timeout=5.0)
        except EpError as e:
            log.debug("goodbye to %s failed: %s", self.address, e)
        self._closed = True
        if self.lane is not None:
            self.lane.close()
        self.channel.close()
        with self._regions_lock:
            for region in self._regions.values():
                if region is not None:
                    region.close(unmap=False)  # a worker's death must not take the application's data
            self._regions.clear()


def _method_name(method) -> str:
    """'Allocator/Alloc' for the stub method of /ephost.v1.Allocator/Alloc."""
    raw = getattr(method, "_method", b"")
    raw = raw.decode() if isinstance(raw, bytes) else str(raw)
    return "/".join(raw.strip("/").split("/")[-2:]).replace("ephost.v1.", "") or "a call"
