"""A worker turned back into the EP interface of ephost.eps.base (EpFactory, Ep, NodeComputeInfo), so that
sessions and the Environment use a worker exactly as they use an in-process EP."""
from __future__ import annotations

import struct
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx

from ephost import values
from ephost.ep_context import EpContext
from ephost.eps.base import ComputeCall, FusedGraph, NodeGroup
from ephost.errors import EpNotFound
from ephost.external_data import ExternalData
from ephost.memory import Buffer
from ephost.tensor import Tensor
from ephost.types import HOST_MEMORY, EpDeviceInfo, MemoryInfo, checked_desc, desc_to_proto
from ephost.client.allocator import FreeQueue, RemoteAllocator
from ephost.client.context_model import restore_graph
from ephost.client.fastlane import COMPUTE, Placed
from ephost.client.handles import RemoteHandle, owned
from ephost.client.streams import RemoteStream
from ephost.client.supervisor import WorkerLink
from ephost.client.transfer import INLINE_LIMIT, ModelSender, RemoteDataTransfer, Stager, ThreadStaging, tensor_ref
from ephost.v1 import common_pb2, ep_pb2, factory_pb2

_EMPTY = common_pb2.Empty()
_NO_TARGETS: Mapping[int, Tensor] = {}  # never written to
_INLINE, _NAMED, _STAGED = 0, 1, 2  # how a BoundCompute's input travels: its bytes, its handle, staged


def _compute_of(conn):
    return conn.ep.Compute


def _general(key: tuple) -> tuple[tuple, bytes]:
    """A kept Compute's key (RemoteComputeInfo._compute_kept's, with no output written into a buffer of the
    caller's) without the inputs' shapes, their ranks instead; and their dimensions as a repeat of a call kept
    with `keep_shapes` carries them."""
    partition, allocator, layout, _, placed = key
    dims = [d for shape, *_ in layout for d in shape]
    return ((partition, allocator, tuple((len(shape), *rest) for shape, *rest in layout), placed),
            struct.pack(f"<{len(dims)}Q", *dims))


def _write_once(stager: Stager, pending: list[tuple[Buffer, Tensor]]) -> Callable[[], None]:
    """Writing large inputs into their staging buffers (buffer, tensor), once, whichever path asks first (the lane
    overlaps it with the worker's reading the call)."""
    def write() -> None:
        while pending:
            buffer, tensor = pending.pop()
            stager.write(buffer, tensor.local_bytes())
    return write


