"""The fast lane's shared slots: a page pair of shared memory per connection, one slot for each direction,
through which a frame that fits one packet passes without a system call at either end while its reader polls.

A socket round trip costs each end a send and a receive in the kernel (a few microseconds each on a virtual
machine; measured here, a polling round trip of small packets 7 µs, through shared memory under 1 µs). The
socket stays: for the ticket, for descriptors, for frames longer than a packet, for end of file when a peer
dies, and to wake a reader that sleeps in the kernel (a one-byte doorbell packet).

A slot (SLOT bytes): at 0 the number of frames written so far, at 8 the last frame's length, at 16 the count of
the last KEPT_WRITING frame whose inputs the writer has written since (READY, set and rung for as a frame's
count is; ephost/fastlane.py), all written by the writer; at 64, on its own cache line, the reader's `asleep`
flag, written by the reader (each a native u64, written through a memoryview: one aligned store, never seen
torn; struct.pack_into zero-fills its bytes before it writes them, which a reader polling the word would see);
from DATA the frame, header and payload, as on the socket. (The worker lowers its caller's `asleep` as it
writes the early wake, where the caller sleeps on it: the one word an end writes in the other's half.)

The writer puts the frame, then its length, then the count (x86 keeps stores in order, and loads), then reads
`asleep` and rings the doorbell if it is raised. The reader polls the count; before it sleeps in the kernel it
raises `asleep` and looks at the count once more. A writer and a reader can each read the other's word before
the other's store is seen (x86 reorders a load before an earlier store, and Python has no fence): so the first
sleep is bounded (fastlane.FIRST_SLEEP_S; a caller's after a long call at twice its last wait, as a reply cannot
race the flag it raised microseconds after its call went), after which both stores are long visible; a doorbell
rung when no one slept is a packet the reader drops the next time it wakes. Only on x86 (SUPPORTED): where the order is
weaker (ARM) a reader could see the count before the frame, and without a fence Python cannot prevent it; the
socket carries every frame there.

The worker makes the memfd and hands it over with the ticket's answer, to a client that asked for slots; each
side maps it. With it goes an eventfd, the *early wake*: a worker whose EP has run a Compute (kept or whole)
while its caller sleeps (a long call: the caller does not poll for its end) writes it, so that the caller's
waking, tens of microseconds on a virtual machine, overlaps the making of the reply, which the caller then polls
for (server/rpc.py, Call.ran). An eventfd, not the doorbell: a unix socket's wake-up is a "sync" one, which puts
the woken thread on the waker's CPU, where it competed with the framing (tried: shufflenet +73 µs per run); an
eventfd's is not (paired against waking on the reply: squeezenet -56 µs per run for kept calls, 33 of 40 blocks,
and -101 for whole ones, 33 of 40; shufflenet -57, 29 of 40). An old client, which takes
one descriptor, has the kernel drop the second. What a peer writes into a slot is read once (its length checked
against the slot, the frame copied out before it is parsed): a client scribbling in its own slots can only spoil
its own calls.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import platform

from ephost.fastlane import DOORBELL, HEADER, PACKET, FrameError
from ephost.memory import SIZE_SEALS

# Where a slot's words are, counted in u64s
COUNT, LENGTH, READY, ASLEEP = 0, 1, 2, 8
EARLY = 2                    # `asleep`: asleep on the socket and the early wake (1: on the socket alone)
DATA = 128
SLOT = DATA + PACKET         # a slot: its words, then room for one packet
SIZE = 2 * SLOT              # requests (the client writes), then replies (the worker writes)
ASK = b"S"                   # after the ticket: the client asks for slots
SUPPORTED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")  # see above: x86's order


def create() -> tuple[int, mmap.mmap]:
    """A new connection's slots (the worker's end): the memfd to hand over, and its mapping. The memfd is sealed
    against changing size before it is mapped, as a region is (ephost/memory.py): a client that could shrink it
    would make the worker's next access to its slots die with SIGBUS."""
    fd = os.memfd_create("ephost-lane", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, SIZE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
        return fd, mmap.mmap(fd, SIZE)
    except OSError:
        os.close(fd)
        raise


def adopt(fd: int) -> mmap.mmap:
    """Map slots handed over by a worker (the client's end); the descriptor is closed either way."""
    try:
        if os.fstat(fd).st_size != SIZE:
            raise FrameError("the worker handed over slots of an unexpected size")
        return mmap.mmap(fd, SIZE)
    finally:
        os.close(fd)


class Slots:
    """One end's view of a connection's slots: it writes frames into one and reads them from the other.
    Used by the connection's one thread."""

    __slots__ = ("_map", "_bytes", "_words", "_out", "_in", "_count_in", "_asleep_out", "_sent", "_taken",
                 "_sock", "socket_next", "wake")

    def __init__(self, mapping: mmap.mmap, sock, worker: bool, wake: int | None = None):
        self._map = mapping
        self._bytes = memoryview(mapping)  # slices of it copy nothing (an mmap's slices are new bytes)
        self._words = self._bytes.cast("Q")
        self._out, self._in = (SLOT, 0) if worker else (0, SLOT)
        self._count_in = self._in // 8 + COUNT
        self._asleep_out = self._out // 8 + ASLEEP
        self._sock = sock
        self._sent = self._taken = 0  # the slots are new: neither side has written yet
        self.socket_next = False  # the next frame goes on the socket (it follows descriptors sent there)
        self.wake = wake  # the early wake's eventfd (see above; None: none), owned by these slots

    def wake_early(self) -> bool:
        """The worker's EP has run for the call being answered: wake the caller now if it sleeps (True). A
        caller that sleeps on the early wake too (`asleep` EARLY) has its word lowered first: woken so, it polls
        for the reply, which then rings no doorbell (where it sleeps again before the reply comes, it raises the
        word again, and is rung for). One that says only that it sleeps (1: a client that did not take the early
        wake) is rung for as the reply is put."""
        words, asleep = self._words, self._asleep_out
        state = words[asleep]
        if self.wake is not None and state:
            if state == EARLY:
                words[asleep] = 0
            try:
                os.eventfd_write(self.wake, 1)
            except BlockingIOError:  # its count is full (the caller can write it too): a wake is pending anyway
                pass
            return True
        return False

    def put(self, data) -> bool:
        """Write a frame (header and payload, bytes-like) for the peer; False where it goes on the socket
        instead (longer than a packet, or following descriptors)."""
        n = len(data)
        if n > PACKET or self.socket_next:
            self.socket_next = False
            return False
        out, words = self._out, self._words
        self._map[out + DATA:out + DATA + n] = data
        words[out // 8 + LENGTH] = n
        self._sent += 1
        words[out // 8 + COUNT] = self._sent
        if words[self._asleep_out]:  # the peer says it sleeps: rung for (see above for the race a first sleep covers)
            self._sock.send(DOORBELL)
        return True

    def arrived(self) -> bool:
        return self._words[self._count_in] != self._taken

    @property
    def taken(self) -> int:
        """The count of the last frame taken from the peer's slot."""
        return self._taken

    def inputs_written(self) -> None:
        """Say that the inputs of the last frame put (a KEPT_WRITING frame) are written: READY is its count (the
        inputs' stores come before this one: x86 keeps stores in order), and the peer is rung for as for a frame."""
        words = self._words
        words[self._out // 8 + READY] = self._sent
        if words[self._asleep_out]:
            self._sock.send(DOORBELL)

    def written(self, count: int) -> bool:
        """Whether the peer says the inputs of its frame number `count` are written."""
        return self._words[self._in // 8 + READY] >= count

    def take(self, into: bytearray) -> int:
        """Copy the frame that arrived into `into`; its length."""
        at, words = self._in, self._words
        count = words[self._count_in]
        if count != self._taken + 1:
            raise FrameError("a slot whose frame count skipped")
        n = words[at // 8 + LENGTH]
        if not HEADER.size <= n <= PACKET:
            raise FrameError(f"a slot frame of {n} bytes")
        into[:n] = self._bytes[at + DATA:at + DATA + n]
        self._taken = count
        return n

    def asleep(self, flag: bool, early: bool = False) -> None:
        """Say this end sleeps (`early`: on the early wake too) or is awake."""
        self._words[self._in // 8 + ASLEEP] = (EARLY if early else 1) if flag else 0

    def close(self) -> None:
        self._words.release()
        self._bytes.release()
        self._map.close()
        if self.wake is not None:
            os.close(self.wake)
            self.wake = None
