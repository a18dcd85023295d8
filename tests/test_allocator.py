"""Shared allocators: create, get, release; alloc and free; an arena that sub-allocates; stats that add up."""
import numpy as np
import pytest

import ephost
from ephost import DeviceMemoryType, Tensor

MiB = 1 << 20


def aligned(n, a=64):
    return (max(n, 1) + a - 1) // a * a


def test_create_get_release(env, any_device):
    info = any_device.memory_info(DeviceMemoryType.HOST_ACCESSIBLE)
    assert env.get_shared_allocator(info) is None
    allocator = env.create_shared_allocator(any_device, DeviceMemoryType.HOST_ACCESSIBLE)
    assert env.get_shared_allocator(info) is allocator
    assert allocator.memory_info == info
    env.release_shared_allocator(any_device, DeviceMemoryType.HOST_ACCESSIBLE)
    assert env.get_shared_allocator(info) is None
    with pytest.raises(ephost.EpNotFound):
        env.release_shared_allocator(any_device, DeviceMemoryType.HOST_ACCESSIBLE)


def test_create_replaces_like_ort(env, any_device):
    first = env.create_shared_allocator(any_device, DeviceMemoryType.DEFAULT)
    second = env.create_shared_allocator(any_device, DeviceMemoryType.DEFAULT)
    assert second is not first
    assert env.get_shared_allocator(second.memory_info) is second
    env.release_shared_allocator(any_device, DeviceMemoryType.DEFAULT)


def test_stats_add_up(host_allocator):
    sizes = [1, 63, 64, 65, 1000, 4096, 0, 3 * MiB + 7]
    buffers = [host_allocator.alloc(n) for n in sizes]
    stats = host_allocator.get_stats()
    assert stats["NumAllocs"] == len(sizes)
    assert stats["InUse"] == sum(aligned(n) for n in sizes)
    assert stats["MaxInUse"] == stats["InUse"]
    assert stats["MaxAllocSize"] == max(sizes)
    assert stats["TotalAllocated"] >= stats["InUse"]
    assert stats["Limit"] >= stats["TotalAllocated"]
    for b in buffers[::2]:
        host_allocator.free(b)
    half = host_allocator.get_stats()
    assert half["InUse"] == sum(aligned(n) for n in sizes[1::2])
    assert half["MaxInUse"] == stats["InUse"]
    for b in buffers[1::2]:
        host_allocator.free(b)
    assert host_allocator.get_stats()["InUse"] == 0


def test_arena_sub_allocates_instead_of_one_region_per_tensor(host_allocator):
    buffers = [host_allocator.alloc(4096) for _ in range(200)]
    stats = host_allocator.get_stats()
    assert stats["NumArenaExtensions"] == 1, "200 small tensors should share one region"
    assert all(b.region is not None for b in buffers), "host-accessible buffers are mapped here"
    assert len({b.region.id for b in buffers}) == 1
    offsets = sorted(b.offset for b in buffers)
    assert all(b - a >= 4096 for a, b in zip(offsets, offsets[1:])), "buffers overlap"
    for b in buffers:
        host_allocator.free(b)


def test_freed_memory_is_reused_and_large_regions_are_given_back(host_allocator):
    a = host_allocator.alloc(1000)
    host_allocator.free(a)
    b = host_allocator.alloc(1000)
    assert b.offset == a.offset
    big = host_allocator.alloc(200 * MiB)
    grown = host_allocator.get_stats()
    assert grown["NumArenaExtensions"] == 2 and grown["TotalAllocated"] >= 200 * MiB
    host_allocator.free(big)
    again = host_allocator.alloc(150 * MiB)  # the emptied region is kept for the next large tensor
    assert host_allocator.get_stats()["NumArenaExtensions"] == 2
    third = host_allocator.alloc(200 * MiB)
    assert host_allocator.get_stats()["NumArenaExtensions"] == 3
    host_allocator.free(again)
    host_allocator.free(third)  # two empty regions: one goes back
    shrunk = host_allocator.get_stats()
    assert shrunk["NumArenaShrinkages"] == 1
    assert shrunk["TotalAllocated"] == grown["TotalAllocated"]
    host_allocator.free(b)


