"""What the shim calls in a process where Python did not set its callbacks (shim.c): a C, C++ or C# application,
where the shim started Python itself, or a Python one that registered the library with ORT directly. Each returns
what went wrong in words ('' for nothing): the shim hands it to ORT as the error status of CreateEpFactories."""
from __future__ import annotations

import logging

from ephost.ort import callbacks
from ephost.ort.library import loaded_library

log = logging.getLogger(__name__)


def start(library_path: str) -> str:
    """Load the library ORT loaded (its callbacks set): each name ORT asks for then comes from EPHOST_CONFIG."""
    try:
        loaded_library(library_path)
        return ""
    except BaseException as e:  # noqa: BLE001 - the shim turns this into ORT's status
        return f"ephost.ort: {callbacks.describe(e)}"


def stop() -> None:
    """At the exit of a process whose Python the shim started (Python's own exit hooks do not run there): the
    library's end (callbacks.neuter_all, the workers closed)."""
    try:
        loaded_library().shutdown()
    except BaseException as e:  # noqa: BLE001
        log.debug("ephost.ort at exit: %s", e)
