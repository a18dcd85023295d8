"""The `onnxruntime` EP: ONNX Runtime inside the worker, with any of its execution providers by name or any
ORT plugin EP library by path (OpenVINO's among them), so that a crash in vendor code stays in the worker.

GetCapability is the vendor's own decision: ONNX Runtime is asked which nodes the chosen EP takes (with
session.record_ep_graph_assignment_info), and each subgraph it assigns to that EP becomes a fused group.
Compile builds one ORT session per partition; Compute binds inputs to the tensors' own memory and large or
kept outputs to buffers of the output allocator (IOBinding over shared-memory arrays), so ORT reads inputs
where the client wrote them and writes those outputs where the client reads them. Small outputs that go
back inline are read out of ORT's memory (one copy of a few bytes). Bindings are kept between runs.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import tempfile
import threading
import weakref
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from ephost.eps import check_options
from ephost import ep_context, session_config
from ephost.ep_context import EpContext
from ephost.eps.base import (EP_CONTEXT_ENABLE, ComputeCall, EpDefaults, FusedGraph, NodeGroup, ProfilingEvent,
                             split_session_options)
from ephost.eps.host import HostMemoryFactory, cpu_device, local_inputs
from ephost.eps.library_paths import resolve_library
from ephost.eps.ort_values import from_ort_value, is_exotic_type, onnx_type_of, to_ort_value
from ephost.graph import BUILTIN_DOMAINS
from ephost.external_data import ExternalData, has_external_data, on_disk
from ephost.errors import EpError, EpInternal, EpInvalidArgument, EpNotFound
from ephost.tensor import Tensor
from ephost.types import (HOST_MEMORY, EpDeviceInfo, HardwareDevice, HardwareDeviceType, checked_shape, dtype_of,
                          is_plain_dtype, nbytes_of)
from ephost.values import as_value

log = logging.getLogger(__name__)

EP_NAME = "onnxruntime"
CPU = "CPUExecutionProvider"
OPTIONS = {
    "provider": f"the ONNX Runtime execution provider to run (default {CPU}, or the EP of `library`)",
    "provider_options": "options for that provider, as KEY=VALUE pairs separated by ';'",
    "library": "an ONNX Runtime plugin EP library to register and use: its path, or `module:function` returning "
               "it in the worker's environment (e.g. onnxruntime_ggml:library_path)",
    "library_name": "the name `library` is registered under in the worker's ONNX Runtime (a plugin EP that names its "
                    "EP after it shows under it; default: the name of the ephost registration that launched the "
                    "worker, else ephost)",
    "intra_op_num_threads": "threads inside one operator (ORT's default: one per core)",
    "inter_op_num_threads": "threads across operators",
    "graph_optimization_level": "disable, basic, extended or all (default all)",
    "session_config": "ONNX Runtime session config entries, KEY=VALUE pairs separated by ';' (over the "
                      "EP's defaults: session.force_spinning_stop=1)",
    "custom_ops_library": "custom op libraries registered in every ONNX Runtime session of the worker "
                          "(SessionOptions.register_custom_ops_library): paths, or `module:function` returning one "
                          "in the worker's environment (e.g. onnxruntime_extensions:get_library_path), separated "
                          "by ';'",
}
_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
           "all": "ORT_ENABLE_ALL"}
_REGISTRATION = "ephost"
# The compiled forms of the onnxruntime EP (see OrtEp._context).
CONTEXT_OPTIMIZED = "onnxruntime_optimized_model"
CONTEXT_ORT = "onnxruntime_ep_context_model"
# Session config entries of every session the EP makes, under those the user gives (`session_config`).
# force_spinning_stop: ORT's intra-op threads spin between operators as by default, and stop once a run ends
# rather than spin on: what runs next is another process's (the caller's reply and next request, other workers'
# partitions), which would otherwise find its CPU taken by a pool with nothing to do.
SESSION_DEFAULTS = {"session.force_spinning_stop": "1"}
# Where ORT finds the external data files of a model given as bytes (relative locations resolve against it).
ORT_EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"
# Outputs of a known size at least this large are written by ORT straight into the output allocator (for a
# worker: shared memory its client maps); smaller ones, unless a later partition of the same EP reads them
# (`keep`), come from ORT's own memory: they travel inline anyway, so an allocation there would be waste.
PLACE_BYTES = 64 << 10
# Inputs up to this size are copied into memory kept with the IOBinding rather than bound where they are, and
# outputs kept in the allocator are written there and copied into their buffer after the run, rather than bound
# in a new buffer every run (binding an output anew and asking its address costs more than the copy).
COPY_BYTES = 16 << 10


@functools.cache
def ort_api() -> "OrtApi":
    """onnxruntime, whose session classes are ORT's own whatever the application put in their place."""
    try:
        import onnxruntime
    except ImportError:
        raise EpNotFound("the onnxruntime EP needs ONNX Runtime: pip install 'ephost[onnxruntime]'") from None
    return OrtApi(onnxruntime)


_ort = ort_api


class OrtApi:
    """The onnxruntime module, its session classes taken where ORT defines them: an application may replace
    onnxruntime.InferenceSession, SessionOptions or RunOptions with ephost's (code written for ORT, run on
    ephost), and the sessions this EP makes must stay ORT's."""

    def __init__(self, module):
        from onnxruntime.capi import _pybind_state, onnxruntime_inference_collection
        self._module = module
        self.InferenceSession = onnxruntime_inference_collection.InferenceSession
        self.SessionOptions = _pybind_state.SessionOptions
        self.RunOptions = _pybind_state.RunOptions

    def __getattr__(self, name: str):
        return getattr(self._module, name)


