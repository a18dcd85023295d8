"""Fault isolation: a crashing, hanging, raising or leaking EP never takes the application down, loses no
data, and under each failure policy gives a correct result or the typed error. Every test here is bounded."""
import contextlib
import os
import signal
import threading
import time

import numpy as np
import pytest

import ephost
from ephost import InferenceSession, RunOptions, SessionOptions, Tensor
from ephost.client.launcher import WorkerProcess
from ephost.eps.chaos import FAULTS
import models
from helpers import MovedClock, in_threads, killed_while_replaced, worker_pids

SHAPE = (512, 512)  # 1 MiB of float32: outputs are left in the worker's shared memory (so "alloc" is reached)
X = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
EXPECTED = models.diamond_expected(X)
CRASHED = ephost.EpWorkerCrashed  # EpWorkerFailed too, once the crash limit is reached
ERRORS = {"segfault": CRASHED, "abort": CRASHED, "exit": CRASHED,
          "hang": (ephost.EpDeadlineExceeded, CRASHED),  # a hang is ended by killing the worker: a crash
          "raise": ephost.EpInternal, "leak": None}
SUPERVISION = {"timeout_s": "1.5", "crash_window_s": "60"}


def chaos_env(fault, site, **extra):
    env = ephost.Environment()
    env.register_execution_provider_library("chaos", "chaos", {
        "fault": fault, "at": site, "after": "2", "leak_mb": "16", **SUPERVISION, **extra})
    return env


def session(env, policy, timeout=1.0):
    options = SessionOptions()
    options.ep_failure_policy = policy
    options.compute_timeout_s = timeout
    options.add_provider_for_devices(env.get_ep_devices())
    return InferenceSession(models.diamond(SHAPE), options, env=env)


def outcome(action):
    try:
        (y,) = action()
    except ephost.EpError as e:
        return e
    np.testing.assert_allclose(y, EXPECTED, rtol=1e-6)
    return "correct"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("policy", ["raise", "retry", "fallback"])
@pytest.mark.parametrize("site", ["get_capability", "compile", "compute", "alloc"])
@pytest.mark.parametrize("fault", FAULTS)
def test_every_fault_at_every_site_under_every_policy(fault, site, policy):
    env = chaos_env(fault, site)
    try:
        first = session(env, policy)  # set-up calls number 1
        results = [outcome(lambda: first.run(None, {"x": X}))]
        if site in ("get_capability", "compile"):
            results.append(outcome(lambda: session(env, policy).run(None, {"x": X})))  # set-up calls number 2
        else:
            results.append(outcome(lambda: first.run(None, {"x": X})))  # compute/alloc number 2 and on
        results.append(outcome(lambda: first.run(None, {"x": X})))
    finally:
        env.close()
    expected_error = ERRORS[fault]
    for result in results:
        if policy == "fallback" or expected_error is None:
            assert result == "correct", f"{fault} at {site} under {policy}: {result!r}"
        else:
            assert result == "correct" or isinstance(result, expected_error), \
                f"{fault} at {site} under {policy}: {result!r}"
    if policy == "raise" and expected_error is not None:
        assert any(isinstance(r, expected_error) for r in results), "the fault must surface as its typed error"
    if policy == "retry" and site == "compute" and fault != "hang":
        # the second Compute fails; the retry is the first Compute of the restarted worker (or the third of a
        # worker that raised and lives on), which succeeds
        assert results[1] == "correct", "a failed partition is re-run once on the restarted worker"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", FAULTS)