class RemoteComputeInfo(RemoteHandle):
    """A partition compiled in a worker. Values it makes stay in the worker's memory (mapped here when it is
    shared); values that already live in that worker are handed back by handle, without a copy."""

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
        inputs, allocator, keep, timeout, into = call.inputs, call.allocator, call.keep, call.timeout, call.into
        leave, run_options = call.leave, call.run_options
        # First: it waits for a worker being replaced. What the worker that then runs has decides how each value
        # goes (by handle, staged or inline), as the call is kept and as it is sent alike (a kept call made while
        # the old worker was still the current one named its tensors, which went inline to the new one: its
        # repeats then named a buffer where the worker kept inline bytes).
        conn = self.link.conn
        # Bound outputs in this worker's memory are written there (no new buffer, nothing to free).
        targets = self._owned(into) if into else _NO_TARGETS
        if (not keep or allocator is not None) and run_options is None:  # (a kept call's repeats carry none)
            kept = self._kept_inputs(inputs)
            if kept is not None:
                return self._compute_kept(conn, inputs, allocator, timeout, targets, keep, leave, *kept)
        staged: list[Buffer] = []
        try:
            request = self._request(inputs, allocator, keep, targets, staged)
            if run_options is not None:
                request.run_options.CopyFrom(run_options)
            reply = self.link.call(_compute_of, request, conn=conn, timeout=timeout)
        finally:
            self._stager.release(staged)
        outputs = [targets[i] if i in targets else self._output(v, allocator, conn, fetch=i not in leave)
                   for i, v in enumerate(reply.outputs)]
        self.link.between_calls()
        return outputs

    def _owned(self, targets: Mapping[int, Tensor]) -> Mapping[int, Tensor]:
        """The targets in the memory of the worker that runs now (all of them, as given, in the common case)."""
        if all(owned(t.buffer, self.link) for t in targets.values()):
            return targets
        return {i: t for i, t in targets.items() if owned(t.buffer, self.link)}

    def _kept_inputs(self, inputs: Sequence[Any]) -> tuple[tuple, list, int, list[int], list[int]] | None:
        """(types and shapes, a True after those named by handle; the small inputs' bytes, their total size, the
        positions of the large ones, the positions of those named by handle) where every input is a tensor the
        worker has (named by handle) or this process can read: small ones travel inline, large ones through
        buffers this thread keeps for this call (named by handle too). Else None."""
        layout, parts, nbytes, large, named = [], [], 0, [], []
        for i, value in enumerate(inputs):
            if type(value) is not Tensor:
                return None
            if owned(value.buffer, self.link):  # an IOBinding's bound input, say
                layout.append((value.shape, value.dtype, True))
                named.append(i)
                continue
            array = value.local_array()
            if array is None:
                return None
            if value.nbytes < INLINE_LIMIT:
                layout.append((value.shape, value.dtype))
                parts.append(array)
                nbytes += value.nbytes
            elif self._staging is not None:
                # Named by handle as a bound input is: a call kept whatever its shapes (_general: ranks, not
                # sizes) must tell it from an inline one, or a repeat would send bytes where it kept a handle
                layout.append((value.shape, value.dtype, True))
                large.append(i)
                named.append(i)
            else:
                return None
        return tuple(layout), parts, nbytes, large, named

    def _compute_kept(self, conn, inputs: Sequence[Tensor], allocator: RemoteAllocator | None, timeout: float | None,
                      targets: Mapping[int, Tensor], keep: Sequence[int], leave: Sequence[int], layout: tuple,
                      parts: list, nbytes: int, large: list[int], named: list[int]) -> list[Any]:
        """A run a fast lane keeps (FastLane.call_kept), so that a steady stream of them sends the small inputs'
        bytes and the handles of the buffers the call names (the large inputs', which this thread keeps, the
        inputs the worker has, and those the `targets` outputs are written into), and gets the other outputs'
        bytes back (those in `keep` as handles to new buffers of the worker's), nothing else."""
        placed = tuple(i for i in keep if i not in targets) if keep else ()
        staged, write = {}, None
        if large:
            staged = dict(zip(large, self._staging.buffers(*self._kinds(inputs, layout, large))))
            write = _write_once(self._stager, [(buffer, inputs[i]) for i, buffer in staged.items()])
        # The buffers it names go by handle in every frame: a loop whose input is the last step's output (a new
        # buffer each step) repeats one kept call.
        handles = [staged[i].handle if i in staged else inputs[i].buffer.handle for i in named] if named else []
        if targets:
            handles += [targets[i].buffer.handle for i in sorted(targets)]
        if handles:
            parts = [struct.pack(f"<{len(handles)}Q", *handles), *parts]
            nbytes += 8 * len(handles)
        key = self._key(allocator, layout, targets, placed)

        def request_of() -> ep_pb2.ComputeRequest:
            if write is not None:
                write()
            return self._request(inputs, allocator, placed, targets, [], staged)

        result = self.link.run(lambda c: c.call_kept(c.ep.Compute, key, parts, nbytes, request_of, timeout, write,
                                                     None if targets else _general), conn=conn)
        outputs = self.kept_outputs(result, allocator, conn, targets, placed, leave)
        self.link.between_calls()
        return outputs

    def kept_outputs(self, result, allocator: RemoteAllocator | None, conn, targets: Mapping[int, Tensor] = _NO_TARGETS,
                     placed: tuple[int, ...] = (), leave: Sequence[int] = (), arrays: bool = False) -> list[Any]:
        """A kept Compute's outputs from what its call returned (FastLane.call_kept): the outputs that came back,
        in order (all but the `targets`), or the whole reply. With `arrays`, those that came back in a kept
        reply stay the arrays over it (a steady run's), but those left in the worker."""
        if isinstance(result, list):
            if not targets and not placed and _all_arrays(result):
                return result if arrays else [Tensor.trusted(a.shape, a.dtype, HOST_MEMORY, a.nbytes, host=a)
                                              for a in result]
            returned = iter(result)
            return [targets[i] if i in targets else self._returned(next(returned), allocator, conn, i, leave, arrays)
                    for i in range(len(result) + len(targets))]
        return [targets[i] if i in targets else self._output(v, allocator, conn, fetch=i not in leave)
                for i, v in enumerate(result.outputs)]

    def _key(self, allocator: RemoteAllocator | None, layout: tuple, targets: Mapping[int, Tensor],
             placed: tuple[int, ...]) -> tuple:
        """What makes a kept Compute of this partition the same call (FastLane.call_kept's key)."""
        return (self.handle, allocator.handle if allocator is not None else 0, layout,
                tuple((i, t.shape, t.dtype) for i, t in sorted(targets.items())) if targets else (), placed)

    @staticmethod
    def _kinds(inputs: Sequence[Tensor], layout: tuple, large: list[int]) -> tuple[tuple, list[int]]:
        """The staging buffers' key for the large inputs (their types and ranks: a loop's shapes change, their
        kinds not), and the sizes they take."""
        return tuple((len(layout[i][0]), layout[i][1]) for i in large), [inputs[i].nbytes for i in large]

    def steady(self, inputs: Sequence[Tensor], allocator: RemoteAllocator | None, outputs: Sequence[Any],
               keep: Sequence[int] = (), targets: Mapping[int, Tensor] = _NO_TARGETS) -> "SteadyCompute | None":
        """The Compute of `inputs` (tensors in this process's memory, or in this worker's, named by handle) as
        this thread just made it, its outputs in `keep` left in new buffers of `allocator` but those written into
        `targets` (tensors of this worker's, by position: the same every repeat), the others come back, held to be
        repeated with other arrays of the same types and shapes, and tensors of this worker's of the same types
        and shapes where it named some (client/steady.py); None where it is not a kept call on this thread's fast
        lane, or where its `outputs` are not of the types and shapes it was kept with (the worker answers it whole:
        outputs of a data-dependent shape)."""
        conn = self.link.current
        kept = self._kept_inputs(inputs) if conn is not None and conn.lane is not None and conn.kept_calls else None
        if kept is None or (keep and allocator is None) or (targets and self._owned(targets) is not targets):
            return None
        layout, _, nbytes, large, named = kept
        placed = tuple(i for i in keep if i not in targets)
        repeat = conn.lane.repeater(COMPUTE, self._key(allocator, layout, targets, placed))
        if repeat is None or repeat.outputs != [(getattr(v, "shape", None), getattr(v, "dtype", None))
                                                for i, v in enumerate(outputs) if i not in targets]:
            return None
        kinds, sizes = self._kinds(inputs, layout, large)
        buffers = self._staging.buffers(kinds, sizes) if large else ()  # (the worker's memory: only for a kept call)
        # Outputs too large to come back in the reply, left in new buffers of the worker's though not in `keep`
        # (as the call was kept: the run it is made from may have had them from elsewhere, the failure policy's
        # fallback)
        returned = [i for i in range(len(outputs)) if i not in targets]
        spilled = tuple(returned[k] for k in repeat.left if returned[k] not in placed)
        held = tuple(i for i in named if i not in large)  # the worker's tensors: a handle of their own each run
        staged = dict(zip(large, buffers))
        handles = [staged[i].handle if i in staged else None for i in named]
        handles += [targets[i].buffer.handle for i in sorted(targets)]
        # Each large input is written straight into an array over its staging buffer, of its type and shape
        # (KeptRepeat.written): a lane's worker shares its memory, so this process maps them (else: none is made)
        views = [buffer.host_view() for buffer in buffers]
        if any(v is None for v in views):
            return None
        copies = [(view[:inputs[i].nbytes].view(inputs[i].dtype).reshape(inputs[i].shape), i)
                  for view, i in zip(views, large)]
        return SteadyCompute(self, conn, repeat, allocator, [i for i in range(len(inputs)) if i not in named],
                             (self._staging, kinds, buffers), copies,
                             struct.pack(f"<{len(handles)}Q", *handles) if not held else handles,
                             8 * len(handles) + nbytes, held, placed, targets, spilled)

    def bound_steady(self, inputs: Sequence[Any], allocator: RemoteAllocator | None, outputs: Sequence[Any],
                     targets: Mapping[int, Tensor] = _NO_TARGETS) -> "BoundCompute | None":
        """The Compute of `inputs` (tensors in this process's memory, or this worker's, named by handle) as this
        thread's fast lane keeps it, held to be repeated with inputs of the same kinds, types and shapes (the large
        ones written into the staging buffers this thread keeps for the call), or of any shapes where it is kept
        with `keep_shapes` and takes no large input from this process (call_kept's `shaped`: a loop's call, whose
        shapes change every step): a session's steady IOBinding run (client/steady.py). Its outputs in this
        worker's memory (`outputs`, as the call just made them) are left there again, but those written into
        `targets` (tensors of this worker's, by position), which a repeat writes into tensors of their types and
        shapes (a pair swapped every step). None where the call is not kept on this thread's lane."""
        conn = self.link.current
        kept = self._kept_inputs(inputs) if conn is not None and conn.lane is not None and conn.kept_calls else None
        if kept is None or (targets and self._owned(targets) is not targets):
            return None
        layout, _, _, large, _ = kept
        placed = tuple(i for i, v in enumerate(outputs)
                       if i not in targets and type(v) is Tensor and owned(v.buffer, self.link))
        if placed and allocator is None:
            return None
        # Kept whatever its shapes first: a call kept with these shapes may be one step of a loop whose shapes grow
        # (never one writing into the caller's tensors, whose shapes are the call's)
        key = self._key(allocator, layout, targets, placed)
        repeat = conn.lane.repeater(COMPUTE, _general(key)[0]) if not large and not targets else None
        shapes, staged = None, None
        if repeat is None:
            repeat, shapes = conn.lane.repeater(COMPUTE, key), [shape for shape, *_ in layout]
            if repeat is None:
                return None
            if large:
                kinds, sizes = self._kinds(inputs, layout, large)
                staged = (self._staging, kinds, self._staging.buffers(kinds, sizes), self._stager)
        ways = [_STAGED if i in large else _NAMED if rest else _INLINE for i, (_, _, *rest) in enumerate(layout)]
        return BoundCompute(self, conn, repeat, allocator, [(len(shape), dtype, way) for (shape, dtype, *_), way
                                                            in zip(layout, ways)], shapes, placed, staged,
                            tuple((i, t.shape, t.dtype) for i, t in sorted(targets.items())))

    def _returned(self, value, allocator: RemoteAllocator | None, conn, i: int, leave: Sequence[int],
                  array: bool = False) -> Any:
        """Output i of a kept call: an array over its reply (as a tensor, unless `array`), or one it left in a new
        buffer of the worker's."""
        if type(value) is not Placed:
            return value if array else Tensor.trusted(value.shape, value.dtype, HOST_MEMORY, value.nbytes, host=value)
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
            host = np.frombuffer(ref.inline, dtype=dtype).reshape(shape).copy()
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


