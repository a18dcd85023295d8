"""The fast lane: Compute, CopyTensors, Alloc and Free over a unix SOCK_SEQPACKET socket per calling thread,
with everything the gRPC path guarantees (handles per client, typed errors, deadlines, crash detection,
leases), over real workers, sockets and shared memory."""
from __future__ import annotations

import contextlib
import inspect
import mmap
import os
import select
import signal
import socket
import struct
import sys
import threading
import time

import numpy as np
import pytest
from onnx import helper

import ephost
from ephost import InferenceSession, RunOptions, lane_slots
from ephost.fastlane import (DOORBELL, HEADER, KEPT, KEPT_ID, KEPT_WRITING, MAGIC, PLACED, MAX_KEPT, MAX_LENGTH,
                             METHODS, FrameReader, decode_error, put_parts, send_frame)
from ephost.v1 import allocator_pb2, common_pb2, data_transfer_pb2, ep_pb2, factory_pb2
import models
from helpers import RawClient, in_threads, killed_while_replaced, options_for, worker_stats

SHAPE = (4, 4)
X = np.arange(16, dtype=np.float32).reshape(SHAPE)


def lane_of(env, registration: str):
    return env.registration(registration).link.current.lane


def running(session) -> tuple[threading.Thread, dict]:
    """session.run on X on a thread of its own, started: the thread, and its outcome ("y" or "error", and the
    time it "ended")."""
    outcome = {}

    def run():
        try:
            outcome["y"] = session.run(None, {"x": X})[0]
        except Exception as e:  # (what the test asserts on)
            outcome["error"] = e
        outcome["ended"] = time.monotonic()
    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def diamond_session(env, registration, policy="raise", timeout=None):
    options = options_for(env, registration)
    options.ep_failure_policy = policy
    options.compute_timeout_s = timeout
    return InferenceSession(models.diamond(SHAPE), options, env=env)


@pytest.fixture(scope="module")
def ort_env():
    with ephost.Environment() as env:
        env.register_execution_provider_library("ort", "onnxruntime", {"intra_op_num_threads": "1"})
        env.register_execution_provider_library("ort_grpc", "onnxruntime", {"intra_op_num_threads": "1",
                                                                            "fast_lane": "false"})
        yield env


def test_stats_asked_for_after_a_reply_count_the_call_the_lane_answered_before_counting_it():
    """A lane call is answered first and counted right after (counting first held every reply back). What a
    caller has an answer to must still be in the figures it asks for next: GetStats settles first, waiting for
    every call answered before it, and only for those (a thread that never counts is waited for at most the
    bound, and one answering later is not waited for)."""
    from ephost.server.stats import WorkerStats
    stats = WorkerStats()
    answered, counting = threading.Event(), threading.Event()

    def lane_thread():  # as Dispatcher.dispatch does on the lane: answer, then count
        tally = stats.answering()
        tally.answered += 1
        answered.set()
        counting.wait()
        time.sleep(0.05)
        stats.record_call("Ep/Compute", 1e-5, True, lane=True, counts={"kept_calls": 1})
        tally.counted += 1

    thread = threading.Thread(target=lane_thread)
    thread.start()
    answered.wait()
    counting.set()
    stats.settle()
    figures = stats.to_proto()
    assert figures.methods["Ep/Compute"].calls == 1 and figures.fast_lane_calls == 1 and figures.kept_calls == 1
    thread.join()

    stuck = stats.answering()  # answered, never counted: settle gives up after its bound
    stuck.answered += 1
    started = time.monotonic()
    stats.settle(timeout=0.2)
    assert 0.2 <= time.monotonic() - started < 2
    stuck.counted += 1
    started = time.monotonic()
    stats.settle(timeout=5)
    assert time.monotonic() - started < 0.5


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


def test_frames_through_shared_slots_are_a_registration_option_and_give_what_the_socket_gives(ort_env):
    """By default each lane connection passes its frames through shared slots (the worker maps them);
    `fast_lane_slots=false` keeps every frame on the socket. Both give the same results."""
    ort_env.register_execution_provider_library("ort_socket", "onnxruntime", {"intra_op_num_threads": "1",
                                                                              "fast_lane_slots": "false"})
    try:
        results = {}
        for registration in ("ort", "ort_socket"):
            before = worker_stats(ort_env, registration).fast_lane_calls
            with diamond_session(ort_env, registration) as s:
                results[registration] = [s.run(None, {"x": X * k})[0] for k in range(20)]
            assert worker_stats(ort_env, registration).fast_lane_calls - before >= 20
            with open(f"/proc/{ort_env.registration(registration).process.pid}/maps") as f:
                mapped = "memfd:ephost-lane" in f.read()
            assert mapped == (registration == "ort"), registration
        for k in range(20):
            np.testing.assert_array_equal(results["ort"][k], models.diamond_expected(X * k))
            np.testing.assert_array_equal(results["ort"][k], results["ort_socket"][k])
    finally:
        ort_env.unregister_execution_provider_library("ort_socket")


def test_no_lane_without_shared_memory():
    with ephost.Environment() as env:
        env.register_execution_provider_library("ref", "reference", {"shared_memory": "false"})
        assert lane_of(env, "ref") is None
        with diamond_session(env, "ref") as s:
            np.testing.assert_array_equal(s.run(None, {"x": X})[0], models.diamond_expected(X))
        assert worker_stats(env, "ref").fast_lane_calls == 0


