"""ephost.InferenceSession, shaped like ONNX Runtime's: a thin facade over the session's plan (its partitions
across EPs, compiled: client/session_plan.py) and its runs (client/runner.py). Its options: client/session_options.py.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ephost.errors import EpFailedPrecondition, EpInvalidArgument
from ephost.run_options import ForeignOptions
from ephost.tensor import Tensor
from ephost.types import HOST_MEMORY, MemoryInfo
from ephost.values import as_value, to_python
from ephost.client import metrics
from ephost.client.failure_policy import FailurePolicy
from ephost.client.fallback import CpuFallback
from ephost.client.devices import EpDevice
from ephost.client.io_places import input_ep_devices, input_memory_infos, output_memory_infos
from ephost.client.iobinding import IOBinding
from ephost.client.loading import load, session_kwargs
from ephost.client.lora import Adapters
from ephost.client.overrides import Overrides
from ephost.client.providers import normalized
from ephost.client.profiler import Profiler
from ephost.client.runner import PartitionRunner
from ephost.client.session_io import ModelIO, NodeArg, static_shapes
from ephost.client.session_options import SessionOptions
from ephost.client.session_plan import AssignedSubgraph, SessionPlan

log = logging.getLogger(__name__)

# gRPC takes a deadline in seconds, never none: a century stands for "no deadline" (compute_timeout_s=0).
NO_DEADLINE_S = 100 * 365 * 86400.0


@dataclass(frozen=True)
class ModelMetadata:
    """ONNX Runtime's ModelMetadata: what the model says about itself."""

    producer_name: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: dict[str, str]


