"""LoRA adapters, as ONNX Runtime applies them (RunOptions.add_active_adapter): an active adapter's parameters
are fed in place of the model's overridable initializers of their names (client/overrides.py), for every EP.

An adapter is an onnxruntime.LoraAdapter (loaded with Load(path)), an onnxruntime.AdapterFormat, a path to an
.onnx_adapter file, or a mapping of parameter names to arrays. ORT's LoraAdapter keeps its parameters to itself:
ORT reads them, with a session of Identity nodes over the model's overridable initializers run with the adapter
active; the values that differ from the model's defaults are the adapter's."""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ephost.errors import EpError, EpInvalidArgument
from ephost.external_data import ExternalData, external_ref
from ephost.client.feeds import foreign


class Adapters:
    """The parameters of the adapters a session's runs activate, read once per adapter (the last few kept)."""

    def __init__(self, model: onnx.ModelProto, overridable: frozenset[str], external: ExternalData | None,
                 size: int = 8):
        self._model, self._names, self._external = model, overridable, external
        self._size = size
        self._read: OrderedDict[int, tuple[Any, dict[str, np.ndarray]]] = OrderedDict()  # id -> (adapter, values)
        self._lock = threading.Lock()  # guards _read

    def feeds(self, adapters: Sequence[Any]) -> dict[str, np.ndarray]:
        """What the active adapters feed, the later ones over the earlier."""
        out: dict[str, np.ndarray] = {}
        for adapter in adapters:
            out.update(self._values(adapter))
        return out

    def _values(self, adapter: Any) -> dict[str, np.ndarray]:
        with self._lock:
            seen = self._read.get(id(adapter))
            if seen is not None and seen[0] is adapter:
                self._read.move_to_end(id(adapter))
                return seen[1]
        values = self._parameters(adapter)
        unknown = sorted(set(values) - self._names)
        if unknown:
            raise EpInvalidArgument(f"the adapter has parameter(s) {unknown}, which the model has no overridable "
                                    f"initializer (a graph input with a default) for; it has {sorted(self._names)}")
        with self._lock:  # (the adapter is held, so that its id names no other while it is here)
            self._read[id(adapter)] = (adapter, values)
            while len(self._read) > self._size:
                self._read.popitem(last=False)
        return values

    def _parameters(self, adapter: Any) -> dict[str, np.ndarray]:
        if isinstance(adapter, Mapping):
            return {str(k): np.asarray(foreign(v)) for k, v in adapter.items()}
        if isinstance(adapter, (str, os.PathLike)):
            import onnxruntime
            adapter = onnxruntime.AdapterFormat.read_adapter(os.fspath(adapter))
        if hasattr(adapter, "get_parameters"):  # ORT's AdapterFormat
            return {k: np.asarray(foreign(v)) for k, v in adapter.get_parameters().items()}
        if type(adapter).__name__ == "LoraAdapter":
            return self._through_ort(adapter)
        raise EpInvalidArgument(f"an adapter is an onnxruntime.LoraAdapter, an AdapterFormat, a path or a dict of "
                                f"arrays, not {type(adapter).__name__}")

    def _through_ort(self, adapter: Any) -> dict[str, np.ndarray]:
        """An ORT LoraAdapter's parameters, as ORT feeds them: the overridable initializers, run with it active."""
        from ephost.eps.onnxruntime import ort_api
        ort = ort_api()
        g = self._model.graph
        names = sorted(self._names)
        infos = {i.name: i for i in g.input}
        defaults = {t.name: self._default(t) for t in g.initializer if t.name in self._names}
        graph = helper.make_graph(
            [helper.make_node("Identity", [n], [f"{n}:adapter"]) for n in names], "adapter",
            [infos[n] for n in names],
            [helper.make_value_info(f"{n}:adapter", infos[n].type) for n in names],
            [numpy_helper.from_array(defaults[n], n) for n in names])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)],
                                  ir_version=min(self._model.ir_version or 8, 10))
        run_options = ort.RunOptions()
        try:
            run_options.add_active_adapter(adapter)
            outputs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
                None, {}, run_options)
        except EpError:
            raise
        except Exception as e:
            raise EpInvalidArgument(f"ONNX Runtime cannot apply the adapter to this model's overridable initializers "
                                    f"{names}: {e}") from None
        return {n: v for n, v in zip(names, outputs)
                if v.shape != defaults[n].shape or not np.array_equal(v, defaults[n])}

    def _default(self, t: onnx.TensorProto) -> np.ndarray:
        if external_ref(t) is not None and self._external is not None:
            return np.array(self._external.array(t))
        return numpy_helper.to_array(t)
