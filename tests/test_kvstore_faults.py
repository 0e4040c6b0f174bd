"""Bad input and faults: each gets a clear error or a miss, never a crash, hang or bad bytes."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from kvstore import (
    CapacityExhausted,
    EventKind,
    FailedPrecondition,
    InvalidArgument,
    KVLayout,
    NotFound,
    StorageError,
    Tier,
)
from kvstore.shm import unique_shm_name
from kvstore.store import InvariantViolation

from kvstore_helpers import (
    LAYOUT,
    FakeClock,
    key,
    keys,
    make_store,
    page,
    page_bytes,
    run_python,
    small_tmpfs,
    tiers_of,
)

JOIN_TIMEOUT_S = 20


# ---- payloads ------------------------------------------------------------------------------


@pytest.fixture
def store():
    with make_store(dram_pages=4) as s:
        yield s


@pytest.mark.parametrize(
    "payload,match",
    [
        (np.zeros(LAYOUT.page_bytes // 2 - 1, np.float16), "expected 256"),
        (np.zeros(LAYOUT.page_bytes // 2 + 1, np.float16), "expected 256"),
        (b"x" * (LAYOUT.page_bytes - 1), "expected 256"),
        (np.zeros(LAYOUT.page_bytes // 4, np.float32), "float32 does not match"),
        (torch.zeros(LAYOUT.page_bytes // 4, dtype=torch.float32), "float32 does not match"),
        (torch.zeros(LAYOUT.page_bytes // 2, dtype=torch.bfloat16), "bfloat16 does not match"),
        (np.zeros(LAYOUT.page_bytes // 8, np.int64), "int64 does not match"),
        ("not bytes", "must be bytes"),
        (12345, "must be bytes"),
        (None, "must be bytes"),
    ],
)
def test_bad_payloads_are_rejected_and_the_page_stays_unpublished(store, payload, match):
    lease = store.allocate([key(1)])
    with pytest.raises(InvalidArgument, match=match):
        store.write(lease.lease_id, 0, payload)
    with pytest.raises(InvalidArgument):
        store.write(lease.lease_id, 0, np.zeros(LAYOUT.layer_bytes // 2 + 1, np.float16), layer=0)
    store.write(lease.lease_id, 0, page(1))  # the lease is still good
    store.commit(lease.lease_id)
    assert store.read([key(1)])[0].tobytes() == page(1).tobytes()


def test_matching_typed_payloads_in_any_shape_are_accepted(store):
    p = page(1)
    store.put([key(1)], [p.reshape(LAYOUT.page_shape)])
    store.put([key(2)], [torch.from_numpy(p.copy()).reshape(LAYOUT.page_shape)])
    assert store.read(keys(1, 2))[1].tobytes() == p.tobytes()


# ---- unknown keys and leases -------------------------------------------------------------------


def test_unknown_keys_and_leases(store):
    store.put([key(1)], [page(1)])
    got = store.read(keys(7, 1))
    assert got[0] is None and got[1].tobytes() == page(1).tobytes()
    assert store.lookup([key(7)]).hits == 0
    assert store.remove([key(7)]) == 0
    lease = store.acquire(keys(7))
    assert lease.slots == [-1] and lease.tiers == [None] and lease.found == 0
    with pytest.raises(NotFound):
        store.copy_out(lease, 0, np.empty(LAYOUT.page_bytes, np.uint8))
    store.release(lease.lease_id)
    with pytest.raises(NotFound, match="no such lease"):
        store.release(lease.lease_id)
    with pytest.raises(NotFound):
        store.release(987654)
    with pytest.raises(NotFound):
        store.extend(987654, 5)
    with pytest.raises(InvalidArgument, match="16 bytes"):
        store.read([b"short"])
    with pytest.raises(InvalidArgument, match="16 bytes"):
        store.allocate(["not-bytes-16-chr"])


@pytest.mark.parametrize("ttl", [0, -1.0, float("nan")])
def test_bad_lease_ttl(store, ttl):
    with pytest.raises(InvalidArgument, match="ttl"):
        store.allocate([key(1)], ttl_s=ttl)
    with pytest.raises(InvalidArgument, match="ttl"):
        store.acquire([key(1)], ttl_s=ttl)


# ---- capacity ------------------------------------------------------------------------------


def run_with_timeout(fn):
    """Run ``fn`` in a thread; return what it raised (or None). Fails if it does not finish."""
    outcome: dict[str, BaseException | None] = {"error": None}

    def target():
        try:
            fn()
        except BaseException as e:  # handed to the test thread
            outcome["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(JOIN_TIMEOUT_S)
    assert not t.is_alive(), "allocation hung instead of failing"
    return outcome["error"]


def test_capacity_exhausted_with_everything_pinned_fails_at_once(tmp_path):
    with make_store(tmp_path, dram_pages=2, ssd_pages=2) as store:
        for i in (1, 2, 3, 4):
            store.put([key(i)], [page(i)])
        lease = store.acquire(keys(1, 2, 3, 4), into=None)  # every page of both tiers
        err = run_with_timeout(lambda: store.put([key(5)], [page(5)]))
        assert isinstance(err, CapacityExhausted)
        assert "DRAM tier is full" in str(err) and "pinned" in str(err)
        assert store.stats().tiers[0].pinned_blocks == 2
        store.release(lease.lease_id)
        store.put([key(5)], [page(5)])
        assert len(tiers_of(store)) == 4


def test_capacity_exhausted_by_writers_leases():
    with make_store(dram_pages=2) as store:
        store.allocate(keys(1, 2))
        err = run_with_timeout(lambda: store.allocate([key(3)]))
        assert isinstance(err, CapacityExhausted) and "leased" in str(err)


def test_a_full_slower_tier_drops_instead_of_demoting_pinned_blocks(tmp_path):
    # DRAM victims cannot go down when every SSD page is pinned: they are dropped (evicted).
    with make_store(tmp_path, dram_pages=1, ssd_pages=1) as store:
        store.put([key(1)], [page(1)])
        store.put([key(2)], [page(2)])  # 1 -> SSD
        lease = store.acquire([key(1)], into=None)  # pin the only SSD page
        store.take_events()
        store.put([key(3)], [page(3)])
        assert [(e.kind, e.key) for e in store.take_events()] == [
            (EventKind.EVICTED, key(2)),
            (EventKind.STORED, key(3)),
        ]
        store.release(lease.lease_id)


# ---- the SSD tier ----------------------------------------------------------------------------


def test_unusable_ssd_directory_is_a_storage_error_and_leaks_nothing(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a directory")
    name = unique_shm_name("kvtest")
    with pytest.raises(StorageError, match="ssd-dir"):
        make_store(dram_pages=2, ssd_pages=2, ssd_dir=str(blocker / "ssd"), shm_name=name)
    assert not os.path.exists(f"/dev/shm/{name}")  # the DRAM slab was unlinked on the way out
    with pytest.raises(StorageError):
        make_store(dram_pages=2, ssd_pages=2, ssd_dir=str(blocker))


CORRUPT = """
import sys, lmdb
path, map_size, key_hex, how = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
env = lmdb.open(path, map_size=map_size, max_dbs=2, subdir=True)
pages = env.open_db(b"pages")
with env.begin(write=True) as txn:
    value = bytearray(txn.get(bytes.fromhex(key_hex), db=pages))
    if how == "flip":
        value[len(value) // 2] ^= 0x40
    else:
        del value[-1]
    txn.put(bytes.fromhex(key_hex), bytes(value), db=pages)
env.close()
"""


def corrupt_from_another_process(store, k: bytes, how: str) -> None:
    ssd = store.pool(Tier.SSD)
    run_python(CORRUPT, ssd.path, str(ssd.env.info()["map_size"]), k.hex(), how)


@pytest.mark.parametrize("promote", [True, False])
@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_corrupt_ssd_page_is_dropped_and_never_returned(tmp_path, promote, how):
    with make_store(tmp_path, dram_pages=1, ssd_pages=3, promote_on_hit=promote) as store:
        for i in (1, 2, 3):
            store.put([key(i)], [page(i)])
        assert tiers_of(store) == {key(1): "SSD", key(2): "SSD", key(3): "DRAM"}
        corrupt_from_another_process(store, key(1), how)
        store.take_events()
        got = store.read(keys(1, 2, 3))
        assert got[0] is None
        assert [g.tobytes() for g in got[1:]] == [page(2).tobytes(), page(3).tobytes()]
        assert store.stats().corrupt_pages == 1
        assert store.contains(keys(1, 2, 3)) == [False, True, True]
        assert key(1) not in set(store.pool(Tier.SSD).stored_keys())
        assert (EventKind.EVICTED, key(1)) in [(e.kind, e.key) for e in store.take_events()]
        assert store.read([key(1)]) == [None] and store.stats().corrupt_pages == 1
        # the dropped page's slot is usable again
        store.put([key(4)], [page(4)])
        store.put([key(5)], [page(5)])
        assert len(tiers_of(store)) == 4


def test_a_page_corrupted_while_down_is_dropped_after_restart(tmp_path):
    cfg = dict(dram_pages=1, ssd_pages=2)
    with make_store(tmp_path, **cfg) as store:
        for i in (1, 2, 3):
            store.put([key(i)], [page(i)])
        path, map_size = store.pool(Tier.SSD).path, store.pool(Tier.SSD).env.info()["map_size"]
    env = lmdb.open(path, map_size=map_size, max_dbs=2, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(key(2), b"\0" * LAYOUT.page_bytes, db=env.open_db(b"pages", txn=txn))
    env.close()
    with make_store(tmp_path, **cfg) as store:
        assert store.contains(keys(1, 2)) == [True, True]
        got = store.read(keys(1, 2))
        assert got[0].tobytes() == page(1).tobytes() and got[1] is None
        assert store.stats().corrupt_pages == 1 and store.contains([key(2)]) == [False]


# ---- leases ---------------------------------------------------------------------------------


def test_an_expired_write_lease_returns_its_pages():
    clock = FakeClock()
    with make_store(dram_pages=2, clock=clock, lease_ttl_s=10, quarantine_s=0) as store:
        lease = store.allocate(keys(1, 2))
        store.write(lease.lease_id, 0, page(1))
        assert lease.expires_at == clock.now + 10
        with pytest.raises(CapacityExhausted):
            store.allocate([key(3)])
        clock.advance(9.5)
        assert store.expire_leases() == 0
        clock.advance(0.5)  # the deadline itself
        with pytest.raises(FailedPrecondition):
            store.write(lease.lease_id, 1, page(2))  # too late to write ...
        with pytest.raises(FailedPrecondition, match="expired"):
            store.commit(lease.lease_id)  # ... or to publish
        stats = store.stats()
        assert stats.tiers[0].leased_pages == 0 and stats.expired_leases == 1
        assert stats.write_leases == 0 and stats.blocks == 0
        assert store.put(keys(3, 4), [page(3), page(4)]).stored == 2


def test_a_holder_known_gone_gives_back_live_expired_and_pinned_leases_at_once():
    clock = FakeClock()
    with make_store(dram_pages=6, clock=clock, lease_ttl_s=10) as store:  # quarantine: 30 s
        store.put([key(1)], [page(1)])
        expired = store.allocate(keys(2, 3))
        clock.advance(10)  # expired: its 2 pages are quarantined
        live = store.allocate(keys(4, 5))
        pins = store.acquire([key(1)])
        tier = store.stats().tiers[0]
        assert (tier.quarantined_pages, tier.leased_pages, tier.pinned_blocks) == (2, 2, 1)
        assert store.forget_holder(expired.lease_id) == 2
        assert store.forget_holder(live.lease_id) == 2
        assert store.forget_holder(pins.lease_id) == 0
        assert store.forget_holder(live.lease_id) == 0  # ended already: nothing to do
        store.check_invariants()
        tier = store.stats().tiers[0]
        assert (tier.quarantined_pages, tier.leased_pages, tier.pinned_blocks) == (0, 0, 0)
        assert tier.free_pages == 5
        with pytest.raises(FailedPrecondition):
            store.commit(live.lease_id)  # its holder is gone: nothing publishes it
        again = store.allocate(keys(6, 7, 8, 9, 10))  # the whole rest, no eviction
        assert len(again.to_write) == 5 and store.stats().tiers[0].evictions == 0
        assert set(again.slots) >= set(live.slots)  # fenced: the generations moved on
        with pytest.raises(FailedPrecondition, match="stale"):
            store.page_view(live, 0)


def test_extend_keeps_a_write_lease_alive():
    clock = FakeClock()
    with make_store(dram_pages=2, clock=clock, lease_ttl_s=10) as store:
        lease = store.allocate([key(1)])
        clock.advance(8)
        assert store.extend(lease.lease_id, 10) == clock.now + 10
        clock.advance(8)
        assert store.expire_leases() == 0
        store.write(lease.lease_id, 0, page(1))
        assert store.commit(lease.lease_id).stored == 1


def test_extending_a_lease_in_a_loop_keeps_the_deadline_heap_small():
    # Each extension used to leave its old deadline in the heap until that deadline passed
    # (ExtendLease in a loop with a long ttl: node memory growing without bound).
    clock = FakeClock()
    with make_store(dram_pages=4, clock=clock, lease_ttl_s=10) as store:
        write = store.allocate([key(1)])
        store.write(write.lease_id, 0, page(1))
        read = store.acquire([key(2)])
        for i in range(10_000):
            store.extend((write, read)[i % 2].lease_id, 3600)
        assert len(store._deadlines) <= 2 * 2 + 64
        clock.advance(3601)  # the current deadlines still rule
        assert store.expire_leases() == 2
        store.check_invariants()


def test_a_late_writer_cannot_corrupt_a_page_given_to_another():
    clock = FakeClock()
    with make_store(dram_pages=2, clock=clock, lease_ttl_s=10) as store:  # quarantine: 30 s
        slow = store.allocate([key(1)])
        slow_view = store.page_view(slow, 0)  # a same-host writer maps its page once
        clock.advance(10)  # ... and stalls past its lease
        fast = store.allocate([key(2)])
        assert fast.slots != slow.slots  # was the slow writer's page
        store.write(fast.lease_id, 0, page(2))
        store.commit(fast.lease_id)
        slow_view[:] = page(66).view(np.uint8)  # the slow writer wakes up and writes
        assert store.read([key(2)])[0].tobytes() == page_bytes(2)
        tier = store.stats().tiers[0]
        assert (tier.quarantined_pages, tier.free_pages, tier.used_pages) == (1, 0, 1)
        store.check_invariants()
        with pytest.raises(FailedPrecondition, match="quarantined.*not trusted"):
            store.commit(slow.lease_id)
        clock.advance(30)  # 3 lease TTLs after the deadline: the page comes back
        assert store.expire_leases() == 0
        assert store.stats().tiers[0].quarantined_pages == 0
        store.put([key(3)], [page(3)])  # takes the quarantined page, a new generation
        with pytest.raises(FailedPrecondition, match="stale"):
            store.page_view(slow, 0)  # a late writer that asks again is fenced off
        with pytest.raises(FailedPrecondition, match="no such lease"):
            store.commit(slow.lease_id)
        assert [p.tobytes() for p in store.read(keys(2, 3))] == [page_bytes(2), page_bytes(3)]
        store.check_invariants()


def test_the_generation_fence_refuses_a_stale_commit():
    # White box: nothing hands a live lease's page to another owner (check_invariants says so);
    # should it happen, the commit publishes nothing and returns only the pages still its own.
    with make_store(dram_pages=2) as store:
        lease = store.allocate(keys(1, 2))
        store.write_pages(lease.lease_id, [page(1), page(2)])
        store._tiers[Tier.DRAM].gens[lease.slots[1]] += 1  # page #1 went elsewhere
        with pytest.raises(InvariantViolation, match="generation changed"):
            store.check_invariants()
        with pytest.raises(FailedPrecondition, match="stale: its page #1 was reused"):
            store.commit(lease.lease_id)
        stats = store.stats()
        assert (stats.blocks, stats.write_leases, stats.tiers[0].leased_pages) == (0, 0, 0)
        assert list(store._tiers[Tier.DRAM].free) == [lease.slots[0]]


def test_an_abort_frees_pages_at_once_and_quarantine_can_be_off():
    clock = FakeClock()
    with make_store(dram_pages=1, clock=clock, quarantine_s=0) as store:
        store.allocate([key(1)], ttl_s=1)
        clock.advance(1)
        store.put([key(2)], [page(2)])  # no quarantine: the expired page is reused at once
    with make_store(dram_pages=1, clock=clock) as store:
        store.abort(store.allocate([key(1)]).lease_id)  # the writer itself says it is done
        store.put([key(2)], [page(2)])


@pytest.mark.parametrize("q", [-1.0, float("nan"), float("inf")])
def test_bad_quarantine(q):
    with pytest.raises(InvalidArgument, match="quarantine_s"):
        make_store(dram_pages=1, quarantine_s=q)


def test_an_expired_read_lease_unpins_its_blocks():
    clock = FakeClock()
    with make_store(dram_pages=2, clock=clock) as store:
        store.put(keys(1, 2), [page(1), page(2)])
        lease = store.acquire(keys(1, 2), ttl_s=5)
        assert store.stats().tiers[0].pinned_blocks == 2
        with pytest.raises(CapacityExhausted):
            store.put([key(3)], [page(3)])
        clock.advance(5)
        out = np.empty(LAYOUT.page_bytes, np.uint8)
        with pytest.raises(FailedPrecondition, match="expired"):
            store.copy_out(lease, 0, out)
        assert store.stats().tiers[0].pinned_blocks == 0
        store.put([key(3)], [page(3)])  # now 1 can be evicted
        assert store.contains(keys(1, 2, 3)) == [False, True, True]
        with pytest.raises(NotFound):
            store.release(lease.lease_id)
        with pytest.raises(NotFound):
            store.extend(lease.lease_id)


def test_a_commits_hold_pins_its_pages_until_it_lapses():
    """``commit(hold_s=...)``: the lease's pages (its own and a first writer's) are pinned in
    the commit's locked step, under a read lease nobody releases, until its deadline."""
    clock = FakeClock()
    with make_store(dram_pages=2, clock=clock) as store:
        store.put([key(2)], [page(2)])  # another writer stored 2 first
        lease = store.allocate(keys(1, 2))
        store.write_pages(lease.lease_id, [page(1), page(2)])
        for bad in (-1.0, float("nan")):
            with pytest.raises(InvalidArgument, match="ttl"):
                store.commit(lease.lease_id, hold_s=bad)  # refused, nothing published
        assert store.contains(keys(1)) == [False]
        result = store.commit(lease.lease_id, hold_s=5)
        assert (result.stored, result.duplicates) == (1, 0)  # 2 was there at Allocate
        assert result.hold is not None and result.hold.found == 2
        assert store.stats().tiers[0].pinned_blocks == 2
        with pytest.raises(CapacityExhausted):
            store.put([key(3)], [page(3)])  # 1 and 2 are held: nothing to evict
        clock.advance(5)
        store.put([key(3)], [page(3)])  # the hold lapsed: now they can go
        assert store.stats().tiers[0].pinned_blocks == 0
        lease = store.allocate([key(4)])
        store.write_pages(lease.lease_id, [page(4)])
        assert store.commit(lease.lease_id).hold is None  # no hold asked
        store.check_invariants()


