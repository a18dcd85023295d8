"""Handing a region's descriptor to the one peer it was made for.

gRPC cannot carry file descriptors, so a worker also listens on a unix socket beside its gRPC socket. A
client asks for a region over gRPC (Worker.ExportRegion) and gets a single-use, short-lived ticket; it
presents the ticket on this socket and receives the descriptor with SCM_RIGHTS. Regions never have a name,
so there is nothing in /dev/shm to leak or guess, and nothing an error message could reveal.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from ephost.errors import EpPermissionDenied, EpResourceExhausted, EpWorkerUnavailable

log = logging.getLogger(__name__)

TICKET_BYTES = 32
TICKET_TTL_S = 30.0
PROBE_BYTES = 32
IDLE_S = 2.0          # a connection that has not sent its ticket by then is dropped
MAX_CONNECTIONS = 32  # served at once; more are closed at once
BACKLOG = 1024        # connections queued until accepted: a client connecting to a full queue is refused
MAX_TICKETS = 128     # not yet presented, per owner: each may hold a descriptor, of which a process has a few thousand
SWEEP_S = 1.0         # expired tickets are closed at least this often, whatever else happens
COPY_BYTES_PER_S = 50 << 20  # the slowest a worker is expected to copy an imported file
_OK, _NO = b"OK", b"NO"


@dataclass
class _Ticket:
    fd: int | None          # a duplicate of the region's descriptor; None for a probe ticket
    size: int
    expires: float
    owner: Any = None       # who it dies with (a client id), see revoke()
    group: Any = None       # and what (the allocator the region belongs to)
    lane: bool = False      # binds a fast-lane connection to `owner` (ephost.server.fastlane); no descriptor
    sink: Any = None        # an import ticket: called with (a duplicate of) the one descriptor the peer attaches

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class DescriptorServer:
    """Serves descriptors for tickets issued by `issue`, to processes of this user only.

    Connections are served concurrently (an idle one cannot delay a valid ticket) and the peer's uid is
    checked before anything is read. A ticket dies when it is presented, when its time limit passes, and
    when its client or its allocator is released (`revoke`), whichever comes first."""

    def __init__(self, path: str):
        self.path = path
        self._tickets: dict[bytes, _Ticket] = {}
        self._lock = threading.Lock()  # guards _tickets
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)  # bounds the connections served at once
        self._sock = listen_unix(path, socket.SOCK_STREAM)
        self._sock.settimeout(SWEEP_S)  # the accept loop wakes to sweep expired tickets
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="ephost-fdshare", daemon=True)
        self._thread.start()

    def _issue(self, fd: int | None, size: int, owner: Any, group: Any = None, **kind) -> bytes:
        ticket = secrets.token_bytes(TICKET_BYTES)
        entry = _Ticket(fd, size, time.monotonic() + TICKET_TTL_S, owner, group, **kind)
        with self._lock:
            held = owner is not None and sum(e.owner == owner for e in self._tickets.values()) >= MAX_TICKETS
            if not held:
                self._tickets[ticket] = entry
        if held:
            entry.close()
            raise EpResourceExhausted(f"this client holds {MAX_TICKETS} tickets it has not presented; present them, "
                                      f"or let them expire ({TICKET_TTL_S:g} s), first")
        return ticket

    def issue(self, fd: int, size: int, *, owner: Any = None, group: Any = None) -> bytes:
        # A duplicate, so the region may be released before the ticket is redeemed.
        ticket = self._issue(os.dup(fd), size, owner, group)
        self.sweep()
        return ticket

    def issue_probe(self, *, owner: Any = None) -> bytes:
        """A ticket with which a client hands over a segment it made, to show that both share this host."""
        return self._issue(None, 0, owner)

    def issue_import(self, sink, *, owner: Any = None) -> bytes:
        """A ticket with which a client hands over one open file: `sink(fd)` takes it (and owns the descriptor;
        it raises to refuse it, and closes it then)."""
        return self._issue(None, 0, owner, sink=sink)

    def issue_lane(self, client_id: str) -> bytes:
        """A ticket that binds one data-plane connection to this client (redeemed with `redeem_lane`, on the
        lane's socket; this socket refuses it)."""
        return self._issue(None, 0, client_id, lane=True)

    def redeem_lane(self, ticket: bytes) -> str | None:
        """The client a live lane ticket was issued to, the ticket used up; None for any other ticket."""
        with self._lock:
            entry = self._tickets.get(ticket) if len(ticket) == TICKET_BYTES else None
            if entry is None or not entry.lane:
                return None
            del self._tickets[ticket]
        return entry.owner if entry.expires >= time.monotonic() else None

    def revoke(self, owner: Any) -> int:
        """Close the tickets issued to `owner` (a client that left); returns how many."""
        return self._drop(lambda e: e.owner == owner)

    def revoke_group(self, group: Any) -> int:
        """Close the tickets for regions of `group` (an allocator that was released); returns how many."""
        return self._drop(lambda e: e.group is group)

    def _drop(self, which) -> int:
        with self._lock:
            entries = [self._tickets.pop(t) for t, e in list(self._tickets.items()) if which(e)]
        for entry in entries:
            entry.close()
        return len(entries)

    def sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [self._tickets.pop(t) for t, e in list(self._tickets.items()) if e.expires < now]
        for entry in expired:
            entry.close()

    def outstanding(self) -> int:
        with self._lock:
            return len(self._tickets)

    def _serve(self) -> None:
        while not self._closed:
            self.sweep()
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()  # too many at once: whoever holds them waits, nobody else does
                continue
            threading.Thread(target=self._answer_and_close, args=(conn,), name="ephost-fdshare-conn",
                             daemon=True).start()

    def _answer_and_close(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._answer(conn)
        except OSError as e:
            log.debug("descriptor request failed: %s", e)
        finally:
            self._slots.release()

    def _answer(self, conn: socket.socket) -> None:
        # The peer first: a process of another user gets nothing, and is not even read from.
        if peer_uid(conn) != os.getuid():
            return
        conn.settimeout(IDLE_S)
        ticket, fds, _, _ = socket.recv_fds(conn, TICKET_BYTES, 1)
        try:
            with self._lock:
                entry = self._tickets.pop(ticket, None) if len(ticket) == TICKET_BYTES else None
            if entry is None or entry.lane or entry.expires < time.monotonic():
                if entry is not None:
                    entry.close()
                conn.sendall(_NO)
                return
            if entry.sink is not None:  # an import: the client hands over one file
                conn.sendall(_OK if len(fds) == 1 and _accept(entry.sink, fds[0]) else _NO)
                return
            if entry.fd is None:  # a probe: the client hands over its segment
                conn.sendall(_OK + _probe_digest(fds))
                return
            try:
                socket.send_fds(conn, [_OK + struct.pack("<q", entry.size)], [entry.fd])
            finally:
                entry.close()
        finally:
            for fd in fds:  # whatever a peer attached is closed here, answered or not
                os.close(fd)

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        with self._lock:
            entries = list(self._tickets.values())
            self._tickets.clear()
        for entry in entries:
            entry.close()


def _accept(sink, fd: int) -> bool:
    """Give a duplicate of `fd` to an import ticket's sink; False where it refuses it."""
    try:
        sink(os.dup(fd))
        return True
    except Exception as e:
        log.info("an imported file was refused: %s", e)
        return False


def hand_over_file(path: str, ticket: bytes, fd: int, timeout: float = 5.0) -> None:
    """Redeem an import ticket at a worker's descriptor socket, handing it `fd` (an open, read-only file). The
    answer may take a copy's time on top of `timeout` (a worker others share copies a regular file: server/files.py)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            socket.send_fds(sock, [ticket], [fd])
            sock.settimeout(timeout + os.fstat(fd).st_size / COPY_BYTES_PER_S)
            reply = _recv_exact(sock, 2)
        except OSError as e:
            raise EpWorkerUnavailable(f"cannot reach the worker's descriptor socket: {e.strerror or e}") from None
    if reply != _OK:
        raise EpPermissionDenied("the worker refused the file (ticket unknown or expired, not a regular file, a memfd "
                                 "it cannot seal against shrinking, or too large for its cache)")


def _probe_digest(fds: list[int]) -> bytes:
    """The hash of the first bytes of the segment a client handed over (zeros when there was none). Read with
    pread, never mapped: a segment the client can still shrink must not be able to fault this process."""
    import hashlib
    if len(fds) != 1:
        return bytes(32)
    try:
        data = os.pread(fds[0], PROBE_BYTES, 0)
    except OSError:
        return bytes(32)
    return hashlib.sha256(data).digest() if len(data) == PROBE_BYTES else bytes(32)


def prove_sharing(path: str, ticket: bytes, timeout: float = 5.0) -> bool:
    """Hand the worker a segment made here and check that it read what is in it."""
    import hashlib
    nonce = secrets.token_bytes(PROBE_BYTES)
    fd = os.memfd_create("ephost-probe", os.MFD_CLOEXEC)
    try:
        os.write(fd, nonce)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            socket.send_fds(sock, [ticket], [fd])
            reply = _recv_exact(sock, 2 + 32)
    except OSError:
        return False
    finally:
        os.close(fd)
    return reply[:2] == _OK and reply[2:] == hashlib.sha256(nonce).digest()


def listen_unix(path: str, kind: int) -> socket.socket:
    """A listening unix socket at `path` (mode 0600), or at a name in Linux's abstract namespace (a path starting
    with NUL: no file, gone with the process). A socket a dead process left there is removed first."""
    abstract = path.startswith("\0")
    if not abstract:
        remove_stale_socket(path, kind)
    sock = socket.socket(socket.AF_UNIX, kind)  # close-on-exec, as Python makes them
    sock.bind(path)
    if not abstract:
        os.chmod(path, 0o600)
    sock.listen(BACKLOG)
    return sock


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED)."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid


def remove_stale_socket(path: str, kind: int = socket.SOCK_STREAM) -> None:
    """Remove a unix socket a dead process left behind (nothing answers on it); leave a live one alone."""
    import stat
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return
    except FileNotFoundError:
        return
    with socket.socket(socket.AF_UNIX, kind) as probe:
        try:
            probe.connect(path)
            return  # somebody serves here
        except ConnectionRefusedError:
            os.unlink(path)
        except OSError:
            pass


def socket_file(path: str) -> tuple[int, int] | None:
    """Which file a socket path names now ((device, inode)), to remove it later only if it is still that one: a
    successor bound on the same path while this process drained has a file of its own there."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, ValueError):  # (ValueError: a name in the abstract namespace)
        return None
    return st.st_dev, st.st_ino


def remove_socket_file(path: str, made: tuple[int, int] | None) -> None:
    """Remove the socket file at `path` if it is still the one this process made (`made`, from socket_file)."""
    if made is not None and socket_file(path) == made:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def fetch_descriptor(path: str, ticket: bytes, timeout: float = 5.0) -> tuple[int, int]:
    """Redeem a ticket at a worker's descriptor socket: returns (fd, size)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            sock.sendall(ticket)
            msg, fds, _, _ = socket.recv_fds(sock, 16, 1, socket.MSG_CMSG_CLOEXEC)
        except OSError as e:
            raise EpWorkerUnavailable(f"cannot reach the worker's descriptor socket: {e.strerror or e}") from None
    if msg[:2] != _OK or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise EpPermissionDenied("the worker refused to share a memory region (ticket unknown or expired)")
    return fds[0], struct.unpack("<q", msg[2:10])[0]


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data
