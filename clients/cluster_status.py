"""A running cluster at a glance (``kvcache status``): what each process says about itself, read
with the RPCs every role serves, into typed snapshots.

- the conductor: ``ListNodes`` (registered nodes and their load, policy, leader, decisions and
  rejections since start);
- each node: gRPC health and ``Stats`` (tier fill per layout, pinned pages, hits and misses,
  each tenant's leases, leased pages, blocks and streams);
- each messenger: gRPC health, ``GetInfo`` (transport) and ``Stats`` (transfers in flight, byte
  totals).

Counters are totals since each process started; ``with_rates`` turns two snapshots into per-second
figures (decisions/s, GB/s). A process that does not answer is reported with its status code, never
raised: a status tool is most needed when something is down.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, TypeVar

from proto import conductor_pb2 as cpb
from rpc.status import KVCacheRpcError

from .conductor_client import ConductorClient
from .messenger_client import MessengerClient
from .node_client import KVStoreClient

T = TypeVar("T")
_ROLE = {
    cpb.NODE_ROLE_PREFILL: "prefill",
    cpb.NODE_ROLE_DECODE: "decode",
    cpb.NODE_ROLE_BOTH: "both",
    cpb.NODE_ROLE_UNSPECIFIED: "both",
}
_TIER = {1: "gpu", 2: "dram", 3: "ssd"}


@dataclass(frozen=True)
class Target:
    """A node (and its messenger) to ask, as cluster.json or the conductor names it."""

    id: str
    role: str
    address: str
    messenger: str = ""


@dataclass
class TierFill:
    tier: str
    capacity_pages: int
    used_pages: int
    pinned_pages: int
    page_bytes: int

    @property
    def fill(self) -> float:
        return self.used_pages / self.capacity_pages if self.capacity_pages else 0.0


@dataclass
class LayoutStatus:
    namespace: str
    blocks: int
    hits: int
    misses: int
    bytes_written: int
    bytes_read: int
    tiers: list[TierFill]

    @property
    def hit_rate(self) -> float | None:
        """Looked-up blocks found, since the node started (None: nothing looked up yet)."""
        total = self.hits + self.misses
        return self.hits / total if total else None


@dataclass
class MessengerStatus:
    address: str
    health: str
    transport: str = ""
    batches_in_flight: int = 0
    entries_in_flight: int = 0
    entries_done: int = 0
    entries_failed: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    uptime_s: float = 0.0
    recv_gbps: float | None = None  # from two snapshots (with_rates)
    sent_gbps: float | None = None
    error: str = ""


@dataclass
class TenantStatus:
    """One tenant's use of one node (its fair share; the admin is tenant "")."""

    tenant: str
    leases: int
    leased_pages: int
    stored_blocks: int
    streams: int


@dataclass
class NodeStatus:
    id: str
    role: str
    address: str
    health: str
    registered: bool = False  # the conductor holds a lease for it
    lease_remaining_s: float = 0.0
    indexed_blocks: int = 0
    queued_prefill_tokens: int = 0
    decode_requests: int = 0
    decode_tokens: int = 0
    queue_s: float = 0.0  # the scheduler's estimate of prefill work queued there
    layouts: list[LayoutStatus] = field(default_factory=list)
    tenants: list[TenantStatus] = field(default_factory=list)
    messenger: MessengerStatus | None = None
    error: str = ""

    @property
    def pinned_pages(self) -> int:
        return sum(t.pinned_pages for lay in self.layouts for t in lay.tiers)

    @property
    def hit_rate(self) -> float | None:
        hits = sum(lay.hits for lay in self.layouts)
        total = hits + sum(lay.misses for lay in self.layouts)
        return hits / total if total else None


@dataclass
class ConductorStatus:
    address: str
    health: str
    leader: str = ""
    policy: str = ""
    registered_nodes: int = 0
    indexed_keys: int = 0
    pending_requests: int = 0
    decisions: int = 0
    rejections: int = 0
    uptime_s: float = 0.0
    decisions_per_s: float | None = None  # from two snapshots (with_rates)
    error: str = ""


