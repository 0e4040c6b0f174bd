"""KV-cache-centric request scheduling (Mooncake FAST'25, Algorithm 1).

``Scheduler.schedule(request, now)`` picks a prefill node and a decode node for one request:

1. The global index gives, for every node, how many leading blocks of the request it holds
   (``local``) and the best prefix anywhere (``best``, on ``source``).
2. For every prefill candidate: ``queue`` = prefill work the conductor sent there and has not
   seen finish (or what the node's heartbeat reports, whichever is larger);
   ``TTFT_local = queue + prefill(prompt, local)``. The ``global-cache`` policy also considers
   fetching blocks ``[local, best)`` from ``source``:
   ``TTFT_fetch = max(queue, transfer) + prefill(prompt, best)`` (the node's messenger fetches
   while the request waits in the queue) and takes it only when it beats ``TTFT_local`` by the
   ``min_transfer_gain`` fraction: moving blocks is not free for the network or the cache.
3. The policy picks the prefill option (see ``POLICIES``) and a decode node (lowest predicted
   time between tokens, TBT, after adding this request).
4. ``SLORejected`` (gRPC ``RESOURCE_EXHAUSTED``) when the chosen TTFT or TBT misses the
   request's SLO; otherwise the choice is entered in the ledger and returned as a ``Decision``.

The ledger keeps queue estimates honest: ``prefill_done(request_id, now)`` re-anchors the node's
queue at ``now``, ``complete(request_id, now)`` frees the decode slot.

Time is explicit: every method takes ``now`` (default: ``clock()``), so a trace simulation drives
the scheduler in simulated time. Single-threaded: ``conductor.core.Conductor`` adds the lock the
gRPC service needs; a simulation calls the scheduler directly::

    index = GlobalIndex(); registry = Registry(index)
    sched = Scheduler(registry, cost_model=FlopsCostModel(), policy="global-cache")
    registry.register(NodeDescriptor(node_id="p0", role=Role.PREFILL), now=0.0)
    index.apply_events("p0", store.take_events())        # kvstore events of the node's store
    d = sched.schedule(Request(request_id="r1", keys=keys, prompt_tokens=n, block_tokens=512),
                       now=t)
    sched.prefill_done("r1", now=t + d.est_ttft_s); sched.complete("r1", now=t_end)
"""

from __future__ import annotations

import logging
import math
import random
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.errors import (
    CapacityExhausted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    echo,
)

from .costmodel import DEFAULT_COST_MODEL, CostModel, PrefillSample, fit_prefill
from .registry import NodeDescriptor, NodeState, Registry

log = logging.getLogger(__name__)


# ---- boundary types -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Request:
    """One request to place. ``keys`` are the chained keys of the prompt's full blocks, already
    scoped to the caller's tenant (``kvstore.keys.scope_keys``)."""

    request_id: str
    keys: Sequence[bytes]
    prompt_tokens: int
    block_tokens: int
    output_tokens: int = 0
    namespace: str = ""  # only nodes serving it are candidates ("" = any node)
    ttft_slo_s: float | None = None  # None / 0: no SLO
    tbt_slo_s: float | None = None
    block_bytes: int | None = None  # KV bytes per block; None: cost_model.kv_bytes(block)
    exclude: frozenset[str] = frozenset()  # node ids not to place it on (a retry's failed ones)
    tenant: str = ""  # whose share of the ledger it takes (SchedulerConfig.max_pending_per_tenant)


@dataclass(frozen=True, kw_only=True)
class TransferPlan:
    """Move ``keys`` (blocks ``first_block ..`` of the request) from ``src`` to ``dst``."""

    request_id: str
    namespace: str
    src: NodeDescriptor
    dst: NodeDescriptor
    keys: tuple[bytes, ...]
    first_block: int
    nbytes: int
    est_seconds: float


@dataclass(frozen=True, kw_only=True)
class Decision:
    request_id: str
    policy: str
    prefill: NodeDescriptor
    decode: NodeDescriptor
    total_blocks: int  # full blocks in the prompt
    local_blocks: int  # prefix the prefill node holds now
    best_blocks: int  # longest prefix any node holds
    reuse_blocks: int  # prefix the prefill node will have (local, or best after fetching)
    transfer: TransferPlan | None
    est_queue_s: float
    est_transfer_s: float
    est_prefill_s: float
    est_ttft_s: float
    est_tbt_s: float
    decided_at: float

    @property
    def prefill_node(self) -> str:
        return self.prefill.node_id

    @property
    def decode_node(self) -> str:
        return self.decode.node_id


