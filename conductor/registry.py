"""The node registry: who is in the cluster, what each node serves, its load, and its lease.

A node registers (``NodeDescriptor``) and keeps its lease alive with heartbeats carrying its load
(``NodeLoad``). ``expire(now)`` drops nodes whose lease lapsed, from the registry and from the
global index. Registering again (a restarted node, or one that lapsed) starts a new *generation*:
its index entries are reset and rebuilt from the snapshot its event feed starts with.

``NodeState`` also carries the scheduler's ledger for the node (work the conductor sent there and
has not seen finish), so a dropped node takes its ledger with it.

An inference engine beside a node reports its own load (``engine_report``, from the engine's
metrics, ``conductor.engine_load``): its queue and running requests are merged into the node's
``load`` (the larger of the two reports per field), and an engine that answered once and then
stops answering takes its node out of scheduling (``engine_down``) until it answers again. Both
outlive a re-registration of the node.

Not thread-safe: ``conductor.core.Conductor`` serialises calls with one lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvstore.errors import InvalidArgument, NotFound, echo
from kvstore.layout import KVLayout
from rpc.cluster import NodeDescriptor, NodeLoad, Role, TierUsage

from .index import GlobalIndex

DEFAULT_LEASE_S = 10.0
__all__ = [
    "DEFAULT_LEASE_S",
    "NodeDescriptor",
    "NodeLoad",
    "NodeState",
    "Registry",
    "Role",
    "TierUsage",
]


@dataclass(slots=True, eq=False)
class NodeState:
    """A registered node: descriptor, lease, reported load, and the scheduler's ledger."""

    descriptor: NodeDescriptor
    generation: int
    registered_at: float
    lease_expires_at: float
    load: NodeLoad = field(default_factory=NodeLoad)  # the node's report merged with its engine's
    last_heartbeat: float = 0.0
    reported: NodeLoad = field(default_factory=NodeLoad)  # the node's own last report
    engine_down: bool = False  # its engine answered before and does not now: not schedulable
    lease_s: float = DEFAULT_LEASE_S  # inf: liveness is etcd's (conductor.membership_watch)
    # ---- scheduler ledger (conductor.scheduler) ----
    prefill_busy_until: float = 0.0  # when the prefill work sent here should be done
    prefill_pending_s: float = 0.0  # estimated seconds of prefill sent and not yet done
    prefill_pending: int = 0  # requests sent and not yet prefilled
    decode_requests: int = 0  # requests decoding (or about to) here
    decode_tokens: int = 0  # their context tokens
    node_id: str = field(init=False)  # = descriptor.node_id (a plain slot: read per decision)

    def __post_init__(self) -> None:
        self.node_id = self.descriptor.node_id


