"""The rest of ORT's InferenceSession: profiling as Chrome trace JSON, run_async, set_providers, optional inputs."""
import json
import threading
import time

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import ephost
from ephost import DeviceMemoryType, InferenceSession
import models
from helpers import device_of, options_for


@pytest.fixture(scope="module")
def env():
    with ephost.Environment() as environment:
        environment.register_execution_provider_library("ref", "reference", {"ops": "Relu,Neg"})
        yield environment


def test_profiling_writes_a_chrome_trace_of_partitions_calls_and_copies(env, tmp_path):
    model = models.chain(["Sigmoid", "Relu", "Neg"], shape=(3,))  # the fallback, then ref
    options = options_for(env, "ref")
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "trace")
    allocator = env.create_shared_allocator(device_of(env, "ref"), DeviceMemoryType.DEFAULT)
    try:
        with InferenceSession(model, options, env=env) as session:
            start = session.get_profiling_start_time_ns()
            assert 0 < start <= time.monotonic_ns()
            x = np.array([-1.0, 0.5, 2.0], np.float32)
            session.run(None, {"x": x})
            session.run(None, {"x": ephost.Tensor.from_numpy(x, allocator)})  # not readable by the fallback
            path = session.end_profiling()
            assert session.end_profiling() == ""
    finally:
        env.release_shared_allocator(device_of(env, "ref"), DeviceMemoryType.DEFAULT)
    assert path.startswith(str(tmp_path / "trace")) and path.endswith(".json")
    with open(path) as f:
        events = json.load(f)
    assert all(e["ph"] == "X" and e["ts"] >= 0 and e["dur"] >= 0 and {"pid", "tid", "cat", "name", "args"} <= set(e)
               for e in events)
    names = [(e["cat"], e["name"]) for e in events]
    assert names.count(("Session", "model_run")) == 2 and ("Session", "session_initialization") in names
    nodes = [e["args"] for e in events if e["cat"] == "Node"]
    assert [(a["registration"], a["call"]) for a in nodes] == [
        ("fallback", "in process"), ("ref", "Compute")] * 2
    assert {a["ep"] for a in nodes} == {"reference", "CPUExecutionProvider"}
    copies = [e for e in events if e["cat"] == "Copy"]
    assert len(copies) == 1 and copies[0]["args"]["bytes"] == 12 and copies[0]["args"]["src"] == "ref:reference"


def test_the_profile_is_a_json_array_with_one_event_per_line_as_ort_writes_it(env, tmp_path):
    options = options_for(env, "ref")
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "lines")
    with InferenceSession(models.chain(["Sigmoid", "Relu"], shape=(3,)), options, env=env) as session:
        session.run(None, {"x": np.ones(3, np.float32)})
        path = session.end_profiling()
    with open(path) as f:
        lines = f.read().splitlines()
    assert lines[0] == "[" and lines[-1] == "]" and len(lines) >= 5
    events = [json.loads(line.rstrip(",")) for line in lines[1:-1]]  # each line one event, tools read them so
    assert all(line.endswith(",") for line in lines[1:-2]) and not lines[-2].endswith(",")
    assert [e["name"] for e in events if e["cat"] == "Session"] == ["session_initialization", "model_run"]
    with open(path) as f:
        assert json.load(f) == events


def test_profiling_is_off_by_default(env):
    with InferenceSession(models.chain(["Relu"]), options_for(env, "ref"), env=env) as session:
        assert session.get_profiling_start_time_ns() == 0
        session.run(None, {"x": np.ones(4, np.float32)})
        assert session.end_profiling() == ""


def test_run_async_calls_back_with_results_user_data_and_an_error_string(env):
    calls, done = [], threading.Event()

    def callback(results, user_data, err):
        calls.append((results, user_data, err, threading.current_thread() is threading.main_thread()))
        if len(calls) == 2:
            done.set()

    with InferenceSession(models.chain(["Relu", "Neg"], shape=(2,)), options_for(env, "ref"), env=env) as session:
        session.run_async(None, {"x": np.array([-1.0, 3.0], np.float32)}, callback, {"id": 1})
        session.run_async(None, {"x": np.zeros(5, np.float32)}, callback, "second")
        assert done.wait(30)
    (results, data, err, on_main), (bad, data2, err2, _) = calls
    np.testing.assert_array_equal(results[0], [-0.0, -3.0])
    assert data == {"id": 1} and err == "" and not on_main
    assert bad is None and data2 == "second" and "EpInvalidArgument" in err2 and "expects 2 along axis 0" in err2


