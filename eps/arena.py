"""An arena allocator: buffers are carved out of a few large regions, never one region per tensor.

Regions come from a factory (shared memfd regions for HOST_ACCESSIBLE memory, private mappings for DEFAULT),
so the same allocator serves both memory types. Stats use the keys of ORT's OrtAllocator::GetStats.
"""
from __future__ import annotations

import bisect
import itertools
import os
import threading
from typing import Callable, Mapping

from ephost.errors import EpInvalidArgument, EpNotFound, EpResourceExhausted
from ephost.memory import Buffer, Region
from ephost.types import MAX_TENSOR_BYTES, MemoryInfo

MiB = 1 << 20
_handles = itertools.count(1)

# Options that are sizes (the worker checks them against its single-allocation limit).
SIZE_OPTIONS = ("arena.initial_chunk_size_bytes", "arena.initial_growth_chunk_size_bytes")

# ORT's arena configuration keys (OrtArenaCfg) that this arena honours.
OPTIONS = {
    "arena.max_mem": "most bytes the arena may hold (default: the machine's physical memory)",
    "arena.initial_chunk_size_bytes": "size of the first region (default 64 MiB)",
    "arena.initial_growth_chunk_size_bytes": "smallest size of a region added later (default 64 MiB)",
}


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _int_option(options: Mapping[str, str], key: str, default: int) -> int:
    raw = options.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise EpInvalidArgument(f"allocator option {key} must be an integer, got {raw!r}") from None
    if not 0 < value <= MAX_TENSOR_BYTES:
        raise EpInvalidArgument(f"allocator option {key} must be between 1 and {MAX_TENSOR_BYTES}, got {value}")
    return value


class _Chunk:
    """One region and the free ranges inside it, kept sorted by offset and coalesced."""

    def __init__(self, region: Region):
        self.region = region
        self.free_offsets = [0]
        self.free_sizes = [region.size]
        self.live = 0

    def take(self, size: int) -> int | None:
        for i, free in enumerate(self.free_sizes):
            if free >= size:
                offset = self.free_offsets[i]
                if free == size:
                    del self.free_offsets[i], self.free_sizes[i]
                else:
                    self.free_offsets[i] += size
                    self.free_sizes[i] -= size
                self.live += 1
                return offset
        return None

    def give_back(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self.free_offsets, offset)
        self.free_offsets.insert(i, offset)
        self.free_sizes.insert(i, size)
        if i + 1 < len(self.free_offsets) and offset + size == self.free_offsets[i + 1]:
            self.free_sizes[i] += self.free_sizes.pop(i + 1)
            self.free_offsets.pop(i + 1)
        if i > 0 and self.free_offsets[i - 1] + self.free_sizes[i - 1] == offset:
            self.free_sizes[i - 1] += self.free_sizes.pop(i)
            self.free_offsets.pop(i)
        self.live -= 1


