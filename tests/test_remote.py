"""Workers on another host (simulated: shared memory turned off) and on this host over TCP: whether memory is
shared is proven at connect time, and without it tensors and models travel in chunks, with no size limit."""
import socket
import time

import numpy as np
import pytest

import ephost
from ephost import DeviceMemoryType, InferenceSession, Tensor
from helpers import diamond_runs, options_for
import models


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tcp_worker():
    from helpers import Worker
    w = Worker("--ep", "reference", "--listen", f"127.0.0.1:{free_port()}", "--insecure", "--max-message-mb", "64")
    yield w
    w.stop()


def test_a_tcp_worker_on_this_host_proves_it_shares_memory(tcp_worker):
    with ephost.Environment() as env:
        env.register_execution_provider_library("tcp", tcp_worker.address)
        (device,) = env.get_ep_devices()
        assert env.registration("tcp").link.conn.shares_memory
        shared = env.create_shared_allocator(device, DeviceMemoryType.HOST_ACCESSIBLE)
        t = Tensor.from_numpy(np.arange(10, dtype=np.int64), shared)
        np.testing.assert_array_equal(t.numpy(), np.arange(10))  # mapped here: read in place


@pytest.mark.timeout(240)
def test_without_shared_memory_a_1_gib_tensor_travels_in_chunks(tcp_worker):
    with ephost.Environment() as env:
        env.register_execution_provider_library("far", tcp_worker.address, {"shared_memory": "false"})
        (device,) = env.get_ep_devices()
        assert not env.registration("far").link.conn.shares_memory
        assert device.memory_info(DeviceMemoryType.HOST_ACCESSIBLE) is None, "worker-local memory only"
        allocator = env.create_shared_allocator(device, DeviceMemoryType.DEFAULT)
        data = np.random.default_rng(0).integers(0, 255, 1 << 30, dtype=np.uint8)  # 1 GiB, past any message
        on_worker = Tensor.from_numpy(data, allocator)
        back = Tensor.from_numpy(np.zeros_like(data))
        env.copy_tensors([on_worker], [back])
        assert np.array_equal(back.numpy(), data)
        del data, back, on_worker


@pytest.mark.timeout(240)
def test_without_shared_memory_a_300_mb_model_and_a_session_match_the_shared_path(tcp_worker):
    model, weights = models.matmul_with_weights(1000, 75_000)
    x = np.random.default_rng(5).standard_normal((1, 1000)).astype(np.float32)
    results = {}
    for name, options in (("far", {"shared_memory": "false"}), ("near", {})):
        with ephost.Environment() as env:
            env.register_execution_provider_library(name, tcp_worker.address, options)
            with InferenceSession(model, options_for(env, name), env=env) as session:
                (results[name],) = session.run(None, {"x": x})
    np.testing.assert_array_equal(results["far"], results["near"])
    np.testing.assert_allclose(results["far"], np.maximum(x @ weights, 0), rtol=1e-4, atol=1e-3)


def test_sessions_across_a_far_and_a_near_worker(tcp_worker):
    """Values made by a worker that shares no memory reach the fallback and another worker."""
    x = np.random.default_rng(6).standard_normal((512, 512)).astype(np.float32)
    with ephost.Environment() as env:
        env.register_execution_provider_library("far", tcp_worker.address, {"shared_memory": "false"})
        env.register_execution_provider_library("near", "reference", {"ops": "Relu"})
        with InferenceSession(models.diamond((512, 512)), options_for(env, "near", "far"), env=env) as session:
            owners = [s.registration for s in session.get_provider_graph_assignment_info()]
            assert owners == ["far", "near", "far"]
            for _ in range(2):
                (y,) = session.run(None, {"x": x})
                np.testing.assert_allclose(y, models.diamond_expected(x), rtol=1e-6)


@pytest.mark.timeout(120)
def test_replicas_behind_one_name_pin_partitions_and_move_on_when_one_goes(worker):
    """gRPC's name syntax lists two replicas; the session's partitions live on the one its channel picked,
    and when that replica dies, the client moves to the other and compiles there again."""
    from helpers import worker_stats
    replicas = [worker("--ep", "reference", "--listen", f"127.0.0.1:{free_port()}", "--insecure") for _ in range(2)]
    name = "ipv4:" + ",".join(r.address for r in replicas)
    x = np.random.default_rng(7).standard_normal((2, 3)).astype(np.float32)
    with ephost.Environment() as env:
        env.register_execution_provider_library("pool", name, {"timeout_s": "5"})
        options = options_for(env, "pool")
        options.ep_failure_policy = "retry"
        with InferenceSession(models.diamond(), options, env=env) as session:
            for _ in range(3):
                np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
            pid = worker_stats(env, "pool")  # the replica this channel talks to
            serving = env.registration("pool").link.conn.info.pid
            first = next(r for r in replicas if r.proc.pid == serving)
            other = next(r for r in replicas if r is not first)
            assert pid.methods["Ep/Compute"].calls == 3, "every run went to the one replica"
            first.proc.kill()
            first.proc.wait()
            for _ in range(2):  # the first waits for the client to reconnect to the other (retry), then runs there
                np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
            assert env.registration("pool").link.conn.info.pid == other.proc.pid


