"""Compute's reads and writes of ORT's kernel context through the shim's two helpers (shim.c): every input's type,
shape and data in one call, an output made and located in one. Through ctypes each OrtApi call is a trip through
Python, and one tensor's type, shape and data are six of them."""
from __future__ import annotations

import ctypes
import struct
import threading
from ctypes import POINTER, Structure, c_int32, c_int64, c_size_t, c_void_p

import numpy as np

from ephost.errors import EpInvalidArgument
from ephost.ort.abi import OrtAbi
from ephost.ort.values import STRING, array_over, tensor_view

DIMS = 8  # EPHOST_DIMS: a tensor of more dimensions is read the long way
MAX_SHAPES = 64  # output shapes whose dimensions are kept made
MAX_VIEWS = 64  # views of ORT's tensors kept made
MISSING, LONG = -2, -1  # ephost_tensor_t.rank of an input ORT gave none for, and of one of more than DIMS dimensions


class _Tensor(Structure):
    """ephost_tensor_t: its bytes up to `value` name a view of the tensor's data (the dimensions past its rank are
    zero), and key the views kept made."""

    _fields_ = [("data", c_void_p), ("elem", c_int32), ("rank", c_int32), ("dims", c_int64 * DIMS),
                ("value", c_void_p)]


RECORD = ctypes.sizeof(_Tensor)
KEY = _Tensor.value.offset  # the bytes that name a view: where the data lies, its element type and dimensions
_RECORD = struct.Struct(f"@Pii{DIMS}qP")  # (data, elem, rank, *dims, value), as the C compiler lays them out
_HEAD = struct.Struct(f"@Pii{8 * DIMS}xP")  # (data, elem, rank, value)
assert _RECORD.size == _HEAD.size == RECORD


class _Api(Structure):
    """ephost_kernel_api_t: the OrtApi functions the helpers call, in its order."""

    _fields_ = [(name, c_void_p) for name in ("input_count", "input", "output", "type_and_shape", "element_type",
                                              "dims_count", "dims", "release_info", "data")]


class _Room:
    """One thread's records the helpers fill: `capacity` tensors, read back as bytes in one go."""

    __slots__ = ("capacity", "records", "at", "bytes", "count", "count_at")

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.records = (_Tensor * capacity)()
        self.at = ctypes.addressof(self.records)
        self.bytes = memoryview(self.records).cast("B")
        self.count = c_size_t()
        self.count_at = ctypes.addressof(self.count)


