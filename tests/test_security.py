"""Workers on TCP: TLS, mutual TLS and bearer tokens, with certificates made here."""
import socket

import numpy as np
import pytest

import ephost
from ephost import DeviceMemoryType, Tensor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def round_trip(env, name):
    (device,) = [d for d in env.get_ep_devices() if d.registration_name == name]
    allocator = env.create_shared_allocator(device, DeviceMemoryType.DEFAULT)
    data = np.arange(100, dtype=np.float32)
    back = Tensor.from_numpy(np.zeros_like(data))
    env.copy_tensors([Tensor.from_numpy(data, allocator)], [back])
    return back.numpy()


def test_tls_worker_with_a_client_that_trusts_its_ca(worker, pki):
    port = free_port()
    w = worker("--ep", "reference", "--listen", f"localhost:{port}", "--tls-cert", str(pki / "server.pem"),
               "--tls-key", str(pki / "server.key"))
    assert w.address == f"localhost:{port}"
    with ephost.Environment() as env:
        env.register_execution_provider_library("tls", f"grpcs://localhost:{port}", {"tls_ca": str(pki / "ca.pem")})
        np.testing.assert_array_equal(round_trip(env, "tls"), np.arange(100))
        (device,) = env.get_ep_devices()
        assert device.ep_name == "reference"
    with ephost.Environment() as env:  # plain text against a TLS worker
        with pytest.raises(ephost.EpWorkerUnavailable):
            env.register_execution_provider_library("plain", f"grpc://localhost:{port}", {"connect_timeout_s": "2"})


def test_mutual_tls_needs_a_client_certificate(worker, pki):
    port = free_port()
    worker("--ep", "reference", "--listen", f"localhost:{port}", "--tls-cert", str(pki / "server.pem"),
           "--tls-key", str(pki / "server.key"), "--tls-client-ca", str(pki / "ca.pem"))
    with ephost.Environment() as env:
        with pytest.raises(ephost.EpWorkerUnavailable):
            env.register_execution_provider_library("anon", f"grpcs://localhost:{port}",
                                                    {"tls_ca": str(pki / "ca.pem"), "connect_timeout_s": "2"})
        env.register_execution_provider_library("mtls", f"grpcs://localhost:{port}", {
            "tls_ca": str(pki / "ca.pem"), "tls_cert": str(pki / "client.pem"), "tls_key": str(pki / "client.key")})
        np.testing.assert_array_equal(round_trip(env, "mtls"), np.arange(100))


