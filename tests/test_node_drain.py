"""A node that leaves hands its hottest blocks to its peers (``kvcache drain``, SIGTERM with
``--drain-bytes``): real node, messenger and conductor processes on loopback; the peers pull
through the messengers, the conductor's index follows, the bytes are the ones written."""

from __future__ import annotations

import numpy as np
import pytest

from bench.micro.pool_ttft import start_pool
from clients import KVStoreClient
from clients.conductor_client import ConductorClient
from kvstore.keys import block_keys, root_key
from plumbing.launch import free_port, start_service

from helpers import kvcache_cli, rpc_error, wait_until

LAYOUT = "model=drain,num_layers=2,kv_heads=2,head_dim=32,dtype=bfloat16,block_tokens=64"
PAGE = 2 * 2 * 64 * 2 * 32 * 2  # layers x K|V x tokens x heads x dims x bytes: 32 KiB
CHAIN = 8  # blocks per prompt
rng = np.random.default_rng(5)


@pytest.fixture
def services(tmp_path):
    procs = []

    def start(*args: str):
        sp = start_service(list(args), log_dir=str(tmp_path))
        procs.append(sp)
        return sp

    yield start
    for sp in reversed(procs):
        sp.stop()


def write_prompts(address: str, n: int) -> tuple[str, list[list[bytes]], dict[bytes, np.ndarray]]:
    """``n`` prompts of CHAIN blocks, written in order (the last written is the hottest)."""
    with KVStoreClient(address) as c:
        (ns,) = c.namespaces()
        chains, data = [], {}
        for _ in range(n):
            tokens = rng.integers(0, 30000, CHAIN * 64)
            pages = [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(CHAIN)]
            assert c.put(ns, pages, tokens=tokens).stored == CHAIN
            keys = block_keys(tokens, 64, root_key(ns, b""))
            chains.append(keys)
            data.update(zip(keys, pages))
    return ns, chains, data


def held(address: str, ns: str, keys: list[bytes]) -> dict[bytes, np.ndarray]:
    with KVStoreClient(address) as c:
        return {k: p for k, p in zip(keys, c.get(ns, keys=keys)) if p is not None}


def test_kvcache_drain_hands_the_hottest_blocks_to_the_peers_and_the_node_leaves(services):
    conductor, nodes, _ = start_pool(services, LAYOUT, ("A", "B", "C"), "8MiB")
    with ConductorClient(conductor.address) as cc:
        wait_until(lambda: len(cc.list_nodes().nodes) == 3, 30, "the nodes to register")
    ns, chains, data = write_prompts(nodes["A"].address, 4)
    cold, hot = chains[:2], chains[2:]  # a budget of two prompts: the last two written
    out = kvcache_cli("drain", nodes["A"].address, "--max-bytes", str(2 * CHAIN * PAGE))
    assert out.returncode == 0, out.stderr
    assert f"{2 * CHAIN} of {2 * CHAIN} blocks on the peers" in out.stdout
    assert "the node is leaving" in out.stdout
    assert nodes["A"].proc.wait(30) == 0  # it left, cleanly

    on_peers = {**held(nodes["B"].address, ns, data), **held(nodes["C"].address, ns, data)}
    assert set(on_peers) == {k for chain in hot for k in chain}  # the hottest, and only those
    assert all(np.array_equal(on_peers[k], data[k]) for k in on_peers)  # byte for byte
    with ConductorClient(conductor.address) as cc:
        wait_until(lambda: len(cc.list_nodes().nodes) == 2, 30, "A to leave the conductor")
        for chain in hot:  # a prompt's blocks went to one peer: its prefix is found whole
            wait_until(
                lambda chain=chain: max(cc.locate(ns, keys=chain).values(), default=0) == CHAIN,
                30,
                "the conductor to index the prompt on a peer",
            )
        assert all(max(cc.locate(ns, keys=c).values(), default=0) == 0 for c in cold)


