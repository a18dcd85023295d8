"""Transport security of a worker: TLS (and mutual TLS) credentials for TCP listeners, and an optional bearer
token every call must carry, compared in constant time. A missing or wrong token is UNAUTHENTICATED and says
nothing else. grpc.health.v1 stays open, so that probes need no secret."""
from __future__ import annotations

import hmac
from dataclasses import dataclass

import grpc

from ephost import wire
from ephost.errors import EpInvalidArgument

AUTH_KEY = "authorization"
OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # probes need no secret


@dataclass(frozen=True)
class Security:
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    token_file: str | None = None

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.tls_cert and self.tls_key):
            raise SystemExit("ephost worker: TLS needs both --tls-cert and --tls-key")
        pair = (_read(self.tls_key), _read(self.tls_cert))
        if self.tls_client_ca:
            return grpc.ssl_server_credentials([pair], root_certificates=_read(self.tls_client_ca),
                                               require_client_auth=True)
        return grpc.ssl_server_credentials([pair])

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        if not self.token_file:
            return []
        token = _read(self.token_file).decode().strip()
        if not token:
            raise SystemExit("ephost worker: the token file is empty")
        return [TokenInterceptor(token)]


def _read(path: str) -> bytes:
    try:
        return wire.read_file(path)
    except EpInvalidArgument as e:
        raise SystemExit(f"ephost worker: {e}") from None


class TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

        self._deny = deny

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_SERVICES):
            return continuation(handler_call_details)
        given = next((v for k, v in handler_call_details.invocation_metadata or () if k == AUTH_KEY), "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return grpc.unary_unary_rpc_method_handler(self._deny, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)
