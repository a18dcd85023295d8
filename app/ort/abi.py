"""ONNX Runtime's plugin-EP ABI as ctypes: the structs ephost fills (OrtEpFactory, OrtEp, OrtNodeComputeInfo,
OrtNodeFusionOptions, OrtAllocator) and the OrtApi / OrtEpApi functions it calls, by their index in ORT's tables.

Layouts and indices are facts of ORT's public headers (include/onnxruntime/core/session/onnxruntime_c_api.h and
onnxruntime_ep_c_api.h, microsoft/onnxruntime) and of the `static_assert`s that freeze each released version of the
tables (onnxruntime_c_api.cc, ep_api.cc). ORT only ever appends to its tables and structs, so an index or a member,
once released, stays. ephost follows ORT's rules for a plugin built against one version and run on another: it reads
the running version (GetVersionString), asks GetApi for min(that, LAYOUT), allocates each struct at its full layout
with spare zeroed slots after it, sets `ort_version_supported` to min(running, the struct's layout) so that ORT reads
only members that exist on both sides, leaves members newer than the running ORT NULL, and never calls a table entry
newer than the running ORT (`FunctionTable` raises EpFailedPrecondition instead). Releases below FLOOR are refused.
"""
from __future__ import annotations

import ctypes
import os
import re
from ctypes import (CFUNCTYPE, POINTER, Structure, c_bool, c_char_p, c_int, c_int64, c_size_t, c_uint32,
                    c_void_p)
from dataclasses import dataclass
from typing import Any

from ephost.errors import EpFailedPrecondition, EpInternal

FLOOR = (1, 24)  # the oldest ONNX Runtime ephost.ort serves: the first with the plugin-EP API it uses whole
LAYOUT = 29      # the newest ORT version whose OrtEp / OrtEpFactory layouts ephost declares in full
SPARE = 16       # zeroed pointer slots after each struct ephost allocates: room for members it does not know

# The last index of each released version of the tables (ORT's static_asserts "Size of version N API cannot
# change"): an entry's index tells the release that added it.
ORT_API_ENDS = {22: 317, 23: 389, 24: 411}
EP_API_ENDS = {22: 1, 23: 15, 24: 49, 25: 72}

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
    "CreateEnv": (3, _S, (c_int, c_char_p, _PP)),
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
    "ReleaseEnv": (92, None, (_P,)),
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
    "CreateOpAttr": (211, _S, (c_char_p, _P, c_int, c_int, _PP)),
    "ReleaseOpAttr": (212, None, (_P,)),
    "GetBuildInfoString": (254, c_char_p, ()),
    "ReadOpAttr": (272, _S, (_P, c_int, _P, c_size_t, _PSZ)),
    "GetValueInfoName": (289, _S, (_P, _STR)),
    "GetValueInfoTypeInfo": (290, _S, (_P, _PP)),
    "GetModelEditorApi": (291, _P, ()),
    "CreateKeyValuePairs": (295, None, (_PP,)),
    "AddKeyValuePair": (296, None, (_P, c_char_p, c_char_p)),
    "GetKeyValue": (297, c_char_p, (_P, c_char_p)),
    "GetKeyValuePairs": (298, None, (_P, POINTER(_STR), POINTER(_STR), _PSZ)),
    "ReleaseKeyValuePairs": (300, None, (_P,)),
    "UnregisterExecutionProviderLibrary": (302, _S, (_P, c_char_p)),
    "HardwareDevice_Type": (307, c_int, (_P,)),
    "HardwareDevice_VendorId": (308, c_uint32, (_P,)),
    "HardwareDevice_DeviceId": (310, c_uint32, (_P,)),
    "GetEpApi": (317, _P, ()),
    "GetTensorSizeInBytes": (318, _S, (_P, _PSZ)),
    "CreateMemoryInfo_V2": (320, _S, (c_char_p, c_int, c_uint32, ctypes.c_int32, c_int, c_size_t, c_int, _PP)),
    "ValueInfo_GetInitializerValue": (326, _S, (_P, _PP)),
    "Graph_GetName": (333, _S, (_P, _STR)),
    "Graph_GetModelPath": (334, _S, (_P, _STR)),
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
    "CreateProfilingEvent": (65, _S, (c_int, ctypes.c_int32, ctypes.c_int32, c_char_p, c_int64, c_int64, _STR, _STR,
                                      c_size_t, _PP)),
    "ReleaseProfilingEvent": (66, None, (_P,)),
    "ProfilingEventsContainer_AddEvents": (72, _S, (_P, _PP, c_size_t)),
}