def test_faults_in_copy_tensors(fault):
    env = chaos_env(fault, "copy", after="3")
    try:
        (device,) = env.get_ep_devices()
        allocator = env.create_shared_allocator(device, ephost.DeviceMemoryType.DEFAULT)
        data = np.arange(1000, dtype=np.float32)

        def round_trip():
            on_worker = Tensor.empty(data.shape, data.dtype, allocator)
            back = Tensor.from_numpy(np.zeros_like(data))
            env.copy_tensors([Tensor.from_numpy(data)], [on_worker])
            env.copy_tensors([on_worker], [back])
            return back.numpy()

        np.testing.assert_array_equal(round_trip(), data)  # copies number 1 and 2; number 3 faults
        failures = []
        for _ in range(2):
            try:
                np.testing.assert_array_equal(round_trip(), data)
            except ephost.EpError as e:
                failures.append(e)
    finally:
        env.close()
    if ERRORS[fault] is None:
        assert failures == []
    else:
        assert failures and all(isinstance(f, (ERRORS[fault], ephost.EpWorkerUnavailable)) for f in failures)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("slots", ["true", "false"])
def test_a_session_collected_in_the_middle_of_a_fast_lane_call_does_not_take_its_reply(monkeypatch, slots):
    """A session the application drops is closed by its finalizer, which runs wherever the garbage collector
    happens to run: here between the request and the reply of a fast-lane call of the same thread, on the
    restarted worker. The finalizer's own calls (ReleaseNodeComputeInfos, ReleaseEp) must not go on that
    connection: they would read the pending reply, and the call would take theirs (an Alloc read an empty reply
    as buffer 0, and the run failed with "unknown buffer handle 0"; through the shared slots, a request could
    also overwrite the one before it, and the worker closed the connection)."""
    import gc
    from ephost.fastlane import FrameReader
    env = chaos_env("exit", "get_capability", fast_lane_slots=slots)
    gc.disable()  # the dropped session stays garbage until it is collected where this test says
    try:
        first = session(env, "retry")
        assert outcome(lambda: first.run(None, {"x": X})) == "correct"
        # GetCapability number 2 kills the worker, which is restarted; this session runs on the new one and is
        # dropped (sessions are collected by the cycle collector, not when their last reference goes)
        assert outcome(lambda: session(env, "retry").run(None, {"x": X})) == "correct"
        collected = []  # objects the one collection found (it is made once, and not again from inside itself)
        read = FrameReader.read

        def collecting_read(reader, key=None):
            if not collected and threading.current_thread() is threading.main_thread():
                collected.append(0)
                collected[0] = gc.collect()  # as a collection set off by an allocation in read() would
            return read(reader, key)

        monkeypatch.setattr(FrameReader, "read", collecting_read)
        results = [outcome(lambda: first.run(None, {"x": X})) for _ in range(3)]
        monkeypatch.undo()
        # and the dropped session is closed all the same: its EP released on the worker that runs now
        deadline = time.monotonic() + 10
        while env.get_worker_stats("chaos").methods["EpFactory/ReleaseEp"].calls < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        released = env.get_worker_stats("chaos").methods["EpFactory/ReleaseEp"].calls
    finally:
        gc.enable()
        env.close()
    assert collected and collected[0] > 0, "the dropped session was collected during a fast-lane call"
    assert results == ["correct"] * 3, results
    assert released == 1, "the dropped session's EP was released"


@pytest.mark.timeout(60)
def test_a_session_collected_inside_the_shared_staging_pool_does_not_deadlock(monkeypatch):
    """The sessions on one worker share its staging pool (the buffers large inputs are written into), and a
    dropped session gives its buffers back to the pool as it closes. The garbage collector may find it while
    another thread holds the pool's lock (here: a new thread taking its first buffer from the pool): closing it
    there would wait for that lock forever. A dropped session is closed on a thread of its own."""
    import gc
    from ephost.client import transfer
    env = ephost.Environment()
    env.register_execution_provider_library("ort", "onnxruntime", {})
    gc.disable()  # the dropped session stays garbage until it is collected where this test says
    results, collected = [], []
    try:
        first = session(env, "raise")
        assert outcome(lambda: first.run(None, {"x": X})) == "correct"
        assert outcome(lambda: session(env, "raise").run(None, {"x": X})) == "correct"  # dropped, holding one
        with session(env, "raise") as closed:  # its staging buffer goes back to the pool, idle
            assert outcome(lambda: closed.run(None, {"x": X})) == "correct"
        owned = transfer.owned

        def collecting_owned(buffer, link):  # asked of each idle buffer, under the pool's lock
            if not collected:
                collected.append(0)
                collected[0] = gc.collect()  # as a collection set off by an allocation there would
            return owned(buffer, link)

        monkeypatch.setattr(transfer, "owned", collecting_owned)
        thread = threading.Thread(target=lambda: results.append(outcome(lambda: first.run(None, {"x": X}))),
                                  daemon=True)
        thread.start()
        thread.join(20)
        assert not thread.is_alive(), "the run waits for a lock its own thread holds"
        monkeypatch.undo()
        results.append(outcome(lambda: first.run(None, {"x": X})))
    finally:
        gc.enable()
        env.close()
    assert collected and collected[0] > 0, "the dropped session was collected under the pool's lock"
    assert results == ["correct"] * 2, results


