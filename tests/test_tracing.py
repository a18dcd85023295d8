"""OpenTelemetry traces across the process boundary: an application with a tracer provider (the SDK's in-memory
exporter, in a process of its own: a provider is set once per process) runs a session on a worker that exports
its spans as JSON lines (OTEL_TRACES_EXPORTER=console); the worker's Compute spans are children of the
application's partition spans, over the fast lane and over gRPC."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent

APPLICATION = r'''
import json, sys
import numpy as np
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
import ephost, models
from helpers import options_for
with ephost.Environment() as env:
    env.register_execution_provider_library("w", sys.argv[1], {"fast_lane": sys.argv[2]})
    with ephost.InferenceSession(models.diamond(), options_for(env, "w"), env=env) as session:
        for _ in range(3):
            session.run(None, {"x": np.ones((2, 3), np.float32)})
    stats = env.get_worker_stats("w")
spans = [{"name": s.name, "trace": s.context.trace_id, "span": s.context.span_id, "kind": s.kind.name,
          "parent": s.parent.span_id if s.parent else None, "attributes": dict(s.attributes)}
         for s in exporter.get_finished_spans()]
print(json.dumps({"spans": spans, "lane_calls": stats.fast_lane_calls, "kept_calls": stats.kept_calls}))
'''


@pytest.mark.parametrize("fast_lane", ["true", "false"])
def test_a_runs_spans_and_the_workers_compute_spans_join_across_the_boundary(worker, monkeypatch, fast_lane):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    w = worker("--ep", "reference")
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    app = subprocess.run([sys.executable, "-c", APPLICATION, w.address, fast_lane], capture_output=True, text=True,
                         timeout=120, cwd=TESTS, env={**os.environ, "PYTHONPATH": str(TESTS)})
    assert app.returncode == 0, app.stderr
    seen = json.loads(app.stdout.splitlines()[-1])
    spans = seen["spans"]
    runs = [s for s in spans if s["name"] == "ephost.run"]
    partitions = [s for s in spans if s["name"] == "ephost.partition"]
    assert len(runs) == 3 and len(partitions) == 3
    assert {p["parent"] for p in partitions} == {r["span"] for r in runs}, "each partition's span is its run's child"
    assert all(p["kind"] == "CLIENT" and p["attributes"]["ephost.registration"] == "w" for p in partitions)
    w.proc.terminate()
    assert w.proc.wait(30) == 0
    with open(w.log_path) as f:
        served = [json.loads(line) for line in f if line.startswith('{"name"')]
    computes = [s for s in served if s["name"] == "ephost.worker Ep/Compute"]
    assert len(computes) == 3, served
    by_span = {p["span"]: p for p in partitions}
    for compute in computes:
        parent = by_span[int(compute["parent_id"], 16)]  # the worker's span is a partition span's child...
        assert int(compute["context"]["trace_id"], 16) == parent["trace"]  # ...in the application's trace
        assert compute["kind"] == "SpanKind.SERVER" and compute["attributes"]["ephost.ep"] == "reference"
    assert (seen["lane_calls"] > 0) == (fast_lane == "true"), seen  # both planes carry the context
    assert seen["kept_calls"] == 0, "a traced call goes whole"


def test_without_a_tracer_provider_no_span_is_made_and_calls_are_kept(worker):
    """The default: tracing is off (runs repeat as kept calls on the fast lane, no context goes)."""
    import numpy as np
    import ephost
    import models
    from helpers import options_for
    from ephost import tracing
    w = worker("--ep", "reference")
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", w.address)
        with ephost.InferenceSession(models.diamond(), options_for(env, "w"), env=env) as session:
            for _ in range(5):
                session.run(None, {"x": np.ones((2, 3), np.float32)})
        assert env.get_worker_stats("w").kept_calls > 0
    assert not tracing.active() and not tracing.recording()
