"""Compiled models through the bridge: ORT's compile API (and a session with ep.context_enable=1) gets each bridged
partition back as an EPContext node carrying the worker EP's compiled form, with the bridge's compatibility string
in the model's metadata; a session on that model restores the partitions in the worker instead of compiling them,
and ORT's compatibility check answers from the worker's EP and versions."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import (OrtCompiledModelCompatibility,
                                                         get_model_compatibility_for_ep_devices)

import ephost.ort
import models


@pytest.fixture(scope="module")
def npu():
    ephost.ort.register("ctxnpu", "onnxruntime")
    yield "ctxnpu"
    ephost.ort.unregister("ctxnpu")


def devices(name: str) -> list:
    return [d for d in ort.get_ep_devices() if d.ep_name == name]


def options_for(name: str) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.add_provider_for_devices(devices(name), {})
    return options


def worker_stats(name: str):
    return ephost.ort.environment(name).get_worker_stats(name)


@pytest.mark.parametrize("embed", [True, False], ids=["embedded", "beside the model"])
def test_the_compile_api_gets_epcontext_nodes_and_a_session_restores_them(npu, tmp_path, embed):
    source = tmp_path / "m.onnx"
    onnx.save(models.diamond(), str(source))
    compiled = tmp_path / "m_ctx.onnx"
    ort.ModelCompiler(options_for(npu), str(source), embed_compiled_data_into_model=embed).compile_to_file(
        str(compiled))
    model = onnx.load(str(compiled))
    (node,) = model.graph.node
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert (node.op_type, node.domain, attributes["source"], attributes["embed_mode"]) == \
        ("EPContext", "com.microsoft", b"CPUExecutionProvider", 1 if embed else 0)
    beside = sorted(p.name for p in tmp_path.glob("*.bin"))
    assert beside == ([] if embed else [attributes["ep_cache_context"].decode()])
    info = {p.key: p.value for p in model.metadata_props}[f"ep_compatibility_info.{npu}"]
    assert info == f"ephost.ort;ep=CPUExecutionProvider;version={ort.__version__};onnxruntime={ort.__version__}"

    before = worker_stats(npu)
    session = ort.InferenceSession(str(compiled), options_for(npu))
    session.disable_fallback()
    x = np.random.default_rng(3).standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
    after = worker_stats(npu)
    assert (after.partitions_restored - before.partitions_restored,
            after.partitions_compiled - before.partitions_compiled) == (1, 0), "restored, not compiled"
    del session


def test_a_session_asked_for_a_context_model_writes_one(npu, tmp_path):
    """ORT's session config entries, as the compile API sets them, on a plain session."""
    source = tmp_path / "m.onnx"
    onnx.save(models.diamond(), str(source))
    options = options_for(npu)
    for key, value in (("ep.context_enable", "1"), ("ep.context_file_path", str(tmp_path / "out.onnx")),
                       ("ep.context_embed_mode", "1")):
        options.add_session_config_entry(key, value)
    session = ort.InferenceSession(str(source), options)
    x = np.ones((2, 3), np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
    assert [n.op_type for n in onnx.load(str(tmp_path / "out.onnx")).graph.node] == ["EPContext"]
    del session


def test_compatibility_is_judged_by_the_workers_ep_and_versions(npu, tmp_path):
    source = tmp_path / "m.onnx"
    onnx.save(models.diamond(), str(source))
    compiled = tmp_path / "m_ctx.onnx"
    ort.ModelCompiler(options_for(npu), str(source), embed_compiled_data_into_model=True).compile_to_file(
        str(compiled))
    info = {p.key: p.value for p in onnx.load(str(compiled)).metadata_props}[f"ep_compatibility_info.{npu}"]
    judged = lambda text: get_model_compatibility_for_ep_devices(devices(npu), text)  # noqa: E731
    assert judged(info) == OrtCompiledModelCompatibility.EP_SUPPORTED_OPTIMAL
    assert judged(info.replace(f"version={ort.__version__}", "version=0.0.1")) == \
        OrtCompiledModelCompatibility.EP_UNSUPPORTED
    assert judged(info.replace("ep=CPUExecutionProvider", "ep=OpenVINOExecutionProvider")) == \
        OrtCompiledModelCompatibility.EP_UNSUPPORTED
    assert judged("QNNExecutionProvider;version=0.1.0") == OrtCompiledModelCompatibility.EP_NOT_APPLICABLE
