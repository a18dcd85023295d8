"""The data plane, side by side in one run: the same calls in process, over the fast lane (a unix
SOCK_SEQPACKET socket per calling thread, frames through shared slots; with `fast_lane_slots=false` every frame
on the socket; Computes and copies repeated as kept calls, and with `kept_calls=false` every call sent whole)
and over gRPC (`fast_lane=false`), each in hot loops, the loops interleaved in blocks (in, lane, gRPC, then
lane, gRPC, in, ...: the order turns every round, and each block's first calls are not counted) so that the
machine's noise falls on all alike without alternating call by call (which inflates the in-process figure
several times over).

- first, what the machine gives two processes right now: a bare round trip on such a socket, each end asleep
  in the kernel or polling, and through shared memory polling (the floor under what follows; it moves with the
  hypervisor and the load);
- tiny model (one Add on 16 floats, ORT CPU EP): overhead per call over a hot in-process ORT run, and what
  placing both processes on one core, or on two, does to it;
- the same Add on an input whose shape changes every run (a loop whose shapes grow: kept whatever its shapes);
- Neg(Relu(x)) on 1 MiB: an input and an output over the inline limit, each in a buffer of the worker's;
- a decoding loop: a state that grows every step, bound in the worker (IOBinding) and fed back as the next
  step's past, a small row from the application each step: per step, against the same loop on ORT in process;
- a 60-node chain whose nodes alternate between two workers (60 partitions): cost per partition call;
- the same split between two workers with one of them keeping a value for its next partition each time (a
  vendor EP's partitions on either side of one it does not take, a value of the first read by the second: the
  plan's `keep`): 30 blocks, 61 partitions, per partition call;
- squeezenet and shufflenet from the onnx package: out-of-process / in-process ratio, beside it the same run with
  its input in the worker's memory (IOBinding: nothing copied a run) and the floor, ORT's session in a plain
  child process run for a byte (what another process costs here before ephost does anything);
- CopyTensors of 4 KiB, 64 KiB and 1 MiB between two buffers of a worker: calls per second, and bytes per
  second against memcpy of the same size here.
"""
from __future__ import annotations

import contextlib
import glob
import mmap
import os
import select
import socket
import statistics
import subprocess
import sys
import time
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper

import ephost
from ephost import DeviceMemoryType, InferenceSession, Tensor
from ephost.cli.run_command import bundled_input, bundled_model
from bench.session_overhead import (SESSION_CONFIG, in_process_session, interleaved, interleaved_blocks, medians,
                                    options_for, paired_ratio, tiny_model)

CONFIG = ";".join(f"{k}={v}" for k, v in SESSION_CONFIG.items())
# The fast lane as it is (frames through shared slots, small Computes repeated as kept calls), the fast lane
# with every frame on its socket, the fast lane sending every Compute whole, and gRPC alone.
TRANSPORTS = {"lane": {}, "socket": {"fast_lane_slots": "false"}, "unkept": {"kept_calls": "false"},
              "grpc": {"fast_lane": "false"}}
