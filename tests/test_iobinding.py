"""IOBinding (ORT's names): values bound in a worker stay there between runs; outputs as tensors without a copy."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import ephost
from ephost import DeviceMemoryType, InferenceSession
import models
from helpers import TRANSPORTS, device_of, options_for

STEPS = 50
COUNTERS = ("compute_inputs_resident", "compute_inputs_transferred", "compute_input_bytes_resident",
            "compute_input_bytes_transferred", "bytes_inline_in", "bytes_inline_out", "bytes_copied")


def recurrent(n: int = 256, batch: int = 4, seed: int = 0):
    """y = tanh(x @ W): a step whose output is the next step's input."""
    w = (np.random.default_rng(seed).standard_normal((n, n)) / np.sqrt(n)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="matmul"),
             helper.make_node("Tanh", ["h"], ["y"], name="tanh")]
    return models.model(nodes, [models.tensor("x", [batch, n])], [models.tensor("y", [batch, n])],
                        [numpy_helper.from_array(w, "w")])


def ort_loop(model, x, steps):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(steps):
        (x,) = session.run(None, {"x": x})
    return x


def counters(env, name):
    stats = env.get_worker_stats(name)
    return {c: getattr(stats, c) for c in COUNTERS}


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def env(request):
    with ephost.Environment() as environment:
        environment.register_execution_provider_library("ort", "onnxruntime", TRANSPORTS[request.param])
        environment.register_execution_provider_library("ref", "reference", {"ops": "Relu,Neg,Add,Mul,Abs",
                                                                            **TRANSPORTS[request.param]})
        yield environment


def test_a_loop_with_its_output_bound_in_the_worker_moves_no_bytes_after_the_first_step(env):
    model = recurrent()
    x0 = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    device = device_of(env, "ort")
    with InferenceSession(model, options_for(env, "ort"), env=env) as session:
        binding = session.io_binding()
        binding.bind_cpu_input("x", x0)
        binding.bind_output("y", device)
        session.run_with_iobinding(binding)
        first = counters(env, "ort")
        kept_before = env.get_worker_stats("ort").kept_calls
        for _ in range(STEPS - 1):
            (y,) = binding.get_outputs()
            assert y.memory_info == device.memory_info(DeviceMemoryType.HOST_ACCESSIBLE)
            binding.bind_ortvalue_input("x", y)
            session.run_with_iobinding(binding)
        after = counters(env, "ort")
        result = binding.copy_outputs_to_cpu()[0]
    assert first["compute_inputs_transferred"] == 1 and first["compute_input_bytes_transferred"] == x0.nbytes
    moved = {c: after[c] - first[c] for c in COUNTERS}
    assert moved == {"compute_inputs_resident": STEPS - 1, "compute_inputs_transferred": 0,
                     "compute_input_bytes_resident": (STEPS - 1) * x0.nbytes, "compute_input_bytes_transferred": 0,
                     "bytes_inline_in": 0, "bytes_inline_out": 0, "bytes_copied": 0}
    # On the fast lane the steps fed back are kept calls: each names the last step's output, and gets the
    # handle of a new one back.
    lane = env.get_worker_stats("ort").fast_lane_calls > 0
    assert env.get_worker_stats("ort").kept_calls - kept_before == (STEPS - 2 if lane else 0)
    np.testing.assert_allclose(result, ort_loop(model, x0, STEPS), rtol=1e-5, atol=1e-6)



