"""ONNX Runtime's plugin-EP ABI as ctypes: the structs ephost fills (OrtEpFactory, OrtEp, OrtNodeComputeInfo,
OrtNodeFusionOptions) and the OrtApi / OrtEpApi functions it calls, by their index in ORT's function tables.

Layouts and indices are facts of ORT's public headers (include/onnxruntime/core/session/onnxruntime_c_api.h and
onnxruntime_ep_c_api.h, microsoft/onnxruntime). The indices below were counted in the header whose
ORT_API_VERSION is 24; ORT only ever appends to these tables, so an index, once published, stays. The structs are
filled as ORT 1.23 declared them (STRUCT_VERSION), the first release with Compile-based plugin EPs: ORT reads no
member a later version appended (1.24 appended some to OrtEpFactory and OrtEp). They were checked against the
ONNX Runtime releases in CHECKED_VERSIONS; `OrtAbi.load` refuses any other, and checks at load every table slot
it will call, plus round trips through the functions that need no graph (see `OrtAbi.self_check`).
"""
from __future__ import annotations

import ctypes
from ctypes import (CFUNCTYPE, POINTER, Structure, c_bool, c_char_p, c_int, c_int64, c_size_t, c_uint32,
                    c_void_p)
from dataclasses import dataclass
from typing import Any

from ephost.errors import EpFailedPrecondition, EpInternal

CHECKED_VERSIONS = ("1.32.0",)
API_VERSION = 24     # the ORT_API_VERSION of the header the table indices were counted in (GetApi asks for it)
STRUCT_VERSION = 23  # the structs ephost fills, as ORT 1.23 laid them out (members added later are not declared)

ORT_FAIL = 1
ORT_INVALID_ARGUMENT = 2
ORT_EP_FAIL = 11

# OrtOpAttrType
ATTR_INT, ATTR_INTS, ATTR_FLOAT, ATTR_FLOATS, ATTR_STRING, ATTR_STRINGS, ATTR_GRAPH, ATTR_TENSOR = range(1, 9)
ONNX_TYPE_TENSOR, ONNX_TYPE_SEQUENCE, ONNX_TYPE_MAP = 1, 2, 3  # ONNXType
ONNX_TYPE_OPTIONAL = 6

Status = c_void_p  # OrtStatus*; NULL is success

# --- OrtApi: name -> (index, result type, argument types) ----------------------------------------------------

_S = Status
_P = c_void_p
_PP = POINTER(c_void_p)
_PSZ = POINTER(c_size_t)
_STR = POINTER(c_char_p)