class InferenceSession:
    """A model's session (ORT's InferenceSession, its arguments in ORT's order): where each node runs, and runs of
    it. `model`: a path, bytes, a ModelProto or an ephost.ModelOnWorker; `providers`: registration names, or targets
    registered under their own name, after those of the SessionOptions (client/providers.py); `env` (by keyword):
    the Environment whose EPs it uses (the default one if None)."""

    def __init__(self, model, sess_options: SessionOptions | None = None,
                 providers: Iterable[str | tuple[str, Mapping[str, str]]] | None = None,
                 provider_options: Sequence[Mapping[str, str]] | None = None, *, env=None, **kwargs):
        if env is None:
            from ephost import get_default_environment
            env = get_default_environment()
        self._env = env
        self._closed = False
        self._pid = os.getpid()  # a forked child's copy is inert: the partitions are the parent's
        self._lock = threading.Lock()  # guards close, set_providers and the run_async executor's making
        self._plan: SessionPlan | None = None
        self._overrides: Overrides | None = None
        # The model with what the options change in it (ORT's loading: client/loading.py), and the options the
        # session runs by (a copy with the model's own settings, where ORT_LOAD_CONFIG_FROM_MODEL asks for them)
        loaded = load(model, sess_options or SessionOptions(), env, session_kwargs(kwargs))
        options = loaded.options
        self._options = options
        self._timeout = options.compute_timeout_s
        self._runs = itertools.count(1)
        self._foreign_options = ForeignOptions()  # ORT's RunOptions objects runs were given, and their entries
        self._async: ThreadPoolExecutor | None = None
        fallback = CpuFallback(options.fallback, options.ep_config())
        self._failures = FailurePolicy(options.ep_failure_policy, self._link_of, fallback)
        self.profiler = Profiler(bool(options.enable_profiling), options.profile_file_prefix)
        try:
            self._plan = SessionPlan(loaded, env, options, self._failures, fallback)
            self._io = ModelIO(self._plan.model.graph, self._plan.constants)
            self._shapes = static_shapes(self._plan.model.graph)
            self._runner = PartitionRunner(env, self._failures, self.profiler, self._link_of, self._plan.constants,
                                           self._plan.external)
            # Runs that feed initializers the model lets them override, LoRA adapters' parameters among them,
            # run on a variant of this session (client/overrides.py, client/lora.py)
            overridable = frozenset(self._plan.index.overridable)
            self._overrides = Overrides(overridable, lambda fed: InferenceSession(
                model, options.for_variant(fed, self._plan.entries), env=env))
            self._adapters = Adapters(self._plan.model, overridable, self._plan.external)
            with self.profiler.span("Session", "session_initialization"):
                self._plan.set_up(normalized(providers, provider_options))
            self._runner.plan_for(self._plan.partitions, self._io.input_names, self._shapes)
        except BaseException:
            self.close()
            raise

    def _link_of(self, registration: str):
        return self._env.registration(registration).link if self._env.is_registered(registration) else None

    @property
    def environment(self):
        """The Environment this session's EPs are registered in."""
        return self._env

    @property
    def run_log(self):
        """What happened to failed calls, run by run (a bounded deque of dicts)."""
        return self._failures.run_log

    @property
    def failure_counters(self):
        return self._failures.counters

    @property
    def ep_context_files(self) -> list[str]:
        """What ep.context_enable=1 wrote: the context model, and its files."""
        return self._plan.ep_context_files

    # --- ONNX Runtime's session API ------------------------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        return self._io.input_args()

    def get_outputs(self) -> list[NodeArg]:
        return self._io.output_args()

    def get_providers(self) -> list[str]:
        """The session's EPs by name, in order of preference, the fallback's last (ORT lists its CPU EP last)."""
        return self._plan.ep_names()

    def get_input_memory_infos(self) -> list[MemoryInfo]:
        """Where each input is read: the memory of the EP that reads it first (client/io_places.py)."""
        return input_memory_infos(self._env, self._plan.partitions, self._io.input_names)

    def get_output_memory_infos(self) -> list[MemoryInfo]:
        """Where each output is made."""
        return output_memory_infos(self._env, self._plan.partitions, self._io.output_names(None))

    def get_input_epdevices(self) -> list[EpDevice | None]:
        """The device of the EP that reads each input first (None for the CPU fallback)."""
        return input_ep_devices(self._plan.partitions, self._io.input_names, self._plan.entries)

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        """Each EP's options by EP name, as ONNX Runtime's get_provider_options."""
        return self._plan.provider_options()

    def get_session_options(self) -> SessionOptions:
        return self._options

    def get_modelmeta(self) -> ModelMetadata:
        m = self._plan.model
        return ModelMetadata(m.producer_name, m.graph.name, m.domain, m.doc_string, m.graph.doc_string,
                             m.model_version, {p.key: p.value for p in m.metadata_props})

    def get_provider_graph_assignment_info(self) -> list[AssignedSubgraph]:
        return self._plan.assignment()

    def set_providers(self, providers: Sequence[str | tuple[str, Mapping[str, str]]] | None = None,
                      provider_options: Sequence[Mapping[str, str]] | None = None) -> None:
        """Partition and compile again on other EPs (ORT's set_providers: the session is made again). Providers
        are registration names or targets, as `providers=` takes them, or (name, options); ORT's own
        "CPUExecutionProvider" names the fallback, which is always last. None: the SessionOptions' devices."""
        if self._closed:
            raise EpFailedPrecondition("the session is closed")
        providers = normalized(list(providers or []), provider_options)
        with self._lock:
            self._plan.replan(providers)
            self._runner.plan_for(self._plan.partitions, self._io.input_names, self._shapes)

    def get_profiling_start_time_ns(self) -> int:
        """When profiling started, in time.monotonic_ns() terms (0 when SessionOptions.enable_profiling is off)."""
        return self.profiler.start_time_ns

    def end_profiling(self) -> str:
        """Stop profiling and write what was recorded as Chrome trace JSON; the file's name ('' when off)."""
        return self.profiler.end()

    # --- runs -----------------------------------------------------------------------------------------

    @property
    def registrations(self) -> tuple[str, ...]:
        """The registrations the session's partitions run on now, in plan order ("fallback" for the CPU
        fallback)."""
        return tuple(dict.fromkeys(p.registration for p in self._plan.partitions))

    @metrics.observed
    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[Any]:
        """The outputs as numpy arrays (lists, None or dicts for non-tensor values). Feeds may be numpy arrays,
        ephost.Tensors in any memory (a tensor in a worker's memory is read there by a partition of that worker), or
        lists (made into arrays of the input's element type, as ONNX Runtime makes them)."""
        outputs = self._execute(output_names, input_feed, run_options)
        for i, value in enumerate(outputs):  # (a loop, not a comprehension: one Python call fewer)
            if type(value) is not np.ndarray:
                outputs[i] = to_python(value)
        return outputs

    def run_async(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
                  callback: Callable[[list[Any] | None, Any, str], None], user_data: Any = None,
                  run_options: Any = None) -> None:
        """ORT's run_async: run on another thread, then `callback(results, user_data, err)`, with `err` "" on
        success and the error's text (results None) on failure. Runs are taken in the order they were asked."""
        if self._closed:
            raise EpFailedPrecondition("the session is closed")
        with self._lock:
            if self._async is None:
                self._async = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ephost-run-async")
            executor = self._async

        def work():
            try:
                results = self.run(output_names, input_feed, run_options)
            except Exception as e:
                callback(None, user_data, f"{type(e).__name__}: {e}")
                return
            callback(results, user_data, "")

        executor.submit(work)

    @metrics.observed
    def run_with_ort_values(self, output_names: Sequence[str] | None, input_dict_ort_values: Mapping[str, Any],
                            run_options: Any = None) -> list[Any]:
        """ORT's run_with_ort_values: the outputs as ephost.Tensors, left where the partitions made them (in a
        worker's memory, not copied to the application; `numpy()` reads a worker's shared memory in place)."""
        names = self._io.output_names(output_names)
        return [as_value(v) for v in self._execute(names, input_dict_ort_values, run_options, dict.fromkeys(names))]

    def io_binding(self) -> IOBinding:
        """An IOBinding of this session (ORT's session.io_binding())."""
        return IOBinding(self)

    @metrics.observed
    def run_with_iobinding(self, iobinding: IOBinding, run_options: Any = None) -> None:
        """Run with the inputs and outputs bound in `iobinding`; its get_outputs() then holds the outputs where
        they were bound. Outputs bound to an EP's memory are left there by the partition that makes them."""
        if iobinding.session is not self:
            raise EpInvalidArgument("the IOBinding belongs to another session; make one with session.io_binding()")
        outputs = iobinding.bound_outputs()
        if not outputs:
            raise EpInvalidArgument("no output is bound; bind_output(name, ...) at least one")
        placed = {n: b.memory for n, b in outputs.items() if b.memory != HOST_MEMORY}
        targets = {n: b.tensor for n, b in outputs.items() if b.tensor is not None}
        names = list(outputs)
        results = self._execute(names, iobinding.bound_inputs(), run_options, placed, targets)
        iobinding.set_results({name: as_value(value) for name, value in zip(names, results)})

    def _execute(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: Any,
                 placed: Mapping[str, MemoryInfo | None] | None = None,
                 targets: Mapping[str, Tensor] | None = None) -> list[Any]:
        """One run: the requested outputs, in order, as graph values (see PartitionRunner.run for `placed` and
        `targets`)."""
        if self._closed:
            raise EpFailedPrecondition("the session is closed")
        names = self._io.output_names(output_names)
        options = None if run_options is None else self._foreign_options.read(run_options)
        if options is not None and options.adapters:
            input_feed = {**self._adapters.feeds(options.adapters), **input_feed}
            options = dataclasses.replace(options, adapters=[])
        variant = self._overrides.variant(input_feed) if self._overrides.names else None
        if variant is not None:
            return variant._execute(names, input_feed, options, placed, targets)
        values = self._io.feeds(input_feed, self._env.to_host)
        timeout = options.compute_timeout_s if options is not None and options.compute_timeout_s is not None \
            else self._timeout
        self._failures.counters["runs"] += 1
        return self._runner.run(next(self._runs), values, names, NO_DEADLINE_S if timeout == 0 else timeout,
                                placed, targets, options)

    # --- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._pid != os.getpid():
            # A forked child's copy: its partitions, workers and model files are the parent's, in use there.
            log.debug("closing a forked child's copy of a session: what it holds is left to the parent")
            return
        if self._async is not None:
            self._async.shutdown(wait=True)  # runs asked for before close still run, and call back
        if getattr(self, "_runner", None) is not None:
            self._runner.plan_for([], [], {})  # the runs' plans go, and the tensors they hold in workers
        if self._overrides is not None:
            self._overrides.close()
        if self._plan is not None:
            self._plan.release()

    def __enter__(self) -> "InferenceSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_closed", True) or self._pid != os.getpid():
            return
        # A finalizer runs wherever the garbage collector happens to run: inside another call of this thread,
        # with its locks held and its fast-lane connection waiting for a reply. Closing calls the workers, so it
        # runs on a thread of its own (this object lives on until that thread is done with it).
        if sys.is_finalizing():  # a thread started now would never run (and start() would wait for it)
            self._close_dropped()
            return
        try:
            threading.Thread(target=self._close_dropped, name="ephost-session-close", daemon=True).start()
        except RuntimeError:  # the interpreter is exiting and starts no thread: nothing else runs here now
            self._close_dropped()

    def _close_dropped(self) -> None:
        try:
            self.close()
        except Exception as e:  # its Environment may be closing under it; the workers release what it held
            log.debug("closing a dropped session: %s", e)
