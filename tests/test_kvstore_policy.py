"""Eviction order, exactly: LRU and LFU at the policy level and through a TieredStore."""

from __future__ import annotations

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

from kvstore_helpers import key, keys, make_store, page


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


@pytest.mark.parametrize("cls", [LRUPolicy, LFUPolicy])
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


def test_make_policy_by_name():
    assert isinstance(make_policy("LRU", 4), LRUPolicy)
    assert isinstance(make_policy("lfu", 4), LFUPolicy)
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
