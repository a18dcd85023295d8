"""Where a session's inputs are read and its outputs made, as ONNX Runtime's get_input_memory_infos,
get_output_memory_infos and get_input_epdevices say it: the memory of the EP that first reads each input (a
worker's memory this process maps, where an input bound there is read without a copy; the application's for the
CPU fallback) and that EP's device; the memory each output is made in."""
from __future__ import annotations

from typing import Sequence

from ephost.types import HOST_MEMORY, MemoryInfo
from ephost.client.devices import EpDevice
from ephost.client.planner import Partition


def _memory(env, registration: str) -> MemoryInfo:
    if not env.is_registered(registration):
        return HOST_MEMORY  # the CPU fallback's: this process's memory
    return env.registration(registration).session_memory() or HOST_MEMORY


def _first_reader(partitions: Sequence[Partition], name: str) -> Partition | None:
    return next((p for p in partitions if name in p.graph.inputs), None)


def input_memory_infos(env, partitions: Sequence[Partition], names: Sequence[str]) -> list[MemoryInfo]:
    out = []
    for name in names:
        reader = _first_reader(partitions, name)
        out.append(HOST_MEMORY if reader is None else _memory(env, reader.registration))
    return out


def output_memory_infos(env, partitions: Sequence[Partition], names: Sequence[str]) -> list[MemoryInfo]:
    made_by = {v: p.registration for p in partitions for v in p.graph.outputs}
    return [_memory(env, made_by[n]) if n in made_by else HOST_MEMORY for n in names]


def input_ep_devices(partitions: Sequence[Partition], names: Sequence[str],
                     entries: Sequence[tuple[list[EpDevice], dict]]) -> list[EpDevice | None]:
    """The device of the EP that first reads each input; None where the CPU fallback reads it, or nothing does
    (ORT gives None where no plugin EP device reads an input)."""
    devices = {ds[0].registration_name: ds[0] for ds, _ in entries if ds}
    out = []
    for name in names:
        reader = _first_reader(partitions, name)
        out.append(None if reader is None else devices.get(reader.registration))
    return out
