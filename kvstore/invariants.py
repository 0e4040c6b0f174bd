"""The store's consistency check: what must hold between any two public calls.

``TieredStore.check_invariants`` runs it under the store lock; the stateful tests call it after
every step. It reads the shared state directly (it is the store's own auditor) and collects every
broken invariant, so one failure shows all that went wrong at once instead of the first symptom.

Checked:
- page ownership: each slot of each tier is exactly one of free, leased to a live write lease,
  quarantined (an expired write lease's, held back from reuse) or committed (``tier.keys``);
  ``tier.leased`` and ``tier.quarantined`` count them; a quarantined page comes back at a finite
  time, and no live lease is quarantined;
- generations: a live write lease's pages still have the generations it was given (nobody else
  got them since);
- blocks: every indexed block sits in the slot its tier says holds its key, and no slot holds two
  blocks; a block out of the index is still held only while pinned (``doomed``);
- pins: >= 0, equal to the number of live read leases holding the block; ``tier.pinned`` counts
  the pinned blocks of the tier;
- eviction policy: holds exactly the committed, unpinned slots of its tier;
- accounting: used = capacity - free - leased - quarantined (what ``stats`` reports) equals the
  committed pages; pools have the tier's page count and the layout's page size (the DRAM slab is
  exactly pages x page_bytes); the SSD tier's lmdb holds exactly one page per committed SSD block;
  bytes read are whole pages and bytes written whole layers;
- leases: every live lease has a deadline entry, so it can expire.
"""

from __future__ import annotations

import math
from collections import Counter

from .blocks import Block, TierState
from .keys import BlockKey
from .leases import LeaseBook
from .pools import SharedDramPool
from .ssd import SsdPool
from .tiers import Tier

_MAX_REPORTED = 25


class InvariantViolation(AssertionError):
    """The store's internal state is inconsistent: a bug in the store, never bad input."""


def check_store(store: LeaseBook) -> None:
    """Raise ``InvariantViolation`` listing every broken invariant. Caller holds the lock."""
    problems: list[str] = []
    blocks = _check_blocks(store, problems)
    leased = _check_write_leases(store, problems)
    quarantined = _check_quarantine(store, problems)
    for tier, ts in sorted(store._tiers.items()):
        _check_tier(
            store,
            ts,
            [b for b in blocks.values() if b[1].tier is tier],
            leased.get(tier, []),
            quarantined.get(tier, []),
            problems,
        )
    _check_deadlines(store, problems)
    _check_counters(store, problems)
    if problems:
        shown = problems[:_MAX_REPORTED]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more")
        raise InvariantViolation("TieredStore invariants broken:\n- " + "\n- ".join(shown))


def _k(key: bytes | None) -> str:
    return "None" if key is None else key.hex()


def _check_blocks(store: LeaseBook, problems: list[str]) -> dict[int, tuple[BlockKey, Block]]:
    """Every live block (indexed, or pinned by a read lease), by identity; checks each one."""
    blocks: dict[int, tuple[BlockKey, Block]] = {}
    holders: Counter[int] = Counter()  # id(block) -> read leases pinning it
    for key, b in store._index.items():
        blocks[id(b)] = (key, b)
        if b.doomed:
            problems.append(f"block {_k(key)} is in the index but marked doomed")
    for lease_id, r in store._read_leases.items():
        seen: set[int] = set()
        for key, b in r.blocks:
            if id(b) in seen:
                problems.append(f"read lease {lease_id} holds block {_k(key)} twice")
            seen.add(id(b))
            holders[id(b)] += 1
            known = blocks.setdefault(id(b), (key, b))
            if known[0] != key:
                problems.append(f"read lease {lease_id} holds block {_k(known[0])} as {_k(key)}")
            if store._index.get(key) is not b and not b.doomed:
                problems.append(
                    f"read lease {lease_id} pins block {_k(key)}, which is neither "
                    "in the index nor doomed (its page can never be freed)"
                )
    occupants: dict[tuple[Tier, int], tuple[BlockKey, Block]] = {}
    for key, b in blocks.values():
        held = holders[id(b)]
        if b.pins < 0:
            problems.append(f"block {_k(key)} has negative pins ({b.pins})")
        if b.pins != held:
            problems.append(
                f"block {_k(key)} has pins={b.pins} but {held} live read leases hold it"
            )
        if b.doomed and b.pins <= 0:
            problems.append(f"doomed block {_k(key)} is unpinned but its page was not freed")
        ts = store._tiers.get(b.tier)
        if ts is None or not 0 <= b.slot < len(ts.keys):
            problems.append(f"block {_k(key)} is at {b.tier.name} slot {b.slot}: no such slot")
            continue
        if ts.keys[b.slot] != key:
            problems.append(
                f"block {_k(key)} is at {b.tier.name} slot {b.slot}, which holds "
                f"{_k(ts.keys[b.slot])}"
            )
        other = occupants.setdefault((b.tier, b.slot), (key, b))
        if other[1] is not b:
            problems.append(
                f"{b.tier.name} slot {b.slot} is held by two blocks: {_k(other[0])} and {_k(key)}"
            )
    return blocks