class SLORejected(CapacityExhausted):
    """No choice meets the request's SLO (gRPC RESOURCE_EXHAUSTED)."""

    def __init__(self, slo: str, limit_s: float, estimate_s: float, detail: str) -> None:
        super().__init__(
            f"{slo} SLO of {limit_s * 1e3:.1f} ms cannot be met: best estimate "
            f"{estimate_s * 1e3:.1f} ms ({detail}); retry later or relax the SLO"
        )
        self.slo, self.limit_s, self.estimate_s = slo, limit_s, estimate_s


class NoNodeAvailable(FailedPrecondition):
    """No live node can take the request (none registered for its namespace / role)."""


# ---- options the policies choose from -------------------------------------------------------


@dataclass(slots=True)
class PrefillOption:
    node: NodeState
    local_blocks: int
    queue_s: float
    reuse_blocks: int
    transfer_s: float
    prefill_s: float
    ttft_s: float
    source: NodeState | None = None  # fetch [local_blocks, reuse_blocks) from here


@dataclass(slots=True)
class DecodeOption:
    node: NodeState
    requests: int  # after adding this request
    tokens: int
    tbt_s: float


def _min_index(values: list[float]) -> int:
    """Index of the first smallest value (as ``min`` picks among equals)."""
    return values.index(min(values))


class PrefillContext:
    """What a policy sees: every prefill candidate priced with the prefix it holds, as parallel
    lists (one entry per candidate, in candidate order), and the fetch of the best prefix priced
    on demand.

    NOTE: a policy picks an index and materialises only that option (``option(i)``,
    ``fetched_option(i)``): building an option object per candidate per request was a measurable
    share of a decision. ``options`` and ``fetch`` give the objects for policies that want them.
    """

    __slots__ = (
        "request",
        "nodes",
        "local_blocks",
        "queue_s",
        "prefill_s",
        "ttft_s",
        "best_blocks",
        "best_source",
        "_cost",
        "_block_bytes",
        "_keep",
        "_prefill_best",
        "_transfer",
        "_fetched",
    )

    def __init__(
        self,
        request: Request,
        nodes: list[NodeState],
        local_blocks: list[int],
        queue_s: list[float],
        prefill_s: list[float],
        ttft_s: list[float],
        best_blocks: int,
        best_source: NodeState | None,
        cost: CostModel,
        block_bytes: int,
        keep: float,
        prefill_best: float | None,
    ) -> None:
        self.request = request
        self.nodes = nodes
        self.local_blocks = local_blocks
        self.queue_s = queue_s
        self.prefill_s = prefill_s
        self.ttft_s = ttft_s
        self.best_blocks = best_blocks
        self.best_source = best_source
        self._cost = cost
        self._block_bytes = block_bytes
        self._keep = keep  # a fetch must bring TTFT below ttft * keep
        self._prefill_best = prefill_best  # prefill after fetching best_blocks (None: not yet)
        self._transfer: dict[int, float] = {}  # by local prefix length
        self._fetched: list[float | None] | None = None

    def option(self, i: int) -> PrefillOption:
        """Candidate ``i`` computing all but its own prefix."""
        local = self.local_blocks[i]
        return PrefillOption(
            self.nodes[i], local, self.queue_s[i], local, 0.0, self.prefill_s[i], self.ttft_s[i]
        )

    @property
    def options(self) -> list[PrefillOption]:
        return [self.option(i) for i in range(len(self.nodes))]

    def fetched_ttft(self) -> list[float | None]:
        """Per candidate: the TTFT if it first fetches blocks ``[local, best)`` from
        ``best_source`` (``max(queue, transfer) + prefill(prompt, best)``: the fetch runs while
        the request queues), or None where there is nothing to fetch or the fetch does not cut
        TTFT by the ``min_transfer_gain`` fraction."""
        if self._fetched is not None:
            return self._fetched
        best = self.best_blocks
        if self.best_source is None:
            self._fetched = [None] * len(self.nodes)
            return self._fetched
        prefill = self._prefill_at_best()
        transfer_of = self._transfer
        keep = self._keep
        out: list[float | None] = []
        for local, queue, ttft in zip(self.local_blocks, self.queue_s, self.ttft_s):
            if local >= best:
                out.append(None)
                continue
            transfer = transfer_of.get(local)
            if transfer is None:
                transfer = transfer_of[local] = self._cost.transfer_seconds(
                    (best - local) * self._block_bytes
                )
            fetched = (queue if queue >= transfer else transfer) + prefill
            out.append(None if fetched >= ttft * keep else fetched)
        self._fetched = out
        return out

    def fetched_option(self, i: int) -> PrefillOption:
        """Candidate ``i`` fetching the best prefix first (``fetched_ttft()[i]`` is not None)."""
        ttft = self.fetched_ttft()[i]
        assert ttft is not None, "fetched_option of a candidate with nothing worth fetching"
        local = self.local_blocks[i]
        return PrefillOption(
            self.nodes[i],
            local,
            self.queue_s[i],
            self.best_blocks,
            self._transfer[local],
            self._prefill_at_best(),
            ttft,
            self.best_source,
        )

    def fetch(self, option: PrefillOption) -> PrefillOption | None:
        """``option`` (one of ``options``) fetching the best prefix first, or None (see
        ``fetched_ttft``)."""
        i = self.nodes.index(option.node)
        return self.fetched_option(i) if self.fetched_ttft()[i] is not None else None

    def _prefill_at_best(self) -> float:
        if self._prefill_best is None:
            r = self.request
            self._prefill_best = self._cost.prefill_seconds(
                r.prompt_tokens, self.best_blocks * r.block_tokens
            )
        return self._prefill_best


