"""A vLLM v1 KV connector backed by a kvcache node: prefixes computed by one engine are loaded by
any other engine (or the torch client) that shares the node.

    LLM(model=..., kv_transfer_config={
        "kv_connector": "KVCacheConnector",
        "kv_connector_module_path": "clients.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"node": "127.0.0.1:7000", "block_tokens": 256}})

Blocks and keys. Our block is ``block_tokens`` prompt tokens (a multiple of vLLM's
``block_size``); its key is the token chain every kvcache client uses
(``kvstore.keys.block_keys`` rooted in the layout's namespace and the salt; docs/api.md). One page
holds one block for every layer, layer-major; a layer's slice holds the ``block_tokens /
block_size`` vLLM blocks of that layer back to back, copied as opaque bytes (vLLM's CPU and GPU
backends lay a block out differently, so pages written here are read back by vLLM engines of the
same backend; the keys, and so hits and routing, are shared with every client of the namespace).

Scheduler side: one ``Lookup`` per new request (not per block) says how many leading blocks the
node holds; the connector offers vLLM the part beyond its own prefix cache, aligned to vLLM's
block size, and never the last prompt token (vLLM must compute it). Worker side, once per step:
one ``Acquire`` pins every block to load and one ``Allocate`` leases pages for every block to
save; each layer's blocks are copied from shared memory just before that layer's attention
(``wait_for_layer_load``) and into shared memory as the layer completes (``save_kv_layer``);
``wait_for_save`` commits and releases. With ``overlap`` (the default on GPUs) only the Acquire
is waited for up front: the Allocate is sent when vLLM binds the step's metadata and waited for at
the first layer's save, and the Commit and Release are sent without waiting (their results are
collected at later steps and at shutdown), so those round trips overlap the forward. A CPU engine
makes them between its layers instead (see ``ConnectorConfig.overlap``). Without shared memory
(the node on another host) pages travel over the streamed Get/Put instead.

A block that cannot be loaded (gone, corrupt on SSD, node down) is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes it: set ``kv_load_failure_policy`` to
``"recompute"`` (vLLM's default ``"fail"`` fails such requests instead).

``kv_role``: ``kv_both`` loads and stores, ``kv_producer`` (a prefill engine of a disaggregated
deployment) only stores, ``kv_consumer`` (a decode engine) only loads.

Extra config (``kv_connector_extra_config``): ``node`` (address, required), ``token`` or
``token_file`` (bearer token; its tenant scopes every key), ``tls_ca_file``, ``block_tokens``
(default: the node's layout for this model when it serves one, else 256), ``model`` (the layout's
model name; default vLLM's served model name), ``salt``, ``save`` (``"prompt"``: save full prompt
blocks, the default; ``"none"``: load only), ``lease_ttl_s``, ``overlap`` (``"auto"``, true, false).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.keys import block_keys, root_key
from kvstore.layout import KVLayout

from .node_client import KVCacheRpcError, KVStoreClient, ReadLease, WriteLease

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

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
        return cfg


def vllm_layout(vllm_config: "VllmConfig", model: str, block_tokens: int) -> KVLayout:
    """The kvcache layout of a vLLM model: its layers, KV heads, head size and KV dtype, with
    ``block_tokens``-token blocks."""
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = mc.dtype if cache_dtype in ("auto", None) else cache_dtype
    return KVLayout(
        model=model,
        num_layers=mc.get_num_layers(pc),
        kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(),
        dtype=str(dtype).removeprefix("torch."),
        block_tokens=block_tokens,
    )


# ---- what the scheduler tells the workers each step ---------------------------------------------


@dataclass
class _Transfer:
    """Pages ``first_page ..`` of one request and the vLLM blocks they map to.

    ``vblocks[i]`` is the vLLM block id of the request's vLLM block ``first_vblock + i``; page
    ``p`` covers request vLLM blocks ``[p * ratio, (p + 1) * ratio)``."""

    req_id: str
    keys: list[bytes]
    first_page: int
    first_vblock: int
    vblocks: list[int]


@dataclass
class KVCacheConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


@dataclass
class _Request:
    tokens: list[int]
    keys: list[bytes]
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
        # kv_role: a kv_producer (prefill engine) only stores, a kv_consumer (decode engine)
        # only loads, kv_both does both.
        self.loads = bool(self._kv_transfer_config.is_kv_consumer)
        self.saves = bool(self._kv_transfer_config.is_kv_producer) and self.config.save != "none"
        self.vblock_tokens = vllm_config.cache_config.block_size
        self.client = KVStoreClient(
            self.config.node, token=self.config.token, tls_ca_file=self.config.tls_ca_file
        )
        self._lookup_failing = False
        model = self.config.model or _served_name(vllm_config)
        tp = vllm_config.parallel_config.tensor_parallel_size
        if tp > 1:  # each worker holds its own share of the KV heads: a namespace per shard
            model = f"{model}.tp{tp}r{_tp_rank() if role == KVConnectorRole.WORKER else 0}"
        self.layout = self._resolve_layout(vllm_config, model)
        self.namespace = self.layout.namespace
        if self.layout.block_tokens % self.vblock_tokens:
            raise ValueError(
                f"kvcache connector: block_tokens {self.layout.block_tokens} is not "
                f"a multiple of vLLM's block_size {self.vblock_tokens}"
            )
        self.ratio = self.layout.block_tokens // self.vblock_tokens
        self.root = root_key(self.namespace, self.config.salt)
        # scheduler side
        self._reqs: dict[str, _Request] = {}
        # worker side
        self._layer_index: dict[str, int] = {}
        # per layer: [num_blocks, vblock_bytes / word size] of self._word
        self._layers: list[torch.Tensor] = []
        self._word = torch.uint8
        self.overlap = False  # see ConnectorConfig.overlap; decided when the caches register
        self._step: _Step | None = None
        self._load_errors: set[int] = set()
        self._lock = threading.Lock()
        # Commits and releases sent without waiting; their outcomes are logged when collected.
        self._inflight: list[tuple[str, Future[Any]]] = []
        self.stats = STATS
        if role == KVConnectorRole.WORKER:
            atexit.register(self._collect, True)  # an engine that exits without shutdown()
        log.info(
            "kvcache connector (%s) on node %s, namespace %s, %d vLLM blocks per page",
            role.name,
            self.config.node,
            self.namespace,
            self.ratio,
        )

    def _resolve_layout(self, vllm_config: "VllmConfig", model: str) -> KVLayout:
        """The engine's layout; its block size from the config, else from a layout the node
        serves for this model, else 256 tokens. A node that answers must serve the result; one
        that does not is a cache miss until it does (the engine serves all the same)."""
        block_tokens = self.config.block_tokens
        try:
            served = {ns: self.client.layout(ns) for ns in self.client.namespaces()}
        except KVCacheRpcError as e:
            layout = vllm_layout(vllm_config, model, block_tokens or 256)
            log.warning(
                "kvcache node %s does not answer (%s); computing every prompt until it "
                "does (namespace %s)",
                self.config.node,
                e,
                layout.namespace,
            )
            self._lookup_failing = True
            return layout
        if block_tokens is None:
            probe = vllm_layout(vllm_config, model, self.vblock_tokens)
            same = [
                x
                for x in served.values()
                if x.namespace.rsplit("|", 1)[0] == probe.namespace.rsplit("|", 1)[0]
            ]
            block_tokens = same[0].block_tokens if same else 256
        layout = vllm_layout(vllm_config, model, block_tokens)
        if layout.namespace not in served:
            raise ValueError(
                f"kvcache connector: node {self.config.node} does not serve {layout.namespace}; "
                f"start it with --layout model={layout.model},num_layers={layout.num_layers},"
                f"kv_heads={layout.kv_heads},head_dim={layout.head_dim},dtype={layout.dtype},"
                f"block_tokens={layout.block_tokens} (it serves: {', '.join(served) or 'none'})"
            )
        return layout

    # ==== scheduler side ==========================================================================

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int, bool]:
        st = self._request(request)  # a producer needs it too: it plans the saves
        if not st.keys or not self.loads:
            return 0, False
        t0 = time.perf_counter()
        try:
            hit = self.client.lookup(self.namespace, keys=st.keys).hit_blocks
            self._lookup_failing = False
            self.stats.lookups += 1
            self.stats.lookup_s += time.perf_counter() - t0
        except KVCacheRpcError as e:
            if not self._lookup_failing:  # once per outage, not once per request
                log.warning("kvcache lookup failed (%s); computing prompts in full", e)
            self._lookup_failing = True
            return 0, False
        # vLLM must compute at least the last prompt token; offers are whole vLLM blocks.
        last = (len(st.tokens) - 1) // self.vblock_tokens * self.vblock_tokens
        end = min(hit * self.layout.block_tokens, last)
        if end <= num_computed_tokens:
            st.load = None
            return 0, False
        st.load = (num_computed_tokens, end)
        return end - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is not None and num_external_tokens == 0:
            st.load = None

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVCacheConnectorMetadata:
        meta = KVCacheConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            if st.load is not None:
                first, end = st.load
                meta.loads.append(
                    self._transfer(
                        new.req_id, st, first // self.vblock_tokens, end // self.vblock_tokens
                    )
                )
                st.saved_pages = max(st.saved_pages, end // self.layout.block_tokens)
                st.load = None
            self._plan_save(meta, new.req_id, st, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            computed = cached.num_computed_tokens[i]
            if computed < st.saved_pages * self.layout.block_tokens:
                # A load failed and vLLM recomputes from there: save what it recomputes.
                st.saved_pages = computed // self.layout.block_tokens
            self._plan_save(meta, req_id, st, computed + scheduled.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            self._reqs.pop(req_id, None)
        return meta

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        return False, None

    def _request(self, request: "Request") -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None:
            tokens = list(request.prompt_token_ids or [])
            keys = block_keys(tokens, self.layout.block_tokens, self.root) if tokens else []
            st = self._reqs[request.request_id] = _Request(tokens, list(keys))
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

    def _plan_save(
        self, meta: KVCacheConnectorMetadata, req_id: str, st: _Request, computed: int
    ) -> None:
        """Save the request's prompt blocks completed by this step (full pages only)."""
        if not self.saves:
            return
        done = min(computed, len(st.tokens)) // self.layout.block_tokens
        done = min(done, len(st.block_ids) // self.ratio)
        if done > st.saved_pages:
            meta.saves.append(
                self._transfer(req_id, st, st.saved_pages * self.ratio, done * self.ratio)
            )
            st.saved_pages = done

    # ==== worker side =============================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if len(kv_caches) != self.layout.num_layers:
            raise ValueError(
                f"kvcache connector: vLLM has {len(kv_caches)} KV layers, the "
                f"layout {self.namespace} {self.layout.num_layers}"
            )
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        layers = [t.view(torch.uint8).view(t.shape[0], -1) for t in kv_caches.values()]
        vblock_bytes = layers[0].shape[1]
        if vblock_bytes * self.ratio != self.layout.layer_bytes:
            raise ValueError(
                f"kvcache connector: a vLLM block of one layer is {vblock_bytes} bytes; "
                f"{self.ratio} of them ({self.layout.block_tokens} tokens) should fill a "
                f"{self.layout.layer_bytes}-byte layer slice of {self.namespace}"
            )
        # Rows are copied as the widest word that tiles them: torch's row gather / scatter
        # costs per element, so 8-byte words copy ~6x faster than bytes.
        self._word = _word_for(vblock_bytes, [t.data_ptr() for t in layers])
        auto = layers[0].device.type != "cpu"
        self.overlap = auto if self.config.overlap == "auto" else bool(self.config.overlap)
        self._layers = [t.view(self._word) for t in layers]

    # NOTE: vLLM calls start_load_kv before the forward only for steps with synchronous loads,
    # otherwise after it; so whichever hook of a step comes first takes the step's leases.
    # bind_connector_metadata comes before the forward in every vLLM runner.

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._layers:  # worker side, caches registered
            self._current_step()

    def _current_step(self) -> "_Step | None":
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVCacheConnectorMetadata)
        if not meta.loads and not meta.saves:
            return None
        if self._step is None or self._step.meta is not meta:
            self._step = _Step(self, meta)
        return self._step

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._current_step()

    def wait_for_layer_load(self, layer_name: str) -> None:
        step = self._current_step()
        if step is not None:
            step.load_layer(self._layer_index[layer_name])

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: "AttentionMetadata",
        **kwargs: Any,
    ) -> None:
        step = self._current_step()
        if step is not None:
            step.save_layer(self._layer_index[layer_name])

    def wait_for_save(self) -> None:
        step, self._step = self._step, None
        if step is not None:
            step.finish()
        self._collect(wait=False)

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
                pending.result(timeout=self.client.timeout_s + 1)
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
        self.client.close()


