"""The `ephost` command: `worker` serves an EP, `devices` lists a target's EP devices, `check` proves a
target end to end (devices, a shared allocator, a tensor copied in and back), `env` makes, lists and removes
workers' own environments."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import time

import numpy as np

from ephost.errors import EpError
from ephost.progress import ATTRIBUTE as PROGRESS
from ephost.wire import MAX_GRACE_S, MAX_SEND_TIMEOUT_S, MAX_SPIN_S, SEND_TIMEOUT_S, SPIN_S

log = logging.getLogger(__name__)
from ephost.cli.run_command import add_environment_arguments, environment_options, format_table


def _options(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"ephost: --option takes KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


class JsonFormatter(logging.Formatter):
    """Structured logs: one JSON object per record (a progress record's state under "progress")."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"), "level": record.levelname,
                 "logger": record.name, "pid": record.process, "message": record.getMessage()}
        state = getattr(record, PROGRESS, None)
        if state is not None:
            entry["progress"] = {"done": state.done, "total": state.total, "finished": state.finished}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class ConsoleHandler(logging.StreamHandler):
    """Logs on stderr, a line each; on a terminal, progress records (ephost.progress) redraw one line instead, a
    bar where the total is known."""

    BAR = 30

    def __init__(self, stream, formatter: logging.Formatter):
        super().__init__(stream)
        self.setFormatter(formatter)
        self._drawing = not isinstance(formatter, JsonFormatter) and stream.isatty()
        self._open = False  # a progress line is on screen, not ended

    def emit(self, record: logging.LogRecord) -> None:
        state = getattr(record, PROGRESS, None)
        if state is None or not self._drawing:
            if self._open:
                self.stream.write("\n")
                self._open = False
            super().emit(record)
            return
        if state.total:
            filled = self.BAR * state.done // state.total
            line = f"{state.what} [{'#' * filled}{'.' * (self.BAR - filled)}] {100 * state.done // state.total:3d}% " \
                   f"{state.done >> 20}/{state.total >> 20} MiB {state.elapsed_s:.0f} s"
        else:
            line = f"{state.what} ({state.elapsed_s:.0f} s) {'done' if state.finished else state.note}"
        self.stream.write("\r\x1b[K" + line[:200] + ("\n" if state.finished else ""))
        self._open = not state.finished
        self.flush()


# Set in the environment of a worker re-run inside its own environment, which then takes it as it is. A flag in
# the environment, not an edit of the command line: argparse accepts abbreviated flags, which an edit would miss.
IN_WORKER_ENV = "EPHOST_IN_WORKER_ENV"


def cmd_worker(args) -> int:
    from ephost.server.main import parse_listen, serve
    from ephost.worker_env import WorkerEnvironment

    environment = None if os.environ.get(IN_WORKER_ENV) else WorkerEnvironment.take(environment_options(args))
    if environment is not None and not environment.is_default:
        # The worker runs inside its environment: this process becomes it.
        python = environment.interpreter()
        log.info("running the worker with %s", python)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(python, [python, "-m", "ephost", *args.argv], {**os.environ, IN_WORKER_ENV: "1"})
    from ephost.server.security import Security

    security = Security(args.tls_cert, args.tls_key, args.tls_client_ca, args.token_file)
    # A worker its launcher supervises lives and dies with that one client; one that serves others releases
    # the handles of clients that go silent.
    lease = args.client_lease_s if args.client_lease_s is not None else (0.0 if args.exit_with_parent else 60.0)
    return serve(args.ep, _options(args.option), parse_listen(args.listen, args.insecure, security.tls),
                 exit_with_parent=args.exit_with_parent, max_message=args.max_message_mb << 20, security=security,
                 client_lease_s=lease, max_alloc_bytes=(args.max_alloc_mb << 20) if args.max_alloc_mb else None,
                 drain_grace_s=args.drain_grace_s, cache_dir=args.cache_dir,
                 cache_max_bytes=args.cache_max_mb << 20, model_dir=args.model_dir,
                 lane_spin_s=args.lane_spin_us * 1e-6, metrics_listen=args.metrics_listen,
                 send_timeout_s=args.send_timeout_s)


