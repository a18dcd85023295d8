"""A worker turned back into the EP interface of ephost.eps.base (EpFactory, Ep, NodeComputeInfo), so that
sessions and the Environment use a worker exactly as they use an in-process EP."""
from __future__ import annotations

import struct
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx

from ephost import tracing, values
from ephost.ep_context import EpContext
from ephost.eps.base import ComputeCall, FusedGraph, NodeGroup, ProfilingEvent
from ephost.errors import EpError, EpNotFound
from ephost.external_data import ExternalData
from ephost.memory import Buffer
from ephost.tensor import Tensor
from ephost.values import as_value
from ephost.types import HOST_MEMORY, EpDeviceInfo, MemoryInfo, checked_desc, desc_to_proto, is_plain_dtype
from ephost.client.allocator import FreeQueue, RemoteAllocator
from ephost.client.context_model import restore_graph
from ephost.client.fastlane import Placed
from ephost.client.handles import RemoteHandle, owned
from ephost.client.streams import RemoteStream
from ephost.client.supervisor import WorkerLink
from ephost.client.transfer import INLINE_LIMIT, ModelSender, RemoteDataTransfer, Stager, ThreadStaging, tensor_ref
from ephost.v1 import common_pb2, ep_pb2, factory_pb2

_EMPTY = common_pb2.Empty()
_NO_TARGETS: Mapping[int, Tensor] = {}  # never written to
_NO_STAGING: Mapping[int, Buffer] = {}  # never written to


def _compute_of(conn):
    return conn.ep.Compute


_INLINE, _NAMED, _STAGED = 0, 1, 2  # how an input of a kept Compute travels: its bytes, its handle, staged


def _write_once(stager: Stager, pending: list[tuple[Buffer, np.ndarray]]) -> Callable[[], None]:
    """Writing large inputs into their staging buffers (buffer, array), once, whichever path asks first (the lane
    overlaps it with the worker's reading the call)."""
    def write() -> None:
        while pending:
            buffer, array = pending.pop()
            stager.write(buffer, array.reshape(-1).view(np.uint8))
    return write


# How a Compute's inputs go as a kept call (kept_form): each input's (rank, dtype, way), what a repeat carries (its
# parts: its head, the inputs' dimensions then the handles of the buffers it names, followed by the inline inputs'
# arrays; their length in all), the large inputs to write into their staging buffers first (None where there are
# none) and those buffers by input position. A plain tuple: one is made on every repeat.
KeptForm = tuple[tuple, list, int, "Callable[[], None] | None", dict]


