"""The C heap of a worker that serves generations of clients: what a client's sessions, arenas and calls took is
given back to the system when the client goes, not kept by the allocator.

glibc raises its mmap threshold each time a large block that was mapped is freed (up to 32 MiB), so that once the
first client's ORT sessions go, later sessions' arenas and weights come from the heaps of its per-thread arenas,
where what is freed fragments and never shrinks: left so, a shared worker's RSS grows with every generation of
clients (bench/soak.py runs such generations). A fixed threshold keeps large blocks mapped, each returned whole
when freed; what small blocks leave free is trimmed once clients have left. Elsewhere than glibc both are no-ops.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3       # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD = 1 << 20    # blocks this large or larger are mapped on their own, and unmapped when freed


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def configure() -> bool:
    """Fix the mmap threshold (glibc no longer moves it); True where it was set."""
    if _LIBC is None:
        return False
    if not _LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        log.warning("could not fix the C heap's mmap threshold; RSS may grow with generations of clients")
        return False
    return True


def trim() -> None:
    """Give the free pages of every heap back to the system (malloc_trim)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