def test_a_decoding_loop_whose_state_grows_repeats_one_kept_call_with_its_state_left_in_the_worker(env):
    """The loop a decoder runs: its state (the present) grows every step, stays bound in the worker and is the
    next step's past. On the fast lane the second step's call (its past in the worker, named by handle) is kept
    whatever its shapes and every later step repeats it: the frame names the past by handle and carries the
    dimensions and the row's bytes, the reply the score and a new buffer's record. No past is ever sent or fetched;
    the ORT EP copies each present, whose shape ORT learns as it runs, from ORT's memory straight into a buffer of the
    allocator (`compute_outputs_in_place`), not the worker after it; and every score and the final state are
    those of ORT in process."""
    from bench.data_plane import decoding_model  # the bench's decoding loop runs the same step
    model, steps, width = decoding_model(64), 12, 64
    rows = np.random.default_rng(5).standard_normal((steps, 1, 1, width)).astype(np.float32)
    device = device_of(env, "ort")
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with InferenceSession(model, options_for(env, "ort"), env=env) as session:
        binding = session.io_binding()
        binding.bind_cpu_input("past", np.zeros((1, 0, width), np.float32))
        binding.bind_output("present", device)
        binding.bind_output("score")
        past = np.zeros((1, 0, width), np.float32)
        before = counters(env, "ort")
        stats = env.get_worker_stats("ort")
        kept_before, calls_before = stats.kept_calls, stats.calls_kept
        in_place, copied = stats.compute_outputs_in_place, stats.compute_outputs_copied
        for row in rows:
            binding.bind_cpu_input("row", row)
            session.run_with_iobinding(binding)
            past, score = reference.run(None, {"past": past, "row": row})
            present, got = binding.get_outputs()
            assert present.shape == past.shape
            np.testing.assert_allclose(got.numpy(), score, rtol=1e-5)
            binding.bind_ortvalue_input("past", present)
        np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], past)
        stats = env.get_worker_stats("ort")
    moved = {c: getattr(stats, c) - before[c] for c in COUNTERS}
    assert moved["compute_inputs_resident"] == steps - 1  # every past but the first, empty one
    assert moved["compute_input_bytes_resident"] == sum(range(1, steps)) * width * 4
    assert moved["bytes_inline_out"] == steps * 4  # the scores; no present came back
    assert (stats.compute_outputs_in_place - in_place, stats.compute_outputs_copied - copied) == (steps, 0)
    if stats.fast_lane_calls:
        # kept: the first step's call (its empty past sent inline) and the second's; repeated: all the others
        assert (stats.calls_kept - calls_before, stats.kept_calls - kept_before) == (2, steps - 2)
    else:
        assert (stats.calls_kept - calls_before, stats.kept_calls - kept_before) == (0, 0)


def test_unbound_runs_bring_every_output_back(env):
    """The same loop through run(): every step sends its input and gets its output back (what binding saves)."""
    model = recurrent()
    x = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
    with InferenceSession(model, options_for(env, "ort"), env=env) as session:
        before = counters(env, "ort")
        for _ in range(3):
            (x,) = session.run(None, {"x": x})
        after = counters(env, "ort")
    assert after["compute_inputs_transferred"] - before["compute_inputs_transferred"] == 3
    assert after["bytes_inline_out"] - before["bytes_inline_out"] == 3 * x.nbytes


def test_run_with_ort_values_leaves_outputs_in_the_worker_and_run_takes_them_back(env):
    model = recurrent()
    x = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
    device = device_of(env, "ort")
    with InferenceSession(model, options_for(env, "ort"), env=env) as session:
        before = counters(env, "ort")
        (y,) = session.run_with_ort_values(["y"], {"x": ephost.Tensor.from_numpy(x)})
        assert isinstance(y, ephost.Tensor)
        assert y.memory_info == device.memory_info(DeviceMemoryType.HOST_ACCESSIBLE)
        (z,) = session.run(None, {"x": y})  # a worker's tensor fed as it is: named by its handle
        after = counters(env, "ort")
        np.testing.assert_allclose(y.numpy(), ort_loop(model, x, 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(z, ort_loop(model, x, 2), rtol=1e-5, atol=1e-6)
    assert after["bytes_inline_out"] - before["bytes_inline_out"] == z.nbytes  # run()'s output only
    assert after["compute_inputs_resident"] - before["compute_inputs_resident"] == 1


def test_outputs_bound_to_the_cpu_to_a_tensor_and_to_an_address(env):
    model = models.chain(["Relu", "Neg"], shape=(2, 3))
    x = np.random.default_rng(4).standard_normal((2, 3)).astype(np.float32)
    expected = -np.maximum(x, 0)
    with InferenceSession(model, options_for(env, "ref"), env=env) as session:
        binding = session.io_binding()
        binding.bind_input("x", "cpu", 0, np.float32, x.shape, x.ctypes.data)
        binding.bind_output("y")  # "cpu" by default: the output comes to the application
        session.run_with_iobinding(binding)
        np.testing.assert_array_equal(binding.get_outputs()[0].numpy(), expected)

        out = np.zeros_like(x)
        binding.bind_output("y", "cpu", 0, TensorProto.FLOAT, out.shape, out.ctypes.data)
        session.run_with_iobinding(binding)
        np.testing.assert_array_equal(out, expected)
        assert binding.get_outputs()[0].numpy().ctypes.data == out.ctypes.data

        target = ephost.Tensor.from_numpy(np.zeros_like(x))
        binding.bind_output("y", tensor=target)
        x[...] = 1.0  # bound inputs are read when the session runs, as ORT's are
        session.run_with_iobinding(binding)
        assert binding.get_outputs() == [target]
        np.testing.assert_array_equal(target.numpy(), np.full_like(x, -1.0))
        copies = binding.copy_outputs_to_cpu()
        assert copies[0].ctypes.data != target.numpy().ctypes.data


def test_an_output_bound_to_a_workers_default_memory_stays_there_and_feeds_back(env):
    model = models.chain(["Neg"], shape=(3,))
    device = device_of(env, "ref")
    default = device.memory_info(DeviceMemoryType.DEFAULT)
    x = np.array([1.0, -2.0, 3.0], np.float32)
    with InferenceSession(model, options_for(env, "ref"), env=env) as session:
        binding = session.io_binding()
        binding.bind_cpu_input("x", x)
        binding.bind_output("y", default)
        session.run_with_iobinding(binding)
        (y,) = binding.get_outputs()
        assert y.memory_info == default and y.local_bytes() is None  # the worker's own memory
        np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], -x)
        before = counters(env, "ref")
        binding.bind_ortvalue_input("x", y)
        session.run_with_iobinding(binding)
        after = counters(env, "ref")
        np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], x)
    assert after["compute_inputs_transferred"] == before["compute_inputs_transferred"]
    assert after["bytes_inline_in"] == before["bytes_inline_in"]


