"""The server side of every kvcache gRPC service, written once: ``serve`` runs a service until
SIGTERM / SIGINT with auth, TLS, health checking, reflection, a Prometheus endpoint and the one
JSON ready line launchers and tests wait for."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
from concurrent import futures
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health

from .channel import CHANNEL_OPTIONS
from .logs import CURRENT, RequestContext
from .open_services import DEFAULT_TIMEOUT_S, OPEN_METHODS, OpenServices

log = logging.getLogger(__name__)


SERVICE = "\x00service"  # the identity of --service-token-file (no tenant name can be it)


@dataclass
class Auth:
    """Bearer tokens -> identities: "" the admin, a tenant's name, or ``SERVICE``: the cluster's
    own services (the conductor's event feeds and transfer hook), which may do only what each
    server lets them (``require_admin(..., service_ok=True)``) and nothing a tenant or the admin
    does. No tokens: auth off and every caller is the admin."""

    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    @classmethod
    def from_args(
        cls, token: str | None, tenants: Iterable[str] = (), service_token: str | None = None
    ) -> "Auth":
        """``--token T`` (admin, tenant "") plus ``--tenant-token TOKEN=TENANT`` entries and the
        ``--service-token-file`` token."""
        tokens: dict[str, str] = {}
        if token:
            tokens[token] = ""
        for item in tenants:
            tok, sep, tenant = item.partition("=")
            if not sep or not tok or not tenant:
                raise ValueError(f"--tenant-token expects TOKEN=TENANT, got {item!r}")
            tokens[tok] = tenant
        if service_token:
            if service_token in tokens:
                raise ValueError("the service token must differ from the admin and tenant tokens")
            tokens[service_token] = SERVICE
        return cls(tokens)

    def check_metadata(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        """The caller's identity, or None when the token is missing or wrong."""
        if not self.enabled:
            return ""
        for key, value in metadata or ():
            if key == "authorization" and value.startswith("Bearer "):
                return self.tokens.get(value[len("Bearer ") :])
        return None

    def identity(self, context: grpc.ServicerContext) -> str:
        """The caller: "" (admin), a tenant, or ``SERVICE``."""
        who = self.check_metadata(context.invocation_metadata())
        if who is None:  # the interceptor already rejected it; belt and braces
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            raise AssertionError("context.abort returned")
        return who

    def tenant(self, context: grpc.ServicerContext) -> str:
        """The caller's tenant ("" the admin); PERMISSION_DENIED for the service identity."""
        who = self.identity(context)
        if who == SERVICE:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "the service token may only read event feeds and submit transfers; this call "
                "needs the admin token or a tenant's",
            )
            raise AssertionError("context.abort returned")
        return who

    def require_admin(
        self, context: grpc.ServicerContext, what: str, service_ok: bool = False
    ) -> None:
        """PERMISSION_DENIED unless the caller holds the admin token (tenant ""), or with
        ``service_ok`` the service token: cluster-wide views and moves of stored, already
        tenant-scoped keys are the operator's (and its services')."""
        who = self.identity(context)
        if who == "" or (service_ok and who == SERVICE):
            return
        context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{what} needs the admin token (--token)"
            + (" or the service token (--service-token-file)" if service_ok else "")
            + ", not a tenant token",
        )
        raise AssertionError("context.abort returned")


class _AuthInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(self, auth: Auth, open_methods: tuple[str, ...] = ()) -> None:
        self._auth = auth
        self._open = OPEN_METHODS + open_methods

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'",
            )

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_unary_rpc_method_handler(deny)
        self._deny_unary_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        if not self._auth.enabled or details.method.startswith(self._open):
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


