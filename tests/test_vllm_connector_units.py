"""The vLLM connector's parts at the level of vLLM's own objects (``Request``, ``KVCacheConfig``,
a ``VllmConfig`` from ``EngineArgs``) and a real node, without an engine: what a request's keys
hold (multimodal items, prompt embeddings, cache_salt, LoRA files), what the scheduler offers
with several ranks, what the connector refuses at start, and the breaker with a node that
hangs. Fast: the engine-level cases are in test_vllm_connector_cases.py."""

from __future__ import annotations

import os
import re
import signal
import time

import grpc
import numpy as np
import pytest

from clients import KVStoreClient
from clients.node_guard import BreakerOpen
from clients.vllm_guard import NodeGuard
from kvstore.keys import block_keys, root_key
from rpc.status import KVCacheRpcError

from conftest import TEST_NAMESPACE
from helpers import sigstop, wait_until

BT = 64
LAYOUT_H1 = "model=tiny-llama,num_layers=2,kv_heads=1,head_dim=32,dtype=bfloat16,block_tokens=64"
NS_H1 = "tiny-llama|L2|H1|D32|bfloat16|B64"
TOKENS = [int(x) for x in np.random.default_rng(3).integers(1, 500, 6 * BT + 7)]


# ---- the breaker: no vLLM needed ----------------------------------------------------------------


def test_a_node_that_hangs_costs_one_deadline_then_no_calls_until_it_answers(start_node):
    node = start_node()
    clients = [KVStoreClient(node.address, timeout_s=0.3, use_shm=False) for _ in range(2)]
    scheduler, worker = (NodeGuard(c, retry_s=0.2) for c in clients)
    lookup = lambda: clients[0].lookup(TEST_NAMESPACE, tokens=TOKENS)  # noqa: E731
    sigstop(node.pid)
    try:
        with pytest.raises(KVCacheRpcError) as e:
            scheduler.call(lookup)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        # The process's other connector of that node (vLLM's worker side) sees it open too:
        # its calls are not made at all.
        assert scheduler.is_open and worker.is_open and scheduler.trips == 1
        with pytest.raises(BreakerOpen):
            worker.call(lambda: pytest.fail("a call made while the breaker is open"))
        assert worker.skipped == 1 and worker.trips == 0
        os.kill(node.pid, signal.SIGCONT)
        wait_until(lambda: not worker.is_open, 20, "the probe to find the node again")
        assert scheduler.call(lookup).hit_blocks == 0
    finally:
        os.kill(node.pid, signal.SIGCONT)
        for g in (scheduler, worker):
            g.close()
        for c in clients:
            c.close()


def test_a_node_that_answered_fast_and_then_hangs_is_given_up_on_long_before_the_cap(start_node):
    """The deadline follows the node's latency (vllm_guard.Latency) between min_timeout_s and
    the client's timeout_s: a hang after fast answers costs about min_timeout_s, not the cap."""
    node = start_node()
    with KVStoreClient(node.address, timeout_s=60, use_shm=False) as c:
        guard = NodeGuard(c, retry_s=0.2, min_timeout_s=0.2)
        lookup = lambda: c.lookup(TEST_NAMESPACE, tokens=TOKENS)  # noqa: E731
        try:
            assert guard.breaker.latency.deadline() == 60  # nothing timed yet: the cap
            for _ in range(20):
                guard.call(lookup)
            assert guard.breaker.latency.deadline() < 60
            sigstop(node.pid)
            t0 = time.monotonic()
            with pytest.raises(KVCacheRpcError) as e:
                guard.call(lookup)
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and guard.is_open
            assert time.monotonic() - t0 < 30  # half the cap: it was not the cap that cut it
        finally:
            os.kill(node.pid, signal.SIGCONT)
            guard.close()


def test_latency_gives_deadlines_between_its_bounds_and_follows_a_slower_node():
    from clients.vllm_guard import Latency

    lat = Latency(0.2, 1.0)
    assert lat.deadline() == 1.0
    for _ in range(50):
        lat.observe(0.001)
    assert lat.deadline() == 0.2  # floor: 4 x a millisecond is not a deadline
    for _ in range(50):
        lat.observe(0.1)
    assert 0.4 <= lat.deadline() <= 1.0  # a node slowed to 100 ms gets at least 4 x that
    for _ in range(50):
        lat.observe(5.0)
    assert lat.deadline() == 1.0  # the cap holds
    assert Latency(5.0, 1.0).deadline() == 1.0  # a floor above the cap: fixed at the cap


