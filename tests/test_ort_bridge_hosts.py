"""ephost.ort in hosts other than the onnxruntime Python module: a C program with no Python of its own (the shim
starts Python in it; each registration name's target comes from EPHOST_CONFIG), and a second copy of ONNX Runtime
in a Python process (what onnxruntime-genai loads), each copy with its own function tables."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import ephost
import ephost.ort
from ephost.ort.library import loaded_library
from ephost.cli.run_command import bundled_input, bundled_model
import models
from helpers import worker_pids

NATIVE = Path(__file__).with_name("native") / "ort_host.c"
ORT_LIBRARY = next((Path(ort.__file__).parent / "capi").glob("libonnxruntime.so.*"))  # the wheel's C library


@pytest.fixture(scope="module")
def ort_host(tmp_path_factory) -> Path:
    """tests/native/ort_host.c, compiled."""
    binary = tmp_path_factory.mktemp("host") / "ort_host"
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", "-o", str(binary), str(NATIVE), "-ldl"], check=True)
    return binary


@pytest.fixture(scope="module")
def squeezenet(tmp_path_factory):
    """Squeezenet, its input in a file, and ORT's own output for it (its CPU EP, in this process)."""
    path, _ = bundled_model("squeezenet")
    alone = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (arg,), (out,) = alone.get_inputs(), alone.get_outputs()
    x = bundled_input(arg).astype(np.float32)
    feed = tmp_path_factory.mktemp("feed") / "x.bin"
    x.tofile(feed)
    return path, arg.name, out.name, x.shape, feed, alone.run(None, {arg.name: x})[0]


