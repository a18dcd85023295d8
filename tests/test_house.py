"""The house rules a reader relies on, checked over the source: lines within 120 characters, comments and
docstrings of the code that runs free of dates and timings (those belong in commit messages and bench/RESULTS.md),
every module saying what it holds, and every lock saying what it guards where it is declared."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The code that runs: the package's folders (pyproject's package-dir) and the build script
RUNTIME = ["ephost", "client", "server", "eps", "app"]
WRITTEN = [*RUNTIME, "tests", "bench", "tools"]
GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")

# A date, a time figure (3 µs, 20 ms, 1.5us, about a microsecond), a speed-up: what a lab notebook holds
NOTEBOOK = re.compile(r"\b20\d\d-\d\d\b|\d\s?(µs|us|ms|ns)\b|µs|\b(about|a|one|\d+) (micro|milli|nano)seconds?\b"
                      r"|\d(\.\d+)?\s?x (faster|slower)\b")
LOCK = re.compile(r"threading\.(Lock|RLock|Condition|Semaphore|BoundedSemaphore)\(")


def files(folders, *patterns):
    found = [path for folder in folders for pattern in patterns for path in sorted((ROOT / folder).rglob(pattern))]
    return [path for path in found if not GENERATED.search(path.name) and "__pycache__" not in path.parts]


def prose(path: Path):
    """(line number, text) of every comment and docstring of a Python module, or comment of a C file."""
    text = path.read_text()
    if path.suffix == ".c":
        for match in re.finditer(r"/\*.*?\*/|//[^\n]*", text, re.S):
            first = text.count("\n", 0, match.start()) + 1
            yield from ((first + i, line) for i, line in enumerate(match.group(0).splitlines()))
        return
    before = None
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        docstring = token.type == tokenize.STRING and token.string.startswith(('"""', "'''")) and \
            (before is None or before.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE))
        if token.type == tokenize.COMMENT or docstring:
            yield from ((token.start[0] + i, line) for i, line in enumerate(token.string.splitlines()))
        if token.type not in (tokenize.NL, tokenize.COMMENT):
            before = token


def test_every_line_of_code_is_within_120_characters():
    paths = [*files(WRITTEN, "*.py", "*.c"), ROOT / "setup.py", ROOT / "pyproject.toml", ROOT / "Makefile"]
    long = [f"{path.relative_to(ROOT)}:{n}" for path in paths
            for n, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 120]
    assert len(paths) > 100 and not long, long


def test_comments_and_docstrings_of_the_code_hold_no_dates_or_timings():
    paths = [*files(RUNTIME, "*.py", "*.c"), ROOT / "setup.py"]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in paths
             for n, line in prose(path) if NOTEBOOK.search(line)]
    assert any(path.suffix == ".c" for path in paths) and not found, found


def test_every_lock_says_what_it_guards_where_it_is_declared():
    unsaid = []
    for path in files(WRITTEN, "*.py"):
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            if LOCK.search(line) and "guards" not in line and "guards" not in (lines[n - 1] if n else ""):
                unsaid.append(f"{path.relative_to(ROOT)}:{n + 1}: {line.strip()}")
    assert not unsaid, unsaid


def test_every_module_of_the_code_says_what_it_holds():
    paths = files(RUNTIME, "*.py")
    unsaid = [str(path.relative_to(ROOT)) for path in paths if not ast.get_docstring(ast.parse(path.read_text()))]
    assert len(paths) > 100 and not unsaid, unsaid
