"""``kvcache messenger``: one node's block mover (gRPC control API + TCP/RDMA data plane).

    kvcache messenger --node 127.0.0.1:7000 --listen 127.0.0.1:7100 --data-listen 127.0.0.1:7101

It maps the node's DRAM pool by its shared-memory name (so it must run on the node's host), serves
pages to peers on the data port, and pulls the blocks it is asked for (``SubmitTransfer``) from
other messengers into the node.
"""

from __future__ import annotations

import argparse
import logging
import ssl
import time
from typing import Any

import grpc

from clients.node_client import KVCacheRpcError, KVStoreClient
from kvstore.errors import KVStoreError
from node.config import parse_size
from plumbing.registration import (
    MessengerRecord,
    Registration,
    add_etcd_args,
    etcd_settings,
    etcd_tls,
    messengers_prefix,
)
from proto import messenger_pb2 as pb
from proto import messenger_pb2_grpc as pbg
from rpc.channel import make_channel
from rpc.logs import set_identity
from rpc.server import (
    Auth,
    InlineSecret,
    Service,
    TlsConfig,
    add_server_args,
    add_token_file_arg,
    address_arg,
    host_of,
    serve,
    tls_from_args,
)

from .data_security import client_context, derive_data_token, server_context
from .data_server import DataLimits, DataServer, SenderFaults
from .identity import Identities
from .mover import DataAddressResolver, Mover, MoverConfig
from .node_access import NodeAccess, NodePageSource
from .pin_budget import PinShares
from .rdma import RdmaConfig
from .rdma_source import RdmaSource
from .select import MODES, choose_transport
from .service import MessengerMetrics, MessengerServicer
from .tcp import TcpConfig

log = logging.getLogger("kvcache.messenger")
# A messenger's data address, asked by its peers without a token (see lookup_data_address).
OPEN_GETINFO = "/kvcache.v1.MessengerService/GetInfo"


