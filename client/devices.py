"""What the Environment hands to users: EpDevice, shared allocators and sync streams (ORT's OrtEpDevice,
OrtAllocator and OrtSyncStream), each tied to the registration that made it."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Mapping

from ephost.memory import Buffer
from ephost.types import DeviceMemoryType, EpDeviceInfo, HardwareDevice, MemoryInfo

if TYPE_CHECKING:
    from ephost.client.environment import Registration


def qualified(registration: str, info: MemoryInfo) -> MemoryInfo:
    """Memory infos name the registration, so two workers of one EP never share a memory name."""
    return replace(info, name=f"{registration}:{info.name}")


class EpDevice:
    def __init__(self, registration: "Registration", info: EpDeviceInfo):
        self.registration = registration
        self._info = info
        self._memory = {m.device_mem_type: qualified(registration.name, m) for m in info.memory_infos}

    ep_name = property(lambda self: self._info.ep_name)
    ep_vendor = property(lambda self: self._info.ep_vendor)
    ep_metadata = property(lambda self: dict(self._info.ep_metadata))
    ep_options = property(lambda self: dict(self._info.ep_options))
    device: HardwareDevice = property(lambda self: self._info.device)
    index = property(lambda self: self._info.index)
    registration_name = property(lambda self: self.registration.name)  # the name it was registered under

    def memory_info(self, mem_type: DeviceMemoryType) -> MemoryInfo | None:
        return self._memory.get(DeviceMemoryType(mem_type))

    def create_sync_stream(self, options: Mapping[str, str] | None = None) -> "SyncStream":
        inner = self.registration.factory.create_sync_stream_for_device(self._info.index, dict(options or {}))
        return SyncStream(self.registration, inner)

    def __repr__(self) -> str:
        return (f"EpDevice(ep_name={self.ep_name!r}, registration={self.registration.name!r}, "
                f"device={self.device.type.name})")


class SharedAllocator:
    """An allocator the Environment keeps, with the data transfer that reaches its memory."""

    def __init__(self, registration: "Registration", inner, memory_info: MemoryInfo):
        self.registration = registration
        self.inner = inner
        self.memory_info = memory_info
        self.data_transfer = registration.data_transfer

    def alloc(self, nbytes: int) -> Buffer:
        return self.inner.alloc(nbytes)

    def reserve(self, nbytes: int) -> Buffer:
        return self.inner.reserve(nbytes)

    def free(self, buffer: Buffer) -> None:
        self.inner.free(buffer)

    def free_later(self, buffer: Buffer) -> None:
        getattr(self.inner, "free_later", self.inner.free)(buffer)

    def flush_frees(self, timeout: float = 5.0) -> bool:
        """Wait until the buffers of tensors already collected are back in the allocator (a worker's allocator
        frees them in batches, off the collecting thread)."""
        flush = getattr(self.inner, "flush_frees", None)
        return flush(timeout) if flush is not None else True

    def get_stats(self) -> dict[str, int]:
        return self.inner.get_stats()

    def __repr__(self) -> str:
        return f"SharedAllocator({self.memory_info.name})"


class SyncNotification:
    def __init__(self, stream: "SyncStream", inner):
        self._stream = stream
        self.inner = inner

    def activate(self) -> None:
        self.inner.activate()

    def wait_on_host(self, timeout: float | None = None) -> None:
        self.inner.wait_on_host(timeout)

    def wait_on_device(self, stream: "SyncStream") -> None:
        if stream.registration is self._stream.registration:
            self.inner.wait_on_device(stream.inner)
        else:
            # Streams of two workers share no device: the host waits, which keeps the order.
            self.inner.wait_on_host()

    def release(self) -> None:
        self.inner.release()


class SyncStream:
    def __init__(self, registration: "Registration", inner):
        self.registration = registration
        self.inner = inner

    def create_notification(self) -> SyncNotification:
        return SyncNotification(self, self.inner.create_notification())

    def flush(self, timeout: float | None = None) -> None:
        self.inner.flush(timeout)

    def on_session_run_end(self) -> None:
        self.inner.on_session_run_end()

    def release(self) -> None:
        self.inner.release()