@functools.cache
def max_ir_version() -> int:
    """The newest ONNX IR version this ONNX Runtime reads, found by asking it."""
    ort = _ort()
    for ir in range(onnx.IR_VERSION, 3, -1):
        model = helper.make_model(
            helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])]),
            opset_imports=[helper.make_opsetid("", 13)], ir_version=ir)
        try:
            ort.InferenceSession(model.SerializeToString(), providers=[CPU])
            return ir
        except Exception:
            continue
    return 3


def readable_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with an IR version ONNX Runtime reads: lowered where its opsets allow it, else a clear error.
    (The onnx package writes the newest IR version; ONNX Runtime may read only an older one.)"""
    limit = max_ir_version()
    if model.ir_version <= limit:
        return model
    needed = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    if needed > limit:
        opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in model.opset_import)
        raise EpInvalidArgument(f"the model's opsets ({opsets}) need ONNX IR version {needed}, and this ONNX Runtime "
                                f"reads at most IR version {limit}")
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    lowered.ir_version = limit
    return lowered


def _pairs(text: str, what: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (p.strip() for p in text.split(";"))):
        key, sep, value = item.partition("=")
        if not sep:
            raise EpInvalidArgument(f"{what} takes KEY=VALUE pairs separated by ';', got {item!r}")
        out[key.strip()] = value.strip()
    return out


# ORT's status codes (the pybind exception classes of onnxruntime.capi.onnxruntime_pybind11_state) that say
# the request itself is wrong: it would fail on any EP, and a failure policy must not retry or fall back. Every
# other failure (FAIL, EP_FAIL, RUNTIME_EXCEPTION, ENGINE_ERROR, NOT_IMPLEMENTED...) is the vendor's.
_BAD_REQUEST = {"InvalidArgument", "InvalidGraph", "InvalidProtobuf", "NoModel", "NoSuchFile"}


def ort_error(what: str, error: Exception) -> EpError:
    """The typed error for an exception ONNX Runtime raised: EpInvalidArgument for a bad request, EpInternal
    for a failure of ORT or of the EP inside it."""
    cls = EpInvalidArgument if type(error).__name__ in _BAD_REQUEST else EpInternal
    return cls(f"{what}: {error}")


def _in_allocator(shape: tuple[int, ...], dtype: np.dtype, nbytes: int, allocator) -> tuple[Tensor, np.ndarray] | None:
    """A new tensor in a buffer of `allocator` (shape and dtype checked already), and an array over its memory
    for ORT to write, or None where this process cannot write that memory. The array is the buffer's own view,
    made once and kept with it: the next step that reads the buffer (a loop's state fed back, a kept call's
    _Views) finds it made, where a view of the tensor's would be made twice (a view over shared memory is costly,
    more so on a run's cold caches)."""
    buffer = allocator.alloc(nbytes)
    view = buffer.host_view()
    if view is None:
        allocator.free(buffer)
        return None
    # Not the tensor's own array: a view of it handed out (in process) keeps the tensor, and its buffer, alive
    tensor = Tensor.trusted(shape, dtype, allocator.memory_info, nbytes, buffer=buffer, allocator=allocator)
    return tensor, view[:nbytes].view(dtype).reshape(shape)


def _kept_in(result: np.ndarray, allocator) -> Any:
    """An output the caller keeps in `allocator` (a decoding loop's state, bound to a device and fed back) that
    ORT wrote elsewhere (its own memory, the shape known only as it ran; the binding's, a small one): copied once
    into a buffer of the allocator, where the caller would otherwise copy it again (a worker's place_output, an
    IOBinding's bound output)."""
    made = _in_allocator(checked_shape(result.shape), result.dtype, result.nbytes, allocator)
    if made is None:  # memory this process cannot write: the caller copies it there
        return as_value(result.copy())
    np.copyto(made[1], result)
    return made[0]


