"""Ep over gRPC (OrtEp, OrtNodeComputeInfo): GetCapability, Compile and Compute over tensor references."""
from __future__ import annotations

import numpy as np
import onnx

from ephost.eps.base import FusedGraph
from ephost.errors import EpInvalidArgument
from ephost.tensor import Tensor, check_copy_pairs
from ephost.server.rpc import rpc
from ephost.server.state import WorkerState
from ephost.server.tensors import resolve, to_ref
from ephost.v1 import common_pb2, ep_pb2, ep_pb2_grpc


def _parse_model(data: bytes) -> onnx.ModelProto:
    try:
        return onnx.load_model_from_string(data)
    except Exception as e:
        raise EpInvalidArgument(f"model bytes are not a valid ONNX model: {type(e).__name__}") from None


class EpService(ep_pb2_grpc.EpServicer):
    SERVICE = "Ep"

    def __init__(self, state: WorkerState):
        self.state = state

    def _client(self, context):
        return self.state.clients.lookup(context.invocation_metadata())

    @rpc
    def GetCapability(self, request, context):
        ep = self._client(context).get("ep", request.ep)
        model = _parse_model(self.state.model(request.model))
        groups = ep.get_capability(model, frozenset(request.claimed_nodes))
        kind = ep_pb2.NodeGroup.Kind
        return ep_pb2.GetCapabilityResponse(groups=[
            ep_pb2.NodeGroup(kind=kind.KIND_FUSED if g.fused else kind.KIND_SINGLE, node_names=list(g.node_names))
            for g in groups])

    @rpc
    def Compile(self, request, context):
        client = self._client(context)
        ep = client.get("ep", request.ep)
        graphs = [FusedGraph(g.name, _parse_model(self.state.model(g.model))) for g in request.graphs]
        infos = ep.compile(graphs)
        return ep_pb2.CompileResponse(node_compute_infos=[client.add("compute_info", (ep, i)) for i in infos])

    @rpc
    def Compute(self, request, context):
        client = self._client(context)
        _, info = client.get("compute_info", request.node_compute_info)
        stream = client.get("stream", request.stream) if request.stream else None
        inputs = resolve(self.state, client, request.inputs, "input", writable=False)
        outputs = resolve(self.state, client, request.outputs, "output", writable=True)
        if stream is not None:
            stream.flush(context.time_remaining())  # inputs may still be arriving on the stream
        results = info.compute([t.local_array() for t in inputs.tensors])
        self.state.stats.add(bytes_inline_in=inputs.inline_bytes)
        produced = [Tensor.from_numpy(np.ascontiguousarray(r)) for r in results]
        if not request.outputs:
            return ep_pb2.ComputeResponse(outputs=[to_ref(t) for t in produced])
        check_copy_pairs(produced, outputs.tensors)
        for src, dst in zip(produced, outputs.tensors):
            dst.local_bytes()[:] = src.local_bytes()
        return ep_pb2.ComputeResponse(outputs=[to_ref(outputs.tensors[i]) for i in outputs.replies])

    @rpc
    def ReleaseNodeComputeInfos(self, request, context):
        client = self._client(context)
        ep = client.get("ep", request.ep)
        infos = [client.pop("compute_info", h)[1] for h in request.node_compute_infos]
        ep.release_node_compute_infos(infos)
        return common_pb2.Empty()

    @rpc
    def GetPreferredDataLayout(self, request, context):
        return ep_pb2.DataLayout(layout=self._client(context).get("ep", request.id).get_preferred_data_layout())

    @rpc
    def SetDynamicOptions(self, request, context):
        self._client(context).get("ep", request.ep).set_dynamic_options(dict(request.options))
        return common_pb2.Empty()

    @rpc
    def OnRunStart(self, request, context):
        self._client(context).get("ep", request.ep).on_run_start(dict(request.run_options))
        return common_pb2.Empty()

    @rpc
    def OnRunEnd(self, request, context):
        self._client(context).get("ep", request.ep).on_run_end(request.sync_stream)
        return common_pb2.Empty()
