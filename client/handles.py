"""Handles in a worker, and the generations they belong to.

Every client object that names something in a worker (an EP, an allocator, a stream, a compiled partition) holds
its handle through a RemoteHandle: it remembers how the handle was made, and when the worker is restarted (a new
generation of its WorkerLink) it is made again on the next use. Memory of a dead worker that this process mapped
keeps its data and is then treated as host memory.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from ephost.memory import Buffer
from ephost.client.supervisor import WorkerLink


class RemoteHandle:
    """A handle in the worker, made by `_make()` and made again after the worker restarts."""

    def __init__(self, link: WorkerLink, handle: int = 0, generation: int = -1):
        """`handle`: one made already, on the worker of `generation` (read before the call that made it: a
        restart landing before this object is made then leaves it to be made again, never taken as current)."""
        self.link = link
        self._generation = generation if handle else -1
        self._id = handle
        self._make_lock = threading.Lock()  # guards _id and _generation as the handle is made

    def _make(self) -> int:
        raise NotImplementedError

    @property
    def handle(self) -> int:
        """The handle on the worker that runs now, made first if this generation has none yet."""
        if self._generation == self.link.generation:  # the common case, without the lock: `_id` is set first
            return self._id
        with self._make_lock:
            if self._generation != self.link.generation:
                generation = self.link.generation
                self._id = self._make()
                self._generation = generation
            return self._id

    @property
    def current(self) -> bool:
        """Whether the handle was made on the worker that runs now (nothing to release otherwise, nor once the
        link is closing: its worker goes, and what it held with it; nor while the worker is away: one that
        comes back as it was releases this client's handles as its lease ends or at Goodbye)."""
        return self._generation == self.link.generation and not self.link.closing and self.link.serving

    @property
    def current_handle(self) -> int:
        """The handle if it was made on the worker that runs now, else 0 (nothing to name there)."""
        return self._id if self.current else 0

    def call(self, method_of: Callable, request_of: Callable[[int], Any], **kw):
        """Call a method of the worker with a request built around this object's handle."""
        conn = self.link.conn  # first: it waits out a restart, after which the handle is made again
        return self.link.call(method_of, request_of(self.handle), conn=conn, **kw)


def owned(buffer: Buffer | None, link: WorkerLink) -> bool:
    """Whether the worker that runs now can name this buffer by its handle."""
    return buffer is not None and buffer.owner is not None and buffer.owner is link.current
