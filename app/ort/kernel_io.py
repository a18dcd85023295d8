"""Compute's reads and writes of ORT's kernel context through the shim's two helpers (shim.c): every input's type,
shape and data in one call, an output made and located in one. Through ctypes each OrtApi call is a trip through
Python, and one tensor's type, shape and data are six of them."""
from __future__ import annotations

import ctypes
import threading
from ctypes import POINTER, Structure, c_int32, c_int64, c_size_t, c_void_p

import numpy as np

from ephost.ort.abi import OrtAbi
from ephost.ort.values import STRING, array_over, tensor_view

DIMS = 8  # EPHOST_DIMS: a tensor of more dimensions is read the long way
MAX_SHAPES = 64  # output shapes whose dimensions are kept made
MAX_VIEWS = 64  # views of input tensors kept made
MISSING, LONG = -2, -1  # ephost_tensor_t.rank of an input ORT gave none for, and of one of more than DIMS dimensions


class _Tensor(Structure):
    _fields_ = [("value", c_void_p), ("data", c_void_p), ("elem", c_int32), ("rank", c_int32),
                ("dims", c_int64 * DIMS)]


class _Api(Structure):
    """ephost_kernel_api_t: the OrtApi functions the helpers call, in its order."""

    _fields_ = [(name, c_void_p) for name in ("input_count", "input", "output", "type_and_shape", "element_type",
                                              "dims_count", "dims", "release_info", "data")]


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
        self._make.argtypes = [c_void_p, c_void_p, c_size_t, POINTER(c_int64), c_size_t, c_void_p, c_void_p,
                               c_void_p]
        self._local = threading.local()  # per thread: the records the helpers fill
        self._dims: dict[tuple[int, ...], ctypes.Array] = {}  # shapes as the helpers take them (read only once made)
        # Views of ORT's inputs by (address, element type, dims): the same view again for a tensor where the last
        # one of that type and shape lay (a decoder's KV cache, its inputs' buffers, step after step). A view is
        # only read, and only while ORT presents a tensor at its address.
        self._views: dict[tuple, np.ndarray] = {}

    def inputs(self, context: int) -> tuple[list[np.ndarray | None], list[int]]:
        """The context's inputs (None for one ORT gave none for; strings read into an array of str), and where
        each one's data lies (0 for none, and for strings)."""
        local = self._local
        room = getattr(local, "room", None)
        if room is None:
            room = local.room = (_Tensor * 4)()
            local.count = c_size_t()
        count = local.count
        self._abi.check(self._read(self._api_at, context, room, len(room), ctypes.addressof(count)),
                        "reading the kernel context's inputs")
        if count.value > len(room):  # more inputs than this thread has read before: room for them, and again
            room = local.room = (_Tensor * count.value)()
            self._abi.check(self._read(self._api_at, context, room, len(room), ctypes.addressof(count)),
                            "reading the kernel context's inputs")
        arrays: list[np.ndarray | None] = []
        addresses: list[int] = []
        views = self._views
        for i in range(count.value):
            t = room[i]
            rank, elem = t.rank, t.elem
            if rank == MISSING:
                arrays.append(None)
                addresses.append(0)
                continue
            if rank == LONG or elem == STRING:
                arrays.append(tensor_view(self._abi, t.value))
                addresses.append(0 if elem == STRING else t.data or 0)
                continue
            data = t.data or 0
            dims = t.dims[:rank]
            key = (data, elem, *dims)
            array = views.get(key)
            if array is None:
                if len(views) >= MAX_VIEWS:  # tensors somewhere new every Compute: nothing to find again
                    views.clear()
                array = views[key] = array_over(data, elem, dims)
            arrays.append(array)
            addresses.append(data)
        return arrays, addresses

    def output(self, context: int, index: int, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """Output `index` made by ORT with this shape: its OrtValue, where its data lies (0 for none) and its ONNX
        element type."""
        local = self._local
        made = getattr(local, "made", None)
        if made is None:  # this thread's records the helper fills, and their addresses
            records = (c_void_p(), c_void_p(), c_int32())
            made = local.made = (records, tuple(ctypes.addressof(r) for r in records))
        (value, data, elem), at = made
        value.value = data.value = None
        self._abi.check(self._make(self._api_at, context, index, self._dims_of(shape), len(shape), *at),
                        "KernelContext_GetOutput")
        return value.value or 0, data.value or 0, elem.value

    def _dims_of(self, shape: tuple[int, ...]) -> "ctypes.Array":
        """The shape as the helper takes it, made once per shape: a partition's outputs keep theirs from Compute
        to Compute."""
        dims = self._dims.get(shape)
        if dims is None:
            if len(self._dims) >= MAX_SHAPES:  # shapes that change every Compute: nothing to find again
                self._dims.clear()
            dims = self._dims[shape] = shape_of(shape)
        return dims


def shape_of(shape: tuple[int, ...]) -> "ctypes.Array":
    """A shape as the helpers take it."""
    return (c_int64 * len(shape))(*shape)
