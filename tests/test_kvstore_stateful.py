"""A stateful property test of TieredStore: hypothesis runs random sequences of every operation
(puts, two-phase writes, aborts, pinned reads, lease expiry on a fake clock, late writes into the
pages of expired write leases (quarantined, so harmless), removals, and the
evictions, demotions and promotions they cause) on a small real store (DRAM in shared memory, SSD
in lmdb, optionally a "GPU" tier on the CPU) and checks after every step:

- ``TieredStore.check_invariants()`` (page ownership, pins, index vs tier maps, eviction policies,
  page/byte accounting);
- a model fed by the store's own events: the replayed events give exactly the snapshot, results
  of each call are what the model predicts (hits, stored/duplicate counts, capacity errors, which
  leases expire), and bytes read back are the bytes written, for as long as the block is stored.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore import (
    CapacityExhausted,
    CommitResult,
    EventKind,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ReadLease,
    Tier,
    TieredStore,
    WriteLease,
)
from kvstore.index import DictIndex
from kvstore.store import InvariantViolation

from kvstore_helpers import LAYOUT, FakeClock, key, make_store, page, page_bytes

N_KEYS = 10  # more keys than pages in all tiers: eviction and demotion happen all the time
PAGE = LAYOUT.page_bytes
LAYER = LAYOUT.layer_bytes
KEY_IDS = st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=3, unique=True)
TTLS = st.sampled_from([1.0, 3.0, 10.0])


@dataclass
class WriteModel:
    lease: WriteLease
    deadline: float
    seeds: dict[int, int]  # key index -> seed of the page written there


@dataclass
class ReadModel:
    lease: ReadLease
    deadline: float
    seeds: dict[int, int | None]  # found key index -> seed of its bytes (None: unknown)


class StoreMachine(RuleBasedStateMachine):
    index_impl = contextlib.nullcontext  # the store's own key index (C where it is built)

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="kvstore-stateful-")
        self.clock = FakeClock()
        self._store: TieredStore | None = None
        self.tiers: dict[bytes, Tier] = {}  # the index, as the events tell it
        self.content: dict[bytes, int | None] = {}  # seed of each key's bytes (None: unknown)
        self.writes: dict[int, WriteModel] = {}
        self.reads: dict[int, ReadModel] = {}
        self.dead: list[int] = []  # ids of leases that ended
        # Expired write leases whose pages the store still holds back, with their release time.
        self.held: list[tuple[float, WriteModel]] = []
        self.quarantine_s = 0.0
        self.seq = 0
        self.seeds = 0
        self.bytes_written = self.bytes_read = self.expired = self.misses = 0

    # ---- helpers --------------------------------------------------------------------------

    @property
    def store(self) -> TieredStore:
        assert self._store is not None
        return self._store

    def seed(self) -> int:
        self.seeds += 1
        return self.seeds

    def sweep(self) -> int:
        """What the store's lazy expiry does at the start of most calls: leases whose deadline
        has come are gone."""
        now = self.clock.now
        gone = 0
        for leases in (self.writes, self.reads):
            for lid in [i for i, m in leases.items() if m.deadline <= now]:
                model = leases.pop(lid)
                if isinstance(model, WriteModel):  # its pages are quarantined, not freed
                    self.held.append((model.deadline + self.quarantine_s, model))
                self.dead.append(lid)
                gone += 1
        self.held = [(t, m) for t, m in self.held if t > now]
        self.expired += gone
        return gone

    def blocked(self, keys: list[bytes]) -> bool:
        """Whether storing ``keys`` could put a second SSD block beside a removed one that a read
        lease still pins there. The two share one record (``test_a_removed_pinned_ssd_copy_...``
        below): fine in use, where equal keys mean equal bytes, but this model writes different
        bytes per put, so it stays out of that case."""
        now = self.clock.now
        doomed_on_ssd = {
            r.lease.keys[i]
            for r in self.reads.values()
            if r.deadline > now
            for i in r.seeds
            if r.lease.tiers[i] is Tier.SSD
        }
        return any(k in doomed_on_ssd and k not in self.tiers for k in keys)

    def expiry_pending(self) -> bool:
        now = self.clock.now
        return any(m.deadline <= now for m in [*self.writes.values(), *self.reads.values()]) or any(
            t <= now for t, _ in self.held
        )

    def sync(self) -> None:
        """Apply the store's new events to the model."""
        for e in self.store.take_events():
            self.seq += 1
            assert e.seq == self.seq, f"event seq {e.seq}, expected {self.seq}"
            if e.kind is EventKind.STORED:
                self.tiers[e.key] = e.tier
            else:
                assert self.tiers.pop(e.key, None) == e.tier, f"EVICTED {e} of a key not there"
                self.content.pop(e.key, None)

    def fits(self, tier: Tier, keys: list[bytes]) -> bool | None:
        """Whether allocating ``keys`` in ``tier`` must succeed (True) or raise
        CapacityExhausted (False); None when a pending expiry makes it depend on the sweep.
        The request's own stored blocks are never evicted to make room for its new ones."""
        if self.expiry_pending():
            return None
        missing = sum(k not in self.tiers for k in keys)
        own = [self.store._index.get(k) for k in keys if self.tiers.get(k) is tier]
        ts = next(t for t in self.store.stats().tiers if t.tier is tier)
        pins = self.store._tiers[tier].pins
        evictable = ts.used_pages - ts.pinned_blocks - sum(pins[h >> 2] == 0 for h in own)
        return missing - ts.free_pages <= evictable

    def check_bytes(self, out: object, seed: int | None, what: str) -> None:
        assert out is not None, f"{what}: no bytes"
        if seed is not None:
            got = np.asarray(out).view(np.uint8).tobytes()
            assert got == page_bytes(seed), f"{what}: bytes differ from what was written"

    # ---- setup ----------------------------------------------------------------------------

    @initialize(
        gpu=st.booleans(),
        dram=st.integers(2, 4),
        ssd=st.sampled_from([0, 2, 3]),
        policy=st.sampled_from(["lru", "lfu", "prefix"]),
        promote=st.booleans(),
        prefill=st.integers(0, N_KEYS),
        quarantine=st.sampled_from([0.0, 2.0, None]),
    )
    def open_store(
        self,
        gpu: bool,
        dram: int,
        ssd: int,
        policy: str,
        promote: bool,
        prefill: int,
        quarantine: float | None,
    ) -> None:
        cfg: dict[str, object] = dict(
            dram_pages=dram,
            ssd_pages=ssd,
            dram_policy=policy,
            ssd_policy=policy,
            gpu_policy=policy,
            promote_on_hit=promote,
            clock=self.clock,
            lease_ttl_s=5.0,
            quarantine_s=quarantine,
        )
        self.quarantine_s = 15.0 if quarantine is None else quarantine  # default: 3 lease TTLs
        if gpu:
            cfg.update(gpu_pages=2, gpu_device="cpu", write_tier=Tier.GPU)
        with self.index_impl():
            self._store = make_store(Path(self.tmp), **cfg)
        self.write_tier = Tier.GPU if gpu else Tier.DRAM
        # NOTE: hypothesis enables a random subset of rules per example (swarm testing); a
        # prefilled store keeps reads, promotions and removals meaningful when puts are off.
        for i in range(prefill):
            self._put([key(i)])
        self.sync()

    def teardown(self) -> None:
        try:
            if self._store is not None:
                shm = self._store.shm_name
                self._store.close()  # unlinks the shared memory, syncs and closes lmdb
                assert shm is None or not os.path.exists(f"/dev/shm/{shm}"), "shm left behind"
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- writes -----------------------------------------------------------------------------

    @rule(ids=KEY_IDS)
    def put(self, ids: list[int]) -> None:
        self._put([key(i) for i in ids])

    @rule(ids=st.lists(st.integers(0, N_KEYS - 1), min_size=2, max_size=6, unique=True))
    def fill(self, ids: list[int]) -> None:
        """One put per key: fills the write tier, so eviction demotes (or drops) blocks."""
        for i in ids:
            self._put([key(i)])

    def _put(self, keys: list[bytes]) -> None:
        if self.blocked(keys):
            return
        missing = [k for k in keys if k not in self.tiers]
        expect = self.fits(self.write_tier, keys)
        seeds = {k: self.seed() for k in keys}
        self.sweep()
        try:
            result = self.store.put(keys, [page(seeds[k]) for k in keys])
        except CapacityExhausted:
            assert expect is not True, "CapacityExhausted though pages could be freed"
            assert self.store.take_events() == [], "a failed allocation changed the index"
            return
        assert expect is not False, "allocation succeeded past the capacity"
        assert result == CommitResult(len(missing), 0)
        self.bytes_written += len(missing) * PAGE
        self.sync()
        assert all(k in self.tiers for k in keys), "the put evicted its own blocks: a hole"
        for k in missing:
            assert self.tiers[k] is self.write_tier
            self.content[k] = seeds[k]

    @rule(ids=KEY_IDS, ttl=TTLS, chained=st.booleans())
    def allocate(self, ids: list[int], ttl: float, chained: bool) -> None:
        keys = [key(i) for i in ids]
        if self.blocked(keys):
            return
        missing = [k for k in keys if k not in self.tiers]
        expect = self.fits(self.write_tier, keys)
        self.sweep()
        try:
            lease = self.store.allocate(keys, ttl_s=ttl, chained=chained)
        except CapacityExhausted:
            assert expect is not True, "CapacityExhausted though pages could be freed"
            return
        assert expect is not False, "allocation succeeded past the capacity"
        self.sync()
        assert all(k in self.tiers for k in keys if k not in missing), "evicted its own prefix"
        assert lease.tier is self.write_tier and lease.expires_at == self.clock.now + ttl
        assert [s >= 0 for s in lease.slots] == [k in missing for k in keys]
        self.writes[lease.lease_id] = WriteModel(lease, lease.expires_at, {})

    @precondition(lambda self: self.writes)
    @rule(data=st.data(), how=st.sampled_from(["pages", "layers", "view"]))
    def write(self, data: st.DataObject, how: str) -> None:
        lid = data.draw(st.sampled_from(sorted(self.writes)), label="write lease")
        w = self.writes[lid]
        seeds = {i: self.seed() for i in w.lease.to_write}
        if how == "view":
            # Zero-copy: fill the leased pages in place. page_view neither sweeps nor checks the
            # lease, so only a live lease's pages are touched.
            if w.deadline > self.clock.now:
                for i, s in seeds.items():
                    view = self.store.page_view(w.lease, i)
                    if hasattr(view, "numpy"):  # the GPU tier (torch, on the CPU here)
                        view = view.numpy()
                    view[:] = page(s).view(np.uint8)
                w.seeds.update(seeds)
            return
        self.sweep()
        if lid not in self.writes:
            with pytest.raises(FailedPrecondition, match="does not exist"):
                self.store.write_pages(lid, [page(0)] * len(w.lease.keys))
            return
        if how == "pages" or not seeds:  # (write_pages of nothing still sweeps, as modelled)
            self.store.write_pages(lid, [page(seeds.get(i, 0)) for i in range(len(w.lease.keys))])
        else:
            for i, s in seeds.items():
                raw = page(s).view(np.uint8)
                for layer in range(LAYOUT.num_layers):
                    self.store.write(lid, i, raw[layer * LAYER : (layer + 1) * LAYER], layer=layer)
        self.bytes_written += len(seeds) * PAGE
        w.seeds.update(seeds)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def late_write(self, data: st.DataObject) -> None:
        """A same-host writer that stalled past its lease writes into its pages after all. They
        are quarantined: the write reaches no one's block (every later read checks the bytes)."""
        _, w = data.draw(st.sampled_from(self.held), label="expired write lease")
        for i in w.lease.to_write:
            view = self.store.page_view(w.lease, i)  # not reused yet: no stale-lease error
            if hasattr(view, "numpy"):
                view = view.numpy()
            view[:] = page(self.seed()).view(np.uint8)

    def written_sums(self, lease: WriteLease) -> np.ndarray:
        """The xxh3-64 of each leased page as it is now (0 for keys with no page): what a
        writer that verified its pages sends with its commit."""
        sums = np.zeros(len(lease.keys), dtype=np.uint64)
        for i in lease.to_write:
            view = self.store.page_view(lease, i)
            if hasattr(view, "numpy"):  # the GPU tier (torch, on the CPU here)
                view = view.numpy()
            sums[i] = xxhash.xxh3_64_intdigest(np.ascontiguousarray(view))
        return sums

    @precondition(lambda self: self.writes)
    @rule(data=st.data(), sums=st.sampled_from(["none", "writer's", "too few"]))
    def commit(self, data: st.DataObject, sums: str) -> None:
        lid = data.draw(st.sampled_from(sorted(self.writes)), label="write lease")
        w = self.writes[lid]
        leased = [(i, k) for i, (k, s) in enumerate(zip(w.lease.keys, w.lease.slots)) if s >= 0]
        new = [(i, k) for i, k in leased if k not in self.tiers]
        if self.blocked([k for _, k in new]):
            return
        self.sweep()
        if lid not in self.writes:
            with pytest.raises(FailedPrecondition, match="no such lease"):
                self.store.commit(lid)
            return
        checksums = None
        if sums != "none":  # the writer's own checksums, adopted instead of hashing the pages
            checksums = self.written_sums(w.lease)
        if sums == "too few":  # refused, and the lease stays as it was
            with pytest.raises(InvalidArgument, match="checksums for its"):
                self.store.commit(lid, checksums=checksums[1:])
            return
        got = self.store.commit(lid, checksums=checksums)
        assert got == CommitResult(len(new), len(leased) - len(new))
        del self.writes[lid]
        self.dead.append(lid)
        self.sync()
        for i, k in new:
            assert self.tiers[k] is w.lease.tier
            self.content[k] = w.seeds.get(i)  # never written: whatever the page held

    @precondition(lambda self: self.writes)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        # NOTE: abort does not sweep: a lease past its deadline that nothing swept yet aborts.
        lid = data.draw(st.sampled_from(sorted(self.writes)), label="write lease")
        self.store.abort(lid)
        del self.writes[lid]
        self.dead.append(lid)

    # ---- reads -------------------------------------------------------------------------------

    @rule(
        ids=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=4),
        ttl=TTLS,
        into=st.sampled_from(["default", None, Tier.GPU, Tier.DRAM, Tier.SSD]),
    )
    def acquire(self, ids: list[int], ttl: float, into: Tier | str | None) -> None:
        keys = [key(i) for i in ids]
        before = dict(self.content)
        found = [k in self.tiers for k in keys]
        self.sweep()
        if isinstance(into, Tier) and into not in self.store.tiers:
            with pytest.raises(InvalidArgument, match="has no"):
                self.store.acquire(keys, ttl_s=ttl, into=into)
            return
        lease = self.store.acquire(keys, ttl_s=ttl, into=into)
        self.sync()
        assert [s >= 0 for s in lease.slots] == found
        for i, k in enumerate(keys):
            assert lease.tiers[i] == (self.tiers[k] if found[i] else None)
        seeds = {i: before[k] for i, k in enumerate(keys) if found[i]}
        self.reads[lease.lease_id] = ReadModel(lease, lease.expires_at, seeds)

    @precondition(lambda self: any(r.seeds for r in self.reads.values()))
    @rule(data=st.data(), zero_copy=st.booleans())
    def copy_out(self, data: st.DataObject, zero_copy: bool) -> None:
        lid = data.draw(
            st.sampled_from(sorted(i for i, r in self.reads.items() if r.seeds)), label="read lease"
        )
        r = self.reads[lid]
        i = data.draw(st.sampled_from(sorted(r.seeds)), label="key index")
        if zero_copy and r.deadline > self.clock.now:
            # page_view neither sweeps nor checks the lease: only look while it is alive.
            view = self.store.page_view(r.lease, i)
            if view is not None:  # DRAM or GPU: the pinned page itself (SSD: None)
                self.check_bytes(np.asarray(view), r.seeds[i], f"page_view of lease {lid} #{i}")
                return
        self.sweep()
        out = np.zeros(PAGE, dtype=np.uint8)
        if lid not in self.reads:
            with pytest.raises(FailedPrecondition, match="expired or was released"):
                self.store.copy_out(r.lease, i, out)
            return
        assert self.store.copy_out(r.lease, i, out), "a pinned page failed its checksum"
        self.bytes_read += PAGE
        self.check_bytes(out, r.seeds[i], f"copy_out of lease {lid} #{i}")

    @precondition(lambda self: self.reads)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lid = data.draw(st.sampled_from(sorted(self.reads)), label="read lease")
        self.sweep()
        if lid not in self.reads:
            with pytest.raises(NotFound, match="no such lease"):
                self.store.release(lid)
            return
        self.store.release(lid)
        del self.reads[lid]
        self.dead.append(lid)

    @rule(ids=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=4))
    def read(self, ids: list[int]) -> None:
        """Copies of the pages; SSD hits are promoted when promote_on_hit."""
        keys = [key(i) for i in ids]
        before = dict(self.content)
        self.sweep()
        pages = self.store.read(keys)
        self.sync()
        for k, p in zip(keys, pages):
            if k in before:
                self.check_bytes(p, before[k], f"read of {k.hex()}")
                self.bytes_read += PAGE
            else:
                assert p is None

    @rule(ids=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=4))
    def lookup(self, ids: list[int]) -> None:
        keys = [key(i) for i in ids]
        assert self.store.contains(keys) == [k in self.tiers for k in keys]
        hits = 0
        while hits < len(keys) and keys[hits] in self.tiers:
            hits += 1
        result = self.store.lookup(keys)
        assert result.hits == hits
        assert result.tiers == [self.tiers[k] for k in keys[:hits]]
        self.misses += len(keys) - hits

    # ---- removal, time ------------------------------------------------------------------

    @rule(ids=KEY_IDS)
    def remove(self, ids: list[int]) -> None:
        keys = [key(i) for i in ids]
        assert self.store.remove(keys) == sum(k in self.tiers for k in keys)
        self.sync()
        assert not any(k in self.tiers for k in keys)

    @rule(dt=st.sampled_from([0.5, 1.0, 2.0, 5.0]), sweep=st.booleans())
    def advance_clock(self, dt: float, sweep: bool) -> None:
        self.clock.advance(dt)
        if sweep:
            assert self.store.expire_leases() == self.sweep()

    @precondition(lambda self: self.reads or self.writes)
    @rule(data=st.data(), ttl=TTLS)
    def extend(self, data: st.DataObject, ttl: float) -> None:
        lid = data.draw(st.sampled_from(sorted([*self.reads, *self.writes])), label="lease")
        self.sweep()
        model = self.reads.get(lid) or self.writes.get(lid)
        if model is None:
            with pytest.raises(NotFound, match="does not exist"):
                self.store.extend(lid, ttl)
            return
        assert self.store.extend(lid, ttl) == self.clock.now + ttl
        model.deadline = self.clock.now + ttl

    @precondition(lambda self: self.dead)
    @rule(data=st.data(), op=st.sampled_from(["commit", "abort", "write", "release", "extend"]))
    def use_ended_lease(self, data: st.DataObject, op: str) -> None:
        lid = data.draw(st.sampled_from(self.dead[-5:]), label="ended lease")
        if op != "abort":  # abort alone does not sweep
            self.sweep()
        error = NotFound if op in ("release", "extend") else FailedPrecondition
        with pytest.raises(error):
            if op == "commit":
                self.store.commit(lid)
            elif op == "abort":
                self.store.abort(lid)
            elif op == "write":
                self.store.write_pages(lid, [])
            elif op == "release":
                self.store.release(lid)
            else:
                self.store.extend(lid)

    # ---- after every step ---------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if self._store is None:
            return
        self.store.check_invariants()
        self.sync()
        seq, entries = self.store.snapshot()
        assert seq == self.seq and dict(entries) == self.tiers, "events and snapshot disagree"
        stats = self.store.stats()
        assert stats.blocks == len(self.tiers)
        assert (stats.write_leases, stats.read_leases) == (len(self.writes), len(self.reads))
        assert stats.expired_leases == self.expired
        assert (stats.bytes_written, stats.bytes_read) == (self.bytes_written, self.bytes_read)
        assert stats.misses == self.misses
        assert stats.corrupt_pages == 0
        held = sum(len(m.lease.to_write) for _, m in self.held)
        assert sum(t.quarantined_pages for t in stats.tiers) == held, "quarantine differs"


StoreMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestTieredStoreStateful = pytest.mark.slow(StoreMachine.TestCase)


class PythonIndexMachine(StoreMachine):
    """The same machine over the key index's Python twin (what runs where the C module is not
    built)."""

    @staticmethod
    def index_impl() -> contextlib.AbstractContextManager[object]:
        return mock.patch("kvstore.blocks.make_index", DictIndex)


PythonIndexMachine.TestCase.settings = settings(StoreMachine.TestCase.settings, max_examples=30)
TestTieredStoreStatefulPythonIndex = pytest.mark.slow(PythonIndexMachine.TestCase)


# ---- the bugs the machine found, and the checker itself -------------------------------------


def test_acquire_into_an_absent_tier_leaves_no_pins(tmp_path: Path) -> None:
    with make_store(tmp_path, dram_pages=2) as store:
        store.put([key(1)], [page(1)])
        with pytest.raises(InvalidArgument, match="no SSD tier"):
            store.acquire([key(1)], into=Tier.SSD)
        assert store.stats().tiers[0].pinned_blocks == 0  # was 1, forever: no lease to release
        store.check_invariants()


@pytest.mark.parametrize("gpu", [False, True])
def test_acquire_into_ssd_moves_the_page_there(tmp_path: Path, gpu: bool) -> None:
    cfg: dict[str, object] = dict(gpu_pages=2, gpu_device="cpu", write_tier=Tier.GPU) if gpu else {}
    with make_store(tmp_path, dram_pages=2, ssd_pages=2, **cfg) as store:
        store.put([key(1)], [page(1)])
        lease = store.acquire([key(1)], into=Tier.SSD)  # was a TypeError (no SSD page view)
        assert lease.tiers == [Tier.SSD]
        out = np.empty(PAGE, np.uint8)
        assert store.copy_out(lease, 0, out) and out.tobytes() == page_bytes(1)
        store.release(lease.lease_id)
        store.check_invariants()
        assert store.read([key(1)])[0].tobytes() == page_bytes(1)


