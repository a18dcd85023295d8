"""The CPU fallback: ONNX Runtime's CPU EP in process for what no EP takes and for the partitions of an EP that
failed, ONNX's reference evaluator only for what ORT cannot run, and no fallback at all when asked."""
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import ephost
from ephost import InferenceSession, SessionOptions
from ephost.cli.run_command import bundled_input, bundled_model
import models

pytest.importorskip("onnxruntime", reason="the onnxruntime fallback needs the onnxruntime extra")

ORT_CPU = "CPUExecutionProvider"


def ep_of_each_node(session) -> dict[str, tuple[str, str]]:
    return {n.name: (s.registration, s.ep_name) for s in session.get_provider_graph_assignment_info() for n in s.nodes}


def options(fallback="onnxruntime", policy="raise", env=None):
    o = SessionOptions()
    o.fallback = fallback
    o.ep_failure_policy = policy
    if env is not None:
        o.add_provider_for_devices(env.get_ep_devices())
    return o


def mish_model():
    # Mish on double at opset 24: ONNX Runtime's CPU EP has no kernel for it; the reference evaluator has.
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Cast", ["r"], ["d"], name="cast", to=onnx.TensorProto.DOUBLE),
             helper.make_node("Mish", ["d"], ["y"], name="mish")]
    return models.model(nodes, [models.tensor("x", [3, 3])], [models.tensor("y", [3, 3], onnx.TensorProto.DOUBLE)],
                        opset=[helper.make_opsetid("", 24)])


def test_onnx_runtime_is_the_default_fallback_and_takes_what_no_ep_took(env):
    assert SessionOptions().fallback == "onnxruntime"
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    with InferenceSession(models.diamond(), env=env) as session:
        assert ep_of_each_node(session) == {n: ("fallback", ORT_CPU) for n in ("add", "relu", "mul")}
        np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)


def test_an_op_onnx_runtime_lacks_runs_on_the_reference_evaluator_and_the_rest_on_onnx_runtime(env):
    x = np.random.default_rng(1).standard_normal((3, 3)).astype(np.float32)
    with InferenceSession(mish_model(), options(), env=env) as session:
        assert ep_of_each_node(session) == {"relu": ("fallback", ORT_CPU), "cast": ("fallback", ORT_CPU),
                                            "mish": ("fallback", "reference")}
        (y,) = session.run(None, {"x": x})
    d = np.maximum(x, 0).astype(np.float64)
    np.testing.assert_allclose(y, d * np.tanh(np.log1p(np.exp(d))), rtol=1e-6)


def test_the_reference_fallback_takes_every_node(env):
    x = np.random.default_rng(2).standard_normal((2, 3)).astype(np.float32)
    with InferenceSession(models.diamond(), options("reference"), env=env) as session:
        assert ep_of_each_node(session) == {n: ("fallback", "reference") for n in ("add", "relu", "mul")}
        np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)


def test_no_fallback_fails_at_creation_naming_the_nodes_nobody_took(env):
    with pytest.raises(ephost.EpInvalidArgument, match=r"no EP takes node\(s\) add, relu, mul; .*fallback is None"):
        InferenceSession(models.diamond(), options(None), env=env)
    # Where an EP takes every node, no fallback is needed.
    with ephost.Environment() as own:
        own.register_execution_provider_library("cpu", "inproc:reference")
        with InferenceSession(models.diamond(), options(None, env=own), env=own) as session:
            assert {s.registration for s in session.get_provider_graph_assignment_info()} == {"cpu"}


def test_an_unknown_fallback_is_refused(env):
    with pytest.raises(ephost.EpInvalidArgument, match="fallback must be one of"):
        InferenceSession(models.diamond(), options("cuda"), env=env)


@pytest.mark.timeout(120)
def test_after_a_crash_squeezenet_runs_on_onnx_runtime_with_the_expected_output():
    path, expected_path = bundled_model("squeezenet")
    expected = numpy_helper.to_array(onnx.load_tensor(expected_path))
    model = onnx.load(path)
    with ephost.Environment() as env:
        env.register_execution_provider_library("chaos", "chaos", {"fault": "segfault", "after": "1",
                                                                   "crash_limit": "1"})
        with InferenceSession(model, options(policy="fallback", env=env), env=env) as session:
            assert {s.registration for s in session.get_provider_graph_assignment_info()} == {"chaos"}
            feeds = {i.name: bundled_input(i) for i in session.get_inputs()}
            for _ in range(2):  # the first run crashes the worker; both give the model's expected output
                (y,) = session.run(None, feeds)
                np.testing.assert_allclose(y, expected, rtol=1e-3, atol=1e-4)
            assert session.failure_counters["moved to the fallback"] == 1
            owners = set(ep_of_each_node(session).values())
            assert owners == {("fallback", ORT_CPU)}, "the failed EP's partitions run on ORT, not the evaluator"
