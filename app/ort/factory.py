"""The bridged OrtEpFactory: its devices are the worker's, its EP name the ORT registration name."""
from __future__ import annotations

import ctypes
import logging
from ctypes import c_void_p
from typing import TYPE_CHECKING

from ephost import ep_context
from ephost.errors import EpNotFound
from ephost.ort import abi as A
from ephost.ort.callbacks import Guard, Strings, fill, keep, owner_of
from ephost.ort.context import ContextRequest, compatibility, compatibility_info
from ephost.ort.ep import BridgeEp
from ephost.ort.memory import BridgeMemory
from ephost.ort.resident import KeptCopies

if TYPE_CHECKING:
    from ephost.ort.kernel_io import KernelIO
    from ephost.ort.library import Binding
    from ephost.ort.pool import PoolFunctions
    from ephost.ort.resident import Sync

log = logging.getLogger(__name__)

# EP metadata keys ORT sets itself (from GetVersion and the library's path) and refuses from a factory.
RESERVED_METADATA = frozenset({"version", "library_path"})


def provider_options(config_entries: dict[str, str], ep_name: str) -> dict[str, str]:
    """The options the application gave `add_provider_for_devices` for this EP: ORT keeps them in the session's
    config entries as `ep.<ep name>.<key>` (the EP name lowercased), and they go to the worker's EP."""
    prefix = f"ep.{ep_name.lower()}."
    return {k[len(prefix):]: v for k, v in config_entries.items() if k.lower().startswith(prefix)}