def test_tokens(worker, pki, monkeypatch):
    port = free_port()
    w = worker("--ep", "reference", "--listen", f"127.0.0.1:{port}", "--insecure", "--token-file", str(pki / "token"))
    with ephost.Environment() as env:
        for options in ({}, {"token": "wrong"}):
            with pytest.raises(ephost.EpUnauthenticated) as info:
                env.register_execution_provider_library("x", f"grpc://127.0.0.1:{port}", options)
            assert str(info.value) == "missing or wrong token"
        env.register_execution_provider_library("ok", f"grpc://127.0.0.1:{port}", {"token": "s3cret-token"})
        np.testing.assert_array_equal(round_trip(env, "ok"), np.arange(100))
        monkeypatch.setenv("EPHOST_TOKEN", "s3cret-token")
        env.register_execution_provider_library("from-env", f"grpc://127.0.0.1:{port}")
        assert len(env.get_ep_devices()) == 2
    # probes need no token
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(w.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


# --- issue 15: what a hostile client can do to a shared worker ----------------------------------------

import os
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnx import TensorProto, helper, numpy_helper

from helpers import MovedClock, RawClient
from ephost import fdshare
from ephost.v1 import allocator_pb2, common_pb2, data_transfer_pb2, ep_pb2, factory_pb2, worker_pb2

HOST = common_pb2.DEVICE_MEMORY_TYPE_HOST_ACCESSIBLE


def _external(location: str) -> TensorProto:
    t = numpy_helper.from_array(np.zeros(4, np.float32), "c")
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    t.external_data.add(key="location", value=location)
    return t


def _status(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def hostile(worker, tmp_path):
    """A worker whose working directory holds a file a client must never read through it."""
    cwd = os.getcwd()
    os.chdir(tmp_path)
    (tmp_path / "secret.txt").write_bytes(b"TOP-SECRET-BYTES" * 4)
    (tmp_path / "sub").mkdir()
    try:
        w = worker("--ep", "reference", exit_with_parent=False)
    finally:
        os.chdir(cwd)
    client = RawClient(w.address)
    yield w, client
    client.close()


def test_tensors_from_the_wire_never_make_the_worker_read_a_path(hostile):
    w, raw = hostile
    ep = raw(raw.factory.CreateEp, factory_pb2.CreateEpRequest(device_indices=[0])).id
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    relu = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"], name="id")], "g", [x], [y]),
                             opset_imports=[helper.make_opsetid("", 18)])
    (info,) = raw(raw.ep.Compile, ep_pb2.CompileRequest(ep=ep, model=ep_pb2.ModelRef(model=relu.SerializeToString()),
                                                        graphs=[ep_pb2.FusedGraph(name="p", nodes=["id"], inputs=["x"],
                                                                                  outputs=["y"])])).node_compute_infos
    for location in ("secret.txt", "./secret.txt", "sub/../secret.txt"):
        value = common_pb2.Value(onnx=common_pb2.OnnxValue(kind=common_pb2.OnnxValue.KIND_TENSOR,
                                                          data=_external(location).SerializeToString()))
        code, message = _status(lambda: raw(raw.ep.Compute, ep_pb2.ComputeRequest(node_compute_info=info,
                                                                                  inputs=[value])))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "external" in message
        constant = helper.make_model(helper.make_graph(
            [helper.make_node("Constant", [], ["c"], name="c", value=_external(location)),
             helper.make_node("Add", ["x", "c"], ["y"], name="add")], "g", [x], [y]),
            opset_imports=[helper.make_opsetid("", 18)])
        for call in (raw.ep.GetCapability, raw.ep.Compile):
            request = (ep_pb2.GetCapabilityRequest if call is raw.ep.GetCapability else ep_pb2.CompileRequest)(
                ep=ep, model=ep_pb2.ModelRef(model=constant.SerializeToString()))
            code, message = _status(lambda: raw(call, request))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "external" in message
            assert "TOP-SECRET" not in message


def _export(raw, nbytes=4096):
    allocator = raw(raw.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest(
        device_mem_type=HOST, options={"arena.initial_chunk_size_bytes": str(1 << 20)})).allocator
    buffer = raw(raw.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=nbytes))
    ticket = raw(raw.worker.ExportRegion, worker_pb2.ExportRegionRequest(region=buffer.shm.region)).ticket
    return allocator, buffer, ticket


def test_a_client_cannot_shrink_a_region_under_the_worker(hostile):
    w, raw = hostile
    allocator, buffer, ticket = _export(raw)
    fd, size = fdshare.fetch_descriptor(raw.hello.fd_socket, ticket)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # sealed: F_SEAL_SHRINK
    finally:
        os.close(fd)
    transfer = raw(raw.factory.CreateDataTransfer, common_pb2.Empty()).data_transfer
    src = common_pb2.TensorRef(desc=common_pb2.TensorDesc(elem_type=TensorProto.FLOAT, shape=[4]), inline=b"\1" * 16)
    dst = common_pb2.TensorRef(desc=src.desc, buffer=buffer.buffer)
    raw(raw.transfer.CopyTensors, data_transfer_pb2.CopyTensorsRequest(data_transfer=transfer, src=[src], dst=[dst]))
    assert w.proc.poll() is None


def test_an_unsealed_segment_is_never_mapped():
    from ephost.memory import Region
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    with pytest.raises(ephost.EpInvalidArgument, match="sealed"):
        Region.from_fd(fd, 4096, 1)  # closes fd


def test_a_closed_region_hands_out_no_descriptor_and_no_reused_number():
    """A region's descriptor is duplicated under the lock that closes it: once closed, no duplicate is made (a
    duplicate of the old number would be of whatever file the process opened next under it)."""
    from ephost.memory import Region
    region = Region.create_shared(4096)
    fd = region.dup_fd()
    try:
        assert fd != region.fd and os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:ephost")
    finally:
        os.close(fd)
    number = region.fd
    region.close()
    reused = os.open("/dev/null", os.O_RDONLY)  # the lowest free number: most likely the one just closed
    try:
        assert region.dup_fd() is None
        assert reused != number or os.readlink(f"/proc/self/fd/{number}") == "/dev/null"
    finally:
        os.close(reused)


