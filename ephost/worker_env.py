"""A worker's own Python environment: the interpreter a launched worker runs under.

A registration may name an interpreter (`python`) or pip requirements (`requirements`). For requirements,
ephost makes a virtual environment once, keyed by their content, under the cache directory
(`$EPHOST_CACHE_DIR`, default `$XDG_CACHE_HOME/ephost` or `~/.cache/ephost`): it installs this very ephost
(the same code: an editable source checkout is installed editable from the same folder) and the
requirements in one pip run, so that a vendor EP pinning another ONNX Runtime than the application's lives
beside it. Creation holds a lock, so that processes making the same environment at once make it once; an
environment counts as made only when its record is written last, so a half-made one (a creation that was
killed, or failed) is never used: the next creation starts it again.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ephost.errors import EpInvalidArgument, EpNotFound, EpWorkerEnvironmentFailed
from ephost.progress import Progress

log = logging.getLogger(__name__)

RECORD = "environment.json"  # written last: its presence is what makes an environment made
PIP_LOG = "pip.log"
_TRUE = ("1", "true", "yes")
# pip's lines that say how far it has come, shown while an environment is made
_PROGRESS = re.compile(r"^(Collecting|Downloading|Obtaining|Building|Installing|Successfully)\b")


def cache_dir() -> Path:
    """Where environments are kept: $EPHOST_CACHE_DIR, else the user's cache directory."""
    explicit = os.environ.get("EPHOST_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ephost"


def _split(value: str) -> tuple[str, ...]:
    """One item a line (requirement specifiers hold spaces and commas, never newlines)."""
    return tuple(line.strip() for line in value.splitlines() if line.strip())


@dataclass(frozen=True)
class EphostSource:
    """How this process's ephost is installed into another environment, and what identifies that code."""

    pip_args: tuple[str, ...]
    identity: str

    @classmethod
    def current(cls) -> "EphostSource":
        root = Path(__file__).resolve().parent.parent  # ephost/'s parent (not the facade: this is a lower layer)
        pyproject = root / "pyproject.toml"
        if pyproject.is_file() and re.search(r'(?m)^name\s*=\s*"ephost"', pyproject.read_text()):
            # A source checkout (what this process imports ephost from): the environment imports the very same
            # files; its dependencies are what this checkout's metadata says.
            digest = hashlib.sha256(pyproject.read_bytes()).hexdigest()
            return cls(("-e", str(root)), json.dumps(["checkout", str(root), digest]))
        dist = importlib.metadata.distribution("ephost")
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        url = direct.get("url", "")
        if url.startswith("file://"):  # installed from a local folder or file: the same again
            path = urllib.parse.unquote(urllib.parse.urlparse(url).path)
            return cls((path,), json.dumps(["local", path, dist.version]))
        return cls((f"ephost=={dist.version}",), json.dumps(["index", dist.version]))


@dataclass(frozen=True)
class EnvironmentRecord:
    """What `environment.json` says of a made environment."""

    key: str
    requirements: list[str]
    base_python: str
    python: str            # the environment's own interpreter
    ephost: list[str]      # how ephost was installed into it
    created_at: float
    path: str = ""
    packages: dict[str, str] = field(default_factory=dict)  # name -> version of what pip installed

    @classmethod
    def read(cls, directory: Path) -> "EnvironmentRecord | None":
        try:
            data = json.loads((directory / RECORD).read_text())
        except (OSError, ValueError):
            return None
        known = set(cls.__dataclass_fields__)
        return cls(**{**{k: v for k, v in data.items() if k in known}, "path": str(directory)})


@dataclass(frozen=True)
class WorkerEnvironment:
    """A registration's environment options (taken out of its options, like SupervisionPolicy's)."""

    python: str | None = None
    requirements: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    no_index: bool = False

    OPTIONS = {
        "python": "interpreter to launch the worker with; its environment must hold ephost and the EP's packages "
                  "(with requirements: the interpreter their virtual environment is made from)",
        "requirements": "pip requirement specifiers, one a line: the worker runs in a virtual environment made "
                        "(once, cached by content) with them and ephost",
        "find_links": "folders or URLs of wheels for pip (--find-links), one a line",
        "no_index": "true: pip uses no package index, only find_links (an offline machine)",
    }

    @classmethod
    def take(cls, options: dict[str, str]) -> "WorkerEnvironment":
        """The environment from (and without) its keys in a registration's options."""
        mine = {k: options.pop(k) for k in list(options) if k in cls.OPTIONS}
        return cls(python=mine.get("python") or None, requirements=_split(mine.get("requirements", "")),
                   find_links=_split(mine.get("find_links", "")),
                   no_index=mine.get("no_index", "").lower() in _TRUE)

    @property
    def is_default(self) -> bool:
        return self.python is None and not self.requirements

    def base_python(self) -> str:
        python = self.python or sys.executable
        resolved = shutil.which(python)
        if resolved is None or not os.access(resolved, os.X_OK):
            raise EpNotFound(f"no Python interpreter at {python!r} to run the worker with")
        return os.path.abspath(resolved)

    def key(self, source: EphostSource | None = None) -> str:
        """The environment's name in the cache: a hash of what is in it (requirements, the base interpreter,
        ephost's code), not of where its packages come from, so one prepared offline is the one used later."""
        source = source or EphostSource.current()
        content = json.dumps([sorted(self.requirements), os.path.realpath(self.base_python()), source.identity])
        return hashlib.sha256(content.encode()).hexdigest()[:16]

    def interpreter(self, cache: Path | None = None) -> str:
        """The interpreter to launch a worker with, making its environment first where it is not made yet."""
        if not self.requirements:
            return self.base_python() if self.python else sys.executable
        return self.create(cache).python

    # --- making one -------------------------------------------------------------------------------

    def create(self, cache: Path | None = None) -> EnvironmentRecord:
        """The environment for these requirements, made once; concurrent callers wait for the one making it."""
        source = EphostSource.current()
        key = self.key(source)
        envs = (cache or cache_dir()) / "envs"
        envs.mkdir(parents=True, exist_ok=True)
        directory = envs / key
        with _locked(envs / f"{key}.lock", key):
            record = EnvironmentRecord.read(directory)
            if record is not None:
                if os.access(record.python, os.X_OK):
                    log.debug("worker environment %s is made already (%s)", key, directory)
                    return record
                raise EpNotFound(f"worker environment {key} lost its interpreter {record.python} (was its base "
                                 f"Python removed?); remove it with `ephost env remove {key}`")
            return self._make(directory, key, source)

    def _make(self, directory: Path, key: str, source: EphostSource) -> EnvironmentRecord:
        venv = directory / "venv"
        if directory.exists():
            log.info("worker environment %s was left half-made; making it again", key)
            shutil.rmtree(venv, ignore_errors=True)
        directory.mkdir(exist_ok=True)
        pip_log = directory / PIP_LOG
        base = self.base_python()
        started = time.monotonic()
        log.info("making worker environment %s for %s in %s", key, ", ".join(self.requirements), directory)
        progress = Progress(f"making worker environment {key}")
        with open(pip_log, "w") as out:
            self._run([base, "-m", "venv", str(venv)], out, "create the virtual environment", pip_log, venv,
                      progress)
            python = str(venv / "bin" / "python")
            index = [a for link in self.find_links for a in ("--find-links", link)]
            index += ["--no-index"] if self.no_index else []
            self._run([python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
                       "--progress-bar", "off", *index, *source.pip_args, *self.requirements],
                      out, "install " + ", ".join(self.requirements), pip_log, venv, progress)
            packages = self._packages(python)
        record = EnvironmentRecord(key, list(self.requirements), base, python, list(source.pip_args), time.time(),
                                   str(directory), packages)
        temporary = directory / (RECORD + ".tmp")
        temporary.write_text(json.dumps(asdict(record), indent=1))
        os.replace(temporary, directory / RECORD)  # made: from here on it is used
        progress.finish()
        log.info("worker environment %s made in %.0f s", key, time.monotonic() - started)
        return record

    def _run(self, command: list[str], out, what: str, pip_log: Path, venv: Path, progress: Progress) -> None:
        """Run one step, its output into the log file and its progress lines into `progress`."""
        errors: list[str] = []
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              text=True, env={**os.environ, "PIP_NO_INPUT": "1"}) as proc:
            for line in proc.stdout:
                out.write(line)
                line = line.rstrip()
                if _PROGRESS.match(line):
                    progress.note(line)
                elif line.startswith("ERROR:") or errors:
                    errors.append(line)
            code = proc.wait()
        out.flush()
        if code != 0:
            shutil.rmtree(venv, ignore_errors=True)  # never used half-made; the log stays
            said = "; ".join(e for e in errors if e.strip())[:2000] or f"exit code {code}"
            raise EpWorkerEnvironmentFailed(
                f"could not {what} for a worker environment: {said} (pip's full output: {pip_log})",
                requirements=self.requirements, log_path=str(pip_log))

    @staticmethod
    def _packages(python: str) -> dict[str, str]:
        """What is installed, for `ephost env list` (ONNX Runtime's version above all)."""
        script = "import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: d.version " \
                 "for d in m.distributions()}))"
        try:
            return json.loads(subprocess.run([python, "-c", script], capture_output=True, text=True,
                                             check=True, timeout=60).stdout)
        except (subprocess.SubprocessError, ValueError):
            return {}


