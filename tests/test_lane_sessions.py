"""Sessions over the fast lane, against gRPC: the same results, a connection per calling thread, a call made
inside another's going over gRPC, and a call in flight ended by its worker's death, by its EP's unregistration or
by its deadline, over real workers, sockets and shared memory."""
from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

import ephost
from ephost import InferenceSession, RunOptions
from ephost.fastlane import METHODS
import models
from helpers import in_threads, options_for, worker_stats
from lane_helpers import SHAPE, X, LaneWaits, diamond_session, lane_of, running
from lane_helpers import ort_env  # noqa: F401 (a fixture)


def test_compute_goes_over_the_fast_lane_and_gives_what_grpc_gives(ort_env):
    assert lane_of(ort_env, "ort") is not None
    assert lane_of(ort_env, "ort_grpc") is None, "fast_lane=false keeps every call on gRPC"
    results = {}
    for registration in ("ort", "ort_grpc"):
        before = worker_stats(ort_env, registration)
        with diamond_session(ort_env, registration) as s:
            results[registration] = [s.run(None, {"x": X * k})[0] for k in range(5)]
        after = worker_stats(ort_env, registration)
        lane_calls = after.fast_lane_calls - before.fast_lane_calls
        calls = {m: after.methods[m].calls - (before.methods[m].calls if m in before.methods else 0)
                 for m in METHODS if m in after.methods}
        assert calls["Ep/Compute"] == 5
        # Every call of a method the lane carries went on it: the 5 Computes, and what made and released the
        # session's EP, partition and allocator (CreateEp, GetCapability, Compile, ReleaseNodeComputeInfos...).
        assert calls["Ep/Compile"] == 1 and calls["EpFactory/CreateEp"] == 1
        assert lane_calls == (sum(calls.values()) if registration == "ort" else 0)
    for k in range(5):
        np.testing.assert_array_equal(results["ort"][k], models.diamond_expected(X * k))
        np.testing.assert_array_equal(results["ort"][k], results["ort_grpc"][k])


def test_no_lane_without_shared_memory():
    with ephost.Environment() as env:
        env.register_execution_provider_library("ref", "reference", {"shared_memory": "false"})
        assert lane_of(env, "ref") is None
        with diamond_session(env, "ref") as s:
            np.testing.assert_array_equal(s.run(None, {"x": X})[0], models.diamond_expected(X))
        assert worker_stats(env, "ref").fast_lane_calls == 0


def test_copy_tensors_and_alloc_over_the_lane(ort_env):
    device = next(d for d in ort_env.get_ep_devices() if d.registration_name == "ort")
    before = worker_stats(ort_env, "ort").fast_lane_calls
    private = ort_env.create_shared_allocator(device, ephost.DeviceMemoryType.DEFAULT)
    try:
        x = np.arange(1024, dtype=np.float32)
        inside = ephost.Tensor.empty(x.shape, x.dtype, private)                      # Alloc
        ort_env.copy_tensors([ephost.Tensor.from_numpy(x)], [inside])                 # CopyTensors in
        out = ephost.Tensor.from_numpy(np.zeros_like(x))
        ort_env.copy_tensors([inside], [out])                                         # CopyTensors out
        np.testing.assert_array_equal(out.numpy(), x)
        inside.release()                                                              # Free
    finally:
        ort_env.release_shared_allocator(device, ephost.DeviceMemoryType.DEFAULT)
    assert worker_stats(ort_env, "ort").fast_lane_calls - before >= 4


