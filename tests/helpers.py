"""What tests share that is not a fixture: workers started by hand, a raw wire client, session options."""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc

import ephost

from ephost.v1 import worker_pb2, worker_pb2_grpc


def options_for(environment, *registrations):
    """SessionOptions with the devices of these registrations, in this order."""
    from ephost import SessionOptions
    options = SessionOptions()
    for r in registrations:
        options.add_provider_for_devices([d for d in environment.get_ep_devices() if d.registration_name == r])
    return options


def worker_stats(environment, registration: str):
    return environment.get_worker_stats(registration)


def device_of(environment, registration: str):
    return next(d for d in environment.get_ep_devices() if d.registration_name == registration)


class Worker:
    """A worker started by hand, as an operator would: `ephost worker ...`."""

    def __init__(self, *args: str, exit_with_parent: bool = True):
        self.dir = tempfile.mkdtemp(prefix="ephost-test-")
        self.socket = os.path.join(self.dir, "w.sock")
        cmd = [sys.executable, "-m", "ephost", "worker", *args]
        if "--listen" not in args:
            cmd += ["--listen", f"unix://{self.socket}"]
        if exit_with_parent:
            cmd.append("--exit-with-parent")
        # Its log goes to a file: a pipe nobody reads fills up and blocks the worker's next log line.
        self.log_path = os.path.join(self.dir, "worker.log")
        # An operator's shell has no PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python (which importing
        # onnxruntime-extensions sets in this process): the worker parses with the compiled protobuf.
        env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
        self.ready_line = self.proc.stdout.readline().decode()

    @property
    def address(self) -> str:
        return json.loads(self.ready_line)["address"]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return self.proc.returncode


class RawClient:
    """Stubs and a client id, for speaking the wire protocol directly (bad input is sent this way)."""

    def __init__(self, address: str, name: str = "raw"):
        from ephost.v1 import (allocator_pb2_grpc, data_transfer_pb2_grpc, ep_pb2_grpc, factory_pb2_grpc,
                               stream_pb2_grpc)
        self.channel = grpc.insecure_channel(address)
        self.worker = worker_pb2_grpc.WorkerStub(self.channel)
        self.factory = factory_pb2_grpc.EpFactoryStub(self.channel)
        self.allocator = allocator_pb2_grpc.AllocatorStub(self.channel)
        self.transfer = data_transfer_pb2_grpc.DataTransferStub(self.channel)
        self.stream = stream_pb2_grpc.StreamStub(self.channel)
        self.ep = ep_pb2_grpc.EpStub(self.channel)
        hello = self.worker.Hello(worker_pb2.HelloRequest(client_name=name, protocol="ephost.v1"), timeout=30,
                                  wait_for_ready=True)
        self.hello = hello
        self.metadata = (("ephost-client", hello.client_id),)

    def __call__(self, method, request, **kw):
        return method(request, timeout=30, metadata=self.metadata, **kw)

    def close(self):
        self.channel.close()


# The two transports of the data plane: the fast lane (the default where client and worker share memory) and
# gRPC alone (`fast_lane=false`). Modules whose tests must hold over both parametrize their fixtures with these.
TRANSPORTS = {"fast_lane": {}, "grpc": {"fast_lane": "false"}}


class MovedClock:
    """A module's `time` that a test moves on (monkeypatched in its place): the clock named `clock` reads `ahead`
    seconds more; everything else of `time` as it is."""

    def __init__(self, clock: str = "monotonic"):
        self._name, self._clock, self.ahead = clock, getattr(time, clock), 0.0

    def _now(self) -> float:
        return self._clock() + self.ahead

    def __getattr__(self, name):
        return self._now if name == self._name else getattr(time, name)


@contextlib.contextmanager
def diamond_runs(session, tag, threads: int = 2):
    """`threads` threads running the diamond model (models.diamond) on `session` until the block ends. Yields the
    list they append to: (tag(), whether the result is right) for each run, or the EpError a run raised."""
    import numpy as np
    import models
    results, stop = [], threading.Event()

    def work(seed):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            x = rng.standard_normal((2, 3)).astype(np.float32)
            try:
                (y,) = session.run(None, {"x": x})
                results.append((tag(), bool(np.allclose(y, models.diamond_expected(x), rtol=1e-6))))
            except ephost.EpError as e:
                results.append(e)

    running = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in running:
        t.start()
    try:
        yield results
    finally:
        stop.set()
        for t in running:
            t.join(60)