# OrtModelEditorApi (onnxruntime_c_api.h): what makes the EPContext nodes Compile returns. Its first release is 1.22.
MODEL_EDITOR_API: dict[str, tuple[int, Any, tuple]] = {
    "CreateNode": (6, _S, (c_char_p, c_char_p, c_char_p, _STR, c_size_t, _STR, c_size_t, _PP, c_size_t, _PP)),
}
MODEL_EDITOR_API_SINCE = {name: 22 for name in MODEL_EDITOR_API}

# OrtCompiledModelCompatibility, ValidateCompiledModelCompatibilityInfo's answer
EP_NOT_APPLICABLE, EP_SUPPORTED_OPTIMAL, EP_SUPPORTED_PREFER_RECOMPILATION, EP_UNSUPPORTED = range(4)

# --- the structs ephost fills ------------------------------------------------------------------------------

GetStringFn = CFUNCTYPE(c_void_p, c_void_p)  # returns a char* ephost keeps alive (not c_char_p: see strings.py)
_UNUSED = CFUNCTYPE(c_void_p)  # a member ephost leaves NULL: its C type is not needed


@dataclass(frozen=True)
class Layout:
    """One struct of function pointers after a `uint32_t ort_version_supported`, as ORT's header declares it: its
    members in order, each with the ORT minor version that added it and its C type."""

    name: str
    members: tuple[tuple[str, int, Any], ...]
    version: int  # the newest ORT version whose layout `members` is (what ort_version_supported may claim)
    spare: int = SPARE

    def __post_init__(self) -> None:
        fields = [("ort_version_supported", c_uint32), *[(n, t) for n, _, t in self.members]]
        if self.spare:
            fields.append(("_spare", c_void_p * self.spare))
        object.__setattr__(self, "struct", type(self.name, (Structure,), {"_fields_": fields}))
        object.__setattr__(self, "_by_name", {n: (since, t) for n, since, t in self.members})

    def type_of(self, member: str):
        return self._by_name[member][1]

    def since(self, member: str) -> int:
        return self._by_name[member][0]

    def function_names(self) -> list[str]:
        return [n for n, _, _ in self.members]


def _members(since: int, **types) -> list[tuple[str, int, Any]]:
    return [(name, since, t) for name, t in types.items()]


FACTORY = Layout("OrtEpFactory", (
    *_members(23,
              GetName=GetStringFn,
              GetVendor=GetStringFn,
              GetSupportedDevices=CFUNCTYPE(Status, c_void_p, _PP, c_size_t, _PP, c_size_t, _PSZ),
              CreateEp=CFUNCTYPE(Status, c_void_p, _PP, _PP, c_size_t, c_void_p, c_void_p, _PP),
              ReleaseEp=CFUNCTYPE(None, c_void_p, c_void_p),
              GetVendorId=CFUNCTYPE(c_uint32, c_void_p),
              GetVersion=GetStringFn,
              ValidateCompiledModelCompatibilityInfo=CFUNCTYPE(Status, c_void_p, _PP, c_size_t, c_char_p,
                                                               POINTER(c_int)),
              CreateAllocator=CFUNCTYPE(Status, c_void_p, c_void_p, c_void_p, _PP),
              ReleaseAllocator=CFUNCTYPE(None, c_void_p, c_void_p),
              CreateDataTransfer=CFUNCTYPE(Status, c_void_p, _PP),
              IsStreamAware=CFUNCTYPE(c_bool, c_void_p),
              CreateSyncStreamForDevice=CFUNCTYPE(Status, c_void_p, c_void_p, c_void_p, _PP)),
    *_members(24, GetHardwareDeviceIncompatibilityDetails=_UNUSED, CreateExternalResourceImporterForDevice=_UNUSED,
              GetNumCustomOpDomains=_UNUSED, GetCustomOpDomains=_UNUSED),
    *_members(25, InitGraphicsInterop=_UNUSED, DeinitGraphicsInterop=_UNUSED),
), LAYOUT)

