"""What a session checks of its feeds before any EP sees them, as ONNX Runtime does: known names, every input
fed, and each tensor of the declared element type, rank and fixed dimensions. Feeds are taken in the forms ORT
takes: numpy arrays, lists, onnxruntime.OrtValues in this process's memory, and numpy bytes (S) or void (V)
arrays for string tensors. Also how graph inputs and outputs are described to users (NodeArg's type strings and
shapes), and the copy ORT makes of a graph input that is also an output."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import onnx
from onnx import TensorProto

from ephost.errors import EpInvalidArgument
from ephost.tensor import Tensor
from ephost.types import MAX_RANK, dtype_of


# How ORT spells each kind of type in NodeArg.type (onnx's DataTypeUtils: "seq(tensor(float))", "map(...)")
_KIND_WORDS = {"sequence_type": "seq", "optional_type": "optional"}


def _element(elem_type: int) -> str:
    return TensorProto.DataType.Name(elem_type).lower()


def type_string(type_proto: onnx.TypeProto) -> str:
    """ORT's NodeArg.type: "tensor(float)", "seq(tensor(int64))", "optional(tensor(float))",
    "map(int64,tensor(float))", "sparse_tensor(float)"."""
    which = type_proto.WhichOneof("value")
    if which == "tensor_type":
        return f"tensor({_element(type_proto.tensor_type.elem_type)})"
    if which in _KIND_WORDS:
        return f"{_KIND_WORDS[which]}({type_string(getattr(type_proto, which).elem_type)})"
    if which == "map_type":
        return f"map({_element(type_proto.map_type.key_type)},{type_string(type_proto.map_type.value_type)})"
    if which == "sparse_tensor_type":
        return f"sparse_tensor({_element(type_proto.sparse_tensor_type.elem_type)})"
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
        # ORT's words (its ValueError), which code written for it may look for
        raise EpInvalidArgument(f"Required inputs ({missing}) are missing from input feed ({list(input_feed)}): each "
                                f"missing input must be fed (the model's inputs are {list(inputs)})")


def check_feed(name: str, type_proto: onnx.TypeProto, value: Any) -> None:
    """A tensor of the declared element type and rank, with the declared size along every fixed dimension."""
    FeedCheck.of(name, type_proto)(value)


@dataclass(frozen=True, slots=True)
class FeedCheck:
    """check_feed for one input, its declared type read once (a session makes one per input, at creation)."""
    name: str
    type_proto: onnx.TypeProto
    tensor: bool                          # other types (sequences, optionals...) are the EPs' to check
    dtype: np.dtype | None                # None: strings, or a type numpy lacks (bfloat16...: the EP checks it)
    string: bool
    rank: int | None                      # None: no declared shape
    fixed: tuple[tuple[int, int], ...]    # (axis, size) of every fixed dimension
    shape: tuple[int, ...] | None = None  # the declared shape, where every dimension is fixed

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
        shape = tuple(size for _, size in fixed) if len(fixed) == len(dims) else None
        return cls(name, type_proto, True, dtype, string, len(dims), fixed, shape)

    def passes(self, array: np.ndarray) -> bool:
        """Whether an array goes on as it is: C-contiguous, of the declared element type, rank and fixed sizes
        (what most feeds are, looked at first and at least cost); False sends it through `take`."""
        if array.dtype != self.dtype or not array.flags.c_contiguous:
            return False
        shape = array.shape
        if self.shape is not None:  # (the common case: compared whole)
            return shape == self.shape
        if self.rank is None:
            return array.ndim <= MAX_RANK
        if len(shape) != self.rank:
            return False
        for axis, size in self.fixed:
            if shape[axis] != size:
                return False
        return True

    def take(self, value: Any) -> Any:
        """The feed as a session passes it on, checked: a list made into an array, an ORT OrtValue read where
        it is, bytes or void arrays fed for strings decoded (as ORT takes them)."""
        if type(value) is list:
            value = self.from_list(value)
        elif type(value) is not np.ndarray:
            value = foreign(value)
        if self.string and isinstance(value, np.ndarray) and value.dtype.kind in "SV":
            value = decoded(value)
        self(value)
        return value

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


def decoded(array: np.ndarray) -> np.ndarray:
    """A numpy bytes (S) or void (V) array fed for a string tensor, as the strings ORT makes of it (UTF-8)."""
    try:
        return np.array([bytes(v).decode("utf-8") for v in array.reshape(-1)], dtype=object).reshape(array.shape)
    except UnicodeDecodeError as e:
        raise EpInvalidArgument(f"a {array.dtype} array fed for strings holds bytes that are not UTF-8: {e}") from None


def foreign(value: Any) -> Any:
    """An onnxruntime.OrtValue (ORT's Python one, or its C one) as an array over its memory (written through, as
    a bound output is), where it is a tensor in this process's memory; other values as they are."""
    if not _is_ort_value(value):
        return value
    c_value = value._get_c_value() if hasattr(value, "_get_c_value") else value
    if not c_value.is_tensor():
        raise EpInvalidArgument(f"an OrtValue that is not a tensor ({c_value.data_type()}) cannot be fed: give its "
                                "Python value (a list, a dict)")
    if c_value.device_name().lower() != "cpu":
        raise EpInvalidArgument(f"an OrtValue in {c_value.device_name()} memory cannot be fed: ephost reads feeds "
                                "from this process's memory (copy it to the CPU, or bind an ephost.Tensor)")
    if c_value.element_type() == TensorProto.STRING:
        return c_value.numpy()
    return np.asarray(_OrtValueMemory(value, c_value))


class _OrtValueMemory:
    """The memory of an OrtValue tensor, as numpy takes it (the array interface): the array's base holds the
    OrtValue, so that the memory lives as long as the array does."""

    def __init__(self, value: Any, c_value: Any):
        self.value = value
        dtype = dtype_of(c_value.element_type())
        self.__array_interface__ = {"shape": tuple(c_value.shape()), "typestr": dtype.str,
                                    "data": (c_value.data_ptr(), False), "version": 3}


def _is_ort_value(value: Any) -> bool:
    cls = type(value)
    return cls.__name__ == "OrtValue" and cls.__module__.startswith("onnxruntime.")


def passed_through(value: Any) -> Any:
    """A graph input given back as an output is a copy of the feed, as ORT gives it: the caller's array changing
    later must not change the output."""
    if isinstance(value, Tensor) and value.addressable:
        return Tensor.from_numpy(value.local_array().copy())
    if isinstance(value, np.ndarray):
        return value.copy()
    return value


def _declared_dtype(elem_type: int):
    try:
        return dtype_of(elem_type)
    except EpInvalidArgument:
        return None
