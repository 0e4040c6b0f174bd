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
leases pages for every block to save (both in one ``AcquireAllocate`` round trip when the step
does both, the save only when every load was found); each layer's blocks are copied from shared
memory just before that layer's attention and into shared memory as the layer completes;
``wait_for_save`` commits and releases (one ``CommitRelease`` when the step holds both leases).
A step in which a load failed commits nothing. With ``overlap`` (the default on GPUs) the Allocate
is waited for at the first layer's save (a merged AcquireAllocate at once) and the Commit and
Release are sent without waiting. Without shared memory (the node on another host) pages travel
over the streamed Get/Put instead.

A block that cannot be loaded (gone, corrupt on SSD, node down) is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes it (the connector sets vLLM's
``kv_load_failure_policy`` to ``"recompute"``). Every node call has a short deadline
(``min_timeout_ms`` to ``timeout_ms``, following the node's latency); a node that does not
answer opens a breaker that makes the connector a no-op until it answers again
(``clients.vllm_guard``).

``kv_role``: ``kv_both`` loads and stores, ``kv_producer`` (a prefill engine of a disaggregated
deployment) only stores, ``kv_consumer`` (a decode engine) only loads.

Extra config (``kv_connector_extra_config``): ``node`` (address, required), ``token`` or
``token_file`` (bearer token; its tenant scopes every key), ``tls_ca_file``, ``block_tokens``
(default: the node's layout for this model when it serves one, else 256), ``model`` (the
layout's model name; default vLLM's served model name), ``salt``, ``save`` (``"prompt"``: save
full prompt blocks, the default; ``"none"``: load only), ``lease_ttl_s``, ``overlap``
(``"auto"``, true, false), ``timeout_ms`` (the longest deadline of a node call, default 1000 or
``$KVCACHE_CONNECTOR_TIMEOUT_MS``; streamed pages get 10 ms more per MB), ``min_timeout_ms``
(the shortest, default 200 or ``$KVCACHE_CONNECTOR_MIN_TIMEOUT_MS``: between the two, the
deadline follows the node's latency, ``vllm_guard.Latency``), ``retry_s`` (how often
a node that stopped answering is asked again, default 2), ``model_fingerprint`` (the weights'
identity, instead of sampling the weight files), ``conductor`` (the cluster's conductor: a prefix
another node holds more of is pulled into this node and loaded while the request waits in vLLM's
``WAITING_FOR_REMOTE_KVS``; ``clients.remote_pool``), ``messenger`` (this node's messenger;
default: the one it registered), ``remote_timeout_ms`` (the conductor's deadline, default 100 or
``$KVCACHE_CONNECTOR_REMOTE_TIMEOUT_MS``),
``pull_timeout_s`` (how long a request waits for pulled pages before vLLM recomputes them,
default 10), ``pull_max_cost`` (a pull is made when its wait is predicted at most this times
what computing its tokens would add, both measured as the engine runs: ``clients.pull_gate``;
default 1, ``inf``: always). A multi-rank engine (TP, PP) pulls every rank's share, one
batch per namespace, found by rank 0's keys; each rank loads its own.

vLLM's own P/D flow (its disaggregated proxy, llm-d's routing sidecar): a prefill request whose
``kv_transfer_params`` carry ``do_remote_decode`` answers with ``do_remote_prefill``, its node's
messenger (``kvcache_messenger``) and the pages it stored (``kvcache_pages``); a decode engine
given those params pulls the pages into its own node and loads them as above (no conductor
needed; each engine learns its node's messenger from the node).
"""

from __future__ import annotations

import atexit
import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.layout import KVLayout

from .messenger_client import MessengerClient
from .node_client import KVStoreClient
from .pull_gate import PullGate
from .remote_pool import RemotePool
from .vllm_guard import NodeGuard
from .vllm_scheduler import SchedulerSide, _Rank, _Request
from .vllm_setup import (
    ConnectorConfig,
    KVCacheHandshake,
    fingerprint,
    refuse_unsupported,
    served_name,
    vllm_layout,
)
from .vllm_stats import (
    REMOTE_LOAD,
    REMOTE_LOAD_S,
    STATS,
    ConnectorStats,
    Intervals,
    KVCacheConnectorPromMetrics,
    KVCacheConnectorStats,
)
from .vllm_transfer import KVCacheConnectorMetadata, _RowMap, _Step, _Transfer, _word_for
from .vllm_worker import WorkerSide, _Pull

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "STATS",
    "ConnectorConfig",
    "ConnectorStats",
    "KVCacheConnector",
    "KVCacheConnectorMetadata",
    "KVCacheHandshake",
    "_RowMap",
    "_word_for",
    "vllm_layout",
]

log = logging.getLogger(__name__)


class KVCacheConnector(SchedulerSide, WorkerSide):
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
        refuse_unsupported(vllm_config, kv_cache_config)
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
            self.client,
            self.config.retry_s,
            self.config.token,
            self.config.tls_ca_file,
            min_timeout_s=min(self.config.min_timeout_ms, self.config.timeout_ms) / 1000,
        )
        self.model_name = self.config.model or served_name(vllm_config)
        self.stats = ConnectorStats()
        self.remote_load_s = []
        self._intervals = Intervals()
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
        self._formats: list[str] = []
        self._fingerprint = ""
        if role == KVConnectorRole.SCHEDULER:
            self._fingerprint = self.config.model_fingerprint or fingerprint(vllm_config)
        # worker side
        self.rank = ""
        self._handshake: KVCacheHandshake | None = None
        self._layer_index: dict[str, int] = {}
        # per layer: [num_blocks, vblock_bytes / word size] of self._word
        self._layers: list[torch.Tensor] = []
        self._word = torch.uint8
        self.overlap = False  # see ConnectorConfig.overlap; decided when the caches register
        # A step that loads and saves takes both leases in one AcquireAllocate and ends them in
        # one CommitRelease; off (a node that does not know them turns it off): separate calls.
        self.merge_calls = True
        self._on_gpu = False
        self._step: _Step | None = None
        self._step_of: KVConnectorMetadata | None = None  # the metadata _step was made for
        self._load_errors: set[int] = set()
        self._tainted = 0  # steps whose saves are dropped after a failed load
        self._hook_s = 0.0
        # Commits and releases sent without waiting; their outcomes are logged when collected.
        self._inflight: list[tuple[str, Future[Any]]] = []
        # the pool (clients.remote_pool): scheduler side, made on first use; worker side, the
        # pulls it waits for in the background and the requests whose pages it then loaded
        self._pool: RemotePool | None = None
        self._pool_retry_at = 0.0
        # vLLM's asynchronous scheduling schedules a step while the one before it runs
        lag = int(bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)))
        self._gate = PullGate(self.config.pull_max_cost, lag)
        self._messenger_of_node: str | None = None
        self._remote_loads: list[tuple[str, str, dict[str, str], _Transfer]] = []
        self._waiters: dict[str, MessengerClient] = {}
        self._pending_pulls: list[_Pull] = []
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
        d = self._intervals.take(s)
        for k, v in d.items():
            if k != "breaker_open":
                setattr(STATS, k, getattr(STATS, k) + v)
        STATS.breaker_open = d["breaker_open"]
        if self.remote_load_s:
            d[REMOTE_LOAD_S], self.remote_load_s = self.remote_load_s, []
            REMOTE_LOAD.extend(d[REMOTE_LOAD_S])
        return KVCacheConnectorStats(data=d)

    def shutdown(self) -> None:
        step, self._step = self._step, None
        if step is not None:
            step.abort()
        self._collect(wait=True)
        for pull in self._pending_pulls:
            if pull.call is not None:
                pull.call.cancel()
        for waiter in self._waiters.values():
            waiter.close()
        if self._pool is not None:
            self._pool.close()
        self.guard.close()
        self.client.close()
