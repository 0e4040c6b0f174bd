"""Two node + messenger pairs as real processes on loopback: transfers, faults and bad input.

Node A holds the pages; messenger B is asked to pull them into node B. Everything is a separate
``kvcache`` process; the tests talk to them over gRPC and the data port as users and peers do.
"""

from __future__ import annotations

import re
import socket
import urllib.request

import grpc
import numpy as np
import pytest
import xxhash

from clients.messenger_client import MessengerClient
from clients.node_client import KVCacheRpcError, KVStoreClient
from kvstore.keys import keys_from_block_ids, root_key
from plumbing.launch import start_service
from proto import common_pb2 as cpb
from proto import messenger_pb2 as pb
from proto import messenger_pb2_grpc as pbg

from conftest import TEST_LAYOUT
from conftest import TEST_NAMESPACE as NS
from conftest import TEST_PAGE_BYTES as PB
from helpers import CommitLog, wait_until

DONE, FAILED, PENDING = pb.ENTRY_DONE, pb.ENTRY_FAILED, pb.ENTRY_PENDING


def make_keys(n: int, start: int = 0) -> list[bytes]:
    return keys_from_block_ids(list(range(start, start + n)), root_key(NS, b"messenger-test"))


def make_pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, PB), dtype=np.uint8)


class Pair:
    """A node and its messenger."""

    def __init__(
        self,
        procs: list,
        tmp: str,
        dram: str = "16MiB",
        messenger_args=(),
        token: str | None = None,
        node_args=(),
    ) -> None:
        auth = ("--token", token) if token else ()
        self.node = start_service(
            ["node", "--dram", dram, "--layout", TEST_LAYOUT, *auth, *node_args], log_dir=tmp
        )
        procs.append(self.node)
        self.messenger = start_service(
            [
                "messenger",
                "--node",
                self.node.address,
                "--metrics-port",
                "0",
                *auth,
                *messenger_args,
            ],
            log_dir=tmp,
        )
        procs.append(self.messenger)
        self.client = KVStoreClient(self.node.address, token=token)
        self.mclient = MessengerClient(self.messenger.address, token=token)

    @property
    def address(self) -> str:
        return self.messenger.address

    def metric(self, series: str) -> float:
        """One series of the messenger's Prometheus endpoint (0 when not exported yet)."""
        port = self.messenger.info["metrics_port"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        m = re.search(re.escape(series) + r" ([0-9.e+]+)", text.decode())
        return float(m.group(1)) if m else 0.0

    def pages_sent(self) -> float:
        return self.metric("kvcache_messenger_sent_pages_total")

    def pinned(self) -> int:
        stats = self.client.stats().namespaces[0]
        return sum(t.pinned_blocks for t in stats.tiers)

    def close(self) -> None:
        self.client.close()
        self.mclient.close()


@pytest.fixture
def cluster(tmp_path):
    """``cluster(a_args=..., b_args=..., b_dram=...)`` -> (A, B); processes stopped after."""
    procs: list = []
    pairs: list[Pair] = []

    def start(a_args=(), b_args=(), b_dram="16MiB", token=None, node_args=()):
        a = Pair(procs, str(tmp_path), messenger_args=a_args, token=token, node_args=node_args)
        b = Pair(
            procs,
            str(tmp_path),
            dram=b_dram,
            messenger_args=b_args,
            token=token,
            node_args=node_args,
        )
        pairs.extend([a, b])
        return a, b

    yield start
    for p in pairs:
        p.close()
    for sp in reversed(procs):
        sp.stop()


@pytest.fixture(scope="module")
def shared_pair(tmp_path_factory):
    """One default A/B cluster for the tests that need no special flags (each uses its own key
    range), so the module does not pay four process starts per test."""
    procs: list = []
    tmp = str(tmp_path_factory.mktemp("messenger-shared"))
    a, b = Pair(procs, tmp), Pair(procs, tmp)
    yield a, b
    a.close()
    b.close()
    for sp in reversed(procs):
        sp.stop()


def transfer(b: Pair, a: Pair, keys, timeout_s: float = 60.0) -> pb.TransferStatusReply:
    reply = b.mclient.submit(NS, [(k, a.address) for k in keys])
    status = b.mclient.status(reply.batch_id, wait=True, timeout_s=timeout_s)
    assert status.finished, status
    return status


def present(client: KVStoreClient, keys) -> list[bool]:
    return [p is not None for p in client.get(NS, keys=keys)]


@pytest.mark.slow
def test_transfer_1000_pages_bytes_identical(shared_pair):
    a, b = shared_pair
    keys, pages = make_keys(1000, start=10_000), make_pages(1000, seed=1)
    assert a.client.put(NS, list(pages), keys=keys).stored == 1000
    status = transfer(b, a, keys)
    assert (status.done, status.failed, status.pending) == (1000, 0, 0)
    assert status.bytes_moved == 1000 * PB
    assert [e.key for e in status.entries] == keys
    got = b.client.get(NS, keys=keys)
    assert all(g is not None and np.array_equal(g, p) for g, p in zip(got, pages))
    assert a.pinned() == 0  # the source released its pins
    assert b.metric('kvcache_messenger_transfer_entries_total{outcome="ok"}') >= 1000
    assert b.metric("kvcache_messenger_received_bytes_total") >= 1000 * PB
    assert b.metric("kvcache_messenger_job_seconds_count") >= 1
    info = b.mclient.info()
    assert info.transport.startswith("tcp") and info.data_address and info.namespaces == [NS]
    # Asking again moves nothing: the destination already holds every key.
    again = transfer(b, a, keys[:10])
    assert again.done == 10 and all(e.already_present for e in again.entries)
    assert again.bytes_moved == 0


def test_missing_key_fails_not_found_rest_complete(shared_pair):
    a, b = shared_pair
    keys, pages = make_keys(12, start=20_000), make_pages(12, seed=2)
    a.client.put(
        NS,
        [p for i, p in enumerate(pages) if i != 5],
        keys=[k for i, k in enumerate(keys) if i != 5],
    )
    status = transfer(b, a, keys)
    assert status.done == 11 and status.failed == 1
    bad = status.entries[5]
    assert bad.state == FAILED and bad.code == "NOT_FOUND" and "does not hold" in bad.reason
    assert present(b.client, keys) == [i != 5 for i in range(12)]
    got = b.client.get(NS, keys=keys)
    assert all(np.array_equal(got[i], pages[i]) for i in range(12) if i != 5)


@pytest.mark.slow
def test_destination_out_of_capacity(cluster):
    a, b = cluster(b_dram="64KiB")  # 8 pages
    keys, pages = make_keys(20), make_pages(20, seed=3)
    a.client.put(NS, list(pages), keys=keys)
    status = transfer(b, a, keys)
    assert status.failed == 20 and status.done == 0
    assert {e.code for e in status.entries} == {"RESOURCE_EXHAUSTED"}
    assert "allocate" in status.entries[0].reason
    assert not any(present(b.client, keys))
    assert a.pages_sent() == 0  # nothing was pulled for pages with no room


@pytest.mark.slow
def test_corrupted_bytes_on_the_wire_are_caught_and_never_committed(cluster):
    a, b = cluster(a_args=("--fault-corrupt-every", "4"))
    keys, pages = make_keys(16), make_pages(16, seed=4)
    a.client.put(NS, list(pages), keys=keys)
    status = transfer(b, a, keys)
    bad = [i for i, e in enumerate(status.entries) if e.state == FAILED]
    assert len(bad) == 4 and status.done == 12
    assert {status.entries[i].code for i in bad} == {"DATA_LOSS"}
    assert "checksum" in status.entries[bad[0]].reason
    assert present(b.client, keys) == [i not in bad for i in range(16)]
    got = b.client.get(NS, keys=keys)
    assert all(np.array_equal(got[i], pages[i]) for i in range(16) if i not in bad)


def test_garbage_on_the_data_port_drops_the_connection_and_messenger_survives(shared_pair):
    a, b = shared_pair
    keys, pages = make_keys(8, start=30_000), make_pages(8, seed=5)
    a.client.put(NS, list(pages), keys=keys)
    host, port = a.messenger.info["data_address"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"\xde\xad\xbe\xef" * 64)
        try:
            assert s.recv(100) == b""  # dropped, no reply
        except ConnectionResetError:
            pass
    assert a.messenger.alive()
    status = transfer(b, a, keys)
    assert status.done == 8
    wait_until(lambda: "dropping connection" in a.messenger.log(), 10, "the drop logged")


@pytest.mark.slow
def test_duplicate_submissions_are_fetched_once(cluster):
    # The source stalls after 2 pages so the second submission surely finds the first in flight.
    a, b = cluster(a_args=("--fault-stall-after", "2", "--fault-stall-s", "1.5"))
    keys, pages = make_keys(10), make_pages(10, seed=6)
    a.client.put(NS, list(pages), keys=keys)
    first = b.mclient.submit(NS, [(k, a.address) for k in keys + keys[:3]])
    assert first.deduplicated == 3  # duplicates inside one batch
    second = b.mclient.submit(NS, [(k, a.address) for k in keys[4:]])
    assert second.deduplicated == 6  # joined the first batch's fetches
    s1 = b.mclient.status(first.batch_id, wait=True, timeout_s=60)
    s2 = b.mclient.status(second.batch_id, wait=True, timeout_s=60)
    assert s1.done == 13 and s2.done == 6
    assert a.pages_sent() == 10
    got = b.client.get(NS, keys=keys)
    assert all(np.array_equal(g, p) for g, p in zip(got, pages))


@pytest.mark.slow
def test_source_killed_mid_transfer(cluster):
    a, b = cluster(
        a_args=(
            "--fault-stall-after",
            "300",
            "--fault-stall-s",
            "60",
            "--pin-ttl",
            "1",
            "--lanes",
            "1",
        ),
        b_args=("--lanes", "1"),
    )
    keys, pages = make_keys(1000), make_pages(1000, seed=7)
    a.client.put(NS, list(pages), keys=keys)
    reply = b.mclient.submit(NS, [(k, a.address) for k in keys])
    wait_until(lambda: "stalling the data stream" in a.messenger.log(), 30, "the stall")
    assert a.pinned() > 0  # the source holds pins mid-transfer
    a.messenger.kill()
    status = b.mclient.status(reply.batch_id, wait=True, timeout_s=60)
    assert status.finished and status.failed > 0
    failed = [i for i, e in enumerate(status.entries) if e.state == FAILED]
    assert {status.entries[i].code for i in failed} == {"UNAVAILABLE"}
    assert "lost" in status.entries[failed[0]].reason
    # Only complete, verified pages are visible on B; every failed one is absent.
    got = b.client.get(NS, keys=keys)
    for i, g in enumerate(got):
        if i in set(failed):
            assert g is None
        else:
            assert status.entries[i].state == DONE and np.array_equal(g, pages[i])
    # The dead messenger's pins on node A expire with their lease.
    wait_until(lambda: a.pinned() == 0, 15, "the source pins to expire")


def held_back(client: KVStoreClient) -> tuple[int, int]:
    """DRAM pages leased or quarantined (neither used nor free), and write leases, of a node."""
    ns = client.stats().namespaces[0]
    t = next(t for t in ns.tiers if t.tier == cpb.TIER_DRAM)
    return t.capacity_pages - t.used_pages - t.free_pages, ns.write_leases


@pytest.mark.slow
def test_a_destination_messenger_killed_mid_pull_gives_its_pages_back_at_once(cluster, tmp_path):
    """Its node holds the messenger's session: when the process is gone, the pages it had leased
    are free at once (not after --write-ttl and a quarantine), so the pull retried by a restarted
    messenger fits without evicting anything."""
    a, b = cluster(
        a_args=("--fault-stall-after", "64", "--fault-stall-s", "60", "--lanes", "1"),
        b_args=("--write-ttl", "60", "--lanes", "1"),
        b_dram="2MiB",  # 256 pages
        node_args=("--lease-ttl", "60"),  # quarantine: 180 s
    )
    others, other_pages = make_keys(56, start=50_000), make_pages(56, seed=11)
    assert b.client.put(NS, list(other_pages), keys=others).stored == 56
    keys, pages = make_keys(200), make_pages(200, seed=12)
    a.client.put(NS, list(pages), keys=keys)
    b.mclient.submit(NS, [(k, a.address) for k in keys])
    wait_until(lambda: "stalling the data stream" in a.messenger.log(), 30, "the stall")
    assert held_back(b.client)[0] > 0  # pages leased for the groups in flight
    b.messenger.kill()
    wait_until(lambda: held_back(b.client) == (0, 0), 5, "the dead messenger's pages to be free")
    messenger = start_service(
        ["messenger", "--node", b.node.address, "--write-ttl", "60"], log_dir=str(tmp_path)
    )
    try:
        with MessengerClient(messenger.address) as m:
            reply = m.submit(NS, [(k, a.address) for k in keys])
            status = m.status(reply.batch_id, wait=True, timeout_s=60)
        assert (status.done, status.failed) == (200, 0)
    finally:
        messenger.stop()
    assert b.client.stats().namespaces[0].evictions.get("dram", 0) == 0
    got = b.client.get(NS, keys=others + keys)
    assert all(g is not None and np.array_equal(g, p) for g, p in zip(got, [*other_pages, *pages]))


@pytest.mark.slow
def test_cancel_stops_a_batch_and_commits_nothing_cancelled(cluster):
    a, b = cluster(
        a_args=("--fault-stall-after", "1", "--fault-stall-s", "1.5", "--lanes", "1"),
        b_args=("--lanes", "1"),
    )
    keys, pages = make_keys(6), make_pages(6, seed=8)
    a.client.put(NS, list(pages), keys=keys)
    reply = b.mclient.submit(NS, [(k, a.address) for k in keys])
    wait_until(lambda: "stalling the data stream" in a.messenger.log(), 30, "the stall")
    cancelled = b.mclient.cancel(reply.batch_id)
    assert cancelled.finished and {e.code for e in cancelled.entries} == {"CANCELLED"}
    # The job in flight finishes its fetch, then publishes nothing of the cancelled batch.
    wait_until(
        lambda: b.metric('kvcache_messenger_transfer_entries_total{outcome="cancelled"}') == 6,
        30,
        "the in-flight job to wind up",
    )
    assert not any(present(b.client, keys))
    assert b.mclient.status(reply.batch_id).failed == 6


def test_unreachable_source_fails_unavailable(shared_pair):
    a, b = shared_pair
    s = socket.create_server(("127.0.0.1", 0))
    dead = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    reply = b.mclient.submit(NS, [(k, dead) for k in make_keys(3, start=40_000)])
    status = b.mclient.status(reply.batch_id, wait=True, timeout_s=60)
    assert status.failed == 3 and {e.code for e in status.entries} == {"UNAVAILABLE"}
    assert "cannot reach source messenger" in status.entries[0].reason


def test_bad_requests_get_clear_status_codes(shared_pair):
    a, b = shared_pair
    stub = pbg.MessengerServiceStub(grpc.insecure_channel(b.address))
    key = make_keys(1)[0]

    def code(request, method="SubmitTransfer"):
        with pytest.raises(grpc.RpcError) as e:
            getattr(stub, method)(request, timeout=10)
        return e.value.code(), e.value.details()

    entry = pb.TransferEntry(key=key, source=a.address)
    c, d = code(pb.SubmitTransferRequest(namespace="nope", entries=[entry]))
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "nope" in d
    c, d = code(
        pb.SubmitTransferRequest(
            namespace=NS, entries=[pb.TransferEntry(key=b"short", source=a.address)]
        )
    )
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "16 bytes" in d
    c, d = code(pb.SubmitTransferRequest(namespace=NS))
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "at least one" in d
    c, d = code(
        pb.SubmitTransferRequest(
            namespace=NS, entries=[pb.TransferEntry(key=key, source="nowhere")]
        )
    )
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "host:port" in d
    c, d = code(
        pb.SubmitTransferRequest(namespace=NS, entries=[entry], destination_tier=cpb.TIER_SSD)
    )
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "TIER_DRAM" in d
    c, d = code(pb.TransferStatusRequest(batch_id="nope"), "TransferStatus")
    assert c == grpc.StatusCode.NOT_FOUND
    c, d = code(pb.CancelRequest(batch_id="nope"), "Cancel")
    assert c == grpc.StatusCode.NOT_FOUND
    c, d = code(pb.TransferStatusRequest(batch_id="x", timeout_s=-1), "TransferStatus")
    assert c == grpc.StatusCode.INVALID_ARGUMENT
    for wait in (-1.0, float("nan"), 601.0):  # refused before any transfer starts
        c, d = code(pb.SubmitTransferRequest(namespace=NS, entries=[entry], wait_s=wait))
        assert c == grpc.StatusCode.INVALID_ARGUMENT and "wait_s must be in (0, 600" in d
    with pytest.raises(KVCacheRpcError):
        MessengerClient(a.address, timeout_s=5).status("missing")


def test_a_submit_that_waits_answers_the_finished_batch_in_one_call(shared_pair):
    """SubmitTransfer(wait_s): the batch's final status in the reply (what a pull a request
    waits on needs: one round trip, not a submit and a TransferStatus)."""
    a, b = shared_pair
    keys = make_keys(3, start=9100)
    pages = make_pages(3, seed=91)
    a.client.put(NS, list(pages), keys=keys)
    missing = make_keys(1, start=9200)
    reply = b.mclient.submit(NS, [(k, a.address) for k in keys + missing], wait_s=30)
    status = reply.status
    assert status.finished and status.batch_id == reply.batch_id
    assert (status.done, status.failed, status.pending) == (3, 1, 0)
    assert status.entries[3].state == pb.ENTRY_FAILED and status.entries[3].code == "NOT_FOUND"
    got = b.client.get(NS, keys=keys)
    assert all(np.array_equal(g, p) for g, p in zip(got, pages))
    # Without wait_s the reply carries no status; pull() then asks TransferStatus.
    assert not b.mclient.submit(NS, [(keys[0], a.address)]).HasField("status")
    assert b.mclient.pull(NS, keys, a.address).done == 3


def test_messenger_without_a_node_exits_with_a_message(tmp_path):
    s = socket.create_server(("127.0.0.1", 0))
    dead = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    with pytest.raises(RuntimeError, match="cannot use node"):
        start_service(
            ["messenger", "--node", dead, "--node-wait", "0.5"], log_dir=str(tmp_path), timeout_s=30
        )


@pytest.mark.slow
def test_token_everywhere(cluster):
    # the cluster's tenants, on both ends: the source checks a tenant's pulls itself
    alice = ("--tenant-token", "tt=alice")
    a, b = cluster(token="t0k", a_args=alice, b_args=alice)
    keys, pages = make_keys(16), make_pages(16, seed=10)
    a.client.put(NS, list(pages), keys=keys)
    assert transfer(b, a, keys).done == 16
    got = b.client.get(NS, keys=keys)
    assert all(np.array_equal(g, p) for g, p in zip(got, pages))
    with pytest.raises(KVCacheRpcError) as e:
        MessengerClient(b.address, timeout_s=5).stats()
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    # Its data address is not a secret: peers ask for it without a token (their data ports
    # prove themselves in HELLO; a token would go wherever a tenant named a source).
    assert MessengerClient(b.address, timeout_s=5).info().data_address
    # A tenant's pull is scoped to it: naming the admin's stored keys, it finds none of them.
    with MessengerClient(b.address, token="tt", timeout_s=5) as tenant:
        batch = tenant.submit(NS, [(keys[0], a.address)]).batch_id
        status = tenant.status(batch, wait=True, timeout_s=30)
    assert [(e.state, e.code) for e in status.entries] == [(FAILED, "NOT_FOUND")]
    # The data port wants the token too: a peer without it gets nothing.
    from messenger.tcp import TcpConfig, TcpTransport

    t = TcpTransport(TcpConfig(lanes=1))
    try:
        res = t.fetch(
            a.messenger.info["data_address"], NS, keys[:1], [memoryview(np.empty(PB, np.uint8))]
        )
    finally:
        t.close()
    assert not res[0].ok and "token" in res[0].reason


def test_messengers_of_nodes_with_tenants_move_pages_through_their_own_segments(cluster):
    """Nodes with tenant tokens have no /dev/shm slab: each messenger maps the admin identity's
    own segment (OpenShm + the segment socket) on both ends of a transfer."""
    a, b = cluster(token="t0k", node_args=("--tenant-token", "tt=alice"))
    assert a.client.namespace_info(NS).shm_socket and not a.client.namespace_info(NS).shm_name
    keys, pages = make_keys(24, start=70_000), make_pages(24, seed=11)
    a.client.put(NS, list(pages), keys=keys)
    assert transfer(b, a, keys).done == 24
    got = b.client.get(NS, keys=keys)
    assert all(np.array_equal(g, p) for g, p in zip(got, pages))
    assert a.pinned() == 0


def test_a_page_scribbled_on_after_commit_is_never_sent_and_dropped(shared_pair):
    a, b = shared_pair
    keys, pages = make_keys(4, start=80_000), make_pages(4, seed=12)
    lease = a.client.allocate(NS, keys=keys)
    for i in lease.to_write:
        lease.page(i)[:] = pages[i]
    lease.commit()
    lease.page(2)[:64] ^= 0xFF  # a same-host writer kept its view of the slab
    status = transfer(b, a, keys)
    assert status.done == 3 and status.entries[2].code == "NOT_FOUND"
    assert present(b.client, keys) == [True, True, False, True]
    assert a.client.lookup(NS, keys=keys).hit_blocks == 2  # the source dropped it


def test_conductor_transfer_hook_moves_a_plan(shared_pair):
    from conductor.messenger_hook import make_transfer_hook
    from conductor.registry import NodeDescriptor
    from conductor.scheduler import TransferPlan

    a, b = shared_pair
    keys, pages = make_keys(32, start=50_000), make_pages(32, seed=9)
    a.client.put(NS, list(pages), keys=keys)
    plan = TransferPlan(
        request_id="req-1",
        namespace=NS,
        src=NodeDescriptor(node_id="a", address=a.node.address, messenger_address=a.address),
        dst=NodeDescriptor(node_id="b", address=b.node.address, messenger_address=b.address),
        keys=tuple(keys),
        first_block=0,
        nbytes=32 * PB,
        est_seconds=0.01,
    )
    hook = make_transfer_hook()
    try:
        hook.submit(plan)
        (batch,) = hook.recent()
        assert batch.messenger == b.address and batch.blocks == 32
        status = b.mclient.status(batch.batch_id, wait=True, timeout_s=60)
        assert status.done == 32
        got = b.client.get(NS, keys=keys)
        assert all(np.array_equal(g, p) for g, p in zip(got, pages))
        no_messenger = TransferPlan(
            request_id="req-2",
            namespace=NS,
            src=plan.src,
            dst=NodeDescriptor(node_id="c"),
            keys=tuple(keys),
            first_block=0,
            nbytes=0,
            est_seconds=0,
        )
        with pytest.raises(ValueError, match="registered no messenger"):
            hook.submit(no_messenger)
    finally:
        hook.close()


def test_a_batch_of_1500_keys_mostly_missing_completes_with_not_found(cluster):
    # One lane: the source answers one FETCH of 1500 keys, 1480 of them missing (before, a run
    # of over ~1000 missing keys overflowed sendmsg's iovec limit and failed all UNAVAILABLE).
    a, b = cluster(b_args=("--lanes", "1"))
    keys, pages = make_keys(1500, start=60_000), make_pages(20, seed=11)
    a.client.put(NS, list(pages), keys=keys[1480:])
    status = transfer(b, a, keys)
    assert (status.done, status.failed) == (20, 1480)
    assert {e.code for e in status.entries[:1480]} == {"NOT_FOUND"}
    assert status.entries[0].reason == "source does not hold the key"
    assert present(b.client, keys) == [i >= 1480 for i in range(1500)]
    assert a.pinned() == 0


def dram_free(client: KVStoreClient) -> tuple[int, int]:
    (tier,) = [t for t in client.stats().namespaces[0].tiers if t.tier == cpb.TIER_DRAM]
    return tier.free_pages, tier.capacity_pages


def test_a_malformed_source_data_address_is_refused_and_leases_nothing(shared_pair):
    a, b = shared_pair
    keys = make_keys(4, start=70_000)
    free = dram_free(b.client)[0]
    stub = pbg.MessengerServiceStub(grpc.insecure_channel(b.address))
    for bad in ("no-port", "127.0.0.1:99999", "127.0.0.1:http"):
        entries = [pb.TransferEntry(key=k, source=a.address, source_data=bad) for k in keys]
        with pytest.raises(grpc.RpcError) as e:
            stub.SubmitTransfer(pb.SubmitTransferRequest(namespace=NS, entries=entries), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "source_data" in e.value.details() and "host:port" in e.value.details()
    assert dram_free(b.client)[0] == free  # nothing allocated on the destination


def test_a_job_that_fails_midway_releases_its_write_lease_at_once(start_node):
    """The mover in this process against a real node: a transport that blows up (bad source
    data of any kind) must not leave the allocated pages leased until --write-ttl."""
    from messenger.mover import DataAddressResolver, EntryRequest, Mover, MoverConfig
    from messenger.node_access import NodeAccess
    from messenger.transport import Transport

    class Exploding(Transport):
        name = "exploding"

        def fetch(self, peer, namespace, keys, views, identity=None):
            raise RuntimeError("bad source data")

        def close(self) -> None:
            pass

    node = start_node(dram="1MiB")
    client = KVStoreClient(node.address)
    access = NodeAccess(client)
    mover = Mover(
        access,
        Exploding(),
        DataAddressResolver(lambda s: "127.0.0.1:1"),
        MoverConfig(workers=1, write_ttl_s=600),
    )
    try:
        free, capacity = dram_free(client)
        assert free == capacity
        batch, _ = mover.submit(NS, [EntryRequest(k, "127.0.0.1:2") for k in make_keys(8)])
        snap = mover.status(batch, wait=True, timeout_s=30)
        assert snap.finished and snap.count("failed") == 8
        assert "bad source data" in snap.entries[0].result.reason
        assert dram_free(client)[0] == capacity  # aborted, not left to a 600 s lease
    finally:
        mover.close()
        access.close()
        client.close()


def leased(client: KVStoreClient) -> int:
    (tier,) = [t for t in client.stats().namespaces[0].tiers if t.tier == cpb.TIER_DRAM]
    return tier.capacity_pages - tier.used_pages - tier.free_pages


def pull_in_process(a: Pair, b: Pair, transport, keys: list[bytes], client=None):
    """Pull ``keys`` with a mover in this process over node B's client (``client``, or a new
    one), from messenger A's data port; the batch's final snapshot."""
    from messenger.mover import DataAddressResolver, EntryRequest, Mover, MoverConfig
    from messenger.node_access import NodeAccess

    client = client or KVStoreClient(b.node.address)
    data = a.messenger.info["data_address"]
    mover = Mover(NodeAccess(client), transport, DataAddressResolver(lambda s: data), MoverConfig())
    try:
        batch, _ = mover.submit(NS, [EntryRequest(k, a.address) for k in keys])
        return mover.status(batch, wait=True, timeout_s=60)
    finally:
        mover.close()
        transport.close()
        client.close()


@pytest.mark.slow
def test_a_job_commits_group_by_group_and_leases_a_few_groups_at_a_time(cluster):
    """Groups of 4 pages over TCP: the first group is visible on the destination before the last
    one is even asked for (commits overlap the transfer instead of following it), and the job
    never holds more than a few groups of write leases."""
    from messenger.tcp import TcpConfig, TcpTransport

    a, b = cluster(b_dram="1MiB")
    keys, pages = make_keys(32, start=500), make_pages(32, seed=11)
    a.client.put(NS, list(pages), keys=keys)
    held: list[int] = []  # write-leased pages on B whenever a group was asked for

    class Watching(TcpTransport):
        def fetch_groups(self, peer, namespace, page_bytes, n, groups, done):
            def watched():
                for i, group in enumerate(groups):
                    if i == 7:
                        wait_until(
                            lambda: b.client.lookup(NS, keys=keys[:4]).hit_blocks == 4,
                            10,
                            "the first group to be committed before the last is fetched",
                        )
                    held.append(leased(b.client))
                    yield group

            super().fetch_groups(peer, namespace, page_bytes, n, watched(), done)

    transport = Watching(TcpConfig(lanes=1, request_bytes=4 * PB))
    snap = pull_in_process(a, b, transport, keys)
    assert snap.finished and snap.count("done") == 32, snap.entries[0]
    assert len(held) == 8 and max(held) <= 16  # 4 groups of 4 at most, not all 32 pages
    assert leased(b.client) == 0
    got = b.client.get(NS, keys=keys)
    assert all(np.array_equal(got[i], pages[i]) for i in range(32))


@pytest.mark.slow
def test_corrupt_pages_fail_alone_and_every_other_group_commits(cluster):
    """Every 6th page sent is corrupted on the wire: groups of 4 with a bad page publish only
    their verified pages, the others commit whole; nothing bad is ever visible."""
    from messenger.tcp import TcpConfig, TcpTransport

    a, b = cluster(a_args=("--fault-corrupt-every", "6"))
    keys, pages = make_keys(20, start=600), make_pages(20, seed=12)
    a.client.put(NS, list(pages), keys=keys)
    transport = TcpTransport(TcpConfig(lanes=2, request_bytes=4 * PB))
    snap = pull_in_process(a, b, transport, keys)
    bad = [i for i, e in enumerate(snap.entries) if not e.result.ok]
    assert len(bad) == 3 and snap.count("done") == 17  # the 6th, 12th and 18th pages sent
    assert {snap.entries[i].result.outcome.name for i in bad} == {"DATA_LOSS"}
    assert present(b.client, keys) == [i not in bad for i in range(20)]
    got = b.client.get(NS, keys=keys)
    assert all(np.array_equal(got[i], pages[i]) for i in range(20) if i not in bad)
    assert leased(b.client) == 0


@pytest.mark.parametrize("corrupt", [False, True], ids=["clean", "corrupt-every-6"])
def test_commits_carry_the_checksums_the_pages_were_verified_against(cluster, corrupt):
    """The mover's Commit of a group that landed whole carries the xxh3-64 each page was verified
    against, aligned with the lease's keys (0 for a key B held already): B keeps them instead
    of hashing the pages again, and a reader through B's checksum checks gets the exact pages.
    A group with a page corrupted on the wire is republished without them."""
    from messenger.tcp import TcpConfig, TcpTransport

    a, b = cluster(a_args=("--fault-corrupt-every", "6") if corrupt else ())
    keys, pages = make_keys(12, start=700), make_pages(12, seed=13)
    a.client.put(NS, list(pages), keys=keys)
    b.client.put(NS, [pages[2]], keys=[keys[2]])  # held already: offset -1 in its lease
    log = CommitLog(b.node.address)
    transport = TcpTransport(TcpConfig(lanes=1, request_bytes=4 * PB))
    snap = pull_in_process(a, b, transport, keys, client=log)
    bad = {i for i, e in enumerate(snap.entries) if not e.result.ok}
    assert bad == ({6} if corrupt else set()), snap.entries  # the 6th page sent (2 is not sent)
    want = {k: xxhash.xxh3_64_intdigest(p) for k, p in zip(keys, pages)}
    with_sums = [(lease, sums) for lease, sums in log.commits if sums is not None]
    for lease, sums in with_sums:
        assert sums.tolist() == [
            want[k] if o >= 0 else 0 for k, o in zip(lease.keys, lease.offsets)
        ]
    # Groups of 4: [0..3] (2 held: no page), [4..7], [8..11]; a group with a bad page is
    # republished through a second lease (its verified pages), without checksums.
    whole = [keys[0:4], keys[8:12]] if corrupt else [keys[0:4], keys[4:8], keys[8:12]]
    assert sorted(lease.keys for lease, _ in with_sums) == sorted(whole)  # commits run in parallel
    assert len(log.commits) == 3
    with KVStoreClient(b.node.address, use_shm=False) as reader:  # checked on the way out
        got = reader.get(NS, keys=keys)
    assert [g is not None for g in got] == [i not in bad for i in range(12)]
    assert all(np.array_equal(got[i], pages[i]) for i in range(12) if i not in bad)
