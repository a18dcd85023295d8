"""The bridged OrtEp and its OrtNodeComputeInfos: GetCapability, Compile and Compute forwarded to an ephost EP
(a worker, through ephost's client), with ORT's graphs read as ONNX models and ORT's tensors as numpy views."""
from __future__ import annotations

import ctypes
import logging
import threading
from ctypes import c_size_t, c_void_p
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from ephost import ep_context
from ephost.client.runner import compute_and_hold
from ephost.eps.base import ComputeCall, FusedGraph
from ephost.errors import EpInvalidArgument, EpNotFound, EpWorkerDraining
from ephost.graph import GraphIndex, cluster
from ephost.ort import abi as A
from ephost.ort.callbacks import Guard, Strings, fill, forget, keep
from ephost.ort.context import ContextRequest, context_node
from ephost.ort.profiler import BridgeProfiler
from ephost.ort.graph_reader import GraphReader
from ephost.ort.resident import MIN_BYTES, Learned, PartitionCopies
from ephost.ort.values import array_over, string_bytes, write_strings
from ephost.tensor import Tensor

if TYPE_CHECKING:
    from ephost.ort.factory import BridgeFactory

log = logging.getLogger(__name__)

_NOTHING: Mapping = MappingProxyType({})  # never written to


class BridgeEp:
    """OrtEp: one per ORT session that selected the bridged devices; an EP in the worker behind it."""

    def __init__(self, factory: "BridgeFactory", remote, context: ContextRequest):
        self.factory, self.remote = factory, remote
        self.context = context  # what the session asks of EPContext nodes
        self.abi = factory.abi
        self.name = factory.name
        self.guard = Guard(self.abi, self.name)
        self.reader = GraphReader(self.abi)
        self._strings = Strings()
        # initializers stay in the worker
        self.fusion_options = A.OrtNodeFusionOptions(min(self.abi.minor, A.FUSION_OPTIONS_VERSION), True)
        self._capability = None  # (ReadGraph, GraphIndex, value types) of the last top-level GetCapability
        self.struct = A.OrtEp()
        fill(self.struct, A.EP, self.abi, {
            "GetName": lambda this: self.guard.quiet("GetName", lambda: self._strings(self.name)),
            "GetCapability": lambda this, graph, info: self.guard.status(
                "GetCapability", lambda: self.get_capability(graph, info)),
            "Compile": lambda this, graphs, fused, count, infos, ctx_nodes: self.guard.status(
                "Compile", lambda: self.compile(graphs, fused, count, infos, ctx_nodes)),
            "ReleaseNodeComputeInfos": lambda this, infos, count: self.guard.quiet(
                "ReleaseNodeComputeInfos", lambda: self.release_node_compute_infos(infos, count)),
            "SetDynamicOptions": lambda this, keys, values, count: self.guard.status(
                "SetDynamicOptions", lambda: self.remote.set_dynamic_options(
                    {keys[i].decode(): (values[i] or b"").decode() for i in range(count)})),
            "CreateProfiler": lambda this, out: self.guard.status("CreateProfiler", lambda: self._profiler(out)),
            "GetCompiledModelCompatibilityInfo": lambda this, graph: self.guard.quiet(
                "GetCompiledModelCompatibilityInfo", lambda: self._strings(factory.compatibility_info())),
        })
        self.address = keep(self, self.struct)

    def _profiler(self, out) -> None:
        out[0] = BridgeProfiler(self).address

    # --- GetCapability ---

    def get_capability(self, graph: int, support_info: int) -> None:
        if self.reader.is_nested(graph):
            return  # a control-flow node's body: the worker is asked about the whole node in its parent graph
        read = self.reader.read(graph)
        if any(ep_context.is_ep_context(n) for n in read.model.graph.node):
            model_dir = self.reader.model_dir(graph)  # forms kept beside a compiled model go to the worker inside it
            for node in read.model.graph.node:
                if ep_context.is_ep_context(node):
                    ep_context.embed(node, model_dir)
        index = GraphIndex.of(read.model)
        g = read.model.graph
        self._capability = (read, index, {v.name: tensor_kind(v) for v in [*g.input, *g.output, *g.value_info]})
        claimed = frozenset(name for name, node in read.nodes.items() if self._assigned_elsewhere(node))
        groups = self.remote.get_capability(read.model, claimed)
        for group in groups:
            missing = [n for n in group.node_names if n not in read.nodes]
            if missing:
                raise EpInvalidArgument(f"the worker claimed nodes the graph does not have: {missing[:5]}")
        fused = []
        for names in acyclic_groups(index, [g.node_names for g in groups]):
            crossing = [v for v in (lambda io: io[0] + io[1])(index.partition_io(names)) if v in read.non_tensors]
            if crossing:  # a kernel context carries tensors only: ORT's CPU EP keeps these nodes
                log.info("%s: leaving %d node(s) to ORT: non-tensor values %s would cross the partition's edge",
                         self.name, len(names), crossing[:3])
                continue
            fused.append(names)
        for names in fused:
            nodes = (c_void_p * len(names))(*[read.nodes[n] for n in names])
            self.abi.check(self.abi.ep_api.EpGraphSupportInfo_AddNodesToFuse(
                support_info, nodes, len(names), ctypes.addressof(self.fusion_options)),
                "EpGraphSupportInfo_AddNodesToFuse")
        log.info("%s: GetCapability took %d of %d nodes in %d group(s) (the worker said %d)", self.name,
                 sum(map(len, fused)), len(read.nodes), len(fused), len(groups))

    def _assigned_elsewhere(self, node: int) -> bool:
        ep = ctypes.c_char_p()
        self.abi.check(self.abi.api.Node_GetEpName(node, ctypes.byref(ep)), "Node_GetEpName")
        return bool(ep.value) and ep.value.decode() != self.name

    # --- Compile ---

    def compile(self, graphs, fused_nodes, count: int, infos_out, context_nodes=None) -> None:
        api = self.abi.api
        fused: list[FusedGraph] = []
        reused = 0
        for i in range(count):
            node = fused_nodes[i]
            name = self.reader.string(api.Node_GetName, node, "Node_GetName")
            inputs = [self.reader.string(api.GetValueInfoName, v, "GetValueInfoName") if v else ""
                      for v in self.reader.array(api.Node_GetNumInputs, api.Node_GetInputs, node, "Node_GetInputs")]
            outputs = [self.reader.string(api.GetValueInfoName, v, "GetValueInfoName") if v else ""
                       for v in self.reader.array(api.Node_GetNumOutputs, api.Node_GetOutputs, node, "Node_GetOutputs")]
            source, nodes = self._in_capability_model(graphs[i])
            reused += source is not None
            if source is None:  # not the graph GetCapability read: read this one
                read = self.reader.read(graphs[i], exact_edges=False)
                source, nodes = GraphIndex.of(read.model), tuple(read.nodes)
            fused.append(FusedGraph(name, source, nodes, tuple(inputs), tuple(outputs)))
        log.info("%s: Compile of %d partition(s), %d of them cut from the model GetCapability sent", self.name,
                 count, reused)
        compiled = self.remote.compile(fused)
        made = [BridgeComputeInfo(self, graph, info) for graph, info in zip(fused, compiled)]
        for i, info in enumerate(made):
            infos_out[i] = info.address
        if self.context.enabled and context_nodes:  # ORT is writing a compiled model: each partition's EPContext node
            source = self.factory.worker_ep()[0]
            for i, (graph, info) in enumerate(zip(fused, compiled)):
                context_nodes[i] = context_node(self.abi, graph, info, source, self.context)

    def _in_capability_model(self, graph: int) -> tuple[GraphIndex | None, tuple[str, ...]]:
        """The fused graph's nodes as names in the model GetCapability sent, which the worker already holds (so
        Compile sends no weights again), where every node is one GetCapability read, by id and operator."""
        if self._capability is None:
            return None, ()
        read, index, types = self._capability
        api = self.abi.api
        # the partition's edges must carry the element types the compile graph gives them
        edges = self.reader.array(api.Graph_GetNumInputs, api.Graph_GetInputs, graph, "Graph_GetInputs") + \
            self.reader.array(api.Graph_GetNumOutputs, api.Graph_GetOutputs, graph, "Graph_GetOutputs")
        for v in edges:
            info = self.reader.value_info(v, required=False) if v else None
            if info is None or types.get(info.name) != tensor_kind(info):
                return None, ()
        names = []
        for node in self.reader.array(api.Graph_GetNumNodes, api.Graph_GetNodes, graph, "Graph_GetNodes"):
            name = read.ids.get(self.reader.node_id(node))
            op = self.reader.string(api.Node_GetOperatorType, node, "Node_GetOperatorType")
            if name is None or index.nodes[name].op_type != op:
                return None, ()
            names.append(name)
        return index, tuple(names)

    def release_node_compute_infos(self, infos, count: int) -> None:
        owners = [o for o in (forget(infos[i]) for i in range(count)) if isinstance(o, BridgeComputeInfo)]
        for owner in owners:
            if owner.copies is not None:
                owner.copies.release()
        remote = [o.remote for o in owners]
        if remote:
            try:
                self.remote.release_node_compute_infos(remote)
            except EpNotFound as e:  # made on a worker that has since died: gone with it
                log.debug("%s: releasing compute infos: %s", self.name, e)

    def release(self) -> None:
        forget(self.address)
        self.remote.release()

