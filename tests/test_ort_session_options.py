"""SessionOptions as ONNX Runtime's: every attribute honoured or refused (never set and ignored), ORT's settings
reaching ORT in a worker, what the options change in the model, the model's own options, the optimized model."""
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import ephost
from ephost import InferenceSession, SessionOptions
import models
from helpers import Worker


@pytest.fixture(scope="module")
def ort_env():
    with ephost.Environment() as environment:
        environment.register_execution_provider_library("ort", "onnxruntime")
        yield environment


MUL = models.model([helper.make_node("Mul", ["X", "W"], ["Y"])], [models.tensor("X", [3, 2])],
                   [models.tensor("Y", [3, 2])], [numpy_helper.from_array(np.arange(1, 7, dtype=np.float32)
                                                                          .reshape(3, 2), "W")])


def test_an_unknown_option_is_refused_naming_it():
    so = SessionOptions()
    with pytest.raises(ephost.EpUnknownOption, match="no option 'intra_op_num_thread'") as caught:
        so.intra_op_num_thread = 2  # a typo: ORT's is intra_op_num_threads
    assert isinstance(caught.value, AttributeError)  # as ORT's SessionOptions raises
    assert not hasattr(so, "intra_op_num_thread")


@pytest.mark.parametrize("act, name", [
    (lambda so: setattr(so, "use_per_session_threads", False), "use_per_session_threads"),
    (lambda so: so.register_custom_ops_library("/lib/libcustom.so"), "register_custom_ops_library"),
    (lambda so: so.set_load_cancellation_flag(True), "set_load_cancellation_flag"),
    (lambda so: so.set_ep_context_data_read_func(print), "set_ep_context_data_read_func"),
])
def test_options_ephost_cannot_honour_are_refused_naming_them(act, name):
    with pytest.raises(ephost.EpUnimplemented, match=name):
        act(SessionOptions())


def test_ort_settings_read_as_ort_enums_and_check_their_values():
    so = SessionOptions()
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert so.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert (so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level) == (0, 0, -1)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    assert so.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    for name, bad in (("intra_op_num_threads", -1), ("graph_optimization_level", 7), ("log_severity_level", 9)):
        with pytest.raises(ephost.EpInvalidArgument):
            setattr(so, name, bad)
    with pytest.raises(RuntimeError, match="does not have configuration with key: nothing"):
        so.get_session_config_entry("nothing")


def test_settings_reach_onnx_runtime_in_the_worker(tmp_path):
    # ORT logs each session's options at verbose level: the worker's log shows what its ORT was given.
    worker = Worker("--ep", "onnxruntime")
    try:
        with ephost.Environment() as env:
            env.register_execution_provider_library("w", worker.address)
            so = SessionOptions()
            so.intra_op_num_threads, so.inter_op_num_threads = 3, 2
            so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            so.log_severity_level, so.logid = 0, "ortapi-settings"
            so.add_session_config_entry("session.disable_prepacking", "1")
            with InferenceSession(MUL, so, env=env, providers=["w"]) as session:
                np.testing.assert_array_equal(session.run(None, {"X": np.ones((3, 2), np.float32)})[0],
                                              np.arange(1, 7).reshape(3, 2))
        with open(worker.log_path) as f:
            traced = [line for line in f if "TraceSessionOptions" in line and "session_logid:ortapi-settings" in line]
    finally:
        worker.stop()
    assert traced, "the worker's ORT never made a session with the session's logid"
    line = traced[-1]
    assert "execution_mode:1" in line and "graph_optimization_level:1" in line
    assert "intra_op_param:OrtThreadPoolParams { thread_pool_size: 3" in line
    assert "inter_op_param:OrtThreadPoolParams { thread_pool_size: 2" in line
    assert "session.disable_prepacking: 1" in line


def test_free_dimensions_are_fixed_by_name_and_by_denotation(ort_env):
    x = models.tensor("x", ["Dim1", "Dim2", 5])
    y = models.tensor("y", ["Dim1", "Dim2", 5])
    for v in (x, y):
        v.type.tensor_type.shape.dim[0].denotation = "DATA_BATCH"
        v.type.tensor_type.shape.dim[1].denotation = "DATA_CHANNEL"
    model = models.model([helper.make_node("Abs", ["x"], ["y"])], [x], [y])
    so = SessionOptions()
    so.add_free_dimension_override_by_denotation("DATA_BATCH", 3)
    so.add_free_dimension_override_by_name("Dim2", 4)
    with InferenceSession(model, so, env=ort_env, providers=["ort"]) as session:
        assert session.get_inputs()[0].shape == [3, 4, 5] and session.get_outputs()[0].shape == [3, 4, 5]
        assert session.run(None, {"x": -np.ones((3, 4, 5), np.float32)})[0].min() == 1
        with pytest.raises(ephost.EpInvalidArgument, match="expects 3 along axis 0"):
            session.run(None, {"x": np.ones((2, 4, 5), np.float32)})  # the dimension is fixed now


def test_add_initializer_replaces_the_models_value(ort_env):
    so = SessionOptions()
    so.add_initializer("W", ort.OrtValue.ortvalue_from_numpy(np.full((3, 2), 2.0, np.float32)))
    with InferenceSession(MUL, so, env=ort_env, providers=["ort"]) as session:
        np.testing.assert_array_equal(session.run(None, {"X": np.ones((3, 2), np.float32)})[0], np.full((3, 2), 2.0))
    bad = SessionOptions()
    bad.add_initializer("W", np.ones((2, 2), np.float32))
    with pytest.raises(ephost.EpInvalidArgument, match=r"add_initializer\('W'\).*\[3, 2\]"):
        InferenceSession(MUL, bad, env=ort_env, providers=["ort"])


