"""ephost.Environment, shaped like ONNX Runtime's OrtEnv: it registers EPs (launching, connecting to or
hosting them), lists their devices, keeps shared allocators and copies tensors between memories."""
from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ephost.eps import load_factory
from ephost.errors import EpAlreadyExists, EpError, EpFailedPrecondition, EpInvalidArgument, EpNotFound
from ephost.tensor import Tensor, check_copy_pairs
from ephost.types import HOST_MEMORY, DeviceMemoryType, MemoryInfo
from ephost.graph import load_schemas
from ephost.client.connection import Credentials
from ephost.client.devices import EpDevice, SharedAllocator, SyncStream
from ephost.client import metrics
from ephost.client.launcher import WorkerProcess
from ephost.client.remote import RemoteEpFactory
from ephost.client.supervisor import SupervisionPolicy, WorkerLink
from ephost.client.targets import parse_target
from ephost.client.worker_stats import WorkerStats
from ephost.v1 import common_pb2

log = logging.getLogger(__name__)

@dataclass(eq=False)
class Registration:
    name: str
    target: str
    factory: object
    link: WorkerLink | None = None  # None for an EP hosted in this process
    data_transfer: object = None
    devices: list[EpDevice] = field(default_factory=list)
    # qualified MemoryInfo (what users see) -> the EP's own MemoryInfo
    memory: dict[MemoryInfo, MemoryInfo] = field(default_factory=dict)
    _allocators: dict = field(default_factory=dict)  # the EP's MemoryInfo -> allocator sessions use
    _lock: threading.Lock = field(default_factory=threading.Lock)  # guards _allocators

    def session_memory(self) -> MemoryInfo | None:
        """The memory sessions leave outputs in (qualified, as users see it): the EP's HOST_ACCESSIBLE memory,
        which the application maps, or its DEFAULT memory where there is none."""
        first = None
        for info in self.memory:
            if info.host_accessible:
                return info
            first = first or info
        return first

    def session_allocator(self):
        """The allocator (made on first use) of `session_memory()`, in the EP's own terms."""
        info = self.session_memory()
        return self.allocator_for(info) if info is not None else None

    def allocator_for(self, memory_info: MemoryInfo):
        """The EP's allocator (made on first use, kept with the registration) of one of its memories."""
        raw = self.memory[memory_info]
        allocator = self._allocators.get(raw)  # (made once: read without the lock after that)
        if allocator is not None:
            return allocator
        with self._lock:
            allocator = self._allocators.get(raw)
            if allocator is None:
                allocator = self._allocators[raw] = self.factory.create_allocator(raw, {})
            return allocator

    def qualified(self, raw: MemoryInfo) -> MemoryInfo:
        """The MemoryInfo users see for a memory in the EP's own terms (what its tensors are labelled with)."""
        for info, own in self.memory.items():
            if own == raw:
                return info
        return raw

    @property
    def process(self) -> WorkerProcess | None:
        return self.link.process if self.link is not None else None

    def close(self) -> None:
        self.factory.close()


