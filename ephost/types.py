"""Types both sides of the wire share: device and memory descriptions, element types, and their proto forms.

Field names follow ONNX Runtime's Python API (OrtMemoryInfo, OrtHardwareDevice, OrtEpDevice).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import numpy as np
from onnx import TensorProto, helper

from ephost.errors import EpInvalidArgument
from ephost.v1 import common_pb2 as pb


class HardwareDeviceType(enum.IntEnum):
    CPU = 0
    GPU = 1
    NPU = 2


class DeviceMemoryType(enum.IntEnum):
    DEFAULT = 0
    HOST_ACCESSIBLE = 5


class AllocatorType(enum.IntEnum):
    DEVICE = 0
    ARENA = 1


@dataclass(frozen=True)
class MemoryInfo:
    name: str
    device_type: HardwareDeviceType = HardwareDeviceType.CPU
    device_vendor_id: int = 0
    device_id: int = 0
    device_mem_type: DeviceMemoryType = DeviceMemoryType.DEFAULT
    alignment: int = 64
    allocator_type: AllocatorType = AllocatorType.DEVICE

    @property
    def host_accessible(self) -> bool:
        return self.device_mem_type == DeviceMemoryType.HOST_ACCESSIBLE

    def to_proto(self) -> pb.MemoryInfo:
        return pb.MemoryInfo(
            name=self.name, device_type=int(self.device_type), device_vendor_id=self.device_vendor_id,
            device_id=self.device_id, device_mem_type=int(self.device_mem_type), alignment=self.alignment,
            allocator_type=int(self.allocator_type),
        )

    @classmethod
    def from_proto(cls, m: pb.MemoryInfo) -> "MemoryInfo":
        return cls(
            name=m.name, device_type=checked_enum(HardwareDeviceType, m.device_type, "device_type"),
            device_vendor_id=m.device_vendor_id, device_id=m.device_id,
            device_mem_type=checked_enum(DeviceMemoryType, m.device_mem_type, "device_mem_type"),
            alignment=m.alignment, allocator_type=checked_enum(AllocatorType, m.allocator_type, "allocator_type"),
        )


# The application's own memory: plain numpy arrays. ORT calls it "Cpu".
HOST_MEMORY = MemoryInfo("Cpu", HardwareDeviceType.CPU, 0, 0, DeviceMemoryType.DEFAULT, 64, AllocatorType.DEVICE)


def _frozen(d: Mapping[str, str] | None) -> Mapping[str, str]:
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True)
class HardwareDevice:
    type: HardwareDeviceType
    vendor_id: int
    vendor: str
    device_id: int
    metadata: Mapping[str, str] = field(default_factory=dict)

    def to_proto(self) -> pb.HardwareDevice:
        return pb.HardwareDevice(type=int(self.type), vendor_id=self.vendor_id, vendor=self.vendor,
                                 device_id=self.device_id, metadata=dict(self.metadata))

    @classmethod
    def from_proto(cls, m: pb.HardwareDevice) -> "HardwareDevice":
        return cls(HardwareDeviceType(m.type), m.vendor_id, m.vendor, m.device_id, _frozen(m.metadata))


@dataclass(frozen=True)
class EpDeviceInfo:
    """What a factory's GetSupportedDevices reports for one device (OrtEpDevice, as data)."""

    index: int
    ep_name: str
    ep_vendor: str
    device: HardwareDevice
    memory_infos: tuple[MemoryInfo, ...]
    ep_metadata: Mapping[str, str] = field(default_factory=dict)
    ep_options: Mapping[str, str] = field(default_factory=dict)

    def to_proto(self) -> pb.EpDevice:
        return pb.EpDevice(
            index=self.index, ep_name=self.ep_name, ep_vendor=self.ep_vendor, ep_metadata=dict(self.ep_metadata),
            ep_options=dict(self.ep_options), device=self.device.to_proto(),
            memory_infos=[m.to_proto() for m in self.memory_infos],
        )

    @classmethod
    def from_proto(cls, m: pb.EpDevice) -> "EpDeviceInfo":
        return cls(
            index=m.index, ep_name=m.ep_name, ep_vendor=m.ep_vendor, device=HardwareDevice.from_proto(m.device),
            memory_infos=tuple(MemoryInfo.from_proto(x) for x in m.memory_infos),
            ep_metadata=_frozen(m.ep_metadata), ep_options=_frozen(m.ep_options),
        )


# --- element types ------------------------------------------------------------------------------------

# ONNX element type -> numpy dtype, for every type numpy represents natively (onnx's own table, less the types
# it maps to ml_dtypes' extension types and to Python objects, which cannot live in tensor memory).
_NP_BY_ELEM: dict[int, np.dtype] = {
    elem: dtype for elem, dtype in (
        (t, np.dtype(helper.tensor_dtype_to_np_dtype(t))) for t in TensorProto.DataType.values()
        if t != TensorProto.UNDEFINED)
    if dtype.isbuiltin == 1 and dtype.kind in "biufc"  # 2: a type registered by another package
}
_ELEM_BY_NP: dict[np.dtype, int] = {v: k for k, v in _NP_BY_ELEM.items()}

# Refuse descriptions of tensors larger than any machine's memory before doing arithmetic on them.
MAX_TENSOR_BYTES = 1 << 48
# numpy's limit on dimensions (NPY_MAXDIMS of numpy 1.x; numpy 2 allows 64): refused here, not deep in numpy.
MAX_RANK = 32