def test_sigterm_with_drain_bytes_hands_over_before_the_node_exits(services):
    conductor, nodes, _ = start_pool(services, LAYOUT, ("B",), "8MiB")
    messenger_at = f"127.0.0.1:{free_port('127.0.0.1')}"
    a = services(
        "node", "--listen", "127.0.0.1:0", "--dram", "8MiB", "--layout", LAYOUT, "--node-id",
        "A", "--messenger", messenger_at, "--conductor", conductor.address,
        "--drain-bytes", "1MiB", "--drain-seconds", "20",
    )  # fmt: skip
    services("messenger", "--node", a.address, "--listen", messenger_at)
    with ConductorClient(conductor.address) as cc:
        wait_until(lambda: len(cc.list_nodes().nodes) == 2, 30, "the nodes to register")
    ns, chains, data = write_prompts(a.address, 2)
    assert a.stop(60) == 0
    assert set(held(nodes["B"].address, ns, data)) == set(data)  # 512 KiB: all of it


def test_a_node_registered_in_etcd_drains_to_the_peers_etcd_lists(services, etcd_server):
    """As the Kubernetes manifests run nodes: registered in etcd (no --conductor), SIGTERM with
    --drain-bytes finds its peers in etcd's node records."""
    etcd = ["--etcd", etcd_server.endpoint, "--etcd-ttl", "2"]
    node = {}
    for node_id in ("A", "B"):
        messenger_at = f"127.0.0.1:{free_port('127.0.0.1')}"
        drains = ["--drain-bytes", "1MiB", "--drain-seconds", "20"] if node_id == "A" else []
        node[node_id] = services(
            "node", "--listen", "127.0.0.1:0", "--dram", "8MiB", "--layout", LAYOUT,
            "--node-id", node_id, "--messenger", messenger_at, *etcd, *drains,
        )  # fmt: skip
        services("messenger", "--node", node[node_id].address, "--listen", messenger_at)
    ns, chains, data = write_prompts(node["A"].address, 2)
    assert node["A"].stop(60) == 0
    assert set(held(node["B"].address, ns, data)) == set(data)


def test_bad_drains_get_a_clear_error(services, tmp_path):
    # No messenger: the peers would have nothing to pull from.
    lone = services("node", "--listen", "127.0.0.1:0", "--dram", "4MiB", "--layout", LAYOUT)
    out = kvcache_cli("drain", lone.address)
    assert out.returncode == 1
    assert "FAILED_PRECONDITION" in out.stderr and "--messenger" in out.stderr
    assert lone.alive()  # a refused drain does not stop the node

    # A pool of one: no peer to take the blocks.
    _, nodes, _ = start_pool(services, LAYOUT, ("A",), "4MiB")
    out = kvcache_cli("drain", nodes["A"].address)
    assert out.returncode == 1 and "no peer" in out.stderr
    assert nodes["A"].alive()

    # A peer that is not an address.
    with KVStoreClient(nodes["A"].address, use_shm=False) as c:
        code, says = rpc_error(lambda: c.drain(peers=["nowhere"]))
    assert code.name == "INVALID_ARGUMENT" and "host:port" in says

    # A tenant may not move every tenant's blocks.
    guarded = services(
        "node", "--listen", "127.0.0.1:0", "--dram", "4MiB", "--layout", LAYOUT,
        "--token", "admin", "--tenant-token", "tok-a=alice",
    )  # fmt: skip
    with KVStoreClient(guarded.address, "tok-a", use_shm=False) as c:
        code, says = rpc_error(lambda: c.drain())
    assert code.name == "PERMISSION_DENIED" and "Drain" in says

    # Usage errors: exit 2 and what to fix.
    out = kvcache_cli("drain", "no-such-node", "--cluster", str(tmp_path / "none.json"))
    assert out.returncode == 2 and "HOST:PORT" in out.stderr
    out = kvcache_cli("drain", lone.address, "--max-bytes", "lots")
    assert out.returncode == 2 and "--max-bytes" in out.stderr
    out = kvcache_cli("drain", lone.address, "--seconds", "0")
    assert out.returncode == 2 and "--seconds" in out.stderr

    # A node told to drain on exit with nobody to ask for peers refuses to start.
    out = kvcache_cli("node", "--dram", "4MiB", "--layout", LAYOUT, "--drain-bytes", "1GiB")
    assert out.returncode != 0 and "--drain-bytes needs --messenger" in out.stderr
