"""Copies of ORT's tensors kept in the worker's memory between Computes (app/ort/resident.py): what keeps a
decoder's KV cache from crossing the bridge whole every token. Against a real worker's shared memory."""
from __future__ import annotations

import ctypes
import os
import signal
import threading

import numpy as np
import pytest

import ephost
import ephost.ort
from ephost.ort.resident import KeptCopies, Sync


@pytest.fixture(scope="module")
def sync():
    return Sync(ctypes.CDLL(ephost.ort.library_path()))


@pytest.fixture
def worker():
    env = ephost.Environment()
    env.register_execution_provider_library("w", "onnxruntime")
    yield env.registration("w")
    env.close()


def result_in_worker(registration, values: np.ndarray):
    """A worker buffer holding `values` (what a Compute leaves there), as the bridge gets it."""
    buffer = registration.session_allocator().alloc(values.nbytes)
    np.copyto(buffer.host_view(), values.reshape(-1).view(np.uint8))
    return buffer


def bring_in(copies, t: np.ndarray):
    """The copy kept for ORT's tensor `t` (by its address), brought up to date."""
    return copies.bring_in([(t.ctypes.data, t.ctypes.data, t.nbytes)])[0]


def test_sync_copies_only_the_chunks_that_differ(sync):
    dst = np.zeros(1000, np.float32)
    src = dst.copy()
    assert sync(dst.ctypes.data, src.ctypes.data, dst.nbytes) == 0
    src[17] = 1.0       # in chunk 1 (floats 16-31)
    src[999] = 2.0      # in the tail (4000 bytes: 62 whole chunks, then 32 bytes)
    assert sync(dst.ctypes.data, src.ctypes.data, dst.nbytes) == 64 + 32
    np.testing.assert_array_equal(dst, src)
    others = [np.zeros(100, np.float32) for _ in range(9)]  # several in one call: more than its first room holds
    src[500] = src[0] = 3.0
    for other in others:
        other[50] = 1.0
    jobs = [(dst.ctypes.data, src.ctypes.data, dst.nbytes)]
    jobs += [(o.ctypes.data, dst.ctypes.data, o.nbytes) for o in others]
    assert sync.many(jobs) == [2 * 64] + [3 * 64] * 9, "in order: the first brings dst up to date for the others"
    np.testing.assert_array_equal(dst, src)
    for other in others:
        np.testing.assert_array_equal(other, src[:100])


def test_a_kept_copy_is_brought_in_with_only_what_changed(worker, sync):
    copies = KeptCopies(lambda: worker, sync)
    kv = np.random.default_rng(0).standard_normal((2, 256, 16)).astype(np.float32)  # ORT's tensor, 32 KiB
    address = kv.ctypes.data
    assert copies.bring_in([(address, address, kv.nbytes)])[0] is None, "nothing kept yet"
    step = kv.copy()
    step[:, 5] = 7.0  # the worker's result: one new row per head
    copied = copies.bring_out([(address, kv.nbytes, result_in_worker(worker, step))])[0]
    assert copied == 2 * 64, "the two changed rows, one chunk each"
    np.testing.assert_array_equal(kv, step)
    buffer, copied = copies.bring_in([(address, address, kv.nbytes)])[0]
    assert copied == 0, "nobody but the bridge wrote ORT's tensor"
    kv[1, 200, 3] = -1.0  # the application writes it
    buffer2, copied = copies.bring_in([(address, address, kv.nbytes)])[0]
    assert buffer2 is buffer and copied == 64
    np.testing.assert_array_equal(buffer.host_view().view(np.float32).reshape(kv.shape), kv)
    assert copies.bring_in([(address, address, 4)])[0] is None, "another size at that address: not a copy of it"
    assert len(copies) == 0


def test_a_growing_input_copies_what_it_grew_by_into_a_copy_with_room(worker, sync):
    """A decoder's attention mask is a token longer every step, in new memory of ORT's every time: its copy is
    kept by the partition's input position with room to double, and each step copies what it grew by."""
    copies = KeptCopies(lambda: worker, sync)
    key = ("partition", 1)
    mask = np.ones((1, 1000), np.int64)
    buffer, copied = copies.bring_in_growing(key, mask.ctypes.data, mask.nbytes)
    assert copied == mask.nbytes and buffer.nbytes == 2 * mask.nbytes
    for n in range(1001, 1010):
        mask = np.ones((1, n), np.int64)
        again, copied = copies.bring_in_growing(key, mask.ctypes.data, mask.nbytes)
        assert again is buffer and copied <= 64, "the new token's chunk"
    np.testing.assert_array_equal(buffer.host_view()[:mask.nbytes].view(np.int64), mask.reshape(-1))
    mask = np.ones((1, 2001), np.int64)  # past its room: a new copy, whole
    bigger, copied = copies.bring_in_growing(key, mask.ctypes.data, mask.nbytes)
    assert bigger is not buffer and copied == mask.nbytes and len(copies) == 1


def test_copies_of_a_worker_that_died_are_dropped(worker, sync):
    copies = KeptCopies(lambda: worker, sync)
    tensors = [np.full(2048, float(i), np.float32) for i in range(3)]
    for t in tensors:
        copies.bring_out([(t.ctypes.data, t.nbytes, result_in_worker(worker, t))])
    assert len(copies) == 3 and copies.nbytes == 3 * 8192
    process = worker.process
    os.kill(process.pid, signal.SIGKILL)
    assert process.exited.wait(10)
    worker.link.wait_noticed(10)
    worker.link.wait_replaced()
    assert bring_in(copies, tensors[0]) is None
    assert len(copies) == 0 and copies.nbytes == 0, "every copy of the dead worker went"