def test_removing_a_pinned_block_frees_it_on_release(store):
    store.put([key(1)], [page(1)])
    lease = store.acquire([key(1)])
    assert store.remove([key(1)]) == 1
    assert store.contains([key(1)]) == [False]
    # the reader still sees its bytes until it lets go
    assert store.page_view(lease, 0).tobytes() == page(1).tobytes()
    assert store.stats().tiers[0].used_pages == 1
    store.release(lease.lease_id)
    assert store.stats().tiers[0].used_pages == 0


# ---- threads ----------------------------------------------------------------------------------

WRITERS = 3
ROUNDS = 150


def writer_pages() -> dict[int, bytes]:
    return {w: page(100 + w).tobytes() for w in range(WRITERS)}


def test_readers_racing_writers_on_one_key_never_see_torn_pages():
    # room for every writer's lease, the committed page and pages doomed while readers pin them
    with make_store(dram_pages=8) as store:
        race_readers_and_writers(store)


def race_readers_and_writers(store) -> None:
    k = key(42)
    expected = writer_pages()
    valid = set(expected.values())
    errors: list[str] = []
    seen = {"none": 0, "page": 0}
    start = threading.Barrier(WRITERS + 2)

    def writer(w: int) -> None:
        src = page(100 + w)
        start.wait()
        for _ in range(ROUNDS):
            lease = store.allocate([k])
            if lease.slots[0] >= 0:
                for layer in range(LAYOUT.num_layers):  # layer by layer: tearing is possible
                    flat = src.view(np.uint8)
                    off = LAYOUT.layer_offset(layer)
                    store.write(
                        lease.lease_id, 0, flat[off : off + LAYOUT.layer_bytes], layer=layer
                    )
            store.commit(lease.lease_id)
            store.remove([k])

    def reader(use_view: bool) -> None:
        start.wait()
        for _ in range(ROUNDS * 2):
            if use_view:  # zero-copy: pinned page copied outside the store's lock
                lease = store.acquire([k])
                got = store.page_view(lease, 0).tobytes() if lease.slots[0] >= 0 else None
                store.release(lease.lease_id)
            else:
                got = store.read([k])[0]
                got = None if got is None else got.tobytes()
            if got is None:
                seen["none"] += 1
            elif got in valid:
                seen["page"] += 1
            else:
                errors.append("torn or foreign page")

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
    threads += [threading.Thread(target=reader, args=(v,)) for v in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S * 3)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert seen["none"] + seen["page"] == ROUNDS * 4
    stats = store.stats()
    assert stats.write_leases == stats.read_leases == 0
    assert stats.tiers[0].leased_pages == 0 and stats.tiers[0].pinned_blocks == 0