def test_large_tensors_cross_in_several_packets(ort_env):
    """Inline tensors up to the inline limit (512 KiB) travel in frames longer than one packet."""
    x = np.random.default_rng(1).standard_normal((256, 500)).astype(np.float32)  # 500 KB, inline
    before = worker_stats(ort_env, "ort").fast_lane_calls
    with InferenceSession(models.diamond(x.shape), options_for(ort_env, "ort"), env=ort_env) as s:
        np.testing.assert_allclose(s.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
    assert worker_stats(ort_env, "ort").fast_lane_calls > before


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


def test_a_call_kept_whatever_its_shapes_tells_an_input_sent_inline_from_one_staged(ort_env):
    """Shapes that change every run make a call kept whatever its shapes (keep_shapes: kept by the inputs'
    ranks). An input too large to go inline (staged in a buffer, named by handle) is another call than the same
    input small (its bytes in the frame): each repeats its own, and every run gives ORT's answer (a repeat
    sending bytes where the worker kept a handle was refused: 'a kept call takes 840016 bytes ..., got 24')."""
    from client.transfer import INLINE_LIMIT
    large = INLINE_LIMIT // 4 + 1000  # floats in a row of a large input
    shapes = [(1, 8), (3, 4096), (2, 8), (2, 16), (3, 5), (3, 3), (2, 3), (1, large), (2, large // 3), (3, large),
              (2, 7), (1, large + 5), (3, 9), (2, large)]
    model = models.model([helper.make_node("Abs", ["x"], ["y"])], [models.tensor("x", ["b", "n"])],
                         [models.tensor("y", ["b", "n"])])
    with InferenceSession(model, options_for(ort_env, "ort"), env=ort_env) as s:
        rng = np.random.default_rng(3)
        for shape in shapes * 2:
            x = rng.standard_normal(shape).astype(np.float32)
            np.testing.assert_array_equal(s.run(None, {"x": x})[0], np.abs(x))


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
def test_worker_killed_while_a_thread_is_blocked_in_a_lane_call(policy):
    """The call in flight fails within a second with EpWorkerCrashed naming the call (raise), or is made
    again on the restarted worker (retry) or on the CPU fallback (fallback)."""
    with ephost.Environment() as env:
        # The 2nd compute hangs, so that a thread is surely blocked in it when the worker is killed. (Under
        # `retry` the last run below is the new worker's 2nd compute: it hangs to its deadline, then is retried.)
        env.register_execution_provider_library("chaos", "chaos", {"fault": "hang", "at": "compute", "after": "2",
                                                                    "timeout_s": "5"})
        pid = env.registration("chaos").process.pid
        with diamond_session(env, "chaos", policy) as s:
            np.testing.assert_array_equal(s.run(None, {"x": X})[0], models.diamond_expected(X))
            assert lane_of(env, "chaos") is not None
            t, outcome = running(s)
            time.sleep(0.5)  # blocked in the hanging compute
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            t.join(30)
            assert not t.is_alive()
            if policy == "raise":
                error = outcome["error"]
                assert isinstance(error, ephost.EpWorkerCrashed)
                assert "SIGKILL" in str(error) and "Ep/Compute" in str(error)
                assert outcome["ended"] - killed_at < 1.0
            else:
                np.testing.assert_array_equal(outcome["y"], models.diamond_expected(X))
            # The worker is back (the retry's compute was its 1st: no hang) and runs go on.
            env.registration("chaos").link.wait_healthy(10)
            np.testing.assert_array_equal(s.run(None, {"x": X})[0], models.diamond_expected(X))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["raise", "fallback"])
def test_an_ep_unregistered_while_a_thread_waits_in_a_lane_call_ends_that_call_as_unregistered(policy):
    """The call's connection is closed under it by another thread: the call ends at once with the EP's
    EpWorkerUnavailable saying it was unregistered (not what the worker said as it forgot this client, nor the
    released slots or descriptors the closing thread would have freed under the waiting one), or, under
    `fallback`, runs on the CPU fallback."""
    with ephost.Environment() as env:
        env.register_execution_provider_library("chaos", "chaos", {"fault": "hang", "at": "compute", "after": "2"})
        with diamond_session(env, "chaos", policy) as s:
            np.testing.assert_array_equal(s.run(None, {"x": X})[0], models.diamond_expected(X))
            t, outcome = running(s)
            time.sleep(0.5)  # blocked in the hanging compute, on the lane
            assert lane_of(env, "chaos").connections == 2, "the waiting thread's connection is open"
            unregistering = time.monotonic()
            env.unregister_execution_provider_library("chaos")
            t.join(30)
            assert not t.is_alive()
            assert outcome["ended"] - unregistering < 10
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
            start = time.monotonic()
            with pytest.raises((ephost.EpDeadlineExceeded, ephost.EpWorkerCrashed)):
                s.run(None, {"x": X}, run_options=RunOptions(compute_timeout_s=0.5))
            assert time.monotonic() - start < 5
            link = env.registration("chaos").link
            assert link.wait_healthy(10)
            assert env.registration("chaos").process.pid != first, "the stuck worker was killed and replaced"


# --- the wire itself ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lane_worker():
    from helpers import Worker
    w = Worker("--ep", "onnxruntime", "--option", "intra_op_num_threads=1", "--client-lease-s", "1.5")
    yield w
    w.stop()


def sole_client_stats(raw: RawClient, timeout: float = 10.0):
    """The worker's stats once `raw` is the only client it serves. The raw clients of earlier tests never say
    goodbye: the buffers they left go when their lease runs out (1.5 s on lane_worker), and a count of live
    buffers read across that moment would be off by theirs."""
    deadline = time.monotonic() + timeout
    while True:
        raw(raw.worker.Renew, common_pb2.Empty())
        stats = raw(raw.worker.GetStats, common_pb2.Empty())
        if stats.clients == 1 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def open_lane(raw: RawClient, ticket: bytes | None = None) -> tuple[socket.socket, bytes]:
    reply = raw(raw.worker.OpenDataPlane, common_pb2.Empty())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(reply.socket)
    sock.send(ticket if ticket is not None else reply.ticket)
    return sock, reply.ticket


def lane_call(sock, name, request, timeout=10.0):
    method = METHODS[name]
    send_frame(sock, method.id, 0, timeout, request.SerializeToString())
    frame = FrameReader(sock, adopt=lambda region, size, fd: os.close(fd)).read()  # regions: not mapped here
    return frame, (method.reply.FromString(frame.payload) if frame and frame.status == 0 else None)


def fastlane_error(frame) -> str:
    return decode_error(frame.payload)[0]


def host_allocator(raw: RawClient) -> int:
    return raw(raw.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest(
        device_mem_type=common_pb2.DEVICE_MEMORY_TYPE_HOST_ACCESSIBLE)).allocator


def assert_serves_on(sock: socket.socket, alloc: allocator_pb2.AllocRequest, worker) -> None:
    """After whatever came before on it, the connection still answers a good Alloc; then it is closed, and the
    worker is still running."""
    frame, reply = lane_call(sock, "Allocator/Alloc", alloc)
    assert frame.status == 0 and reply.buffer
    sock.close()
    assert worker.proc.poll() is None


def test_a_ticket_binds_one_connection_to_its_client_once(lane_worker):
    a, b = RawClient(lane_worker.address, "a"), RawClient(lane_worker.address, "b")
    try:
        sock_a, ticket = open_lane(a)
        assert sock_a.recv(2) == b"OK"
        allocator = host_allocator(a)
        frame, reply = lane_call(sock_a, "Allocator/Alloc", allocator_pb2.AllocRequest(allocator=allocator, nbytes=64))
        assert frame.status == 0 and reply.buffer
        # b presents a's ticket, already used: refused. A made-up one: refused.
        for stolen in (ticket, os.urandom(32)):
            sock_b, _ = open_lane(b, ticket=stolen)
            assert sock_b.recv(2) == b"NO"
            sock_b.close()
        # b's own connection cannot name a's handles.
        sock_b, _ = open_lane(b)
        assert sock_b.recv(2) == b"OK"
        frame, _ = lane_call(sock_b, "Allocator/Free", allocator_pb2.FreeRequest(allocator=allocator,
                                                                                 buffer=reply.buffer))
        assert frame.status == 5, "NOT_FOUND"  # grpc.StatusCode.NOT_FOUND
        assert b"unknown allocator handle" in bytes(frame.payload)
        frame, _ = lane_call(sock_a, "Allocator/Free", allocator_pb2.FreeRequest(allocator=allocator,
                                                                                 buffer=reply.buffer))
        assert frame.status == 0, "a's own handle still works for a"
        sock_a.close()
        sock_b.close()
    finally:
        a.close()
        b.close()


def test_bad_frames_get_an_error_or_a_closed_connection_and_others_are_served(lane_worker):
    raw = RawClient(lane_worker.address)
    try:
        allocator = host_allocator(raw)
        good = allocator_pb2.AllocRequest(allocator=allocator, nbytes=64)

        sock, _ = open_lane(raw)
        assert sock.recv(2) == b"OK"
        # An unknown method: UNIMPLEMENTED, and the connection serves on.
        send_frame(sock, 999, 0, 5.0, b"")
        frame = FrameReader(sock).read()
        assert frame.status == 12 and b"no method 999" in bytes(frame.payload)  # UNIMPLEMENTED
        # A message that does not parse: INVALID_ARGUMENT, and the connection serves on.
        send_frame(sock, METHODS["Ep/Compute"].id, 0, 5.0, b"\xff\xff\xff")
        frame = FrameReader(sock).read()
        assert frame.status == 3 and b"cannot be parsed" in bytes(frame.payload)
        frame, reply = lane_call(sock, "Allocator/Alloc", good)
        assert frame.status == 0 and reply.buffer
        # A timeout that is no number of seconds: INVALID_ARGUMENT; one centuries away: a deadline like any other
        # (it once overflowed a wait inside the worker: INTERNAL).
        for timeout in (float("nan"), float("inf"), -1.0):
            frame, _ = lane_call(sock, "Allocator/Alloc", good, timeout=timeout)
            assert frame.status == 3 and b"timeout" in bytes(frame.payload)
        stream = raw(raw.factory.CreateSyncStreamForDevice, factory_pb2.CreateSyncStreamRequest()).id
        ep = raw(raw.factory.CreateEp, factory_pb2.CreateEpRequest(device_indices=[0])).id
        (partition,) = raw(raw.ep.Compile, ep_pb2.CompileRequest(
            ep=ep, model=ep_pb2.ModelRef(model=models.chain(["Relu"]).SerializeToString()),
            graphs=[ep_pb2.FusedGraph(name="p", nodes=["n0_Relu"], inputs=["x"], outputs=["y"])])).node_compute_infos
        frame, _ = lane_call(sock, "Ep/Compute", ep_pb2.ComputeRequest(node_compute_info=partition, stream=stream),
                             timeout=1e300)
        assert frame.status == 3 and b"input" in bytes(frame.payload), fastlane_error(frame)
        # A compute naming a partition that does not exist: the typed error the gRPC path gives.
        frame, _ = lane_call(sock, "Ep/Compute", ep_pb2.ComputeRequest(node_compute_info=12345))
        assert frame.status == 5 and b"unknown compute info handle" in bytes(frame.payload)

        def closed_after(packet: bytes) -> bool:
            s, _ = open_lane(raw)
            assert s.recv(2) == b"OK"
            s.send(packet)
            frames = []
            while (f := FrameReader(s).read()) is not None:
                frames.append(f)
            s.close()
            return all(f.status == 3 for f in frames)  # at most an INVALID_ARGUMENT before the end

        assert closed_after(b"xy"), "shorter than a header"
        assert closed_after(HEADER.pack(b"??", 1, 0, 1.0, 0)), "wrong magic"
        assert closed_after(HEADER.pack(MAGIC, 1, 0, 1.0, MAX_LENGTH + 1)), "oversized length"
        # Truncated: a frame announcing more than ever comes, then the sender stops writing.
        s, _ = open_lane(raw)
        assert s.recv(2) == b"OK"
        s.send(HEADER.pack(MAGIC, METHODS["Allocator/Alloc"].id, 0, 1.0, 100) + b"0123456789")
        s.shutdown(socket.SHUT_WR)
        assert FrameReader(s).read() is None, "the worker closed the connection"
        s.close()

        # The first connection, and the worker, keep serving.
        assert_serves_on(sock, good, lane_worker)
    finally:
        raw.close()


def test_lane_calls_keep_the_clients_lease(lane_worker):
    """A client whose only calls are on the fast lane is not released when its lease (1.5 s) runs out."""
    raw = RawClient(lane_worker.address)
    try:
        allocator = host_allocator(raw)
        sock, _ = open_lane(raw)
        assert sock.recv(2) == b"OK"
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline:
            frame, reply = lane_call(sock, "Allocator/Alloc", allocator_pb2.AllocRequest(allocator=allocator,
                                                                                         nbytes=64))
            assert frame.status == 0, bytes(frame.payload)
            time.sleep(0.3)
        sock.close()
    finally:
        raw.close()


def test_a_forked_child_does_not_use_the_parents_connections(ort_env):
    lane = lane_of(ort_env, "ort")
    with diamond_session(ort_env, "ort") as s:
        s.run(None, {"x": X})
        assert lane.connections >= 1
        before = worker_stats(ort_env, "ort")
        pid = os.fork()
        if pid == 0:  # the child: the connections it inherited are dropped, unused
            os._exit(0 if lane.connections == 0 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        np.testing.assert_array_equal(s.run(None, {"x": X})[0], models.diamond_expected(X))
        after = worker_stats(ort_env, "ort")
    assert after.fast_lane_calls - before.fast_lane_calls == 1, "the parent's connection still serves it"
    assert after.fast_lane_connections == before.fast_lane_connections


@pytest.mark.timeout(60)
def test_a_fork_while_another_thread_waits_in_a_lane_call_leaves_that_call_to_finish():
    """The child lets go of its copies of the parent's connections without touching the parent's: the socket
    is shared, and a call under way on another thread of the parent (its copy says so) must not be ended."""
    with ephost.Environment() as env:
        # The 2nd compute touches 512 MiB first: a call that is surely under way when the process forks.
        env.register_execution_provider_library("chaos", "chaos", {"fault": "leak", "leak_mb": "512", "after": "2"})
        with diamond_session(env, "chaos") as s:
            np.testing.assert_array_equal(s.run(None, {"x": X})[0], models.diamond_expected(X))
            t, outcome = running(s)
            time.sleep(0.05)
            forked = time.monotonic()
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            t.join(30)
            assert os.waitstatus_to_exitcode(status) == 0
            assert outcome["ended"] > forked, "the call was under way as the process forked"
            assert "error" not in outcome, outcome.get("error")
            np.testing.assert_array_equal(outcome["y"], models.diamond_expected(X))
            np.testing.assert_array_equal(s.run(None, {"x": X})[0], models.diamond_expected(X))


@pytest.mark.parametrize("transport", ["fast_lane", "grpc"])
def test_a_new_regions_descriptor_rides_along_with_the_first_reply_naming_it(transport):
    """Over the lane, the worker hands a region's descriptor over with the first reply that names it (no
    ExportRegion call, no descriptor socket); over gRPC the client fetches it by ticket."""
    x = np.random.default_rng(2).standard_normal((512, 512)).astype(np.float32)  # 1 MiB out: shared memory
    with ephost.Environment() as env:
        env.register_execution_provider_library("ort", "onnxruntime", {"fast_lane": str(transport == "fast_lane")})
        with InferenceSession(models.chain(["Relu", "Neg"], shape=x.shape), options_for(env, "ort"), env=env) as s:
            (y,) = s.run(None, {"x": x})
            np.testing.assert_array_equal(y, -np.maximum(x, 0))
            exports = worker_stats(env, "ort").methods["Worker/ExportRegion"].calls
    if transport == "fast_lane":
        assert exports == 0
    else:
        assert exports >= 1


def slot_pair(a: socket.socket, b: socket.socket, slots: bool):
    """Shared slots between the two ends of a socket pair (a writes as a worker does, b reads as a client
    does), or none."""
    if not slots:
        return None, None
    fd, mapping = lane_slots.create()
    return lane_slots.Slots(mapping, a, worker=True), lane_slots.Slots(lane_slots.adopt(fd), b, worker=False)


@pytest.mark.parametrize("slots", [False, True], ids=["socket", "slots"])
def test_a_spinning_reader_reads_every_frame_whatever_the_gaps(slots):
    """A reader that polls before it sleeps (the lane's default) loses no frame and no end of file, whether a
    frame comes within its spin, long after it (through a slot: the doorbell wakes it), or in several packets
    (on the socket, between frames through the slot)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    writer, mine = slot_pair(a, b, slots)
    reader = FrameReader(b, spin_s=0.002, slots=mine)
    payloads = [b"first", b"x" * 200_000, b"", b"after a long gap", b"again at once"]
    gaps = [0.0, 0.0, 0.05, 0.05, 0.0]
    read = [threading.Event() for _ in payloads]  # one frame in flight at a time, as requests and replies go

    def peer():
        for i, (gap, payload) in enumerate(zip(gaps, payloads)):
            time.sleep(gap)
            send_frame(a, METHODS["Ep/Compute"].id, 0, 1.5, payload, writer)
            read[i].wait(10)
        time.sleep(0.05)
        a.close()  # end of file, long after the reader began to spin for it

    thread = threading.Thread(target=peer)
    thread.start()
    try:
        for i, payload in enumerate(payloads):
            frame = reader.read()
            read[i].set()
            assert (frame.method, frame.timeout_s, bytes(frame.payload)) == (METHODS["Ep/Compute"].id, 1.5, payload)
        assert reader.read() is None
    finally:
        thread.join()
        b.close()


@pytest.mark.parametrize("slots", [False, True], ids=["socket", "slots"])
@pytest.mark.parametrize("descriptor", ["low", "above FD_SETSIZE"])
def test_a_reader_after_a_long_wait_still_answers_early_late_and_on_its_deadline(descriptor, slots):
    """After a long wait the reader sleeps through the next one until its frame comes: a frame that comes much
    sooner is read at once, one that comes later is still read, and the socket's timeout (a call's deadline)
    counts from the start of the read. Also on a descriptor above 1023, which select cannot take (an
    application with many files open), and with frames through a slot (a sleeping reader woken by the
    doorbell)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if descriptor != "low":
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and hard <= 1100:
            pytest.fail(f"this test needs more than 1100 descriptors (hard limit {hard})")
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
        low = b.detach()
        b = socket.socket(fileno=os.dup2(low, 1100))
        os.close(low)
    writer, mine = slot_pair(a, b, slots)
    reader = FrameReader(b, spin_s=0.001, expect=True, slots=mine)
    compute = METHODS["Ep/Compute"].id

    def read_after(gap: float):
        timer = threading.Timer(gap, send_frame, (a, compute, 0, 0.0, b"%g" % gap, writer))
        start = time.perf_counter()
        timer.start()
        try:
            frame = reader.read()
        finally:
            timer.join()
        assert bytes(frame.payload) == b"%g" % gap
        return time.perf_counter() - start

    try:
        read_after(0.4)                     # a long wait: the next read sleeps
        assert read_after(0.02) < 0.2       # sooner: read at once
        read_after(0.4)
        assert read_after(0.6) >= 0.6       # later: read when it comes
        b.settimeout(0.1)
        start = time.perf_counter()
        with pytest.raises(TimeoutError):
            reader.read()
        assert time.perf_counter() - start < 0.35, "the deadline counts from the start of the read"
    finally:
        a.close()
        b.close()


def test_a_reader_keeps_how_long_each_call_waits_apart():
    """One connection carries every partition of a session on its worker: a reply that always comes soon is
    polled for even right after a long wait for another call (the reader does not sleep, as the slot's `asleep`
    word shows), and the long one is slept through to its end (asleep when its reply is written: polling for
    the end of a long call took a CPU from the worker's threads, a CNN's run 1.5-3.5% longer)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd, mapping = lane_slots.create()
    writer = lane_slots.Slots(mapping, a, worker=True)
    reader = FrameReader(b, spin_s=0.1, expect=True, slots=lane_slots.Slots(lane_slots.adopt(fd), b, worker=False))
    fd_words = memoryview(mapping).cast("Q")  # the test's look at the reply slot's `asleep` word
    asleep = lane_slots.SLOT // 8 + lane_slots.ASLEEP
    compute = METHODS["Ep/Compute"].id

    def read(key, gap: float) -> tuple[bytes, bool, bool]:
        """Read a frame sent `gap` after the read begins; whether the reader slept meanwhile, and whether it
        slept when the frame was written."""
        slept, at_the_end = [], []

        def send():
            deadline = time.perf_counter() + gap
            while time.perf_counter() < deadline:
                slept.append(fd_words[asleep])
                time.sleep(0.001)
            at_the_end.append(fd_words[asleep])
            send_frame(a, compute, 0, 0.0, key.encode(), writer)

        thread = threading.Thread(target=send)
        thread.start()
        try:
            return bytes(reader.read(key).payload), any(slept), bool(at_the_end[0])
        finally:
            thread.join()

    try:
        for _ in range(3):
            assert read("long", 0.5) == (b"long", True, True)        # asleep to its end
            assert read("short", 0.005) == (b"short", False, False)  # polled for (within the 100 ms spin)
    finally:
        fd_words.release()
        a.close()
        b.close()


@contextlib.contextmanager
def early_wake_slots():
    """A lane's slots with their early wake, both ends in this process: (the worker's socket end, the caller's,
    the worker's mapping of the slots, its Slots, the caller's, the caller's FrameReader: polling 0.1 s, reading
    replies)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd, mapping = lane_slots.create()
    wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    writer = lane_slots.Slots(mapping, a, worker=True, wake=wake)
    mine = lane_slots.Slots(lane_slots.adopt(fd), b, worker=False, wake=os.dup(wake))
    try:
        yield a, b, mapping, writer, mine, FrameReader(b, spin_s=0.1, expect=True, slots=mine)
    finally:
        writer.close()
        mine.close()
        a.close()
        b.close()


