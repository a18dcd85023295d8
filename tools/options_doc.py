"""Writes docs/options.md from the code's own definitions of every option: a registration's (supervision,
connection, a worker's environment, each installed EP's), a shared allocator's, a session's, a run's and the
`ephost` command's (the worker's flags among them). The page is never edited by hand.

    python tools/options_doc.py           # write docs/options.md
    python tools/options_doc.py --check   # exit 1, with a diff, where docs/options.md no longer matches the code

A test in `make test` runs --check, so that the page changes with the code.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import importlib
import os
import re
import sys
import textwrap
from typing import Any, Iterable, Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "options.md")
_DEFAULT = re.compile(r"\(default:? ([^;)]*)")

Row = tuple[str, str, str]  # option, default, meaning
# (title, what it is, [(what the table holds, its rows)])
Section = tuple[str, str, list[tuple[str, list[Row]]]]


def _shown(value: Any) -> str:
    """A default as a reader would type it."""
    if value is None or value == () or value == "" or value == [] or value == argparse.SUPPRESS:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _from_text(meaning: str) -> str:
    """The default a meaning states ("... (default 60)"), where the code keeps it only in words."""
    found = _DEFAULT.search(meaning)
    return found.group(1).strip() if found else "none"


def declared(options: Mapping[str, str], defaults: Any = None) -> list[Row]:
    """Rows of an OPTIONS table (name -> meaning); defaults from the dataclass that owns them where there is one."""
    fields = {f.name: f for f in dataclasses.fields(defaults)} if dataclasses.is_dataclass(defaults) else {}
    rows = []
    for name, meaning in options.items():
        field = fields.get(name)
        if field is not None and field.default is not dataclasses.MISSING:
            default = _shown(field.default)
        else:
            default = _from_text(meaning)
        rows.append((name, default, meaning))
    return rows


def _table(rows: Iterable[Row]) -> str:
    lines = ["| option | default | meaning |", "|---|---|---|"]
    for name, default, meaning in rows:
        meaning = " ".join(meaning.split()).replace("|", "\\|")
        lines.append(f"| `{name}` | {default.replace('|', chr(92) + '|')} | {meaning} |")
    return "\n".join(lines)


def _first_paragraph(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


# --- the sections ---------------------------------------------------------------------------------------

def registration_sections() -> list[Section]:
    from ephost.client.connection import Credentials
    from ephost.client.supervisor import SupervisionPolicy
    from ephost.worker_env import WorkerEnvironment
    return [
        ("Supervision and connection",
         "Taken by the Environment for any target, never passed to the EP (`client/supervisor.py`, "
         "`SupervisionPolicy`; `client/connection.py`, `Credentials`).",
         [("", declared(SupervisionPolicy.OPTIONS, SupervisionPolicy) + declared(Credentials.OPTIONS, Credentials))]),
        ("A launched worker's environment",
         "Taken by the launcher, never passed to the EP (`ephost/worker_env.py`, `WorkerEnvironment`): "
         "[worker-environments.md](worker-environments.md).",
         [("", declared(WorkerEnvironment.OPTIONS, WorkerEnvironment))]),
    ]


def _ep_tables() -> list[tuple[str, Mapping[str, str] | None, Mapping[str, str] | None, str]]:
    """(name, registration options, provider options, what it is) of each EP of the `ephost.eps` group."""
    from importlib.metadata import entry_points
    out = []
    for ep in sorted(entry_points(group="ephost.eps"), key=lambda e: e.name):
        factory = ep.load()
        module = sys.modules[factory.__module__]
        options = getattr(factory, "OPTIONS", None)
        if options is None:
            options = getattr(module, "OPTIONS", None)
        provider = getattr(module, "PROVIDER_OPTIONS", None)
        what = _first_paragraph(module.__doc__).split(". ")[0].rstrip(".")
        out.append((ep.name, options, provider, what))
    return out


def ep_sections() -> list[Section]:
    sections = []
    for name, options, provider, what in _ep_tables():
        tables = []
        if options:
            tables.append(("Registration options, given to `register_execution_provider_library` (or `ephost worker "
                           "--option`):", declared(options)))
        if provider:
            tables.append(("Provider options, given to `SessionOptions.add_provider_for_devices(devices, options)` "
                           "(they reach the EP with CreateEp):", declared(provider)))
        if not tables:
            tables.append(("It takes no options.", []))
        sections.append((f"The `{name}` EP", f"{what}." if what else "", tables))
    return sections


def allocator_sections() -> list[Section]:
    from ephost.eps import arena
    return [("Shared allocators",
             "Given to `Environment.create_shared_allocator(device, mem_type, options)`: ONNX Runtime's arena keys "
             "(`eps/arena.py`), for the EPs whose allocators are ephost's arena.", [("", declared(arena.OPTIONS))])]


def session_sections() -> list[Section]:
    from ephost.client.session_options import SessionOptions
    instance = SessionOptions()
    meanings = getattr(SessionOptions, "OPTIONS", {})
    names = [n for n in vars(instance) if not n.startswith("_")]
    missing = [n for n in names if n not in meanings]
    if missing:
        raise SystemExit(f"SessionOptions attributes without a meaning in SessionOptions.OPTIONS: {missing}")
    rows = [(n, _shown(getattr(instance, n)), meanings[n]) for n in names]
    try:
        settings = importlib.import_module("ephost.session_config").SETTINGS
    except ModuleNotFoundError:
        settings = {}
    rows += [(n, _shown(s.default), meanings.get(n, f"ONNX Runtime's `SessionOptions.{n}`, passed to every EP of "
                                                    "the session (the onnxruntime EP runs its sessions by it)"))
             for n, s in settings.items()]
    from ephost import ep_context
    entries = [(ep_context.ENABLE, "0", "1: after compiling, write the model with each partition an EP compiled as "
                                        "an EPContext node ([ep-context.md](ep-context.md))"),
               (ep_context.FILE_PATH, "MODEL_ctx.onnx beside the model", "where the context model goes"),
               (ep_context.EMBED_MODE, "0", "1: the compiled forms inside the context model; 0: each in a file "
                                           "beside it")]
    return [("Session options",
             f"Attributes of `ephost.SessionOptions` (`client/session_options.py`). "
             f"{_first_paragraph(SessionOptions.__doc__)}", [("", rows)]),
            ("Session config entries ephost acts on",
             "`SessionOptions.add_session_config_entry(key, value)`, by ONNX Runtime's names (`ephost/ep_context.py`). "
             "Other entries go to the EPs.", [("", entries)])]


def run_sections() -> list[Section]:
    from ephost.run_options import RunOptions
    meanings = getattr(RunOptions, "OPTIONS", {})
    rows = [(f.name, _shown(f.default) if f.default is not dataclasses.MISSING else "none", meanings.get(f.name, ""))
            for f in dataclasses.fields(RunOptions) if f.repr and f.name in meanings]
    return [("Run options",
             f"Attributes of `ephost.RunOptions` (`ephost/run_options.py`), or of ONNX Runtime's own RunOptions. "
             f"{_first_paragraph(RunOptions.__doc__)}", [("", rows)])] if rows else []


def command_parser() -> argparse.ArgumentParser:
    """The `ephost` command's parser, as its main() builds it."""
    from ephost import cli
    return cli.build_parser()