ORT_API: dict[str, tuple[int, Any, tuple]] = {
    "CreateStatus": (0, _P, (c_int, c_char_p)),
    "GetErrorCode": (1, c_int, (_P,)),
    "GetErrorMessage": (2, c_char_p, (_P,)),
    "GetTensorMutableData": (51, _S, (_P, _PP)),
    "FillStringTensor": (52, _S, (_P, _STR, c_size_t)),
    "GetStringTensorDataLength": (53, _S, (_P, _PSZ)),
    "GetStringTensorContent": (54, _S, (_P, _P, c_size_t, _PSZ, c_size_t)),
    "CastTypeInfoToTensorInfo": (55, _S, (_P, _PP)),
    "GetOnnxTypeFromTypeInfo": (56, _S, (_P, POINTER(c_int))),
    "GetTensorElementType": (60, _S, (_P, POINTER(c_int))),
    "GetDimensionsCount": (61, _S, (_P, _PSZ)),
    "GetDimensions": (62, _S, (_P, POINTER(c_int64), c_size_t)),
    "GetSymbolicDimensions": (63, _S, (_P, _STR, c_size_t)),
    "GetTensorTypeAndShape": (65, _S, (_P, _PP)),
    "KernelContext_GetInputCount": (88, _S, (_P, _PSZ)),
    "KernelContext_GetOutputCount": (89, _S, (_P, _PSZ)),
    "KernelContext_GetInput": (90, _S, (_P, c_size_t, _PP)),
    "KernelContext_GetOutput": (91, _S, (_P, c_size_t, POINTER(c_int64), c_size_t, _PP)),
    "ReleaseStatus": (93, None, (_P,)),
    "ReleaseMemoryInfo": (94, None, (_P,)),
    "ReleaseValue": (96, None, (_P,)),
    "ReleaseTypeInfo": (98, None, (_P,)),
    "ReleaseTensorTypeAndShapeInfo": (99, None, (_P,)),
    "CastTypeInfoToMapTypeInfo": (103, _S, (_P, _PP)),
    "CastTypeInfoToSequenceTypeInfo": (104, _S, (_P, _PP)),
    "GetMapKeyType": (105, _S, (_P, POINTER(c_int))),
    "GetMapValueType": (106, _S, (_P, _PP)),
    "GetSequenceElementType": (107, _S, (_P, _PP)),
    "CastTypeInfoToOptionalTypeInfo": (250, _S, (_P, _PP)),
    "GetOptionalContainedTypeInfo": (251, _S, (_P, _PP)),
    "GetBuildInfoString": (254, c_char_p, ()),
    "ReadOpAttr": (272, _S, (_P, c_int, _P, c_size_t, _PSZ)),
    "GetValueInfoName": (289, _S, (_P, _STR)),
    "GetValueInfoTypeInfo": (290, _S, (_P, _PP)),
    "CreateKeyValuePairs": (295, None, (_PP,)),
    "AddKeyValuePair": (296, None, (_P, c_char_p, c_char_p)),
    "GetKeyValue": (297, c_char_p, (_P, c_char_p)),
    "GetKeyValuePairs": (298, None, (_P, POINTER(_STR), POINTER(_STR), _PSZ)),
    "ReleaseKeyValuePairs": (300, None, (_P,)),
    "HardwareDevice_Type": (307, c_int, (_P,)),
    "HardwareDevice_VendorId": (308, c_uint32, (_P,)),
    "HardwareDevice_DeviceId": (310, c_uint32, (_P,)),
    "GetEpApi": (317, _P, ()),
    "GetTensorSizeInBytes": (318, _S, (_P, _PSZ)),
    "CreateMemoryInfo_V2": (320, _S, (c_char_p, c_int, c_uint32, ctypes.c_int32, c_int, c_size_t, c_int, _PP)),
    "ValueInfo_GetInitializerValue": (326, _S, (_P, _PP)),
    "Graph_GetName": (333, _S, (_P, _STR)),
    "Graph_GetOnnxIRVersion": (335, _S, (_P, POINTER(c_int64))),
    "Graph_GetNumOperatorSets": (336, _S, (_P, _PSZ)),
    "Graph_GetOperatorSets": (337, _S, (_P, _STR, POINTER(c_int64), c_size_t)),
    "Graph_GetNumInputs": (338, _S, (_P, _PSZ)),
    "Graph_GetInputs": (339, _S, (_P, _PP, c_size_t)),
    "Graph_GetNumOutputs": (340, _S, (_P, _PSZ)),
    "Graph_GetOutputs": (341, _S, (_P, _PP, c_size_t)),
    "Graph_GetNumInitializers": (342, _S, (_P, _PSZ)),
    "Graph_GetInitializers": (343, _S, (_P, _PP, c_size_t)),
    "Graph_GetNumNodes": (344, _S, (_P, _PSZ)),
    "Graph_GetNodes": (345, _S, (_P, _PP, c_size_t)),
    "Graph_GetParentNode": (346, _S, (_P, _PP)),
    "Node_GetId": (348, _S, (_P, _PSZ)),
    "Node_GetName": (349, _S, (_P, _STR)),
    "Node_GetOperatorType": (350, _S, (_P, _STR)),
    "Node_GetDomain": (351, _S, (_P, _STR)),
    "Node_GetNumInputs": (353, _S, (_P, _PSZ)),
    "Node_GetInputs": (354, _S, (_P, _PP, c_size_t)),
    "Node_GetNumOutputs": (355, _S, (_P, _PSZ)),
    "Node_GetOutputs": (356, _S, (_P, _PP, c_size_t)),
    "Node_GetNumAttributes": (359, _S, (_P, _PSZ)),
    "Node_GetAttributes": (360, _S, (_P, _PP, c_size_t)),
    "OpAttr_GetTensorAttributeAsOrtValue": (362, _S, (_P, _PP)),
    "OpAttr_GetType": (363, _S, (_P, POINTER(c_int))),
    "OpAttr_GetName": (364, _S, (_P, _STR)),
    "Node_GetNumSubgraphs": (365, _S, (_P, _PSZ)),
    "Node_GetSubgraphs": (366, _S, (_P, _PP, c_size_t, _STR)),
    "Node_GetEpName": (368, _S, (_P, _STR)),
    "GetSessionOptionsConfigEntries": (379, _S, (_P, _PP)),
}

# OrtEpApi (onnxruntime_ep_c_api.h), same rule.
EP_API: dict[str, tuple[int, Any, tuple]] = {
    "CreateEpDevice": (0, _S, (_P, _P, _P, _P, _PP)),
    "ReleaseEpDevice": (1, None, (_P,)),
    "EpGraphSupportInfo_AddNodesToFuse": (2, _S, (_P, _PP, c_size_t, _P)),
    "NodeComputeContext_NodeName": (4, c_char_p, (_P,)),
    "EpDevice_AddAllocatorInfo": (5, _S, (_P, _P)),
}

