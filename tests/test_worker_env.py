"""Workers in environments of their own: `onnxruntime-ggml` (which pins onnxruntime>=1.29,<1.31) runs through
ephost from this application on another ONNX Runtime, in a virtual environment ephost makes from requirements.

The tests that make environments need the package index; where it cannot be reached they skip, saying so. One
environment is made for the whole module (by two processes at once), in a cache under pytest's tmp.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import ephost
from ephost import EpFailedPrecondition, EpNotFound, EpWorkerCrashed, EpWorkerEnvironmentFailed
from ephost.eps.library_paths import resolve_library
from ephost.worker_env import PIP_LOG, WorkerEnvironment, list_environments

from helpers import options_for
import models

GGML = "onnxruntime-ggml==0.2.0"
# ggml keeps weights in float16 unless told otherwise: float32 ones match ORT's CPU EP within float rounding.
GGML_OPTIONS = {"requirements": GGML, "library": "onnxruntime_ggml:library_path", "provider_options": "weights=f32"}

# Making an environment downloads and installs packages: a minute or so.
pytestmark = pytest.mark.timeout(600)


def ephost_cli(*args, cache, timeout=600, **kw):
    return subprocess.run([sys.executable, "-m", "ephost", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "EPHOST_CACHE_DIR": str(cache)}, **kw)


@pytest.fixture(scope="module")
def package_index():
    """Skip where pip cannot reach its package index (it is asked through pip, with pip's own configuration)."""
    result = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "onnxruntime-ggml", "--retries", "0",
                             "--timeout", "15", "--disable-pip-version-check"],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0 or "0.2.0" not in result.stdout:
        pytest.skip(f"the package index cannot be reached (pip says: {result.stderr.strip()[-300:]})")


@pytest.fixture(scope="module")
def cache(tmp_path_factory, package_index):
    """The module's cache directory, the one this process's registrations use too."""
    path = tmp_path_factory.mktemp("ephost-cache")
    before = os.environ.get("EPHOST_CACHE_DIR")
    os.environ["EPHOST_CACHE_DIR"] = str(path)
    yield path
    if before is None:
        del os.environ["EPHOST_CACHE_DIR"]
    else:
        os.environ["EPHOST_CACHE_DIR"] = before


@pytest.fixture(scope="module")
def made(cache):
    """The ggml environment, made by two `ephost env create` processes started at once."""
    command = [sys.executable, "-m", "ephost", "env", "create", "--requirements", GGML]
    environ = {**os.environ, "EPHOST_CACHE_DIR": str(cache)}
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)
             for _ in range(2)]
    results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    records = list_environments(cache)
    assert len(records) == 1, "\n".join(err[-3000:] for _, err, _ in results)
    return records[0], results


@pytest.fixture(scope="module")
def ggml_env(made):
    with ephost.Environment() as env:
        env.register_execution_provider_library("ggml", "onnxruntime", GGML_OPTIONS)
        yield env


def test_two_processes_making_one_environment_at_once_both_succeed_and_make_it_once(made, cache):
    record, results = made
    for out, err, code in results:
        assert code == 0, err
        assert out.split() == [record.key, record.python]
    # one made it (its progress shown, pip's steps and the end), the other waited for it
    waited = ["being made by another process" in err for _, err, _ in results]
    assert sorted(waited) == [False, True]
    (maker,) = [err for _, err, _ in results if "being made by another process" not in err]
    assert f"making worker environment {record.key}: Successfully installed" in maker, maker[-3000:]
    assert f"making worker environment {record.key}: done in" in maker, maker[-3000:]
    pip_log = (cache / "envs" / record.key / PIP_LOG).read_text()
    assert pip_log.count("Successfully installed") == 1
    assert record.packages["onnxruntime-ggml"] == "0.2.0"
    assert record.packages["onnxruntime"].startswith("1.30.")


