from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HardwareDeviceType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HARDWARE_DEVICE_TYPE_CPU: _ClassVar[HardwareDeviceType]
    HARDWARE_DEVICE_TYPE_GPU: _ClassVar[HardwareDeviceType]
    HARDWARE_DEVICE_TYPE_NPU: _ClassVar[HardwareDeviceType]

class DeviceMemoryType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_MEMORY_TYPE_DEFAULT: _ClassVar[DeviceMemoryType]
    DEVICE_MEMORY_TYPE_HOST_ACCESSIBLE: _ClassVar[DeviceMemoryType]

class AllocatorType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALLOCATOR_TYPE_DEVICE: _ClassVar[AllocatorType]
    ALLOCATOR_TYPE_ARENA: _ClassVar[AllocatorType]
HARDWARE_DEVICE_TYPE_CPU: HardwareDeviceType
HARDWARE_DEVICE_TYPE_GPU: HardwareDeviceType
HARDWARE_DEVICE_TYPE_NPU: HardwareDeviceType
DEVICE_MEMORY_TYPE_DEFAULT: DeviceMemoryType
DEVICE_MEMORY_TYPE_HOST_ACCESSIBLE: DeviceMemoryType
ALLOCATOR_TYPE_DEVICE: AllocatorType
ALLOCATOR_TYPE_ARENA: AllocatorType

class MemoryInfo(_message.Message):
    __slots__ = ("name", "device_type", "device_vendor_id", "device_id", "device_mem_type", "alignment", "allocator_type")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_VENDOR_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    ALLOCATOR_TYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    device_type: HardwareDeviceType
    device_vendor_id: int
    device_id: int
    device_mem_type: DeviceMemoryType
    alignment: int
    allocator_type: AllocatorType
    def __init__(self, name: _Optional[str] = ..., device_type: _Optional[_Union[HardwareDeviceType, str]] = ..., device_vendor_id: _Optional[int] = ..., device_id: _Optional[int] = ..., device_mem_type: _Optional[_Union[DeviceMemoryType, str]] = ..., alignment: _Optional[int] = ..., allocator_type: _Optional[_Union[AllocatorType, str]] = ...) -> None: ...

class HardwareDevice(_message.Message):
    __slots__ = ("type", "vendor_id", "vendor", "device_id", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TYPE_FIELD_NUMBER: _ClassVar[int]
    VENDOR_ID_FIELD_NUMBER: _ClassVar[int]
    VENDOR_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    type: HardwareDeviceType
    vendor_id: int
    vendor: str
    device_id: int
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, type: _Optional[_Union[HardwareDeviceType, str]] = ..., vendor_id: _Optional[int] = ..., vendor: _Optional[str] = ..., device_id: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EpDevice(_message.Message):
    __slots__ = ("index", "ep_name", "ep_vendor", "ep_metadata", "ep_options", "device", "memory_infos")
    class EpMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class EpOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INDEX_FIELD_NUMBER: _ClassVar[int]
    EP_NAME_FIELD_NUMBER: _ClassVar[int]
    EP_VENDOR_FIELD_NUMBER: _ClassVar[int]
    EP_METADATA_FIELD_NUMBER: _ClassVar[int]
    EP_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_INFOS_FIELD_NUMBER: _ClassVar[int]
    index: int
    ep_name: str
    ep_vendor: str
    ep_metadata: _containers.ScalarMap[str, str]
    ep_options: _containers.ScalarMap[str, str]
    device: HardwareDevice
    memory_infos: _containers.RepeatedCompositeFieldContainer[MemoryInfo]
    def __init__(self, index: _Optional[int] = ..., ep_name: _Optional[str] = ..., ep_vendor: _Optional[str] = ..., ep_metadata: _Optional[_Mapping[str, str]] = ..., ep_options: _Optional[_Mapping[str, str]] = ..., device: _Optional[_Union[HardwareDevice, _Mapping]] = ..., memory_infos: _Optional[_Iterable[_Union[MemoryInfo, _Mapping]]] = ...) -> None: ...

class TensorDesc(_message.Message):
    __slots__ = ("elem_type", "shape")
    ELEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    elem_type: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, elem_type: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ShmSlice(_message.Message):
    __slots__ = ("region", "offset", "nbytes")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    region: int
    offset: int
    nbytes: int
    def __init__(self, region: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class InlineReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("desc", "shm", "inline", "buffer", "reply", "mapped")
    DESC_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    MAPPED_FIELD_NUMBER: _ClassVar[int]
    desc: TensorDesc
    shm: ShmSlice
    inline: bytes
    buffer: int
    reply: InlineReply
    mapped: ShmSlice
    def __init__(self, desc: _Optional[_Union[TensorDesc, _Mapping]] = ..., shm: _Optional[_Union[ShmSlice, _Mapping]] = ..., inline: _Optional[bytes] = ..., buffer: _Optional[int] = ..., reply: _Optional[_Union[InlineReply, _Mapping]] = ..., mapped: _Optional[_Union[ShmSlice, _Mapping]] = ...) -> None: ...

class OnnxValue(_message.Message):
    __slots__ = ("kind", "data")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_TENSOR: _ClassVar[OnnxValue.Kind]
        KIND_SEQUENCE: _ClassVar[OnnxValue.Kind]
        KIND_OPTIONAL: _ClassVar[OnnxValue.Kind]
        KIND_MAP: _ClassVar[OnnxValue.Kind]
    KIND_TENSOR: OnnxValue.Kind
    KIND_SEQUENCE: OnnxValue.Kind
    KIND_OPTIONAL: OnnxValue.Kind
    KIND_MAP: OnnxValue.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    kind: OnnxValue.Kind
    data: bytes
    def __init__(self, kind: _Optional[_Union[OnnxValue.Kind, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Value(_message.Message):
    __slots__ = ("tensor", "onnx")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    ONNX_FIELD_NUMBER: _ClassVar[int]
    tensor: TensorRef
    onnx: OnnxValue
    def __init__(self, tensor: _Optional[_Union[TensorRef, _Mapping]] = ..., onnx: _Optional[_Union[OnnxValue, _Mapping]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Handle(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    def __init__(self, id: _Optional[int] = ...) -> None: ...
