"""Moving bytes to and from a worker: one encoder of tensors into TensorRefs, one pooled stager for host bytes the
worker cannot reach, models sent once, and the DataTransfer proxy (OrtDataTransferImpl over gRPC).

Where the two processes share memory a staged buffer is written with one memcpy; elsewhere its bytes travel in
chunks. Tensors under INLINE_LIMIT travel inside the call instead.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import threading
import time
import weakref
from typing import Callable, Sequence

import numpy as np
import onnx

from ephost.errors import EpFailedPrecondition, EpInvalidArgument, EpNotFound
from ephost.external_data import ExternalData, WorkerFile, model_key
from ephost.fdshare import hand_over_file
from ephost.memory import Buffer
from ephost.progress import Progress
from ephost.tensor import Tensor, check_copy_pairs
from ephost.types import MemoryInfo, desc_to_proto
from ephost.client.allocator import RemoteAllocator
from ephost.client.handles import RemoteHandle, owned
from ephost.client.supervisor import WorkerLink
from ephost.v1 import common_pb2, data_transfer_pb2, ep_pb2, worker_pb2

log = logging.getLogger(__name__)

# Tensors smaller than this travel inline; larger ones through the worker's shared memory. Going through
# shared memory costs a call or two more (allocate, free) and saves copying the bytes through gRPC; the two
# costs cross near this size (bench/RESULTS.md, "Why the code chooses ...").
INLINE_LIMIT = 512 << 10
SHM_MODEL_BYTES = 16 << 20  # models at least this large go to the worker in a buffer (shared memory or chunks)
BLOB_CHUNK = 4 << 20  # external data goes to a worker's blob cache in chunks of this size


class Stager:
    """Buffers of the worker's through which host memory it cannot reach gets to it (and back). Buffers are kept
    between calls, by size, so that a steady stream of runs allocates nothing; at most IDLE_BYTES stay idle."""

    IDLE_BYTES = 256 << 20

    def __init__(self, link: WorkerLink, memory: MemoryInfo | None,
                 create_allocator: Callable[[MemoryInfo, dict], RemoteAllocator]):
        self._link, self._memory, self._create = link, memory, create_allocator
        self._allocator: RemoteAllocator | None = None
        self._idle: dict[int, list[Buffer]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()  # guards _allocator, _idle and _idle_bytes

    @property
    def available(self) -> bool:
        return self._memory is not None

    def _allocator_now(self) -> RemoteAllocator:
        with self._lock:
            if self._allocator is None:
                self._allocator = self._create(self._memory, {})
            return self._allocator

    def acquire(self, nbytes: int) -> Buffer | None:
        """A buffer of `nbytes` (kept from an earlier call where one fits), or None where the bytes should travel
        inline (small, or no memory to stage in)."""
        if self._memory is None or nbytes < INLINE_LIMIT:
            return None
        with self._lock:
            kept = self._idle.pop(nbytes, ())
            self._idle_bytes -= nbytes * len(kept)
            idle = [b for b in kept if owned(b, self._link)]  # those of a dead worker are gone with it
            if idle:
                buffer = idle.pop()
                if idle:
                    self._idle[nbytes] = idle
                    self._idle_bytes += nbytes * len(idle)
                return buffer
        return self._allocator_now().alloc(nbytes)

    def release(self, buffers: Sequence[Buffer], *, later: bool = False) -> None:
        """Give buffers back: kept for the next call while the idle total allows, freed otherwise (`later`: by
        the free queue, for a finalizer, which must not wait on a call)."""
        extra = []
        with self._lock:
            for buffer in buffers:
                if self._idle_bytes + buffer.nbytes <= self.IDLE_BYTES:
                    self._idle.setdefault(buffer.nbytes, []).append(buffer)
                    self._idle_bytes += buffer.nbytes
                else:
                    extra.append(buffer)
        if extra and later:
            for buffer in extra:
                self._allocator_now().free_later(buffer)
        elif extra:
            self._allocator_now().free_many(extra)

    def write(self, buffer: Buffer, data) -> None:
        self._allocator_now().write(buffer, data)

    def read(self, buffer: Buffer, out: np.ndarray) -> None:
        self._allocator_now().read(buffer, out)

    def stage_bytes(self, data: bytes) -> Buffer:
        """A buffer holding `data`, however large (models): not from the pool, and freed with `discard`."""
        buffer = self._allocator_now().reserve(len(data))
        self.write(buffer, np.frombuffer(data, np.uint8))
        return buffer

    def discard(self, buffer: Buffer) -> None:
        self._allocator_now().free(buffer)

    def close(self) -> None:
        with self._lock:
            idle = [b for buffers in self._idle.values() for b in buffers]
            self._idle.clear()
            self._idle_bytes = 0
        if idle and self._allocator is not None:
            self._allocator.free_many(idle)


class ThreadStaging:
    """Buffers of a Stager that one repeated call keeps per calling thread (kept calls, ephost/fastlane.py): its
    large inputs are written into the same buffers every run, so that the worker names them by the handles it
    kept and the frame carries none of their bytes. Kept by the inputs' types and ranks: a loop whose shapes
    change writes into the same buffers while they are large enough, and into ones twice as large where an input
    outgrew its own. A thread's buffers go back to the stager when the thread ends, when the worker they were in
    is gone, past MAX kinds in one thread, and on release()."""

    MAX = 8

    def __init__(self, link: WorkerLink, stager: Stager):
        self._link, self._stager = link, stager
        self._threads: "weakref.WeakKeyDictionary[threading.Thread, dict]" = weakref.WeakKeyDictionary()
        self._local = threading.local()  # the calling thread's entry of _threads, found without hashing it
        self._lock = threading.Lock()  # guards _threads

    def buffers(self, kinds: tuple, sizes: Sequence[int]) -> tuple[Buffer, ...]:
        """This thread's buffers for large inputs of these types and ranks (`kinds`), of at least these sizes."""
        mine = getattr(self._local, "mine", None)
        if mine is None:
            mine = self._local.mine = {}
            thread = threading.current_thread()
            with self._lock:
                self._threads[thread] = mine
            weakref.finalize(thread, self._give_back, mine, True)
        buffers = mine.get(kinds)
        if buffers is not None and all(owned(b, self._link) and b.nbytes >= n for b, n in zip(buffers, sizes)):
            return buffers
        outgrown = mine.pop(kinds, ())
        stale = [outgrown]
        while len(mine) >= self.MAX:  # only this thread uses these: none is in a call now
            stale.append(mine.pop(next(iter(mine))))
        if outgrown and all(owned(b, self._link) for b in outgrown):  # room to grow: not a new buffer every step
            sizes = [n if b.nbytes >= n else max(n, 2 * b.nbytes) for b, n in zip(outgrown, sizes)]
        mine[kinds] = buffers = tuple(self._stager.acquire(n) for n in sizes)
        self._stager.release([b for old in stale for b in old])
        return buffers

    def holds(self, kinds: tuple, buffers: tuple[Buffer, ...]) -> bool:
        """Whether `buffers` are still this thread's for large inputs of these kinds (buffers() gave them)."""
        mine = getattr(self._local, "mine", None)
        return mine is not None and mine.get(kinds) is buffers

    def _give_back(self, mine: dict, later: bool = False) -> None:
        buffers = [b for kept in mine.values() for b in kept]
        mine.clear()
        if buffers:
            self._stager.release(buffers, later=later)

    def release(self) -> None:
        """Give every thread's buffers back (the call they were kept for is gone)."""
        with self._lock:
            threads = list(self._threads.values())
            self._threads.clear()
            self._local = threading.local()  # a thread that calls again registers anew
        for mine in threads:
            self._give_back(mine)


