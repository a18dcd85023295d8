"""What the `ephost` command prints reads as plain text: help without Markdown, op counts a reader can read."""
from __future__ import annotations

import re
import subprocess
import sys

import onnx

import models

# Prints every command's --help, one after another, from one process.
HELP_OF_EVERY_COMMAND = """
import argparse, contextlib, io, sys
from ephost import cli
commands = [[]]
def walk(parser, path):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                commands.append(path + [name])
                walk(sub, path + [name])
original = argparse.ArgumentParser.parse_args
def capture(self, *args, **kwargs):
    walk(self, [])
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = capture
try:
    cli.main([])
except SystemExit:
    pass
argparse.ArgumentParser.parse_args = original
for command in commands:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cli.main([*command, "--help"])
        except SystemExit:
            pass
    print("=== ephost", " ".join(command))
    print(out.getvalue())
"""


def test_help_is_plain_text():
    done = subprocess.run([sys.executable, "-c", HELP_OF_EVERY_COMMAND], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    helps = done.stdout.split("=== ephost")[1:]
    assert len(helps) >= 10 and any("--drain-grace-s" in h for h in helps)
    marked = [h.splitlines()[0] for h in helps if "`" in h]
    assert not marked, f"Markdown backticks in the help of: {marked}"


def test_run_counts_each_op_apart_from_its_name(tmp_path):
    onnx.save(models.chain(["Relu", "Neg", "Relu"]), tmp_path / "chain.onnx")
    done = subprocess.run([sys.executable, "-m", "ephost", "run", str(tmp_path / "chain.onnx"), "--ep", "reference",
                           "--runs", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("0 "))
    assert row.endswith("Relu x2, Neg x1"), row
    assert done.stdout.count("model: ") == 1
