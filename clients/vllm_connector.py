"""A vLLM v1 KV connector backed by a kvcache node: prefixes computed by one engine are loaded by
any other engine of the same model, weights and page format that shares the node.

    LLM(model=..., kv_transfer_config={
        "kv_connector": "KVCacheConnector",
        "kv_connector_module_path": "clients.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"node": "127.0.0.1:7000", "block_tokens": 256}})

Blocks and keys. Our block is ``block_tokens`` prompt tokens (a multiple of vLLM's
``block_size``); its key is the token chain every kvcache client uses (``kvstore.keys``), rooted
in the layout's namespace and a salt that holds what else the KV depends on: the model's
weights, the page byte format, vLLM's ``cache_salt``, the LoRA adapter, multimodal inputs
(``clients.vllm_identity``; docs/api.md). Requests with prompt embeddings are not cached. One
page holds one block for every layer, layer-major; a layer's slice holds the ``block_tokens /
block_size`` vLLM blocks of that layer back to back, copied as opaque bytes. Each rank of a
tensor- or pipeline-parallel engine stores its own share under keys of its own.

Scheduler side: one ``Lookup`` per new request (not per block; all ranks' keys in one call) says
how many leading blocks every rank holds; the connector offers vLLM the part beyond its own
prefix cache, aligned to vLLM's block size, and never the last prompt token (vLLM must compute
it). Preempted requests get the same offer when they resume. Worker side, once per step
(``clients.vllm_transfer``): one ``Acquire`` pins every block to load, then one ``Allocate``
leases pages for every block to save; each layer's blocks are copied from shared memory just
before that layer's attention and into shared memory as the layer completes; ``wait_for_save``
commits and releases. A step in which a load failed commits nothing. With ``overlap`` (the default
on GPUs) the Allocate is waited for at the first layer's save and the Commit and Release are sent
without waiting. Without shared memory (the node on another host) pages travel over the
streamed Get/Put instead.

A block that cannot be loaded (gone, corrupt on SSD, node down) is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes it (the connector sets vLLM's
``kv_load_failure_policy`` to ``"recompute"``). Every node call has a short deadline
(``timeout_ms``); a node that does not answer opens a breaker that makes the connector a no-op
until it answers again (``clients.vllm_guard``).

``kv_role``: ``kv_both`` loads and stores, ``kv_producer`` (a prefill engine of a disaggregated
deployment) only stores, ``kv_consumer`` (a decode engine) only loads.

Extra config (``kv_connector_extra_config``): ``node`` (address, required), ``token`` or
``token_file`` (bearer token; its tenant scopes every key), ``tls_ca_file``, ``block_tokens``
(default: the node's layout for this model when it serves one, else 256), ``model`` (the
layout's model name; default vLLM's served model name), ``salt``, ``save`` (``"prompt"``: save
full prompt blocks, the default; ``"none"``: load only), ``lease_ttl_s``, ``overlap``
(``"auto"``, true, false), ``timeout_ms`` (deadline of every node call, default 500; streamed
pages get 10 ms more per MB), ``retry_s`` (how often a node that stopped answering is asked
again, default 2), ``model_fingerprint`` (the weights' identity, instead of sampling the weight
files).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.keys import root_key
from kvstore.layout import KVLayout

from .node_client import KVCacheRpcError, KVStoreClient
from .vllm_guard import NodeGuard
from .vllm_identity import (
    engine_salt,
    model_fingerprint,
    page_format,
    rank_keys,
    rank_tag,
    request_keys,
    request_salt,
)
from .vllm_stats import (
    STATS,
    ConnectorStats,
    KVCacheConnectorPromMetrics,
    KVCacheConnectorStats,
    delta,
    snapshot,
)
from .vllm_transfer import (
    KVCacheConnectorMetadata,
    _RowMap,
    _Step,
    _Transfer,
    _word_for,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "STATS",
    "ConnectorConfig",
    "ConnectorStats",
    "KVCacheConnector",
    "KVCacheConnectorMetadata",
    "_RowMap",
    "_word_for",
]

log = logging.getLogger(__name__)


# ---- configuration ------------------------------------------------------------------------------


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
    timeout_ms: float = 500.0
    retry_s: float = 2.0
    model_fingerprint: str | None = None

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
        token_file = values.pop("token_file", None)
        if token_file:
            with open(token_file) as f:
                values["token"] = f.read().strip()
        cfg = cls(**values)
        if cfg.overlap not in ("auto", True, False):
            raise ValueError(
                f"kvcache connector: overlap must be 'auto', true or false, got {cfg.overlap!r}"
            )
        if cfg.save not in ("prompt", "none"):
            raise ValueError(
                f"kvcache connector: save must be 'prompt' or 'none', got {cfg.save!r}"
            )
        if not cfg.timeout_ms > 0 or not cfg.retry_s > 0:
            raise ValueError("kvcache connector: timeout_ms and retry_s must be positive")
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


@dataclass
class _Rank:
    namespace: str
    layout: KVLayout
    tag: str


@dataclass
class _Request:
    tokens: list[int]
    keys: list[bytes]
    salt: bytes = b""
    block_ids: list[int] = field(default_factory=list)
    saved_pages: int = 0
    load: tuple[int, int] | None = None  # (first token, end token) offered to vLLM


class KVCacheConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_extra(
            dict(self._kv_transfer_config.kv_connector_extra_config or {})
        )
        _refuse_unsupported(vllm_config, kv_cache_config)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # A cache must never fail a request: a block it cannot load is recomputed.
            log.warning(
                "kvcache connector: kv_load_failure_policy %r set to 'recompute'",
                self._kv_transfer_config.kv_load_failure_policy,
            )
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        # kv_role: a kv_producer (prefill engine) only stores, a kv_consumer (decode engine)
        # only loads, kv_both does both.
        self.loads = bool(self._kv_transfer_config.is_kv_consumer)
        self.saves = bool(self._kv_transfer_config.is_kv_producer) and self.config.save != "none"
        self.vblock_tokens = vllm_config.cache_config.block_size
        self.client = KVStoreClient(
            self.config.node,
            token=self.config.token,
            tls_ca_file=self.config.tls_ca_file,
            timeout_s=self.config.timeout_ms / 1000,
        )
        self.guard = NodeGuard(
            self.client, self.config.retry_s, self.config.token, self.config.tls_ca_file
        )
        self.model_name = self.config.model or _served_name(vllm_config)
        self.stats = ConnectorStats()
        self._reported: dict[str, Any] = {}
        self._lock = threading.Lock()
        # layout of this worker's rank; on the scheduler side, rank 0's (set at the handshake)
        self.layout: KVLayout | None = None
        self.namespace = ""
        self.ratio = 0
        # scheduler side
        self._reqs: dict[str, _Request] = {}
        self._ranks: list[_Rank] | None = None
        self._epoch = b""
        self._engine_salt = b""
        self._fingerprint = ""
        if role == KVConnectorRole.SCHEDULER:
            self._fingerprint = self.config.model_fingerprint or _fingerprint(vllm_config)
        # worker side
        self.rank = ""
        self._handshake: KVCacheHandshake | None = None
        self._layer_index: dict[str, int] = {}
        # per layer: [num_blocks, vblock_bytes / word size] of self._word
        self._layers: list[torch.Tensor] = []
        self._word = torch.uint8
        self.overlap = False  # see ConnectorConfig.overlap; decided when the caches register
        self._on_gpu = False
        self._step: _Step | None = None
        self._step_of: KVConnectorMetadata | None = None  # the metadata _step was made for
        self._load_errors: set[int] = set()
        self._tainted = 0  # steps whose saves are dropped after a failed load
        self._hook_s = 0.0
        # Commits and releases sent without waiting; their outcomes are logged when collected.
        self._inflight: list[tuple[str, Future[Any]]] = []
        if role == KVConnectorRole.WORKER:
            atexit.register(self._collect, True)  # an engine that exits without shutdown()
        log.info("kvcache connector (%s) on node %s", role.name, self.config.node)

    # ---- what vLLM asks of a connector class ----------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # The per-layer hooks must run between graph pieces: a full CUDA graph replay skips
        # them (and on a GPU every layer is also loaded in start_load_kv, before the forward).
        return True

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVCacheConnectorStats | None:
        return KVCacheConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVCacheConnectorPromMetrics:
        return KVCacheConnectorPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def bulk_timeout(self, nbytes: int) -> float:
        """The deadline of a streamed Get / Put of ``nbytes``: the call's, plus 100 MB/s."""
        return self.client.timeout_s + nbytes / 100e6

    def get_kv_connector_stats(self) -> KVCacheConnectorStats | None:
        """This connector's counters since the last call (also added to ``STATS``)."""
        s = self.stats
        s.breaker_trips, s.breaker_skipped = self.guard.trips, self.guard.skipped
        s.breaker_open = int(self.guard.is_open)
        d = delta(s, self._reported)
        self._reported = snapshot(s)
        for k, v in d.items():
            if k != "breaker_open":
                setattr(STATS, k, getattr(STATS, k) + v)
        STATS.breaker_open = d["breaker_open"]
        return KVCacheConnectorStats(data=d)

    # ==== scheduler side ==========================================================================

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, r): m for r, m in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Every worker's namespace, layout, page format and rank: the keys the scheduler asks
        the node about are what every rank holds."""
        infos = [m for _, m in sorted(metadata.items()) if isinstance(m, KVCacheHandshake)]
        if not infos:
            return
        ranks = [_Rank(m.namespace, KVLayout(**m.layout), m.rank) for m in infos]
        tokens = {r.layout.block_tokens for r in ranks}
        if len(tokens) != 1:
            raise ValueError(
                f"kvcache connector: ranks resolved different block_tokens {sorted(tokens)}; "
                "set block_tokens in kv_connector_extra_config"
            )
        self._ranks = ranks
        self.layout, self.namespace = ranks[0].layout, ranks[0].namespace
        self.ratio = self.layout.block_tokens // self.vblock_tokens
        self._formats = [m.page_format for m in infos]
        self._engine_salt = engine_salt(
            self.config.salt, self._fingerprint, self._formats, self._epoch
        )
        log.info(
            "kvcache connector: %d rank(s), namespace %s, %d vLLM blocks per page",
            len(ranks),
            self.namespace,
            self.ratio,
        )

    def reset_cache(self) -> bool:
        """Nothing stored before can be loaded by this engine any more: its keys move to a new
        epoch (weights updated in place, say). Other engines keep theirs."""
        self._epoch = os.urandom(8)
        if self._ranks is not None:
            self._engine_salt = engine_salt(
                self.config.salt, self._fingerprint, self._formats, self._epoch
            )
        self.stats.resets += 1
        log.info("kvcache connector: cache reset (new key epoch)")
        return True

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int, bool]:
        st = self._request(request)  # a producer needs it too: it plans the saves
        if st is None or not st.keys or not self.loads:
            return 0, False
        t0 = time.perf_counter()
        try:
            hit = self._lookup(st.keys)
        except KVCacheRpcError as e:
            log.debug("kvcache lookup failed (%s); computing the prompt in full", e)
            return 0, False
        self.stats.lookups += 1
        self.stats.lookup_s += time.perf_counter() - t0
        assert self.layout is not None
        # vLLM must compute at least the last prompt token; offers are whole vLLM blocks.
        last = (len(st.tokens) - 1) // self.vblock_tokens * self.vblock_tokens
        end = min(hit * self.layout.block_tokens, last)
        if end <= num_computed_tokens:
            st.load = None
            return 0, False
        st.load = (num_computed_tokens, end)
        return end - num_computed_tokens, False

    def _lookup(self, keys: list[bytes]) -> int:
        """Leading pages every rank holds: per namespace one Lookup of the ranks' keys
        interleaved (page 0 of every rank, then page 1, ...), so its hit counts whole pages."""
        assert self._ranks is not None
        hit = len(keys)
        for ns in dict.fromkeys(r.namespace for r in self._ranks):
            tags = [r.tag for r in self._ranks if r.namespace == ns]
            per_rank = [rank_keys(keys, t) for t in tags]
            mixed = [k for page in zip(*per_rank) for k in page]
            got = self.guard.call(functools.partial(self.client.lookup, ns, keys=mixed))
            hit = min(hit, got.hit_blocks // len(tags))
        return hit

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens == 0:
            st.load = None
        elif st.load is not None:  # what vLLM took of the offer
            st.load = (st.load[0], st.load[0] + num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVCacheConnectorMetadata:
        meta = KVCacheConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan_load(meta, new.req_id, st)
            self._plan_save(meta, new.req_id, st, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed:  # preempted: its blocks were freed, these are all of them
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            computed = cached.num_computed_tokens[i]
            if self.layout is not None and computed < st.saved_pages * self.layout.block_tokens:
                # A load failed and vLLM recomputes from there: save what it recomputes.
                st.saved_pages = computed // self.layout.block_tokens
            if resumed and self._plan_load(meta, req_id, st):
                self.stats.resumed_loads += 1
            self._plan_save(meta, req_id, st, computed + scheduled.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            self._reqs.pop(req_id, None)
        return meta

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Finished: forgotten. A caller that asks (``kv_transfer_params: {"kvcache_keys":
        true}``, the router) learns the namespace and salt of the request's keys, and the
        engine's salt (that of requests without cache_salt, LoRA or multimodal inputs)."""
        st = self._reqs.pop(request.request_id, None)
        asked = request.kv_transfer_params or {}
        if st is None or not asked.get("kvcache_keys") or self._ranks is None:
            return False, None
        salts = {"salt": st.salt.hex(), "engine": self._engine_salt.hex()}
        # ranks: each rank's keys are the chain's derived with its tag (vllm_identity.rank_keys)
        ranks = [r.tag for r in self._ranks if r.tag]
        return False, {"kvcache": {"namespace": self.namespace, **salts, "ranks": ranks}}

    def _request(self, request: "Request") -> _Request | None:
        st = self._reqs.get(request.request_id)
        if st is None and self._ranks is not None and self.layout is not None:
            tokens = list(request.prompt_token_ids or [])
            salt = request_salt(self._engine_salt, request)
            keys: list[bytes] = []
            if tokens and salt is not None:
                root = root_key(self.namespace, salt)
                mm = getattr(request, "mm_features", None)
                keys = list(request_keys(tokens, self.layout.block_tokens, root, mm))
            st = self._reqs[request.request_id] = _Request(tokens, keys, salt or b"")
        return st

    def _transfer(self, req_id: str, st: _Request, first_vblock: int, end_vblock: int) -> _Transfer:
        first_page = first_vblock // self.ratio
        end_page = -(-end_vblock // self.ratio)
        return _Transfer(
            req_id,
            st.keys[first_page:end_page],
            first_page,
            first_vblock,
            st.block_ids[first_vblock:end_vblock],
        )

    def _plan_load(self, meta: KVCacheConnectorMetadata, req_id: str, st: _Request) -> bool:
        """The load vLLM took (``update_state_after_alloc``), for a new or a resumed request."""
        load, st.load = st.load, None
        if load is None or load[1] <= load[0]:
            return False
        assert self.layout is not None
        first, end = load
        meta.loads.append(
            self._transfer(req_id, st, first // self.vblock_tokens, end // self.vblock_tokens)
        )
        # The last page loaded in part is on the node: it is not saved again.
        st.saved_pages = max(st.saved_pages, -(-end // self.layout.block_tokens))
        self.stats.hit_tokens += end - first
        return True

    def _plan_save(
        self, meta: KVCacheConnectorMetadata, req_id: str, st: _Request, computed: int
    ) -> None:
        """Save the request's prompt blocks completed by this step (full pages only). Not while
        the node does not answer: they are saved once it does (the request holds its blocks)."""
        if not self.saves or not st.keys or self.layout is None or self.guard.is_open:
            return
        done = min(computed, len(st.tokens)) // self.layout.block_tokens
        done = min(done, len(st.block_ids) // self.ratio, len(st.keys))
        if done > st.saved_pages:
            meta.saves.append(
                self._transfer(req_id, st, st.saved_pages * self.ratio, done * self.ratio)
            )
            st.saved_pages = done

    # ==== worker side =============================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Every KV layer of this rank (a draft model's included); each block's bytes must be
        contiguous, the same size in every layer."""
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        pc = self._vllm_config.parallel_config
        self.rank = rank_tag(
            get_tp_group().rank_in_group,
            pc.tensor_parallel_size,
            get_pp_group().rank_in_group,
            pc.pipeline_parallel_size,
        )
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        first = next(iter(kv_caches.values()))
        shapes = {
            (t.shape[0], t[0].numel() * t.element_size(), t.dtype) for t in kv_caches.values()
        }
        if len(shapes) != 1 or not all(t[0].is_contiguous() for t in kv_caches.values()):
            raise ValueError(
                "kvcache connector: the KV layers differ in block size or dtype, or a block's "
                f"bytes are not contiguous ({sorted(map(str, shapes))}); not supported"
            )
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        if num_blocks is not None and first.shape[0] != num_blocks:
            raise ValueError(
                f"kvcache connector: a KV layer's first dimension is {first.shape[0]}, not the "
                f"{num_blocks} blocks vLLM allocated; this KV cache layout is not supported"
            )
        layers = [_rows_of(t) for t in kv_caches.values()]
        vblock_bytes = layers[0].shape[1]
        self.layout = self._resolve_layout(len(layers), vblock_bytes)
        self.namespace = self.layout.namespace
        if self.layout.block_tokens % self.vblock_tokens:
            raise ValueError(
                f"kvcache connector: block_tokens {self.layout.block_tokens} is not "
                f"a multiple of vLLM's block_size {self.vblock_tokens}"
            )
        self.ratio = self.layout.block_tokens // self.vblock_tokens
        if vblock_bytes * self.ratio != self.layout.layer_bytes:
            raise ValueError(
                f"kvcache connector: a vLLM block of one layer is {vblock_bytes} bytes; "
                f"{self.ratio} of them ({self.layout.block_tokens} tokens) should fill a "
                f"{self.layout.layer_bytes}-byte layer slice of {self.namespace}"
            )
        # Rows are copied as the widest word that tiles them: torch's row gather / scatter
        # costs per element, so 8-byte words copy ~6x faster than bytes.
        self._word = _word_for(vblock_bytes, [t.data_ptr() for t in layers])
        self._on_gpu = first.device.type != "cpu"
        self.overlap = self._on_gpu if self.config.overlap == "auto" else bool(self.config.overlap)
        self._layers = [t.view(self._word) for t in layers]
        fmt = page_format(
            _vllm_version(),
            first.device.type,
            _backend_name(self._vllm_config, next(iter(kv_caches))),
            str(first.dtype).removeprefix("torch."),
            str(self._vllm_config.cache_config.cache_dtype),
            tuple(first.shape[1:]),
        )
        self._handshake = KVCacheHandshake(self.namespace, self.layout.to_dict(), fmt, self.rank)
        log.info(
            "kvcache connector rank %r: namespace %s, %d vLLM blocks per page, format %s",
            self.rank or "0",
            self.namespace,
            self.ratio,
            fmt,
        )

    def get_handshake_metadata(self) -> KVCacheHandshake | None:
        return self._handshake

    def _resolve_layout(self, num_layers: int, vblock_bytes: int) -> KVLayout:
        """This rank's layout; its block size from the config, else from a layout the node
        serves for it, else 256 tokens. A node that answers must serve the result; one that
        does not is a cache miss until it does (the engine serves all the same)."""
        cfg = self._vllm_config
        block_tokens = self.config.block_tokens
        token_bytes = vblock_bytes // self.vblock_tokens  # one token of one layer

        def layout(bt: int) -> KVLayout:
            return vllm_layout(cfg, self.model_name, bt, num_layers, token_bytes)

        try:
            served = self.guard.call(
                lambda: {ns: self.client.layout(ns) for ns in self.client.namespaces()}
            )
        except KVCacheRpcError as e:
            out = layout(block_tokens or 256)
            log.warning(
                "kvcache node %s does not answer (%s); computing every prompt until it "
                "does (namespace %s)",
                self.config.node,
                e,
                out.namespace,
            )
            return out
        if block_tokens is None:
            probe = layout(self.vblock_tokens)
            same = [
                x
                for x in served.values()
                if x.namespace.rsplit("|", 1)[0] == probe.namespace.rsplit("|", 1)[0]
            ]
            block_tokens = same[0].block_tokens if same else 256
        out = layout(block_tokens)
        if out.namespace not in served:
            raise ValueError(
                f"kvcache connector: node {self.config.node} does not serve {out.namespace}; "
                f"start it with --layout model={out.model},num_layers={out.num_layers},"
                f"kv_heads={out.kv_heads},head_dim={out.head_dim},dtype={out.dtype},"
                f"block_tokens={out.block_tokens} (it serves: {', '.join(served) or 'none'})"
            )
        return out

    # NOTE: vLLM calls start_load_kv before the forward only for steps with synchronous loads,
    # otherwise after it; so whichever hook of a step comes first takes the step's leases.
    # bind_connector_metadata comes before the forward in every vLLM runner.

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._layers:  # worker side, caches registered
            t0 = time.perf_counter()
            self._current_step()
            self._hook_s += time.perf_counter() - t0

    def _current_step(self) -> "_Step | None":
        bound = self._get_connector_metadata()
        assert isinstance(bound, KVCacheConnectorMetadata)
        if not bound.loads and not bound.saves:
            return None
        if self._step is None or self._step_of is not bound:
            meta = bound
            if self._tainted and meta.saves:
                # planned before vLLM learned of a failed load: what it saves may be wrong
                self.stats.saves_dropped += sum(len(t.keys) for t in meta.saves)
                meta = KVCacheConnectorMetadata(loads=meta.loads)
            self._step, self._step_of = _Step(self, meta), bound
        return self._step

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        t0 = time.perf_counter()
        step = self._current_step()
        if step is not None and self._on_gpu:
            # Every layer now: a CUDA graph replay would not call wait_for_layer_load.
            step.load_all()
        self._hook_s += time.perf_counter() - t0

    def wait_for_layer_load(self, layer_name: str) -> None:
        t0 = time.perf_counter()
        step = self._current_step()
        if step is not None:
            step.load_layer(self._layer_index[layer_name])
        self._hook_s += time.perf_counter() - t0

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: "AttentionMetadata",
        **kwargs: Any,
    ) -> None:
        t0 = time.perf_counter()
        step = self._current_step()
        if step is not None:
            step.save_layer(self._layer_index[layer_name])
        self._hook_s += time.perf_counter() - t0

    def wait_for_save(self) -> None:
        t0 = time.perf_counter()
        step, self._step, self._step_of = self._step, None, None
        if step is not None:
            step.finish()
        self._collect(wait=False)
        if step is not None and step.load_failed:
            # With overlapping batches (async scheduling, PP) the next steps were planned
            # before vLLM learned of the failure: their saves are dropped too.
            self._tainted = max(0, self._vllm_config.max_concurrent_batches - 1)
        elif self._tainted:
            self._tainted -= 1
        if step is not None:
            self.stats.steps += 1
            self.stats.step_s += self._hook_s + time.perf_counter() - t0
        self._hook_s = 0.0

    def _send(self, what: str, pending: Future[Any]) -> None:
        self._inflight.append((what, pending))

    def _collect(self, wait: bool) -> None:
        """Log the outcome of the commits and releases that finished (all of them if ``wait``)."""
        keep: list[tuple[str, Future[Any]]] = []
        for what, pending in self._inflight:
            if not wait and not pending.done():
                keep.append((what, pending))
                continue
            try:
                self.guard.result(pending, self.client.timeout_s + 1)
            except KVCacheRpcError as e:  # a cache: a lost commit only costs a future hit
                log.warning("kvcache %s failed (%s)", what, e)
            except Exception as e:  # noqa: BLE001 - e.g. the channel closed at exit
                log.info("kvcache %s not confirmed (%s)", what, e)
        self._inflight = keep

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def _failed(self, vblocks: list[int]) -> None:
        with self._lock:
            self._load_errors.update(vblocks)

    def shutdown(self) -> None:
        step, self._step = self._step, None
        if step is not None:
            step.abort()
        self._collect(wait=True)
        self.guard.close()
        self.client.close()


# ---- what vLLM runs with ------------------------------------------------------------------------


def _refuse_unsupported(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> None:
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


def _fingerprint(vllm_config: "VllmConfig") -> str:
    """The target model's identity, and the draft model's for speculative decoding (its KV
    layers are stored too)."""
    parts = [model_fingerprint(vllm_config.model_config)]
    spec = vllm_config.speculative_config
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft is not None and draft is not vllm_config.model_config:
        parts.append(model_fingerprint(draft))
    return "+".join(parts)


def _rows_of(t: torch.Tensor) -> torch.Tensor:
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


def _backend_name(vllm_config: "VllmConfig", layer: str) -> str:
    ctx = vllm_config.compilation_config.static_forward_context
    module = ctx.get(layer)
    backend = getattr(module, "attn_backend", None)
    try:
        return str(backend.get_name()) if backend is not None else "unknown"
    except Exception:  # noqa: BLE001 - a backend without get_name
        return getattr(backend, "__name__", "unknown")


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "0"))


def _served_name(vllm_config: "VllmConfig") -> str:
    name = vllm_config.model_config.served_model_name
    if isinstance(name, list):
        name = name[0]
    return str(name or vllm_config.model_config.model).rstrip("/").rsplit("/", 1)[-1]
