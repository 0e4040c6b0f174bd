"""``kvcache drain NODE``: a node leaves and hands its hottest blocks to its peers first.

    kvcache drain node-1                          # a node of the cluster 'kvcache up' started
    kvcache drain 10.0.0.7:7001 --token-file T --max-bytes 2GiB --seconds 20
    kvcache drain node-1 --stay                   # copy, and keep the node serving

The node's peers (the other nodes the conductor lists with a messenger, or ``--peer``) pull the
blocks its eviction policy would keep longest through the messengers, up to ``--max-bytes`` in
``--seconds``; then the node stops as on SIGTERM (unless ``--stay``). The conductor's index
follows the peers' stored events, so the next requests find those prefixes on the peers. Exit 0
when the node answered, 1 when it refused or failed (the reason on stderr), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import sys

from rpc.server import address_arg

from .cluster_access import NoCluster, add_access_args, read_cluster


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "node", help="the node's id (in the cluster 'kvcache up' started) or its HOST:PORT"
    )
    parser.add_argument(
        "--max-bytes",
        default="0",
        help="hand over at most this much (e.g. 2GiB; default 0: every block the node holds)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="then cancel what is not done (default %(default)s)",
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        type=address_arg,
        help="a peer's messenger HOST:PORT (repeatable; default: the conductor's other nodes)",
    )
    parser.add_argument(
        "--stay", action="store_true", help="copy only: the node keeps serving afterwards"
    )
    add_access_args(parser)


class DrainError(Exception):
    """What to fix, for stderr."""


def _target(args: argparse.Namespace) -> tuple[str, str | None, str | None]:
    """(the node's address, token, TLS CA)."""
    try:
        return address_arg(args.node), args.token, args.tls_ca
    except argparse.ArgumentTypeError:
        pass  # a node id
    try:
        info, path = read_cluster(args)
    except NoCluster as e:
        raise DrainError(f"{e}; or name the node by HOST:PORT") from None
    by_id = {n.id: n for n in info.nodes}
    if args.node not in by_id:
        raise DrainError(f"no node {args.node!r} in {path}; its nodes: {', '.join(sorted(by_id))}")
    return by_id[args.node].address, args.token or info.token, args.tls_ca or info.tls_ca


def run(args: argparse.Namespace) -> int:
    from clients.node_client import KVCacheRpcError, KVStoreClient
    from kvstore.errors import KVStoreError
    from node.config import parse_size

    try:
        max_bytes = parse_size(args.max_bytes)
    except KVStoreError as e:
        print(f"kvcache drain: --max-bytes: {e}", file=sys.stderr)
        return 2
    if not 0 < args.seconds <= 3600:
        print("kvcache drain: --seconds must be between 0 and 3600", file=sys.stderr)
        return 2
    try:
        address, token, tls_ca = _target(args)
    except DrainError as e:
        print(f"kvcache drain: {e}", file=sys.stderr)
        return 2
    try:
        with KVStoreClient(address, token, tls_ca, use_shm=False) as client:
            reply = client.drain(max_bytes, args.seconds, args.peer, leave=not args.stay)
    except KVCacheRpcError as e:
        print(f"kvcache drain: {address}: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    except OSError as e:  # the CA file
        print(f"kvcache drain: {e}", file=sys.stderr)
        return 1
    rate = reply.bytes / reply.seconds / 1e9 if reply.seconds else 0.0
    print(
        f"{address}: {reply.blocks} of {reply.offered} blocks on the peers, "
        f"{reply.bytes / 2**20:.1f} MiB moved in {reply.seconds:.2f} s ({rate:.2f} GB/s)"
    )
    print(f"{'peer':<24} {'messenger':<22} {'blocks':>8} {'MiB':>9} {'failed':>7}")
    for p in reply.peers:
        print(
            f"{p.node_id or '-':<24} {p.messenger:<22} {p.blocks:>8} "
            f"{p.bytes / 2**20:>9.1f} {p.failed:>7}"
        )
    print("the node stays" if args.stay else "the node is leaving")
    return 0