class OrtComputeInfo:
    """One compiled partition: an ORT session, and the IOBindings kept between its runs (one per caller running
    it at the same time), so that a stream of runs binds and allocates only what changes."""

    def __init__(self, graph: FusedGraph, session, ep_context: EpContext | None = None, restored: bool = False,
                 shared: bool = False):
        self.name = graph.name
        self._session = session  # `shared`: another compute info's too (same partition of the same model)
        self.ep_context, self.restored, self.shared = ep_context, restored, shared
        self._inputs = [i.name for i in session.get_inputs()]
        self._outputs = [(o.name, _static(o)) for o in session.get_outputs()]
        # Outputs ORT can write into memory given to it: plain tensors. Others (sequences, maps, strings) go
        # through session.run; tensors numpy lacks a type for (bfloat16, float8, int4...) through OrtValues.
        self._exotic = [is_exotic_type(o.type) for o in session.get_outputs()]
        self._bindable = not any(self._exotic) and all(o.type.startswith("tensor(") and o.type != "tensor(string)"
                                                       for o in session.get_outputs())
        self._idle: list[_Binding] = []  # list.pop and append are atomic: no lock on the way in or out
        # An output whose shape ORT learns as it runs (ORT allocates it), and none a run with an allocator would
        # have ORT write straight into it: such a run without `keep` or `into` is a plain run (_run).
        self._plain = any(static is None for _, static in self._outputs) and \
            not any(static is not None and static[2] >= PLACE_BYTES for _, static in self._outputs)

    def compute(self, call: ComputeCall) -> list[Any]:
        arrays = _plain_arrays(call.inputs) if self._bindable and call.run_options is None else None
        if arrays is None or (self._plain and not call.into):
            # Sequences, strings...: what IOBinding cannot bind; a run with run options, which ORT's own run takes;
            # and an output whose shape ORT learns as it runs with nothing to write into: ORT allocates it either
            # way, and a binding would bind it anew, ask for it and copy it out on every run.
            return self._run(call)
        if len(arrays) != len(self._inputs):
            raise EpInvalidArgument(f"{self.name} takes {len(self._inputs)} inputs, got {len(arrays)}")
        try:
            binding = self._idle.pop()
        except IndexError:
            binding = _Binding(self._session.io_binding(), self._inputs, self._outputs)
        out = self._run_bound(binding, arrays, call)
        self._idle.append(binding)  # (not where the run failed: that binding goes)
        return out

    def _run_bound(self, binding: "_Binding", arrays: list[np.ndarray], call: ComputeCall) -> list[Any]:
        """A run through `binding`: small inputs copied into memory kept with it, large ones bound where they lie;
        each output where its plan (_output_plan) sends it. Only what moved is bound again."""
        io, allocator, keep, into = binding.io, call.allocator, call.keep, call.into
        if into:
            aliased = _aliased(into, arrays, binding.address)
            sources = {k for k, _ in aliased.values()}
            plan = _output_plan(self._outputs, binding, allocator is not None, keep, into, arrays, aliased)
        else:
            sources = ()
            plan = binding.plan(self._outputs, allocator is not None, keep)
        bound, copies, names = binding.inputs, binding.copies, binding.names
        for k, array in enumerate(arrays):
            if array.nbytes <= COPY_BYTES and k not in sources:
                # Small inputs (inline bytes of a request, new memory every call) are copied into memory kept with
                # the binding and bound once: a copy of a few bytes costs less than binding anew.
                copy = copies[k]
                if copy is None or copy.shape != array.shape or copy.dtype != array.dtype:
                    copy = copies[k] = np.empty(array.shape, array.dtype)
                copy[...] = array
                array = copy
            if bound[k] is not array:  # rebound only where the memory moved
                io.bind_input(names[k], "cpu", 0, array.dtype, array.shape, binding.address(k, array))
                bound[k] = array
        placed: dict[int, Tensor | None] = {}  # outputs placed in the allocator (None: its memory is not ours)
        outputs = binding.outputs
        for i, name, static, how, _, target, _, address in plan:
            if how is _ALLOCATED:
                # Bound again every run: the binding keeps the OrtValue ORT made, and ORT refuses to write a result
                # of another shape into it (a dynamic shape: NonZero).
                io.bind_output(name, "cpu")
                outputs[i] = None
                continue
            if how is _IN_PLACE:
                bound_to = (address, target.shape)  # (with the shape: the model may leave it dynamic)
                if outputs[i] != bound_to:
                    io.bind_output(name, "cpu", 0, target.dtype, target.shape, address)
                    outputs[i] = bound_to
                continue
            if how is _PLACED:
                made = _in_allocator(*static, allocator)
                if made is None:  # memory this process cannot write: into the binding's, as a small output
                    placed[i], address = None, binding.scratch(i, static)[1]
                else:
                    placed[i], array = made
                    address = array.ctypes.data
            if outputs[i] != address:
                io.bind_output(name, "cpu", 0, static[1], static[0], address)
                outputs[i] = address
        try:
            self._session.run_with_iobinding(io)
            call.kernel_ran()
        except Exception as e:
            for tensor in placed.values():
                if tensor is not None:
                    tensor.release()
            raise ort_error(f"{self.name} failed in ONNX Runtime", e) from None
        # Placed and written outputs are already where they go; the others are copied out (the binding's memory,
        # and ORT's own, are written again by the next run).
        produced = io.get_outputs_as_ortvaluevector() if binding.ort_allocated else ()
        out = []
        for i, _, static, how, kept, target, array, _ in plan:
            if how is _SCRATCH and not kept and target is None:
                out.append(Tensor.trusted(static[0], static[1], HOST_MEMORY, static[2], host=array.copy()))
            elif how is _IN_PLACE or how is _WRITTEN:
                out.append(target)
            elif how is _ALLOCATED:
                result = produced[i].numpy()
                out.append(_kept_in(result, allocator) if kept else as_value(result.copy()))
            elif how is _PLACED and placed[i] is not None:
                out.append(placed[i])
            else:  # in the binding's memory: copied into the caller's tensor, or into the allocator
                result = array if how is _SCRATCH else binding.scratch(i, static)[0]
                if target is not None:
                    np.copyto(target.local_array(), result)
                    out.append(target)
                elif kept:
                    out.append(_kept_in(result, allocator))
                else:
                    out.append(Tensor.trusted(static[0], static[1], HOST_MEMORY, static[2], host=result.copy()))
        return out

    def _run(self, call: ComputeCall) -> list[Any]:
        """ORT's own run (session.run), for what a binding cannot take."""
        ort = _ort()
        feeds = local_inputs(self.name, self._inputs, call.inputs)
        # Arrays of types ORT cannot take from numpy go in as OrtValues of their ONNX type.
        feeds = {name: v if (elem := onnx_type_of(v)) is None else to_ort_value(ort, v, elem)
                 for name, v in feeds.items()}
        options = None if call.run_options is None else _ort_run_options(call.run_options)
        try:
            if not any(self._exotic):
                out = [as_value(v) for v in self._session.run(None, feeds, options)]
                call.kernel_ran()
            else:
                # Outputs numpy cannot hold come back as OrtValues, read as ONNX lays their bytes out.
                names = [name for name, _ in self._outputs]
                feeds = {n: v if isinstance(v, ort.OrtValue) else
                         ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for n, v in feeds.items()}
                out = [as_value(from_ort_value(v))
                       for v in self._session.run_with_ort_values(names, feeds, options)]
        except EpError:
            raise
        except Exception as e:
            raise ort_error(f"{self.name} failed in ONNX Runtime", e) from None
        if call.keep and call.allocator is not None and self._bindable:  # kept ones copied into the allocator once
            for i in dict.fromkeys(call.keep):
                if i < len(out):  # as on the binding's path, a position past the outputs names none
                    out[i] = _kept_in(out[i].local_array(), call.allocator)
        return out


