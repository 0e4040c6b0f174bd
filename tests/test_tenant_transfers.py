"""Least privilege between a cluster's parts, with real processes: a tenant moves pages between
nodes itself, and only its own (its messenger scopes the keys it names, whatever they are); the
conductor's event feeds and transfer hook run on a service token that may do just that; nothing
but the operator's tools needs the admin token any more (engines and the router run as a
tenant: kvcache up gives them one)."""

from __future__ import annotations

import socket
import threading

import grpc
import numpy as np
import pytest

from clients.conductor_client import ConductorClient
from clients.messenger_client import MessengerClient
from clients.node_client import KVStoreClient
from kvstore.keys import block_keys, root_key, scope_keys
from messenger.identity import Identity
from messenger.tcp import TcpConfig, TcpTransport
from plumbing.launch import free_port
from proto import common_pb2 as cpb
from proto import messenger_pb2 as mpb
from proto import messenger_pb2_grpc as mpbg
from proto import node_pb2 as npb
from proto import node_pb2_grpc as npbg
from rpc.channel import make_channel
from rpc.server import SERVICE as SERVICE_ID
from rpc.wire import transfer_keys

from conftest import TEST_BLOCK_TOKENS as BT
from conftest import TEST_LAYOUT
from conftest import TEST_NAMESPACE as NS
from conftest import TEST_PAGE_BYTES as PB
from helpers import rpc_error, wait_until

ADMIN, SERVICE, ALICE, MALLORY = "admin-t", "service-t", "alice-t", "mallory-t"
DONE, FAILED = mpb.ENTRY_DONE, mpb.ENTRY_FAILED


@pytest.fixture
def cluster(start_kvcache, tmp_path):
    """A conductor and two node + messenger pairs: A (decode) and B (prefill)."""
    files = {}
    for name, text in (
        ("admin", ADMIN), ("service", SERVICE), ("data", "data-t"),
        ("tenants", f"{ALICE}=alice\n{MALLORY}=mallory"),
    ):  # fmt: skip
        files[name] = str(tmp_path / name)
        (tmp_path / name).write_text(text + "\n")
    common = ["--token-file", files["admin"], "--tenant-tokens-file", files["tenants"]]
    conductor = start_kvcache(
        "conductor", "--listen", "127.0.0.1:0", *common, "--node-token-file", files["service"],
        "--min-transfer-gain", "0", "--transfer-hook", "record",
    )  # fmt: skip
    pairs = {}
    for node_id, role in (("A", "decode"), ("B", "prefill")):
        messenger_at = f"127.0.0.1:{free_port('127.0.0.1')}"
        node = start_kvcache(
            "node", "--listen", "127.0.0.1:0", "--dram", "1MiB", "--layout", TEST_LAYOUT,
            "--node-id", node_id, "--role", role, "--messenger", messenger_at,
            "--conductor", conductor.address, "--conductor-token-file", files["admin"],
            "--service-token-file", files["service"], *common,
        )  # fmt: skip
        messenger = start_kvcache(
            "messenger", "--node", node.address, "--listen", messenger_at, *common,
            "--service-token-file", files["service"], "--data-token-file", files["data"],
        )  # fmt: skip
        pairs[node_id] = (node, messenger)
    with ConductorClient(conductor.address, ADMIN) as c:
        wait_until(lambda: len(c.list_nodes().nodes) == 2, what="the nodes to register")
    return conductor, pairs


def tokens(n_blocks: int) -> np.ndarray:
    return np.arange(1000, 1000 + n_blocks * BT, dtype=np.int64)


def pages(n: int) -> list[np.ndarray]:
    return list(np.random.default_rng(5).integers(0, 256, (n, PB), dtype=np.uint8))


def raw_keys(n_blocks: int) -> list[bytes]:
    return block_keys(tokens(n_blocks), BT, root_key(NS))


