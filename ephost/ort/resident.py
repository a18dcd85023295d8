"""Copies of ORT's tensors kept in the worker's memory from one Compute to the next: a decoder's KV cache.

onnxruntime-genai keeps the KV cache in its own memory (an EP it does not know gets its CPU allocator) and hands
it to every step's Compute whole: as the past, and with its shared buffer as the present output too, in the same
memory. Sent whole every step, the bytes a token costs grow with the context. Instead the bridge keeps, in the
worker's shared memory, a copy of each large tensor a Compute wrote into ORT's memory, by the address of ORT's
tensor. A later Compute given ORT's tensor at that address sends only the 64-byte chunks that differ from the copy
(none, where nothing but the bridge wrote it), and the worker reads the copy by handle; after the Compute, only the
chunks of the worker's result that differ from ORT's tensor are copied into it.

Chunks are compared, never trusted: the bridge cannot see who else wrote ORT's memory between two Computes, so
each side is read whole (at memory speed) and only what changed is copied and counted. A copy belongs to one
worker: after a restart the next Compute sends the tensor whole again.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from collections import OrderedDict
from ctypes import c_size_t, c_void_p
from typing import TYPE_CHECKING, Callable

import numpy as np

from ephost.client.handles import owned
from ephost.errors import EpError
from ephost.memory import Buffer

if TYPE_CHECKING:
    from ephost.client.environment import Registration

log = logging.getLogger(__name__)

MIN_BYTES = 4096  # smaller tensors travel inline with the call: a buffer and its compare would cost more
LIMIT_BYTES = 1 << 30  # worker memory the copies of one registration may hold; the least recently used go first


class Sync:
    """The shim's `ephost_ort_sync`: dst made equal to src by copying the 64-byte chunks that differ."""

    def __init__(self, shim: ctypes.CDLL):
        self._sync = shim.ephost_ort_sync
        self._sync.restype = c_size_t
        self._sync.argtypes = [c_void_p, c_void_p, c_size_t]

    def __call__(self, dst: np.ndarray, src: np.ndarray) -> int:
        """The bytes copied; both of one size, C-contiguous."""
        return self._sync(dst.ctypes.data, src.ctypes.data, dst.nbytes)


class KeptCopies:
    """One registration's copies, by the address of ORT's tensor they copy. Thread-safe; a Compute brings in and
    out the tensors of its own call (two calls at once on one tensor would race in ORT already)."""

    def __init__(self, registration: Callable[[], "Registration | None"], sync: Sync,
                 limit: int = LIMIT_BYTES):
        self._registration, self._sync, self.limit = registration, sync, limit
        self._copies: OrderedDict[int, Buffer] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()  # guards _copies and _bytes

    @property
    def nbytes(self) -> int:
        """Worker memory the copies hold."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._copies)

    def bring_in(self, address: int, array: np.ndarray) -> tuple[Buffer, int] | None:
        """The worker's copy of ORT's tensor at `address` (its bytes: `array`), made equal to it, and the bytes
        that took; None where there is none (or it is a dead worker's, or of another size)."""
        buffer = self._take(address, array.nbytes)
        if buffer is None:
            return None
        copied = self._sync(buffer.host_view(), _bytes_of(array))
        self._put(address, buffer)
        return buffer, copied

    def bring_out(self, address: int, array: np.ndarray, buffer: Buffer) -> int:
        """ORT's tensor at `address` (`array`, writable) made equal to the worker's result in `buffer` (mapped
        here), which becomes the copy of it; the bytes copied."""
        copied = self._sync(_bytes_of(array), buffer.host_view())
        old = self._take(address, None)
        if old is not None and old is not buffer:
            self._free([old])
        self._put(address, buffer)
        return copied

    def forget(self) -> None:
        """Every copy freed (the registration closing, say)."""
        with self._lock:
            gone = list(self._copies.values())
            self._copies.clear()
            self._bytes = 0
        self._free(gone)

    # --- bookkeeping ---

    def _take(self, address: int, nbytes: int | None) -> Buffer | None:
        """The copy at `address`, out of the table (put back by the caller), where it can still be used."""
        link = self._link()
        with self._lock:
            buffer = self._copies.pop(address, None)
            if buffer is None:
                return None
            self._bytes -= buffer.nbytes
        if link is None or not owned(buffer, link):
            self._drop_dead(link)
            return None
        if nbytes is not None and buffer.nbytes != nbytes:
            self._free([buffer])
            return None
        return buffer

    def _put(self, address: int, buffer: Buffer) -> None:
        evicted = []
        with self._lock:
            self._copies[address] = buffer
            self._bytes += buffer.nbytes
            while self._bytes > self.limit and len(self._copies) > 1:
                _, old = self._copies.popitem(last=False)
                self._bytes -= old.nbytes
                evicted.append(old)
        self._free(evicted)

    def _drop_dead(self, link) -> None:
        """A copy found in a worker gone (restarted): the others of that worker go too."""
        with self._lock:
            dead = [a for a, b in self._copies.items() if link is None or not owned(b, link)]
            for a in dead:
                self._bytes -= self._copies.pop(a).nbytes

    def _link(self):
        registration = self._registration()
        return registration.link if registration is not None else None

    def _free(self, buffers: list[Buffer]) -> None:
        registration, link = self._registration(), self._link()
        mine = [b for b in buffers if link is not None and owned(b, link)]
        if not mine:
            return
        try:
            allocator = registration.session_allocator()
            for buffer in mine:
                allocator.free_later(buffer)
        except EpError as e:  # the registration is closing: its worker takes its memory with it
            log.debug("freeing kept copies: %s", e)


def _bytes_of(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)
