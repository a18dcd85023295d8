"""A worker's life: it drains on SIGTERM, dies with the application that launched it, and its death is a
typed error that names the EP, the signal and the call. The application keeps its data; nothing leaks."""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import ephost
from ephost import DeviceMemoryType, Tensor


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit status waits for init to reap it, which takes its time)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not running(pid):
            return True
        time.sleep(0.02)
    return False


def wait_until(condition, seconds: float = 30.0) -> bool:
    """Poll `condition` until it holds (True) or `seconds` pass (False)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def metric(w, name: str, **labels) -> float:
    """A sample of worker `w`'s (started with --metrics-listen) /metrics, 0 where it has none."""
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://{json.loads(w.ready_line)['metrics']}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return next((s.value for family in text_string_to_metric_families(text) for s in family.samples
                 if s.name == name and s.labels == labels), 0)


def calls_under_way(w) -> int:
    """The calls worker `w` (started with --metrics-listen) serves now."""
    return int(metric(w, "ephost_worker_calls_under_way"))


METERED = ("--metrics-listen", "127.0.0.1:0")


def queue_copies(env, w):
    """Seconds of copies queued on a stream inside worker `w`: (its device, the stream)."""
    env.register_execution_provider_library("w", w.address)
    (device,) = env.get_ep_devices()
    allocator = env.create_shared_allocator(device, DeviceMemoryType.DEFAULT)
    a, b = (Tensor.empty((128 << 20,), np.uint8, allocator) for _ in range(2))
    stream = device.create_sync_stream()
    for _ in range(64):
        env.copy_tensors([a, b], [b, a], stream=stream)
    return device, stream


def flushing(stream, w) -> tuple[threading.Thread, list]:
    """stream.flush() on a thread of its own, started and waiting inside worker `w` (started with
    METERED), unless it finished first: the thread, and what it returned or the EpError it met."""
    idle = calls_under_way(w)
    outcome = []

    def flush():
        try:
            outcome.append(stream.flush())
        except ephost.EpError as e:
            outcome.append(e)
    thread = threading.Thread(target=flush)
    thread.start()
    assert wait_until(lambda: calls_under_way(w) > idle or not thread.is_alive()), "the Flush call never came"
    return thread, outcome


def test_sigterm_drains_in_flight_calls_then_exits(worker):
    """While it drains, the worker says NOT_SERVING to the clients watching it (which then wait for a successor),
    stops listening (its socket files go: a successor may take the address), refuses new calls on the
    connections it has, and finishes the calls under way; then it exits."""
    from ephost.client.reach import diagnose
    from ephost.v1 import allocator_pb2
    # A grace long enough for the queued copies on a loaded machine (the default 5 s is an operator's choice).
    w = worker("--ep", "reference", "--drain-grace-s", "120", *METERED)
    with ephost.Environment() as env:
        device, stream = queue_copies(env, w)
        link = env.registration("w").link
        conn = link.current
        thread, results = flushing(stream, w)
        w.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: not link.serving)
        if thread.is_alive():
            assert link.health.startswith("away: is draining"), link.health
            assert diagnose(w.address, conn.credentials).kind == "no socket", "it no longer listens"
            assert not os.path.exists(w.socket + ".fds")
            with pytest.raises(ephost.EpWorkerDraining, match="draining"):  # a call on the lane it has open
                conn.call(conn.allocator.Alloc, allocator_pb2.AllocRequest(allocator=1, nbytes=64))
            assert metric(w, "ephost_worker_draining") == 1
            assert metric(w, "ephost_worker_calls_total", method="Allocator/Alloc", status="UNAVAILABLE") == 1
            drained_while_running = True
        else:
            drained_while_running = False
        thread.join(60)
        assert results == [None], "a call in flight when SIGTERM came must finish"
        assert drained_while_running, "the queued copies outlasted the checks"
        assert w.proc.wait(30) == 0
    assert not os.path.exists(w.socket) and not os.path.exists(w.socket + ".fds")


def test_a_call_longer_than_the_drain_grace_is_cut_and_the_worker_exits(worker):
    w = worker("--ep", "reference", "--drain-grace-s", "0.2", *METERED)
    with ephost.Environment() as env:
        _, stream = queue_copies(env, w)
        thread, outcome = flushing(stream, w)
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(60) == 0
        thread.join(60)
        assert outcome != [None], "the flush outlived a worker that stopped after its 0.2 s grace"
        # The worker went away as it drained: a session's call of this kind is made again on its successor
        assert type(outcome[0]) is ephost.EpWorkerDraining and "as it drained" in str(outcome[0]), outcome


