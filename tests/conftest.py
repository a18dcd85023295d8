"""Fixtures over real worker processes, and the suite-wide leak check: after the last test no worker
process started during the run is alive, and nothing new is left in /dev/shm or as a private socket dir."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import time

import grpc
import pytest

import ephost
from ephost import DeviceMemoryType
from ephost.v1 import worker_pb2, worker_pb2_grpc


def worker_pids() -> set[int]:
    pids = set()
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"ephost" in args and b"worker" in args:
            pids.add(int(cmdline.split("/")[2]))
    return pids


def private_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "ephost-*")))


@pytest.fixture(scope="session", autouse=True)
def nothing_leaks():
    shm_before = set(os.listdir("/dev/shm"))
    pids_before = worker_pids()
    dirs_before = private_dirs()
    yield
    deadline = time.monotonic() + 5
    while worker_pids() - pids_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker_pids() - pids_before == set(), "worker processes outlived the test suite"
    assert set(os.listdir("/dev/shm")) - shm_before == set(), "files left in /dev/shm"
    assert private_dirs() - dirs_before == set(), "private socket directories left behind"


@pytest.fixture(scope="session")
def env():
    """One Environment with a launched reference worker ("ref") and an in-process one ("local")."""
    with ephost.Environment() as environment:
        environment.register_execution_provider_library("ref", "reference")
        environment.register_execution_provider_library("local", "inproc:reference")
        yield environment


def options_for(environment, *registrations):
    """SessionOptions with the devices of these registrations, in this order."""
    from ephost import SessionOptions
    options = SessionOptions()
    for r in registrations:
        options.add_provider_for_devices([d for d in environment.get_ep_devices() if d.registration_name == r])
    return options


def worker_stats(environment, registration: str):
    from ephost.v1 import common_pb2
    conn = environment._registrations[registration].factory.conn
    return conn.call(conn.worker.GetStats, common_pb2.Empty())


def device_of(environment, registration: str):
    return next(d for d in environment.get_ep_devices() if d.registration_name == registration)


@pytest.fixture(scope="session")
def ref_device(env):
    return device_of(env, "ref")


@pytest.fixture(scope="session")
def local_device(env):
    return device_of(env, "local")


@pytest.fixture(params=["ref", "local"])
def any_device(request, env):
    """The same tests, out of process and in process: behaviour must not depend on where the EP lives."""
    return device_of(env, request.param)


@pytest.fixture
def host_allocator(env, any_device):
    allocator = env.create_shared_allocator(any_device, DeviceMemoryType.HOST_ACCESSIBLE)
    yield allocator
    env.release_shared_allocator(any_device, DeviceMemoryType.HOST_ACCESSIBLE)


@pytest.fixture
def default_allocator(env, any_device):
    allocator = env.create_shared_allocator(any_device, DeviceMemoryType.DEFAULT)
    yield allocator
    env.release_shared_allocator(any_device, DeviceMemoryType.DEFAULT)


class Worker:
    """A worker started by hand, as an operator would: `ephost worker ...`."""

    def __init__(self, *args: str, exit_with_parent: bool = True):
        self.dir = tempfile.mkdtemp(prefix="ephost-test-")
        self.socket = os.path.join(self.dir, "w.sock")
        cmd = [sys.executable, "-m", "ephost", "worker", *args]
        if "--listen" not in args:
            cmd += ["--listen", f"unix://{self.socket}"]
        if exit_with_parent:
            cmd.append("--exit-with-parent")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.ready_line = self.proc.stdout.readline().decode()

    @property
    def address(self) -> str:
        import json
        return json.loads(self.ready_line)["address"]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)
        return self.proc.returncode


@pytest.fixture
def worker():
    started = []

    def start(*args: str, **kw) -> Worker:
        w = Worker(*args, **kw)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


class RawClient:
    """Stubs and a client id, for speaking the wire protocol directly (bad input is sent this way)."""

    def __init__(self, address: str, name: str = "raw"):
        from ephost.v1 import (allocator_pb2_grpc, data_transfer_pb2_grpc, ep_pb2_grpc, factory_pb2_grpc,
                               stream_pb2_grpc)
        self.channel = grpc.insecure_channel(address)
        self.worker = worker_pb2_grpc.WorkerStub(self.channel)
        self.factory = factory_pb2_grpc.EpFactoryStub(self.channel)
        self.allocator = allocator_pb2_grpc.AllocatorStub(self.channel)
        self.transfer = data_transfer_pb2_grpc.DataTransferStub(self.channel)
        self.stream = stream_pb2_grpc.StreamStub(self.channel)
        self.ep = ep_pb2_grpc.EpStub(self.channel)
        hello = self.worker.Hello(worker_pb2.HelloRequest(client_name=name, protocol="ephost.v1"), timeout=30,
                                  wait_for_ready=True)
        self.hello = hello
        self.metadata = (("ephost-client", hello.client_id),)

    def __call__(self, method, request, **kw):
        return method(request, timeout=30, metadata=self.metadata, **kw)

    def close(self):
        self.channel.close()


@pytest.fixture(scope="module")
def served():
    """A worker of its own for wire-level tests, so their mischief touches no other test's worker."""
    w = Worker("--ep", "reference")
    yield w
    w.stop()


@pytest.fixture
def raw(served):
    client = RawClient(served.address)
    yield client
    client.close()