class KernelIO:
    """A kernel context's inputs as numpy views of ORT's memory, and its outputs made, through the loaded shim."""

    def __init__(self, abi: OrtAbi, shim: ctypes.CDLL):
        api = abi.api
        functions = (api.KernelContext_GetInputCount, api.KernelContext_GetInput, api.KernelContext_GetOutput,
                     api.GetTensorTypeAndShape, api.GetTensorElementType, api.GetDimensionsCount, api.GetDimensions,
                     api.ReleaseTensorTypeAndShapeInfo, api.GetTensorMutableData)
        self._abi = abi
        self._api = _Api(*[ctypes.cast(f, c_void_p).value for f in functions])
        self._api_at = ctypes.addressof(self._api)
        self._read = shim.ephost_ort_inputs
        self._read.restype = c_void_p
        self._read.argtypes = [c_void_p, c_void_p, c_void_p, c_size_t, c_void_p]
        self._make = shim.ephost_ort_output
        self._make.restype = c_void_p
        self._make.argtypes = [c_void_p, c_void_p, c_size_t, POINTER(c_int64), c_size_t, c_void_p]
        self._local = threading.local()  # per thread: the records the helpers fill
        self._dims: dict[tuple[int, ...], ctypes.Array] = {}  # shapes as the helpers take them (read only once made)
        # Views of ORT's tensors by their record's first KEY bytes (address, element type, dims), each with where its
        # data lies and its size: the same view again for a tensor where the last one of that type and shape lay (a
        # decoder's KV cache, its inputs' buffers, a partition's outputs, step after step). A view is used only
        # while ORT presents a tensor of its type and shape at its address.
        self._views: dict[bytes, tuple[np.ndarray, int]] = {}

    def _room(self, capacity: int) -> _Room:
        room = self._local.room = _Room(capacity)
        return room

    def inputs(self, context: int) -> tuple[list[np.ndarray | None], list[int]]:
        """The context's inputs (None for one ORT gave none for; strings read into an array of str), and where
        each one's data lies (0 for none, and for strings)."""
        room = getattr(self._local, "room", None) or self._room(4)
        status = self._read(self._api_at, context, room.at, room.capacity, room.count_at)
        if status:
            self._abi.check(status, "reading the kernel context's inputs")
        count = room.count.value
        if count > room.capacity:  # more inputs than this thread has read before: room for them, and again
            room = self._room(count)
            self._abi.check(self._read(self._api_at, context, room.at, room.capacity, room.count_at),
                            "reading the kernel context's inputs")
        raw = room.bytes[:count * RECORD].tobytes()
        views = self._views
        arrays: list[np.ndarray | None] = []
        addresses: list[int] = []
        for start in range(0, count * RECORD, RECORD):
            found = views.get(raw[start:start + KEY]) or self._view(raw, start)
            arrays.append(found[0])
            addresses.append(found[1])
        return arrays, addresses

    def _view(self, raw: bytes, start: int) -> tuple[np.ndarray | None, int]:
        """The tensor of the record at `start` (one not found among the views) and where its data lies; a view of
        plain data is kept for the next time."""
        data, elem, rank, *dims, value = _RECORD.unpack_from(raw, start)
        if rank == MISSING:
            return None, 0
        if rank == LONG or elem == STRING:
            return tensor_view(self._abi, value), 0 if elem == STRING else data or 0
        return self._keep(raw[start:start + KEY], array_over(data or 0, elem, dims[:rank]), data or 0)

    def _keep(self, key: bytes, array: np.ndarray, data: int) -> tuple[np.ndarray, int]:
        views = self._views
        if len(views) >= MAX_VIEWS:  # tensors somewhere new every Compute: nothing to find again
            views.clear()
        found = views[key] = (array, data)
        return found

    def output(self, context: int, index: int, shape: tuple[int, ...]) -> tuple[int, int, int, np.ndarray | None]:
        """Output `index` made by ORT with this shape: its OrtValue, where its data lies (0 for none), its ONNX
        element type, and a view of its data (None for strings, and for a type numpy has not)."""
        room = getattr(self._local, "out", None) or self._out_room()
        dims = self._dims.get(shape)
        if dims is None:
            dims = self._dims_of(shape)
        status = self._make(self._api_at, context, index, dims, len(shape), room.at)
        if status:
            self._abi.check(status, "KernelContext_GetOutput")
        data, elem, rank, value = _HEAD.unpack_from(room.bytes)
        key = room.bytes[:KEY].tobytes()
        found = self._views.get(key)
        if found is not None:
            return value or 0, data or 0, elem, found[0]
        if elem == STRING:
            return value or 0, data or 0, elem, None
        try:
            view = array_over(data or 0, elem, shape)
        except EpInvalidArgument:  # no numpy type: the caller says so where it needs one
            return value or 0, data or 0, elem, None
        if rank != LONG:  # (a record of more dimensions does not hold them: no key)
            self._keep(key, view, data or 0)
        return value or 0, data or 0, elem, view

    def _out_room(self) -> _Room:
        room = self._local.out = _Room(1)
        return room

    def _dims_of(self, shape: tuple[int, ...]) -> "ctypes.Array":
        """The shape as the helper takes it, made once per shape: a partition's outputs keep theirs from Compute
        to Compute."""
        if len(self._dims) >= MAX_SHAPES:  # shapes that change every Compute: nothing to find again
            self._dims.clear()
        dims = self._dims[shape] = shape_of(shape)
        return dims


def shape_of(shape: tuple[int, ...]) -> "ctypes.Array":
    """A shape as the helpers take it."""
    return (c_int64 * len(shape))(*shape)
