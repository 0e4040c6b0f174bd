"""TieredStore: the block index, tiers, leases and eviction of one node for one model layout.

Invariants (``TieredStore.check_invariants`` checks them; see ``invariants.py``):
- A committed block lives in exactly one tier (exclusive tiers); ``_index`` maps its key to it.
- A tier's slot is in exactly one of: the free list, a writer's lease, the quarantine of expired
  write leases, or ``tier.keys`` (committed).
- A committed block is in its tier's eviction policy iff it is not pinned.
- Writers' pages are invisible until ``commit``; a lease that expires quarantines them, and they
  return to the free list ``quarantine_s`` later (a late same-host writer may still write there).
- An allocation never evicts the blocks of its own key list (the prefix it is about to reuse).
- Eviction never touches pinned or leased pages; when nothing can be freed, allocation raises
  ``CapacityExhausted`` at once.

Every public method takes one lock; bulk copies run under it too, so a lease can never expire and
hand its page to someone else halfway through a copy. Metadata work per page is O(1).

The store is split by job, over one shared state:
- ``records``: the public value types (config, results, stats);
- ``blocks``: the shared state (index, tiers, counters, events) and block primitives;
- ``leases``: lease handles, deadlines and expiry (``LeaseBook``);
- ``movement``: eviction, demotion and promotion (``TierMovement``);
- ``tier_setup``: opening the tiers' pools and re-indexing the SSD tier (``TierSetup``);
- ``writes``: allocate, write, commit, abort (``TwoPhaseWrites``);
- ``reads``: lookup, and pinned reads: acquire, copy out, release (``PinnedReads``);
- ``invariants``: the consistency check;
- this module: ``TieredStore``, the public API over them: construction, page views, removal,
  events, stats, close. Every public name stays importable here.
"""

from __future__ import annotations

from typing import Any, Sequence, cast

from .errors import NotFound
from .events import BlockEvent
from .invariants import InvariantViolation, check_store
from .keys import BlockKey, block_keys, check_keys, root_key
from .layout import KVLayout
from .leases import ReadLease, WriteLease
from .pools import PagePool
from .reads import PinnedReads
from .records import (
    DEFAULT_LEASE_TTL_S,
    CommitResult,
    LookupResult,
    StoreConfig,
    StoreStats,
    TierStats,
)
from .tier_setup import TierSetup
from .tiers import TIER_OF, Tier
from .writes import TwoPhaseWrites

__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "CommitResult",
    "InvariantViolation",
    "LookupResult",
    "ReadLease",
    "StoreConfig",
    "StoreStats",
    "TierStats",
    "TieredStore",
    "WriteLease",
]