@pytest.mark.timeout(60)
def test_a_buffer_of_a_killed_worker_is_freed_without_a_word_to_its_successor():
    """A buffer freed just after its worker was killed from outside, while the worker is being replaced: the
    Free goes to the worker the buffer was in (gone, the buffer with it) and raises nothing (it raised
    EpWorkerCrashed); never to the successor, which numbers its client's handles from 1 again (a Free that
    waited out the restart named the dead worker's handle there: unknown, or one of the successor's own)."""
    env = ephost.Environment()
    env.register_execution_provider_library("ort", "onnxruntime", {})
    try:
        allocator = env.allocator_for(env.get_ep_devices()[0].memory_info(ephost.DeviceMemoryType.HOST_ACCESSIBLE))
        doomed = Tensor.from_numpy(X, allocator)
        os.kill(env.registration("ort").process.pid, signal.SIGKILL)
        doomed.release()
        kept = Tensor.from_numpy(X * 2, allocator)  # on the successor
        np.testing.assert_array_equal(kept.numpy(), X * 2)
        stats = env.get_worker_stats("ort")
        assert stats.methods["Allocator/Free"].calls == 0 and stats.buffers_live == 1
        kept.release()
        assert env.get_worker_stats("ort").buffers_live == 0
    finally:
        env.close()


def test_a_new_worker_that_dies_as_it_starts_is_a_crash_under_the_budget_and_another_starts():
    """The worker is killed, then its successor too as it starts: a second crash of the three the budget allows,
    after which a third worker starts and runs (before, the EP was marked failed for good, "could not be
    restarted": a vendor library crashing now and then as it loads ended its EP at once). With a budget of two,
    the EP is marked failed, saying so."""
    for limit in (3, 2):
        with ephost.Environment() as env:
            env.register_execution_provider_library("ort", "onnxruntime", {"crash_limit": str(limit)})
            options = SessionOptions()
            options.add_provider_for_devices(env.get_ep_devices(), {})
            with InferenceSession(models.chain(["Neg"], shape=(4,)), options, env=env) as s:
                x = np.arange(4, dtype=np.float32)
                np.testing.assert_array_equal(s.run(None, {"x": x})[0], -x)
                first = env.registration("ort").process
                others = worker_pids()  # (those of other tests' environments too)
                os.kill(first.pid, signal.SIGKILL)
                assert first.exited.wait(10)
                deadline, successor = time.monotonic() + 20, set()
                while not successor and time.monotonic() < deadline:
                    successor = worker_pids() - others
                assert successor, "no successor started"
                second = successor.pop()
                os.kill(second, signal.SIGKILL)  # (a worker takes most of a second to start)
                link = env.registration("ort").link
                if limit == 3:
                    assert link.wait_recovered()
                    np.testing.assert_array_equal(s.run(None, {"x": x})[0], -x)
                    assert env.registration("ort").process.pid not in (first.pid, second)
                else:
                    with pytest.raises(ephost.EpWorkerFailed, match="died as it started.*crashed 2 times"):
                        s.run(None, {"x": x})


