"""The SGLang HiCache storage backend through SGLang's own code: its HybridCacheController (the
engine's controller for MHA and MLA models) creates the backend with StorageBackendFactory and
runs its prefetch, backup and sync threads over SGLang's real host pools in each layout, against
a real node (tests/sglang_rig.py). Keys per rank and model, pages in the pool's dtype, the node
layout's checks, clear(), a hung node, models with more pools than KV, pages outside shared
memory, metrics, tenants."""

from __future__ import annotations

import logging
import signal
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from helpers import sigstop, wait_until

pytest.importorskip("sglang.srt.mem_cache.storage")
from sglang_rig import PAGE, Rank, get_storage_hash_str, layout_spec, rank, tokens  # noqa: E402

FP16, BF16 = layout_spec("float16"), layout_spec("bfloat16")


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@contextmanager
def ranks(*made: Rank) -> Iterator[tuple[Rank, ...]]:
    try:
        yield made
    finally:
        for r in made:
            r.close()


@contextmanager
def hung(node) -> Iterator[None]:
    """The node process stopped (SIGSTOP): it accepts connections and answers nothing."""
    sigstop(node.proc.pid)
    try:
        yield
    finally:
        node.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_pages_load_into_the_host_pool_in_its_dtype(start_node, mla, layout):
    """SGLang reshapes a loaded page in the pool's dtype: raw bytes made every load fail."""
    node = start_node("--layout", BF16, layout=FP16)
    for dtype in (torch.float16, torch.bfloat16):
        with ranks(
            rank(node.address, mla=mla, layout=layout, dtype=dtype),
            rank(node.address, mla=mla, layout=layout, dtype=dtype),
            rank(node.address, mla=mla, layout=layout, dtype=dtype, use_shm=False),
        ) as (writer, reader, remote):
            ts = tokens(3, salt=int(dtype == torch.bfloat16))
            stored, pages = writer.backup(ts, seed=1)
            assert stored == 3 * PAGE
            for r in (reader, remote):  # from shared memory, and streamed (another host's)
                hits, loaded, got = r.prefetch(ts)
                assert (hits, loaded) == (3 * PAGE, 3 * PAGE) and same(got, pages)


def test_tp_ranks_pp_stages_models_and_layouts_keep_their_own_pages(start_node):
    node = start_node(layout=FP16)
    a = node.address
    ts = tokens(2)
    # Every TP rank of a non-MLA model, and every PP stage, holds its own share of a page.
    for shares in ([{"tp": (0, 2)}, {"tp": (1, 2)}], [{"pp": (0, 2)}, {"pp": (1, 2)}]):
        with ranks(*(rank(a, **s) for s in shares), *(rank(a, **s) for s in shares)) as made:
            written = [made[i].backup(ts, seed=10 + i)[1] for i in range(2)]
            for i in range(2):
                hits, loaded, got = made[2 + i].prefetch(ts)
                assert loaded == 2 * PAGE and same(got, written[i]), shares[i]
        ts = tokens(2, salt=1)
    # MLA's KV is the same on every TP rank: rank 0 writes it, rank 1 loads it.
    with ranks(rank(a, mla=True, tp=(0, 2)), rank(a, mla=True, tp=(1, 2))) as (r0, r1):
        _, pages = r0.backup(ts, seed=3)
        assert r1.backup(ts, seed=4)[0] == 0  # SGLang skips a non-writer's backup
        assert r1.prefetch(ts)[1] == 2 * PAGE
        assert same(r1.prefetch(ts)[2], pages)
    # Another model, or another host layout, of the same page size finds nothing.
    made = (rank(a), rank(a, model="other"), rank(a, layout="layer_first"))
    with ranks(*made) as (writer, other_model, other_layout):
        ts = tokens(2, salt=2)
        assert writer.backup(ts, seed=5)[0] == 2 * PAGE
        assert writer.prefetch(ts)[1] == 2 * PAGE
        assert other_model.prefetch(ts)[0] == 0
        assert other_layout.prefetch(ts)[0] == 0


