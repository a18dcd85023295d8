"""The fast lane's frames: the header, the methods the lane carries and their ids, kept calls' KEPT frames and
PLACED records, and the functions that send and read frames on a SOCK_SEQPACKET socket or through a connection's
shared slots (ephost/lane_slots.py). The protocol is described in docs/wire-protocol.md."""
from __future__ import annotations

import math
import os
import select
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from google.protobuf import message_factory

from ephost.errors import EpInvalidArgument
from ephost.v1 import allocator_pb2, data_transfer_pb2, ep_pb2, factory_pb2, worker_pb2

MAGIC = b"EL"
HEADER = struct.Struct("<2sHHdI")  # magic, method id, status, timeout_s (0 = none), payload length
PACKET = 64 << 10                  # bytes in one packet, header included
_FIRST = PACKET - HEADER.size      # the longest payload a frame's first packet (or a slot) carries
SOCKET_BUFFER = 1 << 20            # SO_SNDBUF / SO_RCVBUF: room for several packets in flight
MAX_LENGTH = 1 << 30               # the longest payload either side accepts (a reader may take less)
# A frame's payload up to this long is received into a buffer of its announced length; a longer one grows as its
# bytes arrive, so that a header announcing a gigabyte and nothing after it costs its reader nothing.
EAGER_LENGTH = 1 << 20
TICKET_OK, TICKET_NO = b"OK", b"NO"
STATUS_OK = 0
# A frame of this method id, sent by the worker just before a reply, hands over the descriptors (SCM_RIGHTS)
# of the shared-memory regions the reply names for the first time on this connection; its payload is one
# REGION entry (region id, size) per descriptor, in order.
REGIONS = 0xFFFF
REGION = struct.Struct("<QQ")
# A one-byte packet that wakes a reader asleep in the kernel for a frame put in its slot (ephost/lane_slots.py).
DOORBELL = b"\0"
FIRST_SLEEP_S = 0.001  # a reader about to sleep looks at its slot again after this long (ephost/lane_slots.py)
KEPT = 0xFF00                  # a kept call repeated (docs/wire-protocol.md)
KEPT_WRITING = 0xFF01          # the same, before the caller wrote the large inputs it names
KEPT_ID = struct.Struct("<I")  # the first bytes of a KEPT frame's payload
# In a KEPT reply, after the inline outputs' bytes, each output left in the worker: its buffer's handle, and
# where it lies in shared memory (region, offset, nbytes; region 0: not mapped)
PLACED = struct.Struct("<QQqq")
# Kept calls a worker keeps for one connection: a thread's every partition on it, each at the input shapes it
# runs at. Past the bound the worker keeps a new call only in the place of one its caller names (replace_kept):
# the caller knows which it repeats (client/fastlane.py, _room). A kept call costs the worker a small record, and
# a tensor for each buffer it names.
MAX_KEPT = 1024
MAX_FDS = 16
_TRUNC = int(socket.MSG_TRUNC)  # a plain int: an IntFlag's & costs more than the rest of a frame's reading
_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)
_DONTWAIT = int(socket.MSG_DONTWAIT)


@dataclass(frozen=True)
class Method:
    id: int
    name: str         # "Ep/Compute", as the gRPC path names it without its package
    request: type
    reply: type


def _methods(*pairs) -> dict[str, Method]:
    out = {}
    for i, (module, service, method) in enumerate(pairs, 1):
        descriptor = module.DESCRIPTOR.services_by_name[service].methods_by_name[method]
        out[f"{service}/{method}"] = Method(i, f"{service}/{method}",
                                            message_factory.GetMessageClass(descriptor.input_type),
                                            message_factory.GetMessageClass(descriptor.output_type))
    return out


