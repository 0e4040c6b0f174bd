"""TieredStore: the block index, tiers, leases and eviction of one node for one model layout.

Invariants (checked by the tests):
- A committed block lives in exactly one tier (exclusive tiers); ``_index`` maps its key to it.
- A tier's slot is in exactly one of: the free list, a writer's lease, or ``tier.keys`` (committed).
- A committed block is in its tier's eviction policy iff it is not pinned.
- Writers' pages are invisible until ``commit``; a lease that expires frees them.
- Eviction never touches pinned or leased pages; when nothing can be freed, allocation raises
  ``CapacityExhausted`` at once.

Every public method takes one lock; bulk copies run under it too, so a lease can never expire and
hand its page to someone else halfway through a copy. Metadata work per page is O(1).
"""
from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import xxhash

from .errors import CapacityExhausted, FailedPrecondition, InvalidArgument, NotFound
from .events import BlockEvent, EventKind, EventLog
from .keys import BlockKey, block_keys, check_keys, root_key
from .layout import KVLayout
from .payload import as_uint8, copy_bytes
from .policy import EvictionPolicy, make_policy
from .pools import MetadataPool, PagePool, SharedDramPool, TorchSlabPool
from .ssd import SsdPool
from .tiers import Tier

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
    reserve_shm: bool = False
    metadata_only: bool = False
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    max_events: int = 1 << 20
    clock: Callable[[], float] = time.monotonic
    on_event: Callable[[], None] | None = None  # called (under the store lock) after new events


@dataclass(frozen=True, slots=True)
class LookupResult:
    hits: int                 # length of the cached prefix, in blocks
    tiers: list[Tier]         # tier of each hit block


@dataclass(frozen=True, slots=True)
class WriteLease:
    lease_id: int
    tier: Tier
    keys: list[BlockKey]
    slots: list[int]          # page slot to write for each key; -1: already stored, skip it
    expires_at: float

    @property
    def to_write(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s >= 0]


@dataclass(frozen=True, slots=True)
class ReadLease:
    lease_id: int
    keys: list[BlockKey]
    slots: list[int]          # page slot of each key; -1: not stored
    tiers: list[Tier | None]
    expires_at: float

    @property
    def found(self) -> int:
        return sum(1 for s in self.slots if s >= 0)


@dataclass(frozen=True, slots=True)
class CommitResult:
    stored: int               # newly published blocks
    duplicates: int           # blocks another writer published first (our pages were freed)


@dataclass(frozen=True, kw_only=True)
class TierStats:
    tier: Tier
    capacity_pages: int
    used_pages: int
    leased_pages: int
    pinned_blocks: int
    hits: int
    evictions: int

    @property
    def free_pages(self) -> int:
        """Pages neither committed nor leased to a writer: what an allocation can take now."""
        return self.capacity_pages - self.used_pages - self.leased_pages


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


@dataclass(slots=True)
class _Block:
    tier: Tier
    slot: int
    pins: int = 0
    doomed: bool = False      # out of the index while pinned: its page is freed on the last unpin


@dataclass(slots=True)
class _TierState:
    tier: Tier
    pool: PagePool
    policy: EvictionPolicy
    free: list[int]
    keys: list[BlockKey | None]
    leased: int = 0
    pinned: int = 0
    hits: int = 0
    evictions: int = 0


@dataclass(slots=True)
class _WriteLeaseState:
    lease: WriteLease
    deadline: float


@dataclass(slots=True)
class _ReadLeaseState:
    blocks: list[tuple[BlockKey, "_Block"]]   # what this lease pinned (found ones only)
    deadline: float


@dataclass
class _Counters:
    misses: int = 0
    demotions: int = 0
    promotions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    expired_leases: int = 0
    corrupt_pages: int = 0


