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

from ephost.errors import EpPermissionDenied, EpWorkerUnavailable

log = logging.getLogger(__name__)

TICKET_BYTES = 32
TICKET_TTL_S = 30.0
PROBE_BYTES = 32
_OK, _NO = b"OK", b"NO"
_PROBE = -1  # the descriptor slot of a ticket that asks for the client's segment instead of handing one out


class DescriptorServer:
    """Serves descriptors for tickets issued by `issue`, to processes of this user only."""

    def __init__(self, path: str):
        self.path = path
        self._tickets: dict[bytes, tuple[int, int, float]] = {}
        self._lock = threading.Lock()
        abstract = path.startswith("\0")  # Linux's abstract namespace: no file, gone with the process
        if not abstract:
            remove_stale_socket(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        if not abstract:
            os.chmod(path, 0o600)
        self._sock.listen(16)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="ephost-fdshare", daemon=True)
        self._thread.start()

    def issue(self, fd: int, size: int) -> bytes:
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            for old in [t for t, (_, _, exp) in self._tickets.items() if exp < now]:
                os.close(self._tickets.pop(old)[0])
            # A duplicate, so the region may be released before the ticket is redeemed.
            self._tickets[ticket] = (os.dup(fd), size, now + TICKET_TTL_S)
        return ticket

    def issue_probe(self) -> bytes:
        """A ticket with which a client hands over a segment it made, to show that both share this host."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            self._tickets[ticket] = (_PROBE, 0, time.monotonic() + TICKET_TTL_S)
        return ticket

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self._answer(conn)
                except OSError as e:
                    log.debug("descriptor request failed: %s", e)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)
        _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        ticket, fds, _, _ = socket.recv_fds(conn, TICKET_BYTES, 1)
        with self._lock:
            entry = self._tickets.pop(ticket, None) if uid == os.getuid() else None
        if entry is None or entry[2] < time.monotonic():
            conn.sendall(_NO)
            for fd in fds + ([entry[0]] if entry is not None and entry[0] != _PROBE else []):
                os.close(fd)
            return
        fd, size, _ = entry
        if fd == _PROBE:
            conn.sendall(_OK + _probe_digest(fds))
            return
        try:
            socket.send_fds(conn, [_OK + struct.pack("<q", size)], [fd])
        finally:
            os.close(fd)

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        with self._lock:
            for fd, _, _ in self._tickets.values():
                os.close(fd)
            self._tickets.clear()


def _probe_digest(fds: list[int]) -> bytes:
    """The hash of the first bytes of the segment a client handed over (zeros when there was none)."""
    import hashlib
    import mmap
    try:
        if len(fds) != 1:
            return bytes(32)
        with mmap.mmap(fds[0], PROBE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            return hashlib.sha256(mm[:PROBE_BYTES]).digest()
    except (OSError, ValueError):
        return bytes(32)
    finally:
        for fd in fds:
            os.close(fd)


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


def remove_stale_socket(path: str) -> None:
    """Remove a unix socket a dead process left behind (nothing answers on it); leave a live one alone."""
    import stat
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return
    except FileNotFoundError:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
            return  # somebody serves here
        except ConnectionRefusedError:
            os.unlink(path)
        except OSError:
            pass


def fetch_descriptor(path: str, ticket: bytes, timeout: float = 5.0) -> tuple[int, int]:
    """Redeem a ticket at a worker's descriptor socket: returns (fd, size)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            sock.sendall(ticket)
            msg, fds, _, _ = socket.recv_fds(sock, 16, 1)
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
