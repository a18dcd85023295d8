"""Sync streams: work queued on a stream runs in order; notifications order work across streams and
against the host."""
import numpy as np
import pytest

import ephost
from ephost import DeviceMemoryType, Tensor

BIG = 64 << 20  # bytes: long enough a copy that a missing wait would be seen


@pytest.fixture
def streams(any_device):
    made = [any_device.create_sync_stream() for _ in range(2)]
    yield made
    for s in made:
        s.release()


def test_factory_is_stream_aware(env):
    for registration in env.registrations():
        assert registration.factory.is_stream_aware()


def test_copies_on_one_stream_run_in_order(env, host_allocator, default_allocator, streams):
    s = streams[0]
    data = np.random.default_rng(0).integers(0, 255, BIG, dtype=np.uint8)
    src = Tensor.from_numpy(data, host_allocator)
    middle = Tensor.empty(data.shape, data.dtype, default_allocator)
    out = Tensor.empty(data.shape, data.dtype, host_allocator)
    out.numpy()[:] = 0
    env.copy_tensors([src], [middle], stream=s)
    env.copy_tensors([middle], [out], stream=s)   # must see the first copy's result
    done = s.create_notification()
    done.activate()
    done.wait_on_host(30)
    assert np.array_equal(out.numpy(), data)


def test_wait_on_device_orders_work_across_streams(env, host_allocator, default_allocator, streams):
    first, second = streams
    big = np.ones(BIG, np.uint8)
    small = np.arange(1000, dtype=np.int32)
    big_src, big_dst = Tensor.from_numpy(big, host_allocator), Tensor.empty(big.shape, big.dtype, default_allocator)
    small_src = Tensor.from_numpy(small, host_allocator)
    small_mid = Tensor.empty(small.shape, small.dtype, default_allocator)
    small_out = Tensor.empty(small.shape, small.dtype, host_allocator)
    small_out.numpy()[:] = -1

    env.copy_tensors([big_src, small_src], [big_dst, small_mid], stream=first)   # slow, then the small one
    ready = first.create_notification()
    ready.activate()
    ready.wait_on_device(second)                                 # second waits for first, on the device side
    env.copy_tensors([small_mid], [small_out], stream=second)
    done = second.create_notification()
    done.activate()
    done.wait_on_host(30)
    np.testing.assert_array_equal(small_out.numpy(), small)


def test_flush_returns_after_queued_work(env, host_allocator, default_allocator, streams):
    data = np.full(BIG // 8, 7, np.int64)
    src, dst = Tensor.from_numpy(data, host_allocator), Tensor.empty(data.shape, data.dtype, host_allocator)
    env.copy_tensors([src], [dst], stream=streams[0])
    streams[0].flush()
    assert (dst.numpy() == 7).all()
    streams[0].on_session_run_end()


def test_copy_to_host_memory_on_a_stream_is_complete_after_sync(env, default_allocator, streams):
    data = np.arange(10_000, dtype=np.float64)
    src = Tensor.from_numpy(data, default_allocator)
    out = np.zeros_like(data)
    env.copy_tensors([src], [Tensor.from_numpy(out)], stream=streams[0])
    streams[0].flush()
    np.testing.assert_array_equal(out, data)


def test_waiting_on_a_notification_never_activated_is_an_error(streams):
    n = streams[0].create_notification()
    with pytest.raises(ephost.EpFailedPrecondition, match="never activated"):
        n.wait_on_host(1)
    with pytest.raises(ephost.EpFailedPrecondition, match="never activated"):
        n.wait_on_device(streams[1])


def test_a_stream_of_another_ep_is_refused(env, ref_device, local_device):
    a = env.create_shared_allocator(ref_device, DeviceMemoryType.HOST_ACCESSIBLE)
    stream = local_device.create_sync_stream()
    try:
        t = Tensor.empty((4,), np.float32, a)
        with pytest.raises(ephost.EpInvalidArgument, match="stream belongs"):
            env.copy_tensors([Tensor.from_numpy(np.ones(4, np.float32))], [t], stream=stream)
    finally:
        stream.release()
        env.release_shared_allocator(ref_device, DeviceMemoryType.HOST_ACCESSIBLE)


def test_released_stream_is_gone(any_device):
    s = any_device.create_sync_stream()
    s.release()
    with pytest.raises((ephost.EpNotFound, ephost.EpFailedPrecondition)):
        s.create_notification().activate()