def test_ggml_devices_and_the_worker_onnxruntime_version_are_reported(ggml_env):
    (device,) = [d for d in ggml_env.get_ep_devices() if d.registration_name == "ggml"]
    assert device.ep_vendor == "onnxruntime-ggml"
    assert device.ep_metadata["backend"] == "ggml"
    # the worker runs its own ONNX Runtime, not this application's
    assert device.ep_metadata["onnxruntime_version"].startswith("1.30.")
    assert not ort.__version__.startswith("1.30.")
    info = ggml_env.registration("ggml").link.current.info  # what the worker's Hello said
    assert (info.protocol, info.ephost_version) == ("ephost.v1", ephost.__version__)
    assert info.onnxruntime_version == device.ep_metadata["onnxruntime_version"]


def test_a_second_registration_reuses_the_environment(made, cache, ggml_env):
    record, _ = made
    log_written = (cache / "envs" / record.key / PIP_LOG).stat().st_mtime_ns
    with ephost.Environment() as env:
        env.register_execution_provider_library("again", "onnxruntime", GGML_OPTIONS)
        assert [d.ep_vendor for d in env.get_ep_devices()] == ["onnxruntime-ggml"]
    assert list_environments(cache) == [record]
    assert (cache / "envs" / record.key / PIP_LOG).stat().st_mtime_ns == log_written  # pip did not run again


def test_an_environment_made_ahead_is_used_offline(made, cache):
    """Where its packages come from (--find-links, --no-index) is no part of an environment's identity: the
    one an operator prepared is the one an offline registration gets, with no pip run."""
    record, _ = made
    offline = WorkerEnvironment(requirements=(GGML,), find_links=(str(cache / "no-wheels-here"),), no_index=True)
    assert offline.create() == record