def test_reserve_is_outside_the_arena(host_allocator):
    r = host_allocator.reserve(10_000)
    stats = host_allocator.get_stats()
    assert stats["NumReserves"] == 1 and stats["NumAllocs"] == 0
    assert stats["InUse"] == aligned(10_000)
    host_allocator.free(r)
    assert host_allocator.get_stats()["InUse"] == 0


def test_tensors_allocate_and_free_through_the_allocator(host_allocator):
    t = Tensor.empty((16, 16), np.float32, host_allocator)
    assert t.memory_info == host_allocator.memory_info
    assert host_allocator.get_stats()["InUse"] == 1024
    t.release()
    assert host_allocator.get_stats()["InUse"] == 0
    u = Tensor.empty((8,), np.int64, host_allocator)
    del u  # collected: its buffer goes back, batched off the collecting thread
    assert host_allocator.flush_frees()
    assert host_allocator.get_stats()["InUse"] == 0

    with pytest.raises(ephost.EpInvalidArgument, match="no ONNX tensor element type"):
        Tensor.empty((8,), np.dtype([("a", np.int32)]), host_allocator)  # refused before anything is allocated
    assert host_allocator.get_stats()["NumAllocs"] == 2


def test_a_numpy_view_keeps_its_tensor_alive(host_allocator):
    view = Tensor.from_numpy(np.arange(10, dtype=np.int32), host_allocator).numpy()
    assert host_allocator.get_stats()["InUse"] == 64, "the view pins the tensor, so its memory stays allocated"
    other = Tensor.empty((10,), np.int32, host_allocator)
    other.numpy()[:] = -1
    np.testing.assert_array_equal(view, np.arange(10))
    del view
    other.release()


def test_allocator_options_and_limits(env, any_device):
    allocator = env.create_shared_allocator(any_device, DeviceMemoryType.HOST_ACCESSIBLE,
                                            {"arena.max_mem": str(8 * MiB), "arena.initial_chunk_size_bytes": str(MiB)})
    try:
        a = allocator.alloc(MiB)
        with pytest.raises(ephost.EpResourceExhausted, match="limit"):
            allocator.alloc(8 * MiB)
        assert allocator.get_stats()["Limit"] == 8 * MiB
        allocator.free(a)
    finally:
        env.release_shared_allocator(any_device, DeviceMemoryType.HOST_ACCESSIBLE)
    with pytest.raises(ephost.EpInvalidArgument, match="unknown allocator option"):
        env.create_shared_allocator(any_device, DeviceMemoryType.DEFAULT, {"arena.bogus": "1"})


def test_negative_and_absurd_sizes(host_allocator):
    with pytest.raises(ephost.EpInvalidArgument):
        host_allocator.alloc(-1)
    with pytest.raises(ephost.EpResourceExhausted):
        host_allocator.alloc(1 << 60)
    assert host_allocator.get_stats()["InUse"] == 0
    assert host_allocator.alloc(8) is not None  # still serving


def test_frees_of_collected_tensors_in_quick_succession_go_in_few_calls(env, ref_device, monkeypatch):
    """A loop of runs that each leave a tensor in the worker frees one buffer per run: the free queue lingers a
    moment so that they go together rather than in a Free call each. (The moment is made long here, so that frees
    a millisecond apart stay within it however loaded the machine is.)"""
    import time
    from ephost.client.allocator import FreeQueue
    monkeypatch.setattr(FreeQueue, "LINGER_S", 0.25)
    allocator = env.create_shared_allocator(ref_device, DeviceMemoryType.HOST_ACCESSIBLE)
    try:
        tensors = [Tensor.empty((1024,), np.float32, allocator) for _ in range(10)]
        calls = lambda: env.get_worker_stats("ref").methods["Allocator/Free"].calls  # noqa: E731
        assert allocator.flush_frees()
        before = calls()
        while tensors:
            tensors.pop()  # collected: queued for the free thread
            time.sleep(0.001)
        assert allocator.flush_frees()
        assert allocator.get_stats()["InUse"] == 0
        assert calls() - before <= 5, "ten frees a millisecond apart went in a call each"
    finally:
        env.release_shared_allocator(ref_device, DeviceMemoryType.HOST_ACCESSIBLE)
