"""The KV tensor layouts engines use, and how a page's layer slice maps onto them.

A page (``kvstore.layout``) holds one token block for all layers, layer-major:
``[layers][k|v][block_tokens][kv_heads][head_dim]``. For one layer and one block the torch client
moves ``[block_tokens, kv_heads, head_dim]`` rows of K and of V between that page slice and the
caller's tensors, which come in one of two layouts:

- ``HFLayout``: per layer, K and V are ``[1, kv_heads, seq, head_dim]`` (Hugging Face
  ``DynamicCache``; batch 1 = one request). Sequence index ``s`` holds request token
  ``start + s``.
- ``PagedLayout``: per layer, K and V are ``[num_blocks, block_tokens, kv_heads, head_dim]``
  (vLLM-style paged cache); the request's token block ``i`` lives in cache block
  ``block_table[i]``.

On the host, pages are grouped into ``PageRun``s: request blocks that follow each other in the
caller's tensors and whose pages lie a constant stride apart in memory (the node hands out page
slots in runs) form one strided numpy array, so one layer of a whole run moves in one
``np.copyto`` per K and V instead of two torch calls per block (whose fixed cost was several times
that of copying one layer's 16-32 KiB). Both layouts expose ``blocks(a, run, rows, bt)``: the
``[n, rows, kv_heads, head_dim]`` view of a run's request blocks (tokens ``:rows`` of each) in the
caller's tensor as numpy, and, for CUDA, ``gather`` / ``scatter``, which move all of a request's
blocks between the caller's tensor and a ``[blocks, block_tokens, kv_heads, head_dim]`` staging
tensor in one kernel. Never a copy per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from numpy.typing import NDArray

from kvstore.layout import KVLayout

# Copies move bytes: elements are viewed as integers of their size (numpy has no bf16 or fp8).
_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """The torch dtype of a layout's elements (``float16`` -> ``torch.float16``, ...)."""
    dtype = getattr(torch, layout.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"layout dtype {layout.dtype!r} has no torch dtype")
    return dtype


def host_array(t: torch.Tensor) -> NDArray[np.generic]:
    """A host tensor's elements as a numpy view of same-size integers (no copy)."""
    return t.detach().view(_TORCH_INT[t.element_size()]).numpy()


def _address(a: NDArray[np.generic]) -> int:
    return int(a.__array_interface__["data"][0])


