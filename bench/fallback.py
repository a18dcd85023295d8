"""squeezenet (from the onnx package) after its EP crashed under ep_failure_policy="fallback": per-run time on
each CPU fallback beside ONNX Runtime's CPU EP in process, and the ratio. The chaos EP segfaults on its first
Compute with crash_limit 1, so the EP is marked failed and every later run is the fallback's."""
from __future__ import annotations


import onnx

import ephost
from ephost import InferenceSession, SessionOptions
from ephost.cli.run_command import bundled_input, bundled_model
from bench.session_overhead import side_by_side


def median_ms(run, n: int) -> float:
    return side_by_side({"run": run}, n)["run"] * 1000


def after_a_crash_ms(model: onnx.ModelProto, fallback: str, n: int) -> float:
    with ephost.Environment() as env:
        env.register_execution_provider_library("chaos", "chaos", {"fault": "segfault", "after": "1",
                                                                   "crash_limit": "1"})
        options = SessionOptions()
        options.ep_failure_policy, options.fallback = "fallback", fallback
        options.add_provider_for_devices(env.get_ep_devices())
        with InferenceSession(model, options, env=env) as session:
            feeds = {i.name: bundled_input(i) for i in session.get_inputs()}
            session.run(None, feeds)  # the crash: from here on the fallback runs every partition
            return median_ms(lambda: session.run(None, feeds), n)


def main(quick: bool = False) -> None:
    import logging
    import onnxruntime as ort
    logging.getLogger("ephost").setLevel(logging.CRITICAL)  # the crash is the point; its logs are noise
    path, _ = bundled_model("squeezenet")
    model = onnx.load(path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feeds = {i.name: bundled_input(i) for i in session.get_inputs()}
    n = 5 if quick else 30
    base = median_ms(lambda: session.run(None, feeds), n)
    print("squeezenet after its EP crashed (ep_failure_policy=fallback), median per run\n")
    print("| runs on | per run | vs ORT CPU in process |")
    print("|---|---|---|")
    print(f"| ORT CPU EP in process (baseline) | {base:.1f} ms | 1.0x |")
    for fallback, runs in (("onnxruntime", n), ("reference", 3)):
        t = after_a_crash_ms(model, fallback, runs)
        print(f"| fallback={fallback} | {t:.1f} ms | {t / base:.1f}x |")