class RemoteComputeInfo(RemoteHandle):
    """A partition compiled in a worker. Values it makes stay in the worker's memory (mapped here when it is
    shared); values that already live in that worker are handed back by handle, without a copy. Each Compute goes
    as a kept call where the transport keeps calls (the fast lane: its repeats carry only what changes), else
    whole."""

    def __init__(self, ep: "RemoteEp", graph: FusedGraph, handle: int, generation: int, stager: Stager,
                 context: EpContext | None = None):
        super().__init__(ep.link, handle, generation)
        self._ep, self._graph, self._stager = ep, graph, stager
        self._staging = ThreadStaging(ep.link, stager) if stager.available else None  # kept calls' large inputs
        self.name = graph.name
        self.ep_context = context  # the partition's compiled form, where the EP made one

    def _make(self) -> int:
        """The partition in a worker that does not have it (restarted): restored from its compiled form where
        there is one, else compiled again."""
        graph = self._graph
        if self.ep_context is not None and graph.ep_context_node is None:
            graph = restore_graph(graph, self._ep.get_name(), self.ep_context)
        return self._ep.compile_handles([graph])[0][0]

    def release_staging(self) -> None:
        """Give back the buffers kept for this partition's kept calls (it is being released)."""
        if self._staging is not None:
            self._staging.release()

    def compute(self, call: ComputeCall) -> list[Any]:
        # First: it waits for a worker being replaced. What the worker that then runs has decides how each value
        # goes (by handle, staged or inline).
        conn = self.link.conn
        # Bound outputs in this worker's memory are written there (no new buffer, nothing to free).
        into = self._owned(call.into) if call.into else _NO_TARGETS
        traced = tracing.recording()  # (a traced call goes whole, carrying the trace context)
        # (run options and a trace context: a kept call's repeats carry neither)
        if call.run_options is None and (not call.keep or call.allocator is not None) and not traced:
            form = self.kept_form(call.inputs, _target_handles(into), conn=conn)
            if form is not None:
                outputs = self._compute_kept(conn, call, into, form)
                self.link.between_calls()
                return outputs
        staged: list[Buffer] = []
        try:
            request = self._request(call.inputs, call.allocator, call.keep, into, staged)
            if call.run_options is not None:
                request.run_options.CopyFrom(call.run_options)
            if traced:
                tracing.inject(request.trace_context)
            reply = self.link.call(_compute_of, request, conn=conn, timeout=call.timeout)
        finally:
            self._stager.release(staged)
        outputs = self._outputs(reply, call.allocator, call.leave, conn, into)
        self.link.between_calls()
        return outputs

    def prepare(self, call: ComputeCall) -> "KeptCompute | None":
        """The call as this thread's connection keeps it (after a compute of it), held to be repeated with nothing
        looked up again (a run's plan holds it: client/runner.py); None where the transport keeps no such call."""
        conn = self.link.current
        if conn is None or not conn.keeps_calls or call.run_options is not None or \
                (call.keep and call.allocator is None) or tracing.recording():
            return None
        into = self._owned(call.into) if call.into else _NO_TARGETS
        form = self.kept_form(call.inputs, _target_handles(into))
        if form is None:
            return None
        placed = _placed(call.keep, into)
        kept = conn.kept(conn.ep.Compute, self._key(call.allocator, form[0], into, placed))
        if kept is None:
            return None
        return KeptCompute(self, conn, kept, form[0], call, placed, _targets(into))

    def _owned(self, targets: Mapping[int, Tensor]) -> Mapping[int, Tensor]:
        """The targets in the memory of the worker that runs now (all of them, as given, in the common case)."""
        if all(owned(t.buffer, self.link) for t in targets.values()):
            return targets
        return {i: t for i, t in targets.items() if owned(t.buffer, self.link)}

    def kept_form(self, inputs: Sequence[Any], into: Sequence[int], kinds: list | None = None,
                  conn=None, head: struct.Struct | None = None) -> KeptForm | None:
        """How the inputs go as a kept call, where every input is a tensor the worker has (named by handle) or
        this process can read: small ones inline, large ones through buffers this thread keeps for this call
        (named by handle too); with `kinds`, only where they go so (a held kept call's, whose `head` packs the
        dimensions and handles they make). Else None. `into`: the handles of the buffers outputs go into, by
        position (_target_handles)."""
        current = conn or self.link.current
        made = []  # each input's kind
        dims = []
        handles = []
        parts = [b""]
        nbytes = 0
        staged = None
        for i, value in enumerate(inputs):
            if type(value) is not np.ndarray:
                if type(value) is not Tensor:
                    return None
                buffer = value.buffer
                if buffer is not None and buffer.owner is current:  # a bound input, a value the worker made
                    made.append((len(value.shape), value.dtype, _NAMED))
                    handles.append(buffer.handle)
                    dims += value.shape
                    continue
                value = value.local_array(keeps=False)  # (None: memory neither this process nor the worker reads)
                if value is None:
                    return None
            if not value.flags.c_contiguous:
                return None
            # An array of this process's memory: its bytes go inline where small, else through a staging buffer
            shape, size = value.shape, value.nbytes
            if size < INLINE_LIMIT:
                made.append((value.ndim, value.dtype, _INLINE))
                parts.append(value)
                nbytes += size
            elif self._staging is not None:
                made.append((value.ndim, value.dtype, _STAGED))
                if staged is None:
                    staged = {}
                staged[i] = (len(handles), value)
                handles.append(0)  # the staging buffer's, once it is known
            else:
                return None
            dims += shape
        # One comparison of the whole (`kinds` a list: a held call's, found plain when it was kept)
        if kinds is None:
            kinds = tuple(made)
            if not all(is_plain_dtype(dtype) for _, dtype, way in kinds if way != _NAMED):
                return None
        elif kinds != made:
            return None
        write = None
        if staged:
            arrays = [array for _, array in staged.values()]
            buffers = self._staging.buffers(tuple((len(a.shape), a.dtype) for a in arrays), [a.nbytes for a in arrays])
            for (at, _), buffer in zip(staged.values(), buffers):
                handles[at] = buffer.handle
            write = _write_once(self._stager, list(zip(buffers, arrays)))
            staged = dict(zip(staged, buffers))
        if into:
            handles += into
        packed = parts[0] = (head or _u64s(len(dims) + len(handles))).pack(*dims, *handles)
        return kinds, parts, len(packed) + nbytes, write, staged or _NO_STAGING

    def _key(self, allocator: RemoteAllocator | None, kinds: tuple, into: Mapping[int, Tensor],
             placed: tuple[int, ...]) -> tuple:
        """What makes a kept Compute of this partition the same call (WorkerConnection.call_kept's key)."""
        return (self.handle, allocator.handle if allocator is not None else 0, kinds,
                _targets(into) if into else (), placed)

    def _compute_kept(self, conn, call: ComputeCall, into: Mapping[int, Tensor], form: KeptForm) -> list[Any]:
        """A Compute as the transport keeps it (WorkerConnection.call_kept), so that a stream of them sends the
        inputs' dimensions, the handles of the buffers the call names (the large inputs' staging buffers, the
        inputs the worker has, and those the `into` outputs are written into) and the small inputs' bytes, and
        gets the other outputs' dimensions and bytes back (those in `keep` as handles to new buffers of the
        worker's), nothing else."""
        inputs, allocator = call.inputs, call.allocator
        placed = _placed(call.keep, into)
        kinds, parts, nbytes, write, staged = form
        key = self._key(allocator, kinds, into, placed)

        def request_of() -> ep_pb2.ComputeRequest:
            if write is not None:
                write()
            return self._request(inputs, allocator, placed, into, [], staged)

        timeout = call.timeout
        result = self.link.run(lambda c: c.call_kept(c.ep.Compute, key, parts, nbytes,
                                                     request_of, timeout, write), conn=conn)
        return self._outputs(result, allocator, call.leave, conn, into)

    def _outputs(self, result, allocator: RemoteAllocator | None, leave: Sequence[int], conn,
                 into: Mapping[int, Tensor]) -> list[Any]:
        """A Compute's outputs from what came back: a kept call's (the outputs not written into `into`, in order:
        arrays over its reply, and a Placed for each left in a new buffer of the worker's), or a whole reply.
        `allocator` and `leave`: the call's."""
        if isinstance(result, list):
            if not into:
                for value in result:
                    if type(value) is Placed:
                        return [self._returned(value, allocator, conn, i, leave) for i, value in enumerate(result)]
                return result  # (arrays over the reply, every one: the common case)
            returned = iter(result)
            return [into[i] if i in into else self._returned(next(returned), allocator, conn, i, leave)
                    for i in range(len(result) + len(into))]
        return [into[i] if i in into else self._output(v, allocator, conn, fetch=i not in leave)
                for i, v in enumerate(result.outputs)]

    def _returned(self, value, allocator: RemoteAllocator | None, conn, i: int, leave: Sequence[int]) -> Any:
        """Output i of a kept call: an array over its reply, or a tensor it left in a new buffer of the worker's."""
        if type(value) is not Placed:
            return value
        return self._in_buffer(value.shape, value.dtype, value.nbytes, value.handle, value if value.region else None,
                               allocator, conn, i not in leave)

    def _request(self, inputs: Sequence[Any], allocator: RemoteAllocator | None, keep: Sequence[int],
                 targets: Mapping[int, Tensor], staged: list[Buffer],
                 written: Mapping[int, Buffer] = {}) -> ep_pb2.ComputeRequest:
        """`written`: inputs already written into these buffers of the worker's (named by handle)."""
        # Built in place, field by field: nested keyword constructors cost twice as much on every run.
        request = ep_pb2.ComputeRequest(node_compute_info=self.handle, inline_limit=INLINE_LIMIT)
        for i, value in enumerate(inputs):
            message = request.inputs.add()
            value = as_value(value)  # (an array of this process's memory: a tensor over it)
            if i in written:
                desc_to_proto(value.shape, value.dtype, message.tensor.desc)
                message.tensor.buffer = written[i].handle
            elif isinstance(value, Tensor):
                tensor_ref(value, "source", self.link, self._stager, staged, out=message.tensor)
            else:
                message.onnx.CopyFrom(values.encode(value))
        if allocator is not None:
            request.output_allocator = allocator.handle
            request.keep.extend(keep)
        for i, t in targets.items():
            ref = request.output_buffers[i]
            desc_to_proto(t.shape, t.dtype, ref.desc)
            ref.buffer = t.buffer.handle
        return request

    def _output(self, message: common_pb2.Value, allocator: RemoteAllocator | None, conn, fetch: bool = True) -> Any:
        if message.WhichOneof("kind") == "onnx":
            return values.decode(message.onnx)
        ref = message.tensor
        shape, dtype, nbytes = checked_desc(ref.desc)
        if ref.WhichOneof("location") == "inline":
            # One copy, out of the reply, into a buffer the array is a view of (as the fast lane's replies are)
            host = np.frombuffer(bytearray(ref.inline), dtype=dtype).reshape(shape)
            return Tensor.trusted(shape, dtype, HOST_MEMORY, nbytes, host=host)
        return self._in_buffer(shape, dtype, nbytes, ref.buffer, ref.mapped if ref.HasField("mapped") else None,
                               allocator, conn, fetch)

    def _in_buffer(self, shape, dtype, nbytes: int, handle: int, shm, allocator: RemoteAllocator, conn,
                   fetch: bool) -> Tensor:
        """An output the worker left in a new buffer of `allocator` (`handle`; mapped here where `shm` says: a
        ShmSlice, or a kept call's Placed record). `shape`, `dtype` and `nbytes` were checked already (a reply's
        desc, a kept call's records)."""
        buffer = allocator.adopt(handle, nbytes, shm, conn)
        host = None
        if buffer.region is None and fetch:
            # Memory this process cannot map: fetch a copy (in chunks) for whoever reads it here or elsewhere
            # (and to keep it should the worker die); the worker keeps its own, which a later partition there
            # reads by handle. Outputs the caller leaves there (bound in the worker) are not fetched.
            host = np.empty(shape, dtype)
            allocator.read(buffer, host.reshape(-1).view(np.uint8))
        return Tensor.trusted(shape, dtype, allocator.memory_info, nbytes, buffer=buffer, host=host,
                              allocator=allocator)


