"""ephost.ort's device memory: the bridged EP allocates in the worker's shared memory, so that a partition's output
is ORT's tensor where the worker wrote it and a tensor ORT placed on the device reaches the worker by handle.

Each test is an ORT application (its own session, IOBinding and OrtValues); what crossed without a copy is read
from `ephost.ort.stats`, the bytes the bridge copied and the tensors it handed over in place.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import ephost.ort
from ephost.ort.memory import VENDOR_ID, BridgeMemory
from ephost.ort.pool import SLOTS
import models

N = 1 << 18  # floats: 1 MiB tensors, above the size under which outputs come back inside the reply


def session_on(name: str, model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == name], {})
    session = ort.InferenceSession(model.SerializeToString(), options)
    session.disable_fallback()
    return session


def device_memory(name: str):
    (device,) = [d for d in ort.get_ep_devices() if d.ep_name == name]
    return device.memory_info(ort.OrtDeviceMemoryType.DEFAULT)


def split_around_cpu(n: int = N):
    """y = Relu(x) and z = y + Gelu(y), with Gelu (com.microsoft) on ORT's CPU EP: fusing Relu and Add would put
    Gelu on a path between them, so the worker gets two partitions and the second reads the first's output."""
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="A"),
             helper.make_node("Gelu", ["y"], ["c"], name="C", domain="com.microsoft"),
             helper.make_node("Add", ["y", "c"], ["z"], name="B")]
    opset = [*models.OPSET, helper.make_opsetid("com.microsoft", 1)]
    return models.model(nodes, [models.tensor("x", [1, n])], [models.tensor("z", [1, n])], opset=opset)


def delta(name: str, before) -> dict[str, int]:
    after = ephost.ort.stats(name)
    return {k: getattr(after, k) - getattr(before, k)
            for k in ("computes", "bytes_in_copied", "bytes_out_copied", "inputs_in_place", "outputs_in_place")}


@pytest.fixture(scope="module")
def ref():
    """'ref': a worker hosting the reference EP (no com.microsoft operators), behind the bridge."""
    ephost.ort.register("ref", "reference")
    yield "ref"
    ephost.ort.unregister("ref")


def test_the_bridged_device_offers_the_workers_shared_memory_and_none_without_it(ref):
    info = device_memory(ref)
    assert info is not None and "shared memory" in info.name and info.device_vendor_id == VENDOR_ID
    ephost.ort.register("apart", "reference", {"shared_memory": "false"})
    try:
        assert device_memory("apart") is None  # nothing to share: ORT's CPU memory, copied into calls
    finally:
        ephost.ort.unregister("apart")