def test_tickets_die_with_their_client_and_their_allocator(hostile):
    w, raw = hostile
    pid = w.proc.pid
    baseline = _fds(pid)
    allocator, _, ticket = _export(raw)
    more = [_export(raw)[2] for _ in range(5)]
    raw(raw.factory.ReleaseAllocator, common_pb2.Handle(id=allocator))
    with pytest.raises(ephost.EpPermissionDenied):  # issued before ReleaseAllocator: no longer hands anything over
        fdshare.fetch_descriptor(raw.hello.fd_socket, ticket)
    other = RawClient(w.address, "leaver")
    for _ in range(10):
        _export(other)
    other(other.worker.Goodbye, common_pb2.Empty())
    other.close()
    raw(raw.worker.Goodbye, common_pb2.Empty())
    for t in more:
        with pytest.raises(ephost.EpPermissionDenied):
            fdshare.fetch_descriptor(raw.hello.fd_socket, t)
    deadline = time.monotonic() + 5
    while _fds(pid) > baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _fds(pid) <= baseline, "descriptors of unredeemed tickets outlived their client"


def test_descriptors_attached_to_a_presentation_are_closed(hostile):
    import socket
    w, raw = hostile
    pid = w.proc.pid
    before = _fds(pid)
    for _ in range(10):
        fd = os.memfd_create("attached", os.MFD_CLOEXEC)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(raw.hello.fd_socket)
            socket.send_fds(s, [os.urandom(32)], [fd])
            assert s.recv(2) == b"NO"
        os.close(fd)
    deadline = time.monotonic() + 10
    while _fds(pid) > before and time.monotonic() < deadline:
        time.sleep(0.05)  # the worker closes them as it refuses the presentation
    assert _fds(pid) <= before, "descriptors attached to a refused presentation stayed open in the worker"


def test_idle_connections_do_not_delay_a_valid_ticket(hostile, monkeypatch, tmp_path):
    """A valid ticket is answered while connections made before it still wait to send theirs (a server that
    served them one at a time would answer it only once each had been dropped); the worker drops a connection
    that sends nothing."""
    import select
    import socket
    idle_s = fdshare.IDLE_S  # the worker's
    monkeypatch.setattr(fdshare, "IDLE_S", 600.0)  # a server of this process: its idle connections wait on
    server = fdshare.DescriptorServer(str(tmp_path / "fds"))
    region = os.memfd_create("region", os.MFD_CLOEXEC)
    idle = []
    try:
        ticket = server.issue(region, 0)
        for _ in range(4):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(server.path)
            idle.append(s)
        fd, _ = fdshare.fetch_descriptor(server.path, ticket, timeout=30)
        os.close(fd)
        assert not select.select(idle, [], [], 0)[0], "the idle connections are still open, unanswered"
    finally:
        for s in idle:
            s.close()
        os.close(region)
        server.close()
    _, raw = hostile
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(raw.hello.fd_socket)
        s.settimeout(idle_s + 3)
        assert s.recv(16) == b"", "a connection that sends nothing is dropped"


def test_expired_tickets_are_closed_and_break_nothing(monkeypatch, tmp_path):
    """fdshare used to os.close(-1) for an expired probe ticket, failing every later issue()."""
    clock = MovedClock()
    monkeypatch.setattr(fdshare, "time", clock)
    server = fdshare.DescriptorServer(str(tmp_path / "fds"))
    fd = os.memfd_create("region", os.MFD_CLOEXEC)
    try:
        server.issue_probe(owner="a")
        server.issue(fd, 0, owner="a")
        clock.ahead += fdshare.TICKET_TTL_S + 1
        ticket = server.issue(fd, 0, owner="b")  # sweeps the expired ones: no OSError
        assert server.outstanding() == 1
        clock.ahead += fdshare.TICKET_TTL_S + 1
        deadline = time.monotonic() + fdshare.SWEEP_S * 3 + 1
        while server.outstanding() and time.monotonic() < deadline:
            time.sleep(0.05)  # the server sweeps on its own, with no further issue()
        assert server.outstanding() == 0
        with pytest.raises(ephost.EpPermissionDenied):
            fdshare.fetch_descriptor(server.path, ticket)
    finally:
        os.close(fd)
        server.close()


