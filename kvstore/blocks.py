"""The state every part of the store shares, and the primitives that keep it consistent.

``BlockStore`` holds the block index, the tiers' page bookkeeping, the event log and the counters,
and knows how to publish a block, pin and unpin it, and take it out of the index. The store's other
parts are mixins over it (``leases.LeaseBook``, ``movement.TierMovement``) and ``TieredStore``
combines them, so all of them work on this one state under the one store lock. Imports run one way:
``store`` -> ``leases`` / ``movement`` -> ``blocks`` -> ``records``, ``pools``, ``policy``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

from .errors import InvalidArgument
from .events import EventKind, EventLog
from .keys import BlockKey
from .layout import KVLayout
from .policy import EvictionPolicy
from .pools import PagePool
from .records import StoreConfig
from .tiers import Tier


@dataclass(slots=True)
class Block:
    tier: Tier
    slot: int
    pins: int = 0
    doomed: bool = False  # out of the index while pinned: its page is freed on the last unpin


@dataclass(slots=True)
class TierState:
    tier: Tier
    pool: PagePool
    policy: EvictionPolicy  # the committed, unpinned slots: the only eviction candidates
    free: list[int]
    keys: list[BlockKey | None]  # per slot: the committed block's key, None when free or leased
    leased: int = 0
    quarantined: int = 0  # pages of expired write leases, held back from reuse for a while
    pinned: int = 0
    hits: int = 0
    evictions: int = 0
    write_error: str | None = None  # the pool's last refused write, until one succeeds
    # Per slot: bumped each time the slot leaves the free list, so a write lease can tell that
    # a page it was given has since gone to someone else (a fence against late writers).
    gens: list[int] = field(default_factory=list)


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
        self._index: dict[BlockKey, Block] = {}
        self._tiers: dict[Tier, TierState] = {}
        self._events = EventLog(config.max_events, config.on_event)
        self._n = Counters()

    def _tier(self, tier: Tier | str | int) -> TierState:
        ts = self._tiers.get(Tier.parse(tier))
        if ts is None:
            raise InvalidArgument(f"this store has no {Tier.parse(tier).name} tier")
        return ts

    def _publish(self, ts: TierState, key: BlockKey, slot: int) -> None:
        self._index[key] = Block(ts.tier, slot)
        ts.keys[slot] = key
        ts.policy.insert(slot, fresh=True)
        self._events.append(EventKind.STORED, key, ts.tier)

    def _pin(self, block: Block) -> None:
        if block.pins == 0:
            ts = self._tiers[block.tier]
            ts.policy.remove(block.slot)
            ts.pinned += 1
        block.pins += 1

    def _unpin_blocks(self, blocks: Sequence[tuple[BlockKey, Block]]) -> None:
        for key, b in blocks:
            if b.pins == 0:
                continue
            b.pins -= 1
            if b.pins == 0:
                ts = self._tiers[b.tier]
                ts.pinned -= 1
                if b.doomed:
                    self._free_page(key, b)
                else:
                    ts.policy.insert(b.slot, fresh=False)

    def _discard(self, key: BlockKey, b: Block) -> None:
        """Take a block out of the index (reported evicted); its page is freed now, or on its
        last unpin if a reader still holds it."""
        if self._index.get(key) is b:
            del self._index[key]
            self._events.append(EventKind.EVICTED, key, b.tier)
        if b.pins:
            b.doomed = True
        else:
            self._free_page(key, b)

    def _free_page(self, key: BlockKey, b: Block) -> None:
        ts = self._tiers[b.tier]
        live = self._index.get(key)
        # NOTE: the SSD pool stores pages by key: a removed copy still read until now shares its
        # record with a live copy of the same key (same key, same bytes); keep it for the latter.
        if live is None or live is b or live.tier != b.tier:
            ts.pool.drop_pages([b.slot], [key])
        ts.policy.remove(b.slot)
        ts.keys[b.slot] = None
        ts.free.append(b.slot)
