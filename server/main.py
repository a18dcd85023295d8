"""The worker process: `ephost worker --ep NAME [--option KEY=VALUE ...] [--listen ADDR]`.

It serves one EP over gRPC, prints one JSON line with its address once it is ready, reports SERVING on
grpc.health.v1, drains and exits on SIGTERM, and, when launched with --exit-with-parent, exits as soon as
the process that launched it dies (it watches its stdin, whose other end only the launcher holds).
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Mapping

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ephost.errors import EpError
from ephost.eps import load_factory
from ephost.wire import SEND_TIMEOUT_S, SPIN_S
from ephost.fdshare import DescriptorServer, remove_socket_file, remove_stale_socket, socket_file
from ephost import tracing, wire
from ephost.worker_env import cache_dir as default_cache_root
from ephost.server.allocator_service import AllocatorService
from ephost.server import malloc
from ephost.server.blob_cache import BlobCache
from ephost.server.contract import SERVICES as CONTRACT
from ephost.server.ep_service import EpService
from ephost.server.factory_service import EpFactoryService
from ephost.server.fastlane import LaneServer, lane_path
from ephost.server.rpc import Dispatcher
from ephost.server.security import Security
from ephost.server.state import Limits, WorkerState
from ephost.server.stream_service import StreamService
from ephost.server.transfer_service import DataTransferService
from ephost.server.worker_service import WorkerService

log = logging.getLogger("ephost.worker")

SERVICES = tuple(CONTRACT)
DEFAULT_MAX_MESSAGE = wire.MAX_MESSAGE
# Server threads beyond those ephost's calls may take, so that health checks (and reflection) are answered
# whatever clients do.
SPARE_THREADS = 4
# After the drain's grace, how long the gRPC server may take to stop before the worker exits regardless
# (grpcio can hang in stop() after a malformed client stream).
STOP_SLACK_S = 2.0
# Once the last ephost call has returned, how long gRPC may still take to send its reply before the server
# stops: what else it holds open then is health Watch streams, which never end by themselves.
REPLY_SLACK_S = 1.0
# How long every call slot may stay taken before health says NOT_SERVING (and SERVING again once one is free).
FULL_S = 2.0


@dataclass
class Listen:
    address: str                   # what gRPC binds and what clients dial
    fd_socket: str | None          # descriptor socket, for clients on this host
    private_dir: str | None        # made by us, removed on exit
    private: bool = False          # a private directory is to be made (once the EP has loaded)
    # The socket files made here (path -> fdshare.socket_file), removed only while they are still these: a
    # worker started on the same address while this one drains makes its own.
    files: dict = field(default_factory=dict)

    def make_private_dir(self) -> None:
        """Make the private socket directory, where one is asked for. This waits until the EP has loaded: an
        EP (or a custom op library) that crashes while it loads leaves nothing behind."""
        if self.private and self.private_dir is None:
            self.private_dir = tempfile.mkdtemp(prefix="ephost-")  # mode 0700: only this user reaches the sockets
            path = os.path.join(self.private_dir, "worker.sock")
            self.address, self.fd_socket = f"unix://{path}", path + ".fds"

    def own_files(self, *paths: str | None) -> None:
        """Note the socket files at `paths` (those that are files) as this worker's, once it has made them."""
        for path in paths:
            if path and not path.startswith("\0"):
                self.files[path] = socket_file(path)

    def release_files(self) -> None:
        """Remove this worker's socket files, those still its own: the address is free for a successor."""
        for path, made in self.files.items():
            remove_socket_file(path, made)


def parse_listen(listen: str | None, insecure: bool, tls: bool = False) -> Listen:
    if listen is None:
        return Listen("", None, None, private=True)  # made by make_private_dir
    if listen.startswith("unix:"):
        path = listen[len("unix://"):] if listen.startswith("unix://") else listen[len("unix:"):]
        if not os.path.isabs(path):
            raise SystemExit(f"ephost worker: unix socket path must be absolute: {listen}")
        return Listen(f"unix://{path}", path + ".fds", None)
    # Clients on this host may still share memory with a TCP worker, through a descriptor socket in the abstract
    # namespace (nothing on disk to leave behind if the worker is killed; peers are checked by uid, tickets
    # are secrets), once a client proved it can use it (Worker.ProbeSharing).
    fd_socket = f"\0ephost-{secrets.token_hex(16)}"
    if tls:
        return Listen(listen, fd_socket, None)
    if not insecure:
        raise SystemExit("ephost worker: listening on TCP needs TLS (--tls-cert and --tls-key) or an explicit "
                         "--insecure (plain text). Without --listen the worker uses a private unix socket.")
    log.warning("listening on %s without TLS (--insecure)", listen)
    return Listen(listen, fd_socket, None)


