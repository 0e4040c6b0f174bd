"""The vLLM connector off the happy path, with real vLLM engines (CPU, tiny model) and a real
node: a page gone between the scheduler's Lookup and the worker's Acquire, cache salts and LoRA
adapters, a model of the same name, preempted requests, a node that stops answering, fp8 KV
caches, reset_cache and the connector's stats. Engines are driven one call at a time
(tests/vllm_driver.py) and shared by the tests of the module where they can be; prefix caching
is off, so every run asks the connector."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from bench.models import MODELS, make_model
from clients import KVStoreClient
from kvstore.keys import block_keys, root_key
from rpc.launch import start_service

from vllm_driver import Engine

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
BT = 64  # kvcache block tokens: two vLLM blocks of 32
LAYOUT_FLAG = f"model={MODEL},num_layers=2,kv_heads=2,head_dim=32,dtype=bfloat16,block_tokens={BT}"
NS = f"{MODEL}|L2|H2|D32|bfloat16|B{BT}"


def tokens(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 500, n)]


PROMPT = tokens(5, 299)  # 4 full pages + 43 tokens
BASE = tokens(11, 3 * BT)
STORED = BASE + tokens(12, 40)  # 3 full pages
EXTENDED = BASE + tokens(13, 150)  # the same 3 pages, then 2 more + 22 tokens
PROMPTS = {"prompt": PROMPT, "stored": STORED, "extended": EXTENDED}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-cases")


@pytest.fixture(scope="module")
def model(work) -> str:
    path = str(work / "a" / MODEL)
    make_model(path, MODELS["tiny"], max_len=1024)
    return path


@pytest.fixture(scope="module")
def node(work):
    sp = start_service(
        ["node", "--listen", "127.0.0.1:0", "--dram", "64MiB", "--layout", LAYOUT_FLAG],
        log_dir=str(work),
    )
    yield sp
    sp.stop()


@pytest.fixture(scope="module")
def reference(model, work) -> dict[str, list[int]]:
    """Greedy tokens of full computations, no connector: one engine, every prompt."""
    with Engine(model, log_path=str(work / "reference.log")) as e:
        outs = e.generate(list(PROMPTS.values()))
    return {name: o["tokens"] for name, o in zip(PROMPTS, outs)}


def make_lora(path: str, seed: int) -> str:
    """A LoRA adapter of random weights for the tiny model (q_proj, v_proj; rank 8), as peft
    saves one: adapter_config.json and adapter_model.safetensors."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(2):
        for m, (i, o) in {"q_proj": (128, 128), "v_proj": (128, 64)}.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{m}"
            weights[f"{name}.lora_A.weight"] = (torch.randn(8, i, generator=g) / 2).bfloat16()
            weights[f"{name}.lora_B.weight"] = (torch.randn(o, 8, generator=g) / 2).bfloat16()
    save_file(weights, os.path.join(path, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def engine(model, node, work):
    """The module's engine with the connector (and two LoRA adapters)."""
    loras = {"a": make_lora(str(work / "lora-a"), 1), "b": make_lora(str(work / "lora-b"), 2)}
    with Engine(model, {"node": node.address}, loras=loras, log_path=str(work / "engine.log")) as e:
        yield e


def held(node, kvcache: dict, prompt: list[int]) -> int:
    """Leading pages of ``prompt`` the node holds under the keys an engine reported."""
    root = root_key(kvcache["namespace"], bytes.fromhex(kvcache["salt"]))
    with KVStoreClient(node.address) as c:
        return c.lookup(kvcache["namespace"], keys=block_keys(prompt, BT, root)).hit_blocks


# ---- never wrong KV ---------------------------------------------------------------------------


def pages(node, kvcache: dict, prompt: list[int]) -> list:
    """The node's bytes of the pages of ``prompt`` under the keys an engine reported."""
    root = root_key(kvcache["namespace"], bytes.fromhex(kvcache["salt"]))
    with KVStoreClient(node.address) as c:
        return c.get(kvcache["namespace"], keys=block_keys(prompt, BT, root))


def test_a_page_gone_between_lookup_and_acquire_is_recomputed_and_never_stored_wrong(
    model, node, engine, reference, work
):
    """The scheduler finds 3 pages; page 1 is removed before the worker's Acquire (another
    writer evicted it). vLLM recomputes from there; what the failed step computed attended to
    unfilled blocks and must not be stored: every page stored is the page of a full computation
    (the same engine's after reset_cache, under keys of a new epoch), and a run that loads all
    5 pages gets the tokens of a full computation."""
    (stored,) = engine.generate([STORED])
    assert held(node, stored["kvcache"], STORED) == 3
    with Engine(
        model,
        {"node": node.address},
        connector_module="vllm_hooks",
        connector_class="VanishingConnector",
        env={"KVCACHE_VANISH_PAGE": "1"},
        log_path=str(work / "vanish.log"),
    ) as e:
        (hit,) = e.generate([EXTENDED])
        assert hit["tokens"] == reference["extended"]
        assert e.stats()["load_failed_blocks"] == 4  # pages 1 and 2 (the chain breaks at 1)
        (loaded,) = e.generate([EXTENDED])
        assert loaded["cached"] == 5 * BT and loaded["tokens"] == reference["extended"]
        assert e.reset()
        (full,) = e.generate([EXTENDED])
        assert full["cached"] == 0 and full["kvcache"]["salt"] != hit["kvcache"]["salt"]
    got, want = pages(node, hit["kvcache"], EXTENDED), pages(node, full["kvcache"], EXTENDED)
    assert all(p is not None for p in got + want)
    wrong = [i for i, (g, w) in enumerate(zip(got, want)) if not np.array_equal(g, w)]
    assert wrong == [], f"pages {wrong} were stored from blocks a failed load left unfilled"


def test_cache_salts_and_lora_adapters_never_share_pages(node, engine, reference):
    """vLLM's cache_salt and LoRA adapters are part of its block hashes; they are of our keys:
    a salted request loads only pages of its own salt, an unsalted one none of a salted one's,
    and an adapter's pages are its own."""
    (a,) = engine.generate([{"tokens": PROMPT, "cache_salt": "user-a"}])
    assert a["cached"] == 0 and a["tokens"] == reference["prompt"]
    assert held(node, a["kvcache"], PROMPT) == 4
    b, plain = engine.generate([{"tokens": PROMPT, "cache_salt": "user-b"}, PROMPT])
    assert b["cached"] == 0 and plain["cached"] == 0, "another salt's pages were loaded"
    salted = engine.generate([{"tokens": PROMPT, "cache_salt": "user-c"}])[0]
    assert salted["cached"] == 0, "an unsalted request's pages were loaded by a salted one"
    (again,) = engine.generate([{"tokens": PROMPT, "cache_salt": "user-a"}])
    assert again["cached"] == 4 * BT and again["tokens"] == reference["prompt"]

    (la,) = engine.generate([{"tokens": PROMPT, "lora": "a"}])
    assert la["cached"] == 0, "the base model's pages were loaded for an adapter"
    assert la["tokens"] != reference["prompt"]  # the adapter changes the output
    (lb,) = engine.generate([{"tokens": PROMPT, "lora": "b"}])
    assert lb["cached"] == 0, "another adapter's pages were loaded"
    (la2,) = engine.generate([{"tokens": PROMPT, "lora": "a"}])
    assert la2["cached"] == 4 * BT and la2["tokens"] == la["tokens"]


# ---- the model's identity and preempted requests -------------------------------------------------


@pytest.fixture(scope="module")
def engine_b(work, node):
    """Another model of the same name (the same architecture, other weights: a fine-tune), with
    a KV cache of 24 vLLM blocks, so that four requests of 5 blocks that grow by 2 preempt."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(work / "b" / MODEL)
    torch.manual_seed(1)
    shape = MODELS["tiny"]
    cfg = LlamaConfig(**shape, max_position_embeddings=1024, head_dim=shape["hidden_size"] // 4)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    with Engine(
        path,
        {"node": node.address},
        max_model_len=512,
        kv_cache_bytes=24 * 2 * 2 * 32 * 2 * 32 * 2,  # 24 blocks: layers x K|V x 32 x 2 x 32 x 2B
        log_path=str(work / "engine-b.log"),
    ) as e:
        yield e


def test_a_model_of_the_same_name_shares_no_pages(engine, engine_b):
    """Keys carry the model's identity (config and weights), not the basename of its path."""
    engine.generate([PROMPT])  # model a's pages of PROMPT are on the node
    (b,) = engine_b.generate([PROMPT])
    assert b["cached"] == 0, "another model's pages were loaded"
    (again,) = engine_b.generate([PROMPT])
    assert again["cached"] == 4 * BT and again["tokens"] == b["tokens"]


def test_preempted_requests_get_their_load_when_they_resume(engine_b):
    """Four requests whose KV outgrows the cache: vLLM preempts some and resumes them later
    (``scheduled_cached_reqs``, ``resumed_req_ids``), offering the node's pages of their prompt
    again; a resumed request must get that load, or it attends to blocks nobody filled."""
    prompts = [tokens(40 + i, 2 * BT + 30) for i in range(4)]  # 2 full pages + 30 tokens each
    alone = [engine_b.generate([p], max_tokens=64)[0] for p in prompts]  # stored, no preemption
    before = engine_b.stats()
    together = engine_b.generate(prompts, max_tokens=64)
    after = engine_b.stats()
    assert [o["tokens"] for o in together] == [o["tokens"] for o in alone]
    assert after["resumed_loads"] > before["resumed_loads"], "no request was preempted"
