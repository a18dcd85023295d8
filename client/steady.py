"""A session's steady run: a run made again as the last one went, without the general path's walk.

Where every partition of a session's plan runs in a worker on this host or in this process, each remote
partition's Compute is a kept call on the calling thread's fast lane, and a run is fed numpy arrays of the types
and shapes the last run had and asks for the same outputs, nothing the general path works out (the feeds checked
against the model's types, the runner's walk of the plan, each partition's call key and staging, the
connection's lookups) changes from run to run but the arrays. That path's Python, on the caches a small CNN's
run leaves cold, cost about as much as the rest of the lane (squeezenet, 2026-11-26: a session's run 160-232 µs
over ORT in process, the bare kept call 130-152); on a plan of many small partitions it is paid at every
partition call. A SteadyRun keeps what a general run found, for one thread (a lane connection is its thread's):
one step per partition, in the plan's order, each reading its inputs from the run's feeds and the steps before
it by position, and repeats them while the session's plan, each partition's compute and the calls' connections,
kept calls and staging buffers stay those it was made with. A partition in a worker whose call is not kept (its
connection keeps no more, or the call does not qualify: outputs of another shape than kept) is called as the
general path calls it, as one in this process is (ComputeStep), where some other step repeats a kept call.

A partition that leaves a value in its worker for a later partition there (`keep`: a vendor EP's partitions on
either side of one it does not take, a value of the first read by the second) makes it again as a tensor among
the run's values, which the later partition names by handle, a partition in another worker reads through this
process's mapping of it (`Step.views`), and one in this process as it is. A value the run does not hand out is
written into a tensor of the worker's that the steady run holds, the same every run (ScratchStep); one it hands
out, into a new buffer of the worker's every run, as the general path leaves it.

A step whose call no longer repeats, fails, or whose outputs come back of other types or shapes hands the rest of
the run to the general path (its outputs so far, what failed: `Outcome`); the session then makes a new steady run
when the runs settle again.

A SteadyBinding does the same for a thread's IOBinding runs of a plan of one partition: a loop whose state stays
bound in the worker, a new tensor there every step, whose shapes may grow every step (a decoding loop's), or is
written into tensors of the worker's bound as outputs (two swapped every step).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from ephost.errors import EpError
from ephost.eps.base import ComputeCall
from ephost.tensor import Tensor
from ephost.types import is_plain_dtype
from ephost.values import as_value, to_python
from ephost.client.handles import owned
from ephost.client.planner import Partition


def signature(input_feed: Mapping[str, Any]) -> tuple | None:
    """What a steady run is made for: each feed's name, type and shape, where every feed is a C-contiguous
    numpy array of a plain type; else None."""
    out = []
    for name, value in input_feed.items():
        if type(value) is not np.ndarray or not value.flags.c_contiguous or not is_plain_dtype(value.dtype):
            return None
        out.append((name, value.dtype, value.shape))
    return tuple(out)


def steady_plan(partitions: list[Partition]) -> bool:
    """Whether a plan can make steady runs: at least one partition runs in a worker (a plan all in process gains
    little, and keeps the general path's checks)."""
    return any(hasattr(p.compute_info, "steady") for p in partitions)


class ComputeStep:
    """A partition made again through its Compute as the general path calls it (one in this process, or one in a
    worker whose call its connection does not keep: it keeps as many as it has room for, client/fastlane.py):
    the arrays as tensors, its outputs as arrays where they are of the types and shapes the general run saw (what
    a later step's kept call was made for)."""

    __slots__ = ("_partition", "_outputs")

    def __init__(self, partition: Partition, outputs: Sequence[tuple[np.dtype, tuple[int, ...], bool]]):
        self._partition, self._outputs = partition, outputs

    @classmethod
    def of(cls, partition: Partition, outputs: Sequence[Any]) -> "ComputeStep | None":
        arrays = [_array(v) for v in outputs]
        if any(a is None for a in arrays):
            return None
        return cls(partition, [(a.dtype, a.shape, False) for a in arrays])

    def __call__(self, arrays: list[np.ndarray], timeout: float | None) -> tuple[list, bool]:
        p = self._partition
        outputs = p.compute_info.compute(ComputeCall([as_value(a) for a in arrays], p.allocator, p.keep,
                                                     timeout=timeout))
        out = _as_made(outputs, self._outputs)
        return (outputs, False) if out is None else (out, True)


class ScratchStep:
    """A partition in a worker that keeps values there for later partitions of the worker which the run does not
    hand out: made again with those values written into tensors of the worker's this steady run holds (`targets`,
    the same every run: no buffer made, handed over, mapped here and freed per value and run, and the worker's
    view of it, as the later partition names it, made once). Its first run makes the call so (the lane keeps it),
    the later ones repeat it (RemoteComputeInfo.steady with the targets)."""

    __slots__ = ("_partition", "_targets", "_made", "_compute")

    def __init__(self, partition: Partition, targets: dict[int, Tensor], made: list[tuple]):
        self._partition, self._targets, self._made = partition, targets, made
        self._compute = None

    @classmethod
    def of(cls, partition: Partition, outputs: Sequence[Any], scratch: Sequence[int]) -> "ScratchStep | None":
        """`outputs`: the general run's; `scratch`: the positions of the kept values to write into targets."""
        if any(type(v) is not Tensor for v in outputs):
            return None
        made = [(v.dtype, v.shape, i in partition.keep) for i, v in enumerate(outputs)]
        targets = _made(lambda: {i: Tensor.empty(outputs[i].shape, outputs[i].dtype, partition.allocator)
                                 for i in scratch})
        return None if targets is None else cls(partition, targets, made)

    def __call__(self, inputs: list, timeout: float | None) -> tuple[list, bool] | None:
        compute = self._compute
        if compute is not None:
            return compute(inputs, timeout)
        p = self._partition
        values = [as_value(v) for v in inputs]
        outputs = p.compute_info.compute(ComputeCall(values, p.allocator, p.keep, self._targets, timeout=timeout))
        out = _as_made(outputs, self._made)
        # (a worker that does not write into the targets: the general path's)
        if out is None or any(out[i] is not t for i, t in self._targets.items()):
            return outputs, False
        self._compute = p.compute_info.steady(values, p.allocator, outputs, p.keep, self._targets)
        return out, self._compute is not None


def _made(make: Callable[..., Any], *args) -> Any:
    """What a steady step is made with (a kept call, its targets), `make(*args)`, or None where it cannot be made
    now (its worker died since the run it is made from, or has no memory for the staging buffers or targets): that
    run's outputs stand whatever this does, and the next run goes the general path, under the failure policy."""
    try:
        return make(*args)
    except EpError:
        return None


def _as_made(outputs: Sequence[Any], made: Sequence[tuple[np.dtype, tuple[int, ...], bool]]) -> list | None:
    """A step's outputs as a steady run hands them on, where each is a tensor of the type and shape the general
    run saw (`made`: each one's dtype, shape and whether it stays where it was made): arrays, but those that stay
    (tensors in their worker's memory); else None."""
    if len(outputs) != len(made):
        return None
    out = []
    for value, (dtype, shape, kept) in zip(outputs, made):
        if type(value) is not Tensor or value.dtype != dtype or value.shape != shape:
            return None
        array = value if kept else _array(value)
        if array is None:
            return None
        out.append(array)
    return out


def _mapped(tensor: Tensor) -> np.ndarray:
    """A tensor a step left in its worker as an array over that memory, for a step that reads it from this process
    (a view that does not keep the tensor alive: the run's values do, until the run ends); a copy fetched here
    where this process does not map it."""
    raw = tensor.buffer.host_view()
    if raw is None:
        return tensor.local_array()
    return raw[:tensor.nbytes].view(tensor.dtype).reshape(tensor.shape)


def _array(value: Any) -> np.ndarray | None:
    """A tensor's C-contiguous host array of a plain type, without a copy; else None."""
    array = value.local_array() if type(value) is Tensor else None
    if array is None or not array.flags.c_contiguous or not is_plain_dtype(array.dtype):
        return None
    return array


class Step(NamedTuple):
    """One partition of a steady run: `compute(arrays, timeout)` gives (outputs, as made: arrays of the types and
    shapes the run was made with) or None where its call no longer repeats (nothing ran); `sources` are the
    positions of its inputs among the run's values (the feeds, then each step's outputs, in order)."""

    partition: Partition
    info: Any  # the partition's compute info it was made for (the failure policy may move a partition)
    compute: Callable[[list[np.ndarray], float | None], tuple[list, bool] | None]
    sources: tuple[int, ...]
    views: tuple[int, ...] = ()  # the inputs (by index) another worker left: given as arrays over its memory


class Outcome(NamedTuple):
    """How a steady run went: the run's values (the feeds, then the outputs of the steps `done`), and where a
    step did not go as made, its error (None: it did not repeat, or its outputs were not as made: the general
    path goes on from step `done`). `held`: every step went as made."""

    values: list
    done: int
    error: EpError | None
    held: bool


class SteadyRun:
    """One thread's steady run of a session (see above): what a run must be to be one (`arrays`), and its
    partitions' calls made again (`run`)."""

    __slots__ = ("partitions", "steps", "picks", "_names", "_feeds", "_asked", "_tensors")

    def __init__(self, partitions: list[Partition], steps: list[Step], names: list[str],
                 feeds: Sequence[tuple[str, np.dtype, tuple]], asked: Sequence[str] | None, picks: list[int],
                 tensors: set[int] = frozenset()):
        self.partitions = partitions  # the session's plan it was made in (a new plan is a new list)
        self.steps = steps
        self.picks = picks  # the positions among the run's values of the outputs the run asks for, in its order
        self._tensors = tensors  # those of them left in a worker (tensors, not arrays)
        self._names = names  # the run's values' names, by position
        self._feeds = feeds  # (name, dtype, shape), in the order of the run's values
        self._asked = asked  # the output names the run asked for, as given

    @classmethod
    def of(cls, partitions: list[Partition], output_names: Sequence[str] | None, names: Sequence[str],
           feeds: tuple, record: Sequence[tuple[Partition, list, list]]) -> "SteadyRun | None":
        """The steady run of a run that just went the general path (`names`: the outputs it gave, `feeds`: its
        signature, `record`: each partition it ran, with its inputs and outputs, in order), where there is one."""
        if len(record) != len(partitions) or any(r[0] is not p for r, p in zip(record, partitions)):
            return None
        position = {name: i for i, (name, _, _) in enumerate(feeds)}
        value_names, asked = [name for name, _, _ in feeds], set(names)
        steps, left = [], set()  # left: the positions of the values steps leave in their workers (tensors)
        kept = False  # a step repeats a kept call
        for p, inputs, outputs in record:
            try:
                sources = tuple(position[v] for v in p.graph.inputs)
            except KeyError:  # an input the run did not feed (an initializer the graph lets it override)
                return None
            steady, views = getattr(p.compute_info, "steady", None), ()
            scratch = [i for i in p.keep if p.graph.outputs[i] not in asked] if steady is not None else ()
            if steady is None:
                compute = ComputeStep.of(p, outputs)
            elif scratch:
                compute = ScratchStep.of(p, outputs, scratch)
                kept = True
            else:
                compute = _made(steady, inputs, p.allocator, outputs, p.keep)
                if compute is not None:
                    kept = True
                elif not p.keep:  # its call is not kept (its connection keeps no more, or it does not qualify)
                    compute = ComputeStep.of(p, outputs)
            if compute is None:
                return None
            if steady is not None:  # what another worker left, read here through this process's mapping
                views = tuple(j for j, v in enumerate(sources)
                              if v in left and not owned(getattr(inputs[j], "buffer", None), p.compute_info.link))
            steps.append(Step(p, p.compute_info, compute, sources, views))
            if steady is not None:  # (an in-process partition's are arrays)
                left.update(len(value_names) + i for i in p.keep)
            for v in p.graph.outputs:
                position[v] = len(value_names)
                value_names.append(v)
        if not kept or any(n not in position for n in names):  # nothing to repeat; a constant output
            return None
        picks = [position[n] for n in names]
        return cls(partitions, steps, value_names, list(feeds), None if output_names is None else list(output_names),
                   picks, left.intersection(picks))

    def arrays(self, partitions: list[Partition], output_names: Sequence[str] | None,
               input_feed: Mapping[str, Any]) -> list[np.ndarray] | None:
        """The feeds in the run's order, where this run is one this steady run makes; else None."""
        if partitions is not self.partitions or len(input_feed) != len(self._feeds):
            return None
        if output_names is None:
            if self._asked is not None:
                return None
        elif self._asked is None or list(output_names) != self._asked:
            return None
        arrays = []
        for name, dtype, shape in self._feeds:
            value = input_feed.get(name)
            if type(value) is not np.ndarray or value.dtype != dtype or value.shape != shape \
                    or not value.flags.c_contiguous:
                return None
            arrays.append(value)
        return arrays

    def run(self, arrays: list[np.ndarray], timeout: float | None) -> Outcome | None:
        """The steps made again from the feeds; None where the first did not repeat (nothing ran)."""
        values = arrays
        for done, step in enumerate(self.steps):
            ins = []
            for i in step.sources:  # (a loop, not a comprehension: one Python call fewer on a run's cold caches)
                ins.append(values[i])
            if step.views:
                for j in step.views:
                    ins[j] = _mapped(ins[j])
            if step.partition.compute_info is not step.info:
                made = None  # the partition was moved (to the CPU fallback)
            else:
                try:
                    made = step.compute(ins, timeout)
                except EpError as error:
                    return Outcome(values, done, error, False)
            if made is None:
                return None if done == 0 else Outcome(values, done, None, False)
            outputs, held = made
            values.extend(outputs)
            if not held:
                return Outcome(values, done + 1, None, False)
        return Outcome(values, len(self.steps), None, True)

    def outputs(self, values: list) -> list:
        """The outputs the run asks for, from a run whose every step went as made: arrays (those left in a worker
        over its memory, keeping their buffers, as the general path gives them)."""
        if self._tensors:
            return [to_python(values[i]) if i in self._tensors else values[i] for i in self.picks]
        out = []
        for i in self.picks:  # (see run)
            out.append(values[i])
        return out

    def inputs(self, values: list, step: int) -> list:
        """The inputs of a step, from the run's values, as the general path hands them to its partition."""
        return [as_value(values[i]) for i in self.steps[step].sources]

    def named(self, values: list) -> dict[str, Any]:
        """The run's values by name, as the general path holds them (to go on from where the steady run stopped)."""
        return {name: as_value(v) for name, v in zip(self._names, values)}


class SteadyBinding:
    """One thread's steady IOBinding run: a plan of one partition whose Compute the thread's fast lane keeps
    (RemoteComputeInfo.bound_steady), run with one binding whose outputs stay bound as they were. A loop that
    keeps its state in the worker is one: the state, left there and bound as the next step's input, is a new
    tensor of the worker's every step (a SteadyRun takes arrays), and a decoding loop's grows every step, a call
    the lane then keeps with `keep_shapes`. A run whose bound inputs are of the kinds, types and ranks (and, where
    the call was kept with its shapes, the shapes) of the run it was made from goes straight to the kept call
    (`bound`, then `compute`), its outputs to the binding labelled as the general path labels them
    (`results`)."""

    __slots__ = ("partitions", "partition", "info", "compute", "names", "_binding", "_generation", "_outputs",
                 "_labels", "_targets", "_bound")

    def __init__(self, partitions: list[Partition], compute, binding, outputs: list[str], labels: list,
                 targets: list[str]):
        self.partitions = partitions  # the session's plan it was made in (a new plan is a new list)
        self.partition = partitions[0]
        self.info = self.partition.compute_info  # moved by the failure policy: no longer this steady run's
        self.compute = compute
        self.names = self.partition.graph.inputs  # the bound inputs, in the order the partition takes them
        self._binding = weakref.ref(binding)  # not kept alive here: its outputs (a worker's memory) with it
        self._generation = binding.output_generation
        self._outputs = outputs  # the bound outputs' names, in the binding's order
        self._labels = labels  # each bound output's (position among the partition's, (raw, label) or None)
        self._targets = targets  # the outputs written into bound tensors, in the order of their positions
        # How the outputs were bound, to tell a pair swapped from a new binding
        self._bound = _bound_as(binding.bound_outputs())

    @classmethod
    def of(cls, partitions: list[Partition], binding, outputs: list[str],
           record: Sequence[tuple[Partition, list, list]]) -> "SteadyBinding | None":
        """The steady run of a binding's run that just went the general path (`outputs`: the bound outputs' names,
        `record`: what the runner recorded), where there is one."""
        if len(partitions) != 1 or len(record) != 1 or record[0][0] is not partitions[0]:
            return None
        p, inputs, made = record[0]
        if any(n not in p.graph.outputs for n in outputs):
            return None
        tensors = {p.graph.outputs.index(n): b.tensor for n, b in binding.bound_outputs().items()
                   if b.tensor is not None}
        bound = getattr(p.compute_info, "bound_steady", None)
        compute = _made(bound, inputs, p.allocator, made, tensors) if bound is not None else None
        if compute is None:
            return None
        raw = p.allocator.memory_info if p.allocator is not None else None
        labels = []  # an output left in the worker is labelled as the general path labelled the one it made
        for name in outputs:
            i = p.graph.outputs.index(name)
            labels.append((i, (raw, made[i].memory_info) if i in compute.placed else None))
        return cls(partitions, compute, binding, list(outputs), labels,
                   [p.graph.outputs[i] for i in sorted(tensors)])

    def bound(self, partitions: list[Partition], binding) -> tuple[list, list] | None:
        """The binding's inputs in the partition's order, and the tensors its outputs are written into (in the
        order of their positions), where this run is one this steady run makes (the same plan, partition and
        binding, the outputs bound as they were, to tensors of the same types and shapes where they were, and
        every input bound); else None."""
        if partitions is not self.partitions or self.partition.compute_info is not self.info \
                or self._binding() is not binding:
            return None
        outputs = binding.bound_outputs() if self._targets or binding.output_generation != self._generation else None
        if binding.output_generation != self._generation:  # bound again: as before (a pair swapped), or not
            if _bound_as(outputs) != self._bound:
                return None
            self._generation = binding.output_generation
        bound = binding.bound_inputs()
        if len(bound) != len(self.names):
            return None
        try:
            inputs = [bound[n] for n in self.names]
        except KeyError:
            return None
        return inputs, [outputs[n].tensor for n in self._targets] if self._targets else []

    def results(self, outputs: Sequence[Any]) -> dict[str, Any]:
        """The bound outputs' values by name, from the partition's outputs (labelled in place)."""
        out = {}
        for name, (i, label) in zip(self._outputs, self._labels):
            value = outputs[i]
            if label is not None and type(value) is Tensor and value.memory_info is label[0]:
                value.relabel(label[1])
            out[name] = value
        return out


def _bound_as(outputs: Mapping[str, Any]) -> list[tuple]:
    """How a binding's outputs (its bound_outputs()) are bound: each one's name and memory, and the type and shape
    of the tensor it is written into (None: none is)."""
    return [(name, b.memory, None if b.tensor is None else (b.tensor.shape, b.tensor.dtype))
            for name, b in outputs.items()]
