"""ephost.InferenceSession, shaped like ONNX Runtime's (its SessionOptions: client/session_options.py).

A session asks each EP, in the order they were added, which nodes it takes (GetCapability, with the nodes
already taken marked), groups what each EP took into partitions that can be fused without a cycle, compiles
them on their EPs, and gives what nobody took to the in-process CPU fallback (client/fallback.py: ONNX
Runtime's CPU EP, then the reference evaluator for what ORT cannot run). A run goes
through the partitions in topological order; a value stays where it was made and is only copied when a
partition elsewhere reads it.
"""
from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import onnx

from ephost.errors import EpError, EpFailedPrecondition, EpInvalidArgument
from ephost.eps.base import ComputeCall, capability
from ephost.external_data import ExternalData, WorkerFile, check_inline_size, has_external_data, load_model
from ephost.v1 import worker_pb2
from ephost.graph import GraphIndex, prepare_model
from ephost.run_options import ForeignOptions, RunOptions
from ephost.tensor import Tensor
from ephost.types import HOST_MEMORY, MemoryInfo
from ephost.values import as_value, to_python
from ephost.client.devices import EpDevice
from ephost.client.failure_policy import FailurePolicy, FellBack
from ephost.client.feeds import FeedCheck, check_feed_names, shape_of, type_string
from ephost.client.fallback import CpuFallback
from ephost.client.context_model import ENABLE, CompiledPartition, ContextSettings, embed_files, write_context_model
from ephost.client.iobinding import IOBinding
from ephost.client.planner import Claim, Partition, Placement, plan_partitions
from ephost.client.profiler import Profiler
from ephost.client.runner import PartitionRunner
from ephost.client.session_options import SessionOptions
from ephost.client.steady import SteadyBinding, SteadyRun, signature, steady_plan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeArg:
    """A graph input or output, as ONNX Runtime's NodeArg: name, type ("tensor(float)") and shape."""

    name: str
    type: str
    shape: list


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


# gRPC takes a deadline in seconds, never none: a century stands for "no deadline" (compute_timeout_s=0).
NO_DEADLINE_S = 100 * 365 * 86400.0


def _deadline(timeout: float | None) -> float | None:
    return NO_DEADLINE_S if timeout == 0 else timeout


@dataclass(frozen=True)
class AssignedNode:
    name: str
    op_type: str
    domain: str


@dataclass(frozen=True)
class AssignedSubgraph:
    """One partition and the EP it runs on (ONNX Runtime's OrtEpAssignedSubgraph)."""

    ep_name: str
    registration: str
    nodes: tuple[AssignedNode, ...]

    def get_nodes(self) -> list[AssignedNode]:
        return list(self.nodes)


@dataclass(frozen=True)
class ModelOnWorker:
    """A model in a worker's model directory (`ephost worker --model-dir DIR`), by its path relative to that
    directory: the application gets its graph from the worker, and its weights never leave the worker's host.
    The nodes that read them must run on that worker."""

    registration: str
    path: str


def _from_worker(model: ModelOnWorker, env) -> tuple[onnx.ModelProto, ExternalData | None]:
    link = env.registration(model.registration).link
    if link is None:
        raise EpInvalidArgument(f"{model.registration!r} is hosted in this process; it has no model directory")
    reply = link.call(lambda c: c.worker.OpenModel, worker_pb2.ModelPath(path=model.path))
    loaded = onnx.load_model_from_string(reply.model)
    files = {f.name: WorkerFile(f.name, f.nbytes, model.registration, f.model_dir_path) for f in reply.files}
    external = ExternalData(files) if files else None
    if external is not None:
        external.check(loaded)
    return loaded, external


