"""``kvcache conductor``: the global scheduler as a gRPC server.

Prints one JSON line ``{"event": "ready", "role": "conductor", "address": ...}`` once it serves
(``--listen 127.0.0.1:0`` picks a free port; read it from that line).

With ``--etcd URLS`` it learns the nodes from etcd (``membership_watch.py``) and runs for leader
(``leader.py``); several such conductors make one leader and hot standbys. Health: the process
("") is SERVING while it runs; the ConductorService only while it leads.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import socket
import time
from dataclasses import dataclass, replace
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from kvstore.errors import KVStoreError
from node.config import parse_layout
from plumbing.etcd import EtcdClient
from plumbing.registration import (
    ConductorRecord,
    add_etcd_args,
    election_name,
    etcd_settings,
    etcd_tls,
    nodes_prefix,
)
from proto import conductor_pb2_grpc as pbg
from rpc.server import (
    Auth,
    InlineSecret,
    Service,
    add_server_args,
    add_token_file_arg,
    address_arg,
    serve,
    tls_from_args,
)

from .core import Conductor
from .costmodel import CostModel, FlopsCostModel, HardwareSpec, fit_prefill
from .engine_load import EngineLoadFeed, parse_engine_metrics
from .feed import FeedOptions
from .leader import EtcdLeadership
from .membership_watch import EtcdMembership
from .messenger_hook import make_transfer_hook
from .metrics import ConductorMetrics
from .registry import DEFAULT_LEASE_S
from .scheduler import POLICIES, SchedulerConfig
from .service import DEFAULT_MAX_CONTEXT_TOKENS, SERVICE_NAME, ConductorServicer
from .transfer import RecordingTransferHook, TransferHook
from .vllm_events import VllmEventFeed, parse_vllm_events

log = logging.getLogger("kvcache.conductor")
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DEFAULT_WORKERS = 4
# NOTE: every node's heartbeats and every front end's calls may arrive at once; a few handler
# threads serve them in turn (kvcache bench conductor), so the limit is not tied to the threads.
MAX_CONCURRENT_RPCS = 1024
DEFAULT_MAX_PENDING_PER_TENANT = 1024


def configure(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser)
    parser.add_argument(
        "--policy",
        default="global-cache",
        choices=sorted(POLICIES),
        help="scheduling policy (default: global-cache, Mooncake Algorithm 1)",
    )
    parser.add_argument(
        "--lease",
        type=float,
        default=DEFAULT_LEASE_S,
        help=f"node lease in seconds (default {DEFAULT_LEASE_S:g}); nodes heartbeat every lease/4",
    )
    parser.add_argument(
        "--node-token",
        default=None,
        action=InlineSecret,
        help="admin token for the nodes' Events streams (default: --token)",
    )
    add_token_file_arg(parser, "--node-token-file", "node_token", "--node-token, from a file")
    parser.add_argument(
        "--node-tls-ca", default=None, help="CA certificate (PEM) to verify nodes serving TLS"
    )
    parser.add_argument(
        "--mfu",
        type=float,
        default=HardwareSpec().mfu,
        help="prefill model-FLOPs utilisation of the default cost model "
        "(LLaMA3-70B on 8xA800, Mooncake Table 1)",
    )
    parser.add_argument(
        "--nic-gbps",
        type=float,
        default=HardwareSpec().nic_gbps,
        help="per-node network bandwidth for KV transfers, Gbit/s",
    )
    parser.add_argument(
        "--cost-samples",
        default=None,
        metavar="CSV",
        help="fit the prefill cost model to measured samples: CSV rows of "
        "tokens,prefix_tokens,seconds",
    )
    parser.add_argument(
        "--refit-every",
        type=int,
        default=16,
        metavar="N",
        help="refit the cost model to what is measured: its prefill part after every N new "
        "prefill times (reported with Complete, or read from --engine-metrics), its transfer "
        "and decode-step lines after every N/4 transfer waits (Complete) and inter-token "
        "latencies (--engine-metrics); a transfer is planned only when its measured cost pays "
        "(default %(default)s; 0: never, the model stays as given)",
    )
    parser.add_argument(
        "--min-transfer-gain",
        type=float,
        default=SchedulerConfig().min_transfer_gain,
        help="fetch a prefix from another node only when it cuts the estimated "
        "TTFT by at least this fraction (default %(default)s)",
    )
    parser.add_argument(
        "--max-context-tokens",
        type=int,
        default=DEFAULT_MAX_CONTEXT_TOKENS,
        help="largest prompt_tokens + output_tokens a Schedule may claim (INVALID_ARGUMENT "
        "beyond; also at most 65536 blocks of the layout) (default %(default)s)",
    )
    parser.add_argument(
        "--max-pending-per-tenant",
        type=int,
        default=DEFAULT_MAX_PENDING_PER_TENANT,
        help="requests one tenant may have scheduled and not completed; more are refused with "
        "RESOURCE_EXHAUSTED (0: no limit; default %(default)s)",
    )
    parser.add_argument(
        "--pending-timeout",
        type=float,
        default=SchedulerConfig().stale_after_s,
        metavar="SECONDS",
        help="a scheduled request never completed leaves the ledger (and the queue estimates) "
        "this long after it was scheduled, plus its estimated TTFT, at most as long again "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--transfer-hook",
        default="auto",
        choices=["auto", "messenger", "record"],
        help="what to do with plans that move blocks to a non-holder (default "
        "and messenger: ask the destination's messenger; record: only "
        "return them in Schedule replies)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=DEFAULT_WORKERS,
        help=f"gRPC handler threads (default {DEFAULT_WORKERS}; Python runs one at a time, so "
        "more threads mostly add GIL hand-offs); calls beyond them wait, up to "
        f"{MAX_CONCURRENT_RPCS} in flight",
    )
    parser.add_argument(
        "--max-streams",
        type=int,
        default=None,
        help="ScheduleStream calls served at once (default half of --workers: each holds a "
        "handler thread while open; past it a stream is refused and its client goes unary; 0: "
        "none)",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the random policy")
    parser.add_argument(
        "--vllm-events",
        action="append",
        default=[],
        metavar="ENDPOINT[,REPLAY]=NODE_ID",
        help="subscribe to a vLLM engine's KV events (ZMQ, kv_events_config) and route by the "
        "blocks in its own cache; REPLAY: its replay endpoint, to fill gaps (repeatable)",
    )
    parser.add_argument(
        "--vllm-layout",
        default=None,
        metavar="SPEC",
        help="the layout of the --vllm-events engines, as kvcache node --layout takes it "
        "(its namespace and block_tokens name their blocks' keys)",
    )
    parser.add_argument("--vllm-topic", default="", help="the engines' KV event topic")
    parser.add_argument(
        "--engine-metrics",
        action="append",
        default=[],
        metavar="URL=NODE_ID",
        help="scrape the Prometheus metrics of the vLLM engine beside NODE_ID (running and "
        "waiting requests, KV usage) into that node's load; a node whose engine stops "
        "answering is not scheduled until it answers again (repeatable)",
    )
    parser.add_argument(
        "--engine-poll",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="seconds between scrapes of each --engine-metrics engine (default %(default)s)",
    )
    add_etcd_args(parser)
    parser.add_argument(
        "--advertise",
        default=None,
        type=address_arg,
        help="the address clients reach this conductor at, published in the etcd election "
        "(default: the address it listens on)",
    )


def build_cost_model(args: argparse.Namespace) -> CostModel:
    base = FlopsCostModel()
    if not 0 < args.mfu <= 1:
        raise SystemExit(f"kvcache conductor: --mfu must be in (0, 1], got {args.mfu}")
    if args.nic_gbps <= 0:
        raise SystemExit(f"kvcache conductor: --nic-gbps must be positive, got {args.nic_gbps}")
    model: CostModel = replace(
        base, hardware=replace(base.hardware, mfu=args.mfu, nic_gbps=args.nic_gbps)
    )
    if args.cost_samples:
        try:
            with open(args.cost_samples, newline="") as f:
                rows = [
                    tuple(float(x) for x in row[:3])
                    for row in csv.reader(f)
                    if row and not row[0].startswith("#")
                ]
            model = fit_prefill(rows, base=model)
        except (OSError, ValueError, IndexError, KVStoreError) as e:
            raise SystemExit(
                f"kvcache conductor: cannot fit --cost-samples {args.cost_samples}: {e}"
            ) from None
        log.info(
            "prefill cost model fitted to %d samples: quad=%.3g lin=%.3g const=%.3g",
            len(rows),
            model.quad,
            model.lin,
            model.const,
        )  # type: ignore[attr-defined]
    return model


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise SystemExit("kvcache conductor: --workers must be >= 1")
    if args.max_streams is not None and not 0 <= args.max_streams < args.workers:
        raise SystemExit(
            f"kvcache conductor: --max-streams must be in [0, --workers) = [0, {args.workers}): "
            "each open stream holds a handler thread, and unary calls need one left"
        )
    if args.lease <= 0:
        raise SystemExit("kvcache conductor: --lease must be positive")
    if not 0 <= args.min_transfer_gain < 1:
        raise SystemExit("kvcache conductor: --min-transfer-gain must be in [0, 1)")
    if args.refit_every < 0:
        raise SystemExit("kvcache conductor: --refit-every must be >= 0")
    if args.max_context_tokens < 1 or args.max_pending_per_tenant < 0:
        raise SystemExit(
            "kvcache conductor: --max-context-tokens must be >= 1 and --max-pending-per-tenant >= 0"
        )
    if not 0 < args.pending_timeout < float("inf"):
        raise SystemExit("kvcache conductor: --pending-timeout must be finite seconds > 0")
    try:
        auth = Auth.from_args(args.token, args.tenant_token, args.service_token)
    except ValueError as e:
        raise SystemExit(f"kvcache conductor: {e}") from None
    tls = tls_from_args(args)
    conductor = Conductor.create(
        policy=args.policy,
        cost_model=build_cost_model(args),
        lease_s=args.lease,
        config=SchedulerConfig(
            min_transfer_gain=args.min_transfer_gain,
            refit_every=args.refit_every,
            stale_after_s=args.pending_timeout,
            max_pending_per_tenant=args.max_pending_per_tenant,
        ),
        seed=args.seed,
        hook=_transfer_hook(args.transfer_hook, args.node_token or args.token, args.node_tls_ca),
    )
    etcd = _etcd(args)
    feeds: list[VllmEventFeed | EngineLoadFeed] = [
        *_vllm_feeds(args, conductor),
        *_engine_feeds(args, conductor),
    ]
    metrics = ConductorMetrics(conductor)
    servicer = ConductorServicer(
        conductor,
        auth,
        FeedOptions(token=args.node_token or args.token, tls_ca_file=args.node_tls_ca),
        metrics,
        leadership=etcd.leadership if etcd else None,
        membership_source=etcd.source if etcd else "",
        max_context_tokens=args.max_context_tokens,
        max_streams=args.max_streams if args.max_streams is not None else args.workers // 2,
    )
    health: list[Any] = []

    def leader_changed(leading: bool) -> None:
        metrics.leader.set(1 if leading else 0)
        status = health_pb2.HealthCheckResponse.SERVING if leading else NOT_SERVING
        for h in health:
            h.set(SERVICE_NAME, status)

    def on_health(servicer_: Any) -> None:
        health.append(servicer_)
        leader_changed(servicer.leadership.leading)

    if etcd:  # the index warms up while the server starts
        etcd.watch_membership(conductor, servicer, metrics)

    def add(server: grpc.Server) -> list[str]:
        pbg.add_ConductorServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    def on_serving(address: str, metrics_port: int | None) -> dict[str, Any]:
        servicer.address = address
        if etcd:
            record = ConductorRecord(
                address=args.advertise or address,
                conductor_id=f"{socket.gethostname()}:{os.getpid()}",
            )
            etcd.leadership.start(record, warm=etcd.wait_warm, on_change=leader_changed)
        log.info(
            "conductor serving on %s (policy %s, lease %.1fs, tls=%s, auth=%s)",
            address,
            args.policy,
            args.lease,
            bool(tls),
            auth.enabled,
        )
        return {"policy": args.policy, **({"etcd_prefix": etcd.prefix} if etcd else {})}

    def on_stopping() -> None:
        if etcd:  # hand over first: the standby leads while this one drains
            etcd.leadership.stop()
        _stop_all(feeds)

    def close() -> None:
        if etcd:
            etcd.close()
        servicer.close()

    return serve(
        Service(
            role="conductor",
            listen=args.listen,
            auth=auth,
            tls=tls,
            add=add,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            registry=metrics.registry,
            workers=args.workers,
            open_stream_timeout_s=args.open_stream_timeout,
            health_listen=args.health_listen,
            max_concurrent_rpcs=MAX_CONCURRENT_RPCS,
            on_serving=on_serving,
            on_stopping=on_stopping,
            on_health=on_health,
            close=close,
        )
    )


@dataclass
class _EtcdMode:
    """``--etcd``: membership from etcd's watch, leadership from its election."""

    client: EtcdClient
    prefix: str
    leadership: EtcdLeadership
    membership: EtcdMembership | None = None

    @property
    def source(self) -> str:
        return f"etcd ({','.join(self.client.endpoints)}, {nodes_prefix(self.prefix)})"

    def watch_membership(
        self, conductor: Conductor, servicer: ConductorServicer, metrics: ConductorMetrics
    ) -> None:
        self.membership = EtcdMembership(
            conductor,
            servicer.feeds,
            self.client,
            self.prefix,
            on_dropped=lambda node_id: metrics.expirations.inc(),
        ).start()

    def wait_warm(self, timeout_s: float) -> None:
        """Before campaigning: the membership listed and every node's snapshot indexed."""
        assert self.membership is not None
        deadline = time.monotonic() + timeout_s
        self.membership.synced.wait(timeout_s)
        # NOTE: the listing registered the nodes and started their feeds synchronously.
        loading = self.membership.feeds.wait_indexed(max(deadline - time.monotonic(), 0.0))
        if loading or not self.membership.synced.is_set():
            log.warning(
                "campaigning with a partial index after %.0f s: etcd listed=%s, loading %s",
                timeout_s,
                self.membership.synced.is_set(),
                ", ".join(loading) or "-",
            )

    def close(self) -> None:
        self.leadership.stop()
        if self.membership is not None:
            self.membership.stop()
        self.client.close()


