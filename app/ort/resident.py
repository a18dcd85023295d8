"""Copies of ORT's tensors kept in the worker's memory from one Compute to the next: a decoder's KV cache.

onnxruntime-genai keeps the KV cache in its own memory (an EP it does not know gets its CPU allocator) and hands
it to every step's Compute whole: as the past, and with its shared buffer as the present output too, in the same
memory. Sent whole every step, the bytes a token costs grow with the context. Instead the bridge keeps, in the
worker's shared memory, a copy of each large tensor a Compute wrote into ORT's memory, by the address of ORT's
tensor. A later Compute given ORT's tensor at that address sends only the 64-byte chunks that differ from the copy
(none, where nothing but the bridge wrote it), and the worker reads the copy by handle; after the Compute, only the
chunks of the worker's result that differ from ORT's tensor are copied into it.

Chunks are compared, never trusted: the bridge cannot see who else wrote ORT's memory between two Computes, so
each side is read whole (at memory speed) and only what changed is copied and counted. A copy belongs to one
worker: after a restart the next Compute sends the tensor whole again.
"""
from __future__ import annotations

import ctypes
import logging
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from ctypes import c_size_t, c_void_p
from typing import TYPE_CHECKING, Callable, Hashable

import numpy as np

from ephost.client.handles import owned
from ephost.errors import EpError
from ephost.memory import Buffer
from ephost.tensor import Tensor

if TYPE_CHECKING:
    from ephost.client.environment import Registration

log = logging.getLogger(__name__)

MIN_BYTES = 4096  # smaller tensors travel inline with the call: a buffer and its compare would cost more
LIMIT_BYTES = 1 << 30  # worker memory the copies of one registration may hold; the least recently used go first


_UNREAD = object()  # a value not read yet
_JOB = struct.Struct("@PPNN")  # ephost_sync_t: dst, src, nbytes, copied


class Sync:
    """The shim's `ephost_ort_sync`: dst made equal to src by copying the 64-byte chunks that differ."""

    def __init__(self, shim: ctypes.CDLL):
        self._sync = shim.ephost_ort_sync
        self._sync.restype = c_size_t
        self._sync.argtypes = [c_void_p, c_void_p, c_size_t]
        self._many = shim.ephost_ort_sync_many
        self._many.restype = None
        self._many.argtypes = [c_void_p, c_size_t]
        self._local = threading.local()  # per thread: the jobs `many` hands over, and their address

    def __call__(self, dst: int, src: int, nbytes: int) -> int:
        """The bytes copied, of the `nbytes` at each address."""
        return self._sync(dst, src, nbytes)

    def many(self, jobs: list[tuple[int, int, int]]) -> list[int]:
        """Each (dst, src, nbytes) synced, in one call into the shim; the bytes each copied."""
        local = self._local
        room = getattr(local, "room", None)
        if room is None or len(room) < len(jobs) * _JOB.size:
            room = local.room = bytearray(max(len(jobs), 8) * _JOB.size)
            # (a bytearray's memory stays where it is while it is not resized)
            local.at = ctypes.addressof((ctypes.c_char * len(room)).from_buffer(room))
        pack = _JOB.pack_into
        for k, (dst, src, nbytes) in enumerate(jobs):
            pack(room, k * _JOB.size, dst, src, nbytes, 0)
        self._many(local.at, len(jobs))
        return [copied for *_, copied in _JOB.iter_unpack(memoryview(room)[:len(jobs) * _JOB.size])]


@dataclass(eq=False)
class _Copy:
    buffer: Buffer
    view: np.ndarray  # the buffer's bytes, mapped here (the view keeps the mapping)
    size: int  # the bytes of the tensor it copies (the buffer may have room for more)
    address: int = 0  # where the view's bytes lie

    def __post_init__(self) -> None:
        self.address = self.view.ctypes.data


