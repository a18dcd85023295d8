"""EPContext nodes: a partition an EP compiled, saved as its compiled form (ONNX Runtime's EP context design: an
`EPContext` node of the `com.microsoft` domain whose `source` names the EP, the form embedded in
`ep_cache_context` with embed_mode=1, or a file beside the model that it names with embed_mode=0).

An EP that finds EPContext nodes of its own `source` in a model claims each (GetCapability) and restores it
instead of compiling (Compile of a fused graph that is that one node). What the compiled form is belongs to the
EP; ephost adds to `notes` the form's kind and its SHA-256, so that a corrupted form is refused by name.
Shared by the application (which writes and reads context models) and the EPs in workers (which restore)."""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import dataclass
from typing import Iterable

import onnx
from onnx import helper

from ephost.errors import EpFailedPrecondition, EpInvalidArgument, EpNotFound

OP_TYPE = "EPContext"
DOMAIN = "com.microsoft"
# ONNX Runtime's session config entries for EP context models. ENABLE also reaches an EP as a provider option
# (eps.base.split_session_options): with it the EP gives each compute info it compiles an `ep_context`.
ENABLE = "ep.context_enable"
FILE_PATH = "ep.context_file_path"
EMBED_MODE = "ep.context_embed_mode"


def is_ep_context(node: onnx.NodeProto) -> bool:
    return node.op_type == OP_TYPE and node.domain == DOMAIN


@dataclass(frozen=True)
class EpContext:
    """A compiled form as an EP hands it over: `form` says what it is (e.g. "onnxruntime_optimized_model"),
    `sdk_version` the version of what made it (a restore under another version is refused)."""

    form: str
    blob: bytes
    sdk_version: str = ""

    def encode(self) -> bytes:
        """The form as it travels from a worker: `form`, `sdk_version` and the blob, one length-prefixed frame."""
        head = f"{self.form}\n{self.sdk_version}\n".encode()
        return len(head).to_bytes(4, "little") + head + self.blob

    @classmethod
    def decode(cls, data: bytes) -> "EpContext":
        if len(data) < 4:
            raise EpInvalidArgument("a compiled form is too short to read")
        n = int.from_bytes(data[:4], "little")
        try:
            form, sdk_version, _ = data[4:4 + n].decode().split("\n")
        except (UnicodeDecodeError, ValueError):
            raise EpInvalidArgument("a compiled form has an unreadable header") from None
        return cls(form, data[4 + n:], sdk_version)


def _attrs(node: onnx.NodeProto) -> dict:
    try:
        return {a.name: helper.get_attribute_value(a) for a in node.attribute}
    except Exception as e:  # a malformed attribute, from a peer
        raise EpInvalidArgument(f"EPContext node {node.name!r} has an unreadable attribute: {e}") from None


def _int(node: onnx.NodeProto, attrs: dict, key: str, default: int) -> int:
    value = attrs.get(key, default)
    if not isinstance(value, int):
        raise EpInvalidArgument(f"EPContext node {node.name!r}: attribute {key} must be an int")
    return value


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def source_of(node: onnx.NodeProto) -> str:
    return _text(_attrs(node).get("source", b""))


def make_node(name: str, inputs: Iterable[str], outputs: Iterable[str], source: str, context: EpContext,
              partition_name: str, file_name: str | None = None) -> onnx.NodeProto:
    """The EPContext node of a compiled partition: the form embedded (embed_mode=1), or named by `file_name`
    (embed_mode=0; the caller writes the blob there, beside the model)."""
    digest = hashlib.sha256(context.blob).hexdigest()
    return helper.make_node(
        OP_TYPE, list(inputs), list(outputs), name=name, domain=DOMAIN, main_context=1,
        embed_mode=0 if file_name else 1, ep_cache_context=file_name.encode() if file_name else context.blob,
        ep_sdk_version=context.sdk_version, partition_name=partition_name, source=source,
        notes=f"form={context.form};sha256={digest}")


def as_text(node: onnx.NodeProto) -> onnx.NodeProto:
    """A copy of an embedded node whose compiled form is base64 text, its notes saying so: for an API that copies
    an attribute's string up to its first NUL byte (ONNX Runtime's CreateOpAttr). `read` decodes it."""
    out = onnx.NodeProto()
    out.CopyFrom(node)
    for a in out.attribute:
        if a.name == "ep_cache_context":
            a.s = base64.b64encode(a.s)
        elif a.name == "notes":
            a.s += b";encoding=base64"
    return out


