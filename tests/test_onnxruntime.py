"""The onnxruntime EP: ONNX Runtime and its plugin EP libraries (OpenVINO's) inside a worker."""

import os
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import ephost
from ephost import InferenceSession
from ephost.errors import EpError
from ephost.eps.base import ComputeCall
from ephost.eps.onnxruntime import OrtEpFactory, max_ir_version, readable_model
from ephost.cli.run_command import bundled_input, bundled_model
from ephost.types import DeviceMemoryType
import models
from helpers import compiled, options_for, worker_stats

try:
    import onnxruntime_ep_openvino as OPENVINO
except ImportError:  # only the OpenVINO tests need it
    OPENVINO = None
needs_openvino = pytest.mark.skipif(OPENVINO is None,
                                    reason="onnxruntime-ep-openvino is installed by the openvino extra")


@pytest.fixture(scope="module")
def ort_env():
    with ephost.Environment() as env:
        env.register_execution_provider_library("ort", "onnxruntime")
        yield env


def test_devices_are_what_onnx_runtime_reports(ort_env):
    (device,) = [d for d in ort_env.get_ep_devices() if d.registration_name == "ort"]
    (expected,) = [d for d in ort.get_ep_devices() if d.ep_name == "CPUExecutionProvider"]
    # the worker adds the ONNX Runtime it runs under (here the application's own)
    assert (device.ep_name, device.ep_vendor, device.ep_metadata) == \
           (expected.ep_name, expected.ep_vendor, {**expected.ep_metadata, "onnxruntime_version": ort.__version__})
    hw = device.device
    want = expected.device
    assert (int(hw.type), hw.vendor_id, hw.vendor, hw.device_id) == \
           (int(want.type.value), want.vendor_id, want.vendor, want.device_id)
    assert device.memory_info(ephost.DeviceMemoryType.HOST_ACCESSIBLE) is not None


@pytest.mark.parametrize("name", ["resnet50", "squeezenet", "shufflenet"])
def test_real_models_match_their_expected_outputs(ort_env, name):
    path, expected_path = bundled_model(name)
    expected = numpy_helper.to_array(onnx.load_tensor(expected_path))
    with InferenceSession(path, options_for(ort_env, "ort"), env=ort_env) as session:
        assert {s.registration for s in session.get_provider_graph_assignment_info()} == {"ort"}
        (arg,) = session.get_inputs()
        (y,) = session.run(None, {arg.name: bundled_input(arg)})
    np.testing.assert_allclose(y, expected, rtol=1e-3, atol=1e-5)


def _cpu_ns(pid: int) -> int:
    """The CPU time of every thread of a process, in nanoseconds (schedstat: finer than /proc/PID/stat's ticks)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return total


def _runnable_threads(pid: int) -> int:
    """How many threads of a process are running or waiting for a CPU (state R), not asleep in the kernel."""
    count = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
        count += stat[stat.rindex(")") + 2] == "R"
    return count


def _cpu_ns_until_idle(pid: int, timeout: float = 30.0) -> int:
    """The CPU time a process uses from now until it is idle (no thread runnable at three looks in a row): what a
    thread that spins uses however long the machine's load makes its spin last."""
    start, deadline, quiet = _cpu_ns(pid), time.monotonic() + timeout, 0
    while quiet < 3:
        assert time.monotonic() < deadline, "the process never went idle"
        quiet = quiet + 1 if _runnable_threads(pid) == 0 else 0
        time.sleep(0.002)
    return _cpu_ns(pid) - start