def test_keys_follow_docs_api_md(start_node):
    """A key computed from docs/api.md's "SGLang HiCache keys" is the backend's."""
    import xxhash

    node = start_node(layout=FP16)
    with ranks(rank(node.address, tp=(1, 2), pp=(0, 1), model="org/m")) as (r,):
        name = hashes(tokens(1))[0]
        identity = (
            "model=org/m|dtype=float16|layout=page_first"
            "|page=16:8192:MHATokenToKVPoolHost(2, 16, 2, 2, 32)|share=tp1/2,pp0/1|epoch="
        )
        doc = b"sglang/page/v2\x00" + identity.encode() + b"\x00" + name.encode()
        assert r.backend._keys([name]) == [xxhash.xxh3_128_digest(doc)]


def test_the_node_layout_must_fit_the_pools_dtype_and_model(start_node):
    node = start_node("--layout", BF16, layout=FP16)  # equal page sizes, two dtypes
    with ranks(rank(node.address), rank(node.address, dtype=torch.bfloat16)) as (f16, b16):
        assert f16.backend.namespace == "test|L2|H2|D32|float16|B16"
        assert b16.backend.namespace == "test|L2|H2|D32|bfloat16|B16"
    with pytest.raises(ValueError, match="its dtype is float16, the host pool's bfloat16"):
        rank(node.address, dtype=torch.bfloat16, namespace="test|L2|H2|D32|float16|B16")
    two = start_node("--layout", layout_spec(model="b"), layout=layout_spec(model="a"))
    with ranks(rank(two.address, model="org/B")) as (b,):
        assert b.backend.namespace.startswith("b|")  # the layout named for the model
    with pytest.raises(ValueError, match="name one with 'namespace'"):
        rank(two.address, model="c")


def test_a_node_without_a_layout_serves_the_layouts_the_backends_register(start_kvcache):
    """Any model on any node: a node started with no --layout; a backend finds no layout that
    fits its host pool and has the node serve one for its model (two models, fp16 and bf16
    pools) side by side on one budget; pages go and come back whole."""
    node = start_kvcache("node", "--listen", "127.0.0.1:0", "--dram", "16MiB")
    a = node.address
    made = (rank(a, model="org/m"), rank(a, model="org/m"), rank(a, dtype=torch.bfloat16))
    with ranks(*made) as (writer, reader, other):
        assert writer.backend.namespace == reader.backend.namespace
        assert writer.backend.namespace.startswith("sglang:org/m|")
        assert other.backend.namespace.startswith("sglang:test|")
        assert other.backend.namespace.endswith("|bfloat16|B16")
        for w, r, salt in ((writer, reader, 0), (other, other, 1)):
            ts = tokens(3, salt=salt)
            stored, pages = w.backup(ts, seed=7 + salt)
            assert stored == 3 * PAGE
            hits, loaded, got = r.prefetch(ts)
            assert (hits, loaded) == (3 * PAGE, 3 * PAGE) and same(got, pages)


def test_clear_moves_this_engine_to_a_new_key_epoch(start_node):
    """SGLang's /clear_hicache_storage_backend: the engine (weights updated in place, say) must
    not load what it stored before; other engines keep their pages."""
    node = start_node(layout=FP16)
    a = node.address
    ts = tokens(2)
    with ranks(rank(a), rank(a)) as (engine, other):
        _, old = engine.backup(ts, seed=1)
        assert engine.ctl.clear_storage_backend()  # SGLang's controller call: reported a success
        assert engine.prefetch(ts)[0] == 0
        hits, _, got = other.prefetch(ts)
        assert hits == 2 * PAGE and same(got, old)
        _, new = engine.backup(ts, seed=2)
        assert same(engine.prefetch(ts)[2], new)
        assert same(other.prefetch(ts)[2], old)
    with ranks(rank(a)) as (again,):  # detached and attached again in the same process
        assert same(again.prefetch(ts)[2], new)
    with ranks(rank(a, mla=True, tp=(0, 2))) as (mla,):
        with pytest.raises(RuntimeError, match="key_epoch"):
            mla.ctl.clear_storage_backend()  # SGLang reports the failure


