"""Page runs and the CPU copier: one strided copy per run of pages must move exactly the bytes
that one copy per block would, for any order of pages in memory and of blocks in the caller's
tensors (HF and paged layouts, 1-, 2- and 4-byte dtypes, a partial last block)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clients.torch_layout import HFLayout, PagedLayout, page_runs, torch_dtype
from clients.torch_transfer import CpuCopier
from kvstore.layout import KVLayout

BT = 4


def layout(dtype: str = "float16") -> KVLayout:
    return KVLayout(
        model="runs", num_layers=3, kv_heads=2, head_dim=8, dtype=dtype, block_tokens=BT
    )


def slab_pages(n_slots: int, order: list[int], lay: KVLayout) -> tuple[np.ndarray, list]:
    """A host buffer of ``n_slots`` pages and the page views for ``order`` (request order)."""
    buf = np.zeros((n_slots, lay.page_bytes), np.uint8)
    return buf, [buf[s] for s in order]


def random_kv(shape: tuple[int, ...], lay: KVLayout, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch_dtype(lay))


def page_of(page: np.ndarray, lay: KVLayout) -> torch.Tensor:
    """The page as [layers, 2, bt, H, D] of the layout dtype (a plain per-page view)."""
    return torch.from_numpy(page).view(torch_dtype(lay)).view(lay.page_shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (fp8 has no torch.equal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def block_of(t: torch.Tensor, tl, block: int, rows: int = BT) -> torch.Tensor:
    """Request block ``block`` of the caller's tensor as [rows, H, D], one block at a time."""
    if isinstance(tl, HFLayout):
        a = block * BT - tl.start
        return t[0, :, a : a + rows].transpose(0, 1)
    return t[tl.index(block), :rows]


ORDERS = {
    "ascending": lambda n: list(range(n)),
    "descending": lambda n: list(range(n))[::-1],  # how a fresh node hands out slots
    "every other": lambda n: list(range(0, 2 * n, 2)),
    "shuffled": lambda n: np.random.default_rng(7).permutation(2 * n)[:n].tolist(),
}


def tensor_layouts(n: int, first: int) -> dict[str, object]:
    return {
        "hf": HFLayout(start=first * BT),
        "paged ascending": PagedLayout(list(range(3, 3 + first + n))),
        "paged descending": PagedLayout(list(range(first + n + 2, 2, -1))),
        "paged shuffled": PagedLayout(np.random.default_rng(8).permutation(first + n + 3).tolist()),
    }


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("tl_name", ["hf", "paged ascending", "paged descending", "paged shuffled"])
def test_store_and_load_through_runs_match_per_block_copies(dtype, order, tl_name):
    lay = layout(dtype)
    n, first = 5, 1  # request blocks 1..5 (block 0 was cached before)
    slots = ORDERS[order](n)
    buf, pages = slab_pages(2 * n, slots, lay)
    tl = tensor_layouts(n, first)[tl_name]
    blocks = list(range(first, first + n))
    if isinstance(tl, HFLayout):
        shape: tuple[int, ...] = (1, lay.kv_heads, n * BT, lay.head_dim)
    else:
        shape = (first + n + 3, BT, lay.kv_heads, lay.head_dim)
    kvs = [(random_kv(shape, lay, 2 * l), random_kv(shape, lay, 2 * l + 1)) for l in range(3)]

    runs = page_runs(blocks, pages, lay, tl)
    assert sum(len(r) for r in runs) == n
    copier = CpuCopier(lay)
    for l, (k, v) in enumerate(kvs):
        copier.store_layer(runs, l, tl, k, v, None, first, n)
    for block, page in zip(blocks, pages):
        got = page_of(page, lay)
        for l, (k, v) in enumerate(kvs):
            assert same(got[l, 0], block_of(k, tl, block))
            assert same(got[l, 1], block_of(v, tl, block))
    untouched = [s for s in range(2 * n) if s not in slots]
    assert not buf[untouched].any()

    # ...and back: a load starts at request block 0, so the same pages are blocks 0..n-1 now.
    tokens = (n - 1) * BT + 3  # the last block is partial
    dst_tl = HFLayout() if isinstance(tl, HFLayout) else PagedLayout(tl._ids[first:])
    load_runs = page_runs(range(n), pages, lay, dst_tl, last_rows=3)
    assert load_runs[-1].rows == 3 and len(load_runs[-1]) == 1
    for l, (k, v) in enumerate(kvs):
        if isinstance(tl, HFLayout):
            out = [torch.zeros((1, lay.kv_heads, tokens, lay.head_dim), dtype=k.dtype)]
            out.append(torch.zeros_like(out[0]))
        else:
            out = [torch.zeros_like(k), torch.zeros_like(v)]
        copier.load_layer(load_runs, l, dst_tl, out[0], out[1], tokens)
        for b in range(n):
            rows = BT if b < n - 1 else 3
            assert same(block_of(out[0], dst_tl, b, rows), block_of(k, tl, first + b, rows))
            assert same(block_of(out[1], dst_tl, b, rows), block_of(v, tl, first + b, rows))
        if isinstance(dst_tl, PagedLayout):  # the rest of the caller's cache is not touched
            rest = [i for i in range(shape[0]) if i not in dst_tl._ids[:n]]
            assert not out[0][rest].view(torch.uint8).any()