def test_a_worker_leaves_no_cpu_spinning_after_a_run_unless_the_session_config_says_so():
    """ORT's intra-op threads spin on for tens of milliseconds after a run by default, on CPUs that the caller's
    next request and the other workers need; a worker's sessions stop them as a run ends
    (session.force_spinning_stop=1), and the user's session_config still has the last word."""
    path, _ = bundled_model("squeezenet")
    idle = {}
    with ephost.Environment() as env:
        for name, config in (("stops", {}), ("spins", {"session_config": "session.force_spinning_stop=0"})):
            # Two intra-op threads, so that the pool has one to spin whatever the machine's core count
            env.register_execution_provider_library(name, "onnxruntime", {"intra_op_num_threads": "2", **config})
            pid = env.registration(name).process.pid
            with InferenceSession(path, options_for(env, name), env=env) as session:
                (arg,) = session.get_inputs()
                feeds = {arg.name: bundled_input(arg)}
                used = []
                for _ in range(3):
                    session.run(None, feeds)
                    used.append(_cpu_ns_until_idle(pid))
            idle[name] = sorted(used)[1]  # the median of three: what the worker used after a run
    assert idle["stops"] < 3e6, idle
    assert idle["spins"] > 10e6, idle


def test_outputs_are_written_in_place_into_shared_memory(ort_env):
    """IOBinding: ORT writes a large output straight into memory the client maps; the reference EP, which
    makes its own arrays, has its outputs copied there."""
    model = models.chain(["Relu", "Neg"], shape=(512, 512))  # 1 MiB out: through shared memory
    x = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    with InferenceSession(model, options_for(ort_env, "ort"), env=ort_env) as session:
        before = worker_stats(ort_env, "ort")
        (y,) = session.run(None, {"x": x})
        after = worker_stats(ort_env, "ort")
    np.testing.assert_array_equal(y, -np.maximum(x, 0))
    assert after.compute_outputs_in_place - before.compute_outputs_in_place == 1
    assert after.compute_outputs_copied == before.compute_outputs_copied
    with ephost.Environment() as env:
        env.register_execution_provider_library("ref", "reference")
        with InferenceSession(model, options_for(env, "ref"), env=env) as session:
            session.run(None, {"x": x})
            assert worker_stats(env, "ref").compute_outputs_copied == 1


def test_nodes_onnx_runtime_lacks_fall_back(ort_env):
    # Mish on double at opset 24: ONNX Runtime's CPU EP has no kernel for it; the reference fallback has.
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Cast", ["r"], ["d"], name="cast", to=onnx.TensorProto.DOUBLE),
             helper.make_node("Mish", ["d"], ["y"], name="mish")]
    model = models.model(nodes, [models.tensor("x", [3, 3])], [models.tensor("y", [3, 3], onnx.TensorProto.DOUBLE)],
                         opset=[helper.make_opsetid("", 24)])
    x = np.random.default_rng(1).standard_normal((3, 3)).astype(np.float32)
    with InferenceSession(model, options_for(ort_env, "ort"), env=ort_env) as session:
        owners = {n.name: s.registration for s in session.get_provider_graph_assignment_info() for n in s.nodes}
        assert owners == {"relu": "ort", "cast": "ort", "mish": "fallback"}
        (y,) = session.run(None, {"x": x})
    d = np.maximum(x, 0).astype(np.float64)
    np.testing.assert_allclose(y, d * np.tanh(np.log1p(np.exp(d))), rtol=1e-6)


def test_constants_onnx_runtime_reads_are_in_its_partition(ort_env):
    """ORT loads a Constant as an initializer, a value it knows before the run. A Scan whose body output's rank
    depends on an outer Constant (Unsqueeze/Squeeze axes) runs only if ORT sees that value: given it as a
    partition input instead, ORT fails ("Subgraph must have the shape set for all outputs"), as ONNX's
    linear_attention *_expanded cases did."""
    T = onnx.TensorProto
    body = helper.make_graph(
        [helper.make_node("Add", ["s", "xi"], ["t"]),
         helper.make_node("Unsqueeze", ["t", "axes"], ["u"]),
         helper.make_node("Squeeze", ["u", "axes"], ["s_out"]),
         helper.make_node("Identity", ["t"], ["y_i"])],
        "body", [models.tensor("s", None), models.tensor("xi", None)],
        [models.tensor("s_out", None), models.tensor("y_i", None)])
    nodes = [helper.make_node("Constant", [], ["axes"], name="axes", value=helper.make_tensor("a", T.INT64, [1], [0])),
             helper.make_node("Scan", ["s0", "x"], ["s", "y"], name="scan", body=body, num_scan_inputs=1)]
    model = models.model(nodes, [models.tensor("s0", [2]), models.tensor("x", [3, 2])],
                         [models.tensor("s", None), models.tensor("y", None)])
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    with InferenceSession(model, options_for(ort_env, "ort"), env=ort_env) as session:
        owners = {n.name: s.registration for s in session.get_provider_graph_assignment_info() for n in s.nodes}
        assert owners == {"axes": "ort", "scan": "ort"}
        s, y = session.run(None, {"s0": np.zeros(2, np.float32), "x": x})
    np.testing.assert_array_equal(y, np.cumsum(x, axis=0))
    np.testing.assert_array_equal(s, x.sum(axis=0))