def test_answers_of_a_node_that_is_there_do_not_open_the_breaker(start_node):
    node = start_node()
    with KVStoreClient(node.address, timeout_s=5) as c:
        guard = NodeGuard(c, retry_s=0.2)
        try:
            with pytest.raises(KVCacheRpcError) as e:
                guard.call(lambda: c.lookup("no-such|namespace", tokens=TOKENS))
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert not guard.is_open
        finally:
            guard.close()


def test_the_deadline_comes_from_the_extra_config_else_the_launchers_environment(monkeypatch):
    from clients.vllm_setup import MIN_TIMEOUT_ENV, TIMEOUT_ENV, ConnectorConfig

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert ConnectorConfig.from_extra({"node": "n"}).timeout_ms == 1000
    monkeypatch.setenv(TIMEOUT_ENV, "7500")
    assert ConnectorConfig.from_extra({"node": "n"}).timeout_ms == 7500
    assert ConnectorConfig.from_extra({"node": "n", "timeout_ms": 200}).timeout_ms == 200
    with pytest.raises(ValueError, match="positive"):
        ConnectorConfig.from_extra({"node": "n", "timeout_ms": 0})
    # the shortest deadline likewise
    monkeypatch.delenv(MIN_TIMEOUT_ENV, raising=False)
    assert ConnectorConfig.from_extra({"node": "n"}).min_timeout_ms == 200
    monkeypatch.setenv(MIN_TIMEOUT_ENV, "9000")
    assert ConnectorConfig.from_extra({"node": "n"}).min_timeout_ms == 9000
    assert ConnectorConfig.from_extra({"node": "n", "min_timeout_ms": 50}).min_timeout_ms == 50
    with pytest.raises(ValueError, match="positive"):
        ConnectorConfig.from_extra({"node": "n", "min_timeout_ms": -1})


def test_the_hold_for_the_decode_side_is_finite_seconds_or_none():
    from clients.vllm_setup import ConnectorConfig

    assert ConnectorConfig.from_extra({"node": "n"}).hold_for_decode_s == 30
    assert ConnectorConfig.from_extra({"node": "n", "hold_for_decode_s": 0}).hold_for_decode_s == 0
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="hold_for_decode_s must be finite seconds >= 0"):
            ConnectorConfig.from_extra({"node": "n", "hold_for_decode_s": bad})


def test_a_token_inline_in_the_config_is_warned_about_and_a_token_file_is_not(tmp_path, caplog):
    """vLLM prints kv_connector_extra_config in its start-up log: an inline token leaks there."""
    from clients.vllm_setup import ConnectorConfig

    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    with caplog.at_level("WARNING", logger="clients.vllm_setup"):
        assert ConnectorConfig.from_extra({"node": "n", "token_file": str(secret)}).token == (
            "s3cret"
        )
        assert not caplog.records
        assert ConnectorConfig.from_extra({"node": "n", "token": "inline"}).token == "inline"
    assert "token_file" in caplog.text


# ---- vLLM's objects -----------------------------------------------------------------------------

vllm = pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from clients.vllm_connector import KVCacheConnector, KVCacheHandshake  # noqa: E402
from clients.vllm_identity import (  # noqa: E402
    engine_salt,
    rank_keys,
    rank_tag,
    request_keys,
    request_salt,
)


def request(tokens: list[int] = TOKENS, rid: str = "r", **kw) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, **kw)


def image(identifier: str, offset: int, length: int = 80):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


ENGINE = engine_salt("", "model", ["format"], b"")
ROOT = root_key(NS_H1, ENGINE)


