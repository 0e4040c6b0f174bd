"""What the vLLM connector runs with: its configuration, the kvcache layout of an engine's KV
cache (fp8, MLA, draft layers included), the models it refuses at start, the model's identity, and
what each worker tells the scheduler at start (``KVCacheHandshake``)."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from kvstore.layout import KVLayout

from .vllm_identity import model_fingerprint

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


TIMEOUT_ENV = "KVCACHE_CONNECTOR_TIMEOUT_MS"  # timeout_ms when the extra config has none
MIN_TIMEOUT_ENV = "KVCACHE_CONNECTOR_MIN_TIMEOUT_MS"  # min_timeout_ms, likewise
REMOTE_TIMEOUT_ENV = "KVCACHE_CONNECTOR_REMOTE_TIMEOUT_MS"  # remote_timeout_ms, likewise


@dataclass(frozen=True)
class ConnectorConfig:
    node: str
    token: str | None = None
    tls_ca_file: str | None = None
    block_tokens: int | None = None
    model: str | None = None
    salt: str = ""
    save: str = "prompt"
    lease_ttl_s: float = 30.0
    # Overlap the Allocate / Commit / Release round trips with the forward ("auto": when the KV
    # cache is on a GPU). A CPU engine's forward already keeps every core busy: a round trip in
    # the background stalls its threads' barriers (measured: 1.5x a cold prefill vs 1.1x).
    overlap: str | bool = "auto"
    # A node call on the engine's path waits this long at most; one that does not answer opens
    # the breaker (the connector does nothing until the node answers again, asked every retry_s).
    timeout_ms: float = 1000.0
    # ... and at least this long: between the two, the deadline follows how fast the node has
    # answered lately (vllm_guard.Latency), so a node that hangs costs the engine a fraction of
    # timeout_ms. min_timeout_ms >= timeout_ms: every call waits timeout_ms.
    min_timeout_ms: float = 200.0
    retry_s: float = 2.0
    model_fingerprint: str | None = None
    # The cluster's pool (clients.remote_pool): with ``conductor``, a prefix another node holds
    # more of is pulled into this engine's node by its messenger (``messenger``; default: the
    # one the node registered) while the request waits, then loaded. ``remote_timeout_ms``:
    # the deadline of the conductor's Locate on the scheduler's path; ``pull_timeout_s``: how
    # long a request waits for its pages before vLLM recomputes them.
    conductor: str | None = None
    messenger: str | None = None
    remote_timeout_ms: float = 100.0
    pull_timeout_s: float = 10.0
    # A pull is made when its wait is predicted at most this times the time computing its
    # tokens would add (both measured in the engine: clients.pull_gate); "inf": every pull.
    pull_max_cost: float = 1.0
    # vLLM's P/D flow: a prefill engine pins the pages a decode engine will pull from its node
    # this long (a read lease that lapses by itself), so that writers meanwhile cannot evict
    # them; 0: no pin.
    hold_for_decode_s: float = 30.0

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "ConnectorConfig":
        known = {f for f in cls.__dataclass_fields__} | {"token_file"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"kvcache connector: unknown kv_connector_extra_config keys "
                f"{unknown}; known: {sorted(known)}"
            )
        if not extra.get("node"):
            raise ValueError(
                "kvcache connector: kv_connector_extra_config needs 'node' "
                "(the kvcache node's host:port)"
            )
        values = dict(extra)
        if "timeout_ms" not in values and os.environ.get(TIMEOUT_ENV):
            # an engine launcher's default (a test machine under load, say)
            values["timeout_ms"] = float(os.environ[TIMEOUT_ENV])
        if "min_timeout_ms" not in values and os.environ.get(MIN_TIMEOUT_ENV):
            values["min_timeout_ms"] = float(os.environ[MIN_TIMEOUT_ENV])
        if "remote_timeout_ms" not in values and os.environ.get(REMOTE_TIMEOUT_ENV):
            values["remote_timeout_ms"] = float(os.environ[REMOTE_TIMEOUT_ENV])
        if values.get("token"):
            log.warning(
                "kvcache connector: 'token' in kv_connector_extra_config is printed in vLLM's "
                "start-up log; put the token in a file and name it with 'token_file'"
            )
        token_file = values.pop("token_file", None)
        if token_file:
            with open(token_file) as f:
                values["token"] = f.read().strip()
        if "pull_max_cost" in values:  # "inf" from JSON or TOML text
            try:
                values["pull_max_cost"] = float(values["pull_max_cost"])
            except (TypeError, ValueError):
                values["pull_max_cost"] = math.nan
        cfg = cls(**values)
        if cfg.overlap not in ("auto", True, False):
            raise ValueError(
                f"kvcache connector: overlap must be 'auto', true or false, got {cfg.overlap!r}"
            )
        if cfg.save not in ("prompt", "none"):
            raise ValueError(
                f"kvcache connector: save must be 'prompt' or 'none', got {cfg.save!r}"
            )
        if not 0 <= cfg.hold_for_decode_s < float("inf"):
            raise ValueError(
                "kvcache connector: hold_for_decode_s must be finite seconds >= 0, got "
                f"{cfg.hold_for_decode_s!r}"
            )
        if not cfg.pull_max_cost > 0:
            raise ValueError(
                "kvcache connector: pull_max_cost must be a number > 0 ('inf': pull whatever "
                f"it costs), got {extra['pull_max_cost']!r}"
            )
        if not cfg.timeout_ms > 0 or not cfg.min_timeout_ms > 0 or not cfg.retry_s > 0:
            raise ValueError(
                "kvcache connector: timeout_ms, min_timeout_ms and retry_s must be positive"
            )
        return cfg


_KV_DTYPES = {  # vLLM's kv_cache_dtype -> the layout's dtype (its item size is what counts)
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "fp8_inc": "float8_e4m3fn",
    "fp8_ds_mla": "uint8",
}


def vllm_layout(
    vllm_config: "VllmConfig",
    model: str,
    block_tokens: int,
    num_layers: int | None = None,
    token_bytes: int | None = None,
) -> KVLayout:
    """The kvcache layout of a vLLM model (of this rank): its KV layers (a draft model's layers
    for speculative decoding included), KV heads, head size and KV dtype, with
    ``block_tokens``-token blocks. ``token_bytes`` (one token of one layer, as vLLM allocates
    it): a cache that is not K|V of every head (MLA's latent cache) is laid out as K|V of one
    head of the size that fills it."""
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype or "auto")
    if cache_dtype == "auto":
        dtype = str(mc.dtype).removeprefix("torch.")
    else:
        dtype = _KV_DTYPES.get(cache_dtype, cache_dtype)
    layout = KVLayout(
        model=model,
        num_layers=num_layers or mc.get_num_layers(pc),
        kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(),
        dtype=dtype,
        block_tokens=block_tokens,
    )
    if token_bytes is None or layout.layer_bytes == token_bytes * block_tokens:
        return layout
    if token_bytes % (2 * layout.itemsize):
        raise ValueError(
            f"kvcache connector: one token of one KV layer is {token_bytes} bytes, not K|V "
            f"of {dtype}; not supported"
        )
    return KVLayout(
        model=model,
        num_layers=layout.num_layers,
        kv_heads=1,
        head_dim=token_bytes // (2 * layout.itemsize),
        dtype=dtype,
        block_tokens=block_tokens,
    )


@dataclass
class KVCacheHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What a worker tells the scheduler at start: its namespace, layout, page format, rank."""

    namespace: str
    layout: dict[str, Any]
    page_format: str
    rank: str


def refuse_unsupported(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> None:
    """Features whose KV the connector cannot store faithfully: a clear error at start, never a
    crash or silently wrong KV later."""
    pc = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(pc, name, 1) > 1:
            raise ValueError(f"kvcache connector: {name} > 1 is not supported")
    if kv_cache_config is None:
        return
    groups = kv_cache_config.kv_cache_groups
    features = sorted({_feature(g.kv_cache_spec) for g in groups} - {""})
    if features or len(groups) > 1:
        named = ", ".join(features) or f"{len(groups)} KV cache groups"
        raise ValueError(
            f"kvcache connector: the model has {named}, which the connector does not store "
            "(it keeps whole prompt prefixes of full-attention layers); run this model "
            "without it"
        )


def _feature(spec: Any) -> str:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    kind = type(spec).__name__
    if getattr(spec, "sliding_window", None):
        return "sliding-window attention"
    if getattr(spec, "attention_chunk_size", None):
        return "chunked local attention"
    if "Mamba" in kind or "SSM" in kind:
        return "Mamba (state-space) layers"
    if not isinstance(spec, FullAttentionSpec):
        return f"{kind} layers"
    return ""


def fingerprint(vllm_config: "VllmConfig") -> str:
    """The target model's identity, and the draft model's for speculative decoding (its KV
    layers are stored too)."""
    parts = [model_fingerprint(vllm_config.model_config)]
    spec = vllm_config.speculative_config
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft is not None and draft is not vllm_config.model_config:
        parts.append(model_fingerprint(draft))
    return "+".join(parts)


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """One layer's cache as ``[num_blocks, block bytes]`` uint8; its blocks may be strided (a
    cross-layer layout), each block's bytes are contiguous."""
    es = t.element_size()
    rows = torch.empty(0, dtype=torch.uint8, device=t.device)
    rows.set_(
        t.untyped_storage(),
        t.storage_offset() * es,
        (t.shape[0], t[0].numel() * es),
        (t.stride(0) * es, 1),
    )
    return rows


def backend_name(vllm_config: "VllmConfig", layer: str) -> str:
    ctx = vllm_config.compilation_config.static_forward_context
    module = ctx.get(layer)
    backend = getattr(module, "attn_backend", None)
    try:
        return str(backend.get_name()) if backend is not None else "unknown"
    except Exception:  # noqa: BLE001 - a backend without get_name
        return getattr(backend, "__name__", "unknown")


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "0"))


def served_name(vllm_config: "VllmConfig") -> str:
    name = vllm_config.model_config.served_model_name
    if isinstance(name, list):
        name = name[0]
    return str(name or vllm_config.model_config.model).rstrip("/").rsplit("/", 1)[-1]