def test_only_the_launching_client_may_shut_a_worker_down(worker):
    shared = worker("--ep", "reference", exit_with_parent=False)
    client = RawClient(shared.address)
    try:
        code, message = _status(lambda: client(client.worker.Shutdown, worker_pb2.ShutdownRequest()))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "operator" in message
        code, _ = _status(lambda: client.worker.Shutdown(worker_pb2.ShutdownRequest(), timeout=10))
        assert code == grpc.StatusCode.FAILED_PRECONDITION  # no client id: not even asked
        assert shared.proc.poll() is None
    finally:
        client.close()
    launched = worker("--ep", "reference")  # --exit-with-parent: its launcher may stop it
    client = RawClient(launched.address)
    try:
        client(client.worker.Shutdown, worker_pb2.ShutdownRequest(grace_s=0.5))
        assert launched.proc.wait(15) == 0
    finally:
        client.close()


def test_streams_nobody_reads_cannot_starve_health_checks(worker):
    w = worker("--ep", "reference", exit_with_parent=False)
    clients = [RawClient(w.address, f"c{i}") for i in range(3)]
    streams, open_streams = [], []
    try:
        held = []
        for client in clients:
            allocator = client(client.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest()).allocator
            buffer = client(client.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=16 << 20))
            held.append((client, allocator, buffer.buffer))
        refused = {"client": 0, "worker": 0}
        for client, allocator, buffer in held:
            for _ in range(13):  # a shared worker of 16 call slots lets one client have 12
                stream = client.allocator.Read(allocator_pb2.ReadRequest(
                    allocator=allocator, buffer=buffer, nbytes=16 << 20, chunk_bytes=64),
                    timeout=60, metadata=client.metadata)
                streams.append(stream)
                try:
                    next(stream)  # open, then never read again
                    open_streams.append(stream)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
                    refused["client" if "this client" in e.details() else "worker"] += 1
        assert refused["client"] >= 1, "one client held more streams than its bound"
        assert refused["worker"] >= 9, "the clients together held more streams than the worker's bound"
        with grpc.insecure_channel(w.address) as channel:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert not any(stream.done() for stream in open_streams), "a health check waited behind the streams"
        # Every slot taken: once that lasts, health says the worker cannot serve, and says so until one is free.
        _until_health(w.address, health_pb2.HealthCheckResponse.NOT_SERVING, 10)
        for stream in streams:
            stream.cancel()
        _until_health(w.address, health_pb2.HealthCheckResponse.SERVING, 10)
    finally:
        for stream in streams:
            stream.cancel()
        for client in clients:
            client.close()


# --- issue 59: what a hostile or broken client can still do to a worker that others share ------------------

from ephost import fastlane, lane_slots


def _lane(client, slots: bool = True):
    """A data-plane connection of `client`, bound by its ticket; with `slots`, also the slots' descriptor."""
    import socket
    reply = client(client.worker.OpenDataPlane, common_pb2.Empty())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(reply.socket)
    sock.send(reply.ticket + (lane_slots.ASK if slots else b""))
    answer, fds, _, _ = socket.recv_fds(sock, 2, 2)
    assert answer == fastlane.TICKET_OK
    for fd in fds[1:]:  # the early wake
        os.close(fd)
    return sock, (fds[0] if fds else None)


def test_a_client_cannot_shrink_its_lane_slots_under_the_worker(hostile):
    w, raw = hostile
    sock, fd = _lane(raw)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # sealed: F_SEAL_SHRINK
        slots = lane_slots.Slots(lane_slots.adopt(os.dup(fd)), sock, worker=False)
        fastlane.send_frame(sock, 999, 0, 5.0, b"", slots)  # any frame: the worker reads its slots for it
        frame = fastlane.FrameReader(sock, slots=slots).read()
        slots.close()
        assert frame is not None and frame.status == grpc.StatusCode.UNIMPLEMENTED.value[0]
        assert w.proc.poll() is None
    finally:
        sock.close()
        os.close(fd)


def _rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _unread(sock) -> int:
    """Bytes this end sent that its peer has not read yet (TIOCOUTQ)."""
    import array
    import fcntl
    import termios
    out = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, out)
    return out[0]


