"""ephost as an ONNX Runtime plugin EP library (ephost.ort): ORT's own sessions run nodes in ephost workers.

Each test is an ORT application that knows nothing of ephost beyond `ephost.ort.register`: it selects the
bridged devices with ORT's `add_provider_for_devices` and compares against ORT alone (its CPU EP in process).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import ephost
import ephost.ort
from ephost.errors import EpFailedPrecondition
from ephost.ort import abi, build
from ephost.cli.run_command import bundled_input, bundled_model
import models
from helpers import in_threads


@pytest.fixture(scope="module")
def npu():
    """'npu' in ORT: a worker hosting ORT's CPU EP, behind the bridge."""
    ephost.ort.register("npu", "onnxruntime")
    yield "npu"
    ephost.ort.unregister("npu")


def session_on(name: str, model, **config) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    for key, value in config.items():
        options.add_session_config_entry(key, value)
    options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == name], {})
    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, options)
    session.disable_fallback()  # a failure through the bridge must fail the test, not rerun on ORT's CPU EP
    return session


def owners(session: ort.InferenceSession) -> dict[str, str]:
    return {n.name: s.ep_name for s in session.get_provider_graph_assignment_info() for n in s.get_nodes()}


def test_library_path_is_the_library_built_at_install():
    path = ephost.ort.library_path()
    assert path == str(build.LIBRARY) and os.path.isfile(path)
    lib = ctypes.CDLL(path)
    assert lib.CreateEpFactories and lib.ReleaseEpFactory and lib.ephost_ort_set_callbacks
    assert (ctypes.c_char * 17).in_dll(lib, "ephost_shim_digest").value.decode() == build.source_digest()


def test_a_library_older_than_its_source_is_refused(tmp_path, monkeypatch):
    changed = tmp_path / "shim.c"
    changed.write_text(build.SOURCE.read_text() + "/* changed */\n")
    monkeypatch.setattr(build, "SOURCE", changed)
    with pytest.raises(EpFailedPrecondition, match="built from another shim.c.*pip install -e"):
        build.built_library()


def test_releases_below_the_floor_are_refused_and_every_later_one_is_served():
    with pytest.raises(EpFailedPrecondition, match=r"needs ONNX Runtime 1\.24 or newer.*runs 1\.23\.2"):
        abi.check_version("1.23.2")
    with pytest.raises(EpFailedPrecondition, match="does not know ONNX Runtime version '2.0.0'"):
        abi.check_version("2.0.0")
    assert [abi.check_version(v) for v in ("1.24.1", "1.30.0", "1.40.0-dev")] == [24, 30, 40]
    assert abi.check_version(ort.__version__) == int(ort.__version__.split(".")[1])


def test_an_entry_newer_than_the_running_onnx_runtime_is_never_called(npu):
    """The tables as an older ORT would have them: an OrtEpApi entry of 1.25 is absent under 1.24, and calling it is
    a typed error naming both versions, not a jump through a slot that older release does not have."""
    from ephost.ort.library import loaded_library
    # (genai's copy of the same release may be loaded too, by tests/test_llm.py: either has the running tables)
    copy = next(c for c in loaded_library().copies() if c.abi.version == ort.__version__)
    running = copy.abi
    address = running.api.GetEpApi()
    older = abi.FunctionTable("OrtEpApi", address, abi.EP_API, abi.EP_API_ENDS, 24, "1.24.4")
    assert older.has("CreateEpDevice") and not older.has("ProfilingEventsContainer_AddEvents")
    with pytest.raises(EpFailedPrecondition, match=r"OrtEpApi::CreateProfilingEvent needs ONNX Runtime 1\.25 or "
                                                   r"newer; this process runs 1\.24\.4"):
        older.CreateProfilingEvent(0, 0, 0, b"", 0, 0, None, None, 0, None)
    assert running.ep_api.has("ProfilingEventsContainer_AddEvents") == (running.minor >= 25)


def test_structs_claim_what_both_sides_know_and_leave_newer_members_null():
    """An OrtEp filled for ORT 1.24 claims 24 and leaves 1.25's members NULL; for a release past ephost's newest
    layout it claims that layout (ORT then reads no member ephost does not know), with spare zeroed slots after."""
    from ephost.ort.callbacks import fill
    for version, claimed in (("1.24.4", 24), ("1.27.0", 27), ("1.40.0", abi.LAYOUT)):
        table = abi.OrtAbi(version, abi.minor_of(version), None, None)
        struct = abi.OrtEp()
        fill(struct, abi.EP, table, {"GetName": lambda this: None, "IsConcurrentRunSupported": lambda this, out: None,
                                     "Sync": lambda this: None})
        assert struct.ort_version_supported == claimed
        assert bool(struct.GetName) and bool(struct.IsConcurrentRunSupported)
        assert bool(struct.Sync) == (claimed >= 25)
        assert list(struct._spare) == [None] * abi.SPARE
    assert ctypes.sizeof(abi.OrtEp) == ctypes.sizeof(ctypes.c_void_p) * (1 + len(abi.EP.members) + abi.SPARE)


