"""Workers on TCP: TLS, mutual TLS and bearer tokens, with certificates made here."""
import datetime
import socket

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import ephost
from ephost import DeviceMemoryType, Tensor


def _name(cn):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject, issuer, key, issuer_key, *, ca=False, san=None):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for localhost, and a client certificate, as PEM files."""
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("ephost test CA", "ephost test CA", ca_key, ca_key, ca=True)
    files = {"ca": ca}
    import ipaddress
    for who, san in (("server", [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                     ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        files[who] = _cert(who, "ephost test CA", key, ca_key, san=san)
        (d / f"{who}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    for who, cert in files.items():
        (d / f"{who}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "token").write_text("s3cret-token\n")
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def round_trip(env, name):
    (device,) = [d for d in env.get_ep_devices() if d.registration_name == name]
    allocator = env.create_shared_allocator(device, DeviceMemoryType.DEFAULT)
    data = np.arange(100, dtype=np.float32)
    back = Tensor.from_numpy(np.zeros_like(data))
    env.copy_tensors([Tensor.from_numpy(data, allocator)], [back])
    return back.numpy()


def test_tls_worker_with_a_client_that_trusts_its_ca(worker, pki):
    port = free_port()
    w = worker("--ep", "reference", "--listen", f"localhost:{port}", "--tls-cert", str(pki / "server.pem"),
               "--tls-key", str(pki / "server.key"))
    assert w.address == f"localhost:{port}"
    with ephost.Environment() as env:
        env.register_execution_provider_library("tls", f"grpcs://localhost:{port}", {"tls_ca": str(pki / "ca.pem")})
        np.testing.assert_array_equal(round_trip(env, "tls"), np.arange(100))
        (device,) = env.get_ep_devices()
        assert device.ep_name == "reference"
    with ephost.Environment() as env:  # plain text against a TLS worker
        with pytest.raises(ephost.EpWorkerUnavailable):
            env.register_execution_provider_library("plain", f"grpc://localhost:{port}", {"connect_timeout_s": "2"})


def test_mutual_tls_needs_a_client_certificate(worker, pki):
    port = free_port()
    worker("--ep", "reference", "--listen", f"localhost:{port}", "--tls-cert", str(pki / "server.pem"),
           "--tls-key", str(pki / "server.key"), "--tls-client-ca", str(pki / "ca.pem"))
    with ephost.Environment() as env:
        with pytest.raises(ephost.EpWorkerUnavailable):
            env.register_execution_provider_library("anon", f"grpcs://localhost:{port}",
                                                    {"tls_ca": str(pki / "ca.pem"), "connect_timeout_s": "2"})
        env.register_execution_provider_library("mtls", f"grpcs://localhost:{port}", {
            "tls_ca": str(pki / "ca.pem"), "tls_cert": str(pki / "client.pem"), "tls_key": str(pki / "client.key")})
        np.testing.assert_array_equal(round_trip(env, "mtls"), np.arange(100))


def test_tokens(worker, pki, monkeypatch):
    port = free_port()
    w = worker("--ep", "reference", "--listen", f"127.0.0.1:{port}", "--insecure", "--token-file", str(pki / "token"))
    with ephost.Environment() as env:
        for options in ({}, {"token": "wrong"}):
            with pytest.raises(ephost.EpUnauthenticated) as info:
                env.register_execution_provider_library("x", f"grpc://127.0.0.1:{port}", options)
            assert str(info.value) == "missing or wrong token"
        env.register_execution_provider_library("ok", f"grpc://127.0.0.1:{port}", {"token": "s3cret-token"})
        np.testing.assert_array_equal(round_trip(env, "ok"), np.arange(100))
        monkeypatch.setenv("EPHOST_TOKEN", "s3cret-token")
        env.register_execution_provider_library("from-env", f"grpc://127.0.0.1:{port}")
        assert len(env.get_ep_devices()) == 2
    # probes need no token
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(w.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