def matmul_add_relu(n_in=64, n_out=32):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_in, n_out)).astype(np.float32)
    b = rng.standard_normal((n_out,)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
             helper.make_node("Add", ["m", "b"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]
    return models.model(nodes, [models.tensor("x", [8, n_in])], [models.tensor("y", [8, n_out])],
                        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])


def ort_cpu(model: onnx.ModelProto, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_matmul_add_relu_runs_on_ggml_and_matches_onnx_runtime_cpu(ggml_env):
    model = matmul_add_relu()
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    with ephost.InferenceSession(model, options_for(ggml_env, "ggml"), env=ggml_env) as session:
        assigned = session.get_provider_graph_assignment_info()
        assert {(s.registration, n.name) for s in assigned for n in s.nodes} == \
               {("ggml", "matmul"), ("ggml", "add"), ("ggml", "relu")}
        (y,) = session.run(None, {"x": x})
    (expected,) = ort_cpu(model, {"x": x})
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_a_model_ggml_does_not_take_falls_back(ggml_env):
    # ggml has no Sign; it claims all of a graph or nothing, so this one runs on the CPU fallback
    model = models.chain(["Relu", "Sign"], shape=(4,))
    x = np.array([-2, -0.5, 0, 3], dtype=np.float32)
    with ephost.InferenceSession(model, options_for(ggml_env, "ggml"), env=ggml_env) as session:
        assert {s.registration for s in session.get_provider_graph_assignment_info()} == {"fallback"}
        (y,) = session.run(None, {"x": x})
    np.testing.assert_array_equal(y, np.sign(np.maximum(x, 0)))


def test_a_bad_requirement_fails_registration_naming_it_and_the_log(cache, made, caplog):
    import logging
    from ephost.progress import ATTRIBUTE
    caplog.set_level(logging.INFO, logger="ephost.progress")
    bad = "onnxruntime-ggml==0.0.999"
    with ephost.Environment() as env:
        with pytest.raises(EpWorkerEnvironmentFailed) as caught:
            env.register_execution_provider_library("bad", "onnxruntime", {"requirements": bad})
        assert env.get_ep_devices() == []
    error = caught.value
    assert bad in str(error) and error.log_path in str(error)
    assert error.requirements == (bad,)
    with open(error.log_path) as f:
        assert bad in f.read()
    # never used half-made: no environment is recorded for it, and its venv is gone
    assert [r.requirements for r in list_environments(cache)] == [[GGML]]
    assert not os.path.exists(os.path.join(os.path.dirname(error.log_path), "venv"))
    # its making was reported as it went, through logging (each record with its state)
    states = [getattr(r, ATTRIBUTE) for r in caplog.records if r.name == "ephost.progress"]
    assert states and states[0].what.startswith("making worker environment") and states[0].total is None, states
    assert any(s.note.startswith(("Collecting", "Processing", "Obtaining")) for s in states), states


def test_the_worker_command_runs_inside_its_environment(made, cache):
    record, _ = made
    proc = subprocess.Popen([sys.executable, "-m", "ephost", "worker", "--ep", "onnxruntime", "--requirements", GGML,
                             "--option", "library=onnxruntime_ggml:library_path", "--exit-with-parent"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "EPHOST_CACHE_DIR": str(cache)})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the worker did not announce itself"
        announced = json.loads(proc.stdout.readline())
        with open(f"/proc/{announced['pid']}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0].decode() == record.python
        with ephost.Environment() as env:
            env.register_execution_provider_library("served", announced["address"])
            (device,) = env.get_ep_devices()
            assert device.ep_metadata["onnxruntime_version"].startswith("1.30.")
    finally:
        proc.stdin.close()  # --exit-with-parent: it goes
        proc.wait(10)


def test_env_list_and_remove(made, cache):
    """Last in this module: it removes the module's environment."""
    record, _ = made
    listed = ephost_cli("env", "list", cache=cache)
    assert listed.returncode == 0, listed.stderr
    (row,) = listed.stdout.splitlines()[2:]
    assert row.split()[:3] == [record.key, GGML, record.packages["onnxruntime"]]
    removed = ephost_cli("env", "remove", record.key, cache=cache)
    assert removed.returncode == 0, removed.stderr
    assert list_environments(cache) == [] and not (cache / "envs" / record.key).exists()
    again = ephost_cli("env", "remove", record.key, cache=cache)
    assert again.returncode == 1 and "no worker environment" in again.stderr and "Traceback" not in again.stderr


# --- without the network ----------------------------------------------------------------------------------


def test_a_worker_runs_under_the_interpreter_named(tmp_path):
    with ephost.Environment() as env:
        env.register_execution_provider_library("ref", "reference", {"python": sys.executable})
        pid = env.registration("ref").process.pid
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0].decode() == sys.executable
        with pytest.raises(EpNotFound, match="no Python interpreter"):
            env.register_execution_provider_library("none", "reference", {"python": str(tmp_path / "nope")})
        # an interpreter whose environment lacks ephost: the worker cannot start, and says so
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
        with pytest.raises(EpWorkerCrashed, match="before it was ready"):
            env.register_execution_provider_library("bare", "reference",
                                                    {"python": str(tmp_path / "bare" / "bin" / "python"),
                                                     "restart": "false"})


def test_library_named_by_module_and_function_is_resolved_in_the_worker(capfd):
    openvino = pytest.importorskip("onnxruntime_ep_openvino", reason="installed by the openvino extra")
    assert resolve_library("onnxruntime_ep_openvino:get_library_path") == openvino.get_library_path()
    with ephost.Environment() as env:
        # loads in the worker (OpenVINO reports no device on AMD machines; an Intel one reports its own)
        env.register_execution_provider_library("ov", "onnxruntime",
                                                {"library": "onnxruntime_ep_openvino:get_library_path"})
        assert env.registration("ov").process.returncode is None
        # a worker that cannot resolve the library refuses to start, and says why: a typed error for the
        # application, and on its stderr (which is the application's)
        for library, says in [("no_such_vendor:library_path", "module 'no_such_vendor' is not importable in the "
                                                               "worker's environment"),
                              ("onnxruntime_ep_openvino:nothing_here", "has no function 'nothing_here'")]:
            with pytest.raises(ephost.EpError, match=says):
                env.register_execution_provider_library("bad", "onnxruntime", {"library": library})
            assert says in capfd.readouterr().err


def test_a_worker_speaking_another_protocol_is_refused(tmp_path):
    """A worker of a future release (a real gRPC server answering Hello as ephost.v2 would) is refused at
    connect time with both sides' versions, not with a confusing failure later."""
    from concurrent import futures

    import grpc
    from ephost.v1 import worker_pb2, worker_pb2_grpc

    class FutureWorker(worker_pb2_grpc.WorkerServicer):
        def Hello(self, request, context):
            return worker_pb2.HelloResponse(client_id="c", info=worker_pb2.WorkerInfo(
                protocol="ephost.v2", ephost_version="9.0.0", ep_name="reference"))

    server = grpc.server(futures.ThreadPoolExecutor(2))
    worker_pb2_grpc.add_WorkerServicer_to_server(FutureWorker(), server)
    address = f"unix://{tmp_path}/future.sock"
    server.add_insecure_port(address)
    server.start()
    try:
        with ephost.Environment() as env:
            with pytest.raises(EpFailedPrecondition) as caught:
                env.register_execution_provider_library("future", address)
        message = str(caught.value)
        assert "'ephost.v2'" in message and "9.0.0" in message and "'ephost.v1'" in message
        assert ephost.__version__ in message
    finally:
        server.stop(0)


def test_environment_flags_belong_to_the_ep_before_them_in_run(tmp_path):
    onnx.save(models.diamond((2, 3)), tmp_path / "diamond.onnx")
    ok = subprocess.run([sys.executable, "-m", "ephost", "run", str(tmp_path / "diamond.onnx"), "--ep", "reference",
                         "--python", sys.executable, "--runs", "1"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    missing = subprocess.run([sys.executable, "-m", "ephost", "run", str(tmp_path / "diamond.onnx"), "--ep",
                              "reference", "--python", str(tmp_path / "nope"), "--runs", "1"],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "no Python interpreter" in missing.stderr and "Traceback" not in missing.stderr
    orphan = subprocess.run([sys.executable, "-m", "ephost", "run", "--requirements", GGML], capture_output=True,
                            text=True, timeout=60)
    assert orphan.returncode == 2 and "must follow the --ep" in orphan.stderr


def test_a_client_speaking_another_protocol_is_refused_by_the_worker(served):
    import grpc
    from ephost.v1 import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(served.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            worker_pb2_grpc.WorkerStub(channel).Hello(
                worker_pb2.HelloRequest(protocol="ephost.v0", ephost_version="0.0.1"), timeout=10, wait_for_ready=True)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details()
    assert "'ephost.v0' (ephost '0.0.1')" in details and f"'ephost.v1' (ephost '{ephost.__version__}')" in details


def test_a_launched_worker_parses_with_the_compiled_protobuf_whatever_the_application_set(monkeypatch):
    """Importing onnxruntime-extensions sets PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python in the application; a
    worker it launches does not inherit it (pure-Python protobuf reads every message many times slower, and fails
    a model whose names are not UTF-8 as unreadable rather than naming the node)."""
    from helpers import worker_pids
    monkeypatch.setenv("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")
    before = worker_pids()
    environment = ephost.Environment()
    try:
        environment.register_execution_provider_library("ref", "reference")
        (pid,) = worker_pids() - before
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert not [v for v in f.read().split(b"\0") if v.startswith(b"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=")]
        model = models.chain(["Relu"])
        model.graph.node[0].name = "n0_Relu"
        data = model.SerializeToString().replace(b"n0_Relu", b"n0_\xff\xfelu")
        with pytest.raises(ephost.EpInvalidArgument, match="UTF-8") as caught:
            ephost.InferenceSession(data, options_for(environment, "ref"), env=environment)
        assert "node 0" in str(caught.value)
    finally:
        environment.close()
