"""Progress of a long operation (making a worker's environment, sending a large file or tensor to a worker),
reported through logging on the `ephost.progress` logger at INFO: an application sees it where its logs go once
it turns that logger on, and the command line draws it as one line that updates. Each record carries
`record.ephost_progress`, a ProgressState."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("ephost.progress")

ATTRIBUTE = "ephost_progress"
PERIOD_S = 1.0           # at most one record this often, but the first and the last
MIN_BYTES = 64 << 20     # transfers smaller than this are not reported


@dataclass(frozen=True)
class ProgressState:
    what: str                # "sending model.onnx.data to the worker for 'gpu'"
    done: int                # units done so far
    total: int | None        # None: not known (a line of pip's output says where it is)
    elapsed_s: float
    note: str = ""
    finished: bool = False

    def describe(self) -> str:
        """One line, as a log file shows it."""
        if self.finished:
            size = f" ({_mib(self.done)} MiB)" if self.total else ""
            return f"{self.what}: done in {self.elapsed_s:.1f} s{size}"
        if self.total:
            return f"{self.what}: {_mib(self.done)} of {_mib(self.total)} MiB " \
                   f"({100 * self.done // self.total}%) after {self.elapsed_s:.0f} s"
        return f"{self.what}: {self.note or 'under way'} ({self.elapsed_s:.0f} s)"


class Progress:
    """One operation's progress: `advance(n)` (or `note(text)` where there is no total), then `finish()`."""

    def __init__(self, what: str, total: int | None = None):
        self._what, self._total = what, total
        self._done, self._started = 0, time.monotonic()
        self._last = 0.0
        self._on = log.isEnabledFor(logging.INFO) and (total is None or total >= MIN_BYTES)
        if self._on:
            self._emit("")

    def advance(self, n: int) -> None:
        self._done += n
        if self._on and time.monotonic() - self._last >= PERIOD_S:
            self._emit("")

    def note(self, text: str) -> None:
        if self._on:
            self._emit(text)

    def finish(self) -> None:
        if self._on:
            self._emit("", finished=True)

    def _emit(self, note: str, finished: bool = False) -> None:
        now = time.monotonic()
        self._last = now
        state = ProgressState(self._what, self._done, self._total, now - self._started, note, finished)
        log.info("%s", state.describe(), extra={ATTRIBUTE: state})


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f}"