def test_multimodal_items_are_in_the_keys_from_the_first_page_they_touch():
    """vLLM hashes each item (and its offset in the block) into the blocks it covers, which
    chains into every later block: so do our keys, page by page."""
    plain = request_keys(TOKENS, BT, ROOT)
    assert plain == block_keys(TOKENS, BT, ROOT)
    a = request_keys(TOKENS, BT, ROOT, [image("img-a", 100)])
    b = request_keys(TOKENS, BT, ROOT, [image("img-b", 100)])
    moved = request_keys(TOKENS, BT, ROOT, [image("img-a", 110)])
    assert a[0] == b[0] == moved[0] == plain[0]  # page 0 holds no image: shared
    for other in (b, moved, plain):
        assert all(x != y for x, y in zip(a[1:], other[1:]))  # page 1 on: never shared
    two = request_keys(TOKENS, BT, ROOT, [image("img-a", 100), image("img-c", 300)])
    assert two[:4] == a[:4] and two[4:] != a[4:]
    assert len(a) == len(plain) == 6


def test_prompt_embeddings_cache_salts_and_lora_adapters_in_the_salt(tmp_path):
    import torch
    from vllm.lora.request import LoRARequest

    assert request_salt(ENGINE, request()) == ENGINE
    assert request_salt(ENGINE, request(prompt_embeds=torch.zeros(len(TOKENS), 8))) is None
    salts = {request_salt(ENGINE, request(cache_salt=s)) for s in ("a", "b")}
    assert len(salts | {ENGINE}) == 3
    assert request_salt(ENGINE, request(cache_salt="a")) in salts
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights one")
    lora = LoRARequest("a", 1, str(adapter))
    first = request_salt(ENGINE, request(lora_request=lora))
    assert first not in salts | {ENGINE}
    # The same name and path, other weights (re-pointed, retrained): other keys.
    (adapter / "adapter_model.safetensors").write_bytes(b"weights two")
    os.utime(adapter, (1, 1))
    assert request_salt(ENGINE, request(lora_request=lora)) != first


def test_keys_follow_docs_api_md():
    """Salts and rank keys computed from docs/api.md's "vLLM connector keys" are the
    connector's."""
    import xxhash
    from vllm.lora.request import LoRARequest

    from clients.vllm_identity import adapter_fingerprint

    def parts(*xs: bytes | str) -> bytes:
        out = b""
        for x in xs:
            b = x.encode() if isinstance(x, str) else x
            out += len(b).to_bytes(4, "little") + b
        return out

    d = b"kvcache/vllm/v1\x00"
    fmts = ["vllm0.32|cpu|CPU_ATTN|bfloat16|auto|2x32x64", "a-format"]
    engine = xxhash.xxh3_128_digest(d + parts(b"engine", "s", "fp", *sorted(fmts), b"e"))
    assert engine_salt("s", "fp", fmts + fmts[:1], b"e") == engine
    lora = LoRARequest("ad", 1, "/no/such/adapter")
    adapter = adapter_fingerprint(lora.lora_path)
    want = xxhash.xxh3_128_digest(
        d + parts(b"request", engine, b"cache_salt", "u", b"lora", "ad", adapter)
    )
    assert request_salt(engine, request(cache_salt="u", lora_request=lora)) == want
    key = block_keys(TOKENS, BT, root_key(NS_H1, engine))[0]
    tag = "tp1/2|pp0/1"
    assert rank_keys([key], tag) == [
        xxhash.xxh3_128_digest(b"kvcache/vllm/rank/" + tag.encode() + b"\x00" + key)
    ]


# ---- a scheduler-side connector of a real VllmConfig ---------------------------------------------


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    from vllm.engine.arg_utils import EngineArgs

    from bench.engines.models import MODELS, make_model

    model = str(tmp_path_factory.mktemp("units") / "tiny-llama")
    make_model(model, MODELS["tiny"], max_len=1024)

    def make(node: str, **engine) -> object:
        transfer = {
            "kv_connector": "KVCacheConnector",
            "kv_connector_module_path": "clients.vllm_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"node": node, "timeout_ms": 5000},
        }
        args = EngineArgs(
            model=model,
            skip_tokenizer_init=True,
            max_model_len=1024,
            block_size=32,
            dtype="bfloat16",
            kv_transfer_config=transfer,
            **engine,
        )
        return args.create_engine_config()

    return make


