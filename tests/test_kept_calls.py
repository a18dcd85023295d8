"""Kept calls: a Compute or a CopyTensors the worker keeps for the connection that made it, then repeated with
nothing but what changes (its inputs' dimensions and bytes, the handles of the buffers it names), on the wire and
through sessions: how many a connection keeps and how it makes room, large inputs through staging buffers and
KEPT_WRITING, outputs into buffers or left in the worker, copies; over real workers, sockets and shared memory.
gRPC keeps nothing."""
from __future__ import annotations

import os
import signal
import struct
import threading
import time

import numpy as np
import pytest
from onnx import helper

import ephost
from ephost import InferenceSession, lane_slots
from ephost.fastlane import (KEPT, KEPT_ID, KEPT_WRITING, MAX_KEPT, METHODS, PLACED, FrameReader,
                             decode_error, put_parts, send_frame)
from ephost.v1 import allocator_pb2, common_pb2, data_transfer_pb2, ep_pb2, factory_pb2
import models
from helpers import RawClient, in_threads, killed_while_replaced, options_for, worker_stats
from lane_helpers import (X, assert_serves_on, diamond_session, dims, doorbell_taken, fastlane_error, host_allocator_of,
                          kept_frame, kept_partition, lane_call, open_lane, open_slots, sole_client_stats)
from lane_helpers import lane_worker, ort_env  # noqa: F401 (fixtures)



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


def test_a_call_kept_whatever_its_shapes_tells_an_input_sent_inline_from_one_staged(ort_env):
    """Shapes that change every run make a call kept whatever its shapes (keep_shapes: kept by the inputs'
    ranks). An input too large to go inline (staged in a buffer, named by handle) is another call than the same
    input small (its bytes in the frame): each repeats its own, and every run gives ORT's answer (a repeat
    sending bytes where the worker kept a handle was refused: 'a kept call takes 840016 bytes ..., got 24')."""
    from ephost.client.transfer import INLINE_LIMIT
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
        assert_serves_on(sock, allocator_pb2.AllocRequest(allocator=host_allocator_of(raw), nbytes=64), lane_worker)
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
        assert_serves_on(sock, allocator_pb2.AllocRequest(allocator=host_allocator_of(raw), nbytes=64), lane_worker)
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


