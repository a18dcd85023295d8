"""A seeded, bounded fuzz of every RPC of every service, enumerated from the proto descriptors (a new RPC is
fuzzed without anyone adding it here). Requests are random messages built from each method's descriptor (with
handles biased towards ones that exist, sizes and offsets towards edges, and hostile models and tensors among
the bytes), mutated valid messages, and bytes that are no message at all; they are sent as the owning client,
as another client, with a forged client id and with none. The fast lane's methods are fuzzed again as frames on
its SOCK_SEQPACKET connections: the same messages, with hostile headers (unknown method ids, the descriptor
hand-over's id, odd statuses and timeouts), descriptors attached, and broken framing (short headers, wrong
magic, lengths that lie, packets too long).

What fails the test: the worker dying, a call hanging past its deadline, an INTERNAL or UNKNOWN status (bad
input must get a status that says what is wrong), a descriptor or memfd mapping left in the worker after the
clients leave, and its RSS climbing under this bounded load.

`make test` runs a short budget; `make fuzz` runs a long one (EPHOST_FUZZ_EXAMPLES, EPHOST_FUZZ_SEED).
"""
from __future__ import annotations

import os
import random
import socket
import struct
import time

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor as D
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import ephost
from ephost import fastlane, fdshare, lane_slots, wire
from ephost.server import fastlane as lane_server
from ephost.server.contract import SERVICES
from ephost.v1 import allocator_pb2, common_pb2, data_transfer_pb2, ep_pb2, factory_pb2, worker_pb2

from helpers import RawClient, Worker
from lane_helpers import doorbell_taken

EXAMPLES = int(os.environ.get("EPHOST_FUZZ_EXAMPLES", "25"))  # per method
SEED = int(os.environ.get("EPHOST_FUZZ_SEED", "15"))
DEADLINE_S = 10.0
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
METHODS = [(s.name, m) for s in SERVICES.values() for m in s.methods]

# --- hostile payloads ---------------------------------------------------------------------------------


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _external_tensor(name="w", location="secret.txt") -> TensorProto:
    t = numpy_helper.from_array(np.zeros(4, np.float32), name)
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    t.external_data.add(key="location", value=location)
    return t


X = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
Y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
RELU = _model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [X], [Y])
EXTERNAL_CONSTANT = _model([helper.make_node("Constant", [], ["c"], name="c", value=_external_tensor()),
                            helper.make_node("Add", ["x", "c"], ["y"], name="add")], [X], [Y])
EXTERNAL_INITIALIZER = _model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], [X], [Y],
                              [_external_tensor("w", "./sub/../secret.txt")])
BLOBS = [b"", b"\xff" * 8, RELU.SerializeToString(), EXTERNAL_CONSTANT.SerializeToString(),
         EXTERNAL_INITIALIZER.SerializeToString(), _external_tensor().SerializeToString(),
         np.arange(4, dtype=np.float32).tobytes()]
STRINGS = ["", "x", "y", "relu", "reference", "Cpu", "arena.max_mem", "arena.initial_chunk_size_bytes",
           "../../etc/passwd", "00" * 32, "\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace")]
EDGES = [0, 1, 2, 3, 4, 7, 8, 16, 63, 64, 65, 4096, 2 ** 31 - 1, 2 ** 32, 2 ** 42, 2 ** 62, 2 ** 63 - 1,
         -1, -16, -2 ** 31, -2 ** 63]
RANGES = {D.FieldDescriptor.TYPE_INT32: (-2 ** 31, 2 ** 31 - 1),
          D.FieldDescriptor.TYPE_INT64: (-2 ** 63, 2 ** 63 - 1),
          D.FieldDescriptor.TYPE_UINT32: (0, 2 ** 32 - 1),
          D.FieldDescriptor.TYPE_UINT64: (0, 2 ** 64 - 1),
          D.FieldDescriptor.TYPE_SINT32: (-2 ** 31, 2 ** 31 - 1),
          D.FieldDescriptor.TYPE_SINT64: (-2 ** 63, 2 ** 63 - 1)}


# Field name -> the kind of handle it names, so that most requests reach past the handle lookup.
KIND_OF_FIELD = {"ep": "ep", "node_compute_info": "compute_info", "node_compute_infos": "compute_info",
                 "allocator": "allocator", "output_allocator": "allocator", "buffer": "buffer", "region": "region",
                 "stream": "stream", "notification": "notification", "data_transfer": "data_transfer"}


def _scalar(field: D.FieldDescriptor, handles: dict[str, list[int]]) -> st.SearchStrategy:
    T = D.FieldDescriptor
    if field.type in RANGES:
        lo, hi = RANGES[field.type]
        edges = [v for v in EDGES if lo <= v <= hi]
        kind = KIND_OF_FIELD.get(field.name)
        aimed = handles[kind] if kind else [h for hs in handles.values() for h in hs]
        real = st.sampled_from([h for h in aimed if lo <= h <= hi] or [0])  # handles and regions that exist
        return st.one_of(real, real, st.sampled_from(edges), st.integers(lo, hi))
    if field.type == T.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]),
                         st.sampled_from([-1, 3, 7, 2 ** 31 - 1]))
    if field.type == T.TYPE_BOOL:
        return st.booleans()
    if field.type in (T.TYPE_DOUBLE, T.TYPE_FLOAT):
        return st.one_of(st.sampled_from([0.0, 0.001, 1.0, 1e308, float("inf"), float("nan"), -1.0]), st.floats())
    if field.type == T.TYPE_STRING:
        return st.one_of(st.sampled_from(STRINGS), st.text(max_size=16))
    if field.type == T.TYPE_BYTES:
        return st.one_of(st.sampled_from(BLOBS), st.binary(max_size=64))
    raise AssertionError(f"no strategy for field type {field.type}")


