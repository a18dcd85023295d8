"""The application's Prometheus metrics, per registration (an EP, by the name it was registered under): runs and
their latency, what the failure policy did (failures, retries, fallbacks, calls made again), and its worker's
state, restarts and crashes. Off until `ephost.start_metrics_server(port)` (or `register_metrics(registry)` into a
registry the application serves already): until then runs are left as they are. Figures are kept per
registration name, over every Environment of the process. docs/operations.md lists every metric."""
from __future__ import annotations

import functools
import threading
import time
import weakref
from collections import defaultdict
from typing import Callable

from ephost import histogram

PREFIX = "ephost_ep"

_on = False  # counting runs (set once metrics are asked for)
_lock = threading.Lock()  # guards the tables below
# registration -> [runs, failed runs, total seconds, then the latency histogram's counts (ephost.histogram)]
_runs: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0] + [0] * histogram.SLOTS)
_events: dict[tuple[str, str], int] = defaultdict(int)  # (registration, failure policy event) -> how many
_environments: "weakref.WeakSet" = weakref.WeakSet()   # the Environments whose workers are reported


def track(environment) -> None:
    """Report `environment`'s registrations (every Environment calls this as it is made)."""
    _environments.add(environment)


def note(registration: str, event: str) -> None:
    """What the failure policy did for one call of `registration` ("crashed", "retried", "fell back", ...)."""
    if _on:
        with _lock:
            _events[(registration, event)] += 1


def observed(run: Callable) -> Callable:
    """Marks a session's run method, to be timed into the figures of the registrations its partitions run on
    (InferenceSession.registrations) once metrics are on: `_instrument` puts the timing around it then, so that
    until then a run calls it as it is."""
    run.ephost_observed = True
    return run


def _instrument() -> None:
    """Time the session's marked run methods (once)."""
    from ephost.client.session import InferenceSession
    for name, member in list(vars(InferenceSession).items()):
        if getattr(member, "ephost_observed", False):
            setattr(InferenceSession, name, _timed(member))


def _timed(run: Callable) -> Callable:
    @functools.wraps(run)
    def timed_run(session, *args, **kwargs):
        start = time.perf_counter()
        failed = True
        try:
            outputs = run(session, *args, **kwargs)
            failed = False
            return outputs
        finally:
            _observe(session.registrations, time.perf_counter() - start, failed)
    timed_run.ephost_observed = False  # (wrapped once)
    return timed_run


def _observe(registrations, seconds: float, failed: bool) -> None:
    bucket = histogram.slot(seconds)
    with _lock:
        for name in registrations:
            figures = _runs[name]
            figures[0] += 1
            figures[1] += failed
            figures[2] += seconds
            figures[3 + bucket] += 1


class ApplicationCollector:
    """The application's metrics, made when scraped."""

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        with _lock:
            runs = {name: list(figures) for name, figures in _runs.items()}
            events = dict(_events)
        total = CounterMetricFamily(f"{PREFIX}_runs", "session runs that used the registration's EP, by outcome "
                                    "(ok, failed)", labels=["registration", "outcome"])
        latency = HistogramMetricFamily(f"{PREFIX}_run_duration_seconds", "how long the runs that used the "
                                        "registration's EP took, as the application saw them", labels=["registration"])
        for name, figures in sorted(runs.items()):
            total.add_metric([name, "ok"], figures[0] - figures[1])
            total.add_metric([name, "failed"], figures[1])
            latency.add_metric([name], histogram.cumulative(figures[3:]), figures[2])
        yield total
        yield latency
        policy = CounterMetricFamily(f"{PREFIX}_policy_events", "what the failure policy did, by event: crashed, "
                                     "unavailable, timed out, failed (the EP failed inside), retried, fell back, "
                                     "moved to the fallback, made again (a call the worker did not run)",
                                     labels=["registration", "event"])
        for (name, event), n in sorted(events.items()):
            policy.add_metric([name, event], n)
        yield policy
        up = GaugeMetricFamily(f"{PREFIX}_worker_up", "1 while the registration's worker serves, 0 while it is "
                               "away (restarting, reconnecting) or failed", labels=["registration", "ep"])
        restarts = CounterMetricFamily(f"{PREFIX}_worker_restarts", "new workers (or connections to one) since "
                                       "the registration: restarts, replacements, reconnections",
                                       labels=["registration", "ep"])
        crashes = CounterMetricFamily(f"{PREFIX}_worker_crashes", "deaths of a worker this process launched",
                                      labels=["registration", "ep"])
        for environment in list(_environments):
            for registration in environment.registrations():
                link = registration.link
                if link is None:
                    continue
                labels = [registration.name, registration.factory.get_name()]
                up.add_metric(labels, int(link.serving))
                restarts.add_metric(labels, max(0, link.generation - 1))
                crashes.add_metric(labels, link.supervisor.crashes if link.supervisor is not None else 0)
        yield up
        yield restarts
        yield crashes


_collector = ApplicationCollector()
_registered: set[int] = set()  # id() of the registries it is in


def register_metrics(registry=None) -> None:
    """Count from now on, and report into `registry` (prometheus_client's default registry when None): for an
    application that serves its own metrics already."""
    global _on
    from prometheus_client import REGISTRY
    registry = REGISTRY if registry is None else registry
    with _lock:
        if not _on:
            _instrument()
            _on = True
        if id(registry) in _registered:
            return
        _registered.add(id(registry))
    registry.register(_collector)


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> int:
    """Serve the application's ephost metrics at http://ADDR:PORT/metrics on a thread of its own (plain HTTP);
    the port it listens on (port 0: a free one)."""
    from prometheus_client import CollectorRegistry, start_http_server
    registry = CollectorRegistry(auto_describe=False)
    register_metrics(registry)
    server, _ = start_http_server(port, addr, registry)
    return server.server_port