def test_a_caller_asleep_through_a_long_call_is_woken_early_and_polls_for_the_reply():
    """The early wake (ephost/lane_slots.py): a caller asleep through a long call is woken by the worker as its
    EP finishes, and is awake (polling: its `asleep` word down) when the reply is written a little later;
    without the wake it is still asleep then."""
    compute = METHODS["Ep/Compute"].id
    asleep = lane_slots.SLOT // 8 + lane_slots.ASLEEP  # the reply slot's `asleep` word
    with early_wake_slots() as (a, b, mapping, writer, mine, reader):
        words = memoryview(mapping).cast("Q")  # the test's look at it

        def read(early: bool) -> bool:
            """Whether the reader slept when a reply written 0.3 s into its read was (0.28 s in: the early
            wake)."""
            at_the_end = []

            def send():
                time.sleep(0.28)
                if early:
                    writer.wake_early()
                time.sleep(0.02)  # the reply is being made
                at_the_end.append(words[asleep])
                send_frame(a, compute, 0, 0.0, b"reply", writer)

            thread = threading.Thread(target=send)
            thread.start()
            try:
                assert bytes(reader.read("long").payload) == b"reply"
            finally:
                thread.join()
            return bool(at_the_end[0])

        try:
            read(early=False)  # a long wait: the next reads sleep through
            assert read(early=False), "without the early wake, asleep when the reply is written"
            assert not read(early=True), "woken as the EP finished: polling when the reply is written"
            assert read(early=False), "the wake was taken: the next read sleeps again"
        finally:
            words.release()


def test_a_reply_after_the_early_wake_rings_no_doorbell_unless_the_caller_sleeps_again():
    """Woken early, a caller polls for the reply: the worker lowers its `asleep` word as it wakes it, so that
    the reply, put while the caller is still waking, costs no doorbell at either end. A caller that sleeps again
    before the reply comes raises the word again, and is rung for; so is one that did not take the early wake
    (an older client's lane: the worker writes an eventfd no one reads)."""
    compute = METHODS["Ep/Compute"].id
    with early_wake_slots() as (a, b, _, writer, mine, reader):

        def rung() -> bool:
            try:
                return b.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == DOORBELL
            except BlockingIOError:
                return False

        def answer(payload: bytes, *, again: bool = False, early: bool = True) -> bool:
            """Whether the reply to a caller asleep through a long call (on the early wake too, or on the
            socket alone) rang; `again`: woken, it sleeps again before the reply comes."""
            while rung():  # what the last answer left: taken, as a reader takes it the next time it sleeps
                b.recv(1)
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(mine.wake)
            mine.asleep(True, early=early)
            assert writer.wake_early()
            if again:
                mine.asleep(True, early=early)
            send_frame(a, compute, 0, 0.0, payload, writer)  # before the caller is awake
            was_rung = rung()
            assert bytes(reader.read("long").payload) == payload
            return was_rung

        assert not answer(b"first"), "the reply to a caller woken early rang a doorbell"
        assert answer(b"second", again=True), "a caller asleep again was not rung for"
        assert answer(b"third", early=False), "a caller that did not take the early wake was not rung for"


def test_a_connection_closed_from_two_threads_at_once_closes_its_descriptors_once():
    """A lane connection is closed by its thread's end (its finalizer) and by FastLane.close, which can meet: the
    lane's set still names a connection while its finalizer runs on another thread. The second close must not
    close its descriptors again, as their numbers may be another's by then (here: a new eventfd takes the early
    wake's number while the first close is between closing it and forgetting it)."""
    from ephost.client.fastlane import _Connection
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd, mapping = lane_slots.create()
    slots = lane_slots.Slots(lane_slots.adopt(fd), b, worker=False, wake=os.eventfd(0, os.EFD_CLOEXEC))
    conn = _Connection(b, None, 0.0, slots)
    code = lane_slots.Slots.close.__code__
    source, first = inspect.getsourcelines(lane_slots.Slots.close)
    (forgets,) = [first + i for i, line in enumerate(source) if "self.wake = None" in line]
    closed, resume = threading.Event(), threading.Event()

    def trace(frame, event, arg):
        if frame.f_code is not code:
            return None
        if event == "line" and frame.f_lineno == forgets:  # the wake's descriptor closed, not yet forgotten
            closed.set()
            resume.wait(10)
        return trace

    def first_close():
        sys.settrace(trace)
        try:
            conn.close()
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=first_close)
    thread.start()
    other = None
    try:
        assert closed.wait(10)
        other = os.eventfd(0, os.EFD_CLOEXEC)  # the lowest free number: the one just closed
        conn.close()  # the lane's close, meanwhile
        os.fstat(other)  # still open: the second close closed nothing
    finally:
        resume.set()
        thread.join(10)
        if other is not None:
            with contextlib.suppress(OSError):
                os.close(other)
        mapping.close()
        a.close()


def test_a_handed_over_region_that_cannot_be_mapped_has_its_descriptor_closed_once(env):
    """A region's descriptor the worker hands over with a reply is the mapping's to close, mapped or not: one
    that cannot be mapped (here, not sealed against shrinking) is closed once, not a second time after, when its
    number may be another's (here: a new eventfd takes it as the failure is logged)."""
    conn = env.registration("ref").link.conn
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    code = type(conn).adopt_region.__code__
    source, first = inspect.getsourcelines(type(conn).adopt_region)
    (logged,) = [first + i for i, line in enumerate(source) if "log.debug(" in line]
    other = []

    def trace(frame, event, arg):
        if frame.f_code is not code:
            return None
        if event == "line" and frame.f_lineno == logged:  # the mapping failed, and closed fd
            other.append(os.eventfd(0, os.EFD_CLOEXEC))  # the lowest free number: fd's
        return trace

    sys.settrace(trace)
    try:
        conn.adopt_region(2 ** 40, 4096, fd)
    finally:
        sys.settrace(None)
    try:
        assert other == [fd], "the mapping was expected to fail and to close the descriptor"
        os.fstat(other[0])  # still open: nothing closed fd's number again
    finally:
        for number in other:
            with contextlib.suppress(OSError):
                os.close(number)


def test_the_ort_ep_wakes_its_caller_from_inside_compute_once_a_call():
    """The early wake, sooner (ComputeCall.kernel_ran): a worker wakes a caller asleep for a Compute's reply
    as the EP's kernel ends, before the EP makes its outputs. The ORT EP says so inside compute on each of its
    paths (a plain run: outputs of symbolic shape; a new IOBinding; a steady one); a connection's wake is written
    once a call however often it is asked for (a second write would end the caller's next sleep at once), and
    not at all for a caller that polls. Outside a worker's connection thread, kernel_ran does nothing."""
    from onnx import TensorProto, helper
    from ephost.eps.base import ComputeCall
    from ephost.server.fastlane import _EarlyWake
    from helpers import compiled

    ComputeCall([]).kernel_ran()  # no connection: nothing to wake, nothing raised
    with early_wake_slots() as (_, _, _, writer, mine, _):
        early = _EarlyWake(writer)
        try:
            for shape in ((2, 3), ("n", 3)):  # known: a new binding, then a steady one; symbolic: plain runs
                x, y = (helper.make_tensor_value_info(v, TensorProto.FLOAT, list(shape)) for v in ("x", "y"))
                model = helper.make_model(helper.make_graph([helper.make_node("Neg", ["x"], ["y"], name="neg")], "g",
                                                            [x], [y]), opset_imports=[helper.make_opsetid("", 18)])
                with compiled(model, ("x",), ("y",)) as info:
                    for k in range(4):
                        asleep = k < 3
                        early.woken = False  # a new call, as the connection's loop marks it
                        mine.asleep(asleep, early=True)
                        array = np.full((2, 3), k, np.float32)
                        # as the worker makes a call on a connection's thread
                        call = ComputeCall([ephost.Tensor.from_numpy(array)], on_kernel_ran=early)
                        (out,) = info.compute(call)
                        if asleep:
                            assert os.eventfd_read(mine.wake) == 1, (shape, k)  # written inside compute
                        assert early() is asleep  # the handler's ask as compute returns: no second write
                        with pytest.raises(BlockingIOError):
                            os.eventfd_read(mine.wake)
                        np.testing.assert_array_equal(out.numpy(), -array)
        finally:
            mine.asleep(False)


