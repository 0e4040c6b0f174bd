"""The store's consistency check: what must hold between any two public calls.

``TieredStore.check_invariants`` runs it under the store lock; the stateful tests call it after
every step. It reads the shared state directly (it is the store's own auditor) and collects every
broken invariant, so one failure shows all that went wrong at once instead of the first symptom.

Checked:
- page ownership: each slot of each tier is exactly one of free, leased to a live write lease,
  quarantined (an expired write lease's, held back from reuse), committed (``tier.keys``) or
  withheld (not granted by a shared budget, budget.py);
  ``tier.leased`` and ``tier.quarantined`` count them; a quarantined page comes back at a finite
  time, and no live lease is quarantined;
- generations: a live write lease's pages still have the generations it was given (nobody else
  got them since);
- blocks: every indexed block's handle names a held slot of a tier whose key is the block's, and no
  slot holds two blocks; a block out of the index is still held only while pinned (``doomed``);
- pins: >= 0, equal to the number of live read leases holding the block; ``tier.pinned`` counts
  the pinned blocks of the tier;
- eviction policy: holds exactly the committed, unpinned slots of its tier;
- accounting: used = capacity - withheld - free - leased - quarantined (what ``stats``
  reports) equals the committed pages; pools have the tier's page count and the layout's page
  size (the DRAM slab is exactly pages x page_bytes); the SSD tier's lmdb holds exactly one
  page per committed SSD block; bytes read are whole pages and bytes written whole layers;
- leases: every live lease has a deadline entry, so it can expire;
- prefix tree (when a policy keeps one): links only between indexed blocks, each child in its
  parent's child list exactly once, ``kids`` / ``tkids`` equal to the children counted, and no
  links left on a slot that holds no indexed block.
"""

from __future__ import annotations

import math
from collections import Counter

from .blocks import Handle, TierState
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
            {h >> 2: pins for h, pins in blocks.items() if h & 3 == tier},
            leased.get(tier, []),
            quarantined.get(tier, []),
            problems,
        )
    _check_deadlines(store, problems)
    _check_counters(store, problems)
    _check_tree(store, problems)
    if problems:
        shown = problems[:_MAX_REPORTED]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more")
        raise InvariantViolation("TieredStore invariants broken:\n- " + "\n- ".join(shown))


def _k(key: bytes | None) -> str:
    return "None" if key is None else key.hex()


def _where(h: Handle) -> str:
    tier = Tier(h & 3).name if h & 3 <= Tier.SSD else f"tier#{h & 3}"
    return f"{tier} slot {h >> 2}"


