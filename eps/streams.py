"""A sync stream for EPs whose device is the CPU: an ordered queue run by one thread, and notifications
that really order work within and across streams (OrtSyncStreamImpl, OrtSyncNotificationImpl).
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from ephost.errors import EpDeadlineExceeded, EpError, EpFailedPrecondition, EpInternal

log = logging.getLogger(__name__)

_STOP = object()


class QueueStream:
    """Work enqueued here runs in order, one item at a time, on the stream's own thread."""

    def __init__(self, name: str = "stream"):
        self.name = name
        self._queue: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._released = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ephost-{name}", daemon=True)
        self._thread.start()

    def enqueue(self, work: Callable[[], None], *, signal: bool = False) -> None:
        """Queue `work`. A `signal` (a notification firing) runs even after earlier work failed."""
        if self._released.is_set():
            raise EpFailedPrecondition(f"{self.name} has been released")
        self._queue.put((work, signal))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            work, signal = item
            if self._error is not None and not signal:
                continue  # like a device stream after a fault: later work is skipped until the error is seen
            try:
                work()
            except BaseException as e:  # kept and raised to whoever synchronizes next
                log.warning("work on %s failed: %s", self.name, e)
                self._error = e

    def raise_pending_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            if isinstance(error, EpError):
                raise error
            raise EpInternal(f"work queued on {self.name} failed: {type(error).__name__}: {error}")

    # --- OrtSyncStreamImpl ------------------------------------------------------------------------

    def create_notification(self) -> "QueueNotification":
        return QueueNotification(self)

    def flush(self, timeout: float | None = None) -> None:
        done = threading.Event()
        self.enqueue(done.set, signal=True)
        if not done.wait(timeout):
            raise EpDeadlineExceeded(f"{self.name} did not drain within {timeout} s")
        self.raise_pending_error()

    def on_session_run_end(self) -> None:
        self.flush()

    def release(self) -> None:
        if not self._released.is_set():
            self._released.set()
            self._queue.put(_STOP)


class QueueNotification:
    """Fires when the stream reaches the point where it was activated."""

    def __init__(self, stream: QueueStream):
        self._stream = stream
        self._fired: threading.Event | None = None  # one event per activation

    def activate(self) -> None:
        fired = threading.Event()
        self._stream.enqueue(fired.set, signal=True)
        self._fired = fired

    def _current(self) -> threading.Event:
        if self._fired is None:
            raise EpFailedPrecondition("notification was never activated; activate it on its stream first")
        return self._fired

    def wait_on_host(self, timeout: float | None = None) -> None:
        if not self._current().wait(timeout):
            raise EpDeadlineExceeded(f"notification on {self._stream.name} did not fire within {timeout} s")
        self._stream.raise_pending_error()

    def wait_on_device(self, stream: QueueStream) -> None:
        fired = self._current()
        source = self._stream

        def wait() -> None:
            # Poll so that releasing either stream cannot leave this thread blocked for ever.
            while not fired.wait(0.1):
                if source._released.is_set() or stream._released.is_set():
                    raise EpFailedPrecondition(f"{source.name} was released before its notification fired")

        stream.enqueue(wait)

    def release(self) -> None:
        self._fired = None
