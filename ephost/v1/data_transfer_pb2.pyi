from ephost.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CanCopyRequest(_message.Message):
    __slots__ = ("data_transfer", "src", "dst")
    DATA_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    data_transfer: int
    src: _common_pb2.MemoryInfo
    dst: _common_pb2.MemoryInfo
    def __init__(self, data_transfer: _Optional[int] = ..., src: _Optional[_Union[_common_pb2.MemoryInfo, _Mapping]] = ..., dst: _Optional[_Union[_common_pb2.MemoryInfo, _Mapping]] = ...) -> None: ...

class CanCopyResponse(_message.Message):
    __slots__ = ("can_copy",)
    CAN_COPY_FIELD_NUMBER: _ClassVar[int]
    can_copy: bool
    def __init__(self, can_copy: _Optional[bool] = ...) -> None: ...

class CopyTensorsRequest(_message.Message):
    __slots__ = ("data_transfer", "src", "dst", "stream", "keep_call", "replace_kept")
    DATA_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    KEEP_CALL_FIELD_NUMBER: _ClassVar[int]
    REPLACE_KEPT_FIELD_NUMBER: _ClassVar[int]
    data_transfer: int
    src: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorRef]
    dst: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorRef]
    stream: int
    keep_call: bool
    replace_kept: int
    def __init__(self, data_transfer: _Optional[int] = ..., src: _Optional[_Iterable[_Union[_common_pb2.TensorRef, _Mapping]]] = ..., dst: _Optional[_Iterable[_Union[_common_pb2.TensorRef, _Mapping]]] = ..., stream: _Optional[int] = ..., keep_call: _Optional[bool] = ..., replace_kept: _Optional[int] = ...) -> None: ...

class CopyTensorsResponse(_message.Message):
    __slots__ = ("replies", "kept_call")
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    KEPT_CALL_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedScalarFieldContainer[bytes]
    kept_call: int
    def __init__(self, replies: _Optional[_Iterable[bytes]] = ..., kept_call: _Optional[int] = ...) -> None: ...