@dataclass
class ConnectorStats:
    """What the connectors of this process did and where their time went (seconds): the
    benchmark's breakdown of a hit. Shared by the scheduler and worker sides (``STATS``)."""

    lookups: int = 0
    lookup_s: float = 0.0
    loaded_pages: int = 0
    load_failed_blocks: int = 0
    saved_pages: int = 0
    acquire_s: float = 0.0  # Acquire / streamed Get of the pages to load
    allocate_s: float = 0.0  # waiting for the Allocate of the pages to save
    load_copy_s: float = 0.0  # shared memory -> vLLM blocks, all layers
    save_copy_s: float = 0.0  # vLLM blocks -> shared memory, all layers
    finish_s: float = 0.0  # sending Commit + Release (or the whole streamed Put)


STATS = ConnectorStats()


class _Pages:
    """Rows of ``vblock_bytes`` over page bytes: the node's shared memory, or a host buffer
    for the streamed path. ``rows(offsets, ...)`` indexes the rows of given pages and layer."""

    def __init__(self, data: np.ndarray, vblock_bytes: int, word: torch.dtype) -> None:
        usable = data.shape[0] // vblock_bytes * vblock_bytes
        rows = torch.from_numpy(data[:usable]).view(-1, vblock_bytes)
        # shm is page-aligned, numpy's buffers 16-byte aligned: both take any word up to 8 bytes
        assert rows.data_ptr() % word.itemsize == 0
        self.rows_view = rows.view(word)
        self.vblock_bytes = vblock_bytes


