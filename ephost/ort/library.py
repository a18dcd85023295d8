"""The ORT registration names ephost serves, and the two entry points of the shim ORT calls for them
(CreateEpFactories, ReleaseEpFactory), set from Python when the shim is first loaded."""
from __future__ import annotations

import atexit
import ctypes
import logging
import threading
from ctypes import c_void_p
from dataclasses import dataclass, field
from pathlib import Path

from ephost.client.environment import Environment
from ephost.errors import EpAlreadyExists, EpNotFound
from ephost.ort import abi as A
from ephost.ort import callbacks
from ephost.ort.build import built_library
from ephost.ort.factory import BridgeFactory
from ephost.ort.kernel_io import KernelIO
from ephost.ort.pool import PoolFunctions
from ephost.ort.stats import BridgeStats

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Binding:
    """An ORT registration name bound to an ephost target (an EP to launch, a plugin library, an address), with
    the ephost Environment that holds the worker."""

    ort_name: str
    target: str
    options: dict[str, str]
    environment: Environment | None = None
    factories: list = field(default_factory=list)
    stats: BridgeStats = field(default_factory=BridgeStats)  # shared by the factories ORT makes for this name

    @property
    def registration(self):
        return self.environment.registration(self.ort_name)

    def close(self) -> None:
        if self.environment is not None:
            self.environment.close()


class Library:
    """The loaded shim (one per process) and the bindings it serves."""

    def __init__(self, path: Path):
        self.path = path
        self._cdll = ctypes.CDLL(str(path))
        self._bindings: dict[str, Binding] = {}
        self._lock = threading.Lock()
        self._abi: A.OrtAbi | None = None
        self._kernel_io: KernelIO | None = None
        self._pools: PoolFunctions | None = None
        self._create = A.CreateEpFactoriesFn(self._create_factories)
        self._release = A.ReleaseEpFactoryFn(self._release_factory)
        self._cdll.ephost_ort_set_callbacks.argtypes = [c_void_p, c_void_p]
        self._cdll.ephost_ort_set_callbacks(ctypes.cast(self._create, c_void_p), ctypes.cast(self._release, c_void_p))
        callbacks.set_null_function(ctypes.cast(self._cdll.ephost_ort_null, c_void_p).value)
        atexit.register(self.shutdown)

    # --- bindings ---

    def add(self, binding: Binding) -> None:
        with self._lock:
            if binding.ort_name in self._bindings:
                raise EpAlreadyExists(f"{binding.ort_name!r} is already registered with ephost.ort")
            self._bindings[binding.ort_name] = binding

    def remove(self, ort_name: str) -> Binding:
        with self._lock:
            binding = self._bindings.pop(ort_name, None)
        if binding is None:
            raise EpNotFound(f"{ort_name!r} is not registered with ephost.ort")
        return binding

    def binding(self, ort_name: str) -> Binding | None:
        with self._lock:
            return self._bindings.get(ort_name)

    # --- what ORT calls ---

    def _create_factories(self, name, api_base, logger, factories, max_factories, num_factories):
        num_factories[0] = 0
        try:
            if self._abi is None:
                self._abi = A.OrtAbi.load(api_base)
                self._kernel_io = KernelIO(self._abi, self._cdll)
                self._pools = PoolFunctions(self._cdll)
            binding = self.binding((name or b"").decode())
            if binding is None:
                raise EpNotFound(f"{name.decode()!r} was registered with ONNX Runtime directly; register it with "
                                 "ephost.ort.register(name, target) instead")
            factory = BridgeFactory(binding, self._abi, self._kernel_io, self._pools)
            binding.factories.append(factory)
            factories[0] = factory.address
            num_factories[0] = 1
            return None
        except BaseException as e:  # noqa: BLE001 - nothing may unwind into ORT
            log.warning("ephost.ort: CreateEpFactories failed: %s", callbacks.describe(e))
            return _raw_status(api_base, f"ephost.ort: {callbacks.describe(e)}")

    def _release_factory(self, address):
        owner = callbacks.owner_of(address)
        if owner is not None:
            owner.release()
            owner.binding.factories.remove(owner)
        return None

    def shutdown(self) -> None:
        """At interpreter exit: leave no Python behind any pointer ORT holds, then end the workers."""
        callbacks.neuter_all()
        self._cdll.ephost_ort_set_callbacks(None, None)
        with self._lock:
            bindings = list(self._bindings.values())
        for binding in bindings:
            try:
                binding.close()
            except Exception as e:  # noqa: BLE001
                log.debug("closing %r at exit: %s", binding.ort_name, e)


def _raw_status(api_base: int, message: str) -> int | None:
    """An OrtStatus made without the checked tables (they may be what failed): OrtApi's CreateStatus is slot 0
    in every version."""
    try:
        base = A.OrtApiBase.from_address(api_base)
        table = base.GetApi(1)
        create = ctypes.CFUNCTYPE(c_void_p, ctypes.c_int, ctypes.c_char_p)(c_void_p.from_address(table).value)
        return create(A.ORT_FAIL, message.encode(errors="replace")[:4000])
    except BaseException:  # noqa: BLE001
        return None


_library: Library | None = None
_library_lock = threading.Lock()


def loaded_library(ort_version: str) -> Library:
    """The shim, loaded once per process (built first where needed)."""
    global _library
    with _library_lock:
        if _library is None:
            _library = Library(built_library(ort_version))
        return _library
