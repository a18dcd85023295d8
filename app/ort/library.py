"""The ORT registration names ephost serves, the copies of ONNX Runtime that call it, and the two entry points of
the shim ORT calls (CreateEpFactories, ReleaseEpFactory), set from Python when the shim is first loaded."""
from __future__ import annotations

import atexit
import ctypes
import logging
import threading
from ctypes import c_void_p
from dataclasses import dataclass, field
from pathlib import Path

from ephost.client.environment import Environment
from ephost.client.targets import parse_target
from ephost.errors import EpAlreadyExists, EpError, EpFailedPrecondition, EpInvalidArgument, EpNotFound
from ephost.ort import abi as A
from ephost.ort import callbacks, config
from ephost.ort.build import built_library
from ephost.ort.factory import BridgeFactory
from ephost.ort.kernel_io import KernelIO
from ephost.ort.pool import PoolFunctions
from ephost.ort.resident import Sync
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
    # made for ORT from EPHOST_CONFIG: it ends as ORT releases its last factory (ORT's unregister is its end)
    from_config: bool = False

    @property
    def registration(self):
        return self.environment.registration(self.ort_name)

    def start(self) -> None:
        """Launch or connect to the worker."""
        self.environment = Environment()
        self.environment.register_execution_provider_library(self.ort_name, self.target, self.options)

    def close(self) -> None:
        if self.environment is not None:
            self.environment.close()


@dataclass(eq=False)
class OrtCopy:
    """One copy of ONNX Runtime that loaded the shim (a process may hold several: the onnxruntime module's and
    onnxruntime-genai's, even of different versions): its own function tables, and Compute's reads and writes
    through them."""

    abi: A.OrtAbi
    kernel_io: KernelIO

    def unregister(self, ort_name: str) -> None:
        """ORT's UnregisterExecutionProviderLibrary in this copy, through its OrtEnv (a process-wide singleton in
        each copy: CreateEnv hands back the one that exists, ReleaseEnv gives it back)."""
        api = self.abi.api
        env = c_void_p()
        self.abi.check(api.CreateEnv(3, b"ephost", ctypes.byref(env)), "CreateEnv")  # 3: ORT_LOGGING_LEVEL_ERROR
        try:
            self.abi.check(api.UnregisterExecutionProviderLibrary(env, ort_name.encode()),
                           "UnregisterExecutionProviderLibrary")
        finally:
            api.ReleaseEnv(env)