def in_threads(work, n: int) -> list[tuple[int, Exception]]:
    """work(i) for i in range(n), on n threads at once; (i, exception) of each that failed."""
    errors = []

    def run(i):
        try:
            work(i)
        except Exception as e:  # reported by the caller, with the thread's number
            errors.append((i, e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


@contextlib.contextmanager
def compiled(model, inputs: tuple[str, ...], outputs: tuple[str, ...]):
    """The whole model compiled as one partition by the onnxruntime EP in this process, released after."""
    from ephost.eps.base import FusedGraph
    from ephost.eps.onnxruntime import OrtEpFactory
    from ephost.graph import GraphIndex, prepare_model
    index = GraphIndex.of(prepare_model(model))
    factory = OrtEpFactory()
    ep = factory.create_ep([0], {})
    try:
        (info,) = ep.compile([FusedGraph("all", index, tuple(index.order), inputs, outputs)])
        yield info
        ep.release_node_compute_infos([info])
    finally:
        factory.release_ep(ep)
        factory.close()


def make_env(transport: str = "fast_lane") -> ephost.Environment:
    """An Environment with a launched reference worker ("ref") and an in-process one ("local")."""
    environment = ephost.Environment()
    environment.register_execution_provider_library("ref", "reference", TRANSPORTS[transport])
    environment.register_execution_provider_library("local", "inproc:reference")
    return environment


# The ONNX node suite. `make test` runs a fixed quarter of its cases (chosen by a hash of each name, so the
# sample does not depend on the order onnx lists them) and asserts every property on it; `make conformance`
# (EPHOST_NODE_CASES=all) runs all of them and also asserts the counts the README quotes.
ALL_NODE_CASES = os.environ.get("EPHOST_NODE_CASES", "sample") == "all"
# Ops that draw at random: without a seed, a case's expected output is one draw (onnx makes it anew from numpy's
# unseeded generator each time it lists its cases), and a run passes only where its own draw is the same.
RANDOM_OPS = frozenset({"Bernoulli", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform",
                        "RandomUniformLike"})


def node_cases() -> list:
    """The ONNX node cases (the sample, or all of them), but those whose expected output is a random draw: any
    engine passes those by luck (test_bernoulli_double passed the reference evaluator in this process once, and
    so was expected to pass through a worker too, where its draw differed: a red suite), and they tell nothing
    of how ephost carries a model."""
    import warnings
    import zlib

    from onnx.backend.test.case.node import collect_testcases
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        every = [c for c in collect_testcases(None) if not _drawn_at_random(c.model.graph)]
    return every if ALL_NODE_CASES else [c for c in every if zlib.crc32(c.name.encode()) % 4 == 0]


def _drawn_at_random(graph) -> bool:
    """Whether a node of the graph (or of a graph it holds) draws at random without a seed."""
    for node in graph.node:
        if node.op_type in RANDOM_OPS and not any(a.name == "seed" for a in node.attribute):
            return True
        if any(_drawn_at_random(g) for a in node.attribute for g in (a.g, *a.graphs) if g.node):
            return True
    return False


def worker_pids() -> set[int]:
    """The worker processes this test run started that run now: those with the mark every process it starts
    inherits (conftest.py), so that other runs' workers on the same machine are not counted."""
    mark = f"EPHOST_TEST_RUN={os.environ.get('EPHOST_TEST_RUN', '')}".encode()
    pids = set()
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as f:
                args = f.read().split(b"\0")
            if not (b"ephost" in args and b"worker" in args):
                continue
            with open(cmdline[:-len("cmdline")] + "environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
        except OSError:
            continue
        pids.add(int(cmdline.split("/")[2]))
    return pids


def killed_while_replaced(env, name: str) -> None:
    """SIGKILL the worker of registration `name` and return once its death is noticed, while its successor
    starts (most of a second): the dead worker's connection is still the current one."""
    process = env.registration(name).process
    os.kill(process.pid, signal.SIGKILL)
    assert process.exited.wait(10)
    link = env.registration(name).link
    link.wait_noticed(10)
    assert link.current.process is process, "the successor was up already"


def make_pki(directory) -> None:
    """A CA, a server certificate for localhost (not 127.0.0.1: a name it does not carry), a client certificate
    (PEM: ca.pem, server.pem, server.key, client.pem, client.key) and a bearer token file (token), written into
    `directory`."""
    import datetime
    import pathlib

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject, key, issuer_key, *, ca=False, san=None):
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name("ephost test CA"))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    d = pathlib.Path(directory)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    files = {"ca": cert("ephost test CA", ca_key, ca_key, ca=True)}
    for who, san in (("server", [x509.DNSName("localhost")]), ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        files[who] = cert(who, key, ca_key, san=san)
        (d / f"{who}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    for who, c in files.items():
        (d / f"{who}.pem").write_bytes(c.public_bytes(serialization.Encoding.PEM))
    (d / "token").write_text("s3cret-token\n")