def serve(ep: str, options: Mapping[str, str], listen: Listen, *, exit_with_parent: bool = False,
          max_message: int = DEFAULT_MAX_MESSAGE, threads: int = 16, security: Security = Security(),
          client_lease_s: float = 0.0, max_alloc_bytes: int | None = None, drain_grace_s: float = 5.0,
          cache_dir: str | None = None, cache_max_bytes: int = 10 << 30, model_dir: str | None = None,
          lane_spin_s: float = SPIN_S, metrics_listen: str | None = None,
          send_timeout_s: float = SEND_TIMEOUT_S) -> int:
    limits = Limits(max_alloc_bytes=max_alloc_bytes or default_max_alloc(), max_message=max_message)
    blobs = BlobCache(cache_dir or str(default_cache_root() / "blobs"), cache_max_bytes) if cache_max_bytes > 0 \
        else None
    try:
        code = _serve(ep, options, listen, exit_with_parent, threads, security, client_lease_s, limits,
                      drain_grace_s, blobs, model_dir, lane_spin_s, metrics_listen, send_timeout_s)
    finally:
        _remove_sockets(listen)
    log.info("exiting (code %d)", code)
    return code


def default_max_alloc() -> int:
    """Half the machine's memory: one request may not take more, whatever the arena's own limit."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def _serve(ep: str, options: Mapping[str, str], listen: Listen, exit_with_parent: bool, threads: int,
           security: Security, client_lease_s: float, limits: Limits, drain_grace_s: float,
           blobs: BlobCache | None = None, model_dir: str | None = None, lane_spin_s: float = SPIN_S,
           metrics_listen: str | None = None, send_timeout_s: float = SEND_TIMEOUT_S) -> int:
    max_message = limits.max_message
    tracing.configure_worker()
    try:
        factory = load_factory(ep, options, worker=True)
    except EpError as e:
        print(f"ephost worker: {e}", file=sys.stderr)
        # The launcher reads this line instead of the address: the error keeps its type on the client's side.
        print(json.dumps({"ephost": "error", "code": e.code.name, "message": str(e)}), flush=True)
        return 2
    malloc.configure()  # before the EP's sessions take memory (server/malloc.py)
    listen.make_private_dir()
    fd_server = DescriptorServer(listen.fd_socket) if listen.fd_socket else None
    state = WorkerState(ep, factory, options, fd_server, limits, launched=exit_with_parent, blobs=blobs,
                        model_dir=model_dir)
    stop = threading.Event()
    grace = [drain_grace_s]

    def request_stop(seconds: float = drain_grace_s) -> None:
        grace[0] = seconds
        stop.set()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads + SPARE_THREADS,
                                                    thread_name_prefix="ephost-rpc"),
                         interceptors=security.interceptors(),
                         options=[("grpc.max_receive_message_length", max_message),
                                  ("grpc.max_send_message_length", max_message),
                                  # clients ping every 20 s to notice a dead worker between calls
                                  ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                                  ("grpc.keepalive_permit_without_calls", 1)])
    # A launched worker has one client, which may use all of it; a shared one keeps a quarter from any one.
    ep_service, transfer_service = EpService(state), DataTransferService(state)
    dispatcher = Dispatcher.of(state, [EpFactoryService(state), ep_service, AllocatorService(state),
                                       StreamService(state), transfer_service,
                                       WorkerService(state, request_stop)],
                               per_client=threads if exit_with_parent else max(1, threads * 3 // 4),
                               total=threads)
    state.dispatcher = dispatcher  # the one entry point for a second transport (the same-host data plane)
    server.add_generic_rpc_handlers(dispatcher.grpc_handlers())
    if fd_server is not None:  # the fast lane, for clients on this host: the same dispatch, another transport
        state.lane = LaneServer(lane_path(listen.fd_socket), fd_server, dispatcher.dispatch, state.stats,
                                export=state.export_region, spin_s=lane_spin_s, max_length=max_message,
                                send_timeout_s=send_timeout_s,
                                kept={"Ep/Compute": ep_service.compute_kept,
                                      "DataTransfer/CopyTensors": transfer_service.copy_kept})
        listen.own_files(listen.fd_socket, state.lane.path)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # Server reflection, so that standard gRPC tools (grpcurl, grpc_cli) can list and call the services.
    reflection.enable_server_reflection((*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    if listen.address.startswith("unix://"):
        remove_stale_socket(listen.address[len("unix://"):])  # left by a worker that was killed
    try:
        port = (server.add_secure_port(listen.address, security.server_credentials()) if security.tls
                else server.add_insecure_port(listen.address))
    except RuntimeError as e:
        print(f"ephost worker: cannot listen on {listen.address}: {e}", file=sys.stderr)
        return 2
    address = listen.address if listen.address.startswith("unix:") or not listen.address.endswith(":0") \
        else f"{listen.address.rsplit(':', 1)[0]}:{port}"
    server.start()
    listen.own_files(listen.address[len("unix://"):] if listen.address.startswith("unix://") else None)
    for name in ("", *SERVICES):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    signal.signal(signal.SIGTERM, lambda *_: request_stop())
    signal.signal(signal.SIGINT, lambda *_: request_stop())
    if exit_with_parent:
        threading.Thread(target=_watch_parent, args=(listen, stop), name="ephost-parent", daemon=True).start()

    ready = {"ephost": "ready", "address": address, "pid": os.getpid(), "ep": ep}
    metrics = None
    if metrics_listen is not None:
        from ephost.server.metrics import serve_metrics  # (prometheus_client, only where asked for)
        ready["metrics"], metrics = serve_metrics(state, metrics_listen)
    print(json.dumps(ready), flush=True)
    log.info("listening on %s: EP %r, %s%s", address, ep, "TLS" if security.tls else "no TLS",
             ", a token required" if security.token_file else "")
    tick = min(0.5, client_lease_s / 4) if client_lease_s > 0 else 0.5
    serving, departures = True, 0
    while not stop.wait(tick):
        if client_lease_s > 0:
            state.clients.release_silent(client_lease_s)
        if departures != state.clients.departures:  # what the clients that left held goes back to the system
            departures = state.clients.departures
            malloc.trim()
        # A worker whose call slots have all been taken for a while cannot serve a new call: health says so.
        if serving != (dispatcher.admission.full_for() < FULL_S):
            serving = not serving
            log.warning("every call slot taken for %.0f s: health says NOT_SERVING" if not serving
                        else "a call slot is free again: health says SERVING", FULL_S)
            for name in ("", *SERVICES):
                health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING if serving
                                    else health_pb2.HealthCheckResponse.NOT_SERVING)

    # Drain: health says NOT_SERVING (clients watching it move on at once); the gRPC server stops listening and
    # the socket files go (a successor may take the address now, and new connections go to it or another
    # replica); new calls on open connections are turned away with a reason, on every transport, while the calls
    # under way, counted by the dispatcher whichever transport carries them, get the grace period to finish.
    # If grpcio does not stop in time, the worker exits regardless.
    started = time.monotonic()
    log.info("draining: %d call(s) under way, %d client(s); new calls are refused; grace %.1f s",
             dispatcher.admission.under_way(), len(state.clients), grace[0])
    state.draining.set()
    health_servicer.enter_graceful_shutdown()
    stopped = server.stop(grace[0])
    listen.release_files()
    idle = dispatcher.wait_idle(grace[0])
    left = max(0.0, started + grace[0] - time.monotonic())
    if idle:  # a handler has returned, its reply may still be on its way: not cancelled, not waited on for long
        left = min(left, REPLY_SLACK_S)
        server.stop(left)  # (what else it holds open: health Watch streams, which never end by themselves)
    if not stopped.wait(left + STOP_SLACK_S):
        log.warning("the gRPC server did not stop within %.1f s; exiting regardless", grace[0] + STOP_SLACK_S)
        _remove_sockets(listen)
        os._exit(0)
    if idle:
        log.info("drained in %.1f s: every call finished", time.monotonic() - started)
    else:
        log.warning("drained in %.1f s: %d call(s) still under way were cut at the grace",
                    time.monotonic() - started, dispatcher.admission.under_way())
    for client in state.clients.all():
        state.clients.goodbye(client, "the worker is exiting")
    if state.lane is not None:
        state.lane.close()
    factory.close()
    if fd_server is not None:
        fd_server.close()
    if metrics is not None:
        metrics.shutdown()
    tracing.shutdown()
    return 0


def _watch_parent(listen: Listen, stopping: threading.Event) -> None:
    """Stdin is a pipe whose write end only the launcher holds: EOF means the launcher is gone. Its clients
    went with it, so there is nothing to drain: exit at once. Shared memory goes with the process."""
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    if not stopping.is_set():
        log.warning("the launching process has gone; exiting")
        _remove_sockets(listen)
        os._exit(0)


def _remove_sockets(listen: Listen) -> None:
    if listen.private_dir:
        shutil.rmtree(listen.private_dir, ignore_errors=True)
        return
    listen.release_files()