def _until_read(sock, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _unread(sock) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _unread(sock), "the worker did not read what was sent"


def test_a_frame_announcing_a_gigabyte_costs_the_worker_what_arrived(hostile):
    """A header announcing a 1 GiB body, then a few bytes: the worker allocated (and zero-filled) the whole
    gigabyte before the bytes came (two such connections took its RSS from 92 to 1,600 MiB)."""
    w, raw = hostile
    pid = w.proc.pid
    before = _rss_kib(pid)
    lanes = [_lane(raw, slots=False)[0] for _ in range(2)]
    try:
        for sock in lanes:
            sock.send(fastlane.HEADER.pack(fastlane.MAGIC, 3, 0, 5.0, 1 << 30) + bytes(100))
            sock.send(bytes(1000))  # read once the worker is past the header (and, before, past its allocation)
        for sock in lanes:
            _until_read(sock)
        assert _rss_kib(pid) - before < 64 * 1024, "the worker allocated what a frame announced"
    finally:
        for sock in lanes:
            sock.close()
    assert w.proc.poll() is None


def test_a_frame_longer_than_the_workers_message_limit_is_refused(worker):
    w = worker("--ep", "reference", "--max-message-mb", "4", exit_with_parent=False)
    raw = RawClient(w.address)
    sock, _ = _lane(raw, slots=False)
    try:
        sock.send(fastlane.HEADER.pack(fastlane.MAGIC, 3, 0, 5.0, (4 << 20) + 1))
        frame = fastlane.FrameReader(sock).read()
        assert frame.status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert f"more than the {4 << 20} allowed" in fastlane.decode_error(frame.payload)[0]
        assert fastlane.FrameReader(sock).read() is None  # and the connection is closed
    finally:
        sock.close()
        raw.close()


def test_fast_lane_connections_are_bounded_per_client_and_in_all(hostile, monkeypatch):
    import socket
    from ephost.server import fastlane as lane_server
    w, raw = hostile
    other = RawClient(w.address, "other")
    lanes = []
    try:
        for _ in range(lane_server.MAX_CLIENT_CONNECTIONS):
            lanes.append(_lane(raw, slots=False)[0])
        reply = raw(raw.worker.OpenDataPlane, common_pb2.Empty())
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(10)
            sock.connect(reply.socket)
            sock.send(reply.ticket)
            assert sock.recv(2) == fastlane.TICKET_NO, "one client held more connections than its bound"
        lanes.append(_lane(other, slots=False)[0])  # another client is not refused
        path = reply.socket
        idle = []
        while len(lanes) + len(idle) < lane_server.MAX_CONNECTIONS:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(path)  # and never says which client it is
            idle.append(s)
        lanes += idle
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(path)  # (blocking: it waits for room in the listening socket's queue)
            sock.settimeout(10)
            assert sock.recv(2) == b"", "the worker served more connections than its bound"
    finally:
        for sock in lanes:
            sock.close()
    deadline = time.monotonic() + 10
    while True:  # the worker lets go of them as it sees them closed
        try:
            lanes = [_lane(other, slots=False)[0]]
            break
        except AssertionError:
            assert time.monotonic() < deadline, "the bound stayed taken after the connections closed"
    lanes[0].close()
    other.close()


def test_goodbye_ends_the_clients_lanes_and_what_they_kept(hostile):
    """A kept call naming buffers of the client's (here a CopyTensors, repeated) holds tensors over them; its
    client says Goodbye over gRPC and leaves its lane open: the released allocator's memory stayed mapped in the
    worker until the lane closed."""
    import struct
    w, raw = hostile
    pid = w.proc.pid

    def regions() -> int:
        with open(f"/proc/{pid}/maps") as f:
            return sum(line.rstrip().endswith("/memfd:ephost (deleted)") for line in f)

    before = regions()
    allocator, given, _ = _export(raw, 16)
    taken = raw(raw.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=16))
    desc = common_pb2.TensorDesc(elem_type=TensorProto.FLOAT, shape=[4])
    transfer = raw(raw.factory.CreateDataTransfer, common_pb2.Empty()).data_transfer
    request = data_transfer_pb2.CopyTensorsRequest(data_transfer=transfer, keep_call=True,
                                                   src=[common_pb2.TensorRef(desc=desc, buffer=given.buffer)],
                                                   dst=[common_pb2.TensorRef(desc=desc, buffer=taken.buffer)])
    sock, _ = _lane(raw, slots=False)
    reader = fastlane.FrameReader(sock, adopt=lambda region, size, fd: os.close(fd))
    try:
        fastlane.send_frame(sock, fastlane.METHODS["DataTransfer/CopyTensors"].id, 0, 10.0,
                            request.SerializeToString())
        frame = reader.read()
        assert frame.status == 0, fastlane.decode_error(frame.payload)
        kept = data_transfer_pb2.CopyTensorsResponse.FromString(frame.payload).kept_call
        assert kept
        fastlane.send_frame(sock, fastlane.KEPT, 0, 10.0, fastlane.KEPT_ID.pack(kept) +
                            struct.pack("<2Q", given.buffer, taken.buffer))  # the repeat: its buffers' handles
        frame = reader.read()
        assert frame.status == 0, fastlane.decode_error(frame.payload)
        assert regions() > before
        raw(raw.worker.Goodbye, common_pb2.Empty())
        assert reader.read() is None, "the client's lane served on after its Goodbye"
        deadline = time.monotonic() + 10
        while regions() > before and time.monotonic() < deadline:
            time.sleep(0.05)  # the connection's thread lets go of what it kept as it ends
        assert regions() <= before, "a released allocator's memory stayed mapped in the worker"
    finally:
        sock.close()