def configure(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser)
    parser.add_argument(
        "--node", required=True, type=address_arg, help="this host's node server (host:port)"
    )
    parser.add_argument(
        "--node-token",
        default=None,
        action=InlineSecret,
        help="the cluster's admin token, for the node, peer messengers and the "
        "data port (default: --token)",
    )
    add_token_file_arg(parser, "--node-token-file", "node_token", "--node-token, from a file")
    parser.add_argument(
        "--node-tls-ca",
        default=None,
        help="CA certificate (PEM) to verify the node and the peer messengers serving TLS "
        "(their gRPC and data ports)",
    )
    add_token_file_arg(
        parser,
        "--data-token-file",
        "data_token",
        "the cluster's data-plane credential, which every messenger's data port demands in the "
        "HELLO of a connection (default: one derived from the admin token, which never "
        "crosses the network itself)",
    )
    parser.add_argument(
        "--data-listen",
        default=None,
        type=address_arg,
        help="host:port of the data port peers pull from (default: --listen's host, any free port)",
    )
    parser.add_argument(
        "--data-advertise",
        default=None,
        type=address_arg,
        help="the data port's address as peers reach it, in GetInfo and etcd (default: the "
        "address it listens on); with TLS, a name its certificate holds",
    )
    parser.add_argument(
        "--transport",
        choices=MODES,
        default="auto",
        help="tcp, rdma (fails without RDMA) or auto (RDMA when a port is "
        "ACTIVE, else TCP); RDMA falls back to TCP per peer",
    )
    parser.add_argument("--lanes", type=int, default=2, help="TCP connections per fetch")
    parser.add_argument("--workers", type=int, default=4, help="transfer jobs run at once")
    parser.add_argument(
        "--urgent-workers",
        type=int,
        default=MoverConfig.urgent_workers,
        help="jobs run at once for urgent batches (pulls a request waits on), beside the "
        "--workers bulk ones (default: %(default)s)",
    )
    parser.add_argument(
        "--urgent-bytes",
        type=_size,
        default=MoverConfig.urgent_bytes,
        help="an urgent batch larger than this runs as a bulk one (default: 256MiB)",
    )
    parser.add_argument(
        "--max-fetching",
        type=int,
        default=MoverConfig.max_fetching,
        help="keys being fetched at once, all batches together; one submitter (a tenant, the "
        "admin) may hold half: past it SubmitTransfer is RESOURCE_EXHAUSTED "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--pin-ttl",
        type=float,
        default=30.0,
        help="lease (s) of pins taken on the node while serving a peer",
    )
    parser.add_argument(
        "--write-ttl",
        type=float,
        default=120.0,
        help="lease (s) of pages allocated on the node while they arrive",
    )
    parser.add_argument(
        "--io-timeout",
        type=float,
        default=30.0,
        help="a peer that stalls this long (s) fails its entries",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DataLimits.max_connections,
        help="data-port connections at once; more are refused at once (and counted) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--max-unauthenticated-per-peer",
        type=int,
        default=DataLimits.max_unauthenticated_per_peer,
        help="data-port connections one address may hold before they said HELLO (with a "
        "token); all such connections together at most half of --max-connections "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=DataLimits.idle_timeout_s,
        help="a data-port connection with no request for this long (s) is closed "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--frame-timeout",
        type=float,
        default=DataLimits.frame_timeout_s,
        help="a request frame on the data port must arrive whole this long (s) after its "
        "first byte (and a new connection must send its first request by then) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--fetch-deadline",
        type=float,
        default=None,
        help="a peer must take a FETCH response within this long (s) or it is cut and the "
        "pins are released; below --pin-ttl (default: 0.8 x --pin-ttl)",
    )
    parser.add_argument(
        "--pin-share-per-connection",
        type=float,
        default=PinShares.connection,
        help="share (0-1] of a namespace's DRAM pool one data-port connection may hold pinned "
        "at once; a larger request is served in chunks (default: %(default)s)",
    )
    parser.add_argument(
        "--pin-share-per-peer",
        type=float,
        default=PinShares.peer,
        help="share (0-1] of a namespace's DRAM pool one peer (host address, all its "
        "connections) may hold pinned at once; more waits up to --fetch-deadline "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--advertise",
        default=None,
        type=address_arg,
        help="the gRPC address others reach this messenger at, published in etcd "
        "(default: the address it listens on)",
    )
    add_etcd_args(parser)
    parser.add_argument(
        "--node-wait",
        type=float,
        default=30.0,
        help="wait this long (s) for the node server at start",
    )
    # Test-only fault injection: corrupt every N-th page sent, after checksumming.
    parser.add_argument("--fault-corrupt-every", type=int, default=0, help=argparse.SUPPRESS)
    # Test-only: after N pages sent, stall the stream for S seconds (once).
    parser.add_argument("--fault-stall-after", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--fault-stall-s", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--fault-stall-until", default="", help=argparse.SUPPRESS)
    # Test-only: once serving, allow only N more open files than are open (RLIMIT_NOFILE).
    parser.add_argument("--fault-open-files", type=int, default=0, help=argparse.SUPPRESS)


def _connect_node(args) -> KVStoreClient:
    # NOTE: prefault: pages move through the node's shared memory at network speed; a page
    # fault per 4 KiB of each page would cost more than the copy (RDMA registration populates
    # the region too).
    client = KVStoreClient(
        args.node,
        token=args.node_token or args.token,
        tls_ca_file=args.node_tls_ca,
        prefault_shm=True,
    )
    deadline = time.monotonic() + args.node_wait
    while True:
        try:
            client.info()
            return client
        except KVCacheRpcError as e:
            if e.code.name != "UNAVAILABLE" or time.monotonic() > deadline:
                client.close()
                raise SystemExit(f"kvcache messenger: cannot use node {args.node}: {e}") from None
            time.sleep(0.2)  # the node is still starting: retry until --node-wait


