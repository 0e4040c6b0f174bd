"""One pool for every engine, with real vLLM engines (CPU, tiny model) on two real nodes, their
messengers and a conductor: a prefix one engine stored on its node is found by an engine on the
other node through the conductor's index, pulled into that engine's node while the request
waits (vLLM's WAITING_FOR_REMOTE_KVS), and loaded from there."""

from __future__ import annotations

import os
import signal

import pytest
from test_vllm_connector_cases import BT, LAYOUT_FLAG, MODEL, PROMPT, tokens

from bench.engines.models import MODELS, make_model
from bench.micro.pool_ttft import start_pool
from clients import KVStoreClient
from clients.conductor_client import ConductorClient
from kvstore.keys import block_keys, root_key
from plumbing.launch import free_port, start_service

from helpers import wait_until
from vllm_driver import Engine

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-pool")


@pytest.fixture(scope="module")
def model(work) -> str:
    path = str(work / MODEL)
    make_model(path, MODELS["tiny"], max_len=1024)
    return path


@pytest.fixture(scope="module")
def cluster(work):
    """A conductor and two nodes (A, B), each with its messenger, registered."""
    procs = []

    def start(*args: str):
        sp = start_service(list(args), log_dir=str(work))
        procs.append(sp)
        return sp

    try:
        conductor, nodes, _ = start_pool(start, LAYOUT_FLAG, ("A", "B"), "32MiB")
        with ConductorClient(conductor.address) as c:
            wait_until(lambda: len(c.list_nodes().nodes) == 2, 30, "the nodes to register")
        yield conductor, nodes
    finally:
        for sp in reversed(procs):
            sp.stop()


def held(node, kvcache: dict, prompt: list[int]) -> int:
    root = root_key(kvcache["namespace"], bytes.fromhex(kvcache["salt"]))
    with KVStoreClient(node.address) as c:
        return c.lookup(kvcache["namespace"], keys=block_keys(prompt, BT, root)).hit_blocks


def test_an_engine_loads_a_prefix_another_node_holds_and_keeps_it_on_its_own(model, cluster, work):
    """Before, an engine saw only its own node: B's engine recomputed what A's had stored."""
    conductor, nodes = cluster
    a, b = nodes["A"], nodes["B"]
    with Engine(model, {"node": a.address}, log_path=str(work / "a.log")) as e:
        (first,) = e.generate([PROMPT])
    keys = first["kvcache"]
    assert held(a, keys, PROMPT) == 4
    root = root_key(keys["namespace"], bytes.fromhex(keys["salt"]))
    with ConductorClient(conductor.address) as c:
        wait_until(
            lambda: c.locate(keys["namespace"], keys=block_keys(PROMPT, BT, root)).get("A") == 4,
            30,
            "the conductor to index A's pages",
        )
    pool = {"node": b.address, "conductor": conductor.address}
    with Engine(model, pool, log_path=str(work / "b.log")) as e:
        (pulled,) = e.generate([PROMPT])
        stats = e.stats()
        assert pulled["tokens"] == first["tokens"]
        assert stats["remote_pulls"] == 1 and stats["remote_failed"] == 0
        assert stats["loaded_pages"] == 4 and stats["load_failed_blocks"] == 0
        assert held(b, keys, PROMPT) == 4  # on B now: the next request hits there
        (again,) = e.generate([PROMPT])
        assert again["cached"] == 4 * BT and again["tokens"] == first["tokens"]
        assert e.stats()["remote_pulls"] == 1  # B's own hit, no second pull
        # A prompt nobody holds: no pull, computed in full.
        (fresh,) = e.generate([tokens(77, 3 * BT + 5)])
        assert fresh["cached"] == 0 and e.stats()["remote_pulls"] == 1


