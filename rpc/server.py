"""The server side of every kvcache gRPC service, written once: ``serve`` runs a service until
SIGTERM / SIGINT with auth, TLS, health checking, reflection, a Prometheus endpoint and the one
JSON ready line launchers and tests wait for."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from concurrent import futures
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .channel import CHANNEL_OPTIONS

log = logging.getLogger(__name__)

_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass
class Auth:
    """Bearer tokens -> tenant names. No tokens: auth off and every caller is tenant ``""``."""

    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    @classmethod
    def from_args(cls, token: str | None, tenants: Iterable[str] = ()) -> "Auth":
        """``--token T`` (admin, tenant "") plus ``--tenant-token TOKEN=TENANT`` entries."""
        tokens: dict[str, str] = {}
        if token:
            tokens[token] = ""
        for item in tenants:
            tok, sep, tenant = item.partition("=")
            if not sep or not tok or not tenant:
                raise ValueError(f"--tenant-token expects TOKEN=TENANT, got {item!r}")
            tokens[tok] = tenant
        return cls(tokens)

    def check_metadata(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        """The caller's tenant, or None when the token is missing or wrong."""
        if not self.enabled:
            return ""
        for key, value in metadata or ():
            if key == "authorization" and value.startswith("Bearer "):
                return self.tokens.get(value[len("Bearer ") :])
        return None

    def tenant(self, context: grpc.ServicerContext) -> str:
        tenant = self.check_metadata(context.invocation_metadata())
        if tenant is None:  # the interceptor already rejected it; belt and braces
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            raise AssertionError("context.abort returned")
        return tenant

    def require_admin(self, context: grpc.ServicerContext, what: str) -> None:
        """PERMISSION_DENIED unless the caller holds the admin token (tenant ""): cluster-wide
        views and moves of stored, already tenant-scoped keys are the operator's."""
        if self.tenant(context) != "":
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{what} needs the admin token (--token), not a tenant token",
            )
            raise AssertionError("context.abort returned")


class _AuthInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(self, auth: Auth) -> None:
        self._auth = auth

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'",
            )

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_unary_rpc_method_handler(deny)
        self._deny_unary_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        if not self._auth.enabled or details.method.startswith(_OPEN_METHODS):
            return continuation(details)
        if self._auth.check_metadata(details.invocation_metadata) is not None:
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        if handler.request_streaming:
            return self._deny_stream
        if handler.response_streaming:
            return self._deny_unary_stream
        return self._deny_unary


@dataclass(frozen=True, kw_only=True)
class TlsConfig:
    cert_file: str
    key_file: str


def make_server(auth: Auth, max_workers: int = 32) -> grpc.Server:
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=[_AuthInterceptor(auth)],
        options=CHANNEL_OPTIONS,
        maximum_concurrent_rpcs=max_workers * 8,
    )


def bind(server: grpc.Server, address: str, tls: TlsConfig | None = None) -> int:
    """Bind ``address`` (``host:0`` picks a free port); returns the port."""
    if tls is not None:
        with open(tls.key_file, "rb") as f:
            key = f.read()
        with open(tls.cert_file, "rb") as f:
            cert = f.read()
        port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return port


def add_health_and_reflection(
    server: grpc.Server, service_names: Sequence[str]
) -> health.HealthServicer:
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in [*service_names, ""]:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    names = [
        *service_names,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    ]
    reflection.enable_server_reflection(names, server)
    return servicer


TOKEN_ENV = "KVCACHE_TOKEN"


def read_secret(path: str) -> str:
    """argparse type: a token kept in a file (the first line), so that it is not on the command
    line, which every local user can read in /proc/PID/cmdline."""
    try:
        with open(path) as f:
            text = f.readline().strip()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read token file {path}: {e.strerror}") from None
    if not text:
        raise argparse.ArgumentTypeError(f"token file {path} is empty")
    return text


def read_tenant_tokens(path: str) -> list[str]:
    """argparse type: ``TOKEN=TENANT`` lines of a file, checked as --tenant-token is."""
    try:
        with open(path) as f:
            lines = [ln.strip() for ln in f]
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"cannot read tenant tokens {path}: {e.strerror}"
        ) from None
    items = [ln for ln in lines if ln and not ln.startswith("#")]
    for n, item in enumerate(items, 1):
        tok, sep, tenant = item.partition("=")
        if not sep or not tok or not tenant:
            raise argparse.ArgumentTypeError(
                f"{path}: entry {n} is not TOKEN=TENANT (the token is not echoed)"
            )
    return items


def add_token_file_arg(parser: argparse.ArgumentParser, flag: str, dest: str, what: str) -> None:
    """``flag PATH``: read the token for ``dest`` from a file (see ``read_secret``)."""
    parser.add_argument(flag, dest=dest, type=read_secret, metavar="PATH", help=what)


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0]


