"""The container files: the compose file is well formed and wires workers and client together, and the
image's entry command, run directly here, starts a worker that answers its health check."""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import yaml

import ephost

DOCKER = pathlib.Path(__file__).resolve().parent.parent / "docker"


def test_compose_file_starts_two_workers_and_a_client_that_uses_both():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    workers = {n: s for n, s in services.items() if "worker" in n}
    assert len(workers) == 2
    sockets = {s["environment"]["EPHOST_LISTEN"] for s in workers.values()}
    client = services["client"]
    assert set(client["depends_on"]) == set(workers)
    assert all(c["condition"] == "service_healthy" for c in client["depends_on"].values())
    command = client["entrypoint"]
    assert command[:2] == ["ephost", "run"]
    assert {command[i + 1] for i, a in enumerate(command) if a == "--ep"} == sockets
    for service in services.values():
        assert service["build"]["dockerfile"] == "docker/Dockerfile"
        assert "sockets:/run/ephost" in service["volumes"]
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert "USER ephost" in dockerfile and "HEALTHCHECK" in dockerfile and "ephost health" in dockerfile


def test_kubernetes_manifest_is_valid_against_the_kubernetes_schemas(worker):
    """Each object of docker/kubernetes.yaml validates (strictly: no unknown field) against the schemas of
    Kubernetes that the kubernetes-validate package ships; the Deployment probes the worker's health, Prometheus
    scrapes its metrics' port, and the autoscaler scales it on a metric a worker serves."""
    import kubernetes_validate
    documents = [d for d in yaml.safe_load_all((DOCKER / "kubernetes.yaml").read_text()) if d]
    assert {d["kind"] for d in documents} == {"Deployment", "Service", "HorizontalPodAutoscaler"}
    for document in documents:
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"][:2] == ["ephost", "health"]
    # Prometheus scrapes the port the worker serves its metrics on
    args = container["args"]
    metrics_port = int(args[args.index("--metrics-listen") + 1].rsplit(":", 1)[1])
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == metrics_port
    assert {"name": "metrics", "containerPort": metrics_port} in container["ports"]
    # The autoscaler scales the Deployment on a metric the worker serves
    (hpa,) = [d for d in documents if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    import json
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    w = worker("--ep", "reference", "--metrics-listen", "127.0.0.1:0")
    with urllib.request.urlopen(f"http://{json.loads(w.ready_line)['metrics']}/metrics", timeout=30) as reply:
        served = {f.name for f in text_string_to_metric_families(reply.read().decode())}
    assert metric["pods"]["metric"]["name"] in served


def test_the_entry_command_starts_a_worker_that_reports_healthy():
    directory = tempfile.mkdtemp(prefix="ephost-docker-")
    address = f"unix://{directory}/worker.sock"
    env = dict(os.environ, EPHOST_EP="reference", EPHOST_OPTIONS="ops=Add,Relu", EPHOST_LISTEN=address,
               PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    proc = subprocess.Popen(["sh", str(DOCKER / "entrypoint.sh")], env=env, stdout=subprocess.PIPE)
    try:
        assert '"ready"' in proc.stdout.readline().decode()
        health = subprocess.run([sys.executable, "-m", "ephost", "health", address], capture_output=True, text=True,
                                timeout=60)
        assert health.returncode == 0 and health.stdout.strip() == "SERVING"
        with ephost.Environment() as e:
            e.register_execution_provider_library("w", address)
            (device,) = e.get_ep_devices()
            assert device.ep_options == {"ops": "Add,Relu"}
    finally:
        proc.terminate()
        code = proc.wait(30)
        proc.stdout.close()
        shutil.rmtree(directory, ignore_errors=True)
    assert code == 0
    down = subprocess.run([sys.executable, "-m", "ephost", "health", address, "--timeout", "1"],
                          capture_output=True, text=True, timeout=60)
    assert down.returncode == 3 and down.stdout.startswith("NOT_LISTENING"), down.stdout


def test_reflection_lists_the_services(worker):
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    w = worker("--ep", "reference")
    with grpc.insecure_channel(w.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=10)
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"ephost.v1.EpFactory", "ephost.v1.Ep", "ephost.v1.Allocator", "ephost.v1.Stream",
            "ephost.v1.DataTransfer", "ephost.v1.Worker", "grpc.health.v1.Health"} <= names