def tensor_kind(info) -> int:
    """The element type of a tensor ValueInfoProto: what a partition edge must agree on (ORT's shapes of
    intermediate values are not trusted, see GraphReader.value_info)."""
    return info.type.tensor_type.elem_type

def acyclic_groups(index: GraphIndex, groups: list[tuple[str, ...]]) -> list[list[str]]:
    """The worker's groups, each split where fusing it whole would put a node outside it on a path between two of
    its nodes (ephost's own rule, ephost.graph.cluster): ORT fuses what it is given without that check."""
    key_of: dict[str, object] = {node: ("other", node) for node in index.order}
    for i, names in enumerate(groups):
        for name in names:
            key_of[name] = i
    clusters = cluster(index, key_of, set(range(len(groups))))
    return [c.nodes for c in clusters if isinstance(c.key, int)]

class BridgeComputeInfo:
    """OrtNodeComputeInfo of one fused partition: Compute reads the kernel context's inputs (views of ORT's
    memory), runs the partition in the worker over ephost's data plane, and writes ORT's outputs."""

    def __init__(self, ep: BridgeEp, graph: FusedGraph, remote):
        self.ep, self.graph, self.remote = ep, graph, remote
        self.abi = ep.abi
        guard = ep.guard
        self._what = f"Compute of {graph.name}"
        self.struct = A.OrtNodeComputeInfo()
        fill(self.struct, A.COMPUTE_INFO, self.abi, {
            "CreateState": lambda this, context, state: guard.status("CreateState", lambda: self._state(state)),
            "Compute": self._on_compute,
            "ReleaseState": lambda this, state: None,
        })
        self.address = keep(self, self.struct)
        self._held = threading.local()  # each of ORT's threads' kept call for this partition (compute_and_hold)
        self._output_count: int | None = None
        kept = ep.factory.kept
        # what its Computes keep in the worker's memory (resident.py)
        self.copies = PartitionCopies(kept, self.address) if kept is not None else None

    def _state(self, state_out) -> None:
        state_out[0] = self.address

    def _on_compute(self, this, state, context) -> int | None:
        """ORT's Compute: errors as an OrtStatus (Guard.status's work, without its closure every run)."""
        try:
            self.compute(context)
            return None
        except BaseException as e:  # noqa: BLE001 - nothing may unwind into ORT
            return self.ep.guard.failed(self._what, e)

    def compute(self, context: int) -> None:
        held = getattr(self._held, "calls", None)
        if held is None:
            held = self._held.calls = [None]
        # What the Compute copied (bytes in, bytes out) and named in place (inputs, outputs), counted however it
        # ends: a Compute that fails in the worker copied its inputs all the same.
        crossed = [0, 0, 0, 0]
        try:
            self._run(context, crossed, held)
        except EpWorkerDraining:
            # Refused by a worker this process is replacing (past its memory limit), nothing of it run: made again
            # on the successor (WorkerLink.wait_replaced), as a session's Compute is.
            if not self.remote.link.wait_replaced():
                raise
            self._run(context, crossed, held)
        finally:
            self.ep.factory.stats.count(crossed)

    def _run(self, context: int, crossed: list[int], held: list) -> None:
        """One Compute: ORT's tensors in the worker's memory named by handle, the others' bytes sent (the
        transport repeats the call with only what changes where it keeps calls: `held`, this thread's); what it
        copied added to `crossed`."""
        factory = self.ep.factory
        io = factory.kernel_io
        arrays, addresses = io.inputs(context)
        memory, copies = factory.memory, self.copies
        inputs: list[Any] = []
        in_place = in_bytes = 0
        wanted: list[tuple[int, int, int]] = []  # large inputs that may go as the worker's kept copy of ORT's
        brought: dict[int, Tensor] = {}  # those that do
        try:
            for i, array in enumerate(arrays):
                if array is None:
                    raise EpInvalidArgument(f"input {i} of {self.graph.name} is missing")
                if array.dtype.hasobject:
                    inputs.append(array)  # strings, read out of ORT's: their bytes go
                    in_bytes += string_bytes(array)
                    continue
                nbytes = array.nbytes
                if memory is not None and nbytes:
                    buffer = memory.buffer_at(addresses[i])
                    if buffer is not None:  # in the worker's memory already: named by handle
                        inputs.append(Tensor.trusted(array.shape, array.dtype, buffer.memory_info, nbytes,
                                                     buffer=buffer))
                        in_place += 1
                        continue
                    if copies is not None and nbytes >= MIN_BYTES:
                        wanted.append((i, addresses[i], nbytes))
                        inputs.append(array)  # (replaced by its copy below, where it has one)
                        continue
                inputs.append(array)  # ORT's memory, this process's: its bytes go
                in_bytes += nbytes
            made = copies.bring_in(wanted) if wanted else _NOTHING
            for i, _, nbytes in wanted:
                array = arrays[i]
                if i in made:  # the worker's copy of it, brought up to date: named by handle
                    buffer, copied = made[i]
                    inputs[i] = brought[i] = Tensor.trusted(array.shape, array.dtype, buffer.memory_info, nbytes,
                                                            buffer=buffer)
                    in_bytes += copied
                else:
                    in_bytes += nbytes
        finally:
            crossed[0] += in_bytes
            crossed[2] += in_place
        at = copies.targets(brought, addresses, lambda o, shape: io.output(context, o, shape)[1]) \
            if brought else _NOTHING
        into = {o: tensor for o, (tensor, _) in at.items()} if at else _NOTHING
        # Large outputs stay in the worker's memory (handed to ORT as they are, with the device memory, or kept
        # as the copy of ORT's memory they are brought out into); small ones come back inline: a buffer per
        # small output and its free cost more than the copy.
        allocator = factory.output_allocator()
        keep = copies.keep(into) if copies is not None else ()
        # This thread's held call repeated where it applies, else the call made through compute, which holds it
        # anew (as a run's step does: the ComputeCall is made only then)
        kept, outputs = held[0], None
        if kept is not None and kept.info is self.remote and kept.repeats(allocator, keep):
            outputs = kept.repeat(inputs, into, None)
        if outputs is None:
            outputs = compute_and_hold(self.remote, ComputeCall(inputs, allocator, keep, into), held, 0)
        if memory is not None:  # ORT's outputs in the memory of the worker that ran it (after a restart: this way)
            memory.refresh()
        self._write_outputs(context, outputs, crossed, addresses, at)

    def _write_outputs(self, context: int, outputs: list[Any], crossed: list[int], addresses: list[int],
                       at: Mapping[int, tuple[Tensor, int]]) -> None:
        """ORT's outputs from the partition's: an output in the worker's memory handed over as it is (ORT's
        output tensor is the worker's buffer), or brought out of it into ORT's memory, where ORT had that
        allocated, as the worker's kept copy of it (resident.py; `at`: those the worker wrote into an input's
        copy, and that input); the others' bytes copied into ORT's. What it copied is added to `crossed`."""
        factory = self.ep.factory
        memory, io, copies = factory.memory, factory.kernel_io, self.copies
        if self._output_count is None:  # the fused node's, the same every Compute
            n = c_size_t()
            self.abi.check(self.abi.api.KernelContext_GetOutputCount(context, ctypes.byref(n)),
                           "KernelContext_GetOutputCount")
            self._output_count = n.value
        if self._output_count != len(outputs):
            raise EpInvalidArgument(f"{self.graph.name} made {len(outputs)} outputs where ORT expects "
                                    f"{self._output_count}")
        learned = Learned() if copies is not None else None
        out_place = out_bytes = 0
        try:
            if at:  # made already, in the memory of the input whose copy the worker wrote each into
                out_bytes += copies.bring_out_in_place(learned, [(o, k, addresses[k], outputs[o])
                                                                 for o, (_, k) in at.items()])
            for i, out in enumerate(outputs):
                if at and i in at:
                    continue
                if type(out) is np.ndarray:  # (the common case: an array over the reply)
                    array, buffer = out, None
                elif isinstance(out, Tensor):
                    array, buffer = out.numpy(), out.buffer
                else:
                    array, buffer = np.asarray(out), None
                offered = memory.offer(buffer) if buffer is not None and memory is not None else None
                value = address = 0
                try:
                    value, address, elem, view = io.output(context, i, array.shape)
                finally:
                    taken = offered is not None and memory.taken(offered, address)
                if taken:  # ORT's output is the worker's buffer: it is ORT's to free now
                    out.detach_buffer()
                    out_place += 1
                    continue
                strings = array.dtype.hasobject
                if copies is not None and address and not strings:
                    copied = copies.bring_out(learned, i, address, array.nbytes, out, addresses)
                    if copied is not None:  # only what changed, from the worker's buffer, now the copy of ORT's
                        out_bytes += copied
                        continue
                if strings:
                    out_bytes += write_strings(self.abi, value, array)
                elif array.size:
                    target = array_over(address, elem, array.shape) if view is None else view
                    if target.dtype != array.dtype:
                        raise EpInvalidArgument(f"output {i} of {self.graph.name} is {array.dtype}, where ORT's is "
                                                f"{target.dtype}")
                    target[...] = array  # (np.copyto's dispatch costs more than the copy of a small output)
                    out_bytes += array.nbytes
                if buffer is not None:
                    out.release()
        finally:
            crossed[1] += out_bytes
            crossed[3] += out_place
        if copies is not None:
            copies.done(learned)
