"""A same-host client that dies holding leases gives its pages back at once (real node and client
processes): the node holds the client's session connection and a pidfd on its process, and ends
the leases when both say it is gone, instead of at their deadline plus the write quarantine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest

from clients import KVStoreClient
from clients.node_client import KVCacheRpcError
from kvstore.shm import open_session

from conftest import TEST_NAMESPACE as NS
from conftest import TEST_PAGE_BYTES as PB
from helpers import wait_until
from kvstore_helpers import REPO_ROOT

# NOTE: one tenant leases 96 of the 128 pages here: more than a tenant's default share.
TENANT = ("--token", "admin", "--tenant-token", "tok-a=alice", "--tenant-lease-share", "1")

# A same-host writer: leases pages for 10 minutes, writes into the first, reads some pinned pages
# (a read lease), says so and blocks; with "close", closes its client first (the process lives).
HOLD_LEASES = """
import sys
from clients import KVStoreClient
from clients.node_client import KVCacheRpcError
address, token, n, then = sys.argv[1], sys.argv[2] or None, int(sys.argv[3]), sys.argv[4]
c = KVStoreClient(address, token)
ns = c.namespaces()[0]
assert c.shm_available(ns)
lease = c.allocate(ns, keys=[(1000 + i).to_bytes(16, "little") for i in range(n)], ttl_s=600)
lease.page(0)[:] = 7  # mid-write
pins = c.acquire(ns, keys=[i.to_bytes(16, "little") for i in range(4)], ttl_s=600)
assert pins.found == [True] * 4
if then == "close":
    c.close()
print(len(lease.to_write), flush=True)
sys.stdin.read()
"""


OPEN_SESSION = """
import sys
from kvstore.shm import open_session
print(open_session(sys.argv[1])[1].hex())
"""


def keys(start: int, n: int) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in range(start, start + n)]


def held(client: KVStoreClient) -> tuple[int, int, int]:
    """DRAM pages leased or quarantined (neither used nor free), write and read leases."""
    ns = client.stats().namespaces[0]
    t = next(t for t in ns.tiers if t.tier == 2)
    return t.capacity_pages - t.used_pages - t.free_pages, ns.write_leases, ns.read_leases


def hold_leases(node, token: str, n: int, then: str = "block") -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_LEASES, node.address, token, str(n), then],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == str(n), "the writer did not get its leases"
    return proc


@pytest.mark.parametrize("tenants", [False, True], ids=["shm-by-name", "tenant-memfds"])
def test_a_writer_killed_mid_write_gives_its_pages_back_at_once(start_node, tenants):
    # Lease TTL 600 s and a quarantine of 3 x 60 s: only the writer's death can free them soon.
    node = start_node(*(TENANT if tenants else ()), "--lease-ttl", "60", dram="1MiB")  # 128 pages
    token = "tok-a" if tenants else ""
    with (
        KVStoreClient(node.address, token or None) as c,
        KVStoreClient(node.address, "admin" if tenants else None) as admin,
    ):
        pages = np.random.default_rng(1).integers(0, 256, (32, PB), dtype=np.uint8)
        assert c.put(NS, list(pages), keys=keys(0, 32)).stored == 32  # others' pages
        writer = hold_leases(node, token, 96)
        try:
            assert held(admin) == (96, 1, 1)
            writer.send_signal(signal.SIGKILL)
            writer.wait(10)
            # Far sooner than the lease (600 s) and its quarantine (180 s).
            wait_until(lambda: held(admin) == (0, 0, 0), 5, "the dead writer's pages to be free")
        finally:
            writer.kill()
            writer.wait(10)
        # A new writer gets the whole capacity, without evicting anyone's pages.
        lease = c.allocate(NS, keys=keys(2000, 96))
        assert len(lease.to_write) == 96
        lease.abort()
        assert admin.stats().namespaces[0].evictions.get("dram", 0) == 0
        got = c.get(NS, keys=keys(0, 32))
        assert all(g is not None and np.array_equal(g, p) for g, p in zip(got, pages))
        # logged once the pages are free again: a moment after held() saw them free
        gone = "client pid %d is gone: ended its 2 leases, 96 pages" % writer.pid
        wait_until(lambda: gone in node.log(), 10, "the node to log the writer's end")
    assert node.stop() == 0


def test_a_live_writer_that_closed_its_client_keeps_its_leases_until_it_exits(start_node):
    """A closed session of a process that still runs proves nothing (a thread may still write):
    its leases keep their deadline until the process exits."""
    node = start_node("--lease-ttl", "60", dram="1MiB")
    with KVStoreClient(node.address) as c:
        c.put(NS, [np.zeros(PB, np.uint8)] * 4, keys=keys(0, 4))
        writer = hold_leases(node, "", 16, then="close")
        try:
            wait_until(lambda: "session of pid %d closed" % writer.pid in node.log(), 15, "EOF")
            assert held(c) == (16, 1, 1)
            writer.stdin.close()  # the process exits normally, leases open
            writer.wait(30)
            wait_until(lambda: held(c) == (0, 0, 0), 5, "the exited writer's pages to be free")
        finally:
            writer.kill()
            writer.wait(10)


def test_a_session_id_is_one_connection_and_a_foreign_one_ties_nothing(start_node):
    node = start_node(dram="1MiB")
    with KVStoreClient(node.address) as c:
        name = c.info().session_socket
        assert name.startswith("@")
        conn, sid = open_session(name)
        other, sid2 = open_session(name)
        with conn, other:
            assert len(sid) == 16 and sid2 != sid  # every connection its own session
        c.allocate(NS, keys=keys(0, 2)).abort()  # this client's session is open now
        # An id nobody holds (forged, or another node's) ties nothing: the lease lives on.
        c._session._sid = b"\x01" * 16  # type: ignore[attr-defined]
        lease = c.allocate(NS, keys=keys(0, 2))
        assert held(c) == (2, 1, 0)
        lease.abort()
        c._session._sid = b"\x01" * 65  # type: ignore[attr-defined]
        with pytest.raises(KVCacheRpcError) as bad:
            c.allocate(NS, keys=keys(0, 2))
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and held(c) == (0, 0, 0)
        # The id of a session whose process is gone: a lease still on its way ends at once.
        dead = subprocess.run(
            [sys.executable, "-c", OPEN_SESSION, name],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        c._session._sid = bytes.fromhex(dead.stdout)  # type: ignore[attr-defined]

        def refused() -> str | None:
            try:
                c.allocate(NS, keys=keys(0, 2))  # its session may not be known dead yet:
            except KVCacheRpcError as e:
                assert e.code == grpc.StatusCode.FAILED_PRECONDITION, e
                return e.details
            return None  # then this lease ends with it, as the next one is refused

        assert "session ended" in wait_until(refused, 10, "the dead session to be known")
        wait_until(lambda: held(c) == (0, 0, 0), 5, "no lease left of the dead session")
    assert node.stop() == 0
