"""The fast lane's wire: frames over a unix SOCK_SEQPACKET socket per calling thread and through shared slots,
the ticket that binds a connection to its client, bad frames, the reader that polls before it sleeps and the
early wake that ends its sleep, regions handed over with replies, connections across a fork, and how long each
end spins; over real workers, sockets and shared memory."""
from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time

import numpy as np
import pytest

import ephost
from ephost import InferenceSession, fastlane, lane_slots
from ephost.fastlane import DOORBELL, HEADER, MAGIC, MAX_LENGTH, METHODS, FrameReader, send_frame
from ephost.v1 import allocator_pb2, ep_pb2, factory_pb2
import models
from helpers import MovedClock, RawClient, options_for, worker_stats
from lane_helpers import (X, LaneWaits, assert_serves_on, diamond_session, fastlane_error, host_allocator_of,
                          kept_partition, lane_call, lane_of, open_lane, open_slots, running)
from lane_helpers import lane_worker, ort_env  # noqa: F401 (fixtures)


class _StatsClock:
    """WorkerStats' clock (server/stats.py's `time`): a sleep takes no time but moves it on, and runs what the test
    says happens meanwhile (`meanwhile`, once)."""

    def __init__(self):
        self.now = self.slept = 0.0
        self.meanwhile = None

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        if self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()
        self.slept += seconds
        self.now += seconds
        assert self.slept < 60, "settle never gave up"


def test_stats_asked_for_after_a_reply_count_the_call_the_lane_answered_before_counting_it(monkeypatch):
    """A lane call is answered first and counted right after (counting first held every reply back). What a
    caller has an answer to must still be in the figures it asks for next: GetStats settles first, waiting for
    every call answered before it, and only for those (a thread that never counts is waited for up to the
    bound, on settle's clock, and one answering later is not waited for)."""
    from ephost.server import stats as worker_stats_module
    clock = _StatsClock()
    monkeypatch.setattr(worker_stats_module, "time", clock)
    stats = worker_stats_module.WorkerStats()
    answered, counting = threading.Event(), threading.Event()

    def lane_thread():  # as Dispatcher.dispatch does on the lane: answer, then count
        tally = stats.answering()
        tally.answered += 1
        answered.set()
        counting.wait()
        stats.record_call("Ep/Compute", 1e-5, "", lane=True, counts={"kept_calls": 1})
        tally.counted += 1

    thread = threading.Thread(target=lane_thread)
    thread.start()
    answered.wait()
    late = stats.answering()

    def while_settle_waits():  # the thread counts its call; this one answers one of its own, after settle began
        late.answered += 1
        counting.set()
        thread.join()

    clock.meanwhile = while_settle_waits
    try:
        assert stats.settle(), "the call answered before it counted; the one answered later not waited for"
        assert clock.slept > 0, "settle waited for the call answered before it"
    finally:
        counting.set()  # (whatever settle did, the thread ends)
        thread.join()
    figures = stats.to_proto()
    assert figures.methods["Ep/Compute"].calls == 1 and figures.fast_lane_calls == 1 and figures.kept_calls == 1

    clock.slept = 0.0  # `late`, answered and never counted: settle gives up at its bound
    assert not stats.settle(timeout=0.2)
    assert 0.2 <= clock.slept < 0.21, "settle waited out its bound, then gave up"
    late.counted += 1
    clock.slept = 0.0
    assert stats.settle(timeout=5) and clock.slept == 0.0, "every call answered is counted: no wait"


def test_a_ticket_binds_one_connection_to_its_client_once(lane_worker):
    a, b = RawClient(lane_worker.address, "a"), RawClient(lane_worker.address, "b")
    try:
        sock_a, ticket = open_lane(a)
        assert sock_a.recv(2) == b"OK"
        allocator = host_allocator_of(a)
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
        allocator = host_allocator_of(raw)
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
        allocator = host_allocator_of(raw)
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
        assert_serves_on(sock, allocator_pb2.AllocRequest(allocator=host_allocator_of(raw), nbytes=64), lane_worker)
    finally:
        raw.close()


