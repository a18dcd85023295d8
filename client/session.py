"""ephost.InferenceSession and ephost.SessionOptions, shaped like ONNX Runtime's.

A session asks each EP, in the order they were added, which nodes it takes (GetCapability, with the nodes
already taken marked), groups what each EP took into partitions that can be fused without a cycle, compiles
them on their EPs, and gives what nobody took to the in-process CPU fallback (the reference EP). A run goes
through the partitions in topological order; a value stays where it was made and is only copied when a
partition elsewhere reads it.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ephost.eps.base import FusedGraph
from ephost.eps.reference import ReferenceEpFactory
from ephost.errors import (EpDeadlineExceeded, EpError, EpInternal, EpInvalidArgument, EpNotFound,
                           EpWorkerCrashed, EpWorkerUnavailable)
from ephost.graph import GraphIndex, cluster, prepare_model
from ephost.tensor import Tensor
from ephost.types import dtype_of
from ephost.values import as_value, to_python
from ephost.client.devices import EpDevice

log = logging.getLogger(__name__)

FALLBACK = "fallback"  # the name the CPU fallback goes by in assignment info
# What the failure policy handles: a worker that died, hung or is gone, and an EP that failed inside (a vendor
# bug). Errors about the request itself (bad input) would fail anywhere and are raised as they are.
_WORKER_FAILURES = (EpWorkerUnavailable, EpDeadlineExceeded, EpInternal)


class _FellBack(Exception):
    """An EP failed during set-up and the policy is to leave its nodes to the fallback."""


POLICIES = ("raise", "retry", "fallback")


class SessionOptions:
    """Which EPs a session uses, and what it does when one fails.

    `ep_failure_policy`: "raise" (a failed call raises its typed error), "retry" (wait for the worker's
    restart, compile again, run the failed partition once more) or "fallback" (run the failed partition on the
    CPU fallback; once the EP is marked failed, its partitions run there from then on). `compute_timeout_s`:
    the deadline of every Compute (a worker past it is ended, then the policy applies); None: the EP's call
    deadline."""

    def __init__(self):
        self._providers: list[tuple[list[EpDevice], dict[str, str]]] = []
        self.ep_failure_policy = "raise"
        self.compute_timeout_s: float | None = None

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


@dataclass
class RunOptions:
    """Per-run settings (ONNX Runtime's RunOptions): `compute_timeout_s` overrides the session's."""

    compute_timeout_s: float | None = None


@dataclass(frozen=True)
class NodeArg:
    """A graph input or output, as ONNX Runtime's NodeArg: name, type ("tensor(float)") and shape."""

    name: str
    type: str
    shape: list


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


@dataclass
class _Partition:
    graph: FusedGraph
    registration: str
    ep_name: str
    ep: Any
    compute_info: Any = None
    allocator: Any = None
    keep: tuple[int, ...] = ()  # outputs a later partition of the same EP reads
    last_reads: tuple[str, ...] = ()  # values no later partition reads: let go of once this one ran
    fallback_info: Any = None   # the same partition compiled on the CPU fallback, once it was needed


def _load(model) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        loaded, what = model, "the model"
    else:
        try:
            if isinstance(model, (bytes, bytearray, memoryview)):
                what = "the model bytes"
                loaded = onnx.load_model_from_string(bytes(model))
            else:
                what = f"model file {os.fspath(model)!r}"
                loaded = onnx.load(os.fspath(model))
        except FileNotFoundError:
            raise EpNotFound(f"{what} does not exist") from None
        except Exception as e:
            raise EpInvalidArgument(f"{what} is not a readable ONNX model ({type(e).__name__}: {e})") from None
    if not loaded.HasField("graph") or not loaded.opset_import:
        raise EpInvalidArgument(f"{what} is not an ONNX model: it has no graph or no opset import")
    return loaded


def _type_string(type_proto: onnx.TypeProto) -> str:
    which = type_proto.WhichOneof("value")
    if which == "tensor_type":
        return f"tensor({TensorProto.DataType.Name(type_proto.tensor_type.elem_type).lower()})"
    if which in ("sequence_type", "optional_type"):
        inner = getattr(type_proto, which).elem_type
        return f"{which.split('_')[0]}({_type_string(inner)})"
    return which or "unknown"


def _shape(type_proto: onnx.TypeProto) -> list | None:
    if type_proto.WhichOneof("value") != "tensor_type" or not type_proto.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in type_proto.tensor_type.shape.dim]


