"""The bridged EP's device memory: the worker's shared memory, which this process maps, offered to ORT as the
memory the EP allocates in (an OrtAllocator over it, named by the EpDevice's allocator info).

What it saves: a partition's output is handed to ORT where the worker wrote it (ORT's output tensor *is* the
worker's buffer), and a tensor ORT placed in this memory (a bridged partition's output feeding another, an
OrtValue the application made on the device for IOBinding) reaches the worker by handle. Neither is copied.

ORT is told the memory is CPU memory (device type CPU, ephost's vendor id), which it is: ORT's own CPU kernels
read it in place and ORT puts no copy nodes at the partition's edges (a GPU or NPU device type would make it
insert MemcpyFromHost/ToHost around every bridged partition, one copy each way). For the same reason
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
from ephost.ort.callbacks import Guard, fill, keep
from ephost.ort.pool import PoolFunctions
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
    by size for the next allocation (a steady stream of runs asks the worker for nothing); at most IDLE_BYTES.
    The shim's pool (app/ort/pool.py) keeps them and answers ORT's Alloc and Free of them without Python."""

    IDLE_BYTES = 256 << 20

    def __init__(self, abi: A.OrtAbi, name: str, registration: "Registration", pools: PoolFunctions):
        self.abi, self.registration = abi, registration
        self.guard = Guard(abi, name)
        info = c_void_p()
        abi.check(abi.api.CreateMemoryInfo_V2(f"{name} shared memory".encode(), A.MEMORY_DEVICE_CPU, VENDOR_ID, 0,
                                              A.MEMORY_TYPE_DEFAULT, ALIGNMENT, A.DEVICE_ALLOCATOR,
                                              ctypes.byref(info)), "CreateMemoryInfo_V2")
        self.info = info.value
        self._blocks: dict[int, Block] = {}  # address -> what ORT holds there, or the pool holds idle
        self._lock = threading.Lock()  # guards _blocks
        self._offered = threading.local()  # the output Compute is about to hand over, on the thread that asks
        self._pools = pools
        self._worker = self._current_worker()  # whose memory the pool's blocks are in
        # Python's Alloc and Free, for what the pool does not hold (kept alive here: the pool calls them)
        self._python = (A.ALLOCATOR.type_of("Alloc")(
                            lambda this, nbytes: self.guard.quiet("Alloc", lambda: self.alloc(nbytes), 0)),
                        A.ALLOCATOR.type_of("Free")(lambda this, p: self.guard.quiet("Free", lambda: self.free(p))))
        self.pool = pools.new(*self._python, self.IDLE_BYTES)
        self.struct = A.OrtAllocator.from_address(self.pool)  # the pool's first member
        fill(self.struct, A.ALLOCATOR, abi, {
            "Alloc": pools.alloc,
            "Free": pools.free,
            "Info": lambda this: self.info,
            "Reserve": pools.alloc,
            "GetStats": lambda this, out: self.guard.status("GetStats", lambda: self._stats(out)),
            "AllocOnStream": pools.alloc_on_stream,
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
        """What the pool did not answer: the partition's output offered on this thread, else a new block, which
        the pool keeps from its Free on where it is the worker's."""
        self.refresh()
        block = getattr(self._offered, "block", None)
        if block is not None and nbytes <= block.view.nbytes:
            self._offered.block = None
            block.adopted = True
        else:
            block = self._new_block(nbytes)
        with self._lock:
            self._blocks[block.address] = block
        if block.buffer is not None and not block.adopted:
            _, evicted = self._pools.track(self.pool, block.address, nbytes)
            if evicted:
                self._give_back([evicted])
        return block.address

    def free(self, address: int) -> None:
        """What the pool does not keep: a block handed over in place, one past its idle bytes or slots, private
        memory."""
        self._give_back([address])

    def refresh(self) -> None:
        """Where the worker was replaced, the pool lets go of the blocks in the memory of the one gone (those ORT
        holds are freed through Python, and dropped, as it frees them): its memory is not named by handle, and
        stays mapped here only as long as a block holds it."""
        current = self._current_worker()
        if current is not self._worker:
            self._worker = current
            self._give_back(self._pools.drain(self.pool))

    def _current_worker(self):
        """The connection of the worker that runs now (None once released); every Compute reads it (refresh)."""
        registration = self.registration  # (read once: release may set it to None on another thread)
        return registration.link.current if registration is not None else None

    def _link(self):
        """The registration's link to its worker; None once released (see release)."""
        registration = self.registration  # (read once: release may set it to None on another thread)
        return registration.link if registration is not None else None

    def _give_back(self, addresses: list[int], now: bool = False) -> None:
        """Blocks ORT or the pool let go of: the worker's back to it (batched with its other frees, or `now`), a
        dead worker's and private memory dropped (their mapping goes with the last view)."""
        with self._lock:
            blocks = [self._blocks.pop(a, None) for a in addresses]
        link = self._link()
        mine = [b.buffer for b in blocks if b is not None and b.buffer is not None and link is not None
                and owned(b.buffer, link)]
        if not mine:
            return
        try:
            allocator = self.registration.session_allocator()
            if now:
                allocator.free_many(mine)
            else:
                for buffer in mine:
                    allocator.free_later(buffer)
        except EpError as e:  # the registration is closing: its worker takes its memory with it
            log.debug("freeing blocks: %s", e)

    def _stats(self, out) -> None:
        kvps = c_void_p()
        self.abi.api.CreateKeyValuePairs(ctypes.byref(kvps))
        idle, idle_blocks = self._pools.idle(self.pool)
        with self._lock:
            held = len(self._blocks) - idle_blocks
        self.abi.api.AddKeyValuePair(kvps, b"NumAllocs", str(held).encode())
        self.abi.api.AddKeyValuePair(kvps, b"IdleBytes", str(idle).encode())
        out[0] = kvps.value

    def _new_block(self, nbytes: int) -> Block:
        registration = self.registration
        if registration is not None:  # (None: released, see release: private memory)
            try:
                buffer = registration.session_allocator().alloc(max(nbytes, 1))
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
        """The worker buffer ORT's tensor at `address` lies in, where the worker that runs the Compute can name it.
        A worker that died is waited for while it is replaced, as the Compute waits for it: a buffer of the dead
        one is not named to its successor (its bytes go)."""
        block = self._blocks.get(address)
        if block is None or block.buffer is None:  # (most inputs: asked nothing further)
            return None
        link = self._link()
        return block.buffer if link is not None and block.buffer.owner is link.conn else None

    def offer(self, buffer: Buffer) -> Block | None:
        """Make `buffer` (a partition's output, mapped here) the next allocation this thread asks for, where it
        fits; `taken` then says whether ORT took it."""
        view = buffer.host_view()
        if view is None or not view.nbytes:
            return None
        block = self._offered.block = Block(view, buffer)
        self._pools.offer(self.pool)  # the pool leaves this thread's next Alloc to Python
        return block

    def taken(self, block: Block, address: int) -> bool:
        """Whether ORT's output (at `address`) is the offered buffer; the offer ends here either way."""
        self._offered.block = None
        self._pools.offer(None)
        if not block.adopted:
            return False  # ORT had the output allocated already (a bound output it kept): the bridge copies
        if block.address == address:
            return True
        with self._lock:  # allocated but not what ORT's output is: not ORT's, and the tensor keeps freeing it
            if self._blocks.get(block.address) is block:
                del self._blocks[block.address]
        return False

    def release(self) -> None:
        """With the factory. The OrtMemoryInfo, the pool and this allocator stay, under the struct's address as
        long as the process (a few small objects per registration): ORT's EpDevices hold the memory info, and
        tensors ORT made in this memory outlive the registration where the application holds them (ORT's outputs,
        handed out as numpy arrays over them). Their blocks keep the worker's mapping they lie in readable until
        ORT frees them, and that Free comes here: were this gone, the pool would call into freed callbacks and the
        mapping would go with the blocks' views (either crashes the application). What goes is the registration
        (its closed worker's objects, the models it sent): a Free from now on drops its block, an Alloc gets
        private memory; at exit the struct is neutered with every live one (callbacks.neuter_all)."""
        self._give_back(self._pools.drain(self.pool), now=True)
        self.registration = None