class _RowMap:
    """Which page row goes with which vLLM block. Runs consecutive on both sides (vLLM hands out
    free blocks in order, so a fresh prompt is mostly one run per page) copy as slices, i.e.
    memcpy; scattered rows go through one indexed gather / scatter."""

    def __init__(self, page_rows: list[int], vblocks: list[int]) -> None:
        p = np.asarray(page_rows, dtype=np.int64)
        b = np.asarray(vblocks, dtype=np.int64)
        self.count = len(p)
        cut = np.flatnonzero((np.diff(p) != 1) | (np.diff(b) != 1)) + 1
        starts = np.concatenate([[0], cut]) if self.count else np.zeros(0, np.int64)
        ends = np.concatenate([cut, [self.count]]) if self.count else starts
        self.runs = [(int(p[a]), int(b[a]), int(e - a)) for a, e in zip(starts, ends)]
        self.sliced = len(self.runs) <= max(8, self.count // 4)
        self.page_rows = torch.from_numpy(p)
        self.vblocks = torch.from_numpy(b)

    def to_blocks(self, rows: torch.Tensor, offset: int, blocks: torch.Tensor) -> None:
        if self.sliced:
            for pr, vb, n in self.runs:
                blocks[vb : vb + n].copy_(rows[offset + pr : offset + pr + n])
        else:
            blocks[self.vblocks] = rows[self.page_rows + offset]

    def to_pages(self, blocks: torch.Tensor, rows: torch.Tensor, offset: int) -> None:
        if self.sliced:
            for pr, vb, n in self.runs:
                rows[offset + pr : offset + pr + n].copy_(blocks[vb : vb + n])
        else:
            rows[self.page_rows + offset] = blocks[self.vblocks]


class _Step:
    """One engine step's loads and saves: leases taken up front (one RPC each), copies per layer,
    commit and release at the end."""

    def __init__(self, conn: KVCacheConnector, meta: KVCacheConnectorMetadata) -> None:
        self.conn = conn
        self.meta = meta
        layout = conn.layout
        self.vblock_bytes = layout.layer_bytes // conn.ratio
        self.layer_rows = layout.layer_bytes // self.vblock_bytes
        self.read: ReadLease | None = None
        self.write: WriteLease | None = None
        self.load_plan: tuple[_Pages, _RowMap] | None = None
        self.save_plan: tuple[_Pages, _RowMap] | None = None
        self.save_keys: list[bytes] = []
        self._slots: list[int] = []  # per saved key: its index among the unique keys, or -1
        self.saved_layers: set[int] = set()
        self.streamed_out: np.ndarray | None = None
        self._allocating: Future[WriteLease] | None = None
        self.saves: list[_Transfer] = []
        if meta.saves:
            self._start_saves(meta.saves)
        if meta.loads:
            self._start_loads(meta.loads)

    # -- plans: page rows <-> vLLM block ids for layer 0; layer l adds l * layer_rows ----------

    def _rows(self, t: _Transfer, pages: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """Row (in page space) and vLLM block id of every vLLM block of ``t`` in ``pages``, given
        as (request page index, the page's first row)."""
        ratio = self.conn.ratio
        src: list[int] = []
        dst: list[int] = []
        for p, base in pages:
            lo = max(p * ratio, t.first_vblock)
            hi = min((p + 1) * ratio, t.first_vblock + len(t.vblocks))
            for j in range(lo, hi):
                src.append(base + j - p * ratio)
                dst.append(t.vblocks[j - t.first_vblock])
        return src, dst

    def _start_loads(self, loads: list[_Transfer]) -> None:
        t0 = time.perf_counter()
        try:
            self._take_loads(loads)
        finally:
            self.conn.stats.acquire_s += time.perf_counter() - t0

    def _take_loads(self, loads: list[_Transfer]) -> None:
        conn = self.conn
        keys = [k for t in loads for k in t.keys]
        page_bytes = conn.layout.page_bytes
        try:
            if conn.client.shm_available(conn.namespace):
                self.read = conn.client.acquire(
                    conn.namespace, keys=keys, ttl_s=conn.config.lease_ttl_s
                )
                assert self.read.slab is not None
                pages = _Pages(self.read.slab.array, self.vblock_bytes, conn._word)
                offsets = [
                    o if t is not None else -1 for o, t in zip(self.read.offsets, self.read.tiers)
                ]
            else:
                got = conn.client.get(conn.namespace, keys=keys)
                buf = np.zeros((len(keys), page_bytes), np.uint8)
                offsets = []
                for i, page in enumerate(got):
                    if page is not None:
                        buf[i] = page
                    offsets.append(i * page_bytes if page is not None else -1)
                pages = _Pages(buf.reshape(-1), self.vblock_bytes, conn._word)
        except KVCacheRpcError as e:
            log.warning("kvcache load of %d pages failed (%s); vLLM recomputes them", len(keys), e)
            for t in loads:
                conn._failed(t.vblocks)
            conn.stats.load_failed_blocks += sum(len(t.vblocks) for t in loads)
            return
        src: list[int] = []
        dst: list[int] = []
        i = 0
        for t in loads:
            offs = offsets[i : i + len(t.keys)]
            i += len(t.keys)
            # Only a leading run of pages is usable: the chain breaks at the first missing one.
            n = next((k for k, o in enumerate(offs) if o < 0 or o % self.vblock_bytes), len(offs))
            s, d = self._rows(
                t, [(t.first_page + k, o // self.vblock_bytes) for k, o in enumerate(offs[:n])]
            )
            src += s
            dst += d
            missing = t.vblocks[len(d) :]
            if missing:
                conn._failed(missing)
                conn.stats.load_failed_blocks += len(missing)
            conn.stats.loaded_pages += n
        self.load_plan = (pages, _RowMap(src, dst))

    def _start_saves(self, saves: list[_Transfer]) -> None:
        t0 = time.perf_counter()
        try:
            self._send_allocate(saves)
        finally:
            self.conn.stats.allocate_s += time.perf_counter() - t0

    def _send_allocate(self, saves: list[_Transfer]) -> None:
        conn = self.conn
        # Requests of one step that share a prefix save the same blocks: each key is written
        # once, by its first request (``_slots``: the key's place among the unique keys, -1
        # for a repeat); the node refuses an Allocate that names a key twice.
        unique: dict[bytes, int] = {}
        for t in saves:
            for k in t.keys:
                self._slots.append(-1 if k in unique else unique.setdefault(k, len(unique)))
        keys = list(unique)
        self.saves = saves
        try:
            shm = conn.client.shm_available(conn.namespace)
            if shm and conn.overlap:
                self._allocating = conn.client.allocate_async(
                    conn.namespace, keys=keys, ttl_s=conn.config.lease_ttl_s
                )
            elif shm:
                lease = conn.client.allocate(
                    conn.namespace, keys=keys, ttl_s=conn.config.lease_ttl_s
                )
                self._allocating = Future()
                self._allocating.set_result(lease)
        except KVCacheRpcError as e:  # a cache: a failed save only costs a future hit
            log.warning("kvcache save of %d pages skipped (%s)", len(keys), e)
            return
        if not shm:
            page_bytes = conn.layout.page_bytes
            self.streamed_out = np.zeros((len(keys), page_bytes), np.uint8)
            self.save_keys = keys
            self._plan_saves(
                _Pages(self.streamed_out.reshape(-1), self.vblock_bytes, conn._word),
                [j * page_bytes if j >= 0 else -1 for j in self._slots],
            )

    def _take_saves(self) -> None:
        """Wait for the step's Allocate (sent at the step's start) and plan the copies."""
        allocating, self._allocating = self._allocating, None
        if allocating is None:
            return
        t0 = time.perf_counter()
        try:
            self.write = allocating.result()
        except KVCacheRpcError as e:  # a cache: a failed save only costs a future hit
            n = sum(len(t.keys) for t in self.saves)
            log.warning("kvcache save of %d pages skipped (%s)", n, e)
            return
        finally:
            self.conn.stats.allocate_s += time.perf_counter() - t0
        assert self.write.slab is not None
        pages = _Pages(self.write.slab.array, self.vblock_bytes, self.conn._word)
        offsets = self.write.offsets
        self._plan_saves(pages, [offsets[j] if j >= 0 else -1 for j in self._slots])

    def _plan_saves(self, pages: _Pages, offsets: list[int]) -> None:
        src: list[int] = []
        dst: list[int] = []
        i = 0
        for t in self.saves:
            offs = offsets[i : i + len(t.keys)]
            i += len(t.keys)
            # A page already stored (by anyone) has offset -1: skipped.
            todo = [
                (t.first_page + k, o // self.vblock_bytes) for k, o in enumerate(offs) if o >= 0
            ]
            s, d = self._rows(t, todo)
            src += s
            dst += d
            self.conn.stats.saved_pages += len(todo)
        if src:
            self.save_plan = (pages, _RowMap(src, dst))

    # -- per layer ------------------------------------------------------------------------------

    def load_layer(self, layer: int) -> None:
        if self.load_plan is None:
            return
        pages, rows = self.load_plan
        if rows.count:
            t0 = time.perf_counter()
            rows.to_blocks(pages.rows_view, layer * self.layer_rows, self.conn._layers[layer])
            self.conn.stats.load_copy_s += time.perf_counter() - t0

    def save_layer(self, layer: int) -> None:
        self._take_saves()
        if self.save_plan is None or layer in self.saved_layers:
            return
        self.saved_layers.add(layer)
        pages, rows = self.save_plan
        t0 = time.perf_counter()
        rows.to_pages(self.conn._layers[layer], pages.rows_view, layer * self.layer_rows)
        self.conn.stats.save_copy_s += time.perf_counter() - t0

    def finish(self) -> None:
        conn = self.conn
        for layer in range(conn.layout.num_layers):  # layers no save_kv_layer call reached
            self.save_layer(layer)
        t0 = time.perf_counter()
        try:
            if self.write is not None and conn.overlap:
                # The pages are written: vLLM may reuse its blocks; the commit needs no waiting.
                conn._send("commit", conn.client.commit_async(self.write))
            elif self.write is not None:
                self.write.commit()
            elif self.streamed_out is not None and self.save_plan is not None:
                conn.client.put(conn.namespace, list(self.streamed_out), keys=self.save_keys)
        except KVCacheRpcError as e:
            log.warning("kvcache commit failed (%s); those blocks stay uncached", e)
        finally:
            self.write = None
            self._release()
            conn.stats.finish_s += time.perf_counter() - t0

    def abort(self) -> None:
        try:
            self._take_saves()
            if self.write is not None:
                self.write.abort()
        except KVCacheRpcError:
            pass
        self.write = None
        self._release()

    def _release(self) -> None:
        read, self.read = self.read, None
        if read is None:
            return
        if self.conn.overlap:
            self.conn._send("release", self.conn.client.release_async(read))
            return
        try:
            read.release()
        except KVCacheRpcError as e:
            log.info("kvcache release failed (%s); the lease expires by itself", e)


def _word_for(row_bytes: int, pointers: list[int]) -> torch.dtype:
    """The widest integer type whose size divides the row size and every base address."""
    for word in (torch.int64, torch.int32, torch.int16):
        if row_bytes % word.itemsize == 0 and all(p % word.itemsize == 0 for p in pointers):
            return word
    return torch.uint8


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _served_name(vllm_config: "VllmConfig") -> str:
    name = vllm_config.model_config.served_model_name
    if isinstance(name, list):
        name = name[0]
    return str(name or vllm_config.model_config.model).rstrip("/").rsplit("/", 1)[-1]
