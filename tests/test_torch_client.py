"""The torch layer-wise client against a real `kvcache node` process (no model: random K/V)."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import torch
import xxhash

from clients import KVStoreClient
from clients.node_leases import WriteLease
from clients.torch_client import LayoutMismatchError, LoadProgress, TorchKVClient
from clients.torch_layout import PagedLayout
from clients.torch_transfer import PinnedRing
from kvstore.layout import KVLayout
from kvstore.payload import PageHasher

from torch_helpers import BLOCK_TOKENS, layout_spec, prompt, start_node_for

BT = BLOCK_TOKENS
LAYOUT = KVLayout(
    model="unit", num_layers=3, kv_heads=2, head_dim=8, dtype="float32", block_tokens=BT
)
PATHS = pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "streamed"])


def hf_kv(seq: int, seed: int, layout: KVLayout = LAYOUT) -> list[tuple[torch.Tensor, ...]]:
    """Per layer (K, V) as [1, H, seq, D], distinct random values."""
    g = torch.Generator().manual_seed(seed)
    shape = (1, layout.kv_heads, seq, layout.head_dim)
    return [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        for _ in range(layout.num_layers)
    ]


@pytest.fixture
def node(start_kvcache):
    return start_node_for(start_kvcache, LAYOUT)


@pytest.fixture
def connect(node):
    made: list[TorchKVClient] = []

    def make(use_shm: bool = True, **kw) -> TorchKVClient:
        kv = TorchKVClient.connect(node.address, LAYOUT, use_shm=use_shm, **kw)
        assert kv.shared_memory is use_shm
        made.append(kv)
        return kv

    yield make
    for kv in made:
        kv.close()


@PATHS
def test_hf_round_trip_stores_full_blocks_only(connect, use_shm):
    kv = connect(use_shm)
    tokens = prompt(5 * BT + 3, seed=1)  # 5 full blocks and a partial one
    req = kv.request(tokens)
    assert kv.lookup(req) == 0
    layers = hf_kv(tokens.numel(), seed=2)
    with kv.store(req) as store:
        for l, (k, v) in enumerate(layers):
            store.put_layer(l, k, v)
        result = store.finish()
    assert (result.blocks, result.written, result.stored) == (5, 5, 5)
    assert kv.lookup(tokens) == 5 * BT  # the partial trailing block is not stored
    assert kv.lookup(tokens[: 3 * BT + 7]) == 3 * BT

    with kv.load(req) as load:
        assert load.num_tokens == 5 * BT
        for l, k, v in load:
            torch.testing.assert_close(k, layers[l][0][:, :, : 5 * BT], rtol=0, atol=0)
            torch.testing.assert_close(v, layers[l][1][:, :, : 5 * BT], rtol=0, atol=0)
    with kv.load(req, num_tokens=2 * BT + 5) as part:  # a prefix that ends inside a block
        k, v = part.layer(2)
        assert k.shape == (1, LAYOUT.kv_heads, 2 * BT + 5, LAYOUT.head_dim)
        torch.testing.assert_close(v, layers[2][1][:, :, : 2 * BT + 5], rtol=0, atol=0)


def test_pages_follow_the_documented_layer_major_layout(connect):
    """Other clients read the same bytes: page = [layers][k|v][block_tokens][kv_heads][head_dim]."""
    kv = connect(True)
    tokens = prompt(2 * BT, seed=3)
    layers = hf_kv(tokens.numel(), seed=4)
    with kv.store(tokens) as store:
        for l, (k, v) in enumerate(layers):
            store.put_layer(l, k, v)
        store.finish()
    with KVStoreClient(kv.client.address, use_shm=False) as raw:
        pages = raw.get(LAYOUT.namespace, tokens=tokens.numpy())
    for block, page in enumerate(pages):
        got = page.view(np.float32).reshape(LAYOUT.page_shape)
        rows = slice(block * BT, (block + 1) * BT)
        for l, (k, v) in enumerate(layers):
            np.testing.assert_array_equal(got[l, 0], k[0, :, rows].transpose(0, 1).numpy())
            np.testing.assert_array_equal(got[l, 1], v[0, :, rows].transpose(0, 1).numpy())


@PATHS
def test_paged_layout_round_trip_through_block_tables(connect, use_shm):
    kv = connect(use_shm)
    tokens = prompt(4 * BT, seed=5)
    g = torch.Generator().manual_seed(6)
    shape = (10, BT, LAYOUT.kv_heads, LAYOUT.head_dim)
    src = [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        for _ in range(LAYOUT.num_layers)
    ]
    src_table = [7, 2, 9, 0]
    with kv.store(tokens, tensor_layout=PagedLayout(src_table)) as store:
        for l, (k, v) in enumerate(src):
            store.put_layer(l, k, v)
        assert store.finish().stored == 4
    dst = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(LAYOUT.num_layers)]
    dst_table = torch.tensor([3, 8, 1, 5])
    with kv.load(tokens, tensor_layout=PagedLayout(dst_table), kv_caches=dst) as load:
        for l in range(LAYOUT.num_layers):
            k, v = load.layer(l)
            assert k is dst[l][0]
            for a, b in zip(src_table, dst_table.tolist()):
                torch.testing.assert_close(k[b], src[l][0][a], rtol=0, atol=0)
                torch.testing.assert_close(v[b], src[l][1][a], rtol=0, atol=0)
            untouched = [b for b in range(10) if b not in dst_table.tolist()]
            assert not k[untouched].any() and not v[untouched].any()


@PATHS
def test_store_after_a_cached_prefix_writes_only_new_blocks(connect, use_shm):
    kv = connect(use_shm)
    tokens = prompt(5 * BT, seed=7)
    layers = hf_kv(tokens.numel(), seed=8)
    req = kv.request(tokens)
    with kv.store(kv.request(tokens[: 2 * BT])) as store:
        for l, (k, v) in enumerate(layers):
            store.put_layer(l, k[:, :, : 2 * BT], v[:, :, : 2 * BT])
        store.finish()
    assert kv.lookup(req) == 2 * BT
    # The engine computed only tokens 2*BT.. : hand over just their K/V.
    with kv.store(req, first_block=2) as store:
        for l, (k, v) in enumerate(layers):
            store.put_layer(l, k[:, :, 2 * BT :].clone(), v[:, :, 2 * BT :].clone())
        result = store.finish()
    assert (result.blocks, result.stored) == (3, 3)
    with kv.load(req) as load:
        for l, k, _v in load:
            torch.testing.assert_close(k, layers[l][0], rtol=0, atol=0)


@pytest.mark.parametrize("order", ["in order", "out of order"])
def test_layers_put_in_order_are_committed_with_their_checksums(connect, monkeypatch, order):
    """Each layer's slices are hashed as the worker copies them, and the Commit carries every
    page's xxh3-64 (the node keeps them instead of reading the pages back); layers put out of
    order commit none, and the node hashes. The node's checksums are the pages' either way."""
    sent: list[object] = []
    commit = WriteLease.commit

    def spy(self, checksums=None):
        sent.append(checksums)
        return commit(self, checksums)

    monkeypatch.setattr(WriteLease, "commit", spy)
    kv = connect(True)
    tokens = prompt(4 * BT, seed=31)
    layers = hf_kv(tokens.numel(), seed=32)
    with kv.store(kv.request(tokens[:BT])) as first:  # block 0 stored already: its sum is 0
        for l, (k, v) in enumerate(layers):
            first.put_layer(l, k[:, :, :BT], v[:, :, :BT])
        first.finish()
    sent.clear()
    with kv.store(tokens) as store:
        ls = list(enumerate(layers))
        for l, (k, v) in ls if order == "in order" else ls[::-1]:
            store.put_layer(l, k, v)
        assert store.finish().stored == 3
    with KVStoreClient(kv.client.address, use_shm=False) as raw:
        pages = raw.get(LAYOUT.namespace, tokens=tokens.numpy())
        lease = raw.acquire(LAYOUT.namespace, tokens=tokens.numpy())
        try:
            kept = list(lease.checksums)
        finally:
            raw.release(lease)
    assert kept == [xxhash.xxh3_64_intdigest(p.tobytes()) for p in pages]
    if order == "in order" and PageHasher is not None:
        assert list(sent[0]) == [0, *kept[1:]]
    else:
        assert sent == [None]


def test_abort_and_incomplete_stores_publish_nothing(connect):
    kv = connect(True)
    tokens = prompt(3 * BT, seed=9)
    layers = hf_kv(tokens.numel(), seed=10)
    store = kv.store(tokens)
    for l, (k, v) in enumerate(layers):
        store.put_layer(l, k, v)
    store.abort()
    assert kv.lookup(tokens) == 0
    store = kv.store(tokens)
    store.put_layer(0, *layers[0])
    with pytest.raises(ValueError, match=r"layers \[1, 2\] were never stored"):
        store.finish()
    assert kv.lookup(tokens) == 0
    with kv.store(tokens) as store:  # leaving the block without finish() aborts
        store.put_layer(0, *layers[0])
    assert kv.lookup(tokens) == 0
    # The leases were returned: the same blocks can be stored now.
    with kv.store(tokens) as store:
        for l, (k, v) in enumerate(layers):
            store.put_layer(l, k, v)
        assert store.finish().stored == 3


def test_prefetch_loads_the_next_layer_while_the_caller_computes(connect):
    kv = connect(True)
    tokens = prompt(3 * BT, seed=11)
    with kv.store(tokens) as store:
        for l, (k, v) in enumerate(hf_kv(tokens.numel(), seed=12)):
            store.put_layer(l, k, v)
        store.finish()
    loaded: list[int] = []
    changed = threading.Condition()

    def progress(p: LoadProgress) -> None:
        with changed:
            loaded.append(p.done - 1)
            changed.notify_all()

    with kv.load(tokens, on_progress=progress) as load:
        load.layer(0)
        with changed:  # layer 1 arrives without being asked for...
            assert changed.wait_for(lambda: 1 in loaded, timeout=10)
        assert loaded == [0, 1]  # ...and layer 2 waits: one layer ahead, bounded memory
        load.layer(1)
        with changed:
            assert changed.wait_for(lambda: 2 in loaded, timeout=10)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_device_this_machine_lacks_is_a_clear_error(node):
    with pytest.raises(ValueError, match="no CUDA device here"):
        TorchKVClient.connect(node.address, LAYOUT, device="cuda")
    with pytest.raises(ValueError, match="not supported"):
        TorchKVClient.connect(node.address, LAYOUT, device="meta")


def test_layout_mismatch_is_a_clear_error(node):
    other = KVLayout(
        model="unit", num_layers=4, kv_heads=2, head_dim=16, dtype="float32", block_tokens=BT
    )
    with pytest.raises(LayoutMismatchError) as e:
        TorchKVClient.connect(node.address, other)
    msg = str(e.value)
    assert "num_layers 4 vs 3" in msg and "head_dim 16 vs 8" in msg
    assert "--layout model=unit,num_layers=4" in msg


def test_bad_tensors_are_rejected_with_what_to_fix(connect):
    kv = connect(True)
    tokens = prompt(2 * BT, seed=13)
    with kv.store(tokens) as store:
        k, v = hf_kv(tokens.numel(), seed=14)[0]
        with pytest.raises(ValueError, match="dtype torch.float16 does not match"):
            store.put_layer(0, k.half(), v.half())
        with pytest.raises(ValueError, match="kv_heads=2, head_dim=8"):
            store.put_layer(0, k[:, :1], v[:, :1])
        with pytest.raises(ValueError, match="does not cover tokens"):
            store.put_layer(0, k[:, :, :BT], v[:, :, :BT])
        with pytest.raises(ValueError, match="batch size 2"):
            store.put_layer(0, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
        with pytest.raises(IndexError, match="layer 3 out of range"):
            store.put_layer(3, k, v)
    assert kv.lookup(tokens) == 0


@PATHS
def test_tokens_shorter_than_a_block_cache_nothing(connect, use_shm):
    kv = connect(use_shm)
    tokens = prompt(BT - 1, seed=15)
    assert kv.lookup(tokens) == 0
    with kv.store(tokens) as store:
        for l, (k, v) in enumerate(hf_kv(tokens.numel(), seed=16)):
            store.put_layer(l, k, v)
        assert store.finish().blocks == 0
    with kv.load(tokens) as load:
        assert load.num_tokens == 0
        k, v = load.layer(0)
        assert k.shape[2] == 0
    assert kv.client.stats().namespaces[0].blocks == 0


def store_all(kv: TorchKVClient, tokens, layers, **kw) -> None:
    with kv.store(tokens, **kw) as store:
        for l, (k, v) in enumerate(layers):
            store.put_layer(l, k, v)
        store.finish()


@PATHS
def test_a_block_stored_by_another_writer_splits_the_pages_written(connect, use_shm):
    """Block 2 of 5 is already on the node (another writer put it): the store writes blocks
    0, 1, 3 and 4, in two runs of pages, and loads give every block back."""
    kv = connect(use_shm)
    tokens = prompt(5 * BT, seed=19)
    req = kv.request(tokens)
    layers = hf_kv(tokens.numel(), seed=20)
    other = np.stack(  # block 2's page as the documented layout lays it out
        [
            np.stack([k[0, :, 2 * BT : 3 * BT].transpose(0, 1).numpy() for k in kv_])
            for kv_ in layers
        ]
    )
    with KVStoreClient(kv.client.address, use_shm=False) as raw:
        raw.put(LAYOUT.namespace, [other], keys=[req.keys[2]])
    with kv.store(req) as store:
        for l, (k, v) in enumerate(layers):
            store.put_layer(l, k, v)
        result = store.finish()
    # the streamed path sends every page; the node keeps the first copy of block 2
    assert (result.written, result.stored) == (4 if use_shm else 5, 4)
    with kv.load(req) as load:
        for l, k, v in load:
            torch.testing.assert_close(k, layers[l][0], rtol=0, atol=0)
            torch.testing.assert_close(v, layers[l][1], rtol=0, atol=0)


def test_bf16_inference_tensors_round_trip(start_kvcache):
    """numpy has no bfloat16: the client moves the bytes; tensors made under inference_mode
    (a prefill) are stored and loaded like any other."""
    layout = KVLayout(
        model="unit", num_layers=2, kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=BT
    )
    node = start_node_for(start_kvcache, layout)
    with TorchKVClient.connect(node.address, layout) as kv:
        tokens = prompt(3 * BT + 5, seed=21)
        with torch.inference_mode():
            layers = [tuple(t.bfloat16() for t in kv_) for kv_ in hf_kv(tokens.numel(), 22, layout)]
        store_all(kv, tokens, layers)
        with kv.load(tokens, num_tokens=2 * BT + 3) as load:
            for l, k, v in load:
                assert k.dtype == torch.bfloat16 and k.shape[2] == 2 * BT + 3
                assert torch.equal(k, layers[l][0][:, :, : 2 * BT + 3])
                assert torch.equal(v, layers[l][1][:, :, : 2 * BT + 3])


def test_requests_share_the_clients_copier(connect):
    kv = connect(True)
    tokens = prompt(2 * BT, seed=23)
    cpu = torch.device("cpu")
    assert kv.copier(cpu) is kv.copier(cpu)
    store_all(kv, tokens, hf_kv(tokens.numel(), seed=24))
    with kv.load(tokens) as a, kv.load(tokens) as b:
        assert a._copier is b._copier is kv.copier(cpu)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_round_trip_side_stream(connect):
    kv = connect(True, device="cuda")
    tokens = prompt(4 * BT, seed=17)
    layers = [(k.cuda(), v.cuda()) for k, v in hf_kv(tokens.numel(), seed=18)]
    with kv.store(tokens) as store:
        for l, (k, v) in enumerate(layers):
            store.put_layer(l, k, v)
        assert store.finish().stored == 4
    with kv.load(tokens) as load:
        for l, k, v in load:
            assert k.device.type == "cuda"
            torch.testing.assert_close(k, layers[l][0], rtol=0, atol=0)
            torch.testing.assert_close(v, layers[l][1], rtol=0, atol=0)
    with kv.load(tokens, num_tokens=2 * BT + 3) as load:  # a partial last block
        k, v = load.layer(1)
        torch.testing.assert_close(v, layers[1][1][:, :, : 2 * BT + 3], rtol=0, atol=0)


@pytest.mark.gpu
@needs_cuda
def test_cuda_paged_round_trip_through_block_tables(connect):
    kv = connect(True, device="cuda")
    tokens = prompt(4 * BT + 3, seed=25)
    g = torch.Generator().manual_seed(26)
    shape = (9, BT, LAYOUT.kv_heads, LAYOUT.head_dim)
    src = [
        (torch.randn(shape, generator=g).cuda(), torch.randn(shape, generator=g).cuda())
        for _ in range(LAYOUT.num_layers)
    ]
    store_all(kv, tokens, src, tensor_layout=PagedLayout([8, 1, 2, 3]))
    dst = [(torch.zeros(shape, device="cuda"), torch.zeros(shape, device="cuda")) for _ in src]
    table = torch.tensor([4, 0, 7, 5])
    with kv.load(tokens, 3 * BT + 2, PagedLayout(table), kv_caches=dst) as load:
        for l in range(LAYOUT.num_layers):
            k, _ = load.layer(l)
            for a, b in zip([8, 1, 2], [4, 0, 7]):
                torch.testing.assert_close(k[b], src[l][0][a], rtol=0, atol=0)
            torch.testing.assert_close(k[5, :2], src[l][0][3, :2], rtol=0, atol=0)
            assert not k[5, 2:].any() and not k[[1, 2, 3, 6, 8]].any()


@pytest.mark.gpu
@needs_cuda
def test_cuda_requests_share_one_side_stream_and_pinned_staging(connect):
    """One side stream and one set of pinned staging buffers per client, not per request; a
    loaded layer the caller drops at once (record_stream) does not corrupt the next load."""
    kv = connect(True, device="cuda")
    tokens = prompt(3 * BT, seed=27)
    layers = [(k.cuda(), v.cuda()) for k, v in hf_kv(tokens.numel(), seed=28)]
    store_all(kv, tokens, layers)
    copier = kv.copier(torch.device("cuda", torch.cuda.current_device()))
    seen = set()
    for _ in range(3):
        with kv.load(tokens) as load:
            assert load._copier is copier
            for l in range(LAYOUT.num_layers):
                load.layer(l)  # dropped at once: their memory must not be reused too early
            seen.update(b.data_ptr() for b in copier._loads._buffers if b is not None)
        torch.empty(1 << 20, device="cuda").fill_(7)  # a neighbour allocating on its stream
    assert len(seen) == PinnedRing.SLOTS  # the same pinned buffers, reused
    with kv.load(tokens) as load:
        for l, k, _v in load:
            torch.testing.assert_close(k, layers[l][0], rtol=0, atol=0)


def test_a_restarted_node_gets_the_layers_in_its_new_shared_memory(start_kvcache):
    """The client writes where each lease's reply says the pages are: after the node restarts at
    the same address (a new segment), a store lands in the new node's memory, not in the dead
    node's segment the client mapped first."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    spec = ["node", "--listen", address, "--dram", "16MiB", "--layout", layout_spec(LAYOUT)]
    node = start_kvcache(*spec)
    kv = TorchKVClient.connect(address, LAYOUT)
    try:
        store_all(kv, prompt(2 * BT, seed=29), hf_kv(2 * BT, seed=30))  # maps the first segment
        node.kill()
        start_kvcache(*spec)
        tokens = prompt(3 * BT, seed=31)
        layers = hf_kv(tokens.numel(), seed=32)
        store_all(kv, tokens, layers)
        with KVStoreClient(address, use_shm=False) as raw:
            pages = raw.get(LAYOUT.namespace, tokens=tokens.numpy())
        assert all(p is not None for p in pages)
        got = np.stack(pages).view(np.float32).reshape(3, *LAYOUT.page_shape)
        for l, (k, _) in enumerate(layers):
            want = k[0].reshape(LAYOUT.kv_heads, 3, BT, LAYOUT.head_dim).permute(1, 2, 0, 3)
            np.testing.assert_array_equal(got[:, l, 0], want.numpy())
    finally:
        kv.close()


