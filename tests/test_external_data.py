"""Models whose weights live in external data files: the application reads the graph, never the weights; the
worker gets the files as descriptors and maps them (ORT maps them itself); references are checked, with typed
errors; a model over 2 GiB runs end to end, with the application's peak RSS measured in a child process."""
import json
import os
import subprocess
import sys
import textwrap

import grpc
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import ephost
from ephost import InferenceSession
from ephost.eps.base import ComputeCall
from ephost.v1 import common_pb2, ep_pb2
from helpers import options_for, worker_stats
import models

SMALL = 1 << 18  # elements of each weight in the small models: 1 MiB of float32


def small_model(tmp_path, **kw):
    return models.sparse_external_model(tmp_path, weights=2, elements=SMALL, positions=(0, 99, SMALL - 1), **kw)


def _set(model_path: str, **entries) -> None:
    """Rewrite the external_data entries of W0 in a saved model."""
    m = onnx.load(model_path, load_external_data=False)
    for e in m.graph.initializer[0].external_data:
        if e.key in entries:
            e.value = str(entries[e.key])
    onnx.save(m, model_path)


# --- the application's checks --------------------------------------------------------------------------------

def test_a_missing_file_is_not_found_naming_initializer_and_file(env, tmp_path):
    path, _, _ = small_model(tmp_path)
    os.remove(tmp_path / "weights.bin")
    with pytest.raises(ephost.EpNotFound, match=r"initializer 'W0'.*weights\.bin.*does not exist"):
        InferenceSession(path, env=env, providers=["ref"])


def test_a_location_outside_the_models_directory_is_refused(env, tmp_path):
    (tmp_path / "m").mkdir()
    path, _, _ = small_model(tmp_path / "m")
    os.rename(tmp_path / "m" / "weights.bin", tmp_path / "weights.bin")  # it exists, one level up
    for location in ("../weights.bin", str(tmp_path / "weights.bin")):
        _set(path, location=location)
        with pytest.raises(ephost.EpInvalidArgument, match=r"initializer 'W0'.*outside the model's directory"):
            InferenceSession(path, env=env, providers=["ref"])


@pytest.mark.parametrize("where", ["graph", "function"])
def test_a_sparse_constant_outside_the_models_directory_is_refused(env, tmp_path, where):
    """Every tensor that can name a file is checked: a sparse Constant's values, in the graph or in the body of
    a model function, as much as an initializer."""
    (tmp_path / "m").mkdir()
    (tmp_path / "weights.bin").write_bytes(np.ones(4, np.float32).tobytes())
    values = helper.make_tensor("sparse_values", TensorProto.FLOAT, [1], [0.0])
    values.ClearField("float_data")
    values.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../weights.bin"), ("offset", "0"), ("length", "4")):
        values.external_data.add(key=key, value=value)
    sparse = helper.make_sparse_tensor(values, helper.make_tensor("sparse_indices", TensorProto.INT64, [1], [2]), [4])
    constant = helper.make_node("Constant", [], ["c"], sparse_value=sparse)
    add = helper.make_node("Add", ["x", "c"], ["y"])
    functions = []
    if where == "function":
        functions = [helper.make_function("local", "AddConstant", ["x"], ["y"], [constant, add],
                                          [helper.make_opsetid("", 18)])]
        nodes = [helper.make_node("AddConstant", ["x"], ["y"], domain="local")]
    else:
        nodes = [constant, add]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, functions=functions, opset_imports=[helper.make_opsetid("", 18),
                                                                         helper.make_opsetid("local", 1)])
    path = tmp_path / "m" / "model.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(ephost.EpInvalidArgument, match=r"'sparse_values'.*outside the model's directory"):
        InferenceSession(str(path), env=env, providers=["ref"])


def test_a_link_out_of_the_models_directory_is_refused(env, tmp_path):
    (tmp_path / "m").mkdir()
    path, _, _ = small_model(tmp_path / "m")
    os.rename(tmp_path / "m" / "weights.bin", tmp_path / "weights.bin")
    os.symlink(tmp_path / "weights.bin", tmp_path / "m" / "weights.bin")
    with pytest.raises(ephost.EpInvalidArgument, match=r"initializer 'W0'.*outside the model's directory"):
        InferenceSession(path, env=env, providers=["ref"])


