"""EP context models on the application's side: writing a session's model with each partition an EP compiled as
an `EPContext` node (ONNX Runtime's session config entries `ep.context_enable`, `ep.context_file_path`,
`ep.context_embed_mode`), reading the compiled forms a context model keeps in files beside it, and the one-node
graph that restores a partition from its kept compiled form in a restarted worker."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterable

import onnx
from onnx import helper

from ephost import ep_context
from ephost.ep_context import EpContext
from ephost.eps.base import FusedGraph
from ephost.errors import EpInvalidArgument
from ephost.graph import GraphIndex, subgraph_inputs

log = logging.getLogger(__name__)

ENABLE, FILE_PATH, EMBED_MODE = ep_context.ENABLE, ep_context.FILE_PATH, ep_context.EMBED_MODE
MS_OPSET = helper.make_opsetid(ep_context.DOMAIN, 1)


@dataclass(frozen=True)
class ContextSettings:
    """The session config entries of EP context generation, checked."""

    enabled: bool
    file_path: str | None
    embed: bool

    @classmethod
    def of(cls, config: dict[str, str], model_path: str | None) -> "ContextSettings":
        enabled = _flag(config, ENABLE)
        embed = _flag(config, EMBED_MODE)
        path = config.get(FILE_PATH) or None
        if enabled and path is None:
            if model_path is None:
                raise EpInvalidArgument(f"{ENABLE}=1 needs {FILE_PATH} when the model was not loaded from a file")
            stem, _ = os.path.splitext(model_path)
            path = f"{stem}_ctx.onnx"  # ONNX Runtime's default name
        return cls(enabled, path, embed)


def _flag(config: dict[str, str], key: str) -> bool:
    value = config.get(key, "0")
    if value not in ("0", "1"):
        raise EpInvalidArgument(f"session config entry {key} takes 0 or 1, got {value!r}")
    return value == "1"


@dataclass(frozen=True)
class CompiledPartition:
    """A partition as the context model keeps it: its graph, its EP's name (the node's `source`) and its
    compiled form (None: its nodes stay as they are, e.g. what the fallback runs)."""

    graph: FusedGraph
    source: str
    context: EpContext | None


def embed_files(model: onnx.ModelProto, model_dir: str | None) -> onnx.ModelProto:
    """Read the compiled forms the model's EPContext nodes keep in files beside it into the nodes (in place: the
    model must be the caller's own copy), so that workers (maybe on other hosts) are sent them and never read
    the application's files. Returns the model."""
    for node in model.graph.node:
        if ep_context.is_ep_context(node):
            ep_context.embed(node, model_dir)
    return model


def write_context_model(index: GraphIndex, partitions: Iterable[CompiledPartition],
                        settings: ContextSettings) -> list[str]:
    """Write the context model (and, with embed_mode=0, each compiled form in a file beside it, named in its
    node). Returns the paths written."""
    model = index.model
    path = settings.file_path
    stem = os.path.splitext(os.path.basename(path))[0]
    directory = os.path.dirname(os.path.abspath(path))
    nodes, files, produced = [], {}, set()
    for p in partitions:
        g = p.graph
        if p.context is None:
            nodes += [index.nodes[n] for n in g.nodes]
            continue
        file_name = None if settings.embed else f"{stem}_{g.name}.bin"
        nodes.append(ep_context.make_node(f"EPContext_{g.name}", g.inputs, g.outputs, p.source, p.context,
                                          g.name, file_name))
        if file_name:
            files[os.path.join(directory, file_name)] = p.context.blob
    for n in nodes:
        produced.update(n.output)
    reads = {v for n in nodes for v in [*n.input, *subgraph_inputs(n)]} | {o.name for o in model.graph.output}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [t for t in model.graph.initializer if t.name in reads]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    dropped = {t.name for t in model.graph.initializer} - {t.name for t in kept}
    inputs = [i for i in model.graph.input if i.name not in dropped]
    del graph.input[:]
    graph.input.extend(inputs)
    infos = [v for v in model.graph.value_info if v.name in produced or v.name in reads]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    if not any(o.domain == ep_context.DOMAIN for o in out.opset_import):
        out.opset_import.append(MS_OPSET)
    try:
        os.makedirs(directory, exist_ok=True)
        for file_path, blob in files.items():
            with open(file_path, "wb") as f:
                f.write(blob)
        onnx.save(out, path)
    except OSError as e:
        raise EpInvalidArgument(f"cannot write the EP context model {path}: {e.strerror}") from None
    log.info("wrote EP context model %s (%d compiled partition(s), %d file(s) beside it)", path,
             sum(1 for n in nodes if ep_context.is_ep_context(n)), len(files))
    return [path, *files]


def restore_graph(graph: FusedGraph, source: str, context: EpContext) -> FusedGraph:
    """A fused graph of one EPContext node carrying `context`, with `graph`'s inputs and outputs: compiling it
    on an EP named `source` restores the partition instead of compiling it."""
    part = graph.model
    node = ep_context.make_node(f"EPContext_{graph.name}", graph.inputs, graph.outputs, source, context, graph.name)
    model = helper.make_model(
        helper.make_graph([node], graph.name, list(part.graph.input), list(part.graph.output)),
        opset_imports=[*part.opset_import, *([] if any(o.domain == ep_context.DOMAIN for o in part.opset_import)
                                             else [MS_OPSET])], ir_version=part.ir_version)
    return FusedGraph(graph.name, GraphIndex.of(model), (node.name,), graph.inputs, graph.outputs)