def tensor_ref(tensor: Tensor, role: str, link: WorkerLink, stager: Stager, staged: list[Buffer],
               copy_back: list[tuple[Buffer, Tensor]] | None = None,
               out: common_pb2.TensorRef | None = None) -> common_pb2.TensorRef:
    """How to name `tensor` in one call to the worker of `link`: by handle where that worker has it, else staged
    through a buffer of its (noted in `staged`, to give back after the call), else inline. `role` is "source"
    (the worker reads it) or "destination" (the worker writes it: staged destinations are noted in `copy_back`,
    inline ones come back in the reply). Written into `out` where given (a field of the request being built)."""
    ref = common_pb2.TensorRef() if out is None else out
    desc_to_proto(tensor.shape, tensor.dtype, ref.desc)
    if owned(tensor.buffer, link):
        ref.buffer = tensor.buffer.handle
        return ref
    data = tensor.local_bytes()
    if data is None:
        raise EpNotFound(f"a {role} lives in {tensor.memory_info.name} memory, which neither this process nor the "
                         "worker can read (its worker may have restarted)")
    buffer = stager.acquire(tensor.nbytes)
    if buffer is not None:
        staged.append(buffer)
        if role == "source":
            stager.write(buffer, data)  # straight into the worker's memory where mapped, else in chunks
        else:
            copy_back.append((buffer, tensor))
        ref.buffer = buffer.handle
    elif role == "source":
        ref.inline = data.tobytes()
    else:
        ref.reply.SetInParent()
    return ref


