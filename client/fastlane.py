"""The client's end of the fast lane: one SOCK_SEQPACKET connection per calling thread to a worker on this
host, on which that thread sends a frame and reads the reply itself (no I/O thread, no hand-off).

A connection is opened on a thread's first call with a single-use ticket from Worker.OpenDataPlane (gRPC,
the control plane), which binds it to this client's id in the worker. The call's deadline is the socket's
timeout: past it the connection is dropped (its reply can no longer be told from the next one's) and the
caller gets EpDeadlineExceeded, after which the supervisor ends the worker as it does for gRPC. End of file
means the worker closed the connection or died: the caller gets what `lost(call)` says (EpWorkerCrashed
naming the call, for a launched worker that died). In a forked child the parent's connections are dropped
unused; the child opens its own.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import struct
import threading
import weakref
from typing import Any, Callable, Hashable, NamedTuple

import grpc

import numpy as np

from ephost import lane_slots
from ephost.errors import (EpDeadlineExceeded, EpError, EpInternal, EpPermissionDenied, EpUnknownKeptCall,
                           error_for_status)
from ephost.fastlane import (KEPT, KEPT_ID, KEPT_WRITING, MAX_KEPT, METHODS, PLACED, STATUS_OK, TICKET_OK,
                             FrameError, FrameReader, Method, configure, decode_error, put_parts, send_parts)
from ephost.lane_slots import Slots
from ephost.types import MAX_TENSOR_BYTES, checked_desc, nbytes_of
from ephost.wire import SPIN_S

log = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 5.0
COMPUTE = METHODS["Ep/Compute"]
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
_LANES: "weakref.WeakSet[FastLane]" = weakref.WeakSet()


class LaneUnavailable(Exception):
    """The lane cannot be opened for this thread: the caller uses gRPC instead."""


class Placed(NamedTuple):
    """An output a kept call left in a new buffer of the worker's (its PLACED record): where it lies in shared
    memory (`region` 0: not mapped)."""
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    handle: int
    region: int
    offset: int
    mapped: int


class _Kept:
    """A call the worker kept for this connection: its id, and the outputs that come back (those a Compute does not
    write into the caller's buffers), in order, as (rank, dtype, item size, left): inline (False) or left in the
    worker (True); `used`: when it was last repeated, on its connection's clock (0: never), `born`: when it was kept
    (_room). Each reply of a Compute says the outputs' dimensions first (ephost/fastlane.py); a copy's is empty."""

    __slots__ = ("id", "id_bytes", "outputs", "placed", "records", "used", "born", "live", "conn", "key", "method",
                 "_dims")

    def __init__(self, kid: int, outputs: list[tuple[int, np.dtype, bool]]):
        self.id = kid
        self.id_bytes = KEPT_ID.pack(kid)
        self.outputs = [(rank, dtype, dtype.itemsize, left) for rank, dtype, left in outputs]
        self.placed = sum(1 for *_, left in outputs if left)
        self.records = PLACED.size * self.placed  # the bytes of a reply's Placed records, at its end
        self.used = self.born = 0
        self.live = True  # False once its connection forgot it (the worker let it go, or room was made)
        self.conn: _Connection | None = None  # the connection that keeps it, its key there, and its method
        self.key: Hashable = None
        self.method: Method | None = None
        self._dims = struct.Struct(f"<{sum(rank for rank, _, _ in outputs)}Q")

    @classmethod
    def of(cls, method: Method, request, reply) -> "_Kept":
        """From the call and the reply the worker kept it with. A Compute's outputs that come back are those it
        sent inline and those it left in new buffers of the call's allocator (`keep`, and those too large to go
        inline), as this reply did; it wrote the others into the caller's buffers (`output_buffers`). A
        CopyTensors has none: it writes into the caller's buffers."""
        if method is not COMPUTE:
            return cls(reply.kept_call, [])
        into = request.output_buffers
        outputs = [(checked_desc(v.tensor.desc), v.tensor.WhichOneof("location") == "buffer")
                   for i, v in enumerate(reply.outputs) if i not in into]
        return cls(reply.kept_call, [(len(shape), dtype, left) for (shape, dtype, _), left in outputs])

    def arrays(self, payload) -> list:
        """The outputs that come back, in order: arrays over a KEPT reply's payload, and a Placed for each
        output left in the worker."""
        dims = self._dims
        size = len(payload)
        if size < dims.size:
            raise EpInternal(f"the worker answered a kept call with {size} bytes, fewer than its outputs' "
                             "dimensions take")
        values = dims.unpack_from(payload)
        arrays: list = []
        at, offset = 0, dims.size  # the inline outputs' bytes follow the dimensions, then the Placed records
        for rank, dtype, itemsize, left in self.outputs:
            shape = values[at:at + rank]
            at += rank
            nbytes = math.prod(shape) * itemsize
            if not 0 < nbytes <= MAX_TENSOR_BYTES:  # (an empty one, or out of bounds: checked the long way)
                nbytes = nbytes_of(shape, dtype)
            if left:
                arrays.append((shape, dtype, nbytes))  # made below, once the records' offset is known
                continue
            end = offset + nbytes
            if end > size:
                offset = end
                break
            arrays.append(np.ndarray(shape, dtype, payload, offset))  # frombuffer + reshape: twice the cost
            offset = end
        if size != offset + self.records:
            raise EpInternal(f"the worker answered a kept call with {size} bytes, not what its outputs' "
                             "dimensions make")
        if self.placed:
            for i, (*_, left) in enumerate(self.outputs):
                if left:
                    arrays[i] = Placed(*arrays[i], *PLACED.unpack_from(payload, offset))
                    offset += PLACED.size
        return arrays