def test_ir_versions_onnx_runtime_cannot_read(ort_env):
    model = models.diamond()
    model.ir_version = max_ir_version() + 1
    assert readable_model(model).ir_version == max_ir_version()  # opset 18 allows the lower IR version
    with InferenceSession(model, options_for(ort_env, "ort"), env=ort_env) as session:
        assert {s.registration for s in session.get_provider_graph_assignment_info()} == {"ort"}
    newest = models.model(models.diamond().graph.node, list(models.diamond().graph.input),
                          list(models.diamond().graph.output),
                          opset=[helper.make_opsetid("", onnx.defs.onnx_opset_version())])
    if helper.find_min_ir_version_for(list(newest.opset_import), ignore_unknown=True) > max_ir_version():
        with pytest.raises(ephost.EpInvalidArgument, match="reads at most IR version"):
            readable_model(newest)
        with InferenceSession(newest, options_for(ort_env, "ort"), env=ort_env) as session:
            # ORT cannot read it, so it takes nothing; the fallback runs the model
            assert {s.registration for s in session.get_provider_graph_assignment_info()} == {"fallback"}
            x = np.ones((2, 3), np.float32)
            np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x))


def _reduce_max_of_an_empty_bool_set():
    """A node ORT claims and then fails to run (RUNTIME_EXCEPTION: "ReduceMax is not defined for empty set with
    bool type"), where ONNX's reference evaluator computes it: the model, its feeds and the expected output."""
    from onnx.backend.test.case.node import collect_testcases
    (case,) = [c for c in collect_testcases(None) if c.name == "test_reduce_max_empty_set_bool"]
    inputs, outputs = case.data_sets[0]
    feeds = {i.name: a for i, a in zip(case.model.graph.input, inputs)}
    return case.model, feeds, outputs[0]


def test_a_vendor_failure_is_ep_internal_and_the_fallback_policy_catches_it(ort_env):
    model, feeds, expected = _reduce_max_of_an_empty_bool_set()
    options = options_for(ort_env, "ort")
    with InferenceSession(model, options, env=ort_env) as session:
        assert {s.registration for s in session.get_provider_graph_assignment_info()} == {"ort"}
        with pytest.raises(ephost.EpInternal, match="ReduceMax is not defined for empty set"):
            session.run(None, feeds)
    options.ep_failure_policy = "fallback"
    with InferenceSession(model, options, env=ort_env) as session:
        (y,) = session.run(None, feeds)
        np.testing.assert_array_equal(y, expected)
        assert session.failure_counters["failed"] == 1 and session.failure_counters["fell back"] == 1


def test_bad_options_are_clear_errors():
    with pytest.raises(ephost.EpNotFound, match="no execution provider 'NoSuchExecutionProvider'"):
        ephost.eps.load_factory("onnxruntime", {"provider": "NoSuchExecutionProvider"})
    with pytest.raises(ephost.EpInvalidArgument, match="graph_optimization_level"):
        ephost.eps.load_factory("onnxruntime", {"graph_optimization_level": "max"})
    with pytest.raises(ephost.EpNotFound, match="no plugin EP library"):
        ephost.eps.load_factory("onnxruntime", {"library": "/nonexistent/libplugin.so"})
    factory = ephost.eps.load_factory("onnxruntime", {"provider_options": "a=1;b=2", "intra_op_num_threads": "1"})
    assert factory.get_supported_devices()[0].ep_options == {"a": "1", "b": "2"}


