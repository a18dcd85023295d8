"""Per-client handle tables. Every handle belongs to the client (connection) that made it: another client
asking for it gets NOT_FOUND, and a client's handles are released together when it leaves."""
from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ephost.errors import EpFailedPrecondition, EpNotFound, EpUnknownClient

log = logging.getLogger(__name__)

NAME_CHARS = 200  # of the name a client gives itself, what logs and errors quote
# Kinds of handle, and how each is released when its client leaves (in this order).
KINDS = ("notification", "stream", "compute_info", "ep", "data_transfer", "buffer", "allocator", "file")


@dataclass
class BufferEntry:
    allocator: Any
    buffer: Any
    # Its bytes were made in this worker (by a Compute, or copied by CopyTensors from such a buffer), not
    # written by the client: a Compute that reads it counts a resident input.
    produced: bool = False


@dataclass
class ClientState:
    client_id: str
    name: str
    models: dict[str, Any] = field(default_factory=dict)  # content hash -> GraphIndex of a model it sent
    last_seen: float = field(default_factory=time.monotonic)
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _tables: dict[str, dict[int, Any]] = field(default_factory=lambda: {k: {} for k in KINDS})
    _lock: threading.Lock = field(default_factory=threading.Lock)  # guards _ids, and _tables' changes

    def add(self, kind: str, obj: Any) -> int:
        with self._lock:
            handle = next(self._ids)
            self._tables[kind][handle] = obj
            return handle

    def get(self, kind: str, handle: int) -> Any:
        try:
            return self._tables[kind][handle]  # one step of a table's, atomic without the lock (as under it)
        except KeyError:
            raise EpNotFound(f"unknown {kind.replace('_', ' ')} handle {handle} (never made by this "
                             "client, or already released)") from None

    def pop(self, kind: str, handle: int) -> Any:
        with self._lock:
            try:
                return self._tables[kind].pop(handle)
            except KeyError:
                raise EpNotFound(f"unknown {kind.replace('_', ' ')} handle {handle} (never made by this "
                                 "client, or already released)") from None

    def items(self, kind: str) -> list[tuple[int, Any]]:
        with self._lock:
            return list(self._tables[kind].items())

    def count(self, kind: str) -> int:
        with self._lock:
            return len(self._tables[kind])

    def drain(self) -> list[tuple[str, Any]]:
        """Remove every handle, in release order."""
        with self._lock:
            out = [(kind, obj) for kind in KINDS for obj in self._tables[kind].values()]
            for table in self._tables.values():
                table.clear()
            self.models.clear()
            return out


class ClientRegistry:
    def __init__(self, release: Callable[[str, Any], None], left: Callable[[ClientState], None] = lambda c: None):
        self._clients: dict[str, ClientState] = {}
        self._lock = threading.Lock()  # guards _clients' changes, and reads of more than one step
        self._release = release
        self._left = left  # told when a client is gone, after its handles are released
        self.departures = 0  # clients gone so far (a worker trims its heap after some went: server/malloc.py)

    def hello(self, name: str) -> ClientState:
        client = ClientState(secrets.token_hex(16), name[:NAME_CHARS])
        with self._lock:
            self._clients[client.client_id] = client
        log.info("client %r connected (%d connected)", name, len(self._clients))
        return client

    def lookup(self, client_id: str | None) -> ClientState:
        """The client a call's client id names (ephost.wire.CLIENT_ID_KEY in gRPC metadata)."""
        if not client_id:
            raise EpFailedPrecondition("no client id in the call's metadata; call Worker.Hello first")
        client = self._clients.get(client_id)  # one step, atomic without the lock (as under it), on every call
        if client is None:
            raise EpUnknownClient("unknown client (the worker may have restarted, or released this client "
                                       "after its lease ran out); call Worker.Hello again")
        client.last_seen = time.monotonic()
        return client

    def release_silent(self, lease_s: float) -> int:
        """Release the clients not heard from for `lease_s` seconds; returns how many."""
        now = time.monotonic()
        with self._lock:
            silent = [c for c in self._clients.values() if now - c.last_seen > lease_s]
        for client in silent:
            self.goodbye(client, f"silent for {now - client.last_seen:.0f} s: its handles released")
        return len(silent)

    def goodbye(self, client: ClientState, why: str = "it said goodbye") -> None:
        with self._lock:
            known = self._clients.pop(client.client_id, None) is not None
            left = len(self._clients)
        self.release_all(client)
        self._left(client)
        with self._lock:
            self.departures += 1
        if known:
            log.info("client %r gone (%s; %d connected)", client.name, why, left)

    def release_all(self, client: ClientState) -> None:
        for kind, obj in client.drain():
            try:
                self._release(kind, obj)
            except Exception:
                log.exception("client %r: releasing its %s failed", client.name, kind)

    def all(self) -> list[ClientState]:
        with self._lock:
            return list(self._clients.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._clients)