def _all_arrays(result: list) -> bool:
    """Whether every output of a kept call came back in its reply (none too large to, left in the worker)."""
    for value in result:
        if type(value) is Placed:
            return False
    return True


def _repeated(conn, repeat, parts: list, nbytes: int, copies: list, arrays: Sequence[Any], timeout: float | None):
    """A steady call's kept call repeated with its frame made whole (KeptRepeat.written), under the link's guard
    (WorkerLink.run): the call's deadline, or the connection's."""
    return repeat.written(parts, nbytes, copies, arrays, timeout or conn.timeout_s)


class SteadyCompute:
    """A partition's kept Compute as one thread made it (RemoteComputeInfo.steady): called with arrays of the
    types and shapes it was made with (and tensors of the worker's at the positions `held`), it sends the small
    ones' bytes, writes the large ones into the thread's staging buffers and names the worker's by handle, as
    _compute_kept does, having looked nothing up again. Valid while the worker, the thread's connection, the kept
    call and the staging buffers are the ones it was made with."""

    __slots__ = ("_info", "_conn", "_repeat", "_allocator", "_small", "_staged", "_copies", "_handles", "_nbytes",
                 "_held", "_placed", "_into", "_spilled", "_recycles")

    def __init__(self, info: RemoteComputeInfo, conn, repeat, allocator: RemoteAllocator | None, small: list[int],
                 staged: tuple, copies: list[tuple[np.ndarray, int]], handles: bytes | list, nbytes: int,
                 held: tuple[int, ...] = (), placed: tuple[int, ...] = (),
                 into: Mapping[int, Tensor] = _NO_TARGETS, spilled: tuple[int, ...] = ()):
        """`staged`: the partition's ThreadStaging, and the kinds and buffers it gave (ThreadStaging.holds), one for
        each large input, in order; `copies`: each large input's array over its buffer (of the input's type and shape)
        and position, which a repeat writes it into (KeptRepeat.written); `handles`: the handles a repeat names, packed,
        or where some inputs are tensors of the worker's (`held`), each named input's staging buffer's handle or None
        for those, then the targets'; `placed`: the outputs left in new buffers of the worker's (`keep`); `into`: the
        tensors of the worker's outputs are written into, by position; `spilled`: the outputs too large to come back in
        the reply, left in new buffers of the worker's and handed on as arrays over them (each keeps its buffer until it
        goes)."""
        self._info, self._conn, self._repeat, self._allocator = info, conn, repeat, allocator
        self._small, self._staged, self._copies = small, staged, copies
        self._handles, self._nbytes, self._held, self._placed, self._into = handles, nbytes, held, placed, into
        self._spilled = spilled
        self._recycles = info.link.recycles  # (read once: a link's policy does not change)

    def __call__(self, arrays: Sequence[Any], timeout: float | None) -> tuple[list[Any], bool] | None:
        """The outputs, and whether they are as the call was kept: arrays over the reply where it is a kept
        call's (what the session hands out, made no tensor of on the way; those left in the worker: tensors
        there; True), else as compute returns them (False: of other types or shapes); None where the call no
        longer repeats, or a tensor it names is not of the worker's (nothing ran)."""
        info = self._info
        link = info.link
        # The staging buffers are still this thread's for these inputs (a larger input of their kinds, since,
        # would have had them replaced, and given back to be used by others)
        staging, kinds, buffers = self._staged
        if link.conn is not self._conn or (buffers and not staging.holds(kinds, buffers)):
            return None
        handles = self._handles
        if self._held:
            handles = self._named(arrays)
            if handles is None:
                return None
        parts = [handles]
        for i in self._small:  # (a loop, not a comprehension: one Python call fewer on a run's cold caches)
            parts.append(arrays[i])
        result = link.run(_repeated, self._repeat, parts, self._nbytes, self._copies, arrays, timeout,
                          conn=self._conn)
        if result is None:
            return None
        kept = isinstance(result, list)
        if not kept:
            outputs = info.kept_outputs(result, self._allocator, self._conn, self._into)
        elif self._placed or self._into or self._spilled:
            outputs = info.kept_outputs(result, self._allocator, self._conn, self._into, self._placed, arrays=True)
            for i in self._spilled:
                outputs[i] = outputs[i].local_array()
        else:
            outputs = result
        if self._recycles:
            link.between_calls()
        return outputs, kept

    @property
    def inline(self) -> bool:
        """Whether every output comes back in the reply (none left in the worker or written into its tensors)."""
        return not (self._placed or self._into or self._spilled)

    def _named(self, values: Sequence[Any]) -> bytes | None:
        """The handles a repeat names: the staging buffers', and the held tensors' of this run (None where one is
        not a tensor of this worker's)."""
        handles, held = list(self._handles), iter(self._held)
        for k, handle in enumerate(handles):
            if handle is None:
                i = next(held)
                value = values[i]
                if type(value) is not Tensor or value.buffer is None or value.buffer.owner is not self._conn:
                    return None
                handles[k] = value.buffer.handle
        return struct.pack(f"<{len(handles)}Q", *handles)


