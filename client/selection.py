"""Automatic EP selection, as ONNX Runtime does it (provider_policy_context.cc), over the Environment's devices:
a session given no EP picks them by a device policy (SessionOptions.set_provider_selection_policy) or by the
application's delegate (set_provider_selection_policy_delegate).

The devices are ordered as ORT orders them: NPU, then GPU (discrete first), then CPU; within a kind, devices of
their EP's own vendor first; ORT's own CPU EP (vendor Microsoft) last. PREFER_CPU (and DEFAULT) takes the first
CPU device, and ORT's CPU EP after it; PREFER_NPU (MAX_EFFICIENCY, MIN_OVERALL_POWER) the first NPU, then as
PREFER_CPU; PREFER_GPU (MAX_PERFORMANCE) the first GPU, then as PREFER_CPU. The session's CPU fallback stays
last, whatever is picked.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import onnx

from ephost.errors import EpFailedPrecondition, EpInvalidArgument
from ephost.types import HardwareDeviceType
from ephost.client.devices import EpDevice

MAX_SELECTIONS = 8  # as ORT's delegate is allowed


class DevicePolicy(enum.IntEnum):
    """ORT's OrtExecutionProviderDevicePolicy (its enum compares equal to these)."""

    DEFAULT = 0
    PREFER_CPU = 1
    PREFER_NPU = 2
    PREFER_GPU = 3
    MAX_PERFORMANCE = 4
    MAX_EFFICIENCY = 5
    MIN_OVERALL_POWER = 6


def _is_default_cpu_ep(d: EpDevice) -> bool:
    return d.device.type == HardwareDeviceType.CPU and d.ep_vendor == "Microsoft"


def _matches_vendor(d: EpDevice) -> bool:
    vendor_id = getattr(d.registration.factory, "get_vendor_id", lambda: 0)()
    return (vendor_id != 0 and d.device.vendor_id == vendor_id) or d.device.vendor == d.ep_vendor


def ordered(devices: Sequence[EpDevice]) -> list[EpDevice]:
    """The devices in ORT's order of preference."""
    rank = {HardwareDeviceType.NPU: 0, HardwareDeviceType.GPU: 1, HardwareDeviceType.CPU: 2}

    def key(d: EpDevice):
        discrete = d.device.type == HardwareDeviceType.GPU and d.device.metadata.get("Discrete") == "1"
        # ORT's CPU EP last within the CPUs before the vendor rule: in ORT its factory never matches the CPU's
        # vendor, and an onnxruntime worker's factory reports the vendor of its device
        return (rank.get(d.device.type, 3), not discrete, _is_default_cpu_ep(d), not _matches_vendor(d), d.ep_name)

    return sorted(devices, key=key)


def _prefer_cpu(devices: list[EpDevice]) -> list[EpDevice]:
    cpu = next((d for d in devices if d.device.type == HardwareDeviceType.CPU), None)
    if cpu is None:
        return []  # the session's CPU fallback is the CPU EP then
    out = [cpu]
    if not _is_default_cpu_ep(cpu) and devices and _is_default_cpu_ep(devices[-1]):
        out.append(devices[-1])  # ORT's CPU EP as the last choice, for the widest coverage of ops
    return out


def _prefer(kind: HardwareDeviceType) -> Callable[[list[EpDevice]], list[EpDevice]]:
    def select(devices: list[EpDevice]) -> list[EpDevice]:
        first = next((d for d in devices if d.device.type == kind), None)
        rest = _prefer_cpu(devices)
        return ([first] if first is not None else []) + [d for d in rest if d is not first]
    return select


# Each policy's choice among the ordered devices (ORT's selectors)
POLICIES: dict[DevicePolicy, Callable[[list[EpDevice]], list[EpDevice]]] = {
    DevicePolicy.DEFAULT: _prefer_cpu,
    DevicePolicy.PREFER_CPU: _prefer_cpu,
    DevicePolicy.PREFER_NPU: _prefer(HardwareDeviceType.NPU),
    DevicePolicy.MAX_EFFICIENCY: _prefer(HardwareDeviceType.NPU),
    DevicePolicy.MIN_OVERALL_POWER: _prefer(HardwareDeviceType.NPU),
    DevicePolicy.PREFER_GPU: _prefer(HardwareDeviceType.GPU),
    DevicePolicy.MAX_PERFORMANCE: _prefer(HardwareDeviceType.GPU),
}


def model_metadata(model: onnx.ModelProto) -> dict[str, str]:
    """What a delegate is told of the model, by onnx.proto's field names, as ORT tells it."""
    out = {"producer_name": model.producer_name, "producer_version": model.producer_version,
           "domain": model.domain, "model_version": str(model.model_version), "doc_string": model.doc_string,
           "graph_name": model.graph.name, "graph_description": model.graph.doc_string}
    out.update({p.key: p.value for p in model.metadata_props})
    return out


@dataclass(frozen=True)
class SelectionPolicy:
    """A device policy, or a delegate that picks the devices itself."""

    policy: DevicePolicy | None = None
    delegate: Callable | None = None

    @classmethod
    def of_policy(cls, policy: Any) -> "SelectionPolicy":
        try:
            return cls(policy=DevicePolicy(int(policy)))
        except (TypeError, ValueError):
            raise EpInvalidArgument(f"{policy!r} is not an OrtExecutionProviderDevicePolicy: one of "
                                    f"{', '.join(p.name for p in DevicePolicy)}") from None

    @classmethod
    def of_delegate(cls, delegate: Callable) -> "SelectionPolicy":
        if not callable(delegate):
            raise EpInvalidArgument("the selection policy delegate must be callable: (ep_devices, model_metadata, "
                                    "runtime_metadata, max_selections) -> devices")
        return cls(delegate=delegate)

    def select(self, devices: Sequence[EpDevice], model: onnx.ModelProto) -> list[tuple[list[EpDevice], dict]]:
        """The session's EPs as add_provider_for_devices would give them: the picked devices, those of one EP
        together, in order of preference."""
        devices = ordered(devices)
        if self.delegate is None:
            picked = POLICIES[self.policy](devices)
        else:
            picked = self._delegated(devices, model)
        entries: list[tuple[list[EpDevice], dict]] = []
        for d in picked:
            same = next((e for e in entries if e[0][0].registration is d.registration), None)
            if same is None:
                entries.append(([d], {}))
            elif d not in same[0]:
                same[0].append(d)
        return entries

    def _delegated(self, devices: list[EpDevice], model: onnx.ModelProto) -> list[EpDevice]:
        try:
            picked = self.delegate(list(devices), model_metadata(model), {}, MAX_SELECTIONS)
        except Exception as e:
            raise EpFailedPrecondition(f"EP selection delegate failed: {type(e).__name__}: {e}") from e
        picked = list(picked or [])
        if not picked:
            raise EpFailedPrecondition("EP selection delegate did not select anything.")
        if len(picked) > MAX_SELECTIONS:
            raise EpFailedPrecondition(f"EP selection delegate selected too many EP devices ({len(picked)}). The "
                                       f"limit is {MAX_SELECTIONS} EP devices.")
        strangers = [d for d in picked if not any(d is known for known in devices)]
        if strangers:
            raise EpInvalidArgument(f"EP selection delegate returned {strangers[0]!r}, which is not one of the "
                                    "devices it was given")
        return picked