def test_a_call_whose_reply_is_on_its_way_holds_no_call_slot_but_a_drain_waits_for_it():
    from types import SimpleNamespace

    from ephost.server.rpc import Admission, Dispatcher
    from ephost.server.stats import WorkerStats
    dispatcher = Dispatcher(SimpleNamespace(stats=WorkerStats()), Admission(per_client=12, total=16))
    admission = dispatcher.admission
    for i in range(16):
        admission.enter("a" if i < 12 else "b")
    with pytest.raises(ephost.EpResourceExhausted, match="its limit of 16 calls"):
        admission.enter("c")
    assert admission.full_for() >= 0.0 and admission.under_way() == 16
    tally = dispatcher.state.stats.answering()  # as Dispatcher.dispatch answers on the lane: the reply is
    tally.answered += 1                          # being sent (to a client that may never read it)
    admission.leave("a")
    assert admission.full_for() == 0.0
    admission.enter("c")
    for who in ["a"] * 11 + ["b"] * 4 + ["c"]:
        admission.leave(who)
    assert admission.wait_idle(0.0) and not dispatcher.wait_idle(0.0), "a drain ended with a reply still on its way"
    tally.counted += 1
    assert dispatcher.wait_idle(0.0)


def _flooding(client, lanes: int, nbytes: int = 60_000):
    """`lanes` data-plane connections of `client`, and a frame to flood each with: a CopyTensors whose reply
    carries `nbytes` inline."""
    allocator = client(client.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest()).allocator
    buffer = client(client.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=nbytes)).buffer
    transfer = client(client.factory.CreateDataTransfer, common_pb2.Empty()).data_transfer
    desc = common_pb2.TensorDesc(elem_type=TensorProto.UINT8, shape=[nbytes])
    request = data_transfer_pb2.CopyTensorsRequest(
        data_transfer=transfer, src=[common_pb2.TensorRef(desc=desc, buffer=buffer)],
        dst=[common_pb2.TensorRef(desc=desc, reply=common_pb2.InlineReply())]).SerializeToString()
    frame = fastlane.HEADER.pack(fastlane.MAGIC, fastlane.METHODS["DataTransfer/CopyTensors"].id, 0, 0.0,
                                 len(request)) + request
    return [(_lane(client, slots=False)[0], frame) for _ in range(lanes)]