def test_two_writers_on_one_key_first_commit_wins(store):
    a, b = store.allocate([key(1)]), store.allocate([key(1)])
    assert a.slots[0] >= 0 and b.slots[0] >= 0 and a.slots[0] != b.slots[0]
    store.write(a.lease_id, 0, page(1))
    store.write(b.lease_id, 0, page(2))
    res = store.commit(b.lease_id)
    assert (res.stored, res.duplicates) == (1, 0)
    res = store.commit(a.lease_id)
    assert (res.stored, res.duplicates) == (0, 1)
    assert store.read([key(1)])[0].tobytes() == page(2).tobytes()
    assert store.stats().tiers[0].used_pages == 1 and store.stats().tiers[0].leased_pages == 0
    assert [e.kind for e in store.take_events()] == [EventKind.STORED]


def test_many_writers_on_one_key_from_threads_publish_exactly_once(store):
    results: dict[int, tuple[int, int]] = {}
    start = threading.Barrier(WRITERS)

    def writer(w: int) -> None:
        lease = store.allocate([key(7)])
        start.wait()  # every allocate before any commit
        if lease.slots[0] >= 0:
            store.write(lease.lease_id, 0, page(100 + w))
        res = store.commit(lease.lease_id)
        results[w] = (res.stored, res.duplicates)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    assert sorted(results.values()) == [(0, 1)] * (WRITERS - 1) + [(1, 0)]
    [winner] = [w for w, r in results.items() if r == (1, 0)]
    assert store.read([key(7)])[0].tobytes() == page(100 + winner).tobytes()
    assert store.stats().tiers[0].used_pages == 1 and store.stats().tiers[0].leased_pages == 0


