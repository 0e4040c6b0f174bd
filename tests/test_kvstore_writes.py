"""Two-phase writes: allocate -> write (whole pages or per layer) -> commit or abort."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore import CapacityExhausted, FailedPrecondition, InvalidArgument, NotFound, Tier

from kvstore_helpers import LAYOUT, key, keys, make_store, page


def layer_of(p: np.ndarray, layer: int) -> np.ndarray:
    flat = p.view(np.uint8)
    off = LAYOUT.layer_offset(layer)
    return flat[off : off + LAYOUT.layer_bytes].view(LAYOUT.numpy_dtype)


@pytest.fixture
def store():
    with make_store(dram_pages=4) as s:
        yield s


def test_layer_by_layer_write_is_invisible_until_commit(store):
    lease = store.allocate(keys(1, 2))
    assert lease.tier is Tier.DRAM and lease.to_write == [0, 1]
    assert store.stats().tiers[0].leased_pages == 2
    for layer in range(LAYOUT.num_layers):
        for i, seed in enumerate((1, 2)):
            store.write(lease.lease_id, i, layer_of(page(seed), layer), layer=layer)
        # half-written pages: nobody sees them
        assert store.lookup(keys(1, 2)).hits == 0
        assert store.read(keys(1, 2)) == [None, None]
        assert store.contains(keys(1, 2)) == [False, False]
        assert store.acquire(keys(1)).slots == [-1]
    assert store.take_events() == []
    assert store.commit(lease.lease_id).stored == 2
    assert [p.tobytes() for p in store.read(keys(1, 2))] == [page(1).tobytes(), page(2).tobytes()]
    assert [e.key for e in store.take_events()] == keys(1, 2)
    tier = store.stats().tiers[0]
    assert tier.leased_pages == 0 and tier.used_pages == 2


def pages_of(*seeds: int) -> np.ndarray:
    """A batch of pages, ``[len(seeds), layers, layer elements]`` of the layout dtype."""
    return np.stack([page(s) for s in seeds]).reshape(len(seeds), LAYOUT.num_layers, -1)


def test_write_layer_writes_one_layer_of_every_page_in_one_call(store):
    batch = pages_of(1, 2, 3)
    lease = store.allocate(keys(1, 2, 3))
    for layer in range(LAYOUT.num_layers):
        assert store.lookup(keys(1)).hits == 0  # invisible until commit, as with write()
        store.write_layer(lease.lease_id, layer, batch[:, layer])  # rows a page apart: no copy
    assert store.commit(lease.lease_id).stored == 3
    assert [p.tobytes() for p in store.read(keys(1, 2, 3))] == [
        page(i).tobytes() for i in (1, 2, 3)
    ]
    assert store.stats().bytes_written == 3 * LAYOUT.page_bytes


def test_write_layer_takes_torch_and_bytes_and_skips_stored_keys(store):
    store.put([key(2)], [page(2)])
    batch = pages_of(1, 9, 3)  # the stored key's row is never written
    lease = store.allocate(keys(1, 2, 3))
    store.write_layer(lease.lease_id, 0, torch.from_numpy(batch[:, 0].copy()))
    store.write_layer(lease.lease_id, 1, batch[:, 1].tobytes())
    assert store.commit(lease.lease_id).stored == 2
    assert [p.tobytes() for p in store.read(keys(1, 2, 3))] == [
        page(i).tobytes() for i in (1, 2, 3)
    ]


def test_write_layer_bad_input_is_a_clear_error(store):
    lease = store.allocate(keys(1, 2))
    batch = pages_of(1, 2)
    with pytest.raises(InvalidArgument, match="expected 2 rows"):
        store.write_layer(lease.lease_id, 0, batch[:1, 0])
    with pytest.raises(InvalidArgument, match="rows are 64 bytes; expected 128"):
        store.write_layer(lease.lease_id, 0, batch[:, 0, ::2])
    with pytest.raises(InvalidArgument, match="dtype float32 does not match"):
        store.write_layer(lease.lease_id, 0, batch[:, 0].astype(np.float32))
    with pytest.raises(InvalidArgument, match="layer 2 out of range"):
        store.write_layer(lease.lease_id, 2, batch[:, 0])
    with pytest.raises(InvalidArgument, match="expected 256"):
        store.write_layer(lease.lease_id, 0, b"\0" * 100)
    store.abort(lease.lease_id)
    with pytest.raises(FailedPrecondition, match="does not exist"):
        store.write_layer(lease.lease_id, 0, batch[:, 0])


def test_writers_can_fill_the_page_view_in_place(store):
    lease = store.allocate([key(1)])
    view = store.page_view(lease, 0, layer=1)
    assert view.nbytes == LAYOUT.layer_bytes
    view[:] = layer_of(page(1), 1).view(np.uint8)
    store.page_view(lease, 0, layer=0)[:] = layer_of(page(1), 0).view(np.uint8)
    store.commit(lease.lease_id)
    assert store.read([key(1)])[0].tobytes() == page(1).tobytes()


def test_torch_and_bytes_payloads_are_accepted(store):
    p = page(3)
    store.put(
        keys(1, 2, 3),
        [torch.from_numpy(p.copy()), p.tobytes(), torch.from_numpy(p.view(np.uint8).copy())],
    )
    assert all(x.tobytes() == p.tobytes() for x in store.read(keys(1, 2, 3)))


def test_abort_frees_the_pages_and_publishes_nothing(store):
    lease = store.allocate(keys(1, 2, 3, 4))
    store.write(lease.lease_id, 0, page(1))
    with pytest.raises(CapacityExhausted):
        store.allocate([key(5)])  # every page is leased
    store.abort(lease.lease_id)
    assert store.lookup(keys(1)).hits == 0 and store.take_events() == []
    assert store.stats().tiers[0].leased_pages == 0
    assert store.put(keys(5, 6, 7, 8), [page(i) for i in (5, 6, 7, 8)]).stored == 4
    with pytest.raises(FailedPrecondition):
        store.abort(lease.lease_id)
    with pytest.raises(FailedPrecondition):
        store.commit(lease.lease_id)


def test_commit_of_a_lease_never_allocated(store):
    with pytest.raises(FailedPrecondition, match="allocate again"):
        store.commit(12345)
    with pytest.raises(FailedPrecondition):
        store.write(12345, 0, page(1))


def test_double_commit_fails_and_changes_nothing(store):
    lease = store.allocate([key(1)])
    store.write(lease.lease_id, 0, page(1))
    assert store.commit(lease.lease_id).stored == 1
    events = store.take_events()
    with pytest.raises(FailedPrecondition, match="already"):
        store.commit(lease.lease_id)
    with pytest.raises(FailedPrecondition):
        store.write(lease.lease_id, 0, page(2))  # no writes after publishing either
    assert len(events) == 1 and store.take_events() == []
    assert store.read([key(1)])[0].tobytes() == page(1).tobytes()
    assert store.stats().tiers[0].used_pages == 1


def test_duplicate_keys_in_one_allocate_are_rejected(store):
    with pytest.raises(InvalidArgument, match="duplicates"):
        store.allocate(keys(1, 2, 1))
    assert store.stats().tiers[0].leased_pages == 0 and store.stats().write_leases == 0


def test_already_stored_keys_get_no_page(store):
    store.put([key(2)], [page(2)])
    lease = store.allocate(keys(1, 2, 3))
    assert lease.slots[1] == -1 and lease.to_write == [0, 2]
    assert store.stats().tiers[0].leased_pages == 2
    with pytest.raises(FailedPrecondition, match="already stored"):
        store.write(lease.lease_id, 1, page(9))
    with pytest.raises(NotFound):
        store.page_view(lease, 1)
    # write_pages takes one page per key and skips the stored one
    store.write_pages(lease.lease_id, [page(1), None, page(3)])
    assert store.commit(lease.lease_id).stored == 2
    assert [p.tobytes() for p in store.read(keys(1, 2, 3))] == [
        page(i).tobytes() for i in (1, 2, 3)
    ]


def test_write_index_and_layer_out_of_range(store):
    lease = store.allocate([key(1)])
    with pytest.raises(InvalidArgument, match="out of range"):
        store.write(lease.lease_id, 1, page(1))
    with pytest.raises(InvalidArgument, match="layer 2"):
        store.write(lease.lease_id, 0, layer_of(page(1), 0), layer=2)
    with pytest.raises(InvalidArgument, match="2 pages for 1 keys"):
        store.write_pages(lease.lease_id, [page(1), page(2)])


def test_put_aborts_when_a_page_is_bad(store):
    with pytest.raises(InvalidArgument):
        store.put(keys(1, 2), [page(1), page(2)[:-1]])
    stats = store.stats()
    assert stats.blocks == 0 and stats.write_leases == 0 and stats.tiers[0].leased_pages == 0


def test_allocate_into_another_tier(tmp_path):
    with make_store(tmp_path, dram_pages=2, ssd_pages=2) as store:
        lease = store.allocate([key(1)], tier=Tier.SSD)
        store.write(lease.lease_id, 0, page(1))
        store.commit(lease.lease_id)
        assert store.lookup([key(1)]).tiers == [Tier.SSD]
        with pytest.raises(InvalidArgument, match="no GPU tier"):
            store.allocate([key(2)], tier=Tier.GPU)


# ---- an allocate never evicts the prefix it is about to reuse -----------------------------------


def test_allocate_does_not_evict_the_requests_own_prefix(store):
    store.put(keys(0, 1, 2), [page(i) for i in range(3)])  # the cached prefix; 1 page free
    # [k0 k1 k2] stored, [k3 k4] new: room for k4 would have evicted k0, the LRU block
    with pytest.raises(CapacityExhausted):
        store.allocate(keys(0, 1, 2, 3, 4))
    assert store.contains(keys(0, 1, 2)) == [True] * 3  # was [False, True, True]: a hole
    store.put([key(9)], [page(9)])  # an unrelated block fills the last page
    lease = store.allocate(keys(0, 1, 2, 3))  # evicts k9, never the prefix
    assert lease.to_write == [3]
    assert store.contains(keys(0, 1, 2, 9)) == [True, True, True, False]
    store.write(lease.lease_id, 3, page(3))
    store.commit(lease.lease_id)
    assert [p.tobytes() for p in store.read(keys(0, 1, 2, 3))] == [
        page(i).tobytes() for i in range(4)
    ]
    store.check_invariants()


def test_allocate_keeps_the_prefix_on_lower_tiers_too(tmp_path):
    # k0 sits on the SSD: demoting DRAM victims there must not push it out either.
    with make_store(tmp_path, dram_pages=2, ssd_pages=1) as store:
        store.put([key(0)], [page(0)])
        store.put(keys(1, 2), [page(1), page(2)])  # k0 demoted to the SSD
        assert store.lookup([key(0)]).tiers == [Tier.SSD]
        lease = store.allocate(keys(0, 3))  # k1 is evicted: dropped, the SSD holds k0
        assert store.contains(keys(0, 1, 2)) == [True, False, True]
        store.abort(lease.lease_id)
        store.check_invariants()