def _etcd(args: argparse.Namespace) -> _EtcdMode | None:
    if not args.etcd:
        return None
    urls, prefix = etcd_settings("conductor", args.etcd, args.etcd_prefix, args.etcd_ttl_s)
    if (args.node_token or args.token) and not args.node_tls_ca:
        # Whoever can write under the prefix names the addresses the feeds and the transfer
        # hook call with their token: it must only ever go where TLS verifies who answers.
        raise SystemExit(
            "kvcache conductor: --etcd with a token needs --node-tls-ca: the token goes only "
            "over TLS to addresses learned from etcd (a forged record would collect it)"
        )
    client = etcd_tls("conductor", args).client(urls)
    return _EtcdMode(client, prefix, EtcdLeadership(client, election_name(prefix), args.etcd_ttl_s))


def _stop_all(feeds: list[VllmEventFeed | EngineLoadFeed]) -> None:
    for feed in feeds:
        feed.stop()


def _engine_feeds(args: argparse.Namespace, conductor: Conductor) -> list[EngineLoadFeed]:
    if not args.engine_poll > 0:
        raise SystemExit(
            f"kvcache conductor: --engine-poll must be positive, got {args.engine_poll}"
        )
    try:
        specs = [parse_engine_metrics(s) for s in args.engine_metrics]
    except KVStoreError as e:
        raise SystemExit(f"kvcache conductor: {e}") from None
    nodes = [node for _, node in specs]
    if len(set(nodes)) != len(nodes):
        raise SystemExit("kvcache conductor: one --engine-metrics per node id")
    return [
        EngineLoadFeed(conductor, url, node_id, interval_s=args.engine_poll).start()
        for url, node_id in specs
    ]


