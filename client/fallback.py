"""The session's CPU fallback: what runs the nodes no EP took, and the partitions of an EP that failed.

ONNX Runtime's CPU EP, hosted in this process through the same EP interface as any `inproc:` EP (it is ORT's
own fallback: trusted code), takes what it can run; ONNX's reference evaluator (the `reference` EP) takes only
what ORT cannot (ops it lacks, opsets or IR versions it does not read, a run it fails). `SessionOptions.fallback`
picks the chain: "onnxruntime", "reference", or None (no fallback: a node no EP took is an error).
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Any, Callable

import onnx

from ephost.eps import load_factory
from ephost.eps.base import FusedGraph, NodeGroup
from ephost.errors import EpError, EpInternal, EpInvalidArgument
from ephost.client.planner import Claim, Placement

log = logging.getLogger(__name__)

FALLBACK = "fallback"  # the registration name the fallback's placements go by in assignment info
# Each fallback: the in-process EPs it chains, in the order they are asked.
CHAINS: dict[str, tuple[str, ...]] = {"onnxruntime": ("onnxruntime", "reference"), "reference": ("reference",)}


def default_fallback() -> str:
    """ONNX Runtime's CPU EP where it is installed, else the reference evaluator."""
    return "onnxruntime" if importlib.util.find_spec("onnxruntime") is not None else "reference"


class CpuFallback:
    """The fallback's placements, in the order they are asked (ORT's CPU EP, then the reference evaluator)."""

    def __init__(self, kind: str | None):
        if kind is not None and kind not in CHAINS:
            raise EpInvalidArgument(f"SessionOptions.fallback must be one of {sorted(CHAINS)} or None, got {kind!r}")
        self.kind = kind
        self.placements: tuple[Placement, ...] = tuple(self._placement(ep) for ep in CHAINS.get(kind, ()))

    @staticmethod
    def _placement(ep: str) -> Placement:
        factory = load_factory(ep, {})  # as `inproc:NAME` hosts it
        return Placement(FALLBACK, factory.get_name(), factory.create_ep([0], {}))

    def __bool__(self) -> bool:
        return bool(self.placements)

    def owns(self, placement: Placement) -> bool:
        return any(placement is p for p in self.placements)

    def claims(self, model: onnx.ModelProto, claimed: frozenset[str]) -> list[Claim]:
        """GetCapability of each fallback EP in turn, each seeing what the ones before it took."""
        out = []
        for i, placement in enumerate(self.placements):
            if i == len(self.placements) - 1 and placement.ep_name == "reference":
                # The last resort tries every node left, beyond the ai.onnx ops its GetCapability vouches for
                # (ai.onnx.ml, preview training ops, functions): a node it cannot run fails its compile, clearly.
                rest = tuple(n.name for n in model.graph.node if n.name not in claimed)
                groups = [NodeGroup(rest, fused=True)] if rest else []
            else:
                groups = placement.ep.get_capability(model, claimed)
            out.append(Claim(placement, groups))
            claimed = claimed | {n for g in groups for n in g.node_names}
        return out

    def compile(self, graph: FusedGraph, placement: Placement | None = None) -> tuple[Placement, Any]:
        """`graph` compiled on `placement` (default: the first fallback EP), or on the next one where it
        cannot compile it, e.g. a partition with an op ORT lacks moved here after its EP failed."""
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

    def compute(self, inputs, allocator=None, keep=(), timeout=None, into=None, leave=()):
        if self._next is None:
            try:
                return self._info.compute(inputs, allocator, keep, timeout, into, leave)
            except EpInternal as e:
                log.warning("the fallback failed on %s (%s); the next fallback EP runs it", self.name, e)
                self._next = self._compile_next()
        return self._next.compute(inputs, allocator, keep, timeout, into, leave)