class BridgeFactory:
    def __init__(self, binding: "Binding", abi: A.OrtAbi, kernel_io: "KernelIO", pools: "PoolFunctions",
                 sync: "Sync"):
        self.binding, self.abi = binding, abi
        self.kernel_io = kernel_io  # what Compute reads its inputs and makes its outputs with
        self.stats = binding.stats
        self.name = binding.ort_name
        self.registration = binding.registration
        self._output_allocator = None  # the registration's allocator outputs are left in (output_allocator)
        self.guard = Guard(abi, self.name)
        self._strings = Strings()
        self._device_of: dict[int, int] = {}  # OrtHardwareDevice* -> the worker's device index
        # the EP's device memory: the worker's shared memory, where it shares this process's host
        self.memory = BridgeMemory(abi, self.name, self.registration, pools) \
            if BridgeMemory.available(self.registration) else None
        # copies of ORT's tensors kept in that memory between Computes (a decoder's KV cache)
        self.kept = KeptCopies(lambda: self.registration, sync) if self.memory is not None else None
        # (the worker's factory read through the registration every call: none is kept past release)
        text = lambda what, fn: lambda this: self.guard.quiet(what, lambda: self._strings(fn()))  # noqa: E731
        self.struct = A.OrtEpFactory()
        fill(self.struct, A.FACTORY, abi, {
            "GetName": text("GetName", lambda: self.name),
            "GetVendor": text("GetVendor", lambda: self.registration.factory.get_vendor()),
            "GetVersion": text("GetVersion", lambda: self.registration.factory.get_version()),
            "GetVendorId": lambda this: self.guard.quiet("GetVendorId",
                                                         lambda: self.registration.factory.get_vendor_id(), 0),
            "GetSupportedDevices": lambda this, hw, n_hw, out, max_out, n_out: self.guard.status(
                "GetSupportedDevices", lambda: self.get_supported_devices(hw, n_hw, out, max_out, n_out)),
            "CreateEp": lambda this, hw, metadata, n, session_options, logger, ep_out: self.guard.status(
                "CreateEp", lambda: self.create_ep(hw, n, session_options, ep_out)),
            "ReleaseEp": lambda this, ep: self.guard.quiet("ReleaseEp", lambda: self.release_ep(ep)),
            "ValidateCompiledModelCompatibilityInfo": lambda this, hw, n, info, out: self.guard.status(
                "ValidateCompiledModelCompatibilityInfo",
                lambda: self._set_int(out, compatibility((info or b"").decode(errors="replace"), *self.worker_ep()))),
            "CreateAllocator": lambda this, memory_info, options, out: self.guard.status(
                "CreateAllocator", lambda: self._allocator(memory_info, out)),
            "ReleaseAllocator": lambda this, allocator: None,  # one allocator, released with the factory
            "CreateDataTransfer": lambda this, out: self.guard.status("CreateDataTransfer",
                                                                      lambda: self._set_null(out)),
            "IsStreamAware": lambda this: False,
            "CreateSyncStreamForDevice": lambda this, device, options, out: self.guard.status(
                "CreateSyncStreamForDevice", lambda: self._set_null(out)),
        })
        self.address = keep(self, self.struct)

    def _allocator(self, memory_info: int, out) -> None:
        """The allocator of the memory info the EpDevices name (the only one ORT asks for); none without it."""
        mine = self.memory is not None and memory_info == self.memory.info
        out[0] = self.memory.address if mine else None

    @staticmethod
    def _set_null(out) -> None:
        out[0] = None

    @staticmethod
    def _set_int(out, value: int) -> None:
        out[0] = value

    def worker_ep(self) -> tuple[str, str, str]:
        """The worker's EP as a compiled model records it: its name (an EPContext node's `source`), its version,
        and the worker's ONNX Runtime."""
        factory, devices = self.registration.factory, self.registration.devices
        onnxruntime = devices[0].ep_metadata.get("onnxruntime_version", "") if devices else ""
        return factory.get_name(), factory.get_version(), onnxruntime

    def compatibility_info(self) -> str:
        return compatibility_info(*self.worker_ep())

    def output_allocator(self):
        """Where partitions leave their outputs: the worker's memory this process maps, read in place (through the
        registration's allocator of it, the same one for the registration's life: read once)."""
        allocator = self._output_allocator
        if allocator is None:
            registration = self.registration  # (read once: release may set it to None on another thread)
            if registration is None:
                raise EpNotFound(f"{self.name} was unregistered: a session made with it can no longer run")
            allocator = self._output_allocator = registration.session_allocator()
        return allocator

    # --- devices ---

    def get_supported_devices(self, hw_devices, n_hw: int, out, max_out: int, n_out) -> None:
        api, ep_api = self.abi.api, self.abi.ep_api
        available = [hw_devices[i] for i in range(n_hw)]
        made = 0
        for device in self.registration.devices:
            if made >= max_out:
                break
            hw = self._hardware_for(device, available)
            if hw is None:
                log.warning("%s: ONNX Runtime lists no %s device for the worker's %s device", self.name,
                            device.device.type.name, device.ep_name)
                continue
            worker_metadata = {k: v for k, v in device.ep_metadata.items() if k not in RESERVED_METADATA}
            metadata = self._pairs({**worker_metadata, "ephost.target": self.binding.target,
                                    "ephost.worker_ep": device.ep_name})
            options = self._pairs(device.ep_options)
            try:
                ep_device = c_void_p()
                self.abi.check(ep_api.CreateEpDevice(self.address, hw, metadata, options, ctypes.byref(ep_device)),
                               "CreateEpDevice")
            finally:
                api.ReleaseKeyValuePairs(metadata)
                api.ReleaseKeyValuePairs(options)
            if self.memory is not None:
                self.abi.check(ep_api.EpDevice_AddAllocatorInfo(ep_device.value, self.memory.info),
                               "EpDevice_AddAllocatorInfo")
            out[made] = ep_device.value
            self._device_of[hw] = device.index
            made += 1
        n_out[0] = made

    def _hardware_for(self, device, available: list[int]) -> int | None:
        api = self.abi.api
        same_type = [hw for hw in available if api.HardwareDevice_Type(hw) == int(device.device.type)]
        exact = [hw for hw in same_type if api.HardwareDevice_VendorId(hw) == device.device.vendor_id and
                 api.HardwareDevice_DeviceId(hw) == device.device.device_id]
        return (exact or same_type or [None])[0]

    def _pairs(self, items: dict[str, str]) -> int:
        kvps = c_void_p()
        self.abi.api.CreateKeyValuePairs(ctypes.byref(kvps))
        for key, value in items.items():
            self.abi.api.AddKeyValuePair(kvps, str(key).encode(), str(value).encode())
        return kvps.value

    # --- EPs ---

    def create_ep(self, hw_devices, n: int, session_options: int, ep_out) -> None:
        indices = []
        for i in range(n):
            if hw_devices[i] not in self._device_of:
                raise EpNotFound(f"{self.name} was given a device it did not offer")
            indices.append(self._device_of[hw_devices[i]])
        entries = self._config_entries(session_options)
        options = provider_options(entries, self.name)
        context = ContextRequest.of(entries)
        if context.enabled:  # the worker's EP keeps each partition's compiled form, for Compile's EPContext nodes
            options[ep_context.ENABLE] = "1"
        remote = self.registration.factory.create_ep(indices, options)
        ep_out[0] = BridgeEp(self, remote, context).address

    def _config_entries(self, session_options: int) -> dict[str, str]:
        api = self.abi.api
        kvps = c_void_p()
        self.abi.check(api.GetSessionOptionsConfigEntries(session_options, ctypes.byref(kvps)),
                       "GetSessionOptionsConfigEntries")
        try:
            keys, values, n = A.POINTER(ctypes.c_char_p)(), A.POINTER(ctypes.c_char_p)(), ctypes.c_size_t()
            api.GetKeyValuePairs(kvps, ctypes.byref(keys), ctypes.byref(values), ctypes.byref(n))
            return {keys[i].decode(): (values[i] or b"").decode() for i in range(n.value)}
        finally:
            api.ReleaseKeyValuePairs(kvps)

    def release_ep(self, address: int) -> None:
        ep = owner_of(address)
        if isinstance(ep, BridgeEp):
            ep.release()

    def release(self) -> None:
        """ORT's ReleaseEpFactory. The factory stays, under its struct's address, as its device memory does
        (BridgeMemory.release): ORT calls it after this where the application still holds tensors of its allocator
        (ReleaseAllocator, as the last of them goes) or a session its EP (ReleaseEp); were its callbacks gone with
        it, that call would crash the application. What goes is the registration (its closed worker's objects)."""
        if self.kept is not None:
            self.kept.forget()
        if self.memory is not None:
            self.memory.release()
        self._output_allocator = None
        self.registration = None
