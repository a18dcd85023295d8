"""Runs that override initializers: an initializer a model also lists as a graph input is a default a run may
feed in its place (ONNX Runtime's overridable initializers; LoRA adapters' parameters are fed so).

A session's partitions hold such defaults inside them (each EP has them once, and a run that feeds nothing for
them sends no bytes for them). A run that feeds some runs on a variant of the session where those are plain
inputs, made on the first such run (its partitions planned and compiled on the same EPs) and kept for the
session's life: one variant per set of initializers fed."""
from __future__ import annotations

import threading
from typing import Any, Callable, Mapping


class Overrides:
    def __init__(self, names: frozenset[str], make: Callable[[frozenset[str]], Any]):
        """`names`: the model's overridable initializers; `make(fed)`: a variant session where `fed` are inputs."""
        self.names = names
        self._make = make
        self._variants: dict[frozenset[str], Any] = {}
        self._lock = threading.Lock()  # guards _variants: one variant made per set, whatever the threads

    def variant(self, feed: Mapping[str, Any]) -> Any | None:
        """The variant session a run with these feeds runs on; None where it feeds no overridable initializer."""
        if not self.names:
            return None
        fed = self.names.intersection(feed)
        if not fed:
            return None
        key = frozenset(fed)
        with self._lock:
            variant = self._variants.get(key)
            if variant is None:
                variant = self._variants[key] = self._make(key)
        return variant

    def close(self) -> None:
        with self._lock:
            variants, self._variants = list(self._variants.values()), {}
        for variant in variants:
            variant.close()
