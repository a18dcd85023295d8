"""Handles belong to the client that made them; a client's handles go when it says goodbye."""
import grpc
import pytest

from helpers import RawClient
from ephost.v1 import allocator_pb2, common_pb2, factory_pb2, worker_pb2


def test_another_clients_handles_are_not_found(served):
    alice, mallory = RawClient(served.address, "alice"), RawClient(served.address, "mallory")
    try:
        allocator = alice(alice.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest(
            device_mem_type=common_pb2.DEVICE_MEMORY_TYPE_HOST_ACCESSIBLE)).allocator
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


def test_a_client_that_goes_silent_is_released_after_its_lease(worker):
    """A client that vanished without Goodbye (killed, or cut off) does not hold the worker's memory for ever;
    one that keeps renewing (every Environment connected by address does) keeps its handles while idle."""
    import time

    import ephost
    w = worker("--ep", "reference", "--client-lease-s", "1")
    silent, observer = RawClient(w.address, "silent"), RawClient(w.address, "observer")
    try:
        allocator = silent(silent.factory.CreateAllocator, factory_pb2.CreateAllocatorRequest()).allocator
        for _ in range(3):
            silent(silent.allocator.Alloc, allocator_pb2.AllocRequest(allocator=allocator, nbytes=1000))
        with ephost.Environment() as env:
            env.register_execution_provider_library("kept", w.address)
            (device,) = env.get_ep_devices()
            kept = env.create_shared_allocator(device, ephost.DeviceMemoryType.DEFAULT)
            kept.alloc(64)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                observer(observer.worker.Renew, common_pb2.Empty())
                if observer(observer.worker.GetStats, common_pb2.Empty()).buffers_live == 1:
                    break
                time.sleep(0.2)
            stats = observer(observer.worker.GetStats, common_pb2.Empty())
            assert stats.buffers_live == 1, "the silent client's three buffers are gone, the renewing one's stays"
            assert kept.get_stats()["NumAllocs"] == 1
        with pytest.raises(grpc.RpcError) as info:
            silent(silent.allocator.GetStats, common_pb2.Handle(id=allocator))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "lease" in info.value.details()
    finally:
        silent.close()
        observer.close()