def _root(a: NDArray[np.generic]) -> object:
    """The object that owns ``a``'s memory (pages of one slab share it)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.base if a.base is not None else a


@dataclass(frozen=True, slots=True)
class PageRun:
    """Host pages of request blocks ``[first, first + len(pages))``: ``pages`` is one strided
    ``[n, layers, 2, block_tokens, kv_heads, head_dim]`` numpy array of same-size integers; a load
    copies tokens ``:rows`` of each block (less than a block only for the prefix's last one).
    ``step``: how far apart the run's blocks are in the caller's tensors (paged: in the block
    table, which may run backwards; HF: always 1)."""

    first: int
    pages: NDArray[np.generic]
    rows: int
    step: int = 1

    def __len__(self) -> int:
        return int(self.pages.shape[0])


def page_runs(
    blocks: Sequence[int],
    pages: Sequence[NDArray[np.uint8]],
    layout: KVLayout,
    tensor_layout: "KVTensorLayout",
    last_rows: int | None = None,
) -> list[PageRun]:
    """Group ``pages`` (flat uint8 views, one per request block in ``blocks``, ascending) into
    runs: consecutive blocks, a constant step apart in the caller's tensors, whose pages lie one
    constant stride (either direction) apart in one buffer. ``last_rows``: tokens of the last
    block to load, when that block is partial (it then gets a run of its own). O(blocks), once
    per request."""
    pb, item = layout.page_bytes, np.dtype(_NP_INT[layout.itemsize])
    for p in pages:
        if p.dtype != np.uint8 or p.shape != (pb,) or p.strides != (1,):
            raise ValueError(f"a page must be {pb} contiguous bytes, got {p.dtype} {p.shape}")
    addrs = [_address(p) for p in pages]
    roots = [_root(p) for p in pages]
    index = [tensor_layout.index(b) for b in blocks]
    bt, n = layout.block_tokens, len(pages)
    partial = last_rows is not None and last_rows < bt
    runs: list[PageRun] = []
    i = 0
    while i < n:
        j, step, istep = i + 1, 0, 0
        while j < n and not (partial and j == n - 1):
            d, di = addrs[j] - addrs[j - 1], index[j] - index[j - 1]
            if blocks[j] != blocks[j - 1] + 1 or di == 0 or di != (istep or di):
                break
            if roots[j] is not roots[i] or (step == 0 and abs(d) < pb) or d != (step or d):
                break
            step, istep = d, di
            j += 1
        first = pages[i].view(item).reshape(layout.page_shape)
        # NOTE: safe: the run's pages were each handed to us in full, inside one buffer, and
        # the strides reach exactly them.
        run = np.lib.stride_tricks.as_strided(
            first,
            (j - i, *first.shape),
            (step or pb, *first.strides),
            writeable=first.flags.writeable,
        )
        rows = last_rows if partial and j == n and last_rows is not None else bt
        runs.append(PageRun(blocks[i], run, rows, istep or 1))
        i = j
    return runs


def _check_kv(
    name: str, k: torch.Tensor, v: torch.Tensor, layout: KVLayout, shape_hint: str
) -> None:
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise TypeError(f"{name}: K and V must be torch tensors")
    if k.shape != v.shape:
        raise ValueError(f"{name}: K {tuple(k.shape)} and V {tuple(v.shape)} differ in shape")
    if k.dtype != torch_dtype(layout) or v.dtype != k.dtype:
        raise ValueError(
            f"{name}: dtype {k.dtype} does not match the store's layout dtype "
            f"{layout.dtype} (namespace {layout.namespace})"
        )
    if (
        k.dim() != 4
        or k.shape[1 if shape_hint == "hf" else 2] != layout.kv_heads
        or k.shape[3] != layout.head_dim
    ):
        expect = (
            "[1, kv_heads, seq, head_dim]"
            if shape_hint == "hf"
            else "[num_blocks, block_tokens, kv_heads, head_dim]"
        )
        raise ValueError(
            f"{name}: shape {tuple(k.shape)} does not match {expect} with "
            f"kv_heads={layout.kv_heads}, head_dim={layout.head_dim} "
            f"(namespace {layout.namespace})"
        )


@dataclass(frozen=True)
class HFLayout:
    """Per layer ``[1, kv_heads, seq, head_dim]``; sequence index ``s`` is request token
    ``start + s``.

    ``capacity``: loads allocate ``capacity`` sequence slots (>= the loaded prefix) so that the
    caller can write the uncached suffix into the same tensor instead of concatenating.
    """

    start: int = 0
    capacity: int | None = None

    def check(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: KVLayout,
        first_block: int,
        end_token: int,
        what: str,
    ) -> None:
        """``k``/``v`` must cover request tokens ``[first_block * block_tokens, end_token)``."""
        _check_kv(what, k, v, layout, "hf")
        if k.shape[0] != 1:
            raise ValueError(
                f"{what}: batch size {k.shape[0]}; the store takes one request at a time (batch 1)"
            )
        lo = first_block * layout.block_tokens
        if lo < self.start or end_token > self.start + k.shape[2]:
            raise ValueError(
                f"{what}: seq length {k.shape[2]} starting at token {self.start} does not cover "
                f"tokens [{lo}, {end_token})"
            )

    def allocate(
        self, layout: KVLayout, num_tokens: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seq = max(num_tokens - self.start, self.capacity or 0)
        shape = (1, layout.kv_heads, seq, layout.head_dim)
        dtype = torch_dtype(layout)
        return (
            torch.empty(shape, dtype=dtype, device=device),
            torch.empty(shape, dtype=dtype, device=device),
        )

    def index(self, block: int) -> int:
        return block

    def blocks(
        self, a: NDArray[np.generic], run: PageRun, rows: int, block_tokens: int
    ) -> NDArray[np.generic]:
        """Request blocks ``[run.first, run.first + len(run))``, tokens ``:rows`` of each, as a
        ``[n, rows, kv_heads, head_dim]`` view of ``a`` (the caller's tensor as numpy)."""
        n, s = len(run), run.first * block_tokens - self.start
        if rows < block_tokens:  # the partial last block of a load: a run of its own
            assert n == 1, "page_runs gives a partial block a run of its own"
            x = a[0, :, s : s + rows][:, None]
        else:
            x = a[0, :, s : s + n * block_tokens]
            x = x.reshape(x.shape[0], n, block_tokens, x.shape[2])  # a view: splits one axis
        return x.transpose(1, 2, 0, 3)

    def gather(self, t: torch.Tensor, first: int, n: int, block_tokens: int) -> torch.Tensor:
        s = first * block_tokens - self.start
        x = t[0, :, s : s + n * block_tokens]
        return x.view(x.shape[0], n, block_tokens, x.shape[2]).permute(1, 2, 0, 3)

    def scatter(self, t: torch.Tensor, src: torch.Tensor, num_tokens: int) -> None:
        """Tokens ``[0, num_tokens)`` (a load starts at 0) from ``[blocks, bt, H, D]``."""
        flat = src.reshape(-1, src.shape[2], src.shape[3])[:num_tokens]
        t[0, :, :num_tokens].copy_(flat.transpose(0, 1), non_blocking=True)


@dataclass(frozen=True)
class PagedLayout:
    """Per layer ``[num_blocks, block_tokens, kv_heads, head_dim]``; request block ``i`` is cache
    block ``block_table[i]`` (a list or 1-D integer tensor, indexed by request block)."""

    block_table: Sequence[int] | torch.Tensor
    _ids: tuple[int, ...] = field(init=False, repr=False)
    _on_device: dict[torch.device, torch.Tensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        table = self.block_table
        if isinstance(table, torch.Tensor):
            table = table.reshape(-1).tolist()  # once per request, not per token
        object.__setattr__(self, "_ids", tuple(int(b) for b in table))
        object.__setattr__(self, "_on_device", {})

    def _ids_on(self, device: torch.device) -> torch.Tensor:
        """The block table as a tensor on ``device``, made once per layout: a copy from a Python
        list to a GPU synchronizes its stream, which must not happen per layer."""
        ids = self._on_device.get(device)
        if ids is None:
            ids = self._on_device[device] = torch.tensor(self._ids, device=device)
        return ids

    def check(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: KVLayout,
        first_block: int,
        end_token: int,
        what: str,
    ) -> None:
        _check_kv(what, k, v, layout, "paged")
        if k.shape[1] != layout.block_tokens:
            raise ValueError(
                f"{what}: cache blocks hold {k.shape[1]} tokens; the store's layout "
                f"has block_tokens={layout.block_tokens}"
            )
        last = -(-end_token // layout.block_tokens)
        if len(self._ids) < last:
            raise ValueError(
                f"block_table has {len(self._ids)} entries; tokens up to {end_token} need {last}"
            )
        bad = [b for b in self._ids[first_block:last] if not 0 <= b < k.shape[0]]
        if bad:
            raise ValueError(f"block_table entries {bad[:4]} out of range [0, {k.shape[0]})")

    def index(self, block: int) -> int:
        return self._ids[block]

    def blocks(
        self, a: NDArray[np.generic], run: PageRun, rows: int, block_tokens: int
    ) -> NDArray[np.generic]:
        # page_runs made sure the run's cache blocks are i, i + step, i + 2 * step, ...
        i, last = self._ids[run.first], self._ids[run.first + len(run) - 1]
        stop = last + (1 if run.step > 0 else -1)
        return a[i : stop if stop >= 0 else None : run.step, :rows]

    def gather(self, t: torch.Tensor, first: int, n: int, block_tokens: int) -> torch.Tensor:
        return t.index_select(0, self._ids_on(t.device)[first : first + n])

    def scatter(self, t: torch.Tensor, src: torch.Tensor, num_tokens: int) -> None:
        bt = t.shape[1]
        full, rest = divmod(num_tokens, bt)
        if full:
            t.index_copy_(0, self._ids_on(t.device)[:full], src[:full])
        if rest:
            t[self._ids[full], :rest].copy_(src[full, :rest], non_blocking=True)


KVTensorLayout = HFLayout | PagedLayout
