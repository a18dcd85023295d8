"""ephost's errors are catchable as ONNX Runtime's: code written for ORT catches its pybind exception classes
(Fail, InvalidArgument, NoSuchFile, InvalidProtobuf, InvalidGraph, EPFail...) or RuntimeError."""
import os
import subprocess
import sys

import numpy as np
import pytest
from onnxruntime.capi import onnxruntime_pybind11_state as C

import ephost
from ephost import InferenceSession, errors
import models
from helpers import worker_pids

# Each of ephost's classes and the ORT class code written for ORT catches it as.
KINDS = [(ephost.EpError, C.Fail), (ephost.EpInvalidArgument, C.InvalidArgument),
         (ephost.EpOutOfRange, C.InvalidArgument), (ephost.EpInvalidModel, C.InvalidProtobuf),
         (ephost.EpInvalidGraph, C.InvalidGraph), (ephost.EpNotFound, C.NotFound),
         (ephost.EpNoSuchFile, C.NoSuchFile), (ephost.EpUnimplemented, C.NotImplemented),
         (ephost.EpInternal, C.RuntimeException), (ephost.EpWorkerUnavailable, C.EPFail),
         (ephost.EpWorkerDraining, C.EPFail), (ephost.EpDeadlineExceeded, C.Fail), (ephost.EpCancelled, C.Fail)]


@pytest.mark.parametrize("ours, theirs", KINDS, ids=[k[0].__name__ for k in KINDS])
def test_each_error_is_also_the_ort_class_of_its_kind_and_a_runtime_error(ours, theirs):
    with pytest.raises(theirs) as caught:
        raise ours("what went wrong")
    assert isinstance(caught.value, (RuntimeError, ephost.EpError)) and str(caught.value) == "what went wrong"
    with pytest.raises(RuntimeError):
        raise ours("again")


def test_python_kinds_are_kept():
    assert issubclass(ephost.EpInvalidArgument, ValueError) and issubclass(ephost.EpNotFound, LookupError)
    assert issubclass(ephost.EpNoSuchFile, FileNotFoundError) and issubclass(ephost.EpDeadlineExceeded, TimeoutError)


def test_a_missing_model_file_is_ort_no_such_file(tmp_path):
    with pytest.raises(C.NoSuchFile, match="does not exist"):
        InferenceSession(str(tmp_path / "nowhere.onnx"), providers=[])


def test_unreadable_model_bytes_are_ort_invalid_protobuf():
    with pytest.raises(C.InvalidProtobuf, match="not a readable ONNX model"):
        InferenceSession(b"\x08\xff\xff garbage", providers=[])


def test_a_bad_feed_is_ort_invalid_argument(env):
    with InferenceSession(models.chain(["Relu"]), env=env, providers=["ref"]) as session:
        with pytest.raises(C.InvalidArgument, match="expects tensor\\(float\\)"):
            session.run(None, {"x": np.ones(4, np.int64)})


@pytest.mark.parametrize("cls", [ephost.EpInvalidModel, ephost.EpInvalidGraph, ephost.EpNoSuchFile])
def test_the_kinds_ort_names_cross_the_wire_as_themselves(cls):
    # A worker sends the class's status code and reason (server/rpc.py); the client decodes the same class.
    decoded = errors.error_for_status(cls.code, "from the worker", cls.reason)
    assert type(decoded) is cls


def test_launched_workers_do_not_load_onnxruntime_for_their_errors(env):
    # A reference worker runs no ORT: making its errors ORT's classes would load ORT into every worker's start.
    pids = [p for p in worker_pids() if _serves(p, "reference")]
    assert pids
    pid = pids[0]
    with open(f"/proc/{pid}/environ", "rb") as f:
        assert b"EPHOST_ORT_ERRORS=0" in f.read().split(b"\0")
    with open(f"/proc/{pid}/maps") as f:
        assert "onnxruntime_pybind11_state" not in f.read()


def test_without_ort_errors_ephost_errors_are_runtime_errors():
    code = ("import sys, ephost.errors as e; assert 'onnxruntime' not in sys.modules; "
            "assert e.EpError.__mro__[1] is RuntimeError; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "EPHOST_ORT_ERRORS": "0"},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def _serves(pid: int, ep: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return False
    return ep.encode() in args