@needs_openvino
def test_the_openvino_plugin_library_in_a_worker_reports_what_ort_reports_in_process():
    """Registered by its path, as a user would. On an Intel machine OpenVINO reports its devices and takes
    nodes; on others its factory reports no device: the worker must report exactly what ORT does in process."""
    library = OPENVINO.get_library_path()
    ort.register_execution_provider_library("ephost-test-ov", library)
    in_process = [d for d in ort.get_ep_devices() if d.ep_name == OPENVINO.get_ep_name()]
    with ephost.Environment() as env:
        env.register_execution_provider_library("ov", library)
        devices = [d for d in env.get_ep_devices() if d.registration_name == "ov"]
        assert [(d.ep_name, d.ep_vendor, int(d.device.type), d.device.vendor_id, d.ep_metadata) for d in devices] == \
               [(d.ep_name, d.ep_vendor, int(d.device.type.value), d.device.vendor_id,
                 {**d.ep_metadata, "onnxruntime_version": ort.__version__}) for d in in_process]
        process = env.registration("ov").process
        assert process.proc.poll() is None, "a vendor library that finds no device does not bring its worker down"
        if devices:
            path, expected_path = bundled_model("resnet50")
            with InferenceSession(path, options_for(env, "ov"), env=env) as session:
                (arg,) = session.get_inputs()
                (y,) = session.run(None, {arg.name: bundled_input(arg)})
            np.testing.assert_allclose(y, numpy_helper.to_array(onnx.load_tensor(expected_path)), rtol=1e-3, atol=1e-4)


def test_a_second_session_on_the_same_model_is_answered_from_the_capability_cache(ort_env):
    """GetCapability builds an ORT session of the whole model in the worker; a second ephost session on the same
    model (same content, same EP configuration) gets the worker's earlier answer. Another model is asked anew."""
    x = np.random.default_rng(3).standard_normal((2, 3)).astype(np.float32)

    def session_on(model):
        with InferenceSession(model, options_for(ort_env, "ort"), env=ort_env) as session:
            assert {s.registration for s in session.get_provider_graph_assignment_info()} == {"ort"}
            return session.run(None, {"x": x})[0]

    hits = lambda: worker_stats(ort_env, "ort").capability_cache_hits  # noqa: E731
    before = hits()
    np.testing.assert_allclose(session_on(models.diamond()), models.diamond_expected(x), rtol=1e-6)
    assert hits() == before
    np.testing.assert_allclose(session_on(models.diamond()), models.diamond_expected(x), rtol=1e-6)
    assert hits() == before + 1
    np.testing.assert_allclose(session_on(models.chain(["Relu", "Neg"], shape=(2, 3))), -np.maximum(x, 0))
    assert hits() == before + 1


def test_an_ep_wrapped_by_the_chaos_ep_is_asked_every_time():
    """The chaos EP forwards what it does not override to the EP it wraps; its GetCapability faults must still
    happen, so the cache must not take the wrapped EP's key for it."""
    with ephost.Environment() as env:
        env.register_execution_provider_library("c", "chaos", {"wrap": "onnxruntime", "fault": "raise",
                                                               "at": "compute", "every": "1000"})
        for _ in range(2):
            with InferenceSession(models.diamond(), options_for(env, "c"), env=env) as session:
                session.run(None, {"x": np.ones((2, 3), np.float32)})
        stats = worker_stats(env, "c")
        assert stats.methods["Ep/GetCapability"].calls == 2 and stats.capability_cache_hits == 0