def _plain_arrays(inputs: Sequence[Any]) -> list[np.ndarray] | None:
    """The inputs as arrays over their memory in this process, where every one is a tensor of a plain type this
    process can address (what an IOBinding binds); else None."""
    arrays = []
    for value in inputs:
        array = value if type(value) is np.ndarray else value.local_array() if type(value) is Tensor else None
        if array is None or not is_plain_dtype(array.dtype) or not array.flags.c_contiguous:
            return None
        arrays.append(array)
    return arrays


def _ort_run_options(options) -> Any:
    """ORT's RunOptions for a run's (an ep_pb2.RunOptions, checked by the worker)."""
    ro = _ort().RunOptions()
    ro.logid = options.logid
    ro.log_severity_level = options.log_severity_level
    ro.log_verbosity_level = options.log_verbosity_level
    for key, value in options.config.items():
        ro.add_run_config_entry(key, value)
    return ro


# How a bound run writes an output (an entry of _output_plan): in place into the caller's tensor that is an input's
# memory; into memory ORT allocates; into the caller's tensor; into a new buffer of the allocator; into memory kept
# with the binding, then copied out.
_IN_PLACE, _ALLOCATED, _WRITTEN, _PLACED, _SCRATCH = "in place", "allocated", "written", "placed", "scratch"


def _output_plan(outputs: list, binding: "_Binding", allocator: bool, keep: tuple[int, ...], into,
                 inputs: Sequence[np.ndarray], aliased: Mapping[int, tuple[int, int]]) -> tuple[tuple, ...]:
    """Where each of a bound run's outputs goes, as (position, name, (shape, dtype, nbytes) or None, how, kept, the
    caller's tensor, the binding's memory, the address bound) (`allocator`: the run has one; `aliased`: _aliased's).

    An output whose target is an input's memory is written there in place, whatever its size, and of the shape the
    caller's kernel context gave it (one the model leaves dynamic too: genai's present, as long as its past). One
    of unknown shape is allocated by ORT. Each other one is written by ORT into the caller's tensor (a large one of
    `into`), into a new buffer of the allocator (kept and not small, or large: it leaves by handle, without a
    copy), or into memory kept with the binding (bound once) and read out after the run: small outputs travel
    inline anyway, and an allocation for them would be waste; a small one the caller gives a tensor for is copied
    there (the caller's tensors change from run to run: a swapped pair). `kept`: the caller keeps it in the
    allocator, where what is read out then goes."""
    plan = []
    for i, (name, static) in enumerate(outputs):
        kept = allocator and i in keep
        target = array = address = None
        if i in aliased:
            how, target, address = _IN_PLACE, into[i], aliased[i][1]
        elif static is None:
            how = _ALLOCATED
        else:
            target = _writable_target(into, i, static, inputs) if into else None
            if target is not None and static[2] > COPY_BYTES:
                how, address = _WRITTEN, target.local_array().ctypes.data
            elif allocator and (kept and static[2] > COPY_BYTES or static[2] >= PLACE_BYTES):
                how = _PLACED  # (no target: a small one's is not placed, a large one's is written)
            else:
                how = _SCRATCH
                array, address = binding.scratch(i, static)
        plan.append((i, name, static, how, kept, target, array, address))
    return tuple(plan)


def _aliased(into, inputs: Sequence[np.ndarray], address: Callable[[int, np.ndarray], int]) \
        -> dict[int, tuple[int, int]]:
    """Outputs (by position) whose target IS an input's memory (same start, same size), with that input and where
    that memory lies: the caller gave them one memory as ORT's kernel context did (onnxruntime-genai's shared KV
    cache), so ORT here sees them so too and its kernels write in place (GroupQueryAttention with past ==
    present). `address(key, array)`: where an array lies (input k's under k, output i's target under -1 - i)."""
    targets = {i: array for i, t in into.items() if (array := t.local_array()) is not None and array.nbytes}
    sizes = {array.nbytes for array in targets.values()}
    where = {(address(k, a), a.nbytes): k for k, a in enumerate(inputs) if a.nbytes in sizes}
    out = {}
    for i, array in targets.items():
        at = address(-1 - i, array)
        k = where.get((at, array.nbytes))
        if k is not None:
            out[i] = (k, at)
    return out


def _writable_target(into, i: int, static, inputs: Sequence[np.ndarray]) -> Tensor | None:
    """The caller's tensor output `i` can be written into by ORT: of the output's type and shape, addressable
    here, and sharing no memory with an input (ORT would read what it writes)."""
    target = into.get(i)
    if target is None or target.shape != static[0] or target.dtype != static[1]:
        return None
    array = target.local_array()
    if array is None or any(np.may_share_memory(array, a) for a in inputs):
        return None
    return target


