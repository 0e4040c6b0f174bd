"""The node server as users see it: a real `kvcache node` process, the client library, raw gRPC."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from clients import KVCacheRpcError, KVStoreClient
from clients.node_client import WriteLease
from kvstore.tiers import Tier
from proto import common_pb2 as cpb
from proto import node_pb2 as pb
from proto import node_pb2_grpc as pbg
from rpc.channel import make_channel

from conftest import TEST_BLOCK_TOKENS, TEST_NAMESPACE, TEST_PAGE_BYTES, shm_exists
from helpers import rpc_error, wait_until

NS = TEST_NAMESPACE


def pages_for(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, TEST_PAGE_BYTES, dtype=np.uint8) for _ in range(n)]


def tokens(n_blocks: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n_blocks * TEST_BLOCK_TOKENS, dtype=np.int64)


def stub(address: str, token: str | None = None) -> pbg.NodeServiceStub:
    return pbg.NodeServiceStub(make_channel(address, token))


# ---- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "streamed"])
def test_round_trip_bytes_identical(start_node, use_shm):
    node = start_node()
    pages = pages_for(6, seed=1)
    with KVStoreClient(node.address, use_shm=use_shm) as c:
        assert c.shm_available(NS) is use_shm
        assert c.lookup(NS, tokens=tokens(6)).hit_blocks == 0
        assert c.put(NS, pages, tokens=tokens(6)).stored == 6
        hit = c.lookup(NS, tokens=tokens(8))
        assert (hit.hit_blocks, hit.total_blocks) == (6, 8)
        assert hit.tiers == [Tier.DRAM] * 6
        got = c.get(NS, tokens=tokens(8))
        assert got[6:] == [None, None]
        for want, have in zip(pages, got[:6]):
            np.testing.assert_array_equal(want, have)


def test_a_put_through_shared_memory_commits_the_checksums_it_took_as_it_copied(
    start_node, monkeypatch
):
    """The client hashes each page as it copies it into the node's shared memory and the
    Commit carries the checksums (a page stored already: 0, ignored); the node keeps them, and
    they are the pages' own."""
    sent = []
    commit = KVStoreClient.commit

    def spy(self, lease, checksums=None):
        sent.append(None if checksums is None else list(checksums))
        return commit(self, lease, checksums)

    monkeypatch.setattr(KVStoreClient, "commit", spy)
    node = start_node()
    pages = pages_for(4, seed=9)
    with KVStoreClient(node.address) as c:
        c.put(NS, pages[:1], tokens=tokens(1))
        assert c.put(NS, pages, tokens=tokens(4)).stored == 3
        with c.acquire(NS, tokens=tokens(4)) as pinned:
            kept = list(pinned.checksums)
    assert kept == [xxhash.xxh3_64_intdigest(p) for p in pages]
    assert sent == [kept[:1], [0, *kept[1:]]]


def test_shared_memory_writer_and_streamed_reader_agree(start_node):
    node = start_node()
    pages = pages_for(3, seed=2)
    with KVStoreClient(node.address) as local, KVStoreClient(node.address, use_shm=False) as remote:
        lease = local.allocate(NS, tokens=tokens(3))
        assert lease.to_write == [0, 1, 2]
        for i in lease.to_write:
            lease.page(i)[:] = pages[i]
        assert local.lookup(NS, tokens=tokens(3)).hit_blocks == 0  # invisible before commit
        assert lease.commit().stored == 3
        for want, have in zip(pages, remote.get(NS, tokens=tokens(3))):
            np.testing.assert_array_equal(want, have)
        with local.acquire(NS, tokens=tokens(5), prefix_only=True) as pinned:
            assert pinned.hit_blocks == 3
            np.testing.assert_array_equal(pinned.page(1), pages[1])
            assert not pinned.page(1).flags.writeable


