"""``kvcache bench schedule``: the conductor's scheduling policies on a trace (Mooncake Fig. 5).

A discrete-event simulation in simulated time drives the REAL conductor scheduling core
(``conductor.Scheduler`` over a ``Registry`` and ``GlobalIndex``, in-process, no gRPC) against
simulated nodes. Each node has its own real kvstore cache (``TieredStore``, metadata only) whose
stored / evicted events feed the conductor's global index, exactly as a node server's would.

Per request:

1. **arrive**: ``Scheduler.schedule`` picks a prefill node (and maybe a transfer plan) and a
   decode node, or rejects it (``SLORejected``: counted). The prefill node pins the prefix it
   holds while the request waits; a planned transfer pins the source blocks.
2. **transfer done** (global-cache only): the fetched blocks are written into the prefill node's
   cache and pinned there until the prefill ends.
3. **prefill**: each prefill node runs its queue first-come first-served (as the scheduler's own
   ledger assumes). At start the node looks its cache up for the prefix it really holds; the
   prefill takes ``cost_model.prefill_seconds(prompt, prefix)`` and then stores the prompt's new
   blocks. TTFT = prefill end - arrival. ``Scheduler.prefill_done`` re-anchors the queue.
4. **decode**: the KV cache moves to the decode node (``transfer_seconds``), which stores the
   prompt blocks in its own cache (a global-cache source too), decodes ``output_length`` tokens
   at ``decode_step_seconds`` of its batch at join time, and ``Scheduler.complete`` ends it.

The cost model is the conductor's ``FlopsCostModel`` (Mooncake Table 1: LLaMA3-70B on 8xA800)
at the ``--mfu`` given; the same model prices the scheduler's estimates and the simulated
execution, so differences between policies come from placement, queueing and cache contents.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from bench.report import (
    Column,
    Progress,
    human_count,
    parse_count,
    plot_bars,
    print_table,
    write_json,
)
from conductor import (
    FlopsCostModel,
    GlobalIndex,
    NodeDescriptor,
    Registry,
    Request,
    Role,
    Scheduler,
    SchedulerConfig,
    SLORejected,
)
from conductor.costmodel import CostModel, with_mfu
from conductor.scheduler import POLICIES as SCHEDULING_POLICIES
from kvstore.errors import CapacityExhausted
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.policy import POLICIES as EVICTION_POLICIES
from kvstore.store import StoreConfig, TieredStore

from .parallel import Step, fork_map
from .trace import DEFAULT_TRACE, Trace, TraceError, add_trace_args, describe, trace_from_args

# Mooncake (FAST'25) Fig. 5: average TTFT on the conversation trace with 16 prefill nodes.
PAPER_FIG5_AVG_TTFT_S = {"random": 19.65, "load": 5.27, "local-cache": 3.58, "global-cache": 3.07}
PAPER_PREFILL_NODES = 16
POLICY_ORDER = ("random", "load", "local-cache", "global-cache")

DEFAULT_MFU = 0.3
DEFAULT_CAPACITY = "3M"
_FOREVER_S = 1e12  # lease TTLs and registry leases never run out in simulated time
_PROGRESS_EVERY = 1000


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """The simulated cluster. Capacities are per node, in tokens."""

    prefill_nodes: int = 16
    decode_nodes: int = 16
    capacity_tokens: int = 3_000_000
    decode_capacity_tokens: int = 3_000_000
    eviction: str = "lru"
    mfu: float = DEFAULT_MFU
    ttft_slo_s: float = 0.0  # 0: no SLO
    tbt_slo_s: float = 0.0
    min_transfer_gain: float = SchedulerConfig.min_transfer_gain
    speedup: float = 1.0  # trace time is divided by this
    seed: int = 0

    def check(self, block_tokens: int) -> None:
        if self.prefill_nodes < 1 or self.decode_nodes < 1:
            raise ValueError("the cluster needs at least one prefill and one decode node")
        if self.capacity_tokens < block_tokens:
            raise ValueError(
                f"--capacity {self.capacity_tokens} tokens is less than one "
                f"{block_tokens}-token block"
            )
        if self.decode_capacity_tokens < 0:
            raise ValueError("--decode-capacity must be >= 0")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown eviction policy {self.eviction!r}; choose from "
                f"{sorted(EVICTION_POLICIES)}"
            )
        if not 0 < self.mfu <= 1:
            raise ValueError(f"--mfu must be in (0, 1], got {self.mfu}")
        if self.ttft_slo_s < 0 or self.tbt_slo_s < 0:
            raise ValueError("SLOs must be >= 0 seconds (0: none)")
        if not self.speedup > 0:
            raise ValueError(f"--speedup must be positive, got {self.speedup}")

    def cost_model(self) -> FlopsCostModel:
        return with_mfu(FlopsCostModel(), self.mfu)


@dataclass(frozen=True, kw_only=True)
class PolicyResult:
    policy: str
    requests: int
    admitted: int
    rejected_ttft: int
    rejected_tbt: int
    ttft_avg_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    queue_avg_s: float
    tbt_avg_s: float
    hit_rate: float  # prompt tokens reused / prompt tokens (admitted requests)
    fetched_share: float  # of the reused tokens, the share fetched from another node
    planned_prefix_lost: int  # requests whose cache held less at start than planned
    transfers: int
    transfer_bytes: int
    prefill_gpu_s: float  # node-seconds of prefill computed
    prefill_gpu_s_no_cache: float  # the same prompts with no cache at all
    est_ttft_error_s: float  # mean |scheduler's TTFT estimate - simulated TTFT|
    fetch_dropped: int  # fetched blocks that found the target pinned full
    store_skipped: int  # prefills whose new blocks found the cache pinned full
    schedule_us: float  # mean wall time of one Scheduler.schedule call
    makespan_s: float
    wall_s: float

    @property
    def rejected(self) -> int:
        return self.rejected_ttft + self.rejected_tbt


@dataclass(slots=True)
class _Job:
    index: int
    request_id: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    keys: list[BlockKey]
    prefill: "_PrefillNode | None" = None
    decode: "_DecodeNode | None" = None
    est_ttft_s: float = 0.0
    local_blocks: int = 0  # prefix the prefill node held when scheduled
    planned_blocks: int = 0  # prefix it should hold at start (local + fetched)
    ready: bool = True
    pins: list[tuple[TieredStore, int]] = field(default_factory=list)  # held until prefill end
    fetch_pin: tuple[TieredStore, int] | None = None  # source blocks, held while transferring
    hits: int = 0
    start: float = 0.0
    prefill_s: float = 0.0
    context_tokens: int = 0


@dataclass(slots=True, eq=False)
class _PrefillNode:
    node_id: str
    store: TieredStore
    pages: int
    queue: deque = field(default_factory=deque)
    busy: bool = False


@dataclass(slots=True, eq=False)
class _DecodeNode:
    node_id: str
    store: TieredStore | None
    pages: int
    requests: int = 0
    tokens: int = 0


# Event kinds; at equal times, work finishing is handled before new arrivals.
_TRANSFER_DONE, _PREFILL_END, _DECODE_JOIN, _COMPLETE, _ARRIVE = range(5)


class ClusterSim:
    """One policy on one trace: the real scheduler, simulated nodes, simulated time."""

    def __init__(
        self, trace: Trace, keys: Sequence[Sequence[BlockKey]], spec: ClusterSpec, policy: str
    ) -> None:
        self.trace = trace
        self.keys = keys
        self.spec = spec
        self.policy = policy
        self.bt = trace.block_tokens
        self.cost: CostModel = spec.cost_model()
        self.now = 0.0
        self.index = GlobalIndex()
        self.registry = Registry(self.index, lease_s=_FOREVER_S)
        self.scheduler = Scheduler(
            self.registry,
            cost_model=self.cost,
            policy=policy,
            config=SchedulerConfig(min_transfer_gain=spec.min_transfer_gain),
            clock=self._clock,
            seed=spec.seed,
        )
        layout = KVLayout(
            model="bench-schedule", num_layers=1, kv_heads=1, head_dim=1, block_tokens=self.bt
        )
        self._layout = layout
        pages = spec.capacity_tokens // self.bt
        self.prefill: dict[str, _PrefillNode] = {}
        for i in range(spec.prefill_nodes):
            node = _PrefillNode(f"prefill-{i}", self._store(pages), pages)
            self.prefill[node.node_id] = node
            self.registry.register(NodeDescriptor(node_id=node.node_id, role=Role.PREFILL), 0.0)
        dpages = spec.decode_capacity_tokens // self.bt
        self.decode: dict[str, _DecodeNode] = {}
        for i in range(spec.decode_nodes):
            node = _DecodeNode(f"decode-{i}", self._store(dpages) if dpages else None, dpages)
            self.decode[node.node_id] = node
            self.registry.register(NodeDescriptor(node_id=node.node_id, role=Role.DECODE), 0.0)
        self._events: list[tuple[float, int, int, _Job]] = []
        self._seq = itertools.count()
        # Outcomes.
        self.ttft: list[float] = []
        self.queue_wait: list[float] = []
        self.tbt: list[float] = []
        self.est_error: list[float] = []
        self.rejected = {"TTFT": 0, "TBT": 0}
        self.reused_tokens = self.fetched_tokens = self.prompt_tokens = 0
        self.planned_lost = self.transfers = self.transfer_bytes = 0
        self.fetch_dropped = self.store_skipped = 0
        self.gpu_s = self.gpu_s_no_cache = 0.0
        self.schedule_wall_s = 0.0
        self.decisions = 0

    def _clock(self) -> float:
        return self.now

    def _store(self, pages: int) -> TieredStore:
        config = StoreConfig(
            dram_pages=pages,
            dram_policy=self.spec.eviction,
            metadata_only=True,
            lease_ttl_s=_FOREVER_S,
            clock=self._clock,
            max_events=1 << 16,
        )
        return TieredStore(self._layout, config)

    def _publish(self, node_id: str, store: TieredStore) -> None:
        """Feed a node's cache events to the global index, as its node server would."""
        self.index.apply_events(node_id, store.take_events())

    def _push(self, t: float, kind: int, job: _Job) -> None:
        heapq.heappush(self._events, (t, kind, next(self._seq), job))

    # ---- the run ------------------------------------------------------------------------

    def run(self, progress: Step | None = None) -> PolicyResult:
        wall = time.perf_counter()
        reqs = self.trace.requests
        t0 = reqs[0].timestamp_ms if reqs else 0.0
        # The trace is in timestamp order already (load_trace sorts it).
        arrivals_iter = (
            ((r.timestamp_ms - t0) / 1000.0 / self.spec.speedup, i) for i, r in enumerate(reqs)
        )
        handlers = {
            _TRANSFER_DONE: self._transfer_done,
            _PREFILL_END: self._prefill_end,
            _DECODE_JOIN: self._decode_join,
            _COMPLETE: self._complete,
        }
        next_arrival = next(arrivals_iter, None)
        done = 0
        try:
            while next_arrival is not None or self._events:
                # Arrivals are merged lazily: the heap only holds work in flight.
                if next_arrival is not None and (
                    not self._events or next_arrival[0] < self._events[0][0]
                ):
                    self.now, i = next_arrival
                    self._arrive(i)
                    next_arrival = next(arrivals_iter, None)
                    done += 1
                    if progress is not None and done % _PROGRESS_EVERY == 0:
                        progress(_PROGRESS_EVERY)
                    continue
                t, kind, _, job = heapq.heappop(self._events)
                self.now = t
                handlers[kind](job)
            if progress is not None and done % _PROGRESS_EVERY:
                progress(done % _PROGRESS_EVERY)
            return self._result(time.perf_counter() - wall)
        finally:
            for node in self.prefill.values():
                node.store.close()
            for node in self.decode.values():
                if node.store is not None:
                    node.store.close()

    def _arrive(self, i: int) -> None:
        req = self.trace.requests[i]
        if req.input_length <= 0:
            return
        full = req.input_length // self.bt
        job = _Job(
            index=i,
            request_id=f"r{i}",
            arrival=self.now,
            prompt_tokens=req.input_length,
            output_tokens=req.output_length,
            keys=list(self.keys[i][:full]),
        )
        request = Request(
            request_id=job.request_id,
            keys=job.keys,
            prompt_tokens=req.input_length,
            block_tokens=self.bt,
            output_tokens=req.output_length,
            ttft_slo_s=self.spec.ttft_slo_s or None,
            tbt_slo_s=self.spec.tbt_slo_s or None,
        )
        wall = time.perf_counter()
        try:
            decision = self.scheduler.schedule(request, now=self.now)
        except SLORejected as e:
            self.rejected[e.slo] += 1
            return
        finally:
            self.schedule_wall_s += time.perf_counter() - wall
            self.decisions += 1
        node = self.prefill[decision.prefill_node]
        job.prefill = node
        job.decode = self.decode[decision.decode_node]
        job.est_ttft_s = decision.est_ttft_s
        job.local_blocks = decision.local_blocks
        job.planned_blocks = decision.reuse_blocks
        if decision.local_blocks:
            # The engine holds the prefix it was chosen for while the request waits.
            lease = node.store.acquire(job.keys[: decision.local_blocks])
            job.pins.append((node.store, lease.lease_id))
        plan = decision.transfer
        if plan is not None:
            src = self.prefill.get(plan.src.node_id) or self.decode[plan.src.node_id]
            lease = src.store.acquire(list(plan.keys))
            job.fetch_pin = (src.store, lease.lease_id)
            job.ready = False
            self.transfers += 1
            self.transfer_bytes += plan.nbytes
            self._push(self.now + decision.est_transfer_s, _TRANSFER_DONE, job)
        node.queue.append(job)
        self._try_start(node)

    def _transfer_done(self, job: _Job) -> None:
        """The messenger has copied the planned blocks: publish them on the prefill node and
        keep them pinned for this request."""
        src_store, lease_id = job.fetch_pin
        src_store.release(lease_id)
        job.fetch_pin = None
        node = job.prefill
        store = node.store
        keys = job.keys[: job.planned_blocks]
        end = min(len(keys), node.pages)
        try:
            lease = store.allocate(keys[:end])
            store.commit(lease.lease_id)
            pin = store.acquire(keys[:end])
            job.pins.append((store, pin.lease_id))
        except CapacityExhausted:
            self.fetch_dropped += 1
        self._publish(node.node_id, store)
        job.ready = True
        self._try_start(node)

    def _try_start(self, node: _PrefillNode) -> None:
        if node.busy or not node.queue or not node.queue[0].ready:
            return
        job = node.queue.popleft()
        node.busy = True
        job.start = self.now
        job.hits = node.store.lookup(job.keys).hits
        job.prefill_s = self.cost.prefill_seconds(job.prompt_tokens, job.hits * self.bt)
        self._push(self.now + job.prefill_s, _PREFILL_END, job)

    def _prefill_end(self, job: _Job) -> None:
        node = job.prefill
        for store, lease_id in job.pins:
            store.release(lease_id)
        job.pins.clear()
        end = min(len(job.keys), node.pages)
        if job.hits < end:
            try:
                lease = node.store.allocate(job.keys[job.hits : end])
                node.store.commit(lease.lease_id)
            except CapacityExhausted:
                self.store_skipped += 1
        self._publish(node.node_id, node.store)
        self.scheduler.prefill_done(job.request_id, now=self.now, measured_s=job.prefill_s)
        ttft = self.now - job.arrival
        self.ttft.append(ttft)
        self.queue_wait.append(job.start - job.arrival)
        self.est_error.append(abs(job.est_ttft_s - ttft))
        reused = job.hits * self.bt
        self.reused_tokens += reused
        if job.planned_blocks > job.local_blocks:
            self.fetched_tokens += (
                max(min(job.hits, job.planned_blocks) - job.local_blocks, 0) * self.bt
            )
        self.prompt_tokens += job.prompt_tokens
        self.planned_lost += job.hits < job.planned_blocks
        self.gpu_s += job.prefill_s
        self.gpu_s_no_cache += self.cost.prefill_seconds(job.prompt_tokens, 0)
        node.busy = False
        self._try_start(node)
        kv = self.cost.kv_bytes(job.prompt_tokens)
        self._push(self.now + self.cost.transfer_seconds(kv), _DECODE_JOIN, job)

    def _decode_join(self, job: _Job) -> None:
        node = job.decode
        if node.store is not None:
            end = min(len(job.keys), node.pages)
            if end:
                try:
                    lease = node.store.allocate(job.keys[:end])
                    node.store.commit(lease.lease_id)
                except CapacityExhausted:
                    self.store_skipped += 1
                self._publish(node.node_id, node.store)
        job.context_tokens = job.prompt_tokens + job.output_tokens
        node.requests += 1
        node.tokens += job.context_tokens
        tbt = self.cost.decode_step_seconds(node.requests, node.tokens)
        self.tbt.append(tbt)
        self._push(self.now + job.output_tokens * tbt, _COMPLETE, job)

    def _complete(self, job: _Job) -> None:
        node = job.decode
        node.requests -= 1
        node.tokens -= job.context_tokens
        self.scheduler.complete(job.request_id, now=self.now)

    def _result(self, wall_s: float) -> PolicyResult:
        ttft = np.asarray(self.ttft, dtype=np.float64)

        def pct(q: float) -> float:
            return float(np.percentile(ttft, q)) if ttft.size else 0.0

        def mean(values: list[float]) -> float:
            return float(np.mean(values)) if values else 0.0

        return PolicyResult(
            policy=self.policy,
            requests=len(self.trace),
            admitted=len(self.ttft),
            rejected_ttft=self.rejected["TTFT"],
            rejected_tbt=self.rejected["TBT"],
            ttft_avg_s=mean(self.ttft),
            ttft_p50_s=pct(50),
            ttft_p90_s=pct(90),
            ttft_p99_s=pct(99),
            queue_avg_s=mean(self.queue_wait),
            tbt_avg_s=mean(self.tbt),
            hit_rate=self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            fetched_share=(self.fetched_tokens / self.reused_tokens if self.reused_tokens else 0.0),
            planned_prefix_lost=self.planned_lost,
            transfers=self.transfers,
            transfer_bytes=self.transfer_bytes,
            prefill_gpu_s=self.gpu_s,
            prefill_gpu_s_no_cache=self.gpu_s_no_cache,
            est_ttft_error_s=mean(self.est_error),
            fetch_dropped=self.fetch_dropped,
            store_skipped=self.store_skipped,
            schedule_us=1e6 * self.schedule_wall_s / self.decisions if self.decisions else 0.0,
            makespan_s=self.now,
            wall_s=wall_s,
        )