def test_outputs_are_handed_to_ort_in_place_and_the_next_partition_reads_them_there(ref):
    model = split_around_cpu()
    session, alone = session_on(ref, model), session_on("CPUExecutionProvider", model)
    assert {n.name: s.ep_name for s in session.get_provider_graph_assignment_info() for n in s.get_nodes()} == \
        {"A": ref, "C": "CPUExecutionProvider", "B": ref}
    x = np.random.default_rng(0).standard_normal((1, N)).astype(np.float32)
    before = ephost.ort.stats(ref)
    (z,) = session.run(None, {"x": x})
    np.testing.assert_allclose(z, alone.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
    # A's output y is ORT's tensor in the worker's memory: Gelu (ORT's CPU EP) reads it there, and B gets it by
    # handle; only x (the application's) and c (made by ORT's CPU EP) are copied in. z is handed over too.
    assert delta(ref, before) == {"computes": 2, "bytes_in_copied": 2 * x.nbytes, "bytes_out_copied": 0,
                                  "inputs_in_place": 1, "outputs_in_place": 2}
    del session


def test_an_ortvalue_on_the_bridged_device_crosses_without_a_copy_either_way(ref):
    model = models.chain(["Relu", "Neg"], shape=(1, N))
    session = session_on(ref, model)
    x = np.random.default_rng(1).standard_normal((1, N)).astype(np.float32)
    on_device = ort.OrtValue.ortvalue_from_shape_and_type([1, N], np.float32, memory_info=device_memory(ref))
    on_device.update_inplace(x)
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", on_device)
    before = ephost.ort.stats(ref)
    for _ in range(3):
        # bound afresh each run: ORT allocates it in Compute (an output it kept from the run before, it would
        # hand to Compute already allocated, and the bridge copies into it)
        binding.bind_output("y")
        session.run_with_iobinding(binding)
        np.testing.assert_array_equal(binding.get_outputs()[0].numpy(), -np.maximum(x, 0))
    assert delta(ref, before) == {"computes": 3, "bytes_in_copied": 0, "bytes_out_copied": 0,
                                  "inputs_in_place": 3, "outputs_in_place": 3}
    del binding, session


def test_after_a_crash_what_ort_holds_in_the_dead_workers_memory_stays_readable_and_is_copied_in():
    """The worker segfaults in its second Compute. An output ORT handed over before stays readable (this process
    keeps its mapping); a device OrtValue made in the dead worker's memory goes to the new worker as a copy."""
    ephost.ort.register("crashy", "chaos", {"wrap": "reference", "fault": "segfault", "at": "compute", "after": "2"})
    try:
        model = models.chain(["Relu", "Neg"], shape=(1, N))
        session = session_on("crashy", model)
        x = np.random.default_rng(2).standard_normal((1, N)).astype(np.float32)
        expected = -np.maximum(x, 0)
        on_device = ort.OrtValue.ortvalue_from_shape_and_type([1, N], np.float32,
                                                              memory_info=device_memory("crashy"))
        on_device.update_inplace(x)
        binding = session.io_binding()
        binding.bind_ortvalue_input("x", on_device)
        binding.bind_output("y")
        session.run_with_iobinding(binding)
        first = binding.get_outputs()[0]
        binding.bind_output("y")
        with pytest.raises(Exception, match=r"crashy: Compute of .*(SIGSEGV|signal 11)"):
            session.run_with_iobinding(binding)
        before = ephost.ort.stats("crashy")
        binding.bind_output("y")
        session.run_with_iobinding(binding)
        np.testing.assert_array_equal(binding.get_outputs()[0].numpy(), expected)
        np.testing.assert_array_equal(first.numpy(), expected)  # in the dead worker's memory, still mapped here
        assert delta("crashy", before) == {"computes": 1, "bytes_in_copied": x.nbytes, "bytes_out_copied": 0,
                                           "inputs_in_place": 0, "outputs_in_place": 1}
        del binding, session, first, on_device
    finally:
        ephost.ort.unregister("crashy")


def test_a_tensor_on_the_device_goes_by_handle_after_kept_computes_of_numpy_inputs(ref):
    """Runs fed numpy arrays make the partition's Compute a kept call (its inputs' bytes sent); a run of the same
    shape given an OrtValue on the bridged device still names it by handle, nothing copied in."""
    model = models.chain(["Relu", "Neg"], shape=(1, 16))
    session = session_on(ref, model)
    rng = np.random.default_rng(6)
    repeats = ephost.ort.environment(ref).get_worker_stats(ref).kept_calls
    for _ in range(3):
        x = rng.standard_normal((1, 16)).astype(np.float32)
        np.testing.assert_array_equal(session.run(None, {"x": x})[0], -np.maximum(x, 0))
    assert ephost.ort.environment(ref).get_worker_stats(ref).kept_calls - repeats == 2
    x = rng.standard_normal((1, 16)).astype(np.float32)
    on_device = ort.OrtValue.ortvalue_from_shape_and_type([1, 16], np.float32, memory_info=device_memory(ref))
    on_device.update_inplace(x)
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", on_device)
    binding.bind_output("y")
    before = ephost.ort.stats(ref)
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.get_outputs()[0].numpy(), -np.maximum(x, 0))
    assert delta(ref, before) == {"computes": 1, "bytes_in_copied": 0, "bytes_out_copied": x.nbytes,
                                  "inputs_in_place": 1, "outputs_in_place": 0}
    del binding, session


def gelu_of(x: np.ndarray) -> np.ndarray:
    """z of split_around_cpu, from ORT's CPU EP in process."""
    return session_on("CPUExecutionProvider", split_around_cpu(x.shape[1])).run(None, {"x": x})[0]


