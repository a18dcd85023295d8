"""KernelInfo: an EP's compute sees its partition's input and output names, element types and shapes and its
provider options (ORT's KernelInfo_* calls), in process and in a worker; the `example` EP uses them."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import ephost
from ephost import InferenceSession, SessionOptions
from ephost.eps import load_factory
from ephost.eps.base import ComputeCall, FusedGraph
from ephost.eps.kernel_info import KernelInfo, TypeInfo
from ephost.graph import GraphIndex, prepare_model
import models


def symbolic_model():
    """x [N, 3] float -> Relu -> Neg -> y; and a Cast to double on the side, which the example EP does not take."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Neg", ["r"], ["y"], name="neg"),
             helper.make_node("Cast", ["x"], ["d"], name="cast", to=TensorProto.DOUBLE)]
    return models.model(nodes, [models.tensor("x", ["N", 3])],
                        [models.tensor("y", ["N", 3]), models.tensor("d", ["N", 3], TensorProto.DOUBLE)])


def fused(model, names):
    index = GraphIndex.of(prepare_model(model))
    inputs, outputs = index.partition_io(list(names))
    return FusedGraph("part_0", index, tuple(names), tuple(inputs), tuple(outputs))


def test_a_fused_graph_describes_its_inputs_outputs_and_options():
    info = fused(symbolic_model(), ["relu", "neg"]).kernel_info({"max_batch": "4"})
    assert (info.get_node_name(), info.get_input_count(), info.get_output_count()) == ("part_0", 1, 1)
    assert (info.get_input_name(0), info.get_output_name(0)) == ("x", "y")
    assert info.get_input_type_info(0) == TypeInfo("tensor", TensorProto.FLOAT, ("N", 3))
    assert info.get_output_type_info(0).type_string == "tensor(float)"
    assert info.get_output_type_info(0).dtype == np.float32
    assert info.get_option("max_batch") == "4" and info.get_option("other") is None
    with pytest.raises(ephost.EpOutOfRange, match="part_0 has 1 input"):
        info.get_input_type_info(1)
    with pytest.raises(TypeError):
        info.options["max_batch"] = "5"  # read-only: the EP's options as it was created with them


def test_values_of_other_kinds_and_unknown_shapes():
    seq = helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, None)
    assert TypeInfo.of(seq) == TypeInfo("sequence", 0, None) and TypeInfo.of(seq).type_string == "sequence"
    unknown = helper.make_tensor_value_info("u", TensorProto.INT64, None)
    assert TypeInfo.of(unknown) == TypeInfo("tensor", TensorProto.INT64, None)
    model = models.model([helper.make_node("Add", ["a", "w"], ["b"], name="add")], [models.tensor("a", [2])],
                         [models.tensor("b", [2])], [helper.make_tensor("w", TensorProto.FLOAT, [2], [1, 2])])
    info = KernelInfo.of(model, "m")
    assert [v.name for v in info.inputs] == ["a"], "initializers are no inputs of the kernel"


def test_the_example_eps_compute_keeps_its_kernel_info_in_process():
    ep = load_factory("example").create_ep([0], {"max_batch": "2"})
    (group,) = ep.get_capability(prepare_model(symbolic_model()), frozenset())
    assert set(group.node_names) == {"relu", "neg"}
    (compute_info,) = ep.compile([fused(symbolic_model(), group.node_names)])
    assert compute_info.kernel_info == fused(symbolic_model(), ["relu", "neg"]).kernel_info({"max_batch": "2"})
    x = np.array([[-1, 2, -3]], np.float32)
    (y,) = compute_info.compute(ComputeCall([x]))
    np.testing.assert_array_equal(y.numpy(), -np.maximum(x, 0))


@pytest.fixture(scope="module")
def example_env():
    with ephost.Environment() as env:
        env.register_execution_provider_library("npu", "example")
        yield env


def example_session(env, options):
    o = SessionOptions()
    o.add_provider_for_devices([d for d in env.get_ep_devices() if d.registration_name == "npu"], options)
    return InferenceSession(symbolic_model(), o, env=env)


def test_in_a_worker_compute_sees_names_types_shapes_and_provider_options(example_env):
    """The example EP checks each input against its KernelInfo and its provider option max_batch: a batch over
    the limit is refused in the worker with the input's name, type and symbolic shape from its KernelInfo."""
    with example_session(example_env, {"max_batch": "2"}) as session:
        assert {s.registration for s in session.get_provider_graph_assignment_info()
                for n in s.nodes if n.name in ("relu", "neg")} == {"npu"}
        x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
        y, d = session.run(None, {"x": x})
        np.testing.assert_array_equal(y, -np.maximum(x, 0))
        np.testing.assert_array_equal(d, x.astype(np.float64))
        with pytest.raises(ephost.EpInvalidArgument,
                           match=r"input 'x' \(tensor\(float\), shape \['N', 3\]\) has batch 3; .* at most 2"):
            session.run(None, {"x": np.zeros((3, 3), np.float32)})
    with example_session(example_env, {"max_batch": "8"}) as session:  # other options, another EP and kernel
        assert session.run(["y"], {"x": np.ones((3, 3), np.float32)})[0].shape == (3, 3)


def test_an_unknown_provider_option_is_refused_naming_what_the_ep_takes(example_env):
    with pytest.raises(ephost.EpInvalidArgument, match="max_batch"):
        example_session(example_env, {"batch": "2"})
