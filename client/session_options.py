"""ephost.SessionOptions, shaped like ONNX Runtime's: which EPs a session uses, and how it runs them."""
from __future__ import annotations

from typing import Mapping, Sequence

from ephost.errors import EpInvalidArgument
from ephost.client.devices import EpDevice
from ephost.client.fallback import default_fallback


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
    InferenceSession.end_profiling)."""

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
    }

    def __init__(self):
        self._providers: list[tuple[list[EpDevice], dict[str, str]]] = []
        self.ep_failure_policy = "raise"
        self.compute_timeout_s: float | None = None
        self.fallback: str | None = default_fallback()
        # Keep each partition's compiled form (where its EP makes one) in this process, so that a restarted
        # worker restores the partition instead of compiling it. Costs the forms' memory; ep.context_enable=1
        # implies it.
        self.keep_compiled = False
        self._config: dict[str, str] = {}
        # ORT's profiling options: a Chrome trace of every run, written by session.end_profiling().
        self.enable_profiling = False
        self.profile_file_prefix = "onnxruntime_profile_"

    def add_session_config_entry(self, key: str, value: str) -> None:
        """A session config entry, by ONNX Runtime's names. ephost acts on `ep.context_enable` (1: write the
        model with each partition an EP compiled as an EPContext node, after compiling),
        `ep.context_file_path` (where; default MODEL_ctx.onnx beside the model) and `ep.context_embed_mode`
        (1: the compiled forms inside the model; 0, the default: each in a file beside it)."""
        self._config[str(key)] = str(value)

    def get_session_config_entry(self, key: str) -> str:
        if key not in self._config:
            raise EpInvalidArgument(f"no session config entry {key!r}")
        return self._config[key]

    @property
    def session_config(self) -> dict[str, str]:
        return dict(self._config)

    def add_provider_for_devices(self, ep_devices: Sequence[EpDevice],
                                 provider_options: Mapping[str, str] | None = None) -> None:
        """Use the EP of these devices; EPs are tried in the order they were added. As in ONNX Runtime, all
        the devices must belong to one EP."""
        devices = list(ep_devices)
        if not devices:
            raise EpInvalidArgument("add_provider_for_devices needs at least one device")
        if len({d.registration_name for d in devices}) != 1:
            raise EpInvalidArgument("all devices given to add_provider_for_devices must belong to one EP")
        self._providers.append((devices, {str(k): str(v) for k, v in (provider_options or {}).items()}))

    @property
    def providers(self) -> list[tuple[list[EpDevice], dict[str, str]]]:
        return list(self._providers)
