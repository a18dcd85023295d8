"""The worker's end of the fast lane: a unix SOCK_SEQPACKET listener beside the gRPC socket, for clients on
this host. Each connection is checked (same uid, by SO_PEERCRED), then bound to one gRPC client by a
single-use ticket that client got from Worker.OpenDataPlane; a thread of its own then reads a frame, runs the
call with the same handler the gRPC method runs (same handles, checks, errors, stats, drain, lease) and
writes the reply. No pool, no hand-off: the thread that reads is the thread that answers. A client that asks
for them gets shared slots with the ticket's answer (ephost/lane_slots.py): frames that fit a packet then pass
through memory both ways, without a system call while the reader polls.

A frame that cannot be read closes its connection (what follows it cannot be trusted to start a frame); a
frame that can be read but names an unknown method or carries a bad message gets a typed error back, and
the connection serves on. Either way the worker keeps serving every other connection.
"""
from __future__ import annotations

import errno
import functools
import logging
import math
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from ephost import lane_slots
from ephost.errors import EpDeadlineExceeded, EpError, EpInvalidArgument, public_message
from ephost.fastlane import (BY_ID, KEPT, KEPT_WRITING, MAX_LENGTH, METHODS, PACKET, REPLY_REGIONS, STATUS_OK,
                             TICKET_NO, TICKET_OK, FrameError, FrameReader, configure, encode_error, send_frame,
                             send_parts, send_regions)
from ephost.fdshare import TICKET_BYTES, DescriptorServer, listen_unix, peer_uid, remove_socket_file, socket_file
from ephost.server.kept_calls import KeptCalls
from ephost.server.stats import WorkerStats
from ephost.v1 import ep_pb2
from ephost.wire import SEND_TIMEOUT_S

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
# Connections served at once (bound or still handshaking), and bound to one client: past the first a new one is
# closed at once; past the second its ticket is refused (that client's calls go over gRPC).
MAX_CONNECTIONS = 256
MAX_CLIENT_CONNECTIONS = 64
# (method key "Service/Method", request, client id, deadline in time.monotonic() or None, *, lane=True,
#  respond=callable that sends the reply, ran=the early wake or None) -> reply;
# raises EpError
Dispatch = Callable[..., object]


def _deadline(frame, name: str) -> float | None:
    """The call's deadline (time.monotonic()) from its frame's timeout; None: none."""
    if not (math.isfinite(frame.timeout_s) and frame.timeout_s >= 0):
        raise EpInvalidArgument(f"a frame of {name} whose timeout is not a finite number of seconds >= 0")
    return time.monotonic() + frame.timeout_s if frame.timeout_s > 0 else None


def lane_path(fd_socket: str) -> str:
    """The data-plane socket beside a descriptor socket (a file, or a name in the abstract namespace)."""
    return (fd_socket[:-len(".fds")] if fd_socket.endswith(".fds") else fd_socket) + ".lane"


