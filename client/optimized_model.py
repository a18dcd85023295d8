"""SessionOptions.optimized_model_filepath: the model as ONNX Runtime optimized it, written where the application
asked, with its large initializers in a file beside it where `session.optimized_model_external_initializers_
file_name` (and `..._min_size_in_bytes`) say so.

ONNX Runtime writes the model it runs after its graph optimizations. ephost writes that model where ORT's CPU EP
runs every partition of the session (in a worker, or as the CPU fallback): ORT in this process optimizes the
session's model at the session's level, for its CPU EP, and writes it, as ORT would. Where another EP runs a
partition, no file could say what runs, and the option is refused, naming it."""
from __future__ import annotations

import importlib.util
import logging
from typing import Sequence

import onnx

from ephost.errors import EpError, EpInternal, EpUnimplemented
from ephost.external_data import ExternalData, has_external_data, on_disk
from ephost.eps.onnxruntime import ort_api
from ephost.client.planner import Partition
from ephost.client.session_options import SessionOptions

log = logging.getLogger(__name__)

ORT_CPU = "CPUExecutionProvider"
CONFIG_PREFIX = "session.optimized_model_"  # ORT's entries for where the written model keeps its weights
EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"


def write_optimized_model(model: onnx.ModelProto, external: ExternalData | None, options: SessionOptions,
                          partitions: Sequence[Partition]) -> str:
    """Write the optimized model to options.optimized_model_filepath; the path."""
    path = options.optimized_model_filepath
    others = sorted({p.placement.ep_name for p in partitions} - {ORT_CPU})
    if others:
        raise EpUnimplemented(f"SessionOptions.optimized_model_filepath cannot be honoured for this session: "
                              f"{', '.join(others)} run(s) part of the model, and ephost writes the model ONNX Runtime "
                              f"optimized only where ORT's {ORT_CPU} runs all of it")
    if importlib.util.find_spec("onnxruntime") is None:
        raise EpUnimplemented("SessionOptions.optimized_model_filepath needs onnxruntime installed in this process")
    ort = ort_api()

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel(int(options.graph_optimization_level))
    so.optimized_model_filepath = str(path)
    for key, value in options.session_config.items():
        if key.startswith(CONFIG_PREFIX):
            so.add_session_config_entry(key, value)
    if external is not None and has_external_data(model):
        placed = on_disk(model, external)
        if placed is not None:  # ORT reads the very files the session holds open
            model, folder = placed
            so.add_session_config_entry(EXTERNAL_FOLDER, folder)
        else:  # files given in memory, or gone from disk: their bytes go inside
            model = external.inlined(model)
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=[ORT_CPU])
    except EpError:
        raise
    except Exception as e:
        raise EpInternal(f"ONNX Runtime could not write the optimized model to {path!r}: {e}") from None
    log.info("wrote the model as ONNX Runtime optimized it to %s", path)
    return str(path)
