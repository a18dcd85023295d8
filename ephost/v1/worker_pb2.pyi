from ephost.v1 import common_pb2 as _common_pb2
from ephost.v1 import ep_pb2 as _ep_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelPath(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class ModelGraph(_message.Message):
    __slots__ = ("model", "files")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    model: bytes
    files: _containers.RepeatedCompositeFieldContainer[_ep_pb2.ExternalFile]
    def __init__(self, model: _Optional[bytes] = ..., files: _Optional[_Iterable[_Union[_ep_pb2.ExternalFile, _Mapping]]] = ...) -> None: ...

class BlobRef(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class BlobChunk(_message.Message):
    __slots__ = ("sha256", "nbytes", "offset", "data")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    nbytes: int
    offset: int
    data: bytes
    def __init__(self, sha256: _Optional[str] = ..., nbytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class BlobStatus(_message.Message):
    __slots__ = ("complete", "nbytes")
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    complete: bool
    nbytes: int
    def __init__(self, complete: _Optional[bool] = ..., nbytes: _Optional[int] = ...) -> None: ...

class FileTicket(_message.Message):
    __slots__ = ("ticket", "file")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    file: int
    def __init__(self, ticket: _Optional[bytes] = ..., file: _Optional[int] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("client_name", "protocol", "ephost_version")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    EPHOST_VERSION_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    protocol: str
    ephost_version: str
    def __init__(self, client_name: _Optional[str] = ..., protocol: _Optional[str] = ..., ephost_version: _Optional[str] = ...) -> None: ...

class HelloResponse(_message.Message):
    __slots__ = ("client_id", "info", "fd_socket")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    FD_SOCKET_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    info: WorkerInfo
    fd_socket: str
    def __init__(self, client_id: _Optional[str] = ..., info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., fd_socket: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("protocol", "ep_name", "version", "pid", "ep_options", "started_at", "ephost_version", "onnxruntime_version", "python_version")
    class EpOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    EP_NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EP_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    EPHOST_VERSION_FIELD_NUMBER: _ClassVar[int]
    ONNXRUNTIME_VERSION_FIELD_NUMBER: _ClassVar[int]
    PYTHON_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol: str
    ep_name: str
    version: str
    pid: int
    ep_options: _containers.ScalarMap[str, str]
    started_at: float
    ephost_version: str
    onnxruntime_version: str
    python_version: str
    def __init__(self, protocol: _Optional[str] = ..., ep_name: _Optional[str] = ..., version: _Optional[str] = ..., pid: _Optional[int] = ..., ep_options: _Optional[_Mapping[str, str]] = ..., started_at: _Optional[float] = ..., ephost_version: _Optional[str] = ..., onnxruntime_version: _Optional[str] = ..., python_version: _Optional[str] = ...) -> None: ...

class MethodStats(_message.Message):
    __slots__ = ("calls", "errors", "total_s", "max_s")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_S_FIELD_NUMBER: _ClassVar[int]
    calls: int
    errors: int
    total_s: float
    max_s: float
    def __init__(self, calls: _Optional[int] = ..., errors: _Optional[int] = ..., total_s: _Optional[float] = ..., max_s: _Optional[float] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("methods", "bytes_copied", "bytes_inline_in", "bytes_inline_out", "buffers_live", "clients", "copies", "compute_inputs_resident", "compute_inputs_transferred", "compute_outputs_in_place", "compute_outputs_copied", "fast_lane_calls", "fast_lane_connections", "partitions_compiled", "partitions_restored", "compute_input_bytes_resident", "compute_input_bytes_transferred", "files_imported", "file_bytes_imported", "blob_chunks_received", "blob_bytes_received", "blob_hits", "capability_cache_hits", "partitions_shared", "kept_calls", "early_wakes", "calls_kept")
    class MethodsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: MethodStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[MethodStats, _Mapping]] = ...) -> None: ...
    METHODS_FIELD_NUMBER: _ClassVar[int]
    BYTES_COPIED_FIELD_NUMBER: _ClassVar[int]
    BYTES_INLINE_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_INLINE_OUT_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_LIVE_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INPUTS_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INPUTS_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_OUTPUTS_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_OUTPUTS_COPIED_FIELD_NUMBER: _ClassVar[int]
    FAST_LANE_CALLS_FIELD_NUMBER: _ClassVar[int]
    FAST_LANE_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_COMPILED_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_RESTORED_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INPUT_BYTES_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INPUT_BYTES_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    FILES_IMPORTED_FIELD_NUMBER: _ClassVar[int]
    FILE_BYTES_IMPORTED_FIELD_NUMBER: _ClassVar[int]
    BLOB_CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BLOB_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BLOB_HITS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_SHARED_FIELD_NUMBER: _ClassVar[int]
    KEPT_CALLS_FIELD_NUMBER: _ClassVar[int]
    EARLY_WAKES_FIELD_NUMBER: _ClassVar[int]
    CALLS_KEPT_FIELD_NUMBER: _ClassVar[int]
    methods: _containers.MessageMap[str, MethodStats]
    bytes_copied: int
    bytes_inline_in: int
    bytes_inline_out: int
    buffers_live: int
    clients: int
    copies: int
    compute_inputs_resident: int
    compute_inputs_transferred: int
    compute_outputs_in_place: int
    compute_outputs_copied: int
    fast_lane_calls: int
    fast_lane_connections: int
    partitions_compiled: int
    partitions_restored: int
    compute_input_bytes_resident: int
    compute_input_bytes_transferred: int
    files_imported: int
    file_bytes_imported: int
    blob_chunks_received: int
    blob_bytes_received: int
    blob_hits: int
    capability_cache_hits: int
    partitions_shared: int
    kept_calls: int
    early_wakes: int
    calls_kept: int
    def __init__(self, methods: _Optional[_Mapping[str, MethodStats]] = ..., bytes_copied: _Optional[int] = ..., bytes_inline_in: _Optional[int] = ..., bytes_inline_out: _Optional[int] = ..., buffers_live: _Optional[int] = ..., clients: _Optional[int] = ..., copies: _Optional[int] = ..., compute_inputs_resident: _Optional[int] = ..., compute_inputs_transferred: _Optional[int] = ..., compute_outputs_in_place: _Optional[int] = ..., compute_outputs_copied: _Optional[int] = ..., fast_lane_calls: _Optional[int] = ..., fast_lane_connections: _Optional[int] = ..., partitions_compiled: _Optional[int] = ..., partitions_restored: _Optional[int] = ..., compute_input_bytes_resident: _Optional[int] = ..., compute_input_bytes_transferred: _Optional[int] = ..., files_imported: _Optional[int] = ..., file_bytes_imported: _Optional[int] = ..., blob_chunks_received: _Optional[int] = ..., blob_bytes_received: _Optional[int] = ..., blob_hits: _Optional[int] = ..., capability_cache_hits: _Optional[int] = ..., partitions_shared: _Optional[int] = ..., kept_calls: _Optional[int] = ..., early_wakes: _Optional[int] = ..., calls_kept: _Optional[int] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("grace_s",)
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    grace_s: float
    def __init__(self, grace_s: _Optional[float] = ...) -> None: ...

class ExportRegionRequest(_message.Message):
    __slots__ = ("region",)
    REGION_FIELD_NUMBER: _ClassVar[int]
    region: int
    def __init__(self, region: _Optional[int] = ...) -> None: ...

class DataPlaneTicket(_message.Message):
    __slots__ = ("ticket", "socket")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    socket: str
    def __init__(self, ticket: _Optional[bytes] = ..., socket: _Optional[str] = ...) -> None: ...

class ExportRegionResponse(_message.Message):
    __slots__ = ("ticket", "nbytes")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    nbytes: int
    def __init__(self, ticket: _Optional[bytes] = ..., nbytes: _Optional[int] = ...) -> None: ...
