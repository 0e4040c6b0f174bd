"""Hugging Face transformers with the KV store: prefill only what is not cached.

Needs the optional extra ``hf`` (``pip install kvcache[hf]``). For one prompt:

1. look up the cached prefix on the node;
2. start loading it layer by layer (``TorchKVClient.load``) and put a ``DynamicCache`` in front of
   the model whose layers report the prefix length up front (so positions and masks are right)
   and take each layer's prefix the moment that layer runs: layer l+1 loads while layer l
   computes;
3. run the model on the uncached suffix only; each layer's new K/V goes to a layer-wise store as
   soon as it is computed; the full new blocks are published when the forward ends.

    model = LlamaForCausalLM(config)
    kv = connect_for_model("127.0.0.1:7000", model, model_name="llama-tiny", block_tokens=16)
    result = prefill_with_store(model, prompt_ids, kv)
    next_token = result.logits.argmax()

The store is a cache: if the node is lost or full, the adapter says so (a warning log and
``PrefillResult.notes``), recomputes what it could not load, and the output is the same.
Only models whose every layer is full attention are supported (no sliding window, no linear
attention): their K/V for a token depend only on the prefix, which is what a block key names.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

try:
    from transformers import DynamicCache, PreTrainedModel
    from transformers.cache_utils import DynamicLayer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("clients.hf_adapter needs transformers: pip install 'kvcache[hf]'") from e

from kvstore.layout import KVLayout

from .node_client import KVCacheRpcError
from .torch_client import (
    LayerwiseLoad,
    LayerwiseStore,
    LayoutMismatchError,
    LoadError,
    LoadProgress,
    TorchKVClient,
)
from .torch_layout import HFLayout

log = logging.getLogger(__name__)


def kv_layout_for(
    model: PreTrainedModel, model_name: str | None = None, block_tokens: int = 256
) -> KVLayout:
    """The KV page layout of ``model``'s cache; ``model_name`` names its weights (the namespace
    must change whenever the weights do: equal keys must mean equal K/V)."""
    cfg = model.config.get_text_config(decoder=True)
    name = model_name or getattr(cfg, "_name_or_path", "") or ""
    if not name:
        raise ValueError(
            "the model has no name (built from a config?): pass model_name=, which "
            "must identify its weights"
        )
    layer_types = getattr(cfg, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other or getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        raise ValueError(
            f"model {name} has non-full-attention layers ({other or 'sliding window'})"
            "; only full-attention models can load cached prefixes"
        )
    heads = cfg.num_attention_heads
    return KVLayout(
        model=name,
        num_layers=cfg.num_hidden_layers,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        dtype=str(model.dtype).removeprefix("torch."),
        block_tokens=block_tokens,
    )


def connect_for_model(
    address: str,
    model: PreTrainedModel,
    model_name: str | None = None,
    block_tokens: int = 256,
    token: str | None = None,
    use_shm: bool = True,
    lease_ttl_s: float = 0.0,
) -> TorchKVClient:
    """A ``TorchKVClient`` for ``model`` on the node at ``address``; ``LayoutMismatchError`` if
    the node does not serve the model's layout."""
    return TorchKVClient.connect(
        address,
        kv_layout_for(model, model_name, block_tokens),
        token=token,
        use_shm=use_shm,
        device=model.device,
        lease_ttl_s=lease_ttl_s,
    )


# transformers 4.56 initialises a cache layer from the keys alone; later ones take the values too.
_LAZY_INIT_TAKES_VALUES = len(inspect.signature(DynamicLayer.lazy_initialization).parameters) > 2


