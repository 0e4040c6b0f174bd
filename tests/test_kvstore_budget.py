"""Stores of different layouts sharing one DRAM (and SSD) budget (kvstore/budget.py): a layout
alone fills the whole budget, layouts that contend keep an equal share each, what a store gives
back leaves its shared memory, and together they never hold more than the budget. A stateful
test runs random puts, pinned reads, removals and rebalances over three real stores."""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore import CapacityExhausted, KVLayout, StoreConfig, Tier, TieredStore
from kvstore.budget import SharedBudget

from kvstore_helpers import key, page, page_bytes

SMALL = KVLayout(model="small", num_layers=2, kv_heads=2, head_dim=64, block_tokens=16)  # 16 KiB
BIG = KVLayout(model="big", num_layers=4, kv_heads=2, head_dim=64, block_tokens=16)  # 32 KiB
ODD = KVLayout(model="odd", num_layers=3, kv_heads=1, head_dim=40, block_tokens=16)  # 7.5 KiB


def shared(layout: KVLayout, dram: SharedBudget, ssd: SharedBudget | None = None, tmp=None):
    return TieredStore(
        layout,
        StoreConfig(
            dram_pages=dram.total_bytes // layout.page_bytes,
            ssd_pages=ssd.total_bytes // layout.page_bytes if ssd else 0,
            ssd_dir=str(tmp) if ssd else None,
            dram_budget=dram,
            ssd_budget=ssd,
            reserve_shm=False,
        ),
    )


def fill(store: TieredStore, first: int, count: int) -> list[bytes]:
    keys = [key(first + i) for i in range(count)]
    store.put(keys, [page(first + i, store.layout) for i in range(count)])
    return keys


def resident(store: TieredStore) -> int:
    """Bytes of the store's shared memory backed by memory now."""
    return os.stat(f"/dev/shm/{store.shm_name}").st_blocks * 512


def granted(store: TieredStore, tier: Tier = Tier.DRAM) -> int:
    return store.share_bytes(tier)


def test_a_layout_alone_fills_the_whole_budget_and_others_take_an_equal_share() -> None:
    budget = SharedBudget(Tier.DRAM, 4 << 20)
    with shared(SMALL, budget) as a, shared(BIG, budget) as b:
        assert granted(a) == granted(b) == 0 and resident(a) == 0  # nothing until needed
        fill(a, 0, 256)  # 4 MiB: the whole budget
        assert granted(a) == 4 << 20 and budget.unassigned_bytes == 0
        assert a.stats().tiers[0].evictions == 0
        # b needs room: a gives back its coldest blocks, down to an equal share, at once.
        fill(b, 10_000, 16)
        assert granted(a) + granted(b) == 4 << 20
        assert granted(b) >= 16 * BIG.page_bytes
        assert a.stats().blocks == granted(a) // SMALL.page_bytes
        assert a.contains([key(0)]) == [False] and a.contains([key(255)]) == [True]  # LRU
        assert granted(b) == 16 * BIG.page_bytes  # what the put needed
        # b keeps writing: below an equal share it takes a's pages before evicting its own;
        # at an equal share it evicts its own.
        for n in range(4):
            fill(b, 20_000 + 16 * n, 16)
        assert granted(a) == granted(b) == 2 << 20
        assert b.stats().tiers[0].evictions == 16 and budget.rebalance() == 0
        # What a gave back left its shared memory: together they hold no more than the budget.
        assert resident(a) <= 2 << 20 and resident(a) + resident(b) <= 4 << 20
        for s in (a, b):
            s.check_invariants()
        # The bytes are the bytes written.
        assert a.read([key(255)])[0].tobytes() == page_bytes(255, SMALL)
        assert b.read([key(20_063)])[0].tobytes() == page_bytes(20_063, BIG)
    assert budget.unassigned_bytes == 4 << 20  # closed stores give everything back


def test_pinned_and_leased_pages_are_never_taken_and_a_full_budget_refuses_clearly() -> None:
    budget = SharedBudget(Tier.DRAM, 1 << 20)
    with shared(SMALL, budget) as a, shared(BIG, budget) as b:
        keys = fill(a, 0, 64)  # the whole budget
        lease = a.acquire(keys)  # every page pinned by a reader
        with pytest.raises(CapacityExhausted, match="DRAM tier is full"):
            fill(b, 100, 1)
        assert a.stats().blocks == 64 and granted(b) == 0
        a.release(lease.lease_id)
        w = a.allocate([key(1000 + i) for i in range(16)])  # a writer holds a's fresh pages
        fill(b, 100, 16)  # b takes its equal share from a's other pages
        assert granted(b) == 1 << 19 and len(w.slots) == 16
        a.commit(w.lease_id)  # the writer's pages were never taken
        assert a.contains([key(1000 + i) for i in range(16)]) == [True] * 16
        a.check_invariants()
        b.check_invariants()


