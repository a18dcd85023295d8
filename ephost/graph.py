"""ONNX graph surgery for partitioning: naming nodes, the graph's dependency index, grouping claimed nodes
into partitions that can be fused without creating a cycle, and cutting a partition out as a standalone
model. Shared by the session (client) and the worker, which cuts partitions out of a model it was sent once.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Mapping

import onnx
import onnx.defs
from onnx import helper, shape_inference

from ephost.errors import EpDeadlineExceeded, EpInvalidArgument

log = logging.getLogger(__name__)


# Operator domains ONNX defines: every domain of the onnx package's schemas (tests/test_partition.py checks this
# against onnx.defs; listing the schemas here would cost every worker memory and time at start).
ONNX_DOMAINS = frozenset({"", "ai.onnx.ml", "ai.onnx.preview", "ai.onnx.preview.training"})
# Those, and the domains ONNX Runtime implements itself (its contrib and internal ones). A node of any other
# domain needs a custom op library, unless its model defines it as a function.
BUILTIN_DOMAINS = frozenset({"ai.onnx", "ai.onnx.training", "com.microsoft", "com.microsoft.nchwc",
                             "com.microsoft.experimental", "com.ms.internal.nhwc", "org.pytorch.aten", *ONNX_DOMAINS})


def load_schemas() -> None:
    """Have the onnx package register its operator schemas (once per process; paid by the first shape inference
    otherwise, that is by the first session)."""
    onnx.defs.has("Relu")


def prepare_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose nodes all have unique names (GetCapability and Compile speak of nodes by name), with
    the value types shape inference can find (partitions need the types of their inputs and outputs)."""
    prepared = onnx.ModelProto()
    prepared.CopyFrom(model)
    seen: set[str] = set()
    for i, node in enumerate(prepared.graph.node):
        if not node.name or node.name in seen:
            base = node.name or node.op_type
            name, k = f"{base}_{i}", 0
            while name in seen:
                k += 1
                name = f"{base}_{i}_{k}"
            node.name = name
        seen.add(node.name)
    try:
        inferred = shape_inference.infer_shapes(prepared, check_type=False, strict_mode=False)
        return inferred
    except Exception as e:  # types are a help to EPs, not a requirement
        log.info("shape inference failed, partitions will carry fewer types: %s", e)
        return prepared


def subgraph_inputs(node: onnx.NodeProto) -> list[str]:
    """Outer-scope values a control-flow node's subgraphs read (its implicit inputs)."""
    names: list[str] = []
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in graphs:
            defined = {i.name for i in g.input} | {t.name for t in g.initializer} | \
                      {t.name for t in g.sparse_initializer}
            for inner in g.node:
                for name in [*inner.input, *subgraph_inputs(inner)]:
                    if name and name not in defined and name not in names:
                        names.append(name)
                defined.update(inner.output)
    return names


_EVERY = 4095  # a deadline is looked at once every this many nodes (and one)


