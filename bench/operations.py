"""What an operator's actions cost the application. A first connection to an address where no worker answers (a
closed port, no socket file, a socket file left by a worker that is gone): the time until registration fails,
median and slowest of several. A worker restarted on its address (SIGTERM, a new one started 0.5 s later) under
two threads of runs, per failure policy: the runs that failed, the calls made again on the new worker, and the
longest run (the one that waited for the new worker)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import ephost
from ephost import InferenceSession, SessionOptions
from bench.recovery import model

RESTART_AFTER_S = 0.5  # the scenario: the new worker starts this long after the SIGTERM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_connection_times(directory: str, tries: int) -> dict[str, list[float]]:
    """Seconds until registering an address where nothing answers fails, by what is there."""
    stale = os.path.join(directory, "stale.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(stale)  # bound, never listened on: what a killed worker leaves
    targets = {"closed port": lambda: f"127.0.0.1:{free_port()}",
               "no socket file": lambda: f"unix://{directory}/none.sock",
               "stale socket file": lambda: f"unix://{stale}"}
    times: dict[str, list[float]] = {what: [] for what in targets}
    for _ in range(tries):
        for what, target in targets.items():
            with ephost.Environment() as env:
                start = time.perf_counter()
                try:
                    env.register_execution_provider_library("x", target())
                except ephost.EpWorkerUnavailable:
                    times[what].append(time.perf_counter() - start)
                else:
                    raise AssertionError(f"a worker answered at {what}")
    return times


def start_worker(address: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "ephost", "worker", "--ep", "reference", "--listen", address,
                             "--exit-with-parent"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    json.loads(proc.stdout.readline())  # ready
    return proc


def restart(directory: str, policy: str) -> dict:
    """One restart of the worker on its address under two threads of runs."""
    address = f"unix://{directory}/w-{policy}.sock"
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    expected = np.maximum(x, 0) + x
    workers = [start_worker(address)]
    try:
        with ephost.Environment() as env:
            env.register_execution_provider_library("w", address)
            options = SessionOptions()
            options.ep_failure_policy = policy
            options.add_provider_for_devices(env.get_ep_devices())
            link = env.registration("w").link
            with InferenceSession(model(64), options, env=env) as session:
                runs, stop = [], threading.Event()

                def work():
                    while not stop.is_set():
                        start = time.perf_counter()
                        try:
                            ok = bool(np.allclose(session.run(None, {"x": x})[0], expected))
                        except ephost.EpError:
                            ok = False
                        end = time.perf_counter()
                        runs.append((link.generation, ok, end - start, end))

                threads = [threading.Thread(target=work) for _ in range(2)]
                for t in threads:
                    t.start()
                deadline = time.monotonic() + 120
                try:
                    while len(runs) < 200 and time.monotonic() < deadline:
                        time.sleep(0.01)
                    workers[0].send_signal(signal.SIGTERM)
                    signalled = time.perf_counter()
                    time.sleep(RESTART_AFTER_S)
                    workers.append(start_worker(address))
                    while sum(r[0] == 2 for r in runs) < 200 and time.monotonic() < deadline:
                        time.sleep(0.01)
                finally:
                    stop.set()
                    for t in threads:
                        t.join(60)
                made_again = session.failure_counters["made again"]
    finally:
        for proc in workers:
            proc.terminate()
            proc.wait(30)
            proc.stdin.close()
            proc.stdout.close()
    return {"failed": sum(not r[1] for r in runs), "runs": len(runs), "made_again": made_again,
            "longest": max(r[2] for r in runs), "back": min(r[3] for r in runs if r[0] == 2) - signalled}


def main(quick: bool = False) -> None:
    import logging
    logging.getLogger("ephost").setLevel(logging.ERROR)  # the drains are the point; their logs are noise
    tries = 3 if quick else 7
    directory = tempfile.mkdtemp(prefix="ephost-bench-ops-")
    try:
        print(f"A first connection where no worker answers, until registration fails (median and slowest of {tries})"
              "\n")
        print("| at the address | median | slowest |")
        print("|---|---|---|")
        for what, t in first_connection_times(directory, tries).items():
            print(f"| {what} | {statistics.median(t) * 1000:.1f} ms | {max(t) * 1000:.1f} ms |")
        print(f"\nA worker restarted on its address (SIGTERM, a new one {RESTART_AFTER_S} s later) under two threads "
              "of runs\n")
        print("| policy | runs | failed | made again | longest run | SIGTERM to the first run on the new worker |")
        print("|---|---|---|---|---|---|")
        for policy in ("raise", "retry"):
            r = restart(directory, policy)
            print(f"| {policy} | {r['runs']} | {r['failed']} | {r['made_again']} | {r['longest'] * 1000:.0f} ms | "
                  f"{r['back'] * 1000:.0f} ms |")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
