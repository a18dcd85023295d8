"""OrtValues as numpy arrays: views over the memory ORT owns (no copy), and ORT's tensor types as ONNX's."""
from __future__ import annotations

import ctypes
import math
from ctypes import c_int, c_int64, c_size_t, c_void_p

import numpy as np

from ephost.errors import EpInvalidArgument
from ephost.ort.abi import OrtAbi
from ephost.types import dtype_of


def shape_of(abi: OrtAbi, tensor_info: int, symbols: bool = True) -> tuple[int, list[int], list[str]]:
    """(element type, dims, symbolic dims) of an OrtTensorTypeAndShapeInfo. Unknown dims are negative; symbolic
    names are read only where asked (a value's shape has none)."""
    api = abi.api
    elem, rank = c_int(), c_size_t()
    abi.check(api.GetTensorElementType(tensor_info, ctypes.byref(elem)), "GetTensorElementType")
    abi.check(api.GetDimensionsCount(tensor_info, ctypes.byref(rank)), "GetDimensionsCount")
    dims = (c_int64 * rank.value)()
    if not rank.value:
        return elem.value, [], []
    abi.check(api.GetDimensions(tensor_info, dims, rank.value), "GetDimensions")
    if not symbols:
        return elem.value, list(dims), []
    names = (ctypes.c_char_p * rank.value)()
    abi.check(api.GetSymbolicDimensions(tensor_info, names, rank.value), "GetSymbolicDimensions")
    return elem.value, list(dims), [(n or b"").decode() for n in names]


STRING = 8  # ONNX_TENSOR_ELEMENT_DATA_TYPE_STRING


def tensor_view(abi: OrtAbi, value: int) -> np.ndarray:
    """A numpy array over a tensor OrtValue's own memory (valid while ORT keeps the value); a string tensor is
    read into an array of str (ORT keeps its strings as C++ objects)."""
    api = abi.api
    info = c_void_p()
    abi.check(api.GetTensorTypeAndShape(value, ctypes.byref(info)), "GetTensorTypeAndShape")
    try:
        elem, dims, _ = shape_of(abi, info.value, symbols=False)
    finally:
        api.ReleaseTensorTypeAndShapeInfo(info)
    if elem == STRING:
        return read_strings(abi, value, dims)
    return array_at(abi, value, elem, dims)


def read_strings(abi: OrtAbi, value: int, dims: list[int]) -> np.ndarray:
    count = math.prod(dims)
    total = c_size_t()
    abi.check(abi.api.GetStringTensorDataLength(value, ctypes.byref(total)), "GetStringTensorDataLength")
    data = ctypes.create_string_buffer(max(total.value, 1))
    offsets = (c_size_t * max(count, 1))()
    if count:
        abi.check(abi.api.GetStringTensorContent(value, data, total.value, offsets, count), "GetStringTensorContent")
    ends = list(offsets[1:count]) + [total.value]
    raw = data.raw
    strings = [raw[offsets[i]:ends[i]].decode("utf-8", errors="surrogateescape") for i in range(count)]
    return np.array(strings, dtype=object).reshape(dims)


def write_strings(abi: OrtAbi, value: int, array: np.ndarray) -> int:
    """Fill a string OrtValue (made by ORT with the array's shape) with the array's strings; the bytes copied."""
    items = _encoded(array)
    if items:
        abi.check(abi.api.FillStringTensor(value, (ctypes.c_char_p * len(items))(*items), len(items)),
                  "FillStringTensor")
    return sum(map(len, items))


def string_bytes(array: np.ndarray) -> int:
    """The bytes of an array of strings, as they cross (UTF-8)."""
    return sum(map(len, _encoded(array)))


def _encoded(array: np.ndarray) -> list[bytes]:
    return [s.encode("utf-8", errors="surrogateescape") if isinstance(s, str) else bytes(s)
            for s in array.reshape(-1)]


def array_at(abi: OrtAbi, value: int, elem: int, dims: list[int]) -> np.ndarray:
    if not math.prod(dims):
        return array_over(0, elem, dims)
    data = c_void_p()
    abi.check(abi.api.GetTensorMutableData(value, ctypes.byref(data)), "GetTensorMutableData")
    return array_over(data.value, elem, dims)


def array_over(address: int, elem: int, dims: list[int]) -> np.ndarray:
    """A numpy view of a tensor's data of ONNX element type `elem` at `address` (a new empty array for none)."""
    try:
        dtype = dtype_of(elem)
    except EpInvalidArgument:
        raise EpInvalidArgument(f"a tensor of ONNX element type {elem} cannot cross the bridge (no numpy type)") \
            from None
    count = math.prod(dims)
    if count == 0:
        return np.empty(dims, dtype)
    # One constructor over the memory (frombuffer, then reshape: twice the cost, on every input of every Compute)
    return np.ndarray(dims, dtype, (ctypes.c_char * (count * dtype.itemsize)).from_address(address))
