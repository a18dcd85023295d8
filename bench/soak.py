"""A shared worker under generations of short-lived clients (`make soak`): one onnxruntime worker on a TCP port
(or a unix socket), and rounds of new client processes, each with threads that run squeezenet for a while and
then exit. After each round, once the worker has let go of every client, its RSS, descriptors and memfd mappings
are read from /proc. Everything a client held must go when it goes: from the second round on (the first pays
for what any first client does, ORT's arenas and thread pools among it) the RSS stays flat.

    python -m bench.soak [--rounds 6] [--clients 8] [--threads 2] [--seconds 8] [--unix]

Exits 1 where a round after the second ends above the second by more than --slack-mb, or a client failed.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np


def client(address: str, seconds: float, threads: int) -> None:
    """One client process: `threads` threads, each with a session of its own, running squeezenet for
    `seconds`; prints one JSON line (runs made, wrong results)."""
    import onnx
    from onnx import numpy_helper

    import ephost
    from ephost import InferenceSession, SessionOptions
    from ephost.cli.run_command import bundled_input, bundled_model

    path, expected_path = bundled_model("squeezenet")
    expected = numpy_helper.to_array(onnx.load_tensor(expected_path))
    counts = {"runs": 0, "wrong": 0, "errors": []}
    lock = threading.Lock()  # guards counts: every client thread adds to it
    with ephost.Environment() as env:
        env.register_execution_provider_library("shared", address)
        options = SessionOptions()
        options.add_provider_for_devices(env.get_ep_devices(), {})

        def work() -> None:
            try:
                with InferenceSession(path, options, env=env) as session:
                    arg = session.get_inputs()[0]
                    feeds = {arg.name: bundled_input(arg)}
                    end = time.monotonic() + seconds
                    while time.monotonic() < end:
                        (out,) = session.run(None, feeds)
                        with lock:
                            counts["runs"] += 1
                            counts["wrong"] += not np.allclose(out, expected, rtol=1e-3, atol=1e-4)
            except Exception as e:  # reported by the round, which fails
                with lock:
                    counts["errors"].append(f"{type(e).__name__}: {e}")

        pool = [threading.Thread(target=work) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    print(json.dumps(counts), flush=True)


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _memfd_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("memfd:" in line for line in f)


def _clients(address: str) -> int:
    """How many clients the worker holds, by Worker.GetStats."""
    import grpc
    from ephost.v1 import common_pb2, worker_pb2_grpc
    with grpc.insecure_channel(address.removeprefix("grpc://")) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetStats(common_pb2.Empty(), timeout=10).clients


def _settled(address: str, timeout: float = 90.0) -> float:
    """Wait until the worker holds no client (each says Goodbye as its Environment closes; one that could not is
    released when its lease runs out, 60 s), and then for its next tick, in which it gives what they held back to
    the system (server/malloc.py). Returns how long the clients took to go."""
    start = time.monotonic()
    while _clients(address):
        if time.monotonic() > start + timeout:
            raise SystemExit("soak: the worker still holds clients after their lease ran out")
        time.sleep(0.2)
    gone = time.monotonic() - start
    time.sleep(1.0)
    return gone


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--clients", type=int, default=8, help="client processes per round")
    parser.add_argument("--threads", type=int, default=2, help="threads per client, a session each")
    parser.add_argument("--seconds", type=float, default=8.0, help="how long each thread runs")
    parser.add_argument("--unix", action="store_true", help="the worker on a unix socket, not a TCP port")
    parser.add_argument("--slack-mb", type=float, default=8.0, help="growth past the second round allowed")
    parser.add_argument("--client", nargs=3, metavar=("ADDRESS", "SECONDS", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        client(args.client[0], float(args.client[1]), int(args.client[2]))
        return 0

    folder = tempfile.mkdtemp(prefix="ephost-soak-")
    listen = f"unix://{folder}/w.sock" if args.unix else f"127.0.0.1:{_free_port()}"
    log = open(os.path.join(folder, "worker.log"), "wb")
    worker = subprocess.Popen([sys.executable, "-m", "ephost", "worker", "--ep", "onnxruntime", "--listen", listen,
                               "--insecure"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log)
    try:
        address = json.loads(worker.stdout.readline())["address"]
        address = address if address.startswith("unix:") else f"grpc://{address}"
        pid = worker.pid
        rows = [("before", _status(pid, "VmRSS"), len(os.listdir(f"/proc/{pid}/fd")), _memfd_maps(pid), 0, 0)]
        print(f"soak: an onnxruntime worker at {address}; {args.rounds} rounds of {args.clients} client processes, "
              f"{args.threads} threads each, squeezenet for {args.seconds:g} s", flush=True)
        failed = []
        for r in range(1, args.rounds + 1):
            errors = os.path.join(folder, f"round{r}.err")
            with open(errors, "w") as stderr:
                procs = [subprocess.Popen([sys.executable, "-m", "bench.soak", "--client", address, str(args.seconds),
                                           str(args.threads)], stdout=subprocess.PIPE, stderr=stderr, text=True)
                         for _ in range(args.clients)]
            runs = wrong = 0
            for p in procs:
                out, _ = p.communicate(timeout=args.seconds * 4 + 120)
                try:
                    counts = json.loads(out.strip().splitlines()[-1])
                except (ValueError, IndexError):
                    with open(errors) as f:
                        tail = [line for line in f if "WARNING" not in line][-3:]
                    failed.append(f"round {r}: a client exited {p.returncode} without its counts: {''.join(tail)}")
                    continue
                runs += counts["runs"]
                wrong += counts["wrong"]
                failed += [f"round {r}: {e}" for e in counts["errors"]]
            gone = _settled(address)
            if gone > 10:
                failed.append(f"round {r}: the worker let its clients go {gone:.0f} s after they exited (a lease, "
                              "not a Goodbye)")
            rows.append((f"round {r}", _status(pid, "VmRSS"), len(os.listdir(f"/proc/{pid}/fd")), _memfd_maps(pid),
                         runs, wrong))
            print(f"  round {r}: RSS {rows[-1][1] / 1024:.1f} MiB, {rows[-1][2]} fds, {rows[-1][3]} memfd maps, "
                  f"{runs} runs ({runs / args.seconds:.0f}/s), {wrong} wrong", flush=True)
        print("\n| after | worker RSS | fds | memfd maps | runs | wrong |\n|---|---|---|---|---|---|")
        for name, rss, fds, maps, runs, wrong in rows:
            print(f"| {name} | {rss / 1024:.1f} MiB | {fds} | {maps} | {runs} | {wrong} |")
        second = rows[2][1] if len(rows) > 2 else rows[-1][1]
        grown = max(rss for _, rss, *_ in rows[2:]) - second if len(rows) > 2 else 0
        print(f"\ngrowth after the second round: {grown / 1024:+.1f} MiB (allowed {args.slack_mb:g})")
        if failed or any(row[5] for row in rows) or grown > args.slack_mb * 1024:
            for line in failed[:20]:
                print("soak:", line)
            return 1
        return 0
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
        log.close()
        import shutil
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
