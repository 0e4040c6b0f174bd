"""``kvcache node``: serve one host's KV block pools over gRPC.

Precedence: built-in defaults < ``--config FILE.toml`` < flags given on the command line.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import grpc

from kvstore.errors import KVStoreError
from kvstore.policy import POLICIES
from plumbing.registration import Registration, add_etcd_args, etcd_settings, etcd_tls
from proto import node_pb2 as pb
from proto import node_pb2_grpc as pbg
from rpc.logs import set_identity
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

from .agent import NodeAgent, start_etcd_registration, start_node_agent
from .config import NodeConfig, load_toml, parse_layout, parse_size
from .control import ControlServer
from .drain import drain
from .metrics import NodeMetrics
from .node import Node
from .service import NodeServicer

log = logging.getLogger("kvcache.node")
WORKERS = 32  # gRPC worker threads: each open stream holds one
MIN_UNARY_WORKERS = 8  # never taken by streams (see --max-streams)


def configure(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser)
    parser.add_argument("--config", help="TOML file with the same keys as these flags")
    parser.add_argument("--node-id", help="name of this node in the cluster (default: host-based)")
    parser.add_argument(
        "--layout",
        action="append",
        metavar="SPEC",
        help="a served model layout, repeatable: model=NAME,num_layers=L,"
        "kv_heads=H,head_dim=D[,dtype=float16][,block_tokens=256]; the node then serves "
        "these only, each with an even split of --dram and --ssd (default: the layouts its "
        "clients register at run time, engines' connectors do at start, sharing --dram and "
        "--ssd; the 1 MiB-page demo layout from the start)",
    )
    parser.add_argument(
        "--max-layouts",
        type=int,
        help="without --layout: how many layouts clients may register in all (default 8; a "
        "tenant: half of them)",
    )
    parser.add_argument("--dram", help="DRAM pool size in shared memory, e.g. 4GiB (default 1GiB)")
    parser.add_argument("--gpu", help="GPU tier size (needs CUDA), e.g. 8GiB (default 0)")
    parser.add_argument("--ssd", help="SSD tier size, e.g. 20GiB (default 0: no SSD tier)")
    parser.add_argument("--ssd-dir", help="directory for the SSD tier's lmdb files")
    parser.add_argument(
        "--ssd-damaged",
        choices=["refuse", "move-aside"],
        help="a damaged SSD lmdb file at start: refuse to start (default), or move it aside "
        "(renamed next to it) and start with an empty SSD tier",
    )
    for tier in ("dram", "ssd", "gpu"):
        parser.add_argument(
            f"--{tier}-policy",
            choices=sorted(POLICIES),
            help="eviction policy (default lru; prefix: leaves of the prefix tree first)",
        )
    parser.add_argument(
        "--no-promote",
        dest="promote_on_hit",
        action="store_const",
        const=False,
        help="do not promote SSD hits to DRAM on copy-out reads",
    )
    parser.add_argument(
        "--no-dram-checksums",
        dest="dram_checksums",
        action="store_const",
        const=False,
        help="do not checksum DRAM pages at commit (faster writes: one pass less over each "
        "page; a page scribbled on after its commit is then served as it is)",
    )
    parser.add_argument(
        "--no-reserve-shm",
        dest="reserve_shm",
        action="store_const",
        const=False,
        help="do not reserve the DRAM pool's memory at start: the pool stays sparse, and when "
        "another process fills /dev/shm later, a write into a page not yet backed kills the "
        "writer (node or same-host client) with SIGBUS. By default every page is allocated at "
        "start, and a --dram beyond what /dev/shm (or memory) has is refused then",
    )
    # NOTE: reserving became the default; the old opt-in stays accepted.
    parser.add_argument(
        "--reserve-shm",
        dest="reserve_shm",
        action="store_const",
        const=True,
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--lease-ttl",
        dest="lease_ttl_s",
        type=float,
        help="default lease time of pins and write leases, seconds (default 30)",
    )
    parser.add_argument(
        "--drain-bytes",
        help="on SIGTERM, first hand up to this much of the hottest blocks (e.g. 2GiB) to the "
        "peers the conductor lists, through the messengers (needs --messenger and --conductor; "
        "default 0: leave at once)",
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        help="how long that hand-over may take before the rest is cancelled (default 30)",
    )
    parser.add_argument(
        "--write-quarantine",
        dest="write_quarantine_s",
        type=float,
        help="seconds the pages of an expired write lease are held back from reuse, because a "
        "same-host writer may still be writing into them (default 3 x --lease-ttl; 0: reuse at "
        "once)",
    )
    parser.add_argument(
        "--max-streams",
        type=int,
        help=f"Get and Put streams open at once; more are refused with RESOURCE_EXHAUSTED, so "
        f"that unary calls always find one of the {WORKERS} gRPC workers (default 16)",
    )
    parser.add_argument(
        "--max-event-streams", type=int, help="Events feeds open at once (default 4)"
    )
    parser.add_argument(
        "--max-streams-per-tenant",
        type=int,
        help="Get and Put streams one tenant may have open at once (default: half of "
        "--max-streams); the admin is not limited",
    )
    parser.add_argument(
        "--tenant-lease-share",
        type=float,
        help="share (0-1] of a namespace's DRAM pages one tenant's leases and streams may hold "
        "(pages leased to write, blocks pinned to read); more is refused with "
        "RESOURCE_EXHAUSTED (default 0.5)",
    )
    parser.add_argument(
        "--tenant-max-leases", type=int, help="live leases one tenant may hold (default 1024)"
    )
    parser.add_argument(
        "--tenant-lease-lifetime",
        dest="tenant_lease_lifetime_s",
        type=float,
        help="seconds a tenant's lease lives at most from its grant, extensions included "
        "(default 600)",
    )
    parser.add_argument(
        "--stream-idle-timeout",
        dest="stream_idle_timeout_s",
        type=float,
        help="seconds a stream may wait for its client to send (Put) or read (Get, Events) "
        "before it is cut with DEADLINE_EXCEEDED (default 30); an Events feed waiting for "
        "events is not idle",
    )
    parser.add_argument(
        "--conductor", type=address_arg, help="conductor address to register with (optional)"
    )
    parser.add_argument(
        "--conductor-token",
        action=InlineSecret,
        help="bearer token for the conductor (prefer --conductor-token-file)",
    )
    add_token_file_arg(
        parser, "--conductor-token-file", "conductor_token", "--conductor-token, from a file"
    )
    parser.add_argument(
        "--conductor-tls-ca", help="CA certificate (PEM) to verify a conductor serving TLS"
    )
    parser.add_argument("--role", choices=["prefill", "decode", "both"])
    parser.add_argument(
        "--messenger",
        type=address_arg,
        help="this node's messenger gRPC address, for the conductor",
    )
    parser.add_argument(
        "--advertise", type=address_arg, help="address others use to reach this node"
    )
    add_etcd_args(parser, defaults=False)


def build_config(args: argparse.Namespace) -> NodeConfig:
    values: dict = load_toml(args.config) if args.config else {}
    flags = {
        "listen": args.listen,
        "node_id": args.node_id,
        "ssd_dir": args.ssd_dir,
        "ssd_damaged": args.ssd_damaged,
        "dram_policy": args.dram_policy,
        "ssd_policy": args.ssd_policy,
        "gpu_policy": args.gpu_policy,
        "promote_on_hit": args.promote_on_hit,
        "reserve_shm": args.reserve_shm,
        "dram_checksums": args.dram_checksums,
        "lease_ttl_s": args.lease_ttl_s,
        "write_quarantine_s": args.write_quarantine_s,
        "drain_bytes": args.drain_bytes,
        "drain_seconds": args.drain_seconds,
        "max_streams": args.max_streams,
        "max_layouts": args.max_layouts,
        "max_event_streams": args.max_event_streams,
        "stream_idle_timeout_s": args.stream_idle_timeout_s,
        "max_streams_per_tenant": args.max_streams_per_tenant,
        "tenant_lease_share": args.tenant_lease_share,
        "tenant_max_leases": args.tenant_max_leases,
        "tenant_lease_lifetime_s": args.tenant_lease_lifetime_s,
        "token": args.token,
        "service_token": args.service_token,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "conductor": args.conductor,
        "conductor_token": args.conductor_token,
        "conductor_tls_ca": args.conductor_tls_ca,
        "role": args.role,
        "messenger": args.messenger,
        "advertise": args.advertise,
        "etcd": args.etcd,
        "etcd_prefix": args.etcd_prefix,
        "etcd_ttl_s": args.etcd_ttl_s,
        "etcd_ca": args.etcd_ca,
        "etcd_cert": args.etcd_cert,
        "etcd_key": args.etcd_key,
        "dram": args.dram,
        "gpu": args.gpu,
        "ssd": args.ssd,
    }
    if args.tenant_token:
        flags["tenant_tokens"] = args.tenant_token
    if args.layout:
        flags["layouts"] = [parse_layout(s) for s in args.layout]
    # NOTE: --listen has a non-None default; a TOML "listen" wins over that default only.
    if args.listen == "127.0.0.1:0" and "listen" in values:
        flags["listen"] = None
    values.update({k: v for k, v in flags.items() if v is not None})
    for key in ("listen", "conductor", "messenger", "advertise"):  # a TOML file's too
        if values.get(key):
            try:
                values[key] = address_arg(values[key])
            except argparse.ArgumentTypeError as e:
                raise KVStoreError(f"{key}: {e}") from None
    for key in ("dram", "gpu", "ssd", "drain_bytes"):
        if key in values:
            values[key] = parse_size(values[key])
    if "layouts" in values and values["layouts"] and isinstance(values["layouts"][0], (str, dict)):
        values["layouts"] = [parse_layout(s) for s in values["layouts"]]
    cfg = NodeConfig(**values)
    q = cfg.write_quarantine_s
    if q is not None and not 0 <= q < float("inf"):  # NOTE: NaN fails this test too
        raise KVStoreError(f"--write-quarantine must be finite seconds >= 0, got {q}")
    if cfg.max_streams < 1 or cfg.max_event_streams < 1:
        raise KVStoreError("--max-streams and --max-event-streams must be >= 1")
    if cfg.max_streams + cfg.max_event_streams > WORKERS - MIN_UNARY_WORKERS:
        raise KVStoreError(
            f"--max-streams + --max-event-streams must leave {MIN_UNARY_WORKERS} of the "
            f"{WORKERS} gRPC workers to unary calls: at most {WORKERS - MIN_UNARY_WORKERS}"
        )
    if cfg.max_streams_per_tenant is not None and cfg.max_streams_per_tenant < 1:
        raise KVStoreError("--max-streams-per-tenant must be >= 1")
    if not 0 < cfg.stream_idle_timeout_s < float("inf"):
        raise KVStoreError("--stream-idle-timeout must be finite seconds > 0")
    if cfg.etcd and cfg.conductor:
        raise KVStoreError(
            "--etcd and --conductor are alternatives: with --etcd the node registers in etcd "
            "and every conductor finds it there"
        )
    if not 0 < cfg.drain_seconds < float("inf"):
        raise KVStoreError("--drain-seconds must be finite seconds > 0")
    if cfg.drain_bytes and not (cfg.messenger and (cfg.conductor or cfg.etcd)):
        raise KVStoreError(
            "--drain-bytes needs --messenger (the peers pull through it) and --conductor or "
            "--etcd (whose node list names the peers)"
        )
    if cfg.ssd and not cfg.ssd_dir:
        raise KVStoreError("--ssd needs --ssd-dir (a directory for the lmdb files)")
    return cfg


def run(args: argparse.Namespace) -> int:
    try:
        cfg = build_config(args)
        if cfg.etcd:
            urls, cfg.etcd_prefix = etcd_settings("node", cfg.etcd, cfg.etcd_prefix, cfg.etcd_ttl_s)
            etcd_tls("node", cfg)  # the files exist, cert and key go together
            cfg.etcd = ",".join(urls)
        # NOTE: validated before the node exists, so a bad flag leaves no shared memory behind.
        auth = Auth.from_args(cfg.token, cfg.tenant_tokens, cfg.service_token)
        tls = tls_from_args(cfg)
        node = Node(cfg)
    except (KVStoreError, TypeError, ValueError, OSError) as e:
        raise SystemExit(f"kvcache node: {e}") from None
    set_identity(node_id=node.node_id)
    metrics = NodeMetrics(lambda: node.stores)
    servicer = NodeServicer(
        node,
        auth,
        metrics,
        max_streams=cfg.max_streams,
        max_event_streams=cfg.max_event_streams,
        stream_idle_timeout_s=cfg.stream_idle_timeout_s,
        max_streams_per_tenant=cfg.max_streams_per_tenant,
    )
    try:
        control = ControlServer(servicer, auth)  # same-host lease calls without gRPC's cost
    except OSError as e:
        node.close()
        raise SystemExit(f"kvcache node: cannot open its control socket: {e}") from None
    servicer.control_socket = control.socket_name
    agent: NodeAgent | None = None
    registration: Registration | None = None

    def close() -> None:
        control.close()
        node.close()

    def add(server: grpc.Server) -> list[str]:
        pbg.add_NodeServiceServicer_to_server(servicer, server)
        return [pb.DESCRIPTOR.services_by_name["NodeService"].full_name]

    def on_serving(address: str, metrics_port: int | None) -> dict[str, Any]:
        nonlocal agent, registration
        if cfg.conductor:  # register with the conductor and keep the lease alive
            agent = start_node_agent(cfg, node, cfg.advertise or address)
        if cfg.etcd:  # or in etcd, where every conductor watches
            registration = start_etcd_registration(cfg, node, cfg.advertise or address)
        log.info(
            "node %s serving %s on %s (tls=%s, auth=%s)",
            node.node_id,
            ", ".join(node.stores),
            address,
            bool(tls),
            auth.enabled,
        )
        # NOTE: with tenants no store has a /dev/shm name (per-tenant memfds instead): none to list.
        shm = {ns: s.shm_name for ns, s in node.stores.items() if s.shm_name}
        return {"node_id": node.node_id, "shm": shm}

    def on_stopping() -> None:
        if cfg.drain_bytes and not node.drained:  # while it still serves the peers' reads
            try:
                drain(node, cfg, cfg.drain_bytes, cfg.drain_seconds)
            except KVStoreError as e:
                log.warning("drain on exit: %s", e)
        servicer.stopping = True
        if agent is not None:
            agent.stop()
        if registration is not None:
            registration.stop()  # revokes the lease: the conductors drop the node at once

    return serve(
        Service(
            role="node",
            listen=cfg.listen,
            auth=auth,
            tls=tls,
            add=add,
            metrics_port=cfg.metrics_port,
            metrics_host=cfg.metrics_host,
            registry=metrics.registry,
            on_serving=on_serving,
            on_stopping=on_stopping,
            close=close,
            workers=WORKERS,
            open_stream_timeout_s=args.open_stream_timeout,
            health_listen=args.health_listen,
        )
    )