class BoundCompute:
    """A partition's kept Compute as one thread made it (RemoteComputeInfo.bound_steady): called with tensors of
    the kinds (small ones in this process's memory, large ones written into the thread's staging buffers, or the
    worker's, named by handle), types and ranks it was made with, and of its shapes where it was not kept with
    `keep_shapes`, it sends what call_kept sends in a repeat of it (the inputs' dimensions where it was, the
    handles of the buffers it names, the small ones' bytes), having looked nothing up again. Valid while the
    worker, the thread's connection and its staging buffers are the ones it was made with, and the call is kept
    there."""

    __slots__ = ("_info", "_conn", "_repeat", "_allocator", "_kinds", "_shapes", "placed", "into", "_staged",
                 "_dims", "_handles", "_recycles")

    def __init__(self, info: RemoteComputeInfo, conn, repeat, allocator: RemoteAllocator | None,
                 kinds: list[tuple[int, np.dtype, int]], shapes: list[tuple[int, ...]] | None,
                 placed: tuple[int, ...], staged: tuple | None = None, into: tuple = ()):
        """`kinds`: each input's (rank, dtype, how it travels); `shapes`: each input's shape, None where the call
        was kept with `keep_shapes`; `placed`: the outputs left in the worker; `staged`: the partition's
        ThreadStaging, the kinds and buffers it gave (one for each staged input, in order) and the Stager;
        `into`: the (position, shape, dtype) of each output written into a tensor of the worker's, in order."""
        self._info, self._conn, self._repeat, self._allocator = info, conn, repeat, allocator
        self._kinds, self._shapes, self.placed, self.into, self._staged = kinds, shapes, placed, into, staged
        self._dims = struct.Struct(f"<{sum(rank for rank, _, _ in kinds)}Q") if shapes is None else None
        self._handles = struct.Struct(f"<{sum(1 for *_, way in kinds if way != _INLINE) + len(into)}Q")
        self._recycles = info.link.recycles  # (as SteadyCompute's)

    def __call__(self, inputs: Sequence[Any], timeout: float | None,
                 targets: Sequence[Tensor] = ()) -> list[Any] | None:
        """The outputs (those in `placed` as tensors in the worker's memory, those `into` the `targets`, one per
        position of `into`, in order); None where the inputs or targets are not as it was made with, or the call
        no longer repeats (nothing ran then)."""
        info, shapes, staged = self._info, self._shapes, self._staged
        link = info.link
        # The staging buffers are still this thread's for these inputs (see SteadyCompute)
        if link.conn is not self._conn or (staged is not None and not staged[0].holds(staged[1], staged[2])) \
                or len(targets) != len(self.into):
            return None
        conn = self._conn
        dims, handles, parts, nbytes, writes = [], [], [], 0, []
        buffers = iter(staged[2]) if staged is not None else None
        for i, (value, (rank, dtype, way)) in enumerate(zip(inputs, self._kinds)):
            if type(value) is not Tensor or value.dtype != dtype:
                return None
            if shapes is None:
                if len(value.shape) != rank:
                    return None
                dims += value.shape
            elif value.shape != shapes[i]:
                return None
            buffer = value.buffer
            if buffer is not None and buffer.owner is conn:  # (owned: the link's connection is this one)
                if way != _NAMED:
                    return None
                handles.append(buffer.handle)
                continue
            array = value.local_array() if way != _NAMED else None
            if array is None:
                return None
            if way == _STAGED:
                buffer = next(buffers)
                handles.append(buffer.handle)
                writes.append((buffer, value))
            elif shapes is None and value.nbytes >= INLINE_LIMIT:  # (a call kept with its shapes keeps its sizes)
                return None
            else:
                parts.append(array)
                nbytes += value.nbytes
        for target, (_, shape, dtype) in zip(targets, self.into):
            if type(target) is not Tensor or target.shape != shape or target.dtype != dtype \
                    or not owned(target.buffer, link):
                return None
            handles.append(target.buffer.handle)
        head = self._handles.pack(*handles) if shapes is not None else \
            self._dims.pack(*dims) + self._handles.pack(*handles)
        if head:
            parts.insert(0, head)
            nbytes += len(head)
        if writes:
            write = _write_once(staged[3], writes)
            result = link.run(lambda c: self._repeat(parts, nbytes, timeout or c.timeout_s, write), conn=conn)
        else:  # nothing to write: its frame made whole at once (KeptRepeat.written), as a steady run's
            result = link.run(_repeated, self._repeat, parts, nbytes, (), (), timeout, conn=conn)
        if result is None:
            return None
        written = {i: t for (i, _, _), t in zip(self.into, targets)} if targets else _NO_TARGETS
        outputs = info.kept_outputs(result, self._allocator, conn, written, self.placed, self.placed)
        if self._recycles:
            link.between_calls()
        return outputs


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