def test_async_calls_pipeline_a_batched_write_and_read(start_node):
    """allocate_async / commit_async / acquire_async / release_async: the next batch's lease is
    taken while this one is copied; pages, results and errors as the blocking calls give them."""
    node = start_node()
    pages = pages_for(6, seed=9)
    with KVStoreClient(node.address) as c:
        first = c.allocate_async(NS, tokens=tokens(2))
        second = c.allocate_async(NS, tokens=tokens(4, start=2 * TEST_BLOCK_TOKENS))
        lease = first.result()
        for i in lease.to_write:
            lease.page(i)[:] = pages[i]
        done = c.commit_async(lease)
        lease2 = second.result()  # blocks 2..5 as a chain of their own
        for i in lease2.to_write:
            lease2.page(i)[:] = pages[2 + i]
        assert done.result().stored == 2 and c.commit_async(lease2).result().stored == 4
        reads = [c.acquire_async(NS, tokens=tokens(2)), c.acquire_async(NS, tokens=tokens(3))]
        r1, r2 = (f.result() for f in reads)
        assert r1.hit_blocks == 2 and r2.found == [True, True, False]
        for i in range(2):
            np.testing.assert_array_equal(r2.page(i), pages[i])
        assert c.release_async(r1).result() is None and c.release_async(r2).result() is None
        again = c.release_async(r1)  # a server's refusal comes with the result
        with pytest.raises(KVCacheRpcError) as err:
            again.result()
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(KVCacheRpcError, match="not served"):  # a client's, at once
            c.acquire_async("no|such|namespace", tokens=tokens(1))


def test_layer_wise_write_through_lease_views(start_node):
    node = start_node()
    with KVStoreClient(node.address) as c:
        layout = c.layout(NS)
        lease = c.allocate(NS, tokens=tokens(1))
        for layer in range(layout.num_layers):
            lease.layer(0, layer, layout)[:] = layer + 1
        lease.commit()
        page = c.get(NS, tokens=tokens(1))[0]
        for layer in range(layout.num_layers):
            off = layout.layer_offset(layer)
            assert (page[off : off + layout.layer_bytes] == layer + 1).all()


def test_keys_and_tokens_name_the_same_blocks(start_node):
    from kvstore.keys import block_keys, root_key

    node = start_node()
    keys = block_keys(tokens(4), TEST_BLOCK_TOKENS, root_key(NS, b"s1"))
    with KVStoreClient(node.address) as c:
        c.put(NS, pages_for(4, 3), tokens=tokens(4), salt=b"s1")
        assert c.lookup(NS, keys=keys).hit_blocks == 4
        assert c.lookup(NS, tokens=tokens(4), salt=b"other").hit_blocks == 0
        lease = c.acquire(NS, tokens=tokens(4), salt=b"s1")
        assert lease.keys == keys
        lease.release()


# ---- concurrency ---------------------------------------------------------------------------------


