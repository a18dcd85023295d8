"""What a registration name stands for where the application does not say it in Python: a TOML file named by the
environment variable EPHOST_CONFIG (read when ONNX Runtime asks the library for a name ephost.ort.register did not
bind: a C, C++ or C# application, or one that registered the library with ORT directly).

    [registrations.npu]
    target = "onnxruntime"             # what ephost.ort.register takes: an EP name, a plugin library, an address
    options = { timeout_s = "5" }      # optional: the options register takes (values become strings)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ephost.errors import EpInvalidArgument, EpNotFound

VARIABLE = "EPHOST_CONFIG"


@dataclass(frozen=True)
class Registration:
    name: str
    target: str
    options: dict[str, str]


def registration(name: str) -> Registration:
    """The registration the file names `name`; EpNotFound where there is no file or no such table in it,
    EpInvalidArgument where the file is not as above."""
    path = os.environ.get(VARIABLE, "")
    if not path:
        raise EpNotFound(f"{name!r} is not registered with ephost.ort: in Python, call ephost.ort.register({name!r}, "
                         f"target) before registering the library with ONNX Runtime; in any application, set "
                         f"{VARIABLE} to a TOML file with a [registrations.{name}] table naming its target")
    tables = read(Path(path))
    if name not in tables:
        raise EpNotFound(f"{VARIABLE} ({path}) has no [registrations.{name}] table (it has: "
                         f"{', '.join(sorted(tables)) or 'none'})")
    return tables[name]


def read(path: Path) -> dict[str, Registration]:
    """Every registration of the file."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        document = tomllib.loads(path.read_text())
    except OSError as e:
        raise EpInvalidArgument(f"{VARIABLE} names {path}, which cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise EpInvalidArgument(f"{VARIABLE} ({path}) is not valid TOML: {e}") from None
    unknown = sorted(set(document) - {"registrations"})
    if unknown:
        raise EpInvalidArgument(f"{VARIABLE} ({path}) has tables ephost does not read: {unknown} "
                                "(registrations go under [registrations.NAME])")
    tables = document.get("registrations", {})
    if not isinstance(tables, dict):
        raise EpInvalidArgument(f"{VARIABLE} ({path}): 'registrations' must be a table of [registrations.NAME]")
    return {name: _registration(path, name, table) for name, table in tables.items()}


def _registration(path: Path, name: str, table) -> Registration:
    where = f"{VARIABLE} ({path}), [registrations.{name}]"
    if not isinstance(table, dict):
        raise EpInvalidArgument(f"{where} must be a table")
    unknown = sorted(set(table) - {"target", "options"})
    if unknown:
        raise EpInvalidArgument(f"{where} has keys ephost does not read: {unknown} (it takes target and options)")
    target = table.get("target")
    if not isinstance(target, str) or not target:
        raise EpInvalidArgument(f"{where} needs target = \"...\" (an EP name, a plugin EP library path or a worker's "
                                "address)")
    options = table.get("options", {})
    if not isinstance(options, dict) or any(isinstance(v, (dict, list)) for v in options.values()):
        raise EpInvalidArgument(f"{where}: options must be a table of plain values")
    return Registration(name, target, {str(k): _text(v) for k, v in options.items()})


def _text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
