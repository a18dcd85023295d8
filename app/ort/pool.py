"""The bridged device allocator's pool in the shim (shim.c, `ephost_pool_*`), as BridgeMemory calls it.

ORT allocates every bridged partition's outputs in the device memory and frees them after the run; through ctypes'
trampolines each is a call into Python, a large part of a tiny model's run through the bridge. The pool answers them
in C for the blocks Python made in the worker's memory: one ORT frees waits there, idle, for the next allocation of
its size. Python is asked for the rest: a size the pool holds no idle block of, a partition's output offered to ORT
in place (the thread's next allocation, `offer`), a block the pool does not keep.
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, c_int, c_size_t, c_void_p

from ephost.errors import EpInternal, EpResourceExhausted

SLOTS = 64  # the blocks one pool keeps, idle or held by ORT (the shim's EPHOST_POOL, checked as it loads)


class PoolFunctions:
    """The loaded shim's pool functions."""

    def __init__(self, shim: ctypes.CDLL):
        slots = c_size_t.in_dll(shim, "ephost_pool_slots").value
        if slots != SLOTS:
            raise EpInternal(f"the ONNX Runtime shim's pool keeps {slots} blocks where ephost.ort.pool says {SLOTS}")
        self.alloc = ctypes.cast(shim.ephost_pool_alloc, c_void_p).value
        self.free = ctypes.cast(shim.ephost_pool_free, c_void_p).value
        self.alloc_on_stream = ctypes.cast(shim.ephost_pool_alloc_on_stream, c_void_p).value
        self._new = shim.ephost_pool_new
        self._new.restype = c_void_p
        self._new.argtypes = [c_void_p, c_void_p, c_size_t]
        self._track = shim.ephost_pool_track
        self._track.restype = c_int
        self._track.argtypes = [c_void_p, c_void_p, c_size_t, POINTER(c_void_p)]
        self._drain = shim.ephost_pool_drain
        self._drain.restype = c_size_t
        self._drain.argtypes = [c_void_p, POINTER(c_void_p)]
        self._idle = shim.ephost_pool_idle_bytes
        self._idle.restype = c_size_t
        self._idle.argtypes = [c_void_p, POINTER(c_size_t)]
        self.offer = shim.ephost_pool_offer
        self.offer.restype = None
        self.offer.argtypes = [c_void_p]

    def new(self, python_alloc, python_free, idle_limit: int) -> int:
        """A pool (its address: an OrtAllocator to fill, then the pool's state) that hands what it does not hold
        to these two (ctypes functions of OrtAllocator's Alloc and Free, kept alive by the caller), and keeps at
        most `idle_limit` bytes idle."""
        address = self._new(ctypes.cast(python_alloc, c_void_p), ctypes.cast(python_free, c_void_p), idle_limit)
        if not address:
            raise EpResourceExhausted("no memory for the bridged device's allocator pool")
        return address

    def track(self, pool: int, address: int, nbytes: int) -> tuple[bool, int]:
        """Let the pool keep a block Python made for an Alloc (from its Free on): whether it does, and an idle
        block it let go to make room (0: none), which the caller frees."""
        evicted = c_void_p()
        kept = self._track(pool, address, nbytes, ctypes.byref(evicted))
        return bool(kept), evicted.value or 0

    def drain(self, pool: int) -> list[int]:
        """Let go of every block: the idle ones' addresses (the caller frees them); ORT's Free of the others goes
        to Python from now on."""
        idle = (c_void_p * SLOTS)()
        n = self._drain(pool, idle)
        return [idle[i] for i in range(n)]

    def idle(self, pool: int) -> tuple[int, int]:
        """The bytes of the blocks the pool holds idle, and how many."""
        blocks = c_size_t()
        nbytes = self._idle(pool, ctypes.byref(blocks))
        return nbytes, blocks.value
