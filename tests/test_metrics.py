"""Prometheus metrics, scraped over real HTTP and read with prometheus_client's own parser: a worker's
(`ephost worker --metrics-listen`) and the application's (ephost.start_metrics_server)."""
import json
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import ephost
import models
from helpers import RawClient, options_for


def scrape(address: str) -> dict:
    """{(sample name, frozenset of its labels): value} at http://ADDRESS/metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def metered(worker):
    """A worker serving its metrics on a free port: (the worker, the metrics' HOST:PORT)."""
    w = worker("--ep", "reference", "--metrics-listen", "127.0.0.1:0")
    return w, json.loads(w.ready_line)["metrics"]


def test_a_worker_serves_calls_latency_bytes_clients_and_handles(metered):
    w, address = metered
    x = np.ones((2, 3), np.float32)
    with ephost.Environment() as env:
        env.register_execution_provider_library("w", w.address)
        (device,) = env.get_ep_devices()
        held = ephost.Tensor.empty((1 << 20,), np.uint8, env.create_shared_allocator(device,
                                                                                       ephost.DeviceMemoryType.DEFAULT))
        with ephost.InferenceSession(models.diamond(), options_for(env, "w"), env=env) as session:
            for _ in range(7):
                session.run(None, {"x": x})
            computes = env.get_worker_stats("w").methods["Ep/Compute"].calls
            samples = scrape(address)
        del held
    assert computes >= 7
    assert value(samples, "ephost_worker_calls_total", method="Ep/Compute", status="OK") == computes
    assert value(samples, "ephost_worker_call_duration_seconds_count", method="Ep/Compute") == computes
    buckets = sorted(((float(dict(labels)["le"]), v) for (name, labels), v in samples.items()
                      if name == "ephost_worker_call_duration_seconds_bucket" and
                      dict(labels)["method"] == "Ep/Compute"))
    assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1] == (float("inf"), computes)
    assert value(samples, "ephost_worker_call_duration_seconds_sum", method="Ep/Compute") > 0
    assert value(samples, "ephost_worker_clients") == 1
    assert value(samples, "ephost_worker_handles", kind="compute_info") == 1
    lane_in = value(samples, "ephost_worker_tensor_bytes_total", plane="lane", direction="in")
    grpc_in = value(samples, "ephost_worker_tensor_bytes_total", plane="grpc", direction="in")
    assert lane_in + grpc_in >= 7 * x.nbytes
    assert value(samples, "ephost_worker_info", ep="reference", ephost_version=ephost.__version__,
                 onnxruntime_version=__import__("onnxruntime").__version__, protocol="ephost.v1") == 1
    assert value(samples, "ephost_worker_memory_in_use_bytes", memory="reference") >= 1 << 20, "the tensor held"
    assert value(samples, "ephost_worker_handles", kind="buffer") >= 1
    assert value(samples, "ephost_worker_process_resident_memory_bytes") > 0
    assert all(name.startswith("ephost_") for name, _ in samples)


def test_a_failed_call_is_counted_under_its_status(metered):
    from ephost.v1 import ep_pb2
    w, address = metered
    raw = RawClient(w.address)
    try:
        with pytest.raises(Exception):
            raw(raw.ep.Compute, ep_pb2.ComputeRequest(node_compute_info=12345))
    finally:
        raw.close()
    samples = scrape(address)
    assert value(samples, "ephost_worker_calls_total", method="Ep/Compute", status="NOT_FOUND") == 1
    assert value(samples, "ephost_worker_calls_total", method="Ep/Compute", status="OK") == 0


def test_the_application_serves_runs_failures_restarts_and_latency_per_registration():
    port = ephost.start_metrics_server(0, "127.0.0.1")
    x = np.ones((2, 3), np.float32)
    with ephost.Environment() as env:
        # (chaos wraps the reference EP, and goes by its name)
        env.register_execution_provider_library("metered", "chaos", {"fault": "segfault", "after": "2"})
        options = options_for(env, "metered")
        options.ep_failure_policy = "retry"
        with ephost.InferenceSession(models.diamond(), options, env=env) as session:
            for _ in range(2):  # the second run's Compute crashes the worker, and is made on the next one
                session.run(None, {"x": x})
            samples = scrape(f"127.0.0.1:{port}")
    assert value(samples, "ephost_ep_runs_total", registration="metered", outcome="ok") == 2
    assert value(samples, "ephost_ep_runs_total", registration="metered", outcome="failed") == 0
    assert value(samples, "ephost_ep_run_duration_seconds_count", registration="metered") == 2
    assert value(samples, "ephost_ep_policy_events_total", registration="metered", event="crashed") == 1
    assert value(samples, "ephost_ep_policy_events_total", registration="metered", event="retried") == 1
    assert value(samples, "ephost_ep_worker_crashes_total", registration="metered", ep="reference") == 1
    assert value(samples, "ephost_ep_worker_restarts_total", registration="metered", ep="reference") == 1
    assert value(samples, "ephost_ep_worker_up", registration="metered", ep="reference") == 1
    assert all(name.startswith("ephost_") for name, _ in samples)


def test_the_application_counts_failed_runs_and_fallbacks_per_registration():
    """A crash under "raise" is a failed run of its registration; under "fallback" the run is done on the CPU
    fallback (an "ok" run, its partition's "fell back" counted)."""
    port = ephost.start_metrics_server(0, "127.0.0.1")
    x = np.ones((2, 3), np.float32)
    with ephost.Environment() as env:
        for name, policy in (("fails", "raise"), ("falls", "fallback")):
            env.register_execution_provider_library(name, "chaos", {"fault": "segfault", "after": "2"})
            options = options_for(env, name)
            options.ep_failure_policy = policy
            with ephost.InferenceSession(models.diamond(), options, env=env) as session:
                session.run(None, {"x": x})
                if policy == "raise":  # the second run's Compute crashes the worker
                    with pytest.raises(ephost.EpWorkerCrashed):
                        session.run(None, {"x": x})
                else:
                    np.testing.assert_allclose(session.run(None, {"x": x})[0], models.diamond_expected(x), rtol=1e-6)
        samples = scrape(f"127.0.0.1:{port}")
    assert value(samples, "ephost_ep_runs_total", registration="fails", outcome="ok") == 1
    assert value(samples, "ephost_ep_runs_total", registration="fails", outcome="failed") == 1
    assert value(samples, "ephost_ep_run_duration_seconds_count", registration="fails") == 2
    assert value(samples, "ephost_ep_policy_events_total", registration="fails", event="crashed") == 1
    assert value(samples, "ephost_ep_runs_total", registration="falls", outcome="ok") == 2
    assert value(samples, "ephost_ep_runs_total", registration="falls", outcome="failed") == 0
    assert value(samples, "ephost_ep_policy_events_total", registration="falls", event="crashed") == 1
    assert value(samples, "ephost_ep_policy_events_total", registration="falls", event="fell back") == 1
    assert value(samples, "ephost_ep_worker_crashes_total", registration="falls", ep="reference") == 1