def test_an_early_wake_whose_count_the_caller_filled_fails_nothing():
    """The caller holds the early wake's eventfd too, and can write its count to the full: the worker's wake
    then finds it full (a wake pending anyway) and goes on, rather than failing the call it answers."""
    with early_wake_slots() as (_, _, _, writer, mine, _):
        os.eventfd_write(mine.wake, 2 ** 64 - 2)  # the most an eventfd holds
        assert not writer.wake_early(), "a caller awake is not woken"
        mine.asleep(True)
        assert writer.wake_early(), "a caller asleep is (its count full: nothing more to add)"
        assert os.eventfd_read(mine.wake) == 2 ** 64 - 2


def test_how_long_each_end_spins_is_a_registration_option():
    def worker_command(env, name):
        with open(f"/proc/{env.registration(name).process.pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")

    with ephost.Environment() as env:
        env.register_execution_provider_library("default", "reference")
        env.register_execution_provider_library("off", "reference", {"fast_lane_spin_us": "0"})
        assert b"--lane-spin-us" in worker_command(env, "default")
        command = worker_command(env, "off")
        assert command[command.index(b"--lane-spin-us") + 1] == b"0", "the launched worker spins as its client does"
        with diamond_session(env, "off") as s:  # a lane that never spins serves as one that does
            assert lane_of(env, "off") is not None
            np.testing.assert_array_equal(s.run(None, {"x": X})[0], models.diamond_expected(X))
        for bad in ("-1", "nan", "1e9"):
            with pytest.raises(ephost.EpInvalidArgument, match="fast_lane_spin_us"):
                env.register_execution_provider_library(f"bad{bad}", "reference", {"fast_lane_spin_us": bad})


@pytest.mark.parametrize("value", ["-1", "inf", "1e9"])
def test_a_worker_refuses_a_spin_out_of_range(value):
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-m", "ephost", "worker", "--ep", "reference", "--lane-spin-us", value],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--lane-spin-us" in result.stderr and "microseconds" in result.stderr


# --- kept calls: a Compute repeated with nothing but its inputs' bytes ----------------------------------------


def test_a_steady_stream_of_small_runs_travels_as_kept_calls(ort_env):
    """Inputs and outputs small enough to travel inline: the first run sends the whole Compute and the worker
    keeps it; the next send only the inputs' bytes and get only the outputs' back. gRPC keeps nothing, nor a
    registration with kept_calls=false."""
    ort_env.register_execution_provider_library("ort_unkept", "onnxruntime", {"kept_calls": "false"})
    try:
        for registration, lane, kept in (("ort", True, 9), ("ort_grpc", False, 0), ("ort_unkept", True, 0)):
            before = worker_stats(ort_env, registration)
            with diamond_session(ort_env, registration) as s:
                results = [s.run(None, {"x": X * k})[0] for k in range(10)]
            after = worker_stats(ort_env, registration)
            assert after.methods["Ep/Compute"].calls - before.methods["Ep/Compute"].calls == 10
            assert (after.fast_lane_calls - before.fast_lane_calls >= 10 if lane else
                    after.fast_lane_calls == before.fast_lane_calls), registration
            assert after.kept_calls - before.kept_calls == kept, registration
            for k, y in enumerate(results):
                np.testing.assert_array_equal(y, models.diamond_expected(X * k))
                y += 1  # outputs are the caller's, writable, as ORT's are
    finally:
        ort_env.unregister_execution_provider_library("ort_unkept")


