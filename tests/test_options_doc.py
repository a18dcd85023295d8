"""docs/options.md is made from the code's own definitions of every option (tools/options_doc.py): it must say what
the code says, so that a new option, or a changed default, changes the page."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_options_page_matches_the_code():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "options_doc.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_the_options_page_names_every_registration_option_with_its_default():
    from ephost.client.supervisor import SupervisionPolicy
    with open(os.path.join(ROOT, "docs", "options.md")) as f:
        page = f.read()
    for name in SupervisionPolicy.OPTIONS:
        assert f"| `{name}` |" in page, name
    assert "| `timeout_s` | 60 |" in page
    assert "| `--drain-grace-s DRAIN_GRACE_S` | 5 |" in page
