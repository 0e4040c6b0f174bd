"""The values the store API takes and returns: its configuration, lookup and commit results, stats.

Plain dataclasses with no behaviour, in a module of their own so that every part of the store
(``blocks``, ``leases``, ``movement``, ``writes``, ``reads``, ``store``) can import them without
importing each other. ``kvstore.store`` re-exports them; callers keep importing them from there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .budget import SharedBudget
from .tiers import Tier

if TYPE_CHECKING:
    from .leases import ReadLease

DEFAULT_LEASE_TTL_S = 30.0


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Capacities in pages per tier (0: tier absent) and behaviour switches."""

    gpu_pages: int = 0
    dram_pages: int = 0
    ssd_pages: int = 0
    ssd_dir: str | None = None
    gpu_policy: str = "lru"
    dram_policy: str = "lru"
    ssd_policy: str = "lru"
    gpu_device: str = "cuda"
    write_tier: Tier = Tier.DRAM
    promote_on_hit: bool = True
    shm_name: str | None = None
    # Allocate every DRAM page at start (posix_fallocate): a sparse slab's pages are taken on
    # first write, and when /dev/shm is full by then, that write is a SIGBUS in its writer.
    reserve_shm: bool = True
    private_dram: bool = False  # DRAM pages in an anonymous memfd, not a /dev/shm name
    # xxh3-64 of every DRAM page at commit, verified by copy-outs and moves (and handed to
    # same-host readers); off: commits skip that pass over the bytes, and scribbles go unnoticed
    dram_checksums: bool = True
    ssd_damaged: str = "refuse"  # a damaged lmdb file at start: "refuse", or "move-aside"
    metadata_only: bool = False
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    # Pages of an expired write lease are held this long before they are reused: a same-host
    # writer fills shared memory directly and may still be writing. None: 3 x lease_ttl_s.
    quarantine_s: float | None = None
    max_events: int = 1 << 20
    clock: Callable[[], float] = time.monotonic
    on_event: Callable[[], None] | None = None  # called (under the store lock) after new events
    # Budgets shared with other layouts' stores (budget.py): the tier's pages are then the most
    # the whole budget holds in this layout, taken from it as needed.
    dram_budget: SharedBudget | None = None
    ssd_budget: SharedBudget | None = None


@dataclass(frozen=True, slots=True)
class LookupResult:
    hits: int  # length of the cached prefix, in blocks
    tier_codes: bytes  # tier of each hit block as one byte, Tier + 1 (the wire's Tier numbers)

    @property
    def tiers(self) -> list[Tier]:
        """The tier of each hit block."""
        of = _TIER_OF_CODE
        return [of[c] for c in self.tier_codes]


_TIER_OF_CODE = {1: Tier.GPU, 2: Tier.DRAM, 3: Tier.SSD}


@dataclass(frozen=True, slots=True)
class CommitResult:
    stored: int  # newly published blocks
    duplicates: int  # blocks another writer published first (our pages were freed)
    hold: ReadLease | None = None  # the pin of ``commit(hold_s=...)``: it lapses, unreleased


@dataclass(frozen=True, kw_only=True)
class TierStats:
    tier: Tier
    capacity_pages: int
    used_pages: int
    leased_pages: int
    pinned_blocks: int
    hits: int
    evictions: int
    quarantined_pages: int = 0  # of expired write leases, not reusable yet (see quarantine_s)
    # Under a budget shared with other layouts (budget.py): the pages granted now, of the
    # ``capacity_pages`` the whole budget would hold in this layout. Without one: capacity.
    granted_pages: int | None = None
    grantable_pages: int = 0  # what the budget has unassigned, in this layout's pages

    @property
    def free_pages(self) -> int:
        """Pages neither committed, leased to a writer nor quarantined: what an allocation can
        take now without evicting (under a shared budget: of those granted, plus what the
        budget has unassigned)."""
        granted = self.capacity_pages if self.granted_pages is None else self.granted_pages
        return (
            granted
            - self.used_pages
            - self.leased_pages
            - self.quarantined_pages
            + self.grantable_pages
        )


@dataclass(frozen=True, kw_only=True)
class StoreStats:
    tiers: list[TierStats]
    blocks: int
    misses: int
    demotions: int
    promotions: int
    corrupt_pages: int
    bytes_written: int
    bytes_read: int
    write_leases: int
    read_leases: int
    expired_leases: int
    last_event_seq: int
    dropped_events: int
    demotion_failures: int = 0  # blocks the next tier down refused (e.g. a full SSD filesystem)
