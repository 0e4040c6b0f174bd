"""The vLLM KV connector with real vLLM engines (CPU) and a real node: what one engine stores,
a fresh engine loads, producing exactly the tokens of a full computation; faults fall back."""

from __future__ import annotations

import os
import tempfile

import lmdb
import numpy as np
import pytest
import xxhash

from bench.engines.models import MODELS, make_model
from clients import KVStoreClient
from clients.torch_client import TorchKVClient
from kvstore.keys import block_keys, root_key
from kvstore.layout import KVLayout

from helpers import rpc_calls
from vllm_driver import Engine

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
LAYOUT = KVLayout(
    model=MODEL, num_layers=2, kv_heads=2, head_dim=32, dtype="bfloat16", block_tokens=64
)
LAYOUT_FLAG = "model=tiny-llama,num_layers=2,kv_heads=2,head_dim=32,dtype=bfloat16,block_tokens=64"
PROMPT = [int(x) for x in np.random.default_rng(5).integers(1, 500, 299)]  # 4 full blocks + 43


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A random 2-layer Llama (head_dim 32, as vLLM's CPU attention needs), made here."""
    path = str(tmp_path_factory.mktemp("models") / MODEL)
    make_model(path, MODELS["tiny"], max_len=1024)
    return path


def generate(
    model: str, prompts: list[list[int]], connector: dict | None = None, max_tokens: int = 8
) -> list[dict]:
    """Run a fresh engine in a process of its own (tests/vllm_driver.py) on ``prompts``."""
    with Engine(model, connector, prefix_caching=True, log_path=_log()) as e:
        return e.generate(prompts, max_tokens)


def _log() -> str:
    fd, path = tempfile.mkstemp(prefix="vllm-engine-", suffix=".log")
    os.close(fd)
    return path


def held(address: str, out: dict, prompt: list[int], token: str | None = None) -> int:
    """Leading pages of ``prompt`` the node holds under the keys the engine reported for it."""
    kv = out["kvcache"]
    root = root_key(kv["namespace"], bytes.fromhex(kv["salt"]))
    with KVStoreClient(address, token=token) as c:
        return c.lookup(kv["namespace"], keys=block_keys(prompt, 64, root)).hit_blocks


@pytest.fixture(scope="module")
def reference(model) -> list[int]:
    """Greedy tokens of a full computation, no connector."""
    (out,) = generate(model, [PROMPT])
    assert out["cached"] == 0
    return out["tokens"]


def test_a_fresh_engine_loads_what_another_stored(model, reference, start_node):
    node = start_node(dram="16MiB", layout=LAYOUT_FLAG)
    conn = {"node": node.address}
    with Engine(model, conn, prefix_caching=True, log_path=_log()) as e:
        (a,) = e.generate([PROMPT])
        stats = e.stats()
    assert a["tokens"] == reference and a["cached"] == 0
    assert held(node.address, a, PROMPT) == 4
    # The worker hashed each layer as it copied it and the Commit carried the checksums: the
    # node kept them (they are the pages' own; a wrong one would fail the load below).
    assert stats["saved_pages"] == stats["checksummed_pages"] == 4
    kv = a["kvcache"]
    keys = block_keys(PROMPT, 64, root_key(kv["namespace"], bytes.fromhex(kv["salt"])))
    with KVStoreClient(node.address, use_shm=False) as c:
        pages = c.get(kv["namespace"], keys=keys)
        lease = c.acquire(kv["namespace"], keys=keys)
        c.release(lease)
    assert list(lease.checksums) == [xxhash.xxh3_64_intdigest(p.tobytes()) for p in pages]
    # vLLM's pages hold its attention backend's bytes: the torch client, same layout and
    # tokens, finds none of them.
    with TorchKVClient.connect(node.address, LAYOUT) as kv:
        assert kv.lookup(PROMPT) == 0
    (b,) = generate(model, [PROMPT], conn)
    assert b["cached"] == 4 * 64, "engine B did not load the prefix from kvcache"
    assert b["tokens"] == reference


def test_corrupt_pages_and_a_stopped_node_fall_back_to_recompute(
    model, reference, start_kvcache, tmp_path
):
    ssd = str(tmp_path / "ssd")
    args = (
        "node",
        "--listen",
        "127.0.0.1:0",
        "--dram",
        "512KiB",
        "--ssd",
        "8MiB",
        "--ssd-dir",
        ssd,
        "--layout",
        LAYOUT_FLAG,
    )
    node = start_kvcache(*args)
    (a,) = generate(model, [PROMPT], {"node": node.address})
    assert a["tokens"] == reference
    # Push the prompt's pages down to SSD (DRAM holds 16 pages), then rot their bytes on disk.
    with KVStoreClient(node.address) as c:
        filler = np.random.default_rng(1).integers(0, 500, 64 * 16).tolist()
        c.put(LAYOUT.namespace, [np.full(LAYOUT.page_bytes, 7, np.uint8)] * 16, tokens=filler)
    node.stop()
    (data,) = [os.path.join(d, f) for d, _, fs in os.walk(ssd) for f in fs if f == "data.mdb"]
    env = lmdb.open(os.path.dirname(data), max_dbs=2, subdir=True)
    pages = env.open_db(b"pages")
    with env.begin(write=True) as txn:
        keys = [k for k, _ in txn.cursor(db=pages)]
        for k in keys:
            txn.put(k, b"\x55" * LAYOUT.page_bytes, db=pages)
    env.close()
    assert len(keys) >= 4
    node = start_kvcache(*args)  # recovers the (now corrupt) SSD pages into its index
    assert held(node.address, a, PROMPT) == 4
    (b,) = generate(model, [PROMPT], {"node": node.address})
    assert b["tokens"] == reference
    with KVStoreClient(node.address) as c:  # B tried: the node caught the rot and dropped pages
        (ns,) = c.stats().namespaces
        assert ns.corrupt_pages >= 1
    # What B recomputed in place of the rotten pages it stored again.
    assert held(node.address, b, PROMPT) == 4
    # The node is gone: every lookup fails, the engine computes everything and still answers.
    address = node.address
    node.stop()
    (c_,) = generate(model, [PROMPT], {"node": address, "block_tokens": 64})
    assert c_["tokens"] == reference and c_["cached"] == 0


STEP_CALLS = ("AcquireAllocate", "CommitRelease", "Acquire", "Allocate", "Commit", "Release")


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_a_step_that_loads_a_prefix_and_stores_the_rest_makes_two_calls(
    model, reference, start_node, overlap
):
    """Engine B loads the 3 pages engine A stored and stores the 4th in the same step: one
    AcquireAllocate and one CommitRelease (sent without waiting with ``overlap``), none of the
    four separate calls; a fresh engine then loads all 4 pages."""
    node = start_node("--metrics-port", "0", dram="16MiB", layout=LAYOUT_FLAG)
    conn = {"node": node.address, "overlap": overlap}
    # One engine, its own prefix cache emptied before each request: each asks the node as a
    # fresh engine would (a process per request costs ~8 s of vLLM imports).
    with Engine(model, conn, prefix_caching=True, log_path=_log()) as e:
        (a,) = e.generate([PROMPT[: 3 * 64 + 10]])
        assert held(node.address, a, PROMPT) == 3
        assert e.reset(connector=False)
        before = {m: rpc_calls(node, m) for m in STEP_CALLS}
        (b,) = e.generate([PROMPT])
        assert b["cached"] == 3 * 64 and b["tokens"] == reference
        calls = {m: rpc_calls(node, m) - n for m, n in before.items()}
        assert calls == {m: int(m in ("AcquireAllocate", "CommitRelease")) for m in STEP_CALLS}
        assert held(node.address, b, PROMPT) == 4
        assert e.reset(connector=False)
        (c,) = e.generate([PROMPT])
        assert c["cached"] == 4 * 64 and c["tokens"] == reference


def test_a_refused_merged_call_falls_back_to_the_separate_calls(model, reference, start_node):
    """A tenant allowed one lease at a time: the node refuses the AcquireAllocate (two leases),
    and the step makes the Acquire and the Allocate as before: the load is served, the save
    refused (the prefix is loaded, the 4th page not stored), and the engine's tokens are right."""
    node = start_node(
        "--metrics-port", "0",
        "--token", "admin", "--tenant-token", "tok-a=alice", "--tenant-max-leases", "1",
        dram="16MiB", layout=LAYOUT_FLAG,
    )  # fmt: skip
    conn = {"node": node.address, "token": "tok-a"}
    (a,) = generate(model, [PROMPT[: 3 * 64 + 10]], conn)
    assert held(node.address, a, PROMPT, "tok-a") == 3
    with Engine(model, conn, prefix_caching=True, log_path=_log()) as e:
        (b,) = e.generate([PROMPT])
        stats = e.stats()
    assert b["cached"] == 3 * 64 and b["tokens"] == reference
    assert stats["loaded_pages"] == 3 and stats["load_failed_blocks"] == 0
    assert rpc_calls(node, "AcquireAllocate", "RESOURCE_EXHAUSTED") == 1
    assert rpc_calls(node, "Allocate", "RESOURCE_EXHAUSTED") == 1
    assert held(node.address, b, PROMPT, "tok-a") == 3


def test_a_node_without_a_layout_serves_two_models_engines_at_once(
    model, tmp_path_factory, start_kvcache
):
    """Any model on any node: a node started with no --layout; two engines of two models (2 and 3
    layers) register their layouts at start, store on one DRAM budget, and each loads its own
    prompt back with the tokens of its full computation."""
    other = str(tmp_path_factory.mktemp("models") / "tiny-3-layers")
    make_model(other, dict(MODELS["tiny"], num_hidden_layers=3), max_len=1024)
    node = start_kvcache("node", "--listen", "127.0.0.1:0", "--dram", "16MiB")
    conn = {"node": node.address, "block_tokens": 64}
    spaces = []
    with (
        Engine(model, conn, prefix_caching=True, log_path=_log()) as a,
        Engine(other, conn, prefix_caching=True, log_path=_log()) as b,
    ):
        for e in (a, b):
            (first,) = e.generate([PROMPT])
            e.reset(connector=False)  # vLLM's own cache emptied: the next asks the node
            (again,) = e.generate([PROMPT])
            assert first["cached"] == 0 and again["cached"] == 4 * 64
            assert again["tokens"] == first["tokens"]
            spaces.append(first["kvcache"]["namespace"])
    assert spaces[0] != spaces[1] and "|L3|" in spaces[1]
    with KVStoreClient(node.address) as c:
        used = {n.namespace: sum(t.used_pages for t in n.tiers) for n in c.stats().namespaces}
    assert used[spaces[0]] >= 4 and used[spaces[1]] >= 4  # both on the one budget
