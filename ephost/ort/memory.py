"""The bridged EP's device memory: the worker's shared memory, which this process maps, offered to ORT as the
memory the EP allocates in (an OrtAllocator over it, named by the EpDevice's allocator info).

What it saves: a partition's output is handed to ORT where the worker wrote it (ORT's output tensor *is* the
worker's buffer), and a tensor ORT placed in this memory (a bridged partition's output feeding another, an
OrtValue the application made on the device for IOBinding) reaches the worker by handle. Neither is copied.

ORT is told the memory is CPU memory (device type CPU, ephost's vendor id), which it is: ORT's own CPU kernels
read it in place and ORT puts no copy nodes at the partition's edges (a GPU or NPU device type would make it
insert MemcpyFromHost/ToHost around every bridged partition, one copy each way, measured). For the same reason
ORT copies to and from it with its own CPU data transfer, and the bridge offers none.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from ctypes import c_void_p
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ephost.errors import EpError
from ephost.memory import Buffer
from ephost.ort import abi as A
from ephost.ort.callbacks import Guard, fill, forget, keep
from ephost.client.handles import owned

if TYPE_CHECKING:
    from ephost.client.environment import Registration

log = logging.getLogger(__name__)

VENDOR_ID = 0xE905  # ephost's, in the memory info: what tells ephost's shared memory from ORT's own CPU memory
ALIGNMENT = 64


@dataclass(eq=False)
class Block:
    """One allocation ORT holds: a worker buffer (mapped here; `view` keeps the mapping alive even after the
    worker is gone) or, where the worker could not give one, private memory of this process."""

    view: np.ndarray
    buffer: Buffer | None = None
    adopted: bool = False  # a partition's output handed over; freed back to the worker, not kept for reuse
    address: int = field(init=False)  # where the view's data lies (ORT's pointer): asked every Alloc

    def __post_init__(self) -> None:
        self.address = self.view.ctypes.data


class BridgeMemory:
    """OrtAllocator over the worker's shared memory, for one registration. Freed blocks of the worker's are kept
    by size for the next allocation (a steady stream of runs asks the worker for nothing); at most IDLE_BYTES."""

    IDLE_BYTES = 256 << 20

    def __init__(self, abi: A.OrtAbi, name: str, registration: "Registration"):
        self.abi, self.registration = abi, registration
        self.guard = Guard(abi, name)
        info = c_void_p()
        abi.check(abi.api.CreateMemoryInfo_V2(f"{name} shared memory".encode(), A.MEMORY_DEVICE_CPU, VENDOR_ID, 0,
                                              A.MEMORY_TYPE_DEFAULT, ALIGNMENT, A.DEVICE_ALLOCATOR,
                                              ctypes.byref(info)), "CreateMemoryInfo_V2")
        self.info = info.value
        self._blocks: dict[int, Block] = {}  # address -> what ORT holds there
        self._idle: dict[int, list[Block]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self._offered = threading.local()  # the output Compute is about to hand over, on the thread that asks
        alloc = lambda this, nbytes: self.guard.quiet("Alloc", lambda: self.alloc(nbytes), 0)  # noqa: E731
        self.struct = A.OrtAllocator()
        fill(self.struct, A.ALLOCATOR_FUNCTIONS, {
            "Alloc": alloc,
            "Free": lambda this, p: self.guard.quiet("Free", lambda: self.free(p)),
            "Info": lambda this: self.info,
            "Reserve": alloc,
            "GetStats": lambda this, out: self.guard.status("GetStats", lambda: self._stats(out)),
            "AllocOnStream": lambda this, nbytes, stream: alloc(this, nbytes),
        })
        self.address = keep(self, self.struct)

    @staticmethod
    def available(registration: "Registration") -> bool:
        """Whether the worker shares memory with this process that it hands outputs over in."""
        link, info = registration.link, registration.session_memory()
        return link is not None and link.current is not None and link.current.shares_memory \
            and info is not None and info.host_accessible

    # --- OrtAllocator ---

    def alloc(self, nbytes: int) -> int:
        block = getattr(self._offered, "block", None)
        if block is not None and nbytes <= block.view.nbytes:
            self._offered.block = None
            block.adopted = True
        else:
            block = self._idle_block(nbytes) or self._new_block(nbytes)
        with self._lock:
            self._blocks[block.address] = block
        return block.address

    def free(self, address: int) -> None:
        with self._lock:
            block = self._blocks.pop(address, None)
            if block is None or block.buffer is None:
                return
            mine = owned(block.buffer, self.registration.link)
            if mine and not block.adopted and self._idle_bytes + block.buffer.nbytes <= self.IDLE_BYTES:
                self._idle.setdefault(block.buffer.nbytes, []).append(block)
                self._idle_bytes += block.buffer.nbytes
                return
        if mine:  # a dead worker's memory went with it (the mapping here goes with the view)
            try:
                self.registration.session_allocator().free_later(block.buffer)
            except EpError as e:  # the registration is closing: its worker takes its memory with it
                log.debug("freeing a block: %s", e)

    def _stats(self, out) -> None:
        kvps = c_void_p()
        self.abi.api.CreateKeyValuePairs(ctypes.byref(kvps))
        with self._lock:
            held, idle = len(self._blocks), self._idle_bytes
        self.abi.api.AddKeyValuePair(kvps, b"NumAllocs", str(held).encode())
        self.abi.api.AddKeyValuePair(kvps, b"IdleBytes", str(idle).encode())
        out[0] = kvps.value

    def _idle_block(self, nbytes: int) -> Block | None:
        link = self.registration.link
        with self._lock:
            blocks = self._idle.get(nbytes)
            while blocks:
                block = blocks.pop()
                self._idle_bytes -= nbytes
                if owned(block.buffer, link):
                    return block
        return None

    def _new_block(self, nbytes: int) -> Block:
        try:
            buffer = self.registration.session_allocator().alloc(max(nbytes, 1))
            view = buffer.host_view()
            if view is not None:
                return Block(view, buffer)
            log.debug("a buffer of the worker's is not mapped here: private memory instead")
        except EpError as e:  # the worker is restarting, or out of memory: ORT still gets memory
            log.debug("no worker buffer for %d bytes (%s): private memory instead", nbytes, e)
        raw = np.empty(nbytes + ALIGNMENT, np.uint8)
        start = -raw.ctypes.data % ALIGNMENT
        return Block(raw[start:start + nbytes])

    # --- what Compute asks ---

    def buffer_at(self, address: int) -> Buffer | None:
        """The worker buffer ORT's tensor at `address` lies in, where the running worker can name it."""
        block = self._blocks.get(address)
        if block is not None and block.buffer is not None and owned(block.buffer, self.registration.link):
            return block.buffer
        return None

    def offer(self, buffer: Buffer) -> Block | None:
        """Make `buffer` (a partition's output, mapped here) the next allocation this thread asks for, where it
        fits; `taken` then says whether ORT took it."""
        view = buffer.host_view()
        if view is None or not view.nbytes:
            return None
        block = self._offered.block = Block(view, buffer)
        return block

    def taken(self, block: Block, address: int) -> bool:
        """Whether ORT's output (at `address`) is the offered buffer; the offer ends here either way."""
        self._offered.block = None
        if not block.adopted:
            return False  # ORT had the output allocated already (a bound output it kept): the bridge copies
        if block.address == address:
            return True
        with self._lock:  # allocated but not what ORT's output is: not ORT's, and the tensor keeps freeing it
            if self._blocks.get(block.address) is block:
                del self._blocks[block.address]
        return False

    def release(self) -> None:
        """With the factory. The OrtMemoryInfo stays: ORT's EpDevices hold the pointer itself, and may outlive
        this by a moment (a small object per registration)."""
        with self._lock:
            idle = [b.buffer for blocks in self._idle.values() for b in blocks]
            self._idle.clear()
            self._idle_bytes = 0
        forget(self.address)
        if idle and owned(idle[0], self.registration.link):
            try:
                self.registration.session_allocator().free_many(idle)
            except EpError as e:
                log.debug("freeing idle blocks: %s", e)
