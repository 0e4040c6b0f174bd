"""A leaving node hands its hottest blocks to its peers (``Drain``, SIGTERM with --drain-bytes).

The node chooses, per namespace, the blocks its eviction policy would keep longest (faster tiers
first) within a byte budget, and asks each peer's messenger to pull a share of them from this
node's messenger: one SubmitTransfer per peer and namespace, in runs of ``RUN`` blocks dealt
round-robin, so blocks touched together (a prompt's chain sits together in an LRU) land on one
peer and a lookup there finds the prefix whole. The peers' stores emit stored events, so the
conductor's index follows; what is not done by the deadline is cancelled. Peers come from the
request or from the conductor the node registers with (nodes with a messenger that serve the
namespace).

Pages move as stored (the admin names keys as stored): a tenant's blocks stay that tenant's
on the peer.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import grpc

from kvstore.errors import FailedPrecondition, InvalidArgument
from plumbing.etcd import EtcdClient
from plumbing.registration import NodeRecord, nodes_prefix
from proto import conductor_pb2 as cpb
from proto import conductor_pb2_grpc as cpbg
from proto import messenger_pb2 as mpb
from proto import messenger_pb2_grpc as mpbg
from rpc.channel import make_channel
from rpc.wire import layout_from_pb

from .config import NodeConfig
from .node import Node

log = logging.getLogger(__name__)
RUN = 64  # blocks dealt to one peer at a time
DEFAULT_SECONDS = 60.0
POLL_S = 0.05


@dataclass
class Peer:
    messenger: str
    node_id: str = ""
    namespaces: set[str] | None = None  # None: unknown (named in the request): tried with all
    blocks: int = 0
    bytes: int = 0
    failed: int = 0
    batches: list[tuple[mpbg.MessengerServiceStub, str]] = field(default_factory=list)


@dataclass
class DrainResult:
    offered: int
    blocks: int
    bytes: int
    seconds: float
    peers: list[Peer]


def etcd_peers(config: NodeConfig, node_id: str) -> list[Peer]:
    """The other nodes registered in etcd with a messenger (a node started with --etcd, as the
    Kubernetes manifests start them), and the namespaces they serve."""
    assert config.etcd
    client = EtcdClient(
        config.etcd, ca_file=config.etcd_ca, cert_file=config.etcd_cert, key_file=config.etcd_key
    )
    try:
        _, kvs = client.get_prefix(nodes_prefix(config.etcd_prefix))
    except Exception as e:  # noqa: BLE001 - any failure to read etcd: no peers, said why
        raise FailedPrecondition(f"etcd at {config.etcd} did not list the peers: {e}") from None
    finally:
        client.close()
    peers = []
    for kv in kvs:
        try:
            d = NodeRecord.decode(kv.value).descriptor
        except InvalidArgument:
            continue  # not a node's record: skipped, as the conductors skip it
        if d.node_id != node_id and d.messenger_address:
            peers.append(Peer(d.messenger_address, d.node_id, set(d.namespaces)))
    return peers


def conductor_peers(config: NodeConfig, node_id: str) -> list[Peer]:
    """The other nodes the conductor lists with a messenger, and the namespaces they serve
    (etcd's records instead for a node registered there)."""
    if not config.conductor and config.etcd:
        return etcd_peers(config, node_id)
    if not config.conductor:
        raise FailedPrecondition(
            "no peers: name them (kvcache drain --peer MESSENGER) or start the node with "
            "--conductor (or --etcd), whose node list gives them"
        )
    channel = make_channel(config.conductor, config.conductor_token, config.conductor_tls_ca)
    try:
        reply = cpbg.ConductorServiceStub(channel).ListNodes(cpb.ListNodesRequest(), timeout=10)
    except grpc.RpcError as e:
        raise FailedPrecondition(
            f"the conductor at {config.conductor} did not list the peers: "
            f"{e.code().name} {e.details()}"
        ) from None
    finally:
        channel.close()
    return [
        Peer(
            messenger=s.node.messenger_address,
            node_id=s.node.node_id,
            namespaces={layout_from_pb(x).namespace for x in s.node.layouts},
        )
        for s in reply.nodes
        if s.node.node_id != node_id and s.node.messenger_address
    ]


def drain(
    node: Node,
    config: NodeConfig,
    max_bytes: int = 0,
    max_seconds: float = 0.0,
    peers: list[str] | None = None,
) -> DrainResult:
    """Copy the hottest blocks to the peers, at most ``max_bytes`` (0: all) in ``max_seconds``
    (0: 60 s). The node keeps serving meanwhile (the peers read from it)."""
    if not config.messenger:
        raise FailedPrecondition(
            "this node has no messenger to serve its pages to the peers: start it with "
            "--messenger (and the messenger beside it)"
        )
    if max_seconds < 0 or max_seconds != max_seconds or max_seconds == float("inf"):
        raise InvalidArgument(f"max_seconds must be finite and >= 0, got {max_seconds}")
    for p in peers or ():
        host, _, port = p.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"peer {p[:100]!r} is not a messenger's host:port")
    t0 = time.monotonic()
    deadline = t0 + (max_seconds or DEFAULT_SECONDS)
    chosen = [Peer(messenger=p) for p in peers] if peers else conductor_peers(config, node.node_id)
    chosen = [p for p in chosen if p.messenger != config.messenger]
    if not chosen:
        raise FailedPrecondition(
            "no peer to drain to: no other node with a messenger is registered"
        )
    budget = max_bytes or (1 << 62)
    offered = 0
    channels = {p.messenger: make_channel(p.messenger, config.token, config.conductor_tls_ca)
                for p in chosen}  # fmt: skip
    try:
        for ns, store in list(node.stores.items()):
            page = store.layout.page_bytes
            takers = [p for p in chosen if p.namespaces is None or ns in p.namespaces]
            if not takers or budget < page:
                continue
            keys = store.hottest(budget // page)
            budget -= len(keys) * page
            offered += len(keys)
            shares: list[list[bytes]] = [[] for _ in takers]
            for i in range(0, len(keys), RUN):
                shares[(i // RUN) % len(takers)].extend(keys[i : i + RUN])
            for peer, share in zip(takers, shares):
                if share:
                    stub = mpbg.MessengerServiceStub(channels[peer.messenger])
                    _submit(peer, stub, ns, share, config.messenger)
        _wait(chosen, deadline)
    finally:
        for ch in channels.values():
            ch.close()
    blocks = sum(p.blocks for p in chosen)
    moved = sum(p.bytes for p in chosen)
    seconds = time.monotonic() - t0
    log.info(
        "drained %d of %d blocks (%d bytes) to %d peers in %.2f s",
        blocks, offered, moved, len(chosen), seconds,
    )  # fmt: skip
    return DrainResult(offered, blocks, moved, seconds, chosen)


def _submit(
    peer: Peer, stub: mpbg.MessengerServiceStub, ns: str, keys: list[bytes], source: str
) -> None:
    try:
        reply = stub.SubmitTransfer(
            mpb.SubmitTransferRequest(
                namespace=ns, entries=[mpb.TransferEntry(key=k, source=source) for k in keys]
            ),
            timeout=10,
        )
    except grpc.RpcError as e:
        log.warning("drain: %s refused %d blocks: %s %s", peer.messenger, len(keys),
                    e.code().name, e.details())  # fmt: skip
        peer.failed += len(keys)
        return
    peer.batches.append((stub, reply.batch_id))


def _wait(peers: list[Peer], deadline: float) -> None:
    """Poll every batch until it finished or the deadline passed (then cancel it), and count."""
    open_ = [(p, b) for p in peers for b in p.batches]
    while open_:
        still = []
        for peer, (stub, batch_id) in open_:
            late = time.monotonic() >= deadline
            try:
                st = stub.TransferStatus(mpb.TransferStatusRequest(batch_id=batch_id), timeout=10)
                if not st.finished and late:
                    st = stub.Cancel(mpb.CancelRequest(batch_id=batch_id), timeout=10)
            except grpc.RpcError as e:
                log.warning("drain: batch %s on %s: %s", batch_id, peer.messenger, e.code().name)
                continue  # counted as neither held nor failed: the peer is gone
            if st.finished or late:
                done = sum(e.state == mpb.ENTRY_DONE for e in st.entries)
                peer.blocks += done
                peer.failed += len(st.entries) - done
                peer.bytes += st.bytes_moved
            else:
                still.append((peer, (stub, batch_id)))
        open_ = still
        if open_:
            time.sleep(POLL_S)


def leave_soon(delay_s: float = 0.2) -> None:
    """Stop this process as SIGTERM does, once the reply that asked for it is on its way."""
    timer = threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGTERM))
    timer.daemon = True
    timer.start()
