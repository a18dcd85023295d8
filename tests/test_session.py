"""InferenceSession: partitioning across EP workers, compilation, execution, CPU fallback."""
import re
import threading

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

import ephost
from ephost import InferenceSession
import models
from helpers import TRANSPORTS, device_of, make_env, options_for, worker_stats


# Every test here runs over both transports of the data plane: the fast lane and gRPC alone.
@pytest.fixture(scope="module", params=list(TRANSPORTS))
def env(request):
    with make_env(request.param) as environment:
        yield environment


@pytest.fixture(scope="module")
def ref_device(env):
    return device_of(env, "ref")


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def split_env(request):
    """Worker "a" takes Add and Mul (and If), worker "b" takes Relu and Neg; the rest falls back."""
    with ephost.Environment() as env:
        env.register_execution_provider_library("a", "reference", {"ops": "Add,Mul,If,Loop",
                                                                   **TRANSPORTS[request.param]})
        env.register_execution_provider_library("b", "reference", {"ops": "Relu,Neg", **TRANSPORTS[request.param]})
        yield env


def assignment(session):
    return [(s.registration, sorted(n.name for n in s.get_nodes()))
            for s in session.get_provider_graph_assignment_info()]


def test_a_whole_model_on_one_worker_matches_the_evaluator(env):
    model = models.chain(["Relu", "Neg", "Abs", "Sigmoid"])
    with InferenceSession(model, options_for(env, "ref"), env=env) as session:
        assert assignment(session) == [("ref", ["n0_Relu", "n1_Neg", "n2_Abs", "n3_Sigmoid"])]
        x = np.random.default_rng(1).standard_normal(4).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, ReferenceEvaluator(model).run(None, {"x": x})[0], rtol=1e-6)


def test_the_diamond_is_split_rather_than_fused_into_a_cycle(split_env):
    with InferenceSession(models.diamond(), options_for(split_env, "a", "b"), env=split_env) as session:
        assert assignment(session) == [("a", ["add"]), ("b", ["relu"]), ("a", ["mul"])]
        info = session.get_provider_graph_assignment_info()
        assert [s.ep_name for s in info] == ["reference"] * 3
        assert (info[0].get_nodes()[0].op_type, info[0].get_nodes()[0].domain) == ("Add", "")
        x = np.random.default_rng(2).standard_normal((2, 3)).astype(np.float32)
        (y,) = session.run(["y"], {"x": x})
        np.testing.assert_allclose(y, models.diamond_expected(x), rtol=1e-6)


def test_a_valid_group_is_fused_into_one_partition(split_env):
    # Add -> Mul on "a", with Relu hanging off the side: nothing lies between Add and Mul.
    from onnx import helper
    nodes = [helper.make_node("Add", ["x", "x"], ["s"], name="add"),
             helper.make_node("Mul", ["s", "s"], ["y"], name="mul"),
             helper.make_node("Relu", ["s"], ["r"], name="relu")]
    model = models.model(nodes, [models.tensor("x", [3])], [models.tensor("y", [3]), models.tensor("r", [3])])
    with InferenceSession(model, options_for(split_env, "a", "b"), env=split_env) as session:
        assert assignment(session) == [("a", ["add", "mul"]), ("b", ["relu"])]
        x = np.array([-1.0, 0.5, 2.0], np.float32)
        y, r = session.run(None, {"x": x})
        np.testing.assert_allclose(y, (2 * x) ** 2)
        np.testing.assert_allclose(r, np.maximum(2 * x, 0))


def test_chains_that_alternate_eps_and_the_fallback(split_env):
    ops = ["Relu", "Sigmoid", "Neg", "Abs", "Relu", "Neg", "Sigmoid", "Abs"]
    model = models.chain(ops, shape=(64, 64))
    with InferenceSession(model, options_for(split_env, "a", "b"), env=split_env) as session:
        owners = [r for r, _ in assignment(session)]
        assert owners == ["b", "fallback", "b", "fallback", "b", "fallback"]
        x = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, ReferenceEvaluator(model).run(None, {"x": x})[0], rtol=1e-6)


@pytest.mark.parametrize("shape", [(2, 3), (512, 512)], ids=["inline", "shared-memory"])
def test_values_stay_on_the_worker_that_made_them(split_env, shape):
    """Counted in the workers: the Add output that Mul reads on the same worker is handed over inside it;
    only values whose consumer lives elsewhere are transferred."""
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    with InferenceSession(models.diamond(shape), options_for(split_env, "a", "b"), env=split_env) as session:
        a0, b0 = worker_stats(split_env, "a"), worker_stats(split_env, "b")
        runs = 3
        for _ in range(runs):
            (y,) = session.run(None, {"x": x})
            np.testing.assert_allclose(y, models.diamond_expected(x), rtol=1e-6)
        a1, b1 = worker_stats(split_env, "a"), worker_stats(split_env, "b")
    assert a1.compute_inputs_resident - a0.compute_inputs_resident == runs          # s into Mul
    assert a1.compute_inputs_transferred - a0.compute_inputs_transferred == 2 * runs  # x into Add, r into Mul
    assert b1.compute_inputs_transferred - b0.compute_inputs_transferred == runs    # s into Relu
    assert b1.compute_inputs_resident == b0.compute_inputs_resident


