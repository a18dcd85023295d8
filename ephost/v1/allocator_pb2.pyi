from ephost.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BufferChunk(_message.Message):
    __slots__ = ("allocator", "buffer", "offset", "data")
    ALLOCATOR_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    allocator: int
    buffer: int
    offset: int
    data: bytes
    def __init__(self, allocator: _Optional[int] = ..., buffer: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("allocator", "buffer", "offset", "nbytes", "chunk_bytes")
    ALLOCATOR_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    allocator: int
    buffer: int
    offset: int
    nbytes: int
    chunk_bytes: int
    def __init__(self, allocator: _Optional[int] = ..., buffer: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class AllocRequest(_message.Message):
    __slots__ = ("allocator", "nbytes")
    ALLOCATOR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    allocator: int
    nbytes: int
    def __init__(self, allocator: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class AllocResponse(_message.Message):
    __slots__ = ("buffer", "nbytes", "shm")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    buffer: int
    nbytes: int
    shm: _common_pb2.ShmSlice
    def __init__(self, buffer: _Optional[int] = ..., nbytes: _Optional[int] = ..., shm: _Optional[_Union[_common_pb2.ShmSlice, _Mapping]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("allocator", "buffer", "buffers")
    ALLOCATOR_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    allocator: int
    buffer: int
    buffers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, allocator: _Optional[int] = ..., buffer: _Optional[int] = ..., buffers: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("released_regions",)
    RELEASED_REGIONS_FIELD_NUMBER: _ClassVar[int]
    released_regions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, released_regions: _Optional[_Iterable[int]] = ...) -> None: ...

class AllocatorStats(_message.Message):
    __slots__ = ("stats",)
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: _containers.ScalarMap[str, int]
    def __init__(self, stats: _Optional[_Mapping[str, int]] = ...) -> None: ...