_FULL = object()
LOOKS = 8  # kept calls a new call looks at for one unused long enough to take the place of (_room)


def _room(kept: dict, clock: int, capacity: int):
    """Where a new call may be kept on a connection that keeps `kept` (key -> _Kept) with room for `capacity`, at
    `clock` (its new calls so far): None where there is room; else the key of a kept call it takes the place of, one not
    used during the last 2 x `capacity` new calls; else _FULL (it goes whole). The kept calls looked at and used since
    go to the back, to be looked at after the others. A plan that cycles through more calls than a connection keeps thus
    repeats those it keeps, run after run, and sends the rest whole; one that moved on lets the old ones go. (Were the
    oldest to go for each new call, each would go before it came round again, and every run would keep every call
    anew.)"""
    if len(kept) < capacity:
        return None
    horizon = clock - 2 * capacity
    for _ in range(min(LOOKS, len(kept))):
        key = next(iter(kept))
        call = kept[key]
        if (call.used or call.born) < horizon:
            return key
        del kept[key]
        kept[key] = call
    return _FULL


class _Connection:
    __slots__ = ("sock", "slots", "reader", "timeout", "kept", "clock", "busy", "closed", "_closing",
                 "__weakref__")

    def __init__(self, sock: socket.socket, adopt, spin_s: float, slots: Slots | None):
        self.sock = sock
        self.slots = slots
        self.reader = FrameReader(sock, adopt, spin_s, expect=True, slots=slots)
        self.timeout = sock.gettimeout()
        # key -> _Kept: the calls its worker keeps for it, the same, call for call, as the worker's own (one goes
        # in where the worker kept it, one goes out where this end said so: _room)
        self.kept: dict = {}
        self.clock = 0  # new calls made that may be kept (repeats do not count: a kept call's `used` is this)
        self.busy = False  # a call on it waits for its reply
        self.closed = False  # close() was called (the descriptors may stay until a call under way ends)
        self._closing = threading.Lock()  # guards the descriptors' close: taken by the first, never given back

    def close(self) -> None:
        """Close: at once where no call is under way on it; else (FastLane.close, from another thread) end that
        call's wait and leave the descriptors to its thread, which closes them as the call ends (_exchange):
        closed under it, the call would read released slots, or an early-wake descriptor whose number something
        else opened meanwhile. Once: its thread's end (the finalizer) and FastLane.close can meet here, on two
        threads (the lane's set names a connection while its finalizer runs): a second close of its descriptors
        would close whatever took their numbers meanwhile."""
        self.closed = True
        if self.busy:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # the call's wait ends at end of file
            except OSError:  # closed by its thread meanwhile
                pass
            return
        self.release()

    def forget(self, kept: _Kept) -> None:
        """A kept call its worker let go, or that makes room for another: forgotten here, and no longer repeated."""
        kept.live = False
        if self.kept.get(kept.key) is kept:
            del self.kept[kept.key]

    def release(self) -> None:
        """Close this process's descriptors and mapping of it (once), whatever `busy` says: by the thread whose
        call ends, or in a forked child (where `busy` is the parent's, and a shutdown would end the parent's
        connection: the socket is the parent's too)."""
        if not self._closing.acquire(blocking=False):
            return
        self.sock.close()
        if self.slots is not None:
            self.slots.close()

    def __del__(self):  # the thread that owned it ended
        self.close()