def _grace(text: str) -> float:
    seconds = float(text)
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_GRACE_S):
        raise argparse.ArgumentTypeError(f"must be between 0 and {MAX_GRACE_S:g} seconds")
    return seconds


def _spin(text: str) -> float:
    microseconds = float(text)
    if not (math.isfinite(microseconds) and 0 <= microseconds <= MAX_SPIN_S * 1e6):
        raise argparse.ArgumentTypeError(f"must be between 0 and {MAX_SPIN_S * 1e6:g} microseconds")
    return microseconds


def _send_timeout(text: str) -> float:
    seconds = float(text)
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_SEND_TIMEOUT_S):
        raise argparse.ArgumentTypeError(f"must be over 0 and at most {MAX_SEND_TIMEOUT_S:g} seconds")
    return seconds


def _registered(args):
    from ephost import Environment

    env = Environment()
    try:
        env.register_execution_provider_library("target", args.target,
                                                {**_options(args.option), **environment_options(args)})
    except BaseException:
        env.close()
        raise
    return env


def cmd_devices(args) -> int:
    with _registered(args) as env:
        rows = [["EP", "EP vendor", "device", "vendor", "vendor id", "device id", "memory", "metadata"]]
        for d in env.get_ep_devices():
            memory = ", ".join(f"{m.name.split(':', 1)[1]} ({m.device_mem_type.name})"
                               for m in map(d.memory_info, (0, 5)) if m is not None)
            metadata = ", ".join(f"{k}={v}" for k, v in sorted({**d.ep_metadata, **d.device.metadata}.items()))
            rows.append([d.ep_name, d.ep_vendor, d.device.type.name, d.device.vendor, f"0x{d.device.vendor_id:04x}",
                         str(d.device.device_id), memory, metadata])
        print(format_table(rows))
    return 0


# "(default X)", "(default: X)", "(ORT's default: X)" in an option's meaning: its default, shown on its own.
_DEFAULT = re.compile(r"\s*\(([^()]*?)default:? ([^()]*)\)")


def _option_rows(ep: str, options: dict[str, str]) -> list[list[str]]:
    rows = []
    for name, meaning in options.items():
        found = _DEFAULT.search(meaning)
        default = "-"
        if found:
            default = f"{found.group(2)} ({found.group(1).strip()})" if found.group(1).strip() else found.group(2)
            meaning = (meaning[:found.start()] + meaning[found.end():]).strip()
        rows.append([ep, name, default, meaning])
    return rows


def cmd_eps(args) -> int:
    """The EPs installed here (the `ephost.eps` entry points), their options and defaults, and the options every
    registration takes beside them."""
    from ephost.client.connection import Credentials
    from ephost.client.supervisor import SupervisionPolicy
    from ephost.eps import installed_eps
    from ephost.worker_env import WorkerEnvironment

    eps = installed_eps()
    print(format_table([["EP", "package", "what it is"], *([e.name, e.distribution, e.summary] for e in eps)]))
    rows = [["EP", "option", "default", "meaning"]]
    for e in eps:
        if e.options is None:
            rows.append([e.name, "?", "-", "its factory does not list its options"])
        rows += _option_rows(e.name, dict(e.options or {}))
    print()
    print(format_table(rows))
    print()
    own = [["any EP", "option", "default", "meaning"]]
    for options in (SupervisionPolicy.OPTIONS, WorkerEnvironment.OPTIONS, Credentials.OPTIONS):
        own += _option_rows("(any)", options)
    print(format_table(own))
    return 0


def cmd_stats(args) -> int:
    """A worker's counters (Environment.get_worker_stats): the totals, then calls per method."""
    with _registered(args) as env:
        stats = env.get_worker_stats("target")
        print(format_table([["counter", "value"], *([name, str(value)] for name, value in stats.counters().items())]))
        rows = [["method", "calls", "errors", "total ms", "max ms"]]
        for method, m in sorted(stats.methods.items()):
            rows.append([method, str(m.calls), str(m.errors), f"{m.total_s * 1000:.1f}", f"{m.max_s * 1000:.1f}"])
        print()
        print(format_table(rows))
    return 0


