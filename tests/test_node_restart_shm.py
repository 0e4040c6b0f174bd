"""A node that restarts at the same address serves a new shared-memory segment: clients and
messengers that mapped the old one must follow it (found by ``kvcache bench soak``).

Before the fix, a ``KVStoreClient`` kept its mapping of the killed node's (unlinked) segment:
``put`` wrote the pages there and committed pages the new node never saw written (zeros), and
``get`` read the dead node's bytes; a messenger did the same when it pulled into or served from a
restarted node.
"""

from __future__ import annotations

import numpy as np

from clients.messenger_client import MessengerClient
from clients.node_client import KVStoreClient
from kvstore.keys import keys_from_block_ids, root_key
from plumbing.launch import ServiceProcess, free_port, start_service
from proto import messenger_pb2 as mpb

from conftest import TEST_LAYOUT
from conftest import TEST_NAMESPACE as NS
from conftest import TEST_PAGE_BYTES as PB


def free_address() -> str:
    return f"127.0.0.1:{free_port('127.0.0.1')}"  # below the ephemeral range (plumbing.launch)


def pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 256, (n, PB), dtype=np.uint8)


def keys(n: int, start: int) -> list[bytes]:
    return keys_from_block_ids(list(range(start, start + n)), root_key(NS, b"restart"))


def test_client_and_messenger_follow_a_restarted_nodes_shared_memory(tmp_path):
    log = str(tmp_path)
    addr = [free_address(), free_address()]
    maddr = [free_address(), free_address()]
    node_args = [["node", "--listen", a, "--dram", "1MiB", "--layout", TEST_LAYOUT] for a in addr]
    procs: list[ServiceProcess] = []

    def start(args: list[str]) -> ServiceProcess:
        sp = start_service(args, log_dir=log)
        procs.append(sp)
        return sp

    try:
        node0 = start(node_args[0])
        start(node_args[1])
        for i in range(2):
            start(["messenger", "--node", addr[i], "--listen", maddr[i]])
        with KVStoreClient(addr[0]) as c0, MessengerClient(maddr[1]) as m1:
            assert c0.shm_available(NS)
            first = pages(2, 1)
            c0.put(NS, first, keys=keys(2, 0))  # maps node 0's first segment
            # the messengers map the segments too: move one page each way
            done = m1.status(m1.submit(NS, [(keys(1, 0)[0], maddr[0])]).batch_id, wait=True)
            assert done.done == 1
            old_shm = node0.info["shm"][NS]

            node0.kill()  # a crash; the same node comes back at the same address
            node0 = start(node_args[0])
            assert node0.info["shm"][NS] != old_shm

            # the same client writes and reads again: through the new segment
            second = pages(3, 2)
            c0.put(NS, second, keys=keys(3, 10))
            got = c0.get(NS, keys=keys(3, 10))
            with KVStoreClient(addr[0], use_shm=False) as fresh:
                streamed = fresh.get(NS, keys=keys(3, 10))
            for i in range(3):
                assert np.array_equal(streamed[i], second[i]), f"page {i} committed wrong"
                assert np.array_equal(got[i], second[i]), f"page {i} read wrong"

            # node 1's messenger pulls from node 0's messenger (which serves the new segment)
            st = m1.status(m1.submit(NS, [(k, maddr[0]) for k in keys(3, 10)]).batch_id, wait=True)
            assert st.done == 3, st
            with KVStoreClient(addr[1], use_shm=False) as c1:
                moved = c1.get(NS, keys=keys(3, 10))
            assert all(np.array_equal(moved[i], second[i]) for i in range(3))

            # and node 0's messenger pulls into the new segment
            with KVStoreClient(addr[1]) as c1, MessengerClient(maddr[0]) as m0:
                third = pages(2, 3)
                c1.put(NS, third, keys=keys(2, 20))
                st = m0.status(
                    m0.submit(NS, [(k, maddr[1]) for k in keys(2, 20)]).batch_id, wait=True
                )
                assert [e.state for e in st.entries] == [mpb.ENTRY_DONE] * 2, st
            with KVStoreClient(addr[0], use_shm=False) as fresh:
                back = fresh.get(NS, keys=keys(2, 20))
            assert all(np.array_equal(back[i], third[i]) for i in range(2))
    finally:
        for sp in reversed(procs):
            sp.stop()


def test_a_tenant_client_follows_a_restarted_nodes_segment(tmp_path):
    """With tenants the pages travel through the tenant's own memfd segment, which has no name:
    the replies name the node instance's segment socket instead, so a client still holding the
    dead node's segment maps the new one (else the new node would commit the unwritten pages of
    its own segment, and reads would come from the dead node's memory)."""
    address = free_address()
    args = ["node", "--listen", address, "--dram", "1MiB", "--layout", TEST_LAYOUT,
            "--tenant-token", "tok-a=alice"]  # fmt: skip
    node = start_service(args, log_dir=str(tmp_path))
    try:
        with KVStoreClient(address, token="tok-a") as c:
            first = pages(2, 4)
            c.put(NS, first, keys=keys(2, 0))
            assert c.shm_available(NS)
            node.kill()
            node = start_service(args, log_dir=str(tmp_path))
            second = pages(3, 5)
            c.put(NS, second, keys=keys(3, 10))
            got = c.get(NS, keys=keys(3, 10))
            with KVStoreClient(address, token="tok-a", use_shm=False) as fresh:
                streamed = fresh.get(NS, keys=keys(3, 10))
            for i in range(3):
                assert np.array_equal(streamed[i], second[i]), f"page {i} committed wrong"
                assert np.array_equal(got[i], second[i]), f"page {i} read wrong"
    finally:
        node.stop()