def test_register_refuses_a_taken_name_and_a_bad_target_leaves_nothing(npu):
    with pytest.raises(ephost.EpAlreadyExists, match="npu"):
        ephost.ort.register(npu, "onnxruntime")
    with pytest.raises(ephost.EpError, match="no-such-ep"):
        ephost.ort.register("broken", "no-such-ep")
    assert "broken" not in {d.ep_name for d in ort.get_ep_devices()}
    with pytest.raises(ephost.EpNotFound, match="broken"):
        ephost.ort.unregister("broken")
    with pytest.raises(ephost.EpInvalidArgument, match="runs the EP of 'here' in a worker.*not 'inproc:reference'"):
        ephost.ort.register("here", "inproc:reference")
    assert "here" not in {d.ep_name for d in ort.get_ep_devices()}


def test_devices_are_the_workers_under_the_registration_name(npu):
    (device,) = [d for d in ort.get_ep_devices() if d.ep_name == npu]
    (cpu,) = [d for d in ort.get_ep_devices() if d.ep_name == "CPUExecutionProvider"]
    assert device.ep_vendor == cpu.ep_vendor  # the worker's EP is ORT's CPU EP
    assert device.device.type == cpu.device.type
    metadata = dict(device.ep_metadata)
    assert metadata["ephost.worker_ep"] == "CPUExecutionProvider" and metadata["ephost.target"] == "onnxruntime"
    assert metadata["onnxruntime_version"] == ort.__version__


def test_a_small_model_runs_in_the_worker(npu):
    model = models.diamond()
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    session = session_on(npu, model)
    before = ephost.ort.stats(npu)
    (y,) = session.run(None, {"x": x})
    after = ephost.ort.stats(npu)
    np.testing.assert_allclose(y, models.diamond_expected(x), rtol=1e-6)
    assert set(owners(session).values()) == {npu}
    # one Compute; ORT's input copied toward the worker, the worker's output into ORT's tensor
    assert (after.computes - before.computes, after.bytes_in_copied - before.bytes_in_copied,
            after.bytes_out_copied - before.bytes_out_copied) == (1, x.nbytes, y.nbytes)


def kept_repeats(name: str) -> int:
    """The worker's count of Computes it served as kept calls' repeats (only what changes sent)."""
    return ephost.ort.environment(name).get_worker_stats(name).kept_calls


def test_repeated_computes_are_kept_calls_whatever_their_shapes_and_stay_right(npu):
    """The partition's Compute is kept by the worker's fast lane on its first run and repeated from then on with
    only its inputs' dimensions and bytes, whatever its shapes: every result right as the values and the batch
    size change."""
    session = session_on(npu, models.diamond(("n", 3)))
    rng = np.random.default_rng(4)
    before, repeats = ephost.ort.stats(npu), kept_repeats(npu)
    for n in (2, 2, 2, 2, 5, 5, 5, 2, 2):
        x = rng.standard_normal((n, 3)).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, models.diamond_expected(x), rtol=1e-6)
    after = ephost.ort.stats(npu)
    # the first run keeps the call; every later one repeats it, the changes of shape too
    assert (after.computes - before.computes, kept_repeats(npu) - repeats) == (9, 8)
    assert after.bytes_in_copied - before.bytes_in_copied == 4 * 3 * (6 * 2 + 3 * 5)  # every input's bytes sent
    del session


def test_inputs_of_any_rank_size_and_type_cross_the_bridge(npu):
    """The kernel context's inputs are read in one call into records of up to 8 dimensions (app/ort/shim.c):
    one of 9 dimensions is read the long way, a scalar and an empty tensor as they are; every output right, on
    the whole Compute and on the kept call's repeats after it."""
    nodes = [helper.make_node("Relu", ["a"], ["ra"], name="relu"), helper.make_node("Neg", ["b"], ["nb"], name="neg"),
             helper.make_node("Abs", ["c"], ["ac"], name="abs"), helper.make_node("Not", ["d"], ["nd"], name="not")]
    long = (1, 2, 1, 2, 1, 2, 1, 2, 2)
    model = models.model(nodes, [models.tensor("a", list(long)), models.tensor("b", [], onnx.TensorProto.INT64),
                                 models.tensor("c", [0, 3]), models.tensor("d", [2], onnx.TensorProto.BOOL)],
                         [models.tensor("ra", list(long)), models.tensor("nb", [], onnx.TensorProto.INT64),
                          models.tensor("ac", [0, 3]), models.tensor("nd", [2], onnx.TensorProto.BOOL)])
    session = session_on(npu, model)
    assert set(owners(session).values()) == {npu}
    rng = np.random.default_rng(5)
    before, repeats = ephost.ort.stats(npu), kept_repeats(npu)
    for _ in range(3):
        a = rng.standard_normal(long).astype(np.float32)
        b = np.array(rng.integers(-9, 9), np.int64)
        d = rng.random(2) > 0.5
        ra, nb, ac, nd = session.run(None, {"a": a, "b": b, "c": np.zeros((0, 3), np.float32), "d": d})
        np.testing.assert_array_equal(ra, np.maximum(a, 0))
        assert nb.shape == () and nb == -b
        assert ac.shape == (0, 3) and ac.dtype == np.float32
        np.testing.assert_array_equal(nd, ~d)
    after = ephost.ort.stats(npu)
    assert (after.computes - before.computes, kept_repeats(npu) - repeats) == (3, 2)
    del session