@dataclass
class ClusterStatus:
    taken_at: float  # time.time() of the snapshot
    monotonic: float
    conductor: ConductorStatus | None
    nodes: list[NodeStatus]

    def problems(self) -> list[str]:
        """What an operator should look at; empty when every process serves."""
        out = []
        c = self.conductor
        if c is not None and (c.health != "SERVING" or c.error):
            out.append(f"conductor {c.address}: {c.error or c.health}")
        for n in self.nodes:
            if n.health != "SERVING" or n.error:
                out.append(f"node {n.id} {n.address}: {n.error or n.health}")
            elif c is not None and not c.error and not n.registered:
                out.append(f"node {n.id} is not registered with the conductor")
            m = n.messenger
            if m is not None and (m.health != "SERVING" or m.error):
                out.append(f"messenger of {n.id} {m.address}: {m.error or m.health}")
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the derived figures (fill, hit rates, pinned pages) spelled out."""
        nodes = []
        for n in self.nodes:
            d = asdict(n)
            d["pinned_pages"] = n.pinned_pages
            d["hit_rate"] = n.hit_rate
            for lay, ld in zip(n.layouts, d["layouts"]):
                ld["hit_rate"] = lay.hit_rate
                for t, td in zip(lay.tiers, ld["tiers"]):
                    td["fill"] = t.fill
            nodes.append(d)
        return {
            "taken_at": self.taken_at,
            "conductor": asdict(self.conductor) if self.conductor else None,
            "nodes": nodes,
            "problems": self.problems(),
        }


def _why(e: Exception) -> str:
    if isinstance(e, KVCacheRpcError):
        hint = ""
        if e.code.name in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            hint = " (give the cluster's admin token: --token-file, $KVCACHE_TOKEN)"
        return f"{e.code.name}: {e.details}{hint}"
    return f"{type(e).__name__}: {e}"


def _try(fn: Callable[[], T]) -> tuple[T | None, str]:
    try:
        return fn(), ""
    except (KVCacheRpcError, OSError, ValueError) as e:
        return None, _why(e)


class StatusReader:
    """Reads snapshots of one cluster; keeps its channels between reads (``--watch``)."""

    def __init__(
        self,
        conductor: str | None,
        nodes: list[Target],
        token: str | None = None,
        tls_ca_file: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self._conductor_address = conductor
        self._targets = list(nodes)
        self._token, self._tls_ca, self._timeout = token, tls_ca_file, timeout_s
        self._conductor = (
            ConductorClient(conductor, token, tls_ca_file, timeout_s) if conductor else None
        )
        self._nodes: dict[str, KVStoreClient] = {}
        self._messengers: dict[str, MessengerClient] = {}
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="status")

    def _node_client(self, address: str) -> KVStoreClient:
        if address not in self._nodes:
            self._nodes[address] = KVStoreClient(
                address, self._token, self._tls_ca, use_shm=False, timeout_s=self._timeout
            )
        return self._nodes[address]

    def _messenger_client(self, address: str) -> MessengerClient:
        if address not in self._messengers:
            self._messengers[address] = MessengerClient(
                address, self._token, self._tls_ca, timeout_s=self._timeout
            )
        return self._messengers[address]

    def read(self) -> ClusterStatus:
        taken_at, mono = time.time(), time.monotonic()
        conductor, registered = self._read_conductor()
        targets = {t.id: t for t in self._targets}
        for view in registered.values():  # nodes the conductor knows that no file named
            d = view.node
            targets.setdefault(
                d.node_id, Target(d.node_id, _ROLE[d.role], d.address, d.messenger_address)
            )
        nodes = list(
            self._pool.map(lambda t: self._read_node(t, registered.get(t.id)), targets.values())
        )
        return ClusterStatus(taken_at, mono, conductor, nodes)

    def _read_conductor(self) -> tuple[ConductorStatus | None, dict[str, Any]]:
        if self._conductor is None:
            return None, {}
        c = ConductorStatus(address=self._conductor.address, health=self._conductor.health())
        reply, c.error = _try(self._conductor.list_nodes)
        if reply is None:
            return c, {}
        c.leader = reply.leader or c.address
        c.policy = reply.policy
        c.registered_nodes = len(reply.nodes)
        c.indexed_keys = reply.indexed_keys
        c.pending_requests = reply.pending_requests
        c.decisions, c.rejections, c.uptime_s = reply.decisions, reply.rejections, reply.uptime_s
        return c, {n.node.node_id: n for n in reply.nodes}

    def _read_node(self, target: Target, view: Any) -> NodeStatus:
        client = self._node_client(target.address)
        n = NodeStatus(id=target.id, role=target.role, address=target.address, health="")
        n.health = client.health()
        if view is not None:
            n.registered = True
            n.role = _ROLE[view.node.role]
            n.lease_remaining_s = view.lease_remaining_s
            n.indexed_blocks = view.indexed_blocks
            n.queued_prefill_tokens = view.load.queued_prefill_tokens
            n.decode_requests = view.load.running_decode_requests
            n.decode_tokens = view.load.running_decode_tokens
            n.queue_s = view.queue_s
        if n.health == "SERVING":
            stats, n.error = _try(client.stats)
            if stats is not None:
                n.layouts = [_layout(ns) for ns in stats.namespaces]
                n.tenants = [
                    TenantStatus(t.tenant, t.leases, t.leased_pages, t.stored_blocks, t.streams)
                    for t in stats.tenants
                ]
        messenger = target.messenger or (view.node.messenger_address if view is not None else "")
        if messenger:
            n.messenger = self._read_messenger(messenger)
        return n

    def _read_messenger(self, address: str) -> MessengerStatus:
        client = self._messenger_client(address)
        m = MessengerStatus(address=address, health=client.health())
        if m.health != "SERVING":
            return m
        info, m.error = _try(client.info)
        if info is not None:
            m.transport = info.transport
        stats, err = _try(client.stats)
        m.error = m.error or err
        if stats is not None:
            m.batches_in_flight = stats.batches_in_flight
            m.entries_in_flight = stats.entries_in_flight
            m.entries_done, m.entries_failed = stats.entries_done, stats.entries_failed
            m.bytes_received, m.bytes_sent = stats.bytes_received, stats.bytes_sent
            m.uptime_s = stats.uptime_s
        return m

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._conductor is not None:
            self._conductor.close()
        for c in self._nodes.values():
            c.close()
        for m in self._messengers.values():
            m.close()

    def __enter__(self) -> "StatusReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _layout(ns: Any) -> LayoutStatus:
    return LayoutStatus(
        namespace=ns.namespace,
        blocks=ns.blocks,
        hits=sum(ns.hits.values()),
        misses=ns.misses,
        bytes_written=ns.bytes_written,
        bytes_read=ns.bytes_read,
        tiers=[
            TierFill(
                tier=_TIER.get(t.tier, str(t.tier)),
                capacity_pages=t.capacity_pages,
                used_pages=t.used_pages,
                pinned_pages=t.pinned_blocks,
                page_bytes=t.page_bytes,
            )
            for t in ns.tiers
            if t.capacity_pages
        ],
    )


def with_rates(before: ClusterStatus, now: ClusterStatus) -> ClusterStatus:
    """``now`` with per-second figures from the counters' growth since ``before`` (a process
    that restarted in between, its counters back near 0, gets none)."""
    dt = now.monotonic - before.monotonic
    if dt <= 0:
        return now
    c0, c1 = before.conductor, now.conductor
    conductor = c1
    if c0 is not None and c1 is not None and not c1.error and c1.decisions >= c0.decisions:
        conductor = replace(c1, decisions_per_s=(c1.decisions - c0.decisions) / dt)
    old = {n.id: n.messenger for n in before.nodes}
    nodes = []
    for n in now.nodes:
        m0, m1 = old.get(n.id), n.messenger
        if (
            m0 is not None
            and m1 is not None
            and not m1.error
            and m1.health == "SERVING"
            and m1.address == m0.address
            and m1.bytes_received >= m0.bytes_received
            and m1.bytes_sent >= m0.bytes_sent
        ):
            m1 = replace(
                m1,
                recv_gbps=(m1.bytes_received - m0.bytes_received) / dt / 1e9,
                sent_gbps=(m1.bytes_sent - m0.bytes_sent) / dt / 1e9,
            )
            n = replace(n, messenger=m1)
        nodes.append(n)
    return replace(now, conductor=conductor, nodes=nodes)
