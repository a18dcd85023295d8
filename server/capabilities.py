"""GetCapability answers kept per model content, EP configuration and claimed nodes: a second session on the same
model (from any client of this worker) is answered without asking the EP again. For ORT's EPs asking means
building an ORT session of the whole model; an application that opens a session per request pays it once.

Only EPs whose class declares `capability_key()` are cached: it returns what, beside the model and the claimed
nodes, their answer depends on (None: do not cache this one). An EP that does not declare it is always asked."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable

from ephost.eps.base import NodeGroup


class CapabilityCache:
    SIZE = 32

    def __init__(self):
        self._answers: OrderedDict[tuple, list[NodeGroup]] = OrderedDict()
        self._lock = threading.Lock()  # guards _answers

    @staticmethod
    def key(ep: Any, digest: str, claimed: frozenset[str]) -> tuple | None:
        # looked up on the class: a wrapper that forwards attributes (the chaos EP) must not borrow its inner EP's
        declared = getattr(type(ep), "capability_key", None)
        config = declared(ep) if declared is not None and digest else None
        return None if config is None else (digest, config, claimed)

    def answer(self, key: tuple | None, ask: Callable[[], list[NodeGroup]]) -> tuple[list[NodeGroup], bool]:
        """(the answer, whether it came from the cache)."""
        if key is not None:
            with self._lock:
                groups = self._answers.get(key)
                if groups is not None:
                    self._answers.move_to_end(key)
                    return list(groups), True
        groups = ask()
        if key is not None:
            with self._lock:
                self._answers[key] = list(groups)
                while len(self._answers) > self.SIZE:
                    self._answers.popitem(last=False)
        return groups, False