# NOTE: transformers' CacheLayerMixin.__init_subclass__ and __init__ are unannotated.
class StoreBackedLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """A ``DynamicLayer`` that reports a prefix before it is loaded, takes it from the load on
    its first ``update`` and hands that update's new K/V to the store; later updates (decode)
    behave exactly like ``DynamicLayer``."""

    def __init__(
        self,
        layer_idx: int,
        load: LayerwiseLoad | None,
        prefix_tokens: int,
        store: LayerwiseStore | None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._idx = layer_idx
        self._load = load
        self._prefix = prefix_tokens if load is not None else 0
        self._store = store

    def get_seq_length(self) -> int:
        if self._load is not None:
            return self._prefix
        return super().get_seq_length()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        store, self._store = self._store, None
        if store is not None:
            store.put_layer(self._idx, key_states, value_states)
        load, self._load = self._load, None
        if load is None:
            return super().update(key_states, value_states, *args, **kwargs)
        k, v = load.layer(self._idx)  # allocated with room for the suffix: no concatenation
        n, q = self._prefix, key_states.shape[-2]
        k, v = k[:, :, : n + q], v[:, :, : n + q]
        k[:, :, n:].copy_(key_states)
        v[:, :, n:].copy_(value_states)
        if _LAZY_INIT_TAKES_VALUES:
            self.lazy_initialization(key_states, value_states)
        else:
            self.lazy_initialization(key_states)  # type: ignore[call-arg]
        self.keys, self.values = k, v
        return k, v


@dataclass
class PrefillResult:
    logits: torch.Tensor  # next-token logits after the prompt, [vocab]
    cache: DynamicCache  # the prompt's KV cache, ready for decoding
    num_tokens: int
    cached_tokens: int  # prefix loaded from the store (not computed)
    stored_blocks: int  # new blocks published to the store
    load_wait_s: float = 0.0  # time the forward waited for loaded layers (not overlapped)
    store_copy_s: float = 0.0  # background time copying new layers into pages (overlapped)
    store_finish_s: float = 0.0  # time spent after the forward publishing them (not overlapped)
    notes: list[str] = field(default_factory=list)  # fallbacks taken, for the caller to log


def _as_ids(tokens: Any, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(tokens)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(
            f"one prompt at a time: token ids of shape [T] or [1, T], got {tuple(ids.shape)}"
        )
    ids = ids.to(device=device, dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("the prompt is empty")
    return ids


def _note(notes: list[str], message: str) -> None:
    log.warning("kvcache: %s", message)
    notes.append(message)


@torch.inference_mode()
def prefill_with_store(
    model: PreTrainedModel,
    tokens: Any,
    kv: TorchKVClient | None,
    on_progress: Callable[[LoadProgress], None] | None = None,
    load_cached: bool = True,
) -> PrefillResult:
    """Prefill ``tokens`` (one prompt) reusing and extending the store's cached prefix.

    ``kv=None`` is a plain prefill. ``on_progress(LoadProgress)`` is called from the loader
    thread as blocks arrive and layers finish loading.
    """
    ids = _as_ids(tokens, model.device)
    if kv is None:
        out = model(input_ids=ids[None], use_cache=True, logits_to_keep=1)
        return PrefillResult(out.logits[0, -1], out.past_key_values, ids.numel(), 0, 0)
    expected = kv_layout_for(model, kv.layout.model, kv.layout.block_tokens)
    if expected != kv.layout:
        raise LayoutMismatchError(
            f"the model's KV layout {expected.namespace} differs from the "
            f"client's {kv.layout.namespace}"
        )
    notes: list[str] = []
    total = ids.numel()
    req = kv.request(ids)
    bt = kv.layout.block_tokens

    hit = 0
    if load_cached and req.full_blocks:
        try:
            hit = kv.lookup(req)
        except KVCacheRpcError as e:
            _note(notes, f"lookup failed ({e}); computing the whole prompt")
    # NOTE: keep at least one token to compute: its logits are the output.
    want = min(hit, total - 1)
    load, n = None, 0
    if want > 0:
        try:
            load = kv.load(req, want, HFLayout(capacity=total), on_progress=on_progress)
            n = load.num_tokens
        except KVCacheRpcError as e:
            _note(notes, f"could not pin the cached prefix ({e}); computing the whole prompt")
        if load is not None and n < want:
            _note(
                notes,
                f"loaded {n} of {want} cached tokens "
                f"({load.error or 'blocks evicted since the lookup'}); recomputing "
                f"tokens {n}..{total}",
            )
        if load is not None and n == 0:
            load.close()
            load = None

    first = math.ceil(n / bt)
    store = None
    if first < req.full_blocks:
        try:
            store = kv.store(req, first, HFLayout(start=n))
        except KVCacheRpcError as e:
            _note(notes, f"not storing the new blocks ({e})")

    cache = DynamicCache(config=model.config)
    cache.layers = [StoreBackedLayer(l, load, n, store) for l in range(kv.layout.num_layers)]
    try:
        out = model(
            input_ids=ids[None, n:], past_key_values=cache, use_cache=True, logits_to_keep=1
        )
    except LoadError as e:
        if store is not None:
            store.abort()
        _note(notes, f"{e}; recomputing the whole prompt")
        retry = prefill_with_store(model, ids, kv, on_progress, load_cached=False)
        retry.notes[:0] = notes
        return retry
    except BaseException:
        if store is not None:
            store.abort()
        raise
    finally:
        if load is not None:
            load.close()

    stored = 0
    if store is not None:
        try:
            stored = store.finish().stored
        except KVCacheRpcError as e:
            _note(
                notes, f"storing {store.blocks} new blocks failed ({e}); the output is unaffected"
            )
    return PrefillResult(
        out.logits[0, -1],
        cache,
        total,
        n,
        stored,
        load.wait_s if load is not None else 0.0,
        store.copy_s if store is not None else 0.0,
        store.finish_s if store is not None else 0.0,
        notes,
    )


@torch.inference_mode()
def greedy_generate(
    model: PreTrainedModel, tokens: Any, max_new_tokens: int, kv: TorchKVClient | None = None
) -> tuple[torch.Tensor, PrefillResult]:
    """Greedy decoding after a (store-backed) prefill; returns the new token ids and the
    prefill's result."""
    if max_new_tokens <= 0:
        raise ValueError("max_new_tokens must be positive")
    first = prefill_with_store(model, tokens, kv)
    cache = first.cache
    out = [first.logits.argmax()]
    for _ in range(max_new_tokens - 1):
        logits = model(input_ids=out[-1].view(1, 1), past_key_values=cache, use_cache=True).logits
        out.append(logits[0, -1].argmax())
    return torch.stack(out), first


__all__ = [
    "LoadProgress",
    "PrefillResult",
    "StoreBackedLayer",
    "connect_for_model",
    "greedy_generate",
    "kv_layout_for",
    "prefill_with_store",
]
