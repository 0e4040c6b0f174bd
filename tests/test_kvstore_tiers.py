"""Tiers: demotion DRAM -> SSD, promotion on hit, exclusivity, events, snapshot, restart,
metadata-only stores."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import EventKind, FailedPrecondition, InvalidArgument, StoreConfig, Tier, TieredStore

from kvstore_helpers import LAYOUT, key, keys, make_store, page, tiers_of


def as_bytes(arr) -> bytes:
    return np.asarray(arr).tobytes()


def ssd_keys(store) -> set[bytes]:
    return set(store.pool(Tier.SSD).stored_keys())


def test_eviction_demotes_dram_to_ssd_with_the_bytes(tmp_path):
    with make_store(tmp_path, dram_pages=2, ssd_pages=4) as store:
        store.put(keys(1, 2), [page(1), page(2)])
        store.put([key(3)], [page(3)])
        assert tiers_of(store) == {key(1): "SSD", key(2): "DRAM", key(3): "DRAM"}
        assert ssd_keys(store) == {key(1)}
        assert store.lookup(keys(1, 2, 3)).tiers == [Tier.SSD, Tier.DRAM, Tier.DRAM]
        stats = store.stats()
        assert stats.demotions == 1 and stats.blocks == 3
        assert [t.used_pages for t in stats.tiers] == [2, 1]
        assert [t.evictions for t in stats.tiers] == [0, 0]  # demoted, not dropped


def test_the_last_tier_drops_and_reports_evicted(tmp_path):
    with make_store(tmp_path, dram_pages=1, ssd_pages=1) as store:
        for i in (1, 2, 3):
            store.put([key(i)], [page(i)])
        assert tiers_of(store) == {key(2): "SSD", key(3): "DRAM"}
        events = [(e.kind, int.from_bytes(e.key, "little"), e.tier) for e in store.take_events()]
        assert events == [
            (EventKind.STORED, 1, Tier.DRAM),
            (EventKind.STORED, 1, Tier.SSD),
            (EventKind.STORED, 2, Tier.DRAM),
            (EventKind.EVICTED, 1, Tier.SSD),
            (EventKind.STORED, 2, Tier.SSD),
            (EventKind.STORED, 3, Tier.DRAM),
        ]
        assert ssd_keys(store) == {key(2)}
        assert store.stats().tiers[1].evictions == 1


def test_events_have_consecutive_sequence_numbers_and_match_the_snapshot(tmp_path):
    with make_store(tmp_path, dram_pages=2, ssd_pages=2) as store:
        for i in range(6):
            store.put([key(i)], [page(i)])
        store.remove([key(5)])
        events = store.take_events(max_events=3) + store.take_events()
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert store.take_events() == []
        seq, entries = store.snapshot()
        assert seq == events[-1].seq == store.stats().last_event_seq
        # replaying the events gives exactly the snapshot
        held: dict[bytes, Tier] = {}
        for e in events:
            if e.kind is EventKind.STORED:
                held[e.key] = e.tier
            else:
                assert held.pop(e.key) == e.tier
        assert held == dict(entries)
        assert dict(entries) == {key(2): Tier.SSD, key(3): Tier.SSD, key(4): Tier.DRAM}


@pytest.mark.parametrize("promote", [True, False])
def test_ssd_hit_promotes_to_dram_only_when_asked(tmp_path, promote):
    with make_store(tmp_path, dram_pages=2, ssd_pages=4, promote_on_hit=promote) as store:
        for i in (1, 2, 3):
            store.put([key(i)], [page(i)])
        assert tiers_of(store)[key(1)] == "SSD"
        store.take_events()
        [got] = store.read([key(1)])
        assert as_bytes(got) == as_bytes(page(1))
        stats = store.stats()
        if promote:
            # 1 comes up; the LRU block of DRAM (2) goes down to make room: tiers stay exclusive
            assert tiers_of(store) == {key(1): "DRAM", key(2): "SSD", key(3): "DRAM"}
            assert ssd_keys(store) == {key(2)}
            assert stats.promotions == 1 and stats.demotions == 2
            assert [(e.kind, e.key, e.tier) for e in store.take_events()] == [
                (EventKind.STORED, key(2), Tier.SSD),
                (EventKind.STORED, key(1), Tier.DRAM),
            ]
        else:
            assert tiers_of(store)[key(1)] == "SSD" and ssd_keys(store) == {key(1)}
            assert stats.promotions == 0 and store.take_events() == []
        assert stats.bytes_read == LAYOUT.page_bytes
        # every block still reads back its own bytes, wherever it is now
        assert [as_bytes(p) for p in store.read(keys(1, 2, 3))] == [
            as_bytes(page(i)) for i in (1, 2, 3)
        ]


def test_acquire_can_leave_ssd_pages_in_place_and_copy_out(tmp_path):
    with make_store(tmp_path, dram_pages=1, ssd_pages=2) as store:
        store.put([key(1)], [page(1)])
        store.put([key(2)], [page(2)])
        lease = store.acquire(keys(1, 2, 9), into=None)
        assert lease.tiers == [Tier.SSD, Tier.DRAM, None] and lease.slots[2] == -1
        assert lease.found == 2
        out = np.empty(LAYOUT.page_bytes, np.uint8)
        assert store.copy_out(lease, 0, out) and as_bytes(out) == as_bytes(page(1))
        assert as_bytes(store.page_view(lease, 1)) == as_bytes(page(2))
        store.release(lease.lease_id)
        assert tiers_of(store) == {key(1): "SSD", key(2): "DRAM"}


def test_promotion_does_not_inherit_lfu_history_of_the_slot(tmp_path):
    # Regression: a block promoted into a slot freed by a hot block looked hot itself.
    with make_store(tmp_path, dram_pages=2, ssd_pages=4, dram_policy="lfu") as store:
        store.put([key(1)], [page(1)])
        store.put([key(2)], [page(2)])
        for _ in range(5):
            store.lookup([key(1)])
        store.put([key(3)], [page(3)])  # 2 (count 1) goes to SSD
        store.remove([key(1)])  # frees the hot block's slot
        store.read([key(2)])  # 2 comes back into that slot
        store.lookup([key(3)])
        store.lookup([key(3)])  # 3 is now used more than 2
        store.put([key(4)], [page(4)])
        assert tiers_of(store) == {key(2): "SSD", key(3): "DRAM", key(4): "DRAM"}


def test_pages_on_ssd_survive_a_restart(tmp_path):
    cfg = dict(dram_pages=2, ssd_pages=4)
    with make_store(tmp_path, **cfg) as store:
        for i in range(5):
            store.put([key(i)], [page(i)])
        on_ssd = {k for k, t in tiers_of(store).items() if t == "SSD"}
        assert on_ssd == set(keys(0, 1, 2))
    with make_store(tmp_path, **cfg) as store:
        assert tiers_of(store) == {k: "SSD" for k in on_ssd}  # DRAM pages died with the process
        assert [e.kind for e in store.take_events()] == [EventKind.STORED] * 3
        assert [as_bytes(p) for p in store.read(keys(0, 1, 2))] == [
            as_bytes(page(i)) for i in (0, 1, 2)
        ]
        assert store.read(keys(3, 4)) == [None, None]


def test_restart_with_a_smaller_ssd_keeps_what_fits(tmp_path):
    with make_store(tmp_path, dram_pages=1, ssd_pages=4) as store:
        for i in range(5):
            store.put([key(i)], [page(i)])
    with make_store(tmp_path, dram_pages=1, ssd_pages=2) as store:
        kept = tiers_of(store)
        assert len(kept) == 2 and set(kept) <= set(keys(0, 1, 2, 3))
        assert len(ssd_keys(store)) == 2
        for k, p in zip(kept, store.read(list(kept))):
            assert as_bytes(p) == as_bytes(page(int.from_bytes(k, "little")))


def test_other_layouts_do_not_see_each_others_ssd_pages(tmp_path):
    import dataclasses

    with make_store(tmp_path, dram_pages=1, ssd_pages=2) as store:
        store.put([key(1)], [page(1)])
        store.put([key(2)], [page(2)])
    other = dataclasses.replace(LAYOUT, model="another-model")
    with make_store(tmp_path, layout=other, dram_pages=1, ssd_pages=2) as store:
        assert store.snapshot()[1] == []


def test_gpu_tier_on_cpu_demotes_into_dram(tmp_path):
    cfg = dict(
        gpu_pages=2,
        gpu_device="cpu",
        dram_pages=2,
        ssd_pages=2,
        write_tier=Tier.GPU,
        promote_on_hit=False,
    )
    with make_store(tmp_path, **cfg) as store:
        for i in range(5):
            store.put([key(i)], [page(i)])
        assert tiers_of(store) == {
            key(0): "SSD",
            key(1): "DRAM",
            key(2): "DRAM",
            key(3): "GPU",
            key(4): "GPU",
        }
        assert [as_bytes(p) for p in store.read(keys(0, 1, 2, 3, 4))] == [
            as_bytes(page(i)) for i in range(5)
        ]
        # a shared-memory reader asks for DRAM: the GPU page moves down for it
        lease = store.acquire([key(4)], into=Tier.DRAM)
        assert lease.tiers == [Tier.DRAM]
        assert as_bytes(store.page_view(lease, 0)) == as_bytes(page(4))
        store.release(lease.lease_id)
        assert tiers_of(store)[key(4)] == "DRAM"


def test_metadata_only_store_runs_the_real_index_without_bytes():
    with make_store(dram_pages=3, ssd_pages=2, metadata_only=True) as store:
        assert store.shm_name is None
        for i in range(6):
            lease = store.allocate([key(i)])
            assert store.page_view(lease, 0) is None
            assert store.commit(lease.lease_id).stored == 1
        assert tiers_of(store) == {
            key(1): "SSD",
            key(2): "SSD",
            key(3): "DRAM",
            key(4): "DRAM",
            key(5): "DRAM",
        }
        res = store.lookup(keys(3, 4, 5, 6))
        assert res.hits == 3
        stats = store.stats()
        assert stats.tiers[1].evictions == 1 and stats.demotions == 3
        with pytest.raises(FailedPrecondition, match="metadata_only"):
            store.read([key(3)])
        assert store.read([key(9)]) == [None]


@pytest.mark.parametrize(
    "cfg,match",
    [
        (dict(), "at least one tier"),
        (dict(ssd_pages=2), "DRAM tier"),
        (dict(dram_pages=-1), "dram_pages"),
        (dict(dram_pages=2, ssd_pages=2), "ssd_dir"),
        (dict(dram_pages=2, write_tier=Tier.GPU), "write_tier"),
        (dict(dram_pages=2, dram_policy="random"), "eviction policy"),
    ],
)
def test_bad_configurations_are_rejected(cfg, match):
    with pytest.raises(InvalidArgument, match=match):
        TieredStore(LAYOUT, StoreConfig(**cfg))


def test_hottest_lists_what_eviction_would_keep_longest_faster_tiers_first(tmp_path):
    """What a leaving node hands over first (node/drain.py): DRAM's most recently used, then
    SSD's; a block read since it was written counts as used then; pinned blocks are left out."""
    with make_store(tmp_path, dram_pages=3, ssd_pages=4) as store:
        for i in range(1, 6):
            store.put([key(i)], [page(i)])  # 1, 2 demoted to SSD
        assert tiers_of(store)[key(1)] == "SSD" and tiers_of(store)[key(3)] == "DRAM"
        store.read([key(3)])  # 3 is now DRAM's most recently used
        assert store.hottest(10) == [key(3), key(5), key(4), key(2), key(1)]
        assert store.hottest(2) == [key(3), key(5)]
        assert store.hottest(0) == []
        lease = store.acquire([key(5)])  # pinned: not an eviction candidate, not handed over
        assert key(5) not in store.hottest(10)
        store.release(lease.lease_id)
        assert key(5) in store.hottest(10)