EP = Layout("OrtEp", (
    *_members(23,
              GetName=GetStringFn,
              GetCapability=CFUNCTYPE(Status, c_void_p, c_void_p, c_void_p),
              Compile=CFUNCTYPE(Status, c_void_p, _PP, _PP, c_size_t, _PP, _PP),
              ReleaseNodeComputeInfos=CFUNCTYPE(None, c_void_p, _PP, c_size_t),
              GetPreferredDataLayout=CFUNCTYPE(Status, c_void_p, POINTER(c_int)),
              ShouldConvertDataLayoutForOp=CFUNCTYPE(Status, c_void_p, c_char_p, c_char_p, c_int, POINTER(c_int)),
              SetDynamicOptions=CFUNCTYPE(Status, c_void_p, _STR, _STR, c_size_t),
              OnRunStart=CFUNCTYPE(Status, c_void_p, c_void_p),
              OnRunEnd=CFUNCTYPE(Status, c_void_p, c_void_p, c_bool),
              CreateAllocator=CFUNCTYPE(Status, c_void_p, c_void_p, _PP),
              CreateSyncStreamForDevice=CFUNCTYPE(Status, c_void_p, c_void_p, _PP),
              GetCompiledModelCompatibilityInfo=CFUNCTYPE(c_void_p, c_void_p, c_void_p)),
    *_members(24, GetKernelRegistry=_UNUSED, IsConcurrentRunSupported=CFUNCTYPE(Status, c_void_p, POINTER(c_bool))),
    *_members(25, Sync=CFUNCTYPE(Status, c_void_p), CreateProfiler=CFUNCTYPE(Status, c_void_p, _PP)),
    *_members(26, IsGraphCaptureEnabled=_UNUSED, IsGraphCaptured=_UNUSED, ReplayGraph=_UNUSED,
              GetGraphCaptureNodeAssignmentPolicy=_UNUSED, GetAvailableResource=_UNUSED),
    *_members(27, OnSessionInitializationEnd=_UNUSED, GetDefaultMemoryDevice=_UNUSED, ReleaseCapturedGraph=_UNUSED),
    *_members(29, GetWeightlessSupport=_UNUSED),
), LAYOUT)

COMPUTE_INFO = Layout("OrtNodeComputeInfo", tuple(_members(
    23,
    CreateState=CFUNCTYPE(Status, c_void_p, c_void_p, _PP),
    Compute=CFUNCTYPE(Status, c_void_p, c_void_p, c_void_p),
    ReleaseState=CFUNCTYPE(None, c_void_p, c_void_p))), 23)

# OrtEpProfilerImpl (onnxruntime_ep_c_api.h): what OrtEp::CreateProfiler returns.
PROFILER = Layout("OrtEpProfilerImpl", tuple(_members(
    25,
    Release=CFUNCTYPE(None, c_void_p),
    StartProfiling=CFUNCTYPE(Status, c_void_p, c_int64),
    StartEvent=CFUNCTYPE(Status, c_void_p, ctypes.c_uint64),
    StopEvent=CFUNCTYPE(Status, c_void_p, ctypes.c_uint64, c_void_p),
    EndProfiling=CFUNCTYPE(Status, c_void_p, c_void_p))), 25)
PROFILING_NODE_EVENT = 1  # OrtProfilingEventCategory_NODE