# ---- many policies ------------------------------------------------------------------------------


def offered_load(trace: Trace, spec: ClusterSpec) -> float:
    """Prefill node-seconds the trace asks for with no cache at all, per node-second of the
    (sped-up) trace: the utilisation the prefill nodes would see without prefix caching."""
    duration = trace.duration_s / spec.speedup
    if duration <= 0:
        return math.inf if len(trace) else 0.0
    cost = spec.cost_model()
    work = sum(
        cost.prefill_seconds(r.input_length, 0) for r in trace.requests if r.input_length > 0
    )
    return work / (spec.prefill_nodes * duration)


def simulate(
    trace: Trace,
    keys: Sequence[Sequence[BlockKey]],
    spec: ClusterSpec,
    policies: Sequence[str],
    jobs: int = 1,
    progress: Progress | None = None,
) -> list[PolicyResult]:
    """Run every policy on the same trace and cluster (one forked worker per policy)."""
    spec.check(trace.block_tokens)

    def one(policy: str, step: Step) -> PolicyResult:
        return ClusterSim(trace, keys, spec, policy).run(step)

    return fork_map(one, policies, jobs, progress.update if progress is not None else None)


# ---- the command --------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    add_trace_args(parser)
    c = parser.add_argument_group("cluster")
    c.add_argument("--prefill-nodes", type=int, default=ClusterSpec.prefill_nodes)
    c.add_argument("--decode-nodes", type=int, default=ClusterSpec.decode_nodes)
    c.add_argument(
        "--capacity",
        default=DEFAULT_CAPACITY,
        help="KV cache per prefill node, tokens, k/M/G suffixes (default: "
        "%(default)s = ~983 GB of LLaMA3-70B KV, one 8xA800 host's DRAM)",
    )
    c.add_argument(
        "--decode-capacity",
        default=None,
        help="KV cache per decode node, tokens (default: same as --capacity; 0: "
        "decode nodes cache nothing)",
    )
    c.add_argument("--eviction", default="lru", choices=sorted(EVICTION_POLICIES))
    c.add_argument(
        "--mfu",
        type=float,
        default=DEFAULT_MFU,
        help="model FLOPs utilisation of prefill (default: %(default)s)",
    )
    c.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="replay the trace this many times faster than recorded (default: 1)",
    )
    c.add_argument(
        "--target-load",
        type=float,
        default=None,
        help="instead of --speedup: compress time so that the prefill nodes would be "
        "this busy with no cache (e.g. 0.9)",
    )
    s = parser.add_argument_group("scheduling")
    s.add_argument(
        "--policies",
        default=",".join(POLICY_ORDER),
        help=f"comma-separated, from {sorted(SCHEDULING_POLICIES)} (default: %(default)s)",
    )
    s.add_argument(
        "--ttft-slo",
        type=float,
        default=0.0,
        help="reject requests whose estimated TTFT exceeds this (s; 0: no SLO)",
    )
    s.add_argument(
        "--tbt-slo",
        type=float,
        default=0.0,
        help="reject requests whose estimated TBT exceeds this (s; 0: no SLO)",
    )
    s.add_argument(
        "--min-transfer-gain",
        type=float,
        default=SchedulerConfig.min_transfer_gain,
        help="global-cache fetches only when it cuts TTFT by this fraction (default: %(default)s)",
    )
    r = parser.add_argument_group("run")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument(
        "--jobs",
        type=int,
        default=min(os.cpu_count() or 1, 4),
        help="worker processes, one policy each (default: %(default)s)",
    )
    r.add_argument("--out", help="write the results as JSON here")
    r.add_argument("--plot", help="write the TTFT bar chart PNG here (default: next to --out)")
    r.add_argument("--no-progress", action="store_true")


