"""ephost.eps: EP implementations, found by name in the `ephost.eps` entry-point group."""
from __future__ import annotations

import functools
from importlib.metadata import entry_points
from typing import Mapping

from ephost.errors import EpInvalidArgument, EpNotFound

ENTRY_POINT_GROUP = "ephost.eps"


@functools.cache
def _registered() -> tuple:
    """The group's entry points, read once per process: reading them scans every installed distribution (about
    15 ms here), and every session's CPU fallback loads its EPs by name."""
    return tuple(entry_points(group=ENTRY_POINT_GROUP))


def available_eps() -> list[str]:
    return sorted(ep.name for ep in _registered())


def load_factory(name: str, options: Mapping[str, str] | None = None):
    """Create the EP factory registered under `name` with its options."""
    matches = [ep for ep in _registered() if ep.name == name]
    if not matches:
        raise EpNotFound(f"no EP named {name!r}; available: {', '.join(available_eps()) or 'none'}")
    factory_cls = matches[0].load()
    return factory_cls(dict(options or {}))


def check_options(ep: str, options: Mapping[str, str], known: Mapping[str, str]) -> None:
    unknown = sorted(set(options) - set(known))
    if unknown:
        listing = "; ".join(f"{k}: {v}" for k, v in known.items()) or "none"
        raise EpInvalidArgument(f"unknown option(s) {unknown} for EP {ep!r}; it takes: {listing}")