# OrtAllocator (onnxruntime_c_api.h): its `version` member is laid out like the others' ort_version_supported. The
# shim's pool begins with exactly these members (shim.c, ephost_pool_t): no spare slots.
ALLOCATOR = Layout("OrtAllocator", (
    *_members(1, Alloc=CFUNCTYPE(c_void_p, c_void_p, c_size_t), Free=CFUNCTYPE(None, c_void_p, c_void_p),
              Info=CFUNCTYPE(c_void_p, c_void_p)),
    *_members(18, Reserve=CFUNCTYPE(c_void_p, c_void_p, c_size_t)),
    *_members(23, GetStats=CFUNCTYPE(Status, c_void_p, _PP),
              AllocOnStream=CFUNCTYPE(c_void_p, c_void_p, c_size_t, c_void_p)),
), 23, spare=0)

# CreateMemoryInfo_V2's enums
MEMORY_DEVICE_CPU = 0       # OrtMemoryInfoDeviceType_CPU
MEMORY_TYPE_DEFAULT = 0     # OrtDeviceMemoryType_DEFAULT
DEVICE_ALLOCATOR = 0        # OrtAllocatorType::OrtDeviceAllocator

OrtEpFactory = FACTORY.struct
OrtEp = EP.struct
OrtNodeComputeInfo = COMPUTE_INFO.struct
OrtAllocator = ALLOCATOR.struct
OrtEpProfilerImpl = PROFILER.struct


FUSION_OPTIONS_VERSION = 23  # OrtNodeFusionOptions as ORT 1.23 declared it (unchanged since)


class OrtNodeFusionOptions(Structure):
    _fields_ = [("ort_version_supported", c_uint32), ("drop_constant_initializers", c_bool)]


class OrtApiBase(Structure):
    _fields_ = [("GetApi", CFUNCTYPE(c_void_p, c_uint32)), ("GetVersionString", CFUNCTYPE(c_char_p))]


CreateEpFactoriesFn = CFUNCTYPE(Status, c_char_p, c_void_p, c_void_p, _PP, c_size_t, _PSZ)
ReleaseEpFactoryFn = CFUNCTYPE(Status, c_void_p)


# --- versions --------------------------------------------------------------------------------------------------

def minor_of(version: str) -> int:
    """The minor version of an ONNX Runtime version string ("1.24.4" -> 24): ORT's API version is its minor."""
    match = re.match(r"\s*(\d+)\.(\d+)", version or "")
    if match is None or int(match.group(1)) != FLOOR[0]:
        raise EpFailedPrecondition(f"ephost.ort does not know ONNX Runtime version {version!r}")
    return int(match.group(2))


def check_version(version: str) -> int:
    """The running ORT's minor version, where ephost.ort serves it (FLOOR and newer); EpFailedPrecondition below."""
    minor = minor_of(version)
    if minor < FLOOR[1]:
        raise EpFailedPrecondition(
            f"ephost.ort needs ONNX Runtime {FLOOR[0]}.{FLOOR[1]} or newer (the plugin-EP API it uses is whole from "
            f"there); this process runs {version}: upgrade onnxruntime")
    return minor


def since(index: int, ends: dict[int, int]) -> int | None:
    """The version of a table that added the entry at `index` (None: past every release ephost knows)."""
    for version in sorted(ends):
        if index <= ends[version]:
            return version
    return None


# --- calling tables by index ---------------------------------------------------------------------------------

class _Missing:
    """An entry the running ORT does not have: calling it is a typed error, not a jump through a stale slot."""

    def __init__(self, table: str, name: str, needs: int, running: str):
        self.message = (f"{table}::{name} needs ONNX Runtime {FLOOR[0]}.{needs} or newer; this process runs "
                        f"{running}")

    def __call__(self, *args):
        raise EpFailedPrecondition(self.message)

    def __bool__(self) -> bool:
        return False