def test_a_corrupt_read_of_a_removed_copy_keeps_the_indexed_one(tmp_path: Path) -> None:
    with make_store(tmp_path, dram_pages=2, ssd_pages=2, promote_on_hit=False) as store:
        for i in range(4):
            store.put([key(i)], [page(i)])  # keys 0 and 1 are demoted to SSD
        lease = store.acquire([key(0)])  # pinned on the SSD
        store.remove([key(0)])  # out of the index, still readable
        store.put([key(0)], [page(0)])  # a new copy in DRAM
        pool = store.pool(Tier.SSD)
        with pool.env.begin(write=True) as txn:  # the removed copy's page goes bad
            txn.put(key(0), b"\0" * PAGE, db=pool._pages)
        assert not store.copy_out(lease, 0, np.empty(PAGE, np.uint8))
        assert store.contains([key(0)]) == [True]  # was dropped with the bad copy
        store.release(lease.lease_id)
        store.check_invariants()


def test_a_removed_pinned_ssd_copy_does_not_take_a_restored_copys_page(tmp_path: Path) -> None:
    with make_store(tmp_path, dram_pages=2, ssd_pages=2, promote_on_hit=False) as store:
        for i in range(4):
            store.put([key(i)], [page(i)])  # keys 0 and 1 are demoted to SSD
        lease = store.acquire([key(0)])  # pinned on the SSD
        store.remove([key(0)])  # doomed: freed on release
        for i in (0, 1, 2):
            store.put([key(i)], [page(i)])  # key 0 again, demoted to SSD
        store.check_invariants()  # two SSD slots share one record
        store.release(lease.lease_id)  # must keep key 0's record
        store.check_invariants()
        got = store.read([key(0)])[0]
        assert got is not None and got.tobytes() == page_bytes(0), "the live copy lost its page"