def test_a_call_under_way_as_its_connection_is_closed_is_the_workers_going_not_a_cancel(worker):
    """The connection closed under a call by another thread (as a successor's start or an unregister closes
    it): gRPC cancels the call; this end cancelled nothing, so it is EpWorkerUnavailable, which the failure
    policies handle, not EpCancelled."""
    w = worker("--ep", "reference", *METERED)
    with ephost.Environment() as env:
        _, stream = queue_copies(env, w)
        thread, outcome = flushing(stream, w)
        env.registration("w").link.current.close()
        thread.join(60)
        assert len(outcome) == 1 and type(outcome[0]) is ephost.EpWorkerUnavailable, outcome
        assert "Stream/Flush was cancelled: the connection to the worker" in str(outcome[0])


def test_a_drain_grace_out_of_range_is_refused():
    proc = subprocess.run([sys.executable, "-m", "ephost", "worker", "--ep", "reference", "--drain-grace-s", "inf"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--drain-grace-s" in proc.stderr and "between 0 and 600" in proc.stderr


def test_worker_dies_with_the_application_that_launched_it(tmp_path):
    app = textwrap.dedent("""
        import os, sys, time, ephost
        env = ephost.Environment()
        env.register_execution_provider_library("ref", "reference")
        print(env.registration("ref").process.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", app], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        worker_pid = int(proc.stdout.readline())
        shm_before = set(os.listdir("/dev/shm"))
        proc.kill()
        proc.wait()
        assert wait_gone(worker_pid, 30), "the worker outlived its application"
        said = proc.stderr.read().decode()  # the application's stderr, which its worker shares: whole once it is gone
        assert "the launching process has gone; exiting" in said, said
        assert set(os.listdir("/dev/shm")) - shm_before == set()
    finally:
        proc.stdout.close()
        proc.stderr.close()


# The start of an application script: a Relu model, an Environment with a launched reference worker ("ref"),
# and SessionOptions for its devices.
APP_WITH_A_WORKER = textwrap.dedent("""
    import numpy as np
    import ephost
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 18)])
    env = ephost.Environment()
    env.register_execution_provider_library("ref", "reference")
    options = ephost.SessionOptions()
    options.add_provider_for_devices(env.get_ep_devices())