def message_strategy(desc: D.Descriptor, handles: dict[str, list[int]], depth: int = 0) -> st.SearchStrategy:
    cls = message_factory.GetMessageClass(desc)
    if depth > 3:
        return st.just(cls())
    fields = {}
    for field in desc.fields:
        if field.type == D.FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            key = _scalar(field.message_type.fields_by_name["key"], handles)
            value_field = field.message_type.fields_by_name["value"]
            value = (message_strategy(value_field.message_type, handles, depth + 1)
                     if value_field.type == D.FieldDescriptor.TYPE_MESSAGE else _scalar(value_field, handles))
            fields[field.name] = st.dictionaries(key, value, max_size=3)
            continue
        one = (message_strategy(field.message_type, handles, depth + 1)
               if field.type == D.FieldDescriptor.TYPE_MESSAGE else _scalar(field, handles))
        fields[field.name] = st.lists(one, max_size=3) if field.is_repeated else one
    return st.fixed_dictionaries({}, optional=fields).map(lambda values: _build(cls, values))


def _build(cls, values):
    message = cls()
    for name, value in values.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        target = getattr(message, name)
        if field.type == D.FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            for k, v in value.items():
                if isinstance(v, (int, float, str, bytes, bool)):
                    target[k] = v
                else:
                    target[k].CopyFrom(v)
        elif field.is_repeated:
            if field.type == D.FieldDescriptor.TYPE_MESSAGE:
                for v in value:
                    target.add().CopyFrom(v)
            else:
                target.extend(value)
        elif field.type == D.FieldDescriptor.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


def _mutate(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(3)
        if choice == 0 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice == 1 and data:
            del data[rng.randrange(len(data)):]
        else:
            data[rng.randrange(len(data) + 1):0] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    return bytes(data)


# --- the worker and its clients -----------------------------------------------------------------------

def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _memfd_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("memfd:" in line for line in f)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _populate(client: RawClient) -> dict[str, list[int]]:
    """Something behind the handles: an EP, compiled partitions, allocators, buffers, streams. Returns the
    handles and region ids made, by kind, for the fuzz to aim at."""
    made = {kind: [] for kind in set(KIND_OF_FIELD.values())}
    ep = client(client.factory.CreateEp, factory_pb2.CreateEpRequest(device_indices=[0])).id
    made["ep"].append(ep)
    made["compute_info"] += client(client.ep.Compile, ep_pb2.CompileRequest(
        ep=ep, model=ep_pb2.ModelRef(model=RELU.SerializeToString()),
        graphs=[ep_pb2.FusedGraph(name="p", nodes=["relu"], inputs=["x"], outputs=["y"])])).node_compute_infos
    for mem_type in (common_pb2.DEVICE_MEMORY_TYPE_HOST_ACCESSIBLE, common_pb2.DEVICE_MEMORY_TYPE_DEFAULT):
        allocator = client(client.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest(
            device_mem_type=mem_type, options={"arena.initial_chunk_size_bytes": str(1 << 20)})).allocator
        made["allocator"].append(allocator)
        for nbytes in (16, 64):
            reply = client(client.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=nbytes))
            made["buffer"].append(reply.buffer)
            if reply.HasField("shm"):
                made["region"].append(reply.shm.region)
    stream = client(client.factory.CreateSyncStreamForDevice, factory_pb2.CreateSyncStreamRequest()).id
    made["stream"].append(stream)
    made["notification"].append(client(client.stream.CreateNotification, common_pb2.Handle(id=stream)).id)
    made["data_transfer"].append(client(client.factory.CreateDataTransfer, common_pb2.Empty()).data_transfer)
    return made


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    # Not launched by this client (no --exit-with-parent): Shutdown is refused, as on a shared worker, which copies
    # the files it is handed into its cache; a reply nobody reads holds its connection 2 s.
    w = Worker("--ep", "reference", "--max-alloc-mb", "64", "--cache-dir", str(tmp_path_factory.mktemp("cache")),
               "--send-timeout-s", "2", exit_with_parent=False)
    try:
        warm = RawClient(w.address, "warm-up")
        _populate(warm)
        warm(warm.worker.Goodbye, common_pb2.Empty())
        warm.close()
        pid = w.proc.pid
        baseline = (_fds(pid), _memfd_maps(pid), _rss_kib(pid))
        yield w, baseline
    finally:
        w.stop()


