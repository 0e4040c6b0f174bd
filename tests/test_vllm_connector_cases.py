"""The vLLM connector off the happy path, with real vLLM engines (CPU, tiny model) and a real
node: a page gone between the scheduler's Lookup and the worker's Acquire, cache salts and LoRA
adapters, images, a model of the same name, preempted requests, a node that stops answering, fp8 KV
caches, reset_cache and the connector's stats. Engines are driven one call at a time
(tests/vllm_driver.py) and shared by the tests of the module where they can be; prefix caching
is off, so every run asks the connector."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from bench.engines.models import (
    MODELS,
    make_blip2_model,
    make_eagle_draft,
    make_model,
    make_mtp_model,
)
from clients import KVStoreClient
from kvstore.keys import block_keys, root_key
from plumbing.launch import start_service

from helpers import rpc_calls, sigstop, wait_until
from vllm_driver import Engine

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
BT = 64  # kvcache block tokens: two vLLM blocks of 32
LAYOUT_FLAG = f"model={MODEL},num_layers=2,kv_heads=2,head_dim=32,dtype=bfloat16,block_tokens={BT}"
# fp8 KV with a draft model's 2 layers; MLA's latent cache (512 + 64 dims, one "head");
# one rank of TP=2 (one KV head each)
FP8_DRAFT = (
    f"model={MODEL},num_layers=4,kv_heads=2,head_dim=32,dtype=float8_e4m3fn,block_tokens={BT}"
)
FP8_E5M2_DRAFT = FP8_DRAFT.replace("float8_e4m3fn", "float8_e5m2")
EAGLE = f"model={MODEL},num_layers=3,kv_heads=2,head_dim=32,dtype=bfloat16,block_tokens={BT}"
MTP = EAGLE.replace(f"model={MODEL},", "model=tiny-mimo,")
BLIP2 = LAYOUT_FLAG.replace(f"model={MODEL},", "model=tiny-blip2,")
MLA = f"model=tiny-mla,num_layers=2,kv_heads=1,head_dim=288,dtype=bfloat16,block_tokens={BT}"
TP2 = f"model={MODEL},num_layers=2,kv_heads=1,head_dim=32,dtype=bfloat16,block_tokens={BT}"


def tokens(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 500, n)]


PROMPT = tokens(5, 299)  # 4 full pages + 43 tokens
BASE = tokens(11, 3 * BT)
STORED = BASE + tokens(12, 40)  # 3 full pages
EXTENDED = BASE + tokens(13, 150)  # the same 3 pages, then 2 more + 22 tokens


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
    every = (LAYOUT_FLAG, FP8_DRAFT, FP8_E5M2_DRAFT, EAGLE, MTP, MLA, TP2, BLIP2)
    layouts = [a for layout in every for a in ("--layout", layout)]
    sp = start_service(
        ["node", "--listen", "127.0.0.1:0", "--dram", "128MiB", "--metrics-port", "0", *layouts],
        log_dir=str(work),
    )
    yield sp
    sp.stop()


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
    model, node, engine, work
):
    """The scheduler finds 3 pages; page 1 is removed before the worker's AcquireAllocate
    (another writer evicted it). vLLM recomputes from there; what the failed step computed
    attended to unfilled blocks and must not be stored (the node leases nothing to save when a
    page to load is missing): every page stored is the page of a full computation
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
        merged = rpc_calls(node, "AcquireAllocate")
        (hit,) = e.generate([EXTENDED])
        assert e.stats()["load_failed_blocks"] == 4  # pages 1 and 2 (the chain breaks at 1)
        # The failed step's loads and saves went in one call, which leased nothing to save.
        assert rpc_calls(node, "AcquireAllocate") == merged + 1
        (loaded,) = e.generate([EXTENDED])
        assert e.reset()
        (full,) = e.generate([EXTENDED])
    assert full["cached"] == 0 and full["kvcache"]["salt"] != hit["kvcache"]["salt"]
    assert loaded["cached"] == 5 * BT
    assert hit["tokens"] == loaded["tokens"] == full["tokens"]
    got, want = pages(node, hit["kvcache"], EXTENDED), pages(node, full["kvcache"], EXTENDED)
    assert all(p is not None for p in got + want)
    wrong = [i for i, (g, w) in enumerate(zip(got, want)) if not same_kv(g, w)]
    assert wrong == [], f"pages {wrong} were stored from blocks a failed load left unfilled"
    assert not same_kv(got[0], want[1]), "the comparison tells one page's KV from another's"


