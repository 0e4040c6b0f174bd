"""Proof on a real transformer: a seeded random LlamaForCausalLM prefilled through the store.

Tolerance: next-token logits after a prompt whose first 75% came from the store must match a
full prefill within atol=1e-5, rtol=1e-5 (float32 on CPU; the loaded K/V are bit-identical to
the computed ones, differences come only from the suffix-only matmul shapes).
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from clients.hf_adapter import connect_for_model, greedy_generate, kv_layout_for, prefill_with_store
from clients.torch_client import LayoutMismatchError, LoadProgress
from clients.torch_layout import HFLayout

from torch_helpers import BLOCK_TOKENS, prompt, start_node_for, tiny_llama, unlink_shm_of

pytest.importorskip("transformers")

BT = BLOCK_TOKENS
PROMPT = 8 * BT  # 128 tokens
CACHED = 6 * BT  # 75% of it
TOL = dict(atol=1e-5, rtol=1e-5)
PATHS = pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "streamed"])


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture
def node(start_kvcache, model):
    return start_node_for(start_kvcache, kv_layout_for(model, "tiny-llama", BT))


@pytest.fixture
def connect(node, model):
    made = []

    def make(use_shm: bool = True, at=None):
        kv = connect_for_model((at or node).address, model, "tiny-llama", BT, use_shm=use_shm)
        kv.fetch_blocks = 2  # several streamed Get calls per load
        made.append(kv)
        return kv

    yield make
    for kv in made:
        kv.close()


def full_prefill(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids[None]).logits[0, -1]


def cache_prefix(model, kv, ids) -> None:
    """A first request that shares the first 75% of ``ids``: it stores those blocks."""
    first = prefill_with_store(model, ids[:CACHED], kv)
    assert (first.cached_tokens, first.stored_blocks, first.notes) == (0, CACHED // BT, [])


@PATHS
def test_logits_with_a_75pct_cached_prefix_equal_full_prefill(model, connect, use_shm):
    kv = connect(use_shm)
    ids = prompt(PROMPT, seed=1)
    cache_prefix(model, kv, ids)
    assert kv.lookup(ids) == CACHED
    result = prefill_with_store(model, ids, kv)
    assert (result.cached_tokens, result.stored_blocks, result.notes) == (CACHED, 2, [])
    torch.testing.assert_close(result.logits, full_prefill(model, ids), **TOL)
    assert kv.lookup(ids) == PROMPT
    # Whole prompt cached now: only the last token is computed, from a trimmed last block.
    again = prefill_with_store(model, ids, kv)
    assert (again.cached_tokens, again.stored_blocks) == (PROMPT - 1, 0)
    torch.testing.assert_close(again.logits, full_prefill(model, ids), **TOL)


def test_loaded_kv_really_drives_the_logits(model, connect):
    """Control: K/V of another prompt stored under this prompt's keys changes the output."""
    kv = connect(True)
    ids, other = prompt(PROMPT, seed=2), prompt(PROMPT, seed=3)
    with torch.inference_mode():
        wrong = model(input_ids=other[None, :CACHED]).past_key_values
    with kv.store(ids[:CACHED], tensor_layout=HFLayout()) as store:
        for l, layer in enumerate(wrong.layers):
            store.put_layer(l, layer.keys, layer.values)
        store.finish()
    result = prefill_with_store(model, ids, kv)
    assert result.cached_tokens == CACHED
    assert (result.logits - full_prefill(model, ids)).abs().max() > 1e-2


@pytest.mark.slow
@PATHS
def test_greedy_generation_is_identical_with_and_without_the_store(model, connect, use_shm):
    kv = connect(use_shm)
    ids = prompt(PROMPT, seed=4)
    cache_prefix(model, kv, ids)
    with torch.inference_mode():  # NOTE: explicit mask, or token id 0 (pad) would be masked out
        reference = model.generate(
            ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=16, do_sample=False
        )[0, PROMPT:]
    tokens, first = greedy_generate(model, ids, 16, kv)
    assert first.cached_tokens == CACHED
    assert tokens.tolist() == reference.tolist()


def test_model_and_node_layout_mismatch_is_a_clear_error(start_kvcache, model):
    other = tiny_llama(seed=0, layers=2, kv_heads=4)
    node = start_node_for(start_kvcache, kv_layout_for(other, "tiny-llama", BT))
    with pytest.raises(LayoutMismatchError) as e:
        connect_for_model(node.address, model, "tiny-llama", BT)
    msg = str(e.value)
    assert "num_layers 3 vs 2" in msg and "kv_heads 2 vs 4" in msg and "--layout" in msg
    with pytest.raises(ValueError, match="pass model_name="):
        kv_layout_for(model)


def test_client_layout_must_match_the_model(model, connect):
    kv = connect(True)
    with pytest.raises(LayoutMismatchError, match="differs from the client's"):
        prefill_with_store(tiny_llama(seed=0, layers=2), prompt(PROMPT, seed=5), kv)


