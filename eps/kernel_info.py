"""KernelInfo: what a compiled partition knows about itself, as ONNX Runtime's OrtKernelInfo tells a custom op
kernel (KernelInfo_GetInputCount / GetOutputCount, KernelInfo_GetInputName / GetOutputName,
KernelInfo_GetInputTypeInfo / GetOutputTypeInfo, KernelInfo_GetNodeName) and the options its EP was created
with (the provider options of `SessionOptions.add_provider_for_devices`), which ORT hands a kernel through its
EP. An EP written for ephost gets one per fused graph from `FusedGraph.kernel_info(options)` when it compiles
and keeps it with the compute info (see eps/example.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import numpy as np
import onnx

from ephost.errors import EpInvalidArgument, EpOutOfRange

Dim = int | str | None  # a fixed size, a symbolic name ("N"), or unknown


@dataclass(frozen=True)
class TypeInfo:
    """A value's type (ORT's OrtTypeInfo with its OrtTensorTypeAndShapeInfo): `elem_type` is ONNX's
    TensorProto.DataType (0 where the value is no tensor or its type is unknown), `shape` is None where the
    rank is unknown. `kind` is "tensor", "sequence", "map", "optional", "sparse_tensor" or "unknown"."""

    kind: str
    elem_type: int
    shape: tuple[Dim, ...] | None

    @property
    def type_string(self) -> str:
        """ORT's type string: "tensor(float)", or the kind for what is no tensor."""
        if self.kind != "tensor" or not self.elem_type:
            return self.kind
        return f"tensor({onnx.TensorProto.DataType.Name(self.elem_type).lower()})"

    @property
    def dtype(self) -> np.dtype | None:
        """The numpy dtype of a tensor's elements, where numpy has one."""
        if self.kind != "tensor" or not self.elem_type:
            return None
        try:
            return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.elem_type))
        except (KeyError, TypeError):
            return None

    @classmethod
    def of(cls, value: onnx.ValueInfoProto) -> "TypeInfo":
        t = value.type
        kind = t.WhichOneof("value") or "unknown"
        kind = {"tensor_type": "tensor", "sequence_type": "sequence", "map_type": "map",
                "optional_type": "optional", "sparse_tensor_type": "sparse_tensor"}.get(kind, "unknown")
        if kind not in ("tensor", "sparse_tensor"):
            return cls(kind, 0, None)
        tensor = t.tensor_type if kind == "tensor" else t.sparse_tensor_type
        shape = None
        if tensor.HasField("shape"):
            shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
        return cls(kind, tensor.elem_type, shape)


@dataclass(frozen=True)
class ValueInfo:
    name: str
    type: TypeInfo


@dataclass(frozen=True)
class KernelInfo:
    """A compiled partition's inputs and outputs (names, types, shapes, in the order compute takes and
    returns them) and its EP's options. The get_* methods are ORT's KernelInfo_* calls by their names."""

    node_name: str
    inputs: tuple[ValueInfo, ...]
    outputs: tuple[ValueInfo, ...]
    options: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    @classmethod
    def of(cls, model: onnx.ModelProto, name: str, options: Mapping[str, str] | None = None) -> "KernelInfo":
        """The KernelInfo of a partition cut out as a standalone model (FusedGraph.model)."""
        initializers = {t.name for t in model.graph.initializer}
        return cls(name, tuple(ValueInfo(v.name, TypeInfo.of(v)) for v in model.graph.input
                               if v.name not in initializers),
                   tuple(ValueInfo(v.name, TypeInfo.of(v)) for v in model.graph.output), options or {})

    def get_node_name(self) -> str:
        return self.node_name

    def get_input_count(self) -> int:
        return len(self.inputs)

    def get_output_count(self) -> int:
        return len(self.outputs)

    def get_input_name(self, index: int) -> str:
        return self._at(self.inputs, index, "input").name

    def get_output_name(self, index: int) -> str:
        return self._at(self.outputs, index, "output").name

    def get_input_type_info(self, index: int) -> TypeInfo:
        return self._at(self.inputs, index, "input").type

    def get_output_type_info(self, index: int) -> TypeInfo:
        return self._at(self.outputs, index, "output").type

    def get_option(self, key: str, default: str | None = None) -> str | None:
        """One of the EP's options (ORT's provider options, as the kernel's EP received them)."""
        return self.options.get(key, default)

    def option_int(self, key: str, default: int) -> int:
        value = self.options.get(key)
        if value is None:
            return default
        try:
            return int(value)
        except ValueError:
            raise EpInvalidArgument(f"{self.node_name}: option {key} takes an integer, got {value!r}") from None

    def _at(self, values: tuple[ValueInfo, ...], index: int, what: str) -> ValueInfo:
        if not 0 <= index < len(values):
            raise EpOutOfRange(f"{self.node_name} has {len(values)} {what}(s); no {what} {index}")
        return values[index]
