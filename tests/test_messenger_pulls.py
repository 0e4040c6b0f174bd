"""The messenger's pull against what can happen to it in the middle: the destination node
restarts, a batch is cancelled and the same keys are asked for again. Nodes and messengers are
real processes; the source messenger stalls its stream after a few pages (test-only fault
injection) until the test has acted, then goes on."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from clients.messenger_client import MessengerClient
from clients.node_client import KVCacheRpcError, KVStoreClient
from kvstore.keys import keys_from_block_ids, root_key
from plumbing.launch import ServiceProcess, free_port, start_service

from conftest import TEST_LAYOUT
from conftest import TEST_NAMESPACE as NS
from conftest import TEST_PAGE_BYTES as PB
from helpers import wait_until

pytestmark = pytest.mark.slow


def free_address() -> str:
    return f"127.0.0.1:{free_port('127.0.0.1')}"  # below the ephemeral range (plumbing.launch)


def make_keys(n: int, start: int = 0) -> list[bytes]:
    return keys_from_block_ids(list(range(start, start + n)), root_key(NS, b"pulls"))


def make_pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, PB), dtype=np.uint8)


@pytest.fixture
def procs():
    started: list[ServiceProcess] = []
    yield started
    for sp in reversed(started):
        sp.stop()


def stalling_source(procs: list, tmp_path, release) -> tuple[ServiceProcess, ServiceProcess]:
    """A node and a messenger that stops its stream after 2 pages until ``release`` exists."""
    node = start_service(["node", "--dram", "4MiB", "--layout", TEST_LAYOUT], log_dir=str(tmp_path))
    procs.append(node)
    stall = ("--fault-stall-after", "2", "--fault-stall-s", "300")
    messenger = start_service(
        ["messenger", "--node", node.address, *stall, "--fault-stall-until", str(release)],
        log_dir=str(tmp_path),
    )
    procs.append(messenger)
    return node, messenger


def test_a_destination_node_restarted_mid_pull_gets_no_wrong_page_and_no_lease_is_taken(
    procs, tmp_path
):
    """The destination node restarts while its messenger holds a write lease of the old run
    for a pull in flight. Before the fix, the messenger committed that lease by its id on the
    new node, whose ids start at 1 again: it ended a lease another writer had just opened
    there (whose commit then failed), and reported pages done that the node never got. Now
    the late commit is refused (the lease names the node's old run), the other writer's lease
    is untouched, whatever the batch reports done is on the node byte for byte, and the same
    pull asked again moves every page."""
    release = tmp_path / "release"
    node_a, messenger_a = stalling_source(procs, tmp_path, release)
    address_b = free_address()
    node_b_args = ["node", "--listen", address_b, "--dram", "4MiB", "--layout", TEST_LAYOUT]
    node_b = start_service(node_b_args, log_dir=str(tmp_path))
    procs.append(node_b)
    messenger_b = start_service(["messenger", "--node", address_b], log_dir=str(tmp_path))
    procs.append(messenger_b)
    keys, pages = make_keys(8), make_pages(8, seed=1)
    # as many keys as the pull's one group: the old lease's commit fits this one's
    others, other_pages = make_keys(8, start=100), make_pages(8, seed=2)
    with KVStoreClient(node_a.address) as a:
        a.put(NS, list(pages), keys=keys)
    with MessengerClient(messenger_b.address) as m:
        batch = m.submit(NS, [(k, messenger_a.address) for k in keys]).batch_id
        wait_until(lambda: "stalling the data stream" in messenger_a.log(), 60, "the stall")

        node_b.kill()  # a crash; the node comes back at the same address
        procs.remove(node_b)
        node_b = start_service(node_b_args, log_dir=str(tmp_path))
        procs.append(node_b)
        with KVStoreClient(address_b) as b:
            lease = b.allocate(NS, keys=others)  # the new run's first lease
            for i in lease.to_write:
                lease.page(i)[:] = other_pages[i]
            release.touch()
            status = m.status(batch, wait=True, timeout_s=120)
            assert status.finished
            assert b.commit(lease).stored == 8  # still this writer's own lease
            held = b.get(NS, keys=others + keys)
        assert all(np.array_equal(held[i], other_pages[i]) for i in range(8))
        for entry, page, got in zip(status.entries, pages, held[8:]):
            if entry.code == "":  # done: on the node as the source holds it
                assert got is not None and np.array_equal(got, page)
        assert status.failed > 0, "the old run's lease cannot have been committed"

        again = m.status(m.submit(NS, [(k, messenger_a.address) for k in keys]).batch_id, True)
        assert (again.done, again.failed) == (8, 0)
    with KVStoreClient(address_b, use_shm=False) as b:
        moved = b.get(NS, keys=keys)
    assert all(np.array_equal(moved[i], pages[i]) for i in range(8))


def test_a_lease_of_a_nodes_earlier_run_is_not_found(procs, tmp_path):
    """Commit, Abort, Release and ExtendLease of a lease granted before the node restarted
    answer NOT_FOUND naming the restart, even where the new run granted a lease of that id."""
    address = free_address()
    args = ["node", "--listen", address, "--dram", "1MiB", "--layout", TEST_LAYOUT]
    node = start_service(args, log_dir=str(tmp_path))
    procs.append(node)
    with KVStoreClient(address) as c:
        old_write = c.allocate(NS, keys=make_keys(1, start=200))
        c.put(NS, list(make_pages(1, seed=3)), keys=make_keys(1, start=201))
        old_read = c.acquire(NS, keys=make_keys(1, start=201))
        node.kill()
        procs.remove(node)
        node = start_service(args, log_dir=str(tmp_path))
        procs.append(node)
        new_write = c.allocate(NS, keys=make_keys(1, start=200))
        new_read = c.acquire(NS, keys=make_keys(1, start=201))  # not stored in this run
        assert {new_write.lease_id, new_read.lease_id} & {old_write.lease_id, old_read.lease_id}
        for call in (
            lambda: c.commit(old_write),
            lambda: c.abort(old_write),
            lambda: c.extend(old_write),
            lambda: c.release(old_read),
        ):
            with pytest.raises(KVCacheRpcError) as e:
                call()
            assert e.value.code.name == "NOT_FOUND" and "restarted" in e.value.details
        new_write.page(0)[:] = make_pages(1, seed=4)[0]
        assert c.commit(new_write).stored == 1  # the new run's leases are untouched
        c.release(new_read)


def test_a_batch_after_a_cancelled_one_moves_the_same_keys(procs, tmp_path):
    """Before the fix, a batch submitted while a cancelled batch's fetch of the same keys was
    still in flight joined that fetch and inherited its cancel: every entry CANCELLED."""
    release = tmp_path / "release"
    node_a, messenger_a = stalling_source(procs, tmp_path, release)
    node_b = start_service(
        ["node", "--dram", "4MiB", "--layout", TEST_LAYOUT], log_dir=str(tmp_path)
    )
    procs.append(node_b)
    messenger_b = start_service(["messenger", "--node", node_b.address], log_dir=str(tmp_path))
    procs.append(messenger_b)
    keys, pages = make_keys(6, start=300), make_pages(6, seed=5)
    with KVStoreClient(node_a.address) as a:
        a.put(NS, list(pages), keys=keys)
    with MessengerClient(messenger_b.address) as m:
        first = m.submit(NS, [(k, messenger_a.address) for k in keys]).batch_id
        wait_until(lambda: "stalling the data stream" in messenger_a.log(), 60, "the stall")
        assert m.cancel(first).finished
        second = m.submit(NS, [(k, messenger_a.address) for k in keys]).batch_id
        release.touch()
        status = m.status(second, wait=True, timeout_s=120)
    assert (status.done, status.failed) == (6, 0), status
    with KVStoreClient(node_b.address, use_shm=False) as b:
        moved = b.get(NS, keys=keys)
    assert all(np.array_equal(moved[i], pages[i]) for i in range(6))


class _LosesFirstCommit(KVStoreClient):
    """A real node client whose first Commit never reaches the node (a request lost with its
    connection): the lease stays open there, as after any Commit that fails before the node
    ends it."""

    lost = 0

    def commit(self, lease, checksums=None, hold_s=0.0):
        if not self.lost:
            self.lost += 1
            raise KVCacheRpcError(grpc.StatusCode.UNAVAILABLE, "connection lost (test)")
        return super().commit(lease, checksums, hold_s)


def test_a_failed_commit_gives_its_pages_back_at_once(procs, tmp_path):
    """Before the fix, a group whose Commit failed kept its write lease (64 MiB in a real job)
    until --write-ttl, then its quarantine; now the mover aborts it when the node may still
    hold it."""
    from messenger.mover import DataAddressResolver, EntryRequest, Mover, MoverConfig
    from messenger.node_access import NodeAccess
    from messenger.tcp import TcpConfig, TcpTransport

    source = start_service(
        ["node", "--dram", "4MiB", "--layout", TEST_LAYOUT], log_dir=str(tmp_path)
    )
    procs.append(source)
    messenger = start_service(["messenger", "--node", source.address], log_dir=str(tmp_path))
    procs.append(messenger)
    dest = start_service(["node", "--dram", "4MiB", "--layout", TEST_LAYOUT], log_dir=str(tmp_path))
    procs.append(dest)
    keys, pages = make_keys(8, start=400), make_pages(8, seed=6)
    with KVStoreClient(source.address) as a:
        a.put(NS, list(pages), keys=keys)
    client = _LosesFirstCommit(dest.address)
    data = messenger.info["data_address"]
    mover = Mover(
        NodeAccess(client),
        TcpTransport(TcpConfig(lanes=1, request_bytes=4 * PB)),  # two groups of 4
        DataAddressResolver(lambda s: data),
        MoverConfig(workers=1, write_ttl_s=600),
    )
    try:
        batch, _ = mover.submit(NS, [EntryRequest(k, messenger.address) for k in keys])
        snap = mover.status(batch, wait=True, timeout_s=60)
        assert (snap.count("done"), snap.count("failed")) == (4, 4)
        stats = client.stats().namespaces[0]
        assert stats.write_leases == 0  # before: 1, for 600 s
        got = client.get(NS, keys=keys)
        done = [e.result.ok for e in snap.entries]
        assert [g is not None for g in got] == done
        assert all(np.array_equal(g, p) for g, p in zip(got, pages) if g is not None)
    finally:
        mover.close()
        mover.transport.close()
        client.close()


def test_a_pull_of_blocks_from_anywhere_links_none_to_another(procs, tmp_path):
    """A batch of keys from two prompts (the tail of one, the head of the other): before, the
    destination took its group as one chain, and removing the first prompt's block dropped the
    second prompt's head with it as an "orphan". A batch that says it is a chain (the router's
    decode pull of a prompt) is linked as one."""
    source = start_service(
        ["node", "--dram", "4MiB", "--layout", TEST_LAYOUT], log_dir=str(tmp_path)
    )
    procs.append(source)
    messenger_a = start_service(["messenger", "--node", source.address], log_dir=str(tmp_path))
    procs.append(messenger_a)
    dest = start_service(
        ["node", "--dram", "4MiB", "--layout", TEST_LAYOUT, "--dram-policy", "prefix"],
        log_dir=str(tmp_path),
    )
    procs.append(dest)
    messenger_b = start_service(["messenger", "--node", dest.address], log_dir=str(tmp_path))
    procs.append(messenger_b)
    a_keys = keys_from_block_ids([1, 2], root_key(NS, b"prompt-a"))
    b_keys = keys_from_block_ids([1, 2], root_key(NS, b"prompt-b"))
    with KVStoreClient(source.address) as a:
        a.put(NS, list(make_pages(2, seed=7)), keys=a_keys)
        a.put(NS, list(make_pages(2, seed=8)), keys=b_keys)
    with MessengerClient(messenger_b.address) as m, KVStoreClient(dest.address) as b:
        mixed = [a_keys[1], b_keys[0]]  # A's tail, then B's head: no parent and child
        assert m.pull(NS, mixed, messenger_a.address).done == 2
        assert b.remove(NS, keys=[a_keys[1]]) == 1
        assert b.lookup(NS, keys=[b_keys[0]]).hit_blocks == 1  # before: dropped with it
        assert m.pull(NS, b_keys, messenger_a.address, chain=True).done == 2
        assert b.remove(NS, keys=[b_keys[0]]) == 1
        assert b.lookup(NS, keys=[b_keys[1]]).hit_blocks == 0  # a chain's tail goes with it


def test_the_fetch_queue_is_bounded_and_one_submitter_holds_at_most_half(procs, tmp_path):
    """Before, SubmitTransfer queued without end: one tenant could fill the messenger's queue
    (and its memory) and every other pull waited behind it. Now past --max-fetching keys in
    flight, or half of it for one submitter, a batch is RESOURCE_EXHAUSTED, saying why."""
    release = tmp_path / "release"
    tokens = tmp_path / "tenants"
    tokens.write_text("tok-a=alice\n")
    auth = ["--token", "admin", "--tenant-tokens-file", str(tokens)]
    node_a = start_service(
        ["node", "--dram", "4MiB", "--layout", TEST_LAYOUT, *auth], log_dir=str(tmp_path)
    )
    procs.append(node_a)
    stall = ["--fault-stall-after", "1", "--fault-stall-s", "300", "--fault-stall-until"]
    messenger_a = start_service(
        ["messenger", "--node", node_a.address, *auth, *stall, str(release)],
        log_dir=str(tmp_path),
    )
    procs.append(messenger_a)
    node_b = start_service(
        ["node", "--dram", "4MiB", "--layout", TEST_LAYOUT, *auth], log_dir=str(tmp_path)
    )
    procs.append(node_b)
    messenger_b = start_service(
        ["messenger", "--node", node_b.address, *auth, "--max-fetching", "10", "--lanes", "1"],
        log_dir=str(tmp_path),
    )
    procs.append(messenger_b)
    keys, pages = make_keys(12, start=500), make_pages(12, seed=9)
    with KVStoreClient(node_a.address, token="admin") as a:
        a.put(NS, list(pages), keys=keys)
    src = messenger_a.address
    with (
        MessengerClient(messenger_b.address, token="admin") as admin,
        MessengerClient(messenger_b.address, token="tok-a") as alice,
    ):
        first = admin.submit(NS, [(k, src) for k in keys[:5]]).batch_id  # half of 10
        wait_until(lambda: "stalling the data stream" in messenger_a.log(), 60, "the stall")
        with pytest.raises(KVCacheRpcError) as e:
            admin.submit(NS, [(keys[5], src)])
        assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "wait for batches to finish" in e.value.details
        assert admin.submit(NS, [(keys[0], src)]).deduplicated == 1  # joins: nothing more
        theirs = alice.submit(NS, [(k, src) for k in keys[:5]]).batch_id  # her own share
        release.touch()
        assert admin.status(first, wait=True, timeout_s=60).done == 5
        assert alice.status(theirs, wait=True, timeout_s=60).finished
        # room again
        assert admin.status(admin.submit(NS, [(keys[5], src)]).batch_id, True, 60).done == 1


def status_waits(messenger: ServiceProcess) -> float:
    """The messenger's kvcache_messenger_status_waits gauge (0 before it is exported)."""
    import re
    import urllib.request

    port = messenger.info["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(r"^kvcache_messenger_status_waits ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_waiting_status_calls_never_take_every_worker(procs, tmp_path):
    """A waiting TransferStatus holds a gRPC worker for up to 600 s: before, 40 of them (any
    tenant's, or one router's pulls) took all 32 workers and every other call of the messenger
    waited. Now at most 16 wait at once; the client library polls for the others."""
    import threading

    release = tmp_path / "release"
    node_a, messenger_a = stalling_source(procs, tmp_path, release)
    node_b = start_service(
        ["node", "--dram", "4MiB", "--layout", TEST_LAYOUT], log_dir=str(tmp_path)
    )
    procs.append(node_b)
    messenger_b = start_service(
        ["messenger", "--node", node_b.address, "--metrics-port", "0"], log_dir=str(tmp_path)
    )
    procs.append(messenger_b)
    keys, pages = make_keys(6, start=600), make_pages(6, seed=10)
    with KVStoreClient(node_a.address) as a:
        a.put(NS, list(pages), keys=keys)
    src = messenger_a.address
    with MessengerClient(messenger_b.address) as m:
        batch = m.submit(NS, [(k, src) for k in keys]).batch_id
        wait_until(lambda: "stalling the data stream" in messenger_a.log(), 60, "the stall")
        finished: list[bool] = []
        waiters = [
            threading.Thread(
                target=lambda: finished.append(m.status(batch, True, 120).finished), daemon=True
            )
            for _ in range(40)
        ]
        for t in waiters:
            t.start()
        wait_until(lambda: status_waits(messenger_b) >= 16, 60, "16 waiting status calls")
        with MessengerClient(messenger_b.address, timeout_s=10) as other:
            wait_until(lambda: other.stats().batches_in_flight == 1, 30, "the stats")
            assert other.submit(NS, [(keys[0], src)]).deduplicated == 1  # served, not queued
        release.touch()
        for t in waiters:
            t.join(timeout=120)
    assert finished == [True] * 40


def test_an_urgent_pull_does_not_queue_behind_bulk_jobs(procs, tmp_path):
    """Before, every batch waited for one of the --workers job slots in submission order: a
    small pull an engine's request waits on queued behind a bulk job. Now an urgent batch
    (the engines', the router's) runs on workers of its own; a plain one still queues."""
    release = tmp_path / "release"
    node_a, messenger_a = stalling_source(procs, tmp_path, release)  # the bulk job's source
    node_c = start_service(
        ["node", "--dram", "4MiB", "--layout", TEST_LAYOUT], log_dir=str(tmp_path)
    )
    procs.append(node_c)
    messenger_c = start_service(["messenger", "--node", node_c.address], log_dir=str(tmp_path))
    procs.append(messenger_c)
    dest = start_service(["node", "--dram", "4MiB", "--layout", TEST_LAYOUT], log_dir=str(tmp_path))
    procs.append(dest)
    messenger_b = start_service(
        ["messenger", "--node", dest.address, "--workers", "1"], log_dir=str(tmp_path)
    )
    procs.append(messenger_b)
    bulk, small, plain = make_keys(8), make_keys(2, 100), make_keys(2, 200)
    with KVStoreClient(node_a.address) as a, KVStoreClient(node_c.address) as c:
        a.put(NS, list(make_pages(8, seed=1)), keys=bulk)
        c.put(NS, list(make_pages(4, seed=2)), keys=small + plain)
    with MessengerClient(messenger_b.address) as m:
        stuck = m.submit(NS, [(k, messenger_a.address) for k in bulk]).batch_id
        wait_until(lambda: "stalling the data stream" in messenger_a.log(), 60, "the stall")
        queued = m.submit(NS, [(k, messenger_c.address) for k in plain]).batch_id
        urgent = m.submit(NS, [(k, messenger_c.address) for k in small], urgent=True).batch_id
        done = m.status(urgent, wait=True, timeout_s=30)
        assert done.finished and done.done == 2  # while the bulk job holds the one worker
        assert not m.status(stuck).finished
        assert m.status(queued).pending == 2  # behind the bulk job, as every batch was
        release.touch()
        assert m.status(stuck, wait=True, timeout_s=60).done == 8
        assert m.status(queued, wait=True, timeout_s=60).done == 2


def flood(node: str, start: int, pages: int) -> None:
    """Other writers fill the node: ``pages`` new blocks, evicting what nothing pins."""
    with KVStoreClient(node) as c:
        for s in range(0, pages, 64):
            try:
                c.put(NS, list(make_pages(64, seed=start + s)), keys=make_keys(64, start + s))
            except KVCacheRpcError as e:  # everything left is pinned: nothing more fits
                assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                return


def test_pulled_pages_stay_pinned_on_the_destination_while_their_hold_lasts(procs, tmp_path):
    """A pull with ``hold_s``: its pages are committed pinned, so a flood of other writes on the
    destination between the pull's end and its reader's Acquire evicts other blocks, not them;
    the pin lapses by itself. Without a hold the same flood evicts them (the reader's miss).
    Pages the destination held already when the pull came are pinned as well (before, only
    the pages that moved were: a reader's prefix found there was evicted under it)."""
    src = start_service(["node", "--dram", "4MiB", "--layout", TEST_LAYOUT], log_dir=str(tmp_path))
    procs.append(src)
    messenger_a = start_service(["messenger", "--node", src.address], log_dir=str(tmp_path))
    procs.append(messenger_a)
    dst = start_service(["node", "--dram", "4MiB", "--layout", TEST_LAYOUT], log_dir=str(tmp_path))
    procs.append(dst)
    messenger_b = start_service(["messenger", "--node", dst.address], log_dir=str(tmp_path))
    procs.append(messenger_b)
    capacity = (4 << 20) // PB
    held, plain = make_keys(8, start=500), make_keys(8, start=600)
    there = make_keys(8, start=700)  # on the destination before the pull
    pages = make_pages(24, seed=7)
    with KVStoreClient(src.address) as a:
        a.put(NS, list(pages), keys=held + plain + there)
    with KVStoreClient(dst.address, use_shm=False) as b:
        b.put(NS, list(pages[16:]), keys=there)
    with MessengerClient(messenger_b.address) as m:
        for keys, hold in ((held, 30.0), (plain, 0.0), (there, 30.0)):
            batch = m.submit(NS, [(k, messenger_a.address) for k in keys], hold_s=hold).batch_id
            status = m.status(batch, wait=True, timeout_s=60)
            assert (status.done, status.failed) == (8, 0), status
        for bad in (60.5, -1.0, float("nan")):
            with pytest.raises(KVCacheRpcError) as e:
                m.submit(NS, [(held[0], messenger_a.address)], hold_s=bad)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "hold_s" in e.value.details
    flood(dst.address, 10_000, 2 * capacity)
    with KVStoreClient(dst.address, use_shm=False) as b:
        got = b.get(NS, keys=held)
        assert all(np.array_equal(g, p) for g, p in zip(got, pages[:8]))  # held: all there
        got = b.get(NS, keys=there)
        assert all(np.array_equal(g, p) for g, p in zip(got, pages[16:]))  # there, and held
        assert b.lookup(NS, keys=plain).hit_blocks == 0  # not held: evicted by the flood
        assert b.stats().namespaces[0].read_leases >= 1  # the hold (nobody releases it)