class _LogContextInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Runs each RPC's handler with its ``rpc.logs.RequestContext`` set, so that its log lines
    carry the request id (the context is built here, the id only when a line is logged)."""

    def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            # NOTE: wrapped, their handlers would lose their own thread pool and Health.Watch
            # its non-blocking form (rpc/open_services.py): each stream would hold an API worker.
            return handler
        method, metadata = details.method, details.invocation_metadata
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                token = CURRENT.set(RequestContext(method, metadata, request))
                try:
                    return inner(request, context)
                finally:
                    CURRENT.reset(token)

            return handler._replace(unary_unary=unary)
        if handler.unary_stream is not None:
            return handler._replace(
                unary_stream=_streaming(handler.unary_stream, method, metadata, True)
            )
        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            def stream_unary(requests: Any, context: grpc.ServicerContext) -> Any:
                token = CURRENT.set(RequestContext(method, metadata))
                try:
                    return inner_su(requests, context)
                finally:
                    CURRENT.reset(token)

            return handler._replace(stream_unary=stream_unary)
        return handler._replace(
            stream_stream=_streaming(handler.stream_stream, method, metadata, False)
        )


def _streaming(inner: Callable[..., Any], method: str, metadata: Any, unary_request: bool) -> Any:
    def replies(request: Any, context: grpc.ServicerContext) -> Iterable[Any]:
        # NOTE: set while the generator runs in the worker that drains it; a stream abandoned
        # and closed from another thread cannot reset it there, and need not.
        token = CURRENT.set(RequestContext(method, metadata, request if unary_request else None))
        try:
            yield from inner(request, context)
        finally:
            try:
                CURRENT.reset(token)
            except ValueError:
                pass

    return replies


@dataclass(frozen=True, kw_only=True)
class TlsConfig:
    cert_file: str
    key_file: str


# NOTE: gRPC sets SO_REUSEPORT by default: a second server (another node of the same user) could
# bind a port already served and take a share of its connections. A port in use is an error.
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]


def make_server(
    auth: Auth,
    max_workers: int = 32,
    max_concurrent_rpcs: int | None = None,
    open_methods: tuple[str, ...] = (),
) -> grpc.Server:
    """A thread-pool server; calls beyond ``max_concurrent_rpcs`` (default 8 per worker) in
    flight are refused with RESOURCE_EXHAUSTED. Without tokens there is no auth interceptor:
    it would only pass every call on."""
    interceptors: list[Any] = [_LogContextInterceptor()]
    if auth.enabled:
        interceptors.append(_AuthInterceptor(auth, open_methods))
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=interceptors,
        options=SERVER_OPTIONS,
        maximum_concurrent_rpcs=max_concurrent_rpcs or max_workers * 8,
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
    server: grpc.Server, service_names: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S
) -> OpenServices:
    """Health checking and reflection (no token needed), on a pool of their own and with their
    streams capped and timed out (rpc/open_services.py); ``.health`` is the health servicer."""
    services = OpenServices(timeout_s)
    services.add_to(server, service_names)
    return services


TOKEN_ENV = "KVCACHE_TOKEN"
INLINE_SECRETS = "inline_secrets"  # the args attribute naming the secrets given inline


class InlineSecret(argparse.Action):
    """A secret given on the command line, where every local user can read it in
    /proc/PID/cmdline: stored (appended with ``nargs="append"``-style ``append=True``) and named
    in ``args.inline_secrets`` for ``warn_inline_secrets``."""

    def __init__(self, *args: Any, append: bool = False, **kwargs: Any) -> None:
        self.append = append
        super().__init__(*args, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if self.append:
            setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), values])
        else:
            setattr(namespace, self.dest, values)
        given = list(getattr(namespace, INLINE_SECRETS, None) or [])
        setattr(namespace, INLINE_SECRETS, [*given, option_string or self.dest])


def warn_inline_secrets(args: argparse.Namespace) -> None:
    """A warning per secret given on the command line (its file form keeps it out of /proc)."""
    for flag in dict.fromkeys(getattr(args, INLINE_SECRETS, None) or []):
        log.warning(
            "%s was given on the command line, where every local user can read it "
            "(/proc/PID/cmdline): give it in a file instead (%s)",
            flag,
            _FILE_FORM.get(flag, f"{flag}-file"),
        )


_FILE_FORM = {"--tenant-token": "--tenant-tokens-file"}


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


def address_arg(text: str) -> str:
    """argparse type of every HOST:PORT option: a missing port is an error, not gRPC's default
    (443), and an IPv6 host goes in brackets."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT (e.g. 127.0.0.1:7000; port 0: any free port), got {text!r}"
        )
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise argparse.ArgumentTypeError(
            f"an IPv6 host goes in brackets, e.g. [{host}]:{port}; got {text!r}"
        )
    return f"{host}:{port}"


