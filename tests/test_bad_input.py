"""Bad requests on the wire get a clear status, reveal no shared-memory detail, and the worker keeps serving."""
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnx import TensorProto

from ephost.v1 import allocator_pb2, common_pb2, data_transfer_pb2, ep_pb2, factory_pb2, stream_pb2, worker_pb2

HOST = common_pb2.DEVICE_MEMORY_TYPE_HOST_ACCESSIBLE
FLOAT = TensorProto.FLOAT


def status_of(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


@pytest.fixture
def setup(raw):
    """A host-accessible allocator with one 64-byte buffer, and a data transfer."""
    allocator = raw(raw.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest(device_mem_type=HOST)).allocator
    buffer = raw(raw.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=64))
    transfer = raw(raw.factory.CreateDataTransfer, common_pb2.Empty()).data_transfer
    return allocator, buffer, transfer


@pytest.fixture(autouse=True)
def still_serving(served, raw):
    """After every test here: the worker is healthy and a fresh client can allocate."""
    yield
    assert served.proc.poll() is None, "the worker died"
    health = health_pb2_grpc.HealthStub(raw.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    allocator = raw(raw.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest()).allocator
    assert raw(raw.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=16)).buffer


def assert_reveals_nothing(message, served, raw):
    for secret in (raw.hello.fd_socket, served.dir, "/dev/shm", "memfd"):
        assert secret not in message


def desc(*shape, elem_type=FLOAT):
    return common_pb2.TensorDesc(elem_type=elem_type, shape=list(shape))


def copy(raw, transfer, src, dst):
    return raw(raw.transfer.CopyTensors, data_transfer_pb2.CopyTensorsRequest(data_transfer=transfer, src=src, dst=dst))