def test_a_truncated_file_and_an_offset_past_the_end_are_out_of_range(env, tmp_path):
    path, _, _ = small_model(tmp_path)
    size = os.path.getsize(tmp_path / "weights.bin")
    os.truncate(tmp_path / "weights.bin", size - 4)
    with pytest.raises(ephost.EpOutOfRange, match=r"initializer 'W1'.*weights\.bin.*too short"):
        InferenceSession(path, env=env, providers=["ref"])
    os.truncate(tmp_path / "weights.bin", size)
    _set(path, offset=size + 4096)
    with pytest.raises(ephost.EpOutOfRange, match=r"initializer 'W0'.*offset \d+ is past the end.*weights\.bin"):
        InferenceSession(path, env=env, providers=["ref"])


def test_a_length_that_does_not_fit_the_shape_is_refused(env, tmp_path):
    path, _, _ = small_model(tmp_path)
    _set(path, length=16)
    with pytest.raises(ephost.EpInvalidArgument, match=r"initializer 'W0' of shape \[262144\] needs 1048576 bytes"):
        InferenceSession(path, env=env, providers=["ref"])


def test_an_inline_model_over_2_gib_and_a_proto_without_its_path_get_clear_errors(env, tmp_path):
    big = tmp_path / "inline.onnx"
    with open(big, "wb") as f:
        f.truncate(2 << 30)  # sparse: its size is all that is looked at
    with pytest.raises(ephost.EpInvalidArgument, match="over 2 GiB.*save_as_external_data=True"):
        InferenceSession(str(big), env=env, providers=["ref"])
    path, _, _ = small_model(tmp_path)
    with pytest.raises(ephost.EpInvalidArgument, match="give the model's path"):
        InferenceSession(onnx.load(path, load_external_data=False), env=env, providers=["ref"])


# --- the worker's side ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["reference", "onnxruntime"])
def test_external_data_reaches_a_worker_as_descriptors(tmp_path, target):
    path, idx, expected = small_model(tmp_path)
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", target)
        with InferenceSession(path, options_for(env, "w"), env=env) as session:
            assert [s.registration for s in session.get_provider_graph_assignment_info()] == ["w"]
            (y,) = session.run(None, {"idx": idx})
        stats = worker_stats(env, "w")
    np.testing.assert_array_equal(y, expected)
    assert stats.files_imported == 1 and stats.file_bytes_imported == os.path.getsize(tmp_path / "weights.bin")
    assert stats.methods["Allocator/Reserve"].calls == 0, "no weight went through a buffer"


def test_the_next_session_on_a_model_hands_over_nothing_and_is_not_asked_again(tmp_path):
    """A service that opens a session per request: the second session on the same model (the same files,
    unchanged) hands no descriptor over (the worker has the file) and sends no model (the worker knows it by its
    hash), and the worker answers GetCapability from its cache. A file changed on disk is handed over again."""
    path, idx, expected = small_model(tmp_path)
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", "onnxruntime")
        for _ in range(2):
            with InferenceSession(path, options_for(env, "w"), env=env) as session:
                np.testing.assert_array_equal(session.run(None, {"idx": idx})[0], expected)
        stats = worker_stats(env, "w")
        assert (stats.files_imported, stats.capability_cache_hits) == (1, 1)
        os.utime(tmp_path / "weights.bin", ns=(1, 1))  # the same inode, but changed (as far as anyone can tell)
        with InferenceSession(path, options_for(env, "w"), env=env) as session:
            np.testing.assert_array_equal(session.run(None, {"idx": idx})[0], expected)
        assert worker_stats(env, "w").files_imported == 2


def test_the_fallback_maps_its_own_partitions_initializers(env, tmp_path):
    path, idx, expected = small_model(tmp_path)
    for fallback in ("onnxruntime", "reference"):
        options = ephost.SessionOptions()
        options.fallback = fallback
        with InferenceSession(path, options, env=env) as session:
            assert {s.registration for s in session.get_provider_graph_assignment_info()} == {"fallback"}
            np.testing.assert_array_equal(session.run(None, {"idx": idx})[0], expected)


def tcp_worker(*args: str):
    from helpers import Worker
    from test_remote import free_port
    return Worker("--ep", "reference", "--listen", f"127.0.0.1:{free_port()}", "--insecure", *args)


def test_a_worker_without_a_blob_cache_gets_the_bytes_inside_the_model(tmp_path):
    w = tcp_worker("--cache-max-mb", "0")
    try:
        path, idx, expected = small_model(tmp_path)
        with ephost.Environment() as env:
            env.register_execution_provider_library("far", w.address, {"shared_memory": "false"})
            with InferenceSession(path, options_for(env, "far"), env=env) as session:
                np.testing.assert_array_equal(session.run(None, {"idx": idx})[0], expected)
            stats = worker_stats(env, "far")
            assert stats.files_imported == 0 and stats.blob_bytes_received == 0
    finally:
        w.stop()


