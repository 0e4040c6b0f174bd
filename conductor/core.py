"""``Conductor``: the thread-safe domain object the gRPC service wraps.

One lock serialises the registry, the global index and the scheduler (each O(small) per call;
Python runs one thread at a time anyway, so finer locks would buy nothing). Event feeds name the
*generation* of the registration they belong to: a feed of an older registration of the same
node id is refused (``StaleFeed``) so it can never write into the new one's index entries.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from kvstore.errors import FailedPrecondition, echo
from kvstore.tiers import Tier

from .costmodel import DEFAULT_COST_MODEL, CostModel, PrefillSample
from .index import GlobalIndex
from .registry import DEFAULT_LEASE_S, NodeDescriptor, NodeLoad, NodeState, Registry
from .scheduler import Decision, Request, Scheduler, SchedulerConfig
from .transfer import TransferDispatcher, TransferHook


class StaleFeed(FailedPrecondition):
    """An event feed of a registration that is gone (lapsed, or replaced by a newer one)."""


@dataclass(frozen=True, kw_only=True)
class NodeView:
    """A copy of one node's state, safe to read outside the lock."""

    descriptor: NodeDescriptor
    generation: int
    load: NodeLoad
    lease_remaining_s: float
    indexed_blocks: int
    last_seq: int
    resyncing: bool
    queue_s: float
    prefill_pending: int
    decode_requests: int
    decode_tokens: int


@dataclass(frozen=True, kw_only=True)
class Maintenance:
    expired_nodes: list[tuple[str, int]]  # (node id, generation)
    stale_requests: list[str]
    sweep_done: bool


