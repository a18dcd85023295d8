"""Ep over gRPC (OrtEp, OrtNodeComputeInfo): GetCapability and Compile against a model sent once, and
Compute over graph values that stay in this worker's memory between partitions."""
from __future__ import annotations

import time

from ephost.errors import EpDeadlineExceeded, EpInvalidArgument, EpNotFound, quoted
from ephost.run_options import checked
from ephost.eps.base import ComputeCall, FusedGraph, capability
from ephost.tensor import Tensor
from ephost.server.capabilities import CapabilityCache
from ephost.server.kept_calls import KeptRequest
from ephost.server.rpc import Servicer, rpc
from ephost.server.tensors import input_value, into_value, output_buffers, output_value
from ephost.v1 import common_pb2, ep_pb2

_NO_TENSORS: dict = {}  # never written to


class EpService(Servicer):
    SERVICE = "ephost.v1.Ep"

    @rpc
    def GetCapability(self, request, call):
        client = call.client
        ep = client.get("ep", request.ep)
        index = self.state.model(client, request.model, call.deadline)
        claimed = frozenset(request.claimed_nodes)
        groups, cached = self.state.capabilities.answer(CapabilityCache.key(ep, index.digest, claimed),
                                                        lambda: capability(ep, index.model, claimed, index.external))
        if cached:
            self.state.stats.add(capability_cache_hits=1)
        elif call.deadline is not None and time.monotonic() > call.deadline:  # (kept: a retry is answered at once)
            raise EpDeadlineExceeded("the call's deadline passed while the EP looked at the model")
        kind = ep_pb2.NodeGroup.Kind
        return ep_pb2.GetCapabilityResponse(groups=[
            ep_pb2.NodeGroup(kind=kind.KIND_FUSED if g.fused else kind.KIND_SINGLE, node_names=list(g.node_names))
            for g in groups])

    @rpc
    def Compile(self, request, call):
        client = call.client
        ep = client.get("ep", request.ep)
        index = self.state.model(client, request.model, call.deadline)
        for g in request.graphs:
            unknown = [n for n in g.nodes if n not in index.nodes]
            if unknown or not g.nodes:
                raise EpInvalidArgument(f"fused graph {quoted(g.name)} names no node of the model" if not g.nodes else
                                        f"fused graph {quoted(g.name)} names {len(unknown)} node(s) the model does not "
                                        f"have: {', '.join(quoted(n) for n in unknown[:5])}")
        graphs = [FusedGraph(g.name, index, tuple(g.nodes), tuple(g.inputs), tuple(g.outputs))
                  for g in request.graphs]
        infos = ep.compile(graphs)
        restored = sum(1 for i in infos if getattr(i, "restored", False))
        shared = sum(1 for i in infos if getattr(i, "shared", False))
        self.state.stats.add(partitions_compiled=len(infos) - restored - shared, partitions_restored=restored,
                             partitions_shared=shared)
        contexts = [getattr(i, "ep_context", None) for i in infos]
        return ep_pb2.CompileResponse(node_compute_infos=[client.add("compute_info", (ep, i)) for i in infos],
                                      ep_contexts=[c.encode() if c is not None else b"" for c in contexts])

    @rpc
    def Compute(self, request, call):
        """A Compute from its whole request (gRPC, or a fast-lane frame): the same run as a kept call's repeat."""
        client = call.client
        _, info = client.get("compute_info", request.node_compute_info)
        # Checked whether the EP reads them or not: a malformed request is refused the same everywhere.
        options = checked(request.run_options) if request.HasField("run_options") else None
        allocator = client.get("allocator", request.output_allocator) if request.output_allocator else None
        stream = client.get("stream", request.stream) if request.stream else None
        inputs, resident, bytes_here, bytes_moved, inline = [], 0, 0, 0, 0
        for i, message in enumerate(request.inputs):
            value, here, sent_inline = input_value(self.state, client, message, i)
            inputs.append(value)
            if here:
                resident += 1
                bytes_here += value.nbytes
            else:
                moved = value.nbytes if isinstance(value, Tensor) else len(message.onnx.data)
                bytes_moved += moved
                inline += moved if sent_inline else 0
        # What the request leaves empty in the common case is not looked at further (each look costs).
        into = output_buffers(self.state, client, request.output_buffers) if request.output_buffers else None
        if stream is not None:
            stream.flush(call.time_remaining())  # inputs may still be arriving on the stream
        keep = tuple(request.keep) if request.keep else ()
        counts = call.counts = {"compute_inputs_resident": resident,
                                "compute_inputs_transferred": len(inputs) - resident,
                                "compute_input_bytes_resident": bytes_here,
                                "compute_input_bytes_transferred": bytes_moved, "bytes_inline_in": inline}
        outputs = _run(info, ComputeCall(inputs, allocator, keep, into or _NO_TENSORS, run_options=options,
                                         on_kernel_ran=call.ran), call, counts)
        return self._reply(client, outputs, allocator, keep, request.inline_limit, into, request.output_buffers,
                           counts)

    def compute_kept(self, request: KeptRequest, call):
        """A kept Compute repeated (server/kept_calls.py): the same run as a whole request's, read from the
        repeat's frame; a KeptReply, or a whole ComputeResponse where an output is not of its kept type and
        rank."""
        kept, payload, written = request
        client = call.client
        _, info = client.get("compute_info", kept.compute_info)
        allocator = client.get("allocator", kept.allocator) if kept.allocator else None
        call.counts = {"kept_calls": 1}  # what a repeat refused as its frame is read counts
        inputs, handles, counts = kept.input_tensors(payload, client)
        call.counts = counts
        into = kept.into_tensors(handles, client) if kept.into else None
        if written is not None:
            written()
        keep = kept.keep
        # Positional: a call with keywords costs more (no leave, run options or timeout: a repeat carries none)
        outputs = _run(info, ComputeCall(inputs, allocator, keep, into or _NO_TENSORS, (), None, None, call.ran),
                       call, counts)
        reply = kept.reply(outputs)
        if reply is None:
            return self._reply(client, outputs, allocator, keep, kept.inline_limit, into,
                               kept.into_refs(handles) if into else None, counts)
        if into:
            kept.write_into(client, handles, into, outputs, counts)
        parts, counts["bytes_inline_out"], nbytes = reply
        if not kept.placed:
            return parts, nbytes, ()
        records, regions = kept.place(client, allocator, outputs, counts)
        return [*parts, records], nbytes, regions

    def _reply(self, client, outputs, allocator, keep, inline_limit: int, into, output_buffers,
               counts: dict[str, int]) -> ep_pb2.ComputeResponse:
        """A Compute's reply: each output written into the caller's buffer (`into`), left in `allocator`, or
        inline; what that moved counted in `counts` (the call's, recorded as it ends, failed or not)."""
        reply = ep_pb2.ComputeResponse()
        add = reply.outputs.add
        for i, value in enumerate(outputs):
            if into and i in into:
                into_value(client, output_buffers[i], into[i], value, add(), counts)
            else:
                output_value(self.state, client, allocator, 0 if i in keep else inline_limit, value, add(), counts)
        return reply

    @rpc
    def ReleaseNodeComputeInfos(self, request, call):
        client = call.client
        ep = client.get("ep", request.ep)
        handles = list(dict.fromkeys(request.node_compute_infos))
        # All or nothing: every handle is checked before any is released.
        for h in handles:
            if client.get("compute_info", h)[0] is not ep:
                raise EpNotFound(f"compute info {h} was not compiled by ep {request.ep}")
        infos = [client.pop("compute_info", h)[1] for h in handles]
        ep.release_node_compute_infos(infos)
        return common_pb2.Empty()

    @rpc
    def GetPreferredDataLayout(self, request, call):
        return ep_pb2.DataLayout(layout=call.client.get("ep", request.id).get_preferred_data_layout())

    @rpc
    def SetDynamicOptions(self, request, call):
        call.client.get("ep", request.ep).set_dynamic_options(dict(request.options))
        return common_pb2.Empty()

    @rpc
    def OnRunStart(self, request, call):
        call.client.get("ep", request.ep).on_run_start(dict(request.run_options))
        return common_pb2.Empty()

    @rpc
    def OnRunEnd(self, request, call):
        call.client.get("ep", request.ep).on_run_end(request.sync_stream)
        return common_pb2.Empty()

    @rpc
    def StartProfiling(self, request, call):
        call.client.get("ep", request.id).start_profiling()
        return common_pb2.Empty()

    @rpc
    def EndProfiling(self, request, call):
        events = call.client.get("ep", request.id).end_profiling()
        return ep_pb2.ProfilingEvents(events=[
            ep_pb2.ProfilingEvent(name=e.name, category=e.category, start_ns=e.start_ns, duration_ns=e.duration_ns,
                                  args=dict(e.args), pid=e.pid, tid=e.tid) for e in events])


def _run(info, compute: ComputeCall, call, counts: dict[str, int]) -> list:
    """The EP's run of one Compute, whole or kept; its caller woken as it ends where it sleeps for the reply
    (Call.ran, the fast lane's early wake), and that counted."""
    outputs = info.compute(compute)
    if call.ran is not None and call.ran():
        counts["early_wakes"] = 1
    return outputs
