"""One error hierarchy for both sides of the wire, mapped one-to-one onto gRPC status codes.

An EP implementation raises these; the worker turns them into a gRPC status; the client turns the status
back into the same class. Messages must help the user and must never carry a shared-memory name, key or
address.

Code written for ONNX Runtime catches its exception classes (onnxruntime.capi.onnxruntime_pybind11_state.Fail,
InvalidArgument, NoSuchFile, ...) or RuntimeError: every class here is a RuntimeError, and also the ORT class of
its kind where onnxruntime is installed. A process that sets EPHOST_ORT_ERRORS=0 (the workers this package
launches) does not import onnxruntime for that: its errors reach the application as status codes.
"""
from __future__ import annotations

import importlib.util
import os
import re
from types import ModuleType

import grpc

from ephost import wire


def _ort_exceptions() -> ModuleType | None:
    """ORT's pybind module, whose exception classes ours extend; None where ORT is absent or not wanted here."""
    if os.environ.get("EPHOST_ORT_ERRORS", "1") == "0" or importlib.util.find_spec("onnxruntime") is None:
        return None
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state
    except Exception:  # a broken install: ephost's errors stay RuntimeErrors
        return None
    return onnxruntime_pybind11_state


_ORT = _ort_exceptions()


def ort(name: str) -> tuple[type, ...]:
    """ORT's exception class of that name as a base (none where ORT is absent or lacks it)."""
    cls = getattr(_ORT, name, None)
    return (cls,) if isinstance(cls, type) and issubclass(cls, BaseException) else ()


class EpError(*ort("Fail"), RuntimeError):
    """Base of every error ephost raises (ORT's Fail, its generic failure, where onnxruntime is installed).
    `reason`, where a class sets one, travels beside the status (in the call's trailing metadata, see
    ephost.wire.REASON_KEY) so that the peer decodes the same class."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    reason: str = ""


class EpInvalidArgument(EpError, *ort("InvalidArgument"), ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class EpUnknownOption(EpInvalidArgument, AttributeError):
    """An option by a name nothing has (a typo, or an ONNX Runtime option ephost does not have): refused, naming
    it, rather than set and ignored. An AttributeError too, as ORT's SessionOptions raises one."""


class EpInvalidModel(EpInvalidArgument, *ort("InvalidProtobuf")):
    """The model is not a readable ONNX model (ORT's InvalidProtobuf)."""

    reason = wire.REASON_INVALID_MODEL


class EpInvalidGraph(EpInvalidArgument, *ort("InvalidGraph")):
    """The model reads, but its graph is not valid (ORT's InvalidGraph): a type or shape that contradicts an
    operator, a value nobody produces."""

    reason = wire.REASON_INVALID_GRAPH


class EpNotFound(EpError, *ort("NotFound"), LookupError):
    code = grpc.StatusCode.NOT_FOUND


class EpNoSuchFile(EpNotFound, *ort("NoSuchFile"), FileNotFoundError):
    """A file the caller named does not exist (ORT's NoSuchFile): a model path, an external data file."""

    reason = wire.REASON_NO_SUCH_FILE


class EpAlreadyExists(EpError):
    code = grpc.StatusCode.ALREADY_EXISTS


