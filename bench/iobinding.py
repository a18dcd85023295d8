"""A loop y = tanh(x @ W) whose output is the next step's input, through an onnxruntime worker: fed back with
run() (every step's input goes to the worker and its output comes back), with the output bound to the worker's
device (a new tensor there each step, fed back), and with two tensors bound in the worker, swapped each step.
Per step: median time (the ways interleaved in blocks, ORT's thread spinning off on both sides), and the tensor
bytes the worker's counters saw cross between the processes; ORT's CPU EP in process as the baseline."""
from __future__ import annotations

import statistics
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import ephost
from ephost import DeviceMemoryType, InferenceSession, SessionOptions

NO_SPIN = "session.intra_op.allow_spinning=0;session.inter_op.allow_spinning=0"


def recurrent(n: int, batch: int, matmul: bool = True):
    """y = tanh(x @ W) (W: n x n), or y = tanh(x) where the data, not the compute, is the point."""
    w = (np.random.default_rng(0).standard_normal((n, n)) / np.sqrt(n)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])] if matmul \
        else [helper.make_node("Tanh", ["x"], ["y"])]
    graph = helper.make_graph(
        nodes, "loop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, n])],
        [numpy_helper.from_array(w, "w")] if matmul else [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def in_process(model, x0):
    import onnxruntime as ort
    options = ort.SessionOptions()
    for entry in NO_SPIN.split(";"):
        options.add_session_config_entry(*entry.split("="))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return fed_back(session, x0)


def fed_back(session, x0):
    state = {"x": x0}

    def step():
        state["x"] = session.run(None, {"x": state["x"]})[0]
    step.state, step.session = (lambda: state["x"]), session
    return step


def bound_to_device(session, device, x0):
    binding = session.io_binding()
    binding.bind_cpu_input("x", x0)
    binding.bind_output("y", device)
    session.run_with_iobinding(binding)

    def step():
        binding.bind_ortvalue_input("x", binding.get_outputs()[0])
        session.run_with_iobinding(binding)
    step.state = lambda: binding.get_outputs()[0].numpy()
    return step


def alternating(session, env, device, x0):
    allocator = env.allocator_for(device.memory_info(DeviceMemoryType.HOST_ACCESSIBLE))
    pair = [ephost.Tensor.from_numpy(x0, allocator), ephost.Tensor.empty(x0.shape, x0.dtype, allocator)]
    binding = session.io_binding()

    def step():
        binding.bind_ortvalue_input("x", pair[0])
        binding.bind_output("y", tensor=pair[1])
        session.run_with_iobinding(binding)
        pair.reverse()
    step.state = lambda: pair[0].numpy()
    step()
    return step


def check(steps: dict, reference) -> None:
    """One more step of each way, its output checked against `reference` (ORT in process) run on the step's input:
    a way that computes wrong (the bench only times) is no figure."""
    for way, step in steps.items():
        before = np.array(step.state())
        step()
        expected = reference.run(None, {"x": before})[0]
        if not np.allclose(step.state(), expected, rtol=1e-5, atol=1e-6):
            raise AssertionError(f"{way}: a step's output is not what ORT in process makes of its input")


def moved(env, before) -> int:
    after = env.get_worker_stats("ort")
    return sum(getattr(after, c) - getattr(before, c) for c in ("compute_input_bytes_transferred", "bytes_inline_out"))


def measure(n: int, batch: int, matmul: bool, blocks: int, block: int) -> dict[str, tuple[float, float]]:
    """way -> (median seconds per step, bytes between the processes per step)."""
    model = recurrent(n, batch, matmul)
    x0 = np.random.default_rng(1).standard_normal((batch, n)).astype(np.float32)
    with ephost.Environment() as env:
        env.register_execution_provider_library("ort", "onnxruntime", {"session_config": NO_SPIN})
        device = env.get_ep_devices()[0]
        options = SessionOptions()
        options.add_provider_for_devices([device])
        sessions = [InferenceSession(model, options, env=env) for _ in range(3)]
        try:
            steps = {"in process": in_process(model, x0), "run": fed_back(sessions[0], x0),
                     "device": bound_to_device(sessions[1], device, x0),
                     "alternating": alternating(sessions[2], env, device, x0)}
            times = {way: [] for way in steps}
            moved_bytes = dict.fromkeys(steps, 0)
            for _ in range(blocks):
                for way, step in steps.items():
                    step()  # warm: the block starts hot
                    before = env.get_worker_stats("ort")
                    for _ in range(block):
                        start = time.perf_counter()
                        step()
                        times[way].append(time.perf_counter() - start)
                    moved_bytes[way] += moved(env, before)
            check(steps, steps["in process"].session)
            return {way: (statistics.median(times[way]), moved_bytes[way] / (blocks * block)) for way in steps}
        finally:
            for session in sessions:
                session.close()


def main(quick: bool = False) -> None:
    blocks, block = (3, 10) if quick else (10, 30)
    print(f"A step y = f(x) fed back through an onnxruntime worker (fast lane), median per step over {blocks} "
          f"interleaved blocks of {block} steps; bytes: tensor bytes between the processes per step\n")
    print("| f, x | ORT in process | run() fed back | bound to the device | two bound tensors alternating | "
          "device / run() | alternating / run() | bytes: run() / device / alternating |")
    print("|---|---|---|---|---|---|---|---|")
    for n, batch, matmul in ((256, 4, True), (256, 256, True), (1024, 1024, False)):
        r = measure(n, batch, matmul, blocks, block)
        us = {way: t * 1e6 for way, (t, _) in r.items()}
        what = "tanh(x @ W)" if matmul else "tanh(x)"
        print(f"| {what}, float32[{batch}, {n}] ({batch * n * 4 >> 10} KiB) | {us['in process']:.0f} µs | "
              f"{us['run']:.0f} µs | {us['device']:.0f} µs | {us['alternating']:.0f} µs | "
              f"{us['device'] / us['run']:.2f} | {us['alternating'] / us['run']:.2f} | {r['run'][1]:,.0f} / "
              f"{r['device'][1]:,.0f} / {r['alternating'][1]:,.0f} |")
