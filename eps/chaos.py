"""The `chaos` EP: another EP (default `reference`) with faults injected where and when the options say,
deterministically, so that tests and demos can show what a crashing, hanging or leaking vendor EP does.

Options: fault = segfault (a real SIGSEGV, in native code) | abort | exit | hang | leak | raise;
at = get_capability | compile | compute | alloc | copy; after = N (fail on the Nth such call);
every = N (fail on every Nth such call); wrap = the EP to wrap; leak_mb = memory a leak keeps per call
(default 64). Every other option goes to the wrapped EP. Counts start at 1 in each worker process.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
import time
from typing import Any, Mapping, Sequence

from ephost.eps import check_options, load_factory
from ephost.eps.base import ComputeCall, capability
from ephost.errors import EpInternal, EpInvalidArgument

log = logging.getLogger(__name__)

FAULTS = ("segfault", "abort", "exit", "hang", "leak", "raise")
SITES = ("get_capability", "compile", "compute", "alloc", "copy")
OPTIONS = {
    "fault": " | ".join(FAULTS),
    "at": " | ".join(SITES) + " (default compute)",
    "after": "fail on the Nth call at that site",
    "every": "fail on every Nth call at that site",
    "wrap": "the EP to wrap (default reference)",
    "leak_mb": "memory a leak keeps per faulting call (default 64)",
}


class Fault:
    """When and how to fail, counted per call site."""

    def __init__(self, options: Mapping[str, str]):
        self.kind = options.get("fault", "raise")
        self.site = options.get("at", "compute")
        if self.kind not in FAULTS:
            raise EpInvalidArgument(f"chaos fault must be one of {FAULTS}, got {self.kind!r}")
        if self.site not in SITES:
            raise EpInvalidArgument(f"chaos at must be one of {SITES}, got {self.site!r}")
        try:
            self.after = int(options.get("after", "0"))
            self.every = int(options.get("every", "0"))
            self.leak_mb = int(options.get("leak_mb", "64"))
        except ValueError as e:
            raise EpInvalidArgument(f"chaos after, every and leak_mb take integers: {e}") from None
        if not self.after and not self.every:
            self.after = 1
        self._counts = {site: itertools.count(1) for site in SITES}
        self._lock = threading.Lock()  # guards _counts
        self._leaked: list[bytearray] = []

    def check(self, site: str) -> None:
        if site != self.site:
            return
        with self._lock:
            n = next(self._counts[site])
        if n == self.after or (self.every and n % self.every == 0):
            self._fail(site, n)

    def _fail(self, site: str, n: int) -> None:
        log.warning("chaos: injecting %s at %s call %d", self.kind, site, n)
        if self.kind == "segfault":
            ctypes.string_at(0)  # reads address 0: SIGSEGV inside native code
        elif self.kind == "abort":
            os.abort()
        elif self.kind == "exit":
            os._exit(3)
        elif self.kind == "hang":
            while True:
                time.sleep(3600)
        elif self.kind == "leak":
            block = bytearray(self.leak_mb << 20)
            for i in range(0, len(block), 4096):  # touch every page, so the memory is really taken
                block[i] = 1
            self._leaked.append(block)
        else:
            raise EpInternal(f"chaos: injected failure at {site} call {n}")


class _Wrapper:
    def __init__(self, inner: Any, fault: Fault):
        self._inner = inner
        self._fault = fault

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ChaosComputeInfo(_Wrapper):
    def compute(self, call: ComputeCall) -> list[Any]:
        self._fault.check("compute")
        return self._inner.compute(call)


class ChaosEp(_Wrapper):
    def get_capability(self, model, claimed, external=None):
        self._fault.check("get_capability")
        return capability(self._inner, model, claimed, external)

    def compile(self, graphs):
        self._fault.check("compile")
        return [ChaosComputeInfo(i, self._fault) for i in self._inner.compile(graphs)]

    def release_node_compute_infos(self, infos) -> None:
        self._inner.release_node_compute_infos([i._inner for i in infos])


class ChaosAllocator(_Wrapper):
    def alloc(self, nbytes: int):
        self._fault.check("alloc")
        return self._inner.alloc(nbytes)


class ChaosDataTransfer(_Wrapper):
    def copy_tensors(self, src, dst, stream=None):
        self._fault.check("copy")
        return self._inner.copy_tensors(src, dst, stream)


class ChaosEpFactory(_Wrapper):
    OPTIONS = OPTIONS  # (and the wrapped EP's)

    def __init__(self, options: Mapping[str, str] | None = None):
        options = dict(options or {})
        own = {k: v for k, v in options.items() if k in OPTIONS}
        check_options("chaos", own, OPTIONS)
        wrap = own.get("wrap", "reference")
        if wrap == "chaos":
            raise EpInvalidArgument("chaos cannot wrap itself")
        super().__init__(load_factory(wrap, {k: v for k, v in options.items() if k not in OPTIONS}), Fault(own))
        self.options = options

    def create_ep(self, device_indices, session_options):
        return ChaosEp(self._inner.create_ep(device_indices, session_options), self._fault)

    def release_ep(self, ep) -> None:
        self._inner.release_ep(ep._inner)

    def create_allocator(self, memory_info, options):
        return ChaosAllocator(self._inner.create_allocator(memory_info, options), self._fault)

    def release_allocator(self, allocator) -> None:
        self._inner.release_allocator(allocator._inner)

    def create_data_transfer(self):
        inner = self._inner.create_data_transfer()
        return ChaosDataTransfer(inner, self._fault) if inner is not None else None
