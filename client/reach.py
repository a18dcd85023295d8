"""Why an address does not answer a gRPC client: no socket there, nothing listening, no answer at all, or TLS
that does not match (plain text to a TLS worker or the other way round, a certificate this client does not
trust or that names another host, a client certificate the worker asks for). gRPC reports most of these as one
UNAVAILABLE; a short probe of the address with the socket and ssl modules tells them apart."""
from __future__ import annotations

import errno
import socket
import ssl
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ephost.errors import EpTlsError, EpWorkerUnavailable

if TYPE_CHECKING:
    from ephost.client.connection import Credentials

PROBE_S = 1.0   # the longest one endpoint's probe may take
READ_S = 0.3    # after a TLS handshake, how long to wait for the worker to close a connection it refuses


@dataclass(frozen=True)
class Reach:
    """What a probe found at an address. `kind`: "no socket", "refused", "no answer", "unreachable", "tls" or
    "answers" (it listens, and TLS, where asked for, matches: the cause lies elsewhere)."""

    kind: str
    detail: str

    @property
    def answers(self) -> bool:
        return self.kind == "answers"

    def error(self, address: str) -> EpWorkerUnavailable:
        """The typed error for a client that could not reach `address`."""
        if self.kind == "tls":
            return EpTlsError(f"TLS with the worker at {address} failed: {self.detail}")
        return EpWorkerUnavailable(f"no worker at {address}: {self.detail}")


@dataclass(frozen=True)
class _Endpoint:
    family: int
    sockaddr: object
    label: str        # as messages name it
    host: str = ""    # the name TLS checks the certificate against


def diagnose(address: str, credentials: "Credentials", timeout: float = PROBE_S) -> Reach | None:
    """Probe `address` (a gRPC target, as a channel takes it) as a client with `credentials` would reach it;
    None where the target's form is one this cannot probe (a resolver other than dns, ipv4, ipv6 or unix).
    Several addresses behind one name: the first that answers, else what the first one found."""
    try:
        endpoints = _endpoints(address)
    except OSError as e:  # the name does not resolve
        return Reach("unreachable", f"cannot resolve it ({e.strerror or e})")
    if endpoints is None:
        return None
    if not endpoints:
        return Reach("unreachable", "its name resolves to no address")
    deadline = time.monotonic() + timeout
    found = []
    for endpoint in endpoints:
        reach = _probe(endpoint, credentials, max(0.05, deadline - time.monotonic()))
        if reach.answers or reach.kind == "tls":
            return reach
        found.append(reach)
    return found[0]


def _endpoints(address: str) -> list[_Endpoint] | None:
    if address.startswith("unix:"):
        path = address[len("unix://"):] if address.startswith("unix://") else address[len("unix:"):]
        return [_Endpoint(socket.AF_UNIX, path, path)]
    if address.startswith(("ipv4:", "ipv6:")):
        return [e for part in address[5:].split(",") for e in _resolved(part)]
    if address.startswith("dns:"):
        rest = address[len("dns:"):]
        if rest.startswith("//"):  # dns://[authority]/host:port
            rest = rest[2:].split("/", 1)[-1]
        return _resolved(rest)
    return _resolved(address) if _is_host_port(address) else None


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit())


def _resolved(host_port: str) -> list[_Endpoint]:
    host, _, port = host_port.rpartition(":")
    host = host.strip("[]")
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    seen, out = set(), []
    for family, _, _, _, sockaddr in infos:
        if sockaddr not in seen:
            seen.add(sockaddr)
            out.append(_Endpoint(family, sockaddr, host_port, host))
    return out