_U64S: dict[int, struct.Struct] = {}


def _u64s(count: int) -> struct.Struct:
    """The struct of `count` little-endian u64s (a repeat's head), made once per count."""
    packer = _U64S.get(count)
    if packer is None:
        packer = _U64S[count] = struct.Struct(f"<{count}Q")
    return packer


def _targets(into: Mapping[int, Tensor]) -> tuple:
    """Where outputs go into the caller's tensors: (position, shape, dtype) of each, by position."""
    return tuple((i, t.shape, t.dtype) for i, t in sorted(into.items()))


def _target_handles(into: Mapping[int, Tensor]) -> list[int]:
    """The handles of the buffers outputs go into, by position (the tensors in the worker's memory)."""
    return [into[i].buffer.handle for i in sorted(into)] if into else []


def _placed(keep: Sequence[int], into: Mapping[int, Tensor]) -> tuple[int, ...]:
    """The outputs a kept call leaves in new buffers of the worker's: those kept there, but those written into the
    caller's tensors."""
    return tuple(i for i in keep if i not in into) if keep else ()


class KeptCompute:
    """A partition's Compute as one thread's connection keeps it (RemoteComputeInfo.prepare): called with a
    ComputeCall whose inputs are of the kinds it was kept with (types, ranks, how each travels: any shapes) and
    whose outputs go where they went, it repeats the kept call with nothing looked up again. It no longer applies
    (None, nothing sent) once the worker, the thread's connection or the kept call is another, or the call is not
    one it repeats; the caller then goes through compute, which keeps the call anew."""

    __slots__ = ("info", "_conn", "_kept", "_kinds", "_allocator", "_keep", "_leave", "_placed", "_into", "_recycles",
                 "_head")

    def __init__(self, info: RemoteComputeInfo, conn, kept, kinds: tuple, call: ComputeCall, placed: tuple[int, ...],
                 into: tuple):
        self.info, self._conn, self._kept, self._kinds = info, conn, kept, list(kinds)
        self._allocator, self._keep, self._leave = call.allocator, call.keep, call.leave
        self._placed, self._into = placed, into
        self._recycles = info.link.recycles  # (a link's policy does not change)
        # The head of its repeats: every input's dimensions, then the handles named (inputs', then `into`'s)
        self._head = _u64s(sum(rank for rank, _, _ in kinds) + sum(1 for *_, way in kinds if way != _INLINE)
                           + len(into))

    def __call__(self, call: ComputeCall) -> list[Any] | None:
        """`call` made as a repeat (see repeat), where its parts but the inputs and `into` are the kept call's."""
        if call.run_options is not None or not self.repeats(call.allocator, call.keep, call.leave):
            return None
        return self.repeat(call.inputs, call.into, call.timeout)

    def repeats(self, allocator: RemoteAllocator | None, keep: tuple[int, ...], leave: tuple[int, ...] = ()) -> bool:
        """Whether a call with these parts (and no run options) is one it repeats (with any inputs and `into`)."""
        return allocator is self._allocator and keep == self._keep and leave == self._leave

    def repeat(self, inputs: Sequence[Any], into: Mapping[int, Tensor], timeout: float | None) -> list[Any] | None:
        """The call made again with these inputs and `into` (see ComputeCall), its allocator, `keep` and other
        parts those of the call it was kept from (the caller's to know: a run's step's are the same every run);
        None where it no longer applies (nothing was sent)."""
        info = self.info
        link, conn = info.link, self._conn
        # link.conn first: it waits for a worker being replaced (a call of the dead one's is no longer this one)
        if link.conn is not conn:
            return None
        if self._keep and _placed(self._keep, into) != self._placed:
            return None
        handles = self._into_handles(into, conn) if into or self._into else ()
        if handles is None:
            return None
        form = info.kept_form(inputs, handles, self._kinds, conn, self._head)
        if form is None:
            return None
        _, parts, nbytes, write, _ = form
        try:
            result = conn.repeat(self._kept, parts, nbytes, timeout, write)
        except EpError as error:
            link.raise_failure(conn, error)  # (as link.run raises it)
        if result is None:
            return None
        outputs = info._outputs(result, self._allocator, self._leave, conn, into)
        if self._recycles:
            link.between_calls()
        return outputs

    def _into_handles(self, into: Mapping[int, Tensor], conn) -> list[int] | None:
        """The handles of the buffers of `conn`'s worker the outputs go into, where they go into tensors of the
        positions, shapes and types they went into when the call was kept; else None."""
        if len(into) != len(self._into):
            return None
        handles = []
        for i, shape, dtype in self._into:
            target = into.get(i)
            if target is None or target.shape != shape or target.dtype != dtype:
                return None
            buffer = target.buffer
            if buffer is None or buffer.owner is not conn:
                return None
            handles.append(buffer.handle)
        return handles


