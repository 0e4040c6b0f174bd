"""One tier's byte budget shared by the stores of several layouts (a node serving any model).

A store under a shared budget has a slot for every page the whole budget could hold in its
layout, but only the slots it was granted are in circulation; the rest are *withheld* (no bytes
behind them: shared memory is sparse, and a slot given back is punched out of it). So the sum of
what the stores hold never passes the budget, whatever their page sizes.

How the bytes move:
- **On demand.** A store that needs pages and has no free slot takes them from the budget's
  unassigned bytes before it evicts anything of its own (``TierMovement._reserve``). Alone, a
  layout can fill the whole budget.
- **Under contention** (nothing unassigned), a store below an equal share of the budget has the
  stores above it evict their coldest blocks (by their own eviction policies) and give those
  pages back before it evicts any of its own (``SharedBudget.reclaim``, from ``allocate``); at
  or above an equal share it evicts its own. Demotions and promotions between tiers do not
  reclaim (they run under the store's lock): they count the pages refused, and
  ``SharedBudget.rebalance`` (the node's reaper calls it) moves pages toward them the same way.
  So every layout that needs room keeps at least ``budget / layouts`` (max-min fairness, as
  cgroups' memory protection), and an idle one keeps what it holds until someone needs it.

Memory: a page given back is punched out of the store's shared memory (``PagePool.release``),
whole system pages only; a layout whose pages are not a multiple of the system page (4 KiB)
keeps the system pages that a given-back page shares with its neighbours, so its memory may
exceed its share by up to two system pages per page given back (real models' pages of 16 or
more tokens are multiples of 4 KiB).

Locks: a store calls the budget under its own lock; the budget never calls a store under its
lock, and ``rebalance`` takes one store's lock at a time.
"""

from __future__ import annotations

import threading
from typing import Protocol

from .tiers import Tier


class Member(Protocol):
    """What the budget needs of a store (``TieredStore``)."""

    def take_refused(self, tier: Tier) -> int: ...

    def shrink(self, tier: Tier, pages: int) -> int: ...

    def page_bytes_of(self, tier: Tier) -> int: ...


class Room(Protocol):
    """Room held for the budget's bytes outside the stores (``shm.ShmBallast``)."""

    def take(self, nbytes: int) -> None: ...

    def give(self, nbytes: int) -> None: ...


class SharedBudget:
    """``total_bytes`` of one tier, for the stores that join it. It keeps what each holds, so
    shares are read without any store's lock.

    An *equal share* is the budget over the stores that hold some of it (and the one asking):
    a layout registered and never used does not shrink the others' shares."""

    def __init__(self, tier: Tier, total_bytes: int, room: Room | None = None) -> None:
        if total_bytes <= 0:
            raise ValueError(f"a shared budget needs bytes, got {total_bytes}")
        self.tier = tier
        self.room = room  # granted bytes leave it, bytes given back return to it
        self.total_bytes = total_bytes
        self._unassigned = total_bytes
        self._held: dict[Member, int] = {}  # bytes each member holds, every member listed
        self._lock = threading.Lock()

    def join(self, member: Member) -> None:
        with self._lock:
            self._held.setdefault(member, 0)

    def leave(self, member: Member) -> None:
        """``member`` is gone: what it held is unassigned again."""
        with self._lock:
            held = self._held.pop(member, 0)
            self._unassigned += held
            if self.room is not None and held:
                self.room.give(held)

    def take(self, member: Member, pages: int, page_bytes: int) -> int:
        """Up to ``pages`` pages of ``page_bytes`` from the unassigned bytes; how many."""
        with self._lock:
            got = min(pages, self._unassigned // page_bytes)
            self._unassigned -= got * page_bytes
            self._held[member] = self._held.get(member, 0) + got * page_bytes
            if self.room is not None and got:
                self.room.take(got * page_bytes)
            return got

    def give(self, member: Member, pages: int, page_bytes: int) -> None:
        with self._lock:
            held = self._held.get(member, 0) - pages * page_bytes
            assert held >= 0, "more bytes given back than granted"
            self._held[member] = held
            self._unassigned += pages * page_bytes
            if self.room is not None and pages:
                self.room.give(pages * page_bytes)

    def _equal_share(self, asking: Member | None) -> int:
        """Under the lock."""
        active = sum(1 for m, b in self._held.items() if b > 0 or m is asking)
        return self.total_bytes // max(1, active)

    def below_equal_share(self, member: Member) -> bool:
        """Whether ``member`` may take pages of the others (it holds less than an equal
        share, and someone else holds more)."""
        with self._lock:
            fair = self._equal_share(member)
            return self._held.get(member, 0) < fair and any(
                b > fair for m, b in self._held.items() if m is not member
            )

    @property
    def unassigned_bytes(self) -> int:
        with self._lock:
            return self._unassigned

    def reclaim(self, member: Member, pages: int, page_bytes: int) -> int:
        """Right now, for ``member``, below an equal share and ``pages`` pages short: the
        stores above an equal share give back up to that many bytes (their coldest blocks, by
        their own policies), as far as ``member`` stays within an equal share. Returns the
        bytes freed. The caller holds no store lock."""
        with self._lock:
            fair = self._equal_share(member)
            want = min(pages * page_bytes, fair - self._held.get(member, 0))
            rich = sorted(
                ((b - fair, m) for m, b in self._held.items() if m is not member and b > fair),
                key=lambda x: x[0],
                reverse=True,
            )
        return self._take_from(rich, want)

    def rebalance(self) -> int:
        """For the stores refused pages since the last call (demotions and promotions, which
        do not reclaim) and below an equal share: the stores above it give pages back, which
        the refused take at their next need. Returns the bytes freed."""
        with self._lock:
            members = list(self._held)
        if len(members) < 2:
            return 0
        tier = self.tier
        # NOTE: each store's lock is taken alone, never under the budget's (see the docstring).
        refused = {m: m.take_refused(tier) * m.page_bytes_of(tier) for m in members}
        with self._lock:
            want = -self._unassigned
            for m in members:
                fair = self._equal_share(m)
                if refused[m] and self._held.get(m, 0) < fair:
                    want += min(refused[m], fair - self._held.get(m, 0))
            fair = self._equal_share(None)
            rich = sorted(
                ((b - fair, m) for m, b in self._held.items() if b > fair),
                key=lambda x: x[0],
                reverse=True,
            )
        return self._take_from(rich, want)

    def _take_from(self, rich: list[tuple[int, Member]], want: int) -> int:
        freed = 0
        for excess, m in rich:
            if want - freed <= 0:
                break
            page = m.page_bytes_of(self.tier)
            freed += m.shrink(self.tier, -(-min(excess, want - freed) // page)) * page
        return freed