def buffer_partition(raw: RawClient):
    """kept_partition's, its input in a buffer of a host allocator (holding [-1, 2, -3, 4]) instead of inline:
    (ep, partition, request, allocator, buffer, write(values) into the buffer)."""
    ep, partition, request = kept_partition(raw)
    allocator = host_allocator_of(raw)
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
            """A connection with slots, its reader, the payload of a KEPT frame of the call kept there, and the
            test's own mapping of the slots."""
            sock, slots, raw_map = open_slots(raw)
            reader = FrameReader(sock, adopt=lambda region, size, fd: os.close(fd), slots=slots)
            send_frame(sock, METHODS["Ep/Compute"].id, 0, 10.0, request.SerializeToString(), slots)
            frame = reader.read()
            assert frame.status == 0, fastlane_error(frame)
            kid = ep_pb2.ComputeResponse.FromString(frame.payload).kept_call
            return sock, slots, reader, KEPT_ID.pack(kid) + dims(4, buffer), raw_map

        def writing(timeout: float = 10.0, data: bytes | None = None) -> None:
            data = payload if data is None else data
            assert put_parts(slots, KEPT_WRITING, timeout, [data], len(data))

        def worker_asleep() -> bool:
            """Whether the worker says it sleeps on the request slot (its `asleep` word)."""
            return struct.unpack_from("<Q", raw_map, lane_slots.ASLEEP * 8)[0] != 0

        sock, slots, reader, payload, raw_map = connect()
        writing()
        assert doorbell_taken(sock), "the worker waits for the inputs (a stray doorbell meanwhile changes nothing)"
        assert not slots.arrived(), "the worker answered before the inputs were written"
        write([5, -6, 7, -8])
        assert doorbell_taken(sock), "the worker still waits"
        assert not slots.arrived(), "the worker answered on the inputs alone, before the caller said they were written"
        slots.inputs_written()
        frame = reader.read()
        assert (frame.method, frame.status, frame.slot) == (KEPT, 0, True), fastlane_error(frame)
        np.testing.assert_array_equal(np.frombuffer(frame.payload, np.float32, offset=8), [5, 0, 7, 0])

        writing(timeout=1e308)  # a deadline centuries away: the worker sleeps as long as it takes
        assert doorbell_taken(sock), "the worker waits for the inputs"
        deadline = time.monotonic() + 10
        while not worker_asleep():  # past its polling, asleep until they are written
            assert time.monotonic() < deadline, "the worker never slept waiting for the inputs"
            time.sleep(0.001)
        assert doorbell_taken(sock) and not slots.arrived(), "woken in its sleep, the worker sleeps on"
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

        sock, slots, reader, payload, raw_map = connect()
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
    (KEPT_WRITING), then tells the worker, which waits for it (the wire test above shows that wait): the write is
    done while the worker reads the call, and every result is of its own run's input. With the lane's frames on
    its socket, and over gRPC, the input is written before the call. What each run does is told by wrappers
    around the lane's frames, the stager's write and the word that tells the worker."""
    from ephost.client import fastlane as client_lane
    from ephost.client.transfer import Stager
    from ephost.lane_slots import Slots
    rng = np.random.default_rng(9)
    put, send, write, written = client_lane.put_parts, client_lane.send_parts, Stager.write, Slots.inputs_written
    done = []  # what the runs did, in order

    def putting(slots, method, *args):
        went = put(slots, method, *args)
        if went and method == KEPT_WRITING:
            done.append("call sent, its input to follow")
        return went

    def sending(sock, method, *args, **kw):
        if method == KEPT:
            done.append("call sent")
        return send(sock, method, *args, **kw)

    def writing(self, buffer, data):
        done.append("input written")
        write(self, buffer, data)

    def telling(self):
        done.append("worker told")
        written(self)

    ort_env.register_execution_provider_library("ort_socket", "onnxruntime", {"intra_op_num_threads": "1",
                                                                              "fast_lane_slots": "false"})
    try:
        for registration, run in (("ort", ["call sent, its input to follow", "input written", "worker told"]),
                                  ("ort_socket", ["input written", "call sent"]),
                                  ("ort_grpc", ["input written"])):  # (then the call, over gRPC)
            with InferenceSession(staged_model(), options_for(ort_env, registration), env=ort_env) as s:
                for _ in range(2):
                    staged_run(s, rng)
                before = worker_stats(ort_env, registration).methods["Ep/Compute"]
                done.clear()
                with monkeypatch.context() as patch:
                    patch.setattr(client_lane, "put_parts", putting)
                    patch.setattr(client_lane, "send_parts", sending)
                    patch.setattr(Stager, "write", writing)
                    patch.setattr(Slots, "inputs_written", telling)
                    for _ in range(3):
                        staged_run(s, rng)
                after = worker_stats(ort_env, registration).methods["Ep/Compute"]
            assert after.calls - before.calls == 3
            assert done == 3 * run, (registration, done)
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
        allocator = host_allocator_of(raw)
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


@pytest.mark.parametrize("why", ["keep", "too large to go inline"])
def test_kept_calls_leaving_outputs_in_the_worker_on_the_wire(lane_worker, why):
    """A kept call whose output the worker leaves in a new buffer of the call's allocator (`keep`, an
    IOBinding's output bound to a device; or an output over the call's inline limit, as a run's large output
    is): each KEPT reply is a PLACED record naming a new buffer (a handle of the client's, where it lies in a
    region the connection was handed) holding that run's result."""
    raw = RawClient(lane_worker.address)
    try:
        _, _, request = kept_partition(raw)
        allocator = host_allocator_of(raw)
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
        allocator = host_allocator_of(raw)
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
