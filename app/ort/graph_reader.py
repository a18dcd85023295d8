"""An OrtGraph (ORT's read-only graph view, as GetCapability and Compile receive it) as an ONNX model: nodes with
their attributes (control-flow subgraphs included), value types, initializers and opsets, plus which OrtNode
each node of the model is."""
from __future__ import annotations

import ctypes
import os
from ctypes import c_char_p, c_float, c_int, c_int64, c_size_t, c_void_p
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ephost.errors import EpInvalidArgument
from ephost.ort import abi as A
from ephost.ort.abi import OrtAbi
from ephost.ort.values import shape_of, tensor_view


@dataclass
class ReadGraph:
    model: onnx.ModelProto
    nodes: dict[str, int] = field(default_factory=dict)  # node name in `model` -> OrtNode*
    ids: dict[int, str] = field(default_factory=dict)    # OrtNode id (Node_GetId) -> node name in `model`
    # values that are not tensors (sequences, maps, optionals): a fused node's kernel context carries tensors
    # only, so none may cross a partition's boundary (inside one they are the worker's business)
    non_tensors: set[str] = field(default_factory=set)


class GraphReader:
    """Reads OrtGraphs through the OrtApi graph functions."""

    def __init__(self, abi: OrtAbi):
        self.abi = abi
        self.api = abi.api

    # --- small helpers ---

    def string(self, fn, obj: int, what: str) -> str:
        """A string an OrtApi getter returns through an out parameter."""
        out = c_char_p()
        self.abi.check(fn(obj, ctypes.byref(out)), what)
        return (out.value or b"").decode()

    def array(self, count_fn, get_fn, obj: int, what: str) -> list[int | None]:
        """The pointers an OrtApi count/get pair returns (a NULL entry is None)."""
        n = c_size_t()
        self.abi.check(count_fn(obj, ctypes.byref(n)), what)
        items = (c_void_p * n.value)()
        if n.value:
            self.abi.check(get_fn(obj, items, n.value), what)
        return list(items)

    # --- graphs ---

    def model_dir(self, graph: int) -> str | None:
        """The directory of the model file the graph was loaded from (None for a model given as bytes)."""
        path = c_char_p()
        self.abi.check(self.api.Graph_GetModelPath(graph, ctypes.byref(path)), "Graph_GetModelPath")
        return os.path.dirname(os.path.abspath(path.value.decode())) if path.value else None

    def is_nested(self, graph: int) -> bool:
        parent = c_void_p()
        self.abi.check(self.api.Graph_GetParentNode(graph, ctypes.byref(parent)), "Graph_GetParentNode")
        return bool(parent.value)

    def read(self, graph: int, exact_edges: bool = True) -> ReadGraph:
        """The graph as a model. `exact_edges`: its inputs and outputs keep ORT's shapes (a model's own edges);
        otherwise (a fused subgraph, whose edges are intermediate values) only their element type."""
        api = self.api
        read = ReadGraph(onnx.ModelProto())
        g = self._graph(graph, read, top=True, exact_edges=exact_edges)
        n = c_size_t()
        self.abi.check(api.Graph_GetNumOperatorSets(graph, ctypes.byref(n)), "Graph_GetNumOperatorSets")
        domains, versions = (c_char_p * n.value)(), (c_int64 * n.value)()
        self.abi.check(api.Graph_GetOperatorSets(graph, domains, versions, n.value), "Graph_GetOperatorSets")
        ir = c_int64()
        self.abi.check(api.Graph_GetOnnxIRVersion(graph, ctypes.byref(ir)), "Graph_GetOnnxIRVersion")
        read.model = helper.make_model(
            g, opset_imports=[helper.make_opsetid((d or b"").decode(), v) for d, v in zip(domains, versions)],
            ir_version=ir.value, producer_name="ephost.ort")
        return read

    def _graph(self, graph: int, read: ReadGraph, top: bool, exact_edges: bool = True,
               exact_inputs: bool | None = None) -> onnx.GraphProto:
        api = self.api
        name = self.string(api.Graph_GetName, graph, "Graph_GetName") or "graph"
        exact_inputs = exact_edges if exact_inputs is None else exact_inputs
        inputs = [self.value_info(v, dims=exact_inputs) for v in self.array(
            api.Graph_GetNumInputs, api.Graph_GetInputs, graph, "Graph_GetInputs")]
        outputs = [self.value_info(v, dims=exact_edges) for v in self.array(
            api.Graph_GetNumOutputs, api.Graph_GetOutputs, graph, "Graph_GetOutputs")]
        initializers = []
        for v in self.array(api.Graph_GetNumInitializers, api.Graph_GetInitializers, graph, "Graph_GetInitializers"):
            tensor_name = self.string(api.GetValueInfoName, v, "GetValueInfoName")
            value = c_void_p()
            self.abi.check(api.ValueInfo_GetInitializerValue(v, ctypes.byref(value)), "ValueInfo_GetInitializerValue")
            if value.value:
                initializers.append(numpy_helper.from_array(tensor_view(self.abi, value.value), tensor_name))
        nodes, value_infos, seen = [], [], set()
        declared = {i.name for i in inputs} | {o.name for o in outputs}
        for node in self.array(api.Graph_GetNumNodes, api.Graph_GetNodes, graph, "Graph_GetNodes"):
            proto, non_tensors = self._node(node, read)
            base, k = proto.name or proto.op_type, 0
            while proto.name in seen or not proto.name:
                k += 1
                proto.name = f"{base}__{k}"
            seen.add(proto.name)
            if top:
                read.nodes[proto.name] = node
                read.ids[self.node_id(node)] = proto.name
                read.non_tensors |= non_tensors
            nodes.append(proto)
            for v in self.array(api.Node_GetNumOutputs, api.Node_GetOutputs, node, "Node_GetOutputs"):
                if v:
                    info = self.value_info(v, required=False, dims=False)
                    if info is not None and info.name not in declared:
                        value_infos.append(info)
                        declared.add(info.name)
        return helper.make_graph(nodes, name, inputs, outputs, initializer=initializers, value_info=value_infos)

    def node_id(self, node: int) -> int:
        out = c_size_t()
        self.abi.check(self.api.Node_GetId(node, ctypes.byref(out)), "Node_GetId")
        return out.value

    # --- values ---

    def value_info(self, v: int, required: bool = True, dims: bool = True) -> onnx.ValueInfoProto | None:
        """The value's name and tensor type; with `dims` false without a shape: ORT's graph may carry a shape for an
        intermediate value (rank included) that a run does not have, and the worker binds a partition's outputs
        by the shape it infers from the declared ones."""
        api = self.api
        name = self.string(api.GetValueInfoName, v, "GetValueInfoName")
        type_info = c_void_p()
        self.abi.check(api.GetValueInfoTypeInfo(v, ctypes.byref(type_info)), "GetValueInfoTypeInfo")
        kind = self._kind(type_info.value)
        if kind != A.ONNX_TYPE_TENSOR:
            if required:  # a graph's own input or output: declared with its full type
                return helper.make_value_info(name, self.type_proto(type_info.value))
            return None
        tensor_info = c_void_p()
        self.abi.check(api.CastTypeInfoToTensorInfo(type_info, ctypes.byref(tensor_info)), "CastTypeInfoToTensorInfo")
        elem, shape_dims, symbols = shape_of(self.abi, tensor_info.value)
        shape = [d if d >= 0 else (s or None) for d, s in zip(shape_dims, symbols)] if dims else None
        return helper.make_tensor_value_info(name, elem, shape)

    def _kind(self, type_info: int | None) -> int:
        kind = c_int()
        if type_info:
            self.abi.check(self.api.GetOnnxTypeFromTypeInfo(type_info, ctypes.byref(kind)), "GetOnnxTypeFromTypeInfo")
        return kind.value

    def is_tensor(self, v: int) -> bool:
        type_info = c_void_p()
        self.abi.check(self.api.GetValueInfoTypeInfo(v, ctypes.byref(type_info)), "GetValueInfoTypeInfo")
        return self._kind(type_info.value) == A.ONNX_TYPE_TENSOR

    def type_proto(self, type_info: int) -> onnx.TypeProto:
        """An OrtTypeInfo as ONNX's TypeProto: tensors, sequences, maps and optionals of them."""
        api, check = self.api, self.abi.check
        kind = self._kind(type_info)
        if kind == A.ONNX_TYPE_TENSOR:
            tensor_info = c_void_p()
            check(api.CastTypeInfoToTensorInfo(type_info, ctypes.byref(tensor_info)), "CastTypeInfoToTensorInfo")
            elem, _, _ = shape_of(self.abi, tensor_info.value, symbols=False)
            return helper.make_tensor_type_proto(elem, None)
        inner, cast = c_void_p(), c_void_p()
        if kind == A.ONNX_TYPE_SEQUENCE:
            check(api.CastTypeInfoToSequenceTypeInfo(type_info, ctypes.byref(cast)), "CastTypeInfoToSequenceTypeInfo")
            check(api.GetSequenceElementType(cast, ctypes.byref(inner)), "GetSequenceElementType")
            make = helper.make_sequence_type_proto
        elif kind == A.ONNX_TYPE_OPTIONAL:
            check(api.CastTypeInfoToOptionalTypeInfo(type_info, ctypes.byref(cast)), "CastTypeInfoToOptionalTypeInfo")
            check(api.GetOptionalContainedTypeInfo(cast, ctypes.byref(inner)), "GetOptionalContainedTypeInfo")
            make = helper.make_optional_type_proto
        elif kind == A.ONNX_TYPE_MAP:
            key = c_int()
            check(api.CastTypeInfoToMapTypeInfo(type_info, ctypes.byref(cast)), "CastTypeInfoToMapTypeInfo")
            check(api.GetMapKeyType(cast, ctypes.byref(key)), "GetMapKeyType")
            check(api.GetMapValueType(cast, ctypes.byref(inner)), "GetMapValueType")
            make = lambda value: helper.make_map_type_proto(key.value, value)  # noqa: E731
        else:
            raise EpInvalidArgument(f"a value of ONNX type kind {kind} cannot be described to the worker")
        try:
            return make(self.type_proto(inner.value))
        finally:
            api.ReleaseTypeInfo(inner)

    # --- nodes ---

    def _node(self, node: int, read: ReadGraph) -> tuple[onnx.NodeProto, set[str]]:
        """The node, and those of the values it reads and makes that are not tensors."""
        api = self.api
        names = lambda values: [self.string(api.GetValueInfoName, v, "GetValueInfoName") if v else ""  # noqa: E731
                                for v in values]
        input_values = self.array(api.Node_GetNumInputs, api.Node_GetInputs, node, "Node_GetInputs")
        output_values = self.array(api.Node_GetNumOutputs, api.Node_GetOutputs, node, "Node_GetOutputs")
        inputs, outputs = names(input_values), names(output_values)
        non_tensors = {name for v, name in zip([*input_values, *output_values], [*inputs, *outputs])
                       if v and not self.is_tensor(v)}
        proto = helper.make_node(self.string(api.Node_GetOperatorType, node, "Node_GetOperatorType"), inputs, outputs,
                                 name=self.string(api.Node_GetName, node, "Node_GetName"),
                                 domain=self.string(api.Node_GetDomain, node, "Node_GetDomain") or None)
        for attr in self.array(api.Node_GetNumAttributes, api.Node_GetAttributes, node, "Node_GetAttributes"):
            read_attr = self._attribute(attr)
            if read_attr is not None:
                proto.attribute.append(read_attr)
        n = c_size_t()
        self.abi.check(api.Node_GetNumSubgraphs(node, ctypes.byref(n)), "Node_GetNumSubgraphs")
        if n.value:
            graphs, attr_names = (c_void_p * n.value)(), (c_char_p * n.value)()
            self.abi.check(api.Node_GetSubgraphs(node, graphs, n.value, attr_names), "Node_GetSubgraphs")
            present = {a.name for a in proto.attribute}
            for g, attr_name in zip(graphs, attr_names):
                name = (attr_name or b"").decode()
                if name not in present:
                    # a body's inputs keep their shapes (Loop needs its iteration count's), its outputs do not
                    proto.attribute.append(helper.make_attribute(
                        name, self._graph(g, read, top=False, exact_edges=False, exact_inputs=True)))
        return proto, non_tensors

    def _attribute(self, attr: int) -> onnx.AttributeProto | None:
        api = self.api
        name = self.string(api.OpAttr_GetName, attr, "OpAttr_GetName")
        kind = c_int()
        self.abi.check(api.OpAttr_GetType(attr, ctypes.byref(kind)), "OpAttr_GetType")
        kind = kind.value
        if kind == A.ATTR_GRAPH:
            return None  # read through Node_GetSubgraphs
        if kind == A.ATTR_TENSOR:
            value = c_void_p()
            self.abi.check(api.OpAttr_GetTensorAttributeAsOrtValue(attr, ctypes.byref(value)),
                           "OpAttr_GetTensorAttributeAsOrtValue")
            try:
                array = np.array(tensor_view(self.abi, value.value))
            finally:
                api.ReleaseValue(value)
            return helper.make_attribute(name, numpy_helper.from_array(array))
        if kind == A.ATTR_INT:
            out = c_int64()
            self._read(attr, kind, ctypes.addressof(out), 8)
            return helper.make_attribute(name, out.value)
        if kind == A.ATTR_FLOAT:
            out = c_float()
            self._read(attr, kind, ctypes.addressof(out), 4)
            return helper.make_attribute(name, out.value)
        if kind in (A.ATTR_INTS, A.ATTR_FLOATS, A.ATTR_STRING, A.ATTR_STRINGS):
            raw = self._read_sized(attr, kind)
            if kind == A.ATTR_INTS:
                return helper.make_attribute(name, np.frombuffer(raw, np.int64).tolist(),
                                             attr_type=onnx.AttributeProto.INTS)
            if kind == A.ATTR_FLOATS:
                return helper.make_attribute(name, np.frombuffer(raw, np.float32).tolist(),
                                             attr_type=onnx.AttributeProto.FLOATS)
            if kind == A.ATTR_STRING:
                return helper.make_attribute(name, raw, attr_type=onnx.AttributeProto.STRING)
            return helper.make_attribute(name, raw.split(b"\0")[:-1] if raw else [],
                                         attr_type=onnx.AttributeProto.STRINGS)
        raise EpInvalidArgument(f"attribute {name!r} has a type ({kind}) the bridge cannot read")

    def _read(self, attr: int, kind: int, address: int, size: int) -> int:
        out = c_size_t()
        self.abi.check(self.api.ReadOpAttr(attr, kind, address, size, ctypes.byref(out)), "ReadOpAttr")
        return out.value

    def _read_sized(self, attr: int, kind: int) -> bytes:
        probe, need = ctypes.create_string_buffer(8), c_size_t()
        status = self.api.ReadOpAttr(attr, kind, ctypes.addressof(probe), 0, ctypes.byref(need))
        if status:
            self.api.ReleaseStatus(status)  # "too small": `need` says how much
        if need.value == 0:
            return b""
        buffer = ctypes.create_string_buffer(need.value)
        got = self._read(attr, kind, ctypes.addressof(buffer), need.value)
        return buffer.raw[:got]
