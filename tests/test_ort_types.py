"""Values ONNX Runtime cannot take from numpy (bfloat16, float8, int4) reach ORT partitions, in a worker and in
the in-process fallback, as OrtValues of their ONNX type, and come back as ml_dtypes arrays; ORT failing at run
time on a node it claimed falls back under ep_failure_policy="fallback"."""
import warnings

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.backend.test.case.node import collect_testcases
from onnx.backend.test.runner import Runner

import ephost
from ephost import InferenceSession, backend
import models
from helpers import options_for

# (ONNX type, ml_dtypes type, opset where ORT's CPU EP casts it)
TYPES = {
    "bfloat16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16, 21),
    "float8e4m3fn": (TensorProto.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn, 21),
    "int4": (TensorProto.INT4, ml_dtypes.int4, 21),
}


def round_trip(elem: int, opset: int):
    """x (elem) -> Cast float -> Mul 2 -> Cast elem -> y: an input and an output of the type, on ORT."""
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    nodes = [helper.make_node("Cast", ["x"], ["f"], to=TensorProto.FLOAT, name="to_float"),
             helper.make_node("Mul", ["f", "two"], ["g"], name="double"),
             helper.make_node("Cast", ["g"], ["y"], to=elem, name="back")]
    return models.model(nodes, [models.tensor("x", [5], elem)], [models.tensor("y", [5], elem),
                                                                 models.tensor("g", [5])],
                        [two], opset=[helper.make_opsetid("", opset)])


@pytest.fixture(scope="module")
def env():
    with ephost.Environment() as environment:
        environment.register_execution_provider_library("ort", "onnxruntime")
        yield environment


@pytest.mark.parametrize("where", ["worker", "fallback"])
@pytest.mark.parametrize("type_name", list(TYPES))
def test_types_numpy_lacks_go_to_onnx_runtime_as_ort_values(env, type_name, where, caplog):
    elem, dtype, opset = TYPES[type_name]
    x = np.array([1, -2, 3, 0, 2], np.float32).astype(dtype)
    options = options_for(env, "ort") if where == "worker" else ephost.SessionOptions()
    with InferenceSession(round_trip(elem, opset), options, env=env) as session:
        expected_on = "ort" if where == "worker" else "fallback"
        assert {s.registration for s in session.get_provider_graph_assignment_info()} == {expected_on}
        assert {s.ep_name for s in session.get_provider_graph_assignment_info()} == {"CPUExecutionProvider"}
        with caplog.at_level("WARNING", logger="ephost.client.fallback"):
            y, g = session.run(None, {"x": x})
    # ORT ran it: the fallback's ORT did not fail over to the reference evaluator.
    assert not [r for r in caplog.records if "next fallback EP runs it" in r.getMessage()]
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(g, x.astype(np.float32) * 2)
    np.testing.assert_array_equal(y.astype(np.float32), (x.astype(np.float32) * 2).astype(dtype).astype(np.float32))


def node_case(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return next(c for c in collect_testcases(None) if c.name == name)


def run_case(env, case, policy):
    options = ephost.SessionOptions()
    options.ep_failure_policy = policy
    rep = backend.prepare(case.model, env=env, providers=["ort"], sess_options=options)
    try:
        for inputs, expected in case.data_sets:
            Runner.assert_similar_outputs(expected, rep.run(inputs), rtol=case.rtol, atol=case.atol, model_dir=None)
        return rep.session.run_log
    finally:
        rep.close()


def test_the_bfloat16_attention_case_passes_through_an_onnxruntime_worker(env):
    run_case(env, node_case("test_attention_4d_causal_bf16_expanded"), "raise")


@pytest.mark.parametrize("name", ["test_convinteger_with_padding", "test_reduce_max_empty_set_bool",
                                  "test_attention_4d_diff_heads_mask4d_padded_kv"])
def test_cases_onnx_runtime_fails_at_run_time_fall_back_under_the_fallback_policy(env, name):
    case = node_case(name)
    with pytest.raises(ephost.EpInternal, match="failed in ONNX Runtime"):
        run_case(env, case, "raise")
    log = run_case(env, case, "fallback")
    assert [e["event"] for e in log][:2] == ["failed", "fell back"]
