"""The plugin EP library ONNX Runtime loads (libephost_ort.so beside this file), built from shim.c when the package is
built (setup.py): an installed ephost needs no compiler. In a checkout, `pip install -e .` (or `make`) builds it."""
from __future__ import annotations

import ctypes
import hashlib
from pathlib import Path

from ephost.errors import EpFailedPrecondition

SOURCE = Path(__file__).with_name("shim.c")
LIBRARY = Path(__file__).with_name("libephost_ort.so")
DIGEST_LENGTH = 16  # hex digits of shim.c's SHA-256 the library carries (setup.py puts them there)


def built_library() -> Path:
    """The library's path, checked to be built from the shim.c beside it (a checkout's library can be older than its
    source: `pip install -e .` builds it again)."""
    if not LIBRARY.is_file():
        raise EpFailedPrecondition(
            f"ephost's ONNX Runtime plugin library is not built ({LIBRARY} is missing): it is compiled when ephost is "
            "installed; install ephost with pip (in a checkout: pip install -e .)")
    if SOURCE.is_file():
        built = (ctypes.c_char * (DIGEST_LENGTH + 1)).in_dll(ctypes.CDLL(str(LIBRARY)), "ephost_shim_digest").value
        if built.decode() != source_digest():
            raise EpFailedPrecondition(f"{LIBRARY} was built from another shim.c than the one beside it: reinstall "
                                       "ephost (in a checkout: pip install -e .) to build it again")
    return LIBRARY


def source_digest() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:DIGEST_LENGTH]