def test_two_writers_same_key_one_wins_no_corruption(start_node):
    node = start_node()
    a, b = pages_for(1, 10)[0], pages_for(1, 11)[0]
    results = {}
    barrier = threading.Barrier(2)

    def writer(name, page):
        with KVStoreClient(node.address) as c:
            lease = c.allocate(NS, tokens=tokens(1))
            barrier.wait(10)
            if lease.to_write:
                lease.page(0)[:] = page
                results[name] = lease.commit()
            else:
                results[name] = "already stored"
                lease.abort()

    threads = [threading.Thread(target=writer, args=(n, p)) for n, p in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    stored = [r.stored for r in results.values() if not isinstance(r, str)]
    assert sum(stored) == 1
    with KVStoreClient(node.address) as c:
        got = c.get(NS, tokens=tokens(1))[0]
    assert (got == a).all() or (got == b).all()


# ---- leases and faults ---------------------------------------------------------------------------


@pytest.mark.slow
def _allocate_or_none(client: KVStoreClient, toks) -> WriteLease | None:
    try:
        return client.allocate(NS, tokens=toks)
    except KVCacheRpcError as e:
        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "pinned" in e.details
        return None


def test_pins_of_a_killed_client_expire(start_node):
    node = start_node("--lease-ttl", "1.5", dram="32KiB")  # 4 pages
    with KVStoreClient(node.address) as c:
        c.put(NS, pages_for(4, 4), tokens=tokens(4))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        from clients import KVStoreClient
        import numpy as np
        c = KVStoreClient({node.address!r})
        lease = c.acquire({NS!r}, tokens=np.arange({4 * TEST_BLOCK_TOKENS}))
        print(lease.hit_blocks, flush=True)
        time.sleep(600)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "4"
        with KVStoreClient(node.address) as c:
            with pytest.raises(KVCacheRpcError) as e:
                c.allocate(NS, tokens=tokens(1, start=10_000))
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "pinned" in e.value.details
            holder.kill()
            holder.wait(5)
            # Its pins end (at once now that the node sees it gone; at the latest after their
            # lease time): then the next allocation may evict.
            lease = wait_until(
                lambda: _allocate_or_none(c, tokens(1, start=10_000)), 30, "the pins to end"
            )
            assert lease.to_write == [0]
            lease.abort()
    finally:
        holder.kill()


@pytest.mark.slow
def test_write_lease_expires_and_its_pages_return(start_node):
    node = start_node("--lease-ttl", "1", "--write-quarantine", "2", dram="16KiB")  # 2 pages
    with KVStoreClient(node.address) as c:
        dead = c.allocate(NS, tokens=tokens(2))
        with pytest.raises(KVCacheRpcError) as e:
            c.allocate(NS, tokens=tokens(1, start=500))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        wait_until(lambda: c.stats().namespaces[0].expired_leases == 1, 30, "the lease to expire")
        with pytest.raises(KVCacheRpcError) as e:
            dead.commit()
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "quarantined" in e.value.details
        # Held back from reuse for --write-quarantine after the deadline, then back in the pool.
        deadline = time.monotonic() + 30  # generous: the quarantine is 2 s
        while True:
            try:
                c.allocate(NS, tokens=tokens(2, start=500)).abort()
                break
            except KVCacheRpcError as e:
                assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "quarantined" in e.details
                assert time.monotonic() < deadline, "the quarantined pages never came back"
                time.sleep(0.2)


def test_a_late_shared_memory_writer_cannot_corrupt_the_next_writers_page(start_node):
    node = start_node("--lease-ttl", "1", dram="16KiB")  # 2 pages; quarantine 3 s
    mine, theirs = pages_for(2, seed=21)
    with KVStoreClient(node.address) as slow, KVStoreClient(node.address) as fast:
        assert slow.shm_available(NS)
        late = slow.allocate(NS, tokens=tokens(1))
        view = late.page(0)  # mapped once, as a layer-wise writer does
        # It stalls past its lease, until the node's reaper has swept it.
        wait_until(lambda: fast.stats().namespaces[0].expired_leases == 1, 30, "the expiry")
        lease = fast.allocate(NS, tokens=tokens(1, start=500))
        lease.page(0)[:] = theirs
        lease.commit()
        view[:] = mine  # the slow writer wakes up: its page is quarantined, nobody else's
        got = fast.get(NS, tokens=tokens(1, start=500))[0]
        np.testing.assert_array_equal(got, theirs)  # was overwritten with the late bytes
        with pytest.raises(KVCacheRpcError) as e:
            late.commit()
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "not trusted" in e.value.details


def test_allocate_never_evicts_the_prefix_it_reuses(start_node):
    node = start_node(dram="32KiB")  # 4 pages
    pages = pages_for(5, seed=5)
    with KVStoreClient(node.address) as c, KVStoreClient(node.address, use_shm=False) as s:
        c.put(NS, pages[:3], tokens=tokens(3))  # the cached prefix; one page free
        for call in (
            lambda: c.allocate(NS, tokens=tokens(5)),  # blocks 3, 4 new: one page short
            lambda: s.put(NS, pages, tokens=tokens(5)),  # a streamed Put allocates the same way
        ):
            with pytest.raises(KVCacheRpcError) as e:
                call()
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert c.lookup(NS, tokens=tokens(5)).hit_blocks == 3  # was 0: block 0 evicted
        lease = c.allocate(NS, tokens=tokens(4))
        assert lease.to_write == [3]
        lease.page(3)[:] = pages[3]
        lease.commit()
        got = c.get(NS, tokens=tokens(4))
        for want, have in zip(pages, got):
            np.testing.assert_array_equal(want, have)


# ---- bad input -----------------------------------------------------------------------------------


def test_bad_requests_get_clear_status_codes(start_node):
    node = start_node(dram="16KiB")
    s = stub(node.address)
    sel = lambda **kw: cpb.BlockSelector(namespace=kw.pop("namespace", NS), **kw)  # noqa: E731

    code, msg = rpc_error(lambda: s.Lookup(sel(keys=[b"short"])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "16 bytes" in msg
    code, msg = rpc_error(
        lambda: s.Lookup(sel(namespace="llama|L1|H1|D1|float16|B16", keys=[b"k" * 16]))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not served" in msg
    code, msg = rpc_error(lambda: s.Lookup(sel(keys=[b"k" * 16], token_ids=[1] * 16)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not several" in msg
    code, msg = rpc_error(lambda: s.Lookup(sel(key_bytes=b"k" * 16, token_bytes=b"\x01" * 64)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not several" in msg
    code, msg = rpc_error(lambda: s.Lookup(sel(token_bytes=b"\x01\x02\x03")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "multiple of 4" in msg
    code, msg = rpc_error(lambda: s.Lookup(sel(key_bytes=b"k" * 20)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "16-byte keys back to back" in msg
    code, msg = rpc_error(lambda: s.Commit(pb.LeaseRequest(namespace=NS, lease_id=12345)))
    assert code == grpc.StatusCode.NOT_FOUND and "does not exist" in msg
    code, _ = rpc_error(lambda: s.Release(pb.LeaseRequest(namespace=NS, lease_id=12345)))
    assert code == grpc.StatusCode.NOT_FOUND
    for ttl in (-1, float("nan"), float("inf"), 1e9):  # a lease pins pages: bounded by the node
        code, msg = rpc_error(
            lambda ttl=ttl: s.Allocate(
                pb.AllocateRequest(blocks=sel(token_ids=[1] * 16), ttl_s=ttl)
            )
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "ttl_s must be within" in msg, ttl
        code, msg = rpc_error(
            lambda ttl=ttl: s.Acquire(pb.AcquireRequest(blocks=sel(token_ids=[1] * 16), ttl_s=ttl))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "ttl_s must be within" in msg, ttl
    # a megabyte name is refused with a short echo, not sent back whole
    code, msg = rpc_error(lambda: s.Lookup(sel(namespace="n" * (1 << 20), keys=[b"k" * 16])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not served" in msg and len(msg) < 400
    code, msg = rpc_error(lambda: s.Lookup(sel(salt=b"s" * (1 << 20), keys=[b"k" * 16])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "salt" in msg and len(msg) < 400
    code, _ = rpc_error(
        lambda: s.Allocate(
            pb.AllocateRequest(blocks=sel(token_ids=list(range(3 * TEST_BLOCK_TOKENS))))
        )
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # 3 pages into a 2-page pool
    code, _ = rpc_error(
        lambda: next(s.Get(pb.GetRequest(blocks=sel(token_ids=[1] * 16), chunk_bytes=1 << 30)))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT

    def put(*chunks):
        return s.Put(iter(chunks))

    header = pb.PutChunk(header=pb.PutHeader(blocks=sel(token_ids=list(range(16)))))
    code, msg = rpc_error(lambda: put(pb.PutChunk(data=b"x")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "header" in msg
    code, msg = rpc_error(lambda: put(header, pb.PutChunk(data=b"x" * 100)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ended after 100 bytes" in msg
    code, msg = rpc_error(lambda: put(header, pb.PutChunk(data=b"x" * (TEST_PAGE_BYTES + 1))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "more than" in msg
    # none of the failed writes left anything behind
    assert s.Lookup(sel(token_ids=list(range(16)))).hit_blocks == 0
    stats = s.Stats(pb.StatsRequest()).namespaces[0]
    assert stats.write_leases == 0 and stats.blocks == 0

    with KVStoreClient(node.address) as c:
        with pytest.raises(Exception, match="expected 8192"):
            c.put(NS, [np.zeros(100, np.uint8)], tokens=tokens(1))
        with pytest.raises(Exception, match="dtype"):
            c.put(NS, [np.zeros(TEST_PAGE_BYTES // 4, np.float32)], tokens=tokens(1))
    assert node.alive()


# ---- auth and tenants ----------------------------------------------------------------------------


def test_auth_and_tenant_isolation(start_node):
    node = start_node(
        "--token", "admin-secret", "--tenant-token", "tok-a=alice", "--tenant-token", "tok-b=bob"
    )
    sel = cpb.BlockSelector(namespace=NS, token_ids=list(range(16)))
    for token in (None, "wrong"):
        code, msg = rpc_error(lambda token=token: stub(node.address, token).Lookup(sel))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in msg
    health = health_pb2_grpc.HealthStub(make_channel(node.address))  # health stays open
    assert (
        health.Check(health_pb2.HealthCheckRequest()).status
        == health_pb2.HealthCheckResponse.SERVING
    )

    with (
        KVStoreClient(node.address, token="tok-a") as alice,
        KVStoreClient(node.address, token="tok-b") as bob,
        KVStoreClient(node.address, token="admin-secret") as admin,
    ):
        alice.put(NS, pages_for(2, 5), tokens=tokens(2))
        assert alice.lookup(NS, tokens=tokens(2)).hit_blocks == 2
        assert bob.lookup(NS, tokens=tokens(2)).hit_blocks == 0
        # the salt in the body cannot reach another tenant's blocks either
        assert bob.lookup(NS, tokens=tokens(2), salt=b"alice").hit_blocks == 0
        assert admin.lookup(NS, tokens=tokens(2)).hit_blocks == 0
        # Another tenant's leases look exactly like leases that do not exist.
        lease = alice.allocate(NS, tokens=tokens(1, start=900))
        alice.put(NS, pages_for(1, 7), tokens=tokens(1, start=950))
        read = alice.acquire(NS, tokens=tokens(1, start=950))
        _, gone = rpc_error(lambda: admin.release(dataclasses.replace(read, lease_id=99999)))
        for attempt in (
            lambda: bob.commit(lease),
            lambda: bob.abort(lease),
            lambda: bob.extend(lease, 5),
            lambda: bob.release(read),
            lambda: admin.commit(lease),  # the admin token is an identity like any other
        ):
            code, msg = rpc_error(attempt)
            assert code == grpc.StatusCode.NOT_FOUND
            assert msg.replace(str(lease.lease_id), "N").replace(str(read.lease_id), "N") == (
                gone.replace("99999", "N")
            )
        read.release()
        lease.abort()
        for attempt in (lambda: next(bob.events()), bob.stats, alice.stats):
            code, msg = rpc_error(attempt)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "admin token" in msg
        assert admin.stats().namespaces[0].blocks == 3
        first = next(admin.events(resync=True))
        assert first.snapshot and len(first.events) == 3  # alice: 2 blocks, then 1


def test_a_streamed_puts_lease_cannot_be_touched_by_another_tenant(start_node):
    """A Put holds a lease inside the node while its bytes arrive; no RPC can reach it (it used to
    be abortable by any tenant that guessed its id, which then let that tenant write the key)."""
    node = start_node(
        "--token", "adm", "--tenant-token", "tok-a=alice", "--tenant-token", "tok-b=bob"
    )
    go = threading.Event()
    sel = cpb.BlockSelector(namespace=NS, token_ids=list(range(16)))
    page = pages_for(1, 3)[0].tobytes()

    def chunks():
        yield pb.PutChunk(header=pb.PutHeader(blocks=sel))
        yield pb.PutChunk(data=page[:100])
        go.wait(10)
        yield pb.PutChunk(data=page[100:])

    with (
        KVStoreClient(node.address, token="tok-b") as bob,
        KVStoreClient(node.address, token="adm") as admin,
    ):
        probe = bob.allocate(NS, tokens=tokens(1, start=700))  # the next lease ids follow it
        bob.abort(probe)
        result: list = []
        put = threading.Thread(
            target=lambda: result.append(stub(node.address, "tok-a").Put(chunks(), timeout=20))
        )
        put.start()
        wait_until(
            lambda: admin.stats().namespaces[0].write_leases == 1, 30, "the Put's lease to open"
        )
        for lease_id in range(probe.lease_id + 1, probe.lease_id + 4):
            fake = dataclasses.replace(probe, lease_id=lease_id)
            assert rpc_error(lambda fake=fake: bob.abort(fake))[0] == grpc.StatusCode.NOT_FOUND
            assert rpc_error(lambda fake=fake: bob.commit(fake))[0] == grpc.StatusCode.NOT_FOUND
        go.set()
        put.join(20)
        assert result and result[0].stored == 1
    with KVStoreClient(node.address, token="tok-a") as alice:
        (got,) = alice.get(NS, tokens=list(range(16)))
        assert got is not None and got.tobytes() == page


# ---- events --------------------------------------------------------------------------------------


def test_events_feed_sequence_and_resync(start_node):
    node = start_node(dram="32KiB")  # 4 pages: the 5th put evicts
    with KVStoreClient(node.address) as c:
        feed = c.events(after_seq=0)
        c.put(NS, pages_for(4, 6), tokens=tokens(4))
        c.put(NS, pages_for(1, 7), tokens=tokens(1, start=7000))
        seen = []
        for batch in feed:
            seen.extend(batch.events)
            if len(seen) >= 6:
                break
        feed.close()
        assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
        kinds = [e.kind for e in seen]
        assert kinds[:4] == [cpb.EVENT_STORED] * 4
        assert cpb.EVENT_EVICTED in kinds[4:]
        evicted = [e.key for e in seen if e.kind == cpb.EVENT_EVICTED]
        snap = []
        for batch in c.events(resync=True):
            assert batch.snapshot
            snap.extend(batch.events)
            if batch.snapshot_done:
                assert batch.snapshot_seq >= 6
                break
        assert len(snap) == 4 and not set(evicted) & {e.key for e in snap}


# ---- lifecycle -----------------------------------------------------------------------------------


def test_restart_keeps_ssd_pages_and_sigterm_cleans_up(start_node, tmp_path):
    ssd = str(tmp_path / "ssd")
    node = start_node("--ssd", "64KiB", "--ssd-dir", ssd, dram="16KiB")  # 2 DRAM + 8 SSD pages
    pages = pages_for(6, 8)
    with KVStoreClient(node.address) as c:
        for i in range(6):  # one at a time: the older ones are demoted to SSD
            c.put(NS, [pages[i]], tokens=tokens(1, start=100 * i))
        tiers = [c.lookup(NS, tokens=tokens(1, start=100 * i)).tiers[0] for i in range(6)]
    assert tiers[:4] == [Tier.SSD] * 4 and tiers[4:] == [Tier.DRAM] * 2
    shm = next(iter(node.info["shm"].values()))
    assert shm_exists(shm)
    assert node.stop() == 0
    assert not shm_exists(shm)

    node2 = start_node("--ssd", "64KiB", "--ssd-dir", ssd, dram="16KiB")
    with KVStoreClient(node2.address) as c:
        for i in range(4):
            assert c.lookup(NS, tokens=tokens(1, start=100 * i)).tiers == [Tier.SSD]
            np.testing.assert_array_equal(c.get(NS, tokens=tokens(1, start=100 * i))[0], pages[i])
        assert c.lookup(NS, tokens=tokens(1, start=500)).hit_blocks == 0  # DRAM did not survive


def test_health_reflection_metrics_and_toml_config(start_kvcache, tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text(
        textwrap.dedent("""
        dram = "64KiB"
        node-id = "toml-node"
        metrics-port = 0
        [[layout]]
        model = "test"
        num_layers = 2
        kv_heads = 2
        head_dim = 32
        dtype = "float16"
        block_tokens = 16
    """)
    )
    node = start_kvcache("node", "--config", str(cfg))
    assert node.info["node_id"] == "toml-node"
    channel = make_channel(node.address)
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="kvcache.v1.NodeService")).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(
        refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    )
    names = {s.name for s in reply.list_services_response.service}
    assert "kvcache.v1.NodeService" in names
    with KVStoreClient(node.address) as c:
        assert c.namespace_info(NS).dram_pages == 8
        c.put(NS, pages_for(1, 9), tokens=tokens(1))
        c.lookup(NS, tokens=tokens(2))
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{node.info['metrics_port']}/metrics", timeout=10)
        .read()
        .decode()
    )
    assert f'kvcache_store_hits_total{{namespace="{NS}",tier="dram"}} 1.0' in body
    assert 'kvcache_node_rpc_seconds_count{method="Lookup"}' in body


def test_tokens_from_files_and_the_environment_stay_off_the_command_line(
    start_node, start_kvcache, tmp_path
):
    admin_file = tmp_path / "admin-token"
    admin_file.write_text("admin-from-file\n")
    tenants = tmp_path / "tenants"
    tenants.write_text("# token=tenant\n\ntok-a=alice\n")
    node = start_node("--token-file", str(admin_file), "--tenant-tokens-file", str(tenants))
    with open(f"/proc/{node.pid}/cmdline", "rb") as f:
        cmdline = f.read()
    assert b"admin-from-file" not in cmdline and b"tok-a" not in cmdline
    with (
        KVStoreClient(node.address, token="admin-from-file") as admin,
        KVStoreClient(node.address, token="tok-a") as alice,
    ):
        alice.put(NS, pages_for(1, 4), tokens=tokens(1))
        assert admin.stats().namespaces[0].blocks == 1
    code, _ = rpc_error(lambda: stub(node.address, "wrong").Lookup(cpb.BlockSelector(namespace=NS)))
    assert code == grpc.StatusCode.UNAUTHENTICATED

    env_node = start_kvcache(
        "node", "--listen", "127.0.0.1:0", "--dram", "1MiB", env={"KVCACHE_TOKEN": "from-env"}
    )
    code, _ = rpc_error(lambda: stub(env_node.address).Stats(pb.StatsRequest()))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert stub(env_node.address, "from-env").Stats(pb.StatsRequest()) is not None

    for bad, says in (
        (["--token-file", str(tmp_path / "missing")], "cannot read token file"),
        (["--tenant-tokens-file", str(admin_file)], "is not TOKEN=TENANT"),
    ):
        with pytest.raises(RuntimeError, match=says):
            start_kvcache("node", "--dram", "1MiB", *bad)
    empty = tmp_path / "blank"
    empty.write_text("\n")
    with pytest.raises(RuntimeError, match="is empty"):
        start_kvcache("node", "--dram", "1MiB", "--token-file", str(empty))


@pytest.mark.slow
def test_bad_configuration_fails_at_start_with_a_message(start_kvcache, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(RuntimeError, match="SSD tier"):
        start_kvcache("node", "--dram", "1MiB", "--ssd", "1MiB", "--ssd-dir", str(blocker / "ssd"))
    with pytest.raises(RuntimeError, match="cannot parse size"):
        start_kvcache("node", "--dram", "lots")
    with pytest.raises(RuntimeError, match="less than one"):
        start_kvcache("node", "--dram", "1KiB")
    with pytest.raises(RuntimeError, match="--tls-cert and --tls-key go together"):
        start_kvcache("node", "--dram", "1MiB", "--tls-cert", str(blocker))
    with pytest.raises(RuntimeError, match="TOKEN=TENANT"):
        start_kvcache("node", "--dram", "1MiB", "--tenant-token", "no-tenant")


def _self_signed_cert(tmp_path) -> tuple[str, str]:
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            key,
            "-out",
            cert,
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_tls_with_token(start_node, tmp_path):
    cert, key = _self_signed_cert(tmp_path)
    node = start_node("--tls-cert", cert, "--tls-key", key, "--token", "t0k")
    with KVStoreClient(node.address, token="t0k", tls_ca_file=cert) as c:
        c.put(NS, pages_for(1, 12), tokens=tokens(1))
        assert c.lookup(NS, tokens=tokens(1)).hit_blocks == 1
    with KVStoreClient(node.address, token="t0k", timeout_s=5) as plaintext:
        with pytest.raises(KVCacheRpcError) as e:
            plaintext.lookup(NS, tokens=tokens(1))
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
