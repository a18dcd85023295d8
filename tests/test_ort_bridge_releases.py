"""The bridge on an older ONNX Runtime release than the installed one (ephost serves every release from 1.24): an
unchanged application's squeezenet, a worker crash and the next run, the C program and a second copy of ORT, run
by pytest in an environment holding that release (tests/ort_releases.py; `make compat` runs the whole matrix)."""
from __future__ import annotations

import os
import subprocess

import ort_releases

SUBSET = ("real_model_matches_onnx_runtime_alone and squeezenet or worker_crash_in_compute or c_program_runs_squeezenet"
          " or second_copy_of_onnx_runtime")


def test_an_unchanged_application_on_an_older_release():
    python = ort_releases.environment_for(ort_releases.OLDER)
    done = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *ort_releases.TESTS, "-k",
                           SUBSET], cwd=ort_releases.ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "4 passed" in done.stdout, done.stdout[-2000:]  # squeezenet, the crash, the C program, the second copy
    version = subprocess.run([str(python), "-c", "import onnxruntime; print(onnxruntime.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == ort_releases.OLDER


def test_a_release_below_the_floor_is_refused_with_a_message(tmp_path):
    """ORT 1.23: ephost.ort.register refuses it, and ORT loading ephost's library itself (a C application's way)
    gets the same words as its error status, not a crash."""
    python = ort_releases.environment_for("1.23.2")
    (tmp_path / "ephost.toml").write_text('[registrations.npu]\ntarget = "reference"\n')
    code = """
import onnxruntime as ort, ephost.ort
for attempt in (lambda: ephost.ort.register("npu", "reference"),
                lambda: ort.register_execution_provider_library("npu", ephost.ort.library_path())):
    try:
        attempt()
        print("served")
    except Exception as e:
        print("refused:", e)
"""
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "EPHOST_CONFIG": str(tmp_path / "ephost.toml")})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("refused:") for line in lines), done.stdout
    assert all("ephost.ort needs ONNX Runtime 1.24 or newer" in line and "runs 1.23.2" in line for line in lines)