def test_a_tenant_pulls_only_its_own_blocks(cluster):
    _, pairs = cluster
    (a, ma), (b, mb) = pairs["A"], pairs["B"]
    with KVStoreClient(a.address, token=ALICE) as alice_a:
        assert alice_a.put(NS, pages(8), tokens=tokens(8)).stored == 8
    keys = raw_keys(8)  # what anyone computes from the prompt's tokens
    # Mallory names alice's blocks: her pull is scoped to her, and finds nothing.
    with MessengerClient(mb.address, MALLORY) as m:
        reply = m.submit(NS, [(k, ma.address) for k in keys])
        status = m.status(reply.batch_id, wait=True, timeout_s=30)
        assert {e.state for e in status.entries} == {FAILED}
        assert {e.code for e in status.entries} == {"NOT_FOUND"}
        assert [e.key for e in status.entries] == keys  # as she named them
        # Stats are the operator's.
        assert rpc_error(m.stats)[0] is grpc.StatusCode.PERMISSION_DENIED
    # Alice's own pull moves them (before: PERMISSION_DENIED, transfers were admin-only, so
    # engines and the router held the admin token).
    with MessengerClient(mb.address, ALICE) as m:
        reply = m.submit(NS, [(k, ma.address) for k in keys])
        status = m.status(reply.batch_id, wait=True, timeout_s=30)
        assert [e.state for e in status.entries] == [DONE] * 8, status
        batch = reply.batch_id
    with MessengerClient(mb.address, MALLORY) as m:  # her batch is hers alone
        assert rpc_error(lambda: m.status(batch))[0] is grpc.StatusCode.NOT_FOUND
        assert rpc_error(lambda: m.cancel(batch))[0] is grpc.StatusCode.NOT_FOUND
    with KVStoreClient(b.address, token=ALICE, use_shm=False) as alice_b:
        np.testing.assert_array_equal(np.stack(alice_b.get(NS, tokens=tokens(8))), pages(8))
    with KVStoreClient(b.address, token=MALLORY, use_shm=False) as mallory_b:
        assert mallory_b.lookup(NS, tokens=tokens(8)).hit_blocks == 0


def test_a_tenants_schedule_plans_a_pull_it_can_submit(cluster):
    conductor, pairs = cluster
    a = pairs["A"][0]
    with KVStoreClient(a.address, token=ALICE) as alice_a:
        alice_a.put(NS, pages(8), tokens=tokens(8))
    with ConductorClient(conductor.address, ALICE) as c:
        wait_until(lambda: c.locate(NS, tokens=tokens(8)).get("A") == 8, what="the index")
        reply = c.schedule(NS, tokens=tokens(8), request_id="r1")
    assert reply.prefill_node == "B" and len(reply.transfers) == 1
    plan = reply.transfers[0]
    assert transfer_keys(plan) == raw_keys(8)  # as alice names them (before: as stored)
    with MessengerClient(plan.dst_messenger, ALICE) as m:
        submitted = m.submit(NS, [(k, plan.src_messenger) for k in transfer_keys(plan)])
        status = m.status(submitted.batch_id, wait=True, timeout_s=30)
        assert [e.state for e in status.entries] == [DONE] * 8, status


def test_the_service_token_reads_feeds_and_moves_stored_keys_and_nothing_else(cluster):
    conductor, pairs = cluster
    a, mb = pairs["A"][0], pairs["B"][1]
    with KVStoreClient(a.address, token=ALICE) as alice_a:
        alice_a.put(NS, pages(4), tokens=tokens(4))
    # The conductor's feeds run on it: alice's blocks are indexed.
    with ConductorClient(conductor.address, ALICE) as c:
        wait_until(lambda: c.locate(NS, tokens=tokens(4)).get("A") == 4, what="the index")
    with make_channel(a.address, SERVICE) as channel:
        node = npbg.NodeServiceStub(channel)
        feed = node.Events(npb.EventsRequest(resync=True), timeout=10)
        assert next(feed).snapshot
        feed.cancel()
        for call in (
            lambda: node.Stats(npb.StatsRequest(), timeout=10),
            lambda: node.Lookup(_selector(), timeout=10),
        ):
            assert rpc_error(call)[0] is grpc.StatusCode.PERMISSION_DENIED
    with MessengerClient(mb.address, SERVICE) as m:
        # The conductor's transfer hook: keys as stored (the index's), moved as they are.
        stored = scope_keys(raw_keys(4), "alice")
        reply = m.submit(NS, [(k, pairs["A"][1].address) for k in stored])
        status = m.status(reply.batch_id, wait=True, timeout_s=30)
        assert [e.state for e in status.entries] == [DONE] * 4, status
        assert rpc_error(m.stats)[0] is grpc.StatusCode.PERMISSION_DENIED
    # A tenant's token reads no feed.
    with make_channel(a.address, ALICE) as channel:
        feed = npbg.NodeServiceStub(channel).Events(npb.EventsRequest(resync=True), timeout=10)
        assert rpc_error(lambda: next(feed))[0] is grpc.StatusCode.PERMISSION_DENIED


