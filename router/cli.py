"""``kvcache router``: the OpenAI-compatible front end of a cluster (uvicorn), serving each request
disaggregated (prefill and decode engines) or aggregated (one engine, chosen by cache and load).

    kvcache router --cluster out/serve/cluster.json --listen 127.0.0.1:8000
    kvcache router --conductor 127.0.0.1:7200 --engine prefill-0=http://127.0.0.1:8101 \\
        --engine decode-0=http://127.0.0.1:8102 --token-file TOKEN

Prints one JSON line ``{"event": "ready", "role": "router", "address": ...}`` once it serves
(``--listen HOST:0`` picks a free port) and stops cleanly on SIGTERM / Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
from typing import Any

from conductor.policies import POLICIES
from rpc.server import TOKEN_ENV, InlineSecret, add_token_file_arg, announce_ready

from .disagg import MODES, RouterOptions
from .engines import Engine, EngineTimeouts

log = logging.getLogger("kvcache.router")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen", default="127.0.0.1:8000", help="host:port for HTTP (port 0: a free one)"
    )
    parser.add_argument(
        "--cluster",
        default=None,
        help="a 'kvcache up' state file (cluster.json): conductor, token, TLS CA and engines "
        "from it (flags given as well win)",
    )
    parser.add_argument(
        "--conductor",
        default=None,
        help="the conductor's gRPC host:port (several, comma-separated: a standby redirects to "
        "the leader)",
    )
    parser.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="NODE_ID=URL",
        help="the vLLM engine serving beside node NODE_ID, e.g. prefill-0=http://127.0.0.1:8101 "
        "(repeatable; one per node)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV) or None,
        action=InlineSecret,
        help=f"the cluster's admin token (Schedule, messenger transfers); also ${TOKEN_ENV}",
    )
    add_token_file_arg(parser, "--token-file", "token", "the cluster's token, from a file")
    parser.add_argument("--tls-ca", default=None, help="CA (PEM) of a cluster serving TLS")
    parser.add_argument(
        "--api-key",
        default=None,
        action=InlineSecret,
        help="require 'Authorization: Bearer KEY' from HTTP clients (/v1/*)",
    )
    add_token_file_arg(parser, "--api-key-file", "api_key", "--api-key, from a file")
    add_token_file_arg(
        parser,
        "--admin-key-file",
        "admin_key",
        "the operator's key (a file): 'Authorization: Bearer KEY' with it is served as with "
        "the API key, and sees what --debug-headers shows",
    )
    parser.add_argument(
        "--debug-headers",
        action="store_true",
        help="show the operator (--admin-key-file; with no key at all, every caller) where a "
        "request ran and how much of its prompt was cached: the x-kvcache-* headers and the "
        "usage's cached tokens. Off by default: they tell any caller whether a guessed prompt "
        "is cached, so other users' prompts could be recovered block by block",
    )
    parser.add_argument(
        "--namespace",
        default=None,
        help="the layout namespace (default: the one nodes serve; of several, the one of the "
        "model the engines serve)",
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="disaggregated",
        help="disaggregated: a prefill node's engine computes the prompt, a decode node's "
        "generates; aggregated: one node of role both does both, chosen by the conductor by "
        "cache hit and load (default %(default)s)",
    )
    parser.add_argument(
        "--disaggregate-above",
        type=int,
        default=0,
        metavar="TOKENS",
        help="with --mode aggregated: a request whose uncached prompt suffix on the chosen node "
        "is longer than this is served disaggregated instead (default 0: never)",
    )
    parser.add_argument(
        "--policy",
        default="",
        choices=["", *sorted(POLICIES)],
        help="the conductor's scheduling policy for this router's requests (e.g. load, "
        "round-robin; default: the conductor's --policy)",
    )
    parser.add_argument(
        "--connection-per-request",
        action="store_true",
        help="connect to an engine anew for every request instead of keeping connections "
        "alive (for comparison: slower)",
    )
    parser.add_argument(
        "--ttft-slo",
        type=float,
        default=0.0,
        help="TTFT SLO in seconds for requests that name none (0: none); a request the "
        "conductor cannot place within it gets HTTP 429",
    )
    parser.add_argument("--tbt-slo", type=float, default=0.0, help="TBT SLO (0: none)")
    parser.add_argument(
        "--transfer-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for a page transfer between nodes (default %(default)s)",
    )
    parser.add_argument(
        "--engine-timeout",
        type=float,
        default=120.0,
        help="seconds an engine may stay silent: a prefill, a stream's headers, or between "
        "two streamed events (default %(default)s)",
    )
    parser.add_argument(
        "--decode-timeout",
        type=float,
        default=3600.0,
        help="seconds a non-streamed completion may take in all: its engine sends nothing "
        "until the last token, so --engine-timeout does not apply to it (0: no limit; an "
        "engine that dies ends it at once; default %(default)s)",
    )
    parser.add_argument(
        "--max-inflight",
        type=int,
        default=256,
        help="completions served at once; more are answered 429 at once (default %(default)s)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=1,
        help="times a request is sent again, on other nodes, when an engine did not take it "
        "(refused the connection or answered 503; default %(default)s)",
    )
    parser.add_argument(
        "--retry-backoff",
        type=float,
        default=1.0,
        help="seconds before a retry: the conductor learns meanwhile that the engine is gone "
        "(default %(default)s)",
    )


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise SystemExit(f"kvcache router: --listen needs HOST:PORT, got {value!r}")
    return host, int(port)


def _engines(specs: list[str]) -> list[Engine]:
    engines = []
    for spec in specs:
        node, sep, url = spec.partition("=")
        if not sep or not node or not url.startswith(("http://", "https://")):
            raise SystemExit(
                f"kvcache router: --engine needs NODE_ID=http://HOST:PORT, got {spec!r}"
            )
        engines.append(Engine(node, url.rstrip("/")))
    if len({e.node for e in engines}) != len(engines):
        raise SystemExit("kvcache router: one --engine per node id")
    return engines


def _from_cluster(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        return {
            "conductor": state["conductor"]["address"],
            "token": state.get("token"),
            "tls_ca": state.get("tls_ca"),
            "engines": [f"{e['node']}={e['url']}" for e in state.get("engines", [])],
        }
    except OSError as e:
        raise SystemExit(f"kvcache router: cannot read --cluster {path}: {e.strerror}") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise SystemExit(f"kvcache router: {path} is not a 'kvcache up' state file ({e})") from None


def options_from_args(args: argparse.Namespace) -> RouterOptions:
    found = _from_cluster(args.cluster) if args.cluster else {}
    conductor = args.conductor or found.get("conductor")
    engines = _engines(args.engine or found.get("engines", []))
    if not conductor:
        raise SystemExit("kvcache router: give --conductor ADDR (or --cluster cluster.json)")
    if not engines:
        raise SystemExit(
            "kvcache router: give an --engine NODE_ID=URL per engine (or --cluster with engines)"
        )
    for name in ("ttft_slo", "tbt_slo"):
        if not getattr(args, name) >= 0:
            raise SystemExit(f"kvcache router: --{name.replace('_', '-')} must be >= 0")
    for name in ("transfer_timeout", "engine_timeout"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"kvcache router: --{name.replace('_', '-')} must be positive")
    if args.retries < 0 or not args.retry_backoff >= 0:
        raise SystemExit("kvcache router: --retries and --retry-backoff must be >= 0")
    if not args.decode_timeout >= 0:
        raise SystemExit("kvcache router: --decode-timeout must be >= 0 (0: no limit)")
    if args.max_inflight < 1:
        raise SystemExit("kvcache router: --max-inflight must be at least 1")
    if args.disaggregate_above < 0:
        raise SystemExit("kvcache router: --disaggregate-above must be >= 0 (0: never)")
    if args.disaggregate_above and args.mode != "aggregated":
        raise SystemExit("kvcache router: --disaggregate-above needs --mode aggregated")
    return RouterOptions(
        conductor=conductor,
        engines=tuple(engines),
        token=args.token or found.get("token"),
        tls_ca=args.tls_ca or found.get("tls_ca"),
        namespace=args.namespace,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        transfer_timeout_s=args.transfer_timeout,
        retries=args.retries,
        retry_backoff_s=args.retry_backoff,
        timeouts=EngineTimeouts(read_s=args.engine_timeout, decode_s=args.decode_timeout),
        max_inflight=args.max_inflight,
        mode=args.mode,
        disaggregate_above=args.disaggregate_above,
        policy=args.policy,
        pooled=not args.connection_per_request,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import RouterApp

    options = options_from_args(args)
    host, port = _listen(args.listen)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        raise SystemExit(f"kvcache router: cannot listen on {args.listen}: {e.strerror}") from None
    sock.listen(1024)
    address = f"{host}:{sock.getsockname()[1]}"
    if args.debug_headers and args.api_key and not args.admin_key:
        raise SystemExit(
            "kvcache router: --debug-headers needs --admin-key-file when --api-key is set: the "
            "headers are the operator's, not every API client's"
        )
    app = RouterApp(
        options, api_key=args.api_key, admin_key=args.admin_key, debug_headers=args.debug_headers
    )

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                log.info(
                    "router serving on http://%s (conductor %s, engines %s)",
                    address,
                    options.conductor,
                    ", ".join(f"{e.node}={e.url}" for e in options.engines),
                )
                announce_ready("router", address=address, pid=os.getpid())

    config = uvicorn.Config(
        app,
        log_level=args.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    Server(config).run(sockets=[sock])
    return 0
