"""Paired A/B of two whole stacks: ephost as a git revision has it against the working tree, each stack its own
application process with its own workers, the two taking turns block by block on one workload.

    python bench/ab.py REV [tiny|chain|split|squeezenet|shufflenet|decoding|loop|pair|large] [--blocks N]
                       [--per N] [--option KEY=VALUE ...] [--binding[=worker]]

`--option` adds a registration option to the workload's EPs in both stacks (`--option kept_calls=false`: every
Compute sent whole). `--binding` runs the workload through an IOBinding (its feeds bound from the application every
run, its outputs bound to the application; not the decoding loop, which binds its state in the worker anyway);
`--binding=worker` binds its feeds once as tensors of the worker's memory (`bench dataplane`'s "input in the
worker" column: no input copied a run). `loop` is `bench iobinding`'s 4 KiB step bound to the device (its output a
new tensor in the worker each step, fed back), `pair` the same step with two tensors of the worker's bound as its
input and output, swapped each step. `split` is `bench dataplane`'s split chain (30 blocks, 61 partitions, one
worker keeping a value for its next partition each time: the plan's `keep`), reported per partition call as the
chain is. `large` is `bench dataplane`'s Neg(Relu(x)) on 1 MiB (its input staged in a buffer of the worker's, its
output left in one).
Nothing else may run on the machine meanwhile: one CPU-bound process, even at idle priority, changes what the
lane does (README, "Background load").

A change worth 1% of a run does not show in `bench dataplane` on a shared machine (its ratios swing from run to
run); the median of the per-block differences of two stacks running side by side, and in how many blocks the
working tree won, does. The spread of one such comparison is worth knowing first: the working tree against HEAD
with no change (an A/A) reads its noise, and a change's comparison is worth repeating before it is believed
(bench/RESULTS.md has both for this project's machines). The middle half of the per-block differences and a sign
test on the blocks won say how far one comparison stands from a coin. Half the blocks run on stacks started the
other way round: the stack started second can be the faster one with the same code.

Run as a script, not with -m: the revision's stack imports `ephost` from its own checkout (PYTHONPATH), which
the repository root on sys.path (as -m puts it there) would hide.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pyproject.toml's package-dir: the repository's top-level folders are the subpackages of `ephost`.
SUBPACKAGES = ("client", "server", "eps")
WORKLOADS = ("tiny", "chain", "split", "squeezenet", "shufflenet", "decoding", "loop", "pair", "large")
BOUND = ("loop", "pair")  # bench iobinding's loops, bound in the worker (timed per step, like the decoding loop)
DECODING_STEPS = 32  # a decoding run: bench dataplane's loop (its state bound in the worker), timed per step
SPLIT_BLOCKS = 30  # the split chain's blocks: 2 * 30 + 1 partitions


def checkout(rev: str, into: str) -> str:
    """The revision's `ephost` laid out as it is installed, under `into`: the folder to put on PYTHONPATH."""
    source = os.path.join(into, "source")
    os.makedirs(source)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", source], input=archive, check=True)
    package = os.path.join(into, "package")
    shutil.copytree(os.path.join(source, "ephost"), os.path.join(package, "ephost"))
    for name in SUBPACKAGES:
        shutil.copytree(os.path.join(source, name), os.path.join(package, "ephost", name))
    return package