def _log_tail(w: Worker, lines: int = 15) -> str:
    with open(w.log_path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def _call(channel, service: str, method: D.MethodDescriptor, payloads: list[bytes], metadata):
    path = f"/{wire.PROTOCOL}.{service}/{method.name}"
    kw = dict(timeout=DEADLINE_S, metadata=metadata)
    if method.client_streaming:
        return channel.stream_unary(path)(iter(payloads), **kw)
    if method.server_streaming:
        return list(channel.unary_stream(path)(payloads[0], **kw))
    return channel.unary_unary(path)(payloads[0], **kw)


def _present_ticket(client: RawClient, reply_class, data) -> None:
    """Present (and so use up) the ticket a reply carries, if it carries one: a client holds only so many, and the
    fuzz would otherwise run out of them for its own calls."""
    try:
        ticket = getattr(reply_class.FromString(bytes(data)), "ticket", b"")
    except Exception:
        return
    if ticket:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(DEADLINE_S)
            sock.connect(client.hello.fd_socket)
            sock.sendall(ticket)
            sock.recv(16)


def assert_serving(client: RawClient) -> None:
    health = health_pb2_grpc.HealthStub(client.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S).status == \
        health_pb2.HealthCheckResponse.SERVING


def say_goodbye(*clients: RawClient) -> None:
    for client in clients:
        try:
            client(client.worker.Goodbye, common_pb2.Empty())
        except grpc.RpcError:
            pass  # the fuzz may have said goodbye for it
        client.close()


@pytest.mark.parametrize("service,method", METHODS, ids=[f"{s}/{m.name}" for s, m in METHODS])
def test_every_rpc_survives_hostile_input(fuzzed, service, method):
    w, _ = fuzzed
    owner, other = RawClient(w.address, "owner"), RawClient(w.address, "other")
    handles = _populate(owner)
    for kind, more in _populate(other).items():  # the other client's too: cross-client handles
        handles[kind] = sorted(set(handles[kind] + more))
    as_whom = [owner.metadata, owner.metadata, owner.metadata, other.metadata, ((wire.CLIENT_ID_KEY, "forged"),), ()]
    request = message_strategy(method.input_type, handles)

    @seed(SEED)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(messages=st.lists(request, min_size=1, max_size=3), who=st.sampled_from(range(len(as_whom))),
           mangle=st.sampled_from(["none", "none", "none", "mutate", "garbage"]), rng=st.randoms(use_true_random=False))
    def fuzz(messages, who, mangle, rng):
        payloads = [m.SerializeToString() for m in messages]
        if mangle == "mutate":
            payloads = [_mutate(p, rng) for p in payloads]
        elif mangle == "garbage":
            payloads = [rng.randbytes(rng.randint(1, 32)) for _ in payloads]
        try:
            reply = _call(owner.channel, service, method, payloads, as_whom[who])
            if not method.server_streaming:
                _present_ticket(owner, message_factory.GetMessageClass(method.output_type), reply)
        except grpc.RpcError as e:
            assert e.code() not in BAD, f"{service}/{method.name} answered {e.code().name}: {e.details()}"
            assert "memfd" not in (e.details() or "") and w.dir not in (e.details() or "")
        assert w.proc.poll() is None, f"the worker died during {service}/{method.name}"

    try:
        fuzz()
        assert_serving(owner)
    finally:
        say_goodbye(owner, other)


# --- the fast lane: the same methods as frames on a SOCK_SEQPACKET socket ----------------------------------

LANE_METHODS = list(fastlane.METHODS.values())
# What happens to a frame on its way. Well-formed ones must get one reply on a connection that serves on;
# broken framing may get one INVALID_ARGUMENT, and then the worker closes that connection (never the worker).
WELL_FORMED = ["good", "good", "good", "mutate", "garbage", "unknown_method", "regions_id", "status", "descriptor"]
BROKEN = ["short_header", "magic", "announces_less", "announces_more_then_eof", "oversized_length", "long_packet",
          "slot_words"]
TIMEOUTS = [0.0, 5.0, -1.0, float("nan"), float("inf"), 1e308, 1e-9]


class _Lane:
    """One data-plane connection of a client, reopened after the worker closes it; with `slots`, one that asked
    for shared slots (its well-formed frames go through them; `mapping` is the test's own view of them, for
    writing what a client should not)."""

    def __init__(self, client: RawClient, slots: bool = False):
        self.client, self.sock, self.ask = client, None, slots
        self.slots = self.mapping = self.fd = None

    def open(self) -> socket.socket:
        if self.sock is None:
            reply = self.client(self.client.worker.OpenDataPlane, common_pb2.Empty())
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.sock.connect(reply.socket)  # (blocking: it waits for room in the listening socket's queue)
            self.sock.settimeout(DEADLINE_S)
            self.sock.send(reply.ticket + (lane_slots.ASK if self.ask else b""))
            answer, fds, _, _ = socket.recv_fds(self.sock, 2, 1)
            assert answer == fastlane.TICKET_OK and len(fds) == self.ask
            if fds:
                self.fd = os.dup(fds[0])  # for the tests that hurt it
                self.mapping = lane_slots.adopt(os.dup(fds[0]))
                self.slots = lane_slots.Slots(lane_slots.adopt(fds[0]), self.sock, worker=False)
        return self.sock

    def scribble(self, rng: random.Random) -> None:
        """Words and a frame in the request slot as no client should write them: a frame count that skips, a
        length no packet has, a frame without the magic bytes, or one announcing more than it carries."""
        header, data = fastlane.HEADER, lane_slots.DATA
        kind = rng.choice(["count", "length", "magic", "announces_more"])
        if kind == "magic":
            self.mapping[data:data + header.size] = header.pack(b"??", 1, 0, 1.0, 0)
        elif kind == "announces_more":
            self.mapping[data:data + header.size] = header.pack(fastlane.MAGIC, 1, 0, 1.0, 100)
        words = memoryview(self.mapping).cast("Q")
        try:
            count = words[0]
            words[1] = (rng.choice([0, 3, fastlane.PACKET + 1, 2 ** 32, rng.randrange(2 ** 64)]) if kind == "length"
                        else header.size + (rng.randrange(100) if kind == "announces_more" else 0))
            # (what is drawn may not depend on the count: hypothesis replays draws)
            words[0] = (count + rng.choice([2, 3, 2 ** 40, 2 ** 63])) % 2 ** 64 if kind == "count" else count + 1
            if words[lane_slots.ASLEEP]:  # the worker sleeps: ring, as a writer does
                self.sock.send(fastlane.DOORBELL)
        finally:
            words.release()

    def replies(self) -> list[fastlane.Frame]:
        """Every frame up to the first reply, or to end of file (then the connection is forgotten)."""
        reader = fastlane.FrameReader(self.sock, adopt=lambda region, size, fd: os.close(fd), slots=self.slots)
        try:
            frame = reader.read()
        except socket.timeout:
            raise AssertionError("a fast-lane call hung past its deadline") from None
        if frame is None:
            self.close()
            return []
        return [frame]

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        for mapped in (self.slots, self.mapping):
            if mapped is not None:
                mapped.close()
        if self.fd is not None:
            os.close(self.fd)
        self.slots = self.mapping = self.fd = None


def _send_broken(lane: _Lane, kind: str, method: int, payload: bytes, rng: random.Random) -> None:
    header, sock = fastlane.HEADER, lane.sock
    if kind == "slot_words":
        if lane.slots is not None:
            lane.scribble(rng)
        else:
            sock.send(fastlane.MAGIC)
    elif kind == "short_header":
        sock.send(fastlane.MAGIC + b"\x01")
    elif kind == "magic":
        sock.send(header.pack(b"??", method, 0, 1.0, len(payload)) + payload)
    elif kind == "announces_less":
        sock.send(header.pack(fastlane.MAGIC, method, 0, 1.0, max(0, len(payload) - 1)) + payload + b"!")
    elif kind == "announces_more_then_eof":
        sock.send(header.pack(fastlane.MAGIC, method, 0, 1.0, len(payload) + 100) + payload)
        sock.shutdown(socket.SHUT_WR)
    elif kind == "oversized_length":
        sock.send(header.pack(fastlane.MAGIC, method, 0, 1.0, fastlane.MAX_LENGTH + 1))
    elif kind == "long_packet":
        sock.send(header.pack(fastlane.MAGIC, method, 0, 1.0, fastlane.PACKET + 8) + bytes(fastlane.PACKET))


@pytest.mark.parametrize("method", LANE_METHODS, ids=[m.name for m in LANE_METHODS])
def test_every_fast_lane_method_survives_hostile_frames(fuzzed, method):
    w, _ = fuzzed
    owner, other = RawClient(w.address, "owner"), RawClient(w.address, "other")
    handles = _populate(owner)
    for kind, more in _populate(other).items():
        handles[kind] = sorted(set(handles[kind] + more))
    lanes = [_Lane(owner), _Lane(owner, slots=True), _Lane(other, slots=True)]
    request = message_strategy(method.request.DESCRIPTOR, handles)

    @seed(SEED)
    @settings(max_examples=EXAMPLES * 2, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(message=request, lane=st.sampled_from(range(len(lanes))), how=st.sampled_from(WELL_FORMED + BROKEN),
           timeout_s=st.sampled_from(TIMEOUTS), rng=st.randoms(use_true_random=False))
    def fuzz(message, lane, how, timeout_s, rng):
        payload = message.SerializeToString()
        sock = lanes[lane].open()
        if how in BROKEN:
            _send_broken(lanes[lane], how, method.id, payload, rng)
            frames = lanes[lane].replies()
            assert all(f.status == grpc.StatusCode.INVALID_ARGUMENT.value[0] for f in frames), \
                f"{how}: {[(f.status, bytes(f.payload)) for f in frames]}"
            if frames:  # then end of file: the worker closed this connection
                assert lanes[lane].replies() == [], f"{how}: the connection served on after a broken frame"
            lanes[lane].close()
        else:
            unknown = rng.randrange(len(fastlane.METHODS) + 1, 0xFFFF)  # past the lane's methods (or KEPT)
            method_id = {"unknown_method": unknown, "regions_id": fastlane.REGIONS}.get(how, method.id)
            if how == "mutate":
                payload = _mutate(payload, rng)
            elif how == "garbage":
                payload = rng.randbytes(rng.randint(1, 32))
            if how == "descriptor":  # a descriptor the worker never asked for: the kernel drops it
                with open(os.devnull, "rb") as f:
                    socket.send_fds(sock, [fastlane.HEADER.pack(fastlane.MAGIC, method_id, 0, timeout_s, len(payload))
                                           + payload], [f.fileno()])
            else:
                fastlane.send_frame(sock, method_id, rng.randrange(2 ** 16) if how == "status" else 0,
                                    timeout_s, payload, lanes[lane].slots)
            frames = lanes[lane].replies()
            assert frames, f"{how}: the worker closed a connection after a well-formed frame; its log ends: " \
                f"{_log_tail(w)}"
            codes = {c.value[0]: c for c in grpc.StatusCode}
            code = codes.get(frames[0].status)
            detail = fastlane.decode_error(frames[0].payload)[0] if frames[0].status else ""
            assert code is not None and code not in BAD or (code == grpc.StatusCode.DEADLINE_EXCEEDED and
                                                             timeout_s < 1), \
                f"{method.name} over the fast lane answered {frames[0].status}: {detail}"
            assert "memfd" not in detail and w.dir not in detail
            if code == grpc.StatusCode.OK and frames[0].method == method.id:
                _present_ticket(owner, method.reply, frames[0].payload)
        assert w.proc.poll() is None, f"the worker died during {method.name} over the fast lane"

    try:
        fuzz()
        assert_serving(owner)
    finally:
        for lane in lanes:
            lane.close()
        say_goodbye(owner, other)


def test_kept_call_frames_survive_hostile_payloads(fuzzed):
    """KEPT frames (two kept Computes repeated with only their input's dimensions and bytes, a kept CopyTensors
    with only its buffers' handles) with ids kept or not, payloads of
    every length, dimensions of every size, handles of buffers and not, and timeouts of every kind, sent as KEPT
    or as KEPT_WRITING (inputs said written at once, a little later, or, under a short deadline, never): one
    reply each, a result or a typed error, and the worker serves on."""
    w, _ = fuzzed
    owner = RawClient(w.address, "owner")
    handles = _populate(owner)
    lane = _Lane(owner, slots=True)  # the frames through its slots, as a client's are
    request = ep_pb2.ComputeRequest(node_compute_info=handles["compute_info"][0], inline_limit=1 << 20,
                                    keep_call=True)
    ref = request.inputs.add().tensor
    ref.desc.elem_type, ref.desc.shape[:] = TensorProto.FLOAT, [4]
    ref.inline = np.arange(4, dtype=np.float32).tobytes()
    fastlane.send_frame(lane.open(), fastlane.METHODS["Ep/Compute"].id, 0, DEADLINE_S, request.SerializeToString(),
                        lane.slots)
    (frame,) = lane.replies()
    kept = ep_pb2.ComputeResponse.FromString(frame.payload).kept_call
    fastlane.send_frame(lane.open(), fastlane.METHODS["Ep/Compute"].id, 0, DEADLINE_S, request.SerializeToString(),
                        lane.slots)
    (frame,) = lane.replies()
    shaped = ep_pb2.ComputeResponse.FromString(frame.payload).kept_call
    copy = data_transfer_pb2.CopyTensorsRequest(data_transfer=handles["data_transfer"][0], keep_call=True)
    for refs, buffer in ((copy.src, handles["buffer"][0]), (copy.dst, handles["buffer"][2])):
        r = refs.add()
        r.desc.elem_type, r.desc.shape[:] = TensorProto.FLOAT, [4]
        r.buffer = buffer
    fastlane.send_frame(lane.open(), fastlane.METHODS["DataTransfer/CopyTensors"].id, 0, DEADLINE_S,
                        copy.SerializeToString(), lane.slots)
    (frame,) = lane.replies()
    assert frame.status == 0, fastlane.decode_error(frame.payload)[0]
    kept_copy = data_transfer_pb2.CopyTensorsResponse.FromString(frame.payload).kept_call
    assert kept and kept_copy and shaped
    buffers = handles["buffer"]

    @seed(SEED)
    @settings(max_examples=EXAMPLES * 2, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(kid=st.sampled_from([kept, kept, kept_copy, kept_copy, shaped, shaped, 0, shaped + 1, 2 ** 32 - 1]),
           dim=st.sampled_from([4, 4, 0, 6, 2 ** 40, 2 ** 64 - 1]), extra=st.sampled_from([0, 0, 0, 1, -1]),
           length=st.sampled_from([16, 16, 0, 3, 15, 17, 64]), prefix=st.sampled_from([4, 4, 0, 2]),
           handles_=st.lists(st.sampled_from([*buffers, 0, 2 ** 64 - 1]), min_size=2, max_size=2),
           named=st.booleans(), timeout_s=st.sampled_from(TIMEOUTS),
           written=st.sampled_from([None, None, "at once", "later", "never"]), rng=st.randoms(use_true_random=False))
    def fuzz(kid, dim, extra, length, prefix, handles_, named, timeout_s, written, rng):
        body = struct.pack("<2Q", *handles_) if named and length == 16 else rng.randbytes(length)
        if kid in (kept, shaped) and named:  # its input's dimensions, then about as many bytes as they make
            body = struct.pack("<Q", dim) + rng.randbytes(max(0, 4 * min(dim, 64) + extra))
        payload = fastlane.KEPT_ID.pack(kid)[:prefix] + body
        if written == "never" and (timeout_s == 0 or timeout_s >= 1):
            written = "later"  # the worker would wait as long as the deadline, or the caller, takes
        sock = lane.open()
        if written is None:
            fastlane.send_frame(sock, fastlane.KEPT, 0, timeout_s, payload, lane.slots)
        else:
            assert fastlane.put_parts(lane.slots, fastlane.KEPT_WRITING, timeout_s, [payload], len(payload))
            if written == "later":  # once the worker has the frame (and waits for its inputs, or is done with it)
                assert doorbell_taken(sock), "the worker took no frame from its slot"
            if written != "never":
                lane.slots.inputs_written()
        frames = lane.replies()
        assert frames, "the worker closed a connection after a well-formed KEPT frame"
        code = {c.value[0]: c for c in grpc.StatusCode}.get(frames[0].status)
        detail = fastlane.decode_error(frames[0].payload)[0] if frames[0].status else ""
        assert code is not None and code not in BAD or (code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout_s < 1), \
            f"a KEPT frame was answered {frames[0].status}: {detail}"
        if code == grpc.StatusCode.OK and kid in (kept, shaped):  # a shape the partition takes, and its bytes (an
            # empty input's none, whatever `extra` took off)
            assert prefix == 4 and named and dim <= 64 and max(0, 4 * dim + extra) == 4 * dim \
                and len(frames[0].payload) == 8 + 4 * dim
        elif code == grpc.StatusCode.OK:
            assert (prefix, length) == (4, 16) and kid == kept_copy and len(frames[0].payload) == 0
        assert w.proc.poll() is None, "the worker died on a KEPT frame"

    try:
        fuzz()
        assert_serving(owner)
    finally:
        lane.close()
        say_goodbye(owner)


# --- descriptors, slots and floods: what a client holds in its own hands ---------------------------------------

def _served_well(client: RawClient, info: int) -> None:
    """A well-behaved call right after mischief: a Compute over gRPC, and one over a new lane, both right."""
    x = np.array([-1, 2, -3, 4], np.float32)
    request = ep_pb2.ComputeRequest(node_compute_info=info, inline_limit=1 << 20, inputs=[common_pb2.Value(
        tensor=common_pb2.TensorRef(desc=common_pb2.TensorDesc(elem_type=TensorProto.FLOAT, shape=[4]),
                                    inline=x.tobytes()))])
    (out,) = client(client.ep.Compute, request).outputs
    np.testing.assert_array_equal(np.frombuffer(out.tensor.inline, np.float32), np.maximum(x, 0))
    lane = _Lane(client, slots=True)
    try:
        fastlane.send_frame(lane.open(), fastlane.METHODS["Ep/Compute"].id, 0, DEADLINE_S, request.SerializeToString(),
                            lane.slots)
        (frame,) = lane.replies()
        assert frame.status == 0, fastlane.decode_error(frame.payload)[0]
        (out,) = ep_pb2.ComputeResponse.FromString(frame.payload).outputs
        np.testing.assert_array_equal(np.frombuffer(out.tensor.inline, np.float32), np.maximum(x, 0))
    finally:
        lane.close()


def _descriptor(kind: str, data: bytes, folder: str) -> tuple[int, list[int]]:
    """An open descriptor of `kind` holding `data` where it can, and what else to close with it."""
    if kind.startswith("memfd"):
        flags = os.MFD_CLOEXEC | (0 if kind == "memfd_unsealable" else os.MFD_ALLOW_SEALING)
        fd = os.memfd_create("fuzz", flags)
        os.write(fd, data)
        if kind == "memfd_sealed":
            import fcntl
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
        return fd, []
    if kind in ("file", "file_read_only"):
        path = os.path.join(folder, "w.bin")
        with open(path, "wb") as f:
            f.write(data)
        fd = os.open(path, os.O_RDONLY if kind == "file_read_only" else os.O_RDWR)
        os.unlink(path)  # (its client keeps it open, and may still shrink it)
        return fd, []
    if kind == "pipe":
        r, w = os.pipe()
        return r, [w]
    if kind == "socket":
        a, b = socket.socketpair()
        return a.detach(), [b.detach()]
    if kind == "directory":
        return os.open(folder, os.O_RDONLY), []
    if kind == "eventfd":
        return os.eventfd(0), []
    return os.open("/dev/zero", os.O_RDONLY), []


def _hurt(fd: int, how: str) -> None:
    """What a client may do to a descriptor it handed over: nothing, or shrink, grow or hole it (refused or not)."""
    import ctypes
    try:
        if how == "truncate":
            os.ftruncate(fd, 0)
        elif how == "grow":
            os.ftruncate(fd, 1 << 20)
        elif how == "punch":  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
            libc = ctypes.CDLL(None, use_errno=True)
            libc.fallocate(fd, 3, ctypes.c_long(0), ctypes.c_long(4096))
    except OSError:
        pass  # sealed, or no file: the worker's copy or seal holds


DESCRIPTORS = ["file", "file", "file_read_only", "memfd", "memfd", "memfd_unsealable", "memfd_sealed", "pipe",
               "socket", "directory", "eventfd", "dev_zero"]


def test_hostile_descriptors_handed_over_cannot_hurt_a_shared_worker(fuzzed, tmp_path):
    """ImportFile of descriptors of every kind, each then used by a model that reads it, hurt by its client
    (truncated, grown, holed) and read again: the file is taken (copied, or sealed) or refused, every call gets a
    result or a typed error, the worker serves on, and well-behaved calls right after are right."""
    w, _ = fuzzed
    TAKEN = ("file", "file_read_only", "memfd", "memfd_sealed")

    @seed(SEED)
    @settings(max_examples=EXAMPLES * 2, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(kind=st.sampled_from(DESCRIPTORS), how=st.sampled_from(["nothing", "truncate", "grow", "punch"]),
           n=st.sampled_from([4, 16, 4096, 65536]))
    def fuzz(kind, how, n):
        data = np.arange(n // 4, dtype=np.float32).tobytes()
        fd, more = _descriptor(kind, data, str(tmp_path))
        owner = RawClient(w.address, "importer")  # a client each: what it imported goes with it
        try:
            ep = owner(owner.factory.CreateEp, factory_pb2.CreateEpRequest(device_indices=[0])).id
            ticket = owner(owner.worker.ImportFile, common_pb2.Empty())
            try:
                fdshare.hand_over_file(owner.hello.fd_socket, ticket.ticket, fd)
            except ephost.EpPermissionDenied:
                assert kind not in TAKEN, f"a {kind} was refused"
                return
            assert kind in TAKEN, f"a {kind} was taken"
            t = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[n // 4], data_location=TensorProto.EXTERNAL)
            for key, value in (("location", "w"), ("offset", "0"), ("length", str(n))):
                t.external_data.add(key=key, value=value)
            model = _model([helper.make_node("Identity", ["W"], ["y"], name="id")], [],
                           [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n // 4])], [t])
            ref = ep_pb2.ModelRef(model=model.SerializeToString(),
                                  files=[ep_pb2.ExternalFile(name="w", nbytes=n, file=ticket.file)])
            (info,) = owner(owner.ep.Compile, ep_pb2.CompileRequest(ep=ep, model=ref, graphs=[
                ep_pb2.FusedGraph(name="p", nodes=["id"], inputs=[], outputs=["y"])])).node_compute_infos
            _hurt(fd, how)
            for _ in range(2):
                try:
                    (out,) = owner(owner.ep.Compute, ep_pb2.ComputeRequest(node_compute_info=info,
                                                                          inline_limit=1 << 20)).outputs
                    # (a memfd is memory both share: what its client writes, a hole too, the worker reads)
                    assert out.tensor.inline == data or kind.startswith("memfd"), \
                        "the worker read a file its client changed under it"
                except grpc.RpcError as e:
                    assert e.code() not in BAD, e.details()
        finally:
            for d in (fd, *more):
                os.close(d)
            say_goodbye(owner)
        assert w.proc.poll() is None, f"the worker died of a {kind} its client hurt ({how})"

    fuzz()
    owner = RawClient(w.address, "after")
    try:
        _served_well(owner, _populate(owner)["compute_info"][0])
    finally:
        say_goodbye(owner)


def test_lane_slots_in_hostile_hands(fuzzed):
    """The slots memfd of a lane, shrunk, grown, holed, resealed and scribbled on by its client between frames:
    the worker either answers the next frame or closes that one connection, and serves on."""
    import fcntl
    w, _ = fuzzed
    owner = RawClient(w.address, "slots")
    handles = _populate(owner)
    info = handles["compute_info"][0]
    request = ep_pb2.ComputeRequest(node_compute_info=info, inline_limit=1 << 20, inputs=[common_pb2.Value(
        tensor=common_pb2.TensorRef(desc=common_pb2.TensorDesc(elem_type=TensorProto.FLOAT, shape=[4]),
                                    inline=bytes(16)))]).SerializeToString()
    lane = _Lane(owner, slots=True)

    @seed(SEED)
    @settings(max_examples=EXAMPLES * 2, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(how=st.sampled_from(["truncate", "grow", "punch", "seal_write", "scribble", "nothing"]),
           rng=st.randoms(use_true_random=False))
    def fuzz(how, rng):
        lane.open()
        fd = lane.fd
        if how == "seal_write":
            try:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            except OSError:
                pass  # the slots are mapped writable, and sealed against further seals
        elif how == "scribble":
            lane.scribble(rng)
        elif how != "nothing":
            if how == "truncate":
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, 0)  # sealed
            _hurt(fd, how)
        if how != "scribble":
            fastlane.send_frame(lane.sock, fastlane.METHODS["Ep/Compute"].id, 0, DEADLINE_S, request, lane.slots)
        frames = lane.replies()
        if frames and frames[0].status == grpc.StatusCode.INVALID_ARGUMENT.value[0]:
            assert lane.replies() == [], "a connection served on after its slots went wrong"
        elif frames:
            assert frames[0].status == 0, fastlane.decode_error(frames[0].payload)[0]
        lane.close()
        assert w.proc.poll() is None, f"the worker died of slots its client hurt ({how})"

    try:
        fuzz()
        _served_well(owner, info)
    finally:
        lane.close()
        say_goodbye(owner)


def test_floods_cost_a_shared_worker_nothing_that_lasts(fuzzed):
    """Connections past every bound, frames announcing a gigabyte, clients that die mid-frame or in the
    handshake, replies nobody reads: each costs the worker what arrived while it lasts, other clients are
    served meanwhile, and all of it goes with the connections (the test after this one counts)."""
    w, (_, _, rss) = fuzzed
    owner = RawClient(w.address, "flooder")
    other = RawClient(w.address, "bystander")
    handles = _populate(owner)
    info = _populate(other)["compute_info"][0]
    copy = _copy_request(owner, handles)
    path = owner(owner.worker.OpenDataPlane, common_pb2.Empty()).socket

    @seed(SEED)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(kind=st.sampled_from(["connections", "gigabyte", "mid_frame", "handshake", "unread", "tickets"]),
           n=st.integers(1, 80))
    def fuzz(kind, n):
        socks, bound = [], 0
        try:
            for _ in range(n if kind in ("connections", "handshake", "tickets") else max(1, n // 16)):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                socks.append(sock)
                sock.connect(path)
                if kind == "handshake":
                    continue  # says nothing
                if kind == "tickets":
                    sock.send(os.urandom(32))
                    continue
                ticket = owner(owner.worker.OpenDataPlane, common_pb2.Empty()).ticket
                sock.settimeout(DEADLINE_S)
                try:
                    sock.send(ticket)
                    answer = sock.recv(2)
                except OSError:  # closed as it was accepted: past the bound for all
                    answer = b""
                if answer != fastlane.TICKET_OK:
                    _present_ticket(owner, worker_pb2.DataPlaneTicket, worker_pb2.DataPlaneTicket(
                        ticket=ticket).SerializeToString())  # (unread where the worker closed the connection)
                    continue  # past the bound for this client, or for all
                bound += 1
                sock.setblocking(False)
                header = fastlane.HEADER.pack
                try:
                    if kind == "gigabyte":
                        sock.send(header(fastlane.MAGIC, 3, 0, 5.0, 1 << 30) + os.urandom(100))
                    elif kind == "mid_frame":
                        sock.send(header(fastlane.MAGIC, 1, 0, 5.0, 3 * fastlane.PACKET) +
                                  bytes(fastlane.PACKET - fastlane.HEADER.size))
                    elif kind == "unread":
                        for _ in range(40):
                            sock.send(copy)
                except BlockingIOError:
                    pass
            _served_well(other, info)  # while the flood lasts
            assert bound <= lane_server.MAX_CLIENT_CONNECTIONS, "one client held more lane connections than its bound"
            assert _rss_kib(w.proc.pid) - rss < 256 * 1024, f"a flood ({kind}) took the worker's memory"
        finally:
            for sock in socks:
                sock.close()  # the client dies
        assert w.proc.poll() is None, f"the worker died of a flood ({kind})"

    try:
        fuzz()
        _served_well(other, info)
    finally:
        say_goodbye(owner, other)


def _copy_request(client: RawClient, handles) -> bytes:
    """A frame of a CopyTensors whose reply carries 60,000 bytes inline."""
    allocator = handles["allocator"][0]
    buffer = client(client.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=60_000)).buffer
    desc = common_pb2.TensorDesc(elem_type=TensorProto.UINT8, shape=[60_000])
    request = data_transfer_pb2.CopyTensorsRequest(
        data_transfer=handles["data_transfer"][0], src=[common_pb2.TensorRef(desc=desc, buffer=buffer)],
        dst=[common_pb2.TensorRef(desc=desc, reply=common_pb2.InlineReply())]).SerializeToString()
    return fastlane.HEADER.pack(fastlane.MAGIC, fastlane.METHODS["DataTransfer/CopyTensors"].id, 0, 0.0,
                                len(request)) + request


def test_nothing_is_left_after_the_clients_leave(fuzzed):
    """Runs after the fuzz above (same module worker): descriptors, memfd mappings and RSS are back near the
    baseline taken after a warm-up client came and went."""
    w, (fds, maps, rss) = fuzzed
    pid = w.proc.pid
    deadline = time.monotonic() + 10
    while (_fds(pid) > fds or _memfd_maps(pid) > maps) and time.monotonic() < deadline:
        time.sleep(0.2)  # releases happen as the last calls return
    assert _fds(pid) <= fds, "descriptors left in the worker after its clients left"
    assert _memfd_maps(pid) <= maps, "shared-memory mappings left in the worker after its clients left"
    assert _rss_kib(pid) - rss < 192 * 1024, "the worker's RSS climbed under a bounded load"