@pytest.mark.parametrize("name", ["squeezenet", "resnet50"])
def test_a_real_model_matches_onnx_runtime_alone(npu, name, caplog):
    path, _ = bundled_model(name)
    alone = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (arg,) = alone.get_inputs()
    x = bundled_input(arg)
    (expected,) = alone.run(None, {arg.name: x})
    with caplog.at_level(logging.INFO, logger="ephost.ort"):
        session = session_on(npu, path)
    # Compile names nodes of the model GetCapability sent: the worker has its weights already
    assert "Compile of 1 partition(s), 1 of them cut from the model GetCapability sent" in caplog.text
    for _ in range(2):  # the second run reuses what the first compiled and staged
        (y,) = session.run(None, {arg.name: x})
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-6)
    assert set(owners(session).values()) == {npu}  # every node ORT kept after its own optimizations


def test_attributes_and_initializers_cross_the_bridge(npu):
    """Conv (ints attributes), a Constant (tensor attribute), LeakyRelu (float), weights as an initializer."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1], strides=[1, 1]),
             helper.make_node("Constant", [], ["k"], name="k", value=numpy_helper.from_array(np.float32([2.0]))),
             helper.make_node("Mul", ["c", "k"], ["m"], name="mul"),
             helper.make_node("LeakyRelu", ["m"], ["y"], name="leaky", alpha=0.25)]
    model = models.model(nodes, [models.tensor("x", [1, 3, 5, 5])], [models.tensor("y", [1, 4, 5, 5])],
                         [numpy_helper.from_array(w, "w")])
    x = rng.standard_normal((1, 3, 5, 5)).astype(np.float32)
    alone = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (expected,) = alone.run(None, {"x": x})
    session = session_on(npu, model)
    (y,) = session.run(None, {"x": x})
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    assert npu in set(owners(session).values())


def test_control_flow_goes_whole_with_its_subgraphs_and_profiling_names_the_bridged_ep(npu, tmp_path):
    """If reads x2 and the initializer w from the outer scope inside its branches; the worker gets the node
    with both branches (read through Node_GetSubgraphs) and ORT's profile names the bridged EP."""
    import json
    options = ort.SessionOptions()
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == npu], {})
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    session = ort.InferenceSession(models.with_if().SerializeToString(), options)
    session.disable_fallback()
    x = np.array([-1.0, 2.0, 3.0], np.float32)
    w = np.array([1.0, 2.0, 3.0], np.float32)
    for cond, expected in ((True, np.maximum(x, 0) + w), (False, np.maximum(x, 0) - w)):
        np.testing.assert_allclose(session.run(None, {"x": x, "cond": np.array(cond)})[0], expected)
    assert owners(session) == {"relu": npu, "if": npu}
    with open(session.end_profiling()) as f:
        events = json.load(f)
    own = [e for e in events if e.get("cat") == "Node" and "ephost.ep" not in e["args"]]  # ORT's, not the worker's
    assert {e["args"].get("provider") for e in own} == {npu}