class LaneServer:
    def __init__(self, path: str, tickets: DescriptorServer, dispatch: Dispatch, stats: WorkerStats,
                 export: Callable[[str, int], tuple[int, int] | None] | None = None, spin_s: float = 0.0,
                 kept: dict[str, Callable] | None = None, max_length: int = MAX_LENGTH,
                 send_timeout_s: float = SEND_TIMEOUT_S):
        """`dispatch` runs a call as the gRPC path does. `export(client_id, region)`: a duplicate descriptor of
        one of that client's shareable regions and its size, or None; the region rides along with the first
        reply on a connection that names it. `kept`: by method ("Ep/Compute"), the handler that runs a kept call
        of it repeated (server/kept_calls.py: `handler((kept call, payload), call)`), dispatched as the method;
        calls of other methods, and all without it, are not kept. `max_length`: the longest payload a frame may
        carry. `send_timeout_s`: how long a send may wait for its peer to read (SO_SNDTIMEO)."""
        self.path = path
        self._max_length = max_length
        self._send_timeout_s = send_timeout_s
        self._kept = kept or {}
        self._export = export
        self._spin_s = spin_s  # how long a connection's thread polls for the next request before it sleeps
        self._tickets = tickets
        self._dispatch = dispatch
        self._stats = stats
        self._lock = threading.Lock()  # guards the sets below, and every shutdown of a connection in them
        self._connections: set[socket.socket] = set()
        self._by_client: dict[str, set[socket.socket]] = {}  # the connections bound to each client
        self._client_of: dict[socket.socket, str] = {}         # and the other way round
        self._closed = False
        self._sock = listen_unix(path, socket.SOCK_SEQPACKET)
        self._file = socket_file(path)  # removed at close only while it is still this one's
        threading.Thread(target=self._accept, name="ephost-lane", daemon=True).start()

    def issue(self, client_id: str) -> bytes:
        """A ticket that binds one connection to this client."""
        return self._tickets.issue_lane(client_id)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                full = len(self._connections) >= MAX_CONNECTIONS
                if not full:
                    self._connections.add(conn)
            if full:
                log.warning("fast lane: %d connections already; closing a new one", MAX_CONNECTIONS)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="ephost-lane-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        peer = None
        try:
            peer = self._bind(conn)
            if peer is not None:
                self._stats.add(fast_lane_connections=1)
                self._loop(peer)
        except FrameError as e:
            log.warning("fast lane: closing a connection that sent %s", e)
            try:
                self._error(_Peer(conn, ""), 0, grpc.StatusCode.INVALID_ARGUMENT,
                            f"fast lane: {e}; connection closed")
                _drain(conn)
            except OSError:
                pass
        except BlockingIOError:  # SO_SNDTIMEO: the peer reads nothing
            log.warning("fast lane: closing a connection whose peer read nothing for %.0f s", self._send_timeout_s)
        except OSError as e:  # the peer went (quietly); anything else is worth a line
            log.log(logging.DEBUG if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.EBADF) else logging.WARNING,
                    "fast lane connection ended: %s", e)
        except Exception:  # a bug: this connection goes, the worker serves on, and the log says why
            log.exception("fast lane: a connection's thread failed; closing the connection")
        finally:
            with self._lock:
                self._connections.discard(conn)
                client_id = self._client_of.pop(conn, None)
                if client_id is not None:
                    self._by_client[client_id].discard(conn)
                    if not self._by_client[client_id]:
                        del self._by_client[client_id]
            conn.close()
            if peer is not None and peer.slots is not None:
                peer.slots.close()

    def _bind(self, conn: socket.socket) -> "_Peer | None":
        """The client a new connection speaks for (same uid, and a ticket issued to that client), and its
        slots where it asked for them (the ticket followed by lane_slots.ASK)."""
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        uid = peer_uid(conn)
        message = conn.recv(TICKET_BYTES + len(lane_slots.ASK))
        ticket, ask = message[:TICKET_BYTES], message[TICKET_BYTES:]
        asked = (b"", lane_slots.ASK) if lane_slots.SUPPORTED else (b"",)
        client_id = self._tickets.redeem_lane(ticket) if uid == os.getuid() and ask in asked else None
        if client_id is not None:
            with self._lock:
                mine = self._by_client.setdefault(client_id, set())
                crowded = len(mine) >= MAX_CLIENT_CONNECTIONS
                if not crowded:
                    mine.add(conn)
                    self._client_of[conn] = client_id
        if client_id is None or crowded:
            log.warning("fast lane: refused a connection (%s)", "another user" if uid != os.getuid()
                        else "ticket unknown, used or expired" if client_id is None
                        else f"its client has {MAX_CLIENT_CONNECTIONS} already")
            conn.send(TICKET_NO)
            return None
        configure(conn)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self._send_timeout_s))
        slots = _grant_slots(conn) if ask else None
        if slots is None:
            conn.send(TICKET_OK)
        conn.settimeout(None)
        return _Peer(conn, client_id, slots)

    def _loop(self, peer: "_Peer") -> None:
        reader = FrameReader(peer.conn, spin_s=self._spin_s, slots=peer.slots, max_length=self._max_length)
        dispatch = self._dispatch
        kept = KeptCalls()
        # By kept method, its handler and what sends its replies: made once for the connection, not per call.
        kept_methods = {name: (handler, self._kept_responder(peer, METHODS[name].id))
                        for name, handler in self._kept.items()}
        # A Compute, whole or kept, wakes its caller as its EP finishes where the caller sleeps (lane_slots.py):
        # as its kernel ends, where the EP says so (ComputeCall.kernel_ran), else as compute returns (Call.ran).
        # Handed on as its bound method, which costs less to call than the object.
        early = _EarlyWake(peer.slots) if peer.slots is not None else None
        ran = early.wake if early is not None else None
        while True:
            frame = reader.read()
            if frame is None:
                return
            if early is not None:
                early.woken = False  # a new call
            if (frame.method == KEPT or frame.method == KEPT_WRITING) and kept_methods:
                self._serve_kept(peer, frame, kept, kept_methods, reader, ran)
                continue
            method = BY_ID.get(frame.method)
            if method is None:
                # Answered as method 0, never echoed: an echoed REGIONS id would read as a descriptor hand-over.
                self._error(peer, 0, grpc.StatusCode.UNIMPLEMENTED, f"the fast lane carries no method {frame.method}")
                continue
            try:
                request = method.request.FromString(frame.payload)
            except Exception:  # DecodeError, and RuntimeError from the upb parser on deep nesting
                self._error(peer, frame.method, grpc.StatusCode.INVALID_ARGUMENT,
                            f"a frame of {method.name} whose message cannot be parsed")
                continue

            # (A Compute with run options is never kept: a kept call's repeats carry none.)
            keeps = method.name in self._kept and request.keep_call and \
                not (type(request) is ep_pb2.ComputeRequest and request.HasField("run_options"))
            if keeps and request.replace_kept:  # as it is read, whatever comes of the call (the caller forgot it)
                kept.let_go(request.replace_kept)

            def respond(reply):
                if keeps:
                    reply.kept_call = kept.keep(method.name, request, reply)
                    if reply.kept_call:
                        self._stats.add(calls_kept=1)
                self._send_reply(peer, frame.method, reply)

            try:
                dispatch(method.name, request, peer.client_id, _deadline(frame, method.name), lane=True,
                         respond=respond, ran=ran)
            except EpError as e:
                self._error(peer, frame.method, e.code, str(e), getattr(e, "reason", ""))

    def _serve_kept(self, peer: "_Peer", frame, kept: KeptCalls, kept_methods: dict[str, tuple[Callable, Callable]],
                    reader: FrameReader, ran: Callable[[], bool] | None) -> None:
        """A kept call repeated: the outputs' bytes back, or the whole reply where their layout changed. Of a
        KEPT_WRITING frame, no buffer is read before the caller says its inputs are written."""
        try:
            deadline = _deadline(frame, "kept call")
            call = kept.get(frame.payload)
            written = None
            if frame.method == KEPT_WRITING:
                if not frame.slot:
                    raise EpInvalidArgument("a KEPT_WRITING frame goes through the connection's slots, not its "
                                            "socket")
                written = functools.partial(_inputs_written, reader, peer.slots.taken, deadline)
            handler, respond = kept_methods[call.method]
            self._dispatch(call.method, (call, frame.payload, written), peer.client_id, deadline, lane=True,
                           handler=handler, respond=respond, ran=ran)
        except FrameError:
            raise  # what the connection carries next cannot be trusted: it is closed (_serve)
        except EpError as e:
            self._error(peer, KEPT, e.code, str(e), getattr(e, "reason", ""))

    def _kept_responder(self, peer: "_Peer", method: int) -> Callable[[object], None]:
        """What sends the replies of a connection's kept calls of one method (`method`: its id): a KeptReply as a
        KEPT frame, a whole reply as a frame of the method."""
        def respond(reply):
            if type(reply) is tuple:  # a KeptReply
                parts, nbytes, regions = reply
                if regions and self._export is not None:  # (most replies name none)
                    new = [r for r in regions if r not in peer.sent]
                    if new:
                        self._hand_over(peer, new)
                send_parts(peer.conn, KEPT, 0.0, parts, nbytes, peer.slots)
            else:
                self._send_reply(peer, method, reply)
        return respond

    def _send_reply(self, peer: "_Peer", method: int, reply) -> None:
        named = REPLY_REGIONS.get(method)
        if named is not None and self._export is not None:
            regions = [r for r in named(reply) if r not in peer.sent]
            if regions:
                self._hand_over(peer, regions)
        send_frame(peer.conn, method, STATUS_OK, 0.0, reply.SerializeToString(), peer.slots)

    def _hand_over(self, peer: "_Peer", regions: list[int]) -> None:
        batch = []
        try:
            for region in dict.fromkeys(regions):
                exported = self._export(peer.client_id, region)
                if exported is not None:
                    batch.append((region, exported[1], exported[0]))
            if batch:
                send_regions(peer.conn, batch, peer.slots)
                peer.sent.update(region for region, _, _ in batch)
        finally:
            for _, _, fd in batch:
                os.close(fd)

    @staticmethod
    def _error(peer: "_Peer", method: int, code: grpc.StatusCode, details: str, reason: str = "") -> None:
        send_frame(peer.conn, method, code.value[0], 0.0, encode_error(public_message(details), reason), peer.slots)

    def close_client(self, client_id: str) -> int:
        """End the connections bound to a client that left: their threads see end of file and let go of what they
        kept (kept calls hold tensors over the client's buffers). Returns how many."""
        with self._lock:
            return _shut_down(self._by_client.get(client_id, ()))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            _shut_down(self._connections)
        self._sock.close()
        remove_socket_file(self.path, self._file)


