"""The worker side of the vLLM connector: the KV caches it registers (this rank's layout, page
format and handshake), and the hooks that run each step's loads and saves (``vllm_transfer``)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import grpc
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

from kvstore.layout import KVLayout

from .messenger_client import MessengerClient
from .node_client import KVCacheRpcError, KVStoreClient
from .vllm_guard import NodeGuard
from .vllm_identity import page_format, rank_tag
from .vllm_setup import (
    ConnectorConfig,
    KVCacheHandshake,
    backend_name,
    rows_of,
    vllm_layout,
    vllm_version,
)
from .vllm_stats import ConnectorStats, add
from .vllm_transfer import KVCacheConnectorMetadata, _Step, _Transfer, _word_for

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata

log = logging.getLogger("clients.vllm_connector")


class WorkerSide(KVConnectorBase_V1):  # type: ignore[misc]
    """``KVCacheConnector``'s worker-side methods (its state is set up in its ``__init__``)."""

    config: ConnectorConfig
    client: KVStoreClient
    guard: NodeGuard
    stats: ConnectorStats
    vblock_tokens: int
    model_name: str
    layout: KVLayout | None
    namespace: str
    ratio: int
    rank: str
    overlap: bool
    merge_calls: bool
    _handshake: KVCacheHandshake | None
    _layer_index: dict[str, int]
    _layers: list[torch.Tensor]  # per layer: [num_blocks, vblock bytes / word size] of _word
    _word: torch.dtype
    _on_gpu: bool
    _step: _Step | None
    _step_of: KVConnectorMetadata | None  # the metadata _step was made for
    _load_errors: set[int]
    _tainted: int  # steps whose saves are dropped after a failed load
    _hook_s: float  # time in this step's hooks so far
    _inflight: list[tuple[str, Future[Any]]]  # commits and releases sent without waiting
    _lock: threading.Lock
    _waiters: dict[str, MessengerClient]
    _pending_pulls: list["_Pull"]  # pulls its requests wait for (get_finished looks at them)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Every KV layer of this rank (a draft model's included); each block's bytes must be
        contiguous, the same size in every layer."""
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        _allow_amx()
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
        layers = [rows_of(t) for t in kv_caches.values()]
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
        # Rows are copied as the widest word that tiles them (and their addresses and strides):
        # torch's row gather / scatter costs per element, so 8-byte words copy ~6x faster.
        self._word = _word_for(
            vblock_bytes, [a for t in layers for a in (t.data_ptr(), t.stride(0))]
        )
        self._on_gpu = first.device.type != "cpu"
        self.overlap = self._on_gpu if self.config.overlap == "auto" else bool(self.config.overlap)
        self._layers = [t.view(self._word) for t in layers]
        fmt = page_format(
            vllm_version(),
            first.device.type,
            backend_name(self._vllm_config, next(iter(kv_caches))),
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
        if out.namespace not in served and self._register(out):
            return out
        if out.namespace not in served:
            raise ValueError(
                f"kvcache connector: node {self.config.node} does not serve {out.namespace}; "
                f"start it with --layout model={out.model},num_layers={out.num_layers},"
                f"kv_heads={out.kv_heads},head_dim={out.head_dim},dtype={out.dtype},"
                f"block_tokens={out.block_tokens} (it serves: {', '.join(served) or 'none'})"
            )
        return out

    def _register(self, layout: KVLayout) -> bool:
        """Have the node serve this rank's layout (a node started without --layout serves what
        its clients register); False when it refuses (one started with --layout)."""
        try:
            added = self.guard.call(lambda: self.client.register_layout(layout))
        except KVCacheRpcError as e:
            if e.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED):
                log.error("kvcache node %s: %s", self.config.node, e.details)
                return False
            log.warning(
                "kvcache node %s did not register %s (%s); computing every prompt until it "
                "serves it",
                self.config.node,
                layout.namespace,
                e,
            )
            return True  # NOTE: a miss until it answers, as when it did not answer GetInfo
        log.info(
            "kvcache node %s serves %s (%s)",
            self.config.node,
            layout.namespace,
            "registered now" if added else "registered by another rank or engine",
        )
        return True

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
        bound = self._get_connector_metadata()
        if isinstance(bound, KVCacheConnectorMetadata) and bound.remote:
            self._start_remote_loads(bound.remote)
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

    # ---- the pool's loads (clients.remote_pool) -------------------------------------------------

    def _start_remote_loads(self, loads: list[tuple[str, str, dict[str, str], _Transfer]]) -> None:
        """Ask each pull's messenger to answer once the pull is done (a call left in flight;
        ``get_finished`` looks at it every step): no thread of ours waits. A thread did, and
        in a multi-process engine's worker, its core shared with the rank's spinning OpenMP
        threads, its calls at times got no answer for the whole deadline."""
        now = time.monotonic()
        for req_id, messenger, batches, transfer in loads:
            # this rank's share came in its namespace's batch (with the other ranks' there)
            batch_id = batches.get(self.namespace, "")
            waiter = self._waiters.get(messenger)
            if waiter is None:
                waiter = self._waiters[messenger] = MessengerClient(
                    messenger, self.config.token, self.config.tls_ca_file
                )
            pull = _Pull(req_id, waiter, batch_id, transfer, now, now + self.config.pull_timeout_s)
            if batch_id:
                pull.ask()
            self._pending_pulls.append(pull)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose pulled pages are now in their blocks (or failed: load errors): a pull
        done is loaded here, on the engine's thread (a copy on another thread ran 5-10x slower
        against the rank's spinning OpenMP threads: 250-640 ms for the 7 pages of the 125M
        model that a local hit loads in its step). Blocks vLLM holds for a request while it
        waits: no forward touches them. Whatever did not arrive is a load error (vLLM
        recomputes it); a request is reported finished always, by its deadline at the latest."""
        if not self._pending_pulls:
            return None, None
        now = time.monotonic()
        finished: set[str] = set()
        waiting: list[_Pull] = []
        for pull in self._pending_pulls:
            done, whole = pull.poll(now)
            if done is None:
                waiting.append(pull)
                continue
            stats, t = ConnectorStats(), pull.transfer
            stats.remote_wait_s += now - pull.started
            if not whole:
                stats.remote_failed += 1  # what did arrive is loaded, the rest computed
            try:
                if not done:
                    raise KVCacheRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "pull not done")
                step = _Step(self, KVCacheConnectorMetadata(loads=[t]), stats)  # Acquire
                step.load_all()
                step.finish()  # Release
            except Exception as e:  # noqa: BLE001 - vLLM recomputes what was not loaded
                log.info("kvcache pulled pages for %s not loaded: %s", pull.req_id, e)
                stats.load_failed_blocks += len(t.vblocks)
                self._failed(t.vblocks)
            add(self.stats, stats)
            finished.add(pull.req_id)
        self._pending_pulls = waiting
        return None, finished or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def _failed(self, vblocks: list[int]) -> None:
        with self._lock:
            self._load_errors.update(vblocks)