# --- a first connection fails at once, naming its cause -----------------------------------------------------

def _refused(target: str, options: dict | None = None) -> tuple[ephost.EpError, list[str]]:
    """The error registering `target` raises (with a connect timeout of 60 s), and what gRPC said as each first
    connection failed, which the error is made from ("no answer within 60 s" where it waited the timeout out)."""
    from ephost.client import connection
    said, unreachable = [], connection.unreachable

    def told(address, credentials, what, *args, **kw):
        said.append(what)
        return unreachable(address, credentials, what, *args, **kw)

    with pytest.MonkeyPatch.context() as patch, ephost.Environment() as env:
        patch.setattr(connection, "unreachable", told)
        with pytest.raises(ephost.EpWorkerUnavailable) as info:
            env.register_execution_provider_library("x", target, {"connect_timeout_s": "60", **(options or {})})
        return info.value, said


def test_a_closed_port_or_a_missing_socket_fails_at_once_naming_it(tmp_path):
    for target, cause in ((f"127.0.0.1:{free_port()}", "nothing listens there (connection refused)"),
                          (f"dns:///localhost:{free_port()}", "connection refused"),
                          (f"unix://{tmp_path}/none.sock", "no socket file there")):
        error, said = _refused(target)
        assert type(error) is ephost.EpWorkerUnavailable and cause in str(error) and target in str(error)
        assert len(said) == 1 and "failed to connect" in said[0], f"refused, not waited out: {said}"


def test_a_socket_file_nobody_listens_on_is_named_as_such(tmp_path):
    path = tmp_path / "left.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # bound, never listened on: what a killed worker leaves
    error, _ = _refused(f"unix://{path}")
    assert "left by a worker that is gone" in str(error)


@pytest.fixture(scope="module")
def tls_workers(pki):
    """A TLS worker, a mutual-TLS one and a plain-text one on localhost: {kind: port}."""
    from helpers import Worker
    certs = ("--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"))
    ports = {kind: free_port() for kind in ("tls", "mtls", "plain")}
    workers = [Worker("--ep", "reference", "--listen", f"localhost:{ports['tls']}", *certs),
               Worker("--ep", "reference", "--listen", f"localhost:{ports['mtls']}", *certs,
                      "--tls-client-ca", str(pki / "ca.pem")),
               Worker("--ep", "reference", "--listen", f"127.0.0.1:{ports['plain']}", "--insecure")]
    yield ports
    for w in workers:
        w.stop()


def test_tls_mistakes_name_tls_and_the_reason(tls_workers, pki):
    ca = {"tls_ca": str(pki / "ca.pem")}
    cases = [(f"grpc://localhost:{tls_workers['tls']}", {}, "it speaks TLS: connect with grpcs://"),
             (f"grpcs://localhost:{tls_workers['tls']}", {}, "its certificate is not trusted"),
             (f"grpcs://127.0.0.1:{tls_workers['tls']}", ca, "its certificate does not name '127.0.0.1'"),
             (f"grpcs://localhost:{tls_workers['plain']}", ca, "it speaks plain text, not TLS"),
             (f"grpcs://localhost:{tls_workers['mtls']}", ca, "it asks for a client certificate")]
    for target, options, reason in cases:
        error, said = _refused(target, options)
        assert isinstance(error, ephost.EpTlsError), (target, error)
        assert str(error).startswith("TLS with the worker at") and reason in str(error), (target, error)
        assert len(said) == 1 and "no answer within" not in said[0], (target, said)
    with ephost.Environment() as env:  # and with TLS right, it works
        env.register_execution_provider_library("ok", f"grpcs://localhost:{tls_workers['tls']}", ca)
        assert env.get_ep_devices()[0].ep_name == "reference"


def _health(*args: str):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "ephost", "health", *args, "--timeout", "10"], capture_output=True,
                          text=True, timeout=60)


def test_health_tells_nothing_listening_tls_mismatch_and_not_serving_apart(tls_workers, pki, tmp_path):
    import grpc
    from concurrent import futures
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    closed = _health(f"127.0.0.1:{free_port()}")
    assert closed.returncode == 3 and closed.stdout.startswith("NOT_LISTENING: nothing listens"), closed.stdout
    missing = _health(f"unix://{tmp_path}/none.sock")
    assert missing.returncode == 3 and missing.stdout.startswith("NOT_LISTENING: no socket file"), missing.stdout
    plain = _health(f"grpc://localhost:{tls_workers['tls']}")
    assert plain.returncode == 4 and plain.stdout.startswith("TLS_MISMATCH: it speaks TLS"), plain.stdout
    untrusted = _health(f"grpcs://localhost:{tls_workers['tls']}")
    assert untrusted.returncode == 4 and "not trusted" in untrusted.stdout, untrusted.stdout
    serving = _health(f"grpcs://localhost:{tls_workers['tls']}", "--tls-ca", str(pki / "ca.pem"))
    assert serving.returncode == 0 and serving.stdout.strip() == "SERVING", serving.stdout
    # Any gRPC server with a health service that says NOT_SERVING (here, one made in this process)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        down = _health(f"127.0.0.1:{port}")
        assert down.returncode == 1 and down.stdout.strip() == "NOT_SERVING: NOT_SERVING", down.stdout
    finally:
        server.stop(0)