def test_steady_runs_allocate_and_free_in_the_bridged_memory_without_calling_python(ref, monkeypatch):
    """ORT allocates each bridged partition's small outputs in the device memory and frees them after the run: the
    shim's pool hands a freed block of the worker's back for the next allocation of its size, in C. Python is asked
    for blocks on the first two runs only; the second partition still reads the first's output by handle every
    run."""
    calls = []
    for name in ("alloc", "free"):
        real = getattr(BridgeMemory, name)
        monkeypatch.setattr(BridgeMemory, name, lambda self, arg, real=real, name=name: calls.append(name) or
                            real(self, arg))
    session = session_on(ref, split_around_cpu(16))
    rng = np.random.default_rng(7)
    for _ in range(2):  # the first run's y and z, then the block of ORT's memory pattern (its planned values)
        first = rng.standard_normal((1, 16)).astype(np.float32)
        np.testing.assert_allclose(session.run(None, {"x": first})[0], gelu_of(first), rtol=1e-5, atol=1e-6)
    assert "alloc" in calls  # new blocks of the worker's, made in Python
    calls.clear()
    before = ephost.ort.stats(ref)
    for _ in range(8):
        x = rng.standard_normal((1, 16)).astype(np.float32)
        np.testing.assert_allclose(session.run(None, {"x": x})[0], gelu_of(x), rtol=1e-5, atol=1e-6)
    assert calls == []
    assert delta(ref, before)["inputs_in_place"] == 8
    del session


def test_more_sizes_than_the_pool_keeps_stay_right_and_the_latest_are_kept(ref, monkeypatch):
    """Outputs of more sizes than the pool has slots for (a symbolic dimension, 80 sizes, twice over): every result
    right; an idle block is let go (back to the worker) for each new one, so the worker's live buffers stay bounded
    and the size used last is answered by the pool again."""
    session = session_on(ref, models.chain(["Relu", "Neg"], shape=(1, "n")))
    environment = ephost.ort.environment(ref)
    allocator = environment.registration(ref).session_allocator()

    def live() -> int:
        assert allocator.flush_frees()  # (frees go to the worker batched)
        return environment.get_worker_stats(ref).buffers_live

    before = live()
    rng = np.random.default_rng(8)
    for _ in range(2):
        for n in range(1, 81):
            x = rng.standard_normal((1, n)).astype(np.float32)
            np.testing.assert_array_equal(session.run(None, {"x": x})[0], -np.maximum(x, 0))
    assert live() <= before + SLOTS
    calls = []
    real = BridgeMemory.alloc
    monkeypatch.setattr(BridgeMemory, "alloc", lambda self, n: calls.append(n) or real(self, n))
    x = rng.standard_normal((1, 80)).astype(np.float32)
    for _ in range(3):
        np.testing.assert_array_equal(session.run(None, {"x": x})[0], -np.maximum(x, 0))
    assert calls == []
    del session


def test_after_a_restart_small_outputs_are_the_new_workers_again():
    """The pool's blocks lie in the memory of the worker that made them. After that worker crashes and another takes
    its place, the pool lets them go: the first partition's small output is again a block of the running worker's,
    which the second partition reads by handle (a dead worker's block would be copied in, run after run). The first
    run after the restart may still get one: ORT allocates its memory pattern's block as the run starts."""
    ephost.ort.register("crashy16", "chaos", {"wrap": "reference", "fault": "segfault", "at": "compute", "after": "7"})
    try:
        session = session_on("crashy16", split_around_cpu(16))
        rng = np.random.default_rng(9)
        for _ in range(3):  # computes 1-6; the first worker's blocks pooled
            x = rng.standard_normal((1, 16)).astype(np.float32)
            np.testing.assert_allclose(session.run(None, {"x": x})[0], gelu_of(x), rtol=1e-5, atol=1e-6)
        with pytest.raises(Exception, match=r"crashy16: Compute of .*(SIGSEGV|signal 11)"):
            session.run(None, {"x": x})
        for run in range(3):
            before = ephost.ort.stats("crashy16")
            x = rng.standard_normal((1, 16)).astype(np.float32)
            np.testing.assert_allclose(session.run(None, {"x": x})[0], gelu_of(x), rtol=1e-5, atol=1e-6)
            if run:
                assert delta("crashy16", before)["inputs_in_place"] == 1
        del session
    finally:
        ephost.ort.unregister("crashy16")
