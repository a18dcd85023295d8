"""Memory, copies and streams for EPs whose device memory is this process's own memory (CPU EPs, and vendor
EPs that run on the CPU): HOST_ACCESSIBLE arenas of shared memory the application maps, DEFAULT arenas of
private memory, a data transfer that copies bytes, and queue streams."""
from __future__ import annotations

import functools
import os
from typing import Any, Mapping, Sequence

from ephost.eps.arena import ArenaAllocator
from ephost.eps.streams import QueueStream
from ephost.eps.transfer import HostDataTransfer
from ephost.errors import EpInvalidArgument, EpNotFound
from ephost.memory import Region
from ephost.tensor import Tensor
from ephost.types import AllocatorType, DeviceMemoryType, EpDeviceInfo, HardwareDevice, HardwareDeviceType, MemoryInfo


_CPU_VENDORS = {"GenuineIntel": ("Intel", 0x8086), "AuthenticAMD": ("AMD", 0x1022)}


@functools.cache
def cpu_device() -> HardwareDevice:
    vendor, vendor_id = "unknown", 0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    vendor, vendor_id = _CPU_VENDORS.get(line.split(":", 1)[1].strip(), (vendor, 0))
                    break
    except OSError:
        pass
    return HardwareDevice(HardwareDeviceType.CPU, vendor_id, vendor, 0, {"cores": str(os.cpu_count() or 1)})


def local_inputs(partition: str, names: Sequence[str], inputs: Sequence[Any]) -> dict[str, Any]:
    """A compiled partition's inputs by name, tensors as arrays over their memory in this process (no copy)."""
    if len(inputs) != len(names):
        raise EpInvalidArgument(f"{partition} takes {len(names)} inputs, got {len(inputs)}")
    feeds = {}
    for name, value in zip(names, inputs):
        if isinstance(value, Tensor):
            array = value.local_array()
            if array is None:
                raise EpInvalidArgument(f"input {name!r} of {partition} is in memory this EP cannot read")
            value = array
        feeds[name] = value
    return feeds


class HostMemoryFactory:
    """Mixin for an EP factory: call `_init_memory` in __init__, set `device_count`."""

    device_count = 1

    def _init_memory(self, name: str, vendor_id: int) -> None:
        self._memory = {
            t: MemoryInfo(memory_name, HardwareDeviceType.CPU, vendor_id, 0, t, 64, AllocatorType.ARENA)
            for t, memory_name in ((DeviceMemoryType.DEFAULT, name),
                                   (DeviceMemoryType.HOST_ACCESSIBLE, f"{name}_host_accessible"))
        }

    @property
    def memory_infos(self) -> tuple[MemoryInfo, ...]:
        return tuple(self._memory.values())

    def _check_devices(self, indices: Sequence[int]) -> None:
        bad = [i for i in indices if not 0 <= i < self.device_count]
        if bad:
            raise EpNotFound(f"{self.get_name()} has {self.device_count} device(s); no device {bad[0]}")

    def create_allocator(self, memory_info: MemoryInfo, options: Mapping[str, str]) -> ArenaAllocator:
        if memory_info not in self._memory.values():
            raise EpNotFound(f"{self.get_name()} has no memory {memory_info.name!r}")
        shared = memory_info.device_mem_type == DeviceMemoryType.HOST_ACCESSIBLE
        return ArenaAllocator(memory_info, Region.create_shared if shared else Region.create_private, options)

    def release_allocator(self, allocator: ArenaAllocator) -> None:
        allocator.close()

    def create_data_transfer(self) -> HostDataTransfer:
        return HostDataTransfer(self._memory.values())

    def is_stream_aware(self) -> bool:
        return True

    def create_sync_stream_for_device(self, device_index: int, options: Mapping[str, str]) -> QueueStream:
        self._check_devices([device_index])
        return QueueStream(f"{self.get_name()} stream")


class EphostCpuFactory(HostMemoryFactory):
    """A factory of one of ephost's own EPs on this machine's CPU (vendor "ephost", one device, host memory).
    Subclasses set `name` and `version`, call `_init_device` in __init__ and make their EP in `create_ep`."""

    name: str
    version: str

    def _init_device(self, metadata: Mapping[str, str], options: Mapping[str, str]) -> None:
        device = cpu_device()
        self._init_memory(self.name, device.vendor_id)
        self._device = EpDeviceInfo(0, self.name, "ephost", device, self.memory_infos,
                                    {"version": self.version, **metadata}, dict(options))

    def get_name(self) -> str:
        return self.name

    def get_vendor(self) -> str:
        return "ephost"

    def get_vendor_id(self) -> int:
        return 0

    def get_version(self) -> str:
        return self.version

    def get_supported_devices(self) -> list[EpDeviceInfo]:
        return [self._device]

    def release_ep(self, ep) -> None:
        pass

    def close(self) -> None:
        pass
