"""EP context (ORT's ep.context_enable, ep.context_file_path, ep.context_embed_mode): a session writes its
model with each partition an EP compiled as an EPContext node; loading that model hands each node to the EP
named by its `source`, which restores instead of compiling (counted in the worker's stats); a corrupted
compiled form is a typed error naming the node; a worker killed with SIGKILL restores, not compiles, when the
application kept the compiled form; `ephost compile` then `ephost run`."""
import os
import signal
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import ephost
from ephost import InferenceSession, SessionOptions
from ephost import ep_context
import models

pytest.importorskip("onnxruntime", reason="the onnxruntime EP needs the onnxruntime extra")

RNG = np.random.default_rng(11)
W1 = RNG.standard_normal((4, 8)).astype(np.float32)
B1 = RNG.standard_normal((8,)).astype(np.float32)
W2 = RNG.standard_normal((8, 3)).astype(np.float32)
X = RNG.standard_normal((2, 4)).astype(np.float32)


def mlp():
    """x -> MatMul W1 -> Add b1 -> Relu -> MatMul W2 -> Mish (double) -> y. With a reference worker taking Relu
    and an onnxruntime worker the rest, three compiled partitions; Mish on double is ORT's CPU EP's gap, so it
    stays with the fallback (the reference evaluator), as nodes."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="matmul1"),
             helper.make_node("Add", ["m1", "b1"], ["a1"], name="add1"),
             helper.make_node("Relu", ["a1"], ["r1"], name="relu1"),
             helper.make_node("MatMul", ["r1", "w2"], ["m2"], name="matmul2"),
             helper.make_node("Cast", ["m2"], ["d"], name="cast", to=TensorProto.DOUBLE),
             helper.make_node("Mish", ["d"], ["y"], name="mish")]
    return models.model(nodes, [models.tensor("x", [2, 4])], [models.tensor("y", [2, 3], TensorProto.DOUBLE)],
                        [numpy_helper.from_array(W1, "w1"), numpy_helper.from_array(B1, "b1"),
                         numpy_helper.from_array(W2, "w2")], opset=[helper.make_opsetid("", 22)])


def expected(x):
    d = (np.maximum(x @ W1 + B1, 0) @ W2).astype(np.float64)
    return d * np.tanh(np.log1p(np.exp(d)))


@pytest.fixture(scope="module")
def ctx_env():
    with ephost.Environment() as env:
        env.register_execution_provider_library("ref", "reference", {"ops": "Relu"})
        env.register_execution_provider_library("ort", "onnxruntime")
        yield env


def options_for(env, *registrations, config=None, policy="raise", keep=False):
    options = SessionOptions()
    options.ep_failure_policy = policy
    options.keep_compiled = keep
    for r in registrations:
        options.add_provider_for_devices([d for d in env.get_ep_devices() if d.registration_name == r])
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    return options


def stats(env, name):
    s = env.get_worker_stats(name)
    return s.partitions_compiled, s.partitions_restored


def compile_to(env, tmp_path, embed: bool):
    source = str(tmp_path / "mlp.onnx")
    onnx.save(mlp(), source)
    config = {"ep.context_enable": "1", "ep.context_embed_mode": "1" if embed else "0"}
    with InferenceSession(source, options_for(env, "ref", "ort", config=config), env=env) as session:
        y = session.run(None, {"x": X})[0]
        files = session.ep_context_files
    return source, files, y


@pytest.mark.parametrize("embed", [True, False], ids=["embedded", "beside"])
def test_the_context_model_restores_each_partition_on_its_ep(ctx_env, tmp_path, embed):
    source, files, y = compile_to(ctx_env, tmp_path, embed)
    np.testing.assert_allclose(y, expected(X), rtol=1e-5)
    context_path = str(tmp_path / "mlp_ctx.onnx")  # ONNX Runtime's default name, beside the model
    assert files[0] == context_path and len(files) == (1 if embed else 4)
    written = onnx.load(context_path)
    contexts = [n for n in written.graph.node if ep_context.is_ep_context(n)]
    assert [ep_context.source_of(n) for n in contexts] == ["CPUExecutionProvider", "reference", "CPUExecutionProvider"]
    assert [n.op_type for n in written.graph.node if not ep_context.is_ep_context(n)] == ["Mish"]
    assert not written.graph.initializer, "weights live in the compiled forms"
    attrs = {a.name: helper.get_attribute_value(a) for a in contexts[0].attribute}
    assert attrs["embed_mode"] == (1 if embed else 0) and attrs["main_context"] == 1
    if not embed:
        assert attrs["ep_cache_context"] == b"mlp_ctx_ort_0.bin" and os.path.isfile(tmp_path / "mlp_ctx_ort_0.bin")

    before = {name: stats(ctx_env, name) for name in ("ref", "ort")}
    with InferenceSession(context_path, options_for(ctx_env, "ref", "ort"), env=ctx_env) as session:
        placed = [(s.registration, [n.op_type for n in s.nodes]) for s in session.get_provider_graph_assignment_info()]
        assert placed == [("ort", ["EPContext"]), ("ref", ["EPContext"]), ("ort", ["EPContext"]),
                          ("fallback", ["Mish"])]
        np.testing.assert_array_equal(session.run(None, {"x": X})[0], y)
    assert stats(ctx_env, "ort") == (before["ort"][0], before["ort"][1] + 2), "restored, not compiled"
    assert stats(ctx_env, "ref") == (before["ref"][0], before["ref"][1] + 1)


def test_a_corrupted_compiled_form_is_refused_naming_the_node(ctx_env, tmp_path):
    compile_to(ctx_env, tmp_path, embed=False)
    blob = tmp_path / "mlp_ctx_ort_0.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(ephost.EpInvalidArgument, match=r"EPContext node 'EPContext_ort_0': its compiled form is "
                                                       r"corrupted"):
        InferenceSession(str(tmp_path / "mlp_ctx.onnx"), options_for(ctx_env, "ref", "ort"), env=ctx_env)
    blob.unlink()
    with pytest.raises(ephost.EpNotFound, match=r"EPContext node 'EPContext_ort_0': its compiled form "
                                                r"'mlp_ctx_ort_0.bin' cannot be read"):
        InferenceSession(str(tmp_path / "mlp_ctx.onnx"), options_for(ctx_env, "ref", "ort"), env=ctx_env)


def test_an_embedded_corrupted_form_and_a_missing_ep_are_typed_errors(ctx_env, tmp_path):
    compile_to(ctx_env, tmp_path, embed=True)
    model = onnx.load(str(tmp_path / "mlp_ctx.onnx"))
    node = next(n for n in model.graph.node if n.name == "EPContext_ref_1")
    attr = next(a for a in node.attribute if a.name == "ep_cache_context")
    attr.s = attr.s[:-7]  # truncated
    with pytest.raises(ephost.EpInvalidArgument,
                       match="EPContext node 'EPContext_ref_1': its compiled form is corrupted"):
        InferenceSession(model, options_for(ctx_env, "ref", "ort"), env=ctx_env)
    # Without the reference worker, the fallback's reference evaluator (the same EP, in process) restores it.
    with InferenceSession(str(tmp_path / "mlp_ctx.onnx"), options_for(ctx_env, "ort"), env=ctx_env) as session:
        placed = {n.name: (s.registration, s.ep_name) for s in session.get_provider_graph_assignment_info()
                  for n in s.nodes}
        assert placed["EPContext_ref_1"] == ("fallback", "reference")
        np.testing.assert_allclose(session.run(None, {"x": X})[0], expected(X), rtol=1e-5)
    # A form made by another ONNX Runtime is refused by the worker's, naming the node.
    model = onnx.load(str(tmp_path / "mlp_ctx.onnx"))
    node = next(n for n in model.graph.node if n.name == "EPContext_ort_0")
    next(a for a in node.attribute if a.name == "ep_sdk_version").s = b"1.0.0"
    with pytest.raises(ephost.EpFailedPrecondition, match="EPContext node 'EPContext_ort_0' was compiled by "
                                                          "version '1.0.0'"):
        InferenceSession(model, options_for(ctx_env, "ref", "ort"), env=ctx_env)
    # A node of an EP the session does not have: the session says which node and which EP.
    model = onnx.load(str(tmp_path / "mlp_ctx.onnx"))
    node = next(n for n in model.graph.node if n.name == "EPContext_ref_1")
    next(a for a in node.attribute if a.name == "source").s = b"VendorNPUExecutionProvider"
    with pytest.raises(ephost.EpNotFound, match=r"'EPContext_ref_1' \(source 'VendorNPUExecutionProvider'\)"):
        InferenceSession(model, options_for(ctx_env, "ort"), env=ctx_env)


def test_context_generation_needs_a_path_for_a_model_given_as_bytes(ctx_env):
    with pytest.raises(ephost.EpInvalidArgument, match="ep.context_file_path"):
        InferenceSession(mlp().SerializeToString(), options_for(ctx_env, "ort", config={"ep.context_enable": "1"}),
                         env=ctx_env)
    with pytest.raises(ephost.EpInvalidArgument, match="takes 0 or 1"):
        InferenceSession(mlp(), options_for(ctx_env, "ort", config={"ep.context_enable": "yes"}), env=ctx_env)


def kill_and_run(env, name, session):
    os.kill(env.registration(name).process.pid, signal.SIGKILL)
    return session.run(None, {"x": X})[0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "not-kept"])
def test_after_sigkill_a_kept_compiled_form_is_restored_not_compiled(keep):
    with ephost.Environment() as env:
        env.register_execution_provider_library("ort", "onnxruntime", {"crash_window_s": "60"})
        with InferenceSession(mlp(), options_for(env, "ort", policy="retry", keep=keep), env=env) as session:
            assert stats(env, "ort") == (1, 0)
            np.testing.assert_allclose(kill_and_run(env, "ort", session), expected(X), rtol=1e-5)
            assert session.failure_counters["crashed"] == 1
            # The restarted worker's own counters: it restored the partition, or compiled it again.
            assert stats(env, "ort") == ((0, 1) if keep else (1, 0))


@pytest.mark.timeout(90)
def test_a_session_of_a_context_model_restores_after_sigkill(ctx_env, tmp_path):
    compile_to(ctx_env, tmp_path, embed=False)
    with ephost.Environment() as env:
        env.register_execution_provider_library("ref", "reference", {"ops": "Relu"})
        env.register_execution_provider_library("ort", "onnxruntime", {"crash_window_s": "60"})
        with InferenceSession(str(tmp_path / "mlp_ctx.onnx"), options_for(env, "ref", "ort", policy="retry"),
                              env=env) as session:
            np.testing.assert_allclose(kill_and_run(env, "ort", session), expected(X), rtol=1e-5)
            assert stats(env, "ort") == (0, 2)


def ephost_cli(*args):
    return subprocess.run([sys.executable, "-m", "ephost", *args], capture_output=True, text=True, timeout=180)


@pytest.mark.timeout(180)
def test_ephost_compile_then_ephost_run(tmp_path):
    source = str(tmp_path / "chain.onnx")
    onnx.save(models.matmul_with_weights(16, 8)[0], source)
    out = str(tmp_path / "compiled" / "chain_ctx.onnx")
    result = ephost_cli("compile", source, "--ep", "onnxruntime", "-o", out)
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout and "chain_ctx_onnxruntime_0.bin" in result.stdout
    x = np.random.default_rng(3).standard_normal((1, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    result = ephost_cli("run", out, "--ep", "onnxruntime", "--input", f"x={tmp_path / 'x.npy'}", "--runs", "1")
    assert result.returncode == 0, result.stderr
    assert "EPContext x1" in result.stdout
    with ephost.Environment() as env:
        env.register_execution_provider_library("ort", "onnxruntime")
        outputs = []
        for path in (source, out):
            with InferenceSession(path, options_for(env, "ort"), env=env) as session:
                outputs.append(session.run(None, {"x": x})[0])
    np.testing.assert_array_equal(outputs[0], outputs[1])


def test_a_compiled_form_that_names_a_file_is_refused(ctx_env):
    """A compiled form comes from a peer like any model: one whose weights are in an external file (here
    /etc/passwd) is refused before the EP sees it, naming the node; the worker stays up."""
    part = models.model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [models.tensor("x", [2])],
                        [models.tensor("y", [2])])
    weights = numpy_helper.from_array(np.zeros(2, np.float32), "w")
    onnx.external_data_helper.set_external_data(weights, "/etc/passwd")
    weights.data_location = TensorProto.EXTERNAL
    weights.ClearField("raw_data")
    part.graph.initializer.append(weights)
    from ephost.eps.reference import CONTEXT_FORM, VERSION
    node = ep_context.make_node("EPContext_hostile", ["x"], ["y"], "reference",
                                ep_context.EpContext(CONTEXT_FORM, part.SerializeToString(), VERSION), "p")
    hostile = models.model([node], [models.tensor("x", [2])], [models.tensor("y", [2])],
                           opset=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    options = options_for(ctx_env, "ref")
    options.fallback = None
    with pytest.raises(ephost.EpInvalidArgument, match="EPContext node 'EPContext_hostile'.*external file"):
        InferenceSession(hostile, options, env=ctx_env)
    assert ctx_env.get_worker_stats("ref").clients >= 1, "the worker is up"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fallback", ["onnxruntime", "reference"])
def test_a_failed_context_partition_goes_to_a_fallback_that_restores_it_or_says_it_cannot(ctx_env, tmp_path,
                                                                                         fallback):
    """A worker (chaos around the onnxruntime EP) restores the context model's ORT partitions and segfaults on
    its first Compute; under ep_failure_policy=fallback, ORT's CPU EP in process restores them in its place;
    the reference evaluator alone cannot, and says so naming the node and its EP."""
    compile_to(ctx_env, tmp_path, embed=True)
    with ephost.Environment() as env:
        env.register_execution_provider_library("c", "chaos", {"wrap": "onnxruntime", "fault": "segfault",
                                                               "after": "1", "crash_window_s": "60"})
        env.register_execution_provider_library("ref", "reference", {"ops": "Relu"})
        options = options_for(env, "c", "ref", policy="fallback")
        options.fallback = fallback
        with InferenceSession(str(tmp_path / "mlp_ctx.onnx"), options, env=env) as session:
            assert stats(env, "c") == (0, 2)
            if fallback == "onnxruntime":
                np.testing.assert_allclose(session.run(None, {"x": X})[0], expected(X), rtol=1e-5)
                # each (restarted) chaos worker segfaults on its first Compute: both ORT partitions fall back
                assert session.failure_counters["crashed"] == session.failure_counters["fell back"] == 2
            else:
                with pytest.raises(ephost.EpNotFound,
                                   match=r"the fallback cannot run EPContext node "
                                         r"'EPContext_ort_0': only its EP \('CPUExecutionProvider'\)"):
                    session.run(None, {"x": X})
