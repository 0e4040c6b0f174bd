"""Lease bookkeeping: the handles callers hold, their deadlines, and what expiry gives back.

A write lease owns the free pages it was given until commit, abort or expiry; a read lease owns one
pin on each block it found. Deadlines sit in one heap, swept lazily (``_expire_locked``) at the
start of every operation that depends on a lease being alive.

An expired write lease's pages are quarantined, not freed: a same-host writer fills shared memory
directly, so a slow one may still write after its lease ended, and a page handed to the next
writer would take those bytes. They go back to the free list ``quarantine_s`` after the deadline
(an abort, which the writer sends itself, frees them at once; so does ``forget_holder`` when the
writer is known to be dead). Each slot also carries a
generation, bumped when it leaves the free list: a lease whose page generations changed is
stale, and neither its page views nor its commit are honoured.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from .blocks import BlockStore, Handle
from .errors import FailedPrecondition, InvalidArgument, NotFound
from .keys import BlockKey
from .layout import KVLayout
from .records import StoreConfig
from .tiers import Tier

# The longest pin a commit may keep for a reader it tells the pages are there (Commit's and
# SubmitTransfer's hold_s): long enough for a reader's next step, short enough that nobody
# pins pages for good with it.
MAX_HOLD_S = 60.0


def check_hold(hold_s: float) -> float:
    """A request's ``hold_s``, or ``InvalidArgument`` naming it (NaN too)."""
    if not 0 <= hold_s <= MAX_HOLD_S:
        raise InvalidArgument(
            f"hold_s must be within [0, {MAX_HOLD_S:g}] seconds (0: no pin), got {hold_s!r}"
        )
    return hold_s


@dataclass(frozen=True, slots=True)
class WriteLease:
    lease_id: int
    tier: Tier
    keys: list[BlockKey]
    slots: list[int]  # page slot to write for each key; -1: already stored, skip it
    expires_at: float
    generations: list[int] = field(default_factory=list)  # of each slot when it was leased
    # The keys are one prefix chain in order (key i's parent is key i - 1), as a writer's own
    # prompt is; False: blocks from anywhere (a transfer with gaps), linked to no parent.
    chained: bool = True

    @property
    def to_write(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s >= 0]


@dataclass(frozen=True, slots=True)
class ReadLease:
    lease_id: int
    keys: list[BlockKey]
    slots: list[int]  # page slot of each key; -1: not stored
    tiers: list[Tier | None]
    expires_at: float

    @property
    def found(self) -> int:
        return sum(1 for s in self.slots if s >= 0)


@dataclass(slots=True)
class WriteLeaseState:
    lease: WriteLease
    deadline: float  # ``lease.expires_at`` until ``extend`` moves it
    # xxh3-64 of pages ``write`` copied whole (by index in the lease), hashed while still in
    # cache; commit seals them with these instead of reading every page back
    sums: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class ReadLeaseState:
    blocks: list[Handle]  # what this lease pinned (found ones only)
    deadline: float