def test_a_source_checks_whom_a_pull_is_for_itself(cluster):
    """The source's data port, not only the destination's messenger, checks a pull's tenant.
    Before, a peer holding the data token (a messenger's credential for opening connections)
    read any tenant's pages by their stored keys. Now each request names whom it is for and
    proves it with that identity's token; the source scopes a tenant's keys itself."""
    _, pairs = cluster
    a, ma = pairs["A"]
    with KVStoreClient(a.address, token=ALICE) as alice_a:
        assert alice_a.put(NS, pages(4), tokens=tokens(4)).stored == 4
    names, stored = raw_keys(4), scope_keys(raw_keys(4), "alice")
    with MessengerClient(ma.address, ADMIN) as m:
        port = m.info().data_address

    def pull(keys: list[bytes], identity: Identity | None) -> tuple[list, np.ndarray]:
        dest = np.zeros((len(keys), PB), dtype=np.uint8)
        t = TcpTransport(TcpConfig(lanes=1, io_timeout_s=10, token="data-t"))
        try:
            res = t.fetch(port, NS, keys, [memoryview(p) for p in dest], identity)
        finally:
            t.close()
        return res, dest

    refused = {
        None: "names no identity",  # the data token alone
        Identity("mallory", b"a-guess"): "proof of its identity is wrong",
        Identity("eve", b"eve-t"): "an identity this source does not know",
    }
    for identity, why in refused.items():
        res, _ = pull(stored, identity)
        assert all(not r.ok and why in r.reason for r in res), (identity, res)
    # Mallory's own token: her names are scoped to her at the source, so alice's stored keys
    # name nothing of alice's there.
    res, _ = pull(stored, Identity("mallory", MALLORY.encode()))
    assert {r.outcome.name for r in res} == {"NOT_FOUND"}
    # Alice, with her names; the admin and the service, with the keys as stored.
    for identity, keys in (
        (Identity("alice", ALICE.encode()), names),
        (Identity("", ADMIN.encode()), stored),
        (Identity(SERVICE_ID, SERVICE.encode()), stored),
    ):
        res, dest = pull(keys, identity)
        assert all(r.ok for r in res), (identity.who, res)
        np.testing.assert_array_equal(dest, np.stack(pages(4)))


def _selector() -> cpb.BlockSelector:
    return cpb.BlockSelector(namespace=NS, token_ids=tokens(1).tolist())


class _FakeMessenger(mpbg.MessengerServiceServicer):
    """A tenant's own 'messenger': it answers GetInfo with a data port of its own, and keeps
    the metadata it was sent."""

    def __init__(self, data_address: str) -> None:
        self.data_address = data_address
        self.metadata: list[tuple[str, str]] = []

    def GetInfo(self, request, context):
        self.metadata += list(context.invocation_metadata())
        return mpb.MessengerInfo(data_address=self.data_address, namespaces=[NS])


def test_a_source_a_tenant_names_gets_no_credential(start_kvcache, start_node, tmp_path):
    """A tenant may now name the sources of its pulls: the messenger must not hand what it
    holds (the admin token, the data token) to whatever address that is (before: GetInfo with
    the admin token, then HELLO with the data token, in clear on a cluster without TLS)."""
    from concurrent import futures as cf

    (tmp_path / "admin").write_text(ADMIN + "\n")
    (tmp_path / "data").write_text("the-data-token\n")
    (tmp_path / "tenants").write_text(f"{MALLORY}=mallory\n")
    auth = [
        "--token-file",
        str(tmp_path / "admin"),
        "--tenant-tokens-file",
        str(tmp_path / "tenants"),
    ]
    node = start_node(*auth)
    messenger = start_kvcache(
        "messenger", "--node", node.address, "--listen", "127.0.0.1:0", *auth,
        "--data-token-file", str(tmp_path / "data"), "--io-timeout", "3",
    )  # fmt: skip
    data = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def listen() -> None:
        conn, _ = data.accept()
        conn.settimeout(5)
        try:
            while chunk := conn.recv(4096):
                received.extend(chunk)
        except OSError:
            pass
        conn.close()

    threading.Thread(target=listen, daemon=True).start()
    fake = _FakeMessenger(f"127.0.0.1:{data.getsockname()[1]}")
    server = grpc.server(cf.ThreadPoolExecutor(2))
    mpbg.add_MessengerServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with MessengerClient(messenger.address, MALLORY) as m:
            reply = m.submit(NS, [(k, f"127.0.0.1:{port}") for k in raw_keys(2)])
            status = m.status(reply.batch_id, wait=True, timeout_s=30)
        assert {e.state for e in status.entries} == {FAILED}
        assert fake.metadata and not any(k == "authorization" for k, _ in fake.metadata)
        assert received  # it did connect: a nonce, nothing it can use
        assert b"the-data-token" not in received and ADMIN.encode() not in received
    finally:
        server.stop(0)
        data.close()
