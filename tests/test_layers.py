"""The layers contract (pyproject.toml, [tool.importlinter]) holds: app/ (the ORT bridge, the command line, ONNX's
backend) over client/ and server/, which never import each other, over eps/, over ephost/'s shared core. It is
checked by import-linter's `lint-imports` over the package as it installs (each folder where pyproject's
package-dir puts it), and tests import the package by those names only."""
from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACT = "app over client | server over eps over the shared core"


def installed_tree(into: Path) -> int:
    """The package's modules laid out as a wheel installs them (pyproject's packages, each from its package-dir),
    with pyproject.toml beside them: grimp finds a package's modules under its own folder only, and in a checkout
    ephost.client's are not under ephost/. Returns how many modules."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    count = 0
    for package in setuptools["packages"]:
        source = ROOT / setuptools["package-dir"].get(package, package.replace(".", "/"))
        target = into.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for module in source.glob("*.py"):
            shutil.copy2(module, target / module.name)
            count += 1
    shutil.copy2(ROOT / "pyproject.toml", into / "pyproject.toml")
    return count


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=tree, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(tree)})


def test_the_layers_contract_is_kept_by_every_module(tmp_path):
    modules = installed_tree(tmp_path)
    done = lint_imports(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Analyzed {modules} files" in done.stdout and f"{CONTRACT} KEPT" in done.stdout, done.stdout


@pytest.mark.parametrize("module, line, broken", [
    # the shared core reaching up to a side
    ("ephost/types.py", "import ephost.client.session", "ephost.types is not allowed to import ephost.client"),
    # the two sides importing each other
    ("ephost/server/rpc.py", "from ephost.client import connection",
     "ephost.server is not allowed to import ephost.client"),
    # a lower layer importing the facade, which hands out the client's classes
    ("ephost/eps/base.py", "import ephost", "ephost.eps is not allowed to import ephost.client"),
    # a new module of ephost/ that no layer names
    ("ephost/newcomer.py", "", "ephost.newcomer"),
])
def test_the_contract_refuses_an_import_across_the_layers(tmp_path, module, line, broken):
    installed_tree(tmp_path)
    path = tmp_path / module
    path.write_text((path.read_text() if path.exists() else "") + f"\n{line}\n")
    done = lint_imports(tmp_path)
    assert done.returncode != 0 and f"{CONTRACT} BROKEN" in done.stdout and broken in done.stdout, done.stdout


# Folders of this checkout that install as parts of ephost: imported by their own names (`import client`, which
# works from the checkout's root), they would load second copies of ephost's modules.
PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
MAPPED = {"ephost", *(Path(folder).parts[0] for folder in PACKAGE_DIR.values())}


def test_tests_and_tools_import_ephost_by_its_installed_names():
    wrong, seen = [], set()
    for path in sorted([*ROOT.glob("tests/*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob("tools/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            wrong += [f"{where}: {name}" for name in names if name.split(".")[0] in MAPPED - {"ephost"}]
            # a module that moved leaves no name behind: an import of its old name fails only when that line runs
            seen.update((where, name) for name in names if name.split(".")[0] == "ephost")
    missing = [f"{where}: {name}" for where, name in sorted(seen) if importlib.util.find_spec(name) is None]
    assert "ephost" in MAPPED and "client" in MAPPED and not wrong, wrong
    assert len(seen) > 100 and not missing, missing