class SchedulingPolicy(ABC):
    """Chooses among the options the scheduler prices. Registered by name in ``POLICIES``."""

    name: str = ""

    @abstractmethod
    def pick_prefill(self, ctx: PrefillContext) -> PrefillOption: ...

    def pick_decode(self, tbt_s: list[float]) -> int:
        """Index of the decode node to use, given each candidate's predicted TBT."""
        return _min_index(tbt_s)


class RandomPolicy(SchedulingPolicy):
    """Uniformly random prefill and decode nodes (a node still reuses its own prefix)."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick_prefill(self, ctx: PrefillContext) -> PrefillOption:
        return ctx.option(self._rng.randrange(len(ctx.nodes)))

    def pick_decode(self, tbt_s: list[float]) -> int:
        return self._rng.randrange(len(tbt_s))


class LoadPolicy(SchedulingPolicy):
    """Shortest prefill queue, ignoring the cache; least-loaded decode node."""

    name = "load"

    def pick_prefill(self, ctx: PrefillContext) -> PrefillOption:
        return ctx.option(_min_index(ctx.queue_s))


class LocalCachePolicy(SchedulingPolicy):
    """Minimum TTFT counting only the prefix each node already holds: no transfers."""

    name = "local-cache"

    def pick_prefill(self, ctx: PrefillContext) -> PrefillOption:
        return ctx.option(_min_index(ctx.ttft_s))


class GlobalCachePolicy(SchedulingPolicy):
    """Mooncake Algorithm 1: minimum TTFT where a node may fetch the best prefix first."""

    name = "global-cache"

    def pick_prefill(self, ctx: PrefillContext) -> PrefillOption:
        fetched = ctx.fetched_ttft()
        ttfts = [t if f is None else f for t, f in zip(ctx.ttft_s, fetched)]
        i = _min_index(ttfts)
        return ctx.option(i) if fetched[i] is None else ctx.fetched_option(i)


POLICIES: dict[str, type[SchedulingPolicy]] = {
    p.name: p for p in (RandomPolicy, LoadPolicy, LocalCachePolicy, GlobalCachePolicy)
}


def make_policy(name: str, seed: int | None = None) -> SchedulingPolicy:
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidArgument(f"unknown scheduling policy {name!r}; use one of {sorted(POLICIES)}")
    return cls(seed) if cls is RandomPolicy else cls()


# ---- the scheduler --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    min_transfer_gain: float = 0.05  # fetch only when it cuts TTFT by at least this fraction
    # A request never completed is dropped from the ledger this long after it was scheduled,
    # plus its estimated TTFT (at most as long again): a tenant that schedules and never
    # completes cannot hold queue estimates up for longer, whatever it claimed.
    stale_after_s: float = 900.0
    max_pending_per_tenant: int = 0  # scheduled, not completed, per tenant (0: no limit)
    max_samples: int = 4096  # measured prefills kept for refitting the cost model
    refit_every: int = 0  # refit the prefill model after this many new samples (0: off)

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_transfer_gain < 1.0:
            raise InvalidArgument(
                f"min_transfer_gain must be in [0, 1), got {self.min_transfer_gain}"
            )
        if (
            not 0 < self.stale_after_s < math.inf
            or self.max_samples < 1
            or self.refit_every < 0
            or self.max_pending_per_tenant < 0
        ):
            raise InvalidArgument(
                "stale_after_s must be finite and > 0, max_samples >= 1, refit_every >= 0 and "
                "max_pending_per_tenant >= 0"
            )


@dataclass(slots=True)
class _Pending:
    prefill_node: str
    prefill_generation: int
    decode_node: str
    decode_generation: int
    prompt_tokens: int
    reuse_tokens: int
    prefill_s: float
    context_tokens: int
    deadline: float
    tenant: str = ""
    prefilled: bool = False


class Scheduler:
    """Places requests on nodes of ``registry`` using its ``index`` and ``cost_model``."""

    def __init__(
        self,
        registry: Registry,
        cost_model: CostModel = DEFAULT_COST_MODEL,
        policy: str | SchedulingPolicy = "global-cache",
        config: SchedulerConfig = SchedulerConfig(),
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = None,
    ) -> None:
        self.registry = registry
        self.index = registry.index
        self.cost_model = cost_model
        self.policy = make_policy(policy, seed) if isinstance(policy, str) else policy
        self.config = config
        self.clock = clock
        self._pending: dict[str, _Pending] = {}
        self._per_tenant: dict[str, int] = {}  # pending requests of each tenant
        self._first_deadline = math.inf  # no pending entry expires before this (a lower bound)
        self._samples: deque[PrefillSample] = deque(maxlen=config.max_samples)
        self._new_samples = 0
        self._base_cost_model = cost_model  # what refits keep transfer / decode estimates from
        self._candidates: dict[str, tuple[int, list[NodeState], list[NodeState]]] = {}

    # ---- scheduling -----------------------------------------------------------------------

    def schedule(self, request: Request, now: float | None = None) -> Decision:
        """Choose nodes for ``request`` and enter it in the ledger. Raises ``SLORejected``,
        ``NoNodeAvailable``, or ``InvalidArgument`` for a malformed request. Cost:
        O(longest held prefix + prefill and decode candidates)."""
        now = self.clock() if now is None else now
        self._validate(request)
        cap = self.config.max_pending_per_tenant
        if cap and self._per_tenant.get(request.tenant, 0) >= cap:
            raise CapacityExhausted(
                f"{'tenant ' + echo(request.tenant) if request.tenant else 'the admin'} has "
                f"{cap} scheduled requests not completed; complete them (Complete) first"
            )
        prefill_nodes, decode_nodes = self._candidates_for(request.namespace)
        if request.exclude:
            prefill_nodes, decode_nodes = _without(request, prefill_nodes, decode_nodes)
        cost = self.cost_model
        n = request.prompt_tokens
        bt = request.block_tokens

        prefix = self.index.prefix_lengths(request.keys) if request.keys else {}
        best_blocks, best_source = 0, None
        for node_id, blocks in prefix.items():
            if blocks > best_blocks:
                best_blocks, best_source = blocks, self.registry.find(node_id)

        # NOTE: most nodes hold nothing of a request: price each distinct prefix length once.
        prefill_of: dict[int, float] = {}
        queued = cost.queued_prefill_seconds
        held = prefix.get
        locals_: list[int] = []
        queues: list[float] = []
        prefills: list[float] = []
        ttfts: list[float] = []
        for node in prefill_nodes:
            local = held(node.node_id, 0)
            prefill = prefill_of.get(local)
            if prefill is None:
                prefill = prefill_of[local] = cost.prefill_seconds(n, local * bt)
            queue = node.prefill_busy_until - now
            reported = node.load.queued_prefill_tokens
            if reported:
                q = queued(reported)
                if q > queue:
                    queue = q
            if queue < 0.0:
                queue = 0.0
            locals_.append(local)
            queues.append(queue)
            prefills.append(prefill)
            ttfts.append(queue + prefill)
        block_bytes = request.block_bytes or cost.kv_bytes(bt)
        chosen = self.policy.pick_prefill(
            PrefillContext(
                request,
                prefill_nodes,
                locals_,
                queues,
                prefills,
                ttfts,
                best_blocks,
                best_source,
                cost,
                block_bytes,
                1.0 - self.config.min_transfer_gain,
                prefill_of.get(best_blocks),
            )
        )

        context = n + request.output_tokens
        step = cost.decode_step_seconds
        tbts = []
        for node in decode_nodes:
            load = node.load
            requests, tokens = node.decode_requests, node.decode_tokens
            if load.running_decode_requests > requests:
                requests = load.running_decode_requests
            if load.running_decode_tokens > tokens:
                tokens = load.running_decode_tokens
            tbts.append(step(requests + 1, tokens + context))
        i = self.policy.pick_decode(tbts)
        node = decode_nodes[i]
        decode = DecodeOption(
            node=node,
            tbt_s=tbts[i],
            tokens=max(node.decode_tokens, node.load.running_decode_tokens) + context,
            requests=max(node.decode_requests, node.load.running_decode_requests) + 1,
        )

        if request.ttft_slo_s and chosen.ttft_s > request.ttft_slo_s:
            raise SLORejected(
                "TTFT",
                request.ttft_slo_s,
                chosen.ttft_s,
                f"node {chosen.node.node_id}: queue {chosen.queue_s * 1e3:.1f} ms, "
                f"transfer {chosen.transfer_s * 1e3:.1f} ms, prefill "
                f"{chosen.prefill_s * 1e3:.1f} ms of {n - chosen.reuse_blocks * bt}"
                f" uncached tokens",
            )
        if request.tbt_slo_s and decode.tbt_s > request.tbt_slo_s:
            raise SLORejected(
                "TBT",
                request.tbt_slo_s,
                decode.tbt_s,
                f"node {decode.node.node_id}: {decode.requests} requests, "
                f"{decode.tokens} tokens of context",
            )
        return self._admit(request, chosen, decode, best_blocks, block_bytes, now)

    def _admit(
        self,
        request: Request,
        chosen: PrefillOption,
        decode: DecodeOption,
        best_blocks: int,
        block_bytes: int,
        now: float,
    ) -> Decision:
        node = chosen.node
        start = max(now + chosen.transfer_s, node.prefill_busy_until, now)
        node.prefill_busy_until = start + chosen.prefill_s
        node.prefill_pending_s += chosen.prefill_s
        node.prefill_pending += 1
        context = request.prompt_tokens + request.output_tokens
        decode.node.decode_requests += 1
        decode.node.decode_tokens += context
        # NOTE: from now, not from the expected prefill end, which the caller's claims set.
        stale = self.config.stale_after_s
        deadline = now + min(node.prefill_busy_until - now, stale) + stale
        if deadline < self._first_deadline:
            self._first_deadline = deadline
        self._pending[request.request_id] = _Pending(
            prefill_node=node.node_id,
            prefill_generation=node.generation,
            decode_node=decode.node.node_id,
            decode_generation=decode.node.generation,
            prompt_tokens=request.prompt_tokens,
            reuse_tokens=chosen.reuse_blocks * request.block_tokens,
            prefill_s=chosen.prefill_s,
            context_tokens=context,
            deadline=deadline,
            tenant=request.tenant,
        )
        self._per_tenant[request.tenant] = self._per_tenant.get(request.tenant, 0) + 1

        transfer = None
        if chosen.source is not None and chosen.reuse_blocks > chosen.local_blocks:
            keys = tuple(request.keys[chosen.local_blocks : chosen.reuse_blocks])
            transfer = TransferPlan(
                request_id=request.request_id,
                namespace=request.namespace,
                src=chosen.source.descriptor,
                dst=node.descriptor,
                keys=keys,
                first_block=chosen.local_blocks,
                nbytes=len(keys) * block_bytes,
                est_seconds=chosen.transfer_s,
            )
        return Decision(
            request_id=request.request_id,
            policy=self.policy.name,
            prefill=node.descriptor,
            decode=decode.node.descriptor,
            total_blocks=len(request.keys),
            local_blocks=chosen.local_blocks,
            best_blocks=best_blocks,
            reuse_blocks=chosen.reuse_blocks,
            transfer=transfer,
            est_queue_s=chosen.queue_s,
            est_transfer_s=chosen.transfer_s,
            est_prefill_s=chosen.prefill_s,
            est_ttft_s=chosen.ttft_s,
            est_tbt_s=decode.tbt_s,
            decided_at=now,
        )

    def queue_seconds(self, node: NodeState, now: float) -> float:
        """Prefill work ahead of a new request on ``node``: the ledger's view or the node's
        own report (queued tokens from its last heartbeat), whichever is larger."""
        own = node.prefill_busy_until - now
        reported = self.cost_model.queued_prefill_seconds(node.load.queued_prefill_tokens)
        return max(own, reported, 0.0)

    # ---- the ledger -----------------------------------------------------------------------

    def prefill_done(
        self, request_id: str, now: float | None = None, measured_s: float | None = None
    ) -> None:
        """The prefill of ``request_id`` finished: its node's queue is re-anchored at ``now``.
        ``measured_s`` (the prefill's real duration) is kept as a cost-model sample.
        Idempotent; NotFound for an unknown request."""
        now = self.clock() if now is None else now
        pending = self._get(request_id)
        if measured_s is not None:
            if not measured_s >= 0:
                raise InvalidArgument(f"measured prefill seconds must be >= 0, got {measured_s}")
            self._samples.append(
                PrefillSample(pending.prompt_tokens, pending.reuse_tokens, measured_s)
            )
            self._new_samples += 1
            every = self.config.refit_every
            if every and self._new_samples >= every:
                self._refit_quietly()
        if pending.prefilled:
            return
        pending.prefilled = True
        node = self.registry.find(pending.prefill_node)
        if node is None or node.generation != pending.prefill_generation:
            return  # the node left (or re-registered with an empty ledger)
        node.prefill_pending = max(node.prefill_pending - 1, 0)
        node.prefill_pending_s = max(node.prefill_pending_s - pending.prefill_s, 0.0)
        if node.prefill_pending == 0:
            node.prefill_pending_s = 0.0  # no float drift when idle
        node.prefill_busy_until = now + node.prefill_pending_s

    def complete(self, request_id: str, now: float | None = None) -> None:
        """``request_id`` finished (or was abandoned): free its prefill and decode share."""
        now = self.clock() if now is None else now
        pending = self._get(request_id)
        if not pending.prefilled:
            self.prefill_done(request_id, now)
        del self._pending[request_id]
        left = self._per_tenant.get(pending.tenant, 1) - 1
        if left > 0:
            self._per_tenant[pending.tenant] = left
        else:
            self._per_tenant.pop(pending.tenant, None)
        node = self.registry.find(pending.decode_node)
        if node is None or node.generation != pending.decode_generation:
            return
        node.decode_requests = max(node.decode_requests - 1, 0)
        node.decode_tokens = max(node.decode_tokens - pending.context_tokens, 0)

    def expire_stale(self, now: float | None = None) -> list[str]:
        """Complete ledger entries nobody completed in time (``stale_after_s``): a lost client,
        or one that never meant to complete, must not inflate queue estimates forever."""
        now = self.clock() if now is None else now
        if not self._first_deadline < now:
            return []  # NOTE: the upkeep calls this 4x a second, under the conductor's lock
        stale = [rid for rid, p in self._pending.items() if p.deadline < now]
        for rid in stale:
            self.complete(rid, now)
        self._first_deadline = min((p.deadline for p in self._pending.values()), default=math.inf)
        return stale

    def pending(self) -> int:
        return len(self._pending)

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    # ---- cost model samples ---------------------------------------------------------------

    def samples(self) -> list[PrefillSample]:
        return list(self._samples)

    def refit_cost_model(self, min_samples: int = 16) -> bool:
        """Replace the prefill part of the cost model by a fit to the measured samples
        (``prefill_done(measured_s=...)``). False when there are too few samples."""
        if len(self._samples) < min_samples:
            return False
        self.cost_model = fit_prefill(self._samples, base=self._base_cost_model)
        self._new_samples = 0
        return True

    def _refit_quietly(self) -> None:
        """Automatic refit: samples that do not determine a model yet (all one size) keep the
        current model; that is logged, not raised at the caller reporting a prefill."""
        try:
            if self.refit_cost_model(min_samples=max(self.config.refit_every, 3)):
                m = self.cost_model
                log.info(
                    "prefill cost model refitted to %d samples: quad=%.3g lin=%.3g const=%.3g",
                    len(self._samples),
                    m.quad,
                    m.lin,
                    m.const,
                )  # type: ignore
        except InvalidArgument as e:
            self._new_samples = 0
            log.warning("prefill cost model not refitted: %s", e)

    # ---- helpers --------------------------------------------------------------------------

    def _get(self, request_id: str) -> _Pending:
        pending = self._pending.get(request_id)
        if pending is None:
            raise NotFound(
                f"request {echo(request_id)} is not scheduled "
                "(never, or already completed / expired)"
            )
        return pending

    def _validate(self, request: Request) -> None:
        if not request.request_id:
            raise InvalidArgument("request_id must be non-empty")
        if request.request_id in self._pending:
            raise InvalidArgument(
                f"request {echo(request.request_id)} is already scheduled; "
                "complete it first or use a new id"
            )
        if request.block_tokens <= 0:
            raise InvalidArgument(f"block_tokens must be positive, got {request.block_tokens}")
        if request.prompt_tokens <= 0:
            raise InvalidArgument(f"prompt_tokens must be positive, got {request.prompt_tokens}")
        if request.prompt_tokens < len(request.keys) * request.block_tokens:
            raise InvalidArgument(
                f"prompt_tokens {request.prompt_tokens} < {len(request.keys)} blocks x "
                f"{request.block_tokens} tokens: the prompt is longer than stated"
            )
        if request.output_tokens < 0:
            raise InvalidArgument(f"output_tokens must be >= 0, got {request.output_tokens}")
        for name in ("ttft_slo_s", "tbt_slo_s"):
            value = getattr(request, name)
            if value is not None and not value >= 0:
                raise InvalidArgument(f"{name} must be >= 0 (0: no SLO), got {value}")

    def _candidates_for(self, namespace: str) -> tuple[list[NodeState], list[NodeState]]:
        """Prefill and decode candidates serving ``namespace``, cached per registry version."""
        cached = self._candidates.get(namespace)
        if cached is not None and cached[0] == self.registry.version:
            return cached[1], cached[2]
        serving = [s for s in self.registry.nodes() if s.descriptor.serves(namespace)]
        nodes = [s for s in serving if not s.engine_down]
        prefill = [s for s in nodes if s.descriptor.role.prefills]
        decode = [s for s in nodes if s.descriptor.role.decodes]
        if not prefill or not decode:
            what = "prefill" if not prefill else "decode"
            scope = f" serving namespace {echo(namespace)}" if namespace else ""
            down = sorted(s.node_id for s in serving if s.engine_down)
            raise NoNodeAvailable(
                f"no live {what} node{scope} is registered; start one or wait for nodes to register"
                + (f" (the engines of {', '.join(down)} do not answer)" if down else "")
            )
        if len(self._candidates) > 64:
            self._candidates.clear()
        self._candidates[namespace] = (self.registry.version, prefill, decode)
        return prefill, decode


def _without(
    request: Request, prefill: list[NodeState], decode: list[NodeState]
) -> tuple[list[NodeState], list[NodeState]]:
    """The candidates less the nodes ``request`` excludes; ``NoNodeAvailable`` if none is left."""
    prefill = [s for s in prefill if s.node_id not in request.exclude]
    decode = [s for s in decode if s.node_id not in request.exclude]
    if not prefill or not decode:
        what = "prefill" if not prefill else "decode"
        raise NoNodeAvailable(
            f"no live {what} node is left besides the excluded {', '.join(sorted(request.exclude))}"
        )
    return prefill, decode