class FunctionTable:
    """A table of C function pointers (OrtApi, OrtEpApi) called by name through the index the header gives. An
    entry newer than the running ORT is a `_Missing` (false, and raises EpFailedPrecondition when called)."""

    def __init__(self, name: str, address: int, entries: dict[str, tuple[int, Any, tuple]], ends: dict[int, int],
                 minor: int, version: str, added: dict[str, int] | None = None):
        if not address:
            raise EpFailedPrecondition(f"ONNX Runtime {version} returned no {name}")
        self.name = name
        needs = {n: (added or {}).get(n) or since(i, ends) for n, (i, _, _) in entries.items()}
        unknown = sorted(n for n, v in needs.items() if v is None)
        if unknown:
            raise EpInternal(f"ephost.ort declares {name} entries past the releases it knows: {unknown}")
        present = {n: e for n, e in entries.items() if needs[n] <= minor}
        size = max((i for i, _, _ in present.values()), default=-1) + 1
        slots = (c_void_p * size).from_address(address)
        empty = sorted(n for n, (i, _, _) in present.items() if not slots[i])
        if empty:
            raise EpFailedPrecondition(f"ONNX Runtime {version}'s {name} has no function at the slots of {empty}: "
                                       "its layout is not the one its headers declare")
        for n, (i, restype, argtypes) in entries.items():  # plain attributes: the hot path looks them up often
            setattr(self, n, CFUNCTYPE(restype, *argtypes)(slots[i]) if n in present
                    else _Missing(name, n, needs[n], version))

    def has(self, name: str) -> bool:
        return not isinstance(getattr(self, name), _Missing)


@dataclass
class OrtAbi:
    """One ONNX Runtime copy's OrtApi and OrtEpApi (a process may hold several: onnxruntime's Python module and
    onnxruntime-genai each load their own), checked, with the version the structs ephost fills for it claim."""

    version: str
    minor: int
    api: FunctionTable
    ep_api: FunctionTable
    origin: str = ""  # the shared object this copy of ORT lives in (to name it in errors)

    @property
    def struct_version(self) -> int:
        """What `ort_version_supported` claims in an OrtEp or OrtEpFactory ephost fills for this ORT."""
        return min(self.minor, LAYOUT)

    def claims(self, layout: Layout) -> int:
        """What `ort_version_supported` claims in a struct of this layout: what both sides know."""
        return min(self.minor, layout.version)

    def model_editor(self) -> FunctionTable:
        """The OrtModelEditorApi, loaded the first time it is needed (a minimal ORT build has none)."""
        table = self.__dict__.get("_model_editor")
        if table is None:
            table = self.__dict__["_model_editor"] = FunctionTable(
                "OrtModelEditorApi", self.api.GetModelEditorApi(), MODEL_EDITOR_API, {}, self.minor, self.version,
                MODEL_EDITOR_API_SINCE)
        return table

    def describe(self) -> str:
        """This copy of ORT in words, for errors: its version and where it was loaded from."""
        return f"ONNX Runtime {self.version}" + (f" ({self.origin})" if self.origin else "")

    @classmethod
    def load(cls, api_base_address: int) -> "OrtAbi":
        base = OrtApiBase.from_address(api_base_address)
        version = (base.GetVersionString() or b"").decode()
        minor = check_version(version)
        api = FunctionTable("OrtApi", base.GetApi(min(minor, LAYOUT)), ORT_API, ORT_API_ENDS, minor, version)
        ep_api = FunctionTable("OrtEpApi", api.GetEpApi(), EP_API, EP_API_ENDS, minor, version)
        abi = cls(version, minor, api, ep_api, shared_object_of(api_base_address))
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


class _DlInfo(Structure):
    _fields_ = [("dli_fname", c_char_p), ("dli_fbase", c_void_p), ("dli_sname", c_char_p), ("dli_saddr", c_void_p)]


def shared_object_of(address: int) -> str:
    """The path of the shared object that holds `address` ('' where the loader cannot say)."""
    try:
        dladdr = ctypes.CDLL(None).dladdr
        dladdr.argtypes, dladdr.restype = [c_void_p, POINTER(_DlInfo)], c_int
        info = _DlInfo()
        if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
            return ""
        return os.path.realpath(info.dli_fname.decode(errors="replace"))
    except (AttributeError, OSError):
        return ""
