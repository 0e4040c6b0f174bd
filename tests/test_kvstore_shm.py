"""The DRAM tier's shared memory, seen and written by a second process."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore import InvalidArgument, SharedSlab, StorageError, StoreConfig, TieredStore
from kvstore.shm import (
    pid_alive,
    prefault,
    shm_free_bytes,
    shm_identity,
    sweep_orphans,
    unique_shm_name,
)

from kvstore_helpers import LAYOUT, REPO_ROOT, key, keys, make_store, page, run_python

# The other process knows only the slab's name, the page size and a slot, as a messenger or a
# same-host client does.
READ_PAGE = """
import sys, xxhash
from kvstore import SharedSlab
name, page_bytes, slot = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
slab = SharedSlab.attach(name)
print(xxhash.xxh3_64_hexdigest(slab.array[slot * page_bytes:(slot + 1) * page_bytes]))
slab.close()
"""

WRITE_PAGE = """
import sys, numpy as np
from kvstore import SharedSlab
name, page_bytes, slot, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
data = np.random.default_rng(seed).integers(0, 256, page_bytes, dtype=np.uint8)
slab = SharedSlab.attach(name)
slab.array[slot * page_bytes:(slot + 1) * page_bytes] = data
slab.close()
"""


def xxh64(data: np.ndarray) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(data.view(np.uint8))


def test_another_process_reads_pages_the_store_wrote():
    with make_store(dram_pages=4) as store:
        store.put(keys(1, 2, 3), [page(1), page(2), page(3)])
        lease = store.acquire(keys(3, 1))  # pinned while the other side reads
        for i, seed in enumerate((3, 1)):
            proc = run_python(
                READ_PAGE, store.shm_name, str(LAYOUT.page_bytes), str(lease.slots[i])
            )
            assert proc.stdout.strip() == xxh64(page(seed))
        store.release(lease.lease_id)
        # the reader's exit did not take the segment with it
        assert os.path.exists(f"/dev/shm/{store.shm_name}")
        assert store.read([key(2)])[0].tobytes() == page(2).tobytes()


def test_another_process_writes_a_leased_page_and_the_store_publishes_it():
    with make_store(dram_pages=4) as store:
        lease = store.allocate(keys(5, 6))
        for i, seed in enumerate((5, 6)):
            run_python(
                WRITE_PAGE, store.shm_name, str(LAYOUT.page_bytes), str(lease.slots[i]), str(seed)
            )
        assert store.lookup(keys(5)).hits == 0  # written, not yet published
        store.commit(lease.lease_id)
        got = store.read(keys(5, 6))
        assert [g.tobytes() for g in got] == [page(5).tobytes(), page(6).tobytes()]


def test_the_slab_is_unlinked_when_the_store_closes():
    name = unique_shm_name("kvtest")
    store = make_store(dram_pages=2, shm_name=name)
    assert store.shm_name == name and os.path.exists(f"/dev/shm/{name}")
    store.put([key(1)], [page(1)])
    held = store.read([key(1)])[0]  # a copy, unaffected by close
    store.close()
    store.close()  # idempotent
    assert not os.path.exists(f"/dev/shm/{name}")
    assert held.tobytes() == page(1).tobytes()
    with pytest.raises(StorageError, match="does not exist"):
        SharedSlab.attach(name)


def test_close_with_a_live_page_view_still_unlinks():
    name = unique_shm_name("kvtest")
    store = make_store(dram_pages=2, shm_name=name)
    store.put([key(1)], [page(1)])
    lease = store.acquire([key(1)])
    view = store.page_view(lease, 0)  # keeps the mapping alive
    store.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    assert view.tobytes() == page(1).tobytes()  # still mapped, still safe to read
    del view


def test_slab_names_and_sizes_are_checked():
    name = unique_shm_name("kvtest")
    with SharedSlab.create(name, 4096) as slab:
        assert slab.size == 4096 and slab.array.nbytes == 4096
        with pytest.raises(StorageError, match="already exists"):
            SharedSlab.create(name, 4096)
        other = SharedSlab.attach(name)
        other.array[:4] = [1, 2, 3, 4]
        assert slab.array[:4].tolist() == [1, 2, 3, 4]
        other.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    for bad in ("", "a/b"):
        with pytest.raises(StorageError, match="invalid shared memory name"):
            SharedSlab.create(bad, 4096)
    with pytest.raises(StorageError, match="positive size"):
        SharedSlab.create(unique_shm_name("kvtest"), 0)
    with pytest.raises(StorageError, match="does not exist"):
        SharedSlab.attach(unique_shm_name("kvtest-missing"))


def test_a_taken_shm_name_is_a_clear_error():
    name = unique_shm_name("kvtest")
    with make_store(dram_pages=1, shm_name=name):
        with pytest.raises(StorageError, match="already exists"):
            make_store(dram_pages=1, shm_name=name)


def test_a_store_never_closed_still_unlinks_its_slab_at_exit():
    name = unique_shm_name("kvtest")
    code = (
        "import sys\n"
        "from kvstore import KVLayout, StoreConfig, TieredStore\n"
        "layout = KVLayout(model='m', num_layers=1, kv_heads=1, head_dim=8)\n"
        "store = TieredStore(layout, StoreConfig(dram_pages=2, shm_name=sys.argv[1]))\n"
        "import os; print(os.path.exists('/dev/shm/' + sys.argv[1]))\n"
    )
    assert run_python(code, name).stdout.strip() == "True"
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.parametrize(
    "cfg", [dict(dram_policy="nope"), dict(ssd_pages=2, ssd_policy="nope"), dict(ssd_pages=2)]
)
def test_a_store_that_fails_to_open_leaves_no_slab(cfg):
    name = unique_shm_name("kvtest")
    with pytest.raises(InvalidArgument, match="policy|ssd_dir"):
        TieredStore(LAYOUT, StoreConfig(dram_pages=2, shm_name=name, **cfg))
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.parametrize("reserve", [False, True])
def test_a_slab_beyond_the_free_shared_memory_is_refused(reserve):
    free = shm_free_bytes()
    if free is None:
        pytest.skip("/dev/shm has no size limit here")
    name = unique_shm_name("kvtest")
    with pytest.raises(StorageError, match="lower --dram, or enlarge /dev/shm"):
        SharedSlab.create(name, free + (1 << 30), reserve=reserve)
    assert not os.path.exists(f"/dev/shm/{name}")


# ---- the start-up sweep of orphaned slabs --------------------------------------------------------


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: no process has this pid now (short of a quick reuse)
    return proc.pid


def test_the_sweep_removes_only_dead_slabs_made_under_this_identity(tmp_path):
    ident = shm_identity()
    assert ident is not None and unique_shm_name().startswith(f"kvcache-{ident}-{os.getpid()}-")
    other = format(int(ident, 16) ^ 1, "08x")
    dead = dead_pid()
    names = {
        f"kvcache-{ident}-{dead}-00000001": True,  # ours, creator gone: an orphan
        f"kvcache-{ident}-{os.getpid()}-00000002": False,  # ours, creator alive
        f"kvcache-{other}-{dead}-00000003": False,  # another PID namespace (or boot): its pid
        f"kvcache-{dead}-00000004": False,  # an older name without identity: cannot tell
        f"kvtest-{ident}-{dead}-00000005": False,  # not a node's slab
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    if os.getuid() == 0:  # another user's orphan under our identity: not ours to remove
        foreign = tmp_path / f"kvcache-{ident}-{dead}-00000006"
        foreign.write_bytes(b"x")
        os.chown(foreign, 65534, 65534)
        names[foreign.name] = False
    assert sweep_orphans(str(tmp_path)) == [n for n, orphan in names.items() if orphan]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        n for n, orphan in names.items() if not orphan
    )


# A process in a PID namespace of its own (as in a container sharing the host's /dev/shm) makes
# a slab from a pid that no process has in ours, and lives on.
IN_ANOTHER_PID_NAMESPACE = """
import os, sys
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write("3999999")
if os.fork() == 0:
    from kvstore import SharedSlab
    from kvstore.shm import unique_shm_name
    slab = SharedSlab.create(unique_shm_name(), 4096)
    print(os.getpid(), slab.name, flush=True)
    sys.stdin.read()  # live until the test closes our stdin
    slab.close()
    slab.unlink()
    os._exit(0)