def _spec(args: argparse.Namespace, trace: Trace) -> ClusterSpec:
    capacity = parse_count(args.capacity)
    decode_capacity = (
        capacity if args.decode_capacity is None else parse_count(args.decode_capacity)
    )
    spec = ClusterSpec(
        prefill_nodes=args.prefill_nodes,
        decode_nodes=args.decode_nodes,
        capacity_tokens=capacity,
        decode_capacity_tokens=decode_capacity,
        eviction=args.eviction,
        mfu=args.mfu,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        min_transfer_gain=args.min_transfer_gain,
        speedup=args.speedup,
        seed=args.seed,
    )
    spec.check(trace.block_tokens)
    if args.target_load is not None:
        if not args.target_load > 0:
            raise ValueError(f"--target-load must be positive, got {args.target_load}")
        base = offered_load(trace, replace(spec, speedup=1.0))
        if not math.isfinite(base) or base <= 0:
            raise ValueError("--target-load needs a trace that spans some time")
        spec = replace(spec, speedup=args.target_load / base)
    return spec


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in SCHEDULING_POLICIES]
    if not names or unknown:
        raise ValueError(
            f"--policies: unknown {unknown or 'empty list'}; choose from "
            f"{sorted(SCHEDULING_POLICIES)}"
        )
    return names