class EpResourceExhausted(EpError, MemoryError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class EpFailedPrecondition(EpError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class EpUnknownClient(EpFailedPrecondition):
    """The worker does not know this client (it restarted, or released the client after its lease ran out):
    say Worker.Hello again and make the handles anew."""

    reason = wire.REASON_UNKNOWN_CLIENT


class EpUnknownKeptCall(EpNotFound):
    """The fast-lane connection has no such kept call (the worker let it go to keep others): send the whole
    Compute again."""

    reason = wire.REASON_UNKNOWN_KEPT_CALL


class EpOutOfRange(EpInvalidArgument):
    code = grpc.StatusCode.OUT_OF_RANGE


class EpDeadlineExceeded(EpError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class EpUnimplemented(EpError, *ort("NotImplemented"), NotImplementedError):
    code = grpc.StatusCode.UNIMPLEMENTED


class EpUnauthenticated(EpError):
    code = grpc.StatusCode.UNAUTHENTICATED


class EpPermissionDenied(EpError):
    code = grpc.StatusCode.PERMISSION_DENIED


class EpCancelled(EpError):
    code = grpc.StatusCode.CANCELLED


class EpInternal(EpError, *ort("RuntimeException")):
    code = grpc.StatusCode.INTERNAL


class EpWorkerUnavailable(EpError, *ort("EPFail"), ConnectionError):
    """The worker cannot be reached (not started yet, gone, or the network is down): the EP failed, as ORT's
    EPFail says."""

    code = grpc.StatusCode.UNAVAILABLE


class EpWorkerDraining(EpWorkerUnavailable):
    """The worker refused the call as it drains (it is shutting down): nothing of the call ran there; make it
    on another worker, or on the worker that replaces it."""

    reason = wire.REASON_DRAINING


class EpWorkerReplaced(EpWorkerUnavailable):
    """The worker at the address is not the one this client knew (it restarted, or another replica took its
    place) and does not know this client: nothing of the call ran there. The client makes its handles again on
    the new worker; make the call again."""


class EpTlsError(EpWorkerUnavailable):
    """The worker's address answers, but TLS between it and this client does not match: plain text to a TLS
    worker (or TLS to a plain one), a certificate this client does not trust or that names another host, or a
    client certificate the worker asks for. The message names which."""


class EpWorkerCrashed(EpWorkerUnavailable):
    """A worker this process launched has died. Names the EP, the exit code or signal and the call."""

    def __init__(self, message: str, *, ep: str = "", returncode: int | None = None, call: str = ""):
        super().__init__(message)
        self.ep = ep
        self.returncode = returncode
        self.call = call

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode is not None and self.returncode < 0 else None


class EpWorkerFailed(EpWorkerCrashed):
    """A launched worker died and is not restarted (restarting is off, or it crashed more often than its
    crash limit allows): every call to its EP fails with this until it is registered again."""


class EpWorkerEnvironmentFailed(EpFailedPrecondition):
    """A worker's environment could not be made (pip could not install its requirements). Names the
    requirements and the log file holding pip's whole output."""

    def __init__(self, message: str, *, requirements: tuple[str, ...] = (), log_path: str = ""):
        super().__init__(message)
        self.requirements = tuple(requirements)
        self.log_path = log_path


# Status code -> class. EpWorkerCrashed is never decoded from a status: only the supervisor knows.
_BY_CODE: dict[grpc.StatusCode, type[EpError]] = {
    cls.code: cls
    for cls in (
        EpInvalidArgument, EpNotFound, EpAlreadyExists, EpResourceExhausted, EpFailedPrecondition,
        EpOutOfRange, EpDeadlineExceeded, EpUnimplemented, EpUnauthenticated, EpPermissionDenied,
        EpCancelled, EpInternal, EpWorkerUnavailable,
    )
}


# Structured reason -> class, for the errors that say more than their status code.
_BY_REASON: dict[str, type[EpError]] = {cls.reason: cls for cls in (EpUnknownClient, EpUnknownKeptCall,
                                                                     EpWorkerDraining, EpInvalidModel,
                                                                     EpInvalidGraph, EpNoSuchFile)}


def error_for_status(code: grpc.StatusCode, message: str, reason: str = "") -> EpError:
    cls = _BY_REASON.get(reason)
    if cls is not None and cls.code == code:
        return cls(message)
    return _BY_CODE.get(code, EpError)(message)


def reason_of(trailing_metadata) -> str:
    """The structured reason a failed call's trailing metadata carries ("" when none)."""
    return next((v for k, v in trailing_metadata or () if k == wire.REASON_KEY), "")


# What an error quotes of a peer's text (a path, a name) is cut to this many characters, and a whole message to
# this many bytes as it leaves the process: it stays readable, and a gRPC status (whose message travels in a
# trailer of at most 16 KiB, percent-encoded) carries it whatever a peer sent.
QUOTE_CHARS = 100
MESSAGE_BYTES = 2048
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_SHARED_NAME = re.compile(r"(/dev/shm/|/?memfd:)[^\s'\",)]*")


def quoted(text) -> str:
    """`text` as an error quotes it: its repr, cut to QUOTE_CHARS characters (and saying so)."""
    text = str(text)
    if len(text) <= QUOTE_CHARS:
        return repr(text)
    return f"{text[:QUOTE_CHARS]!r}... ({len(text)} characters)"


def public_message(message: str) -> str:
    """An error message as it leaves the process for a peer: no memory address, no shared-memory name, and at
    most MESSAGE_BYTES bytes of UTF-8 (cut where longer, and saying so)."""
    message = _SHARED_NAME.sub("(shared memory)", _ADDRESS.sub("0x…", message))
    data = message.encode("utf-8", "replace")
    if len(data) <= MESSAGE_BYTES:
        return message
    return data[:MESSAGE_BYTES].decode("utf-8", "ignore") + f"... (cut from {len(data)} bytes)"
