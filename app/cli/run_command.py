"""`ephost run [MODEL] [--ep TARGET [--option KEY=VALUE ...]] ... [--input NAME=FILE.npy ...]`.

Loads a model into an InferenceSession over the given EPs (default: OpenVINO's plugin EP in a worker, or ONNX
Runtime's CPU EP in a worker where OpenVINO has no device), feeds it the given inputs or random ones of the
declared shapes, and prints which EP got which nodes, the outputs and the time per run. Without MODEL it runs
the resnet50 that ships with the onnx package, checks it against the output shipped beside it, and times the
same model in this process under ONNX Runtime's CPU EP.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from ephost.errors import EpInvalidArgument, EpNotFound
from ephost.types import dtype_of

DEFAULT_MODEL = "resnet50"
MAX_ROWS = 40


@dataclass
class EpArg:
    target: str
    options: dict[str, str] = field(default_factory=dict)


class AddEp(argparse.Action):
    def __call__(self, parser, namespace, value, option_string=None):
        namespace.ep.append(EpArg(value))


class AddOption(argparse.Action):
    """--option KEY=VALUE belongs to the --ep before it."""

    def __call__(self, parser, namespace, value, option_string=None):
        key, sep, val = value.partition("=")
        if not sep or not key:
            parser.error(f"--option takes KEY=VALUE, got {value!r}")
        if not namespace.ep:
            parser.error("--option must follow the --ep it applies to")
        namespace.ep[-1].options[key] = val


class AddEnvironmentOption(argparse.Action):
    """--python/--requirements/--find-links/--no-index belong to the --ep before it, as its environment."""

    def __call__(self, parser, namespace, values, option_string=None):
        if not namespace.ep:
            parser.error(f"{option_string} must follow the --ep it applies to")
        key = self.dest
        options = namespace.ep[-1].options
        if self.nargs == 0:
            options[key] = "true"
        elif key == "python":
            options[key] = values
        else:  # one item a line, accumulated
            items = values if isinstance(values, list) else [values]
            options[key] = "\n".join(filter(None, [options.get(key, ""), *items]))


def add_environment_arguments(p, per_ep: type[argparse.Action] | None = None) -> None:
    """The options of a worker's own environment (WorkerEnvironment.OPTIONS), for `worker`, `devices`, `check`
    and `env create`; `run` passes its per-EP action, so that they belong to the --ep before them."""
    defaults = {"default": argparse.SUPPRESS} if per_ep else {}
    p.add_argument("--python", metavar="PATH", action=per_ep or "store", help="interpreter to run the worker with",
                   **defaults)
    p.add_argument("--requirements", nargs="+", metavar="SPEC", action=per_ep or "extend", **defaults,
                   help="pip requirements: run the worker in a virtual environment made (once) with them and ephost")
    p.add_argument("--find-links", dest="find_links", metavar="DIR", action=per_ep or "append", **defaults,
                   help="a folder or URL of wheels for pip, repeatable")
    if per_ep:
        p.add_argument("--no-index", dest="no_index", nargs=0, action=per_ep, **defaults,
                       help="pip uses no package index, only --find-links")
    else:
        p.add_argument("--no-index", dest="no_index", action="store_true",
                       help="pip uses no package index, only --find-links")


def environment_options(args) -> dict[str, str]:
    """The registration options (WorkerEnvironment.OPTIONS) that add_environment_arguments's flags give."""
    options = {}
    if args.python:
        options["python"] = args.python
    for key in ("requirements", "find_links"):
        if getattr(args, key):
            options[key] = "\n".join(getattr(args, key))
    if args.no_index:
        options["no_index"] = "true"
    return options


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a model across EPs and show who ran what",
                       description=__doc__.replace("`", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help=f"an .onnx file (default: the onnx package's {DEFAULT_MODEL})")
    p.add_argument("--ep", action=AddEp, default=[], metavar="TARGET",
                   help="an EP name, worker address or inproc:NAME; repeat to add EPs in order of preference")
    p.add_argument("--option", action=AddOption, metavar="KEY=VALUE", help="an option of the --ep before it")
    add_environment_arguments(p, AddEnvironmentOption)
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="an input from a .npy file")
    p.add_argument("--runs", type=int, default=10, help="timed runs after one warm-up (default 10)")
    p.add_argument("--on-failure", choices=["raise", "retry", "fallback"], default="raise",
                   help="what a failed EP call does: raise, retry once on the restarted worker, or run the "
                        "partition on the CPU fallback (default raise)")
    p.add_argument("--timeout", type=float, help="deadline of each Compute, in seconds")
    p.add_argument("--compare", action="store_true",
                   help="also time the model in this process: under OpenVINO's plugin EP where it ran by default, "
                        "else under ONNX Runtime's CPU EP")
    p.set_defaults(func=main)


def bundled_model(name: str) -> tuple[str, str]:
    """(model path, expected output path) of a model the onnx package ships with its output."""
    base = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", f"light_{name}")
    return base + ".onnx", base + "_output_0.pb"