def test_tenants_round_trip_through_their_own_segments(start_kvcache):
    """With tenant tokens the node has no /dev/shm slab: each tenant's torch client loads and
    stores layer by layer through its own segment, and sees only its own blocks."""
    node = start_node_for(
        start_kvcache, LAYOUT, "16MiB", "--tenant-token", "ta=alice", "--tenant-token", "tb=bob"
    )
    assert node.info["shm"] == {}
    alice = TorchKVClient.connect(node.address, LAYOUT, token="ta")
    bob = TorchKVClient.connect(node.address, LAYOUT, token="tb")
    try:
        assert alice.shared_memory and bob.shared_memory
        tokens = prompt(3 * BT, seed=7)
        for kv, seed in ((alice, 8), (bob, 9)):
            layers = hf_kv(tokens.numel(), seed=seed)
            with kv.store(kv.request(tokens)) as store:
                for l, (k, v) in enumerate(layers):
                    store.put_layer(l, k, v)
                assert store.finish().stored == 3
            with kv.load(kv.request(tokens)) as load:
                for l, k, v in load:
                    torch.testing.assert_close(k, layers[l][0], rtol=0, atol=0)
                    torch.testing.assert_close(v, layers[l][1], rtol=0, atol=0)
        assert alice.lookup(prompt(3 * BT, seed=70)) == 0
    finally:
        alice.close()
        bob.close()
