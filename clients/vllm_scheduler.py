"""The scheduler side of the vLLM connector: a request's keys, the Lookup that says how much of
its prompt every rank holds, and the plan of each step's loads (new and resumed requests) and
saves (full prompt pages, once) that the workers carry out."""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvstore.keys import root_key
from kvstore.layout import KVLayout

from .conductor_client import ConductorClient
from .node_client import KVCacheRpcError, KVStoreClient
from .pull_gate import PullGate
from .remote_pool import RemotePool, messengers
from .vllm_guard import NodeGuard
from .vllm_identity import engine_salt, rank_keys, request_keys, request_salt
from .vllm_setup import ConnectorConfig, KVCacheHandshake
from .vllm_stats import ConnectorStats
from .vllm_transfer import KVCacheConnectorMetadata, _Transfer

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("clients.vllm_connector")


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
    pulling: dict[str, str] = field(default_factory=dict)  # namespace -> messenger batch
    pulled: bool = False  # it had its pull: a request vLLM retries (the pull failed) computes
    pull_started: float = 0.0  # when its pull was submitted (perf_counter); 0: none pending
    pull_pages: int = 0
    looked_up: float = 0.0  # when the lookup that made its pull began (perf_counter)


class SchedulerSide(KVConnectorBase_V1):  # type: ignore[misc]
    """``KVCacheConnector``'s scheduler-side methods (its state is set up in its ``__init__``)."""

    config: ConnectorConfig
    client: KVStoreClient
    guard: NodeGuard
    stats: ConnectorStats
    remote_load_s: list[float]  # per pull since the last stats: Lookup to vLLM told it is done
    loads: bool
    saves: bool
    vblock_tokens: int
    layout: KVLayout | None
    namespace: str
    ratio: int
    _reqs: dict[str, _Request]
    _ranks: list[_Rank] | None
    _formats: list[str]
    _epoch: bytes
    _engine_salt: bytes
    _fingerprint: str
    _remote_loads: list[tuple[str, str, dict[str, str], _Transfer]]
    _pool: RemotePool | None
    _pool_retry_at: float
    _gate: PullGate
    _messenger_of_node: str | None

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
        # Only a pull started by this call makes the offer asynchronous: one vLLM could not
        # admit last time (no update_state_after_alloc) must not turn a later offer async.
        st.pulling = {}
        t0 = st.looked_up = time.perf_counter()
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
        # vLLM's P/D flow: the prefill engine's answer named its node's messenger (and how many
        # pages it stored); else the pool's index, with a conductor.
        params = request.kv_transfer_params or {}
        source = (
            str(params.get("kvcache_messenger") or "") if params.get("do_remote_prefill") else ""
        )
        if hit * self.layout.block_tokens < last and (source or self.config.conductor):
            stored = params.get("kvcache_pages") if source else None
            remote = self._pull_from_pool(
                request.request_id, st, hit, last, num_computed_tokens, source, stored
            )
            if remote:
                return remote, True
        if end <= num_computed_tokens:
            st.load = None
            return 0, False
        st.load = (num_computed_tokens, end)
        return end - num_computed_tokens, False

    def _pull_from_pool(
        self,
        req_id: str,
        st: _Request,
        hit: int,
        last: int,
        computed: int,
        source: str = "",
        stored: Any = None,
    ) -> int:
        """Tokens another node holds beyond this node's ``hit`` pages, now being pulled into
        this node (``load_async``); 0: none, or no pool. One Locate (its own short deadline),
        or none for a ``source`` messenger a prefill engine named (``stored``: its pages), and
        one SubmitTransfer; any failure is a miss."""
        if st.pulled:
            return 0  # one pull per request: after a failed one, vLLM computes what it lacks
        pool = self._remote_pool()
        if pool is None or self._ranks is None:
            return 0
        assert self.layout is not None
        bt = self.layout.block_tokens
        # Ask the pool only if the best it could give (every page beyond this node's) pays
        # (vLLM's P/D flow pulls whatever it costs: its decode engine is not to prefill).
        gain = last - max(computed, hit * bt)
        pays = bool(source) or self._gate.pays(-(-gain // bt), gain)
        if not pays and not self._gate.explore():
            self.stats.remote_skipped += 1
            return 0
        check_found = not source and pays  # an exploring pull is made whatever the pool holds
        t0 = time.perf_counter()
        try:
            if source:
                pages = len(st.keys) if not isinstance(stored, int) else min(stored, len(st.keys))
                found: tuple[int, str] | None = (pages, source)
            else:
                # rank 0's share stands for the page (the others' are stored beside it; one
                # that is not arrives as a load error: recomputed)
                rank0 = rank_keys(st.keys[: last // bt + 1], self._ranks[0].tag)
                found = pool.find(self.namespace, rank0, hit)
            if found is None:
                return 0
            pages, source = found
            end = min(pages * bt, last)
            if end <= max(computed, hit * bt):
                return 0
            keys = st.keys[hit : -(-end // bt)]
            if check_found and not self._gate.pays(len(keys), end - max(computed, hit * bt)):
                # the pool holds less than the best case: too little to pay
                self.stats.remote_skipped += 1
                return 0
            # one pull per namespace of every rank's keys; a lone rank's are one chain
            st.pulling = {
                ns: pool.pull(ns, ranked, source, chain=ranks == 1)
                for ns, ranks, ranked in self._ranks_keys(keys)
            }
            st.pulled = True
            st.pull_started, st.pull_pages = time.perf_counter(), len(keys)
        except KVCacheRpcError as e:
            log.info("kvcache pool lookup failed (%s); this node's hit only", e)
            return 0
        finally:
            self.stats.remote_lookup_s += time.perf_counter() - t0
        self.stats.remote_pulls += 1
        st.load = (computed, end)
        return end - computed

    def _remote_pool(self) -> RemotePool | None:
        """The pool, made on first use (the node names itself and its messenger); None for
        ``retry_s`` after it could not be made."""
        if not self.loads:
            return None
        if self._pool is not None or time.monotonic() < self._pool_retry_at:
            return self._pool
        try:
            info = self.guard.call(self.client.info)
            timeout_s = self.config.remote_timeout_ms / 1000
            messenger = self.config.messenger or info.messenger_address
            if not messenger and self.config.conductor:
                with ConductorClient(
                    self.config.conductor, self.config.token, self.config.tls_ca_file, timeout_s
                ) as c:
                    messenger = messengers(c).get(info.node_id, "")
            if not messenger:
                raise KVCacheRpcError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"node {info.node_id} registered no messenger: set 'messenger'",
                )
            self._pool = RemotePool(
                self.config.conductor,
                messenger,
                info.node_id,
                self.config.token,
                self.config.tls_ca_file,
                timeout_s,
                self.config.pull_timeout_s,
            )
        except KVCacheRpcError as e:
            log.warning("kvcache pool unavailable (%s); loading from this node only", e)
            self._pool_retry_at = time.monotonic() + self.config.retry_s
        return self._pool

    def _lookup(self, keys: list[bytes]) -> int:
        """Leading pages every rank holds: per namespace one Lookup of the ranks' keys
        interleaved (page 0 of every rank, then page 1, ...), so its hit counts whole pages."""
        hit = len(keys)
        for ns, ranks, mixed in self._ranks_keys(keys):
            got = self.guard.call(functools.partial(self.client.lookup, ns, keys=mixed))
            hit = min(hit, got.hit_blocks // ranks)
        return hit

    def _ranks_keys(self, keys: list[bytes]) -> list[tuple[str, int, list[bytes]]]:
        """Per namespace: how many ranks key their shares there, and their keys of ``keys``
        interleaved (page 0 of every rank, then page 1, ...)."""
        assert self._ranks is not None
        out = []
        for ns in dict.fromkeys(r.namespace for r in self._ranks):
            per_rank = [rank_keys(keys, r.tag) for r in self._ranks if r.namespace == ns]
            out.append((ns, len(per_rank), [k for page in zip(*per_rank) for k in page]))
        return out

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
        if st.pulling and st.load is not None:
            # Waits in WAITING_FOR_REMOTE_KVS: the worker loads these blocks once the pull is
            # done and says so (get_finished); the step that schedules it later loads nothing.
            (ids,) = blocks.get_block_ids()[:1]
            st.block_ids = list(ids)
            first, end = st.load
            assert self.layout is not None
            transfer = self._transfer(
                request.request_id, st, first // self.vblock_tokens, end // self.vblock_tokens
            )
            assert self._pool is not None
            messenger = self._pool.messenger.address
            self._remote_loads.append((request.request_id, messenger, st.pulling, transfer))
            st.saved_pages = max(st.saved_pages, -(-end // self.layout.block_tokens))
            self.stats.hit_tokens += end - first
            st.load = None
        st.pulling = {}

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVCacheConnectorMetadata:
        meta = KVCacheConnectorMetadata(remote=self._remote_loads)
        self._remote_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        cached = scheduler_output.scheduled_cached_reqs
        # the engine's compute per token, for the pool's pulls (a running request continues:
        # the engine did not idle since the last step)
        continued = len(cached.req_ids) > len(cached.resumed_req_ids)
        self._gate.step(time.perf_counter(), scheduler_output.total_num_scheduled_tokens, continued)
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan_load(meta, new.req_id, st)
            self._plan_save(meta, new.req_id, st, new.num_computed_tokens + scheduled[new.req_id])
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

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """A pull vLLM hears is done (its pages loaded, or load errors): how long its request
        waited, for the pool's gate, and how long from its Lookup, for the histogram."""
        now = time.perf_counter()
        for req_id in connector_output.finished_recving or ():
            st = self._reqs.get(req_id)
            if st is not None and st.pull_started:
                self._gate.pulled(st.pull_pages, now - st.pull_started)
                self.remote_load_s.append(now - st.looked_up)
                st.pull_started = 0.0

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Finished: forgotten. A caller that asks (``kv_transfer_params: {"kvcache_keys":
        true}``, the router) learns the namespace and salt of the request's keys, and the
        engine's salt (that of requests without cache_salt, LoRA or multimodal inputs)."""
        st = self._reqs.pop(request.request_id, None)
        asked = request.kv_transfer_params or {}
        if st is None or self._ranks is None:
            return False, None
        out: dict[str, Any] = {}
        if asked.get("do_remote_decode") and self.saves:
            # vLLM's P/D flow (its proxy, llm-d): the decode engine's connector pulls the pages
            # this engine stored from its node's messenger (clients.remote_pool).
            messenger = self._own_messenger()
            if messenger:
                self._hold_for_decode(st)
                out.update(
                    do_remote_prefill=True,
                    do_remote_decode=False,
                    kvcache_messenger=messenger,
                    kvcache_pages=st.saved_pages,
                )
        if asked.get("kvcache_keys"):
            salts = {"salt": st.salt.hex(), "engine": self._engine_salt.hex()}
            # ranks: each rank's keys are the chain's derived with its tag (rank_keys)
            ranks = [r.tag for r in self._ranks if r.tag]
            out["kvcache"] = {"namespace": self.namespace, **salts, "ranks": ranks}
        return False, out or None

    def _hold_for_decode(self, st: _Request) -> None:
        """Pin the pages a decode engine will pull (vLLM's P/D flow) for ``hold_for_decode_s``:
        one Acquire per namespace, started and not waited for (never on the scheduler's path),
        its lease left to lapse (the decode side's pull pins them again while it reads). Pages
        whose commit is still in flight are not pinned; a node that refuses (a tenant's lease
        limit) pins nothing: the pages are then evictable as before."""
        hold = self.config.hold_for_decode_s
        if not hold or not st.saved_pages or self.guard.breaker.is_open:
            return
        for ns, _, ranked in self._ranks_keys(st.keys[: st.saved_pages]):
            pending = self.client.acquire_async(ns, keys=ranked, ttl_s=hold)
            pending.add_done_callback(_log_refused_hold)
        self.stats.decode_holds += 1  # NOTE: here, on the scheduler's thread (see vllm_stats)

    def _own_messenger(self) -> str:
        """This engine's node's messenger ('messenger', else the one the node names)."""
        if self.config.messenger:
            return self.config.messenger
        if self._messenger_of_node is None:
            try:
                self._messenger_of_node = self.guard.call(self.client.info).messenger_address
            except KVCacheRpcError as e:
                log.warning("kvcache: cannot ask the node for its messenger (%s)", e)
                return ""
        return self._messenger_of_node

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


def _log_refused_hold(pending: Any) -> None:
    error = pending.exception()
    if error is not None:
        log.info("kvcache: the pages for the decode side are not pinned: %s", error)