CNNS = ("squeezenet", "shufflenet")
LABELS = {"in": "in process", "lane": "fast lane", "socket": "fast lane, socket only",
          "unkept": "fast lane, calls not kept", "grpc": "gRPC",
          "bound": "fast lane, input in the worker (IOBinding)", "floor": "ORT in a child process, a byte a run"}


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of a process onto these CPUs."""
    for task in glob.glob(f"/proc/{pid}/task/*"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(os.path.basename(task)), cpus)


def chain_model(n: int) -> onnx.ModelProto:
    """x -> Relu -> Neg -> Relu -> Neg ... (n nodes), on 16 floats."""
    names = ["x"] + [f"v{i}" for i in range(n - 1)] + ["y"]
    nodes = [helper.make_node("Relu" if i % 2 == 0 else "Neg", [names[i]], [names[i + 1]], name=f"n{i}")
             for i in range(n)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def tiny(env, blocks: int, per_block: int) -> None:
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    model = tiny_model()
    inproc = in_process_session(model, "ORT CPU")
    with contextlib.ExitStack() as stack:
        sessions = {k: stack.enter_context(InferenceSession(model, options_for(env, f"ort-{k}"), env=env))
                    for k in TRANSPORTS}
        fns = {"in": lambda: inproc.run(None, {"x": x}),
               **{k: (lambda s=s: s.run(None, {"x": x})) for k, s in sessions.items()}}
        t = interleaved(fns, blocks, per_block)
        print("Tiny model (one Add on 16 floats), ORT CPU EP: median per run, hot loops in interleaved blocks, "
              "and the overhead per call over the in-process run\n")
        _overheads(t)

        # Placement: both processes on one core, or each on its own (this machine has os.cpu_count() CPUs).
        worker = env.registration("ort-lane").process.pid
        everything = os.sched_getaffinity(0)
        if len(everything) >= 2:
            a, b = sorted(everything)[:2]
            rows = []
            for label, mine, theirs in (("unpinned", everything, everything), ("one core", {a}, {a}),
                                        ("two cores", {a}, {b})):
                pin(os.getpid(), mine)
                pin(worker, theirs)
                try:
                    p = interleaved({"in": fns["in"], "lane": fns["lane"]}, max(2, blocks // 2), per_block)
                finally:
                    pin(os.getpid(), everything)
                    pin(worker, everything)
                rows.append((label, p))
            print("\nPlacement of the application and the worker (fast lane, tiny model)\n")
            print("| placement | in process | fast lane | overhead per call |")
            print("|---|---|---|---|")
            for label, p in rows:
                print(f"| {label} | {p['in'] * 1e6:.1f} µs | {p['lane'] * 1e6:.1f} µs | "
                      f"{(p['lane'] - p['in']) * 1e6:.1f} µs |")


def changing(env, blocks: int, per_block: int, sizes: int = 400) -> None:
    """A loop whose input shape changes every run, as a decoding loop's grows: no call repeats as it was, so the
    lane keeps it whatever its shapes (a kept call takes inputs of any shape of its ranks)."""
    model = tiny_model("n")
    xs = [np.ones((1, n), np.float32) for n in range(1, sizes + 1)]
    inproc = in_process_session(model, "ORT CPU")
    with contextlib.ExitStack() as stack:
        sessions = {k: stack.enter_context(InferenceSession(model, options_for(env, f"ort-{k}"), env=env))
                    for k in ("lane", "unkept", "grpc")}
        step = dict.fromkeys(("in", *sessions), 0)

        def run(way: str, session) -> None:
            i = step[way] = (step[way] + 1) % sizes
            session.run(None, {"x": xs[i]})
        t = interleaved({"in": lambda: run("in", inproc), **{k: (lambda k=k, s=s: run(k, s))
                                                             for k, s in sessions.items()}}, blocks, per_block)
    print(f"\nA loop whose input shape changes every run (one Add on 1 x n floats, n going round {sizes} sizes), "
          "ORT CPU EP: median per run, and the overhead per call over the in-process run\n")
    _overheads(t)


def large_model(n: int = 1 << 18) -> onnx.ModelProto:
    """y = Neg(Relu(x)) on 1 x n floats (1 MiB by default): an input and an output over the inline limit, the
    input staged in a buffer of the worker's, the output left in one."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])]
    graph = helper.make_graph(nodes, "large", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def large(env, blocks: int, per_block: int) -> None:
    """Neg(Relu(x)) on 1 MiB: the input written into a buffer the calling thread keeps in the worker's shared
    memory, the output left in a new buffer there, which the application's array is a view of."""
    x = np.random.default_rng(3).standard_normal((1, 1 << 18)).astype(np.float32)
    model = large_model()
    inproc = in_process_session(model, "ORT CPU")
    with contextlib.ExitStack() as stack:
        sessions = {k: stack.enter_context(InferenceSession(model, options_for(env, f"ort-{k}"), env=env))
                    for k in TRANSPORTS}
        t = interleaved({"in": lambda: inproc.run(None, {"x": x}),
                         **{k: (lambda s=s: s.run(None, {"x": x})) for k, s in sessions.items()}},
                        blocks, max(2, per_block // 5))
    print("\nNeg(Relu(x)) on 1 MiB in and 1 MiB out (over the inline limit: the input staged in a buffer of the "
          "worker's, the output left in one), ORT CPU EP: median per run, and the overhead per call over the "
          "in-process run\n")
    _overheads(t)


def decoding_model(width: int) -> onnx.ModelProto:
    """A decoding step: the past (1 x t x width) with this step's row appended is the present (the state fed
    back); the step's score is the present's sum."""
    nodes = [helper.make_node("Concat", ["past", "row"], ["present"], name="append", axis=1),
             helper.make_node("ReduceSum", ["present"], ["score"], name="sum", keepdims=0)]
    inputs = [helper.make_tensor_value_info("past", TensorProto.FLOAT, [1, "t", width]),
              helper.make_tensor_value_info("row", TensorProto.FLOAT, [1, 1, width])]
    outputs = [helper.make_tensor_value_info("present", TensorProto.FLOAT, [1, "t1", width]),
               helper.make_tensor_value_info("score", TensorProto.FLOAT, [])]
    graph = helper.make_graph(nodes, "decode", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def decode(session, device, rows: np.ndarray) -> None:
    """One decoding loop of decoding_model through ephost, a step a row of `rows` (steps x 1 x 1 x width): an
    IOBinding keeps the present in the worker (`device`'s memory) and binds it as the next step's past."""
    binding = session.io_binding()
    binding.bind_cpu_input("past", np.zeros((1, 0, rows.shape[-1]), np.float32))
    binding.bind_output("present", device)
    binding.bind_output("score")
    for row in rows:
        binding.bind_cpu_input("row", row)
        session.run_with_iobinding(binding)
        binding.bind_ortvalue_input("past", binding.get_outputs()[0])


def decoding(env, blocks: int, per_block: int, steps: int = 32, width: int = 64) -> None:
    """A decoding loop of `steps` steps: in process, ORT's own loop (the present fed back as an array); through
    ephost, an IOBinding that keeps the present in the worker and binds it as the next past, as an application
    that keeps its state on the device does."""
    model = decoding_model(width)
    rows = np.random.default_rng(2).standard_normal((steps, 1, 1, width)).astype(np.float32)
    start = np.zeros((1, 0, width), np.float32)
    inproc = in_process_session(model, "ORT CPU")

    def in_process() -> None:
        past = start
        for row in rows:
            past, _ = inproc.run(None, {"past": past, "row": row})

    ways = ("lane", "unkept", "grpc")
    devices = {d.registration_name: d for d in env.get_ep_devices()}
    with contextlib.ExitStack() as stack:
        sessions = {k: stack.enter_context(InferenceSession(model, options_for(env, f"ort-{k}"), env=env))
                    for k in ways}
        t = interleaved({"in": in_process, **{k: (lambda s=sessions[k], d=devices[f"ort-{k}"]: decode(s, d, rows))
                                              for k in ways}}, blocks, max(2, per_block // steps))
    print(f"\nA decoding loop ({steps} steps; its state, 1 x t x {width} floats, growing a row a step and kept in the "
          "worker, bound as the next step's past): median per step, and the overhead per step over ORT's own "
          "loop in process\n")
    _overheads({k: v / steps for k, v in t.items()})


def split_model(blocks: int) -> onnx.ModelProto:
    """x -> Neg -> s0; s0 -> Relu -> r0; (s0, r0) -> Sub -> Neg -> s1 ... (`blocks` blocks), on 16 floats: with Neg
    and Sub in one worker and Relu in another, each of the first worker's partitions keeps its s for the next
    (`keep`), which the other's Relu reads between them (2 * blocks + 1 partitions)."""
    nodes, h = [], "x"
    for k in range(blocks):
        nodes += [helper.make_node("Neg", [h], [f"s{k}"], name=f"neg{k}"),
                  helper.make_node("Relu", [f"s{k}"], [f"r{k}"], name=f"relu{k}"),
                  helper.make_node("Sub", [f"s{k}", f"r{k}"], [f"h{k}" if k < blocks - 1 else "y"], name=f"sub{k}")]
        h = f"h{k}"
    graph = helper.make_graph(nodes, "split", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _overheads(t: dict[str, float]) -> None:
    """A table row of each way's median per run, and its overhead over the in-process run's."""
    print("| " + " | ".join(LABELS[k] for k in t) + " |")
    print("|" + "---|" * len(t))
    print("| " + " | ".join(f"{t[k] * 1e6:.1f} µs" + ("" if k == "in" else f" (+{(t[k] - t['in']) * 1e6:.1f})")
                            for k in t) + " |")


def chain(blocks: int, per_block: int, nodes: int = 60, split: bool = False) -> None:
    """The chain (`split`: split_model, of nodes / 2 blocks) per run and per partition call, each way."""
    model, ops = (split_model(nodes // 2), ("Neg,Sub", "Relu")) if split else (chain_model(nodes), ("Relu", "Neg"))
    x = np.random.default_rng(1).standard_normal(16).astype(np.float32)
    with ephost.Environment() as env:
        for transport, extra in (("in", None), *TRANSPORTS.items()):
            for i, op in enumerate(ops):
                target = "inproc:reference" if extra is None else "reference"
                env.register_execution_provider_library(f"{i}-{transport}", target, {"ops": op, **(extra or {})})
        sessions = {t: InferenceSession(model, options_for(env, f"0-{t}", f"1-{t}"), env=env)
                    for t in ("in", *TRANSPORTS)}
        try:
            partitions = len(sessions["lane"].get_provider_graph_assignment_info())
            t = interleaved({k: (lambda s=s: s.run(None, {"x": x})) for k, s in sessions.items()}, blocks,
                            max(2, per_block // 20))
        finally:
            for s in sessions.values():
                s.close()
    if split:
        print(f"\n{nodes // 2} blocks of Neg, Relu, Sub split between two reference workers ({partitions} partitions), "
              "the first keeping each block's Neg for its Sub (`keep`): median per run, and per partition call\n")
    else:
        print(f"\nA chain of {nodes} nodes alternating between two reference workers ({partitions} partitions): "
              "median per run, and per partition call\n")
    print("| | per run | per partition call | / in process |")
    print("|---|---|---|---|")
    for k in ("in", *TRANSPORTS):
        print(f"| {LABELS[k]} | {t[k] * 1e3:.2f} ms | {t[k] / partitions * 1e6:.0f} µs | {t[k] / t['in']:.2f} |")


def cnns(env, blocks: int, per_block: int) -> None:
    print("\nCNNs from the onnx package, ORT CPU EP: median per run, and out of process / in process (the median of "
          "the ratios of each round's two blocks). Beside the ways the fast lane goes: the fast lane's session run "
          "through an IOBinding with its input in a tensor of the worker's memory, put there once (no input copied "
          "a run, as in process), and the floor: ORT's session in a plain child process that holds "
          "its input and runs once for each byte it reads from a socket (nothing sent, framed or copied)\n")
    _cnn_table(env, blocks, per_block, {k: f"ort-{k}" for k in ("lane", "socket", "unkept", "grpc")}, SESSION_CONFIG,
               beside=True)


def cnns_with_ort_defaults(env, blocks: int, per_block: int) -> None:
    """The CNNs with ORT's default threading on both sides, where the table above has its spinning off."""
    print("\nThe same CNNs with ORT's default threading on both sides (its intra-op threads spinning between "
          "operators; in the worker they stop as each run ends, the onnxruntime EP's session.force_spinning_stop=1), "
          "each block followed by 50 ms for a spinning pool to stop: median per run, and out of process / in "
          "process\n")
    env.register_execution_provider_library("ort-defaults", "onnxruntime")
    try:
        _cnn_table(env, blocks, per_block, {"lane": "ort-defaults"}, {}, settle=0.05)
    finally:
        env.unregister_execution_provider_library("ort-defaults")


def _cnn_table(env, blocks: int, per_block: int, ways: dict[str, str], config: dict[str, str],
               settle: float = 0.0, beside: bool = False) -> None:
    """A row per CNN: ORT in process (with session config `config`) against each way (by its registration), and
    with `beside` the "lane" session with its input bound in the worker (`bound_input`) and the floor
    (`OneByteRuns`)."""
    columns = [*ways, *(("bound", "floor") if beside else ())]
    print("| model | in process | " + " | ".join(LABELS[k] for k in columns) + " | " +
          " | ".join(f"{LABELS[k]} / in" for k in columns) + " |")
    print("|---|---|" + "---|---|" * len(columns))
    for name, (t, ratios) in cnn_rows(env, blocks, per_block, ways, config, settle, beside).items():
        print(f"| {name} | {t['in'] * 1e3:.2f} ms | " + " | ".join(f"{t[k] * 1e3:.2f} ms" for k in columns) +
              " | " + " | ".join(f"{ratios[k]:.3f}" for k in columns) + " |")


def cnn_rows(env, blocks: int, per_block: int, ways: dict[str, str], config: dict[str, str], settle: float = 0.0,
             beside: bool = False) -> dict[str, tuple[dict[str, float], dict[str, float]]]:
    """Each CNN's median seconds per run of each way (and "in") and each way's ratio over in process
    (paired_ratio), as _cnn_table prints them."""
    rows = {}
    for name in CNNS:
        path, _ = bundled_model(name)
        model = onnx.load(path)
        inproc = in_process_session(model, "ORT CPU", config)
        with contextlib.ExitStack() as stack:
            sessions = {k: stack.enter_context(InferenceSession(model, options_for(env, r), env=env))
                        for k, r in ways.items()}
            (arg,) = sessions["lane"].get_inputs()
            feeds = {arg.name: bundled_input(arg)}
            fns = {"in": lambda: inproc.run(None, feeds),
                   **{k: (lambda s=s: s.run(None, feeds)) for k, s in sessions.items()}}
            if beside:
                fns["bound"] = bound_input(env, sessions["lane"], ways["lane"], feeds)
                fns["floor"] = stack.enter_context(OneByteRuns(name)).run
            rounds = interleaved_blocks(fns, blocks, per_block, settle)
        rows[name] = (medians(rounds), {k: paired_ratio(rounds, k, "in") for k in fns if k != "in"})
    return rows


def bound_input(env, session, registration: str, feeds: dict[str, np.ndarray]) -> Callable[[], list]:
    """Runs of `session` through an IOBinding whose inputs are tensors of its worker's device memory holding `feeds`
    (put there once, as ORT's `OrtValue.ortvalue_from_numpy(array, device)` does), its outputs bound to this process:
    a run with no input copied."""
    (device,) = [d for d in env.get_ep_devices() if d.registration_name == registration]
    allocator = env.allocator_for(device.memory_info(DeviceMemoryType.DEFAULT))
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, Tensor.from_numpy(array, allocator))
    for out in session.get_outputs():
        binding.bind_output(out.name, "cpu")

    def run() -> list:
        session.run_with_iobinding(binding)
        return binding.get_outputs()
    return run


# A child process holding ORT's session of a bundled model and its input, which runs it once for each byte it reads
# (asleep in recv between runs) and answers with a byte. Run from the repository's root (it imports bench).
_RUNS_ON_A_BYTE = """
import os, socket, onnx
from ephost.cli.run_command import bundled_input, bundled_model
from bench.session_overhead import in_process_session
session = in_process_session(onnx.load(bundled_model(os.environ["MODEL"])[0]), "ORT CPU")
feeds = {arg.name: bundled_input(arg) for arg in session.get_inputs()}
sock = socket.socket(fileno=int(os.environ["FD"]))
sock.send(b"r")
while sock.recv(1):
    session.run(None, feeds)
    sock.send(b"k")
"""


class OneByteRuns:
    """The floor under a CNN's run in another process: ORT's session (spinning off, as `SESSION_CONFIG`) in a plain
    child process that holds its input, run for a byte each time (`run`): two wakes of a process asleep, and nothing
    sent, framed, copied or checked."""

    def __init__(self, model: str):
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.process = subprocess.Popen([sys.executable, "-c", _RUNS_ON_A_BYTE], pass_fds=(theirs.fileno(),), cwd=root,
                                        env={**os.environ, "MODEL": model, "FD": str(theirs.fileno())},
                                        stdin=subprocess.DEVNULL)
        theirs.close()
        if self._sock.recv(1) != b"r":
            self.close()
            raise RuntimeError(f"the child process running {model} did not start")

    def run(self) -> None:
        self._sock.send(b"g")
        if not self._sock.recv(1):
            raise RuntimeError("the child process running the model ended")

    def close(self) -> None:
        self._sock.close()  # the child reads end of file and exits
        self.process.wait(10)

    def __enter__(self) -> "OneByteRuns":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def copies(env, blocks: int, per_block: int) -> None:
    print("\nCopyTensors between two buffers of a worker (shared memory -> its private memory): calls per "
          "second, and bytes per second against memcpy here\n")
    print("| size | memcpy | " + " | ".join(LABELS[t] for t in TRANSPORTS) + " | " +
          " | ".join(f"{LABELS[t]} / memcpy" for t in TRANSPORTS) + " |")
    print("|---|---|" + "---|" * 2 * len(TRANSPORTS))
    pairs = {}
    allocators = []
    for transport in TRANSPORTS:
        device = next(d for d in env.get_ep_devices() if d.registration_name == f"ort-{transport}")
        shared = env.create_shared_allocator(device, DeviceMemoryType.HOST_ACCESSIBLE)
        private = env.create_shared_allocator(device, DeviceMemoryType.DEFAULT)
        allocators.append(device)
        pairs[transport] = (shared, private)
    try:
        for size in (4 << 10, 64 << 10, 1 << 20):
            host_src, host_dst = np.ones(size, np.uint8), np.empty(size, np.uint8)
            tensors = {t: (Tensor.from_numpy(host_src, a), Tensor.empty((size,), np.uint8, b))
                       for t, (a, b) in pairs.items()}
            fns = {"in": lambda: np.copyto(host_dst, host_src)}
            for t, (src, dst) in tensors.items():
                fns[t] = lambda src=src, dst=dst: env.copy_tensors([src], [dst])
            r = interleaved(fns, blocks, per_block)
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            rates = [f"{size / r[k] / 1e9:.1f} GB/s" if k == "in" else f"{size / r[k] / 1e9:.2f} GB/s"
                     for k in r]
            print(f"| {label} | " + " | ".join(f"{1 / r[k] / 1e3:.1f} k/s, {rate}" for k, rate in zip(r, rates)) +
                  " | " + " | ".join(f"{r['in'] / r[t]:.4f}" for t in TRANSPORTS) + " |")
            for src, dst in tensors.values():
                src.release()
                dst.release()
    finally:
        for device in allocators:
            env.release_shared_allocator(device, DeviceMemoryType.HOST_ACCESSIBLE)
            env.release_shared_allocator(device, DeviceMemoryType.DEFAULT)


# A peer process that answers every packet with itself, on the socket it inherits (descriptor FD), reading
# either asleep in the kernel or polling (as the fast lane's readers do while frames keep coming); or, with
# MAP, every message put in shared memory (a u64 count, then 200 bytes; the reply's one page further), polling
# the count as the lane's readers poll their slot (the CPU yielded every 8th turn).
_ECHO = """
import mmap, os, select, socket
s = socket.socket(fileno=int(os.environ["FD"]))
if "MAP" in os.environ:
    m = mmap.mmap(int(os.environ["MAP"]), 8192)
    words, seen, turn = memoryview(m).cast("Q"), 0, 0
    while True:
        while words[0] == seen:
            turn += 1
            if not turn & 7:
                os.sched_yield()
        seen = words[0]
        if seen == 2 ** 64 - 1:
            break
        m[4096 + 8:4096 + 208] = m[8:208]
        words[512] = seen
p = select.poll()
p.register(s, select.POLLIN)
spin = os.environ["SPIN"] == "1"
while True:
    if spin:
        while not p.poll(0):
            os.sched_yield()
    m = s.recv(4096)
    if not m:
        break
    s.send(m)
"""


def _shared_round_trips(n: int) -> list[float]:
    """Round trips of 200 bytes through shared memory with a peer polling for them."""
    fd = os.memfd_create("bench-round-trip")
    os.ftruncate(fd, 8192)
    mapping = mmap.mmap(fd, 8192)
    words = memoryview(mapping).cast("Q")
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    peer = subprocess.Popen([sys.executable, "-c", _ECHO], pass_fds=(theirs.fileno(), fd),
                            env={**os.environ, "SPIN": "1", "FD": str(theirs.fileno()), "MAP": str(fd)},
                            stdin=subprocess.DEVNULL)
    theirs.close()
    os.close(fd)
    message, times, clock, yield_ = b"x" * 200, [], time.perf_counter, os.sched_yield
    try:
        for i in range(1, n + 1):
            start = clock()
            mapping[8:208] = message
            words[0] = i
            turn = 0
            while words[512] != i:
                turn += 1
                if not turn & 7:
                    yield_()
            bytes(mapping[4096 + 8:4096 + 208])
            times.append(clock() - start)
        words[0] = 2 ** 64 - 1
    finally:
        mine.close()
        peer.wait(10)
        words.release()
        mapping.close()
    return times


def round_trips(n: int) -> None:
    """What this machine gives two processes, measured now: the floor under every figure below (it moves with
    the machine's load and the hypervisor, run to run)."""
    rows = []
    for label, spin in (("asleep in recv", "0"), ("polling", "1")):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        peer = subprocess.Popen([sys.executable, "-c", _ECHO], pass_fds=(theirs.fileno(),),
                                env={**os.environ, "SPIN": spin, "FD": str(theirs.fileno())},
                                stdin=subprocess.DEVNULL)
        theirs.close()
        poll = select.poll()
        poll.register(mine, select.POLLIN)
        message, times = b"x" * 200, []
        try:
            for i in range(n):
                start = time.perf_counter()
                mine.send(message)
                if spin == "1":
                    while not poll.poll(0):
                        os.sched_yield()
                mine.recv(4096)
                times.append(time.perf_counter() - start)
        finally:
            mine.close()
            peer.wait(10)
        rows.append((f"socket, {label}", statistics.median(times[n // 10:])))
    times = _shared_round_trips(n)
    rows.append(("shared memory, polling", statistics.median(times[n // 10:])))
    print("A round trip of 200 bytes between two Python processes, on a SOCK_SEQPACKET socket or through shared "
          "memory, each end reading as below: median\n")
    print("| reader | round trip |")
    print("|---|---|")
    for label, t in rows:
        print(f"| {label} | {t * 1e6:.1f} µs |")
    print()


def main(quick: bool = False) -> None:
    import onnxruntime as ort
    ort.set_default_logger_severity(3)
    blocks, per_block = (4, 100) if quick else (10, 300)
    round_trips(2000 if quick else 20000)
    with ephost.Environment() as env:
        for transport, extra in TRANSPORTS.items():
            env.register_execution_provider_library(f"ort-{transport}", "onnxruntime",
                                                    {"session_config": CONFIG, **extra})
        tiny(env, blocks, per_block)
        changing(env, blocks, per_block)
        large(env, blocks, per_block)
        decoding(env, blocks, per_block)
        chain(blocks, per_block)
        chain(blocks, per_block, split=True)
        cnns(env, blocks if quick else 2 * blocks, 5 if quick else 20)  # rounds: the ratio's noise
        cnns_with_ort_defaults(env, blocks if quick else 2 * blocks, 5 if quick else 20)
        copies(env, blocks, per_block)
