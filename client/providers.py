"""What a session's `providers=` names, as ONNX Runtime code writes it (`providers=["CUDAExecutionProvider",
"CPUExecutionProvider"]`, names or (name, options), or names with `provider_options=`), and the names
get_providers() gives back.

A name is, in this order: the CPU fallback's own EP (ORT's "CPUExecutionProvider" where the fallback is ORT's CPU
EP: it is always there, last); a registration of the session's Environment; an ONNX Runtime execution provider
this installation has (run out of process: an onnxruntime worker launched with that provider, registered under
its name); a target (an EP of the ephost.eps entry points, an address...: registered under its own name). An ORT
EP this installation lacks is left out with ORT's warning, as ORT leaves it out. A worker launched for sessions is
shared by the sessions that name it, and unregistered when the last of them closes.
"""
from __future__ import annotations

import collections.abc
import functools
import importlib.util
import logging
import threading
import warnings
import weakref
from typing import Any, Mapping, Sequence

from ephost.errors import EpAlreadyExists, EpError, EpInvalidArgument, EpNotFound
from ephost.client.devices import EpDevice
from ephost.client.fallback import CpuFallback

log = logging.getLogger(__name__)

Entry = tuple[list[EpDevice], dict[str, str]]

# For each Environment, how many sessions hold each registration launched for sessions (not the application's own)
_held: "weakref.WeakKeyDictionary[Any, dict[str, int]]" = weakref.WeakKeyDictionary()
_held_lock = threading.Lock()  # guards _held, and each registration made or removed with its count


def normalized(providers: Any, provider_options: Any = None) -> list[tuple[str, dict[str, str]]]:
    """(name, options) pairs, checked as ORT checks them (check_and_normalize_provider_args): a name given twice
    is kept once, with ORT's warning."""
    if providers is None:
        return []
    if isinstance(providers, str) or not isinstance(providers, collections.abc.Sequence):
        raise EpInvalidArgument("'providers' should be a sequence.")
    pairs: list[tuple[Any, Any]]
    if provider_options is not None:
        if isinstance(provider_options, str) or not isinstance(provider_options, collections.abc.Sequence):
            raise EpInvalidArgument("'provider_options' should be a sequence.")
        if len(providers) != len(provider_options):
            raise EpInvalidArgument("'providers' and 'provider_options' should be the same length if both are given.")
        if not all(isinstance(p, str) for p in providers):
            raise EpInvalidArgument("Only string values for 'providers' are supported if 'provider_options' is "
                                    "given.")
        if not all(isinstance(o, Mapping) for o in provider_options):
            raise EpInvalidArgument("'provider_options' values must be dicts.")
        pairs = list(zip(providers, provider_options))
    else:
        pairs = []
        for p in providers:
            if isinstance(p, str):
                pairs.append((p, {}))
            elif isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], Mapping):
                pairs.append(p)
            else:
                raise EpInvalidArgument("'providers' values must be either strings or (string, dict) tuples.")
    out: dict[str, dict[str, str]] = {}
    for name, options in pairs:
        if name in out:
            warnings.warn(f"Duplicate provider '{name}' encountered, ignoring.")
            continue
        out[name] = {str(k): str(v) for k, v in options.items()}
    return list(out.items())


@functools.lru_cache(maxsize=1)
def ort_providers() -> tuple[frozenset[str], frozenset[str]]:
    """(every EP name ONNX Runtime knows, those this installation has); empty where ORT is not installed."""
    if importlib.util.find_spec("onnxruntime") is None:
        return frozenset(), frozenset()
    import onnxruntime
    return frozenset(onnxruntime.get_all_providers()), frozenset(onnxruntime.get_available_providers())


def provider_entries(env, providers: Sequence[tuple[str, Mapping[str, str]]],
                     fallback: CpuFallback) -> tuple[list[Entry], list[str]]:
    """The session's EPs for these names (see the module's docstring), and the names registered for it here."""
    entries: list[Entry] = []
    launched: list[str] = []
    try:
        for name, options in providers:
            if name == fallback.cpu_ep_name:
                continue  # the fallback, always last
            if not _hold(env, name, launched):
                continue
            devices = [d for d in env.get_ep_devices() if d.registration_name == name]
            entries.append((devices, dict(options)))
    except BaseException:
        for name in launched:
            release(env, name)
        raise
    return entries, launched


def _hold(env, name: str, launched: list[str]) -> bool:
    """Make `name` usable by a session: the application's registration as it is, or one launched for sessions
    (counted, and added to `launched`: the session gives it back with release()). False where it is an ORT EP this
    installation lacks (left out)."""
    with _held_lock:
        counts = _held.setdefault(env, {})
        if counts.get(name):
            counts[name] += 1
            launched.append(name)
            return True
        if env.is_registered(name):
            return True
        try:
            if not _register(env, name):
                return False
        except EpAlreadyExists:  # the application registered it meanwhile: its own, used as it is
            return True
        counts[name] = 1
        launched.append(name)
        return True


def release(env, name: str) -> None:
    """A session is done with a registration _hold launched: unregistered once no session holds it."""
    with _held_lock:
        counts = _held.get(env, {})
        counts[name] = counts.get(name, 1) - 1
        if counts[name] > 0:
            return
        del counts[name]
        try:
            env.unregister_execution_provider_library(name)
        except EpError as e:
            log.debug("unregistering %s: %s", name, e)


def _register(env, name: str) -> bool:
    """Register `name`; False where it is an ORT EP this installation lacks (left out)."""
    known, available = ort_providers()
    if name in known and name not in available:
        warnings.warn(f"Specified provider '{name}' is not in available provider names.Available providers: "
                      f"'{', '.join(sorted(available))}'")
        return False
    target, options = ("onnxruntime", {"provider": name}) if name in available else (name, {})
    try:
        env.register_execution_provider_library(name, target, options)
    except EpNotFound as e:
        raise EpNotFound(f"Unknown Provider Type: {name} (not a registration of the Environment, an ONNX Runtime "
                         f"execution provider, nor an EP or address ephost can launch or reach: {e})") from None
    return True


def provider_names(entries: Sequence[Entry], fallback: CpuFallback, partitions) -> list[str]:
    """get_providers(): the session's EPs by name, in order of preference, then the fallback's: its first EP
    always (ORT lists its CPU EP last whatever it runs), the others only while they run a partition."""
    names = [devices[0].ep_name for devices, _ in entries if devices]
    running = {p.placement.ep_name for p in partitions if fallback.owns(p.placement)}
    names += [n for i, n in enumerate(fallback.ep_names) if i == 0 or n in running]
    return list(dict.fromkeys(names))


def session_entries(env, options, providers: Sequence[tuple[str, Mapping[str, str]]], fallback: CpuFallback,
                    model) -> tuple[list[Entry], list[str]]:
    """A new session's EPs: those its options add by device (add_provider_for_devices), then by name
    (add_provider, then `providers=`); where none is given at all, those its selection policy picks among the
    Environment's devices. Also the names registered for it."""
    named = [*options.named_providers, *providers]
    entries, launched = provider_entries(env, named, fallback)
    entries = options.providers + entries
    if not entries and not named and options.selection_policy is not None:
        entries = options.selection_policy.select(env.get_ep_devices(), model)
    return entries, launched