def _data_limits(args) -> DataLimits:
    if args.pin_ttl <= 0:
        raise SystemExit("kvcache messenger: --pin-ttl must be positive")
    fetch = 0.8 * args.pin_ttl if args.fetch_deadline is None else args.fetch_deadline
    if fetch >= args.pin_ttl:
        # Past the pin lease the node may reuse a page while it is still being sent.
        raise SystemExit(
            f"kvcache messenger: --fetch-deadline ({fetch:g} s) must be below --pin-ttl "
            f"({args.pin_ttl:g} s)"
        )
    try:
        return DataLimits(
            max_connections=args.max_connections,
            max_unauthenticated_per_peer=args.max_unauthenticated_per_peer,
            idle_timeout_s=args.idle_timeout,
            frame_timeout_s=args.frame_timeout,
            fetch_deadline_s=fetch,
        )
    except ValueError as e:
        msg = str(e)
        for field, flag in _LIMIT_FLAGS.items():
            msg = msg.replace(field, flag)  # name the flag the user gave
        raise SystemExit(f"kvcache messenger: {msg}") from None


_LIMIT_FLAGS = {
    "max_unauthenticated_per_peer": "--max-unauthenticated-per-peer",
    "max_connections": "--max-connections",
    "idle_timeout_s": "--idle-timeout",
    "frame_timeout_s": "--frame-timeout",
    "fetch_deadline_s": "--fetch-deadline",
}


def _pin_shares(args) -> PinShares:
    for flag, share in (
        ("--pin-share-per-connection", args.pin_share_per_connection),
        ("--pin-share-per-peer", args.pin_share_per_peer),
    ):
        if not 0 < share <= 1:
            raise SystemExit(f"kvcache messenger: {flag} must be in (0, 1], got {share:g}")
    return PinShares(connection=args.pin_share_per_connection, peer=args.pin_share_per_peer)


def _data_tls(args, tls: TlsConfig | None) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """The data port's server and client TLS contexts: on with ``--tls-cert`` (the same
    certificate as gRPC), peers verified against ``--node-tls-ca``."""
    if tls is None:
        return None, None
    if not args.node_tls_ca:
        raise SystemExit(
            "kvcache messenger: --tls-cert needs --node-tls-ca: the data port serves TLS with "
            "it, and the peers' data ports are verified against that CA"
        )
    try:
        return server_context(tls.cert_file, tls.key_file), client_context(args.node_tls_ca)
    except (OSError, ValueError) as e:
        raise SystemExit(f"kvcache messenger: cannot set up TLS on the data port: {e}") from None