class Library:
    """The loaded shim (one per process) and the bindings it serves."""

    def __init__(self, path: Path):
        self.path = path
        self._cdll = ctypes.CDLL(str(path))
        self._bindings: dict[str, Binding] = {}
        self._copies: dict[int, OrtCopy] = {}  # OrtApiBase* -> that copy of ORT
        self._lock = threading.Lock()  # guards _bindings and _copies
        self._pools = PoolFunctions(self._cdll)
        self._sync = Sync(self._cdll)
        self._create = A.CreateEpFactoriesFn(self._create_factories)
        self._release = A.ReleaseEpFactoryFn(self._release_factory)
        self._cdll.ephost_ort_set_callbacks.argtypes = [c_void_p, c_void_p]
        self._cdll.ephost_ort_set_callbacks(ctypes.cast(self._create, c_void_p), ctypes.cast(self._release, c_void_p))
        callbacks.set_null_function(ctypes.cast(self._cdll.ephost_ort_null, c_void_p).value)
        atexit.register(self.shutdown)

    # --- bindings ---

    def bind(self, ort_name: str, target: str, options: dict[str, str], from_config: bool = False) -> Binding:
        """Bind the name to its target, the worker started; EpAlreadyExists where the name is bound."""
        if parse_target(target).kind == "inproc":
            raise EpInvalidArgument(f"ephost.ort runs the EP of {ort_name!r} in a worker: give an EP name, a plugin EP "
                                    f"library or a worker's address, not {target!r} (an EP in this process is ORT's "
                                    "own plugin EP library, registered with ORT directly)")
        binding = Binding(ort_name, target, options, from_config=from_config)
        with self._lock:
            if ort_name in self._bindings:
                raise EpAlreadyExists(f"{ort_name!r} is already registered with ephost.ort")
            self._bindings[ort_name] = binding
        try:
            binding.start()
        except BaseException:
            self.unbind(ort_name)
            raise
        return binding

    def adopt(self, ort_name: str, target: str, options: dict[str, str]) -> bool:
        """Take over, for ephost.ort.register, the binding another copy of ORT made of this name from EPHOST_CONFIG
        (its worker shared from now on, ended by ephost.ort.unregister); False where there is none.
        EpAlreadyExists where the name is bound otherwise, or to another target."""
        with self._lock:
            binding = self._bindings.get(ort_name)
            if binding is None:
                return False
            if not binding.from_config or (binding.target, binding.options) != (target, options):
                raise EpAlreadyExists(f"{ort_name!r} is already registered with ephost.ort" + (
                    f" (from EPHOST_CONFIG, with target {binding.target!r} and options {binding.options}: give the "
                    "same)" if binding.from_config else ""))
            binding.from_config = False
            return True

    def unbind(self, ort_name: str) -> Binding:
        """Let go of the name and end its worker."""
        with self._lock:
            binding = self._bindings.pop(ort_name, None)
        if binding is None:
            raise EpNotFound(f"{ort_name!r} is not registered with ephost.ort")
        binding.close()
        return binding

    def binding(self, ort_name: str) -> Binding | None:
        with self._lock:
            return self._bindings.get(ort_name)

    def _configured(self, ort_name: str) -> Binding:
        """The binding EPHOST_CONFIG makes for a name ORT asks for that register did not bind."""
        wanted = config.registration(ort_name)
        try:
            return self.bind(ort_name, wanted.target, wanted.options, from_config=True)
        except EpAlreadyExists:  # another copy of ORT asked for it first
            return self.binding(ort_name) or self._configured(ort_name)

    # --- the copies of ORT ---

    def copy_of(self, api_base: int) -> OrtCopy:
        """The copy of ORT whose OrtApiBase this is, its tables loaded and checked the first time it calls."""
        with self._lock:
            copy = self._copies.get(api_base)
        if copy is None:
            abi = A.OrtAbi.load(api_base)
            made = OrtCopy(abi, KernelIO(abi, self._cdll))
            with self._lock:
                copy = self._copies.setdefault(api_base, made)
        return copy

    def copies(self) -> list[OrtCopy]:
        with self._lock:
            return list(self._copies.values())

    def holding(self, ort_name: str) -> list[OrtCopy]:
        """The copies of ORT that hold a factory of this name (it is registered in them)."""
        binding = self.binding(ort_name)
        abis = {id(f.abi) for f in binding.factories} if binding is not None else set()
        return [c for c in self.copies() if id(c.abi) in abis]

    # --- what ORT calls ---

    def _create_factories(self, name, api_base, logger, factories, max_factories, num_factories):
        try:
            num_factories[0] = 0
            copy = self.copy_of(api_base)
            ort_name = (name or b"").decode()
            binding = self.binding(ort_name) or self._configured(ort_name)
            factory = BridgeFactory(binding, copy.abi, copy.kernel_io, self._pools, self._sync)
            binding.factories.append(factory)
            factories[0] = factory.address
            num_factories[0] = 1
            return None
        except BaseException as e:  # noqa: BLE001 - nothing may unwind into ORT
            text = callbacks.describe(e)
            callbacks.note(log, logging.WARNING, "ephost.ort: CreateEpFactories failed: %s", text)
            return _raw_status(api_base, f"ephost.ort: {text}")

    def _release_factory(self, address):
        try:
            owner = callbacks.owner_of(address)
            if owner is None:
                return None
            binding = owner.binding
            try:
                owner.release()
            finally:  # (what failed in the release leaves the binding all the same)
                binding.factories.remove(owner)
            if binding.from_config and not binding.factories and self.binding(binding.ort_name) is binding:
                try:  # ORT unregistered the name in every copy: its worker ends
                    self.unbind(binding.ort_name)
                except EpError as e:
                    log.debug("ending %r: %s", binding.ort_name, e)
        except BaseException as e:  # noqa: BLE001 - nothing may unwind into ORT (ctypes would return it no status)
            callbacks.note(log, logging.WARNING, "ephost.ort: ReleaseEpFactory failed: %s", callbacks.describe(e))
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
_library_lock = threading.Lock()  # guards _library


def loaded_library(path: Path | None = None) -> Library:
    """The shim, loaded once per process: the installed library, or the file at `path` (what ORT loaded, in a host
    that registered it with ORT first)."""
    global _library
    with _library_lock:
        if _library is None:
            _library = Library(path or built_library())
        elif path is not None and Path(path).resolve() != Path(_library.path).resolve():
            raise EpFailedPrecondition(f"ephost.ort's library is loaded from {_library.path}; ONNX Runtime loaded "
                                       f"another copy of it, from {path}: register one path")
        return _library
