"""A loop y = tanh(x @ W) whose output is the next step's input, through an onnxruntime worker: fed back with
run() (every step's input goes to the worker and its output comes back), and with IOBinding (the output bound
in the worker and bound again as the next input). Per step: median time, and the tensor bytes the worker's
counters saw cross between the processes; ORT's CPU EP in process as the baseline."""
from __future__ import annotations

import statistics
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import ephost
from ephost import DeviceMemoryType, InferenceSession, SessionOptions


def recurrent(n: int, batch: int):
    w = (np.random.default_rng(0).standard_normal((n, n)) / np.sqrt(n)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])], "loop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, n])], [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def per_step(step, steps: int) -> float:
    """Median seconds of one step over `steps` steps (after a warm-up step)."""
    step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def moved(env, before) -> int:
    after = env.get_worker_stats("ort")
    return sum(getattr(after, c) - getattr(before, c)
               for c in ("compute_input_bytes_transferred", "bytes_inline_out"))


def loop_in_worker(model, x0: np.ndarray, steps: int, how: str) -> tuple[float, float]:
    """(median seconds per step, tensor bytes between the processes per step). `how`: "run" (fed back through
    run()), "device" (output bound to the worker's device, a new tensor each step) or "alternate" (two tensors
    bound in the worker, swapped each step)."""
    with ephost.Environment() as env:
        env.register_execution_provider_library("ort", "onnxruntime")
        device = env.get_ep_devices()[0]
        options = SessionOptions()
        options.add_provider_for_devices([device])
        with InferenceSession(model, options, env=env) as session:
            state = {"x": x0}
            binding = session.io_binding()
            if how == "device":
                binding.bind_cpu_input("x", x0)
                binding.bind_output("y", device)
                session.run_with_iobinding(binding)

                def step():
                    binding.bind_ortvalue_input("x", binding.get_outputs()[0])
                    session.run_with_iobinding(binding)
            elif how == "alternate":
                allocator = env.allocator_for(device.memory_info(DeviceMemoryType.HOST_ACCESSIBLE))
                state["pair"] = (ephost.Tensor.from_numpy(x0, allocator), ephost.Tensor.empty(x0.shape, x0.dtype,
                                                                                                allocator))

                def step():
                    a, b = state["pair"]
                    binding.bind_ortvalue_input("x", a)
                    binding.bind_output("y", tensor=b)
                    session.run_with_iobinding(binding)
                    state["pair"] = (b, a)
                step()
            else:
                def step():
                    state["x"] = session.run(None, {"x": state["x"]})[0]
            before = env.get_worker_stats("ort")
            seconds = per_step(step, steps)
            return seconds, moved(env, before) / (steps + 1)


def main(quick: bool = False) -> None:
    import onnxruntime as ort
    steps = 20 if quick else 200
    print(f"y = tanh(x @ W) fed back {steps} steps through an onnxruntime worker (fast lane), median per step; "
          "bytes: tensor bytes between the processes per step\n")
    print("| x | ORT in process | run() fed back | bound to the device | two bound tensors alternating | "
          "device / run() | alternating / run() | bytes: run() / bound |")
    print("|---|---|---|---|---|---|---|---|")
    for n, batch in ((256, 4), (1024, 256)):
        model = recurrent(n, batch)
        x0 = np.random.default_rng(1).standard_normal((batch, n)).astype(np.float32)
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        state = {"x": x0}

        def local():
            state["x"] = session.run(None, {"x": state["x"]})[0]
        base = per_step(local, steps)
        unbound, unbound_bytes = loop_in_worker(model, x0, steps, "run")
        device, device_bytes = loop_in_worker(model, x0, steps, "device")
        alternate, alternate_bytes = loop_in_worker(model, x0, steps, "alternate")
        print(f"| float32[{batch}, {n}] ({x0.nbytes >> 10} KiB) | {base * 1e6:.0f} µs | {unbound * 1e6:.0f} µs | "
              f"{device * 1e6:.0f} µs | {alternate * 1e6:.0f} µs | {device / unbound:.2f} | "
              f"{alternate / unbound:.2f} | {unbound_bytes:,.0f} / {max(device_bytes, alternate_bytes):,.0f} |")
