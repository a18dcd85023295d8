"""Time per run of the same model in process (ONNX Runtime) and out of process (ephost, the same EP in a
worker), measured side by side in one run: hot loops, interleaved in blocks, so that the machine's noise falls
on both alike. The tiny model's overhead per call in microseconds, against a hot in-process run; the CNNs' ratio
of out of process to in process, round by round (paired_ratio). Medians and ratios.

Both sides run ONNX Runtime with the same settings, thread spinning off: with it on, the threads of one side
spin after each run and take the cores the other side's next run needs, which measures the spinning.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping

import numpy as np
import onnx
import onnxruntime as ort

import ephost
from ephost import InferenceSession, SessionOptions
from ephost.eps.onnxruntime import readable_model
from ephost.cli.run_command import bundled_input, bundled_model
from ephost.v1 import common_pb2

CNNS = ["resnet50", "squeezenet", "shufflenet", "inception_v1", "densenet121"]
SESSION_CONFIG = {"session.intra_op.allow_spinning": "0"}


def tiny_model(width: int | str = 16) -> onnx.ModelProto:
    """One Add on 1 x `width` floats (a name: a symbolic dimension, the input's shape free to change)."""
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"], name="add")], "tiny", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def side_by_side(fns: dict, runs: int) -> dict[str, float]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def interleaved(fns: dict[str, Callable[[], object]], blocks: int, per_block: int) -> dict[str, float]:
    """Median seconds per call of each fn over all its blocks (interleaved_blocks)."""
    return medians(interleaved_blocks(fns, blocks, per_block))


def interleaved_blocks(fns: dict[str, Callable[[], object]], blocks: int, per_block: int,
                       settle: float = 0.0) -> dict[str, list[list[float]]]:
    """Seconds per call of each fn, block by block, run in hot blocks of `per_block` calls, the blocks
    interleaved: block i of every fn ran in round i, side by side.

    Each block starts with a few calls that are not counted, and the order of the fns turns by one every
    round: the first calls after another fn's block run on caches that block overran (for the CNNs, the first
    runs out of process after an in-process block were up to 19% slower), and a fixed order would charge that to
    whichever fn came after the same one every time. `settle`: seconds slept after each block, for what a block
    leaves running to stop (ORT's thread pool with its default spinning keeps a CPU for about 30 ms after a
    run) rather than take a CPU from the next block."""
    for fn in fns.values():
        for _ in range(max(3, per_block // 4)):
            fn()
    times: dict[str, list[list[float]]] = {name: [] for name in fns}
    clock = time.perf_counter
    order = list(fns)
    warm = max(1, per_block // 10)
    for _ in range(blocks):
        for name in order:
            fn, block = fns[name], []
            for _ in range(warm):
                fn()
            for _ in range(per_block):
                start = clock()
                fn()
                block.append(clock() - start)
            times[name].append(block)
            if settle:
                time.sleep(settle)
        order = order[1:] + order[:1]
    return times


def medians(blocks: dict[str, list[list[float]]]) -> dict[str, float]:
    """The median of all of each fn's times (interleaved_blocks)."""
    return {name: statistics.median(t for block in b for t in block) for name, b in blocks.items()}


def paired_ratio(blocks: dict[str, list[list[float]]], new: str, base: str) -> float:
    """The median over rounds of `new`'s block median over `base`'s in the same round (interleaved_blocks): the
    machine's mood, which moves by several percent from one second to the next on a shared host, falls on both
    blocks of a round alike, where a ratio of the two overall medians takes in how it moved between them."""
    return statistics.median(statistics.median(n) / statistics.median(b) for n, b in zip(blocks[new], blocks[base]))


def ep_targets(env) -> list[tuple[str, str]]:
    """(label, registration) of the EPs to compare: ORT's CPU EP, and OpenVINO where it has a device."""
    config = ";".join(f"{k}={v}" for k, v in SESSION_CONFIG.items())
    env.register_execution_provider_library("ort-cpu", "onnxruntime", {"session_config": config})
    targets = [("ORT CPU", "ort-cpu")]
    try:
        import onnxruntime_ep_openvino
        env.register_execution_provider_library("openvino", "onnxruntime", {
            "library": onnxruntime_ep_openvino.get_library_path(), "session_config": config})
        if any(d.registration_name == "openvino" for d in env.get_ep_devices()):
            targets.append(("OpenVINO", "openvino"))
        else:
            env.unregister_execution_provider_library("openvino")
    except ImportError:
        pass
    return targets


def in_process_session(model: onnx.ModelProto, label: str, config: Mapping[str, str] = SESSION_CONFIG):
    """ORT's own session of `model` on the EP of `label`, with these session config entries (ORT's defaults
    where there are none)."""
    data = readable_model(model).SerializeToString()
    options = ort.SessionOptions()
    for key, value in config.items():
        options.add_session_config_entry(key, value)
    if label == "OpenVINO":
        import onnxruntime_ep_openvino as ov
        if not any(d.ep_name == ov.get_ep_name() for d in ort.get_ep_devices()):  # once per process (ORT refuses more)
            ort.register_execution_provider_library("bench-openvino", ov.get_library_path())
        options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == ov.get_ep_name()], {})
        return ort.InferenceSession(data, options)
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def options_for(env, *registrations: str) -> SessionOptions:
    """SessionOptions with the devices of these registrations, in this order."""
    options = SessionOptions()
    for r in registrations:
        options.add_provider_for_devices([d for d in env.get_ep_devices() if d.registration_name == r])
    return options


def main(quick: bool = False) -> None:
    ort.set_default_logger_severity(3)
    runs = 20 if quick else 60
    cnn_runs = 10
    with ephost.Environment() as env:
        targets = ep_targets(env)
        conn = env.registration("ort-cpu").link.conn
        x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
        tiny = tiny_model()
        with InferenceSession(tiny, options_for(env, "ort-cpu"), env=env) as session:
            inproc = in_process_session(tiny, "ORT CPU")
            # Hot loops in interleaved blocks: alternating call by call inflates the in-process figure several
            # times over (each side finds its caches cold after the other ran) and hides the overhead.
            # The gRPC calls apart: blocks of them between the two would leave gRPC's threads busy on both sides.
            t = interleaved({"in process": lambda: inproc.run(None, {"x": x}),
                             "out of process": lambda: session.run(None, {"x": x})}, 4 if quick else 10, 1000)
            t.update(interleaved({"empty gRPC call": lambda: conn.call(conn.worker.GetInfo, common_pb2.Empty())},
                                 1, runs * 5))
        print("Tiny model (one Add on 16 floats), ORT CPU EP, median per run in hot loops (interleaved blocks)\n")
        print("| in process | out of process | overhead per call | of which an empty gRPC call |")
        print("|---|---|---|---|")
        print(f"| {t['in process'] * 1e6:.0f} µs | {t['out of process'] * 1e6:.0f} µs | "
              f"{(t['out of process'] - t['in process']) * 1e6:.0f} µs | {t['empty gRPC call'] * 1e6:.0f} µs |")

        print("\nCNNs from the onnx package, median per run (interleaved blocks), and out of process / in process with "
              "the same EP (the median of the ratios of each round's two blocks)\n")
        print("| model | EP | in process | out of process | ratio |")
        print("|---|---|---|---|---|")
        for name in CNNS[:2] if quick else CNNS:
            path, _ = bundled_model(name)
            model = onnx.load(path)
            for label, registration in targets:
                with InferenceSession(model, options_for(env, registration), env=env) as session:
                    (arg,) = session.get_inputs()
                    feeds = {arg.name: bundled_input(arg)}
                    inproc = in_process_session(model, label)
                    # Hot blocks, interleaved, as bench/data_plane.py measures them: run by run, each side would
                    # find its weights evicted by the other's ORT threads, not the hot baseline.
                    rounds = interleaved_blocks({"in": lambda: inproc.run(None, feeds),
                                                 "out": lambda: session.run(None, feeds)}, 4 if quick else 8, cnn_runs)
                t = medians(rounds)
                print(f"| {name} | {label} | {t['in'] * 1e3:.1f} ms | {t['out'] * 1e3:.1f} ms | "
                      f"{paired_ratio(rounds, 'out', 'in'):.3f} |")
        if len(targets) == 1:
            print("\nOpenVINO: its plugin library reports no device on this machine, so it is not in the table.")