def _slow_model(steps: int = 8, n: int = 512):
    """A model whose run takes milliseconds (a chain of 64x512 by 512x512 MatMuls), far past a caller's spin."""
    from onnx import TensorProto, helper, numpy_helper
    weights = numpy_helper.from_array(np.full((n, n), 1.0 / n, np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i}", "w"], [f"h{i + 1}" if i + 1 < steps else "y"],
                              name=f"mm{i}") for i in range(steps)]
    graph = helper.make_graph(nodes, "slow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, n])], [weights])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_a_caller_asleep_through_a_long_compute_is_woken_as_the_ep_finishes(ort_env):
    """The early wake (ephost/lane_slots.py), end to end: a caller sleeps through a Compute that runs for
    milliseconds, and the worker wakes it as its EP finishes (`early_wakes`), whether the call is kept or sent
    whole every time (`kept_calls=false`, as a loop whose shapes change every step sends it); the results are
    those of gRPC, which has no such wake. Frames on the socket only (no slots) have none either."""
    ort_env.register_execution_provider_library("ort_socket", "onnxruntime", {"intra_op_num_threads": "1",
                                                                              "fast_lane_slots": "false"})
    ort_env.register_execution_provider_library("ort_whole", "onnxruntime", {"intra_op_num_threads": "1",
                                                                             "kept_calls": "false"})
    x = np.random.default_rng(3).standard_normal((64, 512)).astype(np.float32)
    try:
        results = {}
        for registration in ("ort", "ort_whole", "ort_grpc", "ort_socket"):
            before = worker_stats(ort_env, registration)
            with InferenceSession(_slow_model(), options_for(ort_env, registration), env=ort_env) as s:
                results[registration] = [s.run(None, {"x": x * k})[0] for k in range(12)]
            after = worker_stats(ort_env, registration)
            kept, woken = after.kept_calls - before.kept_calls, after.early_wakes - before.early_wakes
            if registration == "ort":
                assert kept == 11 and woken >= 8, (kept, woken)  # the caller spins through its first long call
            elif registration == "ort_whole":
                assert kept == 0 and woken >= 8, (kept, woken)
            else:
                assert woken == 0, registration
        for k in range(12):
            for registration in ("ort", "ort_whole", "ort_socket"):
                np.testing.assert_allclose(results[registration][k], results["ort_grpc"][k], rtol=1e-5)
    finally:
        ort_env.unregister_execution_provider_library("ort_socket")
        ort_env.unregister_execution_provider_library("ort_whole")


def test_a_loop_whose_shapes_change_every_run_repeats_one_call_kept_whatever_its_shapes(ort_env):
    """A loop whose input shape changes every run has its worker keep its first call (`calls_kept`), which every
    later step repeats (`kept_calls`) with its own shapes, the steps after the loop settled on one shape too. The
    results are those of gRPC, which keeps nothing."""
    from onnx import TensorProto, helper
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"], name="double")], "dyn",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    growing = [np.arange(n, dtype=np.float32).reshape(1, n) for n in range(1, 13)]
    settled = [np.full((1, 20), k, np.float32) for k in range(10)]
    for registration, lane in (("ort", True), ("ort_grpc", False)):
        before = worker_stats(ort_env, registration)
        with InferenceSession(model, options_for(ort_env, registration), env=ort_env) as s:
            for x in growing:
                np.testing.assert_array_equal(s.run(None, {"x": x})[0], 2 * x)
            middle = worker_stats(ort_env, registration)
            for x in settled:
                np.testing.assert_array_equal(s.run(None, {"x": x})[0], 2 * x)
        after = worker_stats(ort_env, registration)
        if lane:
            assert (middle.calls_kept - before.calls_kept, middle.kept_calls - before.kept_calls) == \
                (1, len(growing) - 1)
            assert (after.calls_kept - middle.calls_kept, after.kept_calls - middle.kept_calls) == (0, len(settled))
        else:
            assert after.calls_kept == before.calls_kept and after.kept_calls == before.kept_calls


def test_a_kept_call_whose_outputs_change_shape_gets_the_whole_reply(ort_env):
    """The same input shape can make outputs of another shape (NonZero): the worker answers such a kept call
    with the whole reply, and the call stays kept for the runs after it. (Over either transport: ORT kept the
    first run's output in its IOBinding and refused a result of another shape into it.)"""
    from onnx import TensorProto, helper
    graph = helper.make_graph([helper.make_node("NonZero", ["x"], ["y"], name="nz")], "nz",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    for registration, kept in (("ort", 4), ("ort_grpc", 0)):
        before = worker_stats(ort_env, registration)
        with InferenceSession(model, options_for(ort_env, registration), env=ort_env) as s:
            for x in ([0, 1, 0, 2, 0, 0, 0, 3], [1, 1, 1, 0, 0, 0, 0, 0], [0] * 8, [0, 1, 0, 2, 0, 0, 0, 3], [5] * 8):
                x = np.array(x, np.float32)
                np.testing.assert_array_equal(s.run(None, {"x": x})[0], np.array(np.nonzero(x)))
        assert worker_stats(ort_env, registration).kept_calls - before.kept_calls == kept


def _relu_neg_env(kept_calls_max: int):
    """An Environment whose reference workers run Relu ("Relu") and Neg ("Neg"), each thread's connection to
    either keeping `kept_calls_max` calls."""
    env = ephost.Environment()
    for op in ("Relu", "Neg"):
        env.register_execution_provider_library(op, "reference", {"ops": op, "kept_calls_max": str(kept_calls_max)})
    return env


def _relu_neg(x: np.ndarray, pairs: int) -> np.ndarray:
    for _ in range(pairs):
        x = -np.maximum(x, 0)
    return x


def test_a_plan_cycling_through_more_calls_than_a_connection_keeps_repeats_those_it_keeps():
    """Three partitions in each worker, two kept calls a connection: run after run, the two it keeps are
    repeated and the third goes whole; none is let go to make room for the next and kept anew (as each was where
    the oldest went for every new call: each went before it came round again)."""
    model = models.chain(["Relu", "Neg"] * 3)
    x = np.linspace(-1, 1, 4, dtype=np.float32)
    with _relu_neg_env(2) as env:
        with InferenceSession(model, options_for(env, "Relu", "Neg"), env=env) as s:
            assert len(s.get_provider_graph_assignment_info()) == 6
            for _ in range(3):
                s.run(None, {"x": x})
            before = worker_stats(env, "Relu")
            for _ in range(4):
                np.testing.assert_array_equal(s.run(None, {"x": x})[0], _relu_neg(x, 3))
            after = worker_stats(env, "Relu")
    assert (after.calls_kept - before.calls_kept, after.kept_calls - before.kept_calls) == (0, 4 * 2)
    assert after.calls_kept == 2


def test_a_connection_full_of_calls_no_longer_made_keeps_new_ones_in_their_place():
    """A connection keeping two calls of a session that was closed keeps the next session's in their place once
    they went unused for twice as many calls as it keeps (4): that session's runs are repeats from then on."""
    model = models.chain(["Relu", "Neg", "Relu"])
    x = np.linspace(-1, 1, 4, dtype=np.float32)
    with _relu_neg_env(2) as env:
        with InferenceSession(model, options_for(env, "Relu", "Neg"), env=env) as s:
            for _ in range(3):
                s.run(None, {"x": x})
        assert worker_stats(env, "Relu").calls_kept == 2
        with InferenceSession(model, options_for(env, "Relu", "Neg"), env=env) as s:
            for _ in range(4):
                s.run(None, {"x": x})
            before = worker_stats(env, "Relu")
            for _ in range(4):
                np.testing.assert_array_equal(s.run(None, {"x": x})[0], np.maximum(-np.maximum(x, 0), 0))
            after = worker_stats(env, "Relu")
    assert before.calls_kept == 4
    assert (after.calls_kept - before.calls_kept, after.kept_calls - before.kept_calls) == (0, 4 * 2)


def test_a_connection_keeps_as_many_calls_as_a_registration_option_says_and_no_more_than_a_worker_does():
    env = ephost.Environment()
    for bad in ("0", str(MAX_KEPT + 1), "many"):
        with pytest.raises(ephost.EpInvalidArgument, match="^bad supervision option: kept_calls_max (must|takes)"):
            env.register_execution_provider_library("Relu", "reference", {"ops": "Relu", "kept_calls_max": bad})
    env.close()


def test_a_plan_of_more_partitions_in_a_worker_than_64_stays_kept_run_after_run():
    """Each run of a chain of 65 partitions in each of two workers repeats each partition's kept call: none is
    let go and kept again (with 64 calls a connection, each run kept every call anew)."""
    model = models.chain(["Relu", "Neg"] * 65)
    with ephost.Environment() as env:
        for op in ("Relu", "Neg"):
            env.register_execution_provider_library(op, "reference", {"ops": op})
        with InferenceSession(model, options_for(env, "Relu", "Neg"), env=env) as s:
            assert len(s.get_provider_graph_assignment_info()) == 130
            x = np.linspace(-1, 1, 4, dtype=np.float32)
            expected = x
            for _ in range(65):
                expected = -np.maximum(expected, 0)
            s.run(None, {"x": x})
            before = worker_stats(env, "Relu")
            for _ in range(3):
                np.testing.assert_array_equal(s.run(None, {"x": x})[0], expected)
            after = worker_stats(env, "Relu")
    assert (after.calls_kept - before.calls_kept, after.kept_calls - before.kept_calls) == (0, 3 * 65)


def kept_partition(raw: RawClient):
    """A compiled Relu on 4 floats, and a Compute request for it whose input travels inline."""
    ep = raw(raw.factory.CreateEp, factory_pb2.CreateEpRequest(device_indices=[0])).id
    (partition,) = raw(raw.ep.Compile, ep_pb2.CompileRequest(
        ep=ep, model=ep_pb2.ModelRef(model=models.chain(["Relu"]).SerializeToString()),
        graphs=[ep_pb2.FusedGraph(name="p", nodes=["n0_Relu"], inputs=["x"], outputs=["y"])])).node_compute_infos
    request = ep_pb2.ComputeRequest(node_compute_info=partition, inline_limit=1 << 20, keep_call=True)
    ref = request.inputs.add().tensor
    ref.desc.elem_type, ref.desc.shape[:] = 1, [4]
    ref.inline = np.array([-1, 2, -3, 4], np.float32).tobytes()
    return ep, partition, request


def kept_frame(sock, payload: bytes, timeout: float = 10.0):
    send_frame(sock, KEPT, 0, timeout, payload)
    return FrameReader(sock).read()


def dims(*values: int) -> bytes:
    """Dimensions as a KEPT frame and its reply carry them."""
    return struct.pack(f"<{len(values)}Q", *values)


def test_kept_calls_on_the_wire(lane_worker):
    """The KEPT frame: the kept call's id, the inputs' dimensions and bytes in; the outputs' dimensions and bytes
    out. Every payload is checked (length, id), a kept call belongs to its connection and names a partition looked
    up on every call, and gRPC never keeps one."""
    raw = RawClient(lane_worker.address)
    try:
        ep, partition, request = kept_partition(raw)
        sock, _ = open_lane(raw)
        assert sock.recv(2) == b"OK"
        frame, reply = lane_call(sock, "Ep/Compute", request)
        assert frame.status == 0 and reply.kept_call, fastlane_error(frame)
        np.testing.assert_array_equal(np.frombuffer(reply.outputs[0].tensor.inline, np.float32), [0, 2, 0, 4])
        kid = KEPT_ID.pack(reply.kept_call)
        with_options = ep_pb2.ComputeRequest()
        with_options.CopyFrom(request)
        with_options.run_options.config["memory.enable_memory_arena_shrinkage"] = "cpu:0"
        frame, unkept = lane_call(sock, "Ep/Compute", with_options)
        assert frame.status == 0 and unkept.kept_call == 0  # a call with run options is never kept
        x = np.array([5, -6, 7, -8], np.float32)
        frame = kept_frame(sock, kid + dims(4) + x.tobytes())
        assert (frame.method, frame.status) == (KEPT, 0)
        assert frame.payload[:8] == dims(4)
        np.testing.assert_array_equal(np.frombuffer(frame.payload, np.float32, offset=8), [5, 0, 7, 0])

        for payload, code, says in ((kid + dims(4) + x.tobytes()[:12], 3, b"takes 24 bytes"),
                                    (kid + dims(4) + x.tobytes() + b"\0", 3, b"takes 24 bytes"),
                                    (b"\x01\x00", 3, b"shorter than its 4-byte id"),
                                    (KEPT_ID.pack(999) + dims(4) + x.tobytes(), 5, b"no kept call 999")):
            frame = kept_frame(sock, payload)
            assert (frame.method, frame.status) == (KEPT, code) and says in bytes(frame.payload), fastlane_error(frame)
        assert decode_error(kept_frame(sock, KEPT_ID.pack(999)).payload)[1] == "unknown-kept-call"
        frame = kept_frame(sock, kid + dims(4) + x.tobytes(), timeout=float("nan"))
        assert frame.status == 3 and b"timeout" in bytes(frame.payload)

        # Another connection of the same client does not know it.
        other, _ = open_lane(raw)
        assert other.recv(2) == b"OK"
        assert kept_frame(other, kid + dims(4) + x.tobytes()).status == 5
        other.close()
        # Not asked, or over gRPC: not kept.
        request.keep_call = False
        assert lane_call(sock, "Ep/Compute", request)[1].kept_call == 0
        request.keep_call = True
        assert raw(raw.ep.Compute, request).kept_call == 0

        # A connection keeps MAX_KEPT; past that a new call only in the place of one its caller names
        # (replace_kept), which the worker lets go as it reads the request, whatever comes of the call.
        ids = [lane_call(sock, "Ep/Compute", request)[1].kept_call for _ in range(MAX_KEPT)]
        assert all(ids[:-1]) and ids[-1] == 0
        request.replace_kept = 1 << 31  # no kept call of this connection's: no error, and no room made
        frame, reply = lane_call(sock, "Ep/Compute", request)
        assert frame.status == 0 and reply.kept_call == 0
        request.replace_kept = KEPT_ID.unpack(kid)[0]
        frame, reply = lane_call(sock, "Ep/Compute", request)
        assert frame.status == 0 and reply.kept_call, fastlane_error(frame)
        assert kept_frame(sock, kid + dims(4) + x.tobytes()).status == 5
        newest = KEPT_ID.pack(reply.kept_call)
        assert kept_frame(sock, newest + dims(4) + x.tobytes()).status == 0
        bad = ep_pb2.ComputeRequest()
        bad.CopyFrom(request)
        bad.replace_kept = ids[0]
        bad.inputs[0].tensor.inline = b"\0" * 4  # 4 bytes for 4 floats
        assert lane_call(sock, "Ep/Compute", bad)[0].status == 3
        assert kept_frame(sock, KEPT_ID.pack(ids[0]) + dims(4) + x.tobytes()).status == 5
        request.replace_kept = 0
        # The partition is looked up on every call: released, it is NOT_FOUND like any Compute of it.
        raw(raw.ep.ReleaseNodeComputeInfos, ep_pb2.ReleaseNodeComputeInfosRequest(ep=ep,
                                                                                  node_compute_infos=[partition]))
        frame = kept_frame(sock, newest + dims(4) + x.tobytes())
        assert frame.status == 5 and b"unknown compute info handle" in bytes(frame.payload)
        # The connection, and the worker, serve on.
        assert_serves_on(sock, allocator_pb2.AllocRequest(allocator=host_allocator(raw), nbytes=64), lane_worker)
    finally:
        raw.close()



def test_kept_calls_of_changing_shapes_on_the_wire(lane_worker):
    """A kept Compute's repeats may have inputs of any shape of the kept rank, empty ones too: the dimensions are
    checked as a request's are (a tensor too large for any), and the payload's length against the size they
    make."""
    raw = RawClient(lane_worker.address)
    try:
        ep = raw(raw.factory.CreateEp, factory_pb2.CreateEpRequest(device_indices=[0])).id
        (partition,) = raw(raw.ep.Compile, ep_pb2.CompileRequest(
            ep=ep, model=ep_pb2.ModelRef(model=models.chain(["Relu"], shape=("n",)).SerializeToString()),
            graphs=[ep_pb2.FusedGraph(name="p", nodes=["n0_Relu"], inputs=["x"], outputs=["y"])])).node_compute_infos
        request = ep_pb2.ComputeRequest(node_compute_info=partition, inline_limit=1 << 20, keep_call=True)
        ref = request.inputs.add().tensor
        ref.desc.elem_type, ref.desc.shape[:] = 1, [4]
        ref.inline = np.array([-1, 2, -3, 4], np.float32).tobytes()
        sock, _ = open_lane(raw)
        assert sock.recv(2) == b"OK"
        frame, reply = lane_call(sock, "Ep/Compute", request)
        assert frame.status == 0 and reply.kept_call, fastlane_error(frame)
        kid = KEPT_ID.pack(reply.kept_call)
        for x in (np.array([5, -6, 7, -8, 9, -10], np.float32), np.zeros(0, np.float32), np.float32([-1])):
            frame = kept_frame(sock, kid + struct.pack("<Q", x.size) + x.tobytes())
            assert (frame.method, frame.status) == (KEPT, 0), fastlane_error(frame)
            assert struct.unpack_from("<Q", frame.payload) == (x.size,)
            np.testing.assert_array_equal(np.frombuffer(frame.payload, np.float32, offset=8), np.maximum(x, 0))

        x = np.arange(6, dtype=np.float32)
        for payload, says in ((kid + b"\0" * 4, b"at least 8 bytes"),
                              (kid + struct.pack("<Q", 6) + x.tobytes()[:20], b"takes 32 bytes"),
                              (kid + struct.pack("<Q", 5) + x.tobytes(), b"takes 28 bytes"),
                              (kid + struct.pack("<Q", 1 << 62) + x.tobytes(), b"more than any tensor may be")):
            frame = kept_frame(sock, payload)
            assert (frame.method, frame.status) == (KEPT, 3) and says in bytes(frame.payload), fastlane_error(frame)
        # Over gRPC nothing is kept.
        assert raw(raw.ep.Compute, request).kept_call == 0
        assert_serves_on(sock, allocator_pb2.AllocRequest(allocator=host_allocator(raw), nbytes=64), lane_worker)
    finally:
        raw.close()

def open_slots(raw: RawClient) -> tuple[socket.socket, "lane_slots.Slots", mmap.mmap]:
    """A lane connection that asks for shared slots: its socket, the client's end of the slots, and a mapping
    of them of the test's own (to write what a client should not)."""
    reply = raw(raw.worker.OpenDataPlane, common_pb2.Empty())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(reply.socket)
    sock.send(reply.ticket + lane_slots.ASK)
    answer, fds, _, _ = socket.recv_fds(sock, 2, 1)
    assert answer == b"OK" and len(fds) == 1, "the worker hands the slots over with its answer"
    raw_map = lane_slots.adopt(os.dup(fds[0]))
    return sock, lane_slots.Slots(lane_slots.adopt(fds[0]), sock, worker=False), raw_map


def test_frames_pass_through_shared_slots_and_the_socket_keeps_the_rest(lane_worker):
    """A connection that asks for slots: a request put in the slot is answered in the slot (nothing on the
    socket); a frame longer than a packet goes on the socket both ways, between frames through the slot; a
    reader that says it sleeps is rung for; a slot whose frame count skips, or that says a frame is longer than
    a packet, closes its connection, and the worker serves on."""
    raw = RawClient(lane_worker.address)
    try:
        ep, partition, request = kept_partition(raw)
        request.keep_call = False
        sock, slots, raw_map = open_slots(raw)
        reader = FrameReader(sock, adopt=lambda region, size, fd: os.close(fd), slots=slots)

        def through_slot(x: np.ndarray) -> np.ndarray:
            request.inputs[0].tensor.inline = x.tobytes()
            request.inputs[0].tensor.desc.shape[:] = x.shape
            send_frame(sock, METHODS["Ep/Compute"].id, 0, 10.0, request.SerializeToString(), slots)
            deadline = time.monotonic() + 10
            while not slots.arrived():
                assert time.monotonic() < deadline, "no reply in the slot"
            assert not select.select([sock], [], [], 0)[0], "nothing on the socket"
            frame = reader.read()
            assert frame.status == 0, fastlane_error(frame)
            return np.frombuffer(ep_pb2.ComputeResponse.FromString(frame.payload).outputs[0].tensor.inline,
                                 np.float32)

        x = np.array([-1, 2, -3, 4], np.float32)
        np.testing.assert_array_equal(through_slot(x), np.maximum(x, 0))
        # 100 KiB in and out: on the socket, as several packets.
        big = np.linspace(-1, 1, 25_600, dtype=np.float32)
        (wide,) = raw(raw.ep.Compile, ep_pb2.CompileRequest(
            ep=ep, model=ep_pb2.ModelRef(model=models.chain(["Relu"], shape=big.shape).SerializeToString()),
            graphs=[ep_pb2.FusedGraph(name="w", nodes=["n0_Relu"], inputs=["x"], outputs=["y"])])).node_compute_infos
        large = ep_pb2.ComputeRequest()
        large.CopyFrom(request)
        large.node_compute_info = wide
        large.inputs[0].tensor.inline = big.tobytes()
        large.inputs[0].tensor.desc.shape[:] = big.shape
        frame, reply = lane_call(sock, "Ep/Compute", large)  # read as a reader without slots would
        assert frame.status == 0, fastlane_error(frame)
        np.testing.assert_array_equal(np.frombuffer(reply.outputs[0].tensor.inline, np.float32), np.maximum(big, 0))
        np.testing.assert_array_equal(through_slot(-x), np.maximum(-x, 0))
        # A reader asleep is rung: one zero byte on the socket once the reply is in the slot.
        slots.asleep(True)
        send_frame(sock, METHODS["Ep/Compute"].id, 0, 10.0, request.SerializeToString(), slots)
        assert select.select([sock], [], [], 10)[0] and sock.recv(16) == b"\0"
        slots.asleep(False)
        assert reader.read().status == 0

        for count, length, says in ((2, 64, b"count skipped"), (1, 1 << 20, b"of 1048576 bytes")):
            other, other_slots, other_map = open_slots(raw)
            view = memoryview(other_map).cast("Q")
            view[1], view[0] = length, count  # the request slot's length, then its frame count
            if view[lane_slots.ASLEEP]:  # the worker sleeps already (this thread was slow to write): ring, as a
                other.send(DOORBELL)     # writer does; else it sleeps on and the read below times out
            view.release()
            frame = FrameReader(other).read()  # on the socket: the slot cannot be trusted
            assert frame.status == 3 and says in bytes(frame.payload), fastlane_error(frame)
            assert FrameReader(other).read() is None, "the worker closed the connection"
            other.close()
            other_slots.close()
            other_map.close()
        np.testing.assert_array_equal(through_slot(x), np.maximum(x, 0))
        slots.close()
        raw_map.close()
        assert_serves_on(sock, allocator_pb2.AllocRequest(allocator=host_allocator(raw), nbytes=64), lane_worker)
    finally:
        raw.close()


def staged_model():
    """y = s @ x: x of 1 MiB (over the inline limit: it is staged in a buffer of the worker's), s of 1 KiB
    (inline), y of 4 KiB (inline)."""
    from onnx import helper
    return models.model([helper.make_node("MatMul", ["s", "x"], ["y"], name="mm")],
                        [models.tensor("s", [1, 256]), models.tensor("x", [256, 1024])],
                        [models.tensor("y", [1, 1024])])


def staged_run(session, rng) -> None:
    """One run of staged_model on new random inputs, its result checked."""
    feeds = {"s": rng.standard_normal((1, 256)).astype(np.float32),
             "x": rng.standard_normal((256, 1024)).astype(np.float32)}
    np.testing.assert_allclose(session.run(None, feeds)[0], feeds["s"] @ feeds["x"], rtol=1e-4, atol=1e-4)


def test_runs_with_large_inputs_are_kept_calls_through_buffers_kept_for_them(ort_env):
    """A large input goes into a buffer of the worker's that the calling thread keeps for the call: the first
    run allocates it and sends the whole Compute; the next write the input there again and send a KEPT frame
    with only the small inputs' bytes. Every result is right; no run after the first allocates or frees.
    Over gRPC (no lane) the same buffers are used, and the call is sent whole each time."""
    rng = np.random.default_rng(3)
    for registration, kept in (("ort", 10), ("ort_grpc", 0)):
        with InferenceSession(staged_model(), options_for(ort_env, registration), env=ort_env) as s:
            staged_run(s, rng)
            before = worker_stats(ort_env, registration)
            for _ in range(10):
                staged_run(s, rng)
            after = worker_stats(ort_env, registration)
        assert after.kept_calls - before.kept_calls == kept, registration
        assert after.buffers_live == before.buffers_live, registration
        for method in ("Allocator/Alloc", "Allocator/Free"):
            assert after.methods[method].calls == before.methods[method].calls, (registration, method)
        moved = after.compute_input_bytes_transferred - before.compute_input_bytes_transferred
        assert moved == 10 * (256 + 256 * 1024) * 4, registration  # both inputs, every run
        if kept:  # the large input's bytes never in a frame
            assert after.bytes_inline_in - before.bytes_inline_in == 10 * 256 * 4



def test_a_large_input_whose_shape_grows_is_written_into_buffers_that_grow_twice_as_large(ort_env):
    """A loop whose large input grows every step: the calling thread's buffer for it is used while it is large
    enough and replaced by one twice as large when outgrown, so that a dozen steps allocate twice, not a dozen
    times; on the lane the steps after the first repeat its kept call whatever their shapes, the input's bytes
    never in a frame. Every result is right, over gRPC too."""
    from onnx import helper
    model = models.model([helper.make_node("MatMul", ["s", "x"], ["y"], name="mm")],
                         [models.tensor("s", [1, 256]), models.tensor("x", [256, "n"])],
                         [models.tensor("y", [1, "n"])])
    rng = np.random.default_rng(4)
    widths = [600 + 40 * k for k in range(12)]  # x from 600 KiB to over 1 MiB, over the inline limit throughout
    for registration, lane in (("ort", True), ("ort_grpc", False)):
        before = worker_stats(ort_env, registration)
        with InferenceSession(model, options_for(ort_env, registration), env=ort_env) as session:
            for n in widths:
                feeds = {"s": rng.standard_normal((1, 256)).astype(np.float32),
                         "x": rng.standard_normal((256, n)).astype(np.float32)}
                np.testing.assert_allclose(session.run(None, feeds)[0], feeds["s"] @ feeds["x"], rtol=1e-4,
                                           atol=1e-4)
            after = worker_stats(ort_env, registration)
        allocs = after.methods["Allocator/Alloc"].calls - before.methods["Allocator/Alloc"].calls
        assert allocs == 2, registration
        assert after.compute_input_bytes_transferred - before.compute_input_bytes_transferred == \
            sum(256 * 4 + 256 * n * 4 for n in widths), registration
        if lane:
            assert after.kept_calls - before.kept_calls == len(widths) - 1

def test_threads_keep_buffers_of_their_own(ort_env):
    """Four threads repeating one call with large inputs at once: each writes into buffers of its own, so that
    none reads another's input."""
    with InferenceSession(staged_model(), options_for(ort_env, "ort"), env=ort_env) as s:
        def work(i):
            rng = np.random.default_rng(100 + i)
            for _ in range(15):
                staged_run(s, rng)

        errors = in_threads(work, 4)
    assert errors == []


def test_a_kept_call_through_buffers_survives_its_worker():
    """The worker that had the kept buffers is killed: the next run (retried on its successor) is right, with
    buffers acquired again there, and is kept again."""
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", "onnxruntime", {"intra_op_num_threads": "1"})
        options = options_for(env, "w")
        options.ep_failure_policy = "retry"
        rng = np.random.default_rng(5)
        with InferenceSession(staged_model(), options, env=env) as s:
            for _ in range(3):
                staged_run(s, rng)
            os.kill(env.registration("w").process.pid, signal.SIGKILL)
            env.registration("w").link.wait_noticed(10)
            for _ in range(3):
                staged_run(s, rng)
            assert worker_stats(env, "w").kept_calls == 2  # the successor's 2nd and 3rd runs


def buffer_partition(raw: RawClient):
    """kept_partition's, its input in a buffer of a host allocator (holding [-1, 2, -3, 4]) instead of inline:
    (ep, partition, request, allocator, buffer, write(values) into the buffer)."""
    ep, partition, request = kept_partition(raw)
    allocator = host_allocator(raw)
    buffer = raw(raw.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=16)).buffer

    def write(values):
        raw(raw.allocator.Write, iter([allocator_pb2.BufferChunk(
            allocator=allocator, buffer=buffer, data=np.array(values, np.float32).tobytes())]))

    write([-1, 2, -3, 4])
    request.inputs[0].tensor.buffer = buffer  # instead of inline bytes
    return ep, partition, request, allocator, buffer, write


def test_kept_calls_through_a_buffer_on_the_wire(lane_worker):
    """A kept call whose input is in a buffer of the caller's: the KEPT frame carries the id and the buffer's
    handle (a run may name another buffer), the worker reads the buffer as it is at each call, and looks the
    buffer up every time (freed or unknown: NOT_FOUND; too small: INVALID_ARGUMENT; the connection serves on)."""
    raw = RawClient(lane_worker.address)
    try:
        ep, partition, request, allocator, buffer, write = buffer_partition(raw)
        sock, _ = open_lane(raw)
        assert sock.recv(2) == b"OK"
        frame, reply = lane_call(sock, "Ep/Compute", request)
        assert frame.status == 0 and reply.kept_call, fastlane_error(frame)
        kid = KEPT_ID.pack(reply.kept_call)
        write([5, -6, 7, -8])
        frame = kept_frame(sock, kid + dims(4, buffer))
        assert (frame.method, frame.status) == (KEPT, 0), fastlane_error(frame)
        np.testing.assert_array_equal(np.frombuffer(frame.payload, np.float32, offset=8), [5, 0, 7, 0])
        frame = kept_frame(sock, kid + dims(4, buffer) + bytes(16))  # the input is not in the frame
        assert frame.status == 3 and b"takes 16 bytes" in bytes(frame.payload)
        other = raw(raw.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=16)).buffer
        raw(raw.allocator.Write, iter([allocator_pb2.BufferChunk(
            allocator=allocator, buffer=other, data=np.array([-9, 9, -9, 9], np.float32).tobytes())]))
        frame = kept_frame(sock, kid + dims(4, other))  # another buffer this run
        np.testing.assert_array_equal(np.frombuffer(frame.payload, np.float32, offset=8), [0, 9, 0, 9])
        small = raw(raw.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=8)).buffer
        frame = kept_frame(sock, kid + dims(4, small))
        assert frame.status == 3 and b"does not fit its buffer of 8 bytes" in bytes(frame.payload), \
            fastlane_error(frame)

        raw(raw.allocator.Free, allocator_pb2.FreeRequest(allocator=allocator, buffer=buffer))
        for handle in (buffer, 99999):
            frame = kept_frame(sock, kid + dims(4, handle))
            assert frame.status == 5 and b"unknown buffer handle" in bytes(frame.payload), fastlane_error(frame)
        assert_serves_on(sock, allocator_pb2.AllocRequest(allocator=allocator, nbytes=64), lane_worker)
    finally:
        raw.close()


