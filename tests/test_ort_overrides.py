"""Initializers a model also lists as graph inputs, as ONNX Runtime treats them: defaults, not constants (a model
keeping one in an external file opens), overridden by a run that feeds them, LoRA adapters' parameters so too."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import ephost
from ephost import InferenceSession, RunOptions, SessionOptions
import models


@pytest.fixture(scope="module")
def ort_env():
    with ephost.Environment() as environment:
        environment.register_execution_provider_library("ort", "onnxruntime")
        yield environment


def _reshape_model(tmp_path) -> str:
    """y = Reshape(x, shape): `shape` an initializer in an external file, and a graph input (a default)."""
    model = models.model([helper.make_node("Reshape", ["x", "shape"], ["y"])],
                         [models.tensor("x", [2, 3]), models.tensor("shape", [2], TensorProto.INT64)],
                         [models.tensor("y", None)], [numpy_helper.from_array(np.array([3, 2], np.int64), "shape")])
    path = str(tmp_path / "reshape.onnx")
    onnx.save(model, path, save_as_external_data=True, location="reshape.bin", size_threshold=0)
    return path


@pytest.mark.parametrize("providers", [["ort"], []], ids=["ort worker", "fallback"])
def test_an_external_initializer_that_is_a_graph_input_opens_on_onnx_runtime(ort_env, tmp_path, providers):
    # Its partition keeps it a graph input: ORT does not read it as a constant (which, external, it cannot)
    with InferenceSession(_reshape_model(tmp_path), env=ort_env, providers=providers) as session:
        assert {s.ep_name for s in session.get_provider_graph_assignment_info()} == {"CPUExecutionProvider"}
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        assert session.run(None, {"x": x})[0].shape == (3, 2)


def test_a_run_that_feeds_a_default_overrides_it_and_the_next_runs_keep_the_default(ort_env, tmp_path):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with InferenceSession(_reshape_model(tmp_path), env=ort_env, providers=["ort"]) as session:
        assert session.run(None, {"x": x})[0].shape == (3, 2)
        assert session.run(None, {"x": x, "shape": np.array([1, 6], np.int64)})[0].shape == (1, 6)
        assert session.run(None, {"x": x, "shape": np.array([6, 1], np.int64)})[0].shape == (6, 1)
        assert session.run(None, {"x": x})[0].shape == (3, 2)
        with pytest.raises(ephost.EpInvalidArgument, match="expects tensor\\(int64\\)"):
            session.run(None, {"x": x, "shape": np.array([1, 6], np.int32)})  # checked as any input


def _lora_model():
    """ORT's testdata/lora/two_params_lora_model: output = x @ w + (x @ a) @ b, a and b empty by default."""
    return models.model(
        [helper.make_node("MatMul", ["input_x", "weight_x"], ["mm_x"]),
         helper.make_node("MatMul", ["input_x", "lora_param_a"], ["mm_a"]),
         helper.make_node("MatMul", ["mm_a", "lora_param_b"], ["mm_b"]),
         helper.make_node("Add", ["mm_x", "mm_b"], ["output"])],
        [models.tensor("input_x", [4, 4]), models.tensor("lora_param_a", [4, "dim"]),
         models.tensor("lora_param_b", ["dim", 4])],
        [models.tensor("output", [4, 4])],
        [numpy_helper.from_array(np.arange(1, 17, dtype=np.float32).reshape(4, 4), "weight_x"),
         helper.make_tensor("lora_param_a", TensorProto.FLOAT, [4, 0], []),
         helper.make_tensor("lora_param_b", TensorProto.FLOAT, [0, 4], [])])


A = np.array([3, 4, 5, 6], np.float32).reshape(4, 1)
B = np.array([7, 8, 9, 10], np.float32).reshape(1, 4)


def _adapter_file(tmp_path) -> str:
    adapter = ort.AdapterFormat()
    adapter.set_adapter_version(1)
    adapter.set_model_version(1)
    adapter.set_parameters({"lora_param_a": ort.OrtValue.ortvalue_from_numpy(A),
                            "lora_param_b": ort.OrtValue.ortvalue_from_numpy(B)})
    path = str(tmp_path / "lora.onnx_adapter")
    adapter.export_adapter(path)
    return path


@pytest.mark.parametrize("kind", ["LoraAdapter", "path", "dict"])
def test_an_active_lora_adapter_feeds_its_parameters_as_ort_does(ort_env, tmp_path, kind):
    path = _adapter_file(tmp_path)
    if kind == "LoraAdapter":
        adapter = ort.LoraAdapter()
        adapter.Load(path)
    else:
        adapter = path if kind == "path" else {"lora_param_a": A, "lora_param_b": B}
    x = np.ones((4, 4), np.float32)
    base = x @ np.arange(1, 17, dtype=np.float32).reshape(4, 4)
    with InferenceSession(_lora_model(), env=ort_env, providers=["ort"]) as session:
        run_options = RunOptions()
        run_options.add_active_adapter(adapter)
        np.testing.assert_array_equal(session.run(None, {"input_x": x}, run_options)[0], base + (x @ A) @ B)
        np.testing.assert_array_equal(session.run(None, {"input_x": x}, RunOptions())[0], base)
    assert (base + (x @ A) @ B)[0].tolist() == [154.0, 176.0, 198.0, 220.0]  # ORT's test expects these


def test_an_adapter_for_another_model_is_refused_naming_its_parameters(ort_env):
    with InferenceSession(_lora_model(), env=ort_env, providers=["ort"]) as session:
        run_options = RunOptions()
        run_options.add_active_adapter({"not_here": A})
        with pytest.raises(ephost.EpInvalidArgument, match="not_here"):
            session.run(None, {"input_x": np.ones((4, 4), np.float32)}, run_options)


def test_settings_and_session_options_apply_to_the_variant_too(ort_env, tmp_path):
    so = SessionOptions()
    so.add_initializer("weight_x", np.eye(4, dtype=np.float32))  # (the variant reads the same options)
    with InferenceSession(_lora_model(), so, env=ort_env, providers=["ort"]) as session:
        run_options = RunOptions()
        run_options.add_active_adapter({"lora_param_a": A, "lora_param_b": B})
        x = np.ones((4, 4), np.float32)
        np.testing.assert_array_equal(session.run(None, {"input_x": x}, run_options)[0], x + (x @ A) @ B)
