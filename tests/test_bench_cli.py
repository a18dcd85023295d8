"""`make bench` runs `python -m bench` with no argument: every bench; a name picks some, an unknown one is an
error that says what there is."""
import subprocess
import sys

import pytest

from bench.__main__ import BENCHES, parse_args


def test_no_argument_means_every_bench_and_names_pick_some():
    assert parse_args([]).which == []
    assert parse_args(["--quick", "copy", "dataplane"]).which == ["copy", "dataplane"]


def test_an_unknown_bench_is_an_error_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["nosuch"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no bench nosuch" in err and all(name in err for name, _ in BENCHES)


def test_the_command_line_parses_as_make_bench_calls_it():
    out = subprocess.run([sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "dataplane" in out.stdout