class InferenceSession:
    def __init__(self, model, sess_options: SessionOptions | None = None, env=None,
                 providers: Iterable[str | tuple[str, Mapping[str, str]]] | None = None):
        if env is None:
            from ephost import get_default_environment
            env = get_default_environment()
        self._env = env
        self._closed = False
        self._lock = threading.Lock()
        self._model = prepare_model(_load(model))
        self._index = GraphIndex.of(self._model)
        graph = self._model.graph
        self._inputs = [i for i in graph.input if i.name not in self._index.initializers]
        self._outputs = list(graph.output)
        self._constants = {t.name: t for t in graph.initializer}

        options = sess_options or SessionOptions()
        if options.ep_failure_policy not in POLICIES:
            raise EpInvalidArgument(f"ep_failure_policy must be one of {POLICIES}, got {options.ep_failure_policy!r}")
        self._policy = options.ep_failure_policy
        self._timeout = options.compute_timeout_s
        self.run_log: deque[dict] = deque(maxlen=1000)
        self.failure_counters = Counter()
        self._runs = itertools.count(1)
        entries = options.providers + self._provider_shortcuts(providers or [])
        self._eps: list[tuple[Any, Any]] = []  # (registration, ep), to release on close
        self._fallback_factory = ReferenceEpFactory()
        self._fallback_ep = self._fallback_factory.create_ep([0], {})
        try:
            self._partitions = self._partition(entries)
            self._compile()
        except BaseException:
            self.close()
            raise

    # --- set-up -----------------------------------------------------------------------------------

    def _provider_shortcuts(self, providers) -> list[tuple[list[EpDevice], dict[str, str]]]:
        """`providers=["reference", "unix:///w.sock"]`: registration names, or targets registered under
        their own name in the session's Environment."""
        out = []
        for entry in providers:
            target, options = (entry, {}) if isinstance(entry, str) else entry
            registered = {d.registration_name for d in self._env.get_ep_devices()}
            if target not in registered:
                self._env.register_execution_provider_library(target, target)
            devices = [d for d in self._env.get_ep_devices() if d.registration_name == target]
            out.append((devices, dict(options)))
        return out

    def _partition(self, entries) -> list[_Partition]:
        index = self._index
        key_of: dict[str, tuple] = {}
        fusable: set[tuple] = set()
        owners: dict[tuple, tuple[str, str, Any]] = {}  # key -> (registration, ep name, ep)
        for position, (devices, options) in enumerate(entries):
            registration = self._env._registration_of(devices[0])
            try:
                ep = self._guarded(registration.name, "CreateEp",
                                   lambda: registration.factory.create_ep([d.index for d in devices], options))
                self._eps.append((registration, ep))
                groups = self._guarded(registration.name, "GetCapability",
                                       lambda: ep.get_capability(self._model, frozenset(key_of)))
            except _FellBack:
                continue
            for g, group in enumerate(groups):
                key = (position, g)
                owners[key] = (registration.name, devices[0].ep_name, ep)
                if group.fused:
                    fusable.add(key)
                for name in group.node_names:
                    if name not in index.nodes or name in key_of:
                        log.warning("%s claimed node %r, which %s; ignored", registration.name, name,
                                    "does not exist" if name not in index.nodes else "was already claimed")
                        continue
                    key_of[name] = key
        fallback = (FALLBACK,)
        owners[fallback] = (FALLBACK, self._fallback_factory.get_name(), self._fallback_ep)
        fusable.add(fallback)
        for name in index.nodes:
            key_of.setdefault(name, fallback)

        partitions = []
        for i, c in enumerate(cluster(index, key_of, fusable)):
            registration, ep_name, ep = owners[c.key]
            inputs, outputs = index.partition_io(c.nodes)
            graph = FusedGraph(f"{registration}_{i}", index, tuple(c.nodes), tuple(inputs), tuple(outputs))
            partitions.append(_Partition(graph, registration, ep_name, ep))
        last_reader = {v: p for p in partitions for v in p.graph.inputs}  # the later partition wins
        for p in partitions:
            p.last_reads = tuple(v for v in dict.fromkeys(p.graph.inputs) if last_reader[v] is p)
            # Kept where they were made: values a later partition of the same EP reads.
            readers = {v: {q.registration for q in partitions if v in q.graph.inputs} for v in p.graph.outputs}
            p.keep = tuple(i for i, v in enumerate(p.graph.outputs) if p.registration in readers[v])
        return partitions

    def _compile(self) -> None:
        by_ep: dict[int, list[_Partition]] = {}
        for p in self._partitions:
            by_ep.setdefault(id(p.ep), []).append(p)
        for parts in by_ep.values():
            ep = parts[0].ep
            registration = self._env._registrations.get(parts[0].registration)
            try:
                infos = self._guarded(parts[0].registration, "Compile", lambda: ep.compile([p.graph for p in parts]))
                allocator = registration.session_allocator() if registration is not None else None
            except _FellBack:
                for p in parts:
                    self._to_fallback(p)
                continue
            for p, info in zip(parts, infos):
                p.compute_info, p.allocator = info, allocator
            log.info("compiled %d partition(s) on %s", len(parts), parts[0].registration)

    # --- failures -------------------------------------------------------------------------------------

    def _note(self, event: str, registration: str, what: str, error: BaseException | None = None, run: int = 0):
        self.failure_counters[event] += 1
        entry = {"run": run, "event": event, "registration": registration, "what": what,
                 "error": f"{type(error).__name__}: {error}" if error is not None else ""}
        self.run_log.append(entry)
        log.warning("%s: %s %s%s", registration, what, event, f" ({entry['error']})" if error else "")

    def _guarded(self, registration: str, what: str, call):
        """Set-up calls to an EP (CreateEp, GetCapability, Compile) under the session's failure policy."""
        try:
            return call()
        except _WORKER_FAILURES as error:
            self._note("crashed" if isinstance(error, EpWorkerCrashed) else "failed", registration, what, error)
            if self._policy == "raise":
                raise
            if self._policy == "retry":
                link = self._env._registrations[registration].link
                if link is not None:
                    link.wait_healthy(link.policy.connect_timeout_s + link.policy.max_backoff_s)
                self._note("retried", registration, what)
                return call()
            self._note("fell back", registration, what)
            raise _FellBack() from error

    def _recover(self, run: int, p: _Partition, inputs: list, error: EpError, timeout: float | None) -> list:
        if not isinstance(error, _WORKER_FAILURES) or p.registration == FALLBACK:
            raise error
        event = {EpDeadlineExceeded: "timed out", EpInternal: "failed"}.get(type(error), "crashed")
        self._note(event, p.registration, p.graph.name, error, run)
        if self._policy == "raise":
            raise error
        registration = self._env._registrations.get(p.registration)
        link = registration.link if registration is not None else None
        if link is not None:
            link.wait_noticed(1.0)
            if self._policy == "retry":
                link.wait_healthy(link.policy.connect_timeout_s + link.policy.max_backoff_s)
        failed = registration is None or (link is not None and link.failed)
        if self._policy == "retry" and not failed:
            self._note("retried", p.registration, p.graph.name, run=run)
            return p.compute_info.compute(inputs, p.allocator, p.keep, timeout)
        if self._policy != "fallback":
            raise error
        if failed:  # from now on its partitions run on the fallback
            self._note("moved to the fallback", p.registration, "all its partitions", run=run)
            for q in [q for q in self._partitions if q.registration == p.registration]:
                self._to_fallback(q)
            return p.compute_info.compute(inputs, None, (), timeout)
        self._note("fell back", p.registration, p.graph.name, run=run)
        if p.fallback_info is None:
            (p.fallback_info,) = self._fallback_ep.compile([p.graph])
        return p.fallback_info.compute(inputs)

    def _to_fallback(self, p: _Partition) -> None:
        if p.fallback_info is None:
            (p.fallback_info,) = self._fallback_ep.compile([p.graph])
        p.compute_info, p.allocator, p.keep = p.fallback_info, None, ()
        p.registration, p.ep_name, p.ep = FALLBACK, self._fallback_factory.get_name(), self._fallback_ep

    # --- ONNX Runtime's session API ------------------------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        return [NodeArg(i.name, _type_string(i.type), _shape(i.type)) for i in self._inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [NodeArg(o.name, _type_string(o.type), _shape(o.type)) for o in self._outputs]

    def get_provider_graph_assignment_info(self) -> list[AssignedSubgraph]:
        nodes = self._index.nodes
        return [AssignedSubgraph(p.ep_name, p.registration, tuple(
            AssignedNode(n, nodes[n].op_type, nodes[n].domain) for n in p.graph.nodes)) for p in self._partitions]

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[Any]:
        if self._closed:
            raise EpInvalidArgument("the session is closed")
        names = list(output_names) if output_names else [o.name for o in self._outputs]
        known = {o.name for o in self._outputs}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise EpInvalidArgument(f"unknown output name(s) {unknown}; the model's outputs are {sorted(known)}")
        values = self._feeds(input_feed)
        keep = set(names)
        run = next(self._runs)
        timeout = (run_options.compute_timeout_s if run_options is not None and run_options.compute_timeout_s
                   else self._timeout)
        self.failure_counters["runs"] += 1
        for p in self._partitions:
            inputs = [values[v] for v in p.graph.inputs]
            try:
                outputs = p.compute_info.compute(inputs, p.allocator, p.keep, timeout)
            except EpError as error:
                outputs = self._recover(run, p, inputs, error, timeout)
            if len(outputs) != len(p.graph.outputs):
                raise EpInvalidArgument(f"{p.graph.name} made {len(outputs)} outputs, not {len(p.graph.outputs)}")
            values.update(zip(p.graph.outputs, outputs))
            for v in p.last_reads:  # let go of values no later partition reads
                if v not in keep:
                    values.pop(v, None)
        for n in names:
            if n not in values and n in self._constants:
                values[n] = as_value(numpy_helper.to_array(self._constants[n]))
        return [to_python(values[n]) for n in names]

    def _feeds(self, input_feed: Mapping[str, Any]) -> dict[str, Any]:
        expected = {i.name: i for i in self._inputs}
        unknown = sorted(set(input_feed) - set(expected) - set(self._constants))
        if unknown:
            raise EpInvalidArgument(f"unknown input name(s) {unknown}; the model's inputs are {sorted(expected)}")
        missing = [n for n in expected if n not in input_feed]
        if missing:
            raise EpInvalidArgument(f"missing input(s) {missing}; feed every one of {list(expected)}")
        values = {}
        for name, value in input_feed.items():
            if name in expected:
                _check_feed(name, expected[name].type, value)
            value = as_value(value)
            if isinstance(value, Tensor) and value.local_bytes() is None and value.buffer.owner is None:
                host = Tensor.from_numpy(np.empty(value.shape, value.dtype))
                self._env.copy_tensors([value], [host])
                value = host
            values[name] = value
        return values

    # --- lifetime ---------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for registration, ep in getattr(self, "_eps", []):
            infos = [p.compute_info for p in getattr(self, "_partitions", [])
                     if p.ep is ep and p.compute_info is not None]
            try:
                if infos:
                    ep.release_node_compute_infos(infos)
                registration.factory.release_ep(ep)
            except Exception as e:  # the worker may be gone; what it held went with it
                log.debug("releasing %s's partitions failed: %s", registration.name, e)

    def __enter__(self) -> "InferenceSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()


