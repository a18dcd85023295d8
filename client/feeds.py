"""What a session checks of its feeds before any EP sees them, as ONNX Runtime does: known names, every input
fed, and each tensor of the declared element type, rank and fixed dimensions. Also how graph inputs and outputs
are described to users (NodeArg's type strings and shapes)."""
from __future__ import annotations

from dataclasses import dataclass
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


def check_feed_names(inputs: Mapping[str, Any], constants: Mapping[str, Any], input_feed: Mapping[str, Any]) -> None:
    """Every fed name is an input (or an initializer a feed may override), and every input is fed."""
    unknown = sorted(n for n in input_feed if n not in inputs and n not in constants)
    if unknown:
        raise EpInvalidArgument(f"unknown input name(s) {unknown}; the model's inputs are {sorted(inputs)}")
    missing = [n for n in inputs if n not in input_feed]
    if missing:
        raise EpInvalidArgument(f"missing input(s) {missing}; feed every one of {list(inputs)}")


def check_feed(name: str, type_proto: onnx.TypeProto, value: Any) -> None:
    """A tensor of the declared element type and rank, with the declared size along every fixed dimension."""
    FeedCheck.of(name, type_proto)(value)


@dataclass(frozen=True)
class FeedCheck:
    """check_feed for one input, its declared type read once (a session makes one per input, at creation)."""
    name: str
    type_proto: onnx.TypeProto
    tensor: bool                          # other types (sequences, optionals...) are the EPs' to check
    dtype: np.dtype | None                # None: strings, or a type numpy lacks (bfloat16...: the EP checks it)
    string: bool
    rank: int | None                      # None: no declared shape
    fixed: tuple[tuple[int, int], ...]    # (axis, size) of every fixed dimension

    @classmethod
    def of(cls, name: str, type_proto: onnx.TypeProto) -> "FeedCheck":
        if type_proto.WhichOneof("value") != "tensor_type":
            return cls(name, type_proto, False, None, False, None, ())
        tensor_type = type_proto.tensor_type
        string = tensor_type.elem_type == TensorProto.STRING
        dtype = None if string else _declared_dtype(tensor_type.elem_type)
        if not tensor_type.HasField("shape"):
            return cls(name, type_proto, True, dtype, string, None, ())
        dims = tensor_type.shape.dim
        fixed = tuple((axis, d.dim_value) for axis, d in enumerate(dims) if d.HasField("dim_value"))
        return cls(name, type_proto, True, dtype, string, len(dims), fixed)

    def from_list(self, value: list) -> Any:
        """A list fed for a tensor, made into an array of the declared element type as ONNX Runtime makes one
        (lists only, not tuples, as it takes); a list fed for another type, as it is."""
        if not self.tensor or (self.dtype is None and not self.string):
            return value
        try:
            return np.asarray(value, dtype=np.str_ if self.string else self.dtype)
        except (ValueError, TypeError, OverflowError) as e:
            raise EpInvalidArgument(f"input {self.name!r} expects {type_string(self.type_proto)}, and the list "
                                    f"fed cannot be made into one: {e}") from None

    def __call__(self, value: Any) -> None:
        if not self.tensor:
            return
        if isinstance(value, (Tensor, np.ndarray)):
            dtype, shape = value.dtype, value.shape
        elif isinstance(value, np.generic):
            dtype, shape = np.asarray(value).dtype, np.shape(value)
        else:
            raise EpInvalidArgument(f"input {self.name!r} must be a tensor ({type_string(self.type_proto)}), "
                                    f"got {type(value).__name__}")
        ok = dtype.kind in "OUS" if self.string else self.dtype is None or dtype == self.dtype
        if not ok:
            raise EpInvalidArgument(f"input {self.name!r} expects {type_string(self.type_proto)}, got a {dtype} array")
        if self.rank is None:
            return
        if self.rank != len(shape):
            raise EpInvalidArgument(f"input {self.name!r} expects rank {self.rank} (shape "
                                    f"{shape_of(self.type_proto)}), got rank {len(shape)} (shape {list(shape)})")
        for axis, size in self.fixed:
            if shape[axis] != size:
                raise EpInvalidArgument(f"input {self.name!r} expects {size} along axis {axis} "
                                        f"(shape {shape_of(self.type_proto)}), got shape {list(shape)}")


def _declared_dtype(elem_type: int):
    try:
        return dtype_of(elem_type)
    except EpInvalidArgument:
        return None