class Conductor:
    def __init__(self, scheduler: Scheduler, hook: TransferHook | None = None) -> None:
        self.scheduler = scheduler
        self.registry = scheduler.registry
        self.index = scheduler.index
        self.clock = scheduler.clock
        self.lock = threading.RLock()
        self.dispatcher = TransferDispatcher(hook) if hook is not None else None

    @classmethod
    def create(
        cls,
        policy: str = "global-cache",
        cost_model: CostModel = DEFAULT_COST_MODEL,
        lease_s: float = DEFAULT_LEASE_S,
        config: SchedulerConfig = SchedulerConfig(),
        hook: TransferHook | None = None,
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = None,
    ) -> "Conductor":
        registry = Registry(GlobalIndex(), lease_s=lease_s)
        return cls(
            Scheduler(
                registry,
                cost_model=cost_model,
                policy=policy,
                config=config,
                clock=clock,
                seed=seed,
            ),
            hook,
        )

    def close(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.close()

    # ---- membership -----------------------------------------------------------------------

    def register(
        self,
        descriptor: NodeDescriptor,
        load: NodeLoad | None = None,
        lease_s: float | None = None,
    ) -> NodeState:
        with self.lock:
            return self.registry.register(descriptor, self.clock(), load, lease_s)

    def update(self, descriptor: NodeDescriptor) -> NodeState:
        with self.lock:
            return self.registry.update(descriptor)

    def heartbeat(self, node_id: str, load: NodeLoad | None, generation: int = 0) -> NodeState:
        with self.lock:
            return self.registry.heartbeat(node_id, self.clock(), load, generation)

    def engine_report(self, node_id: str, load: NodeLoad | None) -> None:
        """The load of the engine beside ``node_id`` (None: it does not answer)."""
        with self.lock:
            self.registry.engine_report(node_id, load)

    def unregister(self, node_id: str, generation: int = 0) -> int | None:
        """Drop ``node_id`` (only registration ``generation`` if given); the generation removed,
        or None."""
        with self.lock:
            state = self.registry.find(node_id)
            if state is None or (generation and state.generation != generation):
                return None
            self.registry.drop(node_id)
            return state.generation

    def is_current(self, node_id: str, generation: int) -> bool:
        with self.lock:
            state = self.registry.find(node_id)
            return state is not None and state.generation == generation

    # ---- event feeds ----------------------------------------------------------------------

    def apply_events(self, node_id: str, generation: int, events: Iterable) -> int:
        """Apply proto ``BlockEvent``s; raises ``SequenceGap`` (resync) or ``StaleFeed``."""
        with self.lock:
            self._check_feed(node_id, generation)
            return self.index.apply_proto(node_id, events)

    def begin_resync(self, node_id: str, generation: int) -> None:
        with self.lock:
            self._check_feed(node_id, generation)
            self.index.begin_resync(node_id)

    def load_snapshot(
        self, node_id: str, generation: int, items: Iterable[tuple[bytes, int]]
    ) -> int:
        with self.lock:
            self._check_feed(node_id, generation)
            return self.index.load_snapshot(node_id, items)

    def finish_resync(self, node_id: str, generation: int, snapshot_seq: int) -> None:
        with self.lock:
            self._check_feed(node_id, generation)
            self.index.finish_resync(node_id, snapshot_seq)

    def last_seq(self, node_id: str, generation: int) -> int:
        with self.lock:
            self._check_feed(node_id, generation)
            return self.index.last_seq(node_id)

    def is_resyncing(self, node_id: str, generation: int) -> bool:
        with self.lock:
            self._check_feed(node_id, generation)
            return self.index.is_resyncing(node_id)

    def _check_feed(self, node_id: str, generation: int) -> None:
        state = self.registry.find(node_id)
        if state is None or state.generation != generation:
            raise StaleFeed(f"event feed of node {echo(node_id)} generation {generation} is stale")

    # ---- scheduling -----------------------------------------------------------------------

    def schedule(self, request: Request) -> Decision:
        with self.lock:
            decision = self.scheduler.schedule(request)
        if decision.transfer is not None and self.dispatcher is not None:
            self.dispatcher.dispatch(decision.transfer)
        return decision

    def prefill_done(
        self, request_id: str, measured_s: float | None = None, transfer_s: float | None = None
    ) -> None:
        with self.lock:
            self.scheduler.prefill_done(request_id, measured_s=measured_s, transfer_s=transfer_s)

    def engine_samples(
        self,
        prefills: Sequence[PrefillSample] = (),
        decode_steps: Sequence[tuple[int, float]] = (),
    ) -> None:
        """Cost-model measurements read from an engine (``conductor.engine_load``)."""
        with self.lock:
            self.scheduler.engine_samples(prefills, decode_steps)

    def complete(self, request_id: str) -> None:
        with self.lock:
            self.scheduler.complete(request_id)

    # ---- queries and upkeep ---------------------------------------------------------------

    def nodes(self) -> list[NodeView]:
        with self.lock:
            now = self.clock()
            return [
                NodeView(
                    descriptor=s.descriptor,
                    generation=s.generation,
                    load=s.load,
                    lease_remaining_s=max(s.lease_expires_at - now, 0.0),
                    indexed_blocks=self.index.blocks(s.node_id),
                    last_seq=self.index.last_seq(s.node_id),
                    resyncing=self.index.is_resyncing(s.node_id),
                    queue_s=self.scheduler.queue_seconds(s, now),
                    prefill_pending=s.prefill_pending,
                    decode_requests=s.decode_requests,
                    decode_tokens=s.decode_tokens,
                )
                for s in self.registry.nodes()
            ]

    def locate(self, keys: Sequence[bytes]) -> dict[str, list[Tier]]:
        """For each node holding a prefix of ``keys``: the tier of each block of that prefix."""
        with self.lock:
            lengths = self.index.prefix_lengths(keys)
            return {
                node_id: self.index.tiers(node_id, keys[:n])  # type: ignore[misc]
                for node_id, n in lengths.items()
            }

    def maintain(self, sweep_keys: int = 8192) -> Maintenance:
        """Drop lapsed nodes, expire stale ledger entries, sweep part of the index."""
        with self.lock:
            now = self.clock()
            expired = [(s.node_id, s.generation) for s in self.registry.expire(now)]
            stale = self.scheduler.expire_stale(now)
            done = self.index.sweep(sweep_keys)
        return Maintenance(expired_nodes=expired, stale_requests=stale, sweep_done=done)