def add_server_args(parser: argparse.ArgumentParser, default_listen: str = "127.0.0.1:0") -> None:
    """The options every kvcache server takes."""
    parser.add_argument(
        "--listen",
        default=default_listen,
        help="host:port to serve gRPC on (port 0: pick a free one)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV) or None,
        help="require 'authorization: Bearer TOKEN' (admin, tenant ''); visible to local users "
        f"in /proc: prefer --token-file or ${TOKEN_ENV}",
    )
    add_token_file_arg(parser, "--token-file", "token", "the admin token (--token), from a file")
    parser.add_argument(
        "--tenant-token",
        action="append",
        default=[],
        metavar="TOKEN=TENANT",
        help="another accepted token and the tenant it maps to (repeatable)",
    )
    parser.add_argument(
        "--tenant-tokens-file",
        dest="tenant_token",
        action="extend",
        type=read_tenant_tokens,
        metavar="PATH",
        help="TOKEN=TENANT lines (blank lines and # comments ignored), as --tenant-token",
    )
    parser.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS")
    parser.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics over HTTP on this port (0: any free port)",
    )


def tls_from_args(args: Any) -> TlsConfig | None:
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    return TlsConfig(cert_file=args.tls_cert, key_file=args.tls_key) if args.tls_cert else None


def start_metrics(port: int | None, host: str = "127.0.0.1", registry: Any = None) -> int | None:
    """Serve a Prometheus registry (default: the process's) over HTTP; returns the bound port."""
    if port is None:
        return None
    from prometheus_client import REGISTRY, start_http_server

    server, _thread = start_http_server(port, addr=host, registry=registry or REGISTRY)
    return int(server.server_port)


def announce_ready(role: str, **fields: Any) -> None:
    """Print the one JSON line launchers and tests wait for: {"event": "ready", "role": ...}."""
    print(json.dumps({"event": "ready", "role": role, **fields}), flush=True)
    sys.stdout.flush()


def _note_signal(signum: int, frame: FrameType | None) -> None:
    """Installed so that SIGTERM / SIGINT reach the wakeup fd instead of their default action."""


def wait_for_signal(stop: Callable[[], None], on_ready: Callable[[], None] | None = None) -> None:
    """Block until SIGTERM or SIGINT, then call ``stop`` once. ``on_ready`` runs once the
    handlers are installed (e.g. to tell the user Ctrl-C now stops cleanly)."""
    # NOTE: the signal arrives through a wakeup fd, written by Python's C-level handler in
    # whichever thread the kernel picked: the main thread may never be interrupted (a gRPC or
    # server thread took the signal), and a lock taken in a Python handler (threading.Event.set)
    # deadlocks when a second signal lands while the main thread holds it, which is what Ctrl-C
    # does to a launcher's children: SIGINT to the whole process group, then SIGTERM from it.
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.signal(signal.SIGTERM, _note_signal)
    signal.signal(signal.SIGINT, _note_signal)
    previous = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    try:
        if on_ready is not None:
            on_ready()
        signum = os.read(rfd, 1)[0]
        # Later signals are ignored, also while Python finalizes (it restores the default action
        # of handled signals then, and one arriving would end the process "killed by SIGTERM").
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    finally:
        signal.set_wakeup_fd(previous)
        os.close(rfd)
        os.close(wfd)
    log.info("signal %s: shutting down", signal.Signals(signum).name)
    stop()


@dataclass(kw_only=True)
class Service:
    """What ``serve`` runs: one process's gRPC services and its life-cycle hooks."""

    role: str  # "node", "conductor", "messenger"
    listen: str
    auth: Auth
    tls: TlsConfig | None
    add: Callable[[grpc.Server], Sequence[str]]  # adds servicers, returns service names
    metrics_port: int | None = None
    registry: Any = None  # prometheus CollectorRegistry
    workers: int = 32
    # Called once serving at ``address`` (e.g. to register with a conductor); returns the
    # extra fields of the ready line.
    on_serving: Callable[[str, int | None], dict[str, Any]] = lambda address, mport: {}
    on_stopping: Callable[[], None] = lambda: None  # before the server drains
    close: Callable[[], None] = lambda: None  # after it stopped, or when bind failed


def serve(service: Service) -> int:
    """Bind, start, announce ready, wait for SIGTERM / SIGINT, then stop cleanly (health goes
    NOT_SERVING, ``on_stopping``, 2 s grace for calls in flight, ``close``). Returns 0."""
    server = make_server(service.auth, max_workers=service.workers)
    health_servicer = add_health_and_reflection(server, service.add(server))
    try:
        port = bind(server, service.listen, service.tls)
    except (OSError, RuntimeError) as e:
        service.close()
        raise SystemExit(
            f"kvcache {service.role}: cannot listen on {service.listen}: {e}"
        ) from None
    server.start()
    address = f"{host_of(service.listen)}:{port}"
    # NOTE: metrics on the gRPC host: loopback stays loopback, a pod's or a host's address is
    # where its Prometheus scrapes.
    metrics_port = start_metrics(
        service.metrics_port, host=host_of(service.listen).strip("[]"), registry=service.registry
    )
    fields = service.on_serving(address, metrics_port)

    def stop() -> None:
        health_servicer.enter_graceful_shutdown()
        service.on_stopping()
        server.stop(grace=2).wait()
        service.close()
        log.info("%s stopped", service.role)

    # Ready only once SIGTERM is handled: a stop sent right after the ready line must clean up
    # (shared memory, lmdb sync), not kill the process with the default action.
    wait_for_signal(
        stop,
        on_ready=lambda: announce_ready(
            service.role, address=address, pid=os.getpid(), metrics_port=metrics_port, **fields
        ),
    )
    return 0