def test_the_workers_node_times_are_in_orts_own_profile(npu, tmp_path):
    """ORT 1.25 on asks a plugin EP for a profiler: the worker's EP records each node it runs, and ORT's profile
    has those events (in the worker's process) inside the fused node's own, beside ORT's. Before 1.25 ORT's
    profile has the fused node alone."""
    import json
    options = ort.SessionOptions()
    options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == npu], {})
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    session = ort.InferenceSession(models.diamond().SerializeToString(), options)
    session.disable_fallback()
    x = np.ones((2, 3), np.float32)
    for _ in range(2):
        np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x))
    with open(session.end_profiling()) as f:
        events = [e for e in json.load(f) if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    fused = [e for e in events if "ephost.ep" not in e["args"]]
    worker = [e for e in events if e["args"].get("ephost.ep") == npu]
    assert len(fused) == 2 and {e["args"]["provider"] for e in fused} == {npu}
    if int(ort.__version__.split(".")[1]) < 25:
        assert worker == []
        return
    assert sorted(e["name"] for e in worker) == sorted(["add_kernel_time", "relu_kernel_time", "mul_kernel_time"] * 2)
    assert {e["pid"] for e in worker} == {ephost.ort.environment(npu).registration(npu).process.pid}
    assert {e["args"]["provider"] for e in worker} == {"CPUExecutionProvider"}
    slack = 1000  # µs: the two processes' clocks read apart
    for e in worker:  # each inside one of the fused node's runs
        assert any(f["ts"] - slack <= e["ts"] <= e["ts"] + e["dur"] <= f["ts"] + f["dur"] + slack for f in fused), e


def test_a_group_that_would_make_a_cycle_is_split_not_lost():
    """A reference worker that takes Add and Mul claims {add, mul} as one group, with Relu (left to ORT's CPU EP)
    on the path between them. ORT refuses such a group whole (every node would go to its CPU EP); the bridge
    splits it with ephost's own rule, so both nodes still run in the worker."""
    ephost.ort.register("refnpu", "reference", {"ops": "Add,Mul"})
    try:
        session = session_on("refnpu", models.diamond())
        x = np.random.default_rng(5).standard_normal((2, 3)).astype(np.float32)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
        assert owners(session) == {"add": "refnpu", "mul": "refnpu", "relu": "CPUExecutionProvider"}
        del session
    finally:
        ephost.ort.unregister("refnpu")


def test_a_running_worker_by_address_and_a_plugin_library_by_path():
    """The other two kinds of target: a worker an operator started (by its address), and a vendor's ORT plugin EP
    library by path (OpenVINO's: it loads in the worker, and ORT lists under the name the devices OpenVINO offers
    in process: none without Intel hardware; on an Intel CPU one, which runs the model)."""
    from helpers import Worker
    worker = Worker("--ep", "onnxruntime")
    try:
        ephost.ort.register("remote_npu", worker.address)
        try:
            session = session_on("remote_npu", models.diamond())
            x = np.random.default_rng(6).standard_normal((2, 3)).astype(np.float32)
            np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
            assert set(owners(session).values()) == {"remote_npu"}
            del session
        finally:
            ephost.ort.unregister("remote_npu")
    finally:
        worker.stop()
    import onnxruntime_ep_openvino as openvino
    with contextlib.suppress(Exception):  # already registered in this process by an earlier test
        ort.register_execution_provider_library("ephost-test-ov", openvino.get_library_path())
    in_process = [d.device.type for d in ort.get_ep_devices() if d.ep_name == openvino.get_ep_name()]
    ephost.ort.register("ov", openvino.get_library_path())
    try:
        assert [d.device.type for d in ort.get_ep_devices() if d.ep_name == "ov"] == in_process
        assert len(ephost.ort.environment("ov").registration("ov").devices) == len(in_process)
        if in_process:
            session = session_on("ov", models.diamond())
            x = np.random.default_rng(7).standard_normal((2, 3)).astype(np.float32)
            np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-5)
            assert "ov" in owners(session).values()
            del session
    finally:
        ephost.ort.unregister("ov")


@functools.lru_cache(maxsize=1)
def node_cases() -> dict:
    import warnings
    from onnx.backend.test.case.node import collect_testcases
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {c.name: c for c in collect_testcases(None)}


@pytest.mark.parametrize("case_name", ["test_affine_grid_2d_expanded", "test_loop11", "test_scan9_sum"])
def test_node_cases_whose_intermediate_shapes_ort_gets_wrong(npu, case_name):
    """ORT's graph can carry shapes for intermediate values that a run does not have (here inside an expanded
    function and If branches); the worker binds a partition's outputs by declared shapes, so the bridge sends
    only element types for them, and keeps a body's input shapes (Loop needs its iteration count's)."""
    from onnx.backend.test.runner import Runner
    from ephost.eps.onnxruntime import readable_model
    case = node_cases()[case_name]
    session = session_on(npu, readable_model(case.model))
    names = [i.name for i in case.model.graph.input]
    for inputs, expected in case.data_sets:
        outputs = session.run(None, dict(zip(names, inputs)))
        Runner.assert_similar_outputs(expected, outputs, rtol=case.rtol, atol=case.atol, model_dir=None)
    assert set(owners(session).values()) == {npu}


def test_provider_options_reach_the_workers_ep(npu, monkeypatch):
    """add_provider_for_devices(devices, options): ORT keeps them as `ep.<name>.<key>` session entries; the
    bridge reads them (GetSessionOptionsConfigEntries) and creates the worker's EP with them."""
    from ephost.ort.factory import provider_options
    assert provider_options({"ep.npu.a": "1", "ep.NPU.b": "2", "ep.other.c": "3", "session.d": "4"}, "npu") == \
        {"a": "1", "b": "2"}
    factory = ephost.ort.environment(npu).registration(npu).factory
    seen = []
    create_ep = factory.create_ep
    monkeypatch.setattr(factory, "create_ep", lambda indices, options: seen.append(dict(options)) or
                        create_ep(indices, options))
    options = ort.SessionOptions()
    options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == npu],
                                     {"intra_op_num_threads": "1"})
    session = ort.InferenceSession(models.diamond().SerializeToString(), options)
    x = np.ones((2, 3), np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x))
    assert seen == [{"intra_op_num_threads": "1"}]