def test_control_flow_runs_whole_on_the_ep_that_claims_it(split_env):
    model = models.with_if()
    with InferenceSession(model, options_for(split_env, "a", "b"), env=split_env) as session:
        # the If and its branches (Add, Sub) go to "a"; Relu, read by the branches, comes from "b"
        assert assignment(session) == [("b", ["relu"]), ("a", ["if"])]
        x = np.array([-1.0, 0.0, 4.0], np.float32)
        for cond in (True, False):
            (y,) = session.run(None, {"x": x, "cond": np.array(cond)})
            expected = ReferenceEvaluator(model).run(None, {"x": x, "cond": np.array(cond)})[0]
            np.testing.assert_allclose(y, expected)
    loop = models.with_loop()
    with InferenceSession(loop, options_for(split_env, "a", "b"), env=split_env) as session:
        assert assignment(session) == [("b", ["relu"]), ("a", ["loop"])]
        (total,) = session.run(None, {"x": np.array([1.5, -2.0], np.float32), "n": np.array(4, np.int64)})
        np.testing.assert_allclose(total, [6.0, 0.0])


def test_run_from_eight_threads(split_env):
    model = models.diamond((32, 32))
    errors = []
    with InferenceSession(model, options_for(split_env, "a", "b"), env=split_env) as session:
        def work(seed):
            try:
                rng = np.random.default_rng(seed)
                for _ in range(10):
                    x = rng.standard_normal((32, 32)).astype(np.float32)
                    (y,) = session.run(None, {"x": x})
                    np.testing.assert_allclose(y, models.diamond_expected(x), rtol=1e-6)
            except Exception as e:  # reported below, from the main thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert errors == []


def test_a_model_with_300_mb_of_initializers(worker):
    """Past gRPC's message limit (the worker takes 64 MiB messages here): it travels through shared memory."""
    w = worker("--ep", "reference", "--max-message-mb", "64")
    model, weights = models.matmul_with_weights(1000, 75_000)  # 300 MB of float32
    assert model.ByteSize() > 300_000_000
    x = np.random.default_rng(5).standard_normal((1, 1000)).astype(np.float32)
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", w.address)
        with InferenceSession(model, options_for(env, "w"), env=env) as session:
            assert assignment(session) == [("w", ["matmul", "relu"])]
            (y,) = session.run(None, {"x": x})
        before = worker_stats(env, "w")
    np.testing.assert_allclose(y, np.maximum(x @ weights, 0), rtol=1e-4, atol=1e-3)
    assert before.methods["Allocator/Reserve"].calls == 1, "the model went through one shared-memory buffer"


def test_providers_shortcut_and_the_default_environment():
    """A worker the session launched for `providers=[...]` is the session's: it goes when the session closes."""
    model = models.chain(["Neg", "Abs"])
    env = ephost.get_default_environment()
    with InferenceSession(model, providers=["reference"]) as session:
        assert [r for r, _ in assignment(session)] == ["reference"]
        (y,) = session.run(None, {"x": np.array([1, -2, 3, -4], np.float32)})
        np.testing.assert_array_equal(y, [1, 2, 3, 4])
        assert env.is_registered("reference")
    assert not env.is_registered("reference")


def test_a_provider_registered_before_the_session_outlives_it(env):
    with InferenceSession(models.chain(["Neg"]), env=env, providers=["ref"]):
        pass
    assert env.is_registered("ref")


def test_providers_options_and_metadata_as_onnx_runtime_gives_them(env):
    model = models.chain(["Neg", "Abs"])
    model.producer_name, model.model_version, model.doc_string = "tests", 7, "two nodes"
    onnx.helper.set_model_props(model, {"owner": "ephost"})
    options = options_for(env, "ref")
    with InferenceSession(model, options, env=env) as session:
        assert session.get_providers() == ["reference", "CPUExecutionProvider"]
        assert session.get_provider_options() == {"reference": {}, "CPUExecutionProvider": {}}
        assert session.get_session_options() is options
        meta = session.get_modelmeta()
        assert (meta.producer_name, meta.version, meta.description, meta.graph_name) == ("tests", 7, "two nodes", "g")
        assert meta.custom_metadata_map == {"owner": "ephost"}


def test_a_compute_timeout_of_zero_means_no_deadline(env):
    options = options_for(env, "ref")
    options.compute_timeout_s = 1e-9  # a deadline no call can meet
    x = np.array([1, -2, 3, -4], np.float32)
    with InferenceSession(models.chain(["Neg"]), options, env=env) as session:
        (y,) = session.run(None, {"x": x}, ephost.RunOptions(compute_timeout_s=0))
        np.testing.assert_array_equal(y, -x)


