"""The session's CPU fallback: what runs the nodes no EP took, and the partitions of an EP that failed.

ONNX Runtime's CPU EP, hosted in this process through the same EP interface as any `inproc:` EP (it is ORT's
own fallback: trusted code), takes what it can run; ONNX's reference evaluator (the `reference` EP) takes only
what ORT cannot (ops it lacks, opsets or IR versions it does not read, a run it fails). `SessionOptions.fallback`
picks the chain: "onnxruntime", "reference", or None (no fallback: a node no EP took is an error).
"""
from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Any, Callable, Mapping

import onnx

from ephost.eps import load_factory
from ephost.eps.base import ComputeCall, FusedGraph, NodeGroup, capability
from ephost import ep_context
from ephost.external_data import ExternalData
from ephost.graph import BUILTIN_DOMAINS
from ephost.errors import EpError, EpInternal, EpInvalidArgument, EpNotFound
from ephost.client.planner import Claim, Placement

log = logging.getLogger(__name__)

FALLBACK = "fallback"  # the registration name the fallback's placements go by in assignment info
# Each fallback: the in-process EPs it chains, in the order they are asked.
CHAINS: dict[str, tuple[str, ...]] = {"onnxruntime": ("onnxruntime", "reference"), "reference": ("reference",)}
# The name each of those EPs goes by (its factory's get_name), known without making it
EP_NAMES = {"onnxruntime": "CPUExecutionProvider", "reference": "reference"}


def check_domains(model: onnx.ModelProto, names) -> None:
    """Raise EpNotFound naming these nodes' domains where one is a custom op library's: the fallback loads no
    custom op library (that is vendor code, which runs in workers: the onnxruntime EP's custom_ops_library), so
    no fallback EP has a kernel for it. Functions the model defines are no custom ops: they run by their body."""
    names = set(names)
    functions = {(f.domain, f.name) for f in model.functions}
    vendor = [n for n in model.graph.node if n.name in names and n.domain not in BUILTIN_DOMAINS
              and (n.domain, n.op_type) not in functions]
    if not vendor:
        return
    domains = ", ".join(repr(d) for d in dict.fromkeys(n.domain for n in vendor))
    shown = ", ".join(f"{n.name!r} ({n.domain}:{n.op_type})" for n in vendor[:5])
    more = ", ..." if len(vendor) > 5 else ""
    raise EpNotFound(f"no EP of this session runs operator domain {domains} (node(s) {shown}{more}):"
                     f" they need a custom op library, and the CPU fallback loads none (vendor code runs in "
                     f"workers). Register an onnxruntime worker with the option custom_ops_library=PATH or "
                     f"module:function (e.g. onnxruntime_extensions:get_library_path for ai.onnx.contrib)")


def _check_ep_contexts(model: onnx.ModelProto, claimed: frozenset[str]) -> None:
    """Raise EpNotFound naming the EPContext nodes no EP claimed: only the EP that compiled one restores it."""
    left = [n for n in model.graph.node if ep_context.is_ep_context(n) and n.name not in claimed]
    if left:
        shown = ", ".join(f"{n.name!r} (source {ep_context.source_of(n)!r})" for n in left[:5])
        raise EpNotFound(f"no EP of this session restores EPContext node(s) {shown}: add the EP each names as its "
                         "source to the session, or run the model it was compiled from")


def default_fallback() -> str:
    """ONNX Runtime's CPU EP where it is installed, else the reference evaluator."""
    return "onnxruntime" if importlib.util.find_spec("onnxruntime") is not None else "reference"


