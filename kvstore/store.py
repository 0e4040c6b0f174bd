"""TieredStore: the block index, tiers, leases and eviction of one node for one model layout.

Invariants (``TieredStore.check_invariants`` checks them; see ``invariants.py``):
- A committed block lives in exactly one tier (exclusive tiers); ``_index`` maps its key to it.
- A tier's slot is in exactly one of: the free list, a writer's lease, the quarantine of expired
  write leases, or ``tier.keys`` (committed).
- A committed block is in its tier's eviction policy iff it is not pinned.
- Writers' pages are invisible until ``commit``; a lease that expires quarantines them, and they
  return to the free list ``quarantine_s`` later (a late same-host writer may still write there).
- An allocation never evicts the blocks of its own key list (the prefix it is about to reuse).
- Eviction never touches pinned or leased pages; when nothing can be freed, allocation raises
  ``CapacityExhausted`` at once.

Every public method takes one lock; bulk copies run under it too, so a lease can never expire and
hand its page to someone else halfway through a copy. Metadata work per page is O(1).

The store is split by job, over one shared state:
- ``records``: the public value types (config, results, stats);
- ``blocks``: the shared state (index, tiers, counters, events) and block primitives;
- ``leases``: lease handles, deadlines and expiry (``LeaseBook``);
- ``movement``: eviction, demotion and promotion (``TierMovement``);
- ``invariants``: the consistency check;
- this module: ``TieredStore``, the public API over them. Every public name stays importable here.
"""

from __future__ import annotations

import os
from typing import Any, Sequence, cast

import numpy as np
import numpy.typing as npt
import xxhash

from .blocks import TierState
from .errors import FailedPrecondition, InvalidArgument, NotFound
from .events import BlockEvent
from .invariants import InvariantViolation, check_store
from .keys import BlockKey, block_keys, check_keys, root_key
from .layout import KVLayout
from .leases import LeaseBook, ReadLease, WriteLease
from .movement import TierMovement
from .payload import as_uint8, as_uint8_rows, copy_bytes
from .policy import make_policy
from .pools import MetadataPool, PagePool, SharedDramPool, TorchSlabPool
from .records import (
    DEFAULT_LEASE_TTL_S,
    CommitResult,
    LookupResult,
    StoreConfig,
    StoreStats,
    TierStats,
)
from .ssd import SsdPool
from .tiers import Tier

_TIERS = (Tier.GPU, Tier.DRAM, Tier.SSD)  # by tier number, without an enum call per block

__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "CommitResult",
    "InvariantViolation",
    "LookupResult",
    "ReadLease",
    "StoreConfig",
    "StoreStats",
    "TierStats",
    "TieredStore",
    "WriteLease",
]