def bundled_input(arg) -> np.ndarray:
    """The input the onnx package's model tests feed (their expected outputs were made from it)."""
    shape = tuple(d if isinstance(d, int) and d > 0 else 1 for d in arg.shape)
    n = int(np.prod(shape))
    return (np.arange(n).reshape(shape) / n).astype(np.float32)


def random_input(arg, rng: np.random.Generator) -> np.ndarray:
    if not arg.type.startswith("tensor("):
        raise EpInvalidArgument(f"input {arg.name!r} is of type {arg.type}; give it with --input")
    shape = [d if isinstance(d, int) and d > 0 else 1 for d in (arg.shape or [])]
    elem = onnx.TensorProto.DataType.Value(arg.type[len("tensor("):-1].upper())
    dtype = dtype_of(elem)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) > 0.5
    return rng.integers(0, 10, size=shape).astype(dtype)


def format_table(rows: list[list[str]]) -> str:
    """Rows of cells as aligned columns, the first row a header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ops(nodes) -> str:
    counts = Counter(n.op_type for n in nodes).most_common()
    text = ", ".join(f"{op} x{k}" for op, k in counts[:6])
    return text + (f" +{len(counts) - 6} more" if len(counts) > 6 else "")


def main(args) -> int:
    from ephost import Environment, InferenceSession, SessionOptions

    expected = None
    path = args.model
    if path is None:
        path, expected_path = bundled_model(DEFAULT_MODEL)
        expected = numpy_helper.to_array(onnx.load_tensor(expected_path))
    with Environment() as env:
        options = SessionOptions()
        options.ep_failure_policy = args.on_failure
        options.compute_timeout_s = args.timeout
        eps = args.ep or default_eps(env)
        add_eps(env, options, eps)
        with _progress(path) as shown:
            session = InferenceSession(path, options, env=env)
        with session:
            rng = np.random.default_rng(0)
            given = dict(_load_input(spec) for spec in args.input)
            feeds = {}
            for arg in session.get_inputs():
                if arg.name in given:
                    feeds[arg.name] = given[arg.name]
                elif expected is not None:
                    feeds[arg.name] = bundled_input(arg)
                else:
                    feeds[arg.name] = random_input(arg, rng)
            if not shown:  # (the progress began with it)
                print(f"model: {path}")
            rows = [["partition", "registration", "EP", "nodes", "ops"]]
            assigned = session.get_provider_graph_assignment_info()
            for i, sub in enumerate(assigned[:MAX_ROWS]):
                rows.append([str(i), sub.registration, sub.ep_name, str(len(sub.nodes)), _ops(sub.nodes)])
            print(format_table(rows))
            if len(assigned) > MAX_ROWS:
                print(f"... and {len(assigned) - MAX_ROWS} more partitions")
            start = time.perf_counter()
            outputs = session.run(None, feeds)
            first = time.perf_counter() - start
            times = []
            for i in range(max(args.runs, 0)):
                start = time.perf_counter()
                try:
                    outputs = session.run(None, feeds)
                finally:
                    _show_failures(session, i + 2)
                times.append(time.perf_counter() - start)
            print("outputs:")
            for arg, value in zip(session.get_outputs(), outputs):
                shape = f"{value.dtype}{list(value.shape)}" if isinstance(value, np.ndarray) else type(value).__name__
                print(f"  {arg.name}  {shape}")
            ok = True
            if expected is not None:
                diff = float(np.max(np.abs(outputs[0] - expected)))
                ok = bool(np.allclose(outputs[0], expected, rtol=1e-3, atol=1e-5))
                print(f"  {'matches' if ok else 'DIFFERS FROM'} the expected output shipped with the model "
                      f"(max abs difference {diff:.2e})")
            median = statistics.median(times) if times else first
            print(f"time per run: {_ms(median)} median of {len(times)} runs (first run {_ms(first)})")
            if not args.model or args.compare:
                # The same EP in process where the run took OpenVINO by default: the ratio is then ephost's.
                plugin = _openvino() if not args.ep and eps == [EpArg("openvino")] else None
                baseline = in_process_ort(path, feeds, max(args.runs, 1), plugin)
                if baseline is not None:
                    label = "OpenVINO's plugin EP" if plugin else "ONNX Runtime's CPU EP"
                    print(f"in process, {label}: {_ms(baseline)} median; "
                          f"out of process / in process: {median / baseline:.2f}")
    return 0 if ok else 1


# Models with more bytes than this (the file and its external data) show progress while the session is made.
BIG_MODEL_BYTES = 256 << 20


@contextlib.contextmanager
def _progress(path: str):
    """For a big model: the session's steps (read the graph, ask each EP, compile) as they happen, timed. Yields
    whether it shows them."""
    from ephost.external_data import external_refs
    try:
        total = os.path.getsize(path)
        if total < BIG_MODEL_BYTES:  # a small file: its graph is cheap to read, to add its external data's size
            folder = os.path.dirname(os.path.abspath(path))
            files = {r.location for _, r in external_refs(onnx.load(path, load_external_data=False))}
            total += sum(os.path.getsize(os.path.join(folder, f)) for f in files
                         if os.path.isfile(os.path.join(folder, f)))
    except Exception:  # the session itself says what is wrong with the model
        total = 0
    if total < BIG_MODEL_BYTES:
        yield False
        return
    print(f"model: {path} ({total / (1 << 30):.2f} GiB with its external data); making the session:", flush=True)
    start = time.perf_counter()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_Elapsed(start))
    logger = logging.getLogger("ephost.client.session_plan")  # the session says how its making goes
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # each step once, here, not again in the log
    try:
        yield True
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
    print(f"  [{time.perf_counter() - start:6.2f} s] session ready", flush=True)


class _Elapsed(logging.Formatter):
    def __init__(self, start: float):
        super().__init__()
        self._start = start

    def format(self, record) -> str:
        return f"  [{time.perf_counter() - self._start:6.2f} s] {record.getMessage()}"


def _show_failures(session, run: int) -> None:
    """Print what the session's failure policy did in this run (a crash, a restart, a fallback)."""
    for entry in session.run_log:
        if entry["run"] == run and not entry.get("shown"):
            entry["shown"] = True
            error = f": {entry['error']}" if entry["error"] else ""
            print(f"run {run}: {entry['registration']} {entry['what']} {entry['event']}{error}")