@PATHS
def test_prompt_shorter_than_a_block_is_computed_and_not_stored(model, connect, use_shm):
    kv = connect(use_shm)
    ids = prompt(BT - 3, seed=6)
    for _ in range(2):
        result = prefill_with_store(model, ids, kv)
        assert (result.cached_tokens, result.stored_blocks, result.notes) == (0, 0, [])
        torch.testing.assert_close(result.logits, full_prefill(model, ids), **TOL)
    assert kv.client.stats().namespaces[0].blocks == 0


def test_node_killed_mid_load_streamed_recomputes_the_rest(model, connect, node, caplog):
    kv = connect(False)
    ids = prompt(PROMPT, seed=7)
    cache_prefix(model, kv, ids)

    def kill_after_first_batch(p: LoadProgress) -> None:
        if p.stage == "blocks" and p.done == 2:
            node.kill()  # SIGKILL, waits until the process is gone

    with caplog.at_level(logging.WARNING, logger="clients"):
        result = prefill_with_store(model, ids, kv, on_progress=kill_after_first_batch)
    unlink_shm_of(node)
    assert not node.alive()
    assert result.cached_tokens == 2 * BT  # the blocks that arrived are used...
    torch.testing.assert_close(result.logits, full_prefill(model, ids), **TOL)  # ...rest recomputed
    assert any(f"loaded {2 * BT} of {CACHED - 0} cached tokens" in n for n in result.notes)
    assert any("storing" in n and "failed" in n for n in result.notes)
    assert "received 2 of 6 blocks, the caller recomputes the rest" in caplog.text


def test_node_killed_mid_load_shared_memory_finishes_from_pinned_pages(
    model, connect, node, caplog
):
    kv = connect(True)
    ids = prompt(PROMPT, seed=8)
    cache_prefix(model, kv, ids)
    forward_started = threading.Event()
    hook = model.model.layers[0].register_forward_pre_hook(lambda *_: forward_started.set())

    def kill_after_layer_1(p: LoadProgress) -> None:
        # Layers 0 and 1 are prefetched before the forward; layer 2 loads after the kill.
        if p.stage == "layer" and p.done == 2:
            assert forward_started.wait(timeout=30)
            node.kill()

    with caplog.at_level(logging.WARNING, logger="clients"):
        try:
            result = prefill_with_store(model, ids, kv, on_progress=kill_after_layer_1)
        finally:
            hook.remove()
    unlink_shm_of(node)
    assert not node.alive()
    # Pinned pages stay mapped after the node dies: the load completes from them.
    assert result.cached_tokens == CACHED
    torch.testing.assert_close(result.logits, full_prefill(model, ids), **TOL)
    assert result.stored_blocks == 0 and any(
        "storing 2 new blocks failed" in n for n in result.notes
    )
    assert "could not release the load's pins" in caplog.text
    # With the node gone, the next request says so and computes everything.
    later = prefill_with_store(model, ids, kv)
    assert later.cached_tokens == 0 and "lookup failed" in later.notes[0]
    torch.testing.assert_close(later.logits, full_prefill(model, ids), **TOL)


def test_full_node_or_bad_prompt_shape_still_gives_clear_answers(start_kvcache, model):
    """A node too small for the new blocks: the prefill says so and is still right."""
    layout = kv_layout_for(model, "tiny-llama", BT)
    node = start_node_for(start_kvcache, layout, f"{4 * layout.page_bytes}B")
    kv = connect_for_model(node.address, model, "tiny-llama", BT)
    try:
        ids = prompt(PROMPT, seed=9)
        result = prefill_with_store(model, ids, kv)
        assert result.stored_blocks == 0
        assert "not storing the new blocks" in result.notes[0]
        assert "RESOURCE_EXHAUSTED" in result.notes[0]
        torch.testing.assert_close(result.logits, full_prefill(model, ids), **TOL)
        with pytest.raises(ValueError, match=r"one prompt at a time.*\(2, 128\)"):
            prefill_with_store(model, torch.stack([ids, ids]), kv)
    finally:
        kv.close()


def test_a_layer_that_fails_to_load_mid_forward_is_recomputed(model, connect):
    kv = connect(True)
    ids = prompt(PROMPT, seed=10)
    cache_prefix(model, kv, ids)

    def fail_on_layer_2(p: LoadProgress) -> None:
        if p.stage == "layer" and p.done == 3:
            raise OSError("page copy failed")

    result = prefill_with_store(model, ids, kv, on_progress=fail_on_layer_2)
    assert result.cached_tokens == 0
    assert (
        "loading layer 2 failed: page copy failed; recomputing the whole prompt" in result.notes[0]
    )
    torch.testing.assert_close(result.logits, full_prefill(model, ids), **TOL)
    assert kv.lookup(ids) == PROMPT  # the retry stored the new blocks