def handshake(*tags: str, layers: tuple[int, ...] = ()) -> dict:
    """Workers' handshakes: one per tag, (pp, tp) keyed; ``layers``: per rank (default 2,
    one KV head each) for pipeline stages of their own size."""
    out = {}
    for i, tag in enumerate(tags):
        n = layers[i] if layers else 2
        layout = dict(model="tiny-llama", num_layers=n, kv_heads=1, head_dim=32, dtype="bfloat16")
        ns = f"tiny-llama|L{n}|H1|D32|bfloat16|B{BT}"
        key = (i, 0) if layers else (0, i)
        out[key] = KVCacheHandshake(ns, {**layout, "block_tokens": BT}, "fmt", tag)
    return out


def test_the_scheduler_offers_only_what_every_rank_holds(vllm_config, start_node):
    """With tensor parallelism each rank stores its share under keys of its own; the offer is
    the prefix all of them hold, found with one Lookup."""
    node = start_node(layout=LAYOUT_H1, dram="8MiB")
    cfg = vllm_config(node.address)
    conn = KVCacheConnector(cfg, KVConnectorRole.SCHEDULER, None)
    assert cfg.kv_transfer_config.kv_load_failure_policy == "recompute"  # forced
    tags = [rank_tag(r, 2, 0, 1) for r in range(2)]
    try:
        conn.set_xfer_handshake_metadata_pp_aware(handshake(*tags))
        r = request()
        assert conn.get_num_new_matched_tokens(r, 0) == (0, False)
        chain = conn._reqs["r"].keys
        assert len(chain) == 6
        with KVStoreClient(node.address) as c:
            page = np.zeros(c.layout(NS_H1).page_bytes, np.uint8)
            c.put(NS_H1, [page] * 5, keys=rank_keys(chain, tags[0])[:5])
            fresh = request(rid="r2")
            assert conn.get_num_new_matched_tokens(fresh, 0) == (0, False), "rank 1 holds none"
            c.put(NS_H1, [page] * 2, keys=rank_keys(chain, tags[1])[:2])
            assert conn.get_num_new_matched_tokens(request(rid="r3"), 0) == (2 * BT, False)
            # rank 0's keys are not the chain's: no other client finds them by tokens
            assert c.lookup(NS_H1, keys=chain).hit_blocks == 0
    finally:
        conn.shutdown()


def test_a_prompt_embeds_request_is_neither_looked_up_nor_saved(vllm_config, start_node):
    import torch

    node = start_node(layout=LAYOUT_H1, dram="8MiB")
    conn = KVCacheConnector(vllm_config(node.address), KVConnectorRole.SCHEDULER, None)
    try:
        conn.set_xfer_handshake_metadata_pp_aware(handshake(""))
        r = request(prompt_embeds=torch.zeros(len(TOKENS), 128))
        assert conn.get_num_new_matched_tokens(r, 0) == (0, False)
        assert conn._reqs["r"].keys == [] and conn.stats.lookups == 0
    finally:
        conn.shutdown()


def test_pipeline_stages_of_other_sizes_offer_what_both_hold(vllm_config, start_node):
    """Uneven pipeline stages (2 layers and 1) store pages of other sizes, in namespaces of
    their own: one Lookup per namespace, the offer is the shorter prefix. (The CPU build's
    PP=2 engine dies at its first request, with or without the connector.)"""
    layout_l1 = LAYOUT_H1.replace("num_layers=2", "num_layers=1")
    node = start_node("--layout", layout_l1, layout=LAYOUT_H1, dram="8MiB")
    conn = KVCacheConnector(vllm_config(node.address), KVConnectorRole.SCHEDULER, None)
    tags = [rank_tag(0, 1, p, 2) for p in range(2)]
    try:
        conn.set_xfer_handshake_metadata_pp_aware(handshake(*tags, layers=(2, 1)))
        assert conn.get_num_new_matched_tokens(request(), 0) == (0, False)
        chain = conn._reqs["r"].keys
        ns_l1 = NS_H1.replace("|L2|", "|L1|")
        with KVStoreClient(node.address) as c:
            for ns, tag, n in ((NS_H1, tags[0], 5), (ns_l1, tags[1], 3)):
                page = np.zeros(c.layout(ns).page_bytes, np.uint8)
                c.put(ns, [page] * n, keys=rank_keys(chain, tag)[:n])
        assert conn.get_num_new_matched_tokens(request(rid="r2"), 0) == (3 * BT, False)
    finally:
        conn.shutdown()