def test_eight_threads_run_one_session_at_once(ort_env):
    before = worker_stats(ort_env, "ort").fast_lane_connections
    counts = [0] * 8
    with diamond_session(ort_env, "ort") as s:
        def work(i):
            rng = np.random.default_rng(i)
            for _ in range(40):
                x = rng.standard_normal(SHAPE).astype(np.float32)
                np.testing.assert_allclose(s.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
                counts[i] += 1

        errors = in_threads(work, 8)
    assert errors == []
    assert counts == [40] * 8
    opened = worker_stats(ort_env, "ort").fast_lane_connections - before
    assert opened == 8, "each calling thread has a connection of its own"


def test_a_call_made_inside_a_lane_call_of_the_same_thread_goes_over_grpc(ort_env, monkeypatch):
    """What runs on a thread while its fast-lane call waits for the reply (a finalizer the garbage collector
    runs there, a signal handler) and calls the same worker does not use that connection: it would read the
    pending reply as its own, and leave its own for the waiting call (found as an Alloc that read an empty reply
    as buffer 0). It goes over gRPC, and each call gets its own result."""
    from ephost.fastlane import FrameReader
    x, y = X - 8, X * 2
    with diamond_session(ort_env, "ort") as outer, InferenceSession(
            models.chain(["Relu", "Neg"], shape=SHAPE), options_for(ort_env, "ort"), env=ort_env) as inner:
        for _ in range(2):  # both kept on this thread's connection
            outer.run(None, {"x": x})
            inner.run(None, {"x": y})
        nested = []
        read = FrameReader.read

        def reentrant_read(reader, key=None):
            if not nested and threading.current_thread() is threading.main_thread():
                nested.append(None)  # once: the inner call reads too
                nested[0] = inner.run(None, {"x": y})[0]
            return read(reader, key)

        before = worker_stats(ort_env, "ort")
        monkeypatch.setattr(FrameReader, "read", reentrant_read)
        (got,) = outer.run(None, {"x": x})
        monkeypatch.undo()
        after = worker_stats(ort_env, "ort")
        np.testing.assert_allclose(got, models.diamond_expected(x), rtol=1e-6)
        assert len(nested) == 1
        np.testing.assert_array_equal(nested[0], -np.maximum(y, 0))
        computes = after.methods["Ep/Compute"].calls - before.methods["Ep/Compute"].calls
        assert (computes, after.fast_lane_calls - before.fast_lane_calls) == (2, 1), "the inner one over gRPC"
        np.testing.assert_allclose(outer.run(None, {"x": y})[0], models.diamond_expected(y), rtol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["raise", "retry", "fallback"])
def test_worker_killed_while_a_thread_is_blocked_in_a_lane_call(policy, monkeypatch):
    """The call in flight ends as its connection ends with the worker's death (not at its deadline), with
    EpWorkerCrashed naming the call (raise); or is made again on the restarted worker (retry) or on the CPU
    fallback (fallback)."""
    with ephost.Environment() as env:
        # The 2nd compute hangs, so that a thread is surely blocked in it when the worker is killed. (Under
        # `retry` the last run below is the new worker's 2nd compute: it hangs to its deadline, then is retried.)
        env.register_execution_provider_library("chaos", "chaos", {"fault": "hang", "at": "compute", "after": "2",
                                                                    "timeout_s": "5"})
        pid = env.registration("chaos").process.pid
        with diamond_session(env, "chaos", policy) as s:
            np.testing.assert_array_equal(s.run(None, {"x": X})[0], models.diamond_expected(X))
            assert lane_of(env, "chaos") is not None
            waits = LaneWaits(monkeypatch)
            t, outcome = running(s)
            assert waits.wait_for(t), "the thread waits for its Compute's reply (the compute hangs)"
            os.kill(pid, signal.SIGKILL)
            t.join(30)
            assert not t.is_alive()
            if policy == "raise":
                error = outcome["error"]
                assert isinstance(error, ephost.EpWorkerCrashed), repr(error)
                assert "SIGKILL" in str(error) and "Ep/Compute" in str(error)
                # Its wait ended with its connection (reset where the worker died with bytes unread), not its deadline
                assert waits.ended[t] in ("end of file", "ConnectionResetError"), waits.ended[t]
            else:
                np.testing.assert_array_equal(outcome["y"], models.diamond_expected(X))
            # The worker is back (the retry's compute was its 1st: no hang) and runs go on.
            env.registration("chaos").link.wait_healthy(10)
            np.testing.assert_array_equal(s.run(None, {"x": X})[0], models.diamond_expected(X))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["raise", "fallback"])
def test_an_ep_unregistered_while_a_thread_waits_in_a_lane_call_ends_that_call_as_unregistered(policy, monkeypatch):
    """The call's connection is closed under it by another thread: the call's wait ends before the worker is
    stopped (not as the worker goes), with the EP's EpWorkerUnavailable saying it was unregistered (not what the
    worker said as it forgot this client, nor the released slots or descriptors the closing thread would have
    freed under the waiting one), or, under `fallback`, the call runs on the CPU fallback."""
    with ephost.Environment() as env:
        env.register_execution_provider_library("chaos", "chaos", {"fault": "hang", "at": "compute", "after": "2"})
        with diamond_session(env, "chaos", policy) as s:
            np.testing.assert_array_equal(s.run(None, {"x": X})[0], models.diamond_expected(X))
            waits = LaneWaits(monkeypatch)
            t, outcome = running(s)
            assert waits.wait_for(t), "the thread waits for its Compute's reply on the lane (the compute hangs)"
            assert lane_of(env, "chaos").connections == 2, "the waiting thread's connection is open"
            process = env.registration("chaos").process
            stop, ended_before_stop = process.stop, []

            def stopping(*args, **kw):  # the worker is stopped once unregistering has closed the connections
                ended_before_stop.append(waits.wait_ended(t, 30))
                stop(*args, **kw)

            monkeypatch.setattr(process, "stop", stopping)
            env.unregister_execution_provider_library("chaos")
            t.join(30)
            assert not t.is_alive()
            assert ended_before_stop == [True], "the call's wait ended before its worker was stopped"
            if policy == "raise":
                error = outcome["error"]
                assert type(error) is ephost.EpWorkerUnavailable, repr(error)
                assert "'chaos' was unregistered" in str(error)
            else:
                np.testing.assert_array_equal(outcome["y"], models.diamond_expected(X))


@pytest.mark.timeout(60)
def test_a_compute_past_its_deadline_is_ended_and_the_worker_replaced():
    with ephost.Environment() as env:
        env.register_execution_provider_library("chaos", "chaos", {"fault": "hang", "at": "compute", "after": "1"})
        first = env.registration("chaos").process.pid
        with diamond_session(env, "chaos") as s:
            with pytest.raises(ephost.EpDeadlineExceeded, match="deadline of 0.5 s"):
                s.run(None, {"x": X}, run_options=RunOptions(compute_timeout_s=0.5))
            link = env.registration("chaos").link
            assert link.wait_healthy(10)
            assert env.registration("chaos").process.pid != first, "the stuck worker was killed and replaced"