def notes(trace: Trace, spec: ClusterSpec, load: float) -> list[str]:
    """The modelling choices, printed under the table and kept in the JSON."""
    cost = spec.cost_model()
    m, hw = cost.model, cost.hardware
    avg = trace.total_input_tokens / len(trace) if len(trace) else 0
    kv_gb = cost.kv_bytes(spec.capacity_tokens) / 1e9
    return [
        f"cost model: Mooncake Table 1, LLaMA3-70B (l={m.layers}, d={m.hidden}, a={m.a:g}, "
        f"b={m.b:g}, gqa={m.gqa}, {m.elem_bytes}-byte elements) on {hw.gpus}x"
        f"{hw.flops_per_gpu / 1e12:g} TFLOPS, NIC {hw.nic_gbps:g} Gbps at "
        f"{hw.nic_efficiency:.0%} efficiency.",
        f"MFU {spec.mfu:.2f}: prefill of the trace's average prompt ({avg:,.0f} tokens) takes "
        f"{cost.prefill_seconds(int(avg), 0):.2f} s with no cache. 8-way tensor parallel "
        "prefill of long prompts loses time to all-reduces and attention kernels below peak; "
        "0.3 is a conservative figure for that (the conductor's default is 0.5). MFU scales "
        "every prefill time, and with it the load the trace puts on the nodes.",
        f"capacity: {human_count(spec.capacity_tokens)} tokens per prefill node "
        f"(= {kv_gb:,.0f} GB of KV at {m.kv_bytes_per_token:,} B/token, about the DRAM one "
        "8xA800 host can lend to the cache) and "
        f"{human_count(spec.decode_capacity_tokens)} per decode node; "
        f"{spec.prefill_nodes} prefill nodes pool "
        f"{human_count(spec.prefill_nodes * spec.capacity_tokens)} tokens "
        "(see 'kvcache bench hitrate': one such node alone reaches well under half the "
        "theoretical hit rate, the pool nearly all of it).",
        f"load: trace replayed {spec.speedup:.3g}x faster than recorded; with no cache the "
        f"prefill nodes would be {load:.0%} busy. TTFT = queueing + fetch + prefill of the "
        "uncached suffix on a first-come first-served node (decode and the KV move to decode "
        "are simulated but not part of TTFT).",
        "paper column: Mooncake Fig. 5 (conversation trace, 16 prefill nodes). Their cost "
        "model and load are not fully published: compare orderings and ratios, not seconds.",
    ]