class ArenaAllocator:
    """Thread-safe first-fit arena over regions made by `make_region(size)`."""

    def __init__(self, memory_info: MemoryInfo, make_region: Callable[[int], Region],
                 options: Mapping[str, str] | None = None):
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise EpInvalidArgument(f"unknown allocator option(s) {unknown}; known: {sorted(OPTIONS)}")
        self.memory_info = memory_info
        self._make_region = make_region
        self._align = max(int(memory_info.alignment), 1)
        self._limit = _int_option(options, "arena.max_mem", _physical_memory())
        self._initial = _int_option(options, "arena.initial_chunk_size_bytes", 64 * MiB)
        self._growth = _int_option(options, "arena.initial_growth_chunk_size_bytes", 64 * MiB)
        self._lock = threading.Lock()  # guards _chunks, _reserved, _live and _stats
        self._chunks: list[_Chunk] = []
        self._reserved: dict[int, Region] = {}
        self._live: dict[int, Buffer] = {}
        self._stats = dict.fromkeys(
            ("InUse", "TotalAllocated", "MaxInUse", "NumAllocs", "NumReserves", "NumArenaExtensions",
             "NumArenaShrinkages", "MaxAllocSize"), 0)

    # --- the OrtAllocator interface ---------------------------------------------------------------

    def alloc(self, nbytes: int) -> Buffer:
        size = self._size_for(nbytes)
        with self._lock:
            for chunk in self._chunks:
                offset = chunk.take(size)
                if offset is not None:
                    return self._hand_out(chunk.region, offset, nbytes, size, reserved=False)
            grow = max(size, self._initial if not self._chunks else self._growth)
            grow = _align(grow, MiB) if grow > size else size
            self._check_limit(grow, nbytes)
            chunk = _Chunk(self._make_region(grow))
            self._chunks.append(chunk)
            self._stats["TotalAllocated"] += grow
            self._stats["NumArenaExtensions"] += 1
            return self._hand_out(chunk.region, chunk.take(size), nbytes, size, reserved=False)

    def reserve(self, nbytes: int) -> Buffer:
        size = self._size_for(nbytes)
        with self._lock:
            self._check_limit(size, nbytes)
            region = self._make_region(size)
            self._stats["TotalAllocated"] += size
            self._stats["NumReserves"] += 1
            buffer = self._hand_out(region, 0, nbytes, size, reserved=True)
            self._reserved[region.id] = region
            return buffer

    def free(self, buffer: Buffer) -> None:
        with self._lock:
            if self._live.pop(buffer.handle, None) is None:
                raise EpNotFound("buffer is not live in this allocator (already freed, or someone else's)")
            size = self._size_for(buffer.nbytes)
            self._stats["InUse"] -= size
            if buffer.reserved:
                region = self._reserved.pop(buffer.region.id)
                self._stats["TotalAllocated"] -= region.size
                region.close()
                return
            chunk = next(c for c in self._chunks if c.region is buffer.region)
            chunk.give_back(buffer.offset, size)
            if chunk.live == 0:
                self._shrink(keep=chunk)

    def _shrink(self, keep: _Chunk) -> None:
        """Give back empty regions, except the first and the one just emptied: a loop that allocates and
        frees a large tensor reuses its region instead of mapping a new one every time."""
        for chunk in [c for c in self._chunks[1:] if c.live == 0 and c is not keep]:
            self._chunks.remove(chunk)
            self._stats["TotalAllocated"] -= chunk.region.size
            self._stats["NumArenaShrinkages"] += 1
            chunk.region.close()

    def get_stats(self) -> dict[str, int]:
        with self._lock:
            return {"Limit": self._limit, **self._stats}

    # --- what the worker needs beyond ORT's interface ---------------------------------------------

    def region(self, region_id: int) -> Region | None:
        with self._lock:
            for chunk in self._chunks:
                if chunk.region.id == region_id:
                    return chunk.region
            return self._reserved.get(region_id)

    def close(self) -> None:
        with self._lock:
            for chunk in self._chunks:
                chunk.region.close()
            for region in self._reserved.values():
                region.close()
            self._chunks.clear()
            self._reserved.clear()
            self._live.clear()

    # --- internals --------------------------------------------------------------------------------

    def _size_for(self, nbytes: int) -> int:
        if not isinstance(nbytes, int) or nbytes < 0:
            raise EpInvalidArgument(f"allocation size must be a non-negative integer, got {nbytes!r}")
        if nbytes > MAX_TENSOR_BYTES:
            raise EpResourceExhausted(f"allocating {nbytes} bytes: more than any allocation may be "
                                      f"({MAX_TENSOR_BYTES})")
        return _align(max(nbytes, 1), self._align)

    def _check_limit(self, grow: int, nbytes: int) -> None:
        if self._stats["TotalAllocated"] + grow > self._limit:
            raise EpResourceExhausted(
                f"allocating {nbytes} bytes would take {self.memory_info.name} past its limit of "
                f"{self._limit} bytes ({self._stats['TotalAllocated']} held)")

    def _hand_out(self, region: Region, offset: int, nbytes: int, size: int, reserved: bool) -> Buffer:
        buffer = Buffer(self.memory_info, nbytes, next(_handles), region, offset, reserved)
        self._live[buffer.handle] = buffer
        s = self._stats
        s["InUse"] += size
        s["MaxInUse"] = max(s["MaxInUse"], s["InUse"])
        if not reserved:
            s["NumAllocs"] += 1
        s["MaxAllocSize"] = max(s["MaxAllocSize"], nbytes)
        return buffer