def _pads_model(tmp_path):
    """Pad's pads in an external file nobody has on disk (ORT's model_with_external_initializer_come_from_user)."""
    pads = TensorProto(name="Pads_not_on_disk", data_type=TensorProto.INT64, dims=[4],
                       data_location=TensorProto.EXTERNAL)
    entry = pads.external_data.add()
    entry.key, entry.value = "location", "Pads_not_on_disk.bin"
    model = models.model([helper.make_node("Pad", ["X", "Pads_not_on_disk"], ["Y"], mode="constant")],
                         [models.tensor("X", [1, 2]), models.tensor("Pads_not_on_disk", [4], TensorProto.INT64)],
                         [models.tensor("Y", [2, 3])], [pads])
    path = str(tmp_path / "pads.onnx")
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("given", ["values", "files"])
def test_external_initializers_given_in_memory_stand_for_files_not_on_disk(ort_env, tmp_path, given):
    path = _pads_model(tmp_path)
    pads = np.array([0, 0, 1, 1], np.int64)
    so = SessionOptions()
    if given == "values":
        so.add_external_initializers(["Pads_not_on_disk"], [ort.OrtValue.ortvalue_from_numpy(pads)])
    else:
        so.add_external_initializers_from_files_in_memory(["Pads_not_on_disk.bin"], [pads.tobytes()], [32])
    with InferenceSession(path, so, env=ort_env, providers=["ort"]) as session:
        np.testing.assert_array_equal(session.run(None, {"X": np.array([[1.0, 2.0]], np.float32)})[0],
                                      [[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    with pytest.raises(ephost.EpNoSuchFile, match="Pads_not_on_disk.bin"):
        InferenceSession(path, SessionOptions(), env=ort_env, providers=["ort"])


def test_the_models_own_options_apply_where_ort_load_config_from_model_asks(ort_env, monkeypatch, tmp_path):
    model = onnx.ModelProto()
    model.CopyFrom(MUL)
    helper.set_model_props(model, {"ort_config": json.dumps({"session_options": {
        "inter_op_num_threads": 5, "intra_op_num_threads": 2, "graph_optimization_level": 1, "enable_profiling": 1}})})
    given = SessionOptions()
    given.profile_file_prefix = str(tmp_path / "prof")
    with InferenceSession(model, given, env=ort_env, providers=["ort"]) as session:
        assert session.get_session_options().intra_op_num_threads == 0  # not asked for: the model's are not read
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    with InferenceSession(model, given, env=ort_env, providers=["ort"]) as session:
        options = session.get_session_options()
        assert (options.inter_op_num_threads, options.intra_op_num_threads) == (5, 2)
        assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        assert options.enable_profiling and options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
        os.remove(session.end_profiling())
    assert given.intra_op_num_threads == 0 and not given.enable_profiling  # the caller's options are not changed


def test_ephosts_own_ort_sessions_take_the_models_options_from_ephost_only(ort_env, monkeypatch, tmp_path):
    # ORT_LOAD_CONFIG_FROM_MODEL=1 would have ORT read the model's options again in place of those ephost gives
    # its own ORT sessions (the CPU fallback's here, in this process), and lose what ephost asks of them
    model = onnx.ModelProto()
    model.CopyFrom(MUL)
    helper.set_model_props(model, {"ort_config": json.dumps({"session_options": {"intra_op_num_threads": 2}})})
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    with InferenceSession(model, env=ort_env, providers=["CPUExecutionProvider"]) as session:
        assert session.registrations == ("fallback",)
        assert session.get_session_options().intra_op_num_threads == 2
        x = np.ones((3, 2), np.float32)
        np.testing.assert_array_equal(session.run(None, {"X": x})[0], np.arange(1, 7, dtype=np.float32).reshape(3, 2))


def test_the_optimized_model_is_written_as_onnx_runtime_writes_it(ort_env, tmp_path):
    # Conv then Add of a constant: ORT's optimizations fold the Add into the Conv's bias.
    w = numpy_helper.from_array(np.ones((2, 1, 1, 1), np.float32), "w")
    b = numpy_helper.from_array(np.full((1, 2, 1, 1), 0.5, np.float32), "b")
    model = models.model([helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Add", ["c", "b"], ["y"])],
                         [models.tensor("x", [1, 1, 4, 4])], [models.tensor("y", [1, 2, 4, 4])], [w, b])
    so = SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED  # (ALL adds layout nodes)
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "opt.bin")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1")
    with InferenceSession(model, so, env=ort_env, providers=["ort"]) as session:
        expected = session.run(None, {"x": np.ones((1, 1, 4, 4), np.float32)})[0]
    written = onnx.load(so.optimized_model_filepath, load_external_data=False)
    assert [n.op_type for n in written.graph.node] == ["Conv"]  # the Add folded in, by ORT
    assert os.path.isfile(tmp_path / "opt.bin")
    again = ort.InferenceSession(so.optimized_model_filepath, providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(again.run(None, {"x": np.ones((1, 1, 4, 4), np.float32)})[0], expected)


def test_the_optimized_model_is_refused_where_onnx_runtime_does_not_run_it_all(tmp_path):
    with ephost.Environment() as env:
        env.register_execution_provider_library("ref", "inproc:reference")
        so = SessionOptions()
        so.optimized_model_filepath = str(tmp_path / "opt.onnx")
        with pytest.raises(ephost.EpUnimplemented, match="optimized_model_filepath.*reference"):
            InferenceSession(MUL, so, env=env, providers=["ref"])
    assert not os.path.exists(so.optimized_model_filepath)
