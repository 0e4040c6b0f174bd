"""Health checking and reflection, the services every kvcache server answers without a token,
served so that nobody can starve the API through them.

Load balancers, probes and grpcurl reach them before any credential, so they are the first
thing an attacker who reaches a port can use. A sync gRPC server runs a stream on one worker of
its pool for the stream's whole life: idle reflection streams (and Health.Watch streams, when
an interceptor turns them into blocking generators) used to take every worker of a node,
conductor or messenger, and authenticated calls of every tenant timed out. Here:

- both services run on a small thread pool of their own (``experimental_thread_pool``), never
  on the API's workers, and ``Health.Watch`` is non-blocking: a watch holds no thread at all
  between status changes;
- their streams are capped (at most ``max_streams`` at once, half of them per peer address);
  one more is refused at once with RESOURCE_EXHAUSTED;
- a reflection stream whose client sends nothing for ``timeout_s`` is cut (DEADLINE_EXCEEDED),
  and a Health.Watch lasts at most ``4 x timeout_s`` (its client watches again).
"""

from __future__ import annotations

from concurrent import futures
from typing import Any, Iterator, Sequence

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from kvstore.errors import CapacityExhausted

from .streams import StreamGate, StreamIdle

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
OPEN_METHODS = (f"/{HEALTH_SERVICE}/", "/grpc.reflection.")
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_STREAMS = 8
_WATCH_LIFETIMES = 4  # a Health.Watch lasts this many timeouts


class OpenServices:
    """The health servicer (``.health``, for ``set`` / graceful shutdown) and the reflection
    service of one server, on their own pool, their streams gated."""

    def __init__(
        self, timeout_s: float = DEFAULT_TIMEOUT_S, max_streams: int = DEFAULT_MAX_STREAMS
    ) -> None:
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"--open-stream-timeout must be finite seconds > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        # Threads for reflection streams (each holds one while open) and unary health checks.
        self.pool = futures.ThreadPoolExecutor(
            max_workers=max_streams + 2, thread_name_prefix="grpc-open"
        )
        per_peer = max(1, max_streams // 2)
        self.reflection_gate = StreamGate(
            "reflection", max_streams, timeout_s, per_peer_limit=per_peer
        )
        # NOTE: watches hold no thread; the cap bounds the servicer's callbacks and the gate.
        self.watch_gate = StreamGate(
            "Health.Watch",
            4 * max_streams,
            timeout_s,
            per_peer_limit=2 * max_streams,
            max_lifetime_s=_WATCH_LIFETIMES * timeout_s,
        )
        self.health = _GatedHealth(self.watch_gate, self.pool)
        self._alone: grpc.Server | None = None  # serve_health_alone's server

    def add_to(self, server: grpc.Server, service_names: Sequence[str]) -> None:
        names = [*service_names, HEALTH_SERVICE, reflection.SERVICE_NAME]
        for name in [*service_names, ""]:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        _add_health(server, self.health, self.pool)
        servicer = reflection.ReflectionServicer(names)
        _add_reflection(server, servicer, self.reflection_gate, self.pool)

    def serve_health_alone(self, address: str) -> tuple[grpc.Server, int]:
        """A second, plaintext server on ``address`` with this health service only (its own
        threads, no token, nothing else to reach): what probes that cannot speak TLS ask."""
        server = grpc.server(
            futures.ThreadPoolExecutor(2, thread_name_prefix="grpc-health"),
            options=[("grpc.so_reuseport", 0)],  # a port in use is an error (rpc/server.py)
        )
        _add_health(server, self.health, self.pool)
        port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot listen on {address}")
        server.start()
        self._alone = server
        return server, port

    def close(self) -> None:
        if self._alone is not None:
            self._alone.stop(0)
        self.reflection_gate.close()
        self.watch_gate.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


class _GatedHealth(health.HealthServicer):
    """grpc's health servicer, its non-blocking Watch capped and given a lifetime."""

    def __init__(self, gate: StreamGate, pool: futures.ThreadPoolExecutor) -> None:
        # NOTE: the base class marks ``self.Watch.__func__`` (this class's Watch) non-blocking.
        super().__init__(experimental_non_blocking=True, experimental_thread_pool=pool)
        self._gate = gate

    def Watch(self, request: Any, context: Any, send_response_callback: Any = None) -> Any:
        watch = self._gate.enter("Health.Watch", context)  # CapacityExhausted: refused
        context.add_callback(lambda: self._gate.leave(watch))
        return super().Watch(request, context, send_response_callback)


def _refuse(context: grpc.ServicerContext, e: CapacityExhausted) -> None:
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))


def _add_health(
    server: grpc.Server, servicer: _GatedHealth, pool: futures.ThreadPoolExecutor
) -> None:
    def check(request: Any, context: grpc.ServicerContext) -> Any:
        return servicer.Check(request, context)

    def watch(request: Any, context: grpc.ServicerContext, send_response_callback: Any) -> Any:
        try:
            return servicer.Watch(request, context, send_response_callback)
        except CapacityExhausted as e:
            _refuse(context, e)

    check.experimental_thread_pool = pool  # type: ignore[attr-defined]
    watch.experimental_thread_pool = pool  # type: ignore[attr-defined]
    watch.experimental_non_blocking = True  # type: ignore[attr-defined]
    req, rep = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
    handlers = {
        "Check": grpc.unary_unary_rpc_method_handler(
            check, request_deserializer=req.FromString, response_serializer=rep.SerializeToString
        ),
        "Watch": grpc.unary_stream_rpc_method_handler(
            watch, request_deserializer=req.FromString, response_serializer=rep.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(HEALTH_SERVICE, handlers),)
    )


def _add_reflection(
    server: grpc.Server,
    servicer: reflection.ReflectionServicer,
    gate: StreamGate,
    pool: futures.ThreadPoolExecutor,
) -> None:
    def info(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            stream = gate.enter("ServerReflectionInfo", context)
        except CapacityExhausted as e:
            _refuse(context, e)
            return
        try:
            replies: Iterator[Any] = servicer.ServerReflectionInfo(  # type: ignore[func-returns-value,assignment]
                stream.receive(requests), context
            )
            yield from stream.send(replies)
        except StreamIdle:
            return  # cut by the gate: the client already has DEADLINE_EXCEEDED
        finally:
            gate.leave(stream)

    info.experimental_thread_pool = pool  # type: ignore[attr-defined]
    handler = grpc.stream_stream_rpc_method_handler(
        info,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                reflection.SERVICE_NAME, {"ServerReflectionInfo": handler}
            ),
        )
    )
