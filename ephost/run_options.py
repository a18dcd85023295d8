"""A run's settings, as ONNX Runtime's RunOptions: what the application's session does with them (a deadline, the
terminate flag) and what goes with each Compute to the EPs (the run's tag, log levels and run config entries, as
an ORT plugin EP reads its OrtRunOptions), checked on both sides against ORT's own limits."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from ephost.errors import EpInvalidArgument, EpNotFound
from ephost.v1 import ep_pb2

# The run config keys ONNX Runtime defines (onnxruntime_run_options_config_keys.h). ORT's Python RunOptions lists
# none of its entries, so these, and ephost's own, are those read from one.
ORT_RUN_CONFIG_KEYS = ("memory.enable_memory_arena_shrinkage", "disable_synchronize_execution_providers",
                       "qnn.htp_perf_mode", "qnn.htp_perf_mode_post_run", "qnn.rpc_control_latency",
                       "qnn.lora_config", "gpu_graph_id")
# A deadline given in ORT's RunOptions (ephost's own RunOptions has `compute_timeout_s`): seconds, 0 for none.
COMPUTE_TIMEOUT_KEY = "ephost.compute_timeout_s"
MAX_KEY, MAX_VALUE, MAX_ENTRIES = 128, 1024, 64  # ORT's ConfigOptions limits, and a bound on how many
_ORT_ATTRIBUTES = ("logid", "log_severity_level", "log_verbosity_level", "terminate", "only_execute_path_to_fetches")
TERMINATED = "Exiting due to terminate flag being set to true."  # ORT's words for a run it stopped so


def check_entry(key: Any, value: Any) -> None:
    if not isinstance(key, str) or not isinstance(value, str):
        raise EpInvalidArgument("a run config entry's key and value are strings")
    if not 0 < len(key) <= MAX_KEY:
        raise EpInvalidArgument(f"a run config key is 1 to {MAX_KEY} characters, not {len(key)}")
    if len(value) > MAX_VALUE:
        raise EpInvalidArgument(f"the value of run config entry {key!r} is over {MAX_VALUE} characters")


@dataclass
class RunOptions:
    """Per-run settings, as ONNX Runtime's RunOptions (a session's run takes either: ORT's own is read for its
    attributes and the run config keys ORT defines).

    `terminate`: set True (from another thread, say) and the run stops before its next partition call with
    `EpCancelled` (ORT stops before its next node); a partition already in a worker runs to its end.
    `logid`, `log_severity_level` (-1: the session's), `log_verbosity_level` and the run config entries
    (`add_run_config_entry`) go with the run's Compute calls to the EPs (the onnxruntime EP hands them to ONNX
    Runtime's run, `memory.enable_memory_arena_shrinkage` among them). `compute_timeout_s` is ephost's own:
    the deadline of each of the run's partition calls (None: the session's; 0: none); in ORT's RunOptions it is
    the entry `ephost.compute_timeout_s`. `only_execute_path_to_fetches` is taken and changes nothing: every
    partition runs (ORT's default). `add_active_adapter` activates a LoRA adapter for the run (client/lora.py: its
    parameters are fed in place of the model's overridable initializers); ORT's own RunOptions does not show the
    adapters added to it, so a run given one with adapters runs without them: give ephost's."""

    # What each attribute means (docs/options.md is made from this and the defaults below)
    OPTIONS: ClassVar[dict[str, str]] = {
        "compute_timeout_s": "the deadline of each of the run's partition calls, in seconds; none: the session's; "
                             "0: none (ORT's RunOptions: the entry ephost.compute_timeout_s)",
        "logid": "the run's log id, passed to the EPs",
        "log_severity_level": "the run's log severity, passed to the EPs; -1: the session's",
        "log_verbosity_level": "the run's log verbosity, passed to the EPs",
        "terminate": "set true (from another thread) to stop the run before its next partition call (EpCancelled)",
        "only_execute_path_to_fetches": "taken, and changes nothing: every partition runs (ORT's default)",
    }

    compute_timeout_s: float | None = None
    logid: str = ""
    log_severity_level: int = -1
    log_verbosity_level: int = 0
    terminate: bool = False
    only_execute_path_to_fetches: bool = False
    config: dict[str, str] = field(default_factory=dict)
    adapters: list = field(default_factory=list, repr=False, compare=False)  # LoRA adapters, in the order added
    # ORT's RunOptions this was read from: its terminate flag is the one a run watches
    source: Any = field(default=None, repr=False, compare=False)

    def add_run_config_entry(self, key: str, value: str) -> None:
        check_entry(key, value)
        if key not in self.config and len(self.config) >= MAX_ENTRIES:
            raise EpInvalidArgument(f"a run takes at most {MAX_ENTRIES} run config entries")
        self.config[key] = value

    def add_active_adapter(self, adapter: Any) -> None:
        """Activate a LoRA adapter for the runs given these options: an onnxruntime.LoraAdapter, an
        onnxruntime.AdapterFormat, a path to an .onnx_adapter file, or a dict of parameter names to arrays."""
        self.adapters.append(adapter)

    def get_run_config_entry(self, key: str) -> str:
        if key not in self.config:
            raise EpNotFound(f"RunOptions does not have configuration with key: {key}")
        return self.config[key]

    @property
    def terminated(self) -> bool:
        """The terminate flag as it reads now (ORT's RunOptions' where this was read from one)."""
        return bool((self if self.source is None else self.source).terminate)

    @classmethod
    def of(cls, options: Any, keys: tuple[str, ...] = (*ORT_RUN_CONFIG_KEYS, COMPUTE_TIMEOUT_KEY)) -> "RunOptions":
        """ephost's RunOptions as given, or one read from ORT's (onnxruntime.RunOptions), its entries of `keys`."""
        if isinstance(options, cls):
            return options
        if not all(hasattr(options, a) for a in ("get_run_config_entry", *_ORT_ATTRIBUTES)):
            raise EpInvalidArgument(f"run_options is an ephost.RunOptions or an onnxruntime.RunOptions, not "
                                    f"{type(options).__name__}")
        config = {}
        for key in keys:
            try:
                config[key] = options.get_run_config_entry(key)
            except Exception:  # ORT raises where the entry is not set
                continue
        timeout = config.pop(COMPUTE_TIMEOUT_KEY, None)
        try:
            timeout = None if timeout is None else float(timeout)
        except ValueError:
            raise EpInvalidArgument(f"{COMPUTE_TIMEOUT_KEY} takes seconds, not {timeout!r}") from None
        return cls(timeout, str(options.logid), int(options.log_severity_level), int(options.log_verbosity_level),
                   bool(options.terminate), bool(options.only_execute_path_to_fetches), config, source=options)

    @property
    def plain(self) -> bool:
        """Nothing for the EPs, no deadline of its own, no adapters: a run with these runs as one without them,
        but that it reads the terminate flag."""
        return self.compute_timeout_s is None and not self._for_eps() and not self.adapters

    def _for_eps(self) -> bool:
        return bool(self.logid or self.log_severity_level != -1 or self.log_verbosity_level or self.config)

    def for_eps(self) -> ep_pb2.RunOptions | None:
        """What the run's Compute calls carry to the EPs; None where it is all defaults (nothing to carry)."""
        if not self._for_eps():
            return None
        check(self.logid, self.log_severity_level, self.log_verbosity_level, self.config)
        return ep_pb2.RunOptions(logid=self.logid, log_severity_level=self.log_severity_level,
                                 log_verbosity_level=self.log_verbosity_level, config=self.config)


class ForeignOptions:
    """ORT's RunOptions objects a session has read lately, each with the run config keys it had. ORT lists none
    of an object's entries, and asking it for one it lacks costs an exception, slow enough to matter on every run:
    a run with an object read before reads the values of the keys it had (a change of value is seen), not those it
    lacked (an entry added to that object later is not)."""

    def __init__(self, size: int = 8):
        self._size = size
        self._seen: OrderedDict[int, tuple[Any, tuple[str, ...]]] = OrderedDict()  # id -> (the object, its keys)
        self._lock = threading.Lock()  # guards _seen

    def read(self, options: Any) -> RunOptions:
        if isinstance(options, RunOptions):
            return options
        with self._lock:
            seen = self._seen.get(id(options))
            keys = seen[1] if seen is not None and seen[0] is options else None
            if keys is not None:
                self._seen.move_to_end(id(options))
        if keys is not None:
            return RunOptions.of(options, keys)
        read = RunOptions.of(options)
        keys = tuple(read.config) + ((COMPUTE_TIMEOUT_KEY,) if read.compute_timeout_s is not None else ())
        with self._lock:  # (the object is held, so that its id names no other while it is here)
            self._seen[id(options)] = (options, keys)
            while len(self._seen) > self._size:
                self._seen.popitem(last=False)
        return read


def check(logid: Any, severity: Any, verbosity: Any, config: Mapping[Any, Any]) -> None:
    """Run options within ORT's limits (what the application sends and what a worker takes), or
    EpInvalidArgument."""
    if len(config) > MAX_ENTRIES:
        raise EpInvalidArgument(f"a run takes at most {MAX_ENTRIES} run config entries, not {len(config)}")
    for key, value in config.items():
        check_entry(key, value)
    if not isinstance(logid, str) or len(logid) > MAX_VALUE:
        raise EpInvalidArgument(f"a run's logid is a string of at most {MAX_VALUE} characters")
    if type(severity) is not int or not -1 <= severity <= 4:
        raise EpInvalidArgument(f"log_severity_level is -1 (the session's) or 0 to 4, not {severity!r}")
    if type(verbosity) is not int or verbosity < 0:
        raise EpInvalidArgument(f"log_verbosity_level is 0 or more, not {verbosity!r}")


def checked(message: ep_pb2.RunOptions) -> ep_pb2.RunOptions:
    """A Compute's run options as a worker takes them."""
    check(message.logid, message.log_severity_level, message.log_verbosity_level, message.config)
    return message