# The methods the lane carries: those of a run, then those that make and release a session's EPs, partitions,
# allocators and external data files (a session per request pays them every time, and a gRPC call costs far
# more than a lane call). Ids are positions here: append, never reorder.
METHODS: dict[str, Method] = _methods(
    (ep_pb2, "Ep", "Compute"),
    (data_transfer_pb2, "DataTransfer", "CopyTensors"),
    (allocator_pb2, "Allocator", "Alloc"),
    (allocator_pb2, "Allocator", "Free"),
    (factory_pb2, "EpFactory", "CreateEp"),
    (factory_pb2, "EpFactory", "ReleaseEp"),
    (ep_pb2, "Ep", "GetCapability"),
    (ep_pb2, "Ep", "Compile"),
    (ep_pb2, "Ep", "ReleaseNodeComputeInfos"),
    (factory_pb2, "EpFactory", "CreateAllocator"),
    (factory_pb2, "EpFactory", "ReleaseAllocator"),
    (worker_pb2, "Worker", "ImportFile"),
)
BY_ID: dict[int, Method] = {m.id: m for m in METHODS.values()}


def _compute_regions(reply) -> list[int]:
    return [o.tensor.mapped.region for o in reply.outputs
            if o.WhichOneof("kind") == "tensor" and o.tensor.HasField("mapped")]


# The shared-memory regions a reply names, by method: the worker hands their descriptors over the first time.
REPLY_REGIONS = {
    METHODS["Allocator/Alloc"].id: lambda reply: [reply.shm.region] if reply.HasField("shm") else [],
    METHODS["Ep/Compute"].id: _compute_regions,
}


class FrameError(EpInvalidArgument):
    """A frame that cannot be read: the connection it came on is closed, the peer keeps serving others."""