def _flags(parser: argparse.ArgumentParser) -> list[Row]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or not action.option_strings:
            continue
        name = ", ".join(action.option_strings)
        if action.metavar or action.nargs != 0:
            name += f" {action.metavar or action.dest.upper()}"
        default = action.default
        shown = _from_text(action.help or "") if default in (None, False) else _shown(default)
        if isinstance(action, argparse._StoreTrueAction):
            shown = "off"
        help_text = (action.help or "") % {"default": default} if "%(" in (action.help or "") else action.help or ""
        rows.append((name, shown, help_text))
    return rows


def _subcommands(parser: argparse.ArgumentParser) -> tuple[dict[str, argparse.ArgumentParser], dict[str, str]]:
    """The commands' parsers, and the help line of each."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices), {a.dest: a.help or "" for a in action._choices_actions}
    return {}, {}


def _command(name: str, parser: argparse.ArgumentParser, help_line: str) -> list[Section]:
    """The sections of one command, and of its own commands (`ephost env create`...)."""
    what = _first_paragraph(parser.description) or help_line
    what = what[:1].upper() + what[1:] + ("" if what.endswith((".", ")")) or not what else ".")
    rows = _flags(parser)
    sections = [(f"`ephost {name}`", what, [("", rows)] if rows else [])]
    commands, helps = _subcommands(parser)
    for sub, sub_parser in commands.items():
        sections += _command(f"{name} {sub}", sub_parser, helps.get(sub, ""))
    return sections


def command_sections() -> list[Section]:
    parser = command_parser()
    sections = [("`ephost` (every command)", "Given before the command: `ephost --log-level INFO worker ...`.",
                 [("", _flags(parser))])]
    commands, helps = _subcommands(parser)
    for name, sub in commands.items():
        sections += _command(name, sub, helps.get(name, ""))
    return sections


def _prose(text: str) -> list[str]:
    return textwrap.wrap(text, 120, break_long_words=False, break_on_hyphens=False)


def page() -> str:
    parts = ["# Options", ""]
    parts += _prose("Every option ephost takes, with its default and meaning, as the code defines them. This page is "
                    "generated by `python tools/options_doc.py` (`make docs`), and a test fails when it no longer "
                    "matches the code: change the code's definitions, then run it. Registration options are strings: "
                    "`register_execution_provider_library(name, target, {\"timeout_s\": \"30\"})`.")
    groups = [("Registration options", registration_sections() + ep_sections()),
              ("Allocator options", allocator_sections()),
              ("Session and run options", session_sections() + run_sections()),
              ("The command line", command_sections())]
    for group, sections in groups:
        parts += ["", f"## {group}"]
        for title, intro, tables in sections:
            parts += ["", f"### {title}"]
            if intro:
                parts += [""] + _prose(intro)
            for caption, rows in tables:
                if caption:
                    parts += [""] + _prose(caption)
                if rows:
                    parts += ["", _table(rows)]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--check", action="store_true", help="compare instead of writing")
    check = args.parse_args(argv).check
    text = page()
    if check:
        with open(PAGE) as f:
            current = f.read()
        if current != text:
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                       "docs/options.md", "from the code"))
            print("docs/options.md no longer matches the code: run `python tools/options_doc.py` (make docs)")
            return 1
        return 0
    with open(PAGE, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