class _Binding:
    """An IOBinding kept between runs: what each input and output is bound to, and the memory kept with it
    (small inputs are copied into it; small outputs of known shape are written into it)."""

    __slots__ = ("io", "names", "inputs", "copies", "outputs", "_scratch", "_addresses", "ort_allocated", "_plan")

    def __init__(self, io, inputs: list[str], outputs: list):
        self.io = io
        self.names = inputs
        self.inputs: list[np.ndarray | None] = [None] * len(inputs)  # the array each input is bound to (kept alive)
        self.copies: list[np.ndarray | None] = [None] * len(inputs)  # memory small inputs are copied into
        # address bound (with the shape, where an input's memory is bound); None: ORT allocates; -1: unbound
        self.outputs: list[int | tuple | None] = [-1] * len(outputs)
        self._scratch: dict[int, tuple[np.ndarray, int]] = {}
        self._addresses: dict[int, tuple[np.ndarray, int]] = {}  # key -> (the array of the last run, its address)
        self.ort_allocated = any(static is None for _, static in outputs)
        self._plan: tuple = (None, None, ())  # (allocator, keep, plan) of the last run without `into`

    def plan(self, outputs: list, allocator: bool, keep: tuple[int, ...]) -> tuple[tuple, ...]:
        """The output plan (_output_plan) of a run without `into`: a function of whether the run has an allocator
        and of its `keep` only (the binding's memory it names stays the binding's), so the last one is made anew
        only where either differs."""
        last_allocator, last_keep, plan = self._plan
        if allocator is not last_allocator or keep != last_keep:
            plan = _output_plan(outputs, self, allocator, keep, None, (), {})
            self._plan = (allocator, keep, plan)
        return plan

    def address(self, key: int, array: np.ndarray) -> int:
        """Where `array`'s bytes lie, asked of numpy only where the array in place `key` is not the last run's: a
        kept call's tensors are the same from run to run, and asking numpy costs a call into it each time."""
        seen = self._addresses.get(key)
        if seen is not None and seen[0] is array:
            return seen[1]
        address = array.ctypes.data
        self._addresses[key] = (array, address)
        return address

    def scratch(self, i: int, static) -> tuple[np.ndarray, int]:
        """Output i's memory kept with the binding, and its address (asking numpy for it costs)."""
        kept = self._scratch.get(i)
        if kept is None:
            array = np.empty(static[0], static[1])
            kept = self._scratch[i] = (array, array.ctypes.data)
        return kept


def _static(arg) -> tuple[tuple[int, ...], np.dtype, int] | None:
    """(shape, dtype, nbytes) of an output whose shape and plain type are known before the run."""
    if not arg.type.startswith("tensor(") or not all(isinstance(d, int) and d >= 0 for d in arg.shape or [None]):
        return None
    try:
        dtype = dtype_of(onnx.TensorProto.DataType.Value(arg.type[7:-1].upper()))
    except (ValueError, EpError):
        return None
    return tuple(arg.shape), dtype, nbytes_of(tuple(arg.shape), dtype)


def _with_constants(model: onnx.ModelProto, claimed: frozenset[str], groups: list[NodeGroup]) -> list[NodeGroup]:
    """The groups with the Constant nodes their nodes read (a control-flow body's outer-scope reads too).
    ORT sees a Constant as an initializer, a value known when it loads the model: cut out of the partition,
    it would be a graph input instead, and ORT's shape inference, constant folding and kernels that need a
    constant (a Scan body's output shapes) would no longer see its value."""
    from ephost.graph import subgraph_inputs
    constants = {n.output[0]: n.name for n in model.graph.node
                 if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.name not in claimed}
    if not constants:
        return groups
    nodes = {n.name: n for n in model.graph.node}
    taken = {name for group in groups for name in group.node_names}
    out = []
    for group in groups:
        reads = {v for name in group.node_names for v in [*nodes[name].input, *subgraph_inputs(nodes[name])]}
        added = [constants[v] for v in sorted(reads) if v in constants and constants[v] not in taken]
        taken.update(added)
        out.append(dataclasses.replace(group, node_names=(*added, *group.node_names)) if group.fused else group)
    return out


