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

Both expose ``view(t, block, rows)``: a ``[rows, kv_heads, head_dim]`` view of the caller's tensor
for the first ``rows`` tokens of request block ``block``. Loads copy page rows into that view,
stores copy the view into page rows: one strided copy per block and layer, never per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvstore.layout import KVLayout


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """The torch dtype of a layout's elements (``float16`` -> ``torch.float16``, ...)."""
    dtype = getattr(torch, layout.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"layout dtype {layout.dtype!r} has no torch dtype")
    return dtype


def page_view(raw: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A flat uint8 page as ``[layers, 2, block_tokens, kv_heads, head_dim]`` of the layout
    dtype."""
    return raw.view(torch_dtype(layout)).view(layout.page_shape)


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

    def view(self, t: torch.Tensor, block: int, rows: int, block_tokens: int) -> torch.Tensor:
        a = block * block_tokens - self.start
        return t[0, :, a : a + rows].transpose(0, 1)


@dataclass(frozen=True)
class PagedLayout:
    """Per layer ``[num_blocks, block_tokens, kv_heads, head_dim]``; request block ``i`` is cache
    block ``block_table[i]`` (a list or 1-D integer tensor, indexed by request block)."""

    block_table: Sequence[int] | torch.Tensor
    _ids: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        table = self.block_table
        if isinstance(table, torch.Tensor):
            table = table.reshape(-1).tolist()  # once per request, not per token
        object.__setattr__(self, "_ids", tuple(int(b) for b in table))

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

    def view(self, t: torch.Tensor, block: int, rows: int, block_tokens: int) -> torch.Tensor:
        return t[self._ids[block], :rows]


KVTensorLayout = HFLayout | PagedLayout
