"""A run's RunOptions as ONNX Runtime's: ORT's own object taken, its run config entries reaching ONNX Runtime in the
worker, the terminate flag stopping a run between partitions, and bad entries refused on both sides."""
import threading

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import ephost
from ephost import InferenceSession, RunOptions
from ephost.v1 import common_pb2, ep_pb2
from helpers import options_for, worker_stats
from test_bad_input import _compiled, desc, status_of

SHRINK = "memory.enable_memory_arena_shrinkage"


@pytest.fixture(scope="module")
def env():
    with ephost.Environment() as environment:
        environment.register_execution_provider_library("ort", "onnxruntime")
        environment.register_execution_provider_library("ort-grpc", "onnxruntime", {"fast_lane": "false"})
        environment.register_execution_provider_library("relu", "reference", {"ops": "Relu"})
        yield environment


def add_model():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    return helper.make_model(helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "g", [x], [y]),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def in_process_error(model, config=None, terminate=False) -> str:
    """What ONNX Runtime in this process says of a run with these run options."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    options = ort.RunOptions()
    options.terminate = terminate
    for key, value in (config or {}).items():
        options.add_run_config_entry(key, value)
    with pytest.raises(Exception) as info:
        session.run(None, {"x": np.ones((2, 3), np.float32)}, options)
    return str(info.value).split(" : ")[-1]


@pytest.mark.parametrize("registration", ["ort", "ort-grpc"])
@pytest.mark.parametrize("kind", [ort.RunOptions, RunOptions], ids=["onnxruntime.RunOptions", "ephost.RunOptions"])
def test_run_config_entries_reach_onnx_runtime_in_the_worker(env, registration, kind):
    model = add_model()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with InferenceSession(model, options_for(env, registration), env=env) as session:
        good = kind()
        good.add_run_config_entry(SHRINK, "cpu:0")
        np.testing.assert_array_equal(session.run(None, {"x": x}, good)[0], x + x)
        bad = kind()
        bad.add_run_config_entry(SHRINK, "bogus:9")  # ORT refuses the run: proof the entry got there
        with pytest.raises(ephost.EpInvalidArgument) as info:
            session.run(None, {"x": x}, bad)
        assert in_process_error(model, {SHRINK: "bogus:9"}) in str(info.value)
        binding = session.io_binding()  # an IOBinding's run takes them too
        binding.bind_cpu_input("x", x)
        binding.bind_output("y")
        with pytest.raises(ephost.EpInvalidArgument):
            session.run_with_iobinding(binding, bad)
        session.run_with_iobinding(binding, good)
        np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], x + x)
        good.add_run_config_entry(SHRINK, "bogus:9")  # a new value in an object a run had before is seen
        with pytest.raises(ephost.EpInvalidArgument):
            session.run(None, {"x": x}, good)
        for _ in range(3):  # and the runs without them, steady ones among them, are as before
            np.testing.assert_array_equal(session.run(None, {"x": x})[0], x + x)


@pytest.mark.parametrize("kind", [ort.RunOptions, RunOptions], ids=["onnxruntime.RunOptions", "ephost.RunOptions"])
def test_terminate_set_before_a_run_cancels_it_with_onnx_runtimes_words(env, kind):
    model = add_model()
    x = np.ones((2, 3), np.float32)
    options = kind()
    options.terminate = True
    with InferenceSession(model, options_for(env, "ort"), env=env) as session:
        with pytest.raises(ephost.EpCancelled) as info:
            session.run(None, {"x": x}, options)
        assert str(info.value) == in_process_error(model, terminate=True)
        options.terminate = False
        np.testing.assert_array_equal(session.run(None, {"x": x}, options)[0], x + x)


def slow_then_relu(n: int = 1200, steps: int = 48):
    """x @ W, `steps` times over (a second or more of ONNX Runtime's time), then a Relu: two partitions where the Relu
    goes to the reference worker."""
    w = np.linalg.qr(np.random.default_rng(0).standard_normal((n, n)))[0].astype(np.float32)  # keeps norms
    names = ["x"] + [f"m{i}" for i in range(steps)]
    nodes = [helper.make_node("MatMul", [names[i], "W"], [names[i + 1]]) for i in range(steps)]
    nodes.append(helper.make_node("Relu", [names[-1]], ["y"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, n])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, n])
    graph = helper.make_graph(nodes, "g", [x], [y], [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), w


class WatchedRunOptions(RunOptions):
    """RunOptions that count how often a run reads the terminate flag (before each partition). At the first read
    the run goes on only once another thread has set the flag (`set_meanwhile`): it read the flag down, and the
    flag is up while its first partition runs."""

    def __init__(self):
        super().__init__()
        self.reads = 0
        self._read, self._set = threading.Event(), threading.Event()

    @property
    def terminated(self) -> bool:
        value = super().terminated
        self.reads += 1
        if self.reads == 1:
            self._read.set()
            assert self._set.wait(60)
        return value

    def set_meanwhile(self) -> None:
        """Set the flag once the run has read it the first time."""
        assert self._read.wait(60), "the run reads the flag before its first partition"
        self.terminate = True
        self._set.set()


def test_terminate_set_from_another_thread_stops_the_run_before_its_next_partition(env):
    model, w = slow_then_relu()
    x = np.random.default_rng(1).standard_normal(w.shape).astype(np.float32)
    with InferenceSession(model, options_for(env, "relu", "ort"), env=env) as session:
        eps = [s.ep_name for s in session.get_provider_graph_assignment_info()]
        assert eps == ["CPUExecutionProvider", "reference"]
        options = WatchedRunOptions()
        outcome = []

        def run():
            try:
                outcome.append(session.run(None, {"x": x}, options))
            except ephost.EpError as e:
                outcome.append(e)

        def relu_inputs():
            stats = worker_stats(env, "relu")
            return stats.compute_inputs_resident + stats.compute_inputs_transferred

        before = relu_inputs()
        thread = threading.Thread(target=run)
        thread.start()
        options.set_meanwhile()
        thread.join(120)
        assert isinstance(outcome[0], ephost.EpCancelled), outcome
        assert options.reads == 2, "the run read the flag again before its second partition, and stopped there"
        assert relu_inputs() == before  # the Relu's partition never ran
        options.terminate = False
        (y,) = session.run(None, {"x": x}, options)
        want = x
        for _ in range(48):
            want = want @ w
        np.testing.assert_allclose(y, np.maximum(want, 0), rtol=1e-3, atol=1e-3)


def test_a_deadline_given_in_onnx_runtimes_run_options(env):
    with ephost.Environment() as own:
        own.register_execution_provider_library("hang", "chaos", {"fault": "hang", "after": "2"})
        x = np.ones((2, 3), np.float32)
        with InferenceSession(add_model(), options_for(own, "hang"), env=own) as session:
            session.run(None, {"x": x})
            options = ort.RunOptions()
            options.add_run_config_entry("ephost.compute_timeout_s", "0.5")
            with pytest.raises(ephost.EpDeadlineExceeded, match="deadline of 0.5 s"):  # (the run's, not the link's)
                session.run(None, {"x": x}, options)
            options.add_run_config_entry("ephost.compute_timeout_s", "soon")
            with pytest.raises(ephost.EpInvalidArgument, match="compute_timeout_s"):
                session.run(None, {"x": x}, options)


def test_bad_run_options_are_refused_by_the_application(env):
    options = RunOptions()
    for key, value in (("", "1"), ("k" * 129, "1"), ("key", "v" * 1025), ("key", 1)):
        with pytest.raises(ephost.EpInvalidArgument):
            options.add_run_config_entry(key, value)
    with pytest.raises(ephost.EpNotFound, match="does not have configuration with key: nope"):
        options.get_run_config_entry("nope")
    with InferenceSession(add_model(), options_for(env, "ort"), env=env) as session:
        with pytest.raises(ephost.EpInvalidArgument, match="log_severity_level"):
            session.run(None, {"x": np.ones((2, 3), np.float32)}, RunOptions(log_severity_level=9))
        with pytest.raises(ephost.EpInvalidArgument, match="not dict"):
            session.run(None, {"x": np.ones((2, 3), np.float32)}, {"terminate": True})


@pytest.mark.parametrize("options, words", [
    (ep_pb2.RunOptions(config={"k" * 129: "1"}), "run config key"),
    (ep_pb2.RunOptions(config={"key": "v" * 1025}), "over 1024"),
    (ep_pb2.RunOptions(config={f"k{i}": "1" for i in range(65)}), "at most 64"),
    (ep_pb2.RunOptions(log_severity_level=7), "log_severity_level"),
    (ep_pb2.RunOptions(log_verbosity_level=-2), "log_verbosity_level"),
], ids=["long key", "long value", "many entries", "severity", "verbosity"])
def test_bad_run_options_on_the_wire_are_an_invalid_argument(raw, options, words):
    _, (info, _) = _compiled(raw)
    x = common_pb2.Value(tensor=common_pb2.TensorRef(desc=desc(4), inline=b"\0" * 16))
    request = ep_pb2.ComputeRequest(node_compute_info=info, inputs=[x], run_options=options)
    code, message = status_of(lambda: raw(raw.ep.Compute, request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and words in message
    request.ClearField("run_options")
    assert len(raw(raw.ep.Compute, request).outputs) == 1  # and it serves the same call without them


@pytest.mark.parametrize("kind", [ort.RunOptions, RunOptions], ids=["onnxruntime.RunOptions", "ephost.RunOptions"])
def test_a_loop_that_passes_the_same_plain_run_options_to_every_run_repeats_a_kept_call(env, kind):
    """ORT-style code passes one RunOptions to every run: with nothing in it for the EPs and no deadline of its
    own its runs repeat the partition's kept call, as runs without it do, and still read the terminate flag."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    options = kind()

    def repeats() -> int:
        return env.get_worker_stats("ort").kept_calls

    with InferenceSession(add_model(), options_for(env, "ort"), env=env) as session:
        before = repeats()
        for _ in range(5):
            np.testing.assert_array_equal(session.run(None, {"x": x}, options)[0], x + x)
        assert repeats() - before == 4  # the first run keeps the call, the others repeat it
        options.terminate = True
        with pytest.raises(ephost.EpCancelled):
            session.run(None, {"x": x}, options)
        options.terminate = False
        binding = session.io_binding()
        binding.bind_cpu_input("x", x)
        binding.bind_output("y")
        before = repeats()
        for _ in range(5):
            session.run_with_iobinding(binding, options)
            np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], x + x)
        assert repeats() - before == 5  # the same call as the plain runs'
        options.terminate = True
        with pytest.raises(ephost.EpCancelled):
            session.run_with_iobinding(binding, options)