def test_dynamic_options_reach_the_workers_ep(npu, monkeypatch):
    """InferenceSession.set_ep_dynamic_options -> OrtEp::SetDynamicOptions -> the worker's EP."""
    from ephost.client.remote import RemoteEp
    seen = []
    original = RemoteEp.set_dynamic_options
    monkeypatch.setattr(RemoteEp, "set_dynamic_options",
                        lambda self, options: seen.append(dict(options)) or original(self, options))
    session = session_on(npu, models.diamond())
    session.set_ep_dynamic_options({"ep.dynamic.workload_type": "Efficient"})
    assert seen == [{"ep.dynamic.workload_type": "Efficient"}]
    x = np.ones((2, 3), np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x))


def test_sequences_stay_inside_a_partition_or_on_ort(npu):
    """A kernel context carries tensors only: a sequence made and read inside the worker's partition is fine; a
    graph whose output is a sequence keeps the nodes around it on ORT's CPU EP (typed for the worker, no error)."""
    inside = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
              helper.make_node("SequenceConstruct", ["r", "r"], ["s"], name="seq"),
              helper.make_node("ConcatFromSequence", ["s"], ["c"], name="cat", axis=0),
              helper.make_node("Neg", ["c"], ["y"], name="neg")]
    model = models.model(inside, [models.tensor("x", [2, 3])], [models.tensor("y", [4, 3])])
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    session = session_on(npu, model)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], -np.concatenate([np.maximum(x, 0)] * 2))
    assert set(owners(session).values()) == {npu}
    out = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
           helper.make_node("SequenceConstruct", ["r", "r"], ["s"], name="seq")]
    seq_type = helper.make_sequence_type_proto(helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, [2, 3]))
    model = models.model(out, [models.tensor("x", [2, 3])], [helper.make_value_info("s", seq_type)])
    session = session_on(npu, model)
    (s,) = session.run(None, {"x": x})
    assert len(s) == 2 and np.allclose(s[0], np.maximum(x, 0))
    assert owners(session)["seq"] == "CPUExecutionProvider"


def test_two_bridged_eps_split_a_model_in_the_order_given():
    """ORT asks the EPs in the order they were added: the first (a reference worker that takes Add) gets add; the
    second (an onnxruntime worker) is shown add as taken (Node_GetEpName) and gets the rest."""
    ephost.ort.register("adds", "reference", {"ops": "Add"})
    ephost.ort.register("rest", "onnxruntime")
    try:
        options = ort.SessionOptions()
        options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        for name in ("adds", "rest"):
            options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == name], {})
        session = ort.InferenceSession(models.diamond().SerializeToString(), options)
        session.disable_fallback()
        x = np.random.default_rng(7).standard_normal((2, 3)).astype(np.float32)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
        assert owners(session) == {"add": "adds", "relu": "rest", "mul": "rest"}
        del session
    finally:
        ephost.ort.unregister("rest")
        ephost.ort.unregister("adds")


def test_string_tensors_cross_the_bridge(npu):
    """ORT keeps strings as C++ objects: the bridge reads them with GetStringTensorContent and writes the
    worker's with FillStringTensor."""
    nodes = [helper.make_node("StringConcat", ["a", "b"], ["y"], name="concat")]
    model = models.model(nodes, [models.tensor("a", [3], onnx.TensorProto.STRING),
                                 models.tensor("b", [3], onnx.TensorProto.STRING)],
                         [models.tensor("y", [3], onnx.TensorProto.STRING)], opset=[helper.make_opsetid("", 20)])
    session = session_on(npu, model)
    a, b = np.array(["ab", "é", ""], dtype=object), np.array(["c", "ü", ""], dtype=object)
    before = ephost.ort.stats(npu)
    (y,) = session.run(None, {"a": a, "b": b})
    after = ephost.ort.stats(npu)
    assert y.tolist() == ["abc", "éü", ""]
    assert owners(session) == {"concat": npu}
    # the strings' UTF-8 bytes are what crossed: 2 + 2 + 1 + 2 in, 3 + 4 out
    assert (after.bytes_in_copied - before.bytes_in_copied, after.bytes_out_copied - before.bytes_out_copied) == \
        (7, 7)


