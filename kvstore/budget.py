"""One tier's byte budget shared by the stores of several layouts (a node serving any model).

A store under a shared budget has a slot for every page the whole budget could hold in its
layout, but only the slots it was granted are in circulation; the rest are *withheld* (no bytes
behind them: shared memory is sparse, and a slot given back is punched out of it). So the sum of
what the stores hold never passes the budget, whatever their page sizes.

How the bytes move:
- **On demand.** A store that needs pages and has no free slot takes them from the budget's
  unassigned bytes before it evicts anything of its own (``TierMovement._reserve``). Alone, a
  layout can fill the whole budget.
- **Under contention** (nothing unassigned), a store evicts its own blocks as before and counts
  the pages it was refused. ``SharedBudget.rebalance`` (the node's reaper calls it) then has the
  stores above an equal share evict their coldest blocks, by their own eviction policy, and
  give those pages back for the refused stores to take: every layout that needs room keeps at
  least ``budget / layouts`` (max-min fairness, as cgroups' memory protection), and an idle one
  keeps what it holds until someone needs it.

Locks: a store calls the budget under its own lock; the budget never calls a store under its
lock, and ``rebalance`` takes one store's lock at a time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from .tiers import Tier


class Member(Protocol):
    """What the budget needs of a store (``TieredStore``)."""

    namespace: str

    def share_bytes(self, tier: Tier) -> int: ...

    def take_refused(self, tier: Tier) -> int: ...

    def shrink(self, tier: Tier, pages: int) -> int: ...

    def page_bytes_of(self, tier: Tier) -> int: ...


@dataclass(frozen=True, slots=True)
class BudgetStats:
    total_bytes: int
    unassigned_bytes: int
    members: int


class SharedBudget:
    """``total_bytes`` of one tier, for the stores that join it."""

    def __init__(self, tier: Tier, total_bytes: int) -> None:
        if total_bytes <= 0:
            raise ValueError(f"a shared budget needs bytes, got {total_bytes}")
        self.tier = tier
        self.total_bytes = total_bytes
        self._unassigned = total_bytes
        self._members: list[Member] = []
        self._lock = threading.Lock()

    def join(self, member: Member) -> None:
        with self._lock:
            self._members.append(member)

    def leave(self, member: Member) -> None:
        with self._lock:
            if member in self._members:
                self._members.remove(member)

    def take(self, pages: int, page_bytes: int) -> int:
        """Up to ``pages`` pages of ``page_bytes`` from the unassigned bytes; how many."""
        with self._lock:
            got = min(pages, self._unassigned // page_bytes)
            self._unassigned -= got * page_bytes
            return got

    def give(self, pages: int, page_bytes: int) -> None:
        with self._lock:
            self._unassigned += pages * page_bytes
            assert self._unassigned <= self.total_bytes, "more bytes given back than granted"

    @property
    def unassigned_bytes(self) -> int:
        with self._lock:
            return self._unassigned

    def stats(self) -> BudgetStats:
        with self._lock:
            return BudgetStats(self.total_bytes, self._unassigned, len(self._members))

    def reclaim(self, member: Member, pages: int, page_bytes: int) -> int:
        """Right now, for ``member``, which cannot free ``pages`` pages of its own: the other
        stores above an equal share give back up to that many bytes (coldest blocks first, by
        their policies), as far as ``member`` stays within an equal share. Returns the bytes
        freed. The caller holds no store lock."""
        with self._lock:
            members = [m for m in self._members if m is not member]
            fair = self.total_bytes // (len(members) + 1)
        tier = self.tier
        want = min(pages * page_bytes, fair - member.share_bytes(tier))
        freed = 0
        shares = {id(m): m.share_bytes(tier) for m in members}
        for m in sorted(members, key=lambda m: shares[id(m)], reverse=True):
            excess = shares[id(m)] - fair
            if want - freed <= 0 or excess <= 0:
                break
            page = m.page_bytes_of(tier)
            freed += m.shrink(tier, -(-min(excess, want - freed) // page)) * page
        return freed

    def rebalance(self) -> int:
        """Bytes moved out of stores above an equal share, for the stores refused pages since
        the last call (they take them at their next allocation). Returns the bytes freed."""
        with self._lock:
            members = list(self._members)
            unassigned = self._unassigned
        if len(members) < 2:
            return 0
        tier = self.tier
        # NOTE: each store's lock is taken alone, never under the budget's (see the docstring).
        refused = {id(m): m.take_refused(tier) * m.page_bytes_of(tier) for m in members}
        shares = {id(m): m.share_bytes(tier) for m in members}
        fair = self.total_bytes // len(members)
        # What the refused stores below an equal share may still claim, less what is unassigned.
        want = sum(
            min(refused[id(m)], fair - shares[id(m)])
            for m in members
            if refused[id(m)] and shares[id(m)] < fair
        )
        want -= unassigned
        freed = 0
        for m in sorted(members, key=lambda m: shares[id(m)] - fair, reverse=True):
            if want <= 0:
                break
            excess = shares[id(m)] - fair
            if excess <= 0:
                break
            page = m.page_bytes_of(tier)
            pages = -(-min(excess, want) // page)
            got = m.shrink(tier, pages) * page
            freed += got
            want -= got
        return freed