@pytest.mark.timeout(300)
def test_a_remote_worker_receives_a_300_mb_model_once(tmp_path):
    """Without shared memory the files go, by content, into the worker's disk cache: a second session (another
    client, here) sends nothing; an upload that stopped half way resumes where it stopped."""
    import shutil
    import tempfile
    from ephost.external_data import load_model
    from ephost.v1 import worker_pb2
    from helpers import RawClient
    cache = tempfile.mkdtemp(prefix="ephost-blobs-")
    w = tcp_worker("--cache-dir", cache, "--cache-max-mb", "1024")
    try:
        path, idx, expected = models.sparse_external_model(tmp_path, weights=1, elements=75_000_000,
                                                            positions=(0, 99, 74_999_999))
        size = os.path.getsize(tmp_path / "weights.bin")
        _, external = load_model(path)
        digest = external.files["weights.bin"].sha256()
        external.close()
        # An upload that stopped after its first chunk: its bytes stay, and the next one resumes there.
        raw = RawClient(w.address)
        first = open(tmp_path / "weights.bin", "rb").read(1 << 20)
        status = raw(raw.worker.PutBlob, worker_pb2.BlobChunk(sha256=digest, nbytes=size, offset=0, data=first))
        assert not status.complete and status.nbytes == 1 << 20
        raw.close()
        received = []
        for _ in range(2):
            with ephost.Environment() as env:
                env.register_execution_provider_library("far", w.address, {"shared_memory": "false"})
                with InferenceSession(path, options_for(env, "far"), env=env) as session:
                    np.testing.assert_array_equal(session.run(None, {"idx": idx})[0], expected)
                stats = worker_stats(env, "far")
                received.append((stats.blob_bytes_received, stats.blob_hits))
        assert received[0][0] == size, "sent once, the first chunk not again"
        assert received == [(size, 0), (size, 1)], "the second session sent nothing: the worker had it"
        assert sorted(os.listdir(cache)) == [digest]
    finally:
        w.stop()
        shutil.rmtree(cache, ignore_errors=True)