@pytest.mark.timeout(90)
def test_a_restart_that_takes_several_starts_is_waited_for_as_a_whole(monkeypatch):
    """The worker is killed and its successor hangs as it starts, longer than recovery_timeout_s (its clock is
    moved on past it), then dies: a third worker starts. A call made while that one starts waits for it, up to
    recovery_timeout_s from its start (it failed at once, "has not come back", when the wait counted from the
    first worker's death)."""
    from ephost.client import supervisor
    clock = MovedClock()
    monkeypatch.setattr(supervisor, "time", clock)
    with ephost.Environment() as env:
        env.register_execution_provider_library("ref", "reference", {"recovery_timeout_s": "20"})
        options = SessionOptions()
        options.add_provider_for_devices(env.get_ep_devices(), {})
        with InferenceSession(models.chain(["Neg"], shape=(4,)), options, env=env) as s:
            x = np.arange(4, dtype=np.float32)
            np.testing.assert_array_equal(s.run(None, {"x": x})[0], -x)
            link = env.registration("ref").link
            first = env.registration("ref").process
            others = worker_pids()

            def started() -> int:
                deadline = time.monotonic() + 20
                while not (new := worker_pids() - others) and time.monotonic() < deadline:
                    time.sleep(0.005)
                assert new, "no successor started"
                others.update(new)
                return new.pop()

            os.kill(first.pid, signal.SIGKILL)
            second = started()
            os.kill(second, signal.SIGSTOP)  # a start that hangs (a worker takes most of a second to answer)
            assert not link.serving, "the successor answered before it was stopped"
            clock.ahead += 21  # ... for longer than recovery_timeout_s
            os.kill(second, signal.SIGKILL)
            third = started()
            np.testing.assert_array_equal(s.run(None, {"x": x})[0], -x)  # waits for the third worker
            assert env.registration("ref").process.pid == third
            assert link.supervisor.crashes == 2


def test_a_copy_out_of_a_worker_being_replaced_never_names_its_buffers_to_the_successor():
    """A copy out of a worker's private memory, asked after the worker was killed while it is being replaced: the
    data went with the worker, and the copy says so (EpNotFound) without a call; the dead worker's handle is never
    sent to the successor, which numbers its client's handles from 1 again (the copy decided how to name its
    tensors before it waited out the restart: "unknown buffer handle", or a buffer of the successor's own)."""
    with ephost.Environment() as env:
        env.register_execution_provider_library("ort", "onnxruntime", {})
        device = env.get_ep_devices()[0]
        private = env.create_shared_allocator(device, ephost.DeviceMemoryType.DEFAULT)
        x = np.arange(64, dtype=np.float32)
        inside = Tensor.empty(x.shape, x.dtype, private)
        env.copy_tensors([Tensor.from_numpy(x)], [inside])
        back = Tensor.from_numpy(np.zeros_like(x))
        env.copy_tensors([inside], [back])  # (both ways asked once: nothing left to ask the successor first)
        np.testing.assert_array_equal(back.numpy(), x)
        killed_while_replaced(env, "ort")
        with pytest.raises(ephost.EpNotFound, match="neither this process nor the worker can read"):
            env.copy_tensors([inside], [Tensor.from_numpy(np.zeros_like(x))])
        assert "DataTransfer/CopyTensors" not in env.get_worker_stats("ort").methods


@pytest.mark.timeout(60)
def test_a_worker_replaced_just_after_it_answered_compile_compiles_again(monkeypatch):
    """The worker is killed right after it answered Compile, and replaced before the session holds the
    partitions' handles: those are the dead worker's, and the first run compiles the partitions again on its
    successor (they were taken as the successor's, which has no such partition: "unknown compute info
    handle", or another partition of this client's that bears the number)."""
    from ephost.client.remote import RemoteEp
    env = ephost.Environment()
    env.register_execution_provider_library("ort", "onnxruntime", {})
    link = env.registration("ort").link
    compile_handles = RemoteEp.compile_handles
    replaced = []

    def then_replaced(ep, graphs):
        handles = compile_handles(ep, graphs)
        if not replaced:
            replaced.append(link.generation)
            os.kill(env.registration("ort").process.pid, signal.SIGKILL)
            deadline = time.monotonic() + 20
            while link.generation == replaced[0] and time.monotonic() < deadline:
                time.sleep(0.01)
        return handles

    monkeypatch.setattr(RemoteEp, "compile_handles", then_replaced)
    try:
        s = session(env, "raise")
        monkeypatch.undo()
        assert link.generation == replaced[0] + 1, "the worker was replaced before the session was made"
        assert outcome(lambda: s.run(None, {"x": X})) == "correct"
        assert env.get_worker_stats("ort").methods["Ep/Compile"].calls == 1, "compiled again on the successor"
    finally:
        env.close()