def _load(model, env=None) -> tuple[onnx.ModelProto, ExternalData | None]:
    """The model's graph, and its external data files (opened, checked, not read) where it has any."""
    external = None
    if isinstance(model, ModelOnWorker):
        loaded, external = _from_worker(model, env)
        what = f"model {model.path!r} of {model.registration!r}"
    elif isinstance(model, onnx.ModelProto):
        loaded, what = model, "the model"
        if has_external_data(loaded):
            raise EpInvalidArgument("the model's tensors keep their data in external files, and a ModelProto does "
                                    "not say where it was loaded from: give the model's path instead")
        check_inline_size(loaded)
    else:
        try:
            if isinstance(model, (bytes, bytearray, memoryview)):
                what = "the model bytes"
                loaded = onnx.load_model_from_string(bytes(model))
            else:
                what = f"model file {os.fspath(model)!r}"
                loaded, external = load_model(os.fspath(model))
        except EpError:
            raise
        except Exception as e:
            raise EpInvalidArgument(f"{what} is not a readable ONNX model ({type(e).__name__}: {e})") from None
        if external is None and has_external_data(loaded):
            raise EpInvalidArgument(f"{what} keeps tensors in external files, and bytes do not say where they were "
                                    "loaded from: give the model's path instead")
    if not loaded.HasField("graph") or not loaded.opset_import:
        raise EpInvalidArgument(f"{what} is not an ONNX model: it has no graph or no opset import")
    return loaded, external