class CpuFallback:
    """The fallback's placements, in the order they are asked (ORT's CPU EP, then the reference evaluator)."""

    def __init__(self, kind: str | None, ep_config: Mapping[str, str] | None = None):
        """`ep_config`: the session's config entries and settings, which each fallback EP is created with (as
        every EP of the session is)."""
        if kind is not None and kind not in CHAINS:
            raise EpInvalidArgument(f"SessionOptions.fallback must be one of {sorted(CHAINS)} or None, got {kind!r}")
        self.kind = kind
        self._chain: tuple[str, ...] = tuple(CHAINS.get(kind, ()))
        self._ep_config = dict(ep_config or {})

    @property
    def ep_names(self) -> tuple[str, ...]:
        """The names its EPs go by, in the order they are asked."""
        return tuple(EP_NAMES[ep] for ep in self._chain)

    @property
    def cpu_ep_name(self) -> str | None:
        """ORT's CPU EP's name where the fallback is that EP (a session's providers= naming it means the fallback)."""
        return EP_NAMES["onnxruntime"] if self._chain[:1] == ("onnxruntime",) else None

    @functools.cached_property
    def placements(self) -> tuple[Placement, ...]:
        """Made on first use: a session whose EPs take every node never loads the fallback's EPs (the first
        one in a process is slow to make: ORT's factory, the evaluator's op list)."""
        return tuple(self._placement(ep) for ep in self._chain)

    def _placement(self, ep: str) -> Placement:
        factory = load_factory(ep, {})  # as `inproc:NAME` hosts it
        return Placement(FALLBACK, factory.get_name(), factory.create_ep([0], dict(self._ep_config)))

    def __bool__(self) -> bool:
        return bool(self._chain)

    def owns(self, placement: Placement) -> bool:
        return "placements" in self.__dict__ and any(placement is p for p in self.placements)

    def claims(self, model: onnx.ModelProto, claimed: frozenset[str],
               external: ExternalData | None = None) -> list[Claim]:
        """GetCapability of each fallback EP in turn, each seeing what the ones before it took."""
        if self.placements:
            check_domains(model, (n.name for n in model.graph.node if n.name not in claimed))
        out = []
        for i, placement in enumerate(self.placements):
            if i == len(self.placements) - 1 and placement.ep_name == "reference":
                # The last resort restores its own EPContext nodes, and tries every node left, beyond the
                # ai.onnx ops its GetCapability vouches for (ai.onnx.ml, preview training ops, functions): a
                # node it cannot run fails its compile, clearly.
                groups = [NodeGroup((n.name,), fused=True)
                          for n in ep_context.own_nodes(model, placement.ep_name, claimed)]
                claimed = claimed | {g.node_names[0] for g in groups}
                _check_ep_contexts(model, claimed)
                rest = tuple(n.name for n in model.graph.node if n.name not in claimed)
                groups += [NodeGroup(rest, fused=True)] if rest else []
            else:
                groups = capability(placement.ep, model, claimed, external)
            out.append(Claim(placement, groups))
            claimed = claimed | {n for g in groups for n in g.node_names}
        return out

    def compile(self, graph: FusedGraph, placement: Placement | None = None) -> tuple[Placement, Any]:
        """`graph` compiled on `placement` (default: the first fallback EP), or on the next one where it
        cannot compile it, e.g. a partition with an op ORT lacks moved here after its EP failed."""
        check_domains(graph.source.model, graph.nodes)
        node = graph.ep_context_node
        if node is not None and ep_context.source_of(node) not in {p.ep_name for p in self.placements}:
            raise EpNotFound(f"the fallback cannot run EPContext node {node.name!r}: only its EP "
                             f"({ep_context.source_of(node)!r}) restores its compiled form")
        chain = list(self.placements)
        if placement is not None:
            chain = chain[chain.index(placement):]
        for i, candidate in enumerate(chain):
            try:
                (info,) = candidate.ep.compile([graph])
            except EpError as e:
                if i == len(chain) - 1:
                    raise
                log.info("%s cannot compile %s (%s); the next fallback takes it", candidate.ep_name, graph.name, e)
                continue
            rest = chain[i + 1:]
            if rest:  # a run ORT fails on a node it took goes to the next fallback EP, not to the application
                info = _NextOnFailure(info, graph, lambda g=graph, r=rest[0]: r.ep.compile([g])[0])
            return candidate, info
        raise EpInvalidArgument(f"no fallback EP can compile {graph.name!r} (SessionOptions.fallback is None)")


class _NextOnFailure:
    """A fallback partition that re-runs on the next fallback EP when the first fails inside (EpInternal:
    ORT's own failure on a node it claimed). Bad input fails anywhere and is raised as it is."""

    def __init__(self, info, graph: FusedGraph, compile_next: Callable[[], Any]):
        self.name = info.name
        self._info, self._graph, self._compile_next, self._next = info, graph, compile_next, None

    def compute(self, call: ComputeCall) -> list:
        if self._next is None:
            try:
                return self._info.compute(call)
            except EpInternal as e:
                log.warning("the fallback failed on %s (%s); the next fallback EP runs it", self.name, e)
                self._next = self._compile_next()
        return self._next.compute(call)