def test_the_blob_cache_keeps_to_its_limit_and_checks_what_it_gets(tmp_path):
    import shutil
    import tempfile
    from ephost.external_data import load_model
    from ephost.v1 import worker_pb2
    from helpers import RawClient
    cache = tempfile.mkdtemp(prefix="ephost-blobs-")
    w = tcp_worker("--cache-dir", cache, "--cache-max-mb", "3")
    try:
        digests = []
        for k in range(2):  # two models of 2 MiB each: the first goes when the second arrives
            (tmp_path / str(k)).mkdir()
            path, idx, expected = models.sparse_external_model(tmp_path / str(k), weights=2, elements=SMALL,
                                                                positions=(k, 99))
            with ephost.Environment() as env:
                env.register_execution_provider_library("far", w.address, {"shared_memory": "false"})
                with InferenceSession(path, options_for(env, "far"), env=env) as session:
                    np.testing.assert_array_equal(session.run(None, {"idx": idx})[0], expected)
            digests.append(load_model(path)[1].files["weights.bin"].sha256())
        assert os.listdir(cache) == [digests[1]]
        raw = RawClient(w.address)
        try:
            with pytest.raises(grpc.RpcError) as e:  # bytes that do not hash to the name are dropped
                raw(raw.worker.PutBlob, worker_pb2.BlobChunk(sha256="0" * 64, nbytes=4, offset=0, data=b"abcd"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hash" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                raw(raw.worker.GetBlob, worker_pb2.BlobRef(sha256="../../etc/passwd"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as e:
                raw(raw.worker.PutBlob, worker_pb2.BlobChunk(sha256="1" * 64, nbytes=8, offset=4, data=b"abcd"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "resume there" in e.value.details()
        finally:
            raw.close()
        assert os.listdir(cache) == [digests[1]]
    finally:
        w.stop()
        shutil.rmtree(cache, ignore_errors=True)


def _wire_model(location: str = "w", offset: int = 0, length: int = 16) -> bytes:
    t = models._external(TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[length // 4]), location,
                         offset, length)
    graph = helper.make_graph([helper.make_node("Neg", ["W"], ["y"], name="neg")], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [length // 4])], [t])
    return helper.make_model(graph, opset_imports=models.OPSET).SerializeToString()


def test_the_worker_checks_every_reference_against_the_file_it_was_handed(raw, tmp_path):
    """On the wire a location is a name of ModelRef.files, never a path; the ranges are checked against the
    size of the very file the worker maps."""
    from ephost.fdshare import hand_over_file
    from ephost.v1 import factory_pb2
    weights = tmp_path / "w.bin"
    weights.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    ep = raw(raw.factory.CreateEp, factory_pb2.CreateEpRequest(device_indices=[0])).id
    ticket = raw(raw.worker.ImportFile, common_pb2.Empty())
    fd = os.open(weights, os.O_RDONLY)
    try:
        hand_over_file(raw.hello.fd_socket, ticket.ticket, fd)
    finally:
        os.close(fd)

    def capability(model: bytes, files):
        return raw(raw.ep.GetCapability, ep_pb2.GetCapabilityRequest(ep=ep, model=ep_pb2.ModelRef(
            model=model, files=files)))

    good = [ep_pb2.ExternalFile(name="w", nbytes=16, file=ticket.file)]
    assert [list(g.node_names) for g in capability(_wire_model(), good).groups] == [["neg"]]
    cases = [(_wire_model(location=str(weights)), good, grpc.StatusCode.INVALID_ARGUMENT, "not among"),
             (_wire_model(offset=8), good, grpc.StatusCode.OUT_OF_RANGE, "too short"),
             (_wire_model(), [ep_pb2.ExternalFile(name="w", nbytes=15, file=ticket.file)],
              grpc.StatusCode.INVALID_ARGUMENT, "not the 15"),
             (_wire_model(), [ep_pb2.ExternalFile(name="w", nbytes=16, file=ticket.file + 99)],
              grpc.StatusCode.NOT_FOUND, "file handle"),
             (_wire_model(), [], grpc.StatusCode.INVALID_ARGUMENT, "never read")]
    for model, files, code, text in cases:
        with pytest.raises(grpc.RpcError) as e:
            capability(model, files)
            pytest.fail(f"accepted: {text}")
        assert e.value.code() == code and text in e.value.details(), (code, e.value.details())


def test_only_a_regular_file_is_taken(raw):
    from ephost.fdshare import hand_over_file
    ticket = raw(raw.worker.ImportFile, common_pb2.Empty())
    r, w = os.pipe()
    try:
        with pytest.raises(ephost.EpPermissionDenied, match="not a regular file"):
            hand_over_file(raw.hello.fd_socket, ticket.ticket, r)
    finally:
        os.close(r)
        os.close(w)


# --- over 2 GiB -------------------------------------------------------------------------------------------------

# Run in a child process, so that its peak RSS (VmHWM) is this session's alone.
CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    import ephost

    def status_of(pid, key):
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    def status(key):
        return status_of("self", key)

    path, target = sys.argv[1], sys.argv[2]
    idx = np.array(json.loads(sys.argv[3]), np.int64)
    out = {}
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", target)
        options = ephost.SessionOptions()
        options.add_provider_for_devices([d for d in env.get_ep_devices() if d.registration_name == "w"])
        options.ep_failure_policy = "retry"
        out["before"] = status("VmRSS")
        with ephost.InferenceSession(path, options, env=env) as session:
            out["assigned"] = [s.registration for s in session.get_provider_graph_assignment_info()]
            out["first"] = session.run(None, {"idx": idx})[0].tolist()
            pid = env.registration("w").process.pid
            out["worker_peak"] = status_of(pid, "VmHWM")
            os.kill(pid, signal.SIGKILL)
            out["after_kill"] = session.run(None, {"idx": idx})[0].tolist()
            out["pids"] = [pid, env.registration("w").process.pid]
        stats = env.get_worker_stats("w")
        out["files_imported"] = stats.files_imported
        out["peak"] = status("VmHWM")
    print(json.dumps(out))
""")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("target", ["onnxruntime", "reference"])
def test_a_model_over_2_gib_runs_without_the_application_reading_its_weights(tmp_path, target):
    path, idx, expected = models.sparse_external_model(tmp_path)
    assert os.path.getsize(tmp_path / "weights.bin") > 2 << 30
    assert os.stat(tmp_path / "weights.bin").st_blocks * 512 < 64 << 20, "sparse: the test costs little disk"
    done = subprocess.run([sys.executable, "-c", CHILD, path, target, json.dumps(idx.tolist())],
                          capture_output=True, text=True, timeout=540, cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["assigned"] == ["w"]
    np.testing.assert_array_equal(np.array(out["first"], np.float32), expected)
    np.testing.assert_array_equal(np.array(out["after_kill"], np.float32), expected)
    # The worker was killed, and the restarted one got the same files again (as descriptors; the count is the
    # new worker's): nothing was read through the application.
    assert out["pids"][0] != out["pids"][1]
    assert out["files_imported"] == 1
    grown = out["peak"] - out["before"]
    assert grown < 200 << 20, f"the application's peak RSS grew by {grown >> 20} MiB"
    # The worker maps what it reads (ORT maps the files itself): far less than the 2.5 GiB of weights.
    assert out["worker_peak"] < 1 << 30, f"the worker's peak RSS was {out['worker_peak'] >> 20} MiB"


def test_an_ep_with_an_external_data_loader_loads_its_initializers_itself(tmp_path):
    """ORT's external data loader: an EP that has one is asked per memory info, and loads each initializer of
    its partition (file, offset, length) into a tensor of its own; without one the file is mapped."""
    from ephost.eps.base import FusedGraph, MappingLoader
    from ephost.eps.reference import ReferenceEp, evaluator_ops
    from ephost.external_data import load_model
    from ephost.graph import GraphIndex

    path, idx, expected = small_model(tmp_path)
    model, external = load_model(path)
    index = GraphIndex.of(model)
    index.external = external
    graph = FusedGraph("all", index, tuple(index.order), ("idx",), ("y",))
    calls = []

    class Loader(MappingLoader):
        def can_load(self, memory_info):
            calls.append(("can_load", memory_info.name))
            return True

        def load_tensor(self, file, offset, length, tensor):
            calls.append(("load_tensor", file.name, offset, length))
            super().load_tensor(file, offset, length, tensor)

    class LoadingEp(ReferenceEp):
        def external_data_loader(self):
            return Loader()

    try:
        for ep, loaded in ((LoadingEp(evaluator_ops(), {}), True), (ReferenceEp(evaluator_ops(), {}), False)):
            calls.clear()
            (info,) = ep.compile([graph])
            (y,) = info.compute(ComputeCall([idx]))
            np.testing.assert_array_equal(y.numpy(), expected)
            stride = -(-SMALL * 4 // 65536) * 65536
            assert calls == ([("can_load", "Cpu"), ("load_tensor", "weights.bin", 0, SMALL * 4),
                              ("load_tensor", "weights.bin", stride, SMALL * 4)] if loaded else [])
    finally:
        external.close()


@pytest.mark.timeout(300)
def test_ephost_run_shows_progress_for_a_big_model(tmp_path):
    path, idx, expected = models.sparse_external_model(tmp_path)
    np.save(tmp_path / "idx.npy", idx)
    done = subprocess.run([sys.executable, "-m", "ephost", "run", path, "--ep", "onnxruntime", "--input",
                           f"idx={tmp_path / 'idx.npy'}", "--runs", "1"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "GiB with its external data); making the session" in out
    assert "external data file(s), 2.50 GiB, mapped where used, not read" in out
    assert "asking onnxruntime which nodes it takes" in out and "compiling 1 partition(s) on onnxruntime" in out
    assert "session ready" in out and out.index("session ready") < out.index("time per run")
    # Each step once: not again in the log, nor the model's name after the steps
    assert "asking onnxruntime which nodes it takes" not in done.stderr and out.count("model: ") == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ep", ["reference", "onnxruntime"])
def test_a_model_in_the_workers_model_dir_never_crosses_the_network(tmp_path, ep):
    """`--model-dir`: a client names the model by relative path; the worker reads it and its weights from its
    own directory, and only the graph reaches the client. Paths out of the directory are refused."""
    from helpers import Worker
    from test_remote import free_port
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    _, idx, expected = models.sparse_external_model(tmp_path / "models" / "m")
    models.sparse_external_model(tmp_path / "outside", weights=1, elements=16, positions=(0,))
    w = Worker("--ep", ep, "--listen", f"127.0.0.1:{free_port()}", "--insecure", "--model-dir",
               str(tmp_path / "models"), "--cache-max-mb", "0")
    try:
        with ephost.Environment() as env:
            env.register_execution_provider_library("far", w.address, {"shared_memory": "false"})
            with InferenceSession(ephost.ModelOnWorker("far", "m/model.onnx"), options_for(env, "far"),
                                  env=env) as session:
                assert [s.registration for s in session.get_provider_graph_assignment_info()] == ["far"]
                np.testing.assert_array_equal(session.run(None, {"idx": idx})[0], expected)
            stats = worker_stats(env, "far")
            assert stats.bytes_inline_in < 1 << 20 and stats.blob_bytes_received == 0
            for path, error in (("../outside/model.onnx", ephost.EpInvalidArgument),
                                (str(tmp_path / "outside" / "model.onnx"), ephost.EpInvalidArgument),
                                ("m/missing.onnx", ephost.EpNotFound)):
                with pytest.raises(error, match="model directory"):
                    InferenceSession(ephost.ModelOnWorker("far", path), options_for(env, "far"), env=env)
    finally:
        w.stop()


def test_a_model_file_in_the_model_dir_cannot_name_a_file_outside_it(tmp_path):
    from helpers import Worker
    (tmp_path / "models").mkdir()
    path, _, _ = models.sparse_external_model(tmp_path / "models", weights=1, elements=16, positions=(0,))
    w = Worker("--ep", "reference", "--model-dir", str(tmp_path / "models"))
    try:
        with ephost.Environment() as env:
            env.register_execution_provider_library("w", w.address)
            _set(path, location="../../etc/passwd")
            with pytest.raises(ephost.EpInvalidArgument, match="outside the model's directory"):
                InferenceSession(ephost.ModelOnWorker("w", "model.onnx"), options_for(env, "w"), env=env)
            # A model sent by a client may not name a model directory file outside the directory either.
            ep = env.registration("w").link
            from ephost.v1 import factory_pb2
            handle = ep.call(lambda c: c.factory.CreateEp, factory_pb2.CreateEpRequest(device_indices=[0])).id
            with pytest.raises(ephost.EpInvalidArgument, match="not inside the worker's model directory"):
                ep.call(lambda c: c.ep.GetCapability, ep_pb2.GetCapabilityRequest(ep=handle, model=ep_pb2.ModelRef(
                    model=_wire_model(), files=[ep_pb2.ExternalFile(name="w", nbytes=16,
                                                                    model_dir_path="../outside.bin")])))
    finally:
        w.stop()


def test_a_model_in_memory_over_protobufs_limit_gets_a_clear_error(env, monkeypatch):
    """(A real 2 GiB ModelProto would cost the test 2 GiB: the limit is lowered instead.)"""
    from ephost import external_data
    model, _ = models.matmul_with_weights(10, 100)
    monkeypatch.setattr(external_data, "PROTOBUF_LIMIT", model.ByteSize() - 1)
    with pytest.raises(ephost.EpInvalidArgument, match="over 2 GiB cannot be serialized.*save_as_external_data"):
        InferenceSession(model, env=env, providers=["ref"])


def test_onnxruntime_copies_a_file_that_has_no_path_here_and_says_so(tmp_path, caplog):
    """ORT opens the files by their path, found from the descriptors; a file with none (deleted after it was
    opened, or in another mount namespace) is copied into ORT instead, with a warning."""
    from ephost.eps import load_factory
    from ephost.eps.base import FusedGraph
    from ephost.external_data import load_model, on_disk
    from ephost.graph import GraphIndex

    path, idx, expected = small_model(tmp_path)
    model, external = load_model(path)
    try:
        placed, folder = on_disk(model, external)
        assert folder == str(tmp_path) and placed.graph.initializer[0].external_data[0].value == "weights.bin"
        os.remove(tmp_path / "weights.bin")  # still open here, but no path leads to it any more
        assert on_disk(model, external) is None
        index = GraphIndex.of(model)
        index.external = external
        ep = load_factory("onnxruntime", {}).create_ep([0], {})
        with caplog.at_level("WARNING", logger="ephost.eps.onnxruntime"):
            (info,) = ep.compile([FusedGraph("all", index, tuple(index.order), ("idx",), ("y",))])
        (y,) = info.compute(ComputeCall([idx]))
        np.testing.assert_array_equal(y.numpy(), expected)
        assert "copied into ONNX Runtime" in caplog.text
    finally:
        external.close()


def test_a_fifo_where_the_weights_should_be_is_refused_not_waited_on(env, tmp_path):
    path, _, _ = small_model(tmp_path)
    os.remove(tmp_path / "weights.bin")
    os.mkfifo(tmp_path / "weights.bin")
    with pytest.raises(ephost.EpInvalidArgument, match="not a regular file"):
        InferenceSession(path, env=env, providers=["ref"])
