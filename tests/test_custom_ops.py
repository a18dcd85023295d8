"""Custom op libraries in workers: onnxruntime-extensions' ai.onnx.contrib ops run in an onnxruntime worker
that registers the library (`custom_ops_library`), with the outputs ONNX Runtime gives in process with the same
library; without it a session says which domain no EP runs; a custom op library that crashes (built here with
gcc against ONNX Runtime's custom op C ABI) takes down only its worker, and the failure policies apply."""
import os
import shutil
import subprocess

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import ephost
from ephost import InferenceSession, SessionOptions
import models

extensions = pytest.importorskip("onnxruntime_extensions", reason="onnxruntime-extensions comes with the test extra")
EXTENSIONS = "onnxruntime_extensions:get_library_path"
CONTRIB = helper.make_opsetid("ai.onnx.contrib", 1)
NATIVE = os.path.join(os.path.dirname(__file__), "native", "crash_custom_op.c")


def contrib_model(nodes, inputs, outputs, initializers=()):
    return models.model(nodes, inputs, outputs, initializers, opset=[helper.make_opsetid("", 17), CONTRIB])


def string_model():
    """StringUpper, then StringSplit on spaces: strings in, strings and indices out."""
    nodes = [helper.make_node("StringUpper", ["x"], ["upper"], domain="ai.onnx.contrib", name="upper"),
             helper.make_node("StringSplit", ["upper", "sep", "skip_empty"], ["indices", "values", "shape"],
                              domain="ai.onnx.contrib", name="split")]
    return contrib_model(
        nodes, [models.tensor("x", [None], TensorProto.STRING)],
        [models.tensor("upper", [None], TensorProto.STRING), models.tensor("indices", None, TensorProto.INT64),
         models.tensor("values", None, TensorProto.STRING), models.tensor("shape", None, TensorProto.INT64)],
        [helper.make_tensor("sep", TensorProto.STRING, [], [b" "]),
         helper.make_tensor("skip_empty", TensorProto.BOOL, [], [True])])


def tokenizer_model():
    """BertTokenizer over a small WordPiece vocabulary, then ONNX's Cast of its ids: a contrib node and a
    standard one in one model."""
    vocab = "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "un", "##aff", "##able", "!"])
    nodes = [helper.make_node("BertTokenizer", ["text"], ["ids", "types", "mask"], domain="ai.onnx.contrib",
                              name="tokenize", vocab_file=vocab, do_lower_case=1, strip_accents=1),
             helper.make_node("Cast", ["ids"], ["ids32"], name="cast", to=TensorProto.INT32)]
    return contrib_model(nodes, [models.tensor("text", [None], TensorProto.STRING)],
                         [models.tensor("ids32", None, TensorProto.INT32),
                          models.tensor("mask", None, TensorProto.INT64)])


def in_process(model, feeds):
    """ONNX Runtime in this process with the same library: what the worker must give."""
    options = ort.SessionOptions()
    options.register_custom_ops_library(extensions.get_library_path())
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def options_for(env, name, policy="raise"):
    options = SessionOptions()
    options.ep_failure_policy = policy
    options.add_provider_for_devices([d for d in env.get_ep_devices() if d.registration_name == name])
    return options


def assert_same(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype or (g.dtype.kind in "OU" and e.dtype.kind in "OU")
        np.testing.assert_array_equal(g, e)


@pytest.fixture(scope="module")
def ext_env():
    with ephost.Environment() as env:
        env.register_execution_provider_library("ext", "onnxruntime", {"custom_ops_library": EXTENSIONS})
        env.register_execution_provider_library("plain", "onnxruntime")
        yield env


@pytest.mark.parametrize("make, feeds", [
    (string_model, {"x": np.array(["hello world", "a b  c", ""], dtype=object)}),
    (tokenizer_model, {"text": np.array(["Hello unaffable world!"], dtype=object)}),
])
def test_contrib_ops_run_in_the_worker_that_loads_the_library(ext_env, make, feeds):
    model = make()
    with InferenceSession(model, options_for(ext_env, "ext"), env=ext_env) as session:
        placed = {n.name: s.registration for s in session.get_provider_graph_assignment_info() for n in s.nodes}
        assert placed == {n.name: "ext" for n in model.graph.node}
        got = session.run(None, feeds)
    assert_same(got, in_process(model, feeds))


@pytest.mark.parametrize("registration", [None, "plain"])
def test_without_the_library_the_session_names_the_domain(ext_env, registration):
    """Neither the in-process fallback nor an onnxruntime worker without the library runs ai.onnx.contrib."""
    options = options_for(ext_env, registration) if registration else SessionOptions()
    with pytest.raises(ephost.EpNotFound, match=r"operator domain 'ai.onnx.contrib' .*'upper' "
                                                r"\(ai.onnx.contrib:StringUpper\).*custom_ops_library"):
        InferenceSession(string_model(), options, env=ext_env)


def test_a_library_that_cannot_be_found_or_loaded_is_refused_at_registration(tmp_path):
    not_a_library = tmp_path / "not_a_library.so"
    not_a_library.write_bytes(b"\0" * 64)
    with ephost.Environment() as env:
        with pytest.raises(ephost.EpNotFound, match="no_such_module"):
            env.register_execution_provider_library("a", "onnxruntime", {"custom_ops_library": "no_such_module:path"})
        with pytest.raises(ephost.EpNotFound, match="no custom op library at"):
            env.register_execution_provider_library("b", "onnxruntime", {"custom_ops_library": str(tmp_path / "x.so")})
        with pytest.raises(ephost.EpInvalidArgument, match="cannot load"):
            env.register_execution_provider_library("c", "onnxruntime", {"custom_ops_library": str(not_a_library)})
        assert not any(env.is_registered(name) for name in "abc")


# --- a custom op library that crashes ----------------------------------------------------------------------

def build_crashing_library(directory, marker, *defines):
    if shutil.which("gcc") is None:
        pytest.fail("gcc is needed to build the crashing custom op library")
    path = os.path.join(directory, "libcrash_once.so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", f'-DCRASH_MARKER="{marker}"', *defines, "-o", path, NATIVE],
                   check=True, capture_output=True)
    return path


