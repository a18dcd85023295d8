from ephost.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelRef(_message.Message):
    __slots__ = ("model", "sha256", "buffer", "files")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    model: bytes
    sha256: str
    buffer: BufferBlob
    files: _containers.RepeatedCompositeFieldContainer[ExternalFile]
    def __init__(self, model: _Optional[bytes] = ..., sha256: _Optional[str] = ..., buffer: _Optional[_Union[BufferBlob, _Mapping]] = ..., files: _Optional[_Iterable[_Union[ExternalFile, _Mapping]]] = ...) -> None: ...

class ExternalFile(_message.Message):
    __slots__ = ("name", "nbytes", "file", "sha256", "model_dir_path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    nbytes: int
    file: int
    sha256: str
    model_dir_path: str
    def __init__(self, name: _Optional[str] = ..., nbytes: _Optional[int] = ..., file: _Optional[int] = ..., sha256: _Optional[str] = ..., model_dir_path: _Optional[str] = ...) -> None: ...

class BufferBlob(_message.Message):
    __slots__ = ("buffer", "nbytes")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    buffer: int
    nbytes: int
    def __init__(self, buffer: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class GetCapabilityRequest(_message.Message):
    __slots__ = ("ep", "model", "claimed_nodes")
    EP_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_NODES_FIELD_NUMBER: _ClassVar[int]
    ep: int
    model: ModelRef
    claimed_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ep: _Optional[int] = ..., model: _Optional[_Union[ModelRef, _Mapping]] = ..., claimed_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class NodeGroup(_message.Message):
    __slots__ = ("kind", "node_names")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_FUSED: _ClassVar[NodeGroup.Kind]
        KIND_SINGLE: _ClassVar[NodeGroup.Kind]
    KIND_FUSED: NodeGroup.Kind
    KIND_SINGLE: NodeGroup.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_NAMES_FIELD_NUMBER: _ClassVar[int]
    kind: NodeGroup.Kind
    node_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[_Union[NodeGroup.Kind, str]] = ..., node_names: _Optional[_Iterable[str]] = ...) -> None: ...

class GetCapabilityResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[NodeGroup]
    def __init__(self, groups: _Optional[_Iterable[_Union[NodeGroup, _Mapping]]] = ...) -> None: ...

class FusedGraph(_message.Message):
    __slots__ = ("name", "nodes", "inputs", "outputs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    inputs: _containers.RepeatedScalarFieldContainer[str]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., inputs: _Optional[_Iterable[str]] = ..., outputs: _Optional[_Iterable[str]] = ...) -> None: ...

class CompileRequest(_message.Message):
    __slots__ = ("ep", "model", "graphs")
    EP_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    ep: int
    model: ModelRef
    graphs: _containers.RepeatedCompositeFieldContainer[FusedGraph]
    def __init__(self, ep: _Optional[int] = ..., model: _Optional[_Union[ModelRef, _Mapping]] = ..., graphs: _Optional[_Iterable[_Union[FusedGraph, _Mapping]]] = ...) -> None: ...

class CompileResponse(_message.Message):
    __slots__ = ("node_compute_infos", "ep_contexts")
    NODE_COMPUTE_INFOS_FIELD_NUMBER: _ClassVar[int]
    EP_CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    node_compute_infos: _containers.RepeatedScalarFieldContainer[int]
    ep_contexts: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, node_compute_infos: _Optional[_Iterable[int]] = ..., ep_contexts: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ComputeRequest(_message.Message):
    __slots__ = ("node_compute_info", "inputs", "output_allocator", "inline_limit", "stream", "keep", "output_buffers", "keep_call", "replace_kept", "run_options", "trace_context")
    class OutputBuffersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: _common_pb2.TensorRef
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[_common_pb2.TensorRef, _Mapping]] = ...) -> None: ...
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_COMPUTE_INFO_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_ALLOCATOR_FIELD_NUMBER: _ClassVar[int]
    INLINE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    KEEP_CALL_FIELD_NUMBER: _ClassVar[int]
    REPLACE_KEPT_FIELD_NUMBER: _ClassVar[int]
    RUN_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    node_compute_info: int
    inputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Value]
    output_allocator: int
    inline_limit: int
    stream: int
    keep: _containers.RepeatedScalarFieldContainer[int]
    output_buffers: _containers.MessageMap[int, _common_pb2.TensorRef]
    keep_call: bool
    replace_kept: int
    run_options: RunOptions
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, node_compute_info: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[_common_pb2.Value, _Mapping]]] = ..., output_allocator: _Optional[int] = ..., inline_limit: _Optional[int] = ..., stream: _Optional[int] = ..., keep: _Optional[_Iterable[int]] = ..., output_buffers: _Optional[_Mapping[int, _common_pb2.TensorRef]] = ..., keep_call: _Optional[bool] = ..., replace_kept: _Optional[int] = ..., run_options: _Optional[_Union[RunOptions, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RunOptions(_message.Message):
    __slots__ = ("logid", "log_severity_level", "log_verbosity_level", "config")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LOGID_FIELD_NUMBER: _ClassVar[int]
    LOG_SEVERITY_LEVEL_FIELD_NUMBER: _ClassVar[int]
    LOG_VERBOSITY_LEVEL_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    logid: str
    log_severity_level: int
    log_verbosity_level: int
    config: _containers.ScalarMap[str, str]
    def __init__(self, logid: _Optional[str] = ..., log_severity_level: _Optional[int] = ..., log_verbosity_level: _Optional[int] = ..., config: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ComputeResponse(_message.Message):
    __slots__ = ("outputs", "kept_call")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    KEPT_CALL_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Value]
    kept_call: int
    def __init__(self, outputs: _Optional[_Iterable[_Union[_common_pb2.Value, _Mapping]]] = ..., kept_call: _Optional[int] = ...) -> None: ...

class ReleaseNodeComputeInfosRequest(_message.Message):
    __slots__ = ("ep", "node_compute_infos")
    EP_FIELD_NUMBER: _ClassVar[int]
    NODE_COMPUTE_INFOS_FIELD_NUMBER: _ClassVar[int]
    ep: int
    node_compute_infos: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ep: _Optional[int] = ..., node_compute_infos: _Optional[_Iterable[int]] = ...) -> None: ...

class DataLayout(_message.Message):
    __slots__ = ("layout",)
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    layout: str
    def __init__(self, layout: _Optional[str] = ...) -> None: ...

class SetDynamicOptionsRequest(_message.Message):
    __slots__ = ("ep", "options")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EP_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    ep: int
    options: _containers.ScalarMap[str, str]
    def __init__(self, ep: _Optional[int] = ..., options: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RunStartRequest(_message.Message):
    __slots__ = ("ep", "run_options")
    class RunOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EP_FIELD_NUMBER: _ClassVar[int]
    RUN_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    ep: int
    run_options: _containers.ScalarMap[str, str]
    def __init__(self, ep: _Optional[int] = ..., run_options: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RunEndRequest(_message.Message):
    __slots__ = ("ep", "sync_stream")
    EP_FIELD_NUMBER: _ClassVar[int]
    SYNC_STREAM_FIELD_NUMBER: _ClassVar[int]
    ep: int
    sync_stream: bool
    def __init__(self, ep: _Optional[int] = ..., sync_stream: _Optional[bool] = ...) -> None: ...

class ProfilingEvent(_message.Message):
    __slots__ = ("name", "category", "start_ns", "duration_ns", "args", "pid", "tid")
    class ArgsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    DURATION_NS_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TID_FIELD_NUMBER: _ClassVar[int]
    name: str
    category: str
    start_ns: int
    duration_ns: int
    args: _containers.ScalarMap[str, str]
    pid: int
    tid: int
    def __init__(self, name: _Optional[str] = ..., category: _Optional[str] = ..., start_ns: _Optional[int] = ..., duration_ns: _Optional[int] = ..., args: _Optional[_Mapping[str, str]] = ..., pid: _Optional[int] = ..., tid: _Optional[int] = ...) -> None: ...

class ProfilingEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[ProfilingEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[ProfilingEvent, _Mapping]]] = ...) -> None: ...