""")


def test_an_application_that_closes_nothing_exits_and_leaves_nothing():
    """A script that opens an Environment and a session and exits without closing either (the session dropped
    into a cycle the collector never got to): it exits at once, with its worker gone and nothing in /dev/shm.
    The Environment closes as the application exits (left to the interpreter's teardown, stopping its worker
    waited forever for a thread frozen there), and the session closes in place at teardown (a dropped session
    is closed on a thread of its own, and a thread started then never runs)."""
    app = APP_WITH_A_WORKER + textwrap.dedent("""
        import gc
        print(env.registration("ref").process.pid, flush=True)
        gc.disable()
        print(ephost.InferenceSession(model, options, env=env).run(None, {"x": np.arange(4, dtype=np.float32) - 2})[0])
    """)
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.run([sys.executable, "-c", app], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    pid, result = proc.stdout.splitlines()
    assert result.split() == ["[0.", "0.", "0.", "1.]"]
    assert wait_gone(int(pid), 30), "the worker outlived its application"
    # (its stderr is the application's) stopped by the Environment as the application exited, not left to find
    # its launcher gone
    assert "the launching process has gone" not in proc.stderr, proc.stderr
    assert set(os.listdir("/dev/shm")) - shm_before == set()


CHILD_EXITS = {
    "exit": "sys.exit(0)  # a normal exit: the interpreter's exit hooks run in the child",
    "close": "s.close(); env.close(); sys.exit(0)",
    "with": "with env, s: pass\n    sys.exit(0)",
}


@pytest.mark.parametrize("how", CHILD_EXITS)
def test_a_forked_child_that_exits_leaves_its_parents_workers_alone(how):
    """A child forked from the application that exits normally (atexit hooks run), or closes the session and
    the Environment it inherited first (explicitly, or leaving a `with` block), stops nothing: the workers are
    the parent's, which runs on with the same worker. The child's copies are closed for the child alone."""
    app = APP_WITH_A_WORKER + textwrap.dedent("""
        import os, sys
        worker = env.registration("ref").process.pid
        s = ephost.InferenceSession(model, options, env=env)
        feed = {"x": np.arange(4, dtype=np.float32) - 2}
        s.run(None, feed)
        child = os.fork()
        if child == 0:
            %s
        os.waitpid(child, 0)
        print(s.run(None, feed)[0], env.registration("ref").process.pid == worker, flush=True)
        s.close()
        env.close()
    """) % CHILD_EXITS[how]
    proc = subprocess.Popen([sys.executable, "-c", app], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:  # a child that hung (the failure this test is for) is in the group too
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, err
    assert out.split() == ["[0.", "0.", "0.", "1.]", "True"], out + err


def _after_ready(monkeypatch, then):
    """Workers launched from now on run `then(process, socket path)` once they said they are ready."""
    from ephost.client.launcher import WorkerProcess
    await_ready = WorkerProcess._await_ready

    def ready_then(process, timeout):
        address = await_ready(process, timeout)
        then(process, address[len("unix://"):])
        return address
    monkeypatch.setattr(WorkerProcess, "_await_ready", ready_then)


def test_a_launched_worker_whose_first_answer_fails_is_waited_for(monkeypatch):
    """A worker this process launched said it listens, but the first Hello finds nothing there (here its socket
    is away for a moment; under load, the connection not set up in time): the Hello is tried again while the
    worker lives, rather than the EP failing at once as an address where nothing listens does."""
    moved = threading.Event()

    def away_a_moment(process, path):
        os.rename(path, path + ".away")
        moved.set()
        threading.Timer(0.3, os.rename, (path + ".away", path)).start()
    _after_ready(monkeypatch, away_a_moment)
    with ephost.Environment() as env:
        env.register_execution_provider_library("late", "reference")
        assert moved.is_set() and [d.ep_name for d in env.get_ep_devices()] == ["reference"]
        assert env.registration("late").link.generation == 1


def test_a_launched_worker_that_dies_before_it_answers_is_a_crash_at_once(monkeypatch, caplog):
    """The wait for a launched worker's first answer ends as it dies, naming the signal (not after the
    connect timeout, as no answer); the registration fails, and no worker is started again for it."""
    import logging
    caplog.set_level(logging.INFO, logger="ephost")
    killed = []

    def kill(process, path):
        os.rename(path, path + ".away")  # so that only its death can end the wait
        os.kill(process.pid, signal.SIGKILL)
        killed.append(process.pid)
    _after_ready(monkeypatch, kill)
    with ephost.Environment() as env:
        with pytest.raises(ephost.EpWorkerCrashed, match="died with signal SIGKILL during Worker/Hello"):
            env.register_execution_provider_library("dies", "reference", {"connect_timeout_s": "600"})
        for watcher in [t for t in threading.enumerate() if t.name == f"ephost-watch-{killed[0]}"]:
            watcher.join(10)  # it has told the supervisor of the death
        assert env.registrations() == []
    assert not [r for r in caplog.records if "restarting" in r.getMessage()], "a worker started again"


def test_a_killed_worker_that_is_not_restarted_is_a_typed_error_naming_ep_and_signal():
    env = ephost.Environment()
    try:
        env.register_execution_provider_library("victim", "reference", {"restart": "false"})
        (device,) = env.get_ep_devices()
        allocator = env.create_shared_allocator(device, DeviceMemoryType.HOST_ACCESSIBLE)
        process = env.registration("victim").process
        os.kill(process.pid, signal.SIGKILL)
        assert process.exited.wait(5), "the death is noticed by the watcher, without any call"
        with pytest.raises(ephost.EpWorkerCrashed) as info:
            allocator.get_stats()
        error = info.value
        assert isinstance(error, ephost.EpWorkerFailed)
        assert error.ep == "reference" and error.signal == signal.SIGKILL
        assert "SIGKILL" in str(error) and "restarting is off" in str(error)
        assert isinstance(error, ephost.EpWorkerUnavailable) and isinstance(error, ephost.EpError)
    finally:
        env.close()


def test_the_application_keeps_its_data_when_the_worker_dies():
    env = ephost.Environment()
    try:
        env.register_execution_provider_library("victim", "reference")
        (device,) = env.get_ep_devices()
        allocator = env.create_shared_allocator(device, DeviceMemoryType.HOST_ACCESSIBLE)
        data = np.random.default_rng(3).standard_normal((256, 1024)).astype(np.float32)
        tensor = Tensor.from_numpy(data, allocator)
        view = tensor.numpy()
        process = env.registration("victim").process
        os.kill(process.pid, signal.SIGKILL)
        process.exited.wait(5)
        np.testing.assert_array_equal(tensor.numpy(), data)
        np.testing.assert_array_equal(view, data)
        view[0, 0] = 42.0  # still writable memory of this process
        assert tensor.numpy()[0, 0] == 42.0
    finally:
        env.close()


def test_a_malformed_client_stream_does_not_keep_the_worker_from_stopping(worker):
    """grpcio could hang in server.stop() after a client stream whose message failed to parse; the worker now
    parses requests itself, and its drain ends as any does, every call finished (not by the exit regardless that
    follows its grace)."""
    import grpc
    from helpers import RawClient
    w = worker("--ep", "reference", exit_with_parent=False)
    client = RawClient(w.address)
    try:
        write = client.channel.stream_unary("/ephost.v1.Allocator/Write")
        with pytest.raises(grpc.RpcError) as info:
            write(iter([b"\xff\xff\xff"]), timeout=10, metadata=client.metadata)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        client.close()
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(15) == 0
    with open(w.log_path) as f:
        log = f.read()
    # The gRPC server stopped, every call finished: the drain's own end, not the exit past its grace.
    assert "every call finished" in log and "exiting regardless" not in log, log


# --- restarts and drains the application does not see ------------------------------------------------------

def _listen_args(transport: str, tmp_path) -> list[str]:
    if transport == "unix":
        return ["--listen", f"unix://{tmp_path}/w.sock"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return ["--listen", f"127.0.0.1:{s.getsockname()[1]}", "--insecure"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy, transport", [("retry", "unix"), ("retry", "tcp"), ("raise", "unix")])
def test_a_worker_restarted_on_its_address_under_traffic_fails_no_run(worker, tmp_path, policy, transport, caplog,
                                                                     monkeypatch):
    """SIGTERM to a worker serving two threads of runs, a new worker on the same address once a run waits for
    one: no run fails, whatever the policy (a call the old worker refused as it drained never ran there, and is
    made on the new one), and none is retried: the restart is no failure of the EP, and it is logged as a drain."""
    import logging
    import models
    from helpers import diamond_runs, options_for
    caplog.set_level(logging.INFO, logger="ephost")
    args = ("--ep", "reference", *_listen_args(transport, tmp_path))
    first = worker(*args)
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", first.address)
        link = env.registration("w").link
        waiting, wait_recovered = threading.Event(), link.wait_recovered

        def waits_for_the_worker() -> bool:  # a run waits for a worker to come back
            waiting.set()
            return wait_recovered()

        monkeypatch.setattr(link, "wait_recovered", waits_for_the_worker)
        options = options_for(env, "w")
        options.ep_failure_policy = policy
        with ephost.InferenceSession(models.diamond(), options, env=env) as session:
            with diamond_runs(session, lambda: link.generation) as results:
                assert wait_until(lambda: len(results) >= 50)
                first.proc.send_signal(signal.SIGTERM)
                assert wait_until(lambda: not link.serving), "the clients saw the drain"
                # The operator's restart: a new worker on the same address once a run waits for it, while the
                # first one may still be draining.
                assert waiting.wait(30), "no run waited for the worker"
                worker(*args)
                assert wait_until(lambda: sum(1 for r in results if r == (2, True)) >= 50)
            assert first.proc.wait(30) == 0
            errors = [r for r in results if not isinstance(r, tuple)]
            assert errors == [], errors[:3]
            assert all(ok for _, ok in results), "every result is correct"
            assert {g for g, _ in results} == {1, 2}, "runs on the first worker, then on the second"
            failures = [e["error"] for e in session.run_log if e["error"]]
            assert not {"crashed", "failed", "retried"} & set(session.failure_counters), failures
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("is draining" in r.getMessage() and "reconnecting" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(60)
def test_a_run_that_starts_while_the_worker_is_away_waits_for_it_and_compiles_again(worker, tmp_path, monkeypatch):
    import models
    from ephost.client.supervisor import WorkerLink
    from helpers import options_for
    waiting = set()  # the threads that came to wait for the worker to come back
    wait_recovered = WorkerLink.wait_recovered

    def tell_and_wait(link):
        waiting.add(threading.current_thread())
        return wait_recovered(link)
    monkeypatch.setattr(WorkerLink, "wait_recovered", tell_and_wait)
    address = f"unix://{tmp_path}/w.sock"
    first = worker("--ep", "reference", "--listen", address)
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", address)
        link = env.registration("w").link
        with ephost.InferenceSession(models.diamond(), options_for(env, "w"), env=env) as session:
            x = np.ones((2, 3), np.float32)
            session.run(None, {"x": x})
            first.stop()
            assert wait_until(lambda: not link.serving)
            outcome = []
            thread = threading.Thread(target=lambda: outcome.append(session.run(None, {"x": x})[0]))
            thread.start()  # under the default policy, raise
            assert wait_until(lambda: thread in waiting or not thread.is_alive())
            assert outcome == [] and thread.is_alive(), "the run waits for the worker to come back"
            worker("--ep", "reference", "--listen", address)
            thread.join(30)
            np.testing.assert_allclose(outcome[0], models.diamond_expected(x), rtol=1e-6)
            stats = env.get_worker_stats("w")
            assert link.generation == 2 and stats.partitions_compiled == 1 and stats.methods["Ep/Compute"].calls == 1


# --- logs an operator can use ----------------------------------------------------------------------------------

def test_a_worker_logs_its_life_at_info_by_default(worker):
    """Listening, a client connected and gone, the drain started and finished, the exit: one JSON object a line."""
    import json
    w = worker("--ep", "reference", "--log-format", "json")
    with ephost.Environment() as env:
        env.register_execution_provider_library("app", w.address)
    w.proc.terminate()
    assert w.proc.wait(30) == 0
    with open(w.log_path) as f:
        entries = [json.loads(line) for line in f if line.startswith("{")]
    messages = [e["message"] for e in entries]
    expected = ["listening on", "client 'app' connected", "client 'app' gone (it said goodbye", "draining:",
                "drained in", "exiting (code 0)"]
    found = iter(messages)
    assert all(any(m.startswith(prefix) for m in found) for prefix in expected), messages  # in this order
    assert all(e["level"] == "INFO" and {"time", "logger", "pid"} <= set(e) for e in entries), entries


@pytest.mark.parametrize("policy, then", [("retry", "retried"), ("fallback", "fell back"), ("raise", None)])
def test_one_crash_is_one_warning_naming_its_cause(caplog, policy, then):
    """The supervisor's warning names the signal; what the policy did about the crash is noted at INFO."""
    import logging
    import models
    from helpers import options_for
    caplog.set_level(logging.INFO, logger="ephost")
    with ephost.Environment() as env:
        env.register_execution_provider_library("chaos", "chaos", {"fault": "segfault", "after": "2"})
        options = options_for(env, "chaos")
        options.ep_failure_policy = policy
        with ephost.InferenceSession(models.diamond(), options, env=env) as session:
            x = np.ones((2, 3), np.float32)
            session.run(None, {"x": x})
            if then is None:  # the second run's Compute crashes the worker
                with pytest.raises(ephost.EpWorkerCrashed):
                    session.run(None, {"x": x})
            else:
                session.run(None, {"x": x})
                assert session.failure_counters[then] == 1
            assert session.failure_counters["crashed"] == 1
            assert env.registration("chaos").link.wait_recovered(), "the worker is restarted"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "died with signal SIGSEGV; restarting" in warnings[0], warnings
    if then is not None:
        assert any(r.getMessage().endswith(f"chaos_0 {then}") for r in caplog.records), "the policy's note, at INFO"


def test_one_crash_under_onnx_runtime_is_one_warning_of_ephost(caplog):
    """Through ephost.ort, ORT reports the failed Compute itself (its log and its exception carry ephost's
    message, naming the signal): ephost's one warning is the supervisor's."""
    import logging
    import models
    import onnxruntime as ort
    import ephost.ort
    caplog.set_level(logging.INFO, logger="ephost")
    ephost.ort.register("crashy", "chaos", {"fault": "segfault", "after": "2"})
    try:
        options = ort.SessionOptions()
        options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == "crashy"], {})
        session = ort.InferenceSession(models.diamond().SerializeToString(), options)
        x = np.ones((2, 3), np.float32)
        session.run(None, {"x": x})
        session.disable_fallback()  # (ORT's Python API would make the session again on the CPU, and say so)
        with pytest.raises(Exception, match="died with signal SIGSEGV during Ep/Compute"):
            session.run(None, {"x": x})
        assert wait_until(lambda: any("restarting" in r.getMessage() for r in caplog.records)), "the supervisor's"
    finally:
        ephost.ort.unregister("crashy")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "died with signal SIGSEGV; restarting" in warnings[0], warnings
