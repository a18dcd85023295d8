"""The model a session runs (read by client/model_source.py), with what its SessionOptions change in it, as ONNX
Runtime applies them while it loads a model:
- external initializers given by value (add_external_initializers) or their files given in memory
  (add_external_initializers_from_files_in_memory), in place of files on disk;
- the model's own session options (metadata "ort_config"), where ORT_LOAD_CONFIG_FROM_MODEL=1 or
  read_config_from_model=1 asks for them: applied to a copy of the session's options;
- initializers given by value (add_initializer), in place of the model's;
- free dimensions fixed by name or denotation (add_free_dimension_override_by_name/_by_denotation).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import onnx
from onnx import TensorProto

from ephost.errors import EpInvalidArgument, EpUnimplemented
from ephost.external_data import ExternalData, external_ref
from ephost.session_config import SETTINGS
from ephost.types import dtype_of
from ephost.client import model_source
from ephost.client.session_options import SessionOptions

log = logging.getLogger(__name__)

ORT_CONFIG_KEY = "ort_config"  # the model metadata entry ORT reads its session options from
LOAD_CONFIG_VARIABLE = "ORT_LOAD_CONFIG_FROM_MODEL"
# The settings ORT reads from a model's config (inference_session_utils.cc), each an int there
MODEL_SETTINGS = ("intra_op_num_threads", "inter_op_num_threads", "execution_mode", "graph_optimization_level")


@dataclass
class Loaded:
    model: onnx.ModelProto
    external: ExternalData | None
    options: SessionOptions  # the session's: the given ones, or a copy with the model's own settings applied
    path: str | None  # the model file's, where it was given one


def load(model: Any, options: SessionOptions, env=None, read_config: bool | None = None) -> Loaded:
    """The model and its external data files (opened, checked, not read), with `options` applied.
    `read_config`: whether to apply the model's own session options (None: as ORT_LOAD_CONFIG_FROM_MODEL says)."""
    path = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
    loaded, external = model_source.load(model, env, options.external_initializers, options.external_files)
    try:
        if read_config if read_config is not None else os.environ.get(LOAD_CONFIG_VARIABLE) == "1":
            options = with_model_config(options, loaded)
        if options.initializers:
            loaded = _with_initializers(loaded, options.initializers, external)
        if options.plain_inputs:
            loaded = _as_inputs(loaded, options.plain_inputs)
        by_name, by_denotation = options.free_dimension_overrides
        if by_name or by_denotation:
            loaded = _with_dimensions(loaded, by_name, by_denotation)
    except BaseException:
        if external is not None:
            external.close()
        raise
    return Loaded(loaded, external, options, path)


def with_model_config(options: SessionOptions, model: onnx.ModelProto) -> SessionOptions:
    """A copy of `options` with the session options the model carries in its metadata ("ort_config": a JSON
    object whose "session_options" ORT reads), as ORT applies them; the options as they are where it has none."""
    text = next((p.value for p in model.metadata_props if p.key == ORT_CONFIG_KEY), None)
    if text is None:
        return options
    try:
        config = json.loads(text)
    except ValueError as e:
        raise EpInvalidArgument(f"Json stored in the `{ORT_CONFIG_KEY}` key cannot be parsed. Error message: {e}")
    settings = config.get("session_options", {}) if isinstance(config, dict) else {}
    out = options.copy()
    for key, value in settings.items():
        if key not in (*MODEL_SETTINGS, "enable_profiling"):
            log.info("ignoring session option %r of the model's ORT config, as ORT does", key)
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise EpInvalidArgument(f"{key} option in the model file must be an integer")
        if key == "enable_profiling":
            if value not in (0, 1):
                raise EpInvalidArgument(f"Unsupported value for enable_profiling option: {value}")
            out.enable_profiling = bool(value)
        else:
            setattr(out, key, SETTINGS[key].parse(value))
    return out


def _with_initializers(model: onnx.ModelProto, values: Mapping[str, np.ndarray],
                       external: ExternalData | None) -> onnx.ModelProto:
    """A copy of the model whose initializers of these names hold these values (ORT's add_initializer); a
    value of another type or shape than its initializer is refused, naming it."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    initializers = {t.name: t for t in out.graph.initializer}
    for name, value in values.items():
        t = initializers.get(name)
        if t is None:
            log.warning("add_initializer(%r): the model has no initializer of that name; the value is not used", name)
            continue
        value = np.ascontiguousarray(value)
        if value.dtype != dtype_of(t.data_type) or tuple(value.shape) != tuple(t.dims):
            raise EpInvalidArgument(f"add_initializer({name!r}): the model's initializer is {list(t.dims)} of "
                                    f"{dtype_of(t.data_type)}; the value given is {list(value.shape)} of {value.dtype}")
        if external_ref(t) is not None:
            del t.external_data[:]
            t.data_location = TensorProto.DEFAULT
        t.raw_data = value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes()
        del t.float_data[:], t.int32_data[:], t.int64_data[:], t.double_data[:], t.uint64_data[:]
    return out


def _as_inputs(model: onnx.ModelProto, names: frozenset[str]) -> onnx.ModelProto:
    """A copy of the model whose initializers `names` (graph inputs too) are plain inputs: no default."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [t for t in out.graph.initializer if t.name not in names]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    return out


def _with_dimensions(model: onnx.ModelProto, by_name: Mapping[str, int],
                     by_denotation: Mapping[str, int]) -> onnx.ModelProto:
    """A copy of the model whose free dimensions of these names or denotations are fixed to these sizes, on
    the graph's inputs and outputs and the values it describes (shape inference carries them on)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    used: set[str] = set()
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.type.WhichOneof("value") != "tensor_type":
            continue
        for dim in value.type.tensor_type.shape.dim:
            size = None
            if dim.HasField("dim_param") and dim.dim_param in by_name:
                size, used = by_name[dim.dim_param], used | {dim.dim_param}
            elif dim.denotation and dim.denotation in by_denotation and not dim.HasField("dim_value"):
                size, used = by_denotation[dim.denotation], used | {dim.denotation}
            if size is not None:
                dim.dim_value = size  # (a oneof: the name goes)
    unused = sorted((set(by_name) | set(by_denotation)) - used)
    if unused:
        log.warning("free dimension override(s) %s: the model has no free dimension of that name or denotation",
                    unused)
    return out


def session_kwargs(kwargs: Mapping[str, Any]) -> bool | None:
    """ORT's InferenceSession keyword arguments, checked: whether to read the model's own session options
    (`read_config_from_model`; None: as ORT_LOAD_CONFIG_FROM_MODEL says). ORT's others are honoured where ephost
    does what they ask (enable_fallback=0: a failed EP's error is raised, ephost's default failure policy), else
    refused, naming them."""
    unknown = sorted(set(kwargs) - {"read_config_from_model", "enable_fallback", "disabled_optimizers"})
    if unknown:
        raise TypeError(f"InferenceSession got unexpected keyword argument(s) {unknown}")
    if "enable_fallback" in kwargs and int(kwargs["enable_fallback"]) != 0:
        raise EpUnimplemented("enable_fallback=1 cannot be honoured as ORT's run-time fallback: set "
                              "SessionOptions.ep_failure_policy = 'fallback' (a failed partition runs on the CPU "
                              "fallback)")
    if kwargs.get("disabled_optimizers"):
        raise EpUnimplemented("disabled_optimizers cannot be honoured: ephost's EPs optimize their partitions "
                              "themselves (set SessionOptions.graph_optimization_level instead)")
    if "read_config_from_model" in kwargs:
        return int(kwargs["read_config_from_model"]) == 1
    return None