@pytest.mark.timeout(60)
def test_crash_limit_marks_the_ep_failed_and_fallback_takes_over():
    env = ephost.Environment()
    env.register_execution_provider_library("chaos", "chaos", {"fault": "segfault", "every": "1", "crash_limit": "2"})
    try:
        with session(env, "fallback") as s:
            for _ in range(4):
                np.testing.assert_allclose(s.run(None, {"x": X})[0], EXPECTED, rtol=1e-6)
            assert {sub.registration for sub in s.get_provider_graph_assignment_info()} == {"fallback"}
            assert s.failure_counters["crashed"] == 2 and s.failure_counters["moved to the fallback"] == 1
            assert [e["event"] for e in s.run_log][-2:] == ["crashed", "moved to the fallback"]
        with pytest.raises(ephost.EpWorkerFailed, match="crashed 2 times"):
            env.get_ep_devices()[0].create_sync_stream()
    finally:
        env.close()


@pytest.mark.timeout(60)
def test_an_ep_whose_every_allocation_fails_falls_back_run_after_run():
    # Each run's Compute fails in its Alloc and falls back; a run after one with the same feeds then makes its
    # steady run, which must not ask the worker for memory for a call it did not keep (nor fail a run whose
    # outputs are made where making it fails: CI saw a worker killed just then raise out of a run that fell back)
    env = ephost.Environment()
    env.register_execution_provider_library("chaos", "chaos", {"fault": "raise", "at": "alloc", "every": "1"})
    try:
        with session(env, "fallback") as s:
            for _ in range(4):
                np.testing.assert_allclose(s.run(None, {"x": X})[0], EXPECTED, rtol=1e-6)
            assert s.failure_counters["failed"] == 4 and s.failure_counters["fell back"] == 4
    finally:
        env.close()


@pytest.mark.timeout(60)
def test_a_hang_past_the_run_deadline_kills_the_worker_and_the_next_run_works():
    env = chaos_env("hang", "compute")
    try:
        with session(env, "raise", timeout=30) as s:
            process = env.registration("chaos").process
            s.run(None, {"x": X})
            with pytest.raises(ephost.EpDeadlineExceeded, match="deadline of 1 s"):
                s.run(None, {"x": X}, RunOptions(compute_timeout_s=1.0))  # overrides the session's 30 s
            assert process.exited.wait(5) and process.proc.returncode == -signal.SIGKILL
            np.testing.assert_allclose(s.run(None, {"x": X})[0], EXPECTED, rtol=1e-6)
    finally:
        env.close()


@pytest.mark.timeout(90)
def test_a_leaking_worker_is_restarted_between_calls():
    env = ephost.Environment()
    env.register_execution_provider_library("chaos", "chaos", {"fault": "leak", "every": "1", "leak_mb": "64",
                                                               "memory_limit_mb": "400"})
    try:
        with session(env, "raise") as s:
            pids = set()
            for _ in range(12):
                process = env.registration("chaos").process
                pids.add(process.pid)
                np.testing.assert_allclose(s.run(None, {"x": X})[0], EXPECTED, rtol=1e-6)
                assert process.resident_bytes() < (400 + 64 + 64) << 20 or process.returncode is not None
            assert len(pids) >= 2, "the worker was replaced once it held more than its limit"
            assert s.failure_counters["crashed"] == 0, "a restart for memory is not a crash"
    finally:
        env.close()


