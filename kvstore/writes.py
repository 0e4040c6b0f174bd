"""Two-phase writes: ``allocate`` leases pages (evicting, and demoting, to make room), ``write`` /
``write_layer`` / ``write_pages`` fill them, ``commit`` publishes them (the first writer of a key
wins) or ``abort`` gives them back; ``put`` is the three in one call. Pages stay invisible to
lookups until the commit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import numpy.typing as npt
import xxhash

from .errors import BudgetShort, FailedPrecondition, InvalidArgument
from .keys import BlockKey, check_keys
from .leases import LeaseBook, ReadLease, WriteLease
from .movement import TierMovement
from .payload import as_uint8, as_uint8_rows, copy_bytes, copy_checksum
from .records import CommitResult
from .tiers import Tier


class TwoPhaseWrites(LeaseBook, TierMovement):
    """A mixin of ``TieredStore``: the writer's side of its API."""

    if TYPE_CHECKING:  # the reader's side (kvstore.reads), which commit's hold uses

        def acquire(
            self, keys: Sequence[bytes], ttl_s: float | None = None, into: Tier | None | str = ...
        ) -> ReadLease: ...

    def allocate(
        self,
        keys: Sequence[bytes],
        ttl_s: float | None = None,
        tier: Tier | str | None = None,
        chained: bool = True,
    ) -> WriteLease:
        """Lease pages for the keys not yet stored. Evicts (demoting) as needed; raises
        ``CapacityExhausted`` when the pages cannot be freed because the rest are pinned.
        ``chained``: the keys are one prefix chain in order (each key's parent is the one
        before it); False links them to no parent, so that no block leaves with another it
        was never the parent of."""
        checked = check_keys(keys)
        if len(set(checked)) != len(checked):
            raise InvalidArgument("allocate: the key list contains duplicates")
        target = self.config.write_tier if tier is None else Tier.parse(tier)
        ttl = self._ttl(ttl_s)
        try:
            return self._allocate(checked, target, ttl, chained, reclaim=True)
        except BudgetShort as short:
            # Below an equal share of a budget shared with other layouts: they give pages back
            # (each under its own lock; this store's is not held here), then one more try.
            budget = self._tier(target).budget
            assert budget is not None
            budget.reclaim(self, short.pages, self.layout.page_bytes)
            return self._allocate(checked, target, ttl, chained, reclaim=False)

    def _allocate(
        self, checked: list[BlockKey], target: Tier, ttl: float, chained: bool, reclaim: bool
    ) -> WriteLease:
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
                pages = self._reserve(ts, len(missing), reclaim=reclaim)
            finally:
                self._unpin_blocks(own)
            slots = [-1] * len(checked)
            for i, slot in zip(missing, pages):
                slots[i] = slot
            ts.leased += len(pages)
            gens = [ts.gens[s] if s >= 0 else 0 for s in slots]
            return self._add_write_lease(target, checked, slots, gens, ttl, chained)

    def write(self, lease_id: int, index: int, data: Any, layer: int | None = None) -> None:
        """Copy one page (or, with ``layer``, one layer's K|V slice) into a leased page."""
        with self._lock:
            lease, slot = self._leased_slot(lease_id, index)
            sums = self._write_leases[lease_id].sums
            pool = self._tiers[lease.tier].pool
            if layer is None:
                src = as_uint8(data, self.layout.page_bytes, self.layout.dtype, "page")
                offset, size = 0, self.layout.page_bytes
            else:
                offset, size = self.layout.layer_offset(layer), self.layout.layer_bytes
                src = as_uint8(data, size, self.layout.dtype, f"layer {layer}")
            sums.pop(index, None)
            view = pool.page_view(slot)
            if layer is None and pool.checksums and isinstance(view, np.ndarray):
                if isinstance(src, np.ndarray):
                    # NOTE: hashed as it is copied (a chunk at a time, from cache): hashed at
                    # commit, after a batch of copies, each page was read back from memory
                    # (store put of 16 pages of 1 MiB: 0.54x memcpy); after its copy, 0.58x.
                    sums[index] = copy_checksum(view, src)
                else:  # a device tensor: copied, then hashed from the host page
                    copy_bytes(view, src)
                    sums[index] = xxhash.xxh3_64_intdigest(view.data)
            elif view is not None:
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
            self._write_leases[lease_id].sums.clear()  # the pages change: hashed at commit
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

    def commit(
        self,
        lease_id: int,
        written_in_place: bool = False,
        checksums: npt.NDArray[np.uint64] | None = None,
        hold_s: float = 0.0,
    ) -> CommitResult:
        """Publish a lease's pages. Keys another writer published first keep the first copy.
        ``written_in_place``: the pages were filled through ``page_view`` (a same-host client's
        shared memory, a stream), not ``write``: count their bytes as written now.
        ``checksums``: the writer's xxh3-64 of each page, one per key of the lease (a key it had
        nothing to write for: ignored), sealed as they are instead of hashing the pages again. A
        wrong count raises ``InvalidArgument`` and leaves the lease as it was. ``hold_s``: pin
        the lease's keys that are stored after the commit (its own and the first writers') for
        that long, in the same locked step (nothing is evicted between): ``CommitResult.hold``,
        a read lease left to lapse."""
        if hold_s:
            self._ttl(hold_s)  # a bad hold refused before anything is published
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
            # pages filled in place may have changed since ``write`` hashed them
            hashed = state.sums if sums is None and not written_in_place else {}
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
                # NOTE: a chained lease's keys are one chain, in order
                parent, prev = (prev if lease.chained else None), key
                if slot < 0:
                    continue
                ts.leased -= 1
                if key in index:
                    ts.free.append(slot)
                    dup += 1
                    continue
                # The page's checksum (checked by copy-outs and moves): the writer's, if it sent it.
                ts.pool.seal(slot, sums[i] if sums is not None else hashed.get(i))
                up = index.get(parent) if tree is not None and parent is not None else -1
                self._publish(ts, key, slot, up)
                new.append(slot)
                stored += 1
            ts.policy.insert_many(new, fresh=True)
            if tree is not None and new and lease.chained:
                self._touch_prefix(lease.keys)
            if written_in_place:
                self._n.bytes_written += (stored + dup) * self.layout.page_bytes
            hold = self.acquire(lease.keys, hold_s, into=None) if hold_s else None
            return CommitResult(stored, dup, hold)

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
