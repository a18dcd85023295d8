"""The `example` EP: how to write an EP for ephost, in one page. It stands for a vendor accelerator with a
fixed batch limit that runs a few elementwise ops; what it does with them is numpy's.

What an EP implements is eps/base.py: a factory (devices, memory, EP creation), an Ep (GetCapability: which
nodes it takes; Compile: one compute info per fused graph) and compute infos. Its compute sees what ONNX
Runtime's OrtKernelInfo shows a kernel: `FusedGraph.kernel_info(options)` gives the partition's input and output
names, element types and shapes, in the order compute takes and returns them, and the EP's provider options
(`SessionOptions.add_provider_for_devices(devices, {"max_batch": "8"})`), in a worker as in process:

    info = graph.kernel_info(self.options)
    info.get_input_name(0), info.get_input_type_info(0).shape  # "x", ("N", 3)
    info.get_output_type_info(0).dtype                          # float32
    info.get_option("max_batch")                                # "8"

Register it by name: `env.register_execution_provider_library("npu", "example")` (a worker) or
`"inproc:example"`; a third-party EP adds its factory to the `ephost.eps` entry-point group the same way.
Provider option `max_batch`: the largest first dimension an input may have (default: no limit).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx

from ephost.eps import check_options
from ephost.eps.base import ComputeCall, EpDefaults, FusedGraph, KernelInfo, NodeGroup, split_session_options
from ephost.eps.host import EphostCpuFactory, local_inputs
from ephost.errors import EpInvalidArgument
from ephost.values import as_value

EP_NAME = "example"
VERSION = "0.1.0"
PROVIDER_OPTIONS = {"max_batch": "the largest first dimension an input may have (default: no limit)"}
# What the device runs: ONNX op type -> its kernel. A registry, so adding an op is one line.
KERNELS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Relu": lambda x: np.maximum(x, 0),
    "Neg": np.negative,
    "Abs": np.abs,
    "Exp": np.exp,
    "Tanh": np.tanh,
    "Sigmoid": lambda x: 1 / (1 + np.exp(-x)),
}
_DTYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)


class ExampleComputeInfo:
    """One fused chain of elementwise nodes, checked against its KernelInfo on every call."""

    def __init__(self, graph: FusedGraph, kernel_info: KernelInfo):
        self.name = graph.name
        self.kernel_info = kernel_info
        self._steps = [(KERNELS[n.op_type], n.input[0], n.output[0]) for n in graph.model.graph.node]
        self._max_batch = kernel_info.option_int("max_batch", 0)

    def compute(self, call: ComputeCall) -> list[Any]:
        # `call.into` (outputs the caller would like written into its tensors) and `call.leave` are hints this EP
        # need not take: it returns new arrays, and whoever called copies them where they go.
        info = self.kernel_info
        names = [v.name for v in info.inputs]
        values = local_inputs(self.name, names, call.inputs)
        for i, name in enumerate(names):
            expected, array = info.get_input_type_info(i), np.asarray(values[name])
            if array.dtype != expected.dtype:
                raise EpInvalidArgument(f"{info.get_node_name()}: input {name!r} is {expected.type_string}, "
                                        f"got {array.dtype}")
            if self._max_batch and array.ndim and array.shape[0] > self._max_batch:
                raise EpInvalidArgument(
                    f"{info.get_node_name()}: input {name!r} ({expected.type_string}, shape {list(expected.shape)}) "
                    f"has batch {array.shape[0]}; this device runs at most {self._max_batch} (max_batch)")
        for kernel, source, target in self._steps:
            values[target] = kernel(values[source])
        return [as_value(np.asarray(values[v.name], dtype=v.type.dtype)) for v in info.outputs]


class ExampleEp(EpDefaults):
    def __init__(self, session_options: Mapping[str, str]):
        options, _ = split_session_options(session_options)  # its provider options; session config aside
        check_options(EP_NAME, options, PROVIDER_OPTIONS)
        self.options = options

    def get_name(self) -> str:
        return EP_NAME

    def get_capability(self, model: onnx.ModelProto, claimed: frozenset[str]) -> list[NodeGroup]:
        types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.value_info,
                                                                 *model.graph.output]}
        names = tuple(n.name for n in model.graph.node if n.name not in claimed and n.domain in ("", "ai.onnx")
                      and n.op_type in KERNELS and types.get(n.input[0]) in _DTYPES)
        return [NodeGroup(names, fused=True)] if names else []

    def compile(self, graphs: Sequence[FusedGraph]) -> list[ExampleComputeInfo]:
        return [ExampleComputeInfo(g, g.kernel_info(self.options)) for g in graphs]


class ExampleEpFactory(EphostCpuFactory):
    name, version = EP_NAME, VERSION
    OPTIONS: dict[str, str] = {}  # (its provider options are the session's: PROVIDER_OPTIONS)

    def __init__(self, options: Mapping[str, str] | None = None):
        check_options(EP_NAME, dict(options or {}), {})
        self._init_device({}, {})

    def create_ep(self, device_indices: Sequence[int], session_options: Mapping[str, str]) -> ExampleEp:
        self._check_devices(device_indices)
        return ExampleEp(session_options)