def test_sessions_open_at_once_on_one_model_share_its_compiled_partitions(ort_env):
    """Compile builds an ORT session per partition; while one lives, a second ephost session on the same model
    (same content, same EP configuration) is given it: compiled once, its weights held once. Both run right,
    from two threads at once."""
    import threading
    path, expected_path = bundled_model("squeezenet")
    expected = numpy_helper.to_array(onnx.load_tensor(expected_path))
    stats = lambda: worker_stats(ort_env, "ort")  # noqa: E731
    before = stats()
    with InferenceSession(path, options_for(ort_env, "ort"), env=ort_env) as a, \
            InferenceSession(path, options_for(ort_env, "ort"), env=ort_env) as b:
        after = stats()
        assert (after.partitions_compiled - before.partitions_compiled,
                after.partitions_shared - before.partitions_shared) == (1, 1)
        (arg,) = a.get_inputs()
        feeds = {arg.name: bundled_input(arg)}
        results: list = []
        threads = [threading.Thread(target=lambda s=s: results.append(s.run(None, feeds)[0])) for s in (a, b) * 3]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == 6
    for y in results:
        np.testing.assert_allclose(y, expected, rtol=1e-3, atol=1e-5)


def test_a_kept_binding_follows_an_input_array_reshaped_in_place():
    """The ORT compute info keeps its IOBinding between runs and skips rebinding an input when the same array
    comes again (a kept call's buffer); an array whose shape was changed in place must be bound anew, or ORT
    would run on the old shape."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", "m"])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", "m"])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 18)])
    with compiled(model, ("x",), ("y",)) as info:
        array = np.arange(-8192, 8192, dtype=np.float32).reshape(64, 256)  # 64 KiB: bound where it lies
        for shape in [(64, 256), (64, 256), (256, 64), (16384, 1)]:
            array.shape = shape
            (out,) = info.compute(ComputeCall([ephost.Tensor.from_numpy(array)]))
            assert out.shape == shape
            np.testing.assert_array_equal(out.numpy(), np.maximum(array, 0))


def test_runs_on_a_steady_binding_see_each_runs_inputs_and_keep_each_runs_outputs():
    """Small inputs and small outputs of known shape go through memory kept with the IOBinding; once a run has
    bound them all there, the next like it only copies in and out. Every run must still read its own inputs
    (not the last run's), hand back outputs no later run overwrites, and give way to the general path where a
    run differs (an output written into the caller's tensor, an input of another shape)."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])
    z = helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2, 3])
    model = helper.make_model(helper.make_graph([helper.make_node("Sub", ["x", "y"], ["z"], name="sub")], "g",
                                                [x, y], [z]), opset_imports=[helper.make_opsetid("", 18)])
    rng = np.random.default_rng(3)
    with compiled(model, ("x", "y"), ("z",)) as info:
        fed, got = [], []
        for i in range(6):
            a, b = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)
            ta, tb = ephost.Tensor.from_numpy(a), ephost.Tensor.from_numpy(b)
            if i == 3:  # the output written into the caller's tensor: the general path, then steady again
                target = ephost.Tensor.from_numpy(np.zeros((2, 3), np.float32))
                (out,) = info.compute(ComputeCall([ta, tb], into={0: target}))
                assert out is target
            else:
                (out,) = info.compute(ComputeCall([ta, tb]))
            fed.append((a.copy(), b.copy()))
            got.append(out)
            a += 100  # the caller's memory written after the run: the output is its own
        for (a, b), out in zip(fed, got):
            np.testing.assert_array_equal(out.numpy(), a - b)
        with pytest.raises(EpError, match="invalid dimensions"):  # ORT's own check, on the general path
            info.compute(ComputeCall([ephost.Tensor.from_numpy(np.ones((3, 2), np.float32))] * 2))
        (out,) = info.compute(ComputeCall([ephost.Tensor.from_numpy(np.full((2, 3), 5, np.float32)),
                                           ephost.Tensor.from_numpy(np.ones((2, 3), np.float32))]))
        np.testing.assert_array_equal(out.numpy(), np.full((2, 3), 4, np.float32))


