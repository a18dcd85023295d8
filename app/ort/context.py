"""EP context models through the bridge: when ORT writes a compiled model (its compile API, or a session with
`ep.context_enable=1`), Compile returns each partition as an EPContext node carrying the compiled form the worker's
EP made (ephost.ep_context), and GetCompiledModelCompatibilityInfo says which EP and version made them; a session
on that model restores each partition in the worker instead of compiling it, and ValidateCompiledModelCompatibility-
Info tells ORT whether the bridged EP can."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ephost import ep_context
from ephost.errors import EpFailedPrecondition, EpInvalidArgument
from ephost.eps.base import FusedGraph
from ephost.ort import abi as A
from ephost.ort.nodes import ort_node

PREFIX = "ephost.ort"  # what begins the bridge's compatibility strings


@dataclass(frozen=True)
class ContextRequest:
    """What the session's config entries ask of EP context generation (ORT sets them for its compile API)."""

    enabled: bool
    embed: bool
    file_path: str | None  # the compiled model's path: forms not embedded are written beside it

    @classmethod
    def of(cls, config: dict[str, str]) -> "ContextRequest":
        def flag(key: str) -> bool:
            value = config.get(key, "0")
            if value not in ("0", "1"):
                raise EpInvalidArgument(f"session config entry {key} takes 0 or 1, got {value!r}")
            return value == "1"
        return cls(flag(ep_context.ENABLE), flag(ep_context.EMBED_MODE), config.get(ep_context.FILE_PATH) or None)


def context_node(abi: A.OrtAbi, graph: FusedGraph, compiled, source: str, request: ContextRequest) -> int:
    """The EPContext OrtNode of a partition the worker compiled (`compiled`, its compute info), carrying the
    form, embedded or written beside the compiled model as the request says. ORT's CreateOpAttr copies a string
    up to its first NUL byte: an embedded form goes as base64 text (ephost.ep_context.read decodes it)."""
    context = getattr(compiled, "ep_context", None)
    if context is None:
        raise EpFailedPrecondition(f"the worker's EP {source!r} made no compiled form of {graph.name}: it cannot be "
                                   "saved as an EPContext node")
    file_name = None
    if not request.embed and request.file_path:
        stem = os.path.splitext(os.path.basename(request.file_path))[0]
        file_name = f"{stem}_{graph.name}.bin"
        with open(os.path.join(os.path.dirname(os.path.abspath(request.file_path)), file_name), "wb") as f:
            f.write(context.blob)
    # named as the fused node it stands for: ORT puts it in that node's place by its name
    node = ep_context.make_node(graph.name, graph.inputs, graph.outputs, source, context, graph.name, file_name)
    return ort_node(abi, node if file_name else ep_context.as_text(node))


def compatibility_info(source: str, version: str, onnxruntime: str) -> str:
    """What a compiled model records of the EP that compiled it: the worker's EP, its version, and the ONNX
    Runtime of the worker (the version of the form's SDK where the EP is ORT's)."""
    return f"{PREFIX};ep={source};version={version};onnxruntime={onnxruntime}"


def compatibility(info: str, source: str, version: str, onnxruntime: str) -> int:
    """ValidateCompiledModelCompatibilityInfo's answer for a model compiled as `info` says, on a worker whose EP,
    version and ONNX Runtime are these: another EP's string is not the bridge's to judge; the same worker EP and
    versions restore; another version of either is refused when it restores (ephost.ep_context.read)."""
    if not info.startswith(PREFIX + ";"):
        return A.EP_NOT_APPLICABLE
    fields = dict(item.partition("=")[::2] for item in info[len(PREFIX) + 1:].split(";") if item)
    if fields.get("ep") != source:
        return A.EP_UNSUPPORTED
    same = fields.get("version") == version and fields.get("onnxruntime") == onnxruntime
    return A.EP_SUPPORTED_OPTIMAL if same else A.EP_UNSUPPORTED
