"""Plugin library paths named by the package that ships them: `module:function` is resolved in the worker's
own environment (which the application may not share, so cannot know paths in), by importing the module
and calling the function, e.g. `onnxruntime_ggml:library_path` or `onnxruntime_ep_openvino:get_library_path`."""
from __future__ import annotations

import importlib
import os
import re
import sys

from ephost.errors import EpInvalidArgument, EpNotFound

_REFERENCE = re.compile(r"^(?P<module>[A-Za-z_][\w.]*):(?P<function>[A-Za-z_]\w*)$")


def resolve_library(value: str) -> str:
    """The library path `value` names: itself, or what its `module:function` returns."""
    match = _REFERENCE.match(value)
    if match is None or os.path.exists(value):
        return value
    module_name, function_name = match["module"], match["function"]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EpNotFound(f"cannot resolve library {value!r}: module {module_name!r} is not importable in the "
                         f"worker's environment ({sys.executable}): {e}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise EpNotFound(f"cannot resolve library {value!r}: module {module_name!r} has no function "
                         f"{function_name!r}")
    try:
        path = function()
    except Exception as e:
        raise EpInvalidArgument(f"cannot resolve library {value!r}: {module_name}.{function_name}() failed: "
                                f"{e}") from None
    if not isinstance(path, (str, os.PathLike)):
        raise EpInvalidArgument(f"cannot resolve library {value!r}: {module_name}.{function_name}() returned a "
                                f"{type(path).__name__}, not a path")
    return os.fspath(path)