def same_kv(page: np.ndarray, full: np.ndarray) -> bool:
    """``page`` holds the KV ``full`` (another computation of the same tokens) holds, up to the
    rounding of bf16 sums taken in another order: on CPUs with AMX two computations of the same
    prefix in batches of other sizes differ in the last bits (seen in a full-suite run: every
    page of two full computations differed), so bytes cannot be compared. A page from blocks
    nobody filled holds other tokens' KV (or zeros): far outside this."""
    a, b = (np.frombuffer(p.tobytes(), np.uint16).astype(np.uint32) << 16 for p in (page, full))
    x, y = a.view(np.float32), b.view(np.float32)
    return bool(np.allclose(x, y, rtol=0.05, atol=0.05 * float(np.abs(y).max())))


def test_cache_salts_and_lora_adapters_never_share_pages(node, engine):
    """vLLM's cache_salt and LoRA adapters are part of its block hashes; they are of our keys:
    a salted request loads only pages of its own salt, an unsalted one none of a salted one's,
    and an adapter's pages are its own."""
    (a,) = engine.generate([{"tokens": PROMPT, "cache_salt": "user-a"}])
    assert a["cached"] == 0  # a full computation: the reference
    assert held(node, a["kvcache"], PROMPT) == 4
    b, plain = engine.generate([{"tokens": PROMPT, "cache_salt": "user-b"}, PROMPT])
    assert b["cached"] == 0 and plain["cached"] == 0, "another salt's pages were loaded"
    salted = engine.generate([{"tokens": PROMPT, "cache_salt": "user-c"}])[0]
    assert salted["cached"] == 0, "an unsalted request's pages were loaded by a salted one"
    (again,) = engine.generate([{"tokens": PROMPT, "cache_salt": "user-a"}])
    assert again["cached"] == 4 * BT and again["tokens"] == a["tokens"] == plain["tokens"]

    (la,) = engine.generate([{"tokens": PROMPT, "lora": "a"}])
    assert la["cached"] == 0, "the base model's pages were loaded for an adapter"
    assert la["tokens"] != a["tokens"]  # the adapter changes the output
    (lb,) = engine.generate([{"tokens": PROMPT, "lora": "b"}])
    assert lb["cached"] == 0, "another adapter's pages were loaded"
    (la2,) = engine.generate([{"tokens": PROMPT, "lora": "a"}])
    assert la2["cached"] == 4 * BT and la2["tokens"] == la["tokens"]


# ---- the model's identity and preempted requests -------------------------------------------------


def test_the_same_text_with_another_image_shares_no_pages(node, work):
    """A multimodal model (a random BLIP-2: the image becomes 8 tokens before the text, so it is
    in every page): the same prompt with another image loads nothing the first one stored; with
    the same image it loads every full page and gets the tokens of its full computation."""
    path = str(work / "tiny-blip2")
    make_blip2_model(path, MODELS["tiny"], max_len=1024)
    engine = {"skip_tokenizer_init": False, "limit_mm_per_prompt": {"image": 1}}
    log = str(work / "blip2.log")
    with Engine(path, {"node": node.address}, engine=engine, log_path=log) as e:
        (first,) = e.generate([{"tokens": PROMPT, "image": 1}])
        (other,) = e.generate([{"tokens": PROMPT, "image": 2}])
        (again,) = e.generate([{"tokens": PROMPT, "image": 1}])
    assert first["kvcache"]["namespace"].startswith("tiny-blip2|L2|H2|D32|bfloat16|")
    assert first["cached"] == 0
    assert other["cached"] == 0 and other["tokens"] != first["tokens"]
    assert again["cached"] == 4 * BT and again["tokens"] == first["tokens"]


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


def test_a_fresh_engines_first_step_after_a_load_computes_a_token_or_two(model, node, engine, work):
    """A fresh engine's first request finds all but its last 2 tokens on the node: its first
    forward computes 2 tokens. On a CPU with AMX, vLLM's AMX attention kernel then ran before
    anything had asked the kernel for AMX (oneDNN asks when a matmul is big enough, which the
    first forward of an engine without a cache always is): SIGILL, the engine dead (kvcache up's
    P/D decode engines died at their first request). The connector asks at start."""
    prompt = tokens(14, 4 * BT + 2)
    (stored,) = engine.generate([prompt])
    assert held(node, stored["kvcache"], prompt) == 4
    with Engine(model, {"node": node.address}, log_path=str(work / "fresh.log")) as e:
        (loaded,) = e.generate([prompt])
    assert loaded["cached"] == 4 * BT and loaded["tokens"] == stored["tokens"]


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