class Registry:
    """Registered nodes with leases; keeps ``index`` in step (a node in one is in the other)."""

    def __init__(self, index: GlobalIndex, lease_s: float = DEFAULT_LEASE_S) -> None:
        if lease_s <= 0:
            raise InvalidArgument(f"lease must be positive, got {lease_s}")
        self.index = index
        self.lease_s = lease_s
        self._nodes: dict[str, NodeState] = {}
        self._generation = 0
        # node id -> its engine's last load (None: the engine stopped answering); ids of engines
        # that never answered are absent, and count as up: engines start after their nodes.
        self._engines: dict[str, NodeLoad | None] = {}
        self.version = 0  # bumped on every membership change (caches key on it)

    def register(
        self,
        descriptor: NodeDescriptor,
        now: float,
        load: NodeLoad | None = None,
        lease_s: float | None = None,
    ) -> NodeState:
        """Add (or re-add) a node. Its index entries start empty: its event feed must start
        with a snapshot. Returns the new state (``generation`` identifies this registration).
        ``lease_s``: this registration's lease (default the registry's; inf: never lapses
        here, etcd drops it)."""
        if descriptor.node_id in self._nodes:
            self.drop(descriptor.node_id)
        self._generation += 1
        lease_s = self.lease_s if lease_s is None else lease_s
        reported = load or NodeLoad()
        engine = self._engines.get(descriptor.node_id)
        state = NodeState(
            descriptor=descriptor,
            generation=self._generation,
            registered_at=now,
            lease_expires_at=now + lease_s,
            load=_with_engine(reported, engine),
            last_heartbeat=now,
            lease_s=lease_s,
            prefill_busy_until=now,
            reported=reported,
            engine_down=descriptor.node_id in self._engines and engine is None,
        )
        self._nodes[descriptor.node_id] = state
        self.index.add_node(descriptor.node_id)
        self.version += 1
        return state

    def heartbeat(
        self, node_id: str, now: float, load: NodeLoad | None = None, generation: int = 0
    ) -> NodeState:
        """Renew a lease. NotFound when the node is unknown, its lease lapsed, or
        ``generation`` (if given) names an older registration: the node must register again."""
        state = self._nodes.get(node_id)
        if state is None or (generation and generation != state.generation):
            raise NotFound(
                f"node {echo(node_id)} is not registered (lease lapsed or conductor "
                "restarted): register again"
            )
        state.lease_expires_at = now + state.lease_s
        state.last_heartbeat = now
        if load is not None:
            state.reported = load
            state.load = _with_engine(load, self._engines.get(node_id))
        return state

    def engine_report(self, node_id: str, load: NodeLoad | None) -> None:
        """The load of ``node_id``'s engine, or None when it does not answer. An engine that
        never answered is not held against its node; one that did and stops is (``engine_down``,
        and the membership version moves so schedulers recompute their candidates)."""
        known = node_id in self._engines
        if load is None and not known:
            return
        self._engines[node_id] = load
        state = self._nodes.get(node_id)
        if state is None:
            return
        state.load = _with_engine(state.reported, load)
        if state.engine_down != (load is None):
            state.engine_down = load is None
            self.version += 1

    def engines(self) -> dict[str, NodeLoad | None]:
        """Node id -> its engine's last load (None: not answering), for engines heard from."""
        return dict(self._engines)

    def update(self, descriptor: NodeDescriptor) -> NodeState:
        """A registered node's descriptor changed in place (e.g. its messenger's address),
        same address and store: generation, ledger and index entries stay."""
        state = self.get(descriptor.node_id)
        if descriptor.address != state.descriptor.address:
            raise InvalidArgument(
                f"node {echo(descriptor.node_id)} moved to {echo(descriptor.address)}: "
                "register it again"
            )
        state.descriptor = descriptor
        self.version += 1
        return state

    def drop(self, node_id: str) -> NodeState | None:
        state = self._nodes.pop(node_id, None)
        if state is not None:
            self.index.drop_node(node_id)
            self.version += 1
        return state

    def expire(self, now: float) -> list[NodeState]:
        """Drop every node whose lease lapsed before ``now``."""
        lapsed = [s for s in self._nodes.values() if s.lease_expires_at < now]
        for state in lapsed:
            self.drop(state.node_id)
        return lapsed

    def get(self, node_id: str) -> NodeState:
        state = self._nodes.get(node_id)
        if state is None:
            raise NotFound(f"node {echo(node_id)} is not registered")
        return state

    def find(self, node_id: str) -> NodeState | None:
        return self._nodes.get(node_id)

    def nodes(self) -> list[NodeState]:
        return list(self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node_id: str) -> bool:
        return node_id in self._nodes

    def layout(self, namespace: str) -> KVLayout | None:
        """The layout registered for ``namespace`` by any node, or None."""
        for state in self._nodes.values():
            for layout in state.descriptor.layouts:
                if layout.namespace == namespace:
                    return layout
        return None


def _with_engine(reported: NodeLoad, engine: NodeLoad | None) -> NodeLoad:
    """A node's report with its engine's queue and decode load (the larger of each; a node
    server itself reports 0 for them, only engines and simulations know)."""
    if engine is None:
        return reported
    return replace(
        reported,
        queued_prefill_tokens=max(reported.queued_prefill_tokens, engine.queued_prefill_tokens),
        running_decode_requests=max(
            reported.running_decode_requests, engine.running_decode_requests
        ),
        running_decode_tokens=max(reported.running_decode_tokens, engine.running_decode_tokens),
    )