class OrtEp(EpDefaults):
    def __init__(self, factory: "OrtEpFactory", devices: list, session_options: Mapping[str, str]):
        self._factory = factory
        self._devices = devices
        self._provider_options, config = split_session_options(session_options)
        self._keep_context = config.get(EP_CONTEXT_ENABLE) == "1"
        # The session's settings (threads, optimization level...) and its other session config entries, which
        # every ORT session of this EP runs by
        self._settings = session_config.read(config)
        self._entries = {k: v for k, v in config.items()
                         if k.startswith("session.") and not session_config.is_setting(k)}
        self._profile: _Profile | None = None  # while profiling: the partition sessions that record their runs

    # --- profiling ---

    def start_profiling(self) -> None:
        """Partitions compiled from now on record each node's run (ORT's own session profiler)."""
        if self._profile is None:
            self._profile = _Profile()

    def end_profiling(self) -> list[ProfilingEvent]:
        """The node events the profiled partitions recorded, and profiling stops."""
        profile, self._profile = self._profile, None
        return profile.end() if profile is not None else []

    def get_name(self) -> str:
        return self._factory.get_name()

    def capability_key(self) -> tuple:
        """What GetCapability's answer depends on beside the model and the claimed nodes (server/capabilities.py):
        this factory (its provider, libraries and session configuration are fixed), the devices and the EP's
        options."""
        return (id(self._factory), tuple(self._devices), tuple(sorted(self._provider_options.items())),
                tuple(sorted(self._settings.items())), tuple(sorted(self._entries.items())))

    def _session(self, model: onnx.ModelProto | bytes, external: ExternalData | None = None, *,
                 capability: bool = False, restore: bool = False, context_path: str | None = None):
        """An ORT session of `model`: asking which nodes the EP takes (`capability`), compiling (writing the
        compiled form to `context_path` where given), or restoring a compiled form (`restore`: the model is
        that form, already optimized). `external`: the files the model's external tensors name."""
        ort = _ort()
        options = ort.SessionOptions()
        if not isinstance(model, bytes):
            model = readable_model(model)
            if external is not None and has_external_data(model):
                placed = on_disk(model, external)
                if placed is not None:
                    # ORT opens (and maps) the very files the descriptors are, by their path here: nothing copied.
                    model, folder = placed
                    options.add_session_config_entry(ORT_EXTERNAL_FOLDER, folder)
                else:
                    log.warning("the external data files of %s have no path in this process (deleted, or another "
                                "mount namespace): their bytes are copied into ONNX Runtime", self.get_name())
                    model = external.inlined(model)
        f = self._factory
        for key in ("intra_op_num_threads", "inter_op_num_threads"):
            if key in f.options:
                setattr(options, key, int(f.options[key]))
        for key, value in {**SESSION_DEFAULTS, **f.session_config, **self._entries}.items():
            options.add_session_config_entry(key, value)
        for name, value in self._settings.items():  # the session's own, over the worker's
            if name != "graph_optimization_level":
                kind = type(getattr(options, name))
                setattr(options, name, kind(int(value)) if hasattr(kind, "__members__") else value)
        level = "disable" if capability or restore else f.options.get("graph_optimization_level", "all")
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[level])
        session_level = self._settings.get("graph_optimization_level")
        if session_level is not None and not (capability or restore):
            options.graph_optimization_level = ort.GraphOptimizationLevel(int(session_level))
        if context_path is not None:
            if self._factory.provider == CPU:
                options.optimized_model_filepath = context_path
            else:  # a vendor EP makes its own EPContext model where it can (OpenVINO's does)
                for key, value in ((ep_context.ENABLE, "1"), (ep_context.FILE_PATH, context_path),
                                   (ep_context.EMBED_MODE, "1")):
                    options.add_session_config_entry(key, value)
        for library in f.custom_ops_libraries:
            options.register_custom_ops_library(library)
        profile = self._profile if not capability else None
        if profile is not None:
            options.enable_profiling = True
            options.profile_file_prefix = profile.prefix()
        if capability:
            options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
            options.log_severity_level = 4  # asking is allowed to fail; that is an answer, not an error
        if f.ort_devices:
            options.add_provider_for_devices([f.ort_devices[i] for i in self._devices], self._provider_options)
            providers = None
        else:
            providers = [(f.provider, self._provider_options)]
        data = model if isinstance(model, bytes) else model.SerializeToString()
        # The model's own options (its ort_config) are the client's to apply: they came with `options`
        session = ort.InferenceSession(data, options, providers=providers, read_config_from_model=0)
        if profile is not None:
            profile.sessions.append(session)
        return session

    def get_capability(self, model: onnx.ModelProto, claimed: frozenset[str],
                       external: ExternalData | None = None) -> list[NodeGroup]:
        # Its own EPContext nodes are partitions to restore, each its own; ORT is asked about the rest.
        restore = [NodeGroup((n.name,), fused=True) for n in ep_context.own_nodes(model, self.get_name(), claimed)]
        claimed = claimed | {g.node_names[0] for g in restore}
        return restore + self._capability(model, claimed, external)

    def _capability(self, model: onnx.ModelProto, claimed: frozenset[str],
                    external: ExternalData | None) -> list[NodeGroup]:
        if any(ep_context.is_ep_context(n) for n in model.graph.node):
            # ORT runs no EPContext node of another EP: ask node by node about the others.
            return _with_constants(model, claimed, self._capability_by_node(model, claimed, external=external))
        try:
            session = self._session(model, external, capability=True)
        except EpError as e:
            log.info("%s takes no node of this model: %s", self.get_name(), e)
            return []
        except Exception as e:
            # ORT will not take the whole model (an op no EP of it runs): ask node by node.
            log.info("%s cannot load the whole model (%s); asking node by node", self.get_name(), e)
            return _with_constants(model, claimed, self._capability_by_node(model, claimed, external=external))
        # Everything ORT gives the chosen EP, as one group: the session splits it where fusing would make a
        # cycle. (ORT reports the CPU EP's nodes one subgraph each; a partition of them is one ORT session.)
        provider = self._factory.provider
        model_nodes = {n.name for n in model.graph.node}
        # Nodes of a custom op library's domains run on ORT's CPU EP whatever the chosen EP is: they are this
        # worker's too (the library is loaded here, and nowhere else).
        custom = {n.name for n in model.graph.node if n.domain not in BUILTIN_DOMAINS} \
            if self._factory.custom_ops_libraries else set()
        reported, names = set(), []
        for subgraph in session.get_provider_graph_assignment_info():
            for node in subgraph.get_nodes():
                reported.add(node.name)
                ours = subgraph.ep_name == provider or (subgraph.ep_name == CPU and node.name in custom)
                if ours and node.name in model_nodes and node.name not in claimed:
                    names.append(node.name)
        # Nodes ORT rewrote before assigning (ops it runs through their function body) are reported under
        # other names, or none: ask about each of them alone. Constants become initializers, reported as no
        # node: _with_constants gives ORT those its nodes read.
        rewritten = {n.name for n in model.graph.node
                     if n.name not in reported and n.name not in claimed and n.op_type != "Constant"}
        if rewritten:
            for group in self._capability_by_node(model, claimed, only=rewritten, external=external):
                names += group.node_names
        return _with_constants(model, claimed, [NodeGroup(tuple(names), fused=True)] if names else [])

    def _capability_by_node(self, model: onnx.ModelProto, claimed: frozenset[str],
                            only: set[str] | None = None, external: ExternalData | None = None) -> list[NodeGroup]:
        from ephost.graph import GraphIndex
        index = GraphIndex.of(model)
        index.external = external
        taken = []
        for name in index.order:
            if name in claimed or (only is not None and name not in only):
                continue
            inputs, outputs = index.partition_io([name])
            single = FusedGraph(name, index, (name,), tuple(inputs), tuple(outputs))
            try:
                session = self._session(single.model, external, capability=True)
            except Exception:
                continue
            custom = self._factory.custom_ops_libraries and index.nodes[name].domain not in BUILTIN_DOMAINS
            if any(s.ep_name == self._factory.provider or (s.ep_name == CPU and custom)
                   for s in session.get_provider_graph_assignment_info()):
                taken.append(name)
        return [NodeGroup(tuple(taken), fused=True)] if taken else []

    def compile(self, graphs: Sequence[FusedGraph]) -> list[OrtComputeInfo]:
        infos = []
        for graph in graphs:
            node = graph.ep_context_node
            if node is not None and ep_context.source_of(node) == self.get_name():
                infos.append(self._restore(graph, node))
                continue
            try:
                # A partition whose weights are external data has no compiled form: it would carry them all.
                if self._keep_context and graph.external is None:
                    with tempfile.TemporaryDirectory(prefix="ephost-ctx-") as tmp:
                        path = os.path.join(tmp, "partition.onnx")
                        session = self._session(graph.model, context_path=path)
                        context, shared = self._context(path), False
                else:  # (a profiled partition is its own: its session records this EP's runs only)
                    session, shared = self._factory.compiled(None if self._profile else self._compile_key(graph),
                                                             lambda: self._session(graph.model, graph.external))
                    context = None
            except EpError:
                raise
            except Exception as e:
                raise ort_error(f"ONNX Runtime cannot compile {graph.name!r}", e) from None
            infos.append(OrtComputeInfo(graph, session, context, shared=shared))
        return infos

    def _compile_key(self, graph: FusedGraph) -> tuple | None:
        """What an ORT session of the partition is a function of: the model's content, the partition's nodes and
        edges, the EP's configuration. None where the model has no content hash (nothing to share by)."""
        digest = graph.source.digest
        return (digest, graph.nodes, graph.inputs, graph.outputs, self.capability_key()) if digest else None

    def _context(self, path: str) -> EpContext | None:
        """The compiled form ORT wrote while compiling: for its CPU EP the graph-optimized partition model (what
        `optimized_model_filepath` saves: restoring skips graph optimization, not kernel creation); for a vendor
        EP the EPContext model ORT made for it, where the EP makes one."""
        if not os.path.isfile(path):
            return None  # the vendor EP makes no EP context
        with open(path, "rb") as f:
            blob = f.read()
        form = CONTEXT_OPTIMIZED if self._factory.provider == CPU else CONTEXT_ORT
        return EpContext(form, blob, _ort().__version__)

    def _restore(self, graph: FusedGraph, node: onnx.NodeProto) -> OrtComputeInfo:
        context = ep_context.read(node, _ort().__version__)
        if context.form not in (CONTEXT_OPTIMIZED, CONTEXT_ORT):
            raise EpInvalidArgument(f"EPContext node {node.name!r}: form {context.form!r} is not ONNX Runtime's")
        ep_context.model_of(node, context)  # checked as any model from a peer: it names no file
        try:
            # An optimized model is loaded without optimizing it again; ORT's own EPContext model as ORT loads it.
            session = self._session(context.blob, restore=context.form == CONTEXT_OPTIMIZED)
        except EpError:
            raise
        except Exception as e:
            raise EpInvalidArgument(f"EPContext node {node.name!r}: ONNX Runtime cannot restore its compiled form: "
                                    f"{e}") from None
        return OrtComputeInfo(graph, session, context if self._keep_context else None, restored=True)


