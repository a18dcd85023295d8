"""ephost.eps: EP implementations, found by name in the `ephost.eps` entry-point group."""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Mapping

from ephost.errors import EpInvalidArgument, EpNotFound

ENTRY_POINT_GROUP = "ephost.eps"


@functools.cache
def _registered() -> tuple:
    """The group's entry points, read once per process: reading them scans every installed distribution, and
    every session's CPU fallback loads its EPs by name."""
    return tuple(entry_points(group=ENTRY_POINT_GROUP))


def available_eps() -> list[str]:
    return sorted(ep.name for ep in _registered())


@dataclass(frozen=True)
class InstalledEp:
    """An EP of the group, as `ephost eps` lists it: its name, the distribution that brings it, what it is (its
    module's first line) and its options (name -> meaning, with its default), where its factory class names
    them (an `OPTIONS` attribute; None where it does not)."""

    name: str
    distribution: str
    summary: str
    options: Mapping[str, str] | None


def installed_eps() -> list[InstalledEp]:
    """The EPs of the `ephost.eps` group, by name; loading each factory class (not making a factory)."""
    out = []
    for ep in sorted(_registered(), key=lambda e: e.name):
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "?"
        try:
            cls = ep.load()
        except Exception as e:  # a third-party EP that does not import here: listed, with why
            out.append(InstalledEp(ep.name, dist, f"cannot be loaded here: {type(e).__name__}: {e}", None))
            continue
        module = sys.modules.get(cls.__module__)
        doc = (getattr(module, "__doc__", None) or cls.__doc__ or "").strip()
        first = doc.split("\n\n")[0].replace("\n", " ")
        out.append(InstalledEp(ep.name, dist, first.split(". ")[0].rstrip(".") + ".", getattr(cls, "OPTIONS", None)))
    return out


def load_factory(name: str, options: Mapping[str, str] | None = None, *, worker: bool = False):
    """Create the EP factory registered under `name` with its options. `worker`: this process is a worker, which
    hosts this EP alone: the factory class may first set up what is the process's (its `configure_worker()`, where
    it has one), as it must not in an application's process, whose libraries are set up by the application."""
    matches = [ep for ep in _registered() if ep.name == name]
    if not matches:
        raise EpNotFound(f"no EP named {name!r}; available: {', '.join(available_eps()) or 'none'}")
    factory_cls = matches[0].load()
    if worker and hasattr(factory_cls, "configure_worker"):
        factory_cls.configure_worker()
    return factory_cls(dict(options or {}))


def check_options(ep: str, options: Mapping[str, str], known: Mapping[str, str]) -> None:
    unknown = sorted(set(options) - set(known))
    if unknown:
        listing = "; ".join(f"{k}: {v}" for k, v in known.items()) or "none"
        raise EpInvalidArgument(f"unknown option(s) {unknown} for EP {ep!r}; it takes: {listing}")
