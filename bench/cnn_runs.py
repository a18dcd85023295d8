"""The CNN rows of `bench dataplane` (the fast lane, its input in the worker, and the floor, each over ORT in
process) made again in several new Environments, one after another, with the median over the runs and how many
runs read over the target (1.05).

One run of those rows carries about three points of the host's noise (bench/RESULTS.md, "How far one run of the
CNN rows can be trusted": the two halves of one Environment differ as much as two Environments do, the floor of a
plain child process included), more than the room between the floor and the target. What says where the lane
stands is the median over many runs; this prints it, with each run beside it.
"""
from __future__ import annotations

import statistics

import ephost
from bench.data_plane import CNNS, CONFIG, LABELS, cnn_rows
from bench.session_overhead import SESSION_CONFIG

TARGET = 1.05
WAYS = ("lane", "bound", "floor")


def summary(runs: list[dict[str, dict[str, float]]]) -> dict[tuple[str, str], tuple[float, int]]:
    """For each (model, way): the median of its ratio over `runs` (each run: model -> way -> ratio over in
    process), and how many runs read over TARGET."""
    out = {}
    for model in runs[0]:
        for way in runs[0][model]:
            ratios = [run[model][way] for run in runs]
            out[(model, way)] = (statistics.median(ratios), sum(r > TARGET for r in ratios))
    return out


def measure(runs: int, blocks: int, per_block: int) -> list[dict[str, dict[str, float]]]:
    """`runs` runs of the CNN rows, each in a new Environment with a new onnxruntime worker: model -> way -> ratio."""
    out = []
    for _ in range(runs):
        with ephost.Environment() as env:
            env.register_execution_provider_library("ort-lane", "onnxruntime", {"session_config": CONFIG})
            rows = cnn_rows(env, blocks, per_block, {"lane": "ort-lane"}, SESSION_CONFIG, beside=True)
        out.append({model: {way: ratios[way] for way in WAYS} for model, (_, ratios) in rows.items()})
    return out


def table(runs: list[dict[str, dict[str, float]]]) -> list[str]:
    """The runs' ratios, a row each, then their medians and the count over TARGET (markdown lines)."""
    columns = [(model, way) for model in CNNS for way in WAYS]
    lines = ["| run | " + " | ".join(f"{model}: {LABELS[way]} / in" for model, way in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for i, run in enumerate(runs, 1):
        lines.append(f"| {i} | " + " | ".join(f"{run[model][way]:.3f}" for model, way in columns) + " |")
    totals = summary(runs)
    lines.append("| median | " + " | ".join(f"**{totals[c][0]:.3f}**" for c in columns) + " |")
    lines.append(f"| over {TARGET} | " + " | ".join(f"{totals[c][1]} of {len(runs)}" for c in columns) + " |")
    return lines


def main(quick: bool = False) -> None:
    import onnxruntime as ort
    ort.set_default_logger_severity(3)
    runs, blocks, per_block = (2, 4, 5) if quick else (10, 20, 20)
    print(f"\nsqueezenet and shufflenet, ORT CPU EP: bench dataplane's CNN rows made again in {runs} new Environments, "
          f"one after another ({blocks} rounds of {per_block} runs a way each): out of process / in process, each "
          f"run, the median over the runs, and how many runs read over {TARGET}\n")
    for line in table(measure(runs, blocks, per_block)):
        print(line)