def child(workload: str, per: int, options: dict[str, str], binding: str | None = None) -> None:
    """One stack: set up (its EPs registered with `options` too), then a block of `per` timed runs for every line
    read, its median printed (`binding`: runs through an IOBinding, its feeds bound every run ("cpu") or once in
    the worker ("worker"))."""
    import numpy as np
    import ephost
    from ephost import InferenceSession
    sys.path.append(ROOT)  # the bench's models and helpers; `ephost` is already this stack's
    try:
        import ephost.cli.run_command  # noqa: F401
    except ImportError:  # a revision from before the command line's own folder: the bench imports it by this name
        import importlib
        sys.modules["ephost.cli.run_command"] = importlib.import_module("ephost.run_command")  # (that revision's)
    from bench.data_plane import bound_input, chain_model, decode, decoding_model, large_model, split_model
    from bench.iobinding import NO_SPIN, alternating, bound_to_device, recurrent
    from bench.session_overhead import SESSION_CONFIG, options_for, tiny_model
    from ephost.cli.run_command import bundled_input, bundled_model

    config = ";".join(f"{k}={v}" for k, v in SESSION_CONFIG.items())
    env = ephost.Environment()
    if workload in ("chain", "split"):
        ops = ("Relu", "Neg") if workload == "chain" else ("Neg,Sub", "Relu")
        for op in ops:
            env.register_execution_provider_library(op, "reference", {"ops": op, **options})
        model = chain_model(60) if workload == "chain" else split_model(SPLIT_BLOCKS)
        session = InferenceSession(model, options_for(env, *ops), env=env)
        feeds = {"x": np.random.default_rng(1).standard_normal(16).astype(np.float32)}
    elif workload in BOUND:  # bench iobinding's session (ORT's threads not spinning, as there)
        env.register_execution_provider_library("ort", "onnxruntime", {"session_config": NO_SPIN, **options})
        session = InferenceSession(recurrent(256, 4), options_for(env, "ort"), env=env)
    else:
        env.register_execution_provider_library("ort", "onnxruntime", {"session_config": config, **options})
        model = tiny_model() if workload == "tiny" else decoding_model(64) if workload == "decoding" \
            else large_model() if workload == "large" else bundled_model(workload)[0]
        session = InferenceSession(model, options_for(env, "ort"), env=env)
        if workload != "decoding":
            (arg,) = session.get_inputs()
            feeds = {arg.name: np.random.default_rng(0).standard_normal(tuple(arg.shape)).astype(np.float32)
                     if workload in ("tiny", "large") else bundled_input(arg)}
    if workload == "decoding":
        (device,) = [d for d in env.get_ep_devices() if d.registration_name == "ort"]
        rows = np.random.default_rng(2).standard_normal((DECODING_STEPS, 1, 1, 64)).astype(np.float32)

        def run() -> None:
            decode(session, device, rows)
    elif workload in BOUND:
        (device,) = [d for d in env.get_ep_devices() if d.registration_name == "ort"]
        x0 = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
        run = bound_to_device(session, device, x0) if workload == "loop" else alternating(session, env, device, x0)
    elif binding == "worker":
        run = bound_input(env, session, "ort", feeds)
    elif binding:
        bound = session.io_binding()
        for output in session.get_outputs():
            bound.bind_output(output.name)

        def run() -> None:
            for name, value in feeds.items():
                bound.bind_cpu_input(name, value)
            session.run_with_iobinding(bound)
    else:
        def run() -> None:
            session.run(None, feeds)
    for _ in range(per):
        run()
    print(os.path.dirname(ephost.__file__), flush=True)
    for _ in sys.stdin:
        for _ in range(max(2, per // 5)):  # the other stack's block overran the caches: not counted
            run()
        times = []
        for _ in range(per):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        print(statistics.median(times), flush=True)
    session.close()
    env.close()


def compare(rev: str, workload: str, blocks: int, per: int, options: list[str] = (),
            binding: str | None = None) -> dict:
    """Both stacks' medians per block, and where each imported ephost from. Half the blocks are run by stacks
    started base first, half by two new stacks started the other way round: the order they start in can make one
    faster with the same code (bench/RESULTS.md)."""
    with tempfile.TemporaryDirectory(prefix="ephost-ab-") as scratch:
        package = checkout(rev, scratch)
        first = _compare(package, scratch, workload, (blocks + 1) // 2, per, ("base", "new"), options, binding)
        second = _compare(package, scratch, workload, blocks // 2, per, ("new", "base"), options, binding)
    return {"where": first["where"], "medians": {side: first["medians"][side] + second["medians"][side]
                                                 for side in first["medians"]}}


def _compare(package: str, scratch: str, workload: str, blocks: int, per: int, order: tuple[str, str],
             options: list[str], binding: str | None = None) -> dict:
    """Two stacks started in `order` (the revision's from `package`), taking turns for `blocks` blocks."""
    stacks = {}
    for side in order:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        if side == "base":
            env["PYTHONPATH"] = package
        stacks[side] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", workload, "--per", str(per),
             *(f"--option={o}" for o in options), *([f"--binding={binding}"] if binding else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=scratch, env=env)
    try:
        where = {side: p.stdout.readline().strip() for side, p in stacks.items()}
        failed = [side for side, w in where.items() if not w]
        if failed:
            for p in stacks.values():
                p.kill()
            raise SystemExit(f"bench/ab.py: the {' and the '.join(failed)} stack did not start (see the error above)")
        medians: dict[str, list[float]] = {side: [] for side in stacks}
        for block in range(blocks):
            for side in ("base", "new") if block % 2 else ("new", "base"):  # who goes first turns
                stacks[side].stdin.write("go\n")
                stacks[side].stdin.flush()
                medians[side].append(float(stacks[side].stdout.readline()))
    finally:
        for p in stacks.values():
            with contextlib.suppress(BrokenPipeError):
                p.stdin.close()
            p.wait(timeout=60)
    return {"where": where, "medians": medians}


def _option(text: str) -> str:
    if "=" not in text or not text.split("=", 1)[0]:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return text


def sign_test(wins: int, blocks: int) -> float:
    """Two-sided sign test: how often `blocks` blocks split at least as unevenly as `wins` against the rest where
    neither stack is faster (a coin per block)."""
    fewer = min(wins, blocks - wins)
    return min(1.0, 2 * sum(math.comb(blocks, i) for i in range(fewer + 1)) / 2 ** blocks)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python bench/ab.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", nargs="?", help="the git revision to compare the working tree with")
    parser.add_argument("workload", nargs="?", default="tiny", choices=WORKLOADS)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--per", type=int, default=0, help="timed runs per block (default: by workload)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", type=_option,
                        help="a registration option for the workload's EPs, in both stacks (repeatable)")
    parser.add_argument("--binding", nargs="?", const="cpu", choices=("cpu", "worker"),
                        help="run through an IOBinding, its feeds bound from here every run (cpu, the default) or "
                             "once in the worker (not the loops)")
    parser.add_argument("--child", metavar="WORKLOAD", choices=WORKLOADS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    per = args.per or (300 if (args.child or args.workload) in ("tiny", *BOUND) else 20)
    if args.child:
        child(args.child, per, dict(o.split("=", 1) for o in args.option), args.binding)
        return
    if not args.rev:
        parser.error("name a git revision to compare the working tree with (HEAD: an A/A, the noise)")
    if args.binding and args.workload in ("decoding", *BOUND):
        parser.error(f"the {args.workload} loop binds its state in the worker already: --binding is for the others")
    result = compare(args.rev, args.workload, args.blocks, per, args.option, args.binding)
    base, new = result["medians"]["base"], result["medians"]["new"]
    scale, unit = {"chain": (1 / 60, "µs per partition call"), "split": (1 / (2 * SPLIT_BLOCKS + 1),
                                                                        "µs per partition call"),
                   "decoding": (1 / DECODING_STEPS, "µs per step"),
                   **dict.fromkeys(BOUND, (1, "µs per step"))}.get(args.workload, (1, "µs per run"))
    diffs = [(n - b) * 1e6 * scale for n, b in zip(new, base)]
    wins = sum(d < 0 for d in diffs)
    quartiles = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else diffs * 3
    print(f"{args.rev}: ephost from {result['where']['base']}; working tree: {result['where']['new']}")
    how = {"cpu": ["through an IOBinding"], "worker": ["through an IOBinding, its input in the worker"]}
    with_options = f" ({', '.join(args.option + how.get(args.binding, []))})" \
        if args.option or args.binding else ""
    print(f"{args.workload}{with_options}, {args.blocks} blocks of {per}: {args.rev} "
          f"{statistics.median(base) * 1e6 * scale:.1f}, "
          f"working tree {statistics.median(new) * 1e6 * scale:.1f} {unit}; paired difference (working tree - "
          f"{args.rev}) median {statistics.median(diffs):+.1f} "
          f"(middle half {quartiles[0]:+.1f} to {quartiles[2]:+.1f}), "
          f"the working tree faster in {wins} of {len(diffs)} blocks (sign test p = {sign_test(wins, len(diffs)):.2g})")


if __name__ == "__main__":
    main()