def test_large_tensors_cross_in_several_packets(ort_env):
    """Inline tensors up to the inline limit (512 KiB) travel in frames longer than one packet."""
    x = np.random.default_rng(1).standard_normal((256, 500)).astype(np.float32)  # 500 KB, inline
    before = worker_stats(ort_env, "ort").fast_lane_calls
    with InferenceSession(models.diamond(x.shape), options_for(ort_env, "ort"), env=ort_env) as s:
        np.testing.assert_allclose(s.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
    assert worker_stats(ort_env, "ort").fast_lane_calls > before


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
def test_a_reader_after_a_long_wait_still_answers_early_late_and_on_its_deadline(descriptor, slots, monkeypatch):
    """After a long wait the reader sleeps through the next one until its frame comes, polling for none of it: a
    frame that comes much sooner or later is read as it comes (through a slot: the doorbell ends the sleep, not
    its bound), and the socket's timeout (a call's deadline) counts from the start of the read (the reader
    sleeps for what is left of it, then raises). Also on a descriptor above 1023, which select cannot take (an
    application with many files open), and with frames through a slot (a sleeping reader woken by the
    doorbell). How long each frame is waited for is told by the reader's clock, which the peer moves on."""
    clock = MovedClock("perf_counter")
    monkeypatch.setattr(fastlane, "time", clock)
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
    # What each read does: its polls, and its sleeps (the longest each may last, and whether the socket ended it:
    # a frame there, or the doorbell rung for one in the slot); `waiting` is set as the reader waits for a frame.
    polls, sleeps, waiting = [], [], threading.Event()
    poll_lasts = [0.0]  # how long a poll lasts, on the reader's clock
    spin, readable, receive = reader._spin, reader._readable, reader._receive

    def polling(until: float) -> None:
        polls.append(until)
        clock.ahead += poll_lasts[0]
        spin(until)

    def sleeping(timeout: float) -> bool:
        waiting.set()
        woken = readable(min(timeout, 30.0))  # (a sleep with no end would hang the test)
        sleeps.append((timeout, woken))
        return woken

    def receiving() -> int:
        waiting.set()
        return receive()

    reader._spin, reader._readable, reader._receive = polling, sleeping, receiving

    def read_after(gap: float) -> None:
        """Read a frame sent `gap` into the read (on the reader's clock), once the reader waits for it."""
        polls.clear()
        sleeps.clear()
        waiting.clear()

        def send():
            assert waiting.wait(10), "the reader never waited for the frame"
            clock.ahead += gap
            send_frame(a, compute, 0, 0.0, b"%g" % gap, writer)

        thread = threading.Thread(target=send)
        thread.start()
        try:
            frame = reader.read()
        finally:
            thread.join()
        assert bytes(frame.payload) == b"%g" % gap

    try:
        read_after(0.4)  # a long wait: the next read sleeps
        for gap in (0.02, 0.4, 0.6):  # sooner, as long, later
            read_after(gap)
            assert polls == [], f"after a long wait, no poll for the next frame ({gap} s)"
            if slots:
                assert sleeps and sleeps[-1][1], f"the doorbell ended the sleep, not its bound ({gap} s): {sleeps}"
        b.settimeout(0.1)
        polls.clear()
        sleeps.clear()
        with pytest.raises(TimeoutError):
            reader.read()  # its first sleep bounded at twice the last wait (1.2 s), and by the deadline
        assert polls == []
        if slots:  # (on the socket alone, the socket's own timeout bounds the read)
            slept = sum(timeout for timeout, _ in sleeps)
            assert sleeps and not any(woken for _, woken in sleeps), sleeps
            assert slept <= 0.1, f"slept for {slept} s, past the deadline of 0.1 s"
            # A read that polls first (for 0.05 s, on its clock) sleeps for the rest of its deadline only.
            send_frame(a, compute, 0, 0.0, b"there", writer)
            assert bytes(reader.read().payload) == b"there"  # there at once: the next read polls first
            polls.clear()
            sleeps.clear()
            poll_lasts[0] = 0.05
            with pytest.raises(TimeoutError):
                reader.read()
            slept = sum(timeout for timeout, _ in sleeps)
            assert polls and sleeps and not any(woken for _, woken in sleeps), (polls, sleeps)
            assert slept <= 0.05, f"the deadline counts from the start of the read: slept for {slept} s after the poll"
    finally:
        a.close()
        b.close()


def test_a_reader_keeps_how_long_each_call_waits_apart(monkeypatch):
    """One connection carries every partition of a session on its worker: a call whose reply comes soon is
    polled for even right after a long wait for another call (the reader does not sleep for it), and the long
    one is slept for from the start of its read, not polled for (polling for the end of a long call took a CPU
    from the worker's threads, a CNN's run 1.5-3.5% longer). The long call lasts half a second on the reader's
    clock, which the test moves on."""
    clock = MovedClock("perf_counter")
    monkeypatch.setattr(fastlane, "time", clock)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd, mapping = lane_slots.create()
    writer = lane_slots.Slots(mapping, a, worker=True)
    reader = FrameReader(b, spin_s=0.1, expect=True, slots=lane_slots.Slots(lane_slots.adopt(fd), b, worker=False))
    compute = METHODS["Ep/Compute"].id
    spin, doze = reader._spin, reader._doze

    def read(key: str) -> tuple[bytes, bool, bool]:
        """Read the reply to `key`: a short call's is there as the reader begins to poll for it, a long one's half
        a second after the reader begins to sleep. Whether the reader polled for it, and whether it slept."""
        polled, slept, sent = [], [], []

        def reply(after: float) -> None:
            if not sent:
                sent.append(key)
                clock.ahead += after
                send_frame(a, compute, 0, 0.0, key.encode(), writer)

        def polling(until: float) -> None:
            polled.append(until)
            if key == "short":
                reply(0.0)
            spin(until)

        def sleeping(*args, **kw) -> bool:
            slept.append(args)
            reply(0.5 if key == "long" else 0.0)
            return doze(*args, **kw)

        reader._spin, reader._doze = polling, sleeping
        return bytes(reader.read(key).payload), bool(polled), bool(slept)

    try:
        assert read("long") == (b"long", True, True)  # no wait known for it yet: polled for, then slept for
        assert read("short") == (b"short", True, False)
        for _ in range(3):
            assert read("long") == (b"long", False, True), "slept for from the start, right after a short call"
            assert read("short") == (b"short", True, False), "polled for, right after a long call"
    finally:
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
                        call = ComputeCall([ephost.Tensor.from_numpy(array)], on_kernel_ran=early.wake)
                        (out,) = info.compute(call)
                        if asleep:
                            assert os.eventfd_read(mine.wake) == 1, (shape, k)  # written inside compute
                        assert early.wake() is asleep  # the handler's ask as compute returns: no second write
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


def test_a_handed_over_region_that_cannot_be_mapped_has_its_descriptor_closed_once(env, monkeypatch):
    """A region's descriptor the worker hands over with a reply is the mapping's to close, mapped or not: one
    that cannot be mapped (here, not sealed against shrinking) is closed once, not a second time after, when its
    number may be another's (here: a new eventfd takes it the moment it is closed)."""
    conn = env.registration("ref").link.conn
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    close, closes, other = os.close, [], []

    def close_and_reuse(number):
        close(number)
        if number == fd:
            closes.append(number)
            if not other:
                other.append(os.eventfd(0, os.EFD_CLOEXEC))  # the lowest free number: fd's

    with monkeypatch.context() as patch:
        patch.setattr(os, "close", close_and_reuse)
        conn.adopt_region(2 ** 40, 4096, fd)
    try:
        assert closes == [fd], "the mapping was expected to fail and to close the descriptor once"
        os.fstat(other[0])  # still open: nothing closed fd's number again
    finally:
        for number in other:
            with contextlib.suppress(OSError):
                os.close(number)


def test_a_connection_closed_from_two_threads_at_once_closes_its_descriptors_once():
    """A lane connection is closed by its thread's end (its finalizer) and by FastLane.close, which can meet: the
    lane's set still names a connection while its finalizer runs on another thread. The second close returns at
    once and closes nothing again, as the descriptors' numbers may be another's by then (here: a new eventfd takes
    the number of one the first close closed, while that close is still closing the slots)."""
    from ephost.client.fastlane import _Connection
    closing, resume = threading.Event(), threading.Event()
    closes = []

    class Watched(lane_slots.Slots):
        """The slots, each close counted, the first held until the test resumes it."""
        __slots__ = ()

        def close(self):
            closes.append(threading.current_thread())
            if len(closes) == 1:
                closing.set()
                resume.wait(10)
            super().close()

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd, mapping = lane_slots.create()
    conn = _Connection(b, None, 0.0, Watched(lane_slots.adopt(fd), b, worker=False,
                                             wake=os.eventfd(0, os.EFD_CLOEXEC)))
    first = threading.Thread(target=conn.close)
    first.start()
    other = None
    try:
        assert closing.wait(10)
        other = os.eventfd(0, os.EFD_CLOEXEC)  # the lowest free number: one the first close closed
        second = threading.Thread(target=conn.close)  # the lane's close, meanwhile
        second.start()
        second.join(10)
        assert not second.is_alive(), "the second close waited for the first"
        assert len(closes) == 1, "the second close closed the slots again"
        os.fstat(other)  # still open: the second close closed nothing
    finally:
        resume.set()
        first.join(10)
        if other is not None:
            with contextlib.suppress(OSError):
                os.close(other)
        mapping.close()
        a.close()
    assert closes == [first], "the first close closed the slots, once"


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
def test_a_fork_while_another_thread_waits_in_a_lane_call_leaves_that_call_to_finish(monkeypatch):
    """The child lets go of its copies of the parent's connections without touching the parent's: the socket
    is shared, and a call under way on another thread of the parent (its copy says so) must not be ended."""
    with ephost.Environment() as env:
        # The 2nd compute touches 512 MiB first: a call that is surely under way when the process forks.
        env.register_execution_provider_library("chaos", "chaos", {"fault": "leak", "leak_mb": "512", "after": "2"})
        with diamond_session(env, "chaos") as s:
            np.testing.assert_array_equal(s.run(None, {"x": X})[0], models.diamond_expected(X))
            waits = LaneWaits(monkeypatch)
            t, outcome = running(s)
            assert waits.wait_for(t), "the thread's call is under way: its frame sent, its reply awaited"
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
