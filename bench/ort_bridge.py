"""ephost.ort, the bridge that makes ephost an ONNX Runtime plugin EP library: per-run time of an ORT session
whose nodes run in a worker (ORT's CPU EP hosted out of process, reached through the bridge) beside the same
model on ORT's CPU EP in process, hot loops of one session each (interleaved blocks), medians; and the bytes
the bridge copied per run (ORT's inputs into the worker's memory or the call, the outputs back into ORT's)."""
from __future__ import annotations

import logging

import onnxruntime as ort

import ephost
import ephost.ort
from bench.data_plane import interleaved
from bench.session_overhead import SESSION_CONFIG, tiny_model
from ephost.run_command import bundled_input, bundled_model


def session(model, bridged: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    for key, value in SESSION_CONFIG.items():
        options.add_session_config_entry(key, value)
    if bridged:
        options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == "bench_bridge"], {})
    else:
        options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == "CPUExecutionProvider"], {})
    s = ort.InferenceSession(model if isinstance(model, str) else model.SerializeToString(), options)
    s.disable_fallback()
    return s


def main(quick: bool = False) -> None:
    import numpy as np
    logging.getLogger("ephost").setLevel(logging.WARNING)
    # ORT thread spinning off in the worker too, as in this process (the data plane bench does the same)
    ephost.ort.register("bench_bridge", "onnxruntime",
                        {"session_config": ";".join(f"{k}={v}" for k, v in SESSION_CONFIG.items())})
    try:
        rows = []
        squeezenet, _ = bundled_model("squeezenet")
        for label, model, blocks, per_block in (("tiny (Add, 16 floats)", tiny_model(), 5 if quick else 20,
                                                  50 if quick else 200),
                                                 ("squeezenet", squeezenet, 3 if quick else 8, 3 if quick else 10)):
            alone, bridged = session(model, False), session(model, True)
            feeds = {i.name: (bundled_input(i) if isinstance(model, str) else np.ones((1, 16), np.float32))
                     for i in alone.get_inputs()}
            env = ephost.ort.environment("bench_bridge")  # the same worker, through ephost's own session
            options = ephost.SessionOptions()
            options.add_provider_for_devices(env.get_ep_devices())
            own = ephost.InferenceSession(model, options, env=env)
            before = ephost.ort.stats("bench_bridge")
            times = interleaved({"alone": lambda: alone.run(None, feeds), "bridge": lambda: bridged.run(None, feeds),
                                 "ephost": lambda: own.run(None, feeds)}, blocks, per_block)
            own.close()
            after = ephost.ort.stats("bench_bridge")
            runs = after.computes - before.computes
            copied = (after.bytes_in_copied - before.bytes_in_copied + after.bytes_out_copied -
                      before.bytes_out_copied) / max(runs, 1)
            rows.append((label, times["alone"], times["bridge"], times["ephost"], copied))
            del alone, bridged
        print("ORT session, nodes on ORT's CPU EP in process vs through ephost.ort into a worker hosting it; "
              "median per run\n")
        print("| model | ORT CPU EP in process | ORT + bridge | overhead per run | ratio | ephost session, same worker "
              "| bytes copied per run |")
        print("|---|---|---|---|---|---|---|")
        for label, t_alone, t_bridge, t_own, copied in rows:
            print(f"| {label} | {t_alone * 1e6:.1f} µs | {t_bridge * 1e6:.1f} µs | "
                  f"{(t_bridge - t_alone) * 1e6:.1f} µs | {t_bridge / t_alone:.2f}x | {t_own * 1e6:.1f} µs | "
                  f"{copied:,.0f} B |")
    finally:
        ephost.ort.unregister("bench_bridge")