# --- the structs ephost fills ------------------------------------------------------------------------------

GetStringFn = CFUNCTYPE(c_void_p, c_void_p)  # returns a char* ephost keeps alive (not c_char_p: see strings.py)

FACTORY_FUNCTIONS = {
    "GetName": GetStringFn,
    "GetVendor": GetStringFn,
    "GetSupportedDevices": CFUNCTYPE(Status, c_void_p, _PP, c_size_t, _PP, c_size_t, _PSZ),
    "CreateEp": CFUNCTYPE(Status, c_void_p, _PP, _PP, c_size_t, c_void_p, c_void_p, _PP),
    "ReleaseEp": CFUNCTYPE(None, c_void_p, c_void_p),
    "GetVendorId": CFUNCTYPE(c_uint32, c_void_p),
    "GetVersion": GetStringFn,
    "ValidateCompiledModelCompatibilityInfo": CFUNCTYPE(Status, c_void_p, _PP, c_size_t, c_char_p, POINTER(c_int)),
    "CreateAllocator": CFUNCTYPE(Status, c_void_p, c_void_p, c_void_p, _PP),
    "ReleaseAllocator": CFUNCTYPE(None, c_void_p, c_void_p),
    "CreateDataTransfer": CFUNCTYPE(Status, c_void_p, _PP),
    "IsStreamAware": CFUNCTYPE(c_bool, c_void_p),
    "CreateSyncStreamForDevice": CFUNCTYPE(Status, c_void_p, c_void_p, c_void_p, _PP),
}

EP_FUNCTIONS = {
    "GetName": GetStringFn,
    "GetCapability": CFUNCTYPE(Status, c_void_p, c_void_p, c_void_p),
    "Compile": CFUNCTYPE(Status, c_void_p, _PP, _PP, c_size_t, _PP, _PP),
    "ReleaseNodeComputeInfos": CFUNCTYPE(None, c_void_p, _PP, c_size_t),
    "GetPreferredDataLayout": CFUNCTYPE(Status, c_void_p, POINTER(c_int)),
    "ShouldConvertDataLayoutForOp": CFUNCTYPE(Status, c_void_p, c_char_p, c_char_p, c_int, POINTER(c_int)),
    "SetDynamicOptions": CFUNCTYPE(Status, c_void_p, _STR, _STR, c_size_t),
    "OnRunStart": CFUNCTYPE(Status, c_void_p, c_void_p),
    "OnRunEnd": CFUNCTYPE(Status, c_void_p, c_void_p, c_bool),
    "CreateAllocator": CFUNCTYPE(Status, c_void_p, c_void_p, _PP),
    "CreateSyncStreamForDevice": CFUNCTYPE(Status, c_void_p, c_void_p, _PP),
    "GetCompiledModelCompatibilityInfo": CFUNCTYPE(c_void_p, c_void_p, c_void_p),
}

# OrtAllocator (onnxruntime_c_api.h): its first member is `version`, laid out like the others' version member.
ALLOCATOR_FUNCTIONS = {
    "Alloc": CFUNCTYPE(c_void_p, c_void_p, c_size_t),
    "Free": CFUNCTYPE(None, c_void_p, c_void_p),
    "Info": CFUNCTYPE(c_void_p, c_void_p),
    "Reserve": CFUNCTYPE(c_void_p, c_void_p, c_size_t),        # version 18
    "GetStats": CFUNCTYPE(Status, c_void_p, _PP),               # version 23
    "AllocOnStream": CFUNCTYPE(c_void_p, c_void_p, c_size_t, c_void_p),  # version 23
}

# CreateMemoryInfo_V2's enums
MEMORY_DEVICE_CPU = 0       # OrtMemoryInfoDeviceType_CPU
MEMORY_TYPE_DEFAULT = 0     # OrtDeviceMemoryType_DEFAULT
DEVICE_ALLOCATOR = 0        # OrtAllocatorType::OrtDeviceAllocator

COMPUTE_INFO_FUNCTIONS = {
    "CreateState": CFUNCTYPE(Status, c_void_p, c_void_p, _PP),
    "Compute": CFUNCTYPE(Status, c_void_p, c_void_p, c_void_p),
    "ReleaseState": CFUNCTYPE(None, c_void_p, c_void_p),
}


def _struct(name: str, functions: dict) -> type[Structure]:
    return type(name, (Structure,), {"_fields_": [("ort_version_supported", c_uint32),
                                                  *[(n, f) for n, f in functions.items()]]})


