"""The one place where servicer methods become calls, whatever carries them.

A servicer method is `(self, request, call)`: `call.client` is the caller (resolved from the client id the call
carries; methods marked `@rpc(client=False)` need none) and `call.time_remaining()` its deadline. The
`Dispatcher` maps "Service/Method" to (handler, request class, reply class), enumerated from the proto
descriptors, and `Dispatcher.dispatch` does for every call, on every transport, the same things: refuse new calls
while draining, admit the call under the per-client and whole-worker bounds, count it, and turn any failure
into an `EpError` (typed errors as they are; anything unexpected logged and reported as EpInternal while the
worker keeps serving). `grpc_handlers()` serves the same table over gRPC without a line per method.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import grpc
from google.protobuf import message_factory

from ephost import tracing, wire
from ephost.errors import EpError, EpInternal, EpInvalidArgument, EpResourceExhausted, EpUnimplemented, \
    EpWorkerDraining, public_message, quoted

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RpcSpec:
    needs_client: bool = True


def rpc(method=None, *, client: bool = True):
    """Mark a servicer method `(self, request, call)` as the handler of the proto method of the same name."""
    def mark(fn):
        fn.rpc_spec = RpcSpec(needs_client=client)
        return fn
    return mark(method) if method is not None else mark


class Servicer:
    """Base of the servicers: the service's full proto name, and the worker's shared state."""

    SERVICE = ""  # e.g. "ephost.v1.Allocator"

    def __init__(self, state):
        self.state = state


@dataclass(slots=True)
class Call:
    """What a handler knows about the call beyond its request (one made per call: its fields in slots)."""

    client: Any                      # ClientState, or None for methods that need no client
    deadline: float | None = None    # time.monotonic() by which the caller stops waiting
    counts: dict[str, int] | None = None  # the worker's counters this call adds to, recorded as it ends
    client_id: str = ""              # as the call named its client ("": none), which admission counts under
    # What a handler calls as soon as its EP has run, before it makes the reply (None: nothing): a lane call's
    # early wake (ephost/lane_slots.py), which wakes a caller asleep for the reply and says whether it did.
    ran: Callable[[], bool] | None = None

    def time_remaining(self) -> float | None:
        """Seconds left, capped where threading's waits still take them (a deadline years away is no deadline
        to a wait, but an uncapped one overflows it)."""
        if self.deadline is None:
            return None
        return min(max(0.0, self.deadline - time.monotonic()), threading.TIMEOUT_MAX)


@dataclass(frozen=True)
class Method:
    service: str                     # "Allocator"
    name: str                        # "Alloc"
    handler: Callable                # bound servicer method
    request: type                    # request message class
    reply: type                      # reply message class
    client_streaming: bool
    server_streaming: bool
    needs_client: bool
    key: str = ""                    # "Allocator/Alloc", made once (every call is counted under it)
    traced: bool = False             # its request may carry the caller's trace context (ephost.tracing)

    def __post_init__(self):
        object.__setattr__(self, "key", f"{self.service}/{self.name}")
        object.__setattr__(self, "traced", "trace_context" in self.request.DESCRIPTOR.fields_by_name)


class Admission:
    """Bounds on calls under way: per client, and for the whole worker (so that the server keeps threads for
    health checks whatever clients do). Streams count for as long as they are open. A call whose reply is on its
    way counts no more (a client that never reads its replies holds no slot); a drain waits for its reply
    through the lane's tallies (Dispatcher.wait_idle)."""

    def __init__(self, per_client: int, total: int):
        self.per_client = per_client
        self.total = total
        self._lock = threading.Lock()  # guards the counts below
        self._idle = threading.Condition(self._lock)  # notified only while someone waits (drain): every call
        self._waiting = 0                             # leaves, and a notify costs more than the rest of it
        self._by_client: dict[str, int] = {}
        self._all = 0
        self._full_since: float | None = None  # time.monotonic() since when every slot is taken; None: one is free

    def enter(self, client_id: str) -> None:
        with self._lock:
            if self._all >= self.total:
                raise EpResourceExhausted(f"the worker is serving its limit of {self.total} calls at once; "
                                          "retry shortly")
            mine = self._by_client.get(client_id, 0)
            if client_id and mine >= self.per_client:
                raise EpResourceExhausted(f"this client has {mine} calls or streams under way, its limit; finish "
                                          "or cancel some first")
            self._all += 1
            if self._all == self.total:
                self._full_since = time.monotonic()
            if client_id:
                self._by_client[client_id] = mine + 1

    def leave(self, client_id: str) -> None:
        """A call ends, or its reply is about to be sent."""
        with self._lock:
            self._all -= 1
            self._full_since = None
            if not self._all and self._waiting:
                self._idle.notify_all()
            if client_id:
                left = self._by_client[client_id] - 1
                if left:
                    self._by_client[client_id] = left
                else:
                    del self._by_client[client_id]

    def under_way(self) -> int:
        with self._lock:
            return self._all

    def full_for(self) -> float:
        """How long every call slot has been taken (0.0: one is free)."""
        with self._lock:
            return 0.0 if self._full_since is None else time.monotonic() - self._full_since

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no call is under way (on any transport); False if some still are after `timeout`."""
        with self._lock:
            self._waiting += 1
            try:
                return self._idle.wait_for(lambda: not self._all, timeout)
            finally:
                self._waiting -= 1


@dataclass
class Dispatcher:
    state: Any                                          # WorkerState
    admission: Admission
    methods: dict[str, Method] = field(default_factory=dict)

    @classmethod
    def of(cls, state, servicers, *, per_client: int, total: int) -> "Dispatcher":
        dispatcher = cls(state, Admission(per_client, total))
        for servicer in servicers:
            dispatcher.add(servicer)
        return dispatcher

    def add(self, servicer: Servicer) -> None:
        """Register every method of the servicer's proto service; a proto method without a handler is a bug
        found at start-up, not an UNIMPLEMENTED found by a user."""
        from ephost.server.contract import service_descriptor
        service = service_descriptor(servicer.SERVICE)
        for m in service.methods:
            handler = getattr(servicer, m.name, None)
            spec = getattr(handler, "rpc_spec", None)
            if spec is None:
                raise TypeError(f"{type(servicer).__name__} has no @rpc handler for {service.full_name}/{m.name}")
            method = Method(service.name, m.name, handler, message_factory.GetMessageClass(m.input_type),
                            message_factory.GetMessageClass(m.output_type), m.client_streaming, m.server_streaming,
                            spec.needs_client)
            self.methods[method.key] = method

    def method(self, key: str) -> Method:
        method = self.methods.get(key)
        if method is None:
            raise EpUnimplemented(f"no method {quoted(key)} on this worker")
        return method

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no call is under way and every reply on its way has gone (the lane answers a call after it
        left the bounds: WorkerStats.answering); False if some are left after `timeout`."""
        deadline = time.monotonic() + timeout
        return self.admission.wait_idle(timeout) and \
            self.state.stats.settle(max(0.0, deadline - time.monotonic()))

    # --- the one path every call takes ------------------------------------------------------------

    def dispatch(self, key: str, request, client_id: str | None, deadline: float | None = None, *,
                 lane: bool = False, handler: Callable | None = None, respond: Callable | None = None,
                 ran: Callable[[], bool] | None = None):
        """Run one call (`lane`: it came on the fast lane; `handler`: another form of the method, admitted and
        counted as the method; `respond(reply)` sends the reply, after which the call is counted; `ran`: the
        call's Call.ran). Returns the reply (an iterator of replies for server-streaming methods, which is
        accounted while it is iterated); raises EpError, and what `respond` raises."""
        method = self.methods.get(key)
        if method is None:
            method = self.method(key)  # (raises: its words)
        if method.server_streaming:
            return self._stream(method, request, client_id, deadline)
        start = time.perf_counter()
        call = self._enter(method, client_id, deadline, ran)
        stats, admission = self.state.stats, self.admission
        try:
            if handler is None and method.traced and request.trace_context:  # a traced caller's Compute
                with tracing.served(method.key, request.trace_context, {"ephost.ep": self.state.ep_name}):
                    reply = method.handler(request, call)
            else:
                reply = (handler or method.handler)(request, call)
        except BaseException as e:
            stats.record_call(method.key, time.perf_counter() - start, _status(e), lane, call.counts)
            admission.leave(call.client_id)
            if isinstance(e, EpError) or not isinstance(e, Exception):
                raise
            raise _internal(method, e) from None
        seconds = time.perf_counter() - start
        if respond is None:  # the caller answers once this returns: counted first
            stats.record_call(method.key, seconds, "", lane, call.counts)
            admission.leave(call.client_id)
            return reply
        # Answered first, counted right after: counting first would hold every lane reply back. The tally says
        # which replies are on their way: a GetStats waits for the calls answered before it (WorkerStats.settle),
        # a drain for every reply (wait_idle); the call leaves the bounds before its reply goes, so that a reply
        # its client does not read holds no slot.
        answered = stats.answering()
        answered.answered += 1
        admission.leave(call.client_id)
        try:
            respond(reply)
            # The caller polls for this reply, and on a machine with fewer CPUs than busy threads it may be queued
            # behind this thread, which would keep the CPU through the counting and its next read. Yielded now,
            # the caller runs at once; where no one waits, it costs a system call.
            os.sched_yield()
        finally:
            stats.record_call(method.key, seconds, "", lane, call.counts)
            answered.counted += 1
        return reply

    def _stream(self, method: Method, request, client_id, deadline) -> Iterator:
        start = time.perf_counter()
        call = self._enter(method, client_id, deadline)
        failed = "CANCELLED"  # (a stream its caller stops reading ends here, GeneratorExit)
        try:
            yield from method.handler(request, call)
            failed = ""
        except EpError as e:
            failed = _status(e)
            raise
        except Exception as e:
            failed = "INTERNAL"
            raise _internal(method, e) from None
        finally:
            self.state.stats.record_call(method.key, time.perf_counter() - start, failed, False, call.counts)
            self.admission.leave(call.client_id)

    def _enter(self, method: Method, client_id: str | None, deadline: float | None,
               ran: Callable[[], bool] | None = None) -> Call:
        """Admit a call: refused while draining, bounded per client and for the whole worker; its client."""
        state = self.state
        client_id = client_id or ""
        try:
            if state.draining.is_set():  # calls under way finish; new ones are turned away
                raise EpWorkerDraining("worker is draining (shutting down); try another")
            self.admission.enter(client_id)
        except EpError as e:
            state.stats.refused(method.key, _status(e))
            raise
        try:
            return Call(state.clients.lookup(client_id) if method.needs_client else None, deadline, None, client_id,
                        ran)
        except EpError as e:
            self.admission.leave(client_id)
            state.stats.refused(method.key, _status(e))
            raise

    # --- gRPC -------------------------------------------------------------------------------------

    def grpc_handlers(self) -> list[grpc.GenericRpcHandler]:
        by_service: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        for method in self.methods.values():
            full = f"{wire.PROTOCOL}.{method.service}"
            by_service.setdefault(full, {})[method.name] = self._grpc_handler(method)
        return [grpc.method_handlers_generic_handler(name, handlers) for name, handlers in by_service.items()]

    def _grpc_handler(self, method: Method) -> grpc.RpcMethodHandler:
        key = method.key

        # Requests arrive as bytes and are parsed here, so that bytes which are no message get INVALID_ARGUMENT
        # (grpcio's own deserializer answers INTERNAL, and a failed parse inside a client stream can leave
        # grpcio's server unable to stop).
        def parse(data: bytes):
            return _parse(method.request, data)

        def requests(request):
            return (parse(r) for r in request) if method.client_streaming else parse(request)

        def unary(request, context):
            try:
                return self.dispatch(key, requests(request), _client_id(context), _deadline(context))
            except EpError as e:
                _abort(context, e)

        def streaming(request, context):
            try:
                yield from self.dispatch(key, requests(request), _client_id(context), _deadline(context))
            except EpError as e:
                _abort(context, e)

        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(method.client_streaming,
                                                                      method.server_streaming)]
        return make(streaming if method.server_streaming else unary, request_deserializer=None,
                    response_serializer=method.reply.SerializeToString)


