"""One run of a session's partitions, in topological order: each partition's inputs made readable where it
runs, its Compute under the failure policy, values let go of once no later partition reads them, and the
outputs labelled as the Environment names their memory. Outputs an IOBinding places in an EP's memory are kept
there by the partition that makes them (`placed`), written into bound tensors where the EP can (`targets`), and
not brought to this process when nothing here reads them."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from onnx import numpy_helper

from ephost.errors import EpCancelled, EpError, EpInvalidArgument
from ephost.external_data import ExternalData, external_ref
from ephost.run_options import TERMINATED, RunOptions
from ephost.tensor import Tensor
from ephost.types import HOST_MEMORY, MemoryInfo
from ephost.values import as_value
from ephost.eps.base import ComputeCall
from ephost.client.handles import owned
from ephost.client.planner import Partition


class PartitionRunner:
    """Runs the partitions of one session (set `partitions` whenever they are planned again)."""

    def __init__(self, env, failures, profiler, link_of: Callable[[str], Any], constants: Mapping[str, Any],
                 external: ExternalData | None = None):
        """`constants`: initializers that are graph outputs; `external`: the files those kept outside name."""
        self._env, self._failures, self.profiler, self._link_of = env, failures, profiler, link_of
        self._constants, self._external = constants, external
        self._partitions: list[Partition] = []
        self._read: frozenset[str] = frozenset()
        self._made_by: dict[str, str] = {}

    @property
    def partitions(self) -> list[Partition]:
        return self._partitions

    @partitions.setter
    def partitions(self, partitions: list[Partition]) -> None:
        self._partitions = partitions
        self._read = frozenset(v for p in partitions for v in p.graph.inputs)  # values some partition reads
        self._made_by = {v: p.registration for p in partitions for v in p.graph.outputs}  # value -> its maker

    def run(self, run: int, values: dict[str, Any], names: Sequence[str], timeout: float | None,
            placed: Mapping[str, MemoryInfo | None], targets: Mapping[str, Tensor],
            options: RunOptions | None = None) -> list[Any]:
        """The values of `names` after one run from the feeds in `values`. `placed` names outputs to leave in an
        EP's memory (its MemoryInfo; None: wherever they are made): the partition of that EP that makes one
        keeps it there rather than sending it back. `targets`: outputs to write into these tensors where the EP
        that makes them can (a worker, into its own memory). `options`: the run's RunOptions
        (its terminate flag is read before each partition; what an EP reads of them goes with each Compute)."""
        keep = set(names)
        owners = {n: None if m is None else self._env.owner_of(m) for n, m in placed.items()} if placed else {}
        if self.profiler.enabled:
            with self.profiler.span("Session", "model_run", run=run):
                self._run_partitions(run, values, keep, owners, timeout, targets, options)
        else:
            self._run_partitions(run, values, keep, owners, timeout, targets, options)
        for n in names:
            if n not in values and n in self._constants:
                t = self._constants[n]
                values[n] = as_value(self._external.array(t).copy() if external_ref(t) is not None
                                     else numpy_helper.to_array(t))
        made_by = self._made_by
        if len(names) == 1:
            return [self._labelled(values[names[0]], made_by.get(names[0]))]
        labelled: dict[int, Any] = {}  # one relabelled tensor per value, whatever the names it goes by
        for n in names:
            value = values[n]
            if id(value) not in labelled:
                labelled[id(value)] = self._labelled(value, made_by.get(n))
        return [labelled[id(values[n])] for n in names]

    def _run_partitions(self, run: int, values: dict[str, Any], keep: set[str], owners: Mapping[str, Any],
                        timeout: float | None, targets: Mapping[str, Tensor], options: RunOptions | None) -> None:
        profiling = self.profiler.enabled
        to_eps = options.for_eps() if options is not None else None
        for p in self._partitions:
            if options is not None and options.terminated:
                raise EpCancelled(TERMINATED)
            inputs = [self._reachable(values[v], p) for v in p.graph.inputs]
            if profiling:
                call = "Compute" if self._link_of(p.registration) is not None else "in process"
                with self.profiler.span("Node", p.graph.name, run=run, nodes=len(p.graph.nodes),
                                        ep=p.placement.ep_name, registration=p.registration, call=call):
                    outputs = self._compute(run, p, inputs, owners, targets, timeout, to_eps)
            else:
                outputs = self._compute(run, p, inputs, owners, targets, timeout, to_eps)
            if len(outputs) != len(p.graph.outputs):
                raise EpInvalidArgument(f"{p.graph.name} made {len(outputs)} outputs, not {len(p.graph.outputs)}")
            values.update(zip(p.graph.outputs, outputs))
            for v in p.last_reads:  # let go of values no later partition reads
                if v not in keep:
                    values.pop(v, None)

    def _compute(self, run: int, p: Partition, inputs: list, owners: Mapping[str, Any],
                 targets: Mapping[str, Tensor], timeout: float | None, to_eps=None) -> list[Any]:
        """Partition `p`'s outputs, under the failure policy."""
        kept = self._kept(p, owners)
        call = ComputeCall(inputs, p.allocator, kept, run_options=to_eps, timeout=timeout)
        if targets:
            into = {i: targets[v] for i, v in enumerate(p.graph.outputs) if v in targets}
            if into:
                call.into = into
        if len(kept) > len(p.keep):
            # Placed outputs no partition reads need not come to this process at all.
            call.leave = tuple(i for i in kept if i not in p.keep and p.graph.outputs[i] not in self._read)
        try:
            return p.compute_info.compute(call)
        except EpError as error:
            return self.recover(run, p, call, error)

    def recover(self, run: int, p: Partition, call: ComputeCall, error: EpError) -> list[Any]:
        """Partition `p`'s outputs after its Compute (`call`) failed with `error`, as the failure policy says (a
        session's steady run's too)."""
        with self.profiler.span("Fallback", f"{p.graph.name} after {type(error).__name__}", run=run,
                                policy=self._failures.policy):
            return self._failures.recover(run, p, self._partitions, call, error)

    def _kept(self, p: Partition, owners: Mapping[str, Any]) -> tuple[int, ...]:
        """Outputs of `p` to leave in its EP's memory: those a later partition there reads, and graph outputs
        placed there for this run."""
        if not owners or p.allocator is None:
            return p.keep
        registration = self._env.registration(p.registration) if self._env.is_registered(p.registration) else None
        extra = [i for i, v in enumerate(p.graph.outputs)
                 if v in owners and owners[v] in (None, registration) and i not in p.keep]
        return p.keep + tuple(extra) if extra else p.keep

    def _reachable(self, value: Any, p: Partition) -> Any:
        """`value` as partition `p` can read it: a tensor in a worker's memory that neither this process nor
        p's EP can address comes to the application first."""
        if not isinstance(value, Tensor) or value.addressable:
            return value
        link = self._link_of(p.registration)
        if link is not None and owned(value.buffer, link):
            return value
        with self.profiler.span("Copy", f"to the host for {p.graph.name}", bytes=value.nbytes,
                                src=value.memory_info.name, dst=HOST_MEMORY.name):
            return self._env.to_host(value)

    def _labelled(self, value: Any, registration: str | None) -> Any:
        """A tensor an EP made, labelled with the MemoryInfo users know its memory by (the Environment's)."""
        if not isinstance(value, Tensor) or registration is None or value.memory_info is HOST_MEMORY \
                or value.memory_info == HOST_MEMORY \
                or not self._env.is_registered(registration):
            return value
        label = self._env.registration(registration).qualified(value.memory_info)
        if label is not value.memory_info:
            value.relabel(label)
        return value