def _allow_amx() -> None:
    """Ask Linux for AMX in this process (a no-op where the CPU has none). vLLM's CPU attention
    runs AMX tile instructions on such CPUs but never asks: oneDNN does, in the first matmul big
    enough for its AMX path, which an engine without a cache always has first. With a load, an
    engine's first forward can compute a token or two, and the attention's first tile
    instruction was a SIGILL that killed the engine."""
    cpu = getattr(torch, "cpu", None)
    if cpu is not None and getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        if not cpu._init_amx():
            log.warning("kvcache connector: Linux refused AMX to this process")


class _Pull:
    """One request's pull as this worker sees it: a TransferStatus(wait) call in flight, asked
    again while the pull runs, until its deadline (then cancelled)."""

    def __init__(
        self,
        req_id: str,
        messenger: MessengerClient,
        batch_id: str,
        transfer: _Transfer,
        started: float,
        deadline: float,
    ) -> None:
        self.req_id, self.messenger, self.batch_id = req_id, messenger, batch_id
        self.transfer, self.started, self.deadline = transfer, started, deadline
        self.call: Any = None

    def ask(self) -> None:
        left = self.deadline - time.monotonic()
        self.call = self.messenger.status_future(self.batch_id, max(0.001, min(left, 30.0)))

    def poll(self, now: float) -> tuple[bool | None, bool]:
        """(None, _): not done yet; else (it finished, every page arrived)."""
        if self.call is None:  # no batch for this rank's namespace
            return False, False
        if self.call.done():
            try:
                status = self.call.result()
            except grpc.RpcError as e:
                log.warning("kvcache pull %s: %s; its pages are recomputed", self.batch_id, e)
                return False, False
            if status.finished:
                return True, not status.failed
            if now < self.deadline:
                self.ask()  # the messenger's wait ended first: ask again
                return None, False
        elif now < self.deadline + 1.0:  # its answer is due by the deadline
            return None, False
        self.call.cancel()
        try:
            self.messenger.cancel(self.batch_id)
        except KVCacheRpcError as e:
            log.info("kvcache pull %s: cancel failed (%s)", self.batch_id, e)
        log.warning("kvcache pull %s not done in time; its pages are recomputed", self.batch_id)
        return False, False