# ---- a full SSD tier -------------------------------------------------------------------------

# Another process fills the SSD tier's lmdb map through a database of its own: the store's next
# write then meets a real MDB_MAP_FULL, as on a node whose map is too small. (A map this full takes
# no deletes either, so space never returns here; the tmpfs test below covers recovery.)
FILL_MAP = """
import sys, lmdb
path, map_size = sys.argv[1], int(sys.argv[2])
env = lmdb.open(path, map_size=map_size, max_dbs=3, subdir=True, sync=False)
filler = env.open_db(b"filler")
i = 0
for size in (1 << 20, 1 << 16, 4096, 512, 16):  # big records first, then top up the rest
    while True:
        try:
            with env.begin(write=True) as txn:
                txn.put(i.to_bytes(8, "big"), b"\\0" * size, db=filler)
            i += 1
        except lmdb.MapFullError:
            break
env.close()
"""


def fill_ssd_map(store) -> None:
    ssd = store.pool(Tier.SSD)
    run_python(FILL_MAP, ssd.path, str(ssd.env.info()["map_size"]))


def test_a_full_ssd_map_drops_dram_victims_and_keeps_serving(tmp_path):
    with make_store(tmp_path, dram_pages=2, ssd_pages=8) as store:
        for i in (1, 2, 3, 4):
            store.put([key(i)], [page(i)])  # 1, 2 -> SSD
        assert tiers_of(store)[key(1)] == "SSD"
        fill_ssd_map(store)
        store.take_events()
        # DRAM keeps taking writes: victims the SSD refuses are dropped as evictions.
        for i in range(5, 20):
            assert store.put([key(i)], [page(i)]).stored == 1
        stats = store.stats()
        assert stats.demotion_failures > 0
        assert stats.tiers[0].evictions >= stats.demotion_failures
        evicted = {e.key for e in store.take_events() if e.kind is EventKind.EVICTED}
        assert len(evicted) >= stats.demotion_failures and key(19) not in evicted
        assert store.read([key(19)])[0].tobytes() == page(19).tobytes()
        assert store.read([key(1)])[0].tobytes() == page(1).tobytes()  # the SSD still serves
        store.check_invariants()
        # lmdb cannot even delete now: a removed SSD block is gone all the same
        assert store.remove([key(2)]) == 1 and store.contains([key(2)]) == [False]
        store.check_invariants()


