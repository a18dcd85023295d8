"""The README stays true: its first example runs as written, and it stays a short guide whose links lead somewhere."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
# Pages other streams of work write; a link to one of them may be there before the page is.
WRITTEN_ELSEWHERE = {"docs/operations.md", "docs/security.md", "docs/ort-api.md"}


def readme() -> str:
    with open(README) as f:
        return f.read()


def first_example() -> str:
    """The first Python block under the README's "A first example"."""
    text = readme()
    section = text[text.index("## A first example"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_first_example_runs_as_written(tmp_path):
    done = subprocess.run([sys.executable, "-c", first_example()], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    # Every node ran in the worker the example launched, and the output is the one the onnx package ships.
    assert "cpu CPUExecutionProvider 105 nodes" in done.stdout, done.stdout
    difference = float(re.search(r"largest difference to the expected output: (\S+)", done.stdout).group(1))
    assert difference < 1e-4


def test_the_readme_is_a_short_guide_with_the_two_commands():
    text = readme()
    assert len(text.splitlines()) <= 300
    assert "make run" in text and "make test" in text
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "nothing dated in the README"
    assert all(len(line) <= 120 for line in text.splitlines() if not line.startswith("|"))


def test_links_in_the_readme_and_docs_lead_to_files():
    pages = [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
    missing = []
    for page in pages:
        with open(page) as f:
            links = set(re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", f.read()))
        for link in links:
            path = os.path.normpath(os.path.join(os.path.dirname(page), link))
            if os.path.relpath(path, ROOT) not in WRITTEN_ELSEWHERE and not os.path.exists(path):
                missing.append(f"{os.path.relpath(page, ROOT)} -> {link}")
    assert not missing, f"links to files that do not exist: {missing}"
