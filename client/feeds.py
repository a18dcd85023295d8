"""What a session checks of its feeds before any EP sees them, as ONNX Runtime does: known names, every input
fed, and each tensor of the declared element type, rank and fixed dimensions. Also how graph inputs and outputs
are described to users (NodeArg's type strings and shapes)."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import onnx
from onnx import TensorProto

from ephost.errors import EpInvalidArgument
from ephost.tensor import Tensor
from ephost.types import dtype_of


def type_string(type_proto: onnx.TypeProto) -> str:
    """ORT's NodeArg.type: "tensor(float)", "sequence(tensor(int64))"..."""
    which = type_proto.WhichOneof("value")
    if which == "tensor_type":
        return f"tensor({TensorProto.DataType.Name(type_proto.tensor_type.elem_type).lower()})"
    if which in ("sequence_type", "optional_type"):
        inner = getattr(type_proto, which).elem_type
        return f"{which.split('_')[0]}({type_string(inner)})"
    return which or "unknown"


def shape_of(type_proto: onnx.TypeProto) -> list | None:
    """ORT's NodeArg.shape: ints for fixed dimensions, names or None for the others."""
    if type_proto.WhichOneof("value") != "tensor_type" or not type_proto.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in type_proto.tensor_type.shape.dim]


def check_feed_names(inputs: Mapping[str, onnx.ValueInfoProto], constants: Mapping[str, Any],
                     input_feed: Mapping[str, Any]) -> None:
    """Every fed name is an input (or an initializer a feed may override), and every input is fed."""
    unknown = sorted(set(input_feed) - set(inputs) - set(constants))
    if unknown:
        raise EpInvalidArgument(f"unknown input name(s) {unknown}; the model's inputs are {sorted(inputs)}")
    missing = [n for n in inputs if n not in input_feed]
    if missing:
        raise EpInvalidArgument(f"missing input(s) {missing}; feed every one of {list(inputs)}")


def check_feed(name: str, type_proto: onnx.TypeProto, value: Any) -> None:
    """A tensor of the declared element type and rank, with the declared size along every fixed dimension."""
    if type_proto.WhichOneof("value") != "tensor_type":
        return
    tensor_type = type_proto.tensor_type
    if isinstance(value, Tensor):
        dtype, shape = value.dtype, value.shape
    elif isinstance(value, (np.ndarray, np.generic)):
        dtype, shape = np.asarray(value).dtype, np.shape(value)
    else:
        raise EpInvalidArgument(f"input {name!r} must be a tensor ({type_string(type_proto)}), "
                                f"got {type(value).__name__}")
    declared = tensor_type.elem_type
    if declared == TensorProto.STRING:
        ok = dtype.kind in "OUS"
    else:
        expected = _declared_dtype(declared)
        ok = expected is None or dtype == expected  # types numpy lacks (bfloat16...) are the EP's to check
    if not ok:
        raise EpInvalidArgument(f"input {name!r} expects {type_string(type_proto)}, got a {dtype} array")
    if tensor_type.HasField("shape"):
        dims = tensor_type.shape.dim
        if len(dims) != len(shape):
            raise EpInvalidArgument(f"input {name!r} expects rank {len(dims)} (shape {shape_of(type_proto)}), "
                                    f"got rank {len(shape)} (shape {list(shape)})")
        for axis, (d, n) in enumerate(zip(dims, shape)):
            if d.HasField("dim_value") and d.dim_value != n:
                raise EpInvalidArgument(f"input {name!r} expects {d.dim_value} along axis {axis} "
                                        f"(shape {shape_of(type_proto)}), got shape {list(shape)}")


def _declared_dtype(elem_type: int):
    try:
        return dtype_of(elem_type)
    except EpInvalidArgument:
        return None
