"""Values on the edges of an ONNX graph, on both sides of the wire.

A plain tensor (an element type numpy has natively) is an ephost.Tensor, or, in this process's own memory, a
C-contiguous numpy array (what a session's runs hand along where they can: no wrapper made and unmade per
value), and travels by reference: a buffer, a shared-memory slice, or its raw bytes. Anything else ONNX passes
along an edge (sequences, optionals, maps, tensors of strings or of bfloat16, float8, int4...) travels as its ONNX
protobuf.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from onnx import MapProto, OptionalProto, SequenceProto, TensorProto, numpy_helper

from ephost.errors import EpInvalidArgument
from ephost.tensor import Tensor
from ephost.types import HOST_MEMORY, MAX_RANK, is_plain_dtype, refuse_external_data
from ephost.v1 import common_pb2 as pb

_KIND = pb.OnnxValue.Kind
# kind -> (protobuf class, decode, encode)
_CODECS = {
    _KIND.KIND_TENSOR: (TensorProto, numpy_helper.to_array, numpy_helper.from_array),
    _KIND.KIND_SEQUENCE: (SequenceProto, numpy_helper.to_list, numpy_helper.from_list),
    _KIND.KIND_OPTIONAL: (OptionalProto, numpy_helper.to_optional, numpy_helper.from_optional),
    _KIND.KIND_MAP: (MapProto, numpy_helper.to_dict, numpy_helper.from_dict),
}


def is_plain_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) and is_plain_dtype(value.dtype)


def as_value(value: Any) -> Any:
    """What a graph edge holds: a Tensor for plain tensors (numpy scalars included), else the value itself."""
    if type(value) is np.ndarray and value.flags.c_contiguous and value.ndim <= MAX_RANK \
            and is_plain_dtype(value.dtype):
        # What every kernel returns, once per output of every run: the checks from_numpy would make, made here.
        return Tensor.trusted(value.shape, value.dtype, HOST_MEMORY, value.nbytes, host=value)
    if isinstance(value, Tensor):
        return value
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if is_plain_array(value):
        return Tensor.from_numpy(value if value.flags.c_contiguous else value.copy(order="C"))
    return value


def host_value(value: Any) -> Any:
    """A value as a session's run carries it: a C-contiguous array of a plain type as it is, anything else as
    as_value makes it."""
    if type(value) is np.ndarray and value.flags.c_contiguous and value.ndim <= MAX_RANK \
            and is_plain_dtype(value.dtype):
        return value
    return as_value(value)


def to_python(value: Any) -> Any:
    """What a user gets back: numpy arrays for tensors, lists, None or dicts for the rest."""
    if isinstance(value, Tensor):
        return value.numpy()
    if isinstance(value, list):
        return [to_python(v) for v in value]
    return value


def _kind_of(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return _KIND.KIND_TENSOR
    if isinstance(value, list):
        return _KIND.KIND_SEQUENCE
    if isinstance(value, dict):
        return _KIND.KIND_MAP
    if value is None:
        return _KIND.KIND_OPTIONAL
    raise EpInvalidArgument(f"cannot carry a value of type {type(value).__name__} along a graph edge")


def encode(value: Any) -> pb.OnnxValue:
    kind = _kind_of(value)
    if kind == _KIND.KIND_SEQUENCE:
        value = [v.numpy() if isinstance(v, Tensor) else v for v in value]
    try:
        data = _CODECS[kind][2](value).SerializeToString()
    except Exception as e:
        raise EpInvalidArgument(f"cannot encode a value of type {type(value).__name__} as an ONNX value: {e}") from None
    return pb.OnnxValue(kind=kind, data=data)


def decode(message: pb.OnnxValue) -> Any:
    try:
        cls, to_python_value, _ = _CODECS[message.kind]
    except KeyError:
        raise EpInvalidArgument(f"unknown ONNX value kind {message.kind}") from None
    proto = cls()
    try:
        proto.ParseFromString(message.data)
    except Exception as e:
        raise EpInvalidArgument(f"malformed ONNX value: {type(e).__name__}: {e}") from None
    refuse_external_data(proto, "an ONNX value")
    try:
        return to_python_value(proto)
    except Exception as e:
        raise EpInvalidArgument(f"malformed ONNX value: {type(e).__name__}: {e}") from None