def _break_pinned(store: TieredStore) -> None:
    store._tiers[Tier.DRAM].pinned += 1


def _break_free_list(store: TieredStore) -> None:
    store._tiers[Tier.DRAM].free.append(store._index.get(key(1)) >> 2)


def _break_policy(store: TieredStore) -> None:
    store._tiers[Tier.DRAM].policy.remove(store._index.get(key(1)) >> 2)


def _break_index(store: TieredStore) -> None:
    store._index.pop(key(1))


def _break_ssd(store: TieredStore) -> None:
    store.pool(Tier.SSD).drop_pages([0], [key(0)])


@pytest.mark.parametrize(
    "corrupt,match",
    [
        (_break_pinned, "DRAM counts 3 pinned blocks; 2 blocks are pinned"),
        (_break_free_list, "is owned by \\['free', 'committed'\\]"),
        (_break_policy, "lru policy holds 1 slots, expected the 2 evictable ones"),
        (_break_index, "hold keys no live block owns"),
        (_break_ssd, "lmdb does not hold one page per key of its committed SSD blocks"),
    ],
)
def test_check_invariants_reports_broken_state(tmp_path: Path, corrupt: object, match: str) -> None:
    with make_store(tmp_path, dram_pages=4, ssd_pages=2) as store:
        for i in range(5):
            store.put([key(i)], [page(i)])  # key 0 on SSD, 1-4 in DRAM
        lease = store.acquire([key(2), key(3)], into=None)  # pinned: 2 evictable left (1, 4)
        store.check_invariants()
        assert callable(corrupt)
        corrupt(store)
        with pytest.raises(InvariantViolation, match=match):
            store.check_invariants()
        store.release(lease.lease_id)