class FastLane:
    def __init__(self, ticket: Callable[[], tuple[bytes, str]], lost: Callable[[str], EpError],
                 adopt: Callable[[int, int, int], None], spin_s: float = SPIN_S, slots: bool = True,
                 capacity: int = MAX_KEPT):
        self._ticket = ticket  # (ticket, socket path), from Worker.OpenDataPlane
        self._capacity = capacity  # kept calls a connection keeps (the worker keeps no more than MAX_KEPT)
        # ask the worker for shared slots (ephost/lane_slots.py) on each connection, where this CPU's order allows
        self._slots = slots and lane_slots.SUPPORTED
        self._spin_s = spin_s  # how long a thread polls for its reply before it sleeps (FrameReader)
        self._lost = lost
        self._adopt = adopt    # (region, size, fd): a region's descriptor, handed over with a reply naming it
        self._local = threading.local()
        self._connections: "weakref.WeakSet[_Connection]" = weakref.WeakSet()
        self._lock = threading.Lock()  # guards _connections
        self._closed = False
        _LANES.add(self)

    def open(self) -> bool:
        """Open this thread's connection now; False (and the reason logged) where it cannot be opened."""
        try:
            self._connection()
            return True
        except LaneUnavailable as e:
            log.info("no fast lane to the worker: %s", e.__cause__ or e)
            return False

    def _connection(self) -> _Connection:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        if self._closed:
            raise LaneUnavailable("the fast lane is closed")
        try:
            ticket, path = self._ticket()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # close-on-exec, as Python makes them
        except (EpError, OSError) as e:
            raise LaneUnavailable(str(e)) from e
        try:
            sock.settimeout(OPEN_TIMEOUT_S)
            sock.connect(path)
            configure(sock)
            sock.send(ticket + lane_slots.ASK if self._slots else ticket)
            answer, fds, _, _ = socket.recv_fds(sock, len(TICKET_OK), 2)  # the slots, and their early wake
        except OSError as e:
            sock.close()
            raise LaneUnavailable(f"cannot reach the worker's data-plane socket: {e.strerror or e}") from e
        slots = None
        try:
            if answer != TICKET_OK:
                raise LaneUnavailable("the worker refused the data-plane connection") from \
                    EpPermissionDenied("the worker refused the data-plane connection (ticket unknown or expired)")
            if self._slots and fds:  # none: the worker could not make them, and its frames go on the socket
                mapping = lane_slots.adopt(fds.pop(0))
                slots = Slots(mapping, sock, worker=False, wake=fds.pop(0) if fds else None)
        except (LaneUnavailable, FrameError, OSError) as e:
            for fd in fds:
                os.close(fd)
            sock.close()
            if isinstance(e, LaneUnavailable):
                raise
            raise LaneUnavailable(f"cannot map the worker's slots: {e}") from e
        for fd in fds:  # none that was not asked for is kept
            os.close(fd)
        conn = _Connection(sock, self._adopt, self._spin_s, slots)
        with self._lock:
            self._connections.add(conn)
        self._local.conn = conn
        return conn

    def call(self, method: Method, request, timeout: float):
        """One call on this thread's connection. Raises LaneUnavailable (nothing was sent) where there is no
        connection to be had, and the call's typed error otherwise."""
        data = request.SerializeToString()
        frame = self._exchange(self._connection(), method.id, method.name, [data], len(data), timeout, method.id)
        return method.reply.FromString(frame.payload)

    def call_kept(self, method: Method, key: Hashable, parts: list, nbytes: int, request_of: Callable[[], Any],
                  timeout: float, write: Callable[[], None] | None = None):
        """A Compute or CopyTensors this thread may repeat (ephost/fastlane.py, kept calls): the transport's one
        cache of prepared calls. `key` says what makes it the same call (a Compute's partition, allocator, input
        types, ranks and ways, where its outputs go; a copy's data transfer, stream, types and shapes), `parts`
        are what a repeat carries (a Compute's input dimensions, the handles of the buffers the call names, the
        inputs' bytes: `nbytes` in all) and `request_of()` the whole request. The first call on a connection sends
        the request, asking the worker to keep it; the next send only the parts. `write()` writes large inputs
        into the buffers the call names (once, however often it is called; `request_of()` calls it too): a repeat
        through the slots goes first (KEPT_WRITING), so that the worker reads the call while they are written.
        Returns what comes back (_Kept.arrays: a Compute's outputs as arrays over the reply, no copy, and a Placed
        for each left in the worker) where the reply is a kept call's, else the reply."""
        conn = self._connection()
        key = (method.id, key)
        kept = conn.kept.get(key)
        if kept is not None:
            result = self.repeat(kept, parts, nbytes, timeout, write)
            if result is not None:
                return result
        conn.clock += 1  # a new call (a repeat only reads the clock)
        return self._keep(conn, key, method, request_of(), timeout)

    def kept(self, method: Method, key: Hashable) -> _Kept | None:
        """The call this thread's connection keeps for `key` (call_kept's), to be repeated without being looked up
        again (repeat); None where it keeps none."""
        conn = getattr(self._local, "conn", None)
        return conn.kept.get((method.id, key)) if conn is not None else None

    def repeat(self, kept: _Kept, parts: list, nbytes: int, timeout: float, write: Callable[[], None] | None = None):
        """A kept call (kept()'s) repeated as call_kept repeats it: what comes back; None where it no longer
        applies (its connection forgot it, or is not this thread's now, or is in a call of this thread's: nothing
        was sent then)."""
        conn = kept.conn
        if not kept.live or getattr(self._local, "conn", None) is not conn or conn.busy:
            return None
        kept.used = conn.clock
        method = kept.method
        try:
            frame = self._exchange(conn, KEPT, method.name, [kept.id_bytes, *parts], KEPT_ID.size + nbytes,
                                   timeout, kept.key, write)
        except EpUnknownKeptCall:  # the worker let it go: forgotten here too (the caller sends the whole call)
            conn.forget(kept)
            return None
        if frame.method == KEPT:
            return kept.arrays(frame.payload)
        return method.reply.FromString(frame.payload)  # outputs of other types or ranks: the whole reply

    def _keep(self, conn: _Connection, key: Hashable, method: Method, request, timeout: float):
        """A new call, the worker asked to keep it where the connection has room for it (_room): its reply."""
        kept = conn.kept
        room = _room(kept, conn.clock, self._capacity)
        if room is _FULL:
            return self.call(method, request, timeout)
        request.keep_call = True
        if room is not None:
            request.replace_kept = kept[room].id
        try:
            reply = self.call(method, request, timeout)
        except LaneUnavailable:  # nothing was sent: nothing was let go
            room = None
            raise
        finally:
            if room is not None:  # the worker let it go as it read the request, whatever came of the call
                conn.forget(kept[room])
        if reply.kept_call:
            new = kept[key] = _Kept.of(method, request, reply)
            new.born, new.conn, new.key, new.method = conn.clock, conn, key, method
        return reply

    def _exchange(self, conn: _Connection, method: int, name: str, parts: list, nbytes: int, timeout: float,
                  key: Hashable, write: Callable[[], None] | None = None):
        """Send a frame and read its reply frame; the typed error where the reply is one. `key` names the call
        (its reader polls for the reply, or sleeps until it comes, as the last reply to that call was quick or
        slow); `write()`, a kept call's inputs written after its frame went through the slots, or before it is
        sent."""
        if conn.busy:
            # A call made by this thread while its call on the connection waits for a reply: a finalizer that
            # the garbage collector ran here (a dropped session's, which releases its partitions). On the lane
            # it would read the pending reply as its own, and that call its reply; nothing was sent, it goes
            # over gRPC.
            raise LaneUnavailable(f"this thread's fast-lane connection is in a call ({name} came inside it)")
        sock = conn.sock
        conn.busy = True
        if conn.closed:  # closed by another thread as this call began (it saw the connection idle): nothing sent
            conn.busy = False
            self._drop(conn)
            raise self._lost(name)
        try:
            if conn.timeout != timeout:
                sock.settimeout(timeout)
                conn.timeout = timeout
            if write is None:
                send_parts(sock, method, timeout, parts, nbytes, conn.slots)
            elif conn.slots is not None and put_parts(conn.slots, KEPT_WRITING, timeout, parts, nbytes):
                self._write_after(conn, write)
            else:
                write()
                send_parts(sock, method, timeout, parts, nbytes, conn.slots)
            frame = conn.reader.read(key)
        except TimeoutError:
            self._drop(conn)
            raise EpDeadlineExceeded(f"{name} did not finish within its deadline of {timeout:g} s") from None
        except (OSError, FrameError):
            frame = None
        finally:
            conn.busy = False
            if conn.closed:  # closed by another thread during the call: its descriptors are this thread's to close
                conn.release()
        if frame is not None and frame.status == STATUS_OK:
            return frame
        return self._replied(conn, frame, method, name)

    def _replied(self, conn: _Connection, frame, method: int, name: str):
        """A call's reply frame (None: end of file), or its typed error."""
        if frame is None:
            self._drop(conn)
            raise self._lost(name)
        if frame.status != STATUS_OK:
            code = _STATUS.get(frame.status, grpc.StatusCode.UNKNOWN)
            message, reason = decode_error(frame.payload)
            error = error_for_status(code, message, reason)
            if frame.method != method:  # the worker could not read the frame and closed the connection
                self._drop(conn)
            raise error
        return frame

    def _write_after(self, conn: _Connection, write: Callable[[], None]) -> None:
        """The inputs of the KEPT_WRITING frame just put, written by `write()`; the worker told. Where they cannot
        be, the connection goes (the worker, waiting for them, sees its end)."""
        try:
            write()
        except BaseException:
            self._drop(conn)
            raise
        conn.slots.inputs_written()
        # The worker waits for this word, and may be queued behind this thread on its CPU, which would keep it
        # until this thread sleeps for the reply.
        os.sched_yield()

    def _drop(self, conn: _Connection) -> None:
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._lock:
            self._connections.discard(conn)
        conn.close()

    def _forget(self) -> None:
        """In a forked child: the parent's connections are the parent's. Close our copies, use none."""
        self._local = threading.local()
        for conn in list(self._connections):
            conn.release()
        self._connections = weakref.WeakSet()
        self._lock = threading.Lock()  # guards _connections

    def close(self) -> None:
        self._closed = True
        with self._lock:
            connections = list(self._connections)
            self._connections = weakref.WeakSet()
        for conn in connections:
            conn.close()
        self._local = threading.local()

    @property
    def connections(self) -> int:
        """Connections open now (one per thread that made a call)."""
        with self._lock:
            return len(self._connections)


def _after_fork_in_child() -> None:
    for lane in list(_LANES):
        lane._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)
