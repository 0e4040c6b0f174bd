"""Same-host shared memory per tenant (real node processes): with tenant tokens, each tenant maps
a memfd segment of its own, handed over a Unix socket for a one-time ticket; nothing is in
/dev/shm, and a hostile local tenant cannot reach another tenant's pages. DRAM page checksums,
the node's own or the writer's (sent with Commit)."""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any

import grpc
import numpy as np
import pytest
import xxhash

from clients import KVStoreClient
from kvstore.errors import StorageError
from kvstore.shm import SHM_HELLO, recv_segment, socket_address
from proto import node_pb2 as pb
from proto import node_pb2_grpc as pbg
from rpc.channel import make_channel

from conftest import TEST_BLOCK_TOKENS, TEST_NAMESPACE, TEST_PAGE_BYTES
from helpers import rpc_error

NS = TEST_NAMESPACE
TENANTS = ("--token", "admin", "--tenant-token", "tok-a=alice", "--tenant-token", "tok-b=bob")


def pages_for(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, TEST_PAGE_BYTES, dtype=np.uint8) for _ in range(n)]


def tokens(n_blocks: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n_blocks * TEST_BLOCK_TOKENS, dtype=np.int64)


def no_streaming(client: KVStoreClient) -> KVStoreClient:
    """Make any streamed Put / Get of ``client`` fail the test: pages must go through memory."""

    def refuse(*a, **kw):
        raise AssertionError("a streamed Put/Get happened: shared memory was not used")

    client._put_streamed = refuse  # type: ignore[method-assign]
    client._get_streamed = refuse  # type: ignore[method-assign]
    return client