# ---- never a stalled engine ---------------------------------------------------------------------


def test_a_node_that_stops_answering_costs_nothing_and_is_found_again(model, work):
    """A node that hangs (SIGSTOP) from before the engine starts: the engine starts, serves
    every request in full with the breaker open (node calls are not made: no 30 s deadlines in
    the scheduler or the worker), and finds the node again once it answers. The time it costs is
    bench.faults.vllm_stall's figure, not asserted here."""
    sp = start_service(
        ["node", "--listen", "127.0.0.1:0", "--dram", "16MiB", "--layout", LAYOUT_FLAG],
        log_dir=str(work),
    )
    try:
        sigstop(sp.pid)
        conn = {"node": sp.address, "block_tokens": BT, "timeout_ms": 500, "retry_s": 0.5}
        with Engine(model, conn, log_path=str(work / "stalled.log")) as e:
            outs = e.generate([PROMPT, STORED])  # full computations: the reference
            assert [o["cached"] for o in outs] == [0, 0]
            e.generate([EXTENDED])
            stats = e.stats()
            assert stats["breaker_open"] == 1 and stats["breaker_trips"] >= 1
            assert stats["breaker_skipped"] >= 1, "the connector kept calling a node that hangs"
            assert stats["saved_pages"] == 0
            os.kill(sp.pid, signal.SIGCONT)
            # Found again: PROMPT is stored, and then loaded.
            wait_until(
                lambda: e.generate([PROMPT])[0]["cached"] == 4 * BT,
                timeout_s=120,
                what="hits after the node answers again",
            )
            assert e.generate([PROMPT])[0]["tokens"] == outs[0]["tokens"]
            assert e.stats()["breaker_open"] == 0
    finally:
        os.kill(sp.pid, signal.SIGCONT)
        sp.stop()


# ---- what users hit at start -----------------------------------------------------------------


def stores_then_loads(model: str, node, engine: dict, log, namespace: str) -> None:
    """One engine (``engine``: more LLM arguments) serves PROMPT twice: the first run stores its
    pages under ``namespace``, the second loads all 4 and gets the first run's tokens."""
    with Engine(model, {"node": node.address}, engine=engine, log_path=str(log)) as e:
        (full,) = e.generate([PROMPT])
        assert full["kvcache"]["namespace"].startswith(namespace)
        (loaded,) = e.generate([PROMPT])
    assert full["cached"] == 0
    assert loaded["cached"] == 4 * BT and loaded["tokens"] == full["tokens"]


@pytest.mark.parametrize(
    "kv_dtype, stored", [("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")]
)
def test_an_fp8_kv_cache_with_a_draft_models_layers_stores_and_loads(
    model, node, work, kv_dtype, stored
):
    """kv_cache_dtype fp8 (pages of float8 bytes, in a namespace of their own per format) and
    speculative decoding with a draft model, whose 2 KV layers are stored with the target's 2:
    the engine starts, stores, and a later run loads the prompt and gets the tokens of its full
    computation."""
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 2}
    engine = {"kv_cache_dtype": kv_dtype, "speculative_config": spec}
    stores_then_loads(
        model, node, engine, work / f"{kv_dtype}-draft.log", f"{MODEL}|L4|H2|D32|{stored}|"
    )


def test_an_eagle_drafts_layer_is_stored_and_loaded_with_the_targets(model, node, work):
    """Speculative decoding with an EAGLE head (a random one, vLLM's EagleLlamaForCausalLM):
    its KV layer is stored with the target's 2 (L3), and a later run loads the prompt and gets
    the tokens of its full computation."""
    draft = str(work / "eagle-draft")
    make_eagle_draft(draft, MODELS["tiny"], max_len=1024)
    spec = {"method": "eagle", "model": draft, "num_speculative_tokens": 2}
    engine = {"speculative_config": spec}
    stores_then_loads(model, node, engine, work / "eagle.log", f"{MODEL}|L3|H2|D32|bfloat16|")


