"""OpenTelemetry spans across the process boundary: an application's run, each of its partition calls, and the
worker's Compute, joined by the trace context a Compute carries (ComputeRequest.trace_context, the W3C
traceparent and tracestate), on gRPC and on the fast lane alike: while a span records, a Compute goes whole,
never as a kept call's repeat (whose frame has no room for it).

Off unless the application has set a tracer provider (opentelemetry.trace.set_tracer_provider): until then a run
reads a flag and makes no span (a provider set later is found within CHECK_S). A worker makes its span when a
Compute carries a context and it has a provider of its own: `configure_worker()` makes one from
OTEL_TRACES_EXPORTER (console: JSON on stderr, the worker's log; otlp: opentelemetry-exporter-otlp, configured by
its OTEL_EXPORTER_OTLP_* variables) where opentelemetry-sdk is installed. Only opentelemetry-api is needed here.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Iterator, Mapping, MutableMapping

log = logging.getLogger(__name__)

NAME = "ephost"
CHECK_S = 1.0  # while no provider is set, how often a run looks again

_on = False
_next_check = 0.0
_trace = None  # opentelemetry.trace, once imported


def _api():
    global _trace
    if _trace is None:
        from opentelemetry import trace
        _trace = trace
    return _trace


def active() -> bool:
    """Whether the application has a tracer provider (spans are made)."""
    return _on or (time.monotonic() >= _next_check and _look())


def _look() -> bool:
    global _on, _next_check
    _next_check = time.monotonic() + CHECK_S
    trace = _api()
    _on = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    return _on


def recording() -> bool:
    """Whether a span records now on this thread (a Compute then carries the context, and goes whole)."""
    return _on and _api().get_current_span().is_recording()


@contextlib.contextmanager
def span(name: str, attributes: Mapping[str, object], client: bool = False) -> Iterator[None]:
    """A span of the application's (`client`: a call to another process), current while the block runs."""
    trace = _api()
    kind = trace.SpanKind.CLIENT if client else trace.SpanKind.INTERNAL
    with trace.get_tracer(NAME).start_as_current_span(name, kind=kind, attributes=dict(attributes)):
        yield


def inject(carrier: MutableMapping[str, str]) -> None:
    """Put the current trace context into `carrier` (a Compute's trace_context)."""
    from opentelemetry import propagate
    propagate.inject(carrier)


@contextlib.contextmanager
def served(method: str, carrier: Mapping[str, str], attributes: Mapping[str, object]) -> Iterator[None]:
    """The worker's span of a call that carried its caller's trace context (`carrier`), its child."""
    from opentelemetry import propagate
    trace = _api()
    parent = propagate.extract(dict(carrier))
    with trace.get_tracer(NAME).start_as_current_span(f"ephost.worker {method}", context=parent,
                                                      kind=trace.SpanKind.SERVER, attributes=dict(attributes)):
        yield


def configure_worker() -> None:
    """A worker's tracer provider, where OTEL_TRACES_EXPORTER asks for one and opentelemetry-sdk is installed."""
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter_name in ("", "none"):
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
    except ImportError:
        log.warning("OTEL_TRACES_EXPORTER=%s, but opentelemetry-sdk is not installed: the worker makes no spans",
                    exporter_name)
        return
    import sys
    provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                                                       "ephost-worker")}))
    if exporter_name == "console":  # one JSON object a line per span, on stderr (stdout carries the ready line)
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(
            out=sys.stderr, formatter=lambda span: span.to_json(indent=None) + os.linesep)))
    elif exporter_name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("OTEL_TRACES_EXPORTER=otlp, but opentelemetry-exporter-otlp is not installed: the worker "
                        "makes no spans")
            return
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        log.warning("OTEL_TRACES_EXPORTER=%s is not one this worker knows (console, otlp): it makes no spans",
                    exporter_name)
        return
    _api().set_tracer_provider(provider)
    global _on
    _on = True
    log.info("tracing: spans go to the %s exporter", exporter_name)


def shutdown() -> None:
    """Flush the worker's spans before it exits."""
    if not _on:
        return
    provider = _api().get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()