def _in_time(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise EpDeadlineExceeded("the call's deadline passed while the worker indexed its model")


@dataclass(eq=False)
class GraphIndex:
    """Who produces and who consumes every value of a model's main graph, and a topological order."""

    model: onnx.ModelProto
    nodes: dict[str, onnx.NodeProto] = field(default_factory=dict)
    inputs_of: dict[str, list[str]] = field(default_factory=dict)     # node -> values read (implicit too)
    producer: dict[str, str] = field(default_factory=dict)            # value -> node
    consumers: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    order: list[str] = field(default_factory=list)
    initializers: set[str] = field(default_factory=set)
    # Initializers that are also graph inputs: defaults a run may override (ORT's overridable initializers)
    overridable: set[str] = field(default_factory=set)
    graph_inputs: list[str] = field(default_factory=list)
    graph_outputs: list[str] = field(default_factory=list)
    # The model's external data files (ephost.external_data.ExternalData), where its tensors keep their bytes
    # outside it; None where it has none.
    external: Any = None
    digest: str = ""  # the content hash the worker knows it by (its bytes and its external files), where it has one

    @classmethod
    def of(cls, model: onnx.ModelProto, deadline: float | None = None) -> "GraphIndex":
        """The index of `model`; EpDeadlineExceeded once time.monotonic() passes `deadline` (a model of a million
        nodes takes seconds: a caller that stops waiting stops the work too)."""
        g = model.graph
        index = cls(model)
        index.initializers = {t.name for t in g.initializer} | {t.values.name for t in g.sparse_initializer}
        index.graph_inputs = [i.name for i in g.input if i.name not in index.initializers]
        index.overridable = {i.name for i in g.input if i.name in index.initializers}
        index.graph_outputs = [o.name for o in g.output]
        nodes, inputs_of, producer, consumers = index.nodes, index.inputs_of, index.producer, index.consumers
        for i, node in enumerate(g.node):
            if not i & _EVERY:
                _in_time(deadline)
            name = node.name  # (each read of a field makes a new object: read once)
            if name in nodes:
                raise EpInvalidArgument(f"two nodes are named {name!r}")
            nodes[name] = node
            reads = [n for n in node.input if n]
            if node.attribute:
                reads += [n for n in subgraph_inputs(node) if n not in reads]
            inputs_of[name] = reads
            for value in node.output:
                if value:
                    if value in producer:
                        raise EpInvalidArgument(f"value {value!r} is produced by two nodes")
                    producer[value] = name
            for value in reads:
                consumers[value].append(name)
        index.order = index._topological_order(deadline)
        return index

    def preds(self, node: str) -> set[str]:
        return {self.producer[v] for v in self.inputs_of[node] if v in self.producer}

    def _topological_order(self, deadline: float | None = None) -> list[str]:
        producer, inputs_of, consumers = self.producer, self.inputs_of, self.consumers
        known = set(producer) | self.initializers | set(self.graph_inputs)
        pending = {}
        for i, (node, reads) in enumerate(inputs_of.items()):
            if not i & _EVERY:
                _in_time(deadline)
            missing = [v for v in reads if v not in known]
            if missing:
                raise EpInvalidArgument(f"node {node!r} reads {missing[0]!r}, which nothing produces")
            pending[node] = len(reads) if len(reads) < 2 and (not reads or reads[0] in producer) \
                else len({producer[v] for v in reads if v in producer})
        ready = deque(n for n, k in pending.items() if k == 0)  # a deque: linear in the graph's size
        order: list[str] = []
        while ready:
            node = ready.popleft()
            if not len(order) & _EVERY:
                _in_time(deadline)
            order.append(node)
            for value in self.nodes[node].output:
                for consumer in dict.fromkeys(consumers.get(value, ())):
                    pending[consumer] -= 1
                    if pending[consumer] == 0:
                        ready.append(consumer)
        if len(order) != len(self.nodes):
            raise EpInvalidArgument("the graph has a cycle")
        return order

    def partition_io(self, nodes: Iterable[str]) -> tuple[list[str], list[str]]:
        """A partition's inputs (values it reads and does not make, initializers aside) and outputs
        (values it makes that a node outside it, or the graph, reads)."""
        members = set(nodes)
        inputs: list[str] = []
        outputs: list[str] = []
        for node in (n for n in self.order if n in members):
            for value in self.inputs_of[node]:
                if self.producer.get(value) not in members and value not in self.initializers \
                        and value not in inputs:
                    inputs.append(value)
            for value in self.nodes[node].output:
                if value and (value in self.graph_outputs
                              or any(c not in members for c in self.consumers.get(value, ()))):
                    outputs.append(value)
        return inputs, outputs


@dataclass
class Cluster:
    key: Hashable
    nodes: list[str]


def cluster(index: GraphIndex, key_of: Mapping[str, Hashable], fusable: set) -> list[Cluster]:
    """Group nodes into partitions, in an order they can run in.

    Nodes with the same key whose key is fusable are put together where that creates no cycle between
    partitions: a node joins a cluster only if the cluster is not already an ancestor (through other
    clusters) of one of the node's producers. Otherwise it starts a new cluster, so an EP's group is split,
    never run wrongly."""
    clusters: list[Cluster] = []
    ancestors: list[set[int]] = []
    successors: list[set[int]] = []
    by_key: dict[Hashable, list[int]] = defaultdict(list)
    cluster_of: dict[str, int] = {}
    for node in index.order:
        key = key_of[node]
        pred_clusters = {cluster_of[p] for p in index.preds(node)}
        chosen = None
        if key in fusable:
            candidates = [c for c in sorted(pred_clusters) if clusters[c].key == key]
            candidates += [c for c in reversed(by_key[key]) if c not in pred_clusters]
            for c in candidates:
                if all(c not in ancestors[x] for x in pred_clusters if x != c):
                    chosen = c
                    break
        if chosen is None:
            chosen = len(clusters)
            clusters.append(Cluster(key, []))
            ancestors.append(set())
            successors.append(set())
            by_key[key].append(chosen)
        clusters[chosen].nodes.append(node)
        cluster_of[node] = chosen
        for x in pred_clusters - {chosen}:
            successors[x].add(chosen)
            added = ancestors[x] | {x}
            stack = [chosen]
            while stack:
                y = stack.pop()
                if not added <= ancestors[y]:
                    ancestors[y] |= added
                    stack.extend(successors[y])
    # Kahn over the cluster graph, oldest first among the ready ones.
    pending = [len({x for x in range(len(clusters)) if c in successors[x]}) for c in range(len(clusters))]
    ready = [c for c in range(len(clusters)) if pending[c] == 0]
    order: list[int] = []
    while ready:
        ready.sort()
        c = ready.pop(0)
        order.append(c)
        for s in successors[c]:
            pending[s] -= 1
            if pending[s] == 0:
                ready.append(s)
    assert len(order) == len(clusters), "partitioning produced a cycle"
    return [clusters[c] for c in order]


def _value_infos(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    g = model.graph
    infos = {v.name: v for v in [*g.value_info, *g.input, *g.output]}
    for t in g.initializer:
        infos.setdefault(t.name, helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return infos


def extract(index: GraphIndex, name: str, nodes: Iterable[str], inputs: Iterable[str],
            outputs: Iterable[str]) -> onnx.ModelProto:
    """The partition as a standalone model: these nodes, inputs and outputs, and the initializers it reads
    (its control-flow subgraphs' outer-scope reads included). An initializer the model lists as a graph input
    stays one here too, after the partition's inputs: a default, not a constant (a runtime neither folds it nor
    reads its data to infer shapes, which it cannot where the data is in an external file)."""
    members = set(nodes)
    unknown = sorted(members - set(index.nodes))
    if unknown:
        raise EpInvalidArgument(f"partition {name!r} names nodes the model does not have: {unknown[:5]}")
    model, g = index.model, index.model.graph
    inputs, outputs = list(inputs), list(outputs)
    chosen = [index.nodes[n] for n in index.order if n in members]
    reads = {v for n in chosen for v in [*n.input, *subgraph_inputs(n)]}
    infos = _value_infos(model)

    def info(value: str) -> onnx.ValueInfoProto:
        return infos.get(value) or helper.make_empty_tensor_value_info(value)

    defaults = [v for v in (i.name for i in g.input) if v in index.overridable and v in reads and v not in inputs]
    graph = helper.make_graph(
        chosen, name, [info(v) for v in [*inputs, *defaults]], [info(v) for v in outputs],
        initializer=[t for t in g.initializer if t.name in reads],
        sparse_initializer=[t for t in g.sparse_initializer if t.values.name in reads],
        value_info=[infos[v] for n in chosen for v in n.output if v in infos and v not in set(outputs)],
    )
    part = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                             functions=list(model.functions), producer_name="ephost")
    return part