def embed(node: onnx.NodeProto, model_dir: str | None) -> None:
    """Read a blob kept in a file beside the model into the node (which becomes embed_mode=1), so that a worker,
    which may be on another host, never reads the application's files. The file must lie inside `model_dir`."""
    attrs = _attrs(node)
    if _int(node, attrs, "embed_mode", 1) != 0:
        return
    name = _text(attrs.get("ep_cache_context", b""))
    if model_dir is None:
        raise EpInvalidArgument(f"EPContext node {node.name!r} keeps its compiled form in a file ({name!r}) beside "
                                "the model: load the model from its path, so that the file can be found")
    root = os.path.realpath(model_dir)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.isabs(name) or os.path.commonpath([root, path]) != root:
        raise EpInvalidArgument(f"EPContext node {node.name!r} names a compiled-form file outside the model's "
                                f"directory ({name!r})")
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise EpNotFound(f"EPContext node {node.name!r}: its compiled form {name!r} cannot be read: "
                         f"{e.strerror}") from None
    for a in node.attribute:
        if a.name == "embed_mode":
            a.i = 1
        elif a.name == "ep_cache_context":
            a.s = blob


def read(node: onnx.NodeProto, expected_sdk_version: str | None = None) -> EpContext:
    """The compiled form an (embedded) EPContext node carries, checked against its SHA-256: a corrupted form
    is an EpInvalidArgument naming the node; one made by another version of the EP's SDK, an
    EpFailedPrecondition."""
    attrs = _attrs(node)
    if _int(node, attrs, "embed_mode", 1) != 1:
        raise EpInvalidArgument(f"EPContext node {node.name!r} was not given its compiled form (embed_mode=0)")
    blob = attrs.get("ep_cache_context", b"")
    if not isinstance(blob, bytes):
        raise EpInvalidArgument(f"EPContext node {node.name!r}: attribute ep_cache_context must be a string")
    notes = dict(item.partition("=")[::2] for item in _text(attrs.get("notes", b"")).split(";") if item)
    if notes.get("encoding") == "base64":
        try:
            blob = base64.b64decode(blob, validate=True)
        except binascii.Error:
            raise EpInvalidArgument(f"EPContext node {node.name!r}: its compiled form is not the base64 its notes "
                                    "say") from None
    if "sha256" not in notes or "form" not in notes:
        raise EpInvalidArgument(f"EPContext node {node.name!r} was not written by ephost (no form and SHA-256 "
                                "in its notes); its compiled form cannot be checked")
    if hashlib.sha256(blob).hexdigest() != notes["sha256"]:
        raise EpInvalidArgument(f"EPContext node {node.name!r}: its compiled form is corrupted (SHA-256 "
                                "mismatch); compile the model again")
    sdk_version = _text(attrs.get("ep_sdk_version", b""))
    if expected_sdk_version is not None and sdk_version != expected_sdk_version:
        raise EpFailedPrecondition(f"EPContext node {node.name!r} was compiled by version {sdk_version!r}, and "
                                   f"this EP runs {expected_sdk_version!r}; compile the model again")
    return EpContext(notes["form"], blob, sdk_version)


def model_of(node: onnx.NodeProto, context: EpContext) -> onnx.ModelProto:
    """The ONNX model a compiled form is (for EPs whose form is one), parsed and checked as any model from a
    peer: no tensor whose data is in an external file, no EPContext node that names a file (a restore must
    never make this process read a path)."""
    from ephost.types import refuse_external_data
    model = onnx.ModelProto()
    try:
        model.ParseFromString(context.blob)
    except Exception as e:
        raise EpInvalidArgument(f"EPContext node {node.name!r}: its compiled form is no ONNX model: {e}") from None
    refuse_external_data(model, f"EPContext node {node.name!r}'s compiled form")
    for inner in model.graph.node:
        if is_ep_context(inner) and _int(inner, _attrs(inner), "embed_mode", 1) != 1:
            raise EpInvalidArgument(f"EPContext node {node.name!r}'s compiled form names a file; it must carry "
                                    "its data")
    return model


def own_nodes(model: onnx.ModelProto, source: str, claimed: frozenset[str]) -> list[onnx.NodeProto]:
    """The model's EPContext nodes of this `source` not claimed yet: GetCapability takes each as its own
    partition."""
    return [n for n in model.graph.node if is_ep_context(n) and n.name not in claimed and source_of(n) == source]


def single(nodes) -> onnx.NodeProto | None:
    """The EPContext node a fused graph of one EPContext node consists of (a partition to restore), else None."""
    nodes = list(nodes)
    return nodes[0] if len(nodes) == 1 and is_ep_context(nodes[0]) else None
