"""Eviction order, exactly: LRU and LFU at the policy level and through a TieredStore."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from kvstore import (
    CapacityExhausted,
    EventKind,
    InvalidArgument,
    LFUPolicy,
    LRUPolicy,
    Tier,
    make_policy,
)
from kvstore.policy import PrefixPolicy

from kvstore_helpers import key, keys, make_store, page, tiers_of


def drain(policy) -> list[int]:
    out = []
    while (slot := policy.pop_victim()) is not None:
        out.append(slot)
    return out


# ---- policy level ----------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_first():
    p = LRUPolicy(8)
    for s in (3, 1, 4, 0, 5):
        p.insert(s)
    p.touch(1)
    p.touch(3)
    assert p.order() == [4, 0, 5, 1, 3]
    assert len(p) == 5
    assert drain(p) == [4, 0, 5, 1, 3]
    assert p.pop_victim() is None and len(p) == 0


def test_lru_touch_at_either_end_and_of_a_lone_slot():
    p = LRUPolicy(4)
    p.insert(2)
    p.touch(2)  # alone: stays
    assert p.order() == [2] and len(p) == 1
    p.insert(0)
    p.insert(3)
    p.touch(3)  # already the most recent
    assert p.order() == [2, 0, 3]
    p.touch(2)  # the head goes to the tail
    assert p.order() == [0, 3, 2]
    assert drain(p) == [0, 3, 2]


def test_lru_pinned_slot_is_never_a_victim_and_returns_as_just_used():
    p = LRUPolicy(4)
    for s in range(4):
        p.insert(s)
    p.remove(0)  # pinned
    p.touch(0)  # an access while pinned changes nothing
    assert 0 not in p and p.order() == [1, 2, 3]
    assert p.pop_victim() == 1
    p.insert(0, fresh=False)  # unpinned: most recent
    assert drain(p) == [2, 3, 0]


def test_lru_remove_is_idempotent_and_touch_of_absent_slot_is_harmless():
    p = LRUPolicy(3)
    p.insert(2)
    p.remove(1)
    p.touch(1)
    p.remove(2)
    p.remove(2)
    assert len(p) == 0 and drain(p) == []


def test_lfu_evicts_least_frequently_used_first():
    p = LFUPolicy(8)
    for s in (0, 1, 2, 3):
        p.insert(s)
    for s, n in ((0, 3), (1, 1), (3, 2)):
        for _ in range(n):
            p.touch(s)
    assert [p.count(s) for s in range(4)] == [4, 2, 1, 3]
    assert drain(p) == [2, 1, 3, 0]


def test_lfu_ties_are_broken_by_recency():
    p = LFUPolicy(8)
    for s in (5, 6, 7):
        p.insert(s)
    assert p.order() == [5, 6, 7]  # all count 1: oldest first
    p.touch(6)
    p.touch(5)  # 5 and 6 now at 2; 6 was touched before 5
    assert drain(p) == [7, 6, 5]


def test_lfu_pin_keeps_history_and_fresh_insert_resets_it():
    p = LFUPolicy(4)
    for s in range(3):
        p.insert(s)
    for _ in range(3):
        p.touch(0)
    p.remove(0)  # pinned: out of the buckets, count kept
    p.touch(0)  # read while pinned still counts
    assert p.pop_victim() == 1
    p.insert(0, fresh=False)
    assert p.count(0) == 5
    assert p.order() == [2, 0]
    p.remove(0)
    p.insert(0, fresh=True)  # a new block in slot 0
    assert p.count(0) == 1 and p.order() == [2, 0]


def test_lfu_forget_clears_a_previous_occupants_count():
    p = LFUPolicy(2)
    p.insert(0)
    for _ in range(10):
        p.touch(0)
    p.remove(0)
    p.forget(0)  # a different (pinned) block now sits in slot 0
    p.insert(0, fresh=False)
    assert p.count(0) == 1


def test_lfu_counts_saturate():
    p = LFUPolicy(2, max_count=3)
    p.insert(0)
    p.insert(1)
    for _ in range(10):
        p.touch(0)
    assert p.count(0) == 3
    p.touch(1)
    p.touch(1)
    assert p.count(1) == 3
    assert drain(p) == [0, 1]  # equal (saturated) counts: the earlier-touched goes first


@pytest.mark.parametrize("cls", [LRUPolicy, LFUPolicy, PrefixPolicy])
def test_a_large_policy_stays_consistent_under_mixed_operations(cls):
    n = 100_000
    p = cls(n)
    for s in range(n):
        p.insert(s)
    for s in range(0, n, 3):
        p.remove(s)  # pin a third
    for s in range(1, n, 3):
        p.touch(s)
    victims = drain(p)
    assert len(victims) == len(set(victims)) == n - len(range(0, n, 3))
    assert not any(v % 3 == 0 for v in victims)
    # untouched slots (2 mod 3) go before touched ones (1 mod 3) under both policies
    assert all(v % 3 == 2 for v in victims[: len(range(2, n, 3))])


def test_lru_touch_many_is_touch_in_order_in_c_and_python(monkeypatch):
    import kvstore.policy as policy_mod

    def run() -> list[int]:
        p = LRUPolicy(16)
        for s in range(12):
            p.insert(s)
        p.remove(5)  # pinned: touching it changes nothing
        p.touch_many([3, 5, 11, 0, 3])
        p.touch_many(np.array([7, 2], dtype=np.int32))
        return p.order()

    want = [1, 4, 6, 8, 9, 10, 11, 0, 3, 7, 2]
    assert run() == want  # C where it is built
    monkeypatch.setattr(policy_mod, "_lru_touch", None)
    assert run() == want


def test_prefix_policy_evicts_leaves_deepest_first_and_skips_parents():
    p = PrefixPolicy(8)
    tkids = array("i", [0]) * 8
    p.attach_tree(tkids)
    p.insert_many([0, 1, 2])  # a chain 0 -> 1 -> 2, stored root first
    tkids[0] = tkids[1] = 1
    assert p.order() == [2, 1, 0]  # the tail is the least recent
    p.insert(5)  # a lone block, newer
    p.touch_many([0, 1, 2])  # a hit on the chain: deepest first, the root most recent
    assert p.order() == [5, 2, 1, 0]
    tkids[1] = 0  # 2 was pinned elsewhere... then 1 is a leaf; 0 still has a child
    p.remove(2)
    assert p.pop_victim() == 5
    assert p.pop_victim() == 1  # a leaf
    tkids[0] = 0
    assert p.pop_victim() == 0 and p.pop_victim() is None


def test_prefix_policy_passes_over_blocks_with_children_and_gives_up_after_max_skip():
    p = PrefixPolicy(200)
    tkids = array("i", [1]) * 200  # everything has a child here
    p.attach_tree(tkids)
    p.insert_many(list(range(100)))  # inserted deepest first: order 99 .. 0
    tkids[42] = 0
    assert p.pop_victim() == 42  # within max_skip of the head
    tkids[5] = 0  # 94 blocks from the head: beyond max_skip, the least recent goes
    assert p.pop_victim() == 99
    for s in range(100):
        tkids[s] = 1
    p2 = PrefixPolicy(3)
    p2.attach_tree(array("i", [1, 1, 1]))
    p2.insert_many([0, 1])
    assert p2.pop_victim() == 1  # every evictable block has children: the least recent


def test_make_policy_by_name():
    assert isinstance(make_policy("LRU", 4), LRUPolicy)
    assert isinstance(make_policy("lfu", 4), LFUPolicy)
    assert isinstance(make_policy("prefix", 4), PrefixPolicy)
    with pytest.raises(InvalidArgument, match="lru"):
        make_policy("fifo", 4)


# ---- through the store -------------------------------------------------------------------------


def evicted(store) -> list[int]:
    return [
        int.from_bytes(e.key, "little") for e in store.take_events() if e.kind is EventKind.EVICTED
    ]


def test_store_lru_eviction_order():
    with make_store(dram_pages=3, dram_policy="lru") as store:
        for i in (1, 2, 3):
            store.put([key(i)], [page(i)])
        assert store.lookup([key(1)]).hits == 1  # 1 is now the most recent
        store.take_events()
        store.put([key(4)], [page(4)])
        assert evicted(store) == [2]
        store.put(keys(5, 6), [page(5), page(6)])
        assert evicted(store) == [3, 1]
        assert store.contains(keys(1, 2, 3, 4, 5, 6)) == [False] * 3 + [True] * 3
        assert store.stats().tiers[0].evictions == 3


def test_store_lfu_eviction_order_with_recency_ties():
    with make_store(dram_pages=3, dram_policy="lfu") as store:
        for i in (1, 2, 3):
            store.put([key(i)], [page(i)])
        for i, n in ((1, 2), (2, 1), (3, 1)):
            for _ in range(n):
                store.lookup([key(i)])
        # counts: 1 -> 3, 2 -> 2, 3 -> 2 (3 touched after 2)
        store.take_events()
        store.put([key(4)], [page(4)])
        assert evicted(store) == [2]
        store.put([key(5)], [page(5)])  # 4 is new (count 1): least frequent
        assert evicted(store) == [4]
        store.lookup([key(5)])
        store.lookup([key(5)])  # 5 -> 3, ties with 1; 3 stays the least used
        # two pages at once: 3 (count 2), then 1 (count 3, touched before 5)
        store.put(keys(6, 7), [page(6), page(7)])
        assert evicted(store) == [3, 1]


def test_store_lookup_stops_at_the_first_miss_and_touches_only_hits():
    with make_store(dram_pages=3, dram_policy="lru") as store:
        store.put(keys(1, 2, 3), [page(i) for i in (1, 2, 3)])
        res = store.lookup(keys(1, 9, 3))
        assert res.hits == 1 and res.tiers == [Tier.DRAM]
        assert store.stats().misses == 2
        store.take_events()
        store.put([key(4)], [page(4)])
        assert evicted(store) == [2]  # 3 was not touched by the lookup past the miss


def test_store_never_evicts_pinned_blocks():
    with make_store(dram_pages=3, dram_policy="lru") as store:
        store.put(keys(1, 2, 3), [page(i) for i in (1, 2, 3)])
        lease = store.acquire(keys(1, 2))  # 1 and 2 pinned: only 3 can go
        store.take_events()
        store.put([key(4)], [page(4)])
        assert evicted(store) == [3]
        with pytest.raises(CapacityExhausted, match="pinned"):
            store.put(keys(5, 6), [page(5), page(6)])  # need 2; only 4 is evictable
        assert store.contains(keys(1, 2, 4)) == [True] * 3 and evicted(store) == []
        store.release(lease.lease_id)
        store.put(keys(5, 6), [page(5), page(6)])
        assert evicted(store) == [4, 1]  # unpinned blocks rejoin as just used


# ---- prefix-aware eviction through the store -------------------------------------------------


def test_store_prefix_policy_evicts_a_cold_tail_before_its_hot_head():
    for policy, want in (("lru", [1]), ("prefix", [3])):
        with make_store(dram_pages=4, dram_policy=policy) as store:
            store.put(keys(1, 2, 3), [page(i) for i in (1, 2, 3)])  # one chain 1 -> 2 -> 3
            store.put([key(9)], [page(9)])
            store.lookup(keys(1, 2, 3))  # the chain is hit: 9 is now the least recent
            store.lookup([key(9)])
            store.take_events()
            store.put([key(10)], [page(10)])
            # LRU drops the head of the chain (2 and 3 can never be hit again); prefix its tail
            assert evicted(store) == want, policy
            store.check_invariants()


def test_store_prefix_policy_drops_the_orphans_of_a_removed_block_but_not_pinned_ones():
    with make_store(dram_pages=8, dram_policy="prefix") as store:
        store.put(keys(1, 2, 3, 4), [page(i) for i in (1, 2, 3, 4)])
        store.put(keys(1, 2, 5), [page(i) for i in (1, 2, 5)])  # a branch: 2 -> 5
        lease = store.acquire([key(4)])  # 4 is pinned
        store.take_events()
        assert store.remove([key(2)]) == 1
        # 3 and 5 are orphans; 4 is read by someone: it stays (a root of its own now)
        assert sorted(evicted(store)) == [2, 3, 5]
        assert store.contains(keys(1, 2, 3, 4, 5)) == [True, False, False, True, False]
        store.check_invariants()
        store.release(lease.lease_id)
        store.check_invariants()


def test_an_unchained_lease_links_no_block_to_another_it_was_never_the_child_of():
    """A transfer's lease holds blocks from anywhere (keys of several prompts, with gaps where
    some were already there or joined another fetch). Before, every lease was taken as one
    chain: removing a block dropped the next key of the lease as its "orphan", a live block of
    another prompt. Unchained, each is a root; a chained lease links as before."""
    for chained, dropped in ((True, [2, 9]), (False, [2])):
        with make_store(dram_pages=8, dram_policy="prefix") as store:
            store.put(keys(1, 2), [page(1), page(2)])  # prompt A: 1 -> 2
            lease = store.allocate(keys(2, 9), chained=chained)  # 2 (stored), 9 of prompt B
            store.write_pages(lease.lease_id, [page(2), page(9)])
            store.commit(lease.lease_id)
            store.take_events()
            assert store.remove([key(2)]) == 1
            assert sorted(evicted(store)) == dropped, chained
            assert store.contains([key(9)]) == [not chained]
            store.check_invariants()


def test_store_prefix_tree_follows_demotion_and_guards_the_last_tier(tmp_path):
    with make_store(
        tmp_path, dram_pages=2, ssd_pages=2, dram_policy="prefix", ssd_policy="prefix"
    ) as store:
        store.put(keys(1, 2), [page(1), page(2)])  # chain 1 -> 2 in DRAM
        store.put(keys(7, 8), [page(7), page(8)])  # DRAM full: 2 then 1 go down to the SSD
        assert tiers_of(store) == {key(1): "SSD", key(2): "SSD", key(7): "DRAM", key(8): "DRAM"}
        store.check_invariants()
        store.lookup(keys(7, 8))
        store.take_events()
        store.put(keys(1, 2, 3), [page(1), page(2), page(3)])  # 3 goes under 2 (in the SSD)
        # DRAM evicts 8 (leaf) to the SSD, whose leaves go first: 2 has a child (3, in DRAM)
        store.check_invariants()
        assert store.lookup(keys(1, 2, 3)).hits == 3