def crash_model():
    """Relu (ONNX) -> CrashOnce (the library's; a copy) -> Neg (ONNX)."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("CrashOnce", ["r"], ["c"], domain="test.crash", name="crash_once"),
             helper.make_node("Neg", ["c"], ["y"], name="neg")]
    return models.model(nodes, [models.tensor("x", [2, 3])], [models.tensor("y", [2, 3])],
                        opset=[helper.make_opsetid("", 17), helper.make_opsetid("test.crash", 1)])


X = np.arange(-3, 3, dtype=np.float32).reshape(2, 3)
EXPECTED = -np.maximum(X, 0)


@pytest.fixture
def crashing(tmp_path):
    marker = str(tmp_path / "crash-next")
    library = build_crashing_library(str(tmp_path), marker)
    env = ephost.Environment()
    env.register_execution_provider_library("vendor", "onnxruntime", {
        "custom_ops_library": library, "crash_window_s": "60"})
    env.register_execution_provider_library("ref", "reference")
    try:
        yield env, marker
    finally:
        env.close()


def crash_next(marker):
    open(marker, "w").close()


@pytest.mark.timeout(90)
def test_a_crash_in_a_custom_op_kills_only_its_worker_under_raise(crashing):
    env, marker = crashing
    process = env.registration("vendor").process
    with InferenceSession(crash_model(), options_for(env, "vendor"), env=env) as session:
        assert {s.registration for s in session.get_provider_graph_assignment_info()} == {"vendor"}
        np.testing.assert_array_equal(session.run(None, {"x": X})[0], EXPECTED)
        crash_next(marker)
        with pytest.raises(ephost.EpWorkerCrashed, match="SIGSEGV"):
            session.run(None, {"x": X})
        assert not os.path.exists(marker), "the library's kernel ran, and crashed, in the worker"
        # Another worker of the same application serves on; the vendor's is restarted and compiles again.
        with InferenceSession(models.diamond(), options_for(env, "ref"), env=env) as other:
            x = np.ones((2, 3), np.float32)
            np.testing.assert_allclose(other.run(None, {"x": x})[0], models.diamond_expected(x))
        env.registration("vendor").link.wait_recovered()
        assert env.registration("vendor").process.pid != process.pid
        np.testing.assert_array_equal(session.run(None, {"x": X})[0], EXPECTED)
        assert session.failure_counters["crashed"] == 1


@pytest.mark.timeout(90)
def test_under_retry_the_restarted_worker_runs_the_custom_op(crashing):
    env, marker = crashing
    with InferenceSession(crash_model(), options_for(env, "vendor", "retry"), env=env) as session:
        crash_next(marker)
        np.testing.assert_array_equal(session.run(None, {"x": X})[0], EXPECTED)
        assert (session.failure_counters["crashed"], session.failure_counters["retried"]) == (1, 1)


@pytest.mark.timeout(90)
def test_under_fallback_the_fallback_says_it_runs_no_vendor_domain(crashing):
    """The fallback takes a failed partition, but not one with a custom op: it loads no vendor library."""
    env, marker = crashing
    with InferenceSession(crash_model(), options_for(env, "vendor", "fallback"), env=env) as session:
        crash_next(marker)
        with pytest.raises(ephost.EpNotFound, match=r"operator domain 'test.crash'.*'crash_once'") as caught:
            session.run(None, {"x": X})
        assert isinstance(caught.value.__context__, ephost.EpWorkerCrashed)
        assert session.failure_counters["crashed"] == 1


@pytest.mark.timeout(60)
def test_a_library_that_crashes_when_registered_stops_only_its_worker(tmp_path):
    library = build_crashing_library(str(tmp_path), str(tmp_path / "unused"), "-DCRASH_IN_REGISTER")
    with ephost.Environment() as env:
        with pytest.raises(ephost.EpWorkerCrashed, match="SIGSEGV.*before it was ready"):
            env.register_execution_provider_library("vendor", "onnxruntime", {"custom_ops_library": library})
        env.register_execution_provider_library("ref", "reference")
        x = np.ones((2, 3), np.float32)
        with InferenceSession(models.diamond(), options_for(env, "ref"), env=env) as session:
            np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x))
