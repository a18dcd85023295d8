"""GetCapability, Compile and Compute of the reference EP, in process and through a worker."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import ephost
from ephost import Tensor
from ephost.eps.base import ComputeCall, FusedGraph
from ephost.graph import GraphIndex, prepare_model
from helpers import TRANSPORTS, make_env


def small_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Add", ["x", "x"], ["s"], name="add"),
             helper.make_node("Relu", ["s"], ["r"], name="relu"),
             helper.make_node("Mul", ["r", "x"], ["y"], name="mul")]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 18)])


# Over both transports of the data plane: the fast lane and gRPC alone.
@pytest.fixture(scope="module", params=list(TRANSPORTS))
def env(request):
    with make_env(request.param) as environment:
        yield environment


@pytest.fixture(params=["ref", "local"])
def ep(request, env):
    registration = env.registration(request.param)
    ep = registration.factory.create_ep([0], {})
    yield ep
    registration.factory.release_ep(ep)


def test_capability_respects_claimed_nodes(ep):
    (group,) = ep.get_capability(small_model(), frozenset())
    assert group.fused and set(group.node_names) == {"add", "relu", "mul"}
    (group,) = ep.get_capability(small_model(), frozenset({"relu"}))
    assert set(group.node_names) == {"add", "mul"}


def test_ops_allow_list_limits_capability():
    with ephost.Environment() as env:
        env.register_execution_provider_library("few", "reference", {"ops": "Add,Mul"})
        factory = env.registration("few").factory
        ep = factory.create_ep([0], {})
        (group,) = ep.get_capability(small_model(), frozenset())
        assert set(group.node_names) == {"add", "mul"}


def whole(name, model):
    index = GraphIndex.of(prepare_model(model))
    return FusedGraph(name, index, tuple(index.order), tuple(index.graph_inputs), tuple(index.graph_outputs))


def test_compile_and_compute_match_the_evaluator(ep):
    graph = whole("whole", small_model())
    (info,) = ep.compile([graph])
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    (y,) = info.compute(ComputeCall([Tensor.from_numpy(x)]))
    np.testing.assert_allclose(y.numpy(), np.maximum(x + x, 0) * x, rtol=1e-6)
    (again,) = ep.compile([FusedGraph("again", graph.source, graph.nodes, graph.inputs, graph.outputs)])
    np.testing.assert_allclose(again.compute(ComputeCall([Tensor.from_numpy(x)]))[0].numpy(), y.numpy())
    ep.release_node_compute_infos([info, again])


def test_compute_with_the_wrong_inputs_is_a_clear_error(ep):
    (info,) = ep.compile([whole("whole", small_model())])
    with pytest.raises(ephost.EpInvalidArgument, match="takes 1 inputs, got 2"):
        info.compute(ComputeCall([Tensor.from_numpy(np.zeros((2, 3), np.float32))] * 2))