class TieredStore:
    """Paged KV blocks of one layout in GPU / DRAM / SSD tiers. Thread-safe; batch-first."""

    def __init__(self, layout: KVLayout, config: StoreConfig) -> None:
        self.layout = layout
        self.config = config
        self.namespace = layout.namespace
        self._clock = config.clock
        self._lock = threading.RLock()
        self._index: dict[BlockKey, _Block] = {}
        self._tiers: dict[Tier, _TierState] = {}
        self._write_leases: dict[int, _WriteLeaseState] = {}
        self._read_leases: dict[int, _ReadLeaseState] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._lease_ids = itertools.count(1)
        self._events = EventLog(config.max_events, config.on_event)
        self._n = _Counters()
        self._closed = False
        try:
            self._open_tiers()
            self._recover_ssd()
        except BaseException:
            self._close_pools()
            raise

    # ---- construction -------------------------------------------------------------------

    def _open_tiers(self) -> None:
        cfg, page = self.config, self.layout.page_bytes
        specs = [(Tier.GPU, cfg.gpu_pages, cfg.gpu_policy), (Tier.DRAM, cfg.dram_pages,
                 cfg.dram_policy), (Tier.SSD, cfg.ssd_pages, cfg.ssd_policy)]
        for tier, pages, policy in specs:
            if pages < 0:
                raise InvalidArgument(f"{tier.name.lower()}_pages must be >= 0, got {pages}")
        if not any(p for _, p, _ in specs):
            raise InvalidArgument("a store needs at least one tier with pages > 0")
        if not cfg.metadata_only and cfg.dram_pages <= 0:
            raise InvalidArgument("a store with data needs a DRAM tier (dram_pages > 0): it is "
                                  "where writers and shared-memory readers see pages")
        if cfg.write_tier not in [t for t, p, _ in specs if p]:
            raise InvalidArgument(f"write_tier {cfg.write_tier.name} has no pages")
        for tier, pages, policy in specs:
            if not pages:
                continue
            evict = make_policy(policy, pages)  # NOTE: first: a bad name must not leak a pool
            pool = self._make_pool(tier, pages, page)
            self._tiers[tier] = _TierState(tier, pool, evict, list(range(pages - 1, -1, -1)),
                                           [None] * pages)

    def _make_pool(self, tier: Tier, pages: int, page_bytes: int) -> PagePool:
        cfg = self.config
        if cfg.metadata_only:
            return MetadataPool(tier, pages, page_bytes)
        if tier is Tier.GPU:
            return TorchSlabPool(pages, page_bytes, device=cfg.gpu_device)
        if tier is Tier.DRAM:
            return SharedDramPool(pages, page_bytes, shm_name=cfg.shm_name,
                                  reserve=cfg.reserve_shm)
        if not cfg.ssd_dir:
            raise InvalidArgument("the SSD tier needs ssd_dir (a directory for its lmdb files)")
        sub = xxhash.xxh64_hexdigest(self.namespace.encode())
        return SsdPool(os.path.join(cfg.ssd_dir, sub), pages, page_bytes)

    def _recover_ssd(self) -> None:
        """Re-index pages an earlier run left on the SSD tier (beyond capacity: dropped)."""
        ts = self._tiers.get(Tier.SSD)
        if ts is None or not isinstance(ts.pool, SsdPool):
            return
        keys = ts.pool.stored_keys()
        keep, extra = keys[: len(ts.free)], keys[len(ts.free):]
        if extra:
            ts.pool.drop_pages([-1] * len(extra), extra)
        for key in keep:
            self._publish(ts, BlockKey(key), ts.free.pop())

    # ---- properties ------------------------------------------------------------------------

    @property
    def shm_name(self) -> str | None:
        ts = self._tiers.get(Tier.DRAM)
        return getattr(ts.pool, "shm_name", None) if ts else None

    @property
    def tiers(self) -> list[Tier]:
        return sorted(self._tiers)

    def capacity(self, tier: Tier) -> int:
        ts = self._tiers.get(tier)
        return len(ts.keys) if ts else 0

    def pool(self, tier: Tier) -> PagePool:
        return self._tiers[tier].pool

    def keys_for(self, tokens, salt: bytes | str = b"") -> list[BlockKey]:
        """Block keys of ``tokens`` in this store's namespace under ``salt``."""
        return block_keys(tokens, self.layout.block_tokens, root_key(self.namespace, salt))

    # ---- lookup ------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest cached prefix of ``keys``; stops at the first miss. Counts as an access."""
        keys = check_keys(keys)
        tiers: list[Tier] = []
        with self._lock:
            index = self._index
            for key in keys:
                block = index.get(key)
                if block is None:
                    break
                ts = self._tiers[block.tier]
                ts.policy.touch(block.slot)
                ts.hits += 1
                tiers.append(block.tier)
            self._n.misses += len(keys) - len(tiers)
        return LookupResult(len(tiers), tiers)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Per-key presence without touching recency or statistics."""
        keys = check_keys(keys)
        with self._lock:
            return [k in self._index for k in keys]

    # ---- two-phase writes --------------------------------------------------------------

    def allocate(self, keys: Sequence[bytes], ttl_s: float | None = None,
                 tier: Tier | None = None) -> WriteLease:
        """Lease pages for the keys not yet stored. Evicts (demoting) as needed; raises
        ``CapacityExhausted`` when the pages cannot be freed because the rest are pinned."""
        keys = check_keys(keys)
        if len(set(keys)) != len(keys):
            raise InvalidArgument("allocate: the key list contains duplicates")
        tier = self.config.write_tier if tier is None else Tier.parse(tier)
        ttl_s = self._ttl(ttl_s)
        with self._lock:
            ts = self._tier(tier)
            self._expire_locked()
            missing = [i for i, k in enumerate(keys) if k not in self._index]
            pages = self._reserve(ts, len(missing))
            slots = [-1] * len(keys)
            for i, slot in zip(missing, pages):
                slots[i] = slot
            ts.leased += len(pages)
            lease_id = next(self._lease_ids)
            deadline = self._clock() + ttl_s
            lease = WriteLease(lease_id, tier, keys, slots, deadline)
            self._write_leases[lease_id] = _WriteLeaseState(lease, deadline)
            heapq.heappush(self._deadlines, (deadline, lease_id))
            return lease

    def write(self, lease_id: int, index: int, data, layer: int | None = None) -> None:
        """Copy one page (or, with ``layer``, one layer's K|V slice) into a leased page."""
        with self._lock:
            lease, slot = self._leased_slot(lease_id, index)
            pool = self._tiers[lease.tier].pool
            if layer is None:
                src = as_uint8(data, self.layout.page_bytes, self.layout.dtype, "page")
                offset, size = 0, self.layout.page_bytes
            else:
                offset, size = self.layout.layer_offset(layer), self.layout.layer_bytes
                src = as_uint8(data, size, self.layout.dtype, f"layer {layer}")
            view = pool.page_view(slot)
            if view is not None:
                copy_bytes(view[offset:offset + size], src)
            self._n.bytes_written += size

    def write_pages(self, lease_id: int, pages: Sequence) -> None:
        """Write every page the lease asks for; ``pages`` is aligned with the lease's keys."""
        with self._lock:
            lease = self._write_lease(lease_id).lease
            if len(pages) != len(lease.keys):
                raise InvalidArgument(f"got {len(pages)} pages for {len(lease.keys)} keys")
            for i in lease.to_write:
                self.write(lease_id, i, pages[i])

    def page_view(self, lease: WriteLease | ReadLease, index: int, layer: int | None = None):
        """Zero-copy view of a leased or pinned page (or one layer of it), valid while the lease
        is. Writers fill it in place; readers must not write to it."""
        slot = lease.slots[index]
        if slot < 0:
            raise NotFound(f"key #{index} of lease {lease.lease_id} has no page")
        tier = lease.tier if isinstance(lease, WriteLease) else lease.tiers[index]
        view = self._tiers[tier].pool.page_view(slot)
        if view is None or layer is None:
            return view
        offset = self.layout.layer_offset(layer)
        return view[offset:offset + self.layout.layer_bytes]

    def commit(self, lease_id: int) -> CommitResult:
        """Publish a lease's pages. Keys another writer published first keep the first copy."""
        with self._lock:
            self._expire_locked()
            state = self._write_leases.pop(lease_id, None)
            if state is None:
                raise FailedPrecondition(
                    f"commit of write lease {lease_id}: no such lease (never allocated, already "
                    "committed or aborted, or expired); allocate again")
            lease = state.lease
            ts = self._tiers[lease.tier]
            stored = dup = 0
            for key, slot in zip(lease.keys, lease.slots):
                if slot < 0:
                    continue
                ts.leased -= 1
                if key in self._index:
                    ts.free.append(slot)
                    dup += 1
                    continue
                self._publish(ts, key, slot)
                stored += 1
            return CommitResult(stored, dup)

    def abort(self, lease_id: int) -> None:
        with self._lock:
            state = self._write_leases.pop(lease_id, None)
            if state is None:
                raise FailedPrecondition(f"abort of write lease {lease_id}: no such lease")
            self._free_write_lease(state.lease)

    def put(self, keys: Sequence[bytes], pages: Sequence) -> CommitResult:
        """allocate + write + commit in one call (aborts on a bad page)."""
        lease = self.allocate(keys)
        try:
            self.write_pages(lease.lease_id, pages)
        except BaseException:
            self.abort(lease.lease_id)
            raise
        return self.commit(lease.lease_id)

    # ---- pinned reads ------------------------------------------------------------------------

    def acquire(self, keys: Sequence[bytes], ttl_s: float | None = None,
                into: Tier | None | str = "default") -> ReadLease:
        """Pin the stored keys (missing ones get slot -1) under a lease.

        ``into``: a tier to move pinned blocks into first (DRAM for shared-memory readers: an SSD
        hit is promoted, a GPU page is moved down), as far as it has unpinned room; the lease's
        ``tiers`` say where each page is. Default: DRAM when ``promote_on_hit``, else leave blocks
        where they are.
        """
        keys = check_keys(keys)
        ttl_s = self._ttl(ttl_s)
        if into == "default":
            into = Tier.DRAM if self.config.promote_on_hit and Tier.DRAM in self._tiers else None
        with self._lock:
            self._expire_locked()
            index = self._index
            pinned = [(k, index[k]) for k in dict.fromkeys(keys) if k in index]
            for _, block in pinned:
                self._pin(block)
            if into is not None:
                dst = self._tier(into)
                # NOTE: only blocks no other lease pins may move: another reader may hold a view.
                movers = [(k, b) for k, b in pinned if b.tier != dst.tier and b.pins == 1]
                # Best effort: what does not fit (the target is pinned full) stays where it is.
                movers = movers[: len(dst.free) + len(dst.policy)]
                if movers:
                    self._relocate(movers, dst)
                    pinned = [(k, b) for k, b in pinned if b.pins]
            slots, tiers = [], []
            for key in keys:
                b = index.get(key)
                ok = b is not None and b.pins > 0
                slots.append(b.slot if ok else -1)
                tiers.append(b.tier if ok else None)
            lease_id = next(self._lease_ids)
            deadline = self._clock() + ttl_s
            self._read_leases[lease_id] = _ReadLeaseState(pinned, deadline)
            heapq.heappush(self._deadlines, (deadline, lease_id))
            return ReadLease(lease_id, keys, slots, tiers, deadline)

    def release(self, lease_id: int) -> None:
        with self._lock:
            self._expire_locked()
            state = self._read_leases.pop(lease_id, None)
            if state is None:
                raise NotFound(f"release of read lease {lease_id}: no such lease (expired?)")
            self._unpin_blocks(state.blocks)

    def extend(self, lease_id: int, ttl_s: float | None = None) -> float:
        """Push a read or write lease's deadline ``ttl_s`` from now; returns the new deadline."""
        ttl_s = self._ttl(ttl_s)
        with self._lock:
            self._expire_locked()
            state = self._read_leases.get(lease_id) or self._write_leases.get(lease_id)
            if state is None:
                raise NotFound(f"lease {lease_id} does not exist (expired or released)")
            state.deadline = self._clock() + ttl_s
            heapq.heappush(self._deadlines, (state.deadline, lease_id))
            return state.deadline

    def copy_out(self, lease: ReadLease, index: int, out) -> bool:
        """Copy one pinned page of a read lease into ``out`` (a flat uint8 numpy array or torch
        tensor of page_bytes), from whichever tier holds it. False if it failed its checksum
        (the block is then dropped)."""
        key, slot, tier = lease.keys[index], lease.slots[index], lease.tiers[index]
        size = out.numel() if hasattr(out, "numel") else getattr(out, "size", None)
        if size != self.layout.page_bytes or getattr(out, "ndim", 1) != 1:
            raise InvalidArgument(f"copy_out needs a flat buffer of {self.layout.page_bytes} "
                                  f"bytes, got {getattr(out, 'shape', type(out).__name__)}")
        if slot < 0:
            raise NotFound(f"key #{index} of lease {lease.lease_id} is not stored")
        with self._lock:
            if not self._tiers[tier].pool.has_data:
                raise FailedPrecondition("this store is metadata_only: it keeps no page bytes")
            self._expire_locked()
            if lease.lease_id not in self._read_leases:
                raise FailedPrecondition(f"read lease {lease.lease_id} expired or was released")
            if not self._tiers[tier].pool.read_page_into(slot, key, out):
                self._n.corrupt_pages += 1
                block = self._index.get(key)
                if block is not None:
                    self._discard(key, block)
                return False
            self._n.bytes_read += self.layout.page_bytes
            return True

    def read(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """Copies of the stored pages (None where missing). SSD hits are promoted when
        ``promote_on_hit``; otherwise read straight from lmdb.

        The pages are rows of one new array (keeping one row keeps the batch's buffer alive).
        NOTE: one allocation instead of one per page: a large read gets huge pages (numpy
        madvises them from 4 MiB) instead of a first-touch fault per 4 KiB, which cost over
        80% of the time of a read of 1 MiB pages.
        """
        lease = self.acquire(keys)
        try:
            found = [i for i, slot in enumerate(lease.slots) if slot >= 0]
            buf = np.empty((len(found), self.layout.page_bytes), dtype=np.uint8)
            out: list[np.ndarray | None] = [None] * len(lease.slots)
            for i, row in zip(found, buf):
                if self.copy_out(lease, i, row):
                    out[i] = row
            return out
        finally:
            self.release(lease.lease_id)

    # ---- removal, events, stats ----------------------------------------------------------------

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop blocks; a pinned block goes when its last pin is released. Returns how many."""
        keys = check_keys(keys)
        n = 0
        with self._lock:
            for key in keys:
                b = self._index.get(key)
                if b is not None:
                    self._discard(key, b)
                    n += 1
        return n

    def take_events(self, max_events: int | None = None) -> list[BlockEvent]:
        with self._lock:
            return self._events.take(max_events)

    def snapshot(self) -> tuple[int, list[tuple[BlockKey, Tier]]]:
        """Every stored key with its tier, and the sequence number this snapshot is current to."""
        with self._lock:
            return self._events.last_seq, [(k, b.tier) for k, b in self._index.items()]

    def expire_leases(self) -> int:
        with self._lock:
            return self._expire_locked()

    def stats(self) -> StoreStats:
        with self._lock:
            tiers = [TierStats(tier=t, capacity_pages=len(ts.keys),
                               used_pages=len(ts.keys) - len(ts.free) - ts.leased,
                               leased_pages=ts.leased, pinned_blocks=ts.pinned, hits=ts.hits,
                               evictions=ts.evictions)
                     for t, ts in sorted(self._tiers.items())]
            corrupt = self._n.corrupt_pages
            n = self._n
            return StoreStats(tiers=tiers, blocks=len(self._index), misses=n.misses,
                              demotions=n.demotions, promotions=n.promotions,
                              corrupt_pages=corrupt, bytes_written=n.bytes_written,
                              bytes_read=n.bytes_read, write_leases=len(self._write_leases),
                              read_leases=len(self._read_leases), expired_leases=n.expired_leases,
                              last_event_seq=self._events.last_seq,
                              dropped_events=self._events.dropped)

    def close(self) -> None:
        """Drop every lease and release pools (shared memory unlinked, lmdb synced)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._write_leases.clear()
            self._read_leases.clear()
            self._close_pools()

    def _close_pools(self) -> None:
        for ts in getattr(self, "_tiers", {}).values():
            ts.pool.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals (caller holds the lock) -------------------------------------------------------

    def _ttl(self, ttl_s: float | None) -> float:
        ttl_s = self.config.lease_ttl_s if ttl_s is None else ttl_s
        if not ttl_s > 0:
            raise InvalidArgument(f"lease ttl must be positive seconds, got {ttl_s!r}")
        return float(ttl_s)

    def _tier(self, tier: Tier) -> _TierState:
        ts = self._tiers.get(Tier.parse(tier))
        if ts is None:
            raise InvalidArgument(f"this store has no {Tier.parse(tier).name} tier")
        return ts

    def _write_lease(self, lease_id: int) -> _WriteLeaseState:
        # NOTE: sweep first so that a lease is dead from its deadline on, not from whenever the
        # next allocate/acquire happens to sweep (a late writer must not publish).
        self._expire_locked()
        state = self._write_leases.get(lease_id)
        if state is None:
            raise FailedPrecondition(f"write lease {lease_id} does not exist (never allocated, "
                                     "committed, aborted or expired)")
        return state

    def _leased_slot(self, lease_id: int, index: int) -> tuple[WriteLease, int]:
        lease = self._write_lease(lease_id).lease
        if not 0 <= index < len(lease.keys):
            raise InvalidArgument(f"page index {index} out of range for a lease of "
                                  f"{len(lease.keys)} keys")
        slot = lease.slots[index]
        if slot < 0:
            raise FailedPrecondition(f"key #{index} is already stored; there is nothing to write")
        return lease, slot

    def _publish(self, ts: _TierState, key: BlockKey, slot: int) -> None:
        self._index[key] = _Block(ts.tier, slot)
        ts.keys[slot] = key
        ts.policy.insert(slot, fresh=True)
        self._events.append(EventKind.STORED, key, ts.tier)

    def _pin(self, block: _Block) -> None:
        if block.pins == 0:
            ts = self._tiers[block.tier]
            ts.policy.remove(block.slot)
            ts.pinned += 1
        block.pins += 1

    def _unpin_blocks(self, blocks: Sequence[tuple[BlockKey, _Block]]) -> None:
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

    def _reserve(self, ts: _TierState, n: int) -> list[int]:
        """Take ``n`` free slots of a tier, evicting (and demoting) unpinned blocks if needed."""
        if n == 0:
            return []
        need = n - len(ts.free)
        if need > 0:
            if need > len(ts.policy):
                raise CapacityExhausted(
                    f"{ts.tier.name} tier is full: need {n} pages, {len(ts.free)} free and "
                    f"{len(ts.policy)} evictable; the other {len(ts.keys) - len(ts.free) - len(ts.policy)}"
                    " are pinned by readers or leased to writers. Release leases or add capacity")
            victims = [ts.policy.pop_victim() for _ in range(need)]
            self._evict(ts, victims)
        free = ts.free
        out = free[-n:]
        del free[-n:]
        return out

    def _next_tier(self, tier: Tier) -> _TierState | None:
        for t in range(tier + 1, Tier.SSD + 1):
            if Tier(t) in self._tiers:
                return self._tiers[Tier(t)]
        return None

    def _evict(self, ts: _TierState, victims: list[int]) -> None:
        """Move victim slots' blocks to the next tier if there is room, else drop them."""
        keys = [ts.keys[s] for s in victims]
        dst = self._next_tier(ts.tier)
        moved: list[int] = []
        if dst is not None:
            room = min(len(victims), len(dst.free) + len(dst.policy))
            if room:
                dslots = self._reserve(dst, room)
                src_views = [ts.pool.page_view(s) for s in victims[:room]]
                if ts.pool.has_data and dst.pool.has_data:
                    dst.pool.write_pages(dslots, keys[:room], src_views)
                for key, sslot, dslot in zip(keys, victims, dslots):
                    block = self._index[key]
                    block.tier, block.slot = dst.tier, dslot
                    dst.keys[dslot] = key
                    dst.policy.insert(dslot, fresh=True)
                    self._events.append(EventKind.STORED, key, dst.tier)
                moved = victims[:room]
                self._n.demotions += room
        dropped = victims[len(moved):]
        if dropped:
            dkeys = keys[len(moved):]
            ts.pool.drop_pages(dropped, dkeys)
            for key in dkeys:
                del self._index[key]
                self._events.append(EventKind.EVICTED, key, ts.tier)
            ts.evictions += len(dropped)
        for s in victims:
            ts.keys[s] = None
        ts.free.extend(victims)

    def _relocate(self, blocks: list[tuple[BlockKey, _Block]], dst: _TierState) -> None:
        """Move blocks pinned only by the caller into ``dst``. A page that fails its checksum on
        the way is dropped (unpinned, reported evicted): the caller sees it as missing."""
        dslots = self._reserve(dst, len(blocks))
        for (key, b), dslot in zip(blocks, dslots):
            src = self._tiers[b.tier]
            if src.pool.has_data and dst.pool.has_data:
                if not src.pool.read_page_into(b.slot, key, dst.pool.page_view(dslot)):
                    dst.free.append(dslot)
                    self._n.corrupt_pages += 1
                    b.pins = 0
                    src.pinned -= 1
                    self._discard(key, b)
                    continue
            src.pool.drop_pages([b.slot], [key])
            src.keys[b.slot] = None
            src.free.append(b.slot)
            src.pinned -= 1
            dst.pinned += 1
            if b.tier > dst.tier:
                self._n.promotions += 1
            else:
                self._n.demotions += 1
            b.tier, b.slot = dst.tier, dslot
            dst.keys[dslot] = key
            # NOTE: the pinned block re-enters the policy on unpin with fresh=False, which keeps
            # the slot's history: clear what the slot's previous occupant left there (LFU count).
            dst.policy.forget(dslot)
            self._events.append(EventKind.STORED, key, dst.tier)

    def _discard(self, key: BlockKey, b: _Block) -> None:
        """Take a block out of the index (reported evicted); its page is freed now, or on its
        last unpin if a reader still holds it."""
        if self._index.get(key) is b:
            del self._index[key]
            self._events.append(EventKind.EVICTED, key, b.tier)
        if b.pins:
            b.doomed = True
        else:
            self._free_page(key, b)

    def _free_page(self, key: BlockKey, b: _Block) -> None:
        ts = self._tiers[b.tier]
        ts.pool.drop_pages([b.slot], [key])
        ts.policy.remove(b.slot)
        ts.keys[b.slot] = None
        ts.free.append(b.slot)

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
            deadline, lease_id = heapq.heappop(heap)
            w = self._write_leases.get(lease_id)
            if w is not None and w.deadline <= now:
                del self._write_leases[lease_id]
                self._free_write_lease(w.lease)
                expired += 1
                continue
            r = self._read_leases.get(lease_id)
            if r is not None and r.deadline <= now:
                del self._read_leases[lease_id]
                self._unpin_blocks(r.blocks)
                expired += 1
        self._n.expired_leases += expired
        return expired
