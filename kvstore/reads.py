"""Reads: ``lookup`` of the longest cached prefix, and pinned reads: ``acquire`` pins stored
blocks under a read lease (moving them into DRAM first when asked), ``copy_out`` / ``read`` copy
them out checking each page's checksum, ``release`` unpins, ``extend`` pushes a lease's deadline.
"""

from __future__ import annotations

from typing import Any, Sequence, cast

import numpy as np
import numpy.typing as npt

from .errors import FailedPrecondition, InvalidArgument, NotFound
from .keys import check_keys
from .leases import LeaseBook, ReadLease
from .movement import TierMovement
from .records import LookupResult
from .tiers import TIER_OF, Tier


class PinnedReads(LeaseBook, TierMovement):
    """A mixin of ``TieredStore``: the reader's side of its API."""

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

    def tiers_of(self, keys: Sequence[bytes]) -> list[Tier | None]:
        """Per key: the tier that holds it (None: not stored), without touching recency."""
        checked = check_keys(keys)
        with self._lock:
            return [TIER_OF[h & 3] if h >= 0 else None for h in self._index.get_many(checked)]

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
                self._grant(dst, len(movers) - len(dst.free))
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
                    tiers.append(TIER_OF[h & 3])
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