def contains_page(region: np.ndarray, page: np.ndarray) -> bool:
    rows = region[: len(region) // TEST_PAGE_BYTES * TEST_PAGE_BYTES].reshape(-1, TEST_PAGE_BYTES)
    return bool((rows == page).all(axis=1).any())


def shm_of(pid: int) -> set[str]:
    """/dev/shm names a kvcache process of ``pid`` created."""
    return {n for n in os.listdir("/dev/shm") if f"-{pid}-" in n}


def hello(address: str, payload: bytes) -> tuple[bytes, list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(socket_address(address))
        s.sendall(payload)
        msg, fds, _, _ = socket.recv_fds(s, 256, 1)
    for fd in fds:
        os.close(fd)
    return msg, fds


def test_each_tenant_maps_only_its_own_segment_and_nothing_is_in_dev_shm(start_node):
    node = start_node(*TENANTS)
    assert shm_of(node.pid) == set()  # no name anyone on the host could open
    info = pbg.NodeServiceStub(make_channel(node.address, "tok-a")).GetInfo(pb.GetInfoRequest())
    (ns,) = info.namespaces
    assert ns.shm_name == "" and ns.shm_socket.startswith("@")
    a_pages, b_pages = pages_for(4, seed=1), pages_for(4, seed=2)
    with (
        no_streaming(KVStoreClient(node.address, token="tok-a")) as alice,
        no_streaming(KVStoreClient(node.address, token="tok-b")) as bob,
    ):
        # both keep the zero-copy same-host path: no streamed Put or Get below
        assert alice.shm_available(NS) and bob.shm_available(NS)
        assert alice.put(NS, a_pages, tokens=tokens(4)).stored == 4
        assert bob.put(NS, b_pages, tokens=tokens(4)).stored == 4  # the same tokens
        for want, got in zip(a_pages, alice.get(NS, tokens=tokens(4))):
            np.testing.assert_array_equal(want, got)
        for want, got in zip(b_pages, bob.get(NS, tokens=tokens(4))):
            np.testing.assert_array_equal(want, got)
        a_region, b_region = alice.shm_region(NS), bob.shm_region(NS)
        assert a_region is not None and b_region is not None
        assert a_region.ctypes.data != b_region.ctypes.data
        # While bob holds his pages (pinned and shown in his segment), and writes new ones...
        with bob.acquire(NS, tokens=tokens(4)) as b_read:
            b_write = bob.allocate(NS, tokens=tokens(2, start=100))
            for i in b_write.to_write:
                b_write.page(i)[:] = b_pages[i]
            for i in range(4):
                np.testing.assert_array_equal(b_read.page(i), b_pages[i])
            # ...alice's own offsets, and every other offset of the one segment she can map,
            # show none of bob's bytes: her mapping is a different segment, not an alias.
            with alice.acquire(NS, tokens=tokens(4)) as a_read:
                for i in range(4):
                    np.testing.assert_array_equal(a_read.page(i), a_pages[i])
                for page in b_pages:
                    assert not contains_page(a_region, page)
                for off in b_read.offsets + b_write.offsets:
                    assert not any(
                        np.array_equal(a_region[off : off + TEST_PAGE_BYTES], p) for p in b_pages
                    )
            assert b_write.commit().stored == 2
        # bob's keys, named raw by alice, are alice's (scoped) keys: not bob's blocks
        assert alice.lookup(NS, tokens=tokens(2, start=100)).hit_blocks == 0
        assert shm_of(node.pid) == set()


def test_the_segment_socket_refuses_anything_but_a_fresh_ticket(start_node):
    node = start_node(*TENANTS)
    alice = pbg.NodeServiceStub(make_channel(node.address, "tok-a"))
    reply = alice.OpenShm(pb.OpenShmRequest(namespace=NS))
    addr = reply.socket
    # a wrong ticket, the bearer token itself, garbage, nothing: refused, and no descriptor comes
    for payload in (
        SHM_HELLO + b" " + os.urandom(32).hex().encode() + b"\n",
        SHM_HELLO + b" " + b"tok-a".hex().encode() + b"\n",
        b"tok-a\n",
        b"Bearer tok-b\n",
        b"\n",
    ):
        msg, fds = hello(addr, payload)
        assert msg.startswith(b"DENIED") and fds == []
    with pytest.raises(StorageError, match="refused"):
        recv_segment(addr, os.urandom(32))
    # the real ticket works once: a replay (a sniffed or reused ticket) is refused
    seg = recv_segment(addr, reply.ticket)
    try:
        assert seg.size == reply.segment_bytes
        with pytest.raises(PermissionError):  # sealed: shrinking would SIGBUS the node
            os.ftruncate(seg.fd, 0)
    finally:
        seg.close()
    with pytest.raises(StorageError, match="refused"):
        recv_segment(addr, reply.ticket)
    # a ticket needs the tenant's token on the gRPC channel first
    code, _ = rpc_error(
        lambda: pbg.NodeServiceStub(make_channel(node.address, "wrong")).OpenShm(
            pb.OpenShmRequest(namespace=NS)
        )
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED
    code, _ = rpc_error(lambda: alice.OpenShm(pb.OpenShmRequest(namespace="nope")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_without_tenants_the_shared_slab_is_as_before(start_node):
    node = start_node()
    stub = pbg.NodeServiceStub(make_channel(node.address))
    (ns,) = stub.GetInfo(pb.GetInfoRequest()).namespaces
    assert ns.shm_name and ns.shm_socket == ""
    assert shm_of(node.pid) == {ns.shm_name}
    code, msg = rpc_error(lambda: stub.OpenShm(pb.OpenShmRequest(namespace=NS)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "shm_name" in msg
    with no_streaming(KVStoreClient(node.address)) as c:
        assert c.shm_available(NS)
        c.put(NS, pages_for(1, 3), tokens=tokens(1))


def test_a_dram_page_scribbled_on_after_commit_is_data_loss_on_get_and_dropped(start_node):
    node = start_node()
    pages = pages_for(3, seed=4)
    with (
        KVStoreClient(node.address) as writer,
        KVStoreClient(node.address, use_shm=False) as reader,
    ):
        lease = writer.allocate(NS, tokens=tokens(3))
        for i in lease.to_write:
            lease.page(i)[:] = pages[i]
        assert lease.commit().stored == 3
        lease.page(1)[100:200] = 0xA5  # the writer kept its view and scribbles after the commit
        code, msg = rpc_error(lambda: reader.get(NS, tokens=tokens(3)))
        assert code == grpc.StatusCode.DATA_LOSS and "checksum" in msg
        assert reader.lookup(NS, tokens=tokens(3)).hit_blocks == 1  # page 1 dropped
        got = reader.get(NS, tokens=tokens(3))
        np.testing.assert_array_equal(got[0], pages[0])
        assert got[1] is None
        np.testing.assert_array_equal(got[2], pages[2])


def test_a_tenants_scribbles_after_commit_never_reach_the_stored_page(start_node):
    node = start_node(*TENANTS)
    pages = pages_for(2, seed=5)
    with (
        KVStoreClient(node.address, token="tok-a") as alice,
        KVStoreClient(node.address, token="tok-a", use_shm=False) as streamed,
    ):
        lease = alice.allocate(NS, tokens=tokens(2))
        for i in lease.to_write:
            lease.page(i)[:] = pages[i]
        assert lease.commit().stored == 2
        region = alice.shm_region(NS)
        assert region is not None
        region[:] = 0x5A  # her whole segment, after the commit
        for want, got in zip(pages, streamed.get(NS, tokens=tokens(2))):
            np.testing.assert_array_equal(want, got)
        for want, got in zip(pages, alice.get(NS, tokens=tokens(2))):
            np.testing.assert_array_equal(want, got)


# ---- the writer's checksums at Commit ------------------------------------------------------------


def sums_of(pages: list[np.ndarray]) -> np.ndarray:
    return np.array([xxhash.xxh3_64_intdigest(p) for p in pages], dtype=np.uint64)


@dataclasses.dataclass
class Writing:
    node: Any
    token: str | None  # alice's, with tenants
    writer: KVStoreClient  # through shared memory only
    reader: KVStoreClient  # streamed: through the node's checksum checks


@pytest.fixture(params=[False, True], ids=["shared-slab", "tenants"])
def writing(request, start_node):
    """A node without tenants, or with them: a writer and a reader of the same tenant."""
    node = start_node(*TENANTS) if request.param else start_node()
    token = "tok-a" if request.param else None
    with (
        no_streaming(KVStoreClient(node.address, token=token)) as writer,
        KVStoreClient(node.address, token=token, use_shm=False) as reader,
    ):
        yield Writing(node, token, writer, reader)


def written(client: KVStoreClient, pages: list[np.ndarray]):
    """A write lease for ``len(pages)`` blocks with its pages written in shared memory."""
    lease = client.allocate(NS, tokens=tokens(len(pages)))
    for i in lease.to_write:
        lease.page(i)[:] = pages[i]
    return lease


def test_a_commit_with_the_writers_checksums_serves_its_pages_verified(writing):
    pages = pages_for(4, seed=6)
    writing.writer.put(NS, pages[:1], tokens=tokens(1))
    lease = written(writing.writer, pages)
    assert lease.to_write == [1, 2, 3]  # key 0 is stored: no page, its value is ignored
    sums = sums_of(pages)
    sums[0] = 12345
    assert lease.commit(sums).stored == 3
    for want, got in zip(pages, writing.reader.get(NS, tokens=tokens(4))):  # checked on the way
        np.testing.assert_array_equal(want, got)
    with writing.writer.acquire(NS, tokens=tokens(4)) as pinned:  # what messengers check against
        assert pinned.checksums == sums_of(pages).tolist()


def test_a_wrong_writers_checksum_drops_only_that_page_never_serves_it(writing):
    pages = pages_for(3, seed=7)
    sums = sums_of(pages)
    sums[1] ^= 1  # a writer that got page 1's checksum wrong
    assert written(writing.writer, pages).commit(sums).stored == 3
    code, msg = rpc_error(lambda: writing.reader.get(NS, tokens=tokens(3)))
    assert code == grpc.StatusCode.DATA_LOSS and "checksum" in msg
    assert writing.reader.lookup(NS, tokens=tokens(3)).hit_blocks == 1  # page 1 dropped
    got = writing.writer.get(NS, tokens=tokens(3))
    np.testing.assert_array_equal(got[0], pages[0])
    assert got[1] is None
    np.testing.assert_array_equal(got[2], pages[2])
    if writing.token is None:
        return
    theirs = pages_for(3, seed=8)
    with no_streaming(KVStoreClient(writing.node.address, token="tok-b")) as bob:
        bob.put(NS, theirs, tokens=tokens(3))  # the same tokens: his own blocks
        for want, got in zip(theirs, bob.get(NS, tokens=tokens(3))):
            np.testing.assert_array_equal(want, got)


def test_checksums_of_the_wrong_length_are_invalid_and_the_lease_stays_open(writing):
    pages = pages_for(3, seed=9)
    lease, sums = written(writing.writer, pages), sums_of(pages)
    code, msg = rpc_error(lambda: writing.writer.commit(lease, sums[:2]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "2 checksums for its 3 keys" in msg, msg
    raw = pbg.NodeServiceStub(make_channel(writing.node.address, writing.token))
    request = pb.LeaseRequest(namespace=NS, lease_id=lease.lease_id, checksums=sums.tobytes()[:-1])
    code, msg = rpc_error(lambda: raw.Commit(request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "8 bytes per key" in msg, msg
    assert writing.reader.lookup(NS, tokens=tokens(3)).hit_blocks == 0  # nothing published
    assert writing.writer.commit_async(lease, sums).result().stored == 3  # the same lease, right
    for want, got in zip(pages, writing.reader.get(NS, tokens=tokens(3))):
        np.testing.assert_array_equal(want, got)


# ---- TenantSegments in-process ----------------------------------------------------------------


def test_segments_tickets_are_bound_to_their_tenant_and_expire(monkeypatch):
    from kvstore.layout import KVLayout
    from kvstore.store import StoreConfig, TieredStore
    from node import segments as segments_module
    from node.segments import TenantSegments

    layout = KVLayout(
        model="unit", num_layers=1, kv_heads=1, head_dim=8, dtype="float16", block_tokens=4
    )
    store = TieredStore(layout, StoreConfig(dram_pages=4, private_dram=True))
    segs = TenantSegments({store.namespace: store})
    try:
        pb_ = layout.page_bytes
        for tenant, fill in (("alice", 1), ("bob", 2)):
            segs.page(store.namespace, tenant, 0)[:] = fill
        mapped = recv_segment(segs.socket_name, segs.ticket(store.namespace, "bob"))
        try:
            assert (mapped.array[:pb_] == 2).all()  # bob's ticket maps bob's segment
        finally:
            mapped.close()
        monkeypatch.setattr(segments_module, "TICKET_TTL_S", -1.0)
        with pytest.raises(StorageError, match="refused"):
            recv_segment(segs.socket_name, segs.ticket(store.namespace, "alice"))
        # A page shown by two leases of a tenant stays until the last one ends, then goes.
        segs.hold(store.namespace, 1, "alice", [0, -1])
        segs.hold(store.namespace, 2, "alice", [0])
        segs.drop(store.namespace, 1)
        assert (segs.page(store.namespace, "alice", 0) == 1).all()
        segs.drop(store.namespace, 2)
        assert not segs.page(store.namespace, "alice", 0).any()
        assert (segs.page(store.namespace, "bob", 0) == 2).all()  # bob's own is untouched
    finally:
        segs.close()
        store.close()


def tenant_segment_bytes(pid: int) -> int:
    """Bytes backed in a node process's tenant segments (the memfds labelled kvcache-tenant)."""
    backed: dict[int, int] = {}  # by inode: a segment may be open on several descriptors
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:kvcache-tenant"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                backed[st.st_ino] = st.st_blocks * 512
        except OSError:
            continue  # closed meanwhile
    return sum(backed.values())


def test_a_tenants_segment_holds_only_the_pages_of_its_live_leases(start_node):
    """Each tenant's segment is as large as the DRAM pool (any slot may be leased to it), but
    sparse: a page is backed while a lease of the tenant shows it, and given back when the last
    one ends. So writing and reading the pool over and over costs a tenant nothing once its
    leases end, and its live leases (bounded by --tenant-lease-share) are what it holds."""
    node = start_node(*TENANTS, dram="4MiB")  # 512 pages of 8 KiB
    with no_streaming(KVStoreClient(node.address, token="tok-a")) as alice:
        for i in range(8):  # 384 pages written through the segment, committed, read back
            start = 10_000 * i
            assert alice.put(NS, pages_for(48, i), tokens=tokens(48, start)).stored == 48
            assert all(p is not None for p in alice.get(NS, tokens=tokens(48, start)))
        assert tenant_segment_bytes(node.pid) == 0
        lease = alice.allocate(NS, tokens=tokens(20, start=90_000))
        for i, page in zip(lease.to_write, pages_for(20, 99)):
            lease.page(i)[:] = page
        assert tenant_segment_bytes(node.pid) == 20 * TEST_PAGE_BYTES  # its live lease
        lease.abort()
        assert tenant_segment_bytes(node.pid) == 0