def _loopback(host: str) -> bool:
    import ipaddress

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def positive_seconds(text: str) -> float:
    """argparse type: finite seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected finite seconds > 0, got {text!r}")
    return value


def add_server_args(parser: argparse.ArgumentParser, default_listen: str = "127.0.0.1:0") -> None:
    """The options every kvcache server takes."""
    parser.add_argument(
        "--listen",
        default=default_listen,
        type=address_arg,
        help="host:port to serve gRPC on (port 0: pick a free one)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV) or None,
        action=InlineSecret,
        help="require 'authorization: Bearer TOKEN' (admin, tenant ''); visible to local users "
        f"in /proc (a warning says so): prefer --token-file or ${TOKEN_ENV}",
    )
    add_token_file_arg(parser, "--token-file", "token", "the admin token (--token), from a file")
    parser.add_argument(
        "--tenant-token",
        action=InlineSecret,
        append=True,
        default=[],
        metavar="TOKEN=TENANT",
        help="another accepted token and the tenant it maps to (repeatable); visible to local "
        "users in /proc: prefer --tenant-tokens-file",
    )
    add_token_file_arg(
        parser,
        "--service-token-file",
        "service_token",
        "the token of the cluster's own services (the conductor's event feeds and transfer "
        "hook): it may read a node's event feed and submit a messenger's transfers, nothing "
        "else",
    )
    parser.add_argument(
        "--tenant-tokens-file",
        dest="tenant_token",
        action="extend",
        type=read_tenant_tokens,
        metavar="PATH",
        help="TOKEN=TENANT lines (blank lines and # comments ignored), as --tenant-token",
    )
    parser.add_argument(
        "--open-stream-timeout",
        type=positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="a reflection stream (no token needed) whose client sends nothing for this long is "
        "cut, and a Health.Watch lasts at most 4 x this; both run on threads of their own, a "
        "few at a time per client address (default: %(default)s)",
    )
    parser.add_argument(
        "--health-listen",
        default=None,
        type=address_arg,
        help="also serve gRPC health checking alone, in plaintext, on this host:port (for "
        "probes that cannot speak TLS, e.g. Kubernetes' grpc probes; port 0: any free one)",
    )
    parser.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS")
    parser.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics over HTTP on this port (0: any free port)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics endpoint binds (default: %(default)s; 0.0.0.0: every one)",
    )


def tls_from_args(args: Any) -> TlsConfig | None:
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    return TlsConfig(cert_file=args.tls_cert, key_file=args.tls_key) if args.tls_cert else None


def start_metrics(port: int | None, host: str = "127.0.0.1", registry: Any = None) -> int | None:
    """Serve a Prometheus registry (default: the process's) over HTTP; returns the bound port.
    ``OSError`` when the port cannot be bound (in use, not allowed)."""
    if port is None:
        return None
    from prometheus_client import REGISTRY, start_http_server

    server, _thread = start_http_server(port, addr=host, registry=registry or REGISTRY)
    return int(server.server_port)


def add_process_metrics(registry: Any, role: str) -> None:
    """``process_*`` (CPU, memory, open files, start time), ``python_info`` and
    ``kvcache_build_info`` on a service's own registry (the default one has the first two)."""
    from prometheus_client import REGISTRY, Info, PlatformCollector, ProcessCollector

    from .build import build_labels

    if registry is not None and registry is not REGISTRY:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
    Info(
        "kvcache_build",
        "Version of kvcache and of the libraries it serves with",
        registry=registry or REGISTRY,
    ).info({**build_labels(), "role": role})


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
    metrics_host: str = "127.0.0.1"
    registry: Any = None  # prometheus CollectorRegistry
    workers: int = 32
    max_concurrent_rpcs: int | None = None  # default: 8 per worker (see make_server)
    open_stream_timeout_s: float = DEFAULT_TIMEOUT_S  # health / reflection streams
    health_listen: str | None = None  # health alone, plaintext (probes)
    open_methods: tuple[str, ...] = ()  # methods (full names) answered without a token
    # Called once serving at ``address`` (e.g. to register with a conductor); returns the
    # extra fields of the ready line.
    on_serving: Callable[[str, int | None], dict[str, Any]] = lambda address, mport: {}
    on_stopping: Callable[[], None] = lambda: None  # before the server drains
    # Given the health servicer before the server starts (e.g. to report a standby's
    # service NOT_SERVING while the process itself is healthy).
    on_health: Callable[[health.HealthServicer], None] = lambda servicer: None
    close: Callable[[], None] = lambda: None  # after it stopped, or when bind failed


def serve(service: Service) -> int:
    """Bind, start, announce ready, wait for SIGTERM / SIGINT, then stop cleanly (health goes
    NOT_SERVING, ``on_stopping``, 2 s grace for calls in flight, ``close``). Returns 0."""
    server = make_server(
        service.auth, service.workers, service.max_concurrent_rpcs, service.open_methods
    )
    open_services = add_health_and_reflection(
        server, service.add(server), service.open_stream_timeout_s
    )
    health_servicer = open_services.health
    service.on_health(health_servicer)
    try:
        port = bind(server, service.listen, service.tls)
    except (OSError, RuntimeError) as e:
        open_services.close()
        service.close()
        raise SystemExit(
            f"kvcache {service.role}: cannot listen on {service.listen}: {e}"
        ) from None
    if service.metrics_port is not None:
        add_process_metrics(service.registry, service.role)
    try:
        metrics_port = start_metrics(service.metrics_port, service.metrics_host, service.registry)
    except OSError as e:
        server.stop(0)
        open_services.close()
        service.close()
        raise SystemExit(
            f"kvcache {service.role}: cannot serve metrics on "
            f"{service.metrics_host}:{service.metrics_port}: {e.strerror or e} (--metrics-port: "
            "another port, or 0 for any free one)"
        ) from None
    health_port = None
    if service.health_listen:
        try:
            _, health_port = open_services.serve_health_alone(service.health_listen)
        except (OSError, RuntimeError) as e:
            server.stop(0)
            open_services.close()
            service.close()
            raise SystemExit(
                f"kvcache {service.role}: cannot serve health on {service.health_listen}: {e}"
            ) from None
    server.start()
    address = f"{host_of(service.listen)}:{port}"
    if not service.auth.enabled and not _loopback(host_of(service.listen)):
        log.warning(
            "%s serves %s without a token: every caller who reaches it is the admin (give "
            "--token-file and --tenant-tokens-file; --tls-cert for the network)",
            service.role,
            address,
        )
    fields = service.on_serving(address, metrics_port)
    if service.health_listen and health_port is not None:
        fields = {**fields, "health_address": f"{host_of(service.health_listen)}:{health_port}"}

    def stop() -> None:
        health_servicer.enter_graceful_shutdown()
        service.on_stopping()
        server.stop(grace=2).wait()
        open_services.close()
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