class KeptCopies:
    """One registration's copies, each under one key: the address of ORT's tensor it copies, or a partition's
    input position. Thread-safe; a Compute brings in and out the tensors of its own call (two calls at once on one
    tensor would race in ORT already)."""

    def __init__(self, registration: Callable[[], "Registration | None"], sync: Sync,
                 limit: int = LIMIT_BYTES):
        self._registration, self._sync, self.limit = registration, sync, limit
        self._copies: OrderedDict[Hashable, _Copy] = OrderedDict()  # least recently used first
        self._keys: dict[int, Hashable] = {}  # id(buffer) -> the key its copy is under
        self._bytes = 0
        # ORT's memory the last Compute of a partition wrote each large output into: address -> (partition, output)
        self._writers: dict[int, tuple["PartitionCopies", int]] = {}
        self._wrote: dict[tuple["PartitionCopies", int], int] = {}  # (partition, output) -> where it wrote last
        self._lock = threading.Lock()  # guards _copies, _keys, _bytes, _writers and _wrote

    @property
    def nbytes(self) -> int:
        """Worker memory the copies hold."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._copies)

    def bring_in(self, wanted: list[tuple[Hashable, int, int]], exact: bool = True) \
            -> list[tuple[Buffer, int] | None]:
        """For each (key, address, nbytes): the worker's copy kept under `key`, its first bytes made equal to ORT's
        `nbytes` at `address` (all of them in one sync), and the bytes that took; None where there is none (or it
        is a dead worker's, or copies a tensor of another size: `exact`, or has no room)."""
        with self._lock:
            found = [self._copies.get(key) for key, _, _ in wanted]
            for (key, _, _), copy in zip(wanted, found):
                if copy is not None:
                    self._copies.move_to_end(key)  # the most recently used
        jobs = []
        conn = _UNREAD
        for k, ((key, address, nbytes), copy) in enumerate(zip(wanted, found)):
            if copy is None:
                continue
            if conn is _UNREAD:
                conn = self._conn()
            if conn is None or copy.buffer.owner is not conn or \
                    (copy.size != nbytes if exact else copy.buffer.nbytes < nbytes):
                self._take(key, None)
                found[k] = None
                continue
            jobs.append((copy.address, address, nbytes))
        if not jobs:
            return [None] * len(wanted)
        copied = iter(self._sync.many(jobs))
        made: list[tuple[Buffer, int] | None] = []
        for (_, _, nbytes), copy in zip(wanted, found):
            if copy is None:
                made.append(None)
                continue
            copy.size = nbytes
            made.append((copy.buffer, next(copied)))
        return made

    def bring_in_growing(self, key: Hashable, address: int, nbytes: int) -> tuple[Buffer, int] | None:
        """As bring_in, for an input that grows from Compute to Compute (a decoder's attention mask, a token
        longer every step): where there is no copy with room for it, a new one with room to double, the whole
        tensor copied in. None where the worker gives no buffer."""
        made = self.bring_in([(key, address, nbytes)], exact=False)[0]
        if made is not None:
            return made
        registration = self._registration()
        try:
            buffer = registration.session_allocator().alloc(2 * nbytes)
        except (AttributeError, EpError) as e:  # closing, restarting or out of memory: sent as it is
            log.debug("no buffer for a growing input's copy: %s", e)
            return None
        view = buffer.host_view()
        if view is None:
            self._free([buffer])
            return None
        copy = _Copy(buffer, view, nbytes)
        ctypes.memmove(copy.address, address, nbytes)
        self._put(key, copy)
        return buffer, nbytes

    def bring_out(self, results: list[tuple[int, int, Buffer]]) -> list[int]:
        """For each (address, nbytes, buffer): ORT's `nbytes` at `address` made equal to the worker's result in
        `buffer` (mapped here), which becomes the copy of them (under that key alone); the bytes copied. Results
        written in place into their copy are synced in one call."""
        with self._lock:
            found = [self._copies.get(address) for address, _, _ in results]
            for (address, _, buffer), copy in zip(results, found):
                if copy is not None and copy.buffer is buffer:  # written in place: the copy it is already
                    self._copies.move_to_end(address)
        jobs = []
        for (address, nbytes, buffer), copy in zip(results, found):
            if copy is not None and copy.buffer is buffer:
                copy.size = nbytes
                jobs.append((address, copy.address, nbytes))
        copied = iter(self._sync.many(jobs) if jobs else ())
        made = []
        for (address, nbytes, buffer), copy in zip(results, found):
            if copy is not None and copy.buffer is buffer:
                made.append(next(copied))
                continue
            copy = _Copy(buffer, buffer.host_view(), nbytes)
            made.append(self._sync(address, copy.address, nbytes))
            old = self._take(address, None)
            if old is not None and old.buffer is not buffer:
                self._free([old.buffer])
            self._put(address, copy)
        return made

    def written(self, partition: "PartitionCopies", outputs: list[tuple[int, int]]) -> None:
        """Partition `partition` wrote each (address, o) of `outputs`, its output `o` into ORT's memory at
        `address` (its last write of `o`)."""
        with self._lock:
            for address, o in outputs:
                last = self._wrote.get((partition, o))
                if last is not None and last != address and self._writers.get(last) == (partition, o):
                    del self._writers[last]
                self._wrote[(partition, o)] = address
                self._writers[address] = (partition, o)

    def forget_writer(self, partition: "PartitionCopies") -> None:
        """A released partition's writes are forgotten."""
        with self._lock:
            for key in [k for k in self._wrote if k[0] is partition]:
                address = self._wrote.pop(key)
                if self._writers.get(address) == key:
                    del self._writers[address]

    def read_back(self, address: int) -> None:
        """A Compute was given ORT's memory at `address` as an input: the output last written there is read back
        (genai's present as the next past), and its partition keeps it in the worker from now on."""
        writer = self._writers.get(address)
        if writer is not None:
            writer[0].was_read_back(writer[1])

    def forget(self, which: Callable[[Hashable], bool] | None = None) -> None:
        """The copies under the keys `which` says (every copy: the registration closing, say) freed."""
        with self._lock:
            keys = [k for k in self._copies if which is None or which(k)]
            gone = [self._copies.pop(k) for k in keys]
            for copy in gone:
                self._keys.pop(id(copy.buffer), None)
                self._bytes -= copy.buffer.nbytes
        self._free([c.buffer for c in gone])

    # --- bookkeeping ---

    def _conn(self):
        """The connection of the worker a copy must be in to be used: the running one (one that died is waited
        for while it is replaced: the call would wait for it too); None where the registration is gone."""
        link = self._link()
        return link.conn if link is not None else None

    def _take(self, key: Hashable, nbytes: int | None, exact: bool = True) -> _Copy | None:
        """The copy under `key`, out of the table (put back by the caller), where it can still be used for
        `nbytes` (a tensor of that size, or room for it: not `exact`); one that cannot is freed."""
        link = self._link()
        current = link.current if link is not None else None
        with self._lock:
            copy = self._copies.pop(key, None)
            if copy is None:
                return None
            self._keys.pop(id(copy.buffer), None)
            self._bytes -= copy.buffer.nbytes
        if current is None or copy.buffer.owner is not current:
            self._drop_dead(current)
            return None
        if nbytes is not None and (copy.size != nbytes if exact else copy.buffer.nbytes < nbytes):
            self._free([copy.buffer])
            return None
        return copy

    def _put(self, key: Hashable, copy: _Copy) -> None:
        evicted = []
        with self._lock:
            other = self._keys.get(id(copy.buffer))
            if other is not None and other != key:  # one key per copy: it moves (a partition's input became
                self._bytes -= self._copies.pop(other).buffer.nbytes  # the copy of ORT's tensor it wrote)
            self._copies[key] = copy
            self._keys[id(copy.buffer)] = key
            self._bytes += copy.buffer.nbytes
            while self._bytes > self.limit and len(self._copies) > 1:
                _, old = self._copies.popitem(last=False)
                self._keys.pop(id(old.buffer), None)
                self._bytes -= old.buffer.nbytes
                evicted.append(old.buffer)
        self._free(evicted)

    def _drop_dead(self, current) -> None:
        """A copy found in a worker gone (restarted): the others of that worker go too (its memory with it)."""
        with self._lock:
            dead = [k for k, c in self._copies.items() if current is None or c.buffer.owner is not current]
            for k in dead:
                copy = self._copies.pop(k)
                self._keys.pop(id(copy.buffer), None)
                self._bytes -= copy.buffer.nbytes

    def _link(self):
        registration = self._registration()
        return registration.link if registration is not None else None

    def _free(self, buffers: list[Buffer]) -> None:
        registration, link = self._registration(), self._link()
        mine = [b for b in buffers if link is not None and owned(b, link)]
        if not mine:
            return
        try:
            allocator = registration.session_allocator()
            for buffer in mine:
                allocator.free_later(buffer)
        except EpError as e:  # the registration is closing: its worker takes its memory with it
            log.debug("freeing kept copies: %s", e)


class Learned:
    """What one Compute's outputs showed (PartitionCopies.bring_out), for the partition's next Compute."""

    __slots__ = ("aliases",)

    def __init__(self):
        self.aliases: dict[int, int] = {}  # output -> input ORT gave the same memory


class PartitionCopies:
    """What one partition's Computes keep in the worker, for the bridge's Compute (app/ort/ep.py): which inputs
    go as a kept copy, which outputs the worker writes into an input's copy in place, which it leaves in its memory
    to be kept as the copy of ORT's. What its Computes show (an output ORT gave an input's memory; an output whose
    memory a later Compute was given as an input, genai's present as the next past) the next ones use: the same
    partition is called the same way step after step."""

    def __init__(self, kept: KeptCopies, partition: int):
        self.kept, self._partition = kept, partition
        self._last = Learned()
        self._changing: set[int] = set()  # inputs mostly new every Compute: sent as they are
        # (input, thread) -> its bytes the last Compute it had no copy by address (each thread's own: ORT may run
        # the partition on several at once, two generators on one session, each with a mask of its own)
        self._sizes: dict[tuple[int, int], int] = {}
        self._read_back: set[int] = set()  # outputs whose memory a later Compute got as an input

    def bring_in(self, wanted: list[tuple[int, int, int]]) -> dict[int, tuple[Buffer, int]]:
        """The inputs of `wanted` (position, ORT's address, nbytes: MIN_BYTES or more) that go as a copy in the
        worker, brought up to date, by position: the copy of what an earlier Compute wrote there (a KV cache), else
        of what this input was the last time where it grew since (a mask a token longer every step). Left out
        (sent as they are): the others, and those mostly new every time."""
        kept = self.kept
        for _, address, _ in wanted:
            kept.read_back(address)
        brought = {}
        for (i, address, nbytes), made in zip(wanted, kept.bring_in([(a, a, n) for _, a, n in wanted])):
            if made is None and i not in self._changing:
                made = self._bring_in_by_position(i, address, nbytes)
            if made is not None:
                brought[i] = made
        return brought

    def _bring_in_by_position(self, i: int, address: int, nbytes: int) -> tuple[Buffer, int] | None:
        # Kept only for an input that grew since the last Compute (a mask): one of the same size goes as it is,
        # its bytes written while the worker reads the call, which costs less than a compare of both sides first.
        thread = threading.get_ident()
        last = self._sizes.get((i, thread))
        self._sizes[i, thread] = nbytes
        if last is None or nbytes <= last:
            return None
        key = (self._partition, i, thread)  # a thread's own copy: another's sync never rewrites what it reads
        made = self.kept.bring_in([(key, address, nbytes)], exact=False)[0]
        if made is None:
            return self.kept.bring_in_growing(key, address, nbytes)
        if made[1] > nbytes // 2:
            self._changing.add(i)
        return made

    def targets(self, brought: dict[int, Tensor], addresses: list[int], output_at: Callable[[int, tuple], int]) \
            -> dict[int, tuple[Tensor, int]]:
        """The outputs the worker writes into an input's copy, in place, and that input: those ORT gave that
        input's memory the Compute before and gives it again (`output_at(o, shape)` makes ORT's output o, of the
        input's shape, and says where it lies), as ORT's own kernel would write them (genai's shared
        past/present)."""
        into = {}
        for o, i in self._last.aliases.items():
            tensor = brought.get(i)
            if tensor is None:
                continue
            try:
                where = output_at(o, tensor.shape)
            except EpError:  # ORT holds that output with another shape this time: made later, as it comes back
                continue
            if where == addresses[i]:
                into[o] = (tensor, i)
        return into

    def keep(self, into: dict[int, Tensor]) -> tuple[int, ...]:
        """The outputs the worker leaves in its memory, to be kept as the copy of ORT's they are brought out into:
        those whose memory a later Compute was given (not the logits, written and read by the application)."""
        if not self._read_back:
            return ()
        return tuple(sorted(self._read_back.difference(into)))

    def was_read_back(self, o: int) -> None:
        self._read_back.add(o)

    def bring_out_in_place(self, learned: Learned, written: list[tuple[int, int, int, Tensor]]) -> int:
        """The outputs of `written` (o, i, address, out), each of which the worker wrote in place into the copy of
        input `i` (targets), brought out into ORT's memory at `address` (that input's, given to the output too):
        only what changed; the bytes copied."""
        for o, i, _, _ in written:
            learned.aliases[o] = i
        self.kept.written(self, [(address, o) for o, _, address, _ in written])
        return sum(self.kept.bring_out([(address, out.nbytes, out.buffer) for _, _, address, out in written]))

    def bring_out(self, learned: Learned, o: int, address: int, nbytes: int, out, addresses: list[int]) \
            -> int | None:
        """Output `o` into ORT's memory at `address`: brought out of the worker's buffer (only what changed) and
        kept as the copy of that memory; the bytes copied, or None where it is not one to keep (small, or not in
        the worker's memory: written the plain way)."""
        if address in addresses:
            learned.aliases[o] = addresses.index(address)
        if nbytes < MIN_BYTES:
            return None
        self.kept.written(self, [(address, o)])
        if not isinstance(out, Tensor) or out.buffer is None:
            return None
        copied = self.kept.bring_out([(address, nbytes, out.buffer)])[0]
        out.detach_buffer()  # the kept copy's now
        return copied

    def done(self, learned: Learned) -> None:
        """A Compute's outputs are all in ORT's memory: what they showed is what the next Compute goes by."""
        self._last = learned

    def release(self) -> None:
        """The partition is released: the copies of its inputs go (those of ORT's memory stay: another partition
        may be given that memory)."""
        partition = self._partition
        self.kept.forget(lambda key: type(key) is tuple and key[0] == partition)
        self.kept.forget_writer(self)