def test_an_output_made_by_the_fallback_is_moved_into_the_worker_it_is_bound_to(env):
    # Sigmoid is not among "ref"'s ops: the in-process fallback makes y, which is bound to the worker.
    model = models.chain(["Relu", "Sigmoid"], shape=(4,))
    device = device_of(env, "ref")
    x = np.array([-1.0, 0.0, 1.0, 2.0], np.float32)
    with InferenceSession(model, options_for(env, "ref"), env=env) as session:
        assert session.get_provider_graph_assignment_info()[-1].registration == "fallback"
        binding = session.io_binding()
        binding.bind_cpu_input("x", x)
        binding.bind_output("y", "ref")
        session.run_with_iobinding(binding)
        (y,) = binding.get_outputs()
        assert y.memory_info == device.memory_info(DeviceMemoryType.HOST_ACCESSIBLE)
        np.testing.assert_allclose(y.numpy(), 1 / (1 + np.exp(-np.maximum(x, 0))), rtol=1e-6)
        binding.clear_binding_outputs()
        with pytest.raises(ephost.EpInvalidArgument, match="no output is bound"):
            session.run_with_iobinding(binding)
        binding.bind_output("y")
        binding.clear_binding_inputs()
        with pytest.raises(ephost.EpInvalidArgument, match="missing input"):
            session.run_with_iobinding(binding)


def test_bad_bindings_are_refused_with_clear_errors(env):
    model = models.chain(["Neg"], shape=(3,))
    with InferenceSession(model, options_for(env, "ref"), env=env) as session, \
            InferenceSession(model, options_for(env, "ref"), env=env) as other:
        binding = session.io_binding()
        with pytest.raises(ephost.EpInvalidArgument, match="unknown device type 'cuda'"):
            binding.bind_output("y", "cuda")
        with pytest.raises(ephost.EpInvalidArgument, match="no address in this process"):
            binding.bind_input("x", "ref", 0, np.float32, [3], 4096)
        with pytest.raises(ephost.EpInvalidArgument, match="element_type and shape"):
            binding.bind_output("y", "cpu", 0, None, None, 4096)
        with pytest.raises(ephost.EpInvalidArgument, match="ephost.Tensor or a numpy array"):
            binding.bind_ortvalue_input("x", [1.0, 2.0, 3.0])
        binding.bind_cpu_input("x", np.ones(3, np.float32))
        binding.bind_output("z")
        with pytest.raises(ephost.EpInvalidArgument, match=r"unknown output name\(s\) \['z'\]"):
            session.run_with_iobinding(binding)
        with pytest.raises(ephost.EpInvalidArgument, match="belongs to another session"):
            other.run_with_iobinding(binding)
        binding.clear_binding_outputs()
        binding.bind_output("y", tensor=ephost.Tensor.from_numpy(np.zeros(4, np.float32)))
        with pytest.raises(ephost.EpInvalidArgument, match="float32\\[3\\].*float32\\[4\\]"):
            session.run_with_iobinding(binding)


