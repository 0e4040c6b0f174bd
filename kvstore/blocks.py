"""The state every part of the store shares, and the primitives that keep it consistent.

``BlockStore`` holds the block index, the tiers' page bookkeeping, the event log and the counters,
and knows how to publish a block, pin and unpin it, and take it out of the index. The store's other
parts are mixins over it (``leases.LeaseBook``, ``movement.TierMovement``, ``tier_setup.TierSetup``,
and over the first two ``writes.TwoPhaseWrites`` and ``reads.PinnedReads``) and ``TieredStore``
combines them, so all of them work on this one state under the one store lock. Imports run one way:
``store`` -> ``writes`` / ``reads`` -> ``leases`` / ``movement`` (and ``store`` -> ``tier_setup``)
-> ``blocks`` -> ``records``, ``pools``, ``policy``.

A block is named by its *handle*, ``slot << 2 | tier``: where its page is. Everything else about it
lives in flat per-slot arrays of its tier (its key, pins, whether it is doomed), and the index maps
keys to handles (``index.KeyIndex``). No Python object exists per block: a cached block costs the
index entry and a few bytes of arrays, not a dict entry, a key object and a record. A pinned block
never moves, so a handle a read lease holds stays valid until the lease lets go of it.
"""

from __future__ import annotations

import threading
from array import array
from dataclasses import dataclass, field

from .budget import SharedBudget
from .errors import InvalidArgument
from .events import EventKind, EventLog
from .index import Index, make_index
from .keys import KEY_BYTES, BlockKey
from .layout import KVLayout
from .policy import EvictionPolicy
from .pools import PagePool
from .records import StoreConfig
from .tiers import Tier
from .tree import PrefixTree

Handle = int  # slot << 2 | tier


def handle(tier: int, slot: int) -> Handle:
    return slot << 2 | tier


@dataclass(slots=True, eq=False)
class TierState:
    tier: Tier
    pool: PagePool
    policy: EvictionPolicy  # the committed, unpinned slots: the only eviction candidates
    capacity: int
    # Per slot. A slot is exactly one of: free (in ``free``), leased to a writer, quarantined,
    # held by a committed block (``held``): indexed, or ``doomed`` (out of the index, its page
    # kept until its last reader unpins it), or withheld (not granted by a shared budget).
    free: array[int] = field(init=False)
    keys: bytearray = field(init=False)  # the held block's key, KEY_BYTES per slot
    held: bytearray = field(init=False)
    doomed: bytearray = field(init=False)
    pins: array[int] = field(init=False)
    # Bumped each time the slot leaves the free list, so a write lease can tell that a page it
    # was given has since gone to someone else (a fence against late writers).
    gens: array[int] = field(init=False)
    leased: int = 0
    quarantined: int = 0  # pages of expired write leases, held back from reuse for a while
    pinned: int = 0
    hits: int = 0
    evictions: int = 0
    write_error: str | None = None  # the pool's last refused write, until one succeeds
    # Under a budget shared with other layouts' stores (budget.py): slots not granted are
    # withheld (no bytes behind them), and ``refused`` counts pages asked for and not granted.
    budget: SharedBudget | None = None
    withheld: array[int] = field(init=False)
    refused: int = 0

    def __post_init__(self) -> None:
        n = self.capacity
        self.free = array("i", range(n - 1, -1, -1))
        self.withheld = array("i")
        if self.budget is not None:
            self.free, self.withheld = self.withheld, self.free
        self.keys = bytearray(n * KEY_BYTES)
        self.held = bytearray(n)
        self.doomed = bytearray(n)
        self.pins = array("I", bytes(4 * n))
        self.gens = array("I", bytes(4 * n))

    def key_at(self, slot: int) -> BlockKey:
        o = slot * KEY_BYTES
        return BlockKey(bytes(self.keys[o : o + KEY_BYTES]))

    def hold(self, slot: int, key: bytes) -> None:
        o = slot * KEY_BYTES
        self.keys[o : o + KEY_BYTES] = key
        self.held[slot] = 1


@dataclass
class Counters:
    misses: int = 0
    demotions: int = 0
    promotions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    expired_leases: int = 0
    corrupt_pages: int = 0
    demotion_failures: int = 0  # blocks a lower tier refused (full disk): dropped or left in place