def test_calls_without_hello_are_refused(raw):
    code, message = status_of(lambda: raw.factory.CreateEp(factory_pb2.CreateEpRequest(), timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "Hello" in message
    code, _ = status_of(lambda: raw.factory.CreateEp(factory_pb2.CreateEpRequest(), timeout=10,
                                                     metadata=(("ephost-client", "forged"),)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_wrong_protocol_version(raw):
    code, message = status_of(lambda: raw.worker.Hello(worker_pb2.HelloRequest(protocol="ephost.v0"), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ephost.v1" in message


def test_unknown_and_released_handles(raw, setup):
    allocator, buffer, transfer = setup
    cases = [
        (raw.allocator.Alloc, allocator_pb2.AllocRequest(allocator=987654, nbytes=8), "allocator handle 987654"),
        (raw.allocator.GetStats, common_pb2.Handle(id=0), "allocator handle 0"),
        (raw.allocator.Free, allocator_pb2.FreeRequest(allocator=allocator, buffer=55555), "buffer handle 55555"),
        (raw.factory.ReleaseEp, common_pb2.Handle(id=42), "ep handle 42"),
        (raw.stream.Activate, common_pb2.Handle(id=42), "notification handle 42"),
        (raw.stream.Release, common_pb2.Handle(id=42), "stream or notification handle 42"),
        (raw.ep.Compute, ep_pb2.ComputeRequest(node_compute_info=42), "compute info handle 42"),
        (raw.transfer.CanCopy, data_transfer_pb2.CanCopyRequest(data_transfer=42), "data transfer handle 42"),
        (raw.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest(device_index=3), "no device 3"),
    ]
    for method, request, expected in cases:
        code, message = status_of(lambda: raw(method, request))
        assert code == grpc.StatusCode.NOT_FOUND, (method, message)
        assert expected in message
    raw(raw.allocator.Free, allocator_pb2.FreeRequest(allocator=allocator, buffer=buffer.buffer))
    code, message = status_of(lambda: raw(raw.allocator.Free,
                                          allocator_pb2.FreeRequest(allocator=allocator, buffer=buffer.buffer)))
    assert code == grpc.StatusCode.NOT_FOUND and "already released" in message
    raw(raw.factory.ReleaseAllocator, common_pb2.Handle(id=allocator))
    code, _ = status_of(lambda: raw(raw.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=8)))
    assert code == grpc.StatusCode.NOT_FOUND


def test_negative_and_absurd_allocation_sizes(raw, setup):
    allocator, _, _ = setup
    code, message = status_of(lambda: raw(raw.allocator.Alloc,
                                          allocator_pb2.AllocRequest(allocator=allocator, nbytes=-5)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "-5" in message
    code, message = status_of(lambda: raw(raw.allocator.Alloc,
                                          allocator_pb2.AllocRequest(allocator=allocator, nbytes=1 << 62)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit" in message


def test_slices_outside_their_region(raw, setup, served):
    allocator, buffer, transfer = setup
    region = buffer.shm.region
    size = raw(raw.allocator.GetStats, common_pb2.Handle(id=allocator)).stats["TotalAllocated"]
    dst = [common_pb2.TensorRef(desc=desc(4), buffer=buffer.buffer)]
    cases = [
        (common_pb2.ShmSlice(region=region, offset=size, nbytes=16), grpc.StatusCode.OUT_OF_RANGE),
        (common_pb2.ShmSlice(region=region, offset=size - 8, nbytes=16), grpc.StatusCode.OUT_OF_RANGE),
        (common_pb2.ShmSlice(region=region, offset=(1 << 63) - 8, nbytes=16), grpc.StatusCode.OUT_OF_RANGE),
        (common_pb2.ShmSlice(region=region, offset=-16, nbytes=16), grpc.StatusCode.INVALID_ARGUMENT),
        (common_pb2.ShmSlice(region=region, offset=0, nbytes=12), grpc.StatusCode.INVALID_ARGUMENT),
        (common_pb2.ShmSlice(region=region + 1000, offset=0, nbytes=16), grpc.StatusCode.NOT_FOUND),
    ]
    for shm, expected in cases:
        code, message = status_of(lambda: copy(raw, transfer, [common_pb2.TensorRef(desc=desc(4), shm=shm)], dst))
        assert code == expected, (shm, message)
        assert_reveals_nothing(message, served, raw)
    ok = common_pb2.ShmSlice(region=region, offset=size - 16, nbytes=16)
    copy(raw, transfer, [common_pb2.TensorRef(desc=desc(4), shm=ok)], dst)  # the last 16 bytes are fine


def test_descriptions_that_do_not_fit(raw, setup):
    _, buffer, transfer = setup
    into_buffer = [common_pb2.TensorRef(desc=desc(100), buffer=buffer.buffer)]
    cases = [
        ([common_pb2.TensorRef(desc=desc(100), inline=b"\0" * 400)], into_buffer, "does not fit its buffer"),
        ([common_pb2.TensorRef(desc=desc(4), inline=b"\0" * 15)],
         [common_pb2.TensorRef(desc=desc(4), buffer=buffer.buffer)], "15 inline bytes"),
        ([common_pb2.TensorRef(desc=desc(2, -3), inline=b"")], into_buffer, "negative dimension"),
        ([common_pb2.TensorRef(desc=desc(1 << 40, 1 << 40), inline=b"")], into_buffer, "more than any tensor"),
        ([common_pb2.TensorRef(desc=desc(1, elem_type=TensorProto.STRING), inline=b"")], into_buffer, "STRING"),
        ([common_pb2.TensorRef(desc=desc(1, elem_type=999), inline=b"")], into_buffer, "999"),
        ([common_pb2.TensorRef(desc=desc(4))], into_buffer, "says nowhere"),
        ([common_pb2.TensorRef(desc=desc(4), inline=b"\0" * 16)],
         [common_pb2.TensorRef(desc=desc(4), inline=b"\0" * 16)], "cannot be a destination"),
        ([common_pb2.TensorRef(desc=desc(4), inline=b"\0" * 16)], [], "1 sources but 0 destinations"),
        ([common_pb2.TensorRef(desc=desc(4), inline=b"\0" * 16)],
         [common_pb2.TensorRef(desc=desc(4, elem_type=TensorProto.INT32), buffer=buffer.buffer)],
         "source is float32[4] but destination is int32[4]"),
        ([common_pb2.TensorRef(desc=desc(4), inline=b"\0" * 16)],
         [common_pb2.TensorRef(desc=desc(2, 2), buffer=buffer.buffer)],
         "source is float32[4] but destination is float32[2, 2]"),
    ]
    for src, dst, expected in cases:
        code, message = status_of(lambda: copy(raw, transfer, src, dst))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, message
        assert expected in message


def test_bad_models(raw):
    ep = raw(raw.factory.CreateEp, factory_pb2.CreateEpRequest(device_indices=[0])).id
    code, message = status_of(lambda: raw(raw.ep.GetCapability, ep_pb2.GetCapabilityRequest(
        ep=ep, model=ep_pb2.ModelRef(model=b"\x08\x07this is not onnx\xff"))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid ONNX model" in message
    code, message = status_of(lambda: raw(raw.ep.GetCapability, ep_pb2.GetCapabilityRequest(
        ep=ep, model=ep_pb2.ModelRef(sha256="00" * 32))))
    assert code == grpc.StatusCode.NOT_FOUND and "send it inline" in message


def test_bytes_that_are_not_a_message(raw):
    method = raw.channel.unary_unary("/ephost.v1.Allocator/Alloc", request_serializer=None,
                                     response_deserializer=None)
    code, _ = status_of(lambda: method(b"\xff\xff\xff\xff", timeout=10, metadata=raw.metadata))
    assert code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)


def test_stream_misuse(raw):
    stream = raw(raw.factory.CreateSyncStreamForDevice, factory_pb2.CreateSyncStreamRequest()).id
    notification = raw(raw.stream.CreateNotification, common_pb2.Handle(id=stream)).id
    code, message = status_of(lambda: raw(raw.stream.WaitOnHost,
                                          stream_pb2.WaitOnHostRequest(notification=notification)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "never activated" in message
    code, _ = status_of(lambda: raw(raw.stream.WaitOnDevice,
                                    stream_pb2.WaitOnDeviceRequest(notification=notification, stream=notification)))
    assert code == grpc.StatusCode.NOT_FOUND
    raw(raw.stream.Release, common_pb2.Handle(id=stream))
    code, _ = status_of(lambda: raw(raw.stream.Flush, common_pb2.Handle(id=stream)))
    assert code == grpc.StatusCode.NOT_FOUND


def test_region_export_is_checked(raw, setup):
    from ephost.fdshare import fetch_descriptor
    import ephost
    allocator, buffer, _ = setup
    code, _ = status_of(lambda: raw(raw.worker.ExportRegion, worker_pb2.ExportRegionRequest(region=99999)))
    assert code == grpc.StatusCode.NOT_FOUND
    private = raw(raw.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest()).allocator
    raw(raw.allocator.Alloc, allocator_pb2.AllocRequest(allocator=private, nbytes=8))
    # a ticket works once, and only once
    ticket = raw(raw.worker.ExportRegion, worker_pb2.ExportRegionRequest(region=buffer.shm.region)).ticket
    fd, size = fetch_descriptor(raw.hello.fd_socket, ticket)
    import os
    os.close(fd)
    assert size > 0
    with pytest.raises(ephost.EpPermissionDenied):
        fetch_descriptor(raw.hello.fd_socket, ticket)
    with pytest.raises(ephost.EpPermissionDenied):
        fetch_descriptor(raw.hello.fd_socket, b"\0" * 32)


def test_unknown_client_is_a_structured_reason_and_a_typed_error(raw, served):
    """A forged or forgotten client id says so in the status's trailing metadata (not only in its text), and the
    client decodes it as EpUnknownClient, which supervision acts on by saying Hello again."""
    from ephost import wire
    from ephost.client.connection import WorkerConnection
    from ephost.errors import EpFailedPrecondition, EpUnknownClient
    with pytest.raises(grpc.RpcError) as info:
        raw.factory.CreateEp(factory_pb2.CreateEpRequest(), timeout=10, metadata=((wire.CLIENT_ID_KEY, "forged"),))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (wire.REASON_KEY, wire.REASON_UNKNOWN_CLIENT) in tuple(info.value.trailing_metadata())
    with pytest.raises(grpc.RpcError) as info:  # no id at all is another precondition, without that reason
        raw.factory.CreateEp(factory_pb2.CreateEpRequest(), timeout=10)
    assert wire.REASON_KEY not in dict(info.value.trailing_metadata() or ())
    conn = WorkerConnection(served.address, shared_memory=False)
    try:
        conn.call(conn.worker.Goodbye, common_pb2.Empty())  # the worker forgets this client
        with pytest.raises(EpUnknownClient) as typed:
            conn.call(conn.factory.CreateEp, factory_pb2.CreateEpRequest())
        assert isinstance(typed.value, EpFailedPrecondition) and typed.value.reason == wire.REASON_UNKNOWN_CLIENT
    finally:
        conn.close()


def test_streams_are_counted_and_bounded_like_every_call(raw, setup):
    """Allocator.Read goes through the same accounting as unary calls: it is counted in the worker's stats."""
    allocator, buffer, _ = setup
    before = raw(raw.worker.GetStats, common_pb2.Empty()).methods["Allocator/Read"].calls
    chunks = list(raw(raw.allocator.Read, allocator_pb2.ReadRequest(allocator=allocator, buffer=buffer.buffer,
                                                                    nbytes=64, chunk_bytes=16)))
    assert [len(c.data) for c in chunks] == [16] * 4
    assert raw(raw.worker.GetStats, common_pb2.Empty()).methods["Allocator/Read"].calls == before + 1
    code, message = status_of(lambda: list(raw(raw.allocator.Read, allocator_pb2.ReadRequest(
        allocator=allocator, buffer=buffer.buffer, nbytes=65))))
    assert code == grpc.StatusCode.OUT_OF_RANGE and "65 bytes" in message


# --- issue 15: bad input gets a typed status, never INTERNAL ------------------------------------------

def test_inputs_that_used_to_fail_inside_the_worker_get_a_status_that_says_why(raw, setup, served):
    _, buffer, transfer = setup
    into = [common_pb2.TensorRef(desc=desc(4), buffer=buffer.buffer)]
    inline = [common_pb2.TensorRef(desc=desc(4), inline=b"\0" * 16)]
    cases = [
        (lambda: copy(raw, transfer, [common_pb2.TensorRef(desc=desc(*[1] * 65), inline=b"\0" * 4)], into),
         grpc.StatusCode.INVALID_ARGUMENT, "rank 65"),
        (lambda: copy(raw, transfer, [common_pb2.TensorRef(desc=desc(1 << 62, 1 << 62, 0), inline=b"")], into),
         grpc.StatusCode.INVALID_ARGUMENT, "more bytes than any tensor"),
        (lambda: copy(raw, transfer, inline,
                      [common_pb2.TensorRef(desc=desc(1 << 42), reply=common_pb2.InlineReply())]),
         grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than a message"),
        (lambda: raw(raw.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest(device_mem_type=7)),
         grpc.StatusCode.INVALID_ARGUMENT, "device_mem_type 7"),
        (lambda: raw(raw.transfer.CanCopy, data_transfer_pb2.CanCopyRequest(
            data_transfer=transfer, src=common_pb2.MemoryInfo(device_type=2147483647))),
         grpc.StatusCode.INVALID_ARGUMENT, "device_type 2147483647"),
        (lambda: raw(raw.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest(
            options={"arena.initial_chunk_size_bytes": str(1 << 70)})),
         grpc.StatusCode.RESOURCE_EXHAUSTED, "arena.initial_chunk_size_bytes"),
        (lambda: raw(raw.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest(
            options={"arena.max_mem": str(1 << 70)})), grpc.StatusCode.INVALID_ARGUMENT, "arena.max_mem"),
    ]
    for call, expected, words in cases:
        code, message = status_of(call)
        assert code == expected, message
        assert words in message
        assert_reveals_nothing(message, served, raw)


def test_wait_on_host_with_an_absurd_timeout(raw):
    stream = raw(raw.factory.CreateSyncStreamForDevice, factory_pb2.CreateSyncStreamRequest()).id
    notification = raw(raw.stream.CreateNotification, common_pb2.Handle(id=stream)).id
    for timeout in (float("nan"), float("inf"), -1.0):
        code, message = status_of(lambda: raw(raw.stream.WaitOnHost, stream_pb2.WaitOnHostRequest(
            notification=notification, timeout_s=timeout)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in message
    raw(raw.stream.Activate, common_pb2.Handle(id=notification))
    raw(raw.stream.WaitOnHost, stream_pb2.WaitOnHostRequest(notification=notification, timeout_s=1e308))


def test_bytes_that_are_not_a_message_are_an_invalid_argument(raw):
    for path in ("/ephost.v1.Allocator/Alloc", "/ephost.v1.Ep/Compute"):
        method = raw.channel.unary_unary(path)
        code, message = status_of(lambda: method(b"\xff\xff\xff\xff", timeout=10, metadata=raw.metadata))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in message
    write = raw.channel.stream_unary("/ephost.v1.Allocator/Write")
    code, _ = status_of(lambda: write(iter([b"\xff\xff"]), timeout=10, metadata=raw.metadata))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_single_allocation_is_capped_by_the_worker(worker):
    from helpers import RawClient
    w = worker("--ep", "reference", "--max-alloc-mb", "8")
    client = RawClient(w.address)
    try:
        allocator = client(client.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest()).allocator
        code, message = status_of(lambda: client(client.allocator.Alloc, allocator_pb2.AllocRequest(
            allocator=allocator, nbytes=9 << 20)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-alloc-mb" in message
        assert client(client.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=8 << 20)).buffer
    finally:
        client.close()


# --- issue 15: semantics ------------------------------------------------------------------------------

def _compiled(raw):
    from models import chain
    ep = raw(raw.factory.CreateEp, factory_pb2.CreateEpRequest(device_indices=[0])).id
    model = chain(["Relu"]).SerializeToString()
    infos = raw(raw.ep.Compile, ep_pb2.CompileRequest(ep=ep, model=ep_pb2.ModelRef(model=model), graphs=[
        ep_pb2.FusedGraph(name="p", nodes=["n0_Relu"], inputs=["x"], outputs=["y"])] * 2)).node_compute_infos
    return ep, list(infos)


def _compute(raw, info):
    x = common_pb2.Value(tensor=common_pb2.TensorRef(desc=desc(4), inline=b"\0" * 16))
    return raw(raw.ep.Compute, ep_pb2.ComputeRequest(node_compute_info=info, inputs=[x]))


def test_compute_after_release_ep_is_not_found(raw):
    ep, (info, _) = _compiled(raw)
    assert len(_compute(raw, info).outputs) == 1
    raw(raw.factory.ReleaseEp, common_pb2.Handle(id=ep))
    code, message = status_of(lambda: _compute(raw, info))
    assert code == grpc.StatusCode.NOT_FOUND and "compute info" in message


def test_release_node_compute_infos_is_all_or_nothing(raw):
    ep, (a, b) = _compiled(raw)
    code, _ = status_of(lambda: raw(raw.ep.ReleaseNodeComputeInfos, ep_pb2.ReleaseNodeComputeInfosRequest(
        ep=ep, node_compute_infos=[a, 987654])))
    assert code == grpc.StatusCode.NOT_FOUND
    assert len(_compute(raw, a).outputs) == 1, "a valid compute info was dropped by a call that failed"
    other_ep, (c, _) = _compiled(raw)
    code, _ = status_of(lambda: raw(raw.ep.ReleaseNodeComputeInfos, ep_pb2.ReleaseNodeComputeInfosRequest(
        ep=ep, node_compute_infos=[a, c])))
    assert code == grpc.StatusCode.NOT_FOUND  # c belongs to another EP
    assert len(_compute(raw, c).outputs) == 1
    raw(raw.ep.ReleaseNodeComputeInfos, ep_pb2.ReleaseNodeComputeInfosRequest(ep=ep, node_compute_infos=[a, b]))
    assert status_of(lambda: _compute(raw, a))[0] == grpc.StatusCode.NOT_FOUND


def test_a_fused_graph_naming_nodes_the_model_lacks_is_invalid(raw):
    """Found by the fast-lane fuzz (seed 110): a Compile whose fused graph names a node the model does not have
    (or none) was an INTERNAL KeyError inside the EP; it is the caller's mistake, said so."""
    from models import chain
    ep = raw(raw.factory.CreateEp, factory_pb2.CreateEpRequest(device_indices=[0])).id
    for model, nodes in ((b"", [""]), (chain(["Relu"]).SerializeToString(), ["n0_Relu", "n9_Nope"]),
                         (chain(["Relu"]).SerializeToString(), [])):
        code, message = status_of(lambda: raw(raw.ep.Compile, ep_pb2.CompileRequest(
            ep=ep, model=ep_pb2.ModelRef(model=model),
            graphs=[ep_pb2.FusedGraph(name="p", nodes=nodes, inputs=["x"], outputs=["y"])])))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "fused graph 'p'" in message, message


def test_a_node_name_that_is_not_utf8_is_invalid_argument_naming_the_node(raw):
    """A model whose node name is not valid UTF-8 (ONNX's proto2 messages parse it, as bytes) was an INTERNAL
    UnicodeDecodeError from GetCapability: the client's bad input, said so, naming the node."""
    from models import chain
    data = chain(["Relu"]).SerializeToString()
    assert data.count(b"n0_Relu") == 1
    data = data.replace(b"n0_Relu", b"n0_\xff\xfelu")  # as long: the lengths before it hold
    ep = raw(raw.factory.CreateEp, factory_pb2.CreateEpRequest(device_indices=[0])).id
    for request in (ep_pb2.GetCapabilityRequest(ep=ep, model=ep_pb2.ModelRef(model=data)),
                    ep_pb2.CompileRequest(ep=ep, model=ep_pb2.ModelRef(model=data), graphs=[
                        ep_pb2.FusedGraph(name="p", nodes=["n0_Relu"], inputs=["x"], outputs=["y"])])):
        call = raw.ep.GetCapability if isinstance(request, ep_pb2.GetCapabilityRequest) else raw.ep.Compile
        code, message = status_of(lambda: raw(call, request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, message
        assert "node 0" in message and "'n0_\ufffd\ufffdlu'" in message and "UTF-8" in message


def test_errors_quote_a_client_string_cut_short(worker, tmp_path):
    """A 5,000-character path, protocol or graph name was echoed whole into the error, which then overflowed
    gRPC's trailer ('metadata size exceeds hard limit', RESOURCE_EXHAUSTED): what an error quotes is cut."""
    from helpers import RawClient
    w = worker("--ep", "reference", "--model-dir", str(tmp_path))
    raw = RawClient(w.address)
    try:
        long = "é" * 5000
        code, message = status_of(lambda: raw(raw.worker.OpenModel, worker_pb2.ModelPath(path=long)))
        assert code == grpc.StatusCode.NOT_FOUND and "(5000 characters)" in message and len(message) < 400
        code, message = status_of(lambda: raw.worker.Hello(worker_pb2.HelloRequest(
            client_name=long, protocol=long, ephost_version=long), timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and message.count("(5000 characters)") == 2
        ep = raw(raw.factory.CreateEp, factory_pb2.CreateEpRequest(device_indices=[0])).id
        code, message = status_of(lambda: raw(raw.ep.Compile, ep_pb2.CompileRequest(
            ep=ep, model=ep_pb2.ModelRef(model=b""), graphs=[ep_pb2.FusedGraph(name=long, nodes=[long])])))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "(5000 characters)" in message and len(message) < 600
        assert w.proc.poll() is None
    finally:
        raw.close()


def test_an_error_leaves_the_worker_without_addresses_shared_memory_names_or_excess():
    from ephost.errors import MESSAGE_BYTES, public_message
    message = public_message("ctypes object at 0x7f3a2b1c0d10 over /memfd:ephost (deleted) and /dev/shm/psm_1234")
    assert "0x7f3a" not in message and "memfd:" not in message and "psm_1234" not in message
    assert message.startswith("ctypes object at 0x")
    long = public_message("é" * 5000)
    assert len(long.encode()) < MESSAGE_BYTES + 40 and long.endswith("(cut from 10000 bytes)")


def _fan_out(n: int) -> bytes:
    """A model of `n` Relu nodes that all read its one input, made as bytes (onnx's helpers take seconds for as
    many): each node is a copy of one with its number in its name and output, appended to the graph as a
    second serialization of the graph field, which protobuf merges into the first."""
    from onnx import helper
    x = helper.make_tensor_value_info("x", FLOAT, [4])
    y = helper.make_tensor_value_info("y0000000", FLOAT, [4])
    base = helper.make_model(helper.make_graph([], "fan", [x], [y]), opset_imports=[helper.make_opsetid("", 18)])
    one = helper.make_node("Relu", ["x"], ["y0000000"], name="n0000000").SerializeToString()
    nodes = b"".join(b"\x0a" + _varint(len(one)) + one.replace(b"0000000", b"%07d" % i) for i in range(n))
    return base.SerializeToString() + b"\x3a" + _varint(len(nodes)) + nodes


def _varint(k: int) -> bytes:
    out = bytearray()
    while True:
        out.append((k & 0x7F) | (0x80 if k > 0x7F else 0))
        k >>= 7
        if not k:
            return bytes(out)


def test_a_huge_model_stops_costing_the_worker_at_the_callers_deadline(raw):
    """GetCapability of a 400,000-node fan-out model took the worker 6.5-8.4 s whatever the caller's deadline:
    the worker stops indexing it once the deadline passes, and records the call as failed (indexed to the end,
    it would record it as answered, or keep the index: then the model is known by its hash)."""
    import hashlib
    import time
    data = _fan_out(400_000)
    ep = raw(raw.factory.CreateEp, factory_pb2.CreateEpRequest(device_indices=[0])).id

    def recorded() -> tuple[int, int]:
        stats = raw(raw.worker.GetStats, common_pb2.Empty()).methods
        method = stats["Ep/GetCapability"] if "Ep/GetCapability" in stats else None
        return (method.calls, method.errors) if method is not None else (0, 0)

    calls, errors = recorded()
    code, _ = status_of(lambda: raw.ep.GetCapability(ep_pb2.GetCapabilityRequest(
        ep=ep, model=ep_pb2.ModelRef(model=data)), metadata=raw.metadata, timeout=1.0))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 60  # (a bound on the wait for the worker's record, not a timing)
    while recorded()[0] == calls:
        assert time.monotonic() < deadline, "the worker never finished the call"
        time.sleep(0.05)
    assert recorded() == (calls + 1, errors + 1)  # stopped at the deadline, not answered
    code, message = status_of(lambda: raw(raw.ep.GetCapability, ep_pb2.GetCapabilityRequest(
        ep=ep, model=ep_pb2.ModelRef(sha256=hashlib.sha256(data).hexdigest()))))
    assert code == grpc.StatusCode.NOT_FOUND, "the worker indexed the model to the end"