def test_a_steady_binding_reads_a_bound_array_as_it_is_now_and_binds_another_shape_anew():
    """A large input is bound where it lies (a kept call's buffer, the same array every run) and a steady
    binding does not bind it again: each run must read what the array holds now, and an input of another shape
    over the same memory must be bound anew (the output, of fixed shape, would not show a stale binding)."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", "m"])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    nodes = [helper.make_node("Gather", ["x", "zero"], ["row"], axis=0, name="first_row"),
             helper.make_node("ReduceSum", ["row"], ["y"], keepdims=1, name="sum")]
    zero = helper.make_tensor("zero", onnx.TensorProto.INT64, [], [0])
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], [zero]),
                              opset_imports=[helper.make_opsetid("", 18)])
    with compiled(model, ("x",), ("y",)) as info:
        tensor = ephost.Tensor.from_numpy(np.arange(64 * 256, dtype=np.float32).reshape(64, 256))  # 64 KiB
        array = tensor.numpy()  # the tensor's own array, which the EP binds where it lies
        for step in range(6):
            if step == 2:
                array += 1  # written in place, as a caller writes a kept call's buffer
            if step == 4:
                tensor = ephost.Tensor.from_numpy(array.reshape(256, 64))
                array = tensor.numpy()
            (out,) = info.compute(ComputeCall([tensor]))
            np.testing.assert_array_equal(out.numpy(), [array[0].sum()])


def test_a_large_output_goes_into_the_allocator_whenever_one_is_given():
    """A large output of known shape is written by ORT into a buffer of the call's allocator (shared memory a
    client maps: it leaves by handle, without a copy), and without an allocator into memory kept with the
    binding. A run without an allocator must not make the binding steady for a later run with one."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [128, 256])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [128, 256])  # 128 KiB
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 18)])
    factory = OrtEpFactory()
    shared = next(m for m in factory.memory_infos if m.device_mem_type == DeviceMemoryType.HOST_ACCESSIBLE)
    allocator = factory.create_allocator(shared, {})
    tensor = ephost.Tensor.from_numpy(np.arange(-16384, 16384, dtype=np.float32).reshape(128, 256))
    try:
        with compiled(model, ("x",), ("y",)) as info:
            for given in (None, None, allocator, None, allocator):
                (out,) = info.compute(ComputeCall([tensor], given))
                assert (out.buffer is not None) == (given is not None)
                np.testing.assert_array_equal(out.numpy(), np.maximum(tensor.numpy(), 0))
                if out.buffer is not None:
                    out.release()
    finally:
        factory.release_allocator(allocator)
        factory.close()