def _flood(lanes, calls: int = 200) -> None:
    """Send each lane its frame `calls` times, never reading a reply."""
    for sock, frame in lanes:
        sock.setblocking(False)
        for _ in range(calls):
            try:
                sock.send(frame)
            except BlockingIOError:  # the worker stopped reading: it is stuck in a send
                break


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def _until_health(address: str, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _health(address) != status:
        assert time.monotonic() < deadline, \
            f"health did not say {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
        time.sleep(0.1)


def test_clients_that_never_read_their_replies_hold_no_call_slot(worker):
    """Two clients whose 24 lanes send CopyTensors with 60,000-byte inline replies and never read them held all
    16 call slots for as long as their lanes stayed open: everyone else's calls were RESOURCE_EXHAUSTED. A call
    whose reply is on its way holds no slot, and a send waits at most --send-timeout-s."""
    w = worker("--ep", "reference", "--send-timeout-s", "4", exit_with_parent=False)
    clients = [RawClient(w.address, f"flood{i}") for i in range(2)]
    lanes = []
    try:
        for client in clients:
            lanes += _flooding(client, 12)
        _flood(lanes)
        deadline, last = time.monotonic() + 15, None
        while True:  # until every lane's thread in the worker is stuck in a send (it reads no more requests)
            unread = [_unread(sock) for sock, _ in lanes]
            if all(unread) and unread == last:
                break
            assert time.monotonic() < deadline, f"lanes whose requests the worker refused: {unread.count(0)}"
            last = unread
            time.sleep(0.3)
        late = RawClient(w.address, "late")
        allocator = late(late.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest()).allocator
        assert late(late.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=16)).buffer
        assert late(late.worker.OpenDataPlane, common_pb2.Empty()).ticket
        late.close()
        assert _health(w.address) == health_pb2.HealthCheckResponse.SERVING
        deadline = time.monotonic() + 15
        while True:  # the sends give up, and their connections close
            with open(w.log_path) as f:
                if f.read().count("peer read nothing for 4 s") == len(lanes):
                    break
            assert time.monotonic() < deadline, "sends to clients that read nothing waited on"
            time.sleep(0.2)
    finally:
        for sock, _ in lanes:
            sock.close()
        for client in clients:
            client.close()


_HEAP_PROBE = """
import ctypes, sys
from ephost.server import malloc
if sys.argv[1] == "worker":
    assert malloc.configure()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
libc.free(libc.malloc(16 << 20))  # a large block freed: glibc moves its threshold past it, unless fixed
block = libc.malloc(2 << 20)      # then a session's arena, say
# glibc's chunk header, just before the block: its size, whose bit 2 says the chunk is a mapping of its own
print("own" if ctypes.c_size_t.from_address(block - 8).value & 2 else "heap")
"""


def test_a_worker_gives_back_what_large_blocks_took_whatever_was_freed_before():
    """Finding 9 of issue 59: a shared onnxruntime worker's RSS grew with every generation of clients (98, 120, 181,
    210, 235 MiB): after the first sessions' large blocks were freed, glibc took later ones from its heaps, which
    fragment and never shrink. A worker fixes the mmap threshold, so that each large block is a mapping of its own
    and goes whole when freed (`make soak` shows the RSS over rounds of clients)."""
    import subprocess
    import sys
    run = [sys.executable, "-c", _HEAP_PROBE]
    assert subprocess.run(run + ["plain"], capture_output=True, text=True, check=True).stdout.strip() == "heap"
    assert subprocess.run(run + ["worker"], capture_output=True, text=True, check=True).stdout.strip() == "own"