class _EarlyWake:
    """A connection's early wake (lane_slots.Slots.wake_early), written at most once a call: asked for by the
    EP as its kernel ends (ComputeCall.kernel_ran) and by the handler as compute returns (Call.ran), both through
    `wake`; True where the call's caller was woken. Set for the connection's thread once, not around each
    compute."""

    __slots__ = ("_wake_early", "woken")

    def __init__(self, slots: lane_slots.Slots):
        self._wake_early = slots.wake_early
        self.woken = False

    def wake(self) -> bool:
        if not self.woken:  # a caller that polled as the kernel ended may be asleep by the time compute returns
            self.woken = self._wake_early()
        return self.woken


def _inputs_written(reader: FrameReader, count: int, deadline: float | None) -> None:
    """Wait for the inputs of the KEPT_WRITING frame `count` (ephost/fastlane.py)."""
    if not reader.await_written(count, deadline):
        raise EpDeadlineExceeded("the caller did not write the inputs its call named within the call's deadline")


def _grant_slots(conn: socket.socket) -> "lane_slots.Slots | None":
    """Make a connection's slots and its early wake, and answer its ticket with them; None (nothing sent) where
    the slots cannot be made: the lane still works, its frames on the socket (and without the wake, its caller
    woken by the reply)."""
    try:
        fd, mapping = lane_slots.create()
    except OSError as e:
        log.warning("fast lane: no shared slots for a connection (%s); its frames go on the socket", e.strerror or e)
        return None
    try:
        wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    except OSError as e:
        log.warning("fast lane: no early wake for a connection (%s); its caller wakes on the reply", e.strerror or e)
        wake = None
    try:
        socket.send_fds(conn, [TICKET_OK], [fd] if wake is None else [fd, wake])
    except OSError:
        mapping.close()
        if wake is not None:
            os.close(wake)
        raise
    finally:
        os.close(fd)
    return lane_slots.Slots(mapping, conn, worker=True, wake=wake)


def _shut_down(connections) -> int:
    """Shut connections down (each one's thread sees end of file and closes it); under LaneServer's lock, so that
    no connection is shut down after its thread closed it (its number may be another's by then)."""
    for conn in connections:
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    return len(connections)


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))


def _drain(conn: socket.socket, packets: int = 64) -> None:
    """Read what the peer sent and this end will not (a doorbell, the rest of a broken frame; a few packets at
    most): a unix socket closed with unread packets resets its peer, who would then never read the error
    frame sent just before."""
    conn.setblocking(False)
    for _ in range(packets):
        try:
            if not conn.recv(PACKET):
                return
        except (BlockingIOError, InterruptedError):
            return


@dataclass
class _Peer:
    """One connection's end in the worker: its socket and slots (None: frames on the socket only), the client
    it speaks for, and the regions whose descriptors it was handed."""
    conn: socket.socket
    client_id: str
    slots: "lane_slots.Slots | None" = None
    sent: set[int] = field(default_factory=set)