def compute_errors(raw: RawClient) -> int:
    return raw(raw.worker.GetStats, common_pb2.Empty()).methods["Ep/Compute"].errors


def await_compute_errors(raw: RawClient, count: int, timeout: float = 10.0) -> bool:
    """Whether the worker counts `count` failed Computes (kept calls among them) within `timeout`."""
    deadline = time.monotonic() + timeout
    while compute_errors(raw) < count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_kept_call_sent_before_its_inputs_are_written_waits_for_them_on_the_wire(lane_worker):
    """KEPT_WRITING: a kept call through a buffer, its frame put in the slot before the caller writes the buffer.
    The worker reads none of it before the caller's READY word says so (the result is of what was written after
    the frame; a stray doorbell meanwhile changes nothing; a deadline centuries away is none); its wait ends at
    the call's deadline
    (DEADLINE_EXCEEDED, and the connection serves on), at a frame out of turn and at the connection's end (the
    call fails, that connection goes, the worker serves others). An unknown kept call is answered without a
    wait, and the frame on the socket is refused."""
    raw = RawClient(lane_worker.address)
    try:
        ep, partition, request, allocator, buffer, write = buffer_partition(raw)

        def connect():
            """A connection with slots, its reader, and the payload of a KEPT frame of the call kept there."""
            sock, slots, _ = open_slots(raw)
            reader = FrameReader(sock, adopt=lambda region, size, fd: os.close(fd), slots=slots)
            send_frame(sock, METHODS["Ep/Compute"].id, 0, 10.0, request.SerializeToString(), slots)
            frame = reader.read()
            assert frame.status == 0, fastlane_error(frame)
            kid = ep_pb2.ComputeResponse.FromString(frame.payload).kept_call
            return sock, slots, reader, KEPT_ID.pack(kid) + dims(4, buffer)

        def writing(timeout: float = 10.0, data: bytes | None = None) -> None:
            data = payload if data is None else data
            assert put_parts(slots, KEPT_WRITING, timeout, [data], len(data))

        sock, slots, reader, payload = connect()
        writing()
        time.sleep(0.3)
        assert not slots.arrived(), "the worker answered before the inputs were written"
        sock.send(DOORBELL)
        write([5, -6, 7, -8])
        time.sleep(0.05)
        assert not slots.arrived()
        slots.inputs_written()
        frame = reader.read()
        assert (frame.method, frame.status, frame.slot) == (KEPT, 0, True), fastlane_error(frame)
        np.testing.assert_array_equal(np.frombuffer(frame.payload, np.float32, offset=8), [5, 0, 7, 0])

        writing(timeout=1e308)  # a deadline centuries away: the worker sleeps as long as it takes
        time.sleep(0.1)
        slots.inputs_written()
        frame = reader.read()
        assert frame.status == 0, fastlane_error(frame)

        errors = compute_errors(raw)
        writing(timeout=0.2)
        frame = reader.read()
        assert frame.status == 4 and "did not write the inputs" in fastlane_error(frame)
        write([1, 1, -1, -1])
        writing()
        slots.inputs_written()
        np.testing.assert_array_equal(np.frombuffer(reader.read().payload, np.float32, offset=8), [1, 1, 0, 0])

        writing(data=KEPT_ID.pack(999) + dims(4, buffer))  # never written: nothing to wait for
        assert reader.read().status == 5
        send_frame(sock, KEPT_WRITING, 0, 10.0, payload)  # on the socket
        frame = reader.read()
        assert frame.status == 3 and "through the connection's slots" in fastlane_error(frame)

        writing()
        send_frame(sock, METHODS["Allocator/Alloc"].id, 0, 10.0,
                   allocator_pb2.AllocRequest(allocator=allocator, nbytes=8).SerializeToString())
        assert await_compute_errors(raw, errors + 2), "the wait goes on past a frame out of turn"
        frames = []
        while (frame := reader.read()) is not None:
            frames.append(frame)
        assert [f.status for f in frames] == [3] and "before it wrote" in fastlane_error(frames[0])
        sock.close()

        sock, slots, reader, payload = connect()
        writing()
        sock.close()
        assert await_compute_errors(raw, errors + 3), "the wait goes on past the caller's end"
        sock, _ = open_lane(raw)
        assert sock.recv(2) == b"OK"
        assert_serves_on(sock, allocator_pb2.AllocRequest(allocator=allocator, nbytes=64), lane_worker)
    finally:
        raw.close()