class TieredStore(LeaseBook, TierMovement):
    """Paged KV blocks of one layout in GPU / DRAM / SSD tiers. Thread-safe; batch-first."""

    def __init__(self, layout: KVLayout, config: StoreConfig) -> None:
        super().__init__(layout, config)
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
        specs = [
            (Tier.GPU, cfg.gpu_pages, cfg.gpu_policy),
            (Tier.DRAM, cfg.dram_pages, cfg.dram_policy),
            (Tier.SSD, cfg.ssd_pages, cfg.ssd_policy),
        ]
        for tier, pages, _ in specs:
            if pages < 0:
                raise InvalidArgument(f"{tier.name.lower()}_pages must be >= 0, got {pages}")
        q = cfg.quarantine_s
        if q is not None and not 0 <= q < float("inf"):  # NOTE: NaN fails this test too
            raise InvalidArgument(f"quarantine_s must be finite seconds >= 0, got {q!r}")
        if not any(p for _, p, _ in specs):
            raise InvalidArgument("a store needs at least one tier with pages > 0")
        if not cfg.metadata_only and cfg.dram_pages <= 0:
            raise InvalidArgument(
                "a store with data needs a DRAM tier (dram_pages > 0): it is "
                "where writers and shared-memory readers see pages"
            )
        if cfg.write_tier not in [t for t, p, _ in specs if p]:
            raise InvalidArgument(f"write_tier {cfg.write_tier.name} has no pages")
        for tier, pages, policy in specs:
            if not pages:
                continue
            evict = make_policy(policy, pages)  # NOTE: first: a bad name must not leak a pool
            pool = self._make_pool(tier, pages, page)
            self._add_tier(TierState(tier, pool, evict, pages))
        self._grow_tree()

    def _make_pool(self, tier: Tier, pages: int, page_bytes: int) -> PagePool:
        cfg = self.config
        if cfg.metadata_only:
            return MetadataPool(tier, pages, page_bytes)
        if tier is Tier.GPU:
            return TorchSlabPool(pages, page_bytes, device=cfg.gpu_device)
        if tier is Tier.DRAM:
            return SharedDramPool(
                pages,
                page_bytes,
                shm_name=cfg.shm_name,
                reserve=cfg.reserve_shm,
                private=cfg.private_dram,
                checksums=cfg.dram_checksums,
            )
        if not cfg.ssd_dir:
            raise InvalidArgument("the SSD tier needs ssd_dir (a directory for its lmdb files)")
        sub = xxhash.xxh64_hexdigest(self.namespace.encode())
        return SsdPool(os.path.join(cfg.ssd_dir, sub), pages, page_bytes, on_damage=cfg.ssd_damaged)

    def _recover_ssd(self) -> None:
        """Re-index pages an earlier run left on the SSD tier (beyond capacity: dropped)."""
        ts = self._tiers.get(Tier.SSD)
        if ts is None or not isinstance(ts.pool, SsdPool):
            return
        keys = ts.pool.stored_keys()
        keep, extra = keys[: len(ts.free)], keys[len(ts.free) :]
        if extra:
            ts.pool.drop_pages([-1] * len(extra), extra)
        slots = []
        for key in keep:
            slots.append(ts.free.pop())
            self._publish(ts, BlockKey(key), slots[-1])
        ts.policy.insert_many(slots, fresh=True)

    # ---- properties ------------------------------------------------------------------------

    @property
    def shm_name(self) -> str | None:
        ts = self._tiers.get(Tier.DRAM)
        return getattr(ts.pool, "shm_name", None) if ts else None

    @property
    def quarantine_s(self) -> float:
        """Seconds the pages of an expired write lease stay out of reuse."""
        return self._quarantine_s

    @property
    def tiers(self) -> list[Tier]:
        return sorted(self._tiers)

    def capacity(self, tier: Tier) -> int:
        ts = self._tiers.get(tier)
        return ts.capacity if ts else 0

    def pool(self, tier: Tier) -> PagePool:
        return self._tiers[tier].pool

    def keys_for(self, tokens: Any, salt: bytes | str = b"") -> list[BlockKey]:
        """Block keys of ``tokens`` in this store's namespace under ``salt``."""
        return block_keys(tokens, self.layout.block_tokens, root_key(self.namespace, salt))

    # ---- lookup ------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest cached prefix of ``keys``; stops at the first miss. Counts as an access."""
        with self._lock:
            try:
                found = np.frombuffer(self._index.find_prefix(keys), dtype=np.int32)
            except (TypeError, ValueError):
                check_keys(keys)  # raises InvalidArgument naming the malformed key
                raise
            tiers = found & 3
            # NOTE: one policy call per tier that holds part of the prefix, not one per block.
            for t, ts in enumerate(self._by_int):
                if ts is None:
                    continue
                slots = found[tiers == t] >> 2
                if len(slots):
                    ts.policy.touch_many(slots)
                    ts.hits += len(slots)
            self._n.misses += len(keys) - len(found)
        return LookupResult(len(found), (tiers + 1).astype(np.uint8).tobytes())

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Per-key presence without touching recency or statistics."""
        checked = check_keys(keys)
        with self._lock:
            return [h >= 0 for h in self._index.get_many(checked)]

    # ---- two-phase writes --------------------------------------------------------------

    def allocate(
        self, keys: Sequence[bytes], ttl_s: float | None = None, tier: Tier | str | None = None
    ) -> WriteLease:
        """Lease pages for the keys not yet stored. Evicts (demoting) as needed; raises
        ``CapacityExhausted`` when the pages cannot be freed because the rest are pinned."""
        checked = check_keys(keys)
        if len(set(checked)) != len(checked):
            raise InvalidArgument("allocate: the key list contains duplicates")
        target = self.config.write_tier if tier is None else Tier.parse(tier)
        ttl = self._ttl(ttl_s)
        with self._lock:
            ts = self._tier(target)
            self._expire_locked()
            found = self._index.get_many(checked)
            missing = [i for i, h in enumerate(found) if h < 0]
            # NOTE: pin the request's own stored blocks (its cached prefix, in any tier) while
            # making room: evicting them for the new pages would leave holes in what the writer
            # is about to reuse. No room otherwise: CapacityExhausted, not a hole.
            own = [h for h in found if h >= 0]
            for h in own:
                self._pin(h)
            try:
                pages = self._reserve(ts, len(missing))
            finally:
                self._unpin_blocks(own)
            slots = [-1] * len(checked)
            for i, slot in zip(missing, pages):
                slots[i] = slot
            ts.leased += len(pages)
            gens = [ts.gens[s] if s >= 0 else 0 for s in slots]
            return self._add_write_lease(target, checked, slots, gens, ttl)

    def write(self, lease_id: int, index: int, data: Any, layer: int | None = None) -> None:
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
                copy_bytes(view[offset : offset + size], src)
            self._n.bytes_written += size

    def write_layer(self, lease_id: int, layer: int, data: Any) -> None:
        """Copy layer ``layer``'s K|V slice of every page the lease asks for, in one call.

        ``data``: one slice per key of the lease, ``[len(keys), layer_bytes]`` bytes or a numpy
        array / torch tensor of ``len(keys)`` rows in the layout dtype (rows need not be adjacent:
        ``pages[:, layer]`` of a page batch is fine); rows of keys already stored are skipped.
        """
        offset, size = self.layout.layer_offset(layer), self.layout.layer_bytes
        with self._lock:
            lease = self._write_lease(lease_id).lease
            rows = as_uint8_rows(data, len(lease.keys), size, self.layout.dtype, f"layer {layer}")
            todo = lease.to_write
            if len(todo) < len(lease.keys):
                rows = rows[todo]
            self._tiers[lease.tier].pool.write_range([lease.slots[i] for i in todo], offset, rows)
            self._n.bytes_written += size * len(todo)

    def write_pages(self, lease_id: int, pages: Sequence[Any]) -> None:
        """Write every page the lease asks for; ``pages`` is aligned with the lease's keys."""
        with self._lock:
            lease = self._write_lease(lease_id).lease
            if len(pages) != len(lease.keys):
                raise InvalidArgument(f"got {len(pages)} pages for {len(lease.keys)} keys")
            for i in lease.to_write:
                self.write(lease_id, i, pages[i])

    def page_view(self, lease: WriteLease | ReadLease, index: int, layer: int | None = None) -> Any:
        """Zero-copy view of a leased or pinned page (or one layer of it), valid while the lease
        is. Writers fill it in place; readers must not write to it."""
        slot = lease.slots[index]
        if slot < 0:
            raise NotFound(f"key #{index} of lease {lease.lease_id} has no page")
        # A found key (slot >= 0) of a read lease always has its tier.
        tier = lease.tier if isinstance(lease, WriteLease) else cast(Tier, lease.tiers[index])
        if isinstance(lease, WriteLease):
            with self._lock:
                self._check_generations(lease, index)
        view = self._tiers[tier].pool.page_view(slot)
        if view is None or layer is None:
            return view
        offset = self.layout.layer_offset(layer)
        return view[offset : offset + self.layout.layer_bytes]

    def commit(
        self,
        lease_id: int,
        written_in_place: bool = False,
        checksums: npt.NDArray[np.uint64] | None = None,
    ) -> CommitResult:
        """Publish a lease's pages. Keys another writer published first keep the first copy.
        ``written_in_place``: the pages were filled through ``page_view`` (a same-host client's
        shared memory, a stream), not ``write``: count their bytes as written now.
        ``checksums``: the writer's xxh3-64 of each page, one per key of the lease (a key it had
        nothing to write for: ignored), sealed as they are instead of hashing the pages again. A
        wrong count raises ``InvalidArgument`` and leaves the lease as it was."""
        with self._lock:
            self._expire_locked()
            live = self._write_leases.get(lease_id)
            if checksums is not None and live is not None:
                n = len(live.lease.keys)
                if len(checksums) != n:
                    raise InvalidArgument(
                        f"commit of write lease {lease_id}: {len(checksums)} checksums for its "
                        f"{n} keys; send one per key, in Allocate's order (or none: the node "
                        "computes them)"
                    )
            sums = checksums.tolist() if checksums is not None else None
            state = self._write_leases.pop(lease_id, None)
            if state is None:
                if lease_id in self._quarantined:
                    raise FailedPrecondition(
                        f"commit of write lease {lease_id}: no such lease: it expired, and its "
                        "pages are quarantined (a late write may still land there); their "
                        "content is not trusted: allocate again"
                    )
                raise FailedPrecondition(
                    f"commit of write lease {lease_id}: no such lease (never allocated, already "
                    "committed or aborted, or expired); allocate again"
                )
            lease = state.lease
            ts = self._tiers[lease.tier]
            try:
                self._check_generations(lease)
            except FailedPrecondition:
                # Cannot happen while leases own their pages (check_invariants says so); if it
                # does, publish nothing and give back only the pages that are still ours.
                gens = ts.gens
                for slot, gen in zip(lease.slots, lease.generations):
                    if slot >= 0:
                        ts.leased -= 1
                        if gens[slot] == gen:
                            ts.free.append(slot)
                raise
            stored = dup = 0
            index, tree = self._index, self._tree
            new: list[int] = []
            prev: bytes | None = None
            for i, (key, slot) in enumerate(zip(lease.keys, lease.slots)):
                parent, prev = prev, key  # NOTE: a lease's keys are one chain, in order
                if slot < 0:
                    continue
                ts.leased -= 1
                if key in index:
                    ts.free.append(slot)
                    dup += 1
                    continue
                # The page's checksum (checked by copy-outs and moves): the writer's, if it sent it.
                ts.pool.seal(slot, sums[i] if sums is not None else None)
                up = index.get(parent) if tree is not None and parent is not None else -1
                self._publish(ts, key, slot, up)
                new.append(slot)
                stored += 1
            ts.policy.insert_many(new, fresh=True)
            if tree is not None and new:
                self._touch_prefix(lease.keys)
            if written_in_place:
                self._n.bytes_written += (stored + dup) * self.layout.page_bytes
            return CommitResult(stored, dup)

    def _touch_prefix(self, keys: Sequence[bytes]) -> None:
        """After a commit, its chain's stored blocks count as just used in the tiers whose
        policy orders by prefix: the parents of the new blocks must stay more recent than
        their children, so that the least recent blocks are leaves."""
        found = np.frombuffer(self._index.find_prefix(keys), dtype=np.int32)
        tiers = found & 3
        for t, ts in enumerate(self._by_int):
            if ts is not None and ts.policy.wants_tree:
                slots = found[tiers == t] >> 2
                if len(slots):
                    ts.policy.touch_many(slots)

    def abort(self, lease_id: int) -> None:
        with self._lock:
            state = self._write_leases.pop(lease_id, None)
            if state is None:
                raise FailedPrecondition(f"abort of write lease {lease_id}: no such lease")
            self._free_write_lease(state.lease)

    def put(self, keys: Sequence[bytes], pages: Sequence[Any]) -> CommitResult:
        """allocate + write + commit in one call (aborts on a bad page)."""
        lease = self.allocate(keys)
        try:
            self.write_pages(lease.lease_id, pages)
        except BaseException:
            self.abort(lease.lease_id)
            raise
        return self.commit(lease.lease_id)

    # ---- pinned reads ------------------------------------------------------------------------

    def acquire(
        self, keys: Sequence[bytes], ttl_s: float | None = None, into: Tier | None | str = "default"
    ) -> ReadLease:
        """Pin the stored keys (missing ones get slot -1) under a lease.

        ``into``: a tier to move pinned blocks into first (DRAM for shared-memory readers: an SSD
        hit is promoted, a GPU page is moved down), as far as it has unpinned room; the lease's
        ``tiers`` say where each page is. Default: DRAM when ``promote_on_hit``, else leave blocks
        where they are.
        """
        checked = check_keys(keys)
        ttl = self._ttl(ttl_s)
        if into == "default":
            into = Tier.DRAM if self.config.promote_on_hit and Tier.DRAM in self._tiers else None
        with self._lock:
            self._expire_locked()
            # NOTE: resolve the target before pinning: a bad ``into`` must not leave pins behind.
            dst = None if into is None else self._tier(into)
            index = self._index
            unique = list(dict.fromkeys(checked))
            hits = [(k, h) for k, h in zip(unique, index.get_many(unique)) if h >= 0]
            for _, h in hits:
                self._pin(h)
            if dst is not None:
                # NOTE: only blocks no other lease pins may move: another reader may hold a view.
                movers = [
                    (k, h) for k, h in hits if h & 3 != dst.tier and self._ts(h).pins[h >> 2] == 1
                ]
                # Best effort: what does not fit (the target is pinned full) stays where it is.
                movers = movers[: len(dst.free) + len(dst.policy)]
                if movers:
                    self._relocate(movers, dst)
                    # Moved blocks have new handles; a page that failed its checksum is gone.
                    hits = [(k, h) for k, h in zip(unique, index.get_many(unique)) if h >= 0]
            where = dict(hits)
            slots: list[int] = []
            tiers: list[Tier | None] = []
            for key in checked:
                h = where.get(key, -1)
                if h >= 0:
                    slots.append(h >> 2)
                    tiers.append(_TIERS[h & 3])
                else:
                    slots.append(-1)
                    tiers.append(None)
            return self._add_read_lease(checked, [h for _, h in hits], slots, tiers, ttl)

    def release(self, lease_id: int) -> None:
        with self._lock:
            self._expire_locked()
            state = self._read_leases.pop(lease_id, None)
            if state is None:
                raise NotFound(f"release of read lease {lease_id}: no such lease (expired?)")
            self._unpin_blocks(state.blocks)

    def extend(self, lease_id: int, ttl_s: float | None = None) -> float:
        """Push a read or write lease's deadline ``ttl_s`` from now; returns the new deadline."""
        ttl = self._ttl(ttl_s)
        with self._lock:
            self._expire_locked()
            return self._extend_lease(lease_id, ttl)

    def copy_out(self, lease: ReadLease, index: int, out: Any) -> bool:
        """Copy one pinned page of a read lease into ``out`` (a flat uint8 numpy array or torch
        tensor of page_bytes), from whichever tier holds it. False if it failed its checksum
        (the block is then dropped)."""
        key, slot, tier = lease.keys[index], lease.slots[index], lease.tiers[index]
        size = out.numel() if hasattr(out, "numel") else getattr(out, "size", None)
        if size != self.layout.page_bytes or getattr(out, "ndim", 1) != 1:
            raise InvalidArgument(
                f"copy_out needs a flat buffer of {self.layout.page_bytes} "
                f"bytes, got {getattr(out, 'shape', type(out).__name__)}"
            )
        if slot < 0:
            raise NotFound(f"key #{index} of lease {lease.lease_id} is not stored")
        with self._lock:
            ts = self._tiers[cast(Tier, tier)]  # a found key (slot >= 0) always has its tier
            if not ts.pool.has_data:
                raise FailedPrecondition("this store is metadata_only: it keeps no page bytes")
            self._expire_locked()
            if lease.lease_id not in self._read_leases:
                raise FailedPrecondition(f"read lease {lease.lease_id} expired or was released")
            if not ts.pool.read_page_into(slot, key, out):
                self._n.corrupt_pages += 1
                h = slot << 2 | ts.tier
                # NOTE: only if it is the page just read: a lease may hold a removed (doomed)
                # copy while the index holds a newer, healthy one elsewhere.
                if self._index.get(key) == h:
                    self._discard(key, h)
                return False
            self._n.bytes_read += self.layout.page_bytes
            return True

    def checksums(self, lease: ReadLease) -> list[int]:
        """xxh3-64 of each pinned page as committed, for readers that check what they read from
        shared memory (the messenger, before it sends a page); 0 where none is kept (a missing
        key, a tier without checksums)."""
        with self._lock:
            out: list[int] = []
            for slot, tier in zip(lease.slots, lease.tiers):
                ts = self._tiers.get(tier) if tier is not None and slot >= 0 else None
                out.append((ts.pool.checksum(slot) or 0) if ts is not None else 0)
            return out

    def read(self, keys: Sequence[bytes]) -> list[npt.NDArray[np.uint8] | None]:
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
            out: list[npt.NDArray[np.uint8] | None] = [None] * len(lease.slots)
            for i, row in zip(found, buf):
                if self.copy_out(lease, i, row):
                    out[i] = row
            return out
        finally:
            self.release(lease.lease_id)

    # ---- removal, events, stats ----------------------------------------------------------------

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop blocks; a pinned block goes when its last pin is released. Returns how many."""
        checked = check_keys(keys)
        n = 0
        unique = list(dict.fromkeys(checked))
        with self._lock:
            for key, h in zip(unique, self._index.get_many(unique)):
                if h < 0:
                    continue
                n += 1
                # NOTE: one named earlier may have taken this one with it (prefix policy: the
                # descendants of a removed block go too); it still counts as removed.
                if self._index.get(key) == h:
                    self._discard(key, h)
        return n

    def take_events(self, max_events: int | None = None) -> list[BlockEvent]:
        with self._lock:
            return self._events.take(max_events)

    def snapshot(self) -> tuple[int, list[tuple[BlockKey, Tier]]]:
        """Every stored key with its tier, and the sequence number this snapshot is current to."""
        with self._lock:
            return self._events.last_seq, [
                (BlockKey(k), _TIERS[h & 3]) for k, h in self._index.items()
            ]

    def expire_leases(self) -> int:
        with self._lock:
            return self._expire_locked()

    def stats(self) -> StoreStats:
        with self._lock:
            tiers = [
                TierStats(
                    tier=t,
                    capacity_pages=ts.capacity,
                    used_pages=ts.capacity - len(ts.free) - ts.leased - ts.quarantined,
                    leased_pages=ts.leased,
                    quarantined_pages=ts.quarantined,
                    pinned_blocks=ts.pinned,
                    hits=ts.hits,
                    evictions=ts.evictions,
                )
                for t, ts in sorted(self._tiers.items())
            ]
            n = self._n
            return StoreStats(
                tiers=tiers,
                blocks=len(self._index),
                misses=n.misses,
                demotions=n.demotions,
                promotions=n.promotions,
                corrupt_pages=n.corrupt_pages,
                bytes_written=n.bytes_written,
                bytes_read=n.bytes_read,
                write_leases=len(self._write_leases),
                read_leases=len(self._read_leases),
                expired_leases=n.expired_leases,
                last_event_seq=self._events.last_seq,
                dropped_events=self._events.dropped,
                demotion_failures=n.demotion_failures,
            )

    def check_invariants(self) -> None:
        """Raise ``InvariantViolation`` (an ``AssertionError``) listing every broken invariant
        (see ``invariants.py``). O(pages + leases), plus a key scan of the SSD tier: for tests
        and debugging, not a hot path. A closed store dropped its state: there is nothing to check.
        """
        with self._lock:
            if not self._closed:
                check_store(self)

    def close(self) -> None:
        """Drop every lease and release pools (shared memory unlinked, lmdb synced)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._write_leases.clear()
            self._read_leases.clear()
            self._quarantine.clear()
            self._quarantined.clear()
            self._close_pools()

    def _close_pools(self) -> None:
        for ts in getattr(self, "_tiers", {}).values():
            ts.pool.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
