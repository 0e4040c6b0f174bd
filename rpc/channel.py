"""The client side of every kvcache gRPC link: token metadata, TLS, message-size limits."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import grpc

MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


_Continuation = Callable[[grpc.ClientCallDetails, Any], Any]


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[type-arg]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.StreamStreamClientInterceptor,  # type: ignore[type-arg]
):
    """Adds the bearer token to every call's metadata."""

    def __init__(self, token: str) -> None:
        (self._md,) = token_metadata(token)

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        md = list(details.metadata or [])
        md.append(self._md)
        if hasattr(details, "_replace"):
            return details._replace(metadata=md)  # type: ignore[no-any-return]
        return _CallDetails(
            details.method,
            details.timeout,
            md,
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(
        self, continuation: _Continuation, details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(
        self, continuation: _Continuation, details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(
        self,
        continuation: _Continuation,
        details: grpc.ClientCallDetails,
        request_iterator: Iterator[Any],
    ) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(
        self,
        continuation: _Continuation,
        details: grpc.ClientCallDetails,
        request_iterator: Iterator[Any],
    ) -> Any:
        return continuation(self._details(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(
        self,
        method: str,
        timeout: float | None,
        metadata: Any,
        credentials: Any,
        wait_for_ready: bool | None,
        compression: Any,
    ) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = (
            credentials,
            wait_for_ready,
            compression,
        )


def make_channel(
    address: str, token: str | None = None, tls_ca_file: str | None = None
) -> grpc.Channel:
    if tls_ca_file:
        with open(tls_ca_file, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        channel = grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)
    else:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    if token:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(token))
    return channel


def check_health(channel: grpc.Channel, timeout_s: float = 5.0) -> str:
    """The server's gRPC health ("SERVING", "NOT_SERVING" while it stops, ...), or the status
    code name of the failed check ("UNAVAILABLE": nothing answers there)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.RpcError as e:
        return str(e.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def make_aio_channel(address: str, tls_ca_file: str | None = None) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel with the same limits and TLS as ``make_channel``'s; the token
    goes in each call's metadata (``token_metadata``)."""
    if tls_ca_file:
        with open(tls_ca_file, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        return grpc.aio.secure_channel(address, creds, options=CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that carries ``token`` (what ``make_channel``'s interceptor adds)."""
    return (("authorization", f"Bearer {token}"),) if token else ()