@pytest.mark.parametrize(
    ("order", "tl_name", "expect"),
    [
        ("ascending", "hf", 1),
        ("descending", "hf", 1),
        ("descending", "paged descending", 1),
        ("every other", "paged ascending", 1),  # a stride of two pages is still one run
        ("ascending", "paged shuffled", None),
    ],
)
def test_pages_in_order_make_one_run(order, tl_name, expect):
    lay = layout()
    n = 6
    _, pages = slab_pages(2 * n, ORDERS[order](n), lay)
    tl = tensor_layouts(n, 0)[tl_name]
    runs = page_runs(range(n), pages, lay, tl)
    if expect is None:
        assert len(runs) > 1
    else:
        assert len(runs) == expect


def test_pages_of_separate_buffers_or_gaps_start_new_runs():
    lay = layout()
    own = [np.zeros(lay.page_bytes, np.uint8) for _ in range(3)]  # e.g. streamed Get replies
    assert len(page_runs(range(3), own, lay, HFLayout())) == 3
    _, pages = slab_pages(8, [0, 1, 2, 5, 6], lay)
    runs = page_runs([0, 1, 2, 3, 4], pages, lay, HFLayout())
    assert [(r.first, len(r)) for r in runs] == [(0, 3), (3, 2)]
    _, pages = slab_pages(8, [0, 1, 2, 3], lay)
    runs = page_runs([0, 1, 3, 4], pages, lay, HFLayout())  # block 2 stored by someone else
    assert [(r.first, len(r)) for r in runs] == [(0, 2), (3, 2)]


def test_a_page_of_the_wrong_size_is_refused():
    lay = layout()
    with pytest.raises(ValueError, match="contiguous bytes"):
        page_runs([0], [np.zeros(lay.page_bytes - 1, np.uint8)], lay, HFLayout())


@pytest.mark.parametrize("tl_name", ["hf", "paged descending", "paged shuffled"])
def test_gather_and_scatter_move_every_block_in_one_call(tl_name):
    """The CUDA copier's device side (one kernel per layer), checked here on CPU tensors."""
    lay = layout()
    n, first = 4, 1
    tl = tensor_layouts(n, first)[tl_name]
    if isinstance(tl, HFLayout):
        shape: tuple[int, ...] = (1, lay.kv_heads, n * BT, lay.head_dim)
    else:
        shape = (first + n + 3, BT, lay.kv_heads, lay.head_dim)
    k = random_kv(shape, lay, 30)
    got = tl.gather(k, first, n, BT)
    assert got.shape == (n, BT, lay.kv_heads, lay.head_dim)
    for i in range(n):
        assert same(got[i], block_of(k, tl, first + i))

    # a load fills tokens [0, 3 * BT + 2) from request block 0 on
    dst_tl = HFLayout() if isinstance(tl, HFLayout) else PagedLayout(tl._ids[first:])
    out = torch.zeros_like(k)
    tokens = 3 * BT + 2
    dst_tl.scatter(out, got, tokens)
    for i in range(4):
        rows = BT if i < 3 else 2
        assert same(block_of(out, dst_tl, i, rows), got[i, :rows])
    if isinstance(dst_tl, HFLayout):
        assert not out[0, :, tokens:].any()
    else:
        assert not out[dst_tl.index(3), 2:].any()
        rest = [b for b in range(shape[0]) if b not in dst_tl._ids[:4]]
        assert not out[rest].any()