def _vllm_feeds(args: argparse.Namespace, conductor: Conductor) -> list[VllmEventFeed]:
    if not args.vllm_events:
        return []
    if not args.vllm_layout:
        raise SystemExit(
            "kvcache conductor: --vllm-events needs --vllm-layout (the engines' "
            "layout, e.g. model=llama3-8b,num_layers=32,kv_heads=8,head_dim=128,"
            "dtype=bfloat16,block_tokens=256)"
        )
    try:
        layout = parse_layout(args.vllm_layout)
        specs = [parse_vllm_events(s) for s in args.vllm_events]
    except (KVStoreError, ValueError) as e:
        raise SystemExit(f"kvcache conductor: {e}") from None
    return [
        VllmEventFeed(conductor, layout, endpoint, replay, node_id, args.vllm_topic).start()
        for endpoint, replay, node_id in specs
    ]


def _transfer_hook(choice: str, token: str | None, tls_ca_file: str | None) -> TransferHook:
    """``messenger`` and ``auto``: the destination's messenger is asked to fetch the blocks
    (``messenger_hook``); ``record``: plans are only recorded and returned in Schedule replies."""
    if choice in ("messenger", "auto"):
        return make_transfer_hook(token, tls_ca_file)
    log.info("transfer plans are recorded and returned in Schedule replies only")
    return RecordingTransferHook()
