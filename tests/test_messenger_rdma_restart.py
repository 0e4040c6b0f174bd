"""Issue 29: RDMA registrations follow the mapping the pages live in, across node restarts.

A node that restarts serves its pool from a new shared-memory segment; leases carry the mapping
their offsets point into (``lease.slab``). Before the fix the source kept one registration per
namespace (the dead segment's: READs returned the dead node's bytes, DATA_LOSS, with no TCP
retry) and the destination one per namespace from its start (pages of the new segment were "not
in RDMA-registered memory": every pull fell back to TCP), and the dead pools stayed registered.
Each test below fails on that code: the first with DATA_LOSS, the second UNAVAILABLE, and the
one on real nodes crashes (the fake READs from the dead segment, unmapped once its client let
it go; an HCA would have kept its pages pinned and read the dead node's bytes).
"""

from __future__ import annotations

import socket

import numpy as np
import xxhash

from messenger.data_server import DataServer
from messenger.frames import Kind, lease_key, pack_keys_body, unpack_pinned
from messenger.rdma import FallbackTransport, RdmaConfig, RdmaSource, RdmaTransport
from messenger.slab_peer import fill_pattern
from messenger.tcp import TcpTransport
from messenger.transport import FetchGroup
from messenger.verbs_fake import FakeFabric, FakeVerbsBackend

from conftest import TEST_LAYOUT, TEST_PAGE_BYTES
from conftest import TEST_NAMESPACE as NODE_NS
from rdma_helpers import NS, PAGES, PB, Setup


def _pin(session, keys):
    h, body = session.request(Kind.RDMA_PIN, pack_keys_body(NS, PB, keys), count=len(keys))
    assert h.kind is Kind.RDMA_PINNED, body
    return unpack_pinned(body, len(keys))


def _mr_lkeys(backend: FakeVerbsBackend) -> set[int]:
    with backend.fabric.lock:
        return set(backend.by_lkey)


def test_the_source_registers_the_mapping_a_pin_lives_in_and_drops_the_old_one():
    s = Setup()
    try:
        assert all(r.ok for r in s.rdma.fetch(s.server.address, NS, s.keys, s.views()))
        (old,) = s.rdma_source.regions.registered()
        # A lease of the old mapping is still held (a puller mid-transfer) when it is replaced.
        other = RdmaTransport(s.dst_backend, RdmaConfig(chain=4, chains_in_flight=2))
        s.others.append(other)
        holder = other._session(s.server.address)
        held = _pin(holder, s.keys[:2])
        fresh = np.empty(PAGES * PB, dtype=np.uint8)
        fill_pattern(fresh.reshape(PAGES, PB), seed=7)  # other bytes than the old mapping's
        s.source._region = fresh  # the node restarted: its pool is a new segment
        s.dst[:] = 0
        res = s.rdma.fetch(s.server.address, NS, s.keys, s.views())
        assert all(r.ok for r in res), res[0]
        np.testing.assert_array_equal(s.dst.reshape(-1), fresh)
        regs = s.rdma_source.regions.registered()
        assert len(regs) == 2 and old in regs  # the held lease's windows still use the old
        h, _ = holder.request(Kind.RDMA_RELEASE, key=lease_key(held.lease_id))
        assert h.kind is Kind.END
        (new,) = s.rdma_source.regions.registered()  # the old one is gone with its last lease
        assert new.addr == fresh.ctypes.data and s.src_backend.deregistrations == 1
        assert _mr_lkeys(s.src_backend) == {new.lkey}
    finally:
        s.close()


def test_the_destination_registers_a_groups_mapping_and_drops_the_one_it_replaced():
    s = Setup()
    try:
        old = np.zeros(PAGES * PB, dtype=np.uint8)
        s.rdma.register_local(old, NS)  # the node's mapping at the messenger's start
        for seed in (1, 2):  # the node restarted, twice
            mapping = np.zeros((PAGES, PB), dtype=np.uint8)
            group = FetchGroup(
                list(s.keys), [memoryview(p) for p in mapping], region=mapping.reshape(-1)
            )
            res = s.rdma.fetch_group(s.server.address, NS, group)
            assert all(r.ok for r in res), res[0]
            np.testing.assert_array_equal(mapping.reshape(-1), s.src_region)
            assert group.checksums == [xxhash.xxh3_64_intdigest(p) for p in mapping]
            kept = {mr.addr for mr in s.rdma.regions.registered()}
            # Setup's own memory (kept) and the namespace's current mapping, nothing else.
            assert kept == {s.dst.ctypes.data, mapping.ctypes.data}, seed
        assert s.dst_backend.deregistrations == 2
        assert len(_mr_lkeys(s.dst_backend)) == 2
    finally:
        s.close()


