"""A session's ONNX Runtime settings (SessionOptions' thread counts, optimization level, execution mode, logging
and memory flags), and how they reach the EPs: as session config entries of CreateEp, as ORT hands a plugin EP
its OrtSessionOptions. An EP takes what it runs by (the onnxruntime EP applies each to its ORT sessions; the
reference evaluator has no threads to count) and leaves the rest. Both sides read this module: the application
writes the entries, a worker's EP reads them."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ephost.errors import EpInvalidArgument


class GraphOptimizationLevel(enum.IntEnum):
    """ORT's GraphOptimizationLevel (its enum compares equal to these)."""

    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99


class ExecutionMode(enum.IntEnum):
    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


class ExecutionOrder(enum.IntEnum):
    DEFAULT = 0
    PRIORITY_BASED = 1
    MEMORY_EFFICIENT = 2


def _member(kind: type[enum.IntEnum]) -> Callable[[Any], enum.IntEnum]:
    def parse(value: Any) -> enum.IntEnum:
        try:
            return kind(int(value))  # ORT's enum, ephost's, or its number
        except (TypeError, ValueError):
            raise EpInvalidArgument(f"{value!r} is not a {kind.__name__}: one of "
                                    f"{', '.join(m.name for m in kind)}") from None
    return parse


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EpInvalidArgument(f"a thread count is an int, 0 (ORT's default) or more, not {value!r}")
    return value


def _severity(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= 4:
        raise EpInvalidArgument(f"log_severity_level is -1 (the default) or 0 to 4, not {value!r}")
    return value


def _verbosity(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EpInvalidArgument(f"log_verbosity_level is 0 or more, not {value!r}")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise EpInvalidArgument(f"logid is a string, not {type(value).__name__}")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, (bool, int)):
        raise EpInvalidArgument(f"a flag is True or False, not {value!r}")
    return bool(value)


@dataclass(frozen=True)
class Setting:
    """One SessionOptions attribute an EP may run by: its ORT name, default, and how a value is checked."""

    name: str
    default: Any
    parse: Callable[[Any], Any]

    @property
    def key(self) -> str:
        """Its session config entry: ORT defines no entry for these, so the attribute's own name under
        `session.` stands for it."""
        return f"session.{self.name}"


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("intra_op_num_threads", 0, _count),
    Setting("inter_op_num_threads", 0, _count),
    Setting("graph_optimization_level", GraphOptimizationLevel.ORT_ENABLE_ALL, _member(GraphOptimizationLevel)),
    Setting("execution_mode", ExecutionMode.ORT_SEQUENTIAL, _member(ExecutionMode)),
    Setting("execution_order", ExecutionOrder.DEFAULT, _member(ExecutionOrder)),
    Setting("log_severity_level", -1, _severity),
    Setting("log_verbosity_level", 0, _verbosity),
    Setting("logid", "", _text),
    Setting("enable_cpu_mem_arena", True, _flag),
    Setting("enable_mem_pattern", True, _flag),
    Setting("enable_mem_reuse", True, _flag),
    Setting("use_deterministic_compute", False, _flag),
)}
_BY_KEY = {s.key: s for s in SETTINGS.values()}


def entries(values: Mapping[str, Any]) -> dict[str, str]:
    """The settings that differ from ORT's defaults, as session config entries (for CreateEp)."""
    out = {}
    for name, value in values.items():
        setting = SETTINGS[name]
        if value != setting.default:
            out[setting.key] = str(int(value)) if isinstance(value, (bool, enum.IntEnum)) else str(value)
    return out


def read(config: Mapping[str, str]) -> dict[str, Any]:
    """The settings among a CreateEp's session config entries, by attribute name (an EP's side); a value that does
    not parse is EpInvalidArgument naming it."""
    out = {}
    for key, text in config.items():
        setting = _BY_KEY.get(key)
        if setting is None:
            continue
        default = setting.default
        try:
            value = text if isinstance(default, str) else bool(int(text)) if isinstance(default, bool) else int(text)
        except ValueError:
            raise EpInvalidArgument(f"session config entry {key}={text!r} is not a value of {setting.name}") from None
        out[setting.name] = setting.parse(value)
    return out


def is_setting(key: str) -> bool:
    return key in _BY_KEY