def _check_blocks(store: LeaseBook, problems: list[str]) -> dict[Handle, int]:
    """Every live block (indexed, or pinned by a read lease), by handle, with the number of live
    read leases holding it; checks each one."""
    holders: Counter[Handle] = Counter()
    indexed: dict[Handle, BlockKey] = {}
    for key, h in store._index.items():
        ts = store._by_int[h & 3] if h & 3 <= Tier.SSD else None
        slot = h >> 2
        if ts is None or not 0 <= slot < ts.capacity:
            problems.append(f"block {_k(key)} is at {_where(h)}: no such slot")
            continue
        if h in indexed:
            problems.append(f"{_where(h)} is held by two blocks: {_k(indexed[h])} and {_k(key)}")
        indexed[h] = BlockKey(key)
        if not ts.held[slot]:
            problems.append(f"block {_k(key)} is at {_where(h)}, which holds no block")
        elif ts.key_at(slot) != key:
            problems.append(f"block {_k(key)} is at {_where(h)}, which holds {_k(ts.key_at(slot))}")
        if ts.doomed[slot]:
            problems.append(f"block {_k(key)} is in the index but marked doomed")
    for lease_id, r in store._read_leases.items():
        if len(set(r.blocks)) != len(r.blocks):
            problems.append(f"read lease {lease_id} holds a block twice: {r.blocks}")
        for h in set(r.blocks):
            holders[h] += 1
            ts = store._by_int[h & 3] if h & 3 <= Tier.SSD else None
            if ts is None or not 0 <= h >> 2 < ts.capacity:
                problems.append(f"read lease {lease_id} pins {_where(h)}: no such slot")
                continue
            if not ts.held[h >> 2]:
                problems.append(f"read lease {lease_id} pins {_where(h)}, which holds no block")
            elif h not in indexed and not ts.doomed[h >> 2]:
                problems.append(
                    f"read lease {lease_id} pins block {_k(ts.key_at(h >> 2))} at {_where(h)}, "
                    "which is neither in the index nor doomed (its page can never be freed)"
                )
    blocks: dict[Handle, int] = {h: holders[h] for h in indexed}
    blocks.update(holders)
    for h, held in blocks.items():
        ts = store._by_int[h & 3] if h & 3 <= Tier.SSD else None
        if ts is None or not 0 <= h >> 2 < ts.capacity:
            continue
        pins = ts.pins[h >> 2]
        if pins != held:
            problems.append(
                f"block at {_where(h)} has pins={pins} but {held} live read leases hold it"
            )
        if ts.doomed[h >> 2] and pins <= 0:
            problems.append(f"doomed block at {_where(h)} is unpinned but its page was not freed")
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
    blocks: dict[int, int],
    leased: list[int],
    quarantined: list[int],
    problems: list[str],
) -> None:
    """``blocks``: the tier's live blocks, slot -> read leases holding it."""
    name, cap = ts.tier.name, ts.capacity
    sizes = {
        "keys": len(ts.keys) // 16,
        "held": len(ts.held),
        "doomed": len(ts.doomed),
        "pins": len(ts.pins),
        "gens": len(ts.gens),
    }
    if any(n != cap for n in sizes.values()):
        problems.append(f"{name} has per-slot arrays of sizes {sizes} for {cap} slots")
        return
    # Page ownership: free / leased / quarantined / committed, exactly one each.
    owners: dict[int, list[str]] = {}
    for what, slots in (
        ("free", ts.free),
        ("leased", leased),
        ("quarantined", quarantined),
        ("withheld", ts.withheld),
    ):
        for s in slots:
            owners.setdefault(s, []).append(what)
    committed = [s for s in range(cap) if ts.held[s]]
    for s in committed:
        owners.setdefault(s, []).append("committed")
    for s in range(cap):
        got = owners.pop(s, [])
        if len(got) != 1:
            problems.append(
                f"{name} slot {s} is owned by {got or 'nobody'}; expected exactly "
                "one of free, leased, quarantined, committed, withheld"
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
    used = cap - len(ts.withheld) - len(ts.free) - ts.leased - ts.quarantined
    if used != len(committed):
        problems.append(
            f"{name} reports {used} used pages (capacity - withheld - free - leased - "
            "quarantined); "
            f"{len(committed)} are committed"
        )
    # Every committed page belongs to a live block (else it can never be freed).
    orphans = [s for s in committed if s not in blocks]
    if orphans:
        problems.append(f"{name} slots {orphans} hold keys no live block owns (leaked pages)")
    stray = [s for s in range(cap) if not ts.held[s] and (ts.pins[s] or ts.doomed[s])]
    if stray:
        problems.append(f"{name} slots {stray} hold no block but are pinned or doomed")
    pinned = sum(1 for s in blocks if ts.pins[s] > 0)
    if ts.pinned != pinned:
        problems.append(f"{name} counts {ts.pinned} pinned blocks; {pinned} blocks are pinned")
    # The eviction policy orders exactly the evictable blocks: committed and unpinned.
    evictable = {s for s in blocks if ts.pins[s] == 0 and not ts.doomed[s]}
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
    name, cap, pool = ts.tier.name, ts.capacity, ts.pool
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
        indexed = {ts.key_at(s) for s in range(cap) if ts.held[s]}
        if on_disk != indexed:
            missing = sorted(_k(k) for k in indexed - on_disk)
            extra = sorted(_k(k) for k in on_disk - indexed)
            problems.append(
                f"{name} lmdb does not hold one page per key of its committed SSD "
                f"blocks: missing {missing}, not committed {extra}"
            )


def _check_tree(store: LeaseBook, problems: list[str]) -> None:
    tree = store._tree
    if tree is None:
        return
    indexed = {h for _, h in store._index.items()}
    for ts in store._tiers.values():
        t = ts.tier
        for s in range(ts.capacity):
            h = s << 2 | t
            links = (tree.parent[t][s], tree.first[t][s], tree.nsib[t][s], tree.psib[t][s])
            if h not in indexed:
                if links != (-1, -1, -1, -1) or tree.kids[t][s] or tree.tkids[t][s]:
                    problems.append(
                        f"prefix tree: {_where(h)} holds no indexed block but has links"
                    )
                continue
            p = tree.parent[t][s]
            if p >= 0 and (p not in indexed or h not in tree.children(p)):
                problems.append(
                    f"prefix tree: {_where(h)} names parent {_where(p)}, which is not indexed "
                    "or does not list it"
                )
            kids = tree.children(h)
            if len(set(kids)) != len(kids) or any(tree.parent[c & 3][c >> 2] != h for c in kids):
                problems.append(f"prefix tree: {_where(h)} has a broken child list {kids}")
            if tree.kids[t][s] != len(kids):
                problems.append(
                    f"prefix tree: {_where(h)} counts {tree.kids[t][s]} children, has {len(kids)}"
                )
            here = sum(1 for c in kids if c & 3 == t)
            if tree.tkids[t][s] != here:
                problems.append(
                    f"prefix tree: {_where(h)} counts {tree.tkids[t][s]} children in its tier, "
                    f"has {here}"
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
