"""Where a session's model comes from: a path, bytes, a ModelProto, or a model in a worker's model directory
(ModelOnWorker); its graph loaded and its external data files opened and checked, not read."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import onnx

from ephost.errors import EpError, EpInvalidArgument, EpInvalidModel
from ephost.external_data import (ExternalData, WorkerFile, check_inline_size, has_external_data, inline_tensors,
                                  load_model, open_external_data)
from ephost.v1 import worker_pb2


@dataclass(frozen=True)
class ModelOnWorker:
    """A model in a worker's model directory (`ephost worker --model-dir DIR`), by its path relative to that
    directory: the application gets its graph from the worker, and its weights never leave the worker's host.
    The nodes that read them must run on that worker."""

    registration: str
    path: str


def _from_worker(model: ModelOnWorker, env) -> tuple[onnx.ModelProto, ExternalData | None]:
    link = env.registration(model.registration).link
    if link is None:
        raise EpInvalidArgument(f"{model.registration!r} is hosted in this process; it has no model directory")
    reply = link.call(lambda c: c.worker.OpenModel, worker_pb2.ModelPath(path=model.path))
    loaded = onnx.load_model_from_string(reply.model)
    files = {f.name: WorkerFile(f.name, f.nbytes, model.registration, f.model_dir_path) for f in reply.files}
    external = ExternalData(files) if files else None
    if external is not None:
        external.check(loaded)
    return loaded, external


def load(model, env=None, inline: Mapping[str, np.ndarray] | None = None,
         in_memory: Mapping[str, bytes] | None = None) -> tuple[onnx.ModelProto, ExternalData | None]:
    """The model's graph, and its external data files (opened, checked, not read) where it has any. `inline`:
    values the application gives for initializers the model keeps in external files; `in_memory`: contents it
    gives for external files, by location (SessionOptions.add_external_initializers...): in place of files."""
    external = None
    if isinstance(model, ModelOnWorker):
        loaded, external = _from_worker(model, env)
        what = f"model {model.path!r} of {model.registration!r}"
    elif isinstance(model, onnx.ModelProto):
        loaded, what = model, "the model"
        if has_external_data(loaded) and (inline or in_memory):
            loaded = onnx.ModelProto()
            loaded.CopyFrom(model)  # the caller's model stays as it is
            inline_tensors(loaded, inline or {})
            external = open_external_data(loaded, None, what, in_memory)
        elif has_external_data(loaded):
            raise EpInvalidArgument("the model's tensors keep their data in external files, and a ModelProto does "
                                    "not say where it was loaded from: give the model's path instead")
        check_inline_size(loaded)
    else:
        try:
            if isinstance(model, (bytes, bytearray, memoryview)):
                what = "the model bytes"
                loaded = onnx.load_model_from_string(bytes(model))
                if inline:
                    inline_tensors(loaded, inline)
                external = open_external_data(loaded, None, what, in_memory)
            else:
                what = f"model file {os.fspath(model)!r}"
                loaded, external = load_model(os.fspath(model), inline, in_memory)
        except EpError:
            raise
        except Exception as e:
            raise EpInvalidModel(f"{what} is not a readable ONNX model ({type(e).__name__}: {e})") from None
    if not loaded.HasField("graph") or not loaded.opset_import:
        raise EpInvalidModel(f"{what} is not an ONNX model: it has no graph or no opset import")
    return loaded, external
