"""A model's inputs and outputs as a session's runs see them: the feeds checked (client/feeds.py) and made graph
values, the output names a run asks for, and their descriptions as ONNX Runtime gives them (NodeArg)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import onnx

from ephost.errors import EpError, EpInvalidArgument
from ephost.types import dtype_of, is_plain_dtype
from ephost.tensor import Tensor
from ephost.values import host_value
from ephost.client.feeds import FeedCheck, check_feed_names, shape_of, type_string


@dataclass(frozen=True)
class NodeArg:
    """A graph input or output, as ONNX Runtime's NodeArg: name, type ("tensor(float)") and shape."""

    name: str
    type: str
    shape: list


def static_shapes(graph: onnx.GraphProto) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The values of a (shape-inferred) graph whose shape and plain element type are known before it runs."""
    out = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        t = value.type.tensor_type
        if value.type.WhichOneof("value") != "tensor_type" or not t.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        if min(dims, default=0) < 0:
            continue
        try:
            dtype = dtype_of(t.elem_type)
        except EpError:
            continue
        if is_plain_dtype(dtype):
            out[value.name] = (tuple(dims), dtype)
    return out


class ModelIO:
    """The graph's inputs (initializers aside) and outputs, read once when the session is made."""

    def __init__(self, graph: onnx.GraphProto, constants: Mapping[str, Any]):
        self.inputs = [i for i in graph.input if i.name not in constants]
        self.input_names = [i.name for i in self.inputs]
        self.outputs = list(graph.output)
        self._constants = constants
        # As ORT does: an input of optional type that is not fed is an empty optional (None).
        self._empty_optionals = {i.name: None for i in self.inputs if i.type.WhichOneof("value") == "optional_type"}
        self._checks = {i.name: FeedCheck.of(i.name, i.type) for i in self.inputs}
        self._output_names = dict.fromkeys(o.name for o in self.outputs)  # in order
        self._all_outputs = tuple(self._output_names)

    def input_args(self) -> list[NodeArg]:
        return [NodeArg(i.name, type_string(i.type), shape_of(i.type)) for i in self.inputs]

    def output_args(self) -> list[NodeArg]:
        return [NodeArg(o.name, type_string(o.type), shape_of(o.type)) for o in self.outputs]

    def output_names(self, asked: Sequence[str] | None) -> tuple[str, ...]:
        """The outputs a run asks for (None or empty: all of them, in the model's order)."""
        known = self._output_names
        if not asked:
            return self._all_outputs
        names = tuple(asked)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise EpInvalidArgument(f"unknown output name(s) {unknown}; the model's outputs are {sorted(known)}")
        return names

    def feeds(self, input_feed: Mapping[str, Any], to_host) -> list[Any]:
        """The feeds as graph values, in the order of `input_names`, each checked against its input's declared type
        (lists made arrays of it); `to_host(tensor)` brings a tensor no EP can read (in memory of a worker that
        went) to this process. Initializers fed (a variant session's to take) are not among them."""
        checks = self._checks
        if self._empty_optionals:
            input_feed = {**self._empty_optionals, **input_feed}
        # As many feeds as inputs, each input among them: the names are the inputs' (else check_feed_names says why)
        if len(input_feed) != len(checks):
            check_feed_names(checks, self._constants, input_feed)
        values = []
        for name, check in checks.items():
            try:
                value = input_feed[name]
            except KeyError:
                check_feed_names(checks, self._constants, input_feed)  # (raises: the input is not fed)
                raise
            if type(value) is not np.ndarray or not check.passes(value):
                value = host_value(check.take(value))
                if type(value) is Tensor and not value.addressable and value.buffer.owner is None:
                    value = to_host(value)
            values.append(value)
        return values
