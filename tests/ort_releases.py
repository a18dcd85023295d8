"""Virtual environments that each hold one ONNX Runtime release from the package index, for the bridge's tests on
every release it serves (`make compat`; `make test` runs a few of them on one older release).

Each environment under `.compat/ort-<version>` has its own `onnxruntime` (installed without its dependencies) and
reaches everything else (numpy, onnx, grpc, pytest, this checkout's ephost) through the test environment it was
made from, behind its own site-packages: `import onnxruntime` finds the release, every other import the test
environment's packages. Workers the tests start run with the same interpreter, so they use the release too.

    python tests/ort_releases.py 1.24.4 1.30.0       # make (where missing) and run the bridge's tests on each
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / ".compat"
# The releases `make compat` runs: the floor's last patch release, two between, and the newest on the index.
MATRIX = ("1.24.4", "1.25.1", "1.27.0", "1.30.0", "1.32.0")
OLDER = "1.24.4"  # the older release `make test` covers besides the installed one
# What the matrix runs: an unchanged ORT application (squeezenet, a worker crash and the next run, threads, control
# flow, strings, the bridged device's memory) and the hosts without Python.
TESTS = ("tests/test_ort_bridge.py", "tests/test_ort_bridge_memory.py", "tests/test_ort_bridge_hosts.py",
         "tests/test_ort_bridge_context.py")
# Tests of what an application can do only through a later release's Python API, left out on the releases before
# it: an OrtValue made on a plugin EP's device (OrtValue.ortvalue_from_shape_and_type(..., memory_info=)) is 1.28's.
NEEDS = {(1, 28): ("an_ortvalue_on_the_bridged_device", "what_ort_holds_in_the_dead_workers_memory",
                   "a_tensor_on_the_device_goes_by_handle")}  # (parts of the tests' names: -k matches them)


def python_of(version: str) -> Path:
    return COMPAT / f"ort-{version}" / "bin" / "python"


def environment_for(version: str) -> Path:
    """The interpreter of the environment holding ONNX Runtime `version`, made first where missing."""
    home = COMPAT / f"ort-{version}"
    python = python_of(version)
    stamp = home / ".installed"
    if stamp.is_file():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(home)], check=True)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--target", purelib, f"onnxruntime=={version}"], check=True)
    # behind the release: this test environment's packages (site.addsitedir also runs their .pth files: the
    # editable install of this checkout among them)
    (Path(purelib) / "ephost-test-environment.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    found = subprocess.run([str(python), "-c", "import onnxruntime; print(onnxruntime.__version__)"],
                           check=True, capture_output=True, text=True).stdout.strip()
    if found != version:
        raise RuntimeError(f"{home} imports onnxruntime {found}, not {version}")
    stamp.write_text(version + "\n")
    return python


def run(version: str, *pytest_args: str) -> int:
    """The bridge's tests on ONNX Runtime `version` (pytest's exit status)."""
    python = environment_for(version)
    release = tuple(int(p) for p in version.split(".")[:2])
    later = [name for since, names in NEEDS.items() if release < since for name in names]
    print(f"== ONNX Runtime {version}" + (f" (without {len(later)} tests of a later Python API)" if later else ""),
          flush=True)
    select = ["-k", " and ".join(f"not {name}" for name in later)] if later else []
    return subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, *select, *pytest_args],
                          cwd=ROOT, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).returncode


def main(argv: list[str]) -> int:
    versions = [a for a in argv if not a.startswith("-")] or list(MATRIX)
    extra = [a for a in argv if a.startswith("-")]
    failed = [v for v in versions if run(v, *extra) != 0]
    print("ONNX Runtime releases:", ", ".join(f"{v} {'FAILED' if v in failed else 'passed'}" for v in versions))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