def _check_feed(name: str, type_proto: onnx.TypeProto, value: Any) -> None:
    """The checks ONNX Runtime makes on a feed: a tensor of the declared element type and rank, and the
    declared size along every fixed dimension."""
    if type_proto.WhichOneof("value") != "tensor_type":
        return
    tensor_type = type_proto.tensor_type
    if isinstance(value, Tensor):
        dtype, shape = value.dtype, value.shape
    elif isinstance(value, (np.ndarray, np.generic)):
        dtype, shape = np.asarray(value).dtype, np.shape(value)
    else:
        raise EpInvalidArgument(f"input {name!r} must be a tensor ({_type_string(type_proto)}), "
                                f"got {type(value).__name__}")
    declared = tensor_type.elem_type
    if declared == TensorProto.STRING:
        ok = dtype.kind in "OUS"
    else:
        expected = _declared_dtype(declared)
        ok = expected is None or dtype == expected  # types numpy lacks (bfloat16...) are the EP's to check
    if not ok:
        raise EpInvalidArgument(f"input {name!r} expects {_type_string(type_proto)}, got a {dtype} array")
    if tensor_type.HasField("shape"):
        dims = tensor_type.shape.dim
        if len(dims) != len(shape):
            raise EpInvalidArgument(f"input {name!r} expects rank {len(dims)} (shape {_shape(type_proto)}), "
                                    f"got rank {len(shape)} (shape {list(shape)})")
        for axis, (d, n) in enumerate(zip(dims, shape)):
            if d.HasField("dim_value") and d.dim_value != n:
                raise EpInvalidArgument(f"input {name!r} expects {d.dim_value} along axis {axis} "
                                        f"(shape {_shape(type_proto)}), got shape {list(shape)}")


def _declared_dtype(elem_type: int):
    try:
        return dtype_of(elem_type)
    except EpInvalidArgument:
        return None
