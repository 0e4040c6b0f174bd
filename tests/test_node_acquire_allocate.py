"""AcquireAllocate against a real node process (real gRPC, real shared memory): an Acquire and an
Allocate in one round trip, for an engine step that loads a cached prefix and saves what follows
it. Each half answers as its own call would, or the call fails and nothing is leased; tenants,
their shares, their segments, sessions and the node's epoch hold as for the separate calls."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest

from clients import KVStoreClient
from proto import common_pb2 as cpb
from proto import node_pb2 as pb
from proto import node_pb2_grpc as pbg
from rpc.channel import make_channel

from conftest import TEST_NAMESPACE as NS
from conftest import TEST_PAGE_BYTES as PB
from helpers import rpc_error, wait_until
from kvstore_helpers import REPO_ROOT

ADMIN, ALICE, BOB = "admin", "tok-a", "tok-b"
TENANTS = ("--token", ADMIN, "--tenant-token", f"{ALICE}=alice", "--tenant-token", f"{BOB}=bob")


def keys(n: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in range(start, start + n)]


def pages(n: int, seed: int) -> list[np.ndarray]:
    return list(np.random.default_rng(seed).integers(0, 256, (n, PB), dtype=np.uint8))


def held(admin: KVStoreClient) -> tuple[int, int, int]:
    """DRAM pages leased (neither used nor free), live write leases, live read leases."""
    ns = admin.stats().namespaces[0]
    t = next(t for t in ns.tiers if t.tier == 2)
    return t.capacity_pages - t.used_pages - t.free_pages, ns.write_leases, ns.read_leases


def leases_of(admin: KVStoreClient, tenant: str) -> tuple[int, int]:
    """The leases and leased pages the node counts against ``tenant``'s share."""
    use = next((u for u in admin.stats().tenants if u.tenant == tenant), None)
    return (use.leases, use.leased_pages) if use else (0, 0)


def pinned(admin: KVStoreClient) -> int:
    return sum(t.pinned_blocks for t in admin.stats().namespaces[0].tiers)


def stub(address: str, token: str | None) -> pbg.NodeServiceStub:
    return pbg.NodeServiceStub(make_channel(address, token))


def request(load: list[bytes], save: list[bytes], **kw) -> pb.AcquireAllocateRequest:
    return pb.AcquireAllocateRequest(
        acquire=pb.AcquireRequest(blocks=cpb.BlockSelector(namespace=NS, keys=load)),
        allocate=pb.AllocateRequest(blocks=cpb.BlockSelector(namespace=NS, keys=save)),
        **kw,
    )


def test_one_call_loads_and_saves_in_the_tenants_own_segment(start_node):
    node = start_node(*TENANTS)
    stored, fresh = pages(3, 1), pages(2, 2)
    with (
        KVStoreClient(node.address, token=ALICE) as alice,
        KVStoreClient(node.address, token=ADMIN) as admin,
    ):
        assert alice.put(NS, stored, keys=keys(3)).stored == 3
        read, write = alice.acquire_allocate(NS, keys(3), keys(2, 3), allocate_if_loaded=True)
        assert write is not None and read.slab is write.slab  # her segment, not a shared slab
        assert read.found == [True] * 3 and len(write.to_write) == 2
        for i in range(3):
            np.testing.assert_array_equal(read.page(i), stored[i])
        for i in write.to_write:
            write.page(i)[:] = fresh[i]
        # Both leases are this run's, and counted against alice as two calls' would be.
        assert read.node_epoch == write.node_epoch != 0
        assert leases_of(admin, "alice") == (2, 5) and held(admin)[1:] == (1, 1)
        assert write.commit().stored == 2
        read.release()
        assert leases_of(admin, "alice") == (0, 0) and held(admin) == (0, 0, 0)
        got = alice.get(NS, keys=keys(5))
        for want, page in zip(stored + fresh, got):
            np.testing.assert_array_equal(want, page)
        # A page already stored is not leased again (offset -1), as with Allocate.
        read, write = alice.acquire_allocate(NS, keys(1), keys(2, 3))
        assert write is not None and write.offsets == [-1, -1]
        write.abort()
        read.release()


def test_allocate_if_loaded_leases_nothing_to_write_when_a_page_to_load_is_missing(start_node):
    node = start_node(*TENANTS)
    with (
        KVStoreClient(node.address, token=ALICE) as alice,
        KVStoreClient(node.address, token=ADMIN) as admin,
    ):
        ks = keys(3)
        assert alice.put(NS, pages(2, 1), keys=[ks[0], ks[2]]).stored == 2  # page 1 missing
        read, write = alice.acquire_allocate(NS, ks, keys(2, 3), allocate_if_loaded=True)
        assert write is None and read.found == [True, False, True]
        assert leases_of(admin, "alice") == (1, 2) and held(admin)[1:] == (0, 1)
        read.release()
        # Without it, the write lease comes all the same (a writer that does not depend on
        # what it reads).
        read, write = alice.acquire_allocate(NS, ks, keys(2, 3))
        assert write is not None and len(write.to_write) == 2
        write.abort()
        read.release()
        assert held(admin) == (0, 0, 0)