class Environment:
    def __init__(self):
        self._registrations: dict[str, Registration] = {}
        self._allocators: dict[MemoryInfo, SharedAllocator] = {}
        self._lock = threading.RLock()  # guards _registrations, _allocators and _closed
        self._closed = False
        self._pid = os.getpid()  # a forked child's copy is inert: the workers are the parent's
        metrics.track(self)
        # One the application never closes is closed as it exits, while its threads still run: in the
        # interpreter's teardown (__del__), stopping a worker would wait forever for a watcher thread frozen there.
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        # While workers start (this thread waits on them), so that the first session's shape inference does not.
        threading.Thread(target=load_schemas, name="ephost-onnx-schemas", daemon=True).start()

    # --- registration (ORT: RegisterExecutionProviderLibrary) ------------------------------------

    def register_execution_provider_library(self, name: str, target: str,
                                            options: Mapping[str, str] | None = None) -> None:
        """Register an EP under `name`. `target` is an EP name (launch a local worker for it), an address
        (`unix:///path.sock`, `host:port`, `grpc://host:port`: connect to a running worker), a path to an ONNX
        Runtime plugin EP library, or `inproc:NAME` (host the EP in this process).

        Options go to the EP, except the supervision options (SupervisionPolicy.OPTIONS: restart,
        crash_limit, crash_window_s, memory_limit_mb, timeout_s, connect_timeout_s, recovery_timeout_s)."""
        options = {str(k): str(v) for k, v in (options or {}).items()}
        with self._lock:
            self._check_open()
            if name in self._registrations:
                raise EpAlreadyExists(f"an EP library is already registered as {name!r}")
            spec = parse_target(target)
            link = None
            if spec.kind == "inproc":
                factory = load_factory(spec.ep, options)
            else:
                policy = SupervisionPolicy.take(options)
                if spec.kind == "launch":
                    # (a plugin EP library registered in the worker's ORT under this name, as in process)
                    ep_options = {"library_name": name, **options, "library": spec.library} if spec.library \
                        else options
                    link = WorkerLink(name, ep=spec.ep, ep_options=ep_options, policy=policy)
                else:
                    credentials = Credentials.take(options, spec.tls)
                    if options:
                        raise EpInvalidArgument(f"unknown option(s) {sorted(options)} for a running worker; it takes "
                                                f"{sorted({**SupervisionPolicy.OPTIONS, **Credentials.OPTIONS})}")
                    link = WorkerLink(name, address=spec.address, policy=policy, credentials=credentials)
                try:
                    factory = RemoteEpFactory(link)
                except BaseException:
                    link.close()
                    raise
            registration = Registration(name, target, factory, link)
            try:
                registration.data_transfer = factory.create_data_transfer()
                for info in factory.get_supported_devices():
                    device = EpDevice(registration, info)
                    registration.devices.append(device)
                    for raw in info.memory_infos:
                        registration.memory[device.memory_info(raw.device_mem_type)] = raw
            except BaseException:
                registration.close()
                raise
            self._registrations[name] = registration
            log.info("registered %r (%s) with %d device(s)", name, target, len(registration.devices))

    def unregister_execution_provider_library(self, name: str) -> None:
        with self._lock:
            registration = self._registrations.pop(name, None)
            if registration is None:
                raise EpNotFound(f"no EP library registered as {name!r}")
            for info in [i for i, a in self._allocators.items() if a.registration is registration]:
                self._release(info)
        registration.close()

    def get_ep_devices(self) -> list[EpDevice]:
        with self._lock:
            return [d for r in self._registrations.values() for d in r.devices]

    # --- shared allocators ------------------------------------------------------------------------

    def create_shared_allocator(self, ep_device: EpDevice, mem_type: DeviceMemoryType = DeviceMemoryType.DEFAULT,
                                options: Mapping[str, str] | None = None) -> SharedAllocator:
        """Create (or replace, as ORT does) the shared allocator for one memory of a device."""
        registration = self.registration_of(ep_device)
        info = ep_device.memory_info(mem_type)
        if info is None:
            raise EpNotFound(f"{ep_device.ep_name} device has no {DeviceMemoryType(mem_type).name} memory")
        with self._lock:
            if info in self._allocators:
                self._release(info)
            inner = registration.factory.create_allocator(registration.memory[info], dict(options or {}))
            allocator = SharedAllocator(registration, inner, info)
            self._allocators[info] = allocator
            return allocator

    def get_shared_allocator(self, memory_info: MemoryInfo) -> SharedAllocator | None:
        with self._lock:
            return self._allocators.get(memory_info)

    def release_shared_allocator(self, ep_device: EpDevice,
                                 mem_type: DeviceMemoryType = DeviceMemoryType.DEFAULT) -> None:
        info = ep_device.memory_info(mem_type)
        with self._lock:
            if info not in self._allocators:
                raise EpNotFound(f"no shared allocator for {info.name if info else DeviceMemoryType(mem_type).name}")
            self._release(info)

    def _release(self, info: MemoryInfo) -> None:
        allocator = self._allocators.pop(info)
        allocator.registration.factory.release_allocator(allocator.inner)

    # --- copies (ORT: CopyTensors) ----------------------------------------------------------------

    def to_host(self, tensor: Tensor) -> Tensor:
        """A copy of `tensor` in this process's own memory."""
        host = Tensor.from_numpy(np.empty(tensor.shape, tensor.dtype))
        self.copy_tensors([tensor], [host])
        return host

    def copy_tensors(self, src: Sequence[Tensor], dst: Sequence[Tensor], stream: SyncStream | None = None) -> None:
        """Copy src[i] into dst[i], in one batched call per EP. With a stream the copies are ordered on it:
        they are done once a notification activated after them fires, or the stream is flushed."""
        check_copy_pairs(src, dst)
        batches: dict[Registration | None, tuple[list[Tensor], list[Tensor]]] = {}
        for s, d in zip(src, dst):
            owners = {self._owner(s.memory_info), self._owner(d.memory_info)} - {None}
            if len(owners) > 1:  # device to device across EPs: through the host
                self.copy_tensors([self.to_host(s)], [d])
                continue
            owner = owners.pop() if owners else None
            batch = batches.setdefault(owner, ([], []))
            batch[0].append(s)
            batch[1].append(d)
        for owner, (s_list, d_list) in batches.items():
            if owner is None:
                for s, d in zip(s_list, d_list):
                    np.copyto(d.local_bytes(), s.local_bytes())
                continue
            transfer = owner.data_transfer
            if transfer is None:
                raise EpInvalidArgument(f"EP {owner.name!r} has no data transfer")
            for s, d in zip(s_list, d_list):
                if not transfer.can_copy(owner.memory.get(s.memory_info, HOST_MEMORY),
                                         owner.memory.get(d.memory_info, HOST_MEMORY)):
                    raise EpInvalidArgument(
                        f"EP {owner.name!r} cannot copy {s.memory_info.name} to {d.memory_info.name}")
            inner_stream = None
            if stream is not None:
                if stream.registration is not owner:
                    raise EpInvalidArgument(f"stream belongs to {stream.registration.name!r}, not to {owner.name!r}")
                inner_stream = stream.inner
            transfer.copy_tensors(s_list, d_list, inner_stream)

    def owner_of(self, memory_info: MemoryInfo) -> Registration | None:
        """The registration whose EP owns a memory (None for the application's own memory)."""
        return self._owner(memory_info)

    def allocator_for(self, memory_info: MemoryInfo) -> SharedAllocator:
        """An allocator of a memory of a registered EP: the shared allocator where one was created, else one
        kept with the registration (tensors made from it are labelled with `memory_info`)."""
        shared = self.get_shared_allocator(memory_info)
        if shared is not None:
            return shared
        registration = self._owner(memory_info)
        if registration is None:
            raise EpInvalidArgument("the application's own memory has no allocator; use numpy arrays")
        return SharedAllocator(registration, registration.allocator_for(memory_info), memory_info)

    def _owner(self, info: MemoryInfo) -> Registration | None:
        if info == HOST_MEMORY:
            return None
        with self._lock:
            for registration in self._registrations.values():
                if info in registration.memory:
                    return registration
        raise EpNotFound(f"memory {info.name!r} belongs to no registered EP (was it unregistered?)")

    # --- what sessions, the CLI and tools see of registrations -------------------------------------

    def registration(self, name: str) -> Registration:
        """The registration of an EP library by its name."""
        with self._lock:
            registration = self._registrations.get(name)
        if registration is None:
            raise EpNotFound(f"no EP library registered as {name!r}")
        return registration

    def registrations(self) -> list[Registration]:
        with self._lock:
            return list(self._registrations.values())

    def is_registered(self, name: str) -> bool:
        with self._lock:
            return name in self._registrations

    def registration_of(self, ep_device: EpDevice) -> Registration:
        """The registration a device belongs to, while it is registered."""
        registration = ep_device.registration
        with self._lock:
            if self._registrations.get(registration.name) is not registration:
                raise EpNotFound(f"device's EP library {registration.name!r} is no longer registered")
        return registration

    def get_worker_stats(self, name: str) -> WorkerStats:
        """A worker's counters (WorkerStats): calls per method, resident vs transferred Compute inputs, bytes each
        way, live buffers, clients."""
        registration = self.registration(name)
        if registration.link is None:
            raise EpInvalidArgument(f"{name!r} is hosted in this process; it has no worker")
        return WorkerStats.from_proto(registration.link.call(lambda c: c.worker.GetStats, common_pb2.Empty()))

    def _check_open(self) -> None:
        if self._closed:
            raise EpFailedPrecondition("the environment is closed")

    # --- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            names = list(self._registrations)
        atexit.unregister(self._at_exit)
        if self._pid != os.getpid():
            # A forked child's copy: the workers, and the channels to them, are the parent's, which runs on
            # with them. Closing it stops nothing; this copy is only no longer usable.
            log.debug("closing a forked child's copy of the environment: its workers are left to the parent")
            return
        for name in reversed(names):
            try:
                self.unregister_execution_provider_library(name)
            except EpError as e:
                log.warning("closing %r: %s", name, e)

    def __enter__(self) -> "Environment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True) and self._pid == os.getpid():
            self.close()


def _close_at_exit(ref: "weakref.ref[Environment]") -> None:
    env = ref()
    if env is not None and env._pid == os.getpid():  # a forked child inherits the hook too
        env.close()
