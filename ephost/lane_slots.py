"""The fast lane's shared slots: a page pair of shared memory per connection, one slot for each direction,
through which a frame that fits one packet passes without a system call at either end while its reader polls. The
socket stays for the ticket, descriptors, long frames, end of file and the doorbell that wakes a sleeping reader.
The layout and the protocol are in docs/wire-protocol.md ("Shared slots"). What a peer writes into a slot is read
once (its length checked, the frame copied out before it is parsed): a client scribbling in its own slots can only
spoil its own calls.
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
# Each word is a native u64 written through a memoryview: one aligned store, never seen torn (struct.pack_into
# zero-fills its bytes first, which a reader polling the word would see). The writer stores the frame, its length,
# then its count, and x86 keeps stores in order; but a load may pass an earlier store and Python has no fence, so a
# writer and a reader can each miss the other's word: a reader's first sleep is bounded (fastlane.FIRST_SLEEP_S).
# Where the order is weaker (ARM) a reader could see the count before the frame: there every frame goes on the socket.
SUPPORTED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


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
        # The early wake (None: none), owned by these slots: an eventfd, not the doorbell, as a unix socket's
        # wake-up is a "sync" one, which puts the woken thread on the waker's CPU, where it competes with the
        # framing; an eventfd's is not. An old client, which takes one descriptor, has the kernel drop the second.
        self.wake = wake

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