def cmd_check(args) -> int:
    from ephost import DeviceMemoryType, Tensor

    start = time.perf_counter()
    with _registered(args) as env:
        ready = time.perf_counter() - start
        device = env.get_ep_devices()[0]
        # Memory this process maps where the worker shares some, else the worker's own (a worker off this host)
        shared = device.memory_info(DeviceMemoryType.HOST_ACCESSIBLE) is not None
        allocator = env.create_shared_allocator(device, DeviceMemoryType.HOST_ACCESSIBLE if shared else
                                                DeviceMemoryType.DEFAULT)
        data = np.random.default_rng(0).standard_normal(args.mib << 18, dtype=np.float32)
        worker_tensor = Tensor.empty(data.shape, data.dtype, allocator)
        back = Tensor.from_numpy(np.empty_like(data))
        env.copy_tensors([Tensor.from_numpy(data)], [worker_tensor])
        env.copy_tensors([worker_tensor], [back])
        ok = np.array_equal(back.numpy(), data)
        stats = allocator.get_stats()
        print(f"{device.ep_name} ({device.ep_vendor}) on {device.device.type.name} {device.device.vendor}: "
              f"ready in {ready * 1000:.0f} ms")
        print(f"copied {args.mib} MiB host -> {allocator.memory_info.name} -> host: "
              f"{'identical' if ok else 'MISMATCH'}; allocator in use {stats['InUse']} of "
              f"{stats['TotalAllocated']} bytes")
    return 0 if ok else 1


def cmd_env_create(args) -> int:
    from ephost.worker_env import WorkerEnvironment

    if not args.requirements:
        raise SystemExit("ephost env create: give --requirements")
    record = WorkerEnvironment.take(environment_options(args)).create()
    print(f"{record.key}  {record.python}")
    return 0


def cmd_env_list(args) -> int:
    from ephost.worker_env import cache_dir, list_environments

    rows = [["key", "requirements", "onnxruntime", "python", "created", "path"]]
    for r in list_environments():
        rows.append([r.key, " ".join(r.requirements), r.packages.get("onnxruntime", "-"), r.base_python,
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created_at)), r.path])
    if len(rows) == 1:
        print(f"no worker environments in {cache_dir() / 'envs'}")
        return 0
    print(format_table(rows))
    return 0


def cmd_env_remove(args) -> int:
    from ephost.worker_env import list_environments, remove_environment

    keys = [r.key for r in list_environments()] if args.all else args.keys
    if not keys and not args.all:
        raise SystemExit("ephost env remove: give KEY ... or --all")
    for key in keys:
        remove_environment(key)
        print(f"removed {key}")
    return 0


# `ephost health` exit codes beside 0 (SERVING): scripts and probes can tell the causes apart.
HEALTH_EXIT = {"NOT_SERVING": 1, "NOT_LISTENING": 3, "UNREACHABLE": 3, "TLS_MISMATCH": 4}


def cmd_health(args) -> int:
    """Exit 0 when the worker at ADDRESS reports SERVING on grpc.health.v1 (a container health check). Otherwise
    one line says why: NOT_SERVING (it answers, and says so), NOT_LISTENING (no socket, or nothing listens),
    UNREACHABLE (no answer), TLS_MISMATCH (it answers, but TLS does not match)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from ephost.client.connection import Credentials
    from ephost.client.reach import diagnose
    from ephost.client.targets import parse_target

    spec = parse_target(args.address)
    if spec.kind != "connect":
        raise SystemExit(f"ephost health: {args.address} is not a worker address")
    credentials = Credentials(tls=spec.tls, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)
    channel = (grpc.secure_channel(spec.address, credentials.channel_credentials()) if spec.tls
               else grpc.insecure_channel(spec.address))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                              timeout=args.timeout)
        except grpc.RpcError as e:
            code = e.code()
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return _health("NOT_SERVING", f"{code.name}: {e.details()}")
            reach = diagnose(spec.address, credentials, min(1.0, args.timeout))
            if reach is None or reach.answers:
                return _health("UNREACHABLE", e.details() or code.name)
            word = {"tls": "TLS_MISMATCH", "no socket": "NOT_LISTENING", "refused": "NOT_LISTENING"}
            return _health(word.get(reach.kind, "UNREACHABLE"), reach.detail)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        print(status)
        return 0
    return _health("NOT_SERVING", status)


def _health(word: str, why: str) -> int:
    print(f"{word}: {why}")
    return HEALTH_EXIT[word]


def _version() -> str:
    """ephost's version, its wire protocol and what it runs on."""
    import importlib.metadata
    import platform

    from ephost.wire import PROTOCOL

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"
    return (f"ephost {version('ephost')} (wire protocol {PROTOCOL}; Python {platform.python_version()}, grpcio "
            f"{version('grpcio')}, onnx {version('onnx')}, onnxruntime {version('onnxruntime')})")