COLUMNS = [
    Column("policy", "policy"),
    Column("ttft_avg_s", "avg TTFT s", "{:.2f}"),
    Column("ttft_p90_s", "p90 TTFT s", "{:.2f}"),
    Column("paper_avg_s", "paper avg s", "{:.2f}"),
    Column("ratio", "avg / global", "{:.2f}"),
    Column("paper_ratio", "paper ratio", "{:.2f}"),
    Column("hit_rate", "hit rate", "{:.1%}"),
    Column("fetched_share", "fetched", "{:.1%}"),
    Column("gpu_h", "prefill GPU h", "{:.2f}"),
    Column("gpu_vs_no_cache", "vs no cache", "{:.1%}"),
    Column("rejected", "rejected", "{:,}"),
    Column("transfer_gb", "xfer GB", "{:,.0f}"),
    Column("queue_avg_s", "avg queue s", "{:.2f}"),
    Column("schedule_us", "sched us", "{:.0f}"),
]


def rows(results: Sequence[PolicyResult]) -> list[dict]:
    by_name = {r.policy: r for r in results}
    ref = by_name.get("global-cache")
    out = []
    for r in results:
        paper = PAPER_FIG5_AVG_TTFT_S.get(r.policy)
        out.append(
            {
                "policy": r.policy,
                "ttft_avg_s": r.ttft_avg_s,
                "ttft_p90_s": r.ttft_p90_s,
                "paper_avg_s": paper,
                "ratio": r.ttft_avg_s / ref.ttft_avg_s if ref and ref.ttft_avg_s else None,
                "paper_ratio": (
                    paper / PAPER_FIG5_AVG_TTFT_S["global-cache"] if paper is not None else None
                ),
                "hit_rate": r.hit_rate,
                "fetched_share": r.fetched_share,
                "gpu_h": r.prefill_gpu_s / 3600.0,
                "gpu_vs_no_cache": (
                    r.prefill_gpu_s / r.prefill_gpu_s_no_cache if r.prefill_gpu_s_no_cache else None
                ),
                "rejected": r.rejected,
                "transfer_gb": r.transfer_bytes / 1e9,
                "queue_avg_s": r.queue_avg_s,
                "schedule_us": r.schedule_us,
            }
        )
    return out


