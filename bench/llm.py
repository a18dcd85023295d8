"""LLM decoding through the ORT bridge: onnxruntime-genai's greedy decoding of the tiny decoder of
tests/llm_fixture.py (GroupQueryAttention, the KV cache shared between past and present), genai with ORT's CPU EP
in process beside genai with its decoder in a worker (ephost.ort, a worker hosting ORT's CPU EP), at a few
contexts (genai's max_length: its KV cache is allocated at that length). A block is one generation: a prompt that
fills the context but for the last tokens, then those tokens, each step timed (generate_next_token, which runs the
decoder once); blocks of the two sides interleaved, medians of the steps. Beside them, what `ephost.ort.stats`
counted per step: the bytes the bridge copied in (genai's inputs, its KV cache among them, toward the worker) and
out (the worker's outputs into genai's tensors), and the share of Computes the worker ran as repeats of a kept call
(the fast lane's prepared calls: only what changed crosses)."""
from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time

import ephost.ort
from bench.session_overhead import SESSION_CONFIG

NAME = "bench_llm"


def _steps(model, prompt: list[int], steps: int, counted: list | None = None) -> list[float]:
    """Seconds of each decoding step of one generation (the prompt's run not among them); `counted`: the bridge's
    counts over those steps appended to it."""
    import onnxruntime_genai as og
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + steps)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    generator.generate_next_token()  # runs nothing: the prompt's run made its logits
    before = _counts()
    times = []
    clock = time.perf_counter
    while not generator.is_done():
        start = clock()
        generator.generate_next_token()
        times.append(clock() - start)
    if counted is not None:
        counted.append((before, _counts()))
    del generator, params
    return times


def _counts() -> dict[str, int]:
    """The bridge's counts, and the worker's repeats of kept calls (the fast lane's prepared calls)."""
    crossed = ephost.ort.stats(NAME)
    worker = ephost.ort.environment(NAME).get_worker_stats(NAME)
    return {"computes": crossed.computes, "bytes_in_copied": crossed.bytes_in_copied,
            "bytes_out_copied": crossed.bytes_out_copied, "kept_calls": worker.kept_calls}


def measure(folder: str, context: int, steps: int, blocks: int) -> dict:
    """Per-step medians in process and through the bridge, and the bridge's counts per step."""
    import onnxruntime_genai as og
    from tests import llm_fixture
    prompt = llm_fixture.prompt(context - steps)
    alone = og.Model(og.Config(folder))
    config = og.Config(folder)
    config.clear_providers()
    config.append_provider(NAME)
    bridged = og.Model(config)
    _steps(alone, prompt, steps), _steps(bridged, prompt, steps)  # warm: compiled, allocated, mapped
    times: dict[str, list[float]] = {"alone": [], "bridge": []}
    counted: list = []
    for i in range(blocks):
        for side in (("alone", "bridge") if i % 2 else ("bridge", "alone")):
            times[side] += _steps(alone if side == "alone" else bridged, prompt, steps,
                                  counted if side == "bridge" else None)
    del alone, bridged
    runs = sum(after["computes"] - before["computes"] for before, after in counted) or 1
    per_run = {what: sum(after[what] - before[what] for before, after in counted) / runs
               for what in ("bytes_in_copied", "bytes_out_copied", "kept_calls")}
    return {"context": context, "alone": statistics.median(times["alone"]),
            "bridge": statistics.median(times["bridge"]), "in": per_run["bytes_in_copied"],
            "out": per_run["bytes_out_copied"], "repeats": per_run["kept_calls"]}


def main(quick: bool = False) -> None:
    import onnxruntime_genai as og
    from tests import llm_fixture
    logging.getLogger("ephost").setLevel(logging.WARNING)
    # The worker's ORT with the threads genai gives its own session (half the cores, at most 16), as in process
    threads = min(max(1, (os.cpu_count() or 2) // 2), 16)
    config = ";".join(f"{k}={v}" for k, v in SESSION_CONFIG.items())
    ephost.ort.register(NAME, "onnxruntime", {"intra_op_num_threads": str(threads), "session_config": config})
    og.register_execution_provider_library(NAME, ephost.ort.library_path())
    try:
        rows = []
        steps, blocks = (8, 3) if quick else (32, 9)
        with tempfile.TemporaryDirectory() as folder:
            llm_fixture.write(folder, max_length=1024)
            for context in (128, 1024):
                rows.append(measure(folder, context, steps, blocks))
        shape = llm_fixture.Shape()
        print(f"onnxruntime-genai greedy decoding, tiny decoder ({shape.layers} layers, {shape.kv_heads} KV heads of "
              f"{shape.head_size}, fp32, KV cache shared past/present), ORT's CPU EP in process vs through ephost.ort "
              "into a worker hosting it; median per token\n")
        print("| context (max_length) | KV cache | genai in process | genai + bridge | overhead per token | ratio "
              "| bytes copied in per token | bytes copied out per token | kept-call repeats |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['context']} | {shape.kv_bytes(r['context']):,} B | {r['alone'] * 1e6:.0f} µs | "
                  f"{r['bridge'] * 1e6:.0f} µs | {(r['bridge'] - r['alone']) * 1e6:.0f} µs | "
                  f"{r['bridge'] / r['alone']:.2f}x | {r['in']:,.0f} B | {r['out']:,.0f} B | {r['repeats']:.0%} |")
    finally:
        og.unregister_execution_provider_library(NAME)
        ephost.ort.unregister(NAME)