class BlockStore:
    """Shared state and block primitives. Methods with a leading underscore expect the caller to
    hold ``_lock``."""

    def __init__(self, layout: KVLayout, config: StoreConfig) -> None:
        self.layout = layout
        self.config = config
        self.namespace = layout.namespace
        self._clock = config.clock
        self._lock = threading.RLock()
        self._closed = False
        # Holds only indexed blocks, at most one per page of every tier.
        pages = max(0, config.gpu_pages) + max(0, config.dram_pages) + max(0, config.ssd_pages)
        self._index: Index = make_index(pages)
        self._tiers: dict[Tier, TierState] = {}
        self._by_int: list[TierState | None] = [None, None, None]  # tier number -> state
        self._events = EventLog(config.max_events, config.on_event)
        self._n = Counters()
        self._tree: PrefixTree | None = None  # kept when a tier's policy orders by prefix

    def _grow_tree(self) -> None:
        """Keep the prefix tree if a tier's policy needs it (after the tiers are added)."""
        if not any(ts.policy.wants_tree for ts in self._tiers.values()):
            return
        self._tree = PrefixTree([ts.capacity if ts else 0 for ts in self._by_int])
        last = max(self._tiers)
        for t, ts in self._tiers.items():
            # NOTE: eviction from the last tier drops a block: its children anywhere would be
            # orphaned. Above it, eviction demotes: only children in the same tier count.
            kids = self._tree.kids if t == last else self._tree.tkids
            ts.policy.attach_tree(kids[t])

    def _add_tier(self, ts: TierState) -> None:
        self._tiers[ts.tier] = ts
        self._by_int[ts.tier] = ts

    def _tier(self, tier: Tier | str | int) -> TierState:
        ts = self._tiers.get(Tier.parse(tier))
        if ts is None:
            raise InvalidArgument(f"this store has no {Tier.parse(tier).name} tier")
        return ts

    def _ts(self, h: Handle) -> TierState:
        ts = self._by_int[h & 3]
        assert ts is not None, f"handle {h} names an absent tier"
        return ts

    def _publish(self, ts: TierState, key: BlockKey, slot: int, parent: Handle = -1) -> None:
        """Index a committed block; the caller makes it evictable (``policy.insert_many``).
        ``parent``: the handle of the block before it in its chain, where known."""
        h = slot << 2 | ts.tier
        self._index.put(key, h)
        ts.hold(slot, key)
        if self._tree is not None:
            self._tree.link(h, parent)
        self._events.append(EventKind.STORED, key, ts.tier)

    def _pin(self, h: Handle) -> None:
        ts, slot = self._ts(h), h >> 2
        if ts.pins[slot] == 0:
            ts.policy.remove(slot)
            ts.pinned += 1
        ts.pins[slot] += 1

    def _unpin_blocks(self, handles: list[Handle]) -> None:
        by_int = self._by_int
        back: list[list[int]] = [[], [], []]  # per tier: slots evictable again, in chain order
        for h in handles:
            ts, slot = by_int[h & 3], h >> 2
            assert ts is not None
            pins = ts.pins[slot]
            if pins == 0:
                continue
            ts.pins[slot] = pins - 1
            if pins == 1:
                ts.pinned -= 1
                if ts.doomed[slot]:
                    self._free_page(ts, slot)
                else:
                    back[h & 3].append(slot)
        for t, slots in enumerate(back):
            if slots:
                ts = by_int[t]
                assert ts is not None
                ts.policy.insert_many(slots, fresh=False)

    def _discard(self, key: BlockKey, h: Handle) -> None:
        """Take a block out of the index (reported evicted); its page is freed now, or on its
        last unpin if a reader still holds it. With the prefix tree, its descendants go too:
        nothing can reach them any more."""
        ts, slot = self._ts(h), h >> 2
        if self._index.get(key) == h:
            self._index.pop(key)
            self._events.append(EventKind.EVICTED, key, ts.tier)
        if ts.pins[slot]:
            ts.doomed[slot] = 1
        else:
            self._free_page(ts, slot)
        if self._tree is not None:
            self._drop_orphans(self._tree.detach(h, self._is_pinned))

    def _is_pinned(self, h: Handle) -> bool:
        return self._ts(h).pins[h >> 2] > 0

    def _drop_orphans(self, orphans: list[Handle]) -> None:
        """Drop blocks whose ancestor left the store (reported evicted, counted as evictions of
        their tier); pinned ones go on their last unpin."""
        for o in orphans:
            ts, slot = self._ts(o), o >> 2
            key = ts.key_at(slot)
            if self._index.get(key) != o:
                continue  # already out (doomed, or dropped with the same batch)
            self._index.pop(key)
            self._events.append(EventKind.EVICTED, key, ts.tier)
            ts.evictions += 1
            if ts.pins[slot]:
                ts.doomed[slot] = 1
            else:
                self._free_page(ts, slot)

    def _free_page(self, ts: TierState, slot: int) -> None:
        key = ts.key_at(slot)
        live = self._index.get(key)
        # NOTE: the SSD pool stores pages by key: a removed copy still read until now shares its
        # record with a live copy of the same key (same key, same bytes); keep it for the latter.
        if live < 0 or live == slot << 2 | ts.tier or live & 3 != ts.tier:
            ts.pool.drop_pages([slot], [key])
        ts.policy.remove(slot)
        ts.held[slot] = 0
        ts.doomed[slot] = 0
        ts.free.append(slot)