def test_the_bridge_needs_no_ephost_import_beyond_register(tmp_path):
    """An unchanged ORT script: only the register line is ephost's."""
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, onnxruntime as ort
        import ephost.ort
        ephost.ort.register("vendor_npu", "onnxruntime")
        devices = [d for d in ort.get_ep_devices() if d.ep_name == "vendor_npu"]
        options = ort.SessionOptions()
        options.add_provider_for_devices(devices, {})
        options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        session = ort.InferenceSession(sys_argv_model, options)
        x = np.ones((2, 3), np.float32)
        (y,) = session.run(None, {"x": x})
        print(float(y.sum()), sorted({s.ep_name for s in session.get_provider_graph_assignment_info()}))
    """).replace("sys_argv_model", repr(str(tmp_path / "m.onnx"))))
    onnx.save(models.diamond(), str(tmp_path / "m.onnx"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == str(float(models.diamond_expected(np.ones((2, 3), np.float32)).sum()))
    assert "['vendor_npu']" in done.stdout


def test_an_ort_session_outliving_its_registration_is_released_quietly(caplog):
    """ORT releases a session's EP and partitions when the session goes, which may be after the EP was
    unregistered (its worker closed: at exit, sessions are often the last to go). Nothing is left to release
    there, and nothing is called or logged as failed."""
    import gc
    ephost.ort.register("gone", "onnxruntime")
    try:
        session = session_on("gone", models.diamond())
        x = np.ones((2, 3), np.float32)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
    finally:
        ephost.ort.unregister("gone")
    with caplog.at_level(logging.DEBUG, logger="ephost"):
        del session
        gc.collect()
    assert "ReleaseEp" in caplog.text, "ORT released the session's EP here"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_outputs_held_past_unregister_stay_readable_and_the_process_exits_cleanly(tmp_path):
    """ORT hands a large output out as a numpy array over the bridged device's memory (the worker's, mapped here),
    and frees it through the factory's allocator when the application lets it go: after the registration went,
    and at exit. The arrays stay readable, each Free and ORT's late ReleaseAllocator find a live allocator and
    factory (they crashed the application before), and the registration itself is not kept alive by them. A
    child process: a crash must fail this test, not end the run."""
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent("""
        import gc, sys, weakref
        import numpy as np, onnxruntime as ort
        import ephost.ort
        W = 262144  # 1 MiB of floats: over the inline limit, each output is handed over in the worker's memory
        ephost.ort.register("held", "onnxruntime")
        options = ort.SessionOptions()
        options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == "held"], {})
        session = ort.InferenceSession(sys.argv[1], options)
        session.disable_fallback()
        feed = np.arange(W, dtype=np.float32).reshape(1, W)
        outs = [session.run(None, {"x": feed + i})[0] for i in range(3)]
        print(ephost.ort.stats("held").outputs_in_place)
        registration = weakref.ref(ephost.ort.environment("held").registration("held"))
        del session, options
        ephost.ort.unregister("held")
        gc.collect()
        print(registration() is None)
        print(*[np.array_equal(out, -(feed + i)) for i, out in enumerate(outs)])
        del outs[0]
        gc.collect()
        print(np.array_equal(outs[0], -(feed + 1)))  # the other two are still held as the process exits
    """))
    onnx.save(models.chain(["Neg"], shape=(1, 262144)), str(tmp_path / "m.onnx"))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "m.onnx")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    handed_over, released, readable, still = done.stdout.splitlines()
    assert int(handed_over) == 3, "each output was handed to ORT in the worker's memory"
    assert released == "True", "nothing the allocator or factory keeps holds the registration"
    assert readable == "True True True"
    assert still == "True"


def test_a_failure_while_orts_factory_is_released_is_logged_and_the_binding_still_goes(tmp_path):
    """ReleaseEpFactory returns ORT a status: a Python error escaping it would reach ORT as no status at all
    (ctypes prints it and returns whatever the register held; ORT then reads and frees that). A fault injected
    where the factory gives the worker's memory back (the call the release makes first) is logged as the
    release's failure, and the registration's factory still leaves it. A child process: a crash must fail this
    test, not end the run."""
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent("""
        import gc, sys
        import numpy as np, onnxruntime as ort
        import ephost.ort
        from ephost.client.allocator import RemoteAllocator
        ephost.ort.register("failing", "onnxruntime")
        options = ort.SessionOptions()
        options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == "failing"], {})
        session = ort.InferenceSession(sys.argv[1], options)
        session.disable_fallback()
        session.run(None, {"x": np.ones((2, 3), np.float32)})
        from ephost.ort.library import loaded_library
        binding = loaded_library().binding("failing")
        del session, options
        gc.collect()
        def fault(self, buffers):
            print("injected", flush=True)
            raise RuntimeError("a fault while giving memory back")
        RemoteAllocator.free_many = fault
        ephost.ort.unregister("failing")
        print(len(binding.factories))
    """))
    onnx.save(models.diamond(), str(tmp_path / "m.onnx"))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "m.onnx")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["injected", "0"], "the release met the fault, and its factory left the binding"
    assert "ReleaseEpFactory failed: RuntimeError: a fault while giving memory back" in done.stderr, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr


@pytest.mark.parametrize("fault", ["unreadable error", "failing log filter"])
def test_a_failure_in_every_kind_of_callback_reaches_ort_as_a_status_or_a_log_line_never_unwinding(tmp_path, fault):
    """What a callback does with the error it caught can fail too: an error whose message raises as it is read
    ("unreadable error"), a log filter of the application that raises on the line the callback logs ("failing log
    filter"). Neither escapes: CreateEpFactories and GetCapability and Compute (Guard.failed) return ORT a status
    that names the error, ReleaseNodeComputeInfos and ReleaseEp (Guard.quiet) and ReleaseEpFactory log it, each
    with a fault injected into the dependency it calls. A child process: one that escaped would reach ORT as no
    status at all (ctypes returns whatever the register held), which crashes the application."""
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent("""
        import gc, logging, sys
        import numpy as np, onnxruntime as ort
        import ephost.ort
        from ephost.client.allocator import RemoteAllocator
        from ephost.client.environment import Environment
        from ephost.client.remote import RemoteComputeInfo, RemoteEp

        class Unreadable(RuntimeError):
            def __str__(self):
                raise ValueError("reading the message fails too")

        class FailingFilter(logging.Filter):
            def filter(self, record):
                raise RuntimeError("a log filter that fails")

        if sys.argv[2] == "unreadable error":
            error, said = Unreadable, "Unreadable (its message raised an error)"
        else:
            error, said = (lambda: RuntimeError("injected")), "RuntimeError: injected"
            handler = logging.StreamHandler()
            handler.addFilter(FailingFilter())
            for name in ("ephost.ort.callbacks", "ephost.ort.library"):
                logging.getLogger(name).addHandler(handler)
                logging.getLogger(name).setLevel(logging.DEBUG)

        def failing(owner, *names):  # these methods raise the fault; what it returns restores them
            real = {name: owner.__dict__[name] for name in names}
            def fault(*args, **kwargs):
                raise error()
            for name in names:
                setattr(owner, name, fault)
            return lambda: [setattr(owner, name, fn) for name, fn in real.items()]

        restore = failing(Environment, "registration")
        try:
            ephost.ort.register("failing", "onnxruntime")
        except Exception as e:
            print("CreateEpFactories", said in str(e))
        restore()
        ephost.ort.register("failing", "onnxruntime")
        options = ort.SessionOptions()
        options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == "failing"], {})
        x = np.ones((2, 3), np.float32)
        restore = failing(RemoteEp, "get_capability")
        session = ort.InferenceSession(sys.argv[1], options)
        restore()
        session.run(None, {"x": x})
        print("GetCapability", ephost.ort.stats("failing").computes == 0)  # ORT's CPU EP ran it all
        session = ort.InferenceSession(sys.argv[1], options)
        session.disable_fallback()
        restore = failing(RemoteComputeInfo, "compute")
        try:
            session.run(None, {"x": x})
        except Exception as e:
            print("Compute", "EP_FAIL" in str(e) and said in str(e))
        restore()
        print("next", bool((session.run(None, {"x": x})[0] == -x).all()))
        restore = failing(RemoteEp, "release_node_compute_infos", "release")
        del session
        gc.collect()
        restore()
        binding = ephost.ort.library.loaded_library().binding("failing")
        failing(RemoteAllocator, "free_many")
        ephost.ort.unregister("failing")
        print("ReleaseEpFactory", len(binding.factories))
    """))
    onnx.save(models.chain(["Neg"], shape=(2, 3)), str(tmp_path / "m.onnx"))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "m.onnx"), fault], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["CreateEpFactories True", "GetCapability True", "Compute True", "next True",
                                        "ReleaseEpFactory 0"], done.stdout + done.stderr[-3000:]
    assert "Exception ignored" not in done.stderr, done.stderr
    said = "Unreadable (its message raised an error)" if fault == "unreadable error" else "RuntimeError: injected"
    assert f"failing: GetCapability: {said}" in done.stderr, "ORT logs the status it got"
    if fault == "unreadable error":  # (the failing filter lets none of ephost's lines through)
        for line in (f"failing: ReleaseNodeComputeInfos failed: {said}", f"failing: ReleaseEp failed: {said}",
                     f"ephost.ort: ReleaseEpFactory failed: {said}"):
            assert line in done.stderr, done.stderr


def test_a_worker_crash_in_compute_is_an_ort_error_and_the_next_run_is_correct():
    """The chaos EP segfaults (a real SIGSEGV) in its second Compute: ORT raises naming the EP, the call and the
    signal; supervision restarts the worker and the bridge compiles again from what it recorded."""
    ephost.ort.register("crashy", "chaos", {"wrap": "onnxruntime", "fault": "segfault", "at": "compute",
                                            "after": "2"})
    try:
        session = session_on("crashy", models.diamond())  # without fallback: ORT's Python API would rerun on CPU
        x = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
        with pytest.raises(Exception, match=r"crashy: Compute of .*(SIGSEGV|signal 11)") as failure:
            session.run(None, {"x": x})
        assert "EP_FAIL" in str(failure.value) or "EPFail" in type(failure.value).__name__
        for _ in range(1):  # the restarted worker's first Compute is fine again
            np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
        assert set(owners(session).values()) == {"crashy"}
        del session
    finally:
        ephost.ort.unregister("crashy")


def test_a_hanging_worker_is_an_ort_error_at_its_deadline_and_the_next_run_is_correct():
    """The supervision options of register (here timeout_s) hold through ORT: a Compute past its deadline is
    abandoned, its worker ended and restarted, and ORT raises; the next run compiles again and is right."""
    ephost.ort.register("hangs", "chaos", {"wrap": "onnxruntime", "fault": "hang", "at": "compute", "after": "2",
                                           "timeout_s": "3"})
    try:
        session = session_on("hangs", models.diamond())
        x = np.ones((2, 3), np.float32)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x))
        with pytest.raises(Exception, match=r"hangs: Compute of .*did not finish within its deadline of 3 s"):
            session.run(None, {"x": x})
        np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x))
        del session
    finally:
        ephost.ort.unregister("hangs")


@pytest.mark.timeout(120)
def test_a_worker_replaced_for_memory_under_ort_threads_fails_none_of_their_runs():
    """As for a session of ephost's own: a Compute the old worker refuses as it drains (this process replacing
    it past its memory limit) is made again on its successor, not an EP_FAIL to ORT."""
    ephost.ort.register("leaky", "chaos", {"wrap": "onnxruntime", "fault": "leak", "every": "8", "leak_mb": "24",
                                           "memory_limit_mb": "250"})
    try:
        session = session_on("leaky", models.diamond())
        x = np.ones((2, 3), np.float32)
        registration = ephost.ort.environment("leaky").registration("leaky")
        pids = set()
        deadline = time.monotonic() + 50

        def work(i: int) -> None:
            while len(pids) < 11 and time.monotonic() < deadline:
                np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x))
                pids.add(registration.process.pid)

        assert in_threads(work, 4) == []
        assert len(pids) >= 11, "the worker was replaced ten times"
        session = None  # released before its EP is unregistered
    finally:
        ephost.ort.unregister("leaky")


def test_a_compile_failure_is_an_ort_error_at_session_creation():
    ephost.ort.register("badcompile", "chaos", {"wrap": "onnxruntime", "fault": "raise", "at": "compile",
                                                "every": "1"})
    try:
        with pytest.raises(Exception, match=r"EP_FAIL : badcompile: Compile: chaos: injected failure"):
            session_on("badcompile", models.diamond())
    finally:
        ephost.ort.unregister("badcompile")


def test_eight_threads_on_one_session_are_correct(npu):
    import threading
    path, _ = bundled_model("squeezenet")
    session = session_on(npu, path)
    (arg,) = session.get_inputs()
    rng = np.random.default_rng(2)
    feeds = [rng.random((1, 3, 224, 224), dtype=np.float32) for _ in range(8)]
    alone = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    expected = [alone.run(None, {arg.name: f})[0] for f in feeds]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(5):
                (y,) = session.run(None, {arg.name: feeds[i]})
                np.testing.assert_allclose(y, expected[i], rtol=1e-4, atol=1e-6)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_get_capability_failure_leaves_the_nodes_to_ort_cpu(caplog):
    caplog.set_level(logging.INFO, logger="ephost.ort")  # (ORT logs the failure itself; ephost's line is INFO)
    ephost.ort.register("capfail", "chaos", {"wrap": "onnxruntime", "fault": "raise", "at": "get_capability",
                                             "every": "1"})
    try:
        session = session_on("capfail", models.diamond())
        x = np.random.default_rng(4).standard_normal((2, 3)).astype(np.float32)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
        assert set(owners(session).values()) == {"CPUExecutionProvider"}
        # the worker's error came back to ORT as a status (ORT logs it and moves on), not as an exception in C
        assert any("capfail: GetCapability failed" in r.getMessage() and "chaos" in r.getMessage()
                   for r in caplog.records)
        del session
    finally:
        ephost.ort.unregister("capfail")


def test_the_library_loaded_without_ephost_fails_with_a_status_not_a_crash(tmp_path):
    """A Python application that registers the library with ORT itself, naming nothing for it: CreateEpFactories
    returns an error status naming what to do (register the name, or give it a target in EPHOST_CONFIG)."""
    path = ephost.ort.library_path()
    code = f"""
import onnxruntime as ort
try:
    ort.register_execution_provider_library("alone", {path!r})
except Exception as e:
    print("refused:", e)
"""
    env = {k: v for k, v in os.environ.items() if k != "EPHOST_CONFIG"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'alone' is not registered with ephost.ort: in Python, call ephost.ort.register('alone'" in done.stdout
    assert "set EPHOST_CONFIG to a TOML file with a [registrations.alone] table" in done.stdout
