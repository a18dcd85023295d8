from ephost.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FactoryInfo(_message.Message):
    __slots__ = ("name", "vendor", "vendor_id", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VENDOR_FIELD_NUMBER: _ClassVar[int]
    VENDOR_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    vendor: str
    vendor_id: int
    version: str
    def __init__(self, name: _Optional[str] = ..., vendor: _Optional[str] = ..., vendor_id: _Optional[int] = ..., version: _Optional[str] = ...) -> None: ...

class SupportedDevices(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[_common_pb2.EpDevice]
    def __init__(self, devices: _Optional[_Iterable[_Union[_common_pb2.EpDevice, _Mapping]]] = ...) -> None: ...

class CreateEpRequest(_message.Message):
    __slots__ = ("device_indices", "session_options")
    class SessionOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    SESSION_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    device_indices: _containers.RepeatedScalarFieldContainer[int]
    session_options: _containers.ScalarMap[str, str]
    def __init__(self, device_indices: _Optional[_Iterable[int]] = ..., session_options: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CreateAllocatorRequest(_message.Message):
    __slots__ = ("device_index", "device_mem_type", "options")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    device_mem_type: _common_pb2.DeviceMemoryType
    options: _containers.ScalarMap[str, str]
    def __init__(self, device_index: _Optional[int] = ..., device_mem_type: _Optional[_Union[_common_pb2.DeviceMemoryType, str]] = ..., options: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CreateAllocatorResponse(_message.Message):
    __slots__ = ("allocator", "memory_info")
    ALLOCATOR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_INFO_FIELD_NUMBER: _ClassVar[int]
    allocator: int
    memory_info: _common_pb2.MemoryInfo
    def __init__(self, allocator: _Optional[int] = ..., memory_info: _Optional[_Union[_common_pb2.MemoryInfo, _Mapping]] = ...) -> None: ...

class CreateDataTransferResponse(_message.Message):
    __slots__ = ("data_transfer",)
    DATA_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    data_transfer: int
    def __init__(self, data_transfer: _Optional[int] = ...) -> None: ...

class IsStreamAwareResponse(_message.Message):
    __slots__ = ("stream_aware",)
    STREAM_AWARE_FIELD_NUMBER: _ClassVar[int]
    stream_aware: bool
    def __init__(self, stream_aware: _Optional[bool] = ...) -> None: ...

class CreateSyncStreamRequest(_message.Message):
    __slots__ = ("device_index", "options")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    options: _containers.ScalarMap[str, str]
    def __init__(self, device_index: _Optional[int] = ..., options: _Optional[_Mapping[str, str]] = ...) -> None: ...