def test_bad_halves_are_invalid_arguments_and_lease_nothing(start_node):
    node = start_node(*TENANTS)
    node_stub = stub(node.address, ALICE)
    with (
        KVStoreClient(node.address, token=ALICE) as alice,
        KVStoreClient(node.address, token=ADMIN) as admin,
    ):
        assert alice.put(NS, pages(2, 1), keys=keys(2)).stored == 2
        good = request(keys(2), keys(2, 2))
        bad: dict[str, pb.AcquireAllocateRequest] = {}
        for half in ("acquire", "allocate"):
            r = pb.AcquireAllocateRequest()
            r.CopyFrom(good)
            r.ClearField(half)
            bad[f"no {half}"] = r
        bad["neither"] = pb.AcquireAllocateRequest()
        for half, field, value in (
            ("allocate", "namespace", "nope|L1"),
            ("acquire", "ttl_s", float("nan")),
            ("allocate", "ttl_s", 7200.0),
            ("acquire", "session", b"s" * 65),
            ("allocate", "session", b"s" * 65),
            ("allocate", "keys", keys(1, 2) * 2),  # a key twice: refused once the read is held
        ):
            r = pb.AcquireAllocateRequest()
            r.CopyFrom(good)
            part = getattr(r, half)
            if field == "namespace":
                part.blocks.namespace = value
            elif field == "keys":
                del part.blocks.keys[:]
                part.blocks.keys.extend(value)
            else:
                setattr(part, field, value)
            bad[f"{half} {field}"] = r
        for what, r in bad.items():
            code, details = rpc_error(lambda r=r: node_stub.AcquireAllocate(r))
            assert code is grpc.StatusCode.INVALID_ARGUMENT, (what, code, details)
            if what in ("no acquire", "no allocate", "neither"):
                assert "both halves" in details
            # Nothing leased, nothing pinned, whichever half was wrong.
            assert leases_of(admin, "alice") == (0, 0), what
            assert held(admin) == (0, 0, 0) and pinned(admin) == 0, what
        assert "duplicates" in rpc_error(lambda: node_stub.AcquireAllocate(bad["allocate keys"]))[1]
        # The good request is served.
        reply = node_stub.AcquireAllocate(good)
        assert list(reply.acquire.keys) == keys(2) and list(reply.allocate.keys) == keys(2, 2)


def test_a_tenant_reaches_neither_another_tenants_pages_nor_its_leases(start_node):
    node = start_node(*TENANTS)
    bobs = pages(2, 3)
    with (
        KVStoreClient(node.address, token=ALICE) as alice,
        KVStoreClient(node.address, token=BOB) as bob,
    ):
        assert bob.put(NS, bobs, keys=keys(2)).stored == 2
        # Bob's keys, named by alice, are alice's own: nothing to load, so nothing to save.
        read, write = alice.acquire_allocate(NS, keys(2), keys(1, 2), allocate_if_loaded=True)
        assert read.found == [False, False] and write is None
        read.release()
        # Saving under bob's keys writes alice's blocks, never bob's pages.
        read, write = alice.acquire_allocate(NS, keys(1, 5), keys(2))
        assert write is not None and len(write.to_write) == 2
        for i in write.to_write:
            write.page(i)[:] = 0xEE
        # Bob cannot end (or commit) alice's leases: they do not exist for him.
        bob_stub = stub(node.address, BOB)
        for rpc, lease in (("Commit", write), ("Abort", write), ("Release", read)):
            ask = pb.LeaseRequest(namespace=NS, lease_id=lease.lease_id)
            code, _ = rpc_error(lambda rpc=rpc, ask=ask: getattr(bob_stub, rpc)(ask))
            assert code is grpc.StatusCode.NOT_FOUND, rpc
        assert write.commit().stored == 2
        read.release()
        for want, got in zip(bobs, bob.get(NS, keys=keys(2))):
            np.testing.assert_array_equal(want, got)
        assert all(p is not None and (p == 0xEE).all() for p in alice.get(NS, keys=keys(2)))


