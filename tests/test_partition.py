"""The grouping of claimed nodes into partitions: never a cycle between partitions."""
from onnx import helper

from ephost.graph import GraphIndex, cluster, prepare_model
import models


def check_order(index, clusters):
    """Every partition reads only values made by partitions before it (or graph inputs/initializers)."""
    made = set(index.graph_inputs) | index.initializers
    for c in clusters:
        inputs, outputs = index.partition_io(c.nodes)
        assert set(inputs) <= made, f"{c.nodes} reads {set(inputs) - made} before it is made"
        made |= {v for n in c.nodes for v in index.nodes[n].output}


def test_two_groups_that_would_feed_each_other_are_split():
    # a -> b and b2 -> a2, with {a, a2} one EP's group and {b, b2} another's: each group alone has no
    # path through the other, yet fusing both would make the two partitions wait on each other.
    nodes = [helper.make_node("Relu", ["x"], ["va"], name="a"),
             helper.make_node("Relu", ["x"], ["vb2"], name="b2"),
             helper.make_node("Add", ["va", "x"], ["vb"], name="b"),
             helper.make_node("Add", ["vb2", "x"], ["va2"], name="a2")]
    model = models.model(nodes, [models.tensor("x", [1])], [models.tensor("vb", [1]), models.tensor("va2", [1])])
    index = GraphIndex.of(prepare_model(model))
    key = {"a": "A", "a2": "A", "b": "B", "b2": "B"}
    clusters = cluster(index, key, {"A", "B"})
    check_order(index, clusters)
    assert sorted(len(c.nodes) for c in clusters) in ([1, 1, 2], [1, 1, 1, 1])


def test_diamond_split_and_chain_fused():
    index = GraphIndex.of(prepare_model(models.diamond()))
    clusters = cluster(index, {"add": "A", "mul": "A", "relu": "B"}, {"A", "B"})
    assert [c.nodes for c in clusters] == [["add"], ["relu"], ["mul"]]
    clusters = cluster(index, {"add": "A", "mul": "A", "relu": "A"}, {"A"})
    assert [c.nodes for c in clusters] == [["add", "relu", "mul"]]
    clusters = cluster(index, {"add": "A", "mul": "A", "relu": "A"}, set())  # single nodes
    assert [c.nodes for c in clusters] == [["add"], ["relu"], ["mul"]]


def test_nodes_without_names_get_unique_ones():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["b"], name="dup"),
             helper.make_node("Relu", ["b"], ["y"], name="dup")]
    model = models.model(nodes, [models.tensor("x", [1])], [models.tensor("y", [1])])
    names = [n.name for n in prepare_model(model).graph.node]
    assert len(set(names)) == 3 and all(names)
    assert [n.name for n in model.graph.node] == ["", "dup", "dup"], "the caller's model is left alone"


def test_the_builtin_domains_name_every_domain_of_onnxs_schemas():
    """ephost.graph lists ONNX's operator domains rather than reading every schema at start (13 MiB per worker):
    a new domain in a new onnx release must be added there, or its nodes would be taken for custom ops."""
    import onnx.defs
    from ephost.graph import BUILTIN_DOMAINS, ONNX_DOMAINS
    domains = {s.domain for s in onnx.defs.get_all_schemas_with_history()}
    assert domains == ONNX_DOMAINS and domains <= BUILTIN_DOMAINS
