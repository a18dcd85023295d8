"""ephost.SessionOptions, shaped like ONNX Runtime's: which EPs a session uses, and how it runs them.

Every attribute ORT's SessionOptions has is here, and each is honoured or refused, never ignored: a name neither
has (a typo) is an error naming it. ORT's settings (threads, optimization level, execution mode, logging, memory
flags: ephost/session_config.py) go to every EP the session creates, which takes those it runs by; what changes
the model (free dimension overrides, initializers given here, external data given in memory) the session applies
as it loads the model (client/loading.py); a selection policy picks the EPs where none is given
(client/providers.py)."""
from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ephost import session_config
from ephost.errors import EpInvalidArgument, EpUnimplemented, EpUnknownOption
from ephost.tensor import Tensor
from ephost.client.devices import EpDevice
from ephost.client.feeds import foreign
from ephost.client.fallback import default_fallback
from ephost.client.selection import SelectionPolicy

# Attributes that hold a value as they are given: ephost's own, and ORT's that need no check
_PLAIN = frozenset({"ep_failure_policy", "compute_timeout_s", "fallback", "keep_compiled", "enable_profiling",
                    "profile_file_prefix", "optimized_model_filepath"})
# Session config entries the session acts on itself, not its EPs: where an optimized model puts its weights, and
# assignment info (always recorded)
_OWN_ENTRIES = ("session.optimized_model_", "session.record_ep_graph_assignment_info")
# ORT attributes ephost cannot honour in any value but their default: (default, why)
_FIXED = {"use_per_session_threads": (True, "ephost's EPs run on threads of their own, per session: there are "
                                            "no global thread pools to share")}


