"""One greedy tenant against a real node shared with another: leases it never commits and extends
forever, streams it never feeds, blocks that push everyone else's out, a flood of sessions, a
slow segment handshake. Each used to take the node from every other tenant; each is bounded now
by that tenant's share (node/quotas.py) and by deadlines that count the whole exchange."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

from clients import KVStoreClient
from kvstore.keys import keys_from_block_ids, root_key
from kvstore.shm import socket_address
from proto import common_pb2 as cpb
from proto import node_pb2 as pb
from proto import node_pb2_grpc as pbg
from rpc.channel import make_channel

from conftest import TEST_NAMESPACE as NS
from conftest import TEST_PAGE_BYTES as PB
from helpers import kvcache_cli, rpc_error, wait_until

ADMIN, MALLORY, ALICE = "admin-token", "mallory-token", "alice-token"
DRAM_PAGES = 128  # --dram 1MiB of 8 KiB pages


@pytest.fixture
def shared_node(start_node, tmp_path):
    """``shared_node(*flags)``: a node with an admin and two tenants, mallory and alice."""

    def start(*flags: str):
        (tmp_path / "admin").write_text(ADMIN + "\n")
        (tmp_path / "tenants").write_text(f"{MALLORY}=mallory\n{ALICE}=alice\n")
        return start_node(
            "--token-file", str(tmp_path / "admin"),
            "--tenant-tokens-file", str(tmp_path / "tenants"), *flags,
        )  # fmt: skip

    return start


def keys(n: int, start: int = 0, tag: bytes = b"q") -> list[bytes]:
    return keys_from_block_ids(list(range(start, start + n)), root_key(NS, tag))


def pages(n: int, seed: int = 0) -> list[np.ndarray]:
    return list(np.random.default_rng(seed).integers(0, 256, (n, PB), dtype=np.uint8))


def test_a_tenant_leases_at_most_its_share_and_others_keep_writing(shared_node):
    node = shared_node()
    with (
        KVStoreClient(node.address, token=MALLORY) as m,
        KVStoreClient(node.address, token=ALICE) as a,
    ):
        # Mallory leases the whole pool, 16 pages at a time, for an hour, and never commits.
        held, refused = [], []
        for i in range(DRAM_PAGES // 16):
            try:
                held.append(m.allocate(NS, keys=keys(16, 16 * i, b"m"), ttl_s=3600))
            except Exception as e:  # noqa: BLE001 - the refusal is what is looked at
                refused.append(e)
        assert len(held) == DRAM_PAGES // 2 // 16  # --tenant-lease-share 0.5
        assert refused and all(e.code is grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
        assert "--tenant-lease-share" in refused[0].details
        # Alice still writes (before: CapacityExhausted, every page leased) and reads back.
        assert a.put(NS, pages(32, 1), keys=keys(32, tag=b"a")).stored == 32
        got = a.get(NS, keys=keys(32, tag=b"a"))
        np.testing.assert_array_equal(np.stack(got), np.stack(pages(32, 1)))
        # What mallory holds is what the admin sees of her.
        with KVStoreClient(node.address, token=ADMIN) as admin:
            use = {t.tenant: t for t in admin.stats().tenants}
        assert use["mallory"].leases == len(held)
        assert use["mallory"].leased_pages == DRAM_PAGES // 2
        assert use["alice"].stored_blocks == 32
        for lease in held:
            lease.abort()


def test_a_tenants_lease_ends_at_its_lifetime_however_often_extended(shared_node):
    node = shared_node("--tenant-lease-lifetime", "2", "--tenant-max-leases", "3")
    with make_channel(node.address, MALLORY) as channel:
        stub = pbg.NodeServiceStub(channel)
        sel = cpb.BlockSelector(namespace=NS, keys=keys(4, tag=b"life"))
        reply = stub.Allocate(pb.AllocateRequest(blocks=sel, ttl_s=3600), timeout=10)
        assert reply.ttl_s <= 2  # an hour asked, the lifetime granted
        extend = pb.ExtendLeaseRequest(namespace=NS, lease_id=reply.lease_id, ttl_s=3600)

        def extended_in_vain():
            try:
                stub.ExtendLease(extend, timeout=10)
            except grpc.RpcError as e:
                return e.code() is grpc.StatusCode.FAILED_PRECONDITION and "lifetime" in (
                    e.details() or ""
                )
            return False

        wait_until(extended_in_vain, timeout_s=10, interval_s=0.2, what="the lifetime to end")
        # And a tenant holds a bounded number of leases (read leases too).
        for _ in range(2):
            stub.Acquire(pb.AcquireRequest(blocks=sel), timeout=10)
        code, details = rpc_error(lambda: stub.Acquire(pb.AcquireRequest(blocks=sel), timeout=10))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "--tenant-max-leases" in details


def test_blocks_of_a_tenant_over_its_share_are_evicted_first(shared_node):
    node = shared_node()
    with (
        KVStoreClient(node.address, token=MALLORY) as m,
        KVStoreClient(node.address, token=ALICE) as a,
    ):
        alice = keys(16, tag=b"alice-blocks")
        assert a.put(NS, pages(16, 2), keys=alice).stored == 16
        # Mallory writes three pools' worth of blocks (before: the LRU took alice's too).
        for i in range(3 * DRAM_PAGES // 16):
            m.put(NS, pages(16, 100 + i), keys=keys(16, 16 * i, b"flood"))
        assert a.lookup(NS, keys=alice).hit_blocks == 16
        np.testing.assert_array_equal(np.stack(a.get(NS, keys=alice)), np.stack(pages(16, 2)))


def test_a_tenant_holds_at_most_its_share_of_the_streams(shared_node):
    node = shared_node("--max-streams", "4", "--stream-idle-timeout", "30")
    never = threading.Event()
    calls, channels = [], []

    def silent_put():
        yield pb.PutChunk(header=pb.PutHeader(blocks=cpb.BlockSelector(namespace=NS)))
        never.wait(60)

    try:
        for _ in range(4):  # mallory opens every stream slot and never sends
            channel = make_channel(node.address, MALLORY)
            channels.append(channel)
            calls.append(pbg.NodeServiceStub(channel).Put.future(silent_put()))
        with KVStoreClient(node.address, token=ALICE, use_shm=False) as a:
            # Two of mallory's four are refused (before: all four held, alice refused too).
            wait_until(lambda: sum(1 for c in calls if c.done()) == 2, what="mallory's refusals")
            for c in calls:
                if c.done():
                    assert c.exception().code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert a.put(NS, pages(4, 3), keys=keys(4, tag=b"alice-stream")).stored == 4
            assert len(a.get(NS, keys=keys(4, tag=b"alice-stream"))) == 4
    finally:
        never.set()
        for c in calls:
            c.cancel()
        for channel in channels:
            channel.close()


# ---- unauthenticated local sockets ----------------------------------------------------------


def test_a_slow_segment_handshake_is_cut_by_its_total_deadline(shared_node):
    node = shared_node()
    with KVStoreClient(node.address, token=ALICE) as a:
        name = a.info().namespaces[0].shm_socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(socket_address(name))
    s.settimeout(0.1)
    t0 = time.monotonic()
    closed = None
    # A byte every 0.5 s: each read would meet a per-read timeout of 2 s (before: held forever).
    for byte in b"KVCACHE-SHM/1 " + b"ab" * 32:
        try:
            s.send(bytes([byte]))
            if s.recv(64) == b"":
                closed = time.monotonic() - t0
                break
        except socket.timeout:
            pass
        except OSError:
            closed = time.monotonic() - t0
            break
        time.sleep(0.5)
    s.close()
    # By the handshake's 2 s total deadline: long before the 33 s the trickle takes.
    assert closed is not None and closed < 15.0, closed


def test_one_user_cannot_take_every_session_of_the_node(shared_node, tmp_path):
    python = shutil.which("python3", path="/usr/bin:/bin")  # one the other user may run
    if os.geteuid() != 0 or python is None:
        pytest.skip("needs root and a system python3 to run the flood as another user")
    node = shared_node()
    with KVStoreClient(node.address, token=ALICE) as a:
        name = a.info().session_socket
    # Another user on the host opens 300 sessions and holds them.
    flood = subprocess.Popen(
        [python, "-c", _FLOOD, name, "300"],
        stdout=subprocess.PIPE,
        text=True,
        user=65534,
        group=65534,
    )
    try:
        assert flood.stdout is not None
        held = int(flood.stdout.readline())
        assert held == 64  # MAX_SESSIONS_PER_UID (before: 256, every session of the node)
        # A client of this user still gets its session (it writes through shared memory).
        with KVStoreClient(node.address, token=ALICE) as a:
            lease = a.allocate(NS, keys=keys(2, tag=b"session"))
            for i in lease.to_write:
                lease.page(i)[:] = 7
            assert lease.commit().stored == 2
        assert "holds 64 sessions" in node.log()
    finally:
        flood.kill()  # our own child, by handle
        flood.wait()


_FLOOD = """
import socket, sys
name, n = sys.argv[1], int(sys.argv[2])
addr = b"\\0" + name[1:].encode()
held = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(addr)
    s.settimeout(2)
    try:
        if s.recv(128):
            held.append(s)
    except OSError:
        pass