OrtEpFactory = _struct("OrtEpFactory", FACTORY_FUNCTIONS)
OrtEp = _struct("OrtEp", EP_FUNCTIONS)
OrtNodeComputeInfo = _struct("OrtNodeComputeInfo", COMPUTE_INFO_FUNCTIONS)
OrtAllocator = _struct("OrtAllocator", ALLOCATOR_FUNCTIONS)


class OrtNodeFusionOptions(Structure):
    _fields_ = [("ort_version_supported", c_uint32), ("drop_constant_initializers", c_bool)]


class OrtApiBase(Structure):
    _fields_ = [("GetApi", CFUNCTYPE(c_void_p, c_uint32)), ("GetVersionString", CFUNCTYPE(c_char_p))]


CreateEpFactoriesFn = CFUNCTYPE(Status, c_char_p, c_void_p, c_void_p, _PP, c_size_t, _PSZ)
ReleaseEpFactoryFn = CFUNCTYPE(Status, c_void_p)


# --- calling tables by index ---------------------------------------------------------------------------------

class FunctionTable:
    """A table of C function pointers (OrtApi, OrtEpApi) called by name through the index the header gives."""

    def __init__(self, name: str, address: int, entries: dict[str, tuple[int, Any, tuple]]):
        if not address:
            raise EpFailedPrecondition(f"ONNX Runtime returned no {name}")
        self.name = name
        size = max(i for i, _, _ in entries.values()) + 1
        slots = (c_void_p * size).from_address(address)
        missing = sorted(n for n, (i, _, _) in entries.items() if not slots[i])
        if missing:
            raise EpFailedPrecondition(f"ONNX Runtime's {name} has no function at the slots of {missing}: its "
                                       f"layout is not the one ephost.ort was checked against")
        for n, (i, restype, argtypes) in entries.items():  # plain attributes: the hot path looks them up often
            setattr(self, n, CFUNCTYPE(restype, *argtypes)(slots[i]))


@dataclass
class OrtAbi:
    """The running ORT's OrtApi and OrtEpApi, checked."""

    version: str
    api: FunctionTable
    ep_api: FunctionTable

    @classmethod
    def load(cls, api_base_address: int) -> "OrtAbi":
        base = OrtApiBase.from_address(api_base_address)
        version = base.GetVersionString().decode()
        check_version(version)
        api = FunctionTable("OrtApi", base.GetApi(API_VERSION), ORT_API)
        abi = cls(version, api, FunctionTable("OrtEpApi", api.GetEpApi(), EP_API))
        abi.self_check()
        return abi

    def self_check(self) -> None:
        """Round trips through the functions that need no graph: a wrong index reads as a failure here."""
        api = self.api
        status = api.CreateStatus(ORT_INVALID_ARGUMENT, b"ephost probe")
        try:
            if api.GetErrorCode(status) != ORT_INVALID_ARGUMENT or api.GetErrorMessage(status) != b"ephost probe":
                raise EpFailedPrecondition("ONNX Runtime's OrtStatus functions are not where ephost.ort expects")
        finally:
            api.ReleaseStatus(status)
        if not (api.GetBuildInfoString() or b"").startswith(b"ORT Build Info"):
            raise EpFailedPrecondition("OrtApi::GetBuildInfoString is not where ephost.ort expects")
        kvps = c_void_p()
        api.CreateKeyValuePairs(ctypes.byref(kvps))
        try:
            api.AddKeyValuePair(kvps, b"ephost", b"probe")
            keys, values, n = _STR(), _STR(), c_size_t()
            api.GetKeyValuePairs(kvps, ctypes.byref(keys), ctypes.byref(values), ctypes.byref(n))
            if api.GetKeyValue(kvps, b"ephost") != b"probe" or n.value != 1 or keys[0] != b"ephost":
                raise EpFailedPrecondition("ONNX Runtime's OrtKeyValuePairs functions are not where ephost.ort expects")
        finally:
            api.ReleaseKeyValuePairs(kvps)

    # --- helpers over the tables ---

    def check(self, status: int | None, what: str) -> None:
        """Raise EpInternal with ORT's message where a call returned an error status (the status is released)."""
        if status:
            try:
                message = (self.api.GetErrorMessage(status) or b"").decode(errors="replace")
            finally:
                self.api.ReleaseStatus(status)
            raise EpInternal(f"ONNX Runtime {what}: {message}")

    def status(self, code: int, message: str) -> int:
        """A new OrtStatus (ORT takes it over)."""
        return self.api.CreateStatus(code, message.encode(errors="replace")[:4000])


def check_version(version: str) -> None:
    if version not in CHECKED_VERSIONS:
        raise EpFailedPrecondition(
            f"ephost.ort was checked against ONNX Runtime {', '.join(CHECKED_VERSIONS)}, not {version}: the function "
            "tables it calls by index may differ; use a checked version")
