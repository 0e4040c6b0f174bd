"""One pool for SGLang too: SGLang's HiCache controller (tests/sglang_rig.py) on node B finds the
pages another engine backed up on node A through the conductor's index (batch_exists counts
them) and its prefetch pulls them into B through B's messenger first (batch_get). Real nodes,
messengers and conductor processes."""

from __future__ import annotations

import pytest
import torch

from bench.micro.pool_ttft import start_pool
from clients.conductor_client import ConductorClient
from clients.node_client import KVStoreClient

from helpers import wait_until

pytest.importorskip("sglang.srt.mem_cache.storage")
from sglang_rig import PAGE, layout_spec, rank, tokens  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_prefix_backed_up_on_another_node_is_prefetched_through_this_one(start_kvcache):
    """Before, B's engine saw only B: a miss for pages A held. Now its prefetch hits all of
    them, the pages are A's byte for byte, and B keeps them (its node's own hit next time)."""
    conductor, nodes, _ = start_pool(start_kvcache, layout_spec(), ("A", "B"), "8MiB")
    with ConductorClient(conductor.address) as c:
        wait_until(lambda: len(c.list_nodes().nodes) == 2, 30, "the nodes to register")
    prompt = tokens(6, salt=7)
    a = rank(nodes["A"].address)
    try:
        stored, pages = a.backup(prompt, seed=1)
        assert stored == 6 * PAGE
    finally:
        a.close()
    with ConductorClient(conductor.address) as c:
        wait_until(
            lambda: any(n.indexed_blocks >= 6 for n in c.list_nodes().nodes), 30, "the index"
        )
    b = rank(nodes["B"].address, conductor=conductor.address)
    try:
        hits, loaded, got = b.prefetch(prompt)
        assert (hits, loaded) == (6 * PAGE, 6 * PAGE)
        assert len(got) == 6 and all(torch.equal(x, y) for x, y in zip(got, pages))
    finally:
        b.close()
    with KVStoreClient(nodes["B"].address) as client:
        assert client.stats().namespaces[0].tiers[0].used_pages >= 6  # kept on B
    alone = rank(nodes["B"].address)  # without the pool: B's own pages now
    try:
        assert alone.prefetch(prompt)[:2] == (6 * PAGE, 6 * PAGE)
    finally:
        alone.close()