def _free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_rdma_pulls_between_real_nodes_follow_both_nodes_restarts(start_kvcache):
    """The mover pulls from node A's messenger into node B over (fake) RDMA; A restarts, then
    B restarts: every pull still moves the right bytes over RDMA (no TCP fallback), and only
    the live segments stay registered on either side."""
    from clients.node_client import KVStoreClient
    from kvstore.keys import keys_from_block_ids, root_key
    from messenger.mover import DataAddressResolver, EntryRequest, Mover
    from messenger.node_access import NodeAccess, NodePageSource

    address = {"a": _free_address(), "b": _free_address()}

    def start(name: str):
        return start_kvcache(
            "node", "--listen", address[name], "--dram", "1MiB", "--layout", TEST_LAYOUT
        )

    nodes = {"a": start("a"), "b": start("b")}
    ca, cb = KVStoreClient(address["a"]), KVStoreClient(address["b"])
    fabric = FakeFabric()
    src_backend, dst_backend = FakeVerbsBackend(fabric), FakeVerbsBackend(fabric)
    source = NodePageSource(NodeAccess(ca), pin_ttl_s=10)
    server = DataServer(source).start()
    rdma_source = RdmaSource(src_backend, source)
    rdma_source.install(server)
    rdma = RdmaTransport(dst_backend)
    transport = FallbackTransport(rdma, TcpTransport())
    mover = Mover(NodeAccess(cb), transport, DataAddressResolver(lambda _: server.address))

    def round_trip(first_block: int, seed: int) -> None:
        keys = keys_from_block_ids(
            list(range(first_block, first_block + 6)), root_key(NODE_NS, b"r")
        )
        pages = np.random.default_rng(seed).integers(0, 256, (6, TEST_PAGE_BYTES), np.uint8)
        ca.put(NODE_NS, list(pages), keys=keys)
        read_before = fabric.bytes_read
        batch_id, _ = mover.submit(NODE_NS, [EntryRequest(k, "source:1") for k in keys])
        snap = mover.status(batch_id, wait=True, timeout_s=30)
        assert snap.finished and snap.count("done") == 6, snap.entries[0]
        assert fabric.bytes_read - read_before == 6 * TEST_PAGE_BYTES  # all of it over RDMA
        assert not transport.tcp_only_peers()
        with KVStoreClient(address["b"], use_shm=False) as reader:
            got = reader.get(NODE_NS, keys=keys)
        assert all(np.array_equal(g, p) for g, p in zip(got, pages))

    def shm(name: str) -> int:
        """The address of node ``name``'s segment as its messenger's client maps it now."""
        region = (ca if name == "a" else cb).shm_region(NODE_NS)
        assert region is not None
        return region.ctypes.data

    try:
        round_trip(0, 1)
        assert [mr.addr for mr in rdma_source.regions.registered()] == [shm("a")]
        assert [mr.addr for mr in rdma.regions.registered()] == [shm("b")]

        nodes["a"].kill()  # a crash; it comes back at the same address
        nodes["a"] = start("a")
        round_trip(10, 2)
        assert [mr.addr for mr in rdma_source.regions.registered()] == [shm("a")]
        assert src_backend.deregistrations == 1  # the dead segment's

        nodes["b"].kill()
        nodes["b"] = start("b")
        round_trip(20, 3)
        assert [mr.addr for mr in rdma.regions.registered()] == [shm("b")]
        assert dst_backend.deregistrations == 1
        assert src_backend.bound_windows() == 0
        assert len(_mr_lkeys(src_backend)) == len(_mr_lkeys(dst_backend)) == 1
    finally:
        mover.close()
        transport.close()
        server.stop()
        rdma_source.close()
        ca.close()
        cb.close()