def run(args: argparse.Namespace) -> int:
    try:
        trace = trace_from_args(args)
        if trace.arrivals == "none" and len(trace):
            raise ValueError(
                f"{trace.source} has no timestamps and scheduling needs arrival times: give "
                "--rate REQUESTS_PER_S for Poisson arrivals"
            )
        policies = _policies(args.policies)
        spec = _spec(args, trace)
    except (TraceError, ValueError) as e:
        print(f"kvcache bench schedule: {e}", file=sys.stderr)
        return 2
    if not len(trace):
        print(
            f"kvcache bench schedule: the trace {trace.source} has no requests; nothing to replay",
            file=sys.stderr,
        )
        return 1
    print(describe(trace))
    print(
        f"cluster: {spec.prefill_nodes} prefill + {spec.decode_nodes} decode nodes, "
        f"{human_count(spec.capacity_tokens)} tokens of {spec.eviction} cache per prefill node, "
        f"MFU {spec.mfu:g}, speedup {spec.speedup:.3g}x"
        + (f", TTFT SLO {spec.ttft_slo_s:g} s" if spec.ttft_slo_s else "")
        + (f", TBT SLO {spec.tbt_slo_s * 1e3:g} ms" if spec.tbt_slo_s else "")
    )
    start = time.perf_counter()
    keys = trace.block_keys()
    load = offered_load(trace, spec)
    progress = Progress(len(trace) * len(policies), "schedule", enabled=not args.no_progress)
    results = simulate(trace, keys, spec, policies, args.jobs, progress)
    elapsed = progress.finish(f"{len(policies)} policies")
    table = rows(results)
    print_table(
        table,
        COLUMNS,
        title=(f"scheduling policies (real conductor Scheduler, simulated time; {elapsed:.1f} s)"),
    )
    comparable = spec.prefill_nodes == PAPER_PREFILL_NODES and os.path.basename(
        trace.source
    ) == os.path.basename(DEFAULT_TRACE)
    if not comparable:
        print(
            "NOTE: the paper column is for the conversation trace on 16 prefill nodes; this "
            "run differs"
        )
    explained = notes(trace, spec, load)
    for line in explained:
        print(f"- {line}")
    doc = {
        "command": "schedule",
        "trace": {
            "source": trace.source,
            "requests": len(trace),
            "blocks": trace.total_blocks,
            "block_tokens": trace.block_tokens,
            "input_tokens": trace.total_input_tokens,
            "duration_s": trace.duration_s,
        },
        "cluster": spec,
        "offered_load": load,
        "paper_fig5_avg_ttft_s": PAPER_FIG5_AVG_TTFT_S,
        "paper_comparable": comparable,
        "notes": explained,
        "results": [{**row, "detail": r} for r, row in zip(results, table)],
        "seconds": time.perf_counter() - start,
    }
    if args.out:
        write_json(args.out, doc)
        print(f"wrote {args.out}")
    plot_path = args.plot or (os.path.splitext(args.out)[0] + ".png" if args.out else None)
    if plot_path:
        groups = {
            "ours: avg TTFT": [r.ttft_avg_s for r in results],
            "ours: p90 TTFT": [r.ttft_p90_s for r in results],
        }
        if any(r.policy in PAPER_FIG5_AVG_TTFT_S for r in results):
            groups["Mooncake Fig. 5: avg TTFT"] = [
                PAPER_FIG5_AVG_TTFT_S.get(r.policy) for r in results
            ]
        plot_bars(
            plot_path,
            [r.policy for r in results],
            groups,
            title=f"TTFT by scheduling policy ({spec.prefill_nodes} prefill nodes, "
            f"{human_count(spec.capacity_tokens)} tokens each)",
            ylabel="seconds",
        )
        print(f"wrote {plot_path}")
    return 0
