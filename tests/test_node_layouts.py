"""Any model on any node: a node started without --layout serves the layouts its clients
register (RegisterLayout), on one DRAM budget they share, and the pool follows: the conductor
learns the new layouts and messengers pull them. Real node, messenger and conductor processes on
loopback, talked to as clients do."""

from __future__ import annotations

import os

import grpc
import numpy as np

from bench.micro.pool_ttft import start_pool
from clients import KVStoreClient
from clients.conductor_client import ConductorClient
from clients.messenger_client import MessengerClient
from kvstore import KVLayout
from kvstore.keys import block_keys, root_key
from proto import common_pb2 as cpb

from helpers import rpc_error, wait_until

SMALL = KVLayout(model="small", num_layers=2, kv_heads=2, head_dim=64, block_tokens=16)  # 16 KiB
BIG = KVLayout(model="big", num_layers=4, kv_heads=2, head_dim=64, block_tokens=16)  # 32 KiB
rng = np.random.default_rng(11)


def put_prompt(c: KVStoreClient, layout: KVLayout, blocks: int):
    tokens = rng.integers(0, 30000, blocks * layout.block_tokens)
    pages = [rng.integers(0, 256, layout.page_bytes, dtype=np.uint8) for _ in range(blocks)]
    assert c.put(layout.namespace, pages, tokens=tokens).stored == blocks
    return block_keys(tokens, layout.block_tokens, root_key(layout.namespace, b"")), pages


def dram(c: KVStoreClient, namespace: str):
    """The namespace's DRAM usage in the node's Stats."""
    (ns,) = [n for n in c.stats().namespaces if n.namespace == namespace]
    return next(t for t in ns.tiers if t.tier == cpb.TIER_DRAM)


def test_a_node_without_layouts_serves_two_models_on_one_budget(start_kvcache):
    node = start_kvcache("node", "--listen", "127.0.0.1:0", "--dram", "4MiB")
    with KVStoreClient(node.address) as a, KVStoreClient(node.address) as b:
        assert [ns.split("|")[0] for ns in a.namespaces()] == ["demo"]  # served from the start
        assert a.register_layout(SMALL) is True
        assert b.register_layout(SMALL) is False  # the same layout: served already
        assert b.register_layout(BIG) is True
        assert set(a.namespaces()) >= {SMALL.namespace, BIG.namespace}
        # One model fills the whole budget while the other stores nothing...
        small = [put_prompt(a, SMALL, 32) for _ in range(8)]  # 8 x 512 KiB = 4 MiB
        assert dram(a, SMALL.namespace).used_pages == 256
        # ...and the other gets an equal share when it needs room: the first model's coldest
        # prompts go, its most recent stay, byte for byte.
        big = [put_prompt(b, BIG, 16) for _ in range(4)]  # 4 x 512 KiB = 2 MiB
        assert dram(b, BIG.namespace).used_pages == 64
        assert dram(a, SMALL.namespace).used_pages == 128
        keys, pages = small[-1]
        assert all(np.array_equal(x, y) for x, y in zip(a.get(SMALL.namespace, keys=keys), pages))
        assert a.lookup(SMALL.namespace, keys=small[0][0]).hit_blocks == 0
        keys, pages = big[-1]
        assert all(np.array_equal(x, y) for x, y in zip(b.get(BIG.namespace, keys=keys), pages))


def shm_of(pid: int) -> dict[str, int]:
    """The node's files in /dev/shm (named with its pid) -> bytes backed by memory."""
    return {
        name: os.stat(f"/dev/shm/{name}").st_blocks * 512
        for name in os.listdir("/dev/shm")
        if name.startswith("kvcache-") and f"-{pid}-" in name
    }