class ModelSender:
    """Each model travels to a worker once: by hash after that, inline when small, staged when large (so that no
    message limit applies). A restarted worker gets it again.

    A model's external data files go as descriptors where the worker shares this host (each file once per
    worker generation: a restarted worker gets the same descriptors again, nothing is read here); to a worker
    that does not, their bytes are put inside the model (a copy, for models under protobuf's 2 GiB)."""

    def __init__(self, link: WorkerLink, stager: Stager):
        self._link, self._stager = link, stager
        self._lock = threading.Lock()  # guards _hashes, _files and _sent_to
        self._hashes: dict[int, tuple[onnx.ModelProto, str]] = {}
        self._inlined_models: dict[int, tuple[onnx.ModelProto, onnx.ModelProto]] = {}  # for workers off this host
        self._sent: set[str] = set()
        self._files: dict[tuple, int] = {}  # ExternalFile.version -> the worker's handle, this generation
        self._blobs: set[str] = set()  # digests the worker's blob cache has, this generation
        self._sent_to = None  # the connection (generation) `_sent` and `_files` are about

    def _digest(self, model: onnx.ModelProto) -> tuple[str, bytes | None]:
        with self._lock:
            cached = self._hashes.get(id(model))
        if cached is not None and cached[0] is model:
            return cached[1], None
        data = model.SerializeToString()
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            self._hashes[id(model)] = (model, digest)
            while len(self._hashes) > 8:
                self._hashes.pop(next(iter(self._hashes)))
        return digest, data

    def _handles(self, external: ExternalData, conn) -> dict[str, int]:
        """The worker's handle of each file, by name: handed over (as a descriptor) the first time this worker
        sees the file, whichever session opened it (the same file, unchanged: ExternalFile.version). The next
        session on a model then names the same files, and the worker knows the model by its hash."""
        out = {}
        for name, f in external.files.items():
            with self._lock:
                handle = self._files.get(f.version)
            if handle is None:
                reply = self._link.call(lambda c: c.worker.ImportFile, common_pb2.Empty(), conn=conn)
                hand_over_file(conn.fd_socket, reply.ticket, f.fd)
                handle = reply.file
                with self._lock:
                    if self._sent_to is conn:
                        self._files[f.version] = handle
            out[name] = handle
        return out

    @contextlib.contextmanager
    def ref(self, model: onnx.ModelProto, external: ExternalData | None = None):
        """How to name `model` in one call: `with sender.ref(model, external) as ref: ...`."""
        conn = self._link.current
        with self._lock:
            if self._sent_to is not conn:
                self._sent, self._files, self._blobs, self._sent_to = set(), {}, set(), conn
        source, handles = self._where(external, conn)
        if source == "inline":
            log.info("the worker keeps no blob cache: the model's external data travels inside it")
            model, external = self._inlined(model, external), None
        digest, data = self._digest(model)
        key = model_key(digest, {name: (h, external.files[name].size) for name, h in handles.items()})
        with self._lock:
            sent = key in self._sent
        if sent:
            yield ep_pb2.ModelRef(sha256=key)
            return
        if data is None:
            data = model.SerializeToString()
        files = [ep_pb2.ExternalFile(name=name, nbytes=external.files[name].size, **{source: handle})
                 for name, handle in handles.items()]
        staged = self._stager.stage_bytes(data) if len(data) >= SHM_MODEL_BYTES and self._stager.available else None
        try:
            if staged is None:
                yield ep_pb2.ModelRef(model=data, files=files)
            else:
                yield ep_pb2.ModelRef(buffer=ep_pb2.BufferBlob(buffer=staged.handle, nbytes=len(data)), files=files)
            with self._lock:
                if self._sent_to is conn:
                    self._sent.add(key)
        finally:
            if staged is not None:
                self._stager.discard(staged)

    def _where(self, external: ExternalData | None, conn) -> tuple[str, dict]:
        """How the worker gets the external data files: ExternalFile's source field, and each file's value of it
        by name ("inline": their bytes go inside the model)."""
        if not external:
            return "", {}
        on_worker = [f for f in external.files.values() if isinstance(f, WorkerFile)]
        if on_worker:
            elsewhere = [f for f in external.files.values()
                         if not isinstance(f, WorkerFile) or f.worker != self._link.name]
            if elsewhere:
                raise EpFailedPrecondition(f"external data {elsewhere[0].label} cannot reach the worker for "
                                           f"{self._link.name!r}: the nodes that read it must run where it lives")
            return "model_dir_path", {f.name: f.path for f in on_worker}
        if conn is not None and not conn.shares_memory:
            blobs = self._uploaded(external, conn)
            return ("sha256", blobs) if blobs is not None else ("inline", {})
        return "file", self._handles(external, conn)

    def _uploaded(self, external: ExternalData, conn) -> dict[str, str] | None:
        """Each file's digest, by name, once the worker's blob cache has it: only what it lacks is sent, in
        chunks, from where an interrupted upload stopped. None where the worker keeps no cache."""
        out = {}
        for name, f in external.files.items():
            digest = f.sha256()
            with self._lock:
                known = self._sent_to is conn and digest in self._blobs
            if known:
                out[name] = digest
                continue
            try:
                status = self._link.call(lambda c: c.worker.GetBlob, worker_pb2.BlobRef(sha256=digest), conn=conn)
            except EpFailedPrecondition:
                return None
            offset = status.nbytes
            progress = Progress(f"sending {f.label} to the worker for {self._link.name!r}",
                                f.size - offset) if not status.complete else None
            while not status.complete:
                data = os.pread(f.fd, min(BLOB_CHUNK, f.size - offset), offset)
                if not data and offset < f.size:
                    raise EpInvalidArgument(f"external data {f.label!r} became shorter while it was sent")
                try:
                    status = self._link.call(lambda c: c.worker.PutBlob, worker_pb2.BlobChunk(
                        sha256=digest, nbytes=f.size, offset=offset, data=data), conn=conn)
                except EpFailedPrecondition:  # another client is sending the same bytes: wait for it, or take over
                    time.sleep(0.05)
                    status = self._link.call(lambda c: c.worker.GetBlob, worker_pb2.BlobRef(sha256=digest), conn=conn)
                progress.advance(status.nbytes - offset)
                offset = status.nbytes
            if progress is not None:
                progress.finish()
            with self._lock:
                if self._sent_to is conn:
                    self._blobs.add(digest)
            out[name] = digest
        return out

    def _inlined(self, model: onnx.ModelProto, external: ExternalData) -> onnx.ModelProto:
        with self._lock:
            cached = self._inlined_models.get(id(model))
        if cached is not None and cached[0] is model:
            return cached[1]
        inlined = external.inlined(model)
        with self._lock:
            self._inlined_models[id(model)] = (model, inlined)
            while len(self._inlined_models) > 2:  # copies with all their weights: keep few
                self._inlined_models.pop(next(iter(self._inlined_models)))
        return inlined