def test_set_providers_partitions_and_compiles_again(env):
    model = models.chain(["Relu", "Neg"], shape=(2,))
    x = np.array([-1.0, 3.0], np.float32)
    with InferenceSession(model, env=env, providers=["ref"]) as session:
        assert {s.registration for s in session.get_provider_graph_assignment_info()} == {"ref"}
        session.set_providers(["CPUExecutionProvider"])
        assert {s.registration for s in session.get_provider_graph_assignment_info()} == {"fallback"}
        assert session.get_providers() == ["CPUExecutionProvider"]  # the reference evaluator runs nothing
        np.testing.assert_array_equal(session.run(None, {"x": x})[0], [-0.0, -3.0])
        session.set_providers(["ref"], [{}])
        assert {s.registration for s in session.get_provider_graph_assignment_info()} == {"ref"}
        np.testing.assert_array_equal(session.run(None, {"x": x})[0], [-0.0, -3.0])
        with pytest.raises(ephost.EpInvalidArgument, match="should be the same length"):
            session.set_providers(["ref"], [{}, {}])


def test_set_providers_lets_go_of_a_worker_the_session_launched(env):
    with InferenceSession(models.chain(["Relu"]), env=env, providers=["reference"]) as session:
        assert env.is_registered("reference")
        session.set_providers(["CPUExecutionProvider"])
        assert not env.is_registered("reference")
        np.testing.assert_array_equal(session.run(None, {"x": np.array([-1, 0, 1, 2], np.float32)})[0], [0, 0, 1, 2])


def test_an_optional_input_left_out_is_an_empty_optional_as_in_onnx_runtime(env):
    optional = helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [2]))
    model = models.model([helper.make_node("OptionalHasElement", ["o"], ["h"])],
                         [helper.make_value_info("o", optional)], [models.tensor("h", [], TensorProto.BOOL)])
    with InferenceSession(model, env=env) as session:
        assert session.run(None, {})[0] == np.array(False)
        assert session.run(None, {"o": None})[0] == np.array(False)
        assert session.run(None, {"o": np.ones(2, np.float32)})[0] == np.array(True)


def test_outputs_a_worker_sends_back_are_writable_views_of_their_one_copy_as_in_onnx_runtime(env):
    # ORT's own test (test_run_session_owned_output_is_zero_copy) asks that an output have a backing object:
    # here the reply's copy, on the first run (its reply over gRPC) as on the later ones (over the fast lane)
    with InferenceSession(models.chain(["Relu"], shape=(3,)), env=env, providers=["ref"]) as session:
        assert session.registrations == ("ref",)
        x = np.array([-1.0, 0.5, 2.0], np.float32)
        outputs = [session.run(None, {"x": x})[0] for _ in range(3)]
    for y in outputs:
        assert y.base is not None and y.flags.writeable
        y += 1  # the caller's own
    np.testing.assert_array_equal(outputs[0], [1.0, 1.5, 3.0])
    assert not np.shares_memory(outputs[0], outputs[1])


def test_providers_is_the_third_argument_as_in_onnx_runtime(env):
    with InferenceSession(models.chain(["Relu"], shape=(3,)), None, ["ref"], env=env) as session:
        assert session.registrations == ("ref",)
    with pytest.raises(TypeError):
        InferenceSession(models.chain(["Relu"], shape=(3,)), None, ["ref"], None, env)  # env is by keyword only


def test_onnx_runtimes_logger_in_this_process_stays_as_the_application_set_it(env):
    records = []
    ort.set_default_logger_callback(lambda *record: records.append(record), severity=0)
    try:
        with InferenceSession(models.chain(["Relu"], shape=(3,)), providers=["CPUExecutionProvider"],
                              env=env) as session:
            assert session.registrations == ("fallback",)  # ORT's CPU EP in this process
            session.run(None, {"x": np.array([-1.0, 0.5, 2.0], np.float32)})
    finally:
        ort.set_default_logger_callback(None)
        ort.set_default_logger_severity(2)
    assert any(severity == 0 for severity, *_ in records)  # ORT's verbose records of the fallback's session