def test_the_budgets_room_in_dev_shm_is_held_from_the_start(start_kvcache):
    """The shared budget's slabs are sparse; the node holds their room in /dev/shm instead (a
    file reserved at start that gives the slabs what they are granted), so what the node holds
    there stays the budget: written pages cannot find /dev/shm full."""
    node = start_kvcache("node", "--listen", "127.0.0.1:0", "--dram", "4MiB")
    assert sum(shm_of(node.proc.pid).values()) == 4 << 20  # all of it held at start
    with KVStoreClient(node.address) as c:
        c.register_layout(SMALL)
        c.register_layout(BIG)
        for _ in range(3):
            put_prompt(c, SMALL, 32)  # 1.5 MiB
        put_prompt(c, BIG, 32)  # 1 MiB
        assert sum(shm_of(node.proc.pid).values()) == 4 << 20
        for _ in range(4):
            put_prompt(c, BIG, 16)  # BIG takes SMALL's pages: given back, taken again
        assert sum(shm_of(node.proc.pid).values()) == 4 << 20


def test_registering_layouts_refuses_what_it_should_with_a_reason(start_kvcache, start_node):
    node = start_kvcache(
        "node", "--listen", "127.0.0.1:0", "--dram", "4MiB", "--max-layouts", "4",
        "--token", "adm", "--tenant-token", "ta=alice",
    )  # fmt: skip
    with (
        KVStoreClient(node.address, token="adm") as admin,
        KVStoreClient(node.address, token="ta") as alice,
    ):
        code, why = rpc_error(
            lambda: alice.register_layout(
                KVLayout(model="tiny", num_layers=1, kv_heads=1, head_dim=8, block_tokens=16)
            )
        )
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "at least 4096 bytes" in why
        long_name = KVLayout(model="x" * 300, num_layers=2, kv_heads=2, head_dim=64)
        code, why = rpc_error(lambda: alice.register_layout(long_name))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "at most 256" in why
        assert alice.register_layout(SMALL) and alice.register_layout(BIG)  # half of 4
        third = KVLayout(model="third", num_layers=2, kv_heads=4, head_dim=64, block_tokens=16)
        code, why = rpc_error(lambda: alice.register_layout(third))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "its share" in why
        assert admin.register_layout(third)  # the demo layout, two of alice's and this: 4
        fifth = KVLayout(model="fifth", num_layers=2, kv_heads=4, head_dim=64, block_tokens=32)
        code, why = rpc_error(lambda: admin.register_layout(fifth))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-layouts" in why
        # A tenant's pages of a registered layout are its own, as in any namespace.
        keys, _ = put_prompt(alice, SMALL, 2)
        assert admin.lookup(SMALL.namespace, keys=keys).hit_blocks == 0
    # A node started with --layout serves those only, and says how to get the other behaviour.
    fixed = start_node()
    with KVStoreClient(fixed.address) as c:
        code, why = rpc_error(lambda: c.register_layout(SMALL))
        assert code is grpc.StatusCode.FAILED_PRECONDITION
        assert "start it without --layout" in why


def test_the_conductor_and_the_messengers_follow_layouts_registered_at_run_time(start_kvcache):
    conductor, nodes, messengers = start_pool(start_kvcache, None, ("A", "B"), "8MiB")
    with ConductorClient(conductor.address) as cc:
        wait_until(lambda: len(cc.list_nodes().nodes) == 2, 30, "the nodes to register")
        with KVStoreClient(nodes["A"].address) as a, KVStoreClient(nodes["B"].address) as b:
            a.register_layout(SMALL)  # A's engine started: B has never heard of this model
            keys, pages = put_prompt(a, SMALL, 8)
            wait_until(
                lambda: cc.locate(SMALL.namespace, keys=keys).get("A") == 8,
                30,
                "the conductor to index A's blocks of the new layout",
            )
            b.register_layout(SMALL)  # B's engine started later
            with MessengerClient(messengers["B"].address) as mb:
                status = mb.pull(SMALL.namespace, keys, messengers["A"].address, chain=True)
            assert status.done == 8, status
            got = b.get(SMALL.namespace, keys=keys)
            assert all(np.array_equal(x, y) for x, y in zip(got, pages))
