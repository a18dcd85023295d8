"""Tensors of the types ONNX Runtime cannot take from numpy, nor give back to it: bfloat16, the float8 types,
int4/uint4, float4 (and any other ONNX element type numpy has only through ml_dtypes' extension types).

ORT refuses an ml_dtypes array as a feed ("Numpy_type ... can't be converted to MLDataType") and cannot turn such
an output into numpy. Both ways go through an OrtValue of the ONNX type instead, with the bytes laid out as ONNX
lays them out in a TensorProto's raw_data (onnx.numpy_helper packs and unpacks the 4-bit types): an OrtValue of
the shape and type is made in ORT's CPU memory and the bytes written at its address; an output's bytes are read
at its address and decoded by onnx.numpy_helper.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from ephost.types import is_plain_dtype


def _extension(dtype: np.dtype) -> bool:
    """A numpy dtype of another package's (ml_dtypes), which ORT does not know."""
    return dtype.kind not in "OUS" and not is_plain_dtype(dtype)


def onnx_type_of(array: Any) -> int | None:
    """The ONNX element type of an array ORT cannot take from numpy (an ml_dtypes type), else None."""
    if not isinstance(array, np.ndarray) or not _extension(array.dtype):
        return None
    try:
        return helper.np_dtype_to_tensor_dtype(array.dtype)
    except (KeyError, ValueError, TypeError):
        return None


def is_exotic_type(type_string: str) -> bool:
    """Whether an ORT NodeArg type ("tensor(bfloat16)") is a tensor numpy cannot hold natively."""
    if not type_string.startswith("tensor(") or type_string == "tensor(string)":
        return False
    try:
        elem = TensorProto.DataType.Value(type_string[7:-1].upper())
        return _extension(np.dtype(helper.tensor_dtype_to_np_dtype(elem)))
    except (ValueError, KeyError, TypeError):
        return False


def to_ort_value(ort, array: np.ndarray, elem_type: int):
    """An OrtValue of ONNX type `elem_type` in ORT's CPU memory holding `array`'s values."""
    raw = numpy_helper.from_array(np.ascontiguousarray(array)).raw_data
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), elem_type, "cpu", 0)
    if raw:
        ctypes.memmove(value.data_ptr(), raw, len(raw))
    return value


def from_ort_value(value) -> Any:
    """A tensor OrtValue as a numpy array (ml_dtypes' types for bfloat16, float8, int4...)."""
    if not value.is_tensor():
        return value.numpy()
    elem = value.element_type()
    if not _extension(np.dtype(helper.tensor_dtype_to_np_dtype(elem))):
        return value.numpy()
    proto = TensorProto(data_type=elem, dims=value.shape())
    nbytes = value.tensor_size_in_bytes()
    proto.raw_data = ctypes.string_at(value.data_ptr(), nbytes) if nbytes else b""
    return numpy_helper.to_array(proto)