def test_everything_on_the_fallback_without_providers(env):
    model = models.chain(["Neg", "Abs"])
    with InferenceSession(model, env=env) as session:
        assert assignment(session) == [("fallback", ["n0_Neg", "n1_Abs"])]
        assert session.run(None, {"x": np.array([1, -2, 3, -4], np.float32)})[0].tolist() == [1, 2, 3, 4]


def test_inputs_outputs_and_bad_feeds(env):
    model = models.diamond((2, 3))
    with InferenceSession(model, options_for(env, "ref"), env=env) as session:
        (i,) = session.get_inputs()
        (o,) = session.get_outputs()
        assert (i.name, i.type, i.shape) == ("x", "tensor(float)", [2, 3])
        assert (o.name, o.type, o.shape) == ("y", "tensor(float)", [2, 3])
        good = np.ones((2, 3), np.float32)
        cases = [
            ({}, "missing input"),
            ({"x": good, "z": good}, "unknown input name"),
            ({"z": good}, "unknown input name"),  # as many feeds as inputs, one of another name
            ({"x": good.astype(np.int64)}, "expects tensor(float), got a int64 array"),
            ({"x": np.ones((6,), np.float32)}, "expects rank 2"),
            ({"x": np.ones((3, 2), np.float32)}, "expects 2 along axis 0"),
            ({"x": "text"}, "must be a tensor"),
        ]
        for feeds, message in cases:
            with pytest.raises(ephost.EpInvalidArgument, match=re.escape(message)):
                session.run(None, feeds)
        with pytest.raises(ephost.EpInvalidArgument, match="unknown output name"):
            session.run(["nope"], {"x": good})
        np.testing.assert_allclose(session.run(None, {"x": good})[0], models.diamond_expected(good))
    with pytest.raises(ephost.EpFailedPrecondition, match="closed"):
        session.run(None, {"x": good})


def test_a_list_fed_for_a_tensor_is_made_into_one_of_the_declared_type_as_onnx_runtime_makes_it(env):
    """ORT's run takes a (nested) list for a tensor input, as an array of the input's element type; not a tuple,
    and not a list that cannot be made into one of that type or shape."""
    import onnxruntime as ort
    model = models.diamond((2, 3))
    in_process = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with InferenceSession(model, options_for(env, "ref"), env=env) as session:
        feed = [[1, -2, 3], [-4.5, 5, 6]]  # ints among floats: float32, as ORT makes them
        expected = in_process.run(None, {"x": feed})[0]
        np.testing.assert_array_equal(session.run(None, {"x": feed})[0], expected)
        np.testing.assert_array_equal(expected, models.diamond_expected(np.array(feed, np.float32)))
        for bad, message in [(((1, 2, 3), (4, 5, 6)), "must be a tensor"),
                             ([1, 2, 3, 4, 5, 6], "expects rank 2"),
                             ([["a", "b", "c"], ["d", "e", "f"]], "the list fed cannot be made into one"),
                             ([[1, 2, 3], [4, 5]], "the list fed cannot be made into one")]:
            with pytest.raises(Exception):
                in_process.run(None, {"x": bad})
            with pytest.raises(ephost.EpInvalidArgument, match=re.escape(message)):
                session.run(None, {"x": bad})


def test_feeds_can_be_tensors_in_worker_memory(env, ref_device):
    allocator = env.create_shared_allocator(ref_device, ephost.DeviceMemoryType.DEFAULT)
    try:
        x = np.random.default_rng(6).standard_normal((2, 3)).astype(np.float32)
        feed = ephost.Tensor.from_numpy(x, allocator)
        with InferenceSession(models.diamond(), options_for(env, "ref"), env=env) as session:
            np.testing.assert_allclose(session.run(None, {"x": feed})[0], models.diamond_expected(x))
    finally:
        env.release_shared_allocator(ref_device, ephost.DeviceMemoryType.DEFAULT)


def test_malformed_models_fail_at_load_with_a_clear_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07\x12\x04junk\xff\xfe not a model")
    with pytest.raises(ephost.EpInvalidArgument, match="not a readable ONNX model"):
        InferenceSession(str(bad), env=ephost.Environment())
    with pytest.raises(ephost.EpNotFound, match="does not exist"):
        InferenceSession(str(tmp_path / "missing.onnx"), env=ephost.Environment())
    with pytest.raises(ephost.EpInvalidArgument, match="no graph"):
        InferenceSession(b"", env=ephost.Environment())
    from onnx import helper
    dangling = models.model([helper.make_node("Relu", ["nowhere"], ["y"], name="r")], [models.tensor("x", [1])],
                            [models.tensor("y", [1])])
    with pytest.raises(ephost.EpInvalidArgument, match="nothing produces"):
        InferenceSession(dangling, env=ephost.Environment())


def test_a_model_file_on_disk(tmp_path, env):
    path = tmp_path / "m.onnx"
    onnx.save(models.diamond(), path)
    with InferenceSession(str(path), options_for(env, "ref"), env=env) as session:
        x = np.ones((2, 3), np.float32)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x))