class TieredStore(TierSetup, TwoPhaseWrites, PinnedReads):
    """Paged KV blocks of one layout in GPU / DRAM / SSD tiers. Thread-safe; batch-first."""

    def __init__(self, layout: KVLayout, config: StoreConfig) -> None:
        super().__init__(layout, config)
        self._closed = False
        try:
            self._open_tiers()
            self._recover_ssd()
        except BaseException:
            self._give_back()
            self._close_pools()
            raise
        for ts in self._tiers.values():
            if ts.budget is not None:
                ts.budget.join(self)

    # ---- properties ------------------------------------------------------------------------

    @property
    def shm_name(self) -> str | None:
        ts = self._tiers.get(Tier.DRAM)
        return getattr(ts.pool, "shm_name", None) if ts else None

    @property
    def quarantine_s(self) -> float:
        """Seconds the pages of an expired write lease stay out of reuse."""
        return self._quarantine_s

    @property
    def tiers(self) -> list[Tier]:
        return sorted(self._tiers)

    def capacity(self, tier: Tier) -> int:
        ts = self._tiers.get(tier)
        return ts.capacity if ts else 0

    def pool(self, tier: Tier) -> PagePool:
        return self._tiers[tier].pool

    def keys_for(self, tokens: Any, salt: bytes | str = b"") -> list[BlockKey]:
        """Block keys of ``tokens`` in this store's namespace under ``salt``."""
        return block_keys(tokens, self.layout.block_tokens, root_key(self.namespace, salt))

    # ---- page views ---------------------------------------------------------------------------

    def page_view(self, lease: WriteLease | ReadLease, index: int, layer: int | None = None) -> Any:
        """Zero-copy view of a leased or pinned page (or one layer of it), valid while the lease
        is. Writers fill it in place; readers must not write to it."""
        slot = lease.slots[index]
        if slot < 0:
            raise NotFound(f"key #{index} of lease {lease.lease_id} has no page")
        # A found key (slot >= 0) of a read lease always has its tier.
        tier = lease.tier if isinstance(lease, WriteLease) else cast(Tier, lease.tiers[index])
        if isinstance(lease, WriteLease):
            with self._lock:
                self._check_generations(lease, index)
        view = self._tiers[tier].pool.page_view(slot)
        if view is None or layer is None:
            return view
        offset = self.layout.layer_offset(layer)
        return view[offset : offset + self.layout.layer_bytes]

    def _give_back(self) -> None:
        for ts in getattr(self, "_tiers", {}).values():
            if ts.budget is not None:
                ts.budget.leave(self)  # what it held is unassigned again
                ts.budget = None  # NOTE: given back once; the store is closing

    # ---- removal, events, stats ----------------------------------------------------------------

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop blocks; a pinned block goes when its last pin is released. Returns how many."""
        checked = check_keys(keys)
        n = 0
        unique = list(dict.fromkeys(checked))
        with self._lock:
            for key, h in zip(unique, self._index.get_many(unique)):
                if h < 0:
                    continue
                n += 1
                # NOTE: one named earlier may have taken this one with it (prefix policy: the
                # descendants of a removed block go too); it still counts as removed.
                if self._index.get(key) == h:
                    self._discard(key, h)
        return n

    def hottest(self, limit: int) -> list[BlockKey]:
        """Up to ``limit`` keys of committed blocks, the ones their tier's policy would evict
        last first, faster tiers before slower (what a leaving node hands its peers first).
        Blocks pinned by readers are not eviction candidates and are left out. O(blocks)."""
        out: list[BlockKey] = []
        with self._lock:
            for tier in sorted(self._tiers):
                ts = self._tiers[tier]
                for slot in reversed(ts.policy.order()):
                    if len(out) >= limit:
                        return out
                    if not ts.doomed[slot]:
                        out.append(ts.key_at(slot))
        return out

    def take_events(self, max_events: int | None = None) -> list[BlockEvent]:
        with self._lock:
            return self._events.take(max_events)

    def snapshot(self) -> tuple[int, list[tuple[BlockKey, Tier]]]:
        """Every stored key with its tier, and the sequence number this snapshot is current to."""
        with self._lock:
            return self._events.last_seq, [
                (BlockKey(k), TIER_OF[h & 3]) for k, h in self._index.items()
            ]

    def expire_leases(self) -> int:
        with self._lock:
            return self._expire_locked()

    def stats(self) -> StoreStats:
        page = self.layout.page_bytes
        with self._lock:
            tiers = [
                TierStats(
                    tier=t,
                    capacity_pages=ts.capacity,
                    used_pages=ts.capacity
                    - len(ts.withheld)
                    - len(ts.free)
                    - ts.leased
                    - ts.quarantined,
                    granted_pages=None if ts.budget is None else ts.capacity - len(ts.withheld),
                    grantable_pages=0
                    if ts.budget is None
                    else min(len(ts.withheld), ts.budget.unassigned_bytes // page),
                    leased_pages=ts.leased,
                    quarantined_pages=ts.quarantined,
                    pinned_blocks=ts.pinned,
                    hits=ts.hits,
                    evictions=ts.evictions,
                )
                for t, ts in sorted(self._tiers.items())
            ]
            n = self._n
            return StoreStats(
                tiers=tiers,
                blocks=len(self._index),
                misses=n.misses,
                demotions=n.demotions,
                promotions=n.promotions,
                corrupt_pages=n.corrupt_pages,
                bytes_written=n.bytes_written,
                bytes_read=n.bytes_read,
                write_leases=len(self._write_leases),
                read_leases=len(self._read_leases),
                expired_leases=n.expired_leases,
                last_event_seq=self._events.last_seq,
                dropped_events=self._events.dropped,
                demotion_failures=n.demotion_failures,
            )

    def check_invariants(self) -> None:
        """Raise ``InvariantViolation`` (an ``AssertionError``) listing every broken invariant
        (see ``invariants.py``). O(pages + leases), plus a key scan of the SSD tier: for tests
        and debugging, not a hot path. A closed store dropped its state: there is nothing to check.
        """
        with self._lock:
            if not self._closed:
                check_store(self)

    def close(self) -> None:
        """Drop every lease and release pools (shared memory unlinked, lmdb synced)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._write_leases.clear()
            self._read_leases.clear()
            self._quarantine.clear()
            self._quarantined.clear()
            self._give_back()
            self._close_pools()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