class SessionOptions:
    """Which EPs a session uses, and what it does when one fails.

    `ep_failure_policy`: "raise" (a failed call raises its typed error), "retry" (wait for the worker's
    restart, compile again, run the failed partition once more) or "fallback" (run the failed partition on the
    CPU fallback; once the EP is marked failed, its partitions run there from then on). `compute_timeout_s`:
    the deadline of every Compute (a worker past it is ended, then the policy applies); None: the EP's call
    deadline; 0: no deadline. `fallback`: what runs the nodes no EP takes (and failed partitions under "fallback"):
    "onnxruntime" (ONNX Runtime's CPU EP in process, the reference evaluator for what it cannot run; the
    default where onnxruntime is installed), "reference" (ONNX's reference evaluator only) or None (a node no
    EP takes fails the session's creation). `enable_profiling` / `profile_file_prefix`: as ORT's (see
    InferenceSession.end_profiling). `optimized_model_filepath`: where to write the model as ONNX Runtime
    optimized it (see client/optimized_model.py).

    ORT's `intra_op_num_threads`, `inter_op_num_threads`, `graph_optimization_level`, `execution_mode`,
    `execution_order`, `log_severity_level`, `log_verbosity_level`, `logid`, `enable_cpu_mem_arena`,
    `enable_mem_pattern`, `enable_mem_reuse` and `use_deterministic_compute` go to every EP of the session (the
    onnxruntime EP, in a worker or as the CPU fallback, runs its ORT sessions by them)."""

    # ephost's own attributes and what each means (docs/options.md is made from this and the defaults below)
    OPTIONS = {
        "ep_failure_policy": "what a failed partition call does: raise (its typed error), retry (once, on the "
                             "restarted worker, compiled again) or fallback (on the CPU fallback; all the EP's "
                             "partitions once it is marked failed)",
        "compute_timeout_s": "the deadline of every Compute, in seconds (a worker past it is ended, then the policy "
                             "applies); none: the EP's call deadline (timeout_s); 0: no deadline",
        "fallback": "what runs the nodes no EP takes: onnxruntime (ORT's CPU EP in process, the reference evaluator "
                    "for what it cannot run; the default where onnxruntime is installed), reference, or none (such a "
                    "node fails the session's creation)",
        "keep_compiled": "keep each partition's compiled form in this process, so that a restarted worker restores "
                         "it instead of compiling it (ep.context_enable=1 implies it)",
        "enable_profiling": "record every run as a Chrome trace, written by InferenceSession.end_profiling()",
        "profile_file_prefix": "the start of the profile file's name",
        "optimized_model_filepath": "where to write the model as ONNX Runtime optimized it (only where ORT's CPU "
                                    "EP runs the whole session; refused otherwise)",
    }

    def __init__(self):
        self._providers: list[tuple[list[EpDevice], dict[str, str]]] = []
        self._named: list[tuple[str, dict[str, str]]] = []  # add_provider: EPs by name, as providers= takes them
        self._settings: dict[str, Any] = {name: s.default for name, s in session_config.SETTINGS.items()}
        self._config: dict[str, str] = {}
        self._dims_by_name: dict[str, int] = {}
        self._dims_by_denotation: dict[str, int] = {}
        self._initializers: dict[str, np.ndarray] = {}
        self._external_initializers: dict[str, np.ndarray] = {}
        self._external_files: dict[str, bytes] = {}
        self._selection: SelectionPolicy | None = None
        self._plain_inputs: frozenset[str] = frozenset()  # initializers a session's variant takes as inputs
        self.ep_failure_policy = "raise"
        self.compute_timeout_s: float | None = None
        self.fallback: str | None = default_fallback()
        # Keep each partition's compiled form (where its EP makes one) in this process, so that a restarted
        # worker restores the partition instead of compiling it. Costs the forms' memory; ep.context_enable=1
        # implies it.
        self.keep_compiled = False
        # ORT's profiling options: a Chrome trace of every run, written by session.end_profiling().
        self.enable_profiling = False
        self.profile_file_prefix = "onnxruntime_profile_"
        self.optimized_model_filepath = ""

    # --- attributes: ORT's settings checked, unknown names refused ----------------------------------

    def __getattr__(self, name: str) -> Any:
        settings = self.__dict__.get("_settings")
        if settings is not None and name in settings:
            return settings[name]
        if name in _FIXED:
            return _FIXED[name][0]
        raise AttributeError(f"'SessionOptions' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name in _PLAIN:
            object.__setattr__(self, name, value)
        elif name in session_config.SETTINGS:
            self._settings[name] = session_config.SETTINGS[name].parse(value)
        elif name in _FIXED:
            default, why = _FIXED[name]
            if value != default:
                raise EpUnimplemented(f"SessionOptions.{name} = {value!r} cannot be honoured: {why}")
        else:
            known = sorted(_PLAIN | set(session_config.SETTINGS) | set(_FIXED))
            raise EpUnknownOption(f"SessionOptions has no option {name!r} (a typo, or an ONNX Runtime option ephost "
                                  f"does not have); its options are {', '.join(known)}")

    @property
    def settings(self) -> dict[str, Any]:
        """ORT's settings by attribute name (session_config.SETTINGS)."""
        return dict(self._settings)

    def ep_config(self) -> dict[str, str]:
        """What CreateEp carries to each EP of the session: the `session.` config entries (what CreateEp takes
        under any other prefix is a provider option) but those ephost acts on itself, and the settings that differ
        from ORT's defaults as entries of their own (session_config.entries)."""
        passed = {k: v for k, v in self._config.items() if k.startswith("session.") and not k.startswith(_OWN_ENTRIES)}
        return {**passed, **session_config.entries(self._settings)}

    def copy(self) -> "SessionOptions":
        """A copy whose settings and entries change apart from these (a session's, with the model's own settings
        applied: ORT_LOAD_CONFIG_FROM_MODEL)."""
        out = copy.copy(self)
        for name in ("_providers", "_named", "_settings", "_config", "_dims_by_name", "_dims_by_denotation",
                     "_initializers", "_external_initializers", "_external_files"):
            object.__setattr__(out, name, copy.copy(getattr(self, name)))
        return out

    def for_variant(self, inputs: frozenset[str], entries) -> "SessionOptions":
        """A copy for a variant of a session whose overridable initializers `inputs` are plain inputs there
        (client/overrides.py): the session's EPs (`entries`, by device), and nothing written again (no context
        model, no optimized model)."""
        out = self.copy()
        out._providers, out._named, out._selection = list(entries), [], None
        out._config = {k: v for k, v in self._config.items() if not k.startswith("ep.context_")}
        out._plain_inputs = frozenset(inputs)
        out.optimized_model_filepath = ""
        return out

    @property
    def plain_inputs(self) -> frozenset[str]:
        return self._plain_inputs

    # --- session config entries -------------------------------------------------------------------

    def add_session_config_entry(self, key: str, value: str) -> None:
        """A session config entry, by ONNX Runtime's names; each goes to every EP of the session (as ORT hands its
        OrtSessionOptions to a plugin EP). ephost acts itself on `ep.context_enable` (1: write the model with each
        partition an EP compiled as an EPContext node, after compiling), `ep.context_file_path` (where; default
        MODEL_ctx.onnx beside the model), `ep.context_embed_mode` (1: the compiled forms inside the model; 0, the
        default: each in a file beside it) and `session.optimized_model_external_initializers_file_name` /
        `_min_size_in_bytes` (where optimized_model_filepath puts large initializers)."""
        self._config[str(key)] = str(value)

    def get_session_config_entry(self, key: str) -> str:
        if key not in self._config:
            raise EpInvalidArgument(f"SessionOptions does not have configuration with key: {key}")
        return self._config[key]

    @property
    def session_config(self) -> dict[str, str]:
        return dict(self._config)

    # --- EPs ------------------------------------------------------------------------------------

    def add_provider_for_devices(self, ep_devices: Sequence[EpDevice],
                                 provider_options: Mapping[str, str] | None = None) -> None:
        """Use the EP of these devices; EPs are tried in the order they were added. As in ONNX Runtime, all
        the devices must belong to one EP."""
        devices = list(ep_devices)
        if not devices:
            raise EpInvalidArgument("add_provider_for_devices needs at least one device")
        if len({d.registration_name for d in devices}) != 1:
            raise EpInvalidArgument("all devices given to add_provider_for_devices must belong to one EP")
        self._providers.append((devices, _strings(provider_options)))

    def add_provider(self, provider_name: str, provider_options: Mapping[str, str] | None = None) -> None:
        """Use an EP by name, as `providers=` names one (a registration, a target, an ONNX Runtime EP name); it
        comes after the EPs added by device, in the order the names were added."""
        if not isinstance(provider_name, str) or not provider_name:
            raise EpInvalidArgument("add_provider takes an EP's name")
        self._named.append((provider_name, _strings(provider_options)))

    @property
    def providers(self) -> list[tuple[list[EpDevice], dict[str, str]]]:
        return list(self._providers)

    @property
    def named_providers(self) -> list[tuple[str, dict[str, str]]]:
        return list(self._named)

    def has_providers(self) -> bool:
        return bool(self._providers or self._named)

    def set_provider_selection_policy(self, policy) -> None:
        """Pick the session's EPs among the Environment's devices by ORT's OrtExecutionProviderDevicePolicy
        (DEFAULT, PREFER_CPU, PREFER_NPU, PREFER_GPU, MAX_PERFORMANCE, MAX_EFFICIENCY, MIN_OVERALL_POWER), where
        no EP is given otherwise."""
        self._selection = SelectionPolicy.of_policy(policy)

    def set_provider_selection_policy_delegate(self, delegate: Callable) -> None:
        """Pick the session's EPs with `delegate(ep_devices, model_metadata, runtime_metadata, max_selections)`,
        which returns the EpDevices to use in order, where no EP is given otherwise."""
        self._selection = SelectionPolicy.of_delegate(delegate)

    @property
    def selection_policy(self) -> SelectionPolicy | None:
        return self._selection

    # --- what changes the model --------------------------------------------------------------------

    def add_free_dimension_override_by_name(self, dim_name: str, dim_value: int) -> None:
        """Fix every free dimension named `dim_name` (a graph input's dim_param) to `dim_value`."""
        self._dims_by_name[_name(dim_name, "dimension name")] = _dim(dim_value)

    def add_free_dimension_override_by_denotation(self, dim_denotation: str, dim_value: int) -> None:
        """Fix every free dimension with this denotation (DATA_BATCH, DATA_CHANNEL...) to `dim_value`."""
        self._dims_by_denotation[_name(dim_denotation, "dimension denotation")] = _dim(dim_value)

    @property
    def free_dimension_overrides(self) -> tuple[dict[str, int], dict[str, int]]:
        """(by name, by denotation)."""
        return dict(self._dims_by_name), dict(self._dims_by_denotation)

    def add_initializer(self, name: str, ortvalue: Any) -> None:
        """Use this value for the model's initializer `name` instead of the model's own (an OrtValue, an ephost
        Tensor in this process's memory or an array; read when a session is made)."""
        self._initializers[_name(name, "initializer name")] = _array(ortvalue, name)

    def add_external_initializers(self, names: Sequence[str], ortvalues: Sequence[Any]) -> None:
        """The values of initializers the model keeps in external files, given here instead of read from them."""
        names, values = list(names), list(ortvalues)
        if len(names) != len(values):
            raise EpInvalidArgument(f"add_external_initializers takes as many values as names, not {len(values)} "
                                    f"for {len(names)}")
        for name, value in zip(names, values):
            self._external_initializers[_name(name, "initializer name")] = _array(value, name)

    def add_external_initializers_from_files_in_memory(self, names: Sequence[str], buffers: Sequence[Any],
                                                       lengths: Sequence[int]) -> None:
        """The contents of external data files the model names (by their `location`), given in memory (copied
        now) instead of read from disk."""
        names, buffers, lengths = list(names), list(buffers), list(lengths)
        if not len(names) == len(buffers) == len(lengths):
            raise EpInvalidArgument("add_external_initializers_from_files_in_memory takes one buffer and one length "
                                    "per file name")
        for name, buffer, length in zip(names, buffers, lengths):
            view = memoryview(buffer).cast("B")
            if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= view.nbytes:
                raise EpInvalidArgument(f"external file {name!r}: length {length!r} is not within its buffer of "
                                        f"{view.nbytes} bytes")
            self._external_files[_name(name, "file name")] = bytes(view[:length])

    @property
    def initializers(self) -> dict[str, np.ndarray]:
        return dict(self._initializers)

    @property
    def external_initializers(self) -> dict[str, np.ndarray]:
        return dict(self._external_initializers)

    @property
    def external_files(self) -> dict[str, bytes]:
        return dict(self._external_files)

    # --- ORT's, that ephost cannot honour ------------------------------------------------------------

    def register_custom_ops_library(self, library_path: str) -> None:
        raise EpUnimplemented(
            "SessionOptions.register_custom_ops_library cannot be honoured: a custom op library is vendor code, "
            "which ephost loads in workers only. Register an onnxruntime worker with the option "
            f"custom_ops_library={library_path} and add it to the session")

    def set_load_cancellation_flag(self, value: bool) -> None:
        raise EpUnimplemented("SessionOptions.set_load_cancellation_flag cannot be honoured: an ephost session's "
                              "creation is not cancelled from another thread")

    def set_ep_context_data_read_func(self, func: Callable) -> None:
        raise EpUnimplemented("SessionOptions.set_ep_context_data_read_func cannot be honoured: ephost reads an "
                              "EPContext model's files itself (ep.context_file_path, files beside the model)")

    def clear_ep_context_data_read_func(self) -> None:
        """Nothing to clear: none is ever set."""


def _strings(options: Mapping[Any, Any] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in (options or {}).items()}


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise EpInvalidArgument(f"a {what} is a non-empty string, not {value!r}")
    return value


def _dim(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise EpInvalidArgument(f"a dimension's value is an int, 0 or more, not {value!r}")
    return int(value)


def _array(value: Any, name: str) -> np.ndarray:
    """An initializer's value as an array of its own (the caller's buffer may change or go after this)."""
    value = foreign(value)
    if isinstance(value, Tensor):
        array = value.local_array()
        if array is None:
            raise EpInvalidArgument(f"initializer {name!r}: the tensor is in {value.memory_info.name} memory, which "
                                    "this process cannot read")
        value = array
    if not isinstance(value, (np.ndarray, np.generic)):
        raise EpInvalidArgument(f"initializer {name!r}: give an OrtValue, an ephost.Tensor or a numpy array, not "
                                f"{type(value).__name__}")
    return np.asarray(value)  # read when a session is made, as ORT reads it then
