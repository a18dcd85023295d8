"""What the fast lane's tests share (test_lane_frames.py, test_kept_calls.py, test_lane_sessions.py): their
workers, a session on the diamond model, and a raw client's view of the wire (a lane connection opened by hand, its
frames, its slots). A test module takes the fixtures by importing them."""
from __future__ import annotations

import fcntl
import mmap
import os
import socket
import struct
import termios
import threading
import time

import numpy as np
import pytest

import ephost
from ephost import InferenceSession, lane_slots
from ephost.fastlane import DOORBELL, KEPT, METHODS, FrameReader, decode_error, send_frame
from ephost.v1 import allocator_pb2, common_pb2, ep_pb2, factory_pb2
import models
from helpers import RawClient, Worker, options_for

SHAPE = (4, 4)
X = np.arange(16, dtype=np.float32).reshape(SHAPE)


# --- sessions over the lane -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ort_env():
    """The onnxruntime EP twice: "ort" over the fast lane, "ort_grpc" over gRPC alone."""
    with ephost.Environment() as env:
        env.register_execution_provider_library("ort", "onnxruntime", {"intra_op_num_threads": "1"})
        env.register_execution_provider_library("ort_grpc", "onnxruntime", {"intra_op_num_threads": "1",
                                                                            "fast_lane": "false"})
        yield env


def lane_of(env, registration: str):
    return env.registration(registration).link.current.lane


def diamond_session(env, registration, policy="raise", timeout=None):
    options = options_for(env, registration)
    options.ep_failure_policy = policy
    options.compute_timeout_s = timeout
    return InferenceSession(models.diamond(SHAPE), options, env=env)


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


class LaneWaits:
    """Which threads wait for a fast-lane reply now (their call's frame sent), and how each one's last wait ended
    ("frame", "end of file", or what it raised), told by a wrapper around FrameReader.read (in place until the
    test ends)."""

    def __init__(self, monkeypatch):
        self._cond = threading.Condition()  # guards _waiting and ended
        self._waiting: set[threading.Thread] = set()
        self.ended: dict[threading.Thread, str] = {}
        read = FrameReader.read

        def read_and_tell(reader, key=None):
            me = threading.current_thread()
            with self._cond:
                self._waiting.add(me)
                self._cond.notify_all()
            try:
                frame = read(reader, key)
                end = "end of file" if frame is None else "frame"
                return frame
            except BaseException as e:
                end = type(e).__name__
                raise
            finally:
                with self._cond:
                    self._waiting.discard(me)
                    self.ended[me] = end
                    self._cond.notify_all()

        monkeypatch.setattr(FrameReader, "read", read_and_tell)

    def wait_for(self, thread: threading.Thread, timeout: float = 10.0) -> bool:
        """Whether `thread` comes to wait for a fast-lane reply within `timeout`."""
        with self._cond:
            return self._cond.wait_for(lambda: thread in self._waiting, timeout)

    def wait_ended(self, thread: threading.Thread, timeout: float = 10.0) -> bool:
        """Whether `thread`, waiting for a fast-lane reply, is done waiting within `timeout`."""
        with self._cond:
            return self._cond.wait_for(lambda: thread not in self._waiting, timeout)


# --- the wire, spoken by hand -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lane_worker():
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


def lane_call(sock, name, request, timeout=10.0):
    method = METHODS[name]
    send_frame(sock, method.id, 0, timeout, request.SerializeToString())
    frame = FrameReader(sock, adopt=lambda region, size, fd: os.close(fd)).read()  # regions: not mapped here
    return frame, (method.reply.FromString(frame.payload) if frame and frame.status == 0 else None)


def kept_frame(sock, payload: bytes, timeout: float = 10.0):
    send_frame(sock, KEPT, 0, timeout, payload)
    return FrameReader(sock).read()


def dims(*values: int) -> bytes:
    """Dimensions as a KEPT frame and its reply carry them."""
    return struct.pack(f"<{len(values)}Q", *values)


def fastlane_error(frame) -> str:
    return decode_error(frame.payload)[0]


def host_allocator_of(raw: RawClient) -> int:
    return raw(raw.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest(
        device_mem_type=common_pb2.DEVICE_MEMORY_TYPE_HOST_ACCESSIBLE)).allocator


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


def assert_serves_on(sock: socket.socket, alloc: allocator_pb2.AllocRequest, worker) -> None:
    """After whatever came before on it, the connection still answers a good Alloc; then it is closed, and the
    worker is still running."""
    frame, reply = lane_call(sock, "Allocator/Alloc", alloc)
    assert frame.status == 0 and reply.buffer
    sock.close()
    assert worker.proc.poll() is None


def unread(sock) -> int:
    """Bytes sent on `sock` that its peer has not read yet."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def doorbell_taken(sock, timeout: float = 10.0) -> bool:
    """Ring the doorbell on a connection whose last frame went through its slot: whether the worker takes it
    within `timeout`. A worker reads a frame from its slot before any doorbell rung after the frame was put: it
    takes this one once it has the frame, waiting for that frame's inputs (or, done with it, for its next
    frame)."""
    sock.send(DOORBELL)
    deadline = time.monotonic() + timeout
    while unread(sock):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True