print(len(held), flush=True)
__import__("time").sleep(600)
"""


def test_tenant_limits_must_make_sense(start_node):
    for flag, value in (
        ("--tenant-lease-share", "1.5"),
        ("--tenant-max-leases", "0"),
        ("--tenant-lease-lifetime", "0"),
        ("--max-streams-per-tenant", "0"),
    ):
        with pytest.raises(RuntimeError, match=f"{flag} must be"):
            start_node(flag, value)


def test_status_shows_each_tenants_use(shared_node, tmp_path):
    node = shared_node()
    with KVStoreClient(node.address, token=ALICE) as a:
        a.put(NS, pages(3, 4), keys=keys(3, tag=b"status"))
        lease = a.allocate(NS, keys=keys(5, tag=b"status-held"))
        state = {
            "conductor": {"address": "127.0.0.1:1"},  # none: the node is read all the same
            "nodes": [{"id": "n0", "role": "both", "address": node.address, "messenger": ""}],
        }
        (tmp_path / "cluster.json").write_text(json.dumps(state))
        out = kvcache_cli(
            "status", "--cluster", str(tmp_path / "cluster.json"), "--token", ADMIN,
            "--interval", "0.1", "--json",
        )  # fmt: skip
        lease.abort()
    tenants = json.loads(out.stdout)["nodes"][0]["tenants"]
    alice = next(t for t in tenants if t["tenant"] == "alice")
    assert alice == {
        "tenant": "alice", "leases": 1, "leased_pages": 5, "stored_blocks": 3, "streams": 0
    }  # fmt: skip
    # A tenant sees nobody's use, not even its own, through Stats.
    assert rpc_error(lambda: KVStoreClient(node.address, token=ALICE).stats())[0] is (
        grpc.StatusCode.PERMISSION_DENIED
    )