def _probe(endpoint: _Endpoint, credentials: "Credentials", timeout: float) -> Reach:
    sock = socket.socket(endpoint.family, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(endpoint.sockaddr)
        except FileNotFoundError:
            return Reach("no socket", "no socket file there")
        except ConnectionRefusedError:
            what = "a socket file left by a worker that is gone" if endpoint.family == socket.AF_UNIX else \
                "connection refused"
            return Reach("refused", f"nothing listens there ({what})")
        except socket.timeout:
            return Reach("no answer", f"no answer within {timeout:.1g} s (a host that is down, or a firewall)")
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM):
                return Reach("unreachable", "this user may not connect to it")
            return Reach("unreachable", e.strerror or str(e))
        if endpoint.family == socket.AF_UNIX:
            return Reach("answers", "it listens")
        return _tls(sock, endpoint, credentials, timeout)
    finally:
        sock.close()


def _tls(sock: socket.socket, endpoint: _Endpoint, credentials: "Credentials", timeout: float) -> Reach:
    """A TLS handshake as this client's channel makes it (or, for a plain-text client, one that checks nothing,
    to find a worker that speaks TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.set_alpn_protocols(["h2"])
    if credentials.tls:
        if credentials.tls_ca:
            context.load_verify_locations(credentials.tls_ca)
        else:
            context.load_default_certs()
        if credentials.tls_cert and credentials.tls_key:
            context.load_cert_chain(credentials.tls_cert, credentials.tls_key)
    else:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    try:
        tls = context.wrap_socket(sock, server_hostname=endpoint.host or None)
    except ssl.SSLCertVerificationError as e:
        return Reach("tls", _untrusted(e, endpoint))
    except ssl.SSLError as e:
        if not credentials.tls:
            return Reach("answers", "it speaks plain text")
        if e.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"):
            return Reach("tls", "it speaks plain text, not TLS: connect with grpc:// (or start the worker with "
                                "--tls-cert and --tls-key)")
        return Reach("tls", f"the handshake failed ({e.reason or e})")
    except (ConnectionError, socket.timeout, OSError) as e:
        if not credentials.tls:
            return Reach("answers", "it speaks plain text")
        return Reach("tls", f"the connection ended during the handshake ({type(e).__name__}): it may not speak TLS")
    with tls:
        if not credentials.tls:
            return Reach("tls", "it speaks TLS: connect with grpcs:// (and tls_ca where its CA is not a public one)")
        tls.settimeout(READ_S)
        try:
            if tls.recv(1) == b"":  # it closed at once: a certificate it refuses, or one it asks for
                return Reach("tls", _refused_client(credentials))
        except ssl.SSLError as e:
            return Reach("tls", f"{_refused_client(credentials)} ({e.reason or e})")
        except (socket.timeout, OSError):
            pass
    return Reach("answers", "TLS matches")


def _untrusted(e: ssl.SSLCertVerificationError, endpoint: _Endpoint) -> str:
    message = e.verify_message or str(e)
    if "Hostname mismatch" in message or "IP address mismatch" in message:
        return f"its certificate does not name {endpoint.host!r} ({message})"
    return f"its certificate is not trusted ({message}): give tls_ca, the CA that signed it"


def _refused_client(credentials: "Credentials") -> str:
    if credentials.tls_cert:
        return "the worker closed the connection after the handshake: it does not accept this client's certificate"
    return "the worker closed the connection after the handshake: it asks for a client certificate (mutual TLS): " \
           "give tls_cert and tls_key"


# What gRPC's own message says when TLS failed (it names the reason for a certificate it checked, not for a
# peer that spoke plain text or closed the connection).
_TLS_WORDS = ("Tls handshake failed", "SSL_ERROR", "CERTIFICATE_VERIFY_FAILED", "Hostname Verification",
              "ssl_transport_security")


def unreachable(address: str, credentials: "Credentials", said: str, timeout: float = PROBE_S) -> EpWorkerUnavailable:
    """The typed error for a first connection to `address` that failed, gRPC having `said` why: what a probe of
    the address finds, else gRPC's own words."""
    reach = diagnose(address, credentials, timeout)
    if reach is not None and not reach.answers:
        return reach.error(address)
    if any(word in said for word in _TLS_WORDS):
        return EpTlsError(f"TLS with the worker at {address} failed: {said}")
    return EpWorkerUnavailable(f"the worker at {address} did not answer: {said}")
