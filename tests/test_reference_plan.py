"""The reference EP's plan (eps/reference_plan.py): the evaluator's kernels called directly give what the
evaluator gives, fail as it fails, and leave to it the graphs it must run itself."""
import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import RuntimeTypeError

import ephost
from ephost import InferenceSession, SessionOptions
from ephost.eps.reference_plan import Plan
import models
from models import tensor


def evaluator(nodes, inputs, outputs, initializers=()):
    return ReferenceEvaluator(models.model(nodes, inputs, outputs, initializers))


def test_a_plan_gives_what_the_evaluator_gives():
    # Unary, binary, attributes passed by OpRun.run (Transpose, Gemm), an initializer, an optional input left out
    # (Clip's min), two outputs (TopK), a scalar result made an array (ReduceSum, keepdims=0).
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 2], np.arange(6, dtype=np.float32).tolist())
    ev = evaluator([
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t"], perm=[1, 0]),
        helper.make_node("Gemm", ["r", "w"], ["g"], alpha=0.5, transB=0),
        helper.make_node("Clip", ["g", "", "cap"], ["c"]),
        helper.make_node("TopK", ["c", "k"], ["values", "indices"], axis=1),
        helper.make_node("Sub", ["values", "values"], ["zero"]),
        helper.make_node("ReduceSum", ["t"], ["s"], keepdims=0),
    ], [tensor("x", [2, 3]), tensor("cap", []), tensor("k", [1], TensorProto.INT64)],
        [tensor("t", [3, 2]), tensor("values", [2, 1]), tensor("indices", [2, 1], TensorProto.INT64),
         tensor("zero", [2, 1]), tensor("s", [])], [w])
    plan = Plan.of(ev)
    assert plan is not None
    feeds = {"x": np.array([[1, -2, 3], [-4, 5, 6]], np.float32), "cap": np.float32(4),
             "k": np.array([1], np.int64)}
    got, expected = plan.run(feeds), ev.run(None, feeds)
    assert len(got) == len(expected) == 5
    for a, b in zip(got, expected):
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def test_a_plan_fails_as_the_evaluator_fails():
    ev = evaluator([helper.make_node("Add", ["a", "b"], ["y"])], [tensor("a", [2]), tensor("b", [2])],
                   [tensor("y", [2])])
    feeds = {"a": np.ones(2, np.float32), "b": np.ones(2, np.float64)}  # Add's inputs must agree
    with pytest.raises(RuntimeTypeError, match="Input type mismatch"):
        ev.run(None, feeds)
    with pytest.raises(RuntimeTypeError, match="Input type mismatch"):
        Plan.of(ev).run(feeds)


def test_graphs_with_subgraphs_are_left_to_the_evaluator():
    branch = helper.make_graph([helper.make_node("Neg", ["x"], ["z"])], "b", [], [tensor("z", [2])])
    ev = evaluator([helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)],
                   [tensor("c", [], TensorProto.BOOL), tensor("x", [2])], [tensor("y", [2])])
    assert Plan.of(ev) is None


def test_a_worker_runs_plans_and_evaluator_graphs_alike():
    # One partition the plan runs (Mul, Relu) and one with a subgraph the evaluator runs (If), in one worker.
    branch = helper.make_graph([helper.make_node("Neg", ["r"], ["z"])], "b", [], [tensor("z", [2])])
    m = models.model([helper.make_node("Mul", ["x", "x"], ["m"], name="mul"),
                      helper.make_node("Relu", ["m"], ["r"], name="relu"),
                      helper.make_node("If", ["c"], ["y"], name="if", then_branch=branch, else_branch=branch)],
                     [tensor("c", [], TensorProto.BOOL), tensor("x", [2])], [tensor("y", [2])])
    with ephost.Environment() as env:
        env.register_execution_provider_library("ref", "reference")
        options = SessionOptions()
        options.add_provider_for_devices(env.get_ep_devices())
        with InferenceSession(m, options, env=env) as session:
            x = np.array([3, -2], np.float32)
            (y,) = session.run(None, {"c": np.array(True), "x": x})
            np.testing.assert_array_equal(y, -(x * x))
