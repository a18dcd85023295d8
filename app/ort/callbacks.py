"""What every C-callable piece of the bridge shares: structs kept alive for as long as ORT may call them, strings
returned from buffers that outlive the call, and Python errors turned into OrtStatus (never unwinding into C).

At interpreter exit every function pointer of every live struct is replaced by the shim's `ephost_ort_null`
(which returns NULL, i.e. success and no object): ORT may release factories, EPs and compute infos after Python
is gone, and must then find no Python behind them.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from ctypes import Structure
from typing import Callable

from ephost.errors import EpError
from ephost.ort import abi as A

log = logging.getLogger(__name__)

_live: dict[int, object] = {}  # struct address -> the Python object that owns it
_lock = threading.Lock()  # guards _live
_null_function: int | None = None


def keep(owner: object, struct: Structure) -> int:
    """Keep `owner` (and its struct) alive under the struct's address, which is what ORT holds."""
    address = ctypes.addressof(struct)
    with _lock:
        _live[address] = owner
    return address


def forget(address: int) -> object | None:
    with _lock:
        return _live.pop(address, None)


def owner_of(address: int) -> object | None:
    with _lock:
        return _live.get(address)


def fill(struct: Structure, layout: A.Layout, abi: A.OrtAbi, methods: dict[str, Callable]) -> None:
    """Set the struct's version (what both ephost and this ORT know of its layout) and the function pointers
    `methods` names that this ORT reads; every other member stays NULL."""
    version = abi.claims(layout)
    struct.ort_version_supported = version
    for name, fn in methods.items():
        if layout.since(name) <= version:
            setattr(struct, name, layout.type_of(name)(fn))


def set_null_function(address: int) -> None:
    global _null_function
    _null_function = address


def neuter_all() -> None:
    """Point every function of every live struct at the shim's no-op (see the module's doc)."""
    if not _null_function:
        return
    with _lock:
        owners = list(_live.items())
    for address, owner in owners:
        struct = getattr(owner, "struct", None)
        if struct is None:
            continue
        for name, ftype in struct._fields_[1:]:
            if name.startswith("_"):  # spare slots: NULL already
                continue
            ctypes.c_void_p.from_address(address + getattr(type(struct), name).offset).value = _null_function


class Strings:
    """NUL-terminated strings handed to ORT, kept as long as their owner (ORT may read them after the call)."""

    def __init__(self):
        self._buffers: dict[str, ctypes.Array] = {}

    def __call__(self, text: str) -> int:
        buffer = self._buffers.get(text)
        if buffer is None:
            buffer = self._buffers[text] = ctypes.create_string_buffer(text.encode())
        return ctypes.addressof(buffer)


def describe(error: BaseException) -> str:
    """The error in words, for a log line or ORT's status; never raises (a callback describes what it caught)."""
    try:
        text = str(error) or repr(error)
    except BaseException:  # noqa: BLE001 - its message fails too: named by its class
        return f"{type(error).__name__} (its message raised an error)"
    return text if isinstance(error, EpError) else f"{type(error).__name__}: {text}"


def note(logger: logging.Logger, level: int, message: str, *args) -> None:
    """A log line from a callback: a handler or filter that raises neither reaches ORT nor fails the call."""
    try:
        logger.log(level, message, *args, stacklevel=2)  # (the record names the callback's line)
    except BaseException:  # noqa: BLE001 - nothing may unwind into ORT
        pass


class Guard:
    """Runs a callback's body; an exception becomes an OrtStatus (for functions that return one) or a log line
    (for those that return nothing), named after the EP and the call."""

    def __init__(self, abi: A.OrtAbi, name: str):
        self.abi, self.name = abi, name

    def status(self, what: str, body: Callable[[], None]) -> int | None:
        note(log, logging.DEBUG, "%s: %s", self.name, what)
        try:
            body()
            return None
        except BaseException as e:  # noqa: BLE001 - nothing may unwind into ORT
            return self.failed(what, e)

    def failed(self, what: str, error: BaseException) -> int | None:
        """The OrtStatus of a callback that raised `error` (logged), for a callback that catches it itself (one
        called every run, where a closure a call costs)."""
        text = describe(error)
        # ORT logs and raises the status itself, with this message: at INFO here, so one failure is one warning.
        note(log, logging.INFO, "%s: %s failed: %s", self.name, what, text)
        try:
            return self.abi.status(A.ORT_EP_FAIL, f"{self.name}: {what}: {text}")
        except BaseException:  # noqa: BLE001
            return None

    def quiet(self, what: str, body: Callable[[], object], default=None):
        note(log, logging.DEBUG, "%s: %s", self.name, what)
        try:
            return body()
        except BaseException as e:  # noqa: BLE001
            note(log, logging.WARNING, "%s: %s failed: %s", self.name, what, describe(e))
            return default
