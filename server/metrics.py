"""A worker's Prometheus metrics (`ephost worker --metrics-listen HOST:PORT`, text at /metrics). Everything is
read when scraped, from what the worker counts anyway (server/stats.py), its clients and its allocators: serving
a call costs nothing more for it. docs/operations.md lists every metric and its meaning."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ephost.histogram import cumulative
from ephost.wire import PROTOCOL

if TYPE_CHECKING:
    from ephost.server.state import WorkerState

log = logging.getLogger(__name__)

PREFIX = "ephost_worker"
# The worker's counters (WorkerStats.counters) exported as they are, ephost_worker_<name>_total, with what each
# counts. Those exported otherwise (the inline bytes, by plane) are not here.
COUNTERS = {
    "bytes_copied": "bytes moved by CopyTensors inside the worker",
    "copies": "tensors copied by CopyTensors",
    "compute_inputs_resident": "Compute inputs already in the worker (made by an earlier Compute), not moved",
    "compute_inputs_transferred": "Compute inputs brought in (inline, or written by the client)",
    "compute_input_bytes_resident": "bytes of the Compute inputs already in the worker",
    "compute_input_bytes_transferred": "bytes of the Compute inputs brought in",
    "compute_outputs_in_place": "Compute outputs the EP wrote straight into shared memory",
    "compute_outputs_copied": "Compute outputs copied into shared memory from the EP's own",
    "fast_lane_calls": "calls over the same-host fast lane rather than gRPC",
    "fast_lane_connections": "fast-lane connections opened",
    "kept_calls": "fast-lane Computes that came as repeats of a kept call",
    "calls_kept": "calls the worker kept for their repeats",
    "early_wakes": "fast-lane callers woken as the EP finished, before the reply was made",
    "partitions_compiled": "partitions compiled from their nodes",
    "partitions_restored": "partitions restored from a compiled form (an EPContext node)",
    "partitions_shared": "partitions compiled once for several sessions",
    "capability_cache_hits": "GetCapability calls answered from the worker's cache",
    "files_imported": "external data files handed over as descriptors",
    "file_bytes_imported": "bytes of those files",
    "blob_chunks_received": "chunks of external data received into the blob cache",
    "blob_bytes_received": "bytes received into the blob cache",
    "blob_hits": "blobs asked for that the cache held already",
}


class WorkerCollector:
    """The metrics of one worker, made when scraped."""

    def __init__(self, state: "WorkerState"):
        self._state = state

    def describe(self):
        return []  # (nothing is made at registration: every figure is read at scrape time)

    def collect(self):
        state = self._state
        figures = state.stats.snapshot()
        info = GaugeMetricFamily(f"{PREFIX}_info", "the worker: its EP, ephost's and ONNX Runtime's versions, the "
                                 "wire protocol (always 1)",
                                 labels=["ep", "ephost_version", "onnxruntime_version", "protocol"])
        info.add_metric([state.ep_name, state.ephost_version, state.onnxruntime_version or "", PROTOCOL], 1)
        yield info
        yield GaugeMetricFamily(f"{PREFIX}_start_time_seconds", "when the worker started (Unix time): a change is "
                                "a restart", value=state.started_at)
        yield GaugeMetricFamily(f"{PREFIX}_draining", "1 while the worker drains (it refuses new calls)",
                                value=int(state.draining.is_set()))
        if state.dispatcher is not None:
            yield GaugeMetricFamily(f"{PREFIX}_calls_under_way", "calls the worker is serving now, on both planes "
                                    "(what an autoscaler scales on)", value=state.dispatcher.admission.under_way())
        calls = CounterMetricFamily(f"{PREFIX}_calls", "calls by method and the status they ended with (calls "
                                    "turned away, under theirs)", labels=["method", "status"])
        duration = HistogramMetricFamily(f"{PREFIX}_call_duration_seconds", "how long the worker took to answer "
                                         "each call, by method (Ep/Compute: a partition's run)", labels=["method"])
        for method, m in sorted(figures.methods.items()):
            calls.add_metric([method, "OK"], m[0] - m[1])
            duration.add_metric([method], cumulative(m[4:]), m[2])
        for (method, status), n in sorted(figures.failed.items()):
            calls.add_metric([method, status], n)
        yield calls
        yield duration
        moved = CounterMetricFamily(f"{PREFIX}_tensor_bytes", "tensor bytes carried inside calls and replies, by "
                                    "plane (grpc, lane: the same-host fast lane) and direction (in: to the worker)",
                                    labels=["plane", "direction"])
        lane_in, lane_out = figures.lane_bytes
        for plane, direction, n in (("grpc", "in", figures.counters["bytes_inline_in"] - lane_in),
                                    ("grpc", "out", figures.counters["bytes_inline_out"] - lane_out),
                                    ("lane", "in", lane_in), ("lane", "out", lane_out)):
            moved.add_metric([plane, direction], n)
        yield moved
        for name, meaning in COUNTERS.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", meaning, value=figures.counters[name])
        yield from self._clients(state)

    @staticmethod
    def _clients(state: "WorkerState"):
        from ephost.server.clients import KINDS
        clients = state.clients.all()
        yield GaugeMetricFamily(f"{PREFIX}_clients", "clients connected", value=len(clients))
        handles = GaugeMetricFamily(f"{PREFIX}_handles", "handles the clients hold, by kind", labels=["kind"])
        for kind in KINDS:
            handles.add_metric([kind], sum(c.count(kind) for c in clients))
        yield handles
        in_use = GaugeMetricFamily(f"{PREFIX}_memory_in_use_bytes", "bytes the clients' allocators hand out now, "
                                   "by memory", labels=["memory"])
        reserved = GaugeMetricFamily(f"{PREFIX}_memory_reserved_bytes", "bytes the clients' allocators hold from "
                                     "the system, by memory", labels=["memory"])
        by_memory: dict[str, list[int]] = {}
        for client in clients:
            for _, allocator in client.items("allocator"):
                try:
                    stats = allocator.get_stats()
                except Exception:  # an EP's allocator that cannot say: left out, the scrape goes on
                    continue
                sums = by_memory.setdefault(allocator.memory_info.name, [0, 0])
                sums[0] += int(stats.get("InUse", 0))
                sums[1] += int(stats.get("TotalAllocated", 0))
        for memory, (used, held) in sorted(by_memory.items()):
            in_use.add_metric([memory], used)
            reserved.add_metric([memory], held)
        yield in_use
        yield reserved


def parse_listen(listen: str) -> tuple[str, int]:
    """("host", port) of HOST:PORT ("" or "0.0.0.0": every interface; "[::1]:9400" for IPv6)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise SystemExit(f"ephost worker: --metrics-listen takes HOST:PORT, got {listen!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def serve_metrics(state: "WorkerState", listen: str) -> tuple[str, object]:
    """Serve the worker's metrics at http://HOST:PORT/metrics on a thread of its own: the address it listens on
    (the port it was given, or the one it got for 0) and the server (shutdown() ends it)."""
    host, port = parse_listen(listen)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(state))
    registry.register(ProcessCollector(namespace=PREFIX, registry=None))  # memory, CPU, descriptors
    try:
        server, _ = start_http_server(port, host, registry)
    except OSError as e:
        raise SystemExit(f"ephost worker: cannot serve metrics on {listen}: {e.strerror or e}") from None
    address = f"{'[' + host + ']' if ':' in host else host}:{server.server_port}"
    log.info("metrics at http://%s/metrics", address)
    return address, server