def _identity_of_external(nbytes: int) -> bytes:
    """A model whose output is its initializer W, whose bytes are external data named "w"."""
    w = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[nbytes // 4], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "w"), ("offset", "0"), ("length", str(nbytes))):
        w.external_data.add(key=key, value=value)
    graph = helper.make_graph([helper.make_node("Identity", ["W"], ["y"], name="id")], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [nbytes // 4])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def _import_and_compile(raw, fd: int, nbytes: int) -> int:
    """Hand `fd` over (ImportFile) and compile the model that reads it; the compute info."""
    ticket = raw(raw.worker.ImportFile, common_pb2.Empty())
    fdshare.hand_over_file(raw.hello.fd_socket, ticket.ticket, fd)
    ep = raw(raw.factory.CreateEp, factory_pb2.CreateEpRequest(device_indices=[0])).id
    model = ep_pb2.ModelRef(model=_identity_of_external(nbytes),
                            files=[ep_pb2.ExternalFile(name="w", nbytes=nbytes, file=ticket.file)])
    (info,) = raw(raw.ep.Compile, ep_pb2.CompileRequest(ep=ep, model=model, graphs=[
        ep_pb2.FusedGraph(name="p", nodes=["id"], inputs=[], outputs=["y"])])).node_compute_infos
    return info


def _computed(raw, info: int) -> np.ndarray:
    (out,) = raw(raw.ep.Compute, ep_pb2.ComputeRequest(node_compute_info=info, inline_limit=8 << 20)).outputs
    return np.frombuffer(out.tensor.inline, np.float32)


@pytest.fixture
def shared_with_cache(worker, tmp_path):
    w = worker("--ep", "reference", "--cache-dir", str(tmp_path / "cache"), exit_with_parent=False)
    raw = RawClient(w.address)
    yield w, raw, tmp_path / "cache"
    raw.close()


def test_a_client_cannot_shrink_an_imported_file_under_a_shared_worker(shared_with_cache, tmp_path):
    """ImportFile a 1 MiB file, compile Identity(W) with W in it, truncate the file, Compute: the worker died of
    SIGBUS. A worker others share copies the file into its own cache and maps the copy."""
    import hashlib
    w, raw, cache = shared_with_cache
    weights = np.arange(1 << 18, dtype=np.float32)
    path = tmp_path / "w.bin"
    path.write_bytes(weights.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        info = _import_and_compile(raw, fd, weights.nbytes)
    finally:
        os.close(fd)
    os.truncate(path, 0)
    np.testing.assert_array_equal(_computed(raw, info), weights)
    assert w.proc.poll() is None
    assert os.listdir(cache) == [hashlib.sha256(weights.tobytes()).hexdigest()]  # the copy the worker maps


def test_an_imported_memfd_is_sealed_against_shrinking_or_refused(shared_with_cache):
    w, raw, _ = shared_with_cache
    weights = np.arange(1 << 18, dtype=np.float32)
    fd = os.memfd_create("weights", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, weights.tobytes())
        info = _import_and_compile(raw, fd, weights.nbytes)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # sealed as it was imported
        np.testing.assert_array_equal(_computed(raw, info), weights)
    finally:
        os.close(fd)
    fd = os.memfd_create("weights", os.MFD_CLOEXEC)  # no sealing allowed: the worker cannot make it safe
    try:
        os.write(fd, weights.tobytes())
        ticket = raw(raw.worker.ImportFile, common_pb2.Empty())
        with pytest.raises(ephost.EpPermissionDenied, match="cannot seal"):
            fdshare.hand_over_file(raw.hello.fd_socket, ticket.ticket, fd)
    finally:
        os.close(fd)
    assert w.proc.poll() is None


def test_a_launched_worker_maps_its_applications_memfd_as_it_is(worker):
    """A worker launched by one application for itself maps that application's files as they are, a memfd it
    cannot seal among them (only that application could shrink it)."""
    launched = worker("--ep", "reference")
    raw = RawClient(launched.address)
    weights = np.arange(1 << 10, dtype=np.float32)
    fd = os.memfd_create("weights", os.MFD_CLOEXEC)
    try:
        os.write(fd, weights.tobytes())
        info = _import_and_compile(raw, fd, weights.nbytes)
        np.testing.assert_array_equal(_computed(raw, info), weights)
    finally:
        os.close(fd)
        raw.close()


def test_what_holds_a_descriptor_in_the_worker_is_bounded_per_client(hostile):
    """Tickets (each ExportRegion's holds a duplicate of the region's descriptor until presented, or 30 s) and
    imported files were unbounded: one client could take every descriptor the worker may open, and every other
    client's next region, lane or file then failed."""
    w, raw = hostile
    pid = w.proc.pid
    before = _fds(pid)
    _, buffer, _ = _export(raw)
    region = buffer.shm.region
    issued = 0
    with pytest.raises(grpc.RpcError) as e:
        for _ in range(fdshare.MAX_TICKETS + 1):
            raw(raw.worker.ExportRegion, worker_pb2.ExportRegionRequest(region=region))
            issued += 1
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tickets" in e.value.details()
    assert issued == fdshare.MAX_TICKETS - 1  # (with the one _export made)
    assert _fds(pid) - before < fdshare.MAX_TICKETS + 16
    other = RawClient(w.address, "other")  # another client is not refused
    other(other.worker.ExportRegion, worker_pb2.ExportRegionRequest(region=_export(other)[1].shm.region))
    fd = os.memfd_create("w", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, bytes(16))
    try:
        from ephost.server.worker_service import MAX_FILES
        with pytest.raises(grpc.RpcError) as e:
            for _ in range(MAX_FILES + 1):
                ticket = other(other.worker.ImportFile, common_pb2.Empty())
                fdshare.hand_over_file(other.hello.fd_socket, ticket.ticket, fd)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "imported files" in e.value.details()
    finally:
        os.close(fd)
    for client in (raw, other):
        client(client.worker.Goodbye, common_pb2.Empty())
    other.close()
    deadline = time.monotonic() + 10
    while _fds(pid) > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _fds(pid) <= before