@pytest.mark.timeout(120)
def test_a_worker_replaced_for_memory_under_calls_of_other_threads_fails_none_of_them():
    """Replacing a worker past its memory limit is this process's doing, not a failure: under `raise`, threads
    whose calls meet it (refused by the old worker as it drains, or made as it was being replaced) get their
    answers from its successor, and threads that each found it over its limit replace it once between them
    (a second replacement stopped the new worker under the calls that had gone on to it)."""
    with ephost.Environment() as env:
        env.register_execution_provider_library("chaos", "chaos", {"wrap": "onnxruntime", "fault": "leak", "every": "8",
                                                                   "leak_mb": "24", "memory_limit_mb": "250"})
        with session(env, "raise") as s:
            pids = set()
            deadline = time.monotonic() + 50

            def work(i):
                while len(pids) < 7 and time.monotonic() < deadline:
                    np.testing.assert_allclose(s.run(None, {"x": X})[0], EXPECTED, rtol=1e-6)
                    pids.add(env.registration("chaos").process.pid)

            assert in_threads(work, 4) == []
            assert len(pids) >= 7, "the worker was replaced six times"
            assert s.failure_counters["crashed"] == 0


def test_a_call_cut_by_a_worker_this_process_stopped_is_made_again_not_a_crash():
    """A worker replaced for its memory drains and exits 0 at this process's word: a call it had not read when it
    closed its connections (sent as the replacement began) is EpWorkerDraining, made again on the successor as a
    call it refused is; a worker that died is a crash."""
    stopped = WorkerProcess("reference")
    stopped.stop()
    error = stopped.crashed_error("Ep/Compute")
    assert type(error) is ephost.EpWorkerDraining and "Ep/Compute" in str(error), error
    killed = WorkerProcess("reference")
    try:
        killed.kill()
        assert killed.exited.wait(10)
        error = killed.crashed_error("Ep/Compute")
        assert type(error) is ephost.EpWorkerCrashed and "SIGKILL" in str(error), error
    finally:
        killed.stop()


def test_threads_that_each_found_the_worker_over_its_limit_replace_it_once():
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", "reference", {"memory_limit_mb": "4096"})
        link = env.registration("w").link
        measured = link.current
        link.recycle(stale=measured)  # the first thread to act on what it measured
        replaced = (link.process.pid, link.generation)
        link.recycle(stale=measured)  # the second: the worker it measured is gone already
        assert (link.process.pid, link.generation) == replaced


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["retry", "fallback"])
def test_eight_threads_while_the_worker_is_killed_from_outside(policy):
    env = ephost.Environment()
    env.register_execution_provider_library("victim", "reference", {"crash_limit": "10"})
    results, stop = [], threading.Event()
    try:
        with session(env, policy, timeout=10) as s:
            def work(seed):
                rng = np.random.default_rng(seed)
                while not stop.is_set():
                    x = rng.standard_normal(SHAPE).astype(np.float32)
                    try:
                        (y,) = s.run(None, {"x": x})
                        results.append(bool(np.allclose(y, models.diamond_expected(x), rtol=1e-6)))
                    except ephost.EpError as e:
                        results.append(e)

            def at_work(killed) -> object:
                """The worker process once it is another than `killed` and has served the threads' runs eight
                Computes (the next kill hits a worker at work)."""
                deadline = time.monotonic() + 60
                while True:
                    process = env.registration("victim").process
                    if process is not killed and process.returncode is None:
                        with contextlib.suppress(ephost.EpError):  # (the worker may be dying or starting)
                            if env.get_worker_stats("victim").methods["Ep/Compute"].calls >= 8:
                                return process
                    assert time.monotonic() < deadline, "no worker served the runs"
                    time.sleep(0.01)

            threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            killed = None
            for _ in range(3):
                killed = at_work(killed)
                os.kill(killed.pid, signal.SIGKILL)
            at_work(killed)  # and a successor serves again
            stop.set()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads), "a run hung"
    finally:
        env.close()
    assert results.count(True) > 8, "runs kept succeeding"
    wrong = [r for r in results if r is False]
    assert wrong == [], "every result that came back is correct"
    errors = [r for r in results if not isinstance(r, bool)]
    assert all(isinstance(e, (ephost.EpWorkerCrashed, ephost.EpWorkerUnavailable)) for e in errors), errors[:3]
    if policy == "fallback":
        assert errors == [], "with the fallback every run returns a correct result"