def add_eps(env, options, eps: list[EpArg]) -> None:
    """Register each `--ep` (a target given twice gets a second registration, `target#i`) and use its devices in
    `options`, in the order given."""
    for i, ep in enumerate(eps):
        name = ep.target if ep.target not in [e.target for e in eps[:i]] else f"{ep.target}#{i}"
        if not env.is_registered(name):
            env.register_execution_provider_library(name, ep.target, ep.options)
        devices = [d for d in env.get_ep_devices() if d.registration_name == name]
        if not devices:
            raise EpNotFound(f"{ep.target} reports no device on this machine")
        options.add_provider_for_devices(devices)


def _openvino() -> tuple[str, str] | None:
    """(library path, EP name) of OpenVINO's plugin EP, where it is installed."""
    try:
        import onnxruntime_ep_openvino
    except ImportError:
        return None
    return onnxruntime_ep_openvino.get_library_path(), onnxruntime_ep_openvino.get_ep_name()


def default_eps(env) -> list[EpArg]:
    """OpenVINO's plugin EP in a worker where it runs on this machine; ONNX Runtime's CPU EP where not."""
    openvino = _openvino()
    if openvino is None:
        print("OpenVINO EP: not installed (pip install 'ephost[openvino]'); using ONNX Runtime's CPU EP")
        return [EpArg("onnxruntime")]
    env.register_execution_provider_library("openvino", openvino[0])
    if any(d.registration_name == "openvino" for d in env.get_ep_devices()):
        return [EpArg("openvino")]
    env.unregister_execution_provider_library("openvino")
    from ephost.eps.host import cpu_device
    vendor = cpu_device().vendor
    print(f"OpenVINO EP: its library loads but reports no device here (it takes Intel devices; this CPU is "
          f"{vendor}); using ONNX Runtime's CPU EP")
    return [EpArg("onnxruntime")]


def in_process_ort(path: str, feeds: dict, runs: int, plugin: tuple[str, str] | None = None) -> float | None:
    """Median seconds per run of the same model in this process under ONNX Runtime's CPU EP, or under a plugin
    EP (`plugin`: its library's path and its EP's name; OpenVINO's) with ORT's CPU EP for what it does not take."""
    try:
        import onnxruntime as ort
        from ephost.eps.onnxruntime import readable_model
    except ImportError:
        return None
    options = ort.SessionOptions()
    # ORT's own warnings (unused initializers...) would land in the middle of the table: errors only, unless
    # the user asked for detail (--verbose).
    options.log_severity_level = 2 if logging.getLogger().isEnabledFor(logging.INFO) else 3
    providers = ["CPUExecutionProvider"]
    if plugin is not None:
        library, ep_name = plugin
        if not any(d.ep_name == ep_name for d in ort.get_ep_devices()):  # once per process (ORT refuses more)
            ort.register_execution_provider_library("ephost-run-baseline", library)
        options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == ep_name], {})
        providers = None
    session = ort.InferenceSession(readable_model(onnx.load(path)).SerializeToString(), options,
                                   providers=providers)
    session.run(None, feeds)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _load_input(spec: str) -> tuple[str, np.ndarray]:
    name, sep, path = spec.partition("=")
    if not sep:
        raise EpInvalidArgument(f"--input takes NAME=FILE.npy, got {spec!r}")
    try:
        return name, np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise EpInvalidArgument(f"cannot read input {name!r} from {path}: {e}") from None

