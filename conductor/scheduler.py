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
   An ``aggregated`` request is placed on one node of role ``both`` that prefills and decodes
   it: the candidates are priced as in 2, their queue counting also one decode step of the
   batch they are decoding (a prefill shares the engine's steps with it), and the decode node is
   the chosen one. With ``disaggregate_above``, a request whose uncached suffix on that node is
   longer is placed disaggregated instead (a long prefill would stall the node's decodes).
4. ``SLORejected`` (gRPC ``RESOURCE_EXHAUSTED``) when the chosen TTFT or TBT misses the
   request's SLO; otherwise the choice is entered in the ledger and returned as a ``Decision``.

The ledger keeps queue estimates honest: ``prefill_done(request_id, now)`` re-anchors the node's
queue at ``now``, ``complete(request_id, now)`` frees the decode slot. Measured prefills, the
waits for transfer plans and the engines' decode steps calibrate the cost model
(``conductor.calibration``): a transfer is planned only when its measured cost pays.

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
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.errors import (
    CapacityExhausted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    echo,
)

from .calibration import Calibration
from .costmodel import DEFAULT_COST_MODEL, CostModel, PrefillSample
from .policies import (
    POLICIES,
    DecodeOption,
    PrefillContext,
    PrefillOption,
    SchedulingPolicy,
    make_policy,
)
from .registry import NodeDescriptor, NodeState, Registry, Role

__all__ = [
    "POLICIES",
    "Decision",
    "NoNodeAvailable",
    "PrefillContext",
    "Request",
    "SLORejected",
    "Scheduler",
    "SchedulerConfig",
    "SchedulingPolicy",
    "TransferPlan",
    "make_policy",
]

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
    aggregated: bool = False  # one node of role both prefills and decodes it
    disaggregate_above: int = 0  # aggregated, unless its uncached suffix is longer (0: never)
    policy: str = ""  # a policy of POLICIES for this request ("": the scheduler's)


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
    aggregated: bool = False  # placed on one node that prefills and decodes

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
    # refit the prefill model after this many new samples, the transfer and decode lines after
    # a quarter as many (0: off, the cost model stays as given)
    refit_every: int = 0

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
    transfer_bytes: int = 0  # of the plan made for it (0: none)
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
        self._policies = {self.policy.name: self.policy}  # a request may name another
        self._seed = seed
        self.config = config
        self.clock = clock
        self._pending: dict[str, _Pending] = {}
        self._per_tenant: dict[str, int] = {}  # pending requests of each tenant
        self._first_deadline = math.inf  # no pending entry expires before this (a lower bound)
        self.calibration = Calibration(cost_model, config.refit_every, config.max_samples)
        # namespace -> (registry version, prefill, decode, both-role candidates)
        self._candidates: dict[
            str, tuple[int, list[NodeState], list[NodeState], list[NodeState]]
        ] = {}

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
        policy = self._policy(request.policy)
        prefill_nodes, decode_nodes, both = self._candidates_for(
            request.namespace, request.aggregated
        )
        if request.exclude:
            prefill_nodes, decode_nodes, both = _without(request, prefill_nodes, decode_nodes, both)
        n = request.prompt_tokens
        prefix = self.index.prefix_lengths(request.keys) if request.keys else {}
        best_blocks, best_source = 0, None
        for node_id, blocks in prefix.items():
            if blocks > best_blocks:
                best_blocks, best_source = blocks, self.registry.find(node_id)
        block_bytes = request.block_bytes or self.cost_model.kv_bytes(request.block_tokens)
        context = n + request.output_tokens

        if request.aggregated:
            ctx = self._context(request, both, prefix, best_blocks, best_source, now, True)
            chosen = policy.pick_prefill(ctx)
            suffix = n - chosen.reuse_blocks * request.block_tokens
            limit = request.disaggregate_above
            if not (limit and suffix > limit):
                decode = self._decode_option(chosen.node, context)
                self._check_slos(request, chosen, decode)
                return self._admit(
                    request, policy, chosen, decode, best_blocks, block_bytes, now, True
                )
            # a long prefill would stall the node's decodes: placed disaggregated instead
        ctx = self._context(request, prefill_nodes, prefix, best_blocks, best_source, now, False)
        chosen = policy.pick_prefill(ctx)
        if len(decode_nodes) > 1:
            # disaggregated: the decode runs elsewhere than the prefill (a node of role both
            # may be either, not both, unless it is the only decode candidate)
            decode_nodes = [s for s in decode_nodes if s is not chosen.node]
        step = self.cost_model.decode_step_seconds
        tbts = [step(r + 1, t + context) for r, t in map(_decode_load, decode_nodes)]
        decode = self._decode_option(decode_nodes[policy.pick_decode(tbts)], context)
        self._check_slos(request, chosen, decode)
        return self._admit(request, policy, chosen, decode, best_blocks, block_bytes, now, False)

    def _context(
        self,
        request: Request,
        nodes: list[NodeState],
        prefix: dict[str, int],
        best_blocks: int,
        best_source: NodeState | None,
        now: float,
        aggregated: bool,
    ) -> PrefillContext:
        """Every candidate priced with the prefix it holds (``aggregated``: its queue also
        counts one decode step of what it decodes)."""
        cost = self.cost_model
        n = request.prompt_tokens
        bt = request.block_tokens
        # NOTE: most nodes hold nothing of a request: price each distinct prefix length once.
        prefill_of: dict[int, float] = {}
        queued = cost.queued_prefill_seconds
        step = cost.decode_step_seconds
        held = prefix.get
        locals_: list[int] = []
        queues: list[float] = []
        prefills: list[float] = []
        ttfts: list[float] = []
        for node in nodes:
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
            if aggregated:
                requests, tokens = _decode_load(node)
                if requests:
                    queue += step(requests, tokens)
            locals_.append(local)
            queues.append(queue)
            prefills.append(prefill)
            ttfts.append(queue + prefill)
        return PrefillContext(
            request,
            nodes,
            locals_,
            queues,
            prefills,
            ttfts,
            best_blocks,
            best_source,
            cost,
            request.block_bytes or cost.kv_bytes(bt),
            1.0 - self.config.min_transfer_gain,
            prefill_of.get(best_blocks),
        )

    def _decode_option(self, node: NodeState, context: int) -> DecodeOption:
        """``node`` decoding one more request of ``context`` tokens."""
        requests, tokens = _decode_load(node)
        return DecodeOption(
            node=node,
            requests=requests + 1,
            tokens=tokens + context,
            tbt_s=self.cost_model.decode_step_seconds(requests + 1, tokens + context),
        )

    def _check_slos(self, request: Request, chosen: PrefillOption, decode: DecodeOption) -> None:
        bt = request.block_tokens
        if request.ttft_slo_s and chosen.ttft_s > request.ttft_slo_s:
            raise SLORejected(
                "TTFT",
                request.ttft_slo_s,
                chosen.ttft_s,
                f"node {chosen.node.node_id}: queue {chosen.queue_s * 1e3:.1f} ms, "
                f"transfer {chosen.transfer_s * 1e3:.1f} ms, prefill "
                f"{chosen.prefill_s * 1e3:.1f} ms of "
                f"{request.prompt_tokens - chosen.reuse_blocks * bt} uncached tokens",
            )
        if request.tbt_slo_s and decode.tbt_s > request.tbt_slo_s:
            raise SLORejected(
                "TBT",
                request.tbt_slo_s,
                decode.tbt_s,
                f"node {decode.node.node_id}: {decode.requests} requests, "
                f"{decode.tokens} tokens of context",
            )

    def _policy(self, name: str) -> SchedulingPolicy:
        """The scheduler's policy, or the one a request names (made once, then kept)."""
        if not name:
            return self.policy
        policy = self._policies.get(name)
        if policy is None:
            policy = self._policies[name] = make_policy(name, self._seed)
        return policy

    def _admit(
        self,
        request: Request,
        policy: SchedulingPolicy,
        chosen: PrefillOption,
        decode: DecodeOption,
        best_blocks: int,
        block_bytes: int,
        now: float,
        aggregated: bool,
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
            self._pending[request.request_id].transfer_bytes = transfer.nbytes
        return Decision(
            request_id=request.request_id,
            policy=policy.name,
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
            aggregated=aggregated,
        )

    def queue_seconds(self, node: NodeState, now: float) -> float:
        """Prefill work ahead of a new request on ``node``: the ledger's view or the node's
        own report (queued tokens from its last heartbeat), whichever is larger."""
        own = node.prefill_busy_until - now
        reported = self.cost_model.queued_prefill_seconds(node.load.queued_prefill_tokens)
        return max(own, reported, 0.0)

    # ---- the ledger -----------------------------------------------------------------------

    def prefill_done(
        self,
        request_id: str,
        now: float | None = None,
        measured_s: float | None = None,
        transfer_s: float | None = None,
    ) -> None:
        """The prefill of ``request_id`` finished: its node's queue is re-anchored at ``now``.
        ``measured_s`` (the prefill's real duration) and ``transfer_s`` (the wait for its
        transfer plan) are kept as cost-model samples. Idempotent; NotFound for an unknown
        request."""
        now = self.clock() if now is None else now
        pending = self._get(request_id)
        for name, value in (("prefill", measured_s), ("transfer", transfer_s)):
            if value is not None and not value >= 0:
                raise InvalidArgument(f"measured {name} seconds must be >= 0, got {value}")
        if measured_s is not None:
            sample = PrefillSample(pending.prompt_tokens, pending.reuse_tokens, measured_s)
            if self.calibration.add_prefill(sample):
                self.cost_model = self.calibration.model()
        if transfer_s and pending.transfer_bytes:
            if self.calibration.add_transfer(pending.transfer_bytes, transfer_s):
                self.cost_model = self.calibration.model()
            pending.transfer_bytes = 0  # one sample per plan
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
        return list(self.calibration.prefills)

    def engine_samples(
        self,
        prefills: Sequence[PrefillSample] = (),
        decode_steps: Sequence[tuple[int, float]] = (),
    ) -> None:
        """Measurements read from an engine: prefills, and decode steps as ``(context tokens
        of the batch, seconds per step)``."""
        changed = False
        for sample in prefills:
            changed |= self.calibration.add_prefill(sample)
        for tokens, seconds in decode_steps:
            changed |= self.calibration.add_decode(tokens, seconds)
        if changed:
            self.cost_model = self.calibration.model()

    def refit_cost_model(self, min_samples: int = 16) -> bool:
        """Replace the prefill part of the cost model by a fit to the measured samples
        (``prefill_done(measured_s=...)``). False when there are too few samples."""
        if not self.calibration.refit_prefill(min_samples):
            return False
        self.cost_model = self.calibration.model()
        return True

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

    def _candidates_for(
        self, namespace: str, aggregated: bool = False
    ) -> tuple[list[NodeState], list[NodeState], list[NodeState]]:
        """Prefill, decode and both-role candidates serving ``namespace``, cached per registry
        version; ``NoNodeAvailable`` when the request cannot be placed (``aggregated``: no
        both-role node)."""
        cached = self._candidates.get(namespace)
        if cached is None or cached[0] != self.registry.version:
            serving = [s for s in self.registry.nodes() if s.descriptor.serves(namespace)]
            nodes = [s for s in serving if not s.engine_down]
            if len(self._candidates) > 64:
                self._candidates.clear()
            cached = self._candidates[namespace] = (
                self.registry.version,
                [s for s in nodes if s.descriptor.role.prefills],
                [s for s in nodes if s.descriptor.role.decodes],
                [s for s in nodes if s.descriptor.role is Role.BOTH],
            )
        _, prefill, decode, both = cached
        if aggregated and not both:
            what = "node of role both (aggregated serving)"
        elif not prefill or not decode:
            what = "prefill node" if not prefill else "decode node"
        else:
            return prefill, decode, both
        scope = f" serving namespace {echo(namespace)}" if namespace else ""
        down = sorted(
            s.node_id
            for s in self.registry.nodes()
            if s.engine_down and s.descriptor.serves(namespace)
        )
        raise NoNodeAvailable(
            f"no live {what}{scope} is registered; start one or wait for nodes to register"
            + (f" (the engines of {', '.join(down)} do not answer)" if down else "")
        )


def _decode_load(node: NodeState) -> tuple[int, int]:
    """Requests and context tokens ``node`` decodes: the ledger's view or its engine's report,
    whichever is larger."""
    load = node.load
    requests, tokens = node.decode_requests, node.decode_tokens
    if load.running_decode_requests > requests:
        requests = load.running_decode_requests
    if load.running_decode_tokens > tokens:
        tokens = load.running_decode_tokens
    return requests, tokens


def _without(
    request: Request, prefill: list[NodeState], decode: list[NodeState], both: list[NodeState]
) -> tuple[list[NodeState], list[NodeState], list[NodeState]]:
    """The candidates less the nodes ``request`` excludes; ``NoNodeAvailable`` if none is left."""
    prefill = [s for s in prefill if s.node_id not in request.exclude]
    decode = [s for s in decode if s.node_id not in request.exclude]
    both = [s for s in both if s.node_id not in request.exclude]
    if request.aggregated and not both:
        what = "node of role both"
    elif not prefill or not decode:
        what = "prefill node" if not prefill else "decode node"
    else:
        return prefill, decode, both
    raise NoNodeAvailable(
        f"no live {what} is left besides the excluded {', '.join(sorted(request.exclude))}"
    )
