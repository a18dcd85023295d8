"""OrtValues as numpy arrays: views over the memory ORT owns (no copy), and ORT's tensor types as ONNX's."""
from __future__ import annotations

import ctypes
from ctypes import c_int, c_int64, c_size_t, c_void_p

import numpy as np

from ephost.errors import EpInvalidArgument
from ephost.ort.abi import OrtAbi
from ephost.types import dtype_of


def shape_of(abi: OrtAbi, tensor_info: int) -> tuple[int, list[int], list[str]]:
    """(element type, dims, symbolic dims) of an OrtTensorTypeAndShapeInfo. Unknown dims are negative."""
    api = abi.api
    elem, rank = c_int(), c_size_t()
    abi.check(api.GetTensorElementType(tensor_info, ctypes.byref(elem)), "GetTensorElementType")
    abi.check(api.GetDimensionsCount(tensor_info, ctypes.byref(rank)), "GetDimensionsCount")
    dims = (c_int64 * rank.value)()
    names = (ctypes.c_char_p * rank.value)()
    if rank.value:
        abi.check(api.GetDimensions(tensor_info, dims, rank.value), "GetDimensions")
        abi.check(api.GetSymbolicDimensions(tensor_info, names, rank.value), "GetSymbolicDimensions")
    return elem.value, list(dims), [(n or b"").decode() for n in names]


def tensor_view(abi: OrtAbi, value: int) -> np.ndarray:
    """A numpy array over a tensor OrtValue's own memory (valid while ORT keeps the value)."""
    api = abi.api
    info = c_void_p()
    abi.check(api.GetTensorTypeAndShape(value, ctypes.byref(info)), "GetTensorTypeAndShape")
    try:
        elem, dims, _ = shape_of(abi, info.value)
    finally:
        api.ReleaseTensorTypeAndShapeInfo(info)
    return array_at(abi, value, elem, dims)


def array_at(abi: OrtAbi, value: int, elem: int, dims: list[int]) -> np.ndarray:
    try:
        dtype = dtype_of(elem)
    except EpInvalidArgument:
        raise EpInvalidArgument(f"a tensor of ONNX element type {elem} cannot cross the bridge (no numpy type)") \
            from None
    if dtype == np.dtype(object):
        raise EpInvalidArgument("string tensors cannot cross the bridge")
    count = int(np.prod(dims, dtype=np.int64)) if dims else 1
    if count == 0:
        return np.empty(dims, dtype)
    data = c_void_p()
    abi.check(abi.api.GetTensorMutableData(value, ctypes.byref(data)), "GetTensorMutableData")
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(data.value)
    return np.frombuffer(raw, dtype).reshape(dims)