def _check_write_leases(store: LeaseBook, problems: list[str]) -> dict[Tier, list[int]]:
    """The slots live write leases own, per tier (with repeats, so that a double lease shows)."""
    leased: dict[Tier, list[int]] = {}
    for lease_id, w in store._write_leases.items():
        lease = w.lease
        if lease.lease_id != lease_id or len(lease.slots) != len(lease.keys):
            problems.append(
                f"write lease {lease_id} is malformed: id {lease.lease_id}, "
                f"{len(lease.keys)} keys, {len(lease.slots)} slots"
            )
        if lease.tier not in store._tiers:
            problems.append(f"write lease {lease_id} is on the absent {lease.tier.name} tier")
            continue
        leased.setdefault(lease.tier, []).extend(s for s in lease.slots if s >= 0)
        gens = store._tiers[lease.tier].gens
        if len(lease.generations) != len(lease.slots):
            problems.append(f"write lease {lease_id} has no generation for each slot")
        else:
            stale = [s for s, g in zip(lease.slots, lease.generations) if s >= 0 and gens[s] != g]
            if stale:
                problems.append(
                    f"write lease {lease_id} is live but its {lease.tier.name} slots {stale} "
                    "went to someone else since (generation changed)"
                )
    both = store._write_leases.keys() & store._read_leases.keys()
    if both:
        problems.append(f"lease ids {sorted(both)} are both write and read leases")
    return leased


def _check_quarantine(store: LeaseBook, problems: list[str]) -> dict[Tier, list[int]]:
    """The slots held in quarantine, per tier (with repeats); each entry must come back."""
    held: dict[Tier, list[int]] = {}
    ids = set()
    for release_at, lease_id, tier, slots in store._quarantine:
        ids.add(lease_id)
        if not math.isfinite(release_at):
            problems.append(f"quarantine of write lease {lease_id} never ends ({release_at})")
        if lease_id in store._write_leases:
            problems.append(f"write lease {lease_id} is both live and quarantined")
        if tier not in store._tiers:
            problems.append(f"write lease {lease_id} is quarantined on the absent {tier.name} tier")
            continue
        held.setdefault(tier, []).extend(slots)
    if ids != store._quarantined:
        problems.append(
            f"quarantined lease ids {sorted(store._quarantined)} do not match the entries "
            f"{sorted(ids)}"
        )
    return held


