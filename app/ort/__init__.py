"""ephost as an ONNX Runtime plugin EP library: an unchanged ORT application selects ephost's devices, and ORT's own
session runs the nodes they take in an ephost worker (a vendor EP out of process).

    import onnxruntime as ort, ephost.ort
    ephost.ort.register("npu", "onnxruntime")            # an EP name, a plugin EP library path or an address
    devices = [d for d in ort.get_ep_devices() if d.ep_name == "npu"]
    options = ort.SessionOptions(); options.add_provider_for_devices(devices, {})
    session = ort.InferenceSession("model.onnx", options)

The library ORT loads is a C shim (shim.c, compiled when ephost is installed); every EP function is Python (ctypes)
behind it. A C, C++ or C# application registers `library_path()` with ORT itself and names each registration's
target in the TOML file EPHOST_CONFIG points to: the shim starts Python in that process (docs/ort-bridge.md).
"""
from __future__ import annotations

from typing import Mapping

from ephost.client.environment import Environment
from ephost.errors import EpFailedPrecondition, EpNotFound
from ephost.ort.abi import FLOOR, check_version
from ephost.ort.build import built_library
from ephost.ort.library import loaded_library
from ephost.ort.stats import BridgeStats

__all__ = ["library_path", "register", "unregister", "stats", "environment", "BridgeStats", "MINIMUM_ONNXRUNTIME"]

MINIMUM_ONNXRUNTIME = ".".join(map(str, FLOOR))  # the oldest ONNX Runtime release ephost.ort serves


def _ort():
    import onnxruntime
    check_version(onnxruntime.__version__)
    return onnxruntime


def library_path() -> str:
    """The path of the plugin EP library ORT loads (built when ephost was installed). A C, C++ or C# application
    registers this path with RegisterExecutionProviderLibrary; its names' targets come from EPHOST_CONFIG."""
    return str(built_library())


def register(ort_name: str, target: str, options: Mapping[str, str] | None = None) -> None:
    """Bind the ORT registration name `ort_name` to an ephost target and register the library with ORT.

    `target` and `options` are those of `ephost.Environment.register_execution_provider_library`: an EP name to
    launch a worker for ("onnxruntime", "reference", ...), a path to an ORT plugin EP library, or a worker's
    address; options go to the EP, except the supervision options (restart, crash_limit, timeout_s, ...).
    The devices ORT then lists under `ort_name` are the worker's; the EP's name in ORT is `ort_name`. Another copy
    of ORT in the process (onnxruntime-genai's) registers `library_path()` under the same name itself, before or
    after this (before: the name's target in EPHOST_CONFIG, the same as given here, and the worker is shared)."""
    ort = _ort()
    lib = loaded_library()
    options = {str(k): str(v) for k, v in (options or {}).items()}
    adopted = lib.adopt(ort_name, target, options)
    if not adopted:
        lib.bind(ort_name, target, options)
    try:
        ort.register_execution_provider_library(ort_name, str(lib.path))
    except BaseException:
        if not adopted:
            lib.unbind(ort_name)
        raise


def unregister(ort_name: str) -> None:
    """Unregister the name from every copy of ORT in the process that registered it (the onnxruntime module's,
    onnxruntime-genai's: no session of theirs using the EP may remain), then end the worker. A copy that refuses is
    named in the EpFailedPrecondition raised; the worker ends all the same."""
    ort = _ort()
    lib = loaded_library()
    _binding(ort_name)
    failures = []
    module = _module_origin(ort)
    for copy in lib.holding(ort_name):
        try:
            if copy.abi.origin == module:  # through the module, which keeps its own record of the name
                ort.unregister_execution_provider_library(ort_name)
            else:
                copy.unregister(ort_name)
        except Exception as e:  # noqa: BLE001 - each copy's own exception type, named with the copy
            failures.append(f"{copy.abi.describe()}: {e}")
    if lib.binding(ort_name) is not None:  # (one made from EPHOST_CONFIG ends with its last factory)
        lib.unbind(ort_name)
    if failures:
        raise EpFailedPrecondition(f"unregistering {ort_name!r} failed in " + "; in ".join(failures))


def _module_origin(ort) -> str:
    """The shared object of the onnxruntime module's own copy of ORT."""
    import os
    from onnxruntime.capi import onnxruntime_pybind11_state
    return os.path.realpath(onnxruntime_pybind11_state.__file__)


def _binding(ort_name: str) -> Binding:
    _ort()
    binding = loaded_library().binding(ort_name)
    if binding is None:
        raise EpNotFound(f"{ort_name!r} is not registered with ephost.ort")
    return binding


def stats(ort_name: str) -> BridgeStats:
    """What crossed the bridge for `ort_name` so far: Compute calls, bytes copied in and out."""
    return _binding(ort_name).stats.snapshot()


def environment(ort_name: str) -> Environment:
    """The ephost Environment holding the worker behind `ort_name` (its stats, its registration)."""
    return _binding(ort_name).environment
