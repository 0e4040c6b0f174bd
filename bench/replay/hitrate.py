"""``kvcache bench hitrate``: prefix-cache hit rate vs capacity on a trace (Mooncake Fig. 9).

Every request replays through the real kvstore (``TieredStore`` with ``metadata_only=True``: the
index, tiers, leases and eviction policies, no page bytes) in timestamp order:

1. ``lookup`` the request's chained block keys: the cached prefix is the hit (an access for the
   eviction policy);
2. ``acquire`` + ``release`` the hit prefix, as a reader would (an SSD hit is promoted to DRAM);
3. ``allocate`` + ``commit`` the missing blocks, as the prefill engine would after computing them
   (the lease names the whole chain, hit prefix included: the store keeps that prefix while it
   makes room, and the ``prefix`` policy learns each new block's parent from it).

With both ``lru`` and ``prefix`` in ``--policies`` the report compares them at every capacity.

The theoretical maximum is the same replay against an infinite cache (a set of keys): a
reference for how much prefix sharing the trace holds at all.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from bench.report import (
    Column,
    Progress,
    Series,
    human_count,
    parse_count_list,
    plot_lines,
    print_table,
    write_json,
)
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.policy import POLICIES
from kvstore.store import StoreConfig, TieredStore
from kvstore.tiers import Tier

from .parallel import fork_map
from .trace import Trace, TraceError, add_trace_args, describe, trace_from_args

log = logging.getLogger(__name__)

DEFAULT_CAPACITIES = "1M,3M,10M,20M,50M,100M"
_PROGRESS_EVERY = 2000  # requests between progress reports from a replay


# ---- routing of requests to local pools ------------------------------------------------------


class Router(ABC):
    """Chooses which of ``pools`` local caches serves a request."""

    def __init__(self, pools: int, seed: int, session_blocks: int) -> None:
        self.pools = pools

    @abstractmethod
    def route(self, keys: Sequence[BlockKey]) -> int: ...


class RandomRouter(Router):
    def __init__(self, pools: int, seed: int, session_blocks: int) -> None:
        super().__init__(pools, seed, session_blocks)
        self._rng = np.random.default_rng(seed)

    def route(self, keys: Sequence[BlockKey]) -> int:
        return int(self._rng.integers(self.pools))


class RoundRobinRouter(Router):
    def __init__(self, pools: int, seed: int, session_blocks: int) -> None:
        super().__init__(pools, seed, session_blocks)
        self._next = 0

    def route(self, keys: Sequence[BlockKey]) -> int:
        pool = self._next
        self._next = (pool + 1) % self.pools
        return pool


class SessionHashRouter(Router):
    """Sticky routing by the key of the first ``session_blocks`` blocks (the trace has no session
    ids; a conversation's turns share their opening blocks, while block 0 alone is often a system
    prompt shared by everyone)."""

    def __init__(self, pools: int, seed: int, session_blocks: int) -> None:
        super().__init__(pools, seed, session_blocks)
        self.session_blocks = session_blocks

    def route(self, keys: Sequence[BlockKey]) -> int:
        if not keys:
            return 0
        key = keys[min(self.session_blocks, len(keys)) - 1]
        return int.from_bytes(key[:8], "little") % self.pools


ROUTERS: dict[str, type[Router]] = {
    "random": RandomRouter,
    "round-robin": RoundRobinRouter,
    "session-hash": SessionHashRouter,
}


# ---- one configuration ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CacheSetup:
    """One cache configuration to replay. Capacities are totals over all pools, in tokens."""

    capacity_tokens: int
    policy: str
    ssd_capacity_tokens: int = 0
    ssd_policy: str | None = None  # default: same as ``policy``
    pools: int = 1
    routing: str = "round-robin"  # only used when pools > 1
    session_blocks: int = 2
    seed: int = 0

    def pages_per_pool(self, block_tokens: int) -> tuple[int, int]:
        """(DRAM pages, SSD pages) of each pool."""
        return (
            self.capacity_tokens // self.pools // block_tokens,
            self.ssd_capacity_tokens // self.pools // block_tokens,
        )

    def check(self, block_tokens: int) -> None:
        if self.policy not in POLICIES or (self.ssd_policy or self.policy) not in POLICIES:
            raise ValueError(f"unknown eviction policy; choose from {sorted(POLICIES)}")
        if self.pools < 1:
            raise ValueError(f"--pools must be >= 1, got {self.pools}")
        if self.pools > 1 and self.routing not in ROUTERS:
            raise ValueError(f"unknown routing {self.routing!r}; choose from {sorted(ROUTERS)}")
        dram, ssd = self.pages_per_pool(block_tokens)
        if dram < 1:
            raise ValueError(
                f"capacity {self.capacity_tokens} tokens over {self.pools} pool(s) is less than "
                f"one {block_tokens}-token block per pool; raise the capacity"
            )
        if self.ssd_capacity_tokens and ssd < 1:
            raise ValueError(
                f"SSD capacity {self.ssd_capacity_tokens} tokens is less than one "
                f"{block_tokens}-token block per pool"
            )

    @property
    def label(self) -> str:
        tiers = "DRAM" + (
            f"+SSD {human_count(self.ssd_capacity_tokens)}" if self.ssd_capacity_tokens else ""
        )
        pools = f", {self.pools} pools ({self.routing})" if self.pools > 1 else ""
        return f"{self.policy} {tiers}{pools}"


@dataclass(frozen=True, kw_only=True)
class HitCounts:
    requests: int
    blocks: int
    input_tokens: int
    hit_blocks: int
    hit_tokens: int

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


@dataclass(frozen=True, kw_only=True)
class HitRateResult:
    setup: CacheSetup
    dram_pages_per_pool: int
    ssd_pages_per_pool: int
    counts: HitCounts
    ssd_hit_blocks: int  # hits served from the SSD tier (then promoted)
    evictions: int  # blocks dropped from the last tier, all pools
    seconds: float

    def row(self, best: HitCounts) -> dict:
        s, c = self.setup, self.counts
        return {
            "capacity": s.capacity_tokens,
            "policy": s.policy,
            "ssd": s.ssd_capacity_tokens or None,
            "pools": f"{s.pools} {s.routing}" if s.pools > 1 else "1 global",
            "block_hit": c.block_hit_rate,
            "token_hit": c.token_hit_rate,
            "max_block_hit": best.block_hit_rate,
            "of_max": c.block_hit_rate / best.block_hit_rate if best.hit_blocks else None,
            "ssd_share": (self.ssd_hit_blocks / c.hit_blocks if c.hit_blocks else 0.0)
            if s.ssd_capacity_tokens
            else None,
            "evictions": self.evictions,
            "seconds": self.seconds,
        }


def _layout(block_tokens: int) -> KVLayout:
    # Metadata only: the page geometry matters for nothing but the key namespace.
    return KVLayout(
        model="bench-hitrate", num_layers=1, kv_heads=1, head_dim=1, block_tokens=block_tokens
    )


def _make_store(trace: Trace, dram_pages: int, ssd_pages: int, setup: CacheSetup) -> TieredStore:
    config = StoreConfig(
        dram_pages=dram_pages,
        ssd_pages=ssd_pages,
        dram_policy=setup.policy,
        ssd_policy=setup.ssd_policy or setup.policy,
        metadata_only=True,
        max_events=1024,
    )
    return TieredStore(_layout(trace.block_tokens), config)


def theoretical_max(trace: Trace, keys: Sequence[Sequence[BlockKey]]) -> HitCounts:
    """Hits with an infinite cache: a block hits iff its whole prefix was seen before."""
    seen: set[BlockKey] = set()
    hit_blocks = hit_tokens = 0
    bt = trace.block_tokens
    for req, ks in zip(trace.requests, keys):
        h = 0
        for k in ks:
            if k not in seen:
                break
            h += 1
        hit_blocks += h
        hit_tokens += min(h * bt, req.input_length)
        seen.update(ks)
    return HitCounts(
        requests=len(trace),
        blocks=trace.total_blocks,
        input_tokens=trace.total_input_tokens,
        hit_blocks=hit_blocks,
        hit_tokens=hit_tokens,
    )


def replay(
    trace: Trace,
    keys: Sequence[Sequence[BlockKey]],
    setup: CacheSetup,
    progress: Callable[[int], None] | None = None,
) -> HitRateResult:
    """Replay ``trace`` (with its precomputed ``keys``) through real kvstore pools."""
    setup.check(trace.block_tokens)
    start = time.perf_counter()
    dram_pages, ssd_pages = setup.pages_per_pool(trace.block_tokens)
    stores = [_make_store(trace, dram_pages, ssd_pages, setup) for _ in range(setup.pools)]
    router = (
        ROUTERS[setup.routing](setup.pools, setup.seed, setup.session_blocks)
        if setup.pools > 1
        else None
    )
    bt = trace.block_tokens
    hit_blocks = hit_tokens = ssd_hits = 0
    ssd = Tier.SSD
    try:
        for i, (req, ks) in enumerate(zip(trace.requests, keys)):
            if progress is not None and i and i % _PROGRESS_EVERY == 0:
                progress(_PROGRESS_EVERY)
            if not ks:
                continue
            store = stores[router.route(ks)] if router is not None else stores[0]
            found = store.lookup(ks)
            h = found.hits
            if h:
                hit_blocks += h
                hit_tokens += min(h * bt, req.input_length)
                if ssd_pages:
                    ssd_hits += found.tiers.count(ssd)
                lease = store.acquire(ks[:h])
                store.release(lease.lease_id)
            # NOTE: a prompt longer than the DRAM tier keeps only its first ``dram_pages``
            # blocks (hit prefix included): nothing is pinned here, so allocate can always evict
            # down to that, and storing more would evict the prompt's own prefix.
            end = min(len(ks), dram_pages)
            if h < end:
                lease = store.allocate(ks[:end])
                store.commit(lease.lease_id)
        if progress is not None:
            progress(len(trace) % _PROGRESS_EVERY or (_PROGRESS_EVERY if len(trace) else 0))
        evictions = 0
        for store in stores:
            stats = store.stats()
            evictions += stats.tiers[-1].evictions
    finally:
        for store in stores:
            store.close()
    counts = HitCounts(
        requests=len(trace),
        blocks=trace.total_blocks,
        input_tokens=trace.total_input_tokens,
        hit_blocks=hit_blocks,
        hit_tokens=hit_tokens,
    )
    return HitRateResult(
        setup=setup,
        dram_pages_per_pool=dram_pages,
        ssd_pages_per_pool=ssd_pages,
        counts=counts,
        ssd_hit_blocks=ssd_hits,
        evictions=evictions,
        seconds=time.perf_counter() - start,
    )


# ---- many configurations, in parallel ----------------------------------------------------------


def run_setups(
    trace: Trace, keys, setups: Sequence[CacheSetup], jobs: int, progress: Progress | None = None
) -> list[HitRateResult]:
    """Replay every setup, over ``jobs`` forked workers; results in the order of ``setups``."""

    def one(setup: CacheSetup, step) -> HitRateResult:
        return replay(trace, keys, setup, step)

    return fork_map(one, setups, jobs, progress.update if progress is not None else None)


# ---- the command ---------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    add_trace_args(parser)
    cache = parser.add_argument_group("cache")
    cache.add_argument(
        "--capacities",
        default=DEFAULT_CAPACITIES,
        help="comma-separated total DRAM capacities in tokens, k/M/G suffixes "
        "allowed (default: %(default)s)",
    )
    cache.add_argument(
        "--policies",
        default="lru,lfu,prefix",
        help=f"comma-separated eviction policies from {sorted(POLICIES)} (default: %(default)s)",
    )
    cache.add_argument(
        "--ssd-capacity",
        default="0",
        help="add an SSD tier of this many tokens behind DRAM (default: none)",
    )
    cache.add_argument(
        "--pools",
        type=int,
        default=1,
        help="split the capacity into N local pools (default: 1 global pool)",
    )
    cache.add_argument(
        "--routing",
        default="round-robin",
        choices=sorted(ROUTERS),
        help="how requests are spread over local pools (default: %(default)s)",
    )
    cache.add_argument(
        "--session-blocks",
        type=int,
        default=2,
        help="session-hash routing: hash of the first N blocks (default: 2)",
    )
    run_opts = parser.add_argument_group("run")
    run_opts.add_argument("--seed", type=int, default=0)
    run_opts.add_argument(
        "--jobs",
        type=int,
        default=min(os.cpu_count() or 1, 8),
        help="worker processes over configurations (default: %(default)s)",
    )
    run_opts.add_argument("--out", help="write the results as JSON here")
    run_opts.add_argument(
        "--plot",
        help="write the hit rate vs capacity PNG here (default: next to --out, same name, .png)",
    )
    run_opts.add_argument("--no-progress", action="store_true")


def _setups(args: argparse.Namespace) -> list[CacheSetup]:
    capacities = parse_count_list(args.capacities)
    policies = [p.strip().lower() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if not policies or unknown:
        raise ValueError(
            f"--policies: unknown {unknown or 'empty list'}; choose from {sorted(POLICIES)}"
        )
    ssd = parse_count_list(args.ssd_capacity)[0]
    return [
        CacheSetup(
            capacity_tokens=c,
            policy=p,
            ssd_capacity_tokens=ssd,
            pools=args.pools,
            routing=args.routing,
            session_blocks=args.session_blocks,
            seed=args.seed,
        )
        for p in policies
        for c in sorted(capacities)
    ]


COLUMNS = [
    Column("capacity", "capacity", human_count),
    Column("policy", "policy"),
    Column("ssd", "ssd", human_count),
    Column("pools", "pools"),
    Column("block_hit", "block hit", "{:.1%}"),
    Column("token_hit", "token hit", "{:.1%}"),
    Column("max_block_hit", "max", "{:.1%}"),
    Column("of_max", "of max", "{:.1%}"),
    Column("ssd_share", "from ssd", "{:.1%}"),
    Column("evictions", "evictions", "{:,}"),
    Column("seconds", "s", "{:.1f}"),
]


def versus(results: Sequence[HitRateResult], subject: str, reference: str) -> list[dict]:
    """``subject``'s block hit rate against ``reference``'s at each capacity both ran."""
    ref = {r.setup.capacity_tokens: r for r in results if r.setup.policy == reference}
    rows = []
    for r in results:
        base = ref.get(r.setup.capacity_tokens)
        if r.setup.policy != subject or base is None:
            continue
        a, b = r.counts.block_hit_rate, base.counts.block_hit_rate
        rows.append(
            {
                "capacity": r.setup.capacity_tokens,
                subject: a,
                reference: b,
                "points": 100.0 * (a - b),
                "ratio": a / b if b else None,
                "at_least": a >= b,
            }
        )
    return rows


def plot(path: str, results: Sequence[HitRateResult], best: HitCounts, title: str) -> None:
    by_label: dict[str, list[HitRateResult]] = {}
    for r in results:
        by_label.setdefault(r.setup.policy, []).append(r)
    series = [
        Series(
            label.upper(),
            [r.setup.capacity_tokens for r in rs],
            [100.0 * r.counts.block_hit_rate for r in rs],
        )
        for label, rs in by_label.items()
    ]
    plot_lines(
        path,
        series,
        title=title,
        xlabel="cache capacity (tokens, log scale)",
        ylabel="block hit rate (%)",
        logx=True,
        hlines=[(100.0 * best.block_hit_rate, f"infinite cache {best.block_hit_rate:.1%}")],
        ylim=(0.0, max(5.0, 100.0 * best.block_hit_rate * 1.15)),
    )


def run(args: argparse.Namespace) -> int:
    try:
        trace = trace_from_args(args)
        setups = _setups(args)
        for s in setups:
            s.check(args.trace_block_tokens)
    except (TraceError, ValueError) as e:
        print(f"kvcache bench hitrate: {e}", file=sys.stderr)
        return 2
    if not len(trace):
        print(
            f"kvcache bench hitrate: the trace {trace.source} has no requests; nothing to replay",
            file=sys.stderr,
        )
        return 1
    print(describe(trace))
    start = time.perf_counter()
    keys = trace.block_keys()
    best = theoretical_max(trace, keys)
    progress = Progress(len(trace) * len(setups), "hitrate", enabled=not args.no_progress)
    results = run_setups(trace, keys, setups, args.jobs, progress)
    elapsed = progress.finish(f"{len(setups)} configurations")
    rows = [r.row(best) for r in results]
    print_table(
        rows,
        COLUMNS,
        title=(
            f"prefix-cache hit rate (kvstore metadata-only replay, {len(setups)} configurations in "
            f"{elapsed:.1f} s; infinite cache: {best.block_hit_rate:.1%} of blocks, "
            f"{best.token_hit_rate:.1%} of tokens)"
        ),
    )
    compared = versus(results, "prefix", "lru")
    if compared:
        print()
        print_table(
            compared,
            [
                Column("capacity", "capacity", human_count),
                Column("prefix", "prefix", "{:.1%}"),
                Column("lru", "lru", "{:.1%}"),
                Column("points", "+points", "{:+.2f}"),
                Column("ratio", "x lru", "{:.3f}"),
                Column("at_least", ">= lru", lambda v: "yes" if v else "NO"),
            ],
            title="prefix-aware eviction vs LRU (block hit rate, same trace and capacity)",
        )
    doc = {
        "command": "hitrate",
        "trace": {
            "source": trace.source,
            "requests": len(trace),
            "blocks": trace.total_blocks,
            "block_tokens": trace.block_tokens,
            "input_tokens": trace.total_input_tokens,
            "duration_s": trace.duration_s,
            "reordered": trace.reordered,
        },
        "theoretical_max": {
            **vars(best),
            "block_hit_rate": best.block_hit_rate,
            "token_hit_rate": best.token_hit_rate,
        },
        "results": [
            {
                **row,
                "setup": r.setup,
                "dram_pages_per_pool": r.dram_pages_per_pool,
                "ssd_pages_per_pool": r.ssd_pages_per_pool,
                "hit_blocks": r.counts.hit_blocks,
                "hit_tokens": r.counts.hit_tokens,
                "ssd_hit_blocks": r.ssd_hit_blocks,
            }
            for r, row in zip(results, rows)
        ],
        "prefix_vs_lru": compared,
        "seconds": time.perf_counter() - start,
    }
    if args.out:
        write_json(args.out, doc)
        print(f"wrote {args.out}")
    plot_path = args.plot or (os.path.splitext(args.out)[0] + ".png" if args.out else None)
    if plot_path:
        plot(
            plot_path,
            results,
            best,
            f"Prefix-cache hit rate vs capacity ({len(trace):,} "
            f"requests, {os.path.basename(trace.source)})",
        )
        print(f"wrote {plot_path}")
    return 0