def test_the_least_recently_used_copies_go_past_the_limit(worker, sync):
    copies = KeptCopies(lambda: worker, sync, limit=3 * 8192)
    tensors = [np.full(2048, float(i), np.float32) for i in range(4)]
    for t in tensors[:3]:
        copies.bring_out([(t.ctypes.data, t.nbytes, result_in_worker(worker, t))])
    assert bring_in(copies, tensors[0]) is not None  # used again: the newest now
    copies.bring_out([(tensors[3].ctypes.data, tensors[3].nbytes, result_in_worker(worker, tensors[3]))])
    assert copies.nbytes == 3 * 8192
    assert bring_in(copies, tensors[1]) is None, "the least recently used went"
    for t in (tensors[0], tensors[2], tensors[3]):
        assert bring_in(copies, t)[1] == 0
    copies.forget()
    assert len(copies) == 0 and copies.nbytes == 0


def test_a_released_partition_lets_go_of_its_inputs_copies(worker, sync):
    from ephost.ort.resident import PartitionCopies
    copies = KeptCopies(lambda: worker, sync)
    first, second = PartitionCopies(copies, 1), PartitionCopies(copies, 2)
    masks = [np.ones((1, n), np.int64) for n in (1000, 1001, 1002)]  # a token longer every step
    kv = np.zeros(4096, np.float32)
    for partition in (first, second):
        assert partition.bring_in([(0, masks[0].ctypes.data, masks[0].nbytes)]) == {}, "not grown yet"
        assert partition.bring_in([(0, masks[1].ctypes.data, masks[1].nbytes)])[0][1] == masks[1].nbytes
    copies.bring_out([(kv.ctypes.data, kv.nbytes, result_in_worker(worker, kv))])
    assert len(copies) == 3
    first.release()
    assert len(copies) == 2, "the other partition's input and the copy of ORT's memory stay"
    assert second.bring_in([(0, masks[2].ctypes.data, masks[2].nbytes)])[0][1] <= 64, "the new token's chunk"


def test_each_thread_growing_an_input_has_a_copy_of_its_own(worker, sync):
    """Two of ORT's threads running one partition at once (two generators on one session), each growing its own
    mask: each gets a copy by position of its own, so that one thread's sync never rewrites the copy the other's
    Compute reads in the worker."""
    from ephost.ort.resident import PartitionCopies
    copies = KeptCopies(lambda: worker, sync)
    partition = PartitionCopies(copies, 1)
    first_done, both_done = threading.Event(), threading.Barrier(2)  # (both alive to the end: two thread ids)
    got = {}

    def decode(fill: int, after: threading.Event | None) -> None:
        if after is not None:
            after.wait()
        masks = [np.full((1, n), fill, np.int64) for n in (1000, 1001)]  # a token longer the second step
        assert partition.bring_in([(0, masks[0].ctypes.data, masks[0].nbytes)]) == {}, "not grown yet"
        ((buffer, _),) = partition.bring_in([(0, masks[1].ctypes.data, masks[1].nbytes)]).values()
        got[fill] = buffer, buffer.host_view()[:masks[1].nbytes].view(np.int64).copy()
        first_done.set()
        both_done.wait()

    threads = [threading.Thread(target=decode, args=(1, None)), threading.Thread(target=decode, args=(2, first_done))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[1][0] is not got[2][0] and len(copies) == 2, "a copy for each thread"
    assert (got[1][1] == 1).all() and (got[2][1] == 2).all()
    partition.release()
    assert len(copies) == 0, "both went with the partition"


def test_an_input_of_the_same_size_every_compute_is_sent_as_it_is(worker, sync):
    """An image of the same size every run gets no copy by position: its bytes go with the call (written while
    the worker reads it), which costs less than comparing both sides with a copy before the call goes."""
    from ephost.ort.resident import PartitionCopies
    copies = KeptCopies(lambda: worker, sync)
    partition = PartitionCopies(copies, 1)
    image = np.zeros((1, 3, 64, 64), np.float32)
    for _ in range(3):
        assert partition.bring_in([(0, image.ctypes.data, image.nbytes)]) == {}
    assert len(copies) == 0


def test_an_output_is_kept_in_the_worker_once_its_memory_comes_back_as_an_input(worker, sync):
    """genai's present comes back as the next step's past (its memory given as an input): from then on the worker
    leaves it in its memory to be kept as the copy. Its logits never come back: written the plain way."""
    from ephost.ort.resident import Learned, PartitionCopies
    copies = KeptCopies(lambda: worker, sync)
    partition = PartitionCopies(copies, 1)
    present, logits = np.zeros(4096, np.float32), np.zeros(8192, np.float32)
    learned = Learned()
    for o, t in enumerate((present, logits)):
        assert partition.bring_out(learned, o, t.ctypes.data, t.nbytes, None, []) is None  # (written plainly)
    partition.done(learned)
    assert partition.keep({}) == ()
    partition.bring_in([(0, present.ctypes.data, present.nbytes)])  # the next step's past, in the present's memory
    assert partition.keep({}) == (0,), "the present only"
    partition.release()
    assert len(copies) == 0, "the copy of its input went with the partition"
