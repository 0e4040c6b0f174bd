"""The vLLM KV connector with real vLLM engines (CPU) and a real node, continued (a module of
its own so that a second test worker can run it beside test_vllm_connector.py): tenants, the
producer and consumer roles, a prefix shared within one engine step."""

# ruff: noqa: F811 - the fixtures model and reference come from test_vllm_connector (module scope:
# made again here, once), and the tests name them as arguments.

from __future__ import annotations

import numpy as np
import pytest
from test_vllm_connector import (  # noqa: F401
    LAYOUT_FLAG,
    PROMPT,
    _log,
    generate,
    held,
    model,
    reference,
)

from clients import KVStoreClient

from vllm_driver import Engine

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow


def test_tenants_do_not_hit_each_others_blocks(model, reference, start_node):
    node = start_node(
        "--token",
        "admin",
        "--tenant-token",
        "tok-a=alice",
        "--tenant-token",
        "tok-b=bob",
        dram="16MiB",
        layout=LAYOUT_FLAG,
    )
    # overlap: the round trips a GPU engine makes beside its forward (commit and release sent
    # without waiting), forced on here; every one of them must still land.
    alice = {"node": node.address, "token": "tok-a", "overlap": True}
    (a,) = generate(model, [PROMPT], alice)
    (b,) = generate(model, [PROMPT], {"node": node.address, "token": "tok-b", "overlap": True})
    assert a["tokens"] == b["tokens"] == reference
    assert b["cached"] == 0, "bob hit alice's blocks"
    (a2,) = generate(model, [PROMPT], alice)
    assert a2["cached"] == 4 * 64 and a2["tokens"] == reference
    with KVStoreClient(node.address, token="admin") as c:
        (ns,) = c.stats().namespaces
        assert ns.write_leases == 0 and ns.read_leases == 0, ns  # committed and released


def test_a_producer_only_stores_and_a_consumer_only_loads(model, reference, start_node):
    """kv_role: a disaggregated prefill engine (kv_producer) stores what it computes and loads
    nothing; a decode engine (kv_consumer) loads and stores nothing. Without vLLM's prefix
    cache, so that a second run of a prompt asks the connector again."""
    node = start_node(dram="16MiB", layout=LAYOUT_FLAG)
    other = [int(x) for x in np.random.default_rng(6).integers(1, 500, 200)]  # 3 full blocks

    def runs(kv_role: str, *prompts: list[int]) -> list[dict]:
        with Engine(model, {"node": node.address}, kv_role=kv_role, log_path=_log()) as e:
            return [e.generate([p])[0] for p in prompts]

    stored, again = runs("kv_producer", PROMPT, PROMPT)
    assert stored["tokens"] == again["tokens"] == reference
    assert stored["cached"] == again["cached"] == 0, "a producer loaded"
    assert held(node.address, stored, PROMPT) == 4
    fresh, loaded = runs("kv_consumer", other, PROMPT)
    assert fresh["cached"] == 0
    assert loaded["cached"] == 4 * 64 and loaded["tokens"] == reference
    assert held(node.address, fresh, other) == 0, "a consumer stored"


def test_requests_sharing_a_prefix_in_one_step_store_it_once_and_a_fresh_engine_loads_it(
    model, start_node
):
    """Two prompts with a common 4-block prefix, scheduled in the same engine step: the step
    saves each shared block once (an Allocate naming a key twice is refused, and a refused
    Allocate must not stall the engine), and a fresh engine loads what they stored."""
    node = start_node(dram="16MiB", layout=LAYOUT_FLAG)
    conn = {"node": node.address}
    shared = PROMPT[: 4 * 64]
    first = shared + [int(x) for x in np.random.default_rng(7).integers(1, 500, 100)]
    second = shared + [int(x) for x in np.random.default_rng(8).integers(1, 500, 90)]
    # Nothing to load yet: the first computes in full; vLLM's own cache gives the second the
    # prefix the first computes in the same step, and both save it.
    stored = generate(model, [first, second], conn)
    assert stored[0]["cached"] == 0
    assert held(node.address, stored[0], first) == 5
    assert held(node.address, stored[1], second) == 5
    loaded = generate(model, [first, second], conn)
    assert [o["cached"] for o in loaded] == [5 * 64, 5 * 64]
    assert [o["tokens"] for o in loaded] == [o["tokens"] for o in stored]
