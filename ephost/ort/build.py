"""The C shim ONNX Runtime loads (shim.c), built with the system C compiler on first use into a cache kept per
ephost version, ONNX Runtime version and source: `$EPHOST_CACHE_DIR/ort-shim/<key>/libephost_ort.so`."""
from __future__ import annotations

import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from ephost.errors import EpFailedPrecondition
from ephost.worker_env import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("shim.c")
LIBRARY_NAME = "libephost_ort.so"
COMPILERS = ("cc", "gcc", "clang")
_lock = threading.Lock()


def find_compiler() -> list[str]:
    """The C compiler command: $CC where set, else the first of cc, gcc, clang on PATH."""
    explicit = os.environ.get("CC")
    if explicit:
        command = shlex.split(explicit)
        if not command or shutil.which(command[0]) is None:
            raise EpFailedPrecondition(f"ephost.ort builds its ONNX Runtime shim with $CC={explicit!r}, "
                                       "which is not on PATH")
        return command
    for name in COMPILERS:
        if shutil.which(name):
            return [name]
    raise EpFailedPrecondition(
        f"ephost.ort builds its ONNX Runtime shim ({SOURCE.name}) with the system C compiler, and none of "
        f"{', '.join(COMPILERS)} is on PATH: install one (e.g. `apt-get install gcc`) or set CC")


def cache_key(ort_version: str) -> str:
    from ephost import __version__
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return f"ephost{__version__}-ort{ort_version}-{digest}"


def built_library(ort_version: str) -> Path:
    """The shim's path, compiled first where the cache has none for this key (the file appears whole: it is
    built beside and renamed into place, so concurrent first uses in other processes see it or build their own)."""
    target = cache_dir() / "ort-shim" / cache_key(ort_version) / LIBRARY_NAME
    with _lock:
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        compiler = find_compiler()
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
        os.close(fd)
        command = [*compiler, "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise EpFailedPrecondition(f"building ephost's ONNX Runtime shim failed ({' '.join(command[:1])} "
                                           f"exited {done.returncode}): {done.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.info("built the ONNX Runtime shim with %s", compiler[0])
        return target