def _check_tier(
    store: LeaseBook,
    ts: TierState,
    blocks: list[tuple[BlockKey, Block]],
    leased: list[int],
    quarantined: list[int],
    problems: list[str],
) -> None:
    name, cap = ts.tier.name, len(ts.keys)
    # Page ownership: free / leased / quarantined / committed, exactly one each.
    owners: dict[int, list[str]] = {}
    for what, slots in (("free", ts.free), ("leased", leased), ("quarantined", quarantined)):
        for s in slots:
            owners.setdefault(s, []).append(what)
    for s, key in enumerate(ts.keys):
        if key is not None:
            owners.setdefault(s, []).append("committed")
    for s in range(cap):
        got = owners.pop(s, [])
        if len(got) != 1:
            problems.append(
                f"{name} slot {s} is owned by {got or 'nobody'}; expected exactly "
                "one of free, leased, quarantined, committed"
            )
    if owners:
        problems.append(
            f"{name} free/leased/quarantined lists name slots outside [0, {cap}): {sorted(owners)}"
        )
    if ts.leased != len(leased):
        problems.append(
            f"{name} counts {ts.leased} leased pages; live write leases hold {len(leased)}"
        )
    if ts.quarantined != len(quarantined):
        problems.append(
            f"{name} counts {ts.quarantined} quarantined pages; the quarantine holds "
            f"{len(quarantined)}"
        )
    if len(ts.gens) != cap:
        problems.append(f"{name} has {len(ts.gens)} slot generations for {cap} slots")
    committed = [s for s, key in enumerate(ts.keys) if key is not None]
    used = cap - len(ts.free) - ts.leased - ts.quarantined
    if used != len(committed):
        problems.append(
            f"{name} reports {used} used pages (capacity - free - leased - quarantined); "
            f"{len(committed)} are committed"
        )
    # Every committed page belongs to a live block (else it can never be freed).
    held = {b.slot for _, b in blocks}
    orphans = [s for s in committed if s not in held]
    if orphans:
        problems.append(f"{name} slots {orphans} hold keys no live block owns (leaked pages)")
    pinned = sum(1 for _, b in blocks if b.pins > 0)
    if ts.pinned != pinned:
        problems.append(f"{name} counts {ts.pinned} pinned blocks; {pinned} blocks are pinned")
    # The eviction policy orders exactly the evictable blocks: committed and unpinned.
    evictable = {b.slot for _, b in blocks if b.pins == 0 and not b.doomed}
    wrong = [s for s in range(cap) if (s in ts.policy) != (s in evictable)]
    if wrong or len(ts.policy) != len(evictable):
        problems.append(
            f"{name} {ts.policy.name} policy holds {len(ts.policy)} slots, expected "
            f"the {len(evictable)} evictable ones; wrong membership: {wrong}"
        )
    order = getattr(ts.policy, "order", None)
    if callable(order) and sorted(order()) != sorted(evictable):
        problems.append(
            f"{name} {ts.policy.name} policy lists {sorted(order())}; expected {sorted(evictable)}"
        )
    _check_pool(store, ts, problems)


def _check_pool(store: LeaseBook, ts: TierState, problems: list[str]) -> None:
    """Bytes held == pages x page size, and the SSD's lmdb agrees with the committed SSD pages."""
    name, cap, pool = ts.tier.name, len(ts.keys), ts.pool
    page_bytes = store.layout.page_bytes
    if pool.num_pages != cap or pool.page_bytes != page_bytes:
        problems.append(
            f"{name} pool has {pool.num_pages} pages of {pool.page_bytes} bytes; the "
            f"tier has {cap} pages of {page_bytes}"
        )
    if isinstance(pool, SharedDramPool) and pool.slab.size != cap * page_bytes:
        problems.append(f"{name} slab is {pool.slab.size} bytes, not {cap} x {page_bytes}")
    if isinstance(pool, SsdPool):
        # One record per key: a removed copy still being read shares its key's record.
        on_disk = set(pool.stored_keys())
        indexed = {bytes(k) for k in ts.keys if k is not None}
        if on_disk != indexed:
            missing = sorted(_k(k) for k in indexed - on_disk)
            extra = sorted(_k(k) for k in on_disk - indexed)
            problems.append(
                f"{name} lmdb does not hold one page per key of its committed SSD "
                f"blocks: missing {missing}, not committed {extra}"
            )


def _check_deadlines(store: LeaseBook, problems: list[str]) -> None:
    queued = set(store._deadlines)
    states: list[tuple[int, float]] = [(i, w.deadline) for i, w in store._write_leases.items()]
    states += [(i, r.deadline) for i, r in store._read_leases.items()]
    for lease_id, deadline in states:
        if (deadline, lease_id) not in queued:
            problems.append(
                f"lease {lease_id} has no deadline entry for {deadline}: it would never expire"
            )


def _check_counters(store: LeaseBook, problems: list[str]) -> None:
    n, layout = store._n, store.layout
    negative = {k: v for k, v in vars(n).items() if v < 0}
    for ts in store._tiers.values():
        for k in ("leased", "quarantined", "pinned", "hits", "evictions"):
            if getattr(ts, k) < 0:
                negative[f"{ts.tier.name}.{k}"] = getattr(ts, k)
    if negative:
        problems.append(f"negative counters: {negative}")
    if n.bytes_read % layout.page_bytes:
        problems.append(f"bytes_read {n.bytes_read} is not whole pages of {layout.page_bytes}")
    if n.bytes_written % layout.layer_bytes:
        problems.append(
            f"bytes_written {n.bytes_written} is not whole layers of {layout.layer_bytes}"
        )