def test_odd_page_sizes_and_an_ssd_budget_share_the_same_way(tmp_path: Path) -> None:
    dram, ssd = SharedBudget(Tier.DRAM, 1 << 20), SharedBudget(Tier.SSD, 2 << 20)
    with (
        shared(ODD, dram, ssd, tmp_path / "odd") as a,
        shared(SMALL, dram, ssd, tmp_path / "small") as b,
    ):
        for first in range(0, 300, 50):
            fill(a, first, 50)  # more than DRAM holds: demoted into the SSD's budget
        assert granted(a, Tier.SSD) > 0 and granted(a) <= 1 << 20
        for first in range(10_000, 10_100, 25):
            fill(b, first, 25)  # within an equal share of DRAM a time: a's pages demoted
        dram.rebalance()
        ssd.rebalance()
        for budget in (dram, ssd):
            t = budget.tier
            assert granted(a, t) + granted(b, t) + budget.unassigned_bytes == budget.total_bytes
        assert a.read([key(299)])[0].tobytes() == page_bytes(299, ODD)
        a.check_invariants()
        b.check_invariants()


class BudgetMachine(RuleBasedStateMachine):
    """Three stores of three page sizes on one DRAM budget and one SSD budget."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="kvstore-budget-")
        self.dram = SharedBudget(Tier.DRAM, 512 << 10)
        self.ssd = SharedBudget(Tier.SSD, 256 << 10)
        self.stores = [
            shared(layout, self.dram, self.ssd, Path(self.tmp) / layout.model)
            for layout in (SMALL, BIG, ODD)
        ]
        self.pins: list[tuple[int, int]] = []  # (store, lease id)
        self.next = 0

    def teardown(self) -> None:
        for s in self.stores:
            s.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @rule(which=st.integers(0, 2), count=st.integers(1, 24))
    def put(self, which: int, count: int) -> None:
        store = self.stores[which]
        try:
            fill(store, self.next, count)
        except CapacityExhausted:
            # A put within an equal share of the budget always fits, unless pages are pinned.
            assert self.pins or count * store.layout.page_bytes > self.dram.total_bytes // 3
        self.next += count

    @rule(which=st.integers(0, 2), data=st.data())
    def pin(self, which: int, data: st.DataObject) -> None:
        store = self.stores[which]
        _, stored = store.snapshot()
        if stored and len(self.pins) < 4:
            picked = data.draw(st.sampled_from(sorted(k for k, _ in stored)))
            self.pins.append((which, store.acquire([picked]).lease_id))

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        if self.pins:
            which, lease = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
            self.stores[which].release(lease)

    @rule(which=st.integers(0, 2), data=st.data())
    def remove(self, which: int, data: st.DataObject) -> None:
        _, stored = self.stores[which].snapshot()
        if stored:
            self.stores[which].remove([data.draw(st.sampled_from(sorted(k for k, _ in stored)))])

    @rule()
    def rebalance(self) -> None:
        self.dram.rebalance()
        self.ssd.rebalance()

    @rule(which=st.integers(0, 2), pages=st.integers(1, 40))
    def shrink(self, which: int, pages: int) -> None:
        self.stores[which].shrink(Tier.DRAM, pages)

    @invariant()
    def within_the_budgets(self) -> None:
        for budget in (self.dram, self.ssd):
            held = sum(s.share_bytes(budget.tier) for s in self.stores)
            assert held + budget.unassigned_bytes == budget.total_bytes
            for s in self.stores:
                used = next((t for t in s.stats().tiers if t.tier is budget.tier), None)
                if used is not None:
                    assert (used.used_pages + used.leased_pages) * s.layout.page_bytes <= held
        for s in self.stores:
            # NOTE: only whole system pages go back: a store of pages that are not a multiple
            # of one keeps the system pages its given-back pages share with their neighbours
            # (documented in budget.py); the others hold no more memory than their share.
            if s.layout.page_bytes % mmap.PAGESIZE == 0:
                assert resident(s) <= s.share_bytes(Tier.DRAM)

    @invariant()
    def each_store_is_consistent(self) -> None:
        for s in self.stores:
            s.check_invariants()

    @invariant()
    def pages_read_back_as_written(self) -> None:
        for s in self.stores:
            _, stored = s.snapshot()
            some = sorted(k for k, _ in stored)[:3]
            # NOTE: one read (which pins them all): a read promotes SSD hits, which may evict.
            for k, got in zip(some, s.read(some)):
                i = int.from_bytes(k, "little")
                assert got is not None and got.tobytes() == page_bytes(i, s.layout)


BudgetMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBudgetStateful = BudgetMachine.TestCase