# ---- prefix-policy cases the machine found -------------------------------------------------


def test_prefix_demotion_relinks_its_parent_by_key_not_by_a_stale_page(tmp_path: Path) -> None:
    """GPU victims demoted into a DRAM tier that had to drop their parent to make room: their
    parent's page was reused for one of them (the stale handle made a block its own parent)."""
    cfg = dict(gpu_pages=2, gpu_device="cpu", write_tier=Tier.GPU, dram_pages=2)
    cfg.update(gpu_policy="prefix", dram_policy="prefix", quarantine_s=0.0)
    with make_store(tmp_path, **cfg) as store:
        for i in range(6):
            store.put([key(i)], [page(i)])
        for ids in ([0], [1], [4, 3], [2], [0]):
            store.put([key(i) for i in ids], [page(i) for i in ids])
            store.check_invariants()


def test_prefix_remove_counts_descendants_it_took_along(tmp_path: Path) -> None:
    with make_store(tmp_path, dram_pages=4, dram_policy="prefix") as store:
        store.put([key(7), key(5), key(9)], [page(i) for i in (7, 5, 9)])  # chain 7 -> 5 -> 9
        assert store.remove([key(7), key(9), key(3)]) == 2  # 9 went with 7: still removed
        assert store.contains([key(5)]) == [False]  # the orphan in between went too
        store.check_invariants()