@pytest.mark.timeout(60)
def test_tensors_keep_their_data_across_a_crash_and_restart():
    env = chaos_env("segfault", "compute")
    try:
        (device,) = env.get_ep_devices()
        allocator = env.create_shared_allocator(device, ephost.DeviceMemoryType.HOST_ACCESSIBLE)
        held = Tensor.from_numpy(X, allocator)
        with session(env, "retry") as s:
            for _ in range(3):
                np.testing.assert_allclose(s.run(None, {"x": held})[0], EXPECTED, rtol=1e-6)
            assert s.failure_counters["crashed"] == 2  # each new worker crashes on its second Compute
        np.testing.assert_array_equal(held.numpy(), X)  # still the application's, after the worker died
        fresh = Tensor.from_numpy(X, allocator)         # the shared allocator was made again on the new worker
        np.testing.assert_array_equal(fresh.numpy(), X)
        assert allocator.get_stats()["InUse"] > 0
    finally:
        env.close()


@pytest.mark.timeout(60)
def test_a_remote_worker_that_goes_away_and_comes_back(worker, monkeypatch):
    """Not launched by this process: calls wait for it up to recovery_timeout_s from the moment it went, then
    fail at once naming the cause, and resume (handles made again) once a worker answers at the address."""
    first = worker("--ep", "reference")
    address = first.address
    env = ephost.Environment()
    try:
        env.register_execution_provider_library("remote", address, {"timeout_s": "2", "recovery_timeout_s": "1"})
        (device,) = env.get_ep_devices()
        allocator = env.create_shared_allocator(device, ephost.DeviceMemoryType.DEFAULT)
        assert allocator.get_stats()["InUse"] == 0
        first.proc.kill()
        first.proc.wait()
        link = env.registration("remote").link
        deadline = time.monotonic() + 10
        while link.serving and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.health.startswith("away: stopped answering"), "its health stream broke with it"
        with pytest.raises(ephost.EpWorkerUnavailable, match="has not come back within") as info:
            allocator.get_stats()  # waits out what is left of the second it may take
        assert "stopped answering" in str(info.value) and "left by a worker that is gone" in str(info.value), info.value
        waits = []  # what the next call waits for the worker (the link's condition, past the wait: nothing)
        monkeypatch.setattr(link._cond, "wait", lambda timeout=None: waits.append(timeout))
        with pytest.raises(ephost.EpWorkerUnavailable, match="has not come back"):
            allocator.get_stats()
        assert waits == [], "past the wait, calls fail at once"
        monkeypatch.undo()
        worker("--ep", "reference", "--listen", address)
        recovered, errors = None, []
        while recovered is None and time.monotonic() < deadline + 20:
            try:
                recovered = allocator.get_stats()
            except ephost.EpWorkerUnavailable as e:
                errors.append(str(e))
                time.sleep(0.05)
        assert recovered is not None and recovered["InUse"] == 0, errors[-3:]
        assert link.generation == 2
        t = Tensor.from_numpy(np.arange(8, dtype=np.float32), allocator)
        back = Tensor.from_numpy(np.zeros(8, np.float32))
        env.copy_tensors([t], [back])
        np.testing.assert_array_equal(back.numpy(), np.arange(8))
    finally:
        env.close()