class RemoteDataTransfer(RemoteHandle):
    def __init__(self, link: WorkerLink, stager: Stager):
        super().__init__(link)
        self._stager = stager
        self._can_copy: dict[tuple[MemoryInfo, MemoryInfo], bool] = {}

    def _make(self) -> int:
        return self.link.call(lambda c: c.factory.CreateDataTransfer, common_pb2.Empty()).data_transfer

    def can_copy(self, src: MemoryInfo, dst: MemoryInfo) -> bool:
        key = (src, dst)
        if key not in self._can_copy:
            self._can_copy[key] = self.call(
                lambda c: c.data_transfer.CanCopy,
                lambda h: data_transfer_pb2.CanCopyRequest(data_transfer=h, src=src.to_proto(), dst=dst.to_proto()),
            ).can_copy
        return self._can_copy[key]

    def copy_tensors(self, src: Sequence[Tensor], dst: Sequence[Tensor], stream=None) -> None:
        check_copy_pairs(src, dst)
        remote: list[int] = []
        for i, (s, d) in enumerate(zip(src, dst)):
            # Without a stream, memory both processes map is copied right here: one memcpy, no call.
            s_bytes = d_bytes = None
            if stream is None:
                s_bytes, d_bytes = s.local_bytes(), d.local_bytes()
            if s_bytes is not None and d_bytes is not None:
                np.copyto(d_bytes, s_bytes)
            else:
                remote.append(i)
        if not remote:
            return
        # First: it waits for a worker being replaced. Which tensors the call names by handle is the worker's that
        # then runs to say (decided before, a tensor of the dead worker went by its handle to the successor, where
        # that number may name another buffer).
        conn = self.link.conn
        if all(owned(src[i].buffer, self.link) and owned(dst[i].buffer, self.link) for i in remote):
            self._copy_kept(conn, [src[i] for i in remote], [dst[i] for i in remote], stream)
            return
        staged: list[Buffer] = []
        copy_back: list[tuple[Buffer, Tensor]] = []
        try:
            src_refs = [tensor_ref(src[i], "source", self.link, self._stager, staged) for i in remote]
            dst_refs = [tensor_ref(dst[i], "destination", self.link, self._stager, staged, copy_back) for i in remote]
            request = data_transfer_pb2.CopyTensorsRequest(data_transfer=self.handle, src=src_refs, dst=dst_refs,
                                                           stream=stream.handle if stream is not None else 0)
            reply = self.link.call(lambda c: c.data_transfer.CopyTensors, request, conn=conn)
            if staged and stream is not None:
                # Like a copy from pageable memory on a device stream: host memory the worker cannot map
                # goes through a staging buffer, which must outlive the queued copy.
                stream.flush()
            for buffer, tensor in copy_back:
                self._stager.read(buffer, tensor.local_bytes())
        finally:
            self._stager.release(staged)
        replies = iter(reply.replies)
        for ref, i in zip(dst_refs, remote):
            if ref.WhichOneof("location") == "reply":
                np.copyto(dst[i].local_bytes(), np.frombuffer(next(replies), np.uint8))

    def _copy_kept(self, conn, src: Sequence[Tensor], dst: Sequence[Tensor], stream) -> None:
        """Copies between buffers of the worker's (that of `conn`), repeated as a kept call where the fast lane
        keeps it: a repeat (same stream, same types and shapes) sends the buffers' handles, and nothing comes
        back."""
        transfer, on = self.handle, stream.handle if stream is not None else 0
        handles = [t.buffer.handle for t in (*src, *dst)]
        key = (transfer, on, tuple((t.shape, t.dtype) for t in (*src, *dst)))

        def request_of() -> data_transfer_pb2.CopyTensorsRequest:
            request = data_transfer_pb2.CopyTensorsRequest(data_transfer=transfer, stream=on)
            for refs, tensors in ((request.src, src), (request.dst, dst)):
                for tensor in tensors:
                    ref = refs.add()
                    desc_to_proto(tensor.shape, tensor.dtype, ref.desc)
                    ref.buffer = tensor.buffer.handle
            return request

        self.link.run(lambda c: c.call_kept(c.data_transfer.CopyTensors, key, [struct.pack(f"<{len(handles)}Q",
                                            *handles)], 8 * len(handles), request_of), conn=conn)