class _locked:
    """An exclusive lock on a file (flock: released by the kernel when its holder dies)."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = path, key

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("worker environment %s is being made by another process; waiting for it", self.key)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def list_environments(cache: Path | None = None) -> list[EnvironmentRecord]:
    """The made environments in the cache, oldest first."""
    envs = (cache or cache_dir()) / "envs"
    records = [EnvironmentRecord.read(d) for d in envs.iterdir() if d.is_dir()] if envs.is_dir() else []
    return sorted((r for r in records if r is not None), key=lambda r: r.created_at)


def remove_environment(key: str, cache: Path | None = None) -> None:
    """Remove one environment (waiting for a creation of it under way). Workers running in it are not stopped."""
    if not re.fullmatch(r"[0-9a-f]{16}", key):
        raise EpInvalidArgument(f"{key!r} is not an environment key (`ephost env list` shows them)")
    envs = (cache or cache_dir()) / "envs"
    directory = envs / key
    if not directory.is_dir():
        raise EpNotFound(f"no worker environment {key} in {envs}")
    with _locked(envs / f"{key}.lock", key):
        # The record goes first, so that an interrupted removal leaves a half-made environment, never a broken one.
        (directory / RECORD).unlink(missing_ok=True)
        shutil.rmtree(directory, ignore_errors=True)
    # The lock file stays: a process waiting on it holds it open, and a new one would not exclude it.