def test_a_hung_node_never_holds_sglangs_storage_threads(start_node):
    node = start_node(layout=FP16)
    r = rank(node.address)  # the default deadline
    ts = tokens(2)
    r.backup(ts, seed=1)
    with hung(node):
        # Saves queued as the scheduler queues them, one of them under way: with the client's
        # old 30 s deadline the backup thread was still waiting when SGLang's 10 s join gave up
        # on a detach (a flush, a role switch).
        for i in range(8):
            t = tokens(1, salt=10 + i)
            r.ctl.write_storage(r.group.alloc(PAGE), t, hash_value=hashes(t))
        wait_until(lambda: r.ctl.backup_queue.qsize() < 8, what="a save under way")
        r.close()  # SGLang's detach: raises when its threads do not stop within 10 s

        # Down (hung) at engine start: the start goes on; after one deadline the breaker is
        # open and no call is made (a miss at once), until the probe finds the node back.
        late = rank(node.address, retry_s=0.2)
        b = late.backend
        assert late.prefetch(ts)[0] == 0 and b.breaker.is_open
        assert late.prefetch(ts)[0] == 0 and b.breaker.skipped > 0
    with ranks(late):
        wait_until(lambda: late.prefetch(ts)[1] == 2 * PAGE, 30, "loads once the node answers")


def test_models_with_other_pools_than_kv_are_refused_at_registration(start_node):
    """Hybrid, DSA, Mamba and sliding-window models use SGLang's v2 interface for their other
    pools; without it every prefetch counted 0 hits. Refused, with the reason."""
    node = start_node(layout=FP16)
    with pytest.raises(ValueError, match="swa pool besides its KV"):
        rank(node.address, swa=True)


def test_pages_outside_shared_memory_load(start_node, tmp_path):
    """Pages the node holds on SSD count as hits for SGLang's query and load as well."""
    ssd = str(tmp_path / "ssd")
    node = start_node("--ssd", "256KiB", "--ssd-dir", ssd, "--no-promote", dram="32KiB")
    ts = tokens(6)
    with ranks(rank(node.address), rank(node.address)) as (writer, reader):
        pages: list[torch.Tensor] = []
        for first in (0, 2, 4):  # 2 pages at a time: the first ones go down to SSD
            stored, written = writer.backup(ts[: (first + 2) * PAGE], seed=first, first_page=first)
            assert stored == 2 * PAGE
            pages += written
        b = writer.backend
        tiers = b.client.lookup(b.namespace, keys=b._keys(hashes(ts))).tiers
        assert any(t is not None and t.name == "SSD" for t in tiers)
        hits, loaded, got = reader.prefetch(ts)
        assert hits == loaded == 6 * PAGE and same(got, pages)


def hashes(ts: list[int]) -> list[str]:
    """SGLang's page names of ``ts`` (its hash chain)."""
    return get_storage_hash_str(ts, None, page_size=PAGE)


def test_storage_metrics_reach_sglangs_collector(start_node):
    from sglang.srt.observability.metrics_collector import StorageMetricsCollector

    node = start_node(layout=FP16)
    with ranks(rank(node.address, metrics=True)) as (r,):
        ts = tokens(3)
        r.backup(ts, seed=1)
        r.prefetch(ts)
        stats = r.backend.get_stats()
        StorageMetricsCollector(labels={"storage_backend": "kvcache"}).log_storage_metrics(stats)
        assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
        assert stats.backup_bandwidth[0] > 0 and stats.prefetch_bandwidth[0] > 0
        assert r.backend.get_stats().prefetch_pgs == []  # since the last call


def test_legacy_interface_tenants_and_a_stopped_node(start_node, tmp_path, caplog):
    """SGLang's flat-tensor path (no interface_v1); tenants keep their own pages; a token in the
    extra config is shown with SGLang's server arguments: token_file instead."""
    node = start_node("--tenant-token", "ta=alice", "--tenant-token", "tb=bob", layout=FP16)
    token_file = tmp_path / "token"
    token_file.write_text("ta\n")
    with caplog.at_level(logging.WARNING, logger="clients.sglang_hicache"):
        bob = rank(node.address, token="tb", interface_v1=0)
    assert "token_file" in caplog.text
    alice = rank(node.address, token_file=str(token_file), interface_v1=0)
    with ranks(alice, bob):
        ts = tokens(3)
        _, pages = alice.backup(ts, seed=1)
        assert same(alice.prefetch(ts)[2], pages)
        assert bob.prefetch(ts)[0] == 0
        b = alice.backend
        names = hashes(ts) + ["f" * 64]
        assert b.batch_exists(names) == 3 and b.exists(names[2]) and not b.exists(names[3])
        node.stop()
        assert alice.prefetch(ts)[0] == 0  # a node that is gone is a miss
        assert alice.backup(tokens(1, salt=5), seed=2)[0] == 0
