"""The `reference` EP: ONNX's own reference evaluator behind the EP interface, on the CPU.

It is ephost's CPU fallback and the EP every test can rely on. Option `ops` limits which op types it claims
(a comma-separated allow-list); by default it claims every op the evaluator runs.
"""
from __future__ import annotations

import functools
import os
import threading
from typing import Any, Mapping, Sequence

import onnx
import onnx.defs
from onnx.reference import ReferenceEvaluator

from ephost.eps import check_options
from ephost.eps.base import EpDefaults, FusedGraph, NodeGroup
from ephost.eps.host import HostMemoryFactory, local_inputs
from ephost.errors import EpError, EpInvalidArgument
from ephost.values import as_value
from ephost.types import EpDeviceInfo, HardwareDevice, HardwareDeviceType

EP_NAME = "reference"
VERSION = "0.1.0"
OPTIONS = {"ops": "comma-separated op types to claim (default: every op the reference evaluator runs)"}

_ONNX_DOMAINS = ("", "ai.onnx")
_CPU_VENDORS = {"GenuineIntel": ("Intel", 0x8086), "AuthenticAMD": ("AMD", 0x1022)}


@functools.cache
def evaluator_ops() -> frozenset[str]:
    """Every ai.onnx op the reference evaluator runs: its own kernels, and ops it expands through the
    function body their schema carries."""
    from onnx.reference.ops import load_op

    def has_kernel(op_type: str) -> bool:
        try:
            load_op("", op_type)
            return True
        except Exception:  # onnx raises a plain RuntimeError/NotImplementedError for ops it has no kernel of
            return False

    schemas = [s for s in onnx.defs.get_all_schemas() if s.domain in _ONNX_DOMAINS]
    return frozenset(s.name for s in schemas
                     if s.has_function or s.has_context_dependent_function or has_kernel(s.name))


@functools.cache
def cpu_device() -> HardwareDevice:
    vendor, vendor_id = "unknown", 0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    vendor, vendor_id = _CPU_VENDORS.get(line.split(":", 1)[1].strip(), (vendor, 0))
                    break
    except OSError:
        pass
    return HardwareDevice(HardwareDeviceType.CPU, vendor_id, vendor, 0, {"cores": str(os.cpu_count() or 1)})


class ReferenceComputeInfo:
    def __init__(self, graph: FusedGraph):
        self.name = graph.name
        self._input_names = [i.name for i in graph.model.graph.input]
        try:
            self._evaluator = ReferenceEvaluator(graph.model)
        except Exception as e:
            raise EpInvalidArgument(f"reference EP cannot compile {graph.name!r}: {type(e).__name__}: {e}") from None
        self._lock = threading.Lock()  # the evaluator keeps state while it runs

    def compute(self, inputs: Sequence[Any], allocator=None, keep: Sequence[int] = (),
                timeout: float | None = None, into=None, leave=()) -> list[Any]:
        feeds = local_inputs(self.name, self._input_names, inputs)
        with self._lock:
            try:
                results = self._evaluator.run(None, feeds)
            except EpError:
                raise
            except Exception as e:
                raise EpInvalidArgument(f"{self.name} failed: {type(e).__name__}: {e}") from None
        return [as_value(r) for r in results]


class ReferenceEp(EpDefaults):
    def __init__(self, ops: frozenset[str], session_options: Mapping[str, str]):
        self._ops = ops
        self.session_options = dict(session_options)

    def get_name(self) -> str:
        return EP_NAME

    def get_capability(self, model: onnx.ModelProto, claimed: frozenset[str]) -> list[NodeGroup]:
        # One group of everything it can run; the session splits groups whose fusion would form a cycle.
        names = tuple(n.name for n in model.graph.node
                      if n.domain in _ONNX_DOMAINS and n.op_type in self._ops and n.name and n.name not in claimed)
        return [NodeGroup(names, fused=True)] if names else []

    def compile(self, graphs: Sequence[FusedGraph]) -> list[ReferenceComputeInfo]:
        return [ReferenceComputeInfo(g) for g in graphs]


class ReferenceEpFactory(HostMemoryFactory):
    def __init__(self, options: Mapping[str, str] | None = None):
        options = dict(options or {})
        check_options(EP_NAME, options, OPTIONS)
        self.options = options
        known = evaluator_ops()
        if "ops" in options:
            ops = frozenset(o.strip() for o in options["ops"].split(",") if o.strip())
            unknown = sorted(ops - known)
            if unknown:
                raise EpInvalidArgument(f"option ops names op types the reference evaluator does not run: {unknown}")
            self._ops = ops
        else:
            self._ops = known
        device = cpu_device()
        self._init_memory(EP_NAME, device.vendor_id)
        self._device = EpDeviceInfo(
            index=0, ep_name=EP_NAME, ep_vendor="ephost", device=device, memory_infos=self.memory_infos,
            ep_metadata={"version": VERSION, "ops": str(len(self._ops))},
            ep_options={k: v for k, v in options.items()},
        )

    def get_name(self) -> str:
        return EP_NAME

    def get_vendor(self) -> str:
        return "ephost"

    def get_vendor_id(self) -> int:
        return 0

    def get_version(self) -> str:
        return VERSION

    def get_supported_devices(self) -> list[EpDeviceInfo]:
        return [self._device]

    def create_ep(self, device_indices: Sequence[int], session_options: Mapping[str, str]) -> ReferenceEp:
        self._check_devices(device_indices)
        return ReferenceEp(self._ops, session_options)

    def release_ep(self, ep: ReferenceEp) -> None:
        pass

    def close(self) -> None:
        pass