def test_two_threads_that_find_the_worker_forgot_them_make_one_new_generation(worker):
    """A remote worker restarted at its address forgets this client; two threads whose calls find that out at
    once say Hello once between them: one new connection, one new generation, and both go on working."""
    first = worker("--ep", "reference")
    env = ephost.Environment()
    try:
        env.register_execution_provider_library("remote", first.address, {"timeout_s": "5", "connect_timeout_s": "5"})
        (device,) = env.get_ep_devices()
        allocator = env.create_shared_allocator(device, ephost.DeviceMemoryType.DEFAULT)
        link = env.registration("remote").link
        assert link.generation == 1
        first.proc.kill()
        first.proc.wait()
        deadline = time.monotonic() + 10
        while link.serving and time.monotonic() < deadline:  # the health stream sees it go...
            time.sleep(0.05)
        worker("--ep", "reference", "--listen", first.address)
        while not link.serving and time.monotonic() < deadline + 10:  # ...and the new one come
            time.sleep(0.05)
        assert link.serving
        barrier = threading.Barrier(2)
        outcomes = []

        def call():
            barrier.wait()
            try:
                outcomes.append(allocator.get_stats()["InUse"])
            except ephost.EpWorkerUnavailable as e:
                outcomes.append(str(e))

        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert link.generation == 2, outcomes
        assert all(o == 0 or "forgot this client" in o for o in outcomes), outcomes
        assert allocator.get_stats()["InUse"] == 0  # handles made again on the new generation
    finally:
        env.close()


def test_a_grpc_call_on_a_connection_another_thread_closed_is_a_typed_error():
    """A connection closed by another thread (its worker's successor started, its EP unregistered) as a call on
    it began: gRPC raises ValueError for the closed channel; the caller gets EpWorkerUnavailable. (`read` checks
    nothing first, as a call past the check when the close came.)"""
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", "reference", {"fast_lane": "false"})
        conn = env.registration("w").link.current
        conn.close()
        with pytest.raises(ephost.EpWorkerUnavailable, match="is closed"):
            conn.read(1, 1, np.empty(8, np.uint8))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("policy", ["raise", "retry", "fallback"])
@pytest.mark.parametrize("fault", ["segfault", "raise"])
def test_a_copy_out_of_a_workers_own_memory_for_a_partition_elsewhere_is_under_the_failure_policy(fault, policy):
    """A feed in one worker's own memory (which this process cannot read) for a partition another worker runs:
    the run copies it to the host first, a call to the first worker. Its failure there is handled by the
    session's ep_failure_policy as a failed Compute is: noted, raised under "raise" and "fallback" (nothing else
    holds the value), and asked again under "retry" once the worker is back, which a value that went with a
    crashed worker cannot be (EpNotFound says so)."""
    x = np.arange(8, dtype=np.float32)
    with ephost.Environment() as env:
        env.register_execution_provider_library("holder", "chaos", {"fault": fault, "at": "copy", "after": "2",
                                                                    **SUPERVISION})
        env.register_execution_provider_library("runner", "reference", {})
        held = next(d for d in env.get_ep_devices() if d.registration_name == "holder")
        private = env.create_shared_allocator(held, ephost.DeviceMemoryType.DEFAULT)
        feed = Tensor.from_numpy(x, private)  # the holder's first copy
        assert not feed.addressable
        options = SessionOptions()
        options.ep_failure_policy = policy
        options.add_provider_for_devices([d for d in env.get_ep_devices() if d.registration_name == "runner"])
        with InferenceSession(models.chain(["Neg"], shape=(8,)), options, env=env) as s:
            if policy == "retry" and fault == "raise":  # the copy asked again serves the run
                np.testing.assert_array_equal(s.run(None, {"x": feed})[0], -x)
            else:
                expected = {"raise": ephost.EpInternal, "segfault": CRASHED}[fault]
                if policy == "retry":  # the successor has no such value
                    expected = ephost.EpNotFound
                with pytest.raises(expected):
                    s.run(None, {"x": feed})
            event = "crashed" if fault == "segfault" else "failed"
            assert s.failure_counters[event] == 1, s.failure_counters
            assert s.failure_counters["retried"] == (policy == "retry")
            assert s.failure_counters["fell back"] == 0
            (entry,) = [e for e in s.run_log if e["event"] == event]
            assert entry["registration"] == "holder" and entry["what"].startswith("a copy to the host for runner")
        env.release_shared_allocator(held, ephost.DeviceMemoryType.DEFAULT)