def test_a_pool_whose_conductor_is_gone_costs_a_miss(model, cluster, work):
    """A conductor that does not answer: the engine serves from its own node only."""
    _, nodes = cluster
    gone = f"127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    pool = {"node": nodes["B"].address, "conductor": gone, "remote_timeout_ms": 200}
    prompt = tokens(78, 4 * BT + 10)
    with Engine(model, pool, log_path=str(work / "gone.log")) as e:
        (out,) = e.generate([prompt])
        assert out["cached"] == 0 and e.stats()["remote_pulls"] == 0


def test_a_pull_that_does_not_arrive_in_time_is_recomputed_never_waited_for(model, work):
    """The source's messenger hangs (SIGSTOP) once the conductor indexed its node's pages: the
    request waits ``pull_timeout_s``, the pull is cancelled, its blocks are load errors, and
    vLLM computes them: the same tokens as the engine that computed the prompt, no hang."""
    procs = []

    def start(*args: str):
        sp = start_service(list(args), log_dir=str(work))
        procs.append(sp)
        return sp

    messengers = {}
    try:
        conductor, nodes, messengers = start_pool(start, LAYOUT_FLAG, ("C", "D"), "32MiB")
        with Engine(model, {"node": nodes["C"].address}, log_path=str(work / "c.log")) as e:
            (first,) = e.generate([PROMPT])
        keys = first["kvcache"]
        root = root_key(keys["namespace"], bytes.fromhex(keys["salt"]))
        with ConductorClient(conductor.address) as c:
            chain = block_keys(PROMPT, BT, root)
            wait_until(
                lambda: c.locate(keys["namespace"], keys=chain).get("C") == 4, 30, "the index"
            )
        os.kill(messengers["C"].pid, signal.SIGSTOP)
        pool = {"node": nodes["D"].address, "conductor": conductor.address, "pull_timeout_s": 1}
        with Engine(model, pool, log_path=str(work / "d.log")) as e:
            (out,) = e.generate([PROMPT])
            stats = e.stats()
        assert out["tokens"] == first["tokens"]
        assert stats["remote_pulls"] == 1 and stats["remote_failed"] == 1
        assert stats["load_failed_blocks"] > 0
    finally:
        if "C" in messengers:
            os.kill(messengers["C"].pid, signal.SIGCONT)
        for sp in reversed(procs):
            sp.stop()


def test_vllms_own_prefill_decode_flow_moves_the_prompt_through_the_messengers(
    model, cluster, work
):
    """As vLLM's disaggregated proxy (and llm-d's sidecar) drive a P/D connector: the prefill
    request carries ``do_remote_decode`` and one output token; its answer's kv_transfer_params
    (``do_remote_prefill``, the prefill node's messenger, the pages it stored) go with the
    decode request, whose engine pulls those pages into its own node and loads them. No
    conductor, no kvcache router."""
    _, nodes = cluster
    prompt = tokens(79, 4 * BT + 20)
    with Engine(model, {"node": nodes["A"].address}, log_path=str(work / "p.log")) as p:
        (prefilled,) = p.generate(
            [{"tokens": prompt, "kv_transfer_params": {"do_remote_decode": True}}], max_tokens=1
        )
        assert prefilled["cached"] == 0  # computed here, and stored on its node
    with Engine(model, None, log_path=str(work / "full.log")) as plain:
        (full,) = plain.generate([prompt], max_tokens=8)  # what a full computation decodes
    params = prefilled["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["kvcache_pages"] == 4
    assert params["kvcache_messenger"]  # the node's own (it was started with --messenger)
    with Engine(model, {"node": nodes["B"].address}, log_path=str(work / "pd.log")) as d:
        (decoded,) = d.generate([{"tokens": prompt, "kv_transfer_params": params}], max_tokens=8)
        stats = d.stats()
    # NOTE: vLLM's num_cached_tokens of a request loaded asynchronously can read 0 (it is set
    # at its first admission); the connector's counters say what was loaded.
    assert decoded["tokens"] == full["tokens"]
    assert stats["remote_pulls"] == 1 and stats["remote_failed"] == 0
    assert stats["loaded_pages"] == 4 and stats["load_failed_blocks"] == 0