def test_both_halves_count_against_the_tenants_share_and_a_refused_half_leases_nothing(
    start_node,
):
    # 128 DRAM pages: alice may lease 32 of them, in at most 3 leases.
    node = start_node(*TENANTS, "--tenant-lease-share", "0.25", "--tenant-max-leases", "3")
    with (
        KVStoreClient(node.address, token=ALICE) as alice,
        KVStoreClient(node.address, token=ADMIN) as admin,
    ):
        assert alice.put(NS, pages(4, 1), keys=keys(4)).stored == 4
        big = alice.allocate(NS, keys=keys(26, 100), ttl_s=600)
        # The read (4 pages: 30) fits, the write (4 more: 34) does not: neither is held.
        code, details = rpc_error(lambda: alice.acquire_allocate(NS, keys(4), keys(4, 10)))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "--tenant-lease-share" in details
        assert leases_of(admin, "alice") == (1, 26) and pinned(admin) == 0
        big.abort()
        small = [alice.allocate(NS, keys=keys(1, 200 + i), ttl_s=600) for i in range(2)]
        # Two leases held; the call needs two more, the third leaves no room for the fourth.
        code, details = rpc_error(lambda: alice.acquire_allocate(NS, keys(4), keys(1, 10)))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "--tenant-max-leases" in details
        assert leases_of(admin, "alice") == (2, 2) and pinned(admin) == 0
        small[0].abort()
        read, write = alice.acquire_allocate(NS, keys(4), keys(1, 10))
        assert write is not None and leases_of(admin, "alice") == (3, 6)
        write.abort()
        read.release()
        small[1].abort()
        assert leases_of(admin, "alice") == (0, 0)


def test_a_lease_of_an_earlier_run_of_the_node_is_not_found(start_node):
    node = start_node()
    with KVStoreClient(node.address) as c:
        c.put(NS, pages(1, 1), keys=keys(1))
        read, write = c.acquire_allocate(NS, keys(1), keys(1, 1))
        assert write is not None
        for lease in (read, write):
            code, details = rpc_error(
                lambda lease=lease: stub(node.address, None).Release(
                    pb.LeaseRequest(
                        namespace=NS, lease_id=lease.lease_id, node_epoch=lease.node_epoch ^ 1
                    )
                )
            )
            assert code is grpc.StatusCode.NOT_FOUND and "earlier run" in details
        write.commit()
        read.release()