def test_large_inputs_are_written_while_the_worker_reads_the_call(ort_env, monkeypatch):
    """A repeated run writes its large input into the buffer kept for it after the call went through the slots
    (KEPT_WRITING): the worker waits for it, so that a write made slow is time spent inside the worker's Compute,
    and every result is of its own run's input. With the lane's frames on its socket, and over gRPC, the input is
    written before the call. (A steady run writes it straight into the buffer's view, the general path through
    the stager: both are made slow, the first by its telling the worker late.)"""
    from ephost.client.transfer import Stager
    from ephost.lane_slots import Slots
    rng = np.random.default_rng(9)
    write, written = Stager.write, Slots.inputs_written

    def slow_write(self, buffer, data):
        time.sleep(0.05)
        write(self, buffer, data)

    def slow_written(self):
        time.sleep(0.05)
        written(self)

    ort_env.register_execution_provider_library("ort_socket", "onnxruntime", {"intra_op_num_threads": "1",
                                                                              "fast_lane_slots": "false"})
    try:
        for registration, inside in (("ort", True), ("ort_socket", False), ("ort_grpc", False)):
            with InferenceSession(staged_model(), options_for(ort_env, registration), env=ort_env) as s:
                for _ in range(2):
                    staged_run(s, rng)
                before = worker_stats(ort_env, registration).methods["Ep/Compute"]
                with monkeypatch.context() as patch:
                    patch.setattr(Stager, "write", slow_write)
                    patch.setattr(Slots, "inputs_written", slow_written)
                    for _ in range(3):
                        staged_run(s, rng)
                after = worker_stats(ort_env, registration).methods["Ep/Compute"]
            assert after.calls - before.calls == 3
            assert (after.total_s - before.total_s >= 3 * 0.05) == inside, registration
    finally:
        ort_env.unregister_execution_provider_library("ort_socket")


def test_kept_calls_writing_into_a_buffer_on_the_wire(lane_worker):
    """A kept call whose output goes into a buffer of the caller's (ComputeRequest.output_buffers, an
    IOBinding's bound output): the reply carries none of its bytes, the buffer holds each run's result, the
    buffer is looked up every time (freed: NOT_FOUND; the connection serves on), and an output buffer named
    otherwise than by handle is not kept."""
    raw = RawClient(lane_worker.address)
    try:
        _, _, request = kept_partition(raw)
        allocator = host_allocator(raw)
        out = raw(raw.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=16)).buffer
        target = request.output_buffers[0]
        target.desc.elem_type, target.desc.shape[:] = 1, [4]
        target.buffer = out

        def result():
            return np.frombuffer(b"".join(c.data for c in raw(raw.allocator.Read, allocator_pb2.ReadRequest(
                allocator=allocator, buffer=out, nbytes=16))), np.float32)

        sock, _ = open_lane(raw)
        assert sock.recv(2) == b"OK"
        frame, reply = lane_call(sock, "Ep/Compute", request)
        assert frame.status == 0 and reply.kept_call, fastlane_error(frame)
        assert reply.outputs[0].tensor.buffer == out
        np.testing.assert_array_equal(result(), [0, 2, 0, 4])
        kid = KEPT_ID.pack(reply.kept_call)
        frame = kept_frame(sock, kid + dims(4, out) + np.array([5, -6, 7, -8], np.float32).tobytes())
        assert (frame.method, frame.status, len(frame.payload)) == (KEPT, 0, 0), fastlane_error(frame)
        np.testing.assert_array_equal(result(), [5, 0, 7, 0])

        raw(raw.allocator.Free, allocator_pb2.FreeRequest(allocator=allocator, buffer=out))
        frame = kept_frame(sock, kid + dims(4, out) + np.array([1, 1, 1, 1], np.float32).tobytes())
        assert frame.status == 5 and b"unknown buffer handle" in bytes(frame.payload), fastlane_error(frame)
        target.ClearField("buffer")
        target.reply.SetInParent()
        frame, reply = lane_call(sock, "Ep/Compute", request)
        assert frame.status != 0 or reply.kept_call == 0
        assert_serves_on(sock, allocator_pb2.AllocRequest(allocator=allocator, nbytes=64), lane_worker)
    finally:
        raw.close()


def test_copies_between_a_workers_buffers_repeat_as_kept_calls(ort_env):
    """CopyTensors between buffers of the worker's (shared memory to its private memory and back, destinations
    alternating): the first sends the whole call and the worker keeps it, the next send the buffers' handles;
    every copy lands. A copy from this process's own memory is sent whole. gRPC keeps nothing, nor a
    registration with kept_calls=false."""
    ort_env.register_execution_provider_library("ort_unkept", "onnxruntime", {"kept_calls": "false"})
    try:
        for registration, kept in (("ort", 29), ("ort_grpc", 0), ("ort_unkept", 0)):
            device = next(d for d in ort_env.get_ep_devices() if d.registration_name == registration)
            shared = ort_env.create_shared_allocator(device, ephost.DeviceMemoryType.HOST_ACCESSIBLE)
            private = ort_env.create_shared_allocator(device, ephost.DeviceMemoryType.DEFAULT)
            try:
                src, back = (ephost.Tensor.empty((256,), np.float32, shared) for _ in range(2))
                inside = [ephost.Tensor.empty((256,), np.float32, private) for _ in range(2)]
                before = worker_stats(ort_env, registration)
                for k in range(10):
                    x = np.arange(256, dtype=np.float32) * (k + 1)
                    src.numpy()[:] = x                                  # straight into the worker's memory
                    ort_env.copy_tensors([src], [inside[k % 2]])
                    ort_env.copy_tensors([inside[k % 2]], [back])
                    np.testing.assert_array_equal(back.numpy(), x)
                    here = ephost.Tensor.from_numpy(np.zeros_like(x))   # this process's memory: sent whole
                    ort_env.copy_tensors([inside[k % 2]], [here])
                    np.testing.assert_array_equal(here.numpy(), x)
                after = worker_stats(ort_env, registration)
                assert after.methods["DataTransfer/CopyTensors"].calls - \
                    before.methods["DataTransfer/CopyTensors"].calls == 30
                assert after.copies - before.copies == 30
                # the 20 between buffers of the worker's are one kept call; the 10 into this process's memory
                # (staged through a buffer of the worker's and read back) are sent whole
                assert after.kept_calls - before.kept_calls == (19 if kept else 0), registration
                for t in (src, back, *inside):
                    t.release()
            finally:
                ort_env.release_shared_allocator(device, ephost.DeviceMemoryType.HOST_ACCESSIBLE)
                ort_env.release_shared_allocator(device, ephost.DeviceMemoryType.DEFAULT)
    finally:
        ort_env.unregister_execution_provider_library("ort_unkept")


