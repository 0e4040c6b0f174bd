"""The SGLang HiCache storage backend, loaded the way SGLang loads it (StorageBackendFactory,
"dynamic"), against a real node: SGLang's key and tensor conventions, misses, tenants."""

from __future__ import annotations

import pytest
import torch

from conftest import TEST_LAYOUT, TEST_PAGE_BYTES

pytest.importorskip("sglang.srt.mem_cache.storage")
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

ELEMS = TEST_PAGE_BYTES // 2  # one page as SGLang hands it over: a flat bfloat16 tensor


def backend(node: str, **extra: object) -> HiCacheStorage:
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="test",
        extra_config={
            "backend_name": "kvcache",
            "module_path": "clients.sglang_hicache",
            "class_name": "KVCacheHiCacheStorage",
            "node": node,
            **extra,
        },
    )
    return StorageBackendFactory.create_backend("dynamic", config, None)


def keys(n: int, salt: str = "") -> list[str]:
    return [f"{salt}{i:064x}" for i in range(n)]  # SGLang's 64-hex page hashes


def pages(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(ELEMS, generator=g).to(torch.bfloat16) for _ in range(n)]


def test_pages_round_trip_as_sglang_calls_the_backend(start_node):
    node = start_node(layout=TEST_LAYOUT)
    b = backend(node.address)
    assert isinstance(b, HiCacheStorage)
    ks, vs = keys(6), pages(6)
    assert b.batch_exists(ks) == 0 and b.get(ks[0]) is None
    assert b.batch_set(ks[:4], vs[:4])
    assert b.set(ks[4], vs[4])
    assert b.batch_exists(ks) == 5  # the leading run of stored pages
    assert b.exists(ks[3]) and not b.exists(ks[5])
    targets = [torch.empty(ELEMS, dtype=torch.bfloat16) for _ in ks]
    got = b.batch_get(ks, targets)
    assert got[5] is None
    for i in range(5):
        assert got[i] is targets[i] and torch.equal(targets[i], vs[i])
    one = b.get(ks[2])
    assert one is not None and torch.equal(one.view(torch.bfloat16), vs[2])
    # A page of the wrong size is refused, not stored.
    assert not b.set("f" * 64, torch.zeros(ELEMS + 1, dtype=torch.bfloat16))


def test_tenants_and_a_stopped_node(start_node):
    node = start_node("--tenant-token", "ta=alice", "--tenant-token", "tb=bob", layout=TEST_LAYOUT)
    alice, bob = backend(node.address, token="ta"), backend(node.address, token="tb")
    ks = keys(3)
    assert alice.batch_set(ks, pages(3))
    assert alice.batch_exists(ks) == 3 and bob.batch_exists(ks) == 0
    assert bob.batch_get(ks) == [None, None, None]
    node.stop()
    assert alice.batch_exists(ks) == 0  # a node that is gone is a miss
    assert alice.batch_get(ks) == [None, None, None]
    assert not alice.batch_set(keys(1, "x"), pages(1))
