"""The bridged EP's profiler (OrtEp::CreateProfiler, ORT 1.25 on): with an ORT session's profiling on, the
worker's EP records each node it runs (its own ORT profiler, for the onnxruntime EP), and ORT's profile gets those
events beside its own: the partition's nodes as the worker ran them, under the worker's process."""
from __future__ import annotations

import ctypes
import time
from ctypes import POINTER, c_char_p, c_void_p
from typing import TYPE_CHECKING

from ephost.ort import abi as A
from ephost.ort.callbacks import fill, forget, keep

if TYPE_CHECKING:
    from ephost.ort.ep import BridgeEp


class BridgeProfiler:
    """OrtEpProfilerImpl of one bridged EP (one ORT session)."""

    def __init__(self, ep: "BridgeEp"):
        self.ep, self.abi = ep, ep.abi
        self.start_ns = 0  # ORT's profiling start, on the clock the worker's events are on (time.time_ns)
        guard = ep.guard
        self.struct = A.OrtEpProfilerImpl()
        fill(self.struct, A.PROFILER, self.abi, {
            "Release": lambda this: guard.quiet("Release", lambda: forget(self.address)),
            "StartProfiling": lambda this, offset_ns: guard.status("StartProfiling", lambda: self.start(offset_ns)),
            "StartEvent": lambda this, correlation: None,  # ORT's own events of the fused nodes are enough
            "StopEvent": lambda this, correlation, event: None,
            "EndProfiling": lambda this, container: guard.status("EndProfiling", lambda: self.end(container)),
        })
        self.address = keep(self, self.struct)

    def start(self, offset_ns: int) -> None:
        """ORT started profiling `offset_ns` ago: the worker's EP records from now on."""
        self.start_ns = time.time_ns() - offset_ns
        self.ep.remote.start_profiling()

    def end(self, container: int) -> None:
        """The worker's events into ORT's profile, their times made relative to ORT's start."""
        events = self.ep.remote.end_profiling()
        if not events:
            return
        ep_api = self.abi.ep_api
        made = []
        try:
            for e in events:
                args = {**e.args, "ephost.ep": self.ep.name}
                keys = (c_char_p * len(args))(*[k.encode() for k in args])
                values = (c_char_p * len(args))(*[str(v).encode() for v in args.values()])
                out = c_void_p()
                self.abi.check(ep_api.CreateProfilingEvent(
                    A.PROFILING_NODE_EVENT, e.pid, e.tid, e.name.encode(), (e.start_ns - self.start_ns) // 1000,
                    e.duration_ns // 1000, ctypes.cast(keys, POINTER(c_char_p)), ctypes.cast(values, POINTER(c_char_p)),
                    len(args), ctypes.byref(out)), "CreateProfilingEvent")
                made.append(out.value)
            array = (c_void_p * len(made))(*made)
            self.abi.check(ep_api.ProfilingEventsContainer_AddEvents(container, array, len(made)),
                           "ProfilingEventsContainer_AddEvents")
        finally:
            for event in made:  # (the container keeps copies)
                ep_api.ReleaseProfilingEvent(event)
