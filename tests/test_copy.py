"""Tensors copied host -> EP memory -> host, in and out of process, for every numpy-representable ONNX type."""
import numpy as np
import pytest

import ephost
from ephost import DeviceMemoryType, Tensor

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
          np.uint32, np.uint64, np.bool_, np.complex64, np.complex128]


def sample(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def round_trip(env, data, allocator):
    on_device = Tensor.empty(data.shape, data.dtype, allocator)
    back = Tensor.from_numpy(np.zeros_like(data))
    env.copy_tensors([Tensor.from_numpy(data)], [on_device])
    env.copy_tensors([on_device], [back])
    return on_device, back.numpy()


@pytest.fixture
def allocators(host_allocator, default_allocator):
    return {DeviceMemoryType.HOST_ACCESSIBLE: host_allocator, DeviceMemoryType.DEFAULT: default_allocator}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (2, 3, 5)], ids=str)
@pytest.mark.parametrize("mem", list(DeviceMemoryType), ids=lambda m: m.name)
def test_round_trip(env, allocators, mem, dtype, shape):
    allocator = allocators[mem]
    data = sample(shape, dtype)
    on_device, back = round_trip(env, data, allocator)
    assert back.dtype == data.dtype and back.shape == data.shape
    np.testing.assert_array_equal(back, data)
    assert on_device.shape == shape and on_device.dtype == np.dtype(dtype)


def test_256_mib_round_trip(env, host_allocator, default_allocator):
    data = sample((64, 1 << 20), np.float32, seed=1)  # 256 MiB
    for allocator in (host_allocator, default_allocator):
        _, back = round_trip(env, data, allocator)
        assert np.array_equal(back, data)


def test_host_accessible_memory_is_read_in_place(env, host_allocator):
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = Tensor.from_numpy(data, host_allocator)
    view = t.numpy()
    assert view.shape == (3, 4) and np.array_equal(view, data)
    view[1, 1] = 100.0  # writes the EP's memory itself: a copy out sees it
    back = Tensor.from_numpy(np.zeros_like(data))
    env.copy_tensors([t], [back])
    assert back.numpy()[1, 1] == 100.0
    assert t.numpy().base is not None and np.shares_memory(t.numpy(), view)


def test_default_memory_is_not_host_readable(default_allocator):
    t = Tensor.from_numpy(np.ones(4, np.float32), default_allocator)
    with pytest.raises(ephost.EpInvalidArgument, match="cannot read"):
        t.numpy()


def test_from_numpy_without_allocator_wraps_without_copy(env, host_allocator):
    host = np.zeros(5, np.int64)
    wrapped = Tensor.from_numpy(host)
    assert wrapped.numpy() is host and wrapped.memory_info == ephost.HOST_MEMORY
    env.copy_tensors([Tensor.from_numpy(np.arange(5), host_allocator)], [wrapped])
    np.testing.assert_array_equal(host, np.arange(5))


def test_batched_copy_of_many_tensors_in_one_call(env, host_allocator, default_allocator):
    datas = [sample((i + 1, 3), dt, seed=i) for i, dt in enumerate(DTYPES)]
    shared = [Tensor.empty(d.shape, d.dtype, host_allocator) for d in datas]
    private = [Tensor.empty(d.shape, d.dtype, default_allocator) for d in datas]
    backs = [Tensor.from_numpy(np.zeros_like(d)) for d in datas]
    env.copy_tensors([Tensor.from_numpy(d) for d in datas], shared)
    env.copy_tensors(shared, private)          # device to device, inside the EP
    env.copy_tensors(private, backs)
    for d, b in zip(datas, backs):
        np.testing.assert_array_equal(b.numpy(), d)


def test_copy_between_two_workers_goes_through_the_host(env, ref_device, local_device):
    a = env.create_shared_allocator(ref_device, DeviceMemoryType.DEFAULT)
    b = env.create_shared_allocator(local_device, DeviceMemoryType.DEFAULT)
    try:
        data = sample((100,), np.float64)
        src, dst = Tensor.from_numpy(data, a), Tensor.empty((100,), np.float64, b)
        back = Tensor.from_numpy(np.zeros(100))
        env.copy_tensors([src], [dst])
        env.copy_tensors([dst], [back])
        np.testing.assert_array_equal(back.numpy(), data)
    finally:
        env.release_shared_allocator(ref_device, DeviceMemoryType.DEFAULT)
        env.release_shared_allocator(local_device, DeviceMemoryType.DEFAULT)


def test_worker_counts_the_copies_it_makes(env, ref_device):
    allocator = env.create_shared_allocator(ref_device, DeviceMemoryType.DEFAULT)
    try:
        before = env.get_worker_stats("ref")
        data = np.ones(1000, np.uint8)
        t = Tensor.from_numpy(data, allocator)
        env.copy_tensors([t], [Tensor.from_numpy(np.zeros(1000, np.uint8))])
        after = env.get_worker_stats("ref")
        assert after.bytes_inline_in - before.bytes_inline_in == 1000
        assert after.bytes_inline_out - before.bytes_inline_out == 1000
        assert after.copies - before.copies == 2
        assert after.methods["DataTransfer/CopyTensors"].calls - before.methods["DataTransfer/CopyTensors"].calls == 2
    finally:
        env.release_shared_allocator(ref_device, DeviceMemoryType.DEFAULT)


@pytest.mark.parametrize("bad", ["dtype", "shape", "count"])
def test_mismatched_copies_are_refused(env, host_allocator, bad):
    t = Tensor.empty((2, 3), np.float32, host_allocator)
    if bad == "dtype":
        src, dst = [Tensor.from_numpy(np.zeros((2, 3), np.int32))], [t]
    elif bad == "shape":
        src, dst = [Tensor.from_numpy(np.zeros((3, 2), np.float32))], [t]
    else:
        src, dst = [Tensor.from_numpy(np.zeros((2, 3), np.float32))] * 2, [t]
    with pytest.raises(ephost.EpInvalidArgument, match="copy"):
        env.copy_tensors(src, dst)


def test_non_contiguous_arrays_are_refused_clearly():
    with pytest.raises(ephost.EpInvalidArgument, match="contiguous"):
        Tensor.from_numpy(np.zeros((4, 4))[:, ::2])


def test_can_copy_is_the_eps_own_answer(env, any_device):
    registration = env.registration(any_device.registration_name)
    transfer = registration.data_transfer
    own = [registration.memory[any_device.memory_info(t)] for t in DeviceMemoryType]
    gpu = ephost.MemoryInfo("SomeGpu", ephost.HardwareDeviceType.GPU, 0x10de, 0, DeviceMemoryType.DEFAULT)
    for a in own + [ephost.HOST_MEMORY]:
        for b in own + [ephost.HOST_MEMORY]:
            assert transfer.can_copy(a, b)
        assert not transfer.can_copy(a, gpu) and not transfer.can_copy(gpu, a)