def configure(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def send_regions(sock: socket.socket, regions: list[tuple[int, int, int]], slots=None) -> None:
    """Hand over (region id, size, fd) triples, at most MAX_FDS at a time; the frame after them follows them
    on the socket (its reader reads on from them there)."""
    if slots is not None:
        slots.socket_next = True
    for start in range(0, len(regions), MAX_FDS):
        batch = regions[start:start + MAX_FDS]
        payload = b"".join(REGION.pack(region, size) for region, size, _ in batch)
        socket.send_fds(sock, [HEADER.pack(MAGIC, REGIONS, STATUS_OK, 0.0, len(payload)) + payload],
                        [fd for _, _, fd in batch])


def send_frame(sock: socket.socket, method: int, status: int, timeout_s: float, payload: bytes | memoryview,
               slots=None) -> None:
    """One frame: through `slots` (ephost/lane_slots.py) where given and it fits, else on the socket."""
    header = HEADER.pack(MAGIC, method, status, timeout_s, len(payload))
    first = _FIRST
    if len(payload) <= first:
        if slots is None or not slots.put(header + payload):
            sock.sendmsg([header, payload])
        return
    if slots is not None:
        slots.socket_next = False
    view = memoryview(payload)
    sock.sendmsg([header, view[:first]])
    for start in range(first, len(view), PACKET):
        sock.sendall(view[start:start + PACKET])


def put_parts(slots, method: int, timeout_s: float, parts: list, nbytes: int) -> bool:
    """A frame whose payload is `parts` (`nbytes` in all) put into `slots`; False (nothing written) where it
    does not go there (longer than a packet, or following descriptors on the socket)."""
    return nbytes <= _FIRST and \
        slots.put(b"".join((HEADER.pack(MAGIC, method, STATUS_OK, timeout_s, nbytes), *parts)))


def send_parts(sock: socket.socket, method: int, timeout_s: float, parts: list, nbytes: int, slots=None) -> None:
    """A frame whose payload is `parts` (bytes-like, `nbytes` in all) one after another: sent without joining
    them where they fit one packet (joined once, into the slot, where there are slots)."""
    if nbytes <= _FIRST:
        header = HEADER.pack(MAGIC, method, STATUS_OK, timeout_s, nbytes)
        if slots is None or not slots.put(b"".join((header, *parts))):
            sock.sendmsg([header, *parts])
    else:
        # As bytes: an array's len() and slices count its rows, not its bytes.
        send_frame(sock, method, STATUS_OK, timeout_s, memoryview(parts[0]).cast("B") if len(parts) == 1
                   else b"".join(parts), slots)


def encode_error(message: str, reason: str = "") -> bytes:
    """An error reply's payload: the structured reason (ephost.errors), a NUL, the message."""
    return f"{reason}\0{message}".encode()


def decode_error(payload) -> tuple[str, str]:
    """(message, reason) of an error reply's payload."""
    reason, _, message = bytes(payload).decode("utf-8", "replace").partition("\0")
    return message, reason


@dataclass(slots=True)
class Frame:
    method: int
    status: int
    timeout_s: float
    payload: Any  # bytes-like
    slot: bool = False  # it came through the connection's slot (its count is the slot's `taken`), not the socket


_FD_SETSIZE = 1024
# A wait longer than this is a wait without end (a deadline a peer set centuries away: select and poll take no
# timeout past what their clocks count, and raise OverflowError).
FOREVER_S = 1e9
MAX_WAIT_KEYS = 2 * MAX_KEPT  # calls whose waits a reader keeps (a connection keeps at most MAX_KEPT kept calls)


class FrameReader:
    """Reads whole frames from one socket into a buffer kept between frames. With `adopt`, it takes the
    descriptors of REGIONS frames (calling `adopt(region, size, fd)` for each) and reads on to the next frame;
    without it, descriptors a peer attaches are never received (the kernel closes them).

    With `spin_s`, a read first polls the socket for up to that long before it sleeps in the kernel, as ORT's thread
    pool spins before it waits: a sleeping reader is woken by the peer's send, and on a virtual machine waking an idle
    CPU costs several times what a small call costs. It spins only while frames keep coming within `spin_s` (a wait
    longer than that turns spinning off until a wait is short again; for each kind of call apart, where the caller names
    them in `read`), so that idle connections burn no CPU. After a long wait it sleeps until the frame comes: a caller
    does not poll for the end of a long call (a CNN's run), as that would take a CPU from the worker's threads; nor does
    a worker for a caller's next request after a pause (polling through it would take a CPU from whatever the caller
    does meanwhile). With `expect` (a caller reading the replies to its own calls), a long call's reply is expected
    about as late as the last one: the first sleep is bounded at twice that rather than at FIRST_SLEEP_S (see read); and
    where the slots have an early wake (ephost/lane_slots.py), the worker wakes it as its EP finishes, and it polls for
    the reply from there.

    With `slots` (ephost/lane_slots.py), a frame comes through the slot or on the socket: polling looks at the
    slot (and at the socket every 8th turn, for frames sent there and for end of file), and a reader about to
    sleep says so in the slot, so that the writer rings."""

    def __init__(self, sock: socket.socket, adopt=None, spin_s: float = 0.0, expect: bool = False, slots=None,
                 max_length: int = MAX_LENGTH):
        self._sock = sock
        self._max_length = min(max_length, MAX_LENGTH)  # the longest payload this reader takes
        self._packet = bytearray(PACKET)
        self._into = [self._packet]  # recvmsg_into's buffers, made once
        self._adopt = adopt
        self._ancillary = socket.CMSG_SPACE(MAX_FDS * 4) if adopt is not None else 0
        self._flags = socket.MSG_CMSG_CLOEXEC if adopt is not None else 0  # received descriptors: close-on-exec
        self._spin_s = spin_s if spin_s > 0 else 0.0
        self._expect = expect
        self._wake = slots.wake if slots is not None and expect else None  # the early wake, where there is one
        self._woken_early = False  # the last sleep ended on the early wake, not on a frame
        # How long the last read of each kind waited (a caller's reads are told what call they answer): whether to
        # poll for the next, or to sleep until it comes.
        self._waits: dict[Hashable, float] = {}
        self._slots = slots
        self._poll = None
        if self._spin_s or slots is not None:
            self._poll = select.poll()
            self._poll.register(sock, select.POLLIN)
        self._waking = None  # the socket and the early wake, for a sleep on descriptors select cannot take
        if self._wake is not None:
            self._waking = select.poll()
            self._waking.register(sock, select.POLLIN)
            self._waking.register(self._wake, select.POLLIN)

    def read(self, key: Hashable = None) -> Frame | None:
        """The next frame, or None at end of file (the peer closed or died). `key` names what the frame answers
        (a caller's connection carries every partition of every session on its worker, and the calls between
        them): how long the last read with that key waited says whether to poll for it or sleep until it comes."""
        slots, spin_s = self._slots, self._spin_s
        if slots is not None and slots.arrived():  # there already: no clock, no system call
            if spin_s:
                self._waited(key, 0.0)
            return self._frame(slots.take(self._packet), whole=True)
        started = time.perf_counter() if spin_s or slots is not None else 0.0
        last = self._waits.get(key, 0.0) if spin_s else 0.0
        spinning = bool(spin_s) and last <= spin_s
        if spinning:
            self._spin(started + spin_s)
        while True:
            if slots is not None:
                if slots.arrived():
                    n, whole = slots.take(self._packet), True
                    break
                if not self._poll.poll(0):  # nothing on the socket either
                    if spinning and time.perf_counter() < started + spin_s:
                        # The spin ended on a doorbell rung for an earlier frame (the reader took that frame from
                        # the slot before the bell came): spin on, or every read would sleep and be rung for.
                        self._spin(started + spin_s)
                        continue
                    timeout = self._sock.gettimeout()
                    left = math.inf if timeout is None else started + timeout - time.perf_counter()
                    # A caller expects a long call's reply as late as the last (a partition run again): its first
                    # sleep is bounded at twice that, so that a CNN's run does not wake it halfway through on a CPU
                    # ORT's threads use. The race the bound covers (a writer reading the flag as it rises) needs a
                    # frame written as the reader falls asleep: a request can be (a worker's bound stays), a reply
                    # microseconds after the call was sent cannot.
                    first = max(FIRST_SLEEP_S, 2 * last) if self._expect else FIRST_SLEEP_S
                    if not self._doze(left, first):
                        raise TimeoutError("timed out")
                    if self._woken_early:  # the worker's EP has run: the reply is being made
                        self._woken_early = False
                        if spin_s:
                            self._spin(min(time.perf_counter() + spin_s, started + (timeout or FOREVER_S)))
                    continue
                if self._take_doorbell():  # the frame is in the slot (or the bell was for an earlier one)
                    continue
            n, whole = self._receive(), False
            break
        if spin_s:
            self._waited(key, time.perf_counter() - started)
        return self._frame(n, whole)

    def _waited(self, key: Hashable, seconds: float) -> None:
        waits = self._waits
        waits[key] = seconds
        if len(waits) > MAX_WAIT_KEYS:  # a caller naming ever new calls: start again
            waits.clear()

    def _receive(self) -> int:
        """The next packet from the socket into the buffer, REGIONS frames before it taken: its length."""
        if self._adopt is None:
            # No descriptors taken (the kernel closes any a peer attaches); with MSG_TRUNC the kernel returns
            # the packet's whole length, so a longer one is told from a full one (recvmsg_into costs more).
            n = self._sock.recv_into(self._packet, PACKET, _TRUNC)
            if n > PACKET:
                raise FrameError(f"a packet longer than {PACKET} bytes")
            return n
        n, ancillary, flags, _ = self._sock.recvmsg_into(self._into, self._ancillary, self._flags)
        while ancillary or (n >= HEADER.size and HEADER.unpack_from(self._packet)[1] == REGIONS):
            self._take_regions(n, ancillary)
            n, ancillary, flags, _ = self._sock.recvmsg_into(self._into, self._ancillary, self._flags)
        if flags & _TRUNC:
            raise FrameError(f"a packet longer than {PACKET} bytes")
        return n

    def _frame(self, n: int, whole: bool = False) -> Frame | None:
        """The frame whose first `n` bytes are in the buffer (the rest read from the socket; a frame from a slot
        is `whole`: it has no rest)."""
        if n == 0:
            return None
        if n < HEADER.size:
            raise FrameError(f"a frame of {n} bytes, shorter than its {HEADER.size}-byte header")
        magic, method, status, timeout_s, length = HEADER.unpack_from(self._packet)
        if magic != MAGIC:
            raise FrameError("a frame without the fast lane's magic bytes")
        if length > self._max_length:
            raise FrameError(f"a frame announcing {length} bytes, more than the {self._max_length} allowed")
        got = n - HEADER.size
        if got > length:
            raise FrameError(f"a frame carrying {got} bytes after announcing {length}")
        if got == length:
            return Frame(method, status, timeout_s, self._packet[HEADER.size:n], whole)  # a copy, writable
        if whole:
            raise FrameError(f"a slot frame carrying {got} bytes after announcing {length}")
        if length > EAGER_LENGTH:
            return self._grown(Frame(method, status, timeout_s, bytearray(self._packet[HEADER.size:n])), length)
        payload = bytearray(length)
        payload[:got] = self._packet[HEADER.size:n]
        view = memoryview(payload)
        while got < length:
            k, _, flags, _ = self._sock.recvmsg_into([view[got:got + PACKET]])
            if k == 0:
                return None
            if flags & _TRUNC:
                raise FrameError("a continuation packet longer than announced")
            got += k
        return Frame(method, status, timeout_s, payload)

    def _grown(self, frame: Frame, length: int) -> Frame | None:
        """The rest of a long frame's payload, appended to `frame.payload` packet by packet as it arrives."""
        payload, packet = frame.payload, memoryview(self._packet)
        while len(payload) < length:
            k, _, flags, _ = self._sock.recvmsg_into([packet])
            if k == 0:
                return None
            if flags & _TRUNC or len(payload) + k > length:
                raise FrameError("a continuation packet longer than announced")
            payload += packet[:k]
        return frame

    def _doze(self, timeout: float, first_s: float = FIRST_SLEEP_S, until: Callable[[], bool] | None = None) -> bool:
        """Sleep until the socket is readable or a frame came through the slot (True), or `timeout` (False).
        With slots, the writer is told to ring (ephost/lane_slots.py); the first `first_s` of the sleep end with
        one more look at the slot, as a writer may have missed the flag just as it rose; and a
        doorbell is taken here, so that one rung for an earlier frame (taken from the slot before the bell came)
        does not end the next sleep at once. `until`: what the slot is looked at for, if not a frame."""
        slots = self._slots
        if slots is None:
            return self._readable(timeout)
        until = until or slots.arrived
        clock = time.perf_counter
        end, first = clock() + timeout, True
        slots.asleep(True, early=self._wake is not None)
        try:
            while not until():
                left = end - clock()
                wait = min(left, first_s) if first else left
                if not self._readable(wait):
                    if first and left > wait:
                        first = False
                        continue
                    return until()
                if self._woken_early:
                    return True
                if not self._take_doorbell():
                    return True  # a frame on the socket, or end of file
            return True
        finally:
            slots.asleep(False)

    def _take_doorbell(self) -> bool:
        """Take the doorbell waiting on a readable socket; False where what waits is something else (a frame,
        end of file). The one place a doorbell is read, whether it woke a sleeper or ended a spin."""
        try:
            if self._sock.recv(1, _PEEK) != DOORBELL:
                return False
            self._sock.recv(1, _DONTWAIT)
        except (BlockingIOError, InterruptedError):
            pass
        return True

    def _readable(self, timeout: float) -> bool:
        """Whether the socket is readable within `timeout` seconds (inf, or past FOREVER_S: however long it
        takes). select's timeout has microseconds (poll's and the socket's, milliseconds), but it takes
        descriptors below FD_SETSIZE only."""
        forever = timeout > FOREVER_S
        timeout = max(0.0, timeout)  # poll would take a negative one as "forever"
        if self._wake is not None:
            return self._readable_or_woken(None if forever else timeout)
        if self._sock.fileno() < _FD_SETSIZE:
            return bool(select.select((self._sock,), (), (), None if forever else timeout)[0])
        return bool(self._poll.poll(None if forever else timeout * 1e3))

    def _readable_or_woken(self, timeout: float | None) -> bool:
        """_readable, also ended by the early wake (then `_woken_early`, where the socket is not readable too)."""
        sock, wake = self._sock, self._wake
        if sock.fileno() < _FD_SETSIZE and wake < _FD_SETSIZE:
            ready = select.select((sock, wake), (), (), timeout)[0]
            woken, readable = wake in ready, sock in ready
        else:
            events = dict(self._waking.poll(None if timeout is None else timeout * 1e3))
            woken, readable = wake in events, sock.fileno() in events
        if woken:
            try:
                os.eventfd_read(wake)
            except BlockingIOError:
                pass
            self._woken_early = not readable
        return woken or readable

    def _spin(self, until: float) -> None:
        """Poll without sleeping until a frame is there (on the socket or in the slot; the socket also at end
        of file), or `until`."""
        poll, clock, yield_ = self._poll.poll, time.perf_counter, os.sched_yield
        if self._slots is None:
            while not poll(0) and clock() < until:
                yield_()  # a peer waiting for this CPU (both on one core) runs first
            return
        arrived, turn = self._slots.arrived, 0
        while not arrived() and clock() < until:
            turn += 1
            if not turn & 7:  # the slot costs a fraction of a system call: the socket and the CPU every 8th
                if poll(0):
                    return
                yield_()

    def await_written(self, count: int, deadline: float | None) -> bool:
        """Wait until the peer says the inputs of its slot frame number `count` are written (a KEPT_WRITING
        frame's; Slots.written): polling for up to `spin_s`, then asleep (the peer rings, as for a frame). False
        at `deadline` (time.monotonic(); None: none). Raises FrameError where the socket shows, meanwhile, the
        peer's end or a frame out of turn."""
        slots, clock = self._slots, time.monotonic

        def written() -> bool:
            return slots.written(count)

        spin_until = clock() + self._spin_s
        turn = 0
        while not written():
            turn += 1
            if turn & 7:  # the word costs a fraction of what the clock and the socket do
                continue
            now = clock()
            if deadline is not None and now >= deadline:
                return False
            if now < spin_until:
                if self._poll.poll(0):
                    self._in_turn()
                os.sched_yield()
            elif self._doze(math.inf if deadline is None else deadline - now, until=written) and not written():
                self._in_turn()
        return True

    def _in_turn(self) -> None:
        """What waits on the socket while the peer owes this end something else: a doorbell (taken), or else
        its end or a frame out of turn (FrameError)."""
        if not self._take_doorbell():
            raise FrameError("the peer ended, or sent a frame, before it wrote the inputs its call named")

    def _take_regions(self, n: int, ancillary) -> None:
        fds: list[int] = []
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(struct.unpack(f"{len(data) // 4}i", data[:len(data) - len(data) % 4]))
        entries = []
        if n >= HEADER.size and HEADER.unpack_from(self._packet)[1] == REGIONS:
            length = HEADER.unpack_from(self._packet)[4]
            body = memoryview(self._packet)[HEADER.size:min(n, HEADER.size + length)]
            entries = [REGION.unpack_from(body, k) for k in range(0, len(body) - len(body) % REGION.size,
                                                                   REGION.size)]
        if len(entries) != len(fds):  # not what a worker sends: keep none of it
            for fd in fds:
                os.close(fd)
            raise FrameError("a descriptor hand-over that does not match its list of regions")
        for (region, size), fd in zip(entries, fds):
            self._adopt(region, size, fd)