class InferenceSession:
    def __init__(self, model, sess_options: SessionOptions | None = None, env=None,
                 providers: Iterable[str | tuple[str, Mapping[str, str]]] | None = None):
        if env is None:
            from ephost import get_default_environment
            env = get_default_environment()
        self._env = env
        self._closed = False
        self._pid = os.getpid()  # a forked child's copy is inert: the partitions are the parent's
        self._lock = threading.Lock()
        path = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
        model, self._external = _load(model, env)
        if self._external:
            log.info("read the graph (%d nodes); %d external data file(s), %.2f GiB, mapped where used, not read",
                     len(model.graph.node), len(self._external.files), self._external.nbytes / (1 << 30))
        # Compiled forms kept in files beside a context model are read into our prepared copy of it (after shape
        # inference, which need not see them): workers never read the application's files.
        self._model = embed_files(prepare_model(model), os.path.dirname(os.path.abspath(path)) if path else None)
        self._index = GraphIndex.of(self._model)
        # Kept for the session's life: a restarted worker gets the same descriptors again, nothing re-read.
        self._index.external = self._external
        graph = self._model.graph
        self._inputs = [i for i in graph.input if i.name not in self._index.initializers]
        # As ORT does: an input of optional type that is not fed is an empty optional (None).
        self._empty_optionals = {i.name: None for i in self._inputs
                                 if i.type.WhichOneof("value") == "optional_type"}
        self._feed_checks = {i.name: FeedCheck.of(i.name, i.type) for i in self._inputs}
        self._outputs = list(graph.output)
        self._output_names_known = dict.fromkeys(o.name for o in self._outputs)  # in order
        self._constants = {t.name: t for t in graph.initializer}

        options = sess_options or SessionOptions()
        self._options = options
        self._context = ContextSettings.of(options.session_config, path)
        self._timeout = options.compute_timeout_s
        self.ep_context_files: list[str] = []  # what ep.context_enable=1 wrote: the context model, its files
        self._launched: list[str] = []  # registrations this session made itself: unregistered when it closes
        self._runs = itertools.count(1)
        self._foreign_options = ForeignOptions()  # ORT's RunOptions objects runs were given, and their entries
        self._fallback = CpuFallback(options.fallback)
        self._failures = FailurePolicy(options.ep_failure_policy, self._link_of, self._fallback)
        self._eps: list[tuple[Any, Any]] = []  # (registration, ep), to release on close
        self._partitions: list[Partition] = []
        self._entries: list[tuple[list[EpDevice], dict[str, str]]] = []
        self._async: ThreadPoolExecutor | None = None
        self._steady = threading.local()  # each thread's steady run (client/steady.py), and its last feeds
        self._steady_plan: tuple[list[Partition] | None, bool] = (None, False)  # a plan, and whether it makes them
        self.profiler = Profiler(bool(options.enable_profiling), options.profile_file_prefix)
        self._runner = PartitionRunner(env, self._failures, self.profiler, self._link_of, self._constants,
                                       self._external)
        try:
            with self.profiler.span("Session", "session_initialization"):
                self._set_up(options.providers + self._provider_shortcuts(providers or []))
        except BaseException:
            self.close()
            raise

    def _set_up(self, entries) -> None:
        self._entries = entries
        self._partitions = self._partition(entries)
        self._runner.partitions = self._partitions
        self._compile()
        if self._context.enabled:
            self._write_context_model()

    @property
    def run_log(self):
        """What happened to failed calls, run by run (a bounded deque of dicts)."""
        return self._failures.run_log

    @property
    def failure_counters(self):
        return self._failures.counters

    def _link_of(self, registration: str):
        return self._env.registration(registration).link if self._env.is_registered(registration) else None

    # --- set-up -----------------------------------------------------------------------------------

    def _provider_shortcuts(self, providers) -> list[tuple[list[EpDevice], dict[str, str]]]:
        """`providers=["reference", "unix:///w.sock"]`: registration names, or targets registered under
        their own name in the session's Environment."""
        out = []
        for entry in providers:
            target, options = (entry, {}) if isinstance(entry, str) else entry
            if not self._env.is_registered(target):
                self._env.register_execution_provider_library(target, target)
                self._launched.append(target)
            devices = [d for d in self._env.get_ep_devices() if d.registration_name == target]
            out.append((devices, dict(options)))
        return out

    def _partition(self, entries) -> list[Partition]:
        claims: list[Claim] = []
        claimed: set[str] = set()
        for devices, options in entries:
            registration = self._env.registration_of(devices[0])
            log.info("asking %s which nodes it takes", registration.name)
            if self._context.enabled or self._options.keep_compiled:  # the EP hands over each compiled form
                options = {**options, ENABLE: "1"}
            try:
                ep = self._failures.guarded(registration.name, "CreateEp", lambda: registration.factory.create_ep(
                    [d.index for d in devices], options))
                self._eps.append((registration, ep))
                groups = self._failures.guarded(registration.name, "GetCapability",
                                                lambda: capability(ep, self._model, frozenset(claimed),
                                                                   self._external))
            except FellBack:
                continue
            claims.append(Claim(Placement(registration.name, devices[0].ep_name, ep), groups))
            claimed.update(n for g in groups for n in g.node_names)
        fallbacks = self._fallback.claims(self._model, frozenset(claimed), self._external) \
            if set(self._index.nodes) - claimed else []
        return plan_partitions(self._index, claims, fallbacks)

    def _compile(self) -> None:
        by_ep: dict[int, list[Partition]] = {}
        for p in self._partitions:
            by_ep.setdefault(id(p.placement.ep), []).append(p)
        for parts in by_ep.values():
            name, ep = parts[0].registration, parts[0].placement.ep
            if self._fallback.owns(parts[0].placement):
                for p in parts:  # ORT may still refuse a partition it claimed: the next fallback EP takes it
                    p.placement, p.compute_info = self._fallback.compile(p.graph, p.placement)
                continue
            log.info("compiling %d partition(s) on %s", len(parts), name)
            try:
                infos = self._failures.guarded(name, "Compile", lambda: ep.compile([p.graph for p in parts]))
                allocator = self._env.registration(name).session_allocator()
            except FellBack:
                for p in parts:
                    self._failures.to_fallback(p)
                continue
            for p, info in zip(parts, infos):
                p.compute_info, p.allocator = info, allocator
            log.info("compiled %d partition(s) on %s", len(parts), name)

    def _write_context_model(self) -> None:
        """The model with each partition an EP compiled as an EPContext node carrying its compiled form; what
        the fallback runs, and partitions of EPs that make no compiled form, keep their nodes."""
        kept = []
        for p in self._partitions:
            context = None if self._fallback.owns(p.placement) else getattr(p.compute_info, "ep_context", None)
            kept.append(CompiledPartition(p.graph, p.placement.ep_name, context))
        self.ep_context_files = write_context_model(self._index, kept, self._context)

    # --- ONNX Runtime's session API ------------------------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        return [NodeArg(i.name, type_string(i.type), shape_of(i.type)) for i in self._inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [NodeArg(o.name, type_string(o.type), shape_of(o.type)) for o in self._outputs]

    def get_providers(self) -> list[str]:
        """The session's EPs by name, in order of preference, the fallback's last (ORT lists its CPU EP last)."""
        names = [devices[0].ep_name for devices, _ in self._entries]
        names += [p.ep_name for p in self._fallback.placements]
        return list(dict.fromkeys(names))

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        """Each EP's options by EP name, as ONNX Runtime's get_provider_options."""
        out: dict[str, dict[str, str]] = {}
        for devices, options in self._entries:
            out.setdefault(devices[0].ep_name, dict(options))
        for p in self._fallback.placements:
            out.setdefault(p.ep_name, {})
        return out

    def get_session_options(self) -> SessionOptions:
        return self._options

    def get_modelmeta(self) -> ModelMetadata:
        m = self._model
        return ModelMetadata(m.producer_name, m.graph.name, m.domain, m.doc_string, m.graph.doc_string,
                             m.model_version, {p.key: p.value for p in m.metadata_props})

    def set_providers(self, providers: Sequence[str | tuple[str, Mapping[str, str]]] | None = None,
                      provider_options: Sequence[Mapping[str, str]] | None = None) -> None:
        """Partition and compile again on other EPs (ORT's set_providers: the session is made again). Providers
        are registration names or targets, as `providers=` takes them, or (name, options); ORT's own
        "CPUExecutionProvider" names the fallback, which is always last. None: the SessionOptions' devices."""
        if self._closed:
            raise EpFailedPrecondition("the session is closed")
        providers = list(providers or [])
        if provider_options is not None:
            if len(provider_options) != len(providers) or any(not isinstance(p, str) for p in providers):
                raise EpInvalidArgument("provider_options needs one dict per provider, and providers given as names")
            providers = [(p, dict(o)) for p, o in zip(providers, provider_options)]
        fallback_names = {p.ep_name for p in self._fallback.placements}
        providers = [p for p in providers if (p if isinstance(p, str) else p[0]) not in fallback_names]
        with self._lock:
            old_launched = list(self._launched)
            self._release_eps()
            self._eps, self._partitions = [], []
            self._set_up(self._options.providers + self._provider_shortcuts(providers))
        for name in old_launched:  # workers launched for providers no longer used
            if name not in {p if isinstance(p, str) else p[0] for p in providers}:
                self._launched.remove(name)
                self._unregister(name)

    def get_profiling_start_time_ns(self) -> int:
        """When profiling started, in time.monotonic_ns() terms (0 when SessionOptions.enable_profiling is off)."""
        return self.profiler.start_time_ns

    def end_profiling(self) -> str:
        """Stop profiling and write what was recorded as Chrome trace JSON; the file's name ('' when off)."""
        return self.profiler.end()

    def get_provider_graph_assignment_info(self) -> list[AssignedSubgraph]:
        nodes = self._index.nodes
        return [AssignedSubgraph(p.placement.ep_name, p.registration, tuple(
            AssignedNode(n, nodes[n].op_type, nodes[n].domain) for n in p.graph.nodes)) for p in self._partitions]

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[Any]:
        """The outputs as numpy arrays (lists, None or dicts for non-tensor values). Feeds may be numpy arrays,
        ephost.Tensors in any memory (a tensor in a worker's memory is read there by a partition of that worker), or
        lists (made into arrays of the input's element type, as ONNX Runtime makes them)."""
        record = None
        options = None if run_options is None else self._foreign_options.read(run_options)
        if options is None or options.plain:  # (ORT-style code that passes the same RunOptions to every run)
            outputs = self._run_steady(output_names, input_feed, options)
            if outputs is not None:
                return outputs
            record = self._steady_record(input_feed)
        outputs = [to_python(v) for v in self._execute(output_names, input_feed, options, record=record)]
        if record is not None:  # this run's feeds are those of the last run on this thread (local.last)
            local = self._steady
            local.run = SteadyRun.of(self._partitions, output_names, self._output_names(output_names), local.last,
                                     record)
            if local.run is None:  # (a plan or a call that makes none: tried again every other run, not every run)
                local.last = None
        return outputs

    def _run_steady(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
                    options: RunOptions | None = None) -> list[Any] | None:
        """The run, where the calling thread's steady run makes it (client/steady.py); else None. With RunOptions
        (plain ones) only a steady run of one partition, not terminated: one of several would not read the
        terminate flag between its partitions."""
        steady = getattr(self._steady, "run", None)
        if steady is None or self._closed or self.profiler.enabled:
            return None
        if options is not None and (len(steady.steps) > 1 or options.terminated):
            return None
        arrays = steady.arrays(self._partitions, output_names, input_feed)
        if arrays is None:
            return None
        timeout = _deadline(self._timeout)
        outcome = steady.run(arrays, timeout)
        if outcome is None:  # it no longer repeats (nothing ran): the general path, which makes a new one
            self._steady.run = None
            return None
        self._failures.counters["runs"] += 1
        run = next(self._runs)
        values, done = outcome.values, outcome.done
        if outcome.held:  # every value as made
            return steady.outputs(values)
        self._steady.run = None
        if outcome.error is not None:  # as the general path's Compute: the failure policy's to answer
            p = steady.steps[done].partition
            values.extend(self._runner.recover(run, p, ComputeCall(steady.inputs(values, done), p.allocator, p.keep,
                                                                   timeout=timeout), outcome.error))
            done += 1
        # The rest of the run on the general path, from where the steady run stopped
        names = self._output_names(output_names)
        return [to_python(v) for v in self._runner.run(run, steady.named(values), names, timeout, {}, {}, done)]

    def _steady_record(self, input_feed: Mapping[str, Any]) -> list | None:
        """Before a run on the general path: a list for the runner to record the partitions' calls in, where
        this run's feeds have the types and shapes of the one before it on this thread and the plan makes steady
        runs (client/steady.py); else None."""
        if self.profiler.enabled or self._empty_optionals:
            return None
        partitions = self._partitions
        if self._steady_plan[0] is not partitions:
            self._steady_plan = (partitions, steady_plan(partitions))
        if not self._steady_plan[1]:
            return None
        local = self._steady
        feeds = signature(input_feed)
        if feeds is None or feeds != getattr(local, "last", None):
            local.last = feeds
            return None
        return []

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

    def run_with_ort_values(self, output_names: Sequence[str] | None, input_dict_ort_values: Mapping[str, Any],
                            run_options: Any = None) -> list[Any]:
        """ORT's run_with_ort_values: the outputs as ephost.Tensors, left where the partitions made them (in a
        worker's memory, not copied to the application; `numpy()` reads a worker's shared memory in place)."""
        names = self._output_names(output_names)
        return self._execute(names, input_dict_ort_values, run_options, dict.fromkeys(names))

    def io_binding(self) -> IOBinding:
        """An IOBinding of this session (ORT's session.io_binding())."""
        return IOBinding(self)

    def run_with_iobinding(self, iobinding: IOBinding, run_options: Any = None) -> None:
        """Run with the inputs and outputs bound in `iobinding`; its get_outputs() then holds the outputs where
        they were bound. Outputs bound to an EP's memory are left there by the partition that makes them."""
        if iobinding.session is not self:
            raise EpInvalidArgument("the IOBinding belongs to another session; make one with session.io_binding()")
        options = None if run_options is None else self._foreign_options.read(run_options)
        # (a steady IOBinding run is of one partition: it reads the terminate flag as it starts, as the general
        # path does before each partition)
        steady = options is None or (options.plain and not options.terminated)
        if steady and self._run_bound_steady(iobinding):
            return
        outputs = iobinding.bound_outputs()
        if not outputs:
            raise EpInvalidArgument("no output is bound; bind_output(name, ...) at least one")
        placed = {n: b.memory for n, b in outputs.items() if b.memory != HOST_MEMORY}
        targets = {n: b.tensor for n, b in outputs.items() if b.tensor is not None}
        names = list(outputs)
        # A plan of one partition: a steady run may be made of this one
        record = [] if steady and len(self._partitions) == 1 \
            and not self.profiler.enabled and not self._empty_optionals else None
        results = self._execute(names, iobinding.bound_inputs(), options, placed, targets, record=record)
        iobinding.set_results(dict(zip(names, results)))
        if record is not None:
            self._steady.binding = SteadyBinding.of(self._partitions, iobinding, names, record)

    def _run_bound_steady(self, iobinding: IOBinding) -> bool:
        """Run with `iobinding` as the calling thread's steady IOBinding run makes it (client/steady.py,
        SteadyBinding), where it does; False where it does not (nothing ran)."""
        steady = getattr(self._steady, "binding", None)
        if steady is None or self._closed or self.profiler.enabled:
            return False
        bound = steady.bound(self._partitions, iobinding)
        if bound is None:
            return False
        inputs, targets = bound
        checks = self._feed_checks
        for name, value in zip(steady.names, inputs):  # as the general path checks them: its errors, not an EP's
            check = checks.get(name)
            if check is not None:
                check(value)
        timeout = _deadline(self._timeout)
        run = next(self._runs)
        try:
            outputs = steady.compute(inputs, timeout, targets)
        except EpError as error:  # as the general path's Compute: the failure policy's to answer
            self._steady.binding = None
            self._failures.counters["runs"] += 1
            p = steady.partition
            outputs = self._runner.recover(run, p, ComputeCall(inputs, p.allocator, p.keep, timeout=timeout), error)
        else:
            if outputs is None:  # it no longer repeats so (nothing ran): the general path, which makes a new one
                self._steady.binding = None
                return False
            self._failures.counters["runs"] += 1
        iobinding.set_results(steady.results(outputs))
        return True

    def _output_names(self, output_names: Sequence[str] | None) -> list[str]:
        known = self._output_names_known
        if not output_names:
            return list(known)
        names = list(output_names)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise EpInvalidArgument(f"unknown output name(s) {unknown}; the model's outputs are {sorted(known)}")
        return names

    def _execute(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: Any,
                 placed: Mapping[str, MemoryInfo | None] | None = None,
                 targets: Mapping[str, Tensor] | None = None, record: list | None = None) -> list[Any]:
        """One run: the requested outputs, in order, as graph values (see PartitionRunner.run for `placed`,
        `targets` and `record`)."""
        if self._closed:
            raise EpFailedPrecondition("the session is closed")
        names = self._output_names(output_names)
        values = self._feeds(input_feed)
        options = None if run_options is None else self._foreign_options.read(run_options)
        timeout = _deadline(options.compute_timeout_s if options is not None
                            and options.compute_timeout_s is not None else self._timeout)
        self._failures.counters["runs"] += 1
        return self._runner.run(next(self._runs), values, names, timeout, placed or {}, targets or {},
                                record=record, options=options)

    @property
    def environment(self):
        """The Environment this session's EPs are registered in."""
        return self._env

    def _feeds(self, input_feed: Mapping[str, Any]) -> dict[str, Any]:
        checks = self._feed_checks
        if self._empty_optionals:
            input_feed = {**self._empty_optionals, **input_feed}
        if input_feed.keys() != checks.keys():  # the common case, every input fed and nothing else, is known
            check_feed_names(checks, self._constants, input_feed)
        values = {}
        for name, value in input_feed.items():
            check = checks.get(name)
            if check is not None:
                if type(value) is list:
                    value = check.from_list(value)
                check(value)
            value = as_value(value)
            if isinstance(value, Tensor) and not value.addressable and value.buffer.owner is None:
                value = self._env.to_host(value)
            values[name] = value
        return values

    # --- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._steady = threading.local()  # what the steady runs hold (their threads' connections) goes now
        if self._pid != os.getpid():
            # A forked child's copy: its partitions, workers and model files are the parent's, in use there.
            log.debug("closing a forked child's copy of a session: what it holds is left to the parent")
            return
        if getattr(self, "_async", None) is not None:
            self._async.shutdown(wait=True)  # runs asked for before close still run, and call back
        self._release_eps()
        if getattr(self, "_external", None) is not None:
            self._external.close()  # workers hold their own descriptors; ORT its own mappings
        for name in getattr(self, "_launched", []):  # workers this session launched are its own
            self._unregister(name)

    def _release_eps(self) -> None:
        for registration, ep in getattr(self, "_eps", []):
            infos = [p.compute_info for p in getattr(self, "_partitions", [])
                     if p.placement.ep is ep and p.compute_info is not None]
            try:
                if infos:
                    ep.release_node_compute_infos(infos)
                registration.factory.release_ep(ep)
            except Exception as e:  # the worker may be gone; what it held went with it
                log.debug("releasing %s's partitions failed: %s", registration.name, e)

    def _unregister(self, name: str) -> None:
        try:
            self._env.unregister_execution_provider_library(name)
        except EpError as e:
            log.debug("unregistering %s: %s", name, e)

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