class RemoteEp(RemoteHandle):
    def __init__(self, link: WorkerLink, name: str, device_indices: Sequence[int], session_options: Mapping[str, str],
                 models: ModelSender, stager: Stager):
        super().__init__(link)
        self._name, self._devices, self._options = name, list(device_indices), dict(session_options)
        self._models, self._stager = models, stager
        self.handle

    def _make(self) -> int:
        return self.link.call(lambda c: c.factory.CreateEp, factory_pb2.CreateEpRequest(
            device_indices=self._devices, session_options=self._options)).id

    def get_name(self) -> str:
        return self._name

    def get_capability(self, model: onnx.ModelProto, claimed: frozenset[str],
                       external: ExternalData | None = None) -> list[NodeGroup]:
        conn = self.link.conn  # first: it waits out a restart, after which the handle is made again
        handle = self.handle
        with self._models.ref(model, external) as ref:
            reply = self.link.call(lambda c: c.ep.GetCapability, ep_pb2.GetCapabilityRequest(
                ep=handle, model=ref, claimed_nodes=sorted(claimed)), conn=conn)
        return [NodeGroup(tuple(g.node_names), fused=g.kind == ep_pb2.NodeGroup.KIND_FUSED) for g in reply.groups]

    def compile_handles(self, graphs: Sequence[FusedGraph]) -> list[tuple[int, EpContext | None]]:
        """Compile on the worker that runs now; the compute infos' handles there, in order, each with the
        partition's compiled form where the EP made one."""
        handles: list[tuple[int, EpContext | None]] = []
        conn = self.link.conn  # as in get_capability
        handle = self.handle
        for source in dict.fromkeys(g.source for g in graphs):  # one call per model they come from
            batch = [g for g in graphs if g.source is source]
            with self._models.ref(source.model, source.external) as ref:
                reply = self.link.call(lambda c: c.ep.Compile, ep_pb2.CompileRequest(ep=handle, model=ref, graphs=[
                    ep_pb2.FusedGraph(name=g.name, nodes=g.nodes, inputs=g.inputs, outputs=g.outputs) for g in batch]),
                    conn=conn)
            contexts = list(reply.ep_contexts) or [b""] * len(reply.node_compute_infos)
            handles += [(h, EpContext.decode(c) if c else None) for h, c in zip(reply.node_compute_infos, contexts)]
        return handles

    def compile(self, graphs: Sequence[FusedGraph]) -> list[RemoteComputeInfo]:
        generation = self.link.generation  # before: the handles are of this generation, or a later one
        compiled = self.compile_handles(graphs)
        return [RemoteComputeInfo(self, g, h, generation, self._stager, c) for g, (h, c) in zip(graphs, compiled)]

    def release_node_compute_infos(self, infos: Sequence[RemoteComputeInfo]) -> None:
        for info in infos:
            info.release_staging()
        current = [h for h in (i.current_handle for i in infos) if h]
        if current and self.current:
            self.call(lambda c: c.ep.ReleaseNodeComputeInfos,
                      lambda h: ep_pb2.ReleaseNodeComputeInfosRequest(ep=h, node_compute_infos=current))

    def release(self) -> None:
        """ReleaseEp, where the worker that runs now has it."""
        if self.current:
            self.call(lambda c: c.factory.ReleaseEp, lambda h: common_pb2.Handle(id=h))

    def get_preferred_data_layout(self) -> str:
        return self.call(lambda c: c.ep.GetPreferredDataLayout, lambda h: common_pb2.Handle(id=h)).layout

    def set_dynamic_options(self, options: Mapping[str, str]) -> None:
        self._options.update(options)
        self.call(lambda c: c.ep.SetDynamicOptions,
                  lambda h: ep_pb2.SetDynamicOptionsRequest(ep=h, options=dict(options)))

    def on_run_start(self, run_options: Mapping[str, str]) -> None:
        self.call(lambda c: c.ep.OnRunStart, lambda h: ep_pb2.RunStartRequest(ep=h, run_options=dict(run_options)))

    def on_run_end(self, sync_stream: bool) -> None:
        self.call(lambda c: c.ep.OnRunEnd, lambda h: ep_pb2.RunEndRequest(ep=h, sync_stream=sync_stream))

    def start_profiling(self) -> None:
        self.call(lambda c: c.ep.StartProfiling, lambda h: common_pb2.Handle(id=h))

    def end_profiling(self) -> list[ProfilingEvent]:
        """What the worker's EP recorded since start_profiling (nothing of a worker that has since restarted)."""
        reply = self.call(lambda c: c.ep.EndProfiling, lambda h: common_pb2.Handle(id=h))
        return [ProfilingEvent(e.name, e.category, e.start_ns, e.duration_ns, dict(e.args), e.pid, e.tid)
                for e in reply.events]