def checked_enum(cls: type[enum.IntEnum], value: int, what: str) -> enum.IntEnum:
    """`cls(value)`, or an EpInvalidArgument naming the field and the values it may take."""
    try:
        return cls(value)
    except ValueError:
        known = ", ".join(f"{m.name} ({m.value})" for m in cls)
        raise EpInvalidArgument(f"{what} {value} is not one of {known}") from None


def is_plain_dtype(dtype) -> bool:
    """Whether tensors of this dtype can live in tensor memory (numpy has the type natively)."""
    try:
        if dtype in _ELEM_BY_NP:  # a numpy dtype, as every array has: one lookup (np.dtype() costs three)
            return True
    except TypeError:  # unhashable
        pass
    return np.dtype(dtype) in _ELEM_BY_NP


def elem_type_of(dtype) -> int:
    try:
        return _ELEM_BY_NP[dtype]  # a native-order numpy dtype: the common case, one lookup on the hot path
    except (KeyError, TypeError):
        pass
    dt = np.dtype(dtype)
    try:
        return _ELEM_BY_NP[dt.newbyteorder("=")] if dt.byteorder not in "=|" else _ELEM_BY_NP[dt]
    except KeyError:
        raise EpInvalidArgument(f"numpy dtype {dt} has no ONNX tensor element type ephost can carry") from None


def dtype_of(elem_type: int) -> np.dtype:
    try:
        return _NP_BY_ELEM[elem_type]
    except KeyError:
        name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else elem_type
        raise EpInvalidArgument(f"tensor element type {name} is not supported in tensor memory") from None


def checked_shape(shape) -> tuple[int, ...]:
    dims = tuple(map(int, shape))
    if len(dims) > MAX_RANK:
        raise EpInvalidArgument(f"a shape of rank {len(dims)} has more than the {MAX_RANK} dimensions a tensor may")
    if dims and min(dims) < 0:
        raise EpInvalidArgument(f"shape {list(dims)} has a negative dimension")
    return dims


def nbytes_of(shape: tuple[int, ...], dtype: np.dtype) -> int:
    # Python integers do not overflow; every dimension is bounded too, zeros aside, so that numpy (whose sizes
    # are 64-bit) is never handed a shape it would overflow on, even one with a zero dimension.
    itemsize = dtype.itemsize if isinstance(dtype, np.dtype) else np.dtype(dtype).itemsize
    n = math.prod(shape) * itemsize
    if 0 < n <= MAX_TENSOR_BYTES:  # no zero dimension, and the whole bounded: every dimension is bounded too
        return n
    if any(d * itemsize > MAX_TENSOR_BYTES for d in shape) or \
            math.prod(d for d in shape if d) * itemsize > MAX_TENSOR_BYTES:
        raise EpInvalidArgument(f"shape {list(shape)} of {np.dtype(dtype)} needs more bytes than any tensor may have "
                                f"({MAX_TENSOR_BYTES}): more than any tensor may be")
    return n


def refuse_external_data(message, what: str) -> None:
    """Refuse any onnx TensorProto inside `message` (a model, a tensor, a sequence, a map...) whose data lives
    in an external file: a peer must never make this process read a path. (Large weights travel by other
    means: buffers, descriptors, content-addressed chunks.)"""
    stack = [message]
    while stack:
        m = stack.pop()
        if m.DESCRIPTOR.full_name == "onnx.TensorProto" and (
                m.data_location == TensorProto.EXTERNAL or len(m.external_data)):
            raise EpInvalidArgument(f"{what} has a tensor ({m.name or 'unnamed'}) whose data is in an external "
                                    "file; send the data with it (external data paths are never read)")
        for descriptor, value in m.ListFields():
            if descriptor.type != descriptor.TYPE_MESSAGE:
                continue
            if descriptor.message_type.GetOptions().map_entry:
                stack.extend(v for v in value.values() if hasattr(v, "DESCRIPTOR"))
            elif descriptor.is_repeated:
                stack.extend(value)
            else:
                stack.append(value)


def describe(shape, dtype) -> str:
    return f"{np.dtype(dtype)}{list(shape)}"


def desc_to_proto(shape, dtype, out: pb.TensorDesc | None = None) -> pb.TensorDesc:
    """The TensorDesc of a tensor; written into `out` where given (a field of a message being built, which
    costs half of building one and copying it in)."""
    if out is None:
        return pb.TensorDesc(elem_type=elem_type_of(dtype), shape=shape)
    out.elem_type = elem_type_of(dtype)
    out.shape.extend(shape)
    return out


def desc_from_proto(d: pb.TensorDesc) -> tuple[tuple[int, ...], np.dtype]:
    return checked_desc(d)[:2]


# Descriptions checked already, by (element type, *shape): a steady stream of calls repeats a few of them.
_CHECKED: dict[tuple[int, ...], tuple[tuple[int, ...], np.dtype, int]] = {}
_CHECKED_MAX = 4096


def checked_desc(d: pb.TensorDesc) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, nbytes) of a TensorDesc a peer sent, checked (element type, rank, dimensions, size)."""
    key = (d.elem_type, *d.shape)  # int64s: Python ints already
    known = _CHECKED.get(key)
    if known is not None:
        return known
    dtype = dtype_of(key[0])
    shape = key[1:]
    if len(shape) > MAX_RANK or (shape and min(shape) < 0):
        checked_shape(shape)  # raises, saying which
    known = shape, dtype, nbytes_of(shape, dtype)
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.clear()  # a peer sending ever new shapes: start again rather than grow
    _CHECKED[key] = known
    return known
