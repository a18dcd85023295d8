"""The run driver: one run of a session's partitions, in topological order, for plain runs, IOBinding runs and
run_async alike. A run follows a RunPlan (its steps read their inputs from a list of the run's values by position,
and each value goes once no later step reads it), makes each partition's Compute under the failure policy, and
labels the outputs as the Environment names their memory. Outputs an IOBinding places in an EP's memory are kept
there by the partition that makes them, written into bound tensors where the EP can, and not brought to this
process when nothing here reads them.

Where a partition's EP is reached through a transport that keeps calls (a worker's fast lane), the step holds the
call as the transport keeps it on the calling thread (NodeComputeInfo.prepare), and the next runs repeat it
straight; a held call that no longer applies says so, and the step makes the call through compute again."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from onnx import numpy_helper

from ephost import tracing
from ephost.errors import EpCancelled, EpError, EpInvalidArgument
from ephost.external_data import ExternalData, external_ref
from ephost.run_options import TERMINATED, RunOptions
from ephost.tensor import Tensor
from ephost.types import HOST_MEMORY, MemoryInfo
from ephost.values import as_value
from ephost.eps.base import ComputeCall
from ephost.client.feeds import passed_through
from ephost.client.handles import owned
from ephost.client.planner import Partition

MAX_PLANS = 16  # run plans a session keeps (by asked outputs and their placement); past it, made again
_NONE: Mapping[str, Any] = {}  # never written to
_NO_TARGETS: Mapping[int, Tensor] = {}  # never written to


@dataclass(frozen=True, slots=True)
class Step:
    """One partition in a run plan: where its inputs are among the run's values, where its outputs go (`places`:
    a slice of them, in order), the outputs placed in its EP's memory for this run beyond its own `keep` (`placed`:
    positions among its outputs; `leave`: those of them nothing in this process reads), the values no one
    reads after it (`drop`), and the outputs it keeps in its EP's memory for a later partition there that the run
    does not hand out, of a shape known before it runs (`scratch`: (position, shape, dtype, whether a partition
    elsewhere reads it too) each): they are written into tensors there that the plan holds for each thread, the
    same every run, where this process maps that memory or only partitions of that EP read them."""
    index: int
    partition: Partition
    sources: tuple[int, ...]
    places: slice
    placed: tuple[int, ...]
    leave: tuple[int, ...]
    drop: tuple[int, ...]
    scratch: tuple[tuple[int, tuple[int, ...], Any, bool], ...]
    link: Any  # the partition's worker's (None: in this process)
    count: int  # how many outputs the partition makes
    keep: tuple[int, ...]  # its `keep` and `placed`: what its EP keeps where it has an allocator


class RunPlan:
    """How the partitions run for one set of asked outputs and placements (see the module's docstring); the
    calls each thread's steps hold, in `held()`."""

    def __init__(self, partitions: Sequence[Partition], feeds: Sequence[str], names: Sequence[str],
                 owners: Mapping[str, Any], registration_of: Callable[[str], Any],
                 shapes: Mapping[str, tuple[tuple[int, ...], Any]], link_of: Callable[[str], Any]):
        position = {name: i for i, name in enumerate(feeds)}
        read = {v for p in partitions for v in p.graph.inputs}
        readers: dict[str, list[Partition]] = {}
        for p in partitions:
            for v in p.graph.inputs:
                readers.setdefault(v, []).append(p)
        last = {v: k for k, p in enumerate(partitions) for v in p.graph.inputs}  # the last step reading a value
        asked = set(names)
        steps, made = [], {}
        for k, p in enumerate(partitions):
            sources = tuple(position[v] for v in p.graph.inputs)
            first = len(position)
            for v in p.graph.outputs:
                position[v] = len(position)
            registration = registration_of(p.registration) if owners else None
            placed = tuple(i for i, v in enumerate(p.graph.outputs)
                           if v in owners and owners[v] in (None, registration) and i not in p.keep)
            leave = tuple(i for i in placed if p.graph.outputs[i] not in read)  # not brought to this process
            drop = tuple(position[v] for v in dict.fromkeys(p.graph.inputs) if last[v] == k and v not in asked)
            scratch = tuple((i, *shapes[v], any(q.registration != p.registration for q in readers[v]))
                            for i, v in ((i, p.graph.outputs[i]) for i in p.keep) if v not in asked and v in shapes)
            steps.append(Step(k, p, sources, slice(first, len(position)), placed, leave, drop, scratch,
                              link_of(p.registration), len(p.graph.outputs), p.keep + placed))
            made.update((v, p.registration) for v in p.graph.outputs)
        self.steps = steps
        self.size = len(position)
        self.made = [None] * (self.size - len(feeds))  # the places of the values the steps make, after the feeds
        # Each asked output: its name, its place among the values (None: a constant, an initializer asked for),
        # and the registration that makes it (None: a graph input)
        self.outputs = [(n, position.get(n), made.get(n)) for n in names]
        self.local = threading.local()  # the calling thread's held calls (`held`)

    def held(self) -> list:
        """The calling thread's held calls, one place per step (None: none held)."""
        held = getattr(self.local, "held", None)
        if held is None:
            held = self.local.held = [None] * len(self.steps)
            self.local.scratch = [None] * len(self.steps)
        return held

    def scratch(self, step: Step) -> dict[int, Tensor]:
        """The calling thread's tensors its step writes its scratch outputs into, in the memory of the worker of
        the step's link that runs now (made again for a new one: they are made on one connection, `link.current`)."""
        p, link = step.partition, step.link
        held = self.local.scratch[step.index]
        if held is not None and held[0] is link.current:
            return held[1]
        mapped = p.allocator.memory_info.host_accessible  # (read here by partitions elsewhere)
        try:
            made = {i: Tensor.empty(shape, dtype, p.allocator) for i, shape, dtype, elsewhere in step.scratch
                    if mapped or not elsewhere}
        except EpError:  # the worker is away: its outputs go to new buffers this run, under the policy
            return {}
        self.local.scratch[step.index] = (link.current, made)
        return made


def compute_held(info, call: ComputeCall, held: list, at: int) -> list[Any]:
    """`info`'s outputs for `call`: the call held at `held[at]` repeated where it still applies, else made through
    compute, after which the transport's kept call for it is held there (compute_and_hold)."""
    kept = held[at]
    if kept is not None and kept.info is info:
        outputs = kept(call)
        if outputs is not None:
            return outputs
    return compute_and_hold(info, call, held, at)


def compute_and_hold(info, call: ComputeCall, held: list, at: int) -> list[Any]:
    """`info`'s outputs for `call`, made through compute; the transport's kept call for it is held at `held[at]`
    after (where there is one: info.prepare)."""
    outputs = info.compute(call)
    prepare = getattr(info, "prepare", None)
    held[at] = prepare(call) if prepare is not None else None
    return outputs


def _call(step: Step, inputs: list, into: Mapping[int, Tensor], run_options, timeout: float | None) -> ComputeCall:
    """A step's Compute: outputs kept in its EP's memory where it has an allocator (else all to the host)."""
    allocator = step.partition.allocator
    if allocator is None:
        return ComputeCall(inputs, None, step.partition.keep, into, (), run_options, timeout)
    return ComputeCall(inputs, allocator, step.keep, into, step.leave, run_options, timeout)


class PartitionRunner:
    """Runs the partitions of one session (set `partitions` whenever they are planned again)."""

    def __init__(self, env, failures, profiler, link_of: Callable[[str], Any], constants: Mapping[str, Any],
                 external: ExternalData | None = None):
        """`constants`: the model's initializers (some may be asked for as outputs); `external`: the files those
        kept outside name."""
        self._env, self._failures, self.profiler, self._link_of = env, failures, profiler, link_of
        self._constants, self._external = constants, external
        self._partitions: list[Partition] = []
        self._feeds: list[str] = []
        self._shapes: Mapping[str, tuple[tuple[int, ...], Any]] = {}
        self._plans: dict = {}
        self._plans_lock = threading.Lock()  # guards changes to _plans (runs read it without the lock)

    @property
    def partitions(self) -> list[Partition]:
        return self._partitions

    def plan_for(self, partitions: list[Partition], feeds: Sequence[str],
                 shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> None:
        """Run these partitions from now on, fed the graph inputs `feeds` (in this order); `shapes`: the values
        whose shape and type are known before a run (shape, dtype)."""
        with self._plans_lock:
            self._partitions, self._feeds, self._shapes, self._plans = partitions, list(feeds), shapes, {}

    def _plan(self, key: tuple, names: Sequence[str], owners: Mapping[str, Any]) -> RunPlan:
        """A new plan for the runs `key` names (see run)."""
        plan = RunPlan(self._partitions, self._feeds, names, owners, self._registration, self._shapes,
                       self._link_of)
        with self._plans_lock:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _registration(self, name: str):
        return self._env.registration(name) if self._env.is_registered(name) else None

    def run(self, run: int, feeds: list[Any], names: tuple[str, ...], timeout: float | None,
            placed: Mapping[str, MemoryInfo | None] | None = None, targets: Mapping[str, Tensor] | None = None,
            options: RunOptions | None = None) -> list[Any]:
        """The values of `names` after one run from `feeds` (the graph inputs' values, in plan_for's order).
        `placed` names outputs to leave in an EP's memory (its MemoryInfo; None: wherever they are made): the
        partition of that EP that makes one keeps it there rather than sending it back. `targets`: outputs to
        write into these tensors where the EP that makes them can (a worker, into its own memory). `options`: the
        run's RunOptions (its terminate flag is read before each partition; what an EP reads of them goes with
        each Compute)."""
        if placed:
            owners = {n: None if m is None else self._env.owner_of(m) for n, m in placed.items()}
            key = (names, tuple((n, id(o)) for n, o in owners.items()))
        else:
            owners, key = _NONE, names
        plan = self._plans.get(key) or self._plan(key, names, owners)
        values = feeds + plan.made
        if self.profiler.enabled:
            with self.profiler.span("Session", "model_run", run=run):
                self._steps(run, plan, values, timeout, targets, options, True)
        elif tracing.active():
            with tracing.span("ephost.run", {"ephost.run": run, "ephost.partitions": len(plan.steps)}):
                self._steps(run, plan, values, timeout, targets, options, True)
        else:
            self._steps(run, plan, values, timeout, targets, options, False)
        out = []
        for name, at, maker in plan.outputs:
            if at is None:
                out.append(self._constant(name))
                continue
            value = values[at]
            if maker is None:  # a graph input asked for as an output: a copy, as ORT gives it
                value = passed_through(value)
            elif type(value) is Tensor and value.memory_info is not HOST_MEMORY:
                self._label(value, maker)
            out.append(value)
        return out

    def _steps(self, run: int, plan: RunPlan, values: list, timeout: float | None, targets: Mapping[str, Tensor],
               options: RunOptions | None, watched: bool) -> None:
        """The plan's steps, each partition's outputs put among `values`; `watched`: the run is profiled or
        traced (each partition's call gets a span of its own)."""
        to_eps = options.for_eps() if options is not None else None
        repeats = to_eps is None and not watched  # a held call is repeated (else a span, or RunOptions, go along)
        held = plan.held()
        for step in plan.steps:
            if options is not None and options.terminated:
                raise EpCancelled(TERMINATED)
            p = step.partition
            inputs = []
            for i in step.sources:  # (a loop, not a comprehension: one Python call fewer)
                value = values[i]
                if type(value) is Tensor and not value.addressable:
                    value = self._reachable(value, p)
                inputs.append(value)
            into = plan.scratch(step) if step.scratch and step.link is not None \
                and p.allocator is not None else _NO_TARGETS
            if targets:
                bound = {i: targets[v] for i, v in enumerate(p.graph.outputs) if v in targets}
                if bound:
                    into = {**into, **bound}
            # The call held for this step repeated (a plain run's: no RunOptions, no span), else made through
            # compute, which holds the call anew
            kept = held[step.index]
            outputs = call = None
            try:
                if kept is not None and repeats and kept.info is p.compute_info:
                    outputs = kept.repeat(inputs, into, timeout)
                if outputs is None:
                    call = _call(step, inputs, into, to_eps, timeout)
                    if watched:
                        outputs = self._watched(run, step, call, held)
                    else:
                        outputs = compute_and_hold(p.compute_info, call, held, step.index)
            except EpError as error:  # the failure policy's to answer
                held[step.index] = None
                outputs = self.recover(run, p, call or _call(step, inputs, into, to_eps, timeout), error)
            if len(outputs) != step.count:
                raise EpInvalidArgument(f"{p.graph.name} made {len(outputs)} outputs, not {step.count}")
            values[step.places] = outputs
            for at in step.drop:  # let go of values no later partition reads
                values[at] = None

    def _watched(self, run: int, step: Step, call: ComputeCall, held: list) -> list[Any]:
        """A step's call in a profiled or traced run: in a span of its own."""
        p = step.partition
        if self.profiler.enabled:
            kind = "Compute" if self._link_of(p.registration) is not None else "in process"
            with self.profiler.span("Node", p.graph.name, run=run, nodes=len(p.graph.nodes),
                                    ep=p.placement.ep_name, registration=p.registration, call=kind):
                return compute_held(p.compute_info, call, held, step.index)
        if tracing.recording():  # whole, carrying the trace context: not the held call's repeat
            held[step.index] = None
            with self._traced(p):
                return compute_held(p.compute_info, call, held, step.index)
        return compute_held(p.compute_info, call, held, step.index)

    def _traced(self, p: Partition):
        """The span of partition `p`'s call (a call to another process where its EP is in a worker)."""
        return tracing.span("ephost.partition", {"ephost.partition": p.graph.name, "ephost.registration":
                                                 p.registration, "ephost.ep": p.placement.ep_name,
                                                 "ephost.nodes": len(p.graph.nodes)},
                            client=self._link_of(p.registration) is not None)

    def recover(self, run: int, p: Partition, call: ComputeCall, error: EpError) -> list[Any]:
        """Partition `p`'s outputs after its Compute (`call`) failed with `error`, as the failure policy says."""
        with self.profiler.span("Fallback", f"{p.graph.name} after {type(error).__name__}", run=run,
                                policy=self._failures.policy):
            return self._failures.recover(run, p, self._partitions, call, error)

    def _reachable(self, value: Tensor, p: Partition) -> Any:
        """A tensor this process cannot address as partition `p` can read it: named by handle where it is in the
        memory of p's worker, else brought to the application first, a call to the worker that holds it under
        the failure policy as a Compute is (a worker gone with the value leaves no fallback to read it)."""
        link = self._link_of(p.registration)
        if link is not None and owned(value.buffer, link):
            return value
        holder = self._env.owner_of(value.memory_info)
        with self.profiler.span("Copy", f"to the host for {p.graph.name}", bytes=value.nbytes,
                                src=value.memory_info.name, dst=HOST_MEMORY.name):
            return self._failures.guarded(holder.name, f"a copy to the host for {p.graph.name}",
                                          lambda: self._env.to_host(value), falls_back=False)

    def _constant(self, name: str) -> Any:
        """An initializer asked for as an output, as a value of its own."""
        t = self._constants[name]
        return as_value(self._external.array(t).copy() if external_ref(t) is not None else numpy_helper.to_array(t))

    def _label(self, value: Tensor, registration: str) -> None:
        """A tensor an EP made, labelled with the MemoryInfo users know its memory by (the Environment's)."""
        if value.memory_info == HOST_MEMORY or not self._env.is_registered(registration):
            return
        label = self._env.registration(registration).qualified(value.memory_info)
        if label is not value.memory_info:
            value.relabel(label)