def test_two_bound_tensors_in_the_worker_alternate_without_a_buffer_made_or_freed(env):
    """The decoding-loop pattern: outputs written into tensors bound in the worker, input and output swapped.
    On the fast lane every step after the first is a kept call: a frame naming the call and the two tensors, a
    reply of no bytes."""
    model = recurrent()
    x0 = np.random.default_rng(5).standard_normal((4, 256)).astype(np.float32)
    device = device_of(env, "ort")
    allocator = env.allocator_for(device.memory_info(DeviceMemoryType.HOST_ACCESSIBLE))
    a, b = ephost.Tensor.from_numpy(x0, allocator), ephost.Tensor.empty(x0.shape, x0.dtype, allocator)
    with InferenceSession(model, options_for(env, "ort"), env=env) as session:
        binding = session.io_binding()
        binding.bind_ortvalue_input("x", a)
        binding.bind_output("y", tensor=b)
        session.run_with_iobinding(binding)
        assert binding.get_outputs() == [b]
        first, calls = counters(env, "ort"), env.get_worker_stats("ort").methods
        calls_copied = env.get_worker_stats("ort").compute_outputs_copied
        calls_in_place = env.get_worker_stats("ort").compute_outputs_in_place
        kept_before = env.get_worker_stats("ort").kept_calls
        for _ in range(STEPS - 1):
            a, b = b, a
            binding.bind_ortvalue_input("x", a)
            binding.bind_output("y", tensor=b)
            session.run_with_iobinding(binding)
        after, calls_after = counters(env, "ort"), env.get_worker_stats("ort").methods
        np.testing.assert_allclose(b.numpy(), ort_loop(model, x0, STEPS), rtol=1e-5, atol=1e-6)
    assert after["compute_inputs_resident"] - first["compute_inputs_resident"] == STEPS - 1
    assert {c: after[c] - first[c] for c in COUNTERS if c != "compute_inputs_resident"
            and c != "compute_input_bytes_resident"} == dict.fromkeys(
        ["compute_inputs_transferred", "compute_input_bytes_transferred", "bytes_inline_in", "bytes_inline_out",
         "bytes_copied"], 0)
    # ONNX Runtime in the worker wrote each output straight into the bound tensor: no copy there either.
    placed = [env.get_worker_stats("ort").compute_outputs_copied - calls_copied,
              env.get_worker_stats("ort").compute_outputs_in_place - calls_in_place]
    assert placed == [0, STEPS - 1]
    lane = env.get_worker_stats("ort").fast_lane_calls > 0
    assert env.get_worker_stats("ort").kept_calls - kept_before == (STEPS - 1 if lane else 0)
    for method in ("Allocator/Alloc", "Allocator/Free", "DataTransfer/CopyTensors"):
        assert (calls_after[method].calls if method in calls_after else 0) == \
            (calls[method].calls if method in calls else 0), method


def test_an_output_is_not_written_into_a_worker_tensor_of_another_shape(env):
    device = device_of(env, "ref")
    allocator = env.allocator_for(device.memory_info(DeviceMemoryType.HOST_ACCESSIBLE))
    with InferenceSession(models.chain(["Neg"], shape=(3,)), options_for(env, "ref"), env=env) as session:
        binding = session.io_binding()
        binding.bind_cpu_input("x", np.ones(3, np.float32))
        binding.bind_output("y", tensor=ephost.Tensor.empty([4], np.float32, allocator))
        with pytest.raises(ephost.EpInvalidArgument, match=r"float32\[3\] cannot be written into a buffer of "
                                                           r"float32\[4\]"):
            session.run_with_iobinding(binding)


def test_an_output_asked_twice_comes_back_twice_and_stays_readable(env):
    model = recurrent()
    x = np.random.default_rng(6).standard_normal((4, 256)).astype(np.float32)
    with InferenceSession(model, options_for(env, "ort"), env=env) as session:
        y1, y2 = session.run_with_ort_values(["y", "y"], {"x": x})
        assert y1 is y2
        first, second = session.run(["y", "y"], {"x": x})
        np.testing.assert_array_equal(first, second)
        np.testing.assert_allclose(y1.numpy(), first, rtol=1e-6)