class RemoteEpFactory:
    """EpFactory of a worker, over its link. Closing it closes the link (and the worker, if launched)."""

    def __init__(self, link: WorkerLink):
        self.link = link
        info = link.call(lambda c: c.factory.GetInfo, _EMPTY)
        self._info = (info.name, info.vendor, info.vendor_id, info.version)
        self._devices = [EpDeviceInfo.from_proto(d)
                         for d in link.call(lambda c: c.factory.GetSupportedDevices, _EMPTY).devices]
        if not link.conn.shares_memory:
            # Memory this process cannot map is worker-local to it: only DEFAULT memory is offered.
            self._devices = [replace(d, memory_infos=tuple(m for m in d.memory_infos if not m.host_accessible))
                             for d in self._devices]
        self._frees = FreeQueue(link.name)
        # Host bytes the worker cannot reach are staged in its memory: shared where there is some, else DEFAULT.
        memory = sorted((m for d in self._devices for m in d.memory_infos), key=lambda m: not m.host_accessible)
        self._stager = Stager(link, memory[0] if memory else None, self.create_allocator)
        self._models = ModelSender(link, self._stager)

    def get_name(self) -> str:
        return self._info[0]

    def get_vendor(self) -> str:
        return self._info[1]

    def get_vendor_id(self) -> int:
        return self._info[2]

    def get_version(self) -> str:
        return self._info[3]

    def get_supported_devices(self) -> list[EpDeviceInfo]:
        return list(self._devices)

    def create_ep(self, device_indices: Sequence[int], session_options: Mapping[str, str]) -> RemoteEp:
        return RemoteEp(self.link, self.get_name(), device_indices, session_options, self._models, self._stager)

    def release_ep(self, ep: RemoteEp) -> None:
        ep.release()

    def create_allocator(self, memory_info: MemoryInfo, options: Mapping[str, str]) -> RemoteAllocator:
        for device in self._devices:
            if memory_info in device.memory_infos:
                return RemoteAllocator(self.link, device.index, memory_info, options, self._frees)
        raise EpNotFound(f"worker has no memory {memory_info.name!r}")

    def release_allocator(self, allocator: RemoteAllocator) -> None:
        allocator.release()

    def create_data_transfer(self) -> RemoteDataTransfer | None:
        transfer = RemoteDataTransfer(self.link, self._stager)
        return transfer if transfer.handle else None

    def is_stream_aware(self) -> bool:
        return self.link.call(lambda c: c.factory.IsStreamAware, _EMPTY).stream_aware

    def create_sync_stream_for_device(self, device_index: int, options: Mapping[str, str]) -> RemoteStream:
        return RemoteStream(self.link, device_index, options)

    def flush_frees(self, timeout: float = 5.0) -> bool:
        """Wait until the buffers of tensors already let go of have been freed in the worker."""
        return self._frees.flush(timeout)

    def close(self) -> None:
        self._frees.close()
        self.link.close()
