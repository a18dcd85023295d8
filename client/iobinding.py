"""ephost.IOBinding, ONNX Runtime's IOBinding: inputs and outputs bound to memory before a run, so that values
stay where they live. An output bound to a worker's memory is left there by the partition that makes it (it
never comes back to the application), and a tensor in a worker's memory bound as an input is named by its
handle when the partition that reads it runs in that worker: a loop that feeds an output back moves no tensor
bytes between the processes.

Names and signatures follow onnxruntime.IOBinding (bind_cpu_input, bind_input, bind_ortvalue_input,
bind_output, bind_ortvalue_output, get_outputs, copy_outputs_to_cpu, clear_binding_*). Where ORT takes a
device type string ("cpu", "cuda"), ephost takes "cpu" (the application's memory), the name an EP was
registered under (with `device_id`: that registration's device), an EpDevice, or a MemoryInfo.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ephost.errors import EpInvalidArgument
from ephost.tensor import Tensor
from ephost.types import HOST_MEMORY, DeviceMemoryType, MemoryInfo, checked_shape, dtype_of, nbytes_of
from ephost.values import as_value
from ephost.client.devices import EpDevice
from ephost.client.feeds import foreign

if TYPE_CHECKING:
    from ephost.client.environment import Environment
    from ephost.client.session import InferenceSession


def device_memory(device: EpDevice) -> MemoryInfo:
    """Where values bound to an EP device live: its HOST_ACCESSIBLE memory (shared with the application, where
    the worker leaves outputs), else its DEFAULT memory."""
    memory = device.memory_info(DeviceMemoryType.HOST_ACCESSIBLE) or device.memory_info(DeviceMemoryType.DEFAULT)
    if memory is None:
        raise EpInvalidArgument(f"{device.ep_name} device of {device.registration_name!r} reports no memory")
    return memory


def _named(env: "Environment", name: str, device_id: int) -> MemoryInfo:
    if name.lower() == "cpu":
        return HOST_MEMORY
    if not env.is_registered(name):
        names = sorted(r.name for r in env.registrations())
        raise EpInvalidArgument(f"unknown device type {name!r}: give 'cpu', the name an EP was registered under "
                                f"({', '.join(names) or 'none is'}), an EpDevice or a MemoryInfo")
    devices = [d for d in env.registration(name).devices if d.index == (device_id or 0)]
    if not devices:
        raise EpInvalidArgument(f"{name!r} has no device {device_id}")
    return device_memory(devices[0])


# How each kind of device description names a memory: (env, what was given, device_id) -> MemoryInfo.
_PLACES: dict[type, Callable[["Environment", Any, int], MemoryInfo]] = {
    MemoryInfo: lambda env, memory, _: memory,
    EpDevice: lambda env, device, _: device_memory(device),
    str: _named,
}


def memory_of(env: "Environment", device, device_id: int = 0) -> MemoryInfo:
    """The memory a device description names (ORT's device_type/device_id, or an EpDevice, or a MemoryInfo)."""
    for kind, resolve in _PLACES.items():
        if isinstance(device, kind):
            return resolve(env, device, device_id)
    raise EpInvalidArgument(f"cannot bind to a device given as {type(device).__name__}: give 'cpu', a registration "
                            "name, an EpDevice or a MemoryInfo")


def _element_dtype(element_type) -> np.dtype:
    """ORT's element_type: a numpy type, or an ONNX TensorProto element type (an int)."""
    if isinstance(element_type, (int, np.integer)) and not isinstance(element_type, bool):
        return dtype_of(int(element_type))
    try:
        return np.dtype(element_type)
    except TypeError:
        raise EpInvalidArgument(f"element_type {element_type!r} is neither a numpy type nor an ONNX element "
                                "type") from None


def host_tensor_at(buffer_ptr: int, element_type, shape) -> Tensor:
    """A tensor over host memory at an address of this process (ORT's bind_input/bind_output with a pointer)."""
    if not isinstance(buffer_ptr, (int, np.integer)) or buffer_ptr <= 0:
        raise EpInvalidArgument(f"buffer_ptr must be an address in this process, got {buffer_ptr!r}")
    dtype, shape = _element_dtype(element_type), checked_shape(shape)
    nbytes = nbytes_of(shape, dtype)
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(int(buffer_ptr)))[:nbytes]
    return Tensor.from_numpy(raw.view(dtype).reshape(shape))


@dataclass(frozen=True)
class BoundOutput:
    """Where an output goes: a memory (the application's, or an EP's), and the tensor it is written into when
    one was bound (ORT's pre-allocated output)."""

    memory: MemoryInfo
    tensor: Tensor | None = None


