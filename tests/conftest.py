"""Fixtures over real worker processes, and the suite-wide leak check: after the last test no worker
process started during the run is alive, and nothing new is left in /dev/shm or as a private socket dir."""
from __future__ import annotations

import glob
import os
import tempfile
import time

import pytest

from ephost import DeviceMemoryType
from helpers import RawClient, Worker, device_of, make_env, make_pki, worker_pids


# Every process this test run starts inherits this mark, so that workers of other runs on the same machine
# (other checkouts' test suites) are not counted as this run's leaks.
os.environ["EPHOST_TEST_RUN"] = f"{os.getpid()}-{time.time_ns()}"  # (helpers.worker_pids reads it)
# Workers this run launches make their private socket directories in a temporary directory of this run's own.
RUN_TMP = tempfile.mkdtemp(prefix="ephost-run-")
os.environ["TMPDIR"] = RUN_TMP
tempfile.tempdir = None


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
    import shutil
    shutil.rmtree(RUN_TMP, ignore_errors=True)  # what is left there (pytest's tmp_path) goes too


@pytest.fixture(scope="session")
def env():
    with make_env() as environment:
        yield environment


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


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """A CA, a server certificate for localhost, a client certificate and a token file (helpers.make_pki)."""
    directory = tmp_path_factory.mktemp("pki")
    make_pki(directory)
    return directory


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