def test_a_refused_move_into_the_ssd_leaves_the_block_where_it_is(tmp_path):
    with make_store(tmp_path, dram_pages=2, ssd_pages=4) as store:
        store.put(keys(1, 2), [page(1), page(2)])
        fill_ssd_map(store)
        lease = store.acquire(keys(1, 2), into=Tier.SSD)
        assert lease.tiers == [Tier.DRAM, Tier.DRAM]
        assert store.stats().demotion_failures >= 1
        assert bytes(store.page_view(lease, 0)) == page(1).tobytes()
        store.release(lease.lease_id)
        store.check_invariants()


@pytest.fixture
def small_fs(tmp_path):
    with small_tmpfs(tmp_path / "small-fs") as mnt:
        yield mnt


def test_a_full_ssd_filesystem_drops_dram_victims_and_demotion_resumes(small_fs):
    big = KVLayout(model="m", num_layers=2, kv_heads=4, head_dim=64, block_tokens=64)  # 128 KiB
    pages = [np.full(big.page_bytes // 2, i, np.float16) for i in range(24)]
    with make_store(layout=big, dram_pages=2, ssd_pages=16, ssd_dir=str(small_fs)) as store:
        ks = [key(i) for i in range(24)]
        for i in range(16):
            assert store.put([ks[i]], [pages[i]]).stored == 1
        failures = store.stats().demotion_failures
        assert failures > 0, "the 1 MiB filesystem should have filled up"
        assert store.read([ks[15]])[0].tobytes() == pages[15].tobytes()
        store.check_invariants()
        (small_fs / "ballast").unlink()  # space returns
        for i in range(16, 20):
            store.put([ks[i]], [pages[i]])
        assert store.stats().demotion_failures == failures
        assert tiers_of(store)[ks[17]] == "SSD"
        assert store.read([ks[17]])[0].tobytes() == pages[17].tobytes()
        store.check_invariants()


# ---- a damaged SSD data file at start --------------------------------------------------------

OPEN_SSD = """
import json, sys
from pathlib import Path
from kvstore import StorageError
from kvstore_helpers import make_store, key
try:
    with make_store(Path(sys.argv[1]), dram_pages=2, ssd_pages=64, ssd_damaged=sys.argv[2]) as s:
        ssd = s.pool(s.tiers[-1])
        print(json.dumps({"blocks": s.stats().blocks, "aside": ssd.moved_aside}))
except StorageError as e:
    print(json.dumps({"error": str(e)}))
"""


def open_in_a_child(tmp_path, on_damage: str) -> dict:
    """Open the store in another process: a regression that dies of SIGBUS fails this test
    instead of killing the test run."""
    tests = str(Path(__file__).resolve().parent)
    proc = run_python(OPEN_SSD, str(tmp_path), on_damage, env={"PYTHONPATH": tests})
    return json.loads(proc.stdout)


def damage(tmp_path, how: str) -> tuple[Path, bytes]:
    """Fill an SSD tier, close it, and damage its data file; returns the file and its bytes."""
    with make_store(tmp_path, dram_pages=2, ssd_pages=64) as store:
        for i in range(40):
            store.put([key(i)], [page(i)])
        data = Path(store.pool(Tier.SSD).path) / "data.mdb"
    size = data.stat().st_size
    if how == "cut in half":
        os.truncate(data, size // 2)
    elif how == "meta pages only":  # the tree's pages are past the end: a read is a SIGBUS
        os.truncate(data, 8192)
    elif how == "empty":  # lmdb would take it for a new, empty store
        os.truncate(data, 0)
    elif how == "garbage":
        data.write_bytes(np.random.default_rng(1).bytes(size))
    elif how == "garbage tree":  # sound meta pages over garbage tree pages
        with open(data, "r+b") as f:
            f.seek(8192)
            f.write(np.random.default_rng(2).bytes(size - 8192))
    return data, data.read_bytes()


HOW = ["cut in half", "meta pages only", "empty", "garbage", "garbage tree"]


@pytest.mark.parametrize("how", HOW)
def test_a_damaged_ssd_file_is_refused_by_default_naming_the_flag(tmp_path, how):
    data, bad = damage(tmp_path, how)
    got = open_in_a_child(tmp_path, "refuse")
    assert "damaged" in got["error"] and "--ssd-damaged=move-aside" in got["error"]
    assert str(data) in got["error"]
    assert data.read_bytes() == bad  # left as it was


@pytest.mark.parametrize("how", HOW)
def test_a_damaged_ssd_file_is_moved_aside_on_request(tmp_path, how):
    data, bad = damage(tmp_path, how)
    got = open_in_a_child(tmp_path, "move-aside")
    assert got["blocks"] == 0
    aside = Path(got["aside"])
    assert aside.parent == data.parent and aside.name.startswith("data.mdb.damaged-")
    assert aside.read_bytes() == bad
    # the new file is sound: pages written to it are there after a restart
    cfg = dict(dram_pages=1, ssd_pages=4)
    with make_store(tmp_path, **cfg) as store:
        store.put([key(1)], [page(1)])
        store.put([key(2)], [page(2)])  # 1 -> SSD
    with make_store(tmp_path, **cfg) as store:
        assert store.read([key(1)])[0].tobytes() == page(1).tobytes()
        store.check_invariants()


def test_ssd_files_and_the_dram_slab_are_private_to_their_user(tmp_path):
    with make_store(tmp_path, dram_pages=2, ssd_pages=2) as store:
        ssd = Path(store.pool(Tier.SSD).path)
        for f in (ssd / "data.mdb", ssd / "lock.mdb", Path(f"/dev/shm/{store.shm_name}")):
            assert f.stat().st_mode & 0o777 == 0o600, f
        assert ssd.stat().st_mode & 0o777 == 0o700
