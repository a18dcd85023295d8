"""A worker's allocator, seen from the client (OrtAllocator over gRPC), and the queue that frees buffers.

Buffers of tensors the application lets go of are freed in batches from one thread per worker, never from the
garbage collector's thread (a finalizer may run anywhere, under any lock, and must not block on a call).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Mapping

import numpy as np

from ephost.errors import EpError, EpWorkerCrashed
from ephost.memory import Buffer
from ephost.types import MemoryInfo
from ephost.client.handles import RemoteHandle
from ephost.client.supervisor import WorkerLink
from ephost.v1 import allocator_pb2, common_pb2, factory_pb2

log = logging.getLogger(__name__)

FREE_BATCH = 256  # buffers named in one Free call


class RemoteAllocator(RemoteHandle):
    def __init__(self, link: WorkerLink, device_index: int, memory_info: MemoryInfo, options: Mapping[str, str],
                 frees: "FreeQueue"):
        super().__init__(link)
        self._device_index, self._options = device_index, dict(options)
        self.memory_info = memory_info
        self._frees = frees
        self._regions: set[tuple[Any, int]] = set()
        self._regions_lock = threading.Lock()  # guards _regions
        self.handle  # made now, so that bad options fail here

    def _make(self) -> int:
        reply = self.link.call(lambda c: c.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest(
            device_index=self._device_index, device_mem_type=int(self.memory_info.device_mem_type),
            options=self._options))
        self.memory_info = MemoryInfo.from_proto(reply.memory_info)
        return reply.allocator

    def _allocate(self, method_of, nbytes: int) -> Buffer:
        conn = self.link.conn  # first: it waits out a restart, after which the handle is made again
        reply = self.link.call(method_of, allocator_pb2.AllocRequest(allocator=self.handle, nbytes=nbytes), conn=conn)
        # Owned by the worker the call went to: were a restart to land in between, a buffer owned by the next
        # would be named there by a handle of the dead one's.
        return self.adopt(reply.buffer, reply.nbytes, reply.shm if reply.HasField("shm") else None, conn)

    def adopt(self, handle: int, nbytes: int, shm=None, conn=None) -> Buffer:
        """A Buffer for a buffer the worker made in this allocator (an allocation, or a Compute's output),
        mapped here when it lies in shared memory (`shm`: its `region` and `offset`, a ShmSlice's or a kept
        call's Placed record's)."""
        conn = conn or self.link.current
        region = conn.map_region(shm.region) if shm is not None else None
        if region is not None:
            with self._regions_lock:
                self._regions.add((conn, region.id))
        return Buffer(self.memory_info, nbytes, handle, region, shm.offset if shm is not None else 0, owner=conn)

    def alloc(self, nbytes: int) -> Buffer:
        return self._allocate(lambda c: c.allocator.Alloc, nbytes)

    def reserve(self, nbytes: int) -> Buffer:
        return self._allocate(lambda c: c.allocator.Reserve, nbytes)

    def free(self, buffer: Buffer) -> None:
        """Free now, in one call."""
        self.free_many([buffer])

    def free_later(self, buffer: Buffer) -> None:
        """Free soon, batched with others, from the worker's free queue (what tensors' finalizers use)."""
        self._frees.put(self, buffer)

    def flush_frees(self, timeout: float = 5.0) -> bool:
        """Wait until the frees queued so far (of collected tensors) have been sent."""
        return self._frees.flush(timeout)

    def free_many(self, buffers: list[Buffer]) -> None:
        # To the worker the buffers are in, named with this allocator's handle there: a call that waited out a
        # restart would name the dead worker's handles to its successor, whose own buffers may bear them.
        conn, allocator = self.link.current, self.current_handle
        mine = [b for b in buffers if b.owner is conn] if allocator else []
        for start in range(0, len(mine), FREE_BATCH):  # none where its worker is gone, and its memory with it
            batch = mine[start:start + FREE_BATCH]
            try:
                reply = self.link.call(lambda c: c.allocator.Free, allocator_pb2.FreeRequest(
                    allocator=allocator, buffers=[b.handle for b in batch]), conn=conn)
            except EpWorkerCrashed:
                return  # the worker went, and these buffers with it
            for region_id in reply.released_regions:
                self._forget_region(conn, region_id)

    def _forget_region(self, conn, region_id: int) -> None:
        with self._regions_lock:
            self._regions.discard((conn, region_id))
        conn.forget_region(region_id)

    def get_stats(self) -> dict[str, int]:
        return dict(self.call(lambda c: c.allocator.GetStats, lambda h: common_pb2.Handle(id=h)).stats)

    def write(self, buffer: Buffer, data: np.ndarray) -> None:
        """Put bytes into a buffer: one memcpy where it is mapped here, else sent in chunks."""
        view = buffer.host_view()
        if view is not None:
            view[: len(data)] = data
        else:
            buffer.owner.write(self.handle, buffer.handle, data)

    def read(self, buffer: Buffer, out: np.ndarray) -> None:
        view = buffer.host_view()
        if view is not None:
            out[:] = view[: len(out)]
        else:
            buffer.owner.read(self.handle, buffer.handle, out)

    def release(self) -> None:
        """ReleaseAllocator: the worker drops it and its buffers; this process forgets its regions."""
        self._frees.discard(self)
        if self.current:
            self.call(lambda c: c.factory.ReleaseAllocator, lambda h: common_pb2.Handle(id=h))
        with self._regions_lock:
            regions, self._regions = self._regions, set()
        for conn, region_id in regions:
            conn.forget_region(region_id)


class FreeQueue:
    """Buffers waiting to be freed, per allocator, sent in batches by one thread per worker link.

    A free waits up to LINGER_S for others to go in the same call: a loop of runs that each leave an output in
    the worker would otherwise cost one Free call per run, a round trip that takes both processes' CPUs. `flush`
    sends at once."""

    LINGER_S = 0.005

    def __init__(self, name: str):
        self._pending: dict[RemoteAllocator, list[Buffer]] = {}
        self._queued = 0
        self._cond = threading.Condition()  # guards _pending, _queued, _sending, _urgent and _closed
        self._closed = False
        self._sending = 0
        self._urgent = 0  # callers waiting in flush
        self._thread = threading.Thread(target=self._run, name=f"ephost-free-{name}", daemon=True)
        self._thread.start()

    def put(self, allocator: RemoteAllocator, buffer: Buffer) -> None:
        with self._cond:
            if self._closed:
                return
            self._pending.setdefault(allocator, []).append(buffer)
            self._queued += 1
            if self._queued == 1 or self._queued >= FREE_BATCH:
                self._cond.notify_all()

    def discard(self, allocator: RemoteAllocator) -> None:
        """Forget an allocator's pending frees (it is being released, and its buffers with it)."""
        with self._cond:
            self._queued -= len(self._pending.pop(allocator, ()))

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every free queued so far has been sent (sending them now)."""
        with self._cond:
            self._urgent += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: (not self._pending and not self._sending) or self._closed,
                                           timeout)
            finally:
                self._urgent -= 1

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                self._cond.wait_for(lambda: self._closed or self._urgent or self._queued >= FREE_BATCH,
                                    self.LINGER_S)
                if self._closed:
                    return
                pending, self._pending, self._queued = self._pending, {}, 0
                self._sending += 1
            try:
                for allocator, buffers in pending.items():
                    try:
                        allocator.free_many(buffers)
                    # The worker may be gone, its memory with it; or its channel was closed under us (grpc
                    # raises ValueError for a call on a closed channel): either way nothing is left to free.
                    except (EpError, ValueError) as e:
                        log.debug("freeing %d buffer(s) failed: %s", len(buffers), e)
            finally:
                with self._cond:
                    self._sending -= 1
                    self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._queued = 0
            self._cond.notify_all()