@pytest.mark.parametrize(
    "spec, says",
    [
        ("sliding", "sliding-window attention"),
        ("chunked", "chunked local attention"),
        ("mamba", "Mamba (state-space) layers"),
        ("two groups", "2 KV cache groups"),
    ],
)
def test_models_whose_kv_the_connector_cannot_keep_are_refused_at_start(vllm_config, spec, says):
    """vLLM turns its hybrid allocator off for a connector without SupportsHMA: sliding-window
    layers would then keep every block (memory), Mamba state is not a prefix of pages. Refused,
    naming the feature, before any request."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    specs = {
        "sliding": [
            SlidingWindowSpec(
                block_size=32,
                num_kv_heads=2,
                head_size=32,
                dtype=torch.bfloat16,
                sliding_window=128,
            )
        ],
        "chunked": [
            FullAttentionSpec(
                block_size=32,
                num_kv_heads=2,
                head_size=32,
                dtype=torch.bfloat16,
                attention_chunk_size=128,
            )
        ],
        "mamba": [MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.bfloat16,))],
        "two groups": [full, full],
    }[spec]
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    config = KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=groups)
    with pytest.raises(ValueError, match=re.escape(says)):
        KVCacheConnector(vllm_config("127.0.0.1:1"), KVConnectorRole.SCHEDULER, config)


@pytest.mark.parametrize("name", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallel_engines_are_refused_at_start(vllm_config, name):
    """With decode or prefill context parallelism each rank holds a slice of every page's
    tokens, not pages under the chain's keys: refused at start, naming the setting."""
    cfg = vllm_config("127.0.0.1:1")
    setattr(cfg.parallel_config, name, 2)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=f"{name} > 1 is not supported"):
            KVCacheConnector(cfg, role, None)


# ---- GPU paths (run where a GPU is) -------------------------------------------------------------


def test_the_connector_asks_vllm_for_piecewise_cuda_graphs():
    """A full CUDA graph replay skips the per-layer hooks (loads before attention): vLLM must
    capture piecewise graphs with this connector (and a GPU step loads every layer up front)."""
    assert KVCacheConnector.requires_piecewise_for_cudagraph({}) is True


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_scattered_rows_copy_between_cuda_blocks_and_host_pages():
    """Index tensors on the host, vLLM's blocks on the GPU: the gather / scatter moves rows
    across devices instead of indexing a CUDA tensor with a host index (index_put_)."""
    import torch

    from clients.vllm_transfer import _RowMap

    rows = torch.arange(64 * 16, dtype=torch.int64).view(64, 16)
    blocks = torch.zeros(40, 16, dtype=torch.int64, device="cuda")
    pages, vblocks = [3, 9, 1, 30, 17, 5, 22, 11, 40, 2], [7, 0, 33, 12, 4, 25, 19, 2, 38, 9]
    m = _RowMap(pages, vblocks)
    assert not m.sliced
    m.to_blocks(rows, 0, blocks)
    for p, b in zip(pages, vblocks):
        assert torch.equal(blocks[b].cpu(), rows[p])
    back = torch.zeros_like(rows)
    m.to_pages(blocks, back, 0)
    for p in pages:
        assert torch.equal(back[p], rows[p])


def test_counts_made_while_an_interval_is_cut_fall_in_the_next_one_not_nowhere():
    """A pull thread counts its loaded pages while the engine's thread reports intervals: each
    interval is cut from one read of the counters, so every count is reported exactly once
    (the counts were read twice before, and one made between the reads was lost)."""
    import sys
    import threading

    from clients.vllm_stats import ConnectorStats, Intervals

    stats, intervals, n = ConnectorStats(), Intervals(), 200_000
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave inside the cut, as under load
    try:

        def count() -> None:
            for _ in range(n):
                stats.loaded_pages += 1

        writer = threading.Thread(target=count)
        writer.start()
        reported = 0
        while writer.is_alive():
            reported += intervals.take(stats)["loaded_pages"]
        writer.join()
        reported += intervals.take(stats)["loaded_pages"]
    finally:
        sys.setswitchinterval(switch)
    assert reported == stats.loaded_pages == n
