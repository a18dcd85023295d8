"""A session's profiler, like ONNX Runtime's: with SessionOptions.enable_profiling, each run records its
partitions (where each ran, its Compute call), the fallbacks a failure policy made, and the copies the session
made between memories, as Chrome trace events ("ph": "X", microseconds since the profiler started).
end_profiling() writes them as ORT does, a JSON array with one event per line (chrome://tracing and Perfetto read
it whole, tools read it line by line), and returns the file's name.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from datetime import datetime
from typing import Any, Iterator


class Profiler:
    def __init__(self, enabled: bool, prefix: str):
        self.enabled = enabled
        self._prefix = prefix
        self._start_ns = time.monotonic_ns() if enabled else 0
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # guards _events and enabled
        self._pid = os.getpid()

    @property
    def start_time_ns(self) -> int:
        """When profiling started (time.monotonic_ns()); 0 when it is off."""
        return self._start_ns

    def event(self, category: str, name: str, start_ns: int, end_ns: int, **args: Any) -> None:
        if not self.enabled:
            return
        event = {"cat": category, "pid": self._pid, "tid": threading.get_ident() & 0xFFFFFFFF,
                 "dur": (end_ns - start_ns) // 1000, "ts": (start_ns - self._start_ns) // 1000, "ph": "X",
                 "name": name, "args": {k: v if isinstance(v, (int, float, bool)) else str(v)
                                        for k, v in args.items()}}
        with self._lock:
            self._events.append(event)

    @contextlib.contextmanager
    def span(self, category: str, name: str, **args: Any) -> Iterator[dict[str, Any]]:
        """Record what runs inside as one event; the caller may add args to the dict it gets."""
        if not self.enabled:
            yield args
            return
        start = time.monotonic_ns()
        try:
            yield args
        finally:
            self.event(category, name, start, time.monotonic_ns(), **args)

    def end(self) -> str:
        """Write the events to `<prefix>_<date>_<time>.json` and stop; the file's name ('' when profiling was
        off, as ORT returns)."""
        if not self.enabled:
            return ""
        with self._lock:
            events, self._events = self._events, []
            self.enabled = False
        path = f"{self._prefix}_{datetime.now().strftime('%Y-%m-%d_%H-%M-%S')}_{time.monotonic_ns() % 10**6}.json"
        with open(path, "w") as f:
            f.write("[\n" + ",\n".join(json.dumps(e, separators=(",", ":")) for e in events) + "\n]\n")
        return path
