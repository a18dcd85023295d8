"""Handles belong to the client that made them; a client's handles go when it says goodbye."""
import grpc
import pytest

from conftest import RawClient
from ephost.v1 import allocator_pb2, common_pb2, factory_pb2, worker_pb2


def test_another_clients_handles_are_not_found(served):
    alice, mallory = RawClient(served.address, "alice"), RawClient(served.address, "mallory")
    try:
        allocator = alice(alice.factory.CreateAllocator,
                          factory_pb2.CreateAllocatorRequest(device_mem_type=common_pb2.DEVICE_MEMORY_TYPE_HOST_ACCESSIBLE)).allocator
        buffer = alice(alice.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=128))
        probes = [
            (mallory.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=8)),
            (mallory.allocator.GetStats, common_pb2.Handle(id=allocator)),
            (mallory.allocator.Free, allocator_pb2.FreeRequest(allocator=allocator, buffer=buffer.buffer)),
            (mallory.factory.ReleaseAllocator, common_pb2.Handle(id=allocator)),
            (mallory.worker.ExportRegion, worker_pb2.ExportRegionRequest(region=buffer.shm.region)),
        ]
        for method, request in probes:
            with pytest.raises(grpc.RpcError) as info:
                mallory(method, request)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        # alice's handles are untouched by the probing
        assert alice(alice.allocator.GetStats, common_pb2.Handle(id=allocator)).stats["InUse"] == 128
    finally:
        alice.close()
        mallory.close()


def test_goodbye_releases_everything_a_client_made(served):
    client = RawClient(served.address, "leaver")
    observer = RawClient(served.address, "observer")
    try:
        allocator = client(client.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest()).allocator
        for _ in range(3):
            client(client.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=1000))
        before = observer(observer.worker.GetStats, common_pb2.Empty())
        client(client.worker.Goodbye, common_pb2.Empty())
        after = observer(observer.worker.GetStats, common_pb2.Empty())
        assert before.buffers_live - after.buffers_live == 3
        assert before.clients - after.clients == 1
        with pytest.raises(grpc.RpcError) as info:
            client(client.allocator.GetStats, common_pb2.Handle(id=allocator))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        client.close()
        observer.close()