def test_kept_copies_start_again_on_a_successor_worker():
    """Copies kept by a worker that is then killed: its private memory is gone (a copy from it says so, and
    nothing is sent on the old connection), and copies between buffers of its successor are kept there anew."""
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", "onnxruntime", {"intra_op_num_threads": "1"})
        device = next(d for d in env.get_ep_devices() if d.registration_name == "w")
        shared = env.create_shared_allocator(device, ephost.DeviceMemoryType.HOST_ACCESSIBLE)
        private = env.create_shared_allocator(device, ephost.DeviceMemoryType.DEFAULT)
        x = np.arange(64, dtype=np.float32)

        def round_trip(k):
            src, back = ephost.Tensor.from_numpy(x * k, shared), ephost.Tensor.empty(x.shape, x.dtype, shared)
            inside = ephost.Tensor.empty(x.shape, x.dtype, private)
            env.copy_tensors([src], [inside])
            env.copy_tensors([inside], [back])
            np.testing.assert_array_equal(back.numpy(), x * k)
            return inside

        try:
            for k in range(3):
                left = round_trip(k)
            assert worker_stats(env, "w").kept_calls == 5
            process = env.registration("w").process
            os.kill(process.pid, signal.SIGKILL)
            assert process.exited.wait(10)
            env.registration("w").link.wait_noticed(10)
            with pytest.raises(ephost.EpNotFound, match="neither this process nor the worker can read"):
                env.copy_tensors([left], [ephost.Tensor.from_numpy(np.zeros_like(x))])
            for k in range(3):
                round_trip(k + 10)
            assert worker_stats(env, "w").kept_calls == 5, "the successor keeps its own, from its first copy"
        finally:
            env.release_shared_allocator(device, ephost.DeviceMemoryType.HOST_ACCESSIBLE)
            env.release_shared_allocator(device, ephost.DeviceMemoryType.DEFAULT)


def test_kept_copies_on_the_wire(lane_worker):
    """A kept CopyTensors: the KEPT frame carries the id and the buffers' handles (sources, then destinations;
    each repeat may name others), its reply nothing; every handle is looked up on every repeat (freed or
    unknown: NOT_FOUND; too small: INVALID_ARGUMENT; a wrong length: INVALID_ARGUMENT; the connection serves
    on). A copy with an inline source is not kept, nor one over gRPC."""
    raw = RawClient(lane_worker.address)
    try:
        transfer = raw(raw.factory.CreateDataTransfer, common_pb2.Empty()).data_transfer
        allocator = host_allocator(raw)
        a, b, c = (raw(raw.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=16)).buffer
                   for _ in range(3))
        small = raw(raw.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=8)).buffer

        def write(buffer, values):
            raw(raw.allocator.Write, iter([allocator_pb2.BufferChunk(
                allocator=allocator, buffer=buffer, data=np.array(values, np.float32).tobytes())]))

        def read(buffer):
            return np.frombuffer(b"".join(chunk.data for chunk in raw(raw.allocator.Read, allocator_pb2.ReadRequest(
                allocator=allocator, buffer=buffer, nbytes=16))), np.float32)

        def ref(refs, buffer):
            r = refs.add()
            r.desc.elem_type, r.desc.shape[:] = 1, [4]
            r.buffer = buffer
            return r

        request = data_transfer_pb2.CopyTensorsRequest(data_transfer=transfer, keep_call=True)
        ref(request.src, a)
        ref(request.dst, b)
        assert raw(raw.transfer.CopyTensors, request).kept_call == 0, "gRPC keeps no call"
        write(a, [1, 2, 3, 4])
        sock, _ = open_lane(raw)
        assert sock.recv(2) == b"OK"
        frame, reply = lane_call(sock, "DataTransfer/CopyTensors", request)
        assert frame.status == 0 and reply.kept_call, fastlane_error(frame)
        np.testing.assert_array_equal(read(b), [1, 2, 3, 4])
        kid = KEPT_ID.pack(reply.kept_call)
        write(a, [5, 6, 7, 8])
        frame = kept_frame(sock, kid + struct.pack("<QQ", a, c))  # another destination this time
        assert (frame.method, frame.status, len(frame.payload)) == (KEPT, 0, 0), fastlane_error(frame)
        np.testing.assert_array_equal(read(c), [5, 6, 7, 8])
        frame = kept_frame(sock, kid + struct.pack("<QQ", c, b))  # and the other way
        assert frame.status == 0, fastlane_error(frame)
        np.testing.assert_array_equal(read(b), [5, 6, 7, 8])

        frame = kept_frame(sock, kid + struct.pack("<Q", a))
        assert frame.status == 3 and b"takes 16 bytes" in bytes(frame.payload), fastlane_error(frame)
        frame = kept_frame(sock, kid + struct.pack("<QQ", a, small))
        assert frame.status == 3 and b"does not fit its buffer of 8 bytes" in bytes(frame.payload), \
            fastlane_error(frame)
        raw(raw.allocator.Free, allocator_pb2.FreeRequest(allocator=allocator, buffer=c))
        for pair in ((a, c), (99999, b)):
            frame = kept_frame(sock, kid + struct.pack("<QQ", *pair))
            assert frame.status == 5 and b"unknown buffer handle" in bytes(frame.payload), fastlane_error(frame)
        np.testing.assert_array_equal(read(b), [5, 6, 7, 8])  # nothing half-done

        request.src[0].ClearField("buffer")
        request.src[0].inline = np.array([9, 9, 9, 9], np.float32).tobytes()
        frame, reply = lane_call(sock, "DataTransfer/CopyTensors", request)
        assert frame.status == 0 and reply.kept_call == 0, fastlane_error(frame)
        np.testing.assert_array_equal(read(b), [9, 9, 9, 9])
        assert_serves_on(sock, allocator_pb2.AllocRequest(allocator=allocator, nbytes=64), lane_worker)
    finally:
        raw.close()


@pytest.mark.parametrize("why", ["keep", "too large to go inline"])
def test_kept_calls_leaving_outputs_in_the_worker_on_the_wire(lane_worker, why):
    """A kept call whose output the worker leaves in a new buffer of the call's allocator (`keep`, an
    IOBinding's output bound to a device; or an output over the call's inline limit, as a run's large output
    is): each KEPT reply is a PLACED record naming a new buffer (a handle of the client's, where it lies in a
    region the connection was handed) holding that run's result."""
    raw = RawClient(lane_worker.address)
    try:
        _, _, request = kept_partition(raw)
        allocator = host_allocator(raw)
        request.output_allocator = allocator
        if why == "keep":
            request.keep[:] = [0]
        else:
            request.inline_limit = 16  # the output's 16 bytes are not under it
        sock, _ = open_lane(raw)
        assert sock.recv(2) == b"OK"
        frame, reply = lane_call(sock, "Ep/Compute", request)
        assert frame.status == 0 and reply.kept_call, fastlane_error(frame)
        first = reply.outputs[0].tensor
        kid = KEPT_ID.pack(reply.kept_call)
        handles = {first.buffer}
        before = sole_client_stats(raw)
        for values in ([5, -6, 7, -8], [-1, -1, 9, 1]):
            x = np.array(values, np.float32)
            frame = kept_frame(sock, kid + dims(4) + x.tobytes())
            assert (frame.method, frame.status, len(frame.payload)) == (KEPT, 0, 8 + PLACED.size), \
                fastlane_error(frame)
            assert frame.payload[:8] == dims(4)
            handle, region, offset, nbytes = PLACED.unpack_from(frame.payload, 8)
            assert handle not in handles and region == first.mapped.region and nbytes == 16 and offset >= 0
            handles.add(handle)
            data = b"".join(c.data for c in raw(raw.allocator.Read, allocator_pb2.ReadRequest(
                allocator=allocator, buffer=handle, nbytes=16)))
            np.testing.assert_array_equal(np.frombuffer(data, np.float32), np.maximum(x, 0))
        after = raw(raw.worker.GetStats, common_pb2.Empty())
        assert after.kept_calls - before.kept_calls == 2
        assert after.buffers_live - before.buffers_live == 2  # the client's now, until it frees them
        for handle in handles:
            raw(raw.allocator.Free, allocator_pb2.FreeRequest(allocator=allocator, buffer=handle))
        assert_serves_on(sock, allocator_pb2.AllocRequest(allocator=allocator, nbytes=64), lane_worker)
    finally:
        raw.close()


def test_a_threads_buffers_go_back_when_it_ends(ort_env):
    """Threads that come and go (a pool replaced, a request per thread) do not pile buffers up: an ended
    thread's kept buffers return to the session's staging pool, where the next thread finds them."""
    import gc
    rng = np.random.default_rng(9)
    with InferenceSession(staged_model(), options_for(ort_env, "ort"), env=ort_env) as s:
        def one_run():
            staged_run(s, rng)

        for _ in range(2):  # the first thread's buffer comes from an Alloc
            t = threading.Thread(target=one_run)
            t.start()
            t.join(30)
        gc.collect()
        before = worker_stats(ort_env, "ort")
        for _ in range(5):
            t = threading.Thread(target=one_run)
            t.start()
            t.join(30)
            del t
            gc.collect()
        after = worker_stats(ort_env, "ort")
    assert after.methods["Allocator/Alloc"].calls == before.methods["Allocator/Alloc"].calls
    assert after.buffers_live == before.buffers_live


def test_kept_calls_longer_than_a_packet_both_ways(ort_env):
    """A kept call's frames longer than one packet, an input and an output of 256 KiB each way (a 2-D array:
    its len() counts rows, and was once taken for its size, which sent a packet too long and lost the lane)."""
    from onnx import helper
    model = models.model([helper.make_node("Tanh", ["x"], ["y"], name="tanh")], [models.tensor("x", [256, 256])],
                         [models.tensor("y", [256, 256])])
    rng = np.random.default_rng(11)
    before = worker_stats(ort_env, "ort")
    with InferenceSession(model, options_for(ort_env, "ort"), env=ort_env) as s:
        for _ in range(5):
            x = rng.standard_normal((256, 256)).astype(np.float32)
            np.testing.assert_allclose(s.run(None, {"x": x})[0], np.tanh(x), rtol=1e-5, atol=1e-6)
    after = worker_stats(ort_env, "ort")
    assert after.kept_calls - before.kept_calls == 4
    assert after.bytes_inline_out - before.bytes_inline_out == 5 * 256 * 256 * 4  # the output came inline


def test_an_input_of_a_worker_being_replaced_is_kept_as_it_is_sent():
    """A run fed a tensor of a worker that died, while its successor is being started: the call waits for the
    successor, and the tensor (still mapped here) goes to it inline. The call is kept as it was sent, so that a
    later run feeding a tensor of the successor's (by handle) is kept anew, not repeated as the other (a kept call
    said to name a buffer the worker kept as inline bytes: INVALID_ARGUMENT, found by killing workers under load)."""
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", "onnxruntime", {"intra_op_num_threads": "1"})
        device = next(d for d in env.get_ep_devices() if d.registration_name == "w")
        shared = env.create_shared_allocator(device, ephost.DeviceMemoryType.HOST_ACCESSIBLE)
        x = np.arange(16, dtype=np.float32) - 8
        with InferenceSession(models.chain(["Neg"], shape=(16,)), options_for(env, "w"), env=env) as s:
            for k in range(3):
                (y,) = s.run(None, {"x": ephost.Tensor.from_numpy(x * k, shared)})
                np.testing.assert_array_equal(y, -x * k)
            before = ephost.Tensor.from_numpy(x * 3, shared)
            killed_while_replaced(env, "w")
            (y,) = s.run(None, {"x": before})
            np.testing.assert_array_equal(y, -x * 3)
            for k in range(4, 7):  # tensors of the successor's, named by handle
                (y,) = s.run(None, {"x": ephost.Tensor.from_numpy(x * k, shared)})
                np.testing.assert_array_equal(y, -x * k)
            assert worker_stats(env, "w").kept_calls == 2  # the successor's 5th and 6th runs, repeated
