"""Deciding where each node runs: from what each EP claimed (GetCapability answers, in the order the EPs were
asked) to partitions that can be fused without a cycle, in topological order. Pure: no EP is called here."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from ephost.eps.base import FusedGraph, NodeGroup
from ephost.errors import EpInvalidArgument
from ephost.graph import GraphIndex, cluster

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """An EP a node can be placed on: its registration name, the EP's own name, and the EP object."""

    registration: str
    ep_name: str
    ep: Any


@dataclass(frozen=True)
class Claim:
    """What one EP answered to GetCapability."""

    placement: Placement
    groups: Sequence[NodeGroup]


@dataclass
class Partition:
    graph: FusedGraph
    placement: Placement
    keep: tuple[int, ...] = ()        # outputs a later partition of the same EP reads: they stay where made
    last_reads: tuple[str, ...] = ()  # values no later partition reads: let go of once this one ran
    compute_info: Any = None
    allocator: Any = None
    fallback_info: Any = None         # (placement, compute info) on the CPU fallback, once it was needed

    @property
    def registration(self) -> str:
        return self.placement.registration


def plan_partitions(index: GraphIndex, claims: Sequence[Claim], fallbacks: Sequence[Claim] = ()) -> list[Partition]:
    """Partitions in the order they run. A node goes to the first EP that claimed it; nodes no EP claimed go
    to the first fallback EP that claimed them (`fallbacks`: the fallback EPs' answers, in the order they were
    asked, each seeing what was taken before it). A node nobody claimed is an error (EpInvalidArgument naming
    it). Claims of unknown or already-claimed nodes are ignored (and logged)."""
    key_of: dict[str, tuple] = {}
    fusable: set[tuple] = set()
    placements: dict[tuple, Placement] = {}
    for position, claim in enumerate([*claims, *fallbacks]):
        for g, group in enumerate(claim.groups):
            key = (position, g)
            placements[key] = claim.placement
            if group.fused:
                fusable.add(key)
            for name in group.node_names:
                if name not in index.nodes or name in key_of:
                    log.warning("%s claimed node %r, which %s; ignored", claim.placement.registration, name,
                                "does not exist" if name not in index.nodes else "was already claimed")
                    continue
                key_of[name] = key
    left = [name for name in index.nodes if name not in key_of]
    if left:
        shown = ", ".join(left[:10]) + (f" and {len(left) - 10} more" if len(left) > 10 else "")
        asked = (", ".join(dict.fromkeys(c.placement.ep_name for c in fallbacks))
                 or "none (SessionOptions.fallback is None)")
        raise EpInvalidArgument(f"no EP takes node(s) {shown}; fallback EPs asked: {asked}")

    partitions = []
    for i, c in enumerate(cluster(index, key_of, fusable)):
        placement = placements[c.key]
        inputs, outputs = index.partition_io(c.nodes)
        graph = FusedGraph(f"{placement.registration}_{i}", index, tuple(c.nodes), tuple(inputs), tuple(outputs))
        partitions.append(Partition(graph, placement))
    last_reader = {v: p for p in partitions for v in p.graph.inputs}  # the later partition wins
    for p in partitions:
        p.last_reads = tuple(v for v in dict.fromkeys(p.graph.inputs) if last_reader[v] is p)
        readers = {v: {q.registration for q in partitions if v in q.graph.inputs} for v in p.graph.outputs}
        p.keep = tuple(i for i, v in enumerate(p.graph.outputs) if p.registration in readers[v])
    return partitions
