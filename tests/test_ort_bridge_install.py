"""ephost.ort's plugin library is compiled when the package is built: a wheel installed into a fresh environment
loads it with no compiler anywhere on PATH (from Python, and from a C program that embeds Python through it), and
a build without a compiler stops with one message saying what to install."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

import models
from test_ort_bridge_hosts import Host, toml

ROOT = Path(__file__).resolve().parent.parent
NO_COMPILER = {"PATH": "/nonexistent", "CC": ""}  # what a slim application container has: no cc, gcc or clang


def source_tree(into: Path) -> Path:
    """This checkout's files (what git tracks, and what it would), copied: a build leaves nothing in the checkout."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    for name in listed:
        if (ROOT / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, into / name)
    return into


def build_wheel(source: Path, out: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "--disable-pip-version-check", "-w", str(out), str(source)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **env})


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh environment with ephost's wheel installed (its dependencies reached through this test
    environment's packages, behind its own): its python."""
    base = tmp_path_factory.mktemp("wheel")
    built = build_wheel(source_tree(base / "src"), base / "dist")
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (base / "dist").glob("ephost-*.whl")
    fresh = base / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    python = fresh / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--disable-pip-version-check", str(wheel)], check=True, timeout=300)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "test-dependencies.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return python


def test_an_installed_wheel_loads_its_library_with_no_compiler_on_path(installed, tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(models.diamond(), str(model))
    script = textwrap.dedent("""
        import shutil, sys
        import numpy as np, onnxruntime as ort
        import ephost, ephost.ort
        assert not any(shutil.which(c) for c in ("cc", "gcc", "clang")), "a compiler is on PATH"
        ephost.ort.register("npu", "reference")
        options = ort.SessionOptions()
        options.add_provider_for_devices([d for d in ort.get_ep_devices() if d.ep_name == "npu"], {})
        session = ort.InferenceSession(sys.argv[1], options)
        (y,) = session.run(None, {"x": np.ones((2, 3), np.float32)})
        print(ephost.__file__, ephost.ort.library_path(), float(y.sum()), ephost.ort.stats("npu").computes)
        ephost.ort.unregister("npu")
    """)
    done = subprocess.run([str(installed), "-c", script, str(model)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **NO_COMPILER}, cwd=tmp_path)  # (not the checkout: its ephost/)
    assert done.returncode == 0, done.stderr[-3000:]
    package, library, total, computes = done.stdout.split()
    fresh = str(installed.parent.parent)
    assert package.startswith(fresh) and library.startswith(fresh) and library.endswith("ephost/ort/libephost_ort.so")
    assert float(total) == float(models.diamond_expected(np.ones((2, 3), np.float32)).sum()) and computes == "1"


def test_a_c_program_finds_the_environment_of_an_installed_wheel_by_itself(installed, tmp_path):
    """No EPHOST_PYTHON: the library embeds Python with the virtual environment it is installed in (the
    pyvenv.cfg above it), whose python also runs the worker."""
    binary = tmp_path / "ort_host"
    subprocess.run(["cc", "-O2", "-o", str(binary), str(Path(__file__).with_name("native") / "ort_host.c"), "-ldl"],
                   check=True)
    purelib = subprocess.run([str(installed), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    library = Path(purelib) / "ephost" / "ort" / "libephost_ort.so"
    model = tmp_path / "m.onnx"
    onnx.save(models.diamond(), str(model))
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    x.tofile(tmp_path / "x.bin")
    config = toml(tmp_path, '[registrations.npu]\ntarget = "reference"\n')
    host = Host(binary, str(library), "npu", str(model), "x", "y", (2, 3), config, EPHOST_PYTHON="",
                **NO_COMPILER)
    try:
        workers = host.workers()
        assert len(workers) == 1
        (worker,) = workers
        with open(f"/proc/{worker}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0].decode().startswith(str(installed.parent.parent))
        assert host.ask(f"run {tmp_path / 'x.bin'} {tmp_path / 'y.bin'}") == "ok 24"
        np.testing.assert_allclose(np.fromfile(tmp_path / "y.bin", np.float32).reshape(2, 3),
                                   models.diamond_expected(x), rtol=1e-6)
        assert host.quit() == "bye"
    finally:
        if host.proc.poll() is None:
            host.proc.kill()
            host.proc.wait()


def test_building_without_a_compiler_says_what_to_install(tmp_path):
    built = build_wheel(source_tree(tmp_path / "src"), tmp_path / "dist", **NO_COMPILER)
    assert built.returncode != 0
    output = built.stdout + built.stderr
    assert "ephost: building ephost/ort/libephost_ort.so (ONNX Runtime's plugin EP library) needs a C compiler" \
        in output and "apt-get install gcc" in output, output[-3000:]
    assert not list((tmp_path / "dist").glob("*.whl"))
