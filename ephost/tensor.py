"""ephost.Tensor, the OrtValue of ephost: a typed, shaped view of memory that lives on the host or in an
allocator (possibly one in a worker process)."""
from __future__ import annotations

import logging
import weakref
from typing import Sequence

import numpy as np

from ephost.errors import EpError, EpInvalidArgument
from ephost.memory import Buffer
from ephost.types import HOST_MEMORY, MAX_RANK, MemoryInfo, checked_shape, describe, elem_type_of, nbytes_of

log = logging.getLogger(__name__)


def _free_quietly(allocator, buffer: Buffer) -> None:
    # A finalizer runs on whatever thread collects the tensor: allocators that would block on a call (a
    # worker's) queue the free instead.
    free = getattr(allocator, "free_later", allocator.free)
    try:
        free(buffer)
    except EpError as e:  # the worker may be gone; its memory went with it
        log.debug("freeing a tensor's buffer failed: %s", e)


class Tensor:
    """A tensor in host memory (`host`) or in an allocator's buffer (`buffer`)."""

    def __init__(self, shape, dtype, memory_info: MemoryInfo, *, buffer: Buffer | None = None,
                 host: np.ndarray | None = None, allocator=None):
        self.shape = checked_shape(shape)
        self.dtype = np.dtype(dtype)
        elem_type_of(self.dtype)
        self.nbytes = nbytes_of(self.shape, self.dtype)
        self.memory_info = memory_info
        self._buffer = buffer
        self._host = host
        self._finalizer = None
        if allocator is not None:
            self._free_with(allocator)

    @classmethod
    def trusted(cls, shape: tuple[int, ...], dtype: np.dtype, memory_info: MemoryInfo, nbytes: int, *,
                buffer: Buffer | None = None, host: np.ndarray | None = None, allocator=None) -> "Tensor":
        """A tensor whose shape, dtype and size were checked already (by desc_from_proto, or as a numpy
        array's own): the constructor without its checks, for the paths every Compute takes. With `allocator`,
        it frees its buffer there as the constructor's does."""
        tensor = cls.__new__(cls)
        tensor.shape, tensor.dtype, tensor.nbytes, tensor.memory_info = shape, dtype, nbytes, memory_info
        tensor._buffer, tensor._host, tensor._finalizer = buffer, host, None
        if allocator is not None:
            tensor._free_with(allocator)
        return tensor

    def _free_with(self, allocator) -> None:
        """Have the buffer (where there is one) freed in `allocator` when this tensor goes."""
        if self._buffer is not None:
            self._finalizer = weakref.finalize(self, _free_quietly, allocator, self._buffer)
            self._finalizer.atexit = False

    # --- construction (ORT: OrtValue.ortvalue_from_numpy, OrtValue.ortvalue_from_shape_and_type) ----

    @classmethod
    def from_numpy(cls, array: np.ndarray, allocator=None) -> "Tensor":
        """Without an allocator, wrap the array's own memory (no copy; it can be a copy destination too).
        With one, copy the array into memory from that allocator."""
        array = np.asarray(array)
        if not array.flags.c_contiguous:
            raise EpInvalidArgument("Tensor.from_numpy needs a C-contiguous array; pass np.ascontiguousarray(a)")
        if allocator is None:
            elem_type_of(array.dtype)  # a dtype ephost carries
            if array.ndim > MAX_RANK:
                checked_shape(array.shape)  # refused here, as the constructor would
            return cls.trusted(array.shape, array.dtype, HOST_MEMORY, nbytes_of(array.shape, array.dtype), host=array)
        tensor = cls.empty(array.shape, array.dtype, allocator)
        dst = tensor.local_bytes()
        if dst is not None:
            dst[:] = array.reshape(-1).view(np.uint8)
        else:
            allocator.data_transfer.copy_tensors([cls.from_numpy(array)], [tensor])
        return tensor

    @classmethod
    def empty(cls, shape, dtype, allocator) -> "Tensor":
        shape, dtype = checked_shape(shape), np.dtype(dtype)
        elem_type_of(dtype)  # checked before anything is allocated
        nbytes = nbytes_of(shape, dtype)
        return cls.trusted(shape, dtype, allocator.memory_info, nbytes, buffer=allocator.alloc(nbytes),
                           allocator=allocator)

    # --- access -----------------------------------------------------------------------------------

    @property
    def elem_type(self) -> int:
        return elem_type_of(self.dtype)

    @property
    def buffer(self) -> Buffer | None:
        return self._buffer

    def numpy(self) -> np.ndarray:
        """The tensor as an array: a view, without copy, where the memory is host accessible."""
        if self._host is not None:
            return self._host
        if self.memory_info.host_accessible:
            array = self.local_array()
            if array is not None:
                return array
        raise EpInvalidArgument(
            f"tensor is in {self.memory_info.name} memory ({self.memory_info.device_mem_type.name}), which this "
            "process cannot read; copy it to a host tensor with copy_tensors first")

    @property
    def addressable(self) -> bool:
        """Whether this process can address the tensor's bytes (local_bytes() is not None), without making
        the view."""
        return self._host is not None or (self._buffer is not None and self._buffer.region is not None)

    def local_bytes(self) -> np.ndarray | None:
        """The tensor's bytes as a flat uint8 array, where this process can address them, whatever the
        memory type (for EPs whose device memory is this process's memory); None where it cannot."""
        if self._host is not None:
            return self._host.reshape(-1).view(np.uint8)
        if self._buffer is None or self._buffer.region is None:
            return None
        return self._buffer.host_view(owner=self)[: self.nbytes]

    def local_array(self, keeps: bool = True) -> np.ndarray | None:
        """The tensor as an array of this process's memory, where it can address it (else None). `keeps`: the
        array keeps the tensor alive; False: a view that does not, cheaper to make, for bytes read while the
        caller holds the tensor (a Compute's input on its way to the worker)."""
        host = self._host
        if host is not None and host.shape == self.shape and host.dtype == self.dtype:
            return host  # the array itself (every Compute reads its inputs so: no views to make)
        if keeps or host is not None or self._buffer is None:
            raw = self.local_bytes()
        else:
            raw = self._buffer.host_view()  # (made once for the buffer)
            raw = None if raw is None else raw[:self.nbytes]
        return None if raw is None else raw.view(self.dtype).reshape(self.shape)

    def detach_buffer(self) -> Buffer | None:
        """Take over the buffer: it is no longer freed when this tensor goes (its new owner frees it)."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        return self._buffer

    def relabel(self, memory_info: MemoryInfo) -> None:
        """Label this tensor with the MemoryInfo users know its memory by (a session names a worker's memory as the
        Environment does), in place: call it before anything else sees the tensor (an EP's new output). A new
        tensor would cost a second finalizer, and the first one's hand-over, on every output of every run."""
        self.memory_info = memory_info

    def release(self) -> None:
        """Give the buffer back to its allocator now rather than when the tensor is collected."""
        if self._finalizer is not None:
            _, _, (allocator, buffer), _ = self._finalizer.detach()
            self._finalizer = None
            allocator.free(buffer)

    def __repr__(self) -> str:
        return f"Tensor({describe(self.shape, self.dtype)} in {self.memory_info.name})"


def check_copy_pairs(src: Sequence[Tensor], dst: Sequence[Tensor]) -> None:
    """ORT's CopyTensors contract: as many sources as destinations, each pair of one type and shape."""
    if len(src) != len(dst):
        raise EpInvalidArgument(f"copy_tensors got {len(src)} sources but {len(dst)} destinations")
    for i, (s, d) in enumerate(zip(src, dst)):
        if s.dtype != d.dtype or s.shape != d.shape:
            raise EpInvalidArgument(
                f"copy {i}: source is {describe(s.shape, s.dtype)} but destination is {describe(d.shape, d.dtype)}")