class _Profile:
    """An OrtEp's profiling: the partition sessions made with ORT's profiler on, their trace files in a private
    directory until end() reads and removes them."""

    def __init__(self):
        self.directory = tempfile.mkdtemp(prefix="ephost-profile-")
        self.sessions: list = []

    def prefix(self) -> str:
        return os.path.join(self.directory, f"partition{len(self.sessions)}")

    def end(self) -> list[ProfilingEvent]:
        events = []
        try:
            for session in self.sessions:
                path = session.end_profiling()
                start = session.get_profiling_start_time_ns()  # (ORT's trace: microseconds since then)
                with open(path) as f:
                    trace = json.load(f)
                events += [ProfilingEvent(e["name"], e.get("cat", ""), start + int(e.get("ts", 0)) * 1000,
                                          int(e.get("dur", 0)) * 1000,
                                          {k: v if isinstance(v, str) else json.dumps(v)  # (JSON, as ORT writes)
                                           for k, v in e.get("args", {}).items()},
                                          int(e.get("pid", 0)), int(e.get("tid", 0)))
                           for e in trace if e.get("cat") == "Node"]
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
        return events


class OrtEpFactory(HostMemoryFactory):
    OPTIONS = OPTIONS

    @staticmethod
    def configure_worker() -> None:
        """ORT logs to stderr on its own: a worker keeps it to errors unless it logs in detail. An application's
        process (the CPU fallback, inproc:) keeps ORT's default logger as the application set it."""
        _ort().set_default_logger_severity(2 if log.isEnabledFor(logging.INFO) else 3)

    def __init__(self, options: Mapping[str, str] | None = None):
        options = dict(options or {})
        check_options(EP_NAME, options, OPTIONS)
        level = options.get("graph_optimization_level", "all")
        if level not in _LEVELS:
            raise EpInvalidArgument(f"graph_optimization_level must be one of {sorted(_LEVELS)}, got {level!r}")
        self.options = options
        ort = _ort()
        self.provider_options = _pairs(options.get("provider_options", ""), "provider_options")
        self.session_config = _pairs(options.get("session_config", ""), "session_config")
        before = {d.ep_name for d in ort.get_ep_devices()}
        library = resolve_library(options["library"]) if options.get("library") else None
        if library:
            if not os.path.isfile(library):
                raise EpNotFound(f"no plugin EP library at {library}")
            try:
                ort.register_execution_provider_library(options.get("library_name") or _REGISTRATION, library)
            except Exception as e:
                raise EpInvalidArgument(f"ONNX Runtime cannot load the EP library {library}: {e}") from None
        self.custom_ops_libraries = custom_ops_libraries(options.get("custom_ops_library", ""))
        added = sorted({d.ep_name for d in ort.get_ep_devices()} - before)
        self.provider = options.get("provider") or (added[0] if added else _library_ep_name(library) or CPU)
        self.ort_devices = [d for d in ort.get_ep_devices() if d.ep_name == self.provider]
        if not self.ort_devices and self.provider not in ort.get_available_providers() and not library:
            raise EpNotFound(f"ONNX Runtime has no execution provider {self.provider!r}; it has "
                             f"{', '.join(ort.get_available_providers())}")
        self.version = ort.__version__
        max_ir_version()  # ORT's own first-session set-up, paid here (a worker's start) rather than by a session
        # Compiled partitions by what they are a function of (OrtEp._compile_key), while a compute info holds
        # them: concurrent sessions on one model (one client's or several) compile each partition once and hold
        # its weights once. ORT runs one session from several threads at once.
        self._compiled: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._compiled_lock = threading.Lock()  # guards _compiled
        self._init_memory(self.provider, cpu_device().vendor_id)
        self._devices = [self._device_info(i, d) for i, d in enumerate(self.ort_devices)]
        if not self.ort_devices and not library:
            # A provider ORT knows only by name (no plugin devices): it runs on this host.
            self._devices = [EpDeviceInfo(0, self.provider, "Microsoft", cpu_device(), self.memory_infos,
                                          {"version": self.version}, dict(self.provider_options))]
        if library and not self._devices:
            log.warning("EP library %s (EP %s) reports no device on this machine's hardware", library,
                        self.provider)
        self.device_count = len(self._devices)

    def compiled(self, key: tuple | None, make) -> tuple[Any, bool]:
        """(an ORT session of a partition, whether an earlier compile's was shared): made with `make` unless a
        live one has the same key."""
        if key is not None:
            with self._compiled_lock:
                session = self._compiled.get(key)
            if session is not None:
                return session, True
        session = make()
        if key is None:
            return session, False
        with self._compiled_lock:
            kept = self._compiled.setdefault(key, session)
        return kept, kept is not session
    def _device_info(self, index: int, d) -> EpDeviceInfo:
        hw = d.device
        device = HardwareDevice(HardwareDeviceType(int(hw.type.value)), hw.vendor_id, hw.vendor, hw.device_id,
                                dict(hw.metadata))
        return EpDeviceInfo(index, d.ep_name, d.ep_vendor, device, self.memory_infos, dict(d.ep_metadata),
                            {**dict(d.ep_options), **self.provider_options})

    def get_name(self) -> str:
        return self.provider

    def get_vendor(self) -> str:
        return self._devices[0].ep_vendor if self._devices else "unknown"

    def get_vendor_id(self) -> int:
        return self._devices[0].device.vendor_id if self._devices else 0

    def get_version(self) -> str:
        """The EP's version: a plugin EP library's own (ORT lists it in its devices' metadata), else ORT's."""
        versions = {d.ep_metadata.get("version", "") for d in self._devices} - {""}
        return versions.pop() if len(versions) == 1 else self.version

    def get_supported_devices(self) -> list[EpDeviceInfo]:
        return list(self._devices)

    def create_ep(self, device_indices: Sequence[int], session_options: Mapping[str, str]) -> OrtEp:
        self._check_devices(device_indices)
        return OrtEp(self, list(device_indices) or [0], {**self.provider_options, **session_options})

    def release_ep(self, ep: OrtEp) -> None:
        pass

    def close(self) -> None:
        pass


def custom_ops_libraries(value: str) -> tuple[str, ...]:
    """The custom op libraries `value` names (paths or `module:function`, separated by ';'), resolved in this
    process and each loaded once by ONNX Runtime here, so that a library it cannot load stops the worker at
    start with an error naming it (RegisterCustomOps runs then: a library that crashes there crashes the worker
    before it serves anything)."""
    ort = _ort()
    libraries = []
    for entry in filter(None, (e.strip() for e in value.split(";"))):
        path = resolve_library(entry)
        if not os.path.isfile(path):
            raise EpNotFound(f"custom_ops_library: no custom op library at {path}")
        try:
            ort.SessionOptions().register_custom_ops_library(path)
        except Exception as e:
            raise EpInvalidArgument(f"custom_ops_library: ONNX Runtime cannot load {path}: {e}") from None
        libraries.append(path)
    return tuple(libraries)


def _library_ep_name(library: str | None) -> str | None:
    """The EP name a Python package that ships a plugin library declares (onnxruntime_ep_openvino does)."""
    if not library:
        return None
    if "openvino" in os.path.basename(library):
        try:
            import onnxruntime_ep_openvino
            return onnxruntime_ep_openvino.get_ep_name()
        except ImportError:
            return None
    return None
