"""Compile against restore, per EP: the worker's time in Compile for a model's partitions compiled from their
nodes, and for the same partitions restored from the EPContext nodes of the context model ephost wrote for them
(ep.context_enable); medians of repeated session creations, each on the same running worker. Models are the
onnx package's, their weights (made there by ConstantOfShape) folded into initializers first by ORT's basic,
hardware-independent optimizations, so that the source model and the compiled form both carry the weights.

What a compiled form is, per EP: for the onnxruntime EP on ORT's CPU EP, the graph-optimized partition model
(ORT's optimized_model_filepath); restoring loads it with graph optimization off, so it saves the optimization
passes (constant folding, fusions), not kernel creation. For the reference EP, the partition cut out as a model;
restoring saves only the cut. A vendor EP with a real compile (ORT's EPContext, as OpenVINO makes) saves more."""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import ephost
from ephost import InferenceSession
from ephost.cli.run_command import bundled_model
from bench.session_overhead import options_for


def compile_seconds(env, name: str) -> float:
    stats = env.get_worker_stats(name)
    return sum(m.total_s for key, m in stats.methods.items() if key.endswith("Compile"))


def session_compile(env, name: str, path: str, config: dict[str, str] | None = None) -> tuple[float, float]:
    """(seconds the worker spent in Compile, seconds the session took to create) for one session of `path`."""
    options = options_for(env, name)
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    before = compile_seconds(env, name)
    start = time.perf_counter()
    with InferenceSession(path, options, env=env):
        created = time.perf_counter() - start
    return compile_seconds(env, name) - before, created


def with_weights(model: str, directory: str) -> str:
    """The bundled model with its ConstantOfShape weights folded into initializers (ORT, basic level)."""
    import onnxruntime as ort
    path = os.path.join(directory, f"{model}.onnx")
    if not os.path.exists(path):
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = path
        ort.InferenceSession(bundled_model(model)[0], options, providers=["CPUExecutionProvider"])
    return path


def measure(target: str, options: dict[str, str], model: str, n: int, directory: str) -> dict[str, float]:
    path = with_weights(model, directory)
    context = os.path.join(directory, f"{model}_{target}_ctx.onnx")
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", target, options)
        session_compile(env, "w", path, {"ep.context_enable": "1", "ep.context_file_path": context})
        compiled = [session_compile(env, "w", path) for _ in range(n)]
        restored = [session_compile(env, "w", context) for _ in range(n)]
        stats = env.get_worker_stats("w")
        assert stats.partitions_restored >= n, "the context model's partitions were restored"
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
               if f.startswith(f"{model}_{target}_ctx_"))
    return {"compile": statistics.median(c for c, _ in compiled), "restore": statistics.median(r for r, _ in restored),
            "create_compile": statistics.median(t for _, t in compiled),
            "create_restore": statistics.median(t for _, t in restored), "bytes": size}


def main(quick: bool = False) -> None:
    import logging
    logging.getLogger("ephost").setLevel(logging.ERROR)
    n = 3 if quick else 7
    cases = [("onnxruntime", {}, "squeezenet"), ("onnxruntime", {}, "resnet50"), ("onnxruntime", {}, "inception_v1"),
             ("reference", {}, "squeezenet")]
    if quick:
        cases = cases[:1] + cases[-1:]
    print(f"Compile vs restore from an EPContext node, per EP (worker time in Compile, and session creation; "
          f"median of {n})\n")
    print("| EP | model | compile | restore | restore / compile | session, compiled | session, restored | "
          "model | compiled form |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="ephost-bench-ctx-") as directory:
        for target, options, model in cases:
            r = measure(target, options, model, n, directory)
            ep = "onnxruntime (ORT CPU)" if target == "onnxruntime" else target
            print(f"| {ep} | {model} | {r['compile'] * 1000:.0f} ms | {r['restore'] * 1000:.0f} ms | "
                  f"{r['restore'] / r['compile']:.2f} | {r['create_compile'] * 1000:.0f} ms | "
                  f"{r['create_restore'] * 1000:.0f} ms | "
                  f"{os.path.getsize(with_weights(model, directory)) / 2**20:.1f} MiB | {r['bytes'] / 2**20:.1f} MiB |")
