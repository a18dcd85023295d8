"""Memory regions and the buffers carved out of them.

A region is either anonymous shared memory (a memfd: it has no name in any filesystem, both peers map it,
and it disappears when the last descriptor and mapping close, so a crash cannot leak it) or private memory
that only its own process can address. Every (offset, nbytes) a peer names is checked here, with
arithmetic that cannot overflow, before anything is mapped or copied.
"""
from __future__ import annotations

import ctypes
import fcntl
import itertools
import mmap
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ephost.errors import EpInvalidArgument, EpOutOfRange, EpResourceExhausted
from ephost.types import MemoryInfo

_region_ids = itertools.count(1)
_EMPTY = np.empty(0, np.uint8)
# A region handed to a peer is sealed against changing size: a peer that could shrink it would make this
# process's next access to the lost pages die with SIGBUS.
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def check_slice(offset: int, nbytes: int, size: int, what: str = "region") -> None:
    """Refuse any [offset, offset + nbytes) that is not inside [0, size). No sum is formed, so no overflow."""
    if offset < 0 or nbytes < 0:
        raise EpInvalidArgument(f"negative offset or size in a {what} slice (offset {offset}, nbytes {nbytes})")
    if offset > size or nbytes > size - offset:
        raise EpOutOfRange(f"slice of {nbytes} bytes at offset {offset} runs past the end of its {what} "
                           f"({size} bytes)")


class Region:
    """One mapping. `fd` is set for shareable (memfd) regions, None for private ones."""

    def __init__(self, mm: mmap.mmap, size: int, fd: int | None, region_id: int | None = None):
        self._mm = mm
        self.size = size
        # The whole mapping as one ctypes array type, made once: a view is an instance of it (a new array type
        # per size costs several times an instance, where a loop's shapes change every run).
        self._whole = ctypes.c_char * size
        self._bytes: np.ndarray | None = None  # the whole mapping as one array, made once: see view
        self.fd = fd
        self._fd_lock = threading.Lock()  # guards fd: never duplicated as another thread closes it
        self.id = next(_region_ids) if region_id is None else region_id

    @classmethod
    def create_shared(cls, size: int) -> "Region":
        fd = os.memfd_create("ephost", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            # Commit the pages now: a region that cannot be backed fails here, with an error, rather than
            # with SIGBUS on first write.
            os.posix_fallocate(fd, 0, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, OverflowError, ValueError) as e:
            os.close(fd)
            raise EpResourceExhausted(f"cannot commit {size} bytes of shared memory: "
                                      f"{getattr(e, 'strerror', None) or e}") from None
        return cls(mm, size, fd)

    @classmethod
    def create_private(cls, size: int) -> "Region":
        try:
            mm = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, OverflowError, ValueError) as e:
            raise EpResourceExhausted(f"cannot map {size} bytes of memory: "
                                      f"{getattr(e, 'strerror', None) or e}") from None
        return cls(mm, size, None)

    @classmethod
    def from_fd(cls, fd: int, size: int, region_id: int) -> "Region":
        """Map a region a peer handed over. The descriptor is owned (and closed) by the region. Only a memfd
        sealed against shrinking is mapped: an unsealed one could be cut short under the mapping by whoever
        else holds it, and the next access would die with SIGBUS."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            actual = os.fstat(fd).st_size
        except OSError:
            seals, actual = 0, 0
        if not seals & fcntl.F_SEAL_SHRINK:
            os.close(fd)
            raise EpInvalidArgument("a shared region must be a memfd sealed against shrinking (F_SEAL_SHRINK)")
        if actual < size:
            os.close(fd)
            raise EpInvalidArgument(f"shared region is {actual} bytes, smaller than the {size} announced")
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as e:
            os.close(fd)
            raise EpInvalidArgument(f"cannot map a shared region of {size} bytes: {e}") from None
        return cls(mm, size, fd, region_id)

    @property
    def shareable(self) -> bool:
        return self.fd is not None

    def dup_fd(self) -> int | None:
        """A duplicate of the region's descriptor (the caller owns it), or None where it has none (private, or
        closed). Reading `fd` and duplicating it apart could duplicate whatever file reused the number after
        another thread closed the region in between, and hand that to a peer."""
        with self._fd_lock:
            return os.dup(self.fd) if self.fd is not None else None

    def view(self, offset: int, nbytes: int, owner: Any = None) -> np.ndarray:
        """A writable uint8 array over [offset, offset + nbytes). `owner` is kept alive as long as the array."""
        check_slice(offset, nbytes, self.size)
        if nbytes == 0:
            return _EMPTY
        if owner is None:
            # A slice of the whole mapping's array (made once): far cheaper than a new array over the mapping,
            # above all on a run's cold caches (a worker's view of each new buffer a loop's step leaves or names)
            whole = self._bytes
            if whole is None:
                whole = self._bytes = np.frombuffer(self._mm, np.uint8)
            return whole[offset:offset + nbytes]
        raw = self._whole.from_buffer(self._mm)
        raw._ephost_owner = owner  # a numpy view keeps its tensor (and so its buffer) alive
        return np.frombuffer(raw, np.uint8, nbytes, offset)

    def close(self, unmap: bool = True) -> None:
        """Close the descriptor; unmap too unless `unmap` is False, in which case the mapping lasts as long as
        anything (a buffer, a numpy view) still refers to this region."""
        with self._fd_lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
        if unmap:
            self._bytes = None  # (views made of it keep it, and so the mapping, alive)
            try:
                self._mm.close()
            except BufferError:
                pass  # views are still alive; the mapping goes when the last of them does


@dataclass(eq=False)
class Buffer:
    """Memory from an allocator. `region` is set where this process can address the bytes."""

    memory_info: MemoryInfo
    nbytes: int
    handle: int = 0
    region: Region | None = None
    offset: int = 0
    reserved: bool = False
    owner: Any = None  # what can name `handle` (a worker connection), for buffers that live elsewhere
    _view: np.ndarray | None = field(default=None, init=False, repr=False)

    def host_view(self, owner: Any = None) -> np.ndarray | None:
        """The buffer's bytes where this process maps them; with `owner`, a view that keeps it alive."""
        if self.region is None:
            return None
        if owner is not None:
            return self.region.view(self.offset, self.nbytes, owner)
        view = self._view
        if view is None:  # made once: a view over a mapping is costly, more so on a run's cold caches
            view = self._view = self.region.view(self.offset, self.nbytes)
        return view