def _limit_open_files(more: int) -> None:
    """Test-only: let the process open only ``more`` files beyond those open now."""
    import os
    import resource

    open_now = len(os.listdir("/proc/self/fd"))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + more, hard))
    log.warning("fault injection: open files limited to %d", open_now + more)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except KVStoreError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    if args.lanes < 1 or args.workers < 1 or args.urgent_workers < 1 or args.max_fetching < 2:
        raise SystemExit(
            "kvcache messenger: --lanes, --workers and --urgent-workers must be at least 1, "
            "--max-fetching 2"
        )
    etcd = None
    if args.etcd:
        urls, prefix = etcd_settings("messenger", args.etcd, args.etcd_prefix, args.etcd_ttl_s)
        etcd = etcd_tls("messenger", args).client(urls)
    limits = _data_limits(args)
    pin_shares = _pin_shares(args)
    tls = tls_from_args(args)
    serve_tls, peer_tls = _data_tls(args, tls)
    try:
        auth = Auth.from_args(args.token, args.tenant_token, args.service_token)
    except ValueError as e:
        raise SystemExit(f"kvcache messenger: {e}") from None
    # The same table proves whom each pull is for to its source, and checks it as a source.
    identities = Identities(auth.tokens)
    client = _connect_node(args)
    set_identity(node_id=client.info().node_id)  # its log lines name the node it serves
    node = NodeAccess(client)
    source = NodePageSource(node, pin_ttl_s=args.pin_ttl)
    data_host, data_port = host_of(args.listen), 0
    if args.data_listen:
        data_host, _, port = args.data_listen.rpartition(":")
        data_port = int(port)
    cluster_token = args.node_token or args.token
    # NOTE: the data port carries page bytes, not gRPC. Its credential is the data token, never
    # the admin token (data_security.py); with TLS on gRPC it speaks TLS too.
    data_token = args.data_token or (derive_data_token(cluster_token) if cluster_token else None)
    data = DataServer(
        source,
        host=data_host,
        port=data_port,
        io_timeout_s=args.io_timeout,
        token=data_token,
        tls=serve_tls,
        limits=limits,
        pin_shares=pin_shares,
        identities=identities,
        faults=SenderFaults(
            corrupt_every=args.fault_corrupt_every,
            stall_after=args.fault_stall_after,
            stall_s=args.fault_stall_s,
            stall_until=args.fault_stall_until,
        ),
    )
    try:
        choice = choose_transport(
            args.transport,
            TcpConfig(
                lanes=args.lanes, io_timeout_s=args.io_timeout, token=data_token, tls=peer_tls
            ),
            RdmaConfig(io_timeout_s=args.io_timeout, token=data_token, tls=peer_tls),
        )
    except RuntimeError as e:
        raise SystemExit(f"kvcache messenger: {e}") from None
    rdma_source = None
    if choice.backend is not None:
        rdma_source = RdmaSource(choice.backend, source)
        rdma_source.install(data)
    data.start()
    data_address = args.data_advertise or data.address

    def lookup_data_address(messenger: str) -> str:
        # NOTE: no token: a tenant names the sources of its transfers, and a token would go to
        # whatever address it named (GetInfo needs none; the data port proves itself in HELLO).
        with make_channel(messenger, None, args.node_tls_ca) as channel:
            return (
                pbg.MessengerServiceStub(channel)
                .GetInfo(pb.MessengerInfoRequest(), timeout=10)
                .data_address
            )

    metrics = MessengerMetrics(data)
    mover = Mover(
        node,
        choice.transport,
        DataAddressResolver(lookup_data_address),
        MoverConfig(
            workers=args.workers,
            write_ttl_s=args.write_ttl,
            max_fetching=args.max_fetching,
            urgent_workers=args.urgent_workers,
            urgent_bytes=args.urgent_bytes,
        ),
        on_entry=metrics.on_entry,
        on_job=metrics.on_job,
        identities=identities,
    )
    info = pb.MessengerInfo(
        node=args.node,
        data_address=data_address,
        transport=choice.description,
        lanes=args.lanes,
        namespaces=node.namespaces(),
    )

    def add(server: grpc.Server) -> list[str]:
        servicer = MessengerServicer(mover, info, auth, metrics)
        servicer.data_server = data
        pbg.add_MessengerServiceServicer_to_server(servicer, server)
        return [pb.DESCRIPTOR.services_by_name["MessengerService"].full_name]

    registration: Registration | None = None

    def on_serving(address: str, metrics_port: int | None) -> dict[str, Any]:
        nonlocal registration
        if etcd is not None:  # <prefix>/messengers/<node id>: conductors pair it with its node
            node_id = client.info().node_id
            record = MessengerRecord(
                node_id=node_id,
                address=args.advertise or address,
                data_address=data_address,
                transport=choice.description,
            ).encode()
            registration = Registration(
                etcd, messengers_prefix(prefix) + node_id, lambda: record, ttl_s=args.etcd_ttl_s
            ).start()
        log.info(
            "messenger for node %s on %s, data port %s, transport %s",
            args.node,
            address,
            data_address,
            choice.description,
        )
        if args.fault_open_files:
            _limit_open_files(args.fault_open_files)
        return {"data_address": data_address, "transport": choice.description}

    def on_stopping() -> None:
        if registration is not None:
            registration.stop()

    def close() -> None:
        mover.close()
        data.stop()
        choice.transport.close()
        if rdma_source is not None:
            rdma_source.close()
        if choice.backend is not None:
            choice.backend.close()
        node.close()
        client.close()

    return serve(
        Service(
            role="messenger",
            listen=args.listen,
            auth=auth,
            tls=tls,
            add=add,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            registry=metrics.registry,
            on_serving=on_serving,
            on_stopping=on_stopping,
            close=close,
            open_stream_timeout_s=args.open_stream_timeout,
            health_listen=args.health_listen,
            open_methods=(OPEN_GETINFO,),
        )
    )