def test_progress_of_a_large_transfer_is_logged(tcp_worker, caplog):
    import logging
    from ephost.progress import ATTRIBUTE
    caplog.set_level(logging.INFO, logger="ephost.progress")
    with ephost.Environment() as env:
        env.register_execution_provider_library("far", tcp_worker.address, {"shared_memory": "false"})
        (device,) = env.get_ep_devices()
        allocator = env.create_shared_allocator(device, DeviceMemoryType.DEFAULT)
        Tensor.from_numpy(np.ones(80 << 20, np.uint8), allocator)
        small = len(caplog.records)
        Tensor.from_numpy(np.ones(1 << 20, np.uint8), allocator)
        assert len(caplog.records) == small, "a small transfer is not reported"
    states = [getattr(r, ATTRIBUTE) for r in caplog.records]
    assert states[0].done == 0 and states[-1].finished and states[-1].done == states[-1].total == 80 << 20
    assert "writing a tensor into the worker at" in caplog.records[-1].getMessage()


def test_worker_stats_are_a_typed_value_with_every_counter_the_worker_sends(tcp_worker):
    import dataclasses
    from ephost.v1 import worker_pb2
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", tcp_worker.address)
        stats = env.get_worker_stats("w")
    assert isinstance(stats, ephost.WorkerStats) and stats.clients >= 1
    assert {f.name for f in dataclasses.fields(stats)} == {f.name for f in worker_pb2.WorkerStats.DESCRIPTOR.fields}
    assert stats.methods["Never/Called"].calls == 0 and "Never/Called" not in stats.methods
    hello = stats.methods["Worker/Hello"]
    assert isinstance(hello, ephost.MethodStats) and hello.calls >= 1 and hello.mean_s <= hello.max_s + 1e-9
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.clients = 0


def test_new_clients_spread_over_the_replicas_behind_one_name(worker):
    """Each client's channel shuffles the name's addresses before it picks one (gRFC A62): twenty clients of two
    replicas do not all land on the first (that happens with a chance of one in half a million)."""
    replicas = [worker("--ep", "reference", "--listen", f"127.0.0.1:{free_port()}", "--insecure") for _ in range(2)]
    name = "ipv4:" + ",".join(r.address for r in replicas)
    with ephost.Environment() as env:
        for i in range(20):
            env.register_execution_provider_library(f"c{i}", name)
        served = [env.registration(f"c{i}").link.current.info.pid for i in range(20)]
    counts = [served.count(r.proc.pid) for r in replicas]
    assert sum(counts) == 20 and min(counts) >= 1, counts


@pytest.mark.timeout(120)
def test_a_replica_that_drains_moves_its_clients_to_another_and_no_run_fails(worker):
    """SIGTERM to the replica a client talks to, under two threads of runs, with the default policy ("raise"):
    the calls it refused as it drained never ran there, and are made on the other replica behind the name, where
    the client makes its EP and partitions again."""
    import signal
    replicas = [worker("--ep", "reference", "--listen", f"127.0.0.1:{free_port()}", "--insecure") for _ in range(2)]
    name = "ipv4:" + ",".join(r.address for r in replicas)
    with ephost.Environment() as env:
        env.register_execution_provider_library("pool", name)
        link = env.registration("pool").link
        first = next(r for r in replicas if r.proc.pid == link.current.info.pid)
        other = next(r for r in replicas if r is not first)
        with InferenceSession(models.diamond(), options_for(env, "pool"), env=env) as session:
            with diamond_runs(session, lambda: link.current.info.pid) as results:
                deadline = time.monotonic() + 60
                while len(results) < 50 and time.monotonic() < deadline:
                    time.sleep(0.01)
                first.proc.send_signal(signal.SIGTERM)
                while sum(1 for r in results if r == (other.proc.pid, True)) < 50 and time.monotonic() < deadline:
                    time.sleep(0.01)
            assert first.proc.wait(30) == 0
            errors = [r for r in results if not isinstance(r, tuple)]
            assert errors == [], errors[:3]
            assert all(ok for _, ok in results), "every result is correct"
            assert link.generation == 2 and link.current.info.pid == other.proc.pid
            assert env.get_worker_stats("pool").partitions_compiled == 1, "compiled again on the other replica"
            assert not {"crashed", "failed", "retried"} & set(session.failure_counters), session.failure_counters
