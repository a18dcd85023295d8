"""How often a launched worker may crash before its EP is marked failed, and how long to wait before each restart
(Chrome's GPU process: a crash limit within a forgiveness window, with backoff)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class CrashBudget:
    limit: int = 3           # crashes within `window_s` that exhaust the budget
    window_s: float = 300.0
    backoff_s: float = 0.05  # first restart delay, doubled per crash in the window, at most max_backoff_s
    max_backoff_s: float = 2.0
    _crashes: deque = field(default_factory=deque, repr=False)

    def record(self, now: float) -> float | None:
        """Count a crash at `now` (monotonic seconds): the delay before restarting, or None once the crashes
        within the window reach the limit."""
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self.window_s:
            self._crashes.popleft()
        if len(self._crashes) >= self.limit:
            return None
        return min(self.backoff_s * 2 ** (len(self._crashes) - 1), self.max_backoff_s)

    @property
    def recent(self) -> int:
        """Crashes counted in the current window."""
        return len(self._crashes)
