"""Time from a worker's death to the next correct result, per failure policy: a session runs a model on a
reference worker, the worker is killed with SIGKILL from outside, and the next run() is timed until it
returns a correct result. Median of several kills, each a first crash (kills are spaced past the crash
window, so the restart backoff starts from its first step every time)."""
from __future__ import annotations

import os
import signal
import statistics
import time

import numpy as np
from onnx import TensorProto, helper

import ephost
from ephost import InferenceSession, SessionOptions


def model(size: int = 256):
    """Relu(x) + x on a size x size float tensor."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [size, size])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [size, size])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Add", ["r", "x"], ["y"], name="add")]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 18)])


def recovery_times(policy: str, kills: int) -> list[float]:
    x = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    expected = np.maximum(x, 0) + x
    times = []
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", "reference", {"crash_window_s": "0.5"})
        options = SessionOptions()
        options.ep_failure_policy = policy
        options.add_provider_for_devices(env.get_ep_devices())
        with InferenceSession(model(), options, env=env) as session:
            for _ in range(kills):
                session.run(None, {"x": x})
                process = env.registration("w").process
                start = time.perf_counter()
                os.kill(process.pid, signal.SIGKILL)
                while True:
                    try:
                        (y,) = session.run(None, {"x": x})
                        if np.allclose(y, expected):
                            break
                    except ephost.EpError:
                        pass
                times.append(time.perf_counter() - start)
                env.registration("w").link.wait_healthy(10)  # the next kill hits a running worker
                time.sleep(0.6)  # past the crash window: the next kill is a first crash again
    return times


def main(quick: bool = False) -> None:
    import logging
    logging.getLogger("ephost").setLevel(logging.CRITICAL)  # the kills are the point; their logs are noise
    kills = 3 if quick else 7
    print("Worker killed (SIGKILL) to the next correct result, per failure policy (median of "
          f"{kills} kills)\n")
    print("| policy | median | slowest |")
    print("|---|---|---|")
    for policy in ("raise", "retry", "fallback"):
        t = recovery_times(policy, kills)
        print(f"| {policy} | {statistics.median(t) * 1000:.0f} ms | {max(t) * 1000:.0f} ms |")