def test_an_output_of_symbolic_shape_kept_in_the_allocator_is_copied_there_once():
    """An output whose shape ORT learns as it runs, asked to be kept (`keep`: a decoding loop's state), comes back
    in a buffer of the call's allocator, ORT's result copied there by the EP (a worker hands it over without a
    second copy); with no allocator, or not kept, it is host memory of its own. Positions past the outputs, and
    one named twice, change nothing."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, "n"])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, "n"])
    model = helper.make_model(helper.make_graph([helper.make_node("Neg", ["x"], ["y"], name="neg")], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 18)])
    factory = OrtEpFactory()
    shared = next(m for m in factory.memory_infos if m.device_mem_type == DeviceMemoryType.HOST_ACCESSIBLE)
    allocator = factory.create_allocator(shared, {})
    try:
        with compiled(model, ("x",), ("y",)) as info:
            runs = ((3, allocator, (0,)), (5, allocator, (0, 0, 7)), (2, None, (0,)), (4, allocator, ()))
            for n, given, keep in runs:
                x = np.arange(n, dtype=np.float32).reshape(1, n)
                (out,) = info.compute(ComputeCall([ephost.Tensor.from_numpy(x)], given, tuple(keep)))
                assert (out.buffer is not None) == (given is not None and bool(keep)), (n, keep)
                np.testing.assert_array_equal(out.numpy(), -x)
                if out.buffer is not None:
                    assert out.memory_info == allocator.memory_info
                    out.release()
    finally:
        factory.release_allocator(allocator)
        factory.close()



@pytest.mark.parametrize("n", [4, 128], ids=["4KiB", "128KiB"])
def test_a_loop_kept_in_the_allocator_gets_a_new_buffer_each_step_and_reads_the_step_before(n):
    """A fixed-shape loop whose output is kept in the allocator and fed back (an IOBinding output bound to a
    worker's device): every step's output is a buffer of its own in the call's allocator (no later step writes
    over an earlier one's), and every step reads the buffer the step before made (a large input, bound where it
    lies, moves every step). A run with another allocator, another `keep` or none leaves its output where that
    run asks."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [n, 256])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [n, 256])
    one = helper.make_tensor("one", onnx.TensorProto.FLOAT, [], [1.0])
    model = helper.make_model(helper.make_graph([helper.make_node("Add", ["x", "one"], ["y"], name="add")], "g",
                                                [x], [y], [one]), opset_imports=[helper.make_opsetid("", 18)])
    factory = OrtEpFactory()
    shared = next(m for m in factory.memory_infos if m.device_mem_type == DeviceMemoryType.HOST_ACCESSIBLE)
    first, second = factory.create_allocator(shared, {}), factory.create_allocator(shared, {})
    x0 = np.arange(n * 256, dtype=np.float32).reshape(n, 256)
    try:
        with compiled(model, ("x",), ("y",)) as info:
            state, outs = ephost.Tensor.from_numpy(x0), []
            for step, (allocator, keep) in enumerate([(first, (0,))] * 6 + [(second, (0,))] * 2 +
                                                     [(second, ())] * 2 + [(None, (0,))] * 2 + [(first, (0,))] * 2):
                (state,) = info.compute(ComputeCall([state], allocator, tuple(keep)))
                outs.append(state)
                placed = allocator is not None and (bool(keep) or n == 128)  # 128 KiB: placed, kept or not
                assert (state.buffer is not None) == placed, step
                if placed:
                    assert allocator.region(state.buffer.region.id) is state.buffer.region, step
            for step, out in enumerate(outs):  # every output as its step left it
                np.testing.assert_array_equal(out.numpy(), x0 + step + 1)
            assert len({o.buffer.handle for o in outs if o.buffer is not None}) == sum(o.buffer is not None
                                                                                       for o in outs)
            for out in outs:
                if out.buffer is not None:
                    out.release()
    finally:
        factory.release_allocator(first)
        factory.release_allocator(second)
        factory.close()


@pytest.mark.parametrize("rows", [4, 4096], ids=["128B", "128KiB"])
def test_outputs_written_into_a_pair_of_tensors_swapped_each_run_land_in_each_runs_own(rows):
    """An output written into the caller's tensor (`into`: an IOBinding's bound output; a small one copied there, a
    large one written there by ORT), the caller swapping two tensors every run, and the input the other (a loop's
    state): every run's output lands in the tensor that run gave, the other left as it was (the input, read by
    this run, written by the one before). A target of another shape is not written: the output comes back as its
    own."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [rows, 8])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [rows, 8])
    one = helper.make_tensor("one", onnx.TensorProto.FLOAT, [], [1.0])
    model = helper.make_model(helper.make_graph([helper.make_node("Add", ["x", "one"], ["y"], name="add")], "g",
                                                [x], [y], [one]), opset_imports=[helper.make_opsetid("", 18)])
    x0 = np.arange(-4 * rows, 4 * rows, dtype=np.float32).reshape(rows, 8)  # whole numbers: every sum exact
    with compiled(model, ("x",), ("y",)) as info:
        pair = [ephost.Tensor.from_numpy(x0.copy()), ephost.Tensor.from_numpy(np.zeros((rows, 8), np.float32))]
        for n in range(1, 9):
            (out,) = info.compute(ComputeCall([pair[0]], into={0: pair[1]}))
            assert out is pair[1]
            np.testing.assert_array_equal(pair[1].numpy(), x0 + n)
            np.testing.assert_array_equal(pair[0].numpy(), x0 + n - 1)
            pair.reverse()
        other = ephost.Tensor.from_numpy(np.zeros((8, rows), np.float32))
        (out,) = info.compute(ComputeCall([pair[0]], into={0: other}))
        assert out is not other and not other.numpy().any()
        np.testing.assert_array_equal(out.numpy(), x0 + 9)