class IOBinding:
    """Inputs and outputs of one session bound by name (onnxruntime.IOBinding); made by session.io_binding()."""

    def __init__(self, session: "InferenceSession"):
        self.session = session
        self._env = session.environment
        self._inputs: dict[str, Any] = {}
        self._outputs: dict[str, BoundOutput] = {}
        self._results: list[Any] = []

    # --- inputs -----------------------------------------------------------------------------------

    def bind_cpu_input(self, name: str, arr_on_cpu) -> None:
        """Bind an input to an array in the application's memory (read when the session runs, not copied now)."""
        self._inputs[name] = as_value(np.asarray(arr_on_cpu))

    def bind_input(self, name: str, device_type, device_id: int | None = None, element_type=None, shape=None,
                   buffer_ptr: int | None = None) -> None:
        """ORT's form: memory given by device, element type, shape and address; ephost takes addresses in the
        application's memory ("cpu"), as a worker's memory has no address here (bind the ephost.Tensor
        instead). The short form `bind_input(name, value)` binds an ephost.Tensor or an array as it is."""
        if device_id is None and element_type is None and shape is None and buffer_ptr is None \
                and not isinstance(device_type, (str, EpDevice, MemoryInfo)):
            self.bind_ortvalue_input(name, device_type)
            return
        if element_type is None or shape is None or buffer_ptr is None:
            raise EpInvalidArgument("bind_input takes (name, device_type, device_id, element_type, shape, "
                                    "buffer_ptr), or (name, value)")
        memory = memory_of(self._env, device_type, device_id or 0)
        if memory != HOST_MEMORY:
            raise EpInvalidArgument(f"{memory.name} memory has no address in this process: bind the ephost.Tensor "
                                    "that holds it with bind_ortvalue_input")
        self._inputs[name] = host_tensor_at(buffer_ptr, element_type, shape)

    def bind_ortvalue_input(self, name: str, ortvalue) -> None:
        """Bind an ephost.Tensor (in any memory; one in a worker's memory stays there), an array, or an
        onnxruntime.OrtValue in this process's memory (read where it is)."""
        ortvalue = foreign(ortvalue)
        if not isinstance(ortvalue, (Tensor, np.ndarray, np.generic)):
            raise EpInvalidArgument(f"input {name!r}: bind an ephost.Tensor or a numpy array, not "
                                    f"{type(ortvalue).__name__}")
        self._inputs[name] = as_value(ortvalue)

    def synchronize_inputs(self) -> None:
        """Wait for bound inputs to be in place. Copies in ephost are done when copy_tensors returns (or
        their stream is flushed), so there is nothing left to wait for."""

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    # --- outputs ----------------------------------------------------------------------------------

    def bind_output(self, name: str, device_type="cpu", device_id: int = 0, element_type=None, shape=None,
                    buffer_ptr: int | None = None, *, tensor: Tensor | None = None) -> None:
        """Bind an output to a memory: "cpu" (the default: it comes back to the application), an EP's
        registration name, EpDevice or MemoryInfo (it stays there: in the worker that makes it), or to a tensor
        it is written into (`tensor=`, or an address in the application's memory with element_type and
        shape)."""
        if tensor is not None or isinstance(device_type, Tensor):
            self.bind_ortvalue_output(name, tensor if tensor is not None else device_type)
            return
        memory = memory_of(self._env, device_type, device_id)
        if buffer_ptr is None:
            self._outputs[name] = BoundOutput(memory)
            return
        if element_type is None or shape is None:
            raise EpInvalidArgument("element_type and shape are to be given with a pre-allocated buffer_ptr")
        if memory != HOST_MEMORY:
            raise EpInvalidArgument(f"{memory.name} memory has no address in this process: bind an ephost.Tensor "
                                    "with bind_ortvalue_output")
        self.bind_ortvalue_output(name, host_tensor_at(buffer_ptr, element_type, shape))

    def bind_ortvalue_output(self, name: str, ortvalue: Tensor) -> None:
        """Bind an output to a tensor it is written into (in any memory), or to an onnxruntime.OrtValue in this
        process's memory."""
        ortvalue = foreign(ortvalue)
        if isinstance(ortvalue, np.ndarray):
            ortvalue = as_value(ortvalue)
        if not isinstance(ortvalue, Tensor):
            raise EpInvalidArgument(f"output {name!r}: bind an ephost.Tensor, not {type(ortvalue).__name__}")
        self._outputs[name] = BoundOutput(ortvalue.memory_info, ortvalue)

    def synchronize_outputs(self) -> None:
        """Wait for outputs to be in place: they are when run_with_iobinding returns."""

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()

    def get_outputs(self) -> list[Any]:
        """The outputs of the last run, in the order they were bound: ephost.Tensors where they were bound
        (in a worker's memory, they stay there), or lists/None/dicts for non-tensor values."""
        return list(self._results)

    get_outputs_as_ortvaluevector = get_outputs

    def copy_outputs_to_cpu(self) -> list[Any]:
        """The outputs of the last run as numpy arrays of their own (copied out of whatever memory holds them)."""
        return [self._to_cpu(v) for v in self._results]

    # --- what the session reads and writes --------------------------------------------------------

    def bound_inputs(self) -> dict[str, Any]:
        return dict(self._inputs)

    def bound_outputs(self) -> dict[str, BoundOutput]:
        return dict(self._outputs)

    def set_results(self, values: dict[str, Any]) -> None:
        """Put a run's values where their outputs are bound (session.run_with_iobinding calls this)."""
        self._results = [self._place(values[name], out) for name, out in self._outputs.items()]

    def _place(self, value: Any, out: BoundOutput) -> Any:
        if not isinstance(value, Tensor):
            return value
        if out.tensor is not None:
            if value is not out.tensor:
                self._copy(value, out.tensor)
            return out.tensor
        if value.memory_info is out.memory or value.memory_info == out.memory:  # (most often the same object)
            return value
        if out.memory == HOST_MEMORY:
            if value.local_bytes() is not None:
                return value  # readable here already (a worker's shared memory): no copy
            dst = Tensor.from_numpy(np.empty(value.shape, value.dtype))
        else:
            dst = Tensor.empty(value.shape, value.dtype, self._env.allocator_for(out.memory))
        self._copy(value, dst)
        return dst

    def _copy(self, src: Tensor, dst: Tensor) -> None:
        with self.session.profiler.span("Copy", "to a bound output", bytes=src.nbytes, src=src.memory_info.name,
                                        dst=dst.memory_info.name):
            self._env.copy_tensors([src], [dst])

    def _to_cpu(self, value: Any) -> Any:
        if not isinstance(value, Tensor):
            return value
        local = value.local_array()
        if local is not None:
            return local.copy()
        return self._env.to_host(value).numpy()
