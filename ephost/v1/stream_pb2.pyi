from ephost.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class WaitOnHostRequest(_message.Message):
    __slots__ = ("notification", "timeout_s")
    NOTIFICATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    notification: int
    timeout_s: float
    def __init__(self, notification: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WaitOnDeviceRequest(_message.Message):
    __slots__ = ("notification", "stream")
    NOTIFICATION_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    notification: int
    stream: int
    def __init__(self, notification: _Optional[int] = ..., stream: _Optional[int] = ...) -> None: ...