# A same-host client that takes both leases in one call, says so and blocks (to be killed).
HOLD_BOTH = """
import sys
from clients import KVStoreClient
address, token, load, save = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
c = KVStoreClient(address, token)
ns = c.namespaces()[0]
load = [bytes.fromhex(k) for k in load.split(",")]
save = [bytes.fromhex(k) for k in save.split(",")]
read, write = c.acquire_allocate(ns, load, save, ttl_s=600, allocate_if_loaded=True)
write.page(0)[:] = 7  # mid-write
print(sum(read.found), len(write.to_write), flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("tenants", [False, True], ids=["shm-by-name", "tenant-memfds"])
def test_a_client_killed_holding_both_leases_gives_them_back_at_once(start_node, tenants):
    node = start_node(*(TENANTS if tenants else ()), "--lease-ttl", "60")
    token = ALICE if tenants else ""
    with (
        KVStoreClient(node.address, token or None) as c,
        KVStoreClient(node.address, ADMIN if tenants else None) as admin,
    ):
        assert c.put(NS, pages(4, 1), keys=keys(4)).stored == 4
        load, save = ",".join(k.hex() for k in keys(4)), ",".join(k.hex() for k in keys(8, 4))
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD_BOTH, node.address, token, load, save],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline().split() == ["4", "8"]
            assert held(admin) == (8, 1, 1) and pinned(admin) == 4
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            # Far sooner than the leases' 600 s (and the write quarantine after them).
            wait_until(lambda: held(admin) == (0, 0, 0), 5, "the dead client's leases to end")
            assert pinned(admin) == 0
        finally:
            proc.kill()
            proc.wait(10)


# ---- CommitRelease --------------------------------------------------------------------------


def end_both(write, read, checksums: bytes = b"") -> pb.CommitReleaseRequest:
    commit = pb.LeaseRequest(
        namespace=NS, lease_id=write.lease_id, node_epoch=write.node_epoch, checksums=checksums
    )
    release = pb.LeaseRequest(namespace=NS, lease_id=read.lease_id, node_epoch=read.node_epoch)
    return pb.CommitReleaseRequest(commit=commit, release=release)


def test_one_call_commits_and_releases_and_the_read_ends_whatever_the_commit(start_node):
    node = start_node(*TENANTS)
    fresh = pages(2, 2)
    with (
        KVStoreClient(node.address, token=ALICE) as alice,
        KVStoreClient(node.address, token=ADMIN) as admin,
    ):
        alice_stub = stub(node.address, ALICE)
        assert alice.put(NS, pages(2, 1), keys=keys(2)).stored == 2
        read, write = alice.acquire_allocate(NS, keys(2), keys(2, 2))
        assert write is not None
        for i in write.to_write:
            write.page(i)[:] = fresh[i]
        assert alice.commit_release(write, read).stored == 2
        assert leases_of(admin, "alice") == (0, 0) and held(admin) == (0, 0, 0)
        for want, got in zip(fresh, alice.get(NS, keys=keys(2, 2))):
            np.testing.assert_array_equal(want, got)
        # A commit refused (checksums of the wrong length): the read ends, the write stays open.
        read, write = alice.acquire_allocate(NS, keys(2), keys(2, 4))
        assert write is not None
        code, _ = rpc_error(lambda: alice_stub.CommitRelease(end_both(write, read, b"x" * 9)))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert held(admin)[1:] == (1, 0) and pinned(admin) == 0
        # A read lease that ended already is no error: the commit is made.
        reply = alice_stub.CommitRelease(end_both(write, read))
        assert reply.commit.stored == 2 and not reply.released
        assert leases_of(admin, "alice") == (0, 0) and held(admin) == (0, 0, 0)


def test_bad_commit_release_requests_end_nothing_and_no_tenant_ends_anothers(start_node):
    node = start_node(*TENANTS)
    with (
        KVStoreClient(node.address, token=ALICE) as alice,
        KVStoreClient(node.address, token=ADMIN) as admin,
    ):
        assert alice.put(NS, pages(2, 1), keys=keys(2)).stored == 2
        read, write = alice.acquire_allocate(NS, keys(2), keys(2, 2))
        assert write is not None
        good = end_both(write, read)
        bad = {}
        for half in ("commit", "release"):
            r = pb.CommitReleaseRequest()
            r.CopyFrom(good)
            r.ClearField(half)
            bad[f"no {half}"] = r
        r = pb.CommitReleaseRequest()
        r.CopyFrom(good)
        r.release.namespace = "nope|L1"
        bad["release namespace"] = r
        alice_stub = stub(node.address, ALICE)
        for what, r in bad.items():
            code, details = rpc_error(lambda r=r: alice_stub.CommitRelease(r))
            assert code is grpc.StatusCode.INVALID_ARGUMENT, (what, details)
            assert leases_of(admin, "alice") == (2, 4), what  # neither lease ended
        # Bob names alice's leases: not found, and neither of them ends.
        code, _ = rpc_error(lambda: stub(node.address, BOB).CommitRelease(good))
        assert code is grpc.StatusCode.NOT_FOUND
        assert leases_of(admin, "alice") == (2, 4) and pinned(admin) == 2
        reply = alice_stub.CommitRelease(good)
        assert reply.commit.stored == 2 and reply.released
        assert leases_of(admin, "alice") == (0, 0) and held(admin) == (0, 0, 0)


def test_a_commits_hold_pins_within_the_tenants_share_and_bad_holds_are_refused(start_node):
    """Commit's ``hold_s``: the pages stay pinned under a read lease of the committer's tenant,
    counted in its share, that nobody releases; a tenant at its lease count gets its commit
    (only no pin); a hold out of [0, 60] s is INVALID_ARGUMENT and the lease stays open."""
    node = start_node(*TENANTS, "--tenant-max-leases", "2")
    with (
        KVStoreClient(node.address, token=ALICE) as alice,
        KVStoreClient(node.address, token=ADMIN) as admin,
    ):
        lease = alice.allocate(NS, keys=keys(2, 700), ttl_s=600)
        for i, p in enumerate(pages(2, 9)):
            np.copyto(lease.page(i), p)
        for bad in (60.5, -1.0, float("nan")):
            code, details = rpc_error(lambda b=bad: alice.commit(lease, hold_s=b))
            assert code is grpc.StatusCode.INVALID_ARGUMENT and "hold_s" in details
        assert leases_of(admin, "alice") == (1, 2)  # still open
        assert alice.commit(lease, hold_s=30).stored == 2
        assert pinned(admin) == 2 and leases_of(admin, "alice") == (1, 2)  # the hold
        # alice holds 2 leases now (the hold and this one): the next commit's hold has no room
        other = alice.allocate(NS, keys=keys(1, 710), ttl_s=600)
        np.copyto(other.page(0), pages(1, 10)[0])
        assert alice.commit(other, hold_s=30).stored == 1  # committed, not pinned
        assert pinned(admin) == 2 and leases_of(admin, "alice") == (1, 2)
        got = alice.get(NS, keys=keys(2, 700) + keys(1, 710))
        assert all(np.array_equal(g, p) for g, p in zip(got, pages(2, 9) + pages(1, 10)))