os.wait()
"""


def test_the_sweep_keeps_a_live_slab_of_another_pid_namespace():
    if pid_alive(4000000):
        pytest.skip("pid 4000000 runs here")
    proc = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-c",
            IN_ANOTHER_PID_NAMESPACE,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        line = proc.stdout.readline().split()
        if not line:
            proc.stdin.close()
            pytest.skip(f"cannot run in a new PID namespace (needs root): {proc.stderr.read()}")
        pid, name = int(line[0]), line[1]
        assert pid == 4000000 and not pid_alive(pid)  # to us its creator looks dead
        assert name not in sweep_orphans()
        assert os.path.exists(f"/dev/shm/{name}")
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert not os.path.exists(f"/dev/shm/{name}")


# ---- DRAM page checksums ---------------------------------------------------------------------


def test_a_dram_page_scribbled_on_after_commit_is_dropped_on_copy_out():
    with make_store(dram_pages=4) as store:
        lease = store.allocate(keys(1, 2))
        for i in lease.to_write:
            store.page_view(lease, i)[:] = page(i + 1).view(np.uint8)  # in place, as a client
        store.commit(lease.lease_id)
        slot = store.acquire(keys(1)).slots[0]
        # the writer kept its view of the slab and scribbles on the committed page
        slab = SharedSlab.attach(store.shm_name)
        slab.array[slot * LAYOUT.page_bytes + 7] ^= 0xFF
        slab.close()
        assert store.read(keys(1, 2))[0] is None  # caught, not served
        assert store.read(keys(2))[0].tobytes() == page(2).tobytes()
        assert store.contains(keys(1, 2)) == [False, True]  # dropped
        assert store.stats().corrupt_pages == 1
        store.check_invariants()


def test_without_dram_checksums_pages_are_served_as_they_are():
    with make_store(dram_pages=2, dram_checksums=False) as store:
        store.put(keys(1), [page(1)])
        lease = store.acquire(keys(1))
        assert store.checksums(lease) == [0]  # none kept: readers have nothing to check against
        slab = SharedSlab.attach(store.shm_name)
        slab.array[lease.slots[0] * LAYOUT.page_bytes + 7] ^= 0xFF  # a late writer scribbles
        slab.close()
        store.release(lease.lease_id)
        got = store.read(keys(1))[0]
        assert got is not None and got.tobytes() != page(1).tobytes()  # served: the trade-off
        assert store.stats().corrupt_pages == 0
        store.put(keys(2, 3), [page(2), page(3)])  # slot reuse: no stale seal left behind
        assert [x.tobytes() for x in store.read(keys(2, 3))] == [
            page(2).tobytes(),
            page(3).tobytes(),
        ]
        store.check_invariants()


def test_checksums_of_dram_pages_are_what_readers_check_against():
    import xxhash

    with make_store(dram_pages=4) as store:
        store.put(keys(1, 2), [page(1), page(2)])
        lease = store.acquire(keys(1, 3, 2))
        assert store.checksums(lease) == [
            xxhash.xxh3_64_intdigest(page(1).view(np.uint8)),
            0,  # missing
            xxhash.xxh3_64_intdigest(page(2).view(np.uint8)),
        ]
        store.release(lease.lease_id)


def test_a_page_written_whole_is_sealed_with_the_hash_taken_as_it_was_copied():
    """``write`` hashes a page as it copies it (commit seals with that, no second pass); a page
    changed after, by a layer write or in place, is hashed at commit: never a stale seal."""
    import xxhash

    def digest(i: int) -> int:
        return xxhash.xxh3_64_intdigest(page(i).view(np.uint8))

    with make_store(dram_pages=8) as store:
        lease = store.allocate(keys(1, 2, 3))
        for i in lease.to_write:
            store.write(lease.lease_id, i, page(i + 1))
        # page 2 gets page 7's first layer afterwards: its write-time hash is stale
        store.write_layer(
            lease.lease_id, 0, np.stack([page(7).view(np.uint8)] * 3)[:, : LAYOUT.layer_bytes]
        )
        store.commit(lease.lease_id)
        got = store.read(keys(1, 2, 3))
        assert all(p is not None for p in got)  # sealed with what they hold: none dropped
        want = [page(i).view(np.uint8).copy() for i in (1, 2, 3)]
        for w in want:
            w[: LAYOUT.layer_bytes] = page(7).view(np.uint8)[: LAYOUT.layer_bytes]
        assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
        lease = store.allocate(keys(4, 5))
        store.write(lease.lease_id, 0, page(4))
        store.write(lease.lease_id, 1, page(5))
        view = store.page_view(lease, 1)
        view[:] = page(6).view(np.uint8)  # in place, after the write: committed as in place
        store.commit(lease.lease_id, written_in_place=True)
        read = store.acquire(keys(4, 5))
        assert store.checksums(read) == [digest(4), digest(6)]
        store.release(read.lease_id)
        assert [p.tobytes() for p in store.read(keys(4, 5))] == [
            page(4).tobytes(),
            page(6).tobytes(),
        ]
        assert store.stats().corrupt_pages == 0
        store.check_invariants()


def test_a_page_demoted_and_promoted_back_keeps_a_checksum(tmp_path):
    with make_store(dram_pages=1, ssd_pages=4, ssd_dir=str(tmp_path)) as store:
        store.put(keys(1), [page(1)])
        store.put(keys(2), [page(2)])  # demotes 1 to the SSD
        lease = store.acquire(keys(1), into="DRAM")  # promotes it back
        assert store.checksums(lease)[0] != 0
        store.release(lease.lease_id)
        assert store.read(keys(1))[0].tobytes() == page(1).tobytes()


# ---- memfd segments: no name, handed over as a descriptor --------------------------------------


def test_a_private_dram_pool_creates_nothing_in_dev_shm():
    before = set(os.listdir("/dev/shm"))
    with make_store(dram_pages=4, private_dram=True) as store:
        assert store.shm_name is None
        store.put(keys(1), [page(1)])
        assert store.read(keys(1))[0].tobytes() == page(1).tobytes()
        assert set(os.listdir("/dev/shm")) - before == set()


def test_a_memfd_segment_is_sealed_against_resizing():
    from kvstore.shm import MemfdSegment

    seg = MemfdSegment(1 << 16)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 0)  # would make the owner's next access a SIGBUS
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 1 << 20)
        seg.array[:4096] = 7
        seg.punch(0, 4096)
        assert not seg.array[:4096].any()
    finally:
        seg.close()


@pytest.mark.parametrize("reserve", [False, True])
def test_a_prefaulted_mapping_takes_no_page_faults_when_written(reserve):
    """A second mapping of a slab (a messenger's or an engine's), prefaulted: writing all of it
    faults no page in (a fresh mapping faults once per 4 KiB page, even when the creator touched
    them all); without prefault it would."""
    import resource

    size = 16 << 20
    with SharedSlab.create(unique_shm_name("test-prefault"), size, reserve=reserve) as slab:
        slab.array[:] = 1  # the creator touched every page
        other = SharedSlab.attach(slab.name)
        cold = SharedSlab.attach(slab.name)
        try:
            assert prefault(other.array)
            for mapping, at_most in ((other, 256), (cold, None)):
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                mapping.array[:] = 2
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
                if at_most is not None:
                    assert faults < at_most, faults
                else:  # the reference: the same write through a mapping not prefaulted
                    assert faults >= size // 4096 // 2, faults
            assert int(slab.array.min()) == int(slab.array.max()) == 2  # one memory, shared
        finally:
            other.close()
            cold.close()
