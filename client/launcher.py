"""Launching a worker process and watching it: its death is noticed the moment it happens."""
from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from typing import Callable, Mapping, Sequence

import grpc

from ephost.errors import EpWorkerCrashed, EpWorkerDraining, EpWorkerUnavailable, error_for_status
from ephost.worker_env import WorkerEnvironment

PROTOBUF_IMPLEMENTATION = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"
log = logging.getLogger(__name__)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"



def worker_environ() -> dict[str, str]:
    """The environment a launched worker starts with: this process's, with two exceptions. The worker's errors
    reach this process as status codes, so it need not import onnxruntime to make them ORT's classes too
    (ephost.errors), which would cost every worker's start its load. And it parses with the compiled protobuf:
    onnxruntime-extensions sets PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python in the application as it is
    imported, and a worker with pure-Python protobuf reads every message and model many times slower."""
    env = {**os.environ, "EPHOST_ORT_ERRORS": "0"}
    if env.get(PROTOBUF_IMPLEMENTATION) == "python":
        del env[PROTOBUF_IMPLEMENTATION]
    return env

class WorkerProcess:
    """A local worker serving `ep` on a unix socket in a private (0700) directory made for it. It runs under
    this process's interpreter, or the one its environment options (WorkerEnvironment.OPTIONS: python,
    requirements, ...) name or make."""

    def __init__(self, ep: str, options: Mapping[str, str] | None = None, *, startup_timeout: float = 60.0,
                 on_exit: Callable[["WorkerProcess"], None] | None = None, worker_args: Sequence[str] = ()):
        self.ep = ep
        self.options = dict(options or {})
        self._dir: str | None = None  # the worker's private socket directory
        # The worker logs (ONNX Runtime's own warnings included) in detail when this process does; else only what
        # goes wrong (not its life's events: this process's supervision tells those).
        verbose = ["--verbose"] if logging.getLogger("ephost").isEnabledFor(logging.INFO) else \
            ["--log-level", "WARNING"]
        self.python = WorkerEnvironment.take(self.options).interpreter()
        command = [self.python, "-m", "ephost", *verbose, "worker", "--ep", ep, "--exit-with-parent", *worker_args]
        for key, value in self.options.items():
            command += ["--option", f"{key}={value}"]
        self._on_exit = on_exit
        self.stopping = False  # set when this side asked the worker to go: its exit is not a crash
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
                                     env=worker_environ())
        self.pid = self.proc.pid
        self.exited = threading.Event()
        try:
            self.address = self._await_ready(startup_timeout)
        except BaseException:
            self.stop()
            raise
        threading.Thread(target=self._watch, name=f"ephost-watch-{self.pid}", daemon=True).start()

    def _await_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        line = b""
        fd = self.proc.stdout.fileno()
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EpWorkerUnavailable(f"worker for EP {self.ep!r} was not ready within {timeout:.0f} s")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    code = self.proc.wait()
                    raise EpWorkerCrashed(f"worker for EP {self.ep!r} ended with {describe_exit(code)} before it "
                                          "was ready (its stderr says why)", ep=self.ep, returncode=code,
                                          call="startup")
                line += chunk
        try:
            announced = json.loads(line.splitlines()[0])
            refused = (grpc.StatusCode[announced["code"]], announced["message"]) if announced.get("ephost") == "error" \
                else None
            address = None if refused else announced["address"]
        except (ValueError, KeyError, AttributeError):
            raise EpWorkerUnavailable(f"worker for EP {self.ep!r} announced itself unreadably") from None
        if refused:  # it would not start: bad options, or an EP it cannot load
            self.proc.wait()
            raise error_for_status(*refused)
        self._dir = os.path.dirname(address[len("unix://"):])
        return address

    def _watch(self) -> None:
        code = self.proc.wait()
        self._remove_dir()
        self.exited.set()
        self.proc.stdout.close()
        log.debug("worker %d for EP %r ended with %s", self.pid, self.ep, describe_exit(code))  # (supervision says)
        if self._on_exit is not None:
            self._on_exit(self)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode  # set by the watcher thread (poll() could not reap while it waits)

    def crashed_error(self, call: str) -> EpWorkerUnavailable | None:
        """The typed error for a call that failed because this worker went, or None if it is alive: it died
        (EpWorkerCrashed), or it drained and exited as this process stopped it (EpWorkerDraining: a call it had not
        read when it closed its connections, made again on its successor as a call it refused is)."""
        if self.returncode is None:
            # the failure may come a moment before the exit is visible
            if not self.exited.wait(0.2):
                return None
        code = self.proc.returncode
        if self.stopping and code == 0:
            return EpWorkerDraining(f"worker for EP {self.ep!r} (pid {self.pid}) ended {call} as it drained: this "
                                    "process stopped it")
        return EpWorkerCrashed(f"worker for EP {self.ep!r} (pid {self.pid}) died with {describe_exit(code)} "
                               f"during {call}", ep=self.ep, returncode=code, call=call)

    def kill(self) -> None:
        """SIGKILL: for a worker that hangs. Its exit is reported like any death."""
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass

    def resident_bytes(self) -> int:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) << 10
        except OSError:
            pass
        return 0

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the worker to drain and exit; kill it if it does not within `timeout`."""
        self.stopping = True
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("worker %d for EP %r did not drain in %.0f s; killing it", self.pid, self.ep, timeout)
                self.proc.kill()
                self.proc.wait()
            except ProcessLookupError:
                pass
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        self._remove_dir()

    def _remove_dir(self) -> None:
        """A worker removes its directory when it exits; one that was killed cannot."""
        if self._dir and os.path.basename(self._dir).startswith("ephost-"):
            shutil.rmtree(self._dir, ignore_errors=True)