def _logging_arguments(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """--log-level, --verbose and --log-format on `parser` (without defaults: a subcommand's, which then leave
    the main parser's values alone unless given)."""
    def default(value):
        return value if defaults else argparse.SUPPRESS
    parser.add_argument("--log-level", default=default(None),
                        help="logging level (default WARNING; a worker's own life at INFO: listening, clients "
                             "connected and gone, drain, exit)")
    parser.add_argument("--verbose", "-v", action="store_true", default=default(False),
                        help="log in detail (INFO), ONNX Runtime's own warnings included")
    parser.add_argument("--log-format", choices=["text", "json"], default=default("text"),
                        help="json: one JSON object per line (time, level, logger, pid, message), for log collectors")


def build_parser() -> argparse.ArgumentParser:
    """The `ephost` command's parser, every subcommand with its flags (tools/options_doc.py documents them)."""
    parser = argparse.ArgumentParser(prog="ephost", description="Run ONNX execution providers out of process.")
    _logging_arguments(parser)
    parser.add_argument("--version", action="version", version=_version(),
                        help="print ephost's version, its wire protocol's and what it runs on, and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="serve one EP over gRPC")
    _logging_arguments(w, defaults=False)  # also after `worker` (where an image's entry command appends them)
    w.add_argument("--ep", required=True, help="EP name from the ephost.eps entry points (e.g. reference)")
    w.add_argument("--option", action="append", metavar="KEY=VALUE", help="EP option, repeatable")
    w.add_argument("--listen", help="unix:///path.sock or host:port (default: a private unix socket)")
    w.add_argument("--insecure", action="store_true", help="allow plain-text TCP (logged as a warning)")
    w.add_argument("--tls-cert", help="PEM certificate chain for TLS")
    w.add_argument("--tls-key", help="PEM private key for TLS")
    w.add_argument("--tls-client-ca", help="PEM CA that client certificates must chain to (mutual TLS)")
    w.add_argument("--token-file", help="file holding the bearer token every call must carry")
    w.add_argument("--client-lease-s", type=float,
                   help="release the handles of a client not heard from for this long (default 60; 0: never; "
                        "off for a worker launched with --exit-with-parent)")
    w.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (plain HTTP: bind it where only the "
                        "scraper reaches, e.g. the pod's network; port 0: any free one, named in the ready line)")
    w.add_argument("--exit-with-parent", action="store_true",
                   help="exit when stdin closes (the launching process holds its other end)")
    w.add_argument("--max-message-mb", type=int, default=1024, help="largest gRPC message, MiB (default 1024)")
    w.add_argument("--max-alloc-mb", type=int, help="largest single allocation a client may ask for, MiB "
                                                    "(default: half the machine's memory)")
    w.add_argument("--drain-grace-s", type=_grace, default=5.0,
                   help="on SIGTERM or SIGINT, how long calls under way may take to finish (default 5); keep it "
                        "under the orchestrator's own grace (Kubernetes: terminationGracePeriodSeconds)")
    w.add_argument("--lane-spin-us", type=_spin, default=SPIN_S * 1e6,
                   help="how long a fast-lane connection's thread polls for the next request before it sleeps, "
                        f"while requests come that fast (default {SPIN_S * 1e6:g}; 0: never)")
    w.add_argument("--send-timeout-s", type=_send_timeout, default=SEND_TIMEOUT_S,
                   help="how long a reply to a fast-lane client that reads nothing may wait before its connection "
                        f"is closed (default {SEND_TIMEOUT_S:g})")
    w.add_argument("--cache-dir", help="where external data files sent by clients that share no memory with the "
                                       "worker are kept, by content (default $EPHOST_CACHE_DIR/blobs, "
                                       "~/.cache/ephost/blobs)")
    w.add_argument("--model-dir", help="a directory of models clients may name by relative path "
                                       "(ephost.ModelOnWorker): their weights never leave this host")
    w.add_argument("--cache-max-mb", type=int, default=10240,
                   help="size limit of that cache, MiB; the least recently used go first (default 10240; 0: no "
                        "cache, such clients send the bytes inside the model)")
    add_environment_arguments(w)
    w.set_defaults(func=cmd_worker)

    for name, func, text in (("devices", cmd_devices, "list the EP devices of a target"),
                             ("check", cmd_check, "check a target end to end with a tensor round trip"),
                             ("stats", cmd_stats, "print a worker's counters (calls per method, resident vs "
                                                  "transferred inputs, bytes each way, live buffers, clients)")):
        p = sub.add_parser(name, help=text)
        p.add_argument("target", help="EP name to launch, worker address, or inproc:NAME")
        p.add_argument("--option", action="append", metavar="KEY=VALUE", help="EP or connection option")
        if name == "check":
            p.add_argument("--mib", type=int, default=64, help="tensor size in MiB (default 64)")
        add_environment_arguments(p)
        p.set_defaults(func=func)

    e = sub.add_parser("env", help="make, list and remove workers' own environments (EPHOST_CACHE_DIR)")
    env_sub = e.add_subparsers(dest="env_command", required=True)
    c = env_sub.add_parser("create", help="make the environment for requirements ahead of time (an image build "
                                          "step, an offline machine with a wheel folder)")
    add_environment_arguments(c)
    c.set_defaults(func=cmd_env_create)
    env_sub.add_parser("list", help="the environments made").set_defaults(func=cmd_env_list)
    r = env_sub.add_parser("remove", help="remove environments (workers running in them are not stopped)")
    r.add_argument("keys", nargs="*", metavar="KEY", help="keys as 'ephost env list' shows them")
    r.add_argument("--all", action="store_true", help="remove every environment")
    r.set_defaults(func=cmd_env_remove)

    sub.add_parser("eps", help="list the EPs installed here, their options and defaults").set_defaults(func=cmd_eps)

    h = sub.add_parser("health", help="check a worker's grpc.health.v1 status (exit 0 when SERVING; else 1 "
                                      "NOT_SERVING, 3 NOT_LISTENING or UNREACHABLE, 4 TLS_MISMATCH)")
    h.add_argument("address", help="unix:///path.sock, host:port, grpc://host:port or grpcs://host:port")
    h.add_argument("--tls-ca", help="PEM CA to trust for grpcs://")
    h.add_argument("--tls-cert", help="PEM client certificate, for a worker that asks for one (mutual TLS)")
    h.add_argument("--tls-key", help="PEM client key (mutual TLS)")
    h.add_argument("--service", default="", help="the service to ask about (default: the whole worker)")
    h.add_argument("--timeout", type=float, default=5.0, help="seconds to wait (default 5)")
    h.set_defaults(func=cmd_health)

    from ephost.cli import compile_command, run_command
    run_command.add_parser(sub)  # `ephost run` lives with its helpers
    compile_command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    handler = ConsoleHandler(sys.stderr, JsonFormatter() if args.log_format == "json" else
                             logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    logging.basicConfig(level="INFO" if args.verbose else (args.log_level or "WARNING").upper(), handlers=[handler])
    if args.command == "worker" and args.log_level is None:
        for name in ("ephost.worker", "ephost.server"):  # (not the EP's own, nor ONNX Runtime's: --verbose)
            logging.getLogger(name).setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    # Making an environment, or sending a large model or tensor, takes a while: its progress shows at the default
    # level.
    for name in ("ephost.worker_env", "ephost.progress"):
        logging.getLogger(name).setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    try:
        return args.func(args)
    except EpError as e:
        print(f"ephost: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
