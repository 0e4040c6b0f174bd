"""Tier movement: freeing pages by eviction (demoting to the next tier down, or dropping from the
last), and relocating pinned blocks between tiers (promotion on hit, moving GPU pages to DRAM).

Tiers are exclusive: a block that moves leaves its old page free, and its key's ``STORED`` event
names the new tier.

A tier that refuses a write (``StorageError``: the SSD's filesystem or lmdb map is full) never
costs the tier above its pages: eviction drops the victims instead (``EVICTED`` events, counted in
``demotion_failures``), and a promotion or move leaves the block where it was. Every later
eviction tries the write again, so demotion resumes by itself once space returns.
"""

from __future__ import annotations

import logging

from .blocks import BlockStore, Handle, TierState
from .errors import BudgetShort, CapacityExhausted, StorageError
from .events import EventKind
from .keys import BlockKey
from .payload import ByteView
from .tiers import Tier

log = logging.getLogger(__name__)


class TierMovement(BlockStore):
    """Eviction, demotion, promotion (a mixin of ``TieredStore``; caller holds the lock)."""

    def _grant(self, ts: TierState, n: int) -> None:
        """Bring up to ``n`` more free slots into a tier under a shared budget (budget.py), from
        the budget's unassigned bytes; the pages refused are counted for its rebalancing."""
        if ts.budget is None or n <= 0:
            return
        got = ts.budget.take(self, min(n, len(ts.withheld)), self.layout.page_bytes)
        if got:
            ts.free.extend(ts.withheld[-got:])
            del ts.withheld[-got:]
        ts.refused += n - got

    def _reserve(
        self, ts: TierState, n: int, grant: bool = True, reclaim: bool = False
    ) -> list[int]:
        """Take ``n`` free slots of a tier, evicting (and demoting) unpinned blocks if needed.
        Under a shared budget, unassigned bytes are taken first (``grant``); with ``reclaim``,
        a tier below an equal share of its budget raises ``BudgetShort`` instead of evicting
        its own blocks, so that the caller (holding no lock) takes pages of the stores above
        an equal share first, and tries again without ``reclaim``."""
        if n == 0:
            return []
        need = n - len(ts.free)
        if need > 0 and grant:
            self._grant(ts, need)
            need = n - len(ts.free)
        if need > 0:
            short = need > len(ts.policy)
            full = None
            if short:
                held = ts.capacity - len(ts.withheld) - len(ts.free) - len(ts.policy)
                quarantine = (
                    f" ({ts.quarantined} quarantined after their write lease expired)"
                    if ts.quarantined
                    else ""
                )
                full = CapacityExhausted(
                    f"{ts.tier.name} tier is full: need {n} pages, {len(ts.free)} free and "
                    f"{len(ts.policy)} evictable; the other {held} are pinned by readers or "
                    f"leased to writers{quarantine}. Release leases or add capacity"
                )
            if reclaim and ts.budget is not None and ts.budget.below_equal_share(self):
                raise BudgetShort(need)
            if full is not None:
                raise full
            victims: list[int] = []
            tree = self._tree
            parents: list[BlockKey | None] = []
            for _ in range(need):
                slot = ts.policy.pop_victim()
                assert slot is not None, "need <= len(policy) was checked above"
                victims.append(slot)
                if tree is not None:
                    # NOTE: a victim leaves its parent's children at once, so that the next pop
                    # sees the parent as the leaf it now is (a cold chain goes tail first in
                    # one batch); a demoted victim rejoins it from its new page. The parent is
                    # remembered by key: making room below may move or drop it meanwhile.
                    p = tree.unlink(slot << 2 | ts.tier)
                    parents.append(self._ts(p).key_at(p >> 2) if p >= 0 else None)
            self._evict(ts, victims, parents)
        free = ts.free
        out = free[-n:].tolist()
        del free[-n:]
        gens = ts.gens
        for slot in out:
            gens[slot] += 1
        return out

    # ---- a tier's budget shared with other layouts (budget.Member) ------------------------

    def page_bytes_of(self, tier: Tier) -> int:
        return self.layout.page_bytes

    def share_bytes(self, tier: Tier) -> int:
        """Bytes of ``tier`` this store was granted (all its pages when it has no budget)."""
        with self._lock:
            ts = self._tiers.get(tier)
            return 0 if ts is None else (ts.capacity - len(ts.withheld)) * self.layout.page_bytes

    def take_refused(self, tier: Tier) -> int:
        """Pages this store asked its budget for and did not get, since the last call."""
        with self._lock:
            ts = self._tiers.get(tier)
            if ts is None:
                return 0
            n, ts.refused = ts.refused, 0
            return n

    def shrink(self, tier: Tier, pages: int) -> int:
        """Give up to ``pages`` pages of ``tier`` back to its shared budget, evicting this
        store's coldest blocks (by its policy) when free pages are not enough; pinned and
        leased pages stay. Returns how many went back."""
        with self._lock:
            ts = self._tiers.get(tier)
            if ts is None or self._closed:
                return 0
            return self._withhold(ts, pages)

    def _withhold(self, ts: TierState, pages: int) -> int:
        """Give up to ``pages`` of a budgeted tier's pages back to its budget: free ones first,
        then its policy's victims (evicted or demoted as any eviction). Returns how many."""
        if ts.budget is None:
            return 0
        pages = min(pages, len(ts.free) + len(ts.policy))
        slots = self._reserve(ts, pages, grant=False)
        ts.pool.release(slots)
        ts.withheld.extend(slots)
        ts.budget.give(self, len(slots), self.layout.page_bytes)
        return len(slots)

    def _next_tier(self, tier: Tier) -> TierState | None:
        for t in range(tier + 1, Tier.SSD + 1):
            if Tier(t) in self._tiers:
                return self._tiers[Tier(t)]
        return None

    def _evict(self, ts: TierState, victims: list[int], parents: list[BlockKey | None]) -> None:
        """Move victim slots' blocks to the next tier if there is room, else drop them.
        ``parents``: with the prefix tree, each victim's parent's key (the victims are
        unlinked); a demoted victim whose parent left meanwhile becomes a root."""
        keys = [_committed_key(ts, s) for s in victims]
        index = self._index
        dst = self._next_tier(ts.tier)
        moved: list[int] = []
        if dst is not None:
            self._grant(dst, len(victims) - len(dst.free))
            room = min(len(victims), len(dst.free) + len(dst.policy))
            if room:
                dslots = self._reserve(dst, room)
                if ts.pool.has_data and dst.pool.has_data:
                    src_views = [_source_view(ts, s) for s in victims[:room]]
                    if not self._write_down(dst, dslots, keys[:room], src_views):
                        dst.free.extend(dslots)  # the victims are dropped below instead
                        room, dslots = 0, []
                tree = self._tree
                for i, (key, vslot, dslot) in enumerate(zip(keys, victims, dslots)):
                    index.put(key, dslot << 2 | dst.tier)
                    dst.hold(dslot, key)
                    if tree is not None:
                        pkey = parents[i]
                        up = index.get(pkey) if pkey is not None else -1
                        tree.move(vslot << 2 | ts.tier, dslot << 2 | dst.tier, up)
                    self._events.append(EventKind.STORED, key, dst.tier)
                dst.policy.insert_many(dslots, fresh=True)
                moved = victims[:room]
                self._n.demotions += room
        dropped = victims[len(moved) :]
        orphans: list[Handle] = []
        if dropped:
            dkeys = keys[len(moved) :]
            ts.pool.drop_pages(dropped, dkeys)
            for key in dkeys:
                index.pop(key)
                self._events.append(EventKind.EVICTED, key, ts.tier)
            ts.evictions += len(dropped)
            if self._tree is not None:
                for s in dropped:
                    orphans += self._tree.detach(s << 2 | ts.tier, self._is_pinned)
        held = ts.held
        for s in victims:
            held[s] = 0
        ts.free.extend(victims)
        if orphans:
            self._drop_orphans(orphans)

    def _write_down(
        self, dst: TierState, slots: list[int], keys: list[BlockKey], views: list[ByteView]
    ) -> bool:
        """Write pages into a keyed tier (the SSD); False, counted and logged, when it refuses."""
        try:
            dst.pool.write_pages(slots, keys, views)
        except StorageError as e:
            self._n.demotion_failures += len(keys)
            if dst.write_error is None:  # log the change of state, not every failed eviction
                log.warning("%s: %s; evicted blocks are dropped until it works", self.namespace, e)
            dst.write_error = str(e)
            return False
        if dst.write_error is not None:
            log.info("%s: the %s tier takes writes again", self.namespace, dst.tier.name)
            dst.write_error = None
        return True

    def _relocate(self, blocks: list[tuple[BlockKey, Handle]], dst: TierState) -> None:
        """Move blocks pinned only by the caller into ``dst`` (their handles change: the caller
        looks them up again). A page that fails its checksum on the way is dropped (unpinned,
        reported evicted): the caller sees it as missing."""
        dslots = self._reserve(dst, len(blocks))
        for (key, h), dslot in zip(blocks, dslots):
            src, slot = self._ts(h), h >> 2
            if src.pool.has_data and dst.pool.has_data:
                dview = dst.pool.page_view(dslot)
                if dview is None:
                    # A keyed pool (SSD, via ``acquire(into=SSD)``) has no page views: store the
                    # page under its key, as ``_evict`` does when it demotes.
                    if not self._write_down(dst, [dslot], [key], [_source_view(src, slot)]):
                        dst.free.append(dslot)  # the block stays pinned where it is
                        continue
                elif not src.pool.read_page_into(slot, key, dview):
                    dst.free.append(dslot)
                    self._n.corrupt_pages += 1
                    src.pins[slot] = 0
                    src.pinned -= 1
                    self._discard(key, h)
                    continue
                else:
                    # the source's checksum, checked as the page was copied: no second pass
                    dst.pool.seal(dslot, src.pool.checksum(slot))
            src.pool.drop_pages([slot], [key])
            pins = src.pins[slot]
            src.pins[slot] = 0
            src.held[slot] = 0
            src.free.append(slot)
            src.pinned -= 1
            dst.pinned += 1
            if src.tier > dst.tier:
                self._n.promotions += 1
            else:
                self._n.demotions += 1
            self._index.put(key, dslot << 2 | dst.tier)
            dst.hold(dslot, key)
            dst.pins[dslot] = pins
            if self._tree is not None:
                self._tree.move(h, dslot << 2 | dst.tier)
            # NOTE: the pinned block re-enters the policy on unpin with fresh=False, which keeps
            # the slot's history: clear what the slot's previous occupant left there (LFU count).
            dst.policy.forget(dslot)
            self._events.append(EventKind.STORED, key, dst.tier)


def _source_view(ts: TierState, slot: int) -> ByteView:
    """A page to copy out of: sources are slab tiers (GPU, DRAM); the SSD is the last tier, so
    nothing is demoted from it, and a promotion reads it with ``read_page_into``."""
    view = ts.pool.page_view(slot)
    assert view is not None, f"{ts.tier.name} slot {slot} has no page view to copy from"
    return view


def _committed_key(ts: TierState, slot: int) -> BlockKey:
    assert ts.held[slot], f"{ts.tier.name} slot {slot} is evictable but holds no block"
    return ts.key_at(slot)