class LeaseBook(BlockStore):
    """Live leases and their deadlines (a mixin of ``TieredStore``; caller holds the lock)."""

    def __init__(self, layout: KVLayout, config: StoreConfig) -> None:
        super().__init__(layout, config)
        self._write_leases: dict[int, WriteLeaseState] = {}
        self._read_leases: dict[int, ReadLeaseState] = {}
        # NOTE: (deadline, lease_id) entries; ``extend`` pushes a new one and leaves the old one to
        # be skipped by the sweep, so a lease is expired only when its *current* deadline passed.
        self._deadlines: list[tuple[float, int]] = []
        self._lease_ids = itertools.count(1)
        q = config.quarantine_s
        self._quarantine_s = 3 * config.lease_ttl_s if q is None else q
        # (release time, lease id, tier, slots) of expired write leases, soonest first.
        self._quarantine: list[tuple[float, int, Tier, list[int]]] = []
        self._quarantined: set[int] = set()  # their lease ids: a late commit says why it failed

    def _ttl(self, ttl_s: float | None) -> float:
        ttl_s = self.config.lease_ttl_s if ttl_s is None else ttl_s
        if not ttl_s > 0:
            raise InvalidArgument(f"lease ttl must be positive seconds, got {ttl_s!r}")
        return float(ttl_s)

    def _add_write_lease(
        self,
        tier: Tier,
        keys: list[BlockKey],
        slots: list[int],
        gens: list[int],
        ttl_s: float,
        chained: bool = True,
    ) -> WriteLease:
        lease_id = next(self._lease_ids)
        deadline = self._clock() + ttl_s
        lease = WriteLease(lease_id, tier, keys, slots, deadline, gens, chained)
        self._write_leases[lease_id] = WriteLeaseState(lease, deadline)
        heapq.heappush(self._deadlines, (deadline, lease_id))
        return lease

    def _add_read_lease(
        self,
        keys: list[BlockKey],
        pinned: list[Handle],
        slots: list[int],
        tiers: list[Tier | None],
        ttl_s: float,
    ) -> ReadLease:
        lease_id = next(self._lease_ids)
        deadline = self._clock() + ttl_s
        self._read_leases[lease_id] = ReadLeaseState(pinned, deadline)
        heapq.heappush(self._deadlines, (deadline, lease_id))
        return ReadLease(lease_id, keys, slots, tiers, deadline)

    def _extend_lease(self, lease_id: int, ttl_s: float) -> float:
        state: ReadLeaseState | WriteLeaseState | None = self._read_leases.get(
            lease_id
        ) or self._write_leases.get(lease_id)
        if state is None:
            raise NotFound(f"lease {lease_id} does not exist (expired or released)")
        state.deadline = self._clock() + ttl_s
        heap = self._deadlines
        heapq.heappush(heap, (state.deadline, lease_id))
        live = len(self._read_leases) + len(self._write_leases)
        if len(heap) > 2 * live + 64:
            # NOTE: each extension leaves its old entry behind until that deadline passes (up to
            # the longest lease time): a client extending in a loop would grow the heap without
            # bound. Rebuilt from the live deadlines, it costs O(live) per O(live) extensions.
            heap[:] = [(st.deadline, i) for i, st in self._read_leases.items()]
            heap.extend((st.deadline, i) for i, st in self._write_leases.items())
            heapq.heapify(heap)
        return state.deadline

    def _write_lease(self, lease_id: int) -> WriteLeaseState:
        # NOTE: sweep first so that a lease is dead from its deadline on, not from whenever the
        # next allocate/acquire happens to sweep (a late writer must not publish).
        self._expire_locked()
        state = self._write_leases.get(lease_id)
        if state is None:
            raise FailedPrecondition(
                f"write lease {lease_id} does not exist (never allocated, "
                "committed, aborted or expired)"
            )
        return state

    def _leased_slot(self, lease_id: int, index: int) -> tuple[WriteLease, int]:
        lease = self._write_lease(lease_id).lease
        if not 0 <= index < len(lease.keys):
            raise InvalidArgument(
                f"page index {index} out of range for a lease of {len(lease.keys)} keys"
            )
        slot = lease.slots[index]
        if slot < 0:
            raise FailedPrecondition(f"key #{index} is already stored; there is nothing to write")
        return lease, slot

    def _check_generations(self, lease: WriteLease, index: int | None = None) -> None:
        """FailedPrecondition when a page of ``lease`` (or just page ``index``) was given to
        someone else since: the lease is stale, and what it wrote there is not its own."""
        gens = self._tiers[lease.tier].gens
        for i in range(len(lease.slots)) if index is None else (index,):
            slot = lease.slots[i]
            if slot >= 0 and gens[slot] != lease.generations[i]:
                raise FailedPrecondition(
                    f"write lease {lease.lease_id} is stale: its page #{i} was reused after "
                    "the lease expired; its content is not trusted, allocate again"
                )

    def _quarantine_write_lease(self, lease: WriteLease, deadline: float) -> None:
        ts = self._tiers[lease.tier]
        slots = [s for s in lease.slots if s >= 0]
        ts.leased -= len(slots)
        ts.quarantined += len(slots)
        heapq.heappush(
            self._quarantine, (deadline + self._quarantine_s, lease.lease_id, lease.tier, slots)
        )
        self._quarantined.add(lease.lease_id)

    def _release_quarantine(self, now: float) -> None:
        heap = self._quarantine
        while heap and heap[0][0] <= now:
            _, lease_id, tier, slots = heapq.heappop(heap)
            ts = self._tiers[tier]
            ts.quarantined -= len(slots)
            ts.free.extend(slots)
            self._quarantined.discard(lease_id)

    def forget_holder(self, lease_id: int) -> int:
        """The lease's holder is known to be gone (its process exited): nothing can write into
        its pages any more, so they need no quarantine. A live write lease is aborted, an
        expired one leaves quarantine, a read lease is released. Returns the pages freed (0 for a
        read lease, or a lease that ended already). Freed pages are fenced as any: their
        generation changes when they are leased again."""
        with self._lock:
            self._expire_locked()
            w = self._write_leases.pop(lease_id, None)
            if w is not None:
                self._free_write_lease(w.lease)
                return len(w.lease.to_write)
            r = self._read_leases.pop(lease_id, None)
            if r is not None:
                self._unpin_blocks(r.blocks)
                return 0
            if lease_id not in self._quarantined:
                return 0
            heap = self._quarantine
            i = next(i for i, entry in enumerate(heap) if entry[1] == lease_id)
            _, _, tier, slots = heap[i]
            heap[i] = heap[-1]
            heap.pop()
            heapq.heapify(heap)
            ts = self._tiers[tier]
            ts.quarantined -= len(slots)
            ts.free.extend(slots)
            self._quarantined.discard(lease_id)
            return len(slots)

    def _free_write_lease(self, lease: WriteLease) -> None:
        ts = self._tiers[lease.tier]
        for slot in lease.slots:
            if slot >= 0:
                ts.free.append(slot)
                ts.leased -= 1

    def _expire_locked(self) -> int:
        now = self._clock()
        expired = 0
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            w = self._write_leases.get(lease_id)
            if w is not None and w.deadline <= now:
                del self._write_leases[lease_id]
                self._quarantine_write_lease(w.lease, w.deadline)
                expired += 1
                continue
            r = self._read_leases.get(lease_id)
            if r is not None and r.deadline <= now:
                del self._read_leases[lease_id]
                self._unpin_blocks(r.blocks)
                expired += 1
        self._release_quarantine(now)
        self._n.expired_leases += expired
        return expired
