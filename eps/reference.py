"""The `reference` EP: ONNX's own reference evaluator behind the EP interface, on the CPU.

It is ephost's CPU fallback and the EP every test can rely on. Option `ops` limits which op types it claims
(a comma-separated allow-list); by default it claims every op the evaluator runs.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Mapping, Sequence

import onnx
import onnx.defs
from onnx import helper
from onnx.reference import ReferenceEvaluator

from ephost.eps import check_options
from ephost import ep_context
from ephost.ep_context import EpContext
from ephost.eps.base import (EP_CONTEXT_ENABLE, ComputeCall, EpDefaults, FusedGraph, NodeGroup,
                             external_initializers)
from ephost.external_data import has_external_data
from ephost.eps.host import EphostCpuFactory, local_inputs
from ephost.eps.reference_plan import Plan
from ephost.errors import EpError, EpInvalidArgument
from ephost.tensor import Tensor
from ephost.values import as_value

EP_NAME = "reference"
VERSION = "0.1.0"
OPTIONS = {"ops": "comma-separated op types to claim (default: every op the reference evaluator runs)"}

_ONNX_DOMAINS = ("", "ai.onnx")


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


def _with_external_as_inputs(model: onnx.ModelProto, names) -> onnx.ModelProto:
    """A copy of the partition whose initializers `names` (their bytes external) are graph inputs instead, fed
    at each run with arrays over the file's mapping: the evaluator would otherwise copy them, or open a path."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    kept = [t for t in g.initializer if t.name not in names]
    moved = [t for t in g.initializer if t.name in names]
    del g.initializer[:]
    g.initializer.extend(kept)
    declared = {i.name for i in g.input}
    g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in moved
                   if t.name not in declared)
    return out


# The reference EP's compiled form: the partition cut out as a standalone model. Restoring it saves only the cut
# (extracting the partition from its model); the evaluator is built again either way. A partition with external
# data has none: its weights are references into files the worker was handed for that model only.
CONTEXT_FORM = "reference_partition_model"


class ReferenceComputeInfo:
    def __init__(self, name: str, model: onnx.ModelProto, keep_context: bool = False, restored: bool = False,
                 constants: dict[str, Any] | None = None):
        """`constants`: initializers whose bytes are external, as arrays over the file's mapping (only this
        partition's), given to the evaluator as feeds; `model` has them as graph inputs."""
        self.name = name
        self._constants = constants or {}
        if self._constants:
            keep_context = False  # no compiled form: see CONTEXT_FORM
        initializers = {t.name for t in model.graph.initializer}  # (graph inputs too: defaults, not fed)
        self._input_names = [i.name for i in model.graph.input
                             if i.name not in self._constants and i.name not in initializers]
        try:
            self._evaluator = ReferenceEvaluator(model)
        except Exception as e:
            raise EpInvalidArgument(f"reference EP cannot compile {name!r}: {type(e).__name__}: {e}") from None
        plan = Plan.of(self._evaluator)
        self._run = plan.run if plan is not None else lambda feeds: self._evaluator.run(None, feeds)
        self._lock = threading.Lock()  # guards the evaluator, which keeps state while it runs
        self.restored = restored
        self.ep_context = EpContext(CONTEXT_FORM, model.SerializeToString(), VERSION) if keep_context else None

    @classmethod
    def of(cls, graph: FusedGraph, ep, keep_context: bool) -> "ReferenceComputeInfo":
        constants = {name: v.local_array() if isinstance(v, Tensor) else v
                     for name, v in external_initializers(graph, ep).items()}
        model = _with_external_as_inputs(graph.model, constants) if constants else graph.model
        if graph.external is not None and has_external_data(model):  # in subgraphs or attributes: copied in
            model = graph.external.inlined(model)
        return cls(graph.name, model, keep_context, constants=constants)

    @classmethod
    def restore(cls, graph: FusedGraph, node: onnx.NodeProto, keep_context: bool) -> "ReferenceComputeInfo":
        context = ep_context.read(node, VERSION)
        if context.form != CONTEXT_FORM:
            raise EpInvalidArgument(f"EPContext node {node.name!r}: form {context.form!r} is not the reference EP's")
        return cls(graph.name, ep_context.model_of(node, context), keep_context, restored=True)

    def compute(self, call: ComputeCall) -> list[Any]:
        feeds = local_inputs(self.name, self._input_names, call.inputs)
        if self._constants:
            feeds.update(self._constants)
        with self._lock:
            try:
                results = self._run(feeds)
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

    def get_capability(self, model: onnx.ModelProto, claimed: frozenset[str], external=None) -> list[NodeGroup]:
        # Its own EPContext nodes, each a partition to restore; then one group of everything it can run (the
        # session splits groups whose fusion would form a cycle).
        restore = [NodeGroup((n.name,), fused=True) for n in ep_context.own_nodes(model, EP_NAME, claimed)]
        names = tuple(n.name for n in model.graph.node
                      if n.domain in _ONNX_DOMAINS and n.op_type in self._ops and n.name and n.name not in claimed)
        return restore + ([NodeGroup(names, fused=True)] if names else [])

    def compile(self, graphs: Sequence[FusedGraph]) -> list[ReferenceComputeInfo]:
        keep = self.session_options.get(EP_CONTEXT_ENABLE) == "1"
        out = []
        for g in graphs:
            node = g.ep_context_node
            if node is not None and ep_context.source_of(node) == EP_NAME:
                out.append(ReferenceComputeInfo.restore(g, node, keep))
            else:
                out.append(ReferenceComputeInfo.of(g, self, keep))
        return out


class ReferenceEpFactory(EphostCpuFactory):
    name, version = EP_NAME, VERSION
    OPTIONS = OPTIONS

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
        self._init_device({"ops": str(len(self._ops))}, options)

    def create_ep(self, device_indices: Sequence[int], session_options: Mapping[str, str]) -> ReferenceEp:
        self._check_devices(device_indices)
        return ReferenceEp(self._ops, session_options)
