"""ONNX nodes as the OrtNodes ORT takes from an EP (OrtModelEditorApi::CreateNode): the EPContext nodes Compile
returns when ORT writes a compiled model."""
from __future__ import annotations

import ctypes
from ctypes import c_char_p, c_float, c_int64, c_void_p

import onnx

from ephost.errors import EpInvalidArgument
from ephost.ort import abi as A


def ort_node(abi: A.OrtAbi, node: onnx.NodeProto) -> int:
    """A new OrtNode of `node` (ORT takes it over: ephost releases nothing of it)."""
    attributes = [_op_attr(abi, a) for a in node.attribute]
    names = lambda values: (c_char_p * max(len(values), 1))(*[v.encode() for v in values])  # noqa: E731
    out = c_void_p()
    array = (c_void_p * max(len(attributes), 1))(*attributes)
    try:
        abi.check(abi.model_editor().CreateNode(node.op_type.encode(), node.domain.encode(), node.name.encode(),
                                                names(node.input), len(node.input), names(node.output),
                                                len(node.output), array, len(attributes), ctypes.byref(out)),
                  "OrtModelEditorApi::CreateNode")
    except BaseException:
        for attribute in array[:len(attributes)]:
            if attribute:  # (CreateNode takes over those it was given, and clears them)
                abi.api.ReleaseOpAttr(attribute)
        raise
    return out.value


def _op_attr(abi: A.OrtAbi, attribute: onnx.AttributeProto) -> int:
    """A new OrtOpAttr of an int, float or string attribute (the kinds an EPContext node has)."""
    kind = attribute.type
    if kind == onnx.AttributeProto.INT:
        data, length, ort_type = ctypes.byref(c_int64(attribute.i)), 1, A.ATTR_INT
    elif kind == onnx.AttributeProto.FLOAT:
        data, length, ort_type = ctypes.byref(c_float(attribute.f)), 1, A.ATTR_FLOAT
    elif kind == onnx.AttributeProto.STRING:
        buffer = ctypes.create_string_buffer(attribute.s, len(attribute.s) or 1)
        data, length, ort_type = buffer, len(attribute.s), A.ATTR_STRING
    else:
        raise EpInvalidArgument(f"attribute {attribute.name!r} of a node for ORT is of a kind ephost does not make "
                                f"({onnx.AttributeProto.AttributeType.Name(kind)})")
    out = c_void_p()
    abi.check(abi.api.CreateOpAttr(attribute.name.encode(), ctypes.cast(data, c_void_p), length, ort_type,
                                   ctypes.byref(out)), "CreateOpAttr")
    return out.value