def _status(error: BaseException) -> str:
    """The status a failed call ends with, by name (what metrics count it under)."""
    return error.code.name if isinstance(error, EpError) else "INTERNAL" if isinstance(error, Exception) \
        else "CANCELLED"


def _internal(method: Method, error: Exception) -> EpError:
    """What a call that failed with an untyped error reports: a bug or a vendor failure, logged and reported
    as EpInternal; the worker keeps serving."""
    log.error("%s failed", method.key, exc_info=error)
    return EpInternal(f"{method.name} failed inside the worker: {type(error).__name__}: {error}")


def _parse(cls, data: bytes):
    message = cls()
    try:
        message.ParseFromString(data)
    except Exception as e:  # DecodeError, and RuntimeError from the upb parser on deep nesting
        raise EpInvalidArgument(f"the request is not a valid {cls.DESCRIPTOR.name} message: "
                                f"{type(e).__name__}") from None
    return message


def _client_id(context) -> str | None:
    return next((v for k, v in context.invocation_metadata() or () if k == wire.CLIENT_ID_KEY), None)


def _deadline(context) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _abort(context, error: EpError) -> None:
    if error.reason:
        context.set_trailing_metadata(((wire.REASON_KEY, error.reason),))
    context.abort(error.code, public_message(str(error)))

