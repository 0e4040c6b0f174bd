"""The key space of one SGLang engine rank on a kvcache node, and the node layout it uses.

SGLang names a page by its chained hash, which covers the tokens, ``extra_key`` and
``cache_salt`` only: every TP rank of a non-MLA model, every pipeline stage and every
context-parallel rank holds a different share of the same page under the same name, and two
models (or bf16 and fp16, or two host layouts) can have pages of equal size. So the node key of a
page is ``xxh3_128`` of the page name under this rank's *identity*: the model, the page's byte
format (stored dtype, SGLang's host layout, tokens per page, the pool's page shape), the rank's
share (TP rank/size unless the KV is replicated over TP ranks, as MLA's is; PP rank/size; CP and
DCP rank/size) and a key epoch (``key_epoch`` in the extra config, moved on by ``clear()``).
Ranks and engines whose identity is equal hold the same bytes for the same name, and only they
share pages (MLA's TP ranks, DP-attention replicas of one attention-TP rank, a restarted
engine). See docs/api.md ("SGLang HiCache keys").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

import xxhash

from kvstore.layout import KVLayout

from .node_client import NamespaceInfo

log = logging.getLogger(__name__)
KEY_DOMAIN = b"sglang/page/v2\x00"
# Host layouts whose pages SGLang's host pools read and write whole (get_data_page).
PAGE_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


@dataclass(frozen=True)
class PageFormat:
    """What a page of an SGLang host pool is, byte for byte."""

    dtype: str  # the stored element type, e.g. "bfloat16" ("uint8" for fp8 KV)
    layout: str  # SGLang's host layout (--hicache-mem-layout)
    page_tokens: int
    page_bytes: int
    shape: str  # the pool class and one page's shape in that layout


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def page_format(pool: Any) -> PageFormat:
    """The page format of an SGLang host pool (``HostKVCache``); a layout whose pages cannot be
    moved whole raises ``ValueError``."""
    layout = str(pool.layout)
    if layout not in PAGE_LAYOUTS:
        raise ValueError(
            f"kvcache HiCache backend: the host layout {layout!r} is not supported "
            f"(use --hicache-mem-layout {' / '.join(PAGE_LAYOUTS)})"
        )
    page = pool.get_data_page(0, flat=False)
    return PageFormat(
        dtype=dtype_name(pool.dtype),
        layout=layout,
        page_tokens=int(pool.page_size),
        page_bytes=page.numel() * page.element_size(),
        shape=f"{type(pool).__name__}{tuple(page.shape)}",
    )


def rank_share(config: Any) -> str:
    """The part of the KV this rank holds (``HiCacheStorageConfig``): under DP attention,
    SGLang's ``tp_rank``/``tp_size`` are the attention-TP ones, so DP replicas share."""
    parts = []
    if not config.is_mla_model:  # MLA-style KV is the same on every TP rank
        parts.append(f"tp{config.tp_rank}/{config.tp_size}")
    parts.append(f"pp{config.pp_rank}/{config.pp_size}")
    if config.attn_cp_size > 1:
        parts.append(f"cp{config.attn_cp_rank}/{config.attn_cp_size}")
    if getattr(config, "dcp_size", 1) > 1:
        parts.append(f"dcp{config.dcp_rank}/{config.dcp_size}/page{config.logical_page_size}")
    return ",".join(parts)


def identity(config: Any, fmt: PageFormat, logical_dtype: str, epoch: str) -> bytes:
    """The key prefix of one rank's pages (see the module's docstring)."""
    fields = {
        "model": config.model_name or "",
        "dtype": fmt.dtype if not logical_dtype else f"{fmt.dtype}:{logical_dtype}",
        "layout": fmt.layout,
        "page": f"{fmt.page_tokens}:{fmt.page_bytes}:{fmt.shape}",
        "share": rank_share(config),
        "epoch": epoch,
    }
    return KEY_DOMAIN + "|".join(f"{k}={v}" for k, v in fields.items()).encode() + b"\x00"


def page_keys(prefix: bytes, names: list[str]) -> list[bytes]:
    return [xxhash.xxh3_128_digest(prefix + name.encode()) for name in names]


def dtype_fits(fmt: PageFormat, info: NamespaceInfo) -> bool:
    """Whether the node layout's dtype is the pool's (fp8 KV is stored as uint8)."""
    if fmt.dtype == info.layout.dtype:
        return True
    return fmt.dtype == "uint8" and info.layout.itemsize == 1


def _same_model(a: str, b: str) -> bool:
    return bool(a) and a.rsplit("/", 1)[-1].lower() == b.rsplit("/", 1)[-1].lower()


def layout_for(fmt: PageFormat, model: str) -> KVLayout:
    """A node layout whose pages are this host pool's, byte for byte, to register with a node
    that serves the layouts its clients register: one "layer" of K|V halves per page (SGLang
    moves a page whole, so the node needs its size and dtype, not its inner shape), named for
    the model so that other models' pages never mix with it."""
    itemsize = KVLayout(model="x", num_layers=1, kv_heads=1, head_dim=1, dtype=fmt.dtype).itemsize
    per_token = 2 * fmt.page_tokens * itemsize
    if fmt.page_bytes % per_token:
        raise ValueError(
            f"kvcache HiCache backend: {fmt.page_bytes}-byte pages of {fmt.page_tokens} tokens "
            f"do not split into {fmt.dtype} K|V halves; start the node with a --layout for them"
        )
    return KVLayout(
        model=f"sglang:{model or 'unnamed'}",
        num_layers=1,
        kv_heads=1,
        head_dim=fmt.page_bytes // per_token,
        dtype=fmt.dtype,
        block_tokens=fmt.page_tokens,
    )


def choose_namespace(
    infos: Mapping[str, NamespaceInfo], fmt: PageFormat, model: str, wanted: str | None
) -> str:
    """The node layout this engine's pages go to: its page size and dtype must be the pool's;
    among several, the one named for the model. ``ValueError`` says what to configure."""

    def fits(info: NamespaceInfo) -> str:
        if info.page_bytes != fmt.page_bytes:
            return f"its pages are {info.page_bytes} bytes, the host pool's {fmt.page_bytes}"
        if not dtype_fits(fmt, info):
            return f"its dtype is {info.layout.dtype}, the host pool's {fmt.dtype}"
        return ""

    if wanted:
        if wanted not in infos:
            raise ValueError(
                f"kvcache HiCache backend: the node serves no namespace {wanted!r} "
                f"(it serves: {', '.join(infos)})"
            )
        why = fits(infos[wanted])
        if why:
            raise ValueError(f"kvcache HiCache backend: namespace {wanted!r} does not fit: {why}")
        if not _same_model(model, infos[wanted].layout.model):
            log.warning(
                "kvcache HiCache backend: namespace %s is for model %s, this engine serves %s "
                "(pages are keyed by model, so they are not mixed)",
                wanted,
                infos[wanted].layout.model,
                model or "?",
            )
        return wanted
    fitting = [ns for ns, info in infos.items() if not fits(info)]
    if len(fitting) > 1:
        named = [ns for ns in fitting if _same_model(model, infos[ns].layout.model)]
        fitting = named if len(named) == 1 else fitting
    if len(fitting) != 1:
        reasons = "; ".join(f"{ns}: {fits(info) or 'fits'}" for ns, info in infos.items())
        raise ValueError(
            f"kvcache HiCache backend: {len(fitting)} of the node's layouts fit the host pool "
            f"({fmt.page_bytes}-byte {fmt.dtype} pages) ({reasons}): "
            "name one with 'namespace' in the extra config"
        )
    return fitting[0]
