"""ephost as an ONNX Runtime plugin EP library: an unchanged ORT application selects ephost's devices, and ORT's own
session runs the nodes they take in an ephost worker (a vendor EP out of process).

    import onnxruntime as ort, ephost.ort
    ephost.ort.register("npu", "onnxruntime")            # an EP name, a plugin EP library path or an address
    devices = [d for d in ort.get_ep_devices() if d.ep_name == "npu"]
    options = ort.SessionOptions(); options.add_provider_for_devices(devices, {})
    session = ort.InferenceSession("model.onnx", options)

The library ORT loads is a C shim (shim.c) built on first use with the system C compiler; every EP function is
Python (ctypes) behind it, so it serves Python applications only (README: "ONNX Runtime applications").
"""
from __future__ import annotations

from typing import Mapping

from ephost.client.environment import Environment
from ephost.errors import EpNotFound
from ephost.ort.abi import CHECKED_VERSIONS, check_version
from ephost.ort.build import built_library
from ephost.ort.library import Binding, loaded_library
from ephost.ort.stats import BridgeStats

__all__ = ["library_path", "register", "unregister", "stats", "environment", "BridgeStats", "CHECKED_VERSIONS"]


def _ort():
    import onnxruntime
    check_version(onnxruntime.__version__)
    return onnxruntime


def library_path() -> str:
    """The path of the plugin EP library ORT loads (the shim, built on first use into a per-version cache)."""
    return str(built_library(_ort().__version__))


def register(ort_name: str, target: str, options: Mapping[str, str] | None = None) -> None:
    """Bind the ORT registration name `ort_name` to an ephost target and register the library with ORT.

    `target` and `options` are those of `ephost.Environment.register_execution_provider_library`: an EP name to
    launch a worker for ("onnxruntime", "reference", ...), a path to an ORT plugin EP library, or a worker's
    address; options go to the EP, except the supervision options (restart, crash_limit, timeout_s, ...).
    The devices ORT then lists under `ort_name` are the worker's; the EP's name in ORT is `ort_name`."""
    ort = _ort()
    lib = loaded_library(ort.__version__)
    binding = Binding(ort_name, target, {str(k): str(v) for k, v in (options or {}).items()})
    lib.add(binding)
    try:
        binding.environment = Environment()
        binding.environment.register_execution_provider_library(ort_name, target, binding.options)
        ort.register_execution_provider_library(ort_name, str(lib.path))
    except BaseException:
        lib.remove(ort_name)
        binding.close()
        raise


def unregister(ort_name: str) -> None:
    """Unregister from ORT (no session using the EP may remain) and end the worker."""
    ort = _ort()
    lib = loaded_library(ort.__version__)
    binding = _binding(ort_name)
    try:
        ort.unregister_execution_provider_library(ort_name)
    finally:
        lib.remove(ort_name)
        binding.close()



def _binding(ort_name: str) -> Binding:
    binding = loaded_library(_ort().__version__).binding(ort_name)
    if binding is None:
        raise EpNotFound(f"{ort_name!r} is not registered with ephost.ort")
    return binding


def stats(ort_name: str) -> BridgeStats:
    """What crossed the bridge for `ort_name` so far: Compute calls, bytes copied in and out."""
    return _binding(ort_name).stats.snapshot()


def environment(ort_name: str) -> Environment:
    """The ephost Environment holding the worker behind `ort_name` (its stats, its registration)."""
    return _binding(ort_name).environment