def test_an_mtp_models_prediction_layer_is_stored_and_loaded_with_its_own(node, work):
    """Speculative decoding with the model's own multi-token prediction layer (a random
    MiMo-style model, vLLM's method "mtp"): the MTP layer's KV is stored with the model's 2
    layers (L3), and a later run loads the prompt and gets the tokens of its full computation."""
    path = str(work / "tiny-mimo")
    make_mtp_model(path, MODELS["tiny"], max_len=1024)
    engine = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}
    stores_then_loads(path, node, engine, work / "mtp.log", "tiny-mimo|L3|H2|D32|bfloat16|")


def test_an_mla_model_stores_and_loads(node, work):
    """An MLA model (DeepSeek-V2 shape, CPU_MLA backend): one latent vector per token, not K|V
    per head; its pages hold the latent cache as it is."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    path = str(work / "tiny-mla")
    torch.manual_seed(0)
    cfg = DeepseekV2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
        kv_lora_rank=512,  # the CPU MLA kernels take 512 + 64
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=1024,
    )
    DeepseekV2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    stores_then_loads(path, node, {}, work / "mla.log", "tiny-mla|L2|H1|D288|")


def test_a_sliding_window_model_is_refused_at_start_naming_the_feature(node, work):
    """vLLM turns its hybrid allocator off for the connector: a sliding-window model would run
    with blocks the connector cannot keep (freed outside the window). The engine does not start,
    and says why."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    path = str(work / "tiny-mistral")
    torch.manual_seed(0)
    cfg = MistralConfig(
        **MODELS["tiny"],
        head_dim=32,
        sliding_window=128,
        max_position_embeddings=1024,
    )
    MistralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    with pytest.raises(AssertionError, match="the model has sliding-window attention"):
        Engine(path, {"node": node.address}, log_path=str(work / "sliding.log"))


# ---- ranks --------------------------------------------------------------------------------------


# TP=2: tests/test_vllm_pool.py (each rank's keys, what both hold offered, and a pull of both
# shares from another node).


# ---- reset_cache and stats -------------------------------------------------------------------


def test_reset_cache_forgets_what_the_engine_could_load_and_stats_reach_vllm(engine):
    """vLLM's reset_prefix_cache(reset_connector=True) resets what this engine can load (its
    keys move to a new epoch); the connector's counters reach vLLM's stats and metrics."""
    prompt = tokens(60, 2 * BT + 10)
    engine.generate([prompt])
    (hit,) = engine.generate([prompt])
    assert hit["cached"] == 2 * BT
    assert engine.reset()
    (after,) = engine.generate([prompt])
    assert after["cached"] == 0, "reset_cache left the engine loading what it stored before"
    (again,) = engine.generate([prompt])
    assert again["cached"] == 2 * BT and again["tokens"] == hit["tokens"]
    metrics = engine.metrics()
    stats = engine.stats()
    assert metrics["vllm:kvcache_hit_tokens"] >= 4 * BT
    assert metrics["vllm:kvcache_loaded_pages"] >= 4 and metrics["vllm:kvcache_saved_pages"] >= 4
    assert metrics["vllm:kvcache_loaded_bytes"] == stats["loaded_bytes"]
    assert metrics["vllm:kvcache_steps"] == stats["steps"] > 0
    assert metrics["vllm:kvcache_breaker_open"] == 0


# ---- GPU (run where a GPU is; not on this project's CPU machines) ----------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_with_cuda_graphs_a_load_batched_as_a_decode_is_loaded(model, node, work):
    """vLLM's default on GPUs captures full CUDA graphs; a replay runs no per-layer hook. A
    request whose load leaves one token to compute, batched with decodes, is a uniform decode
    batch: its loaded blocks must be filled all the same (piecewise graphs, every layer loaded
    in start_load_kv)."""
    prompt = tokens(70, 4 * BT + 1)
    other = tokens(71, 100)
    with Engine(
        model, {"node": node.address}, engine={"enforce_eager": False}, log_path=str(work / "g.log")
    ) as e:
        (full,) = e.generate([prompt])
        assert full["cached"] == 0
        outs = e.generate([other, prompt], max_tokens=16)
    assert outs[1]["cached"] == 4 * BT
    assert outs[1]["tokens"][:8] == full["tokens"]