def test_without_shared_memory_a_bound_loop_moves_no_bytes_either():
    """A worker this process cannot share memory with (a remote one): the bound output stays in its DEFAULT
    memory and is neither read back nor sent again; copy_outputs_to_cpu fetches it at the end."""
    model = recurrent()
    x0 = np.random.default_rng(7).standard_normal((4, 256)).astype(np.float32)
    with ephost.Environment() as env:
        env.register_execution_provider_library("far", "onnxruntime", {"shared_memory": "false"})
        device = device_of(env, "far")
        assert device.memory_info(DeviceMemoryType.HOST_ACCESSIBLE) is None
        with InferenceSession(model, options_for(env, "far"), env=env) as session:
            binding = session.io_binding()
            binding.bind_cpu_input("x", x0)
            binding.bind_output("y", device)
            session.run_with_iobinding(binding)
            first, calls = counters(env, "far"), env.get_worker_stats("far").methods
            for _ in range(9):
                (y,) = binding.get_outputs()
                assert y.memory_info == device.memory_info(DeviceMemoryType.DEFAULT) and y.local_bytes() is None
                binding.bind_ortvalue_input("x", y)
                session.run_with_iobinding(binding)
            after, calls_after = counters(env, "far"), env.get_worker_stats("far").methods
            np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], ort_loop(model, x0, 10), rtol=1e-5, atol=1e-6)
    assert after["compute_inputs_resident"] - first["compute_inputs_resident"] == 9
    assert all(after[c] == first[c] for c in COUNTERS if "resident" not in c), (first, after)
    assert (calls_after["Allocator/Read"].calls if "Allocator/Read" in calls_after else 0) == \
        (calls["Allocator/Read"].calls if "Allocator/Read" in calls else 0)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_an_ep_that_makes_new_arrays_still_fills_an_output_bound_in_its_worker(transport):
    """The example EP returns new arrays whatever it is asked (`into` is a hint): an output bound to a tensor in
    its worker is copied there, run after run (on the fast lane, kept calls after the first)."""
    with ephost.Environment() as env:
        env.register_execution_provider_library("npu", "example", TRANSPORTS[transport])
        device = device_of(env, "npu")
        allocator = env.allocator_for(device.memory_info(DeviceMemoryType.HOST_ACCESSIBLE))
        out = ephost.Tensor.empty([3], np.float32, allocator)
        with InferenceSession(models.chain(["Relu", "Neg"], shape=(3,)), options_for(env, "npu"), env=env) as s:
            binding = s.io_binding()
            binding.bind_output("y", tensor=out)
            for k in range(4):
                x = np.array([-1, 2, -3], np.float32) * (k + 1)
                binding.bind_cpu_input("x", x)
                s.run_with_iobinding(binding)
                assert binding.get_outputs() == [out]
                np.testing.assert_array_equal(out.numpy(), -np.maximum(x, 0))
        stats = env.get_worker_stats("npu")
        assert stats.compute_outputs_copied == 4
        assert stats.kept_calls == (3 if transport == "fast_lane" else 0)


def test_a_view_of_an_output_an_ep_in_process_kept_keeps_it_alive():
    """An EP in this process (`inproc:`) leaves a decoding step's present, whose shape ORT learns as it runs, in
    its device's memory: a numpy view of that output keeps its memory, however the tensor and the binding go and
    whatever the allocator hands out after (as any view of a tensor does)."""
    from bench.data_plane import decoding_model
    with ephost.Environment() as environment:
        environment.register_execution_provider_library("ip", "inproc:onnxruntime", {})
        device = device_of(environment, "ip")
        with InferenceSession(decoding_model(4), options_for(environment, "ip"), env=environment) as session:
            binding = session.io_binding()
            binding.bind_cpu_input("past", np.ones((1, 2, 4), np.float32))
            binding.bind_cpu_input("row", np.full((1, 1, 4), 2, np.float32))
            binding.bind_output("present", device)
            binding.bind_output("score")
            session.run_with_iobinding(binding)
            present = binding.get_outputs()[0]
            assert present.buffer is not None, "the present was not left in the device's memory"
            view = present.numpy()
            del present, binding
            allocator = environment.allocator_for(device.memory_info(DeviceMemoryType.HOST_ACCESSIBLE))
            others = [ephost.Tensor.empty((1, 3, 4), np.float32, allocator) for _ in range(4)]
            for other in others:
                other.numpy()[:] = -1
            np.testing.assert_array_equal(view, [[[1] * 4, [1] * 4, [2] * 4]])