class Host:
    """ort_host running: one command a line in, one answer a line out."""

    def __init__(self, binary: Path, plugin: str, name: str, model: str, inputs: str, outputs: str, shape,
                 config: Path | None, **env):
        environ = {**os.environ, "EPHOST_PYTHON": sys.executable, **env}
        if config is not None:
            environ["EPHOST_CONFIG"] = str(config)
        self.proc = subprocess.Popen([str(binary), str(ORT_LIBRARY), plugin, name, model, inputs, outputs,
                                      ",".join(map(str, shape))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=environ, cwd=Path(model).parent)
        self.lines: list[str] = []
        while not self.answer().startswith(("ready", "fatal")):
            pass
        if self.lines[-1].startswith("fatal"):
            self.proc.kill()
            raise AssertionError(self.lines[-1])

    def answer(self) -> str:
        line = self.proc.stdout.readline().strip()
        if not line:
            self.proc.wait(30)
            raise AssertionError(f"ort_host ended ({self.proc.returncode}): {self.proc.stderr.read()[-3000:]}")
        self.lines.append(line)
        return line

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def ask(self, command: str) -> str:
        self.send(command)
        return self.answer()

    def workers(self) -> set[int]:
        """The ephost workers this host started (its children)."""
        return {pid for pid in worker_pids() if _parent(pid) == self.proc.pid}

    def quit(self) -> str:
        answer = self.ask("quit")
        assert self.proc.wait(60) == 0, self.proc.stderr.read()[-3000:]
        return answer


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ephost.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_a_c_program_runs_squeezenet_in_a_worker_survives_its_sigkill_and_runs_on(ort_host, squeezenet, tmp_path):
    """The C program knows ORT's C API only: it registers ephost's library under "npu", selects npu's devices with
    ORT's CPU EP fallback off (so every node is the plugin's), and runs. The worker is SIGKILLed while runs go on:
    the run under way fails with ORT's error naming the EP and the signal, and the next run is right again."""
    model, inputs, outputs, shape, feed, expected = squeezenet
    config = toml(tmp_path, """
        [registrations.npu]
        target = "onnxruntime"
        options = { timeout_s = 30 }
    """)
    host = Host(ort_host, ephost.ort.library_path(), "npu", model, inputs, outputs, shape, config)
    try:
        assert host.lines == ["devices 1", f"ready {ort.__version__}"]
        (worker,) = host.workers()
        out = tmp_path / "y.bin"
        assert host.ask(f"run {feed} {out}") == f"ok {expected.nbytes}"
        np.testing.assert_allclose(np.fromfile(out, np.float32).reshape(expected.shape), expected, rtol=1e-4,
                                   atol=1e-6)
        host.send(f"loop {feed}")
        for _ in range(20):  # runs under way: the kill lands in one of them
            assert host.answer() == "ok"
        os.kill(worker, signal.SIGKILL)
        while (line := host.answer()) == "ok":
            pass
        assert line.startswith("error ") and "npu" in line and ("SIGKILL" in line or "signal 9" in line), line
        for _ in range(2):
            assert host.ask(f"run {feed} {out}") == f"ok {expected.nbytes}"
            np.testing.assert_allclose(np.fromfile(out, np.float32).reshape(expected.shape), expected, rtol=1e-4,
                                       atol=1e-6)
        (successor,) = host.workers()
        assert successor != worker
        assert host.quit() == "bye"
    finally:
        if host.proc.poll() is None:
            host.proc.kill()
            host.proc.wait()
    deadline = time.monotonic() + 10  # the host's unregister ended the worker
    while host.workers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(successor)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("case", ["no config", "no such table", "bad target"])
def test_a_c_program_is_told_what_its_config_lacks(ort_host, tmp_path, case):
    """What a C program that registers the library without a usable EPHOST_CONFIG gets: ORT's error status of
    RegisterExecutionProviderLibrary, saying what to write."""
    text = {"no config": None, "no such table": '[registrations.other]\ntarget = "reference"\n',
            "bad target": '[registrations.npu]\ntarget = 7\n'}[case]
    config = toml(tmp_path, text) if text is not None else None
    model = tmp_path / "m.onnx"
    model.write_bytes(models.diamond().SerializeToString())
    env = {} if config is not None else {"EPHOST_CONFIG": ""}
    with pytest.raises(AssertionError) as ended:
        Host(ort_host, ephost.ort.library_path(), "npu", str(model), "x", "y", (2, 3), config, **env)
    expected = {"no config": "set EPHOST_CONFIG to a TOML file with a [registrations.npu] table",
                "no such table": f"EPHOST_CONFIG ({config}) has no [registrations.npu] table (it has: other)",
                "bad target": "[registrations.npu] needs target = "}[case]
    assert "fatal RegisterExecutionProviderLibrary" in str(ended.value) and expected in str(ended.value), ended.value


def test_a_second_copy_of_onnx_runtime_has_its_own_tables_and_unregister_leaves_both(tmp_path):
    """onnxruntime-genai's situation: the wheel's C library loaded beside the onnxruntime module (its own ORT,
    its own OrtEnv) registers ephost's library under the name ephost.ort.register bound. Each copy calls through
    tables of its own; unregister then unregisters the name from both and ends the worker."""
    ephost.ort.register("twice", "reference")
    try:
        copy = SecondCopy(ORT_LIBRARY)
        copy.register("twice", ephost.ort.library_path())
        lib = loaded_library()
        holding = lib.holding("twice")
        assert len(holding) == 2 and len({id(c.abi.api) for c in holding}) == 2
        assert {c.abi.origin for c in holding} == {os.path.realpath(ORT_LIBRARY), _module_library()}
        assert copy.device_names().count("twice") == 1
    finally:
        ephost.ort.unregister("twice")
    assert lib.holding("twice") == [] and "twice" not in copy.device_names()
    assert "twice" not in {d.ep_name for d in ort.get_ep_devices()}


def test_a_second_copy_that_registers_first_shares_its_worker_and_unregister_ends_it(tmp_path, monkeypatch):
    """The other order: the second copy registers ephost's library first (its names' targets from EPHOST_CONFIG),
    then the application's ephost.ort.register of the same target takes that worker over; one unregister ends it in
    both copies. A name only the second copy registered is unregistered there alone."""
    monkeypatch.setenv("EPHOST_CONFIG", str(toml(tmp_path, """
        [registrations.first]
        target = "reference"
        [registrations.only]
        target = "reference"
    """)))
    copy = SecondCopy(ORT_LIBRARY)
    copy.register("first", ephost.ort.library_path())
    copy.register("only", ephost.ort.library_path())
    worker = ephost.ort.environment("first").registration("first").process
    with pytest.raises(ephost.EpAlreadyExists, match="from EPHOST_CONFIG, with target 'reference'"):
        ephost.ort.register("first", "onnxruntime")
    ephost.ort.register("first", "reference")
    assert ephost.ort.environment("first").registration("first").process is worker
    assert "first" in {d.ep_name for d in ort.get_ep_devices()} and len(loaded_library().holding("first")) == 2
    ephost.ort.unregister("first")
    ephost.ort.unregister("only")
    assert not {"first", "only"} & set(copy.device_names())
    assert "first" not in {d.ep_name for d in ort.get_ep_devices()}
    assert worker.exited.wait(10)


def _module_library() -> str:
    from onnxruntime.capi import onnxruntime_pybind11_state
    return os.path.realpath(onnxruntime_pybind11_state.__file__)


class SecondCopy:
    """ORT's C library loaded through ctypes, as a second copy in this process (genai loads the same file)."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.OrtGetApiBase.restype = ctypes.c_void_p
        base = ctypes.cast(self.lib.OrtGetApiBase(), ctypes.POINTER(ctypes.c_void_p))
        get_api = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)(base[0])
        version = ctypes.CFUNCTYPE(ctypes.c_char_p)(base[1])().decode()
        self.api = ctypes.cast(get_api(int(version.split(".")[1])), ctypes.POINTER(ctypes.c_void_p))
        self.env = ctypes.c_void_p()
        self.call(3, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(3, b"second", ctypes.byref(self.env))

    def call(self, index: int, *argtypes):
        """OrtApi entry `index` (returning an OrtStatus*), its status checked."""
        function = ctypes.CFUNCTYPE(ctypes.c_void_p, *argtypes)(self.api[index])

        def checked(*args):
            status = function(*args)
            if status:
                message = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(self.api[2])(status)
                raise RuntimeError(message.decode())
        return checked

    def register(self, name: str, path: str) -> None:
        self.call(301, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p)(self.env, name.encode(), path.encode())

    def device_names(self) -> list[str]:
        devices, n = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_size_t()
        self.call(303, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(self.env, ctypes.byref(devices),
                                                                           ctypes.byref(n))
        name = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(self.api[312])
        return [name(devices[i]).decode() for i in range(n.value)]


def test_a_plugin_library_in_a_worker_keeps_its_own_name_and_version(tmp_path, monkeypatch):
    """A vendor's plugin EP library hosted in a worker: here ephost's own library, which names its EP after the
    name it is registered under and reports its worker's EP's version (a reference EP, two workers down, its
    target from EPHOST_CONFIG, which the worker inherits). The worker registers the library under the name the
    application chose, as ORT in process would: ephost's tables list its EP as "outer", not "ephost", and the
    bridged device's version is the vendor EP's, not the worker's ONNX Runtime's."""
    from ephost.eps.reference import ReferenceEpFactory
    monkeypatch.setenv("EPHOST_CONFIG", str(toml(tmp_path, '[registrations.outer]\ntarget = "reference"\n')))
    ephost.ort.register("outer", ephost.ort.library_path())
    try:
        (worker_device,) = ephost.ort.environment("outer").get_ep_devices()
        assert worker_device.ep_name == "outer"
        (device,) = [d for d in ort.get_ep_devices() if d.ep_name == "outer"]
        metadata = dict(device.ep_metadata)
        assert metadata["ephost.worker_ep"] == "outer"
        vendor = ReferenceEpFactory().get_version()
        assert metadata["version"] == vendor and vendor != ort.__version__
        options = ort.SessionOptions()
        options.add_provider_for_devices([device], {})
        session = ort.InferenceSession(models.diamond().SerializeToString(), options)
        session.disable_fallback()
        x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
        np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
        assert ephost.ort.stats("outer").computes == 1
        del session
    finally:
        ephost.ort.unregister("outer")
