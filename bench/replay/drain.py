"""``kvcache bench drain``: the pool's hit rate after a node leaves, with and without a drain.

Each scenario starts its own pool (a conductor and ``--nodes`` nodes, each with its messenger:
real processes on loopback) and replays the first ``--requests`` requests of a Mooncake-format
trace (one page per trace block), each to the node holding the longest prefix of it (as
``kvcache router``'s cache-aware policy sends it to the engine beside that node), else
round-robin. A request hits the longest prefix of its blocks that any live node
holds (the pool: any engine loads a prefix cached anywhere); its engine's node then holds every
block of it (what it loaded is touched, the rest is written). After ``--leave-at`` of the
requests, the node holding the most blocks leaves:

- **stays**: no node leaves (the reference: what the cache gives with every node),
- **leaves**: SIGTERM, nothing handed over (what Mooncake's store and LMCache do),
- **drains**: ``Drain`` first (``kvcache drain``): its hottest blocks, up to ``--drain-bytes``,
  are pulled by its peers' messengers, then it stops,

and the rest of the requests are replayed on the nodes left. Printed: the hit rate (hit blocks /
blocks) of the requests after the leave and of the first ``--window`` of them, as a fraction of
the stays reference, and the drain's blocks, bytes, seconds and GB/s. The ideal (an infinite
cache shared by all nodes) is printed beside them. Page bytes are synthetic: this measures what
the cache keeps, not the engines' compute.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from bench.micro.pool_ttft import start_pool
from bench.replay.live_engine import prompt_tokens
from bench.replay.trace import DEFAULT_BLOCK_TOKENS, DEFAULT_TRACE, load_trace
from bench.report import Column, Progress, figure, parse_bytes, print_table, write_json
from clients.conductor_client import ConductorClient
from clients.node_client import KVStoreClient
from kvstore.keys import block_keys, root_key
from plumbing.launch import ServiceProcess, start_service

# One trace block (512 tokens) per page, small pages: the figure is what stays cached.
LAYOUT = "model=drain,num_layers=1,kv_heads=1,head_dim=4,dtype=float16,block_tokens=512"
PAGE_BYTES = 1 * 2 * 512 * 1 * 4 * 2
SCENARIOS = ("stays", "leaves", "drains")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    parser.add_argument("--requests", type=int, default=1000, help="first N requests")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument(
        "--dram", default="64MiB", help="each node's DRAM (default %(default)s: 8192 pages)"
    )
    parser.add_argument(
        "--leave-at", type=float, default=0.5, help="fraction of the requests before the leave"
    )
    parser.add_argument(
        "--window", type=int, default=200, help="the requests right after the leave, counted apart"
    )
    parser.add_argument(
        "--drain-bytes",
        type=parse_bytes,
        default=0,
        help="the drain's budget, e.g. 8MiB (default: all the node holds)",
    )
    parser.add_argument("--drain-seconds", type=float, default=30.0)
    parser.add_argument("--out", default="out/bench-drain", help="JSON and PNG go here")


@dataclass
class Outcome:
    scenario: str
    before: float  # hit rate of the requests before the leave
    after: float  # ... after it
    window: float  # ... of the first --window after it
    curve: list[float]  # hit rate per 50 requests after the leave
    drained_blocks: int = 0
    drained_bytes: int = 0
    drain_s: float = 0.0
    leaving_blocks: int = 0


class Pool:
    """The pool's processes, the replay's clients and its round-robin."""

    def __init__(self, nodes: int, dram: str, work: str) -> None:
        self.procs: list[ServiceProcess] = []

        def start(*args: str) -> ServiceProcess:
            sp = start_service(list(args), log_dir=work)
            self.procs.append(sp)
            return sp

        ids = [f"node-{i}" for i in range(nodes)]
        self.conductor, self.nodes, _ = start_pool(start, LAYOUT, ids, dram)
        with ConductorClient(self.conductor.address) as c:
            deadline = time.monotonic() + 60
            while len(c.list_nodes().nodes) < nodes:
                if time.monotonic() > deadline:
                    raise RuntimeError("the nodes did not register with the conductor")
                time.sleep(0.1)
        self.clients = {n: KVStoreClient(sp.address) for n, sp in self.nodes.items()}
        (self.namespace,) = next(iter(self.clients.values())).namespaces()
        self.root = root_key(self.namespace, b"")
        self.turn = 0

    def serve(self, tokens: np.ndarray) -> tuple[int, int]:
        """(hit blocks, blocks) of one request; its engine's node holds all of them after."""
        keys = block_keys(tokens, DEFAULT_BLOCK_TOKENS, self.root)
        if not keys:
            return 0, 0
        live = list(self.clients)
        hits = {n: self.clients[n].lookup(self.namespace, keys=keys).hit_blocks for n in live}
        best = max(live, key=hits.__getitem__)
        if hits[best]:
            engine = best  # a cache-aware router: where the prefix is (the conductor's policy)
        else:
            engine = live[self.turn % len(live)]  # else round-robin
            self.turn += 1
        client, local = self.clients[engine], hits[engine]
        if local:
            client.get(self.namespace, keys=keys[:local])  # loaded: touched
        missing = keys[local:]
        if missing:  # loaded from a peer or computed: written here
            page = np.zeros(PAGE_BYTES, np.uint8)
            client.put(self.namespace, [page] * len(missing), keys=missing)
        return max(hits.values()), len(keys)

    def busiest(self) -> str:
        return max(self.clients, key=lambda n: self.clients[n].stats().namespaces[0].blocks)

    def leave(
        self, node: str, drain: bool, max_bytes: int, seconds: float
    ) -> tuple[int, int, float]:
        client = self.clients.pop(node)
        try:
            if drain:
                reply = client.drain(max_bytes, seconds, leave=True)
                self.nodes[node].proc.wait(60)
                return reply.blocks, reply.bytes, reply.seconds
            self.nodes[node].stop()
            return 0, 0, 0.0
        finally:
            client.close()

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        for sp in reversed(self.procs):
            sp.stop()


def ideal(requests: list[np.ndarray], start: int) -> list[tuple[int, int]]:
    """(hit, blocks) per request from ``start`` for an infinite cache of everything before."""
    seen: set[bytes] = set()
    out = []
    root = root_key("ideal", b"")
    for i, tokens in enumerate(requests):
        keys = block_keys(tokens, DEFAULT_BLOCK_TOKENS, root)
        hit = next((j for j, k in enumerate(keys) if k not in seen), len(keys))
        seen.update(keys)
        if i >= start:
            out.append((hit, len(keys)))
    return out


def _rate(pairs: list[tuple[int, int]]) -> float:
    total = sum(b for _, b in pairs)
    return sum(h for h, _ in pairs) / total if total else 0.0


def run_scenario(
    name: str, prompts: list[np.ndarray], args: argparse.Namespace, work: str
) -> Outcome:
    pool = Pool(args.nodes, args.dram, work)
    try:
        split = int(len(prompts) * args.leave_at)
        progress = Progress(len(prompts), f"drain bench: {name}")
        first = []
        for tokens in prompts[:split]:
            first.append(pool.serve(tokens))
            progress.update()
        out = Outcome(name, _rate(first), 0.0, 0.0, [])
        if name != "stays":
            leaving = pool.busiest()
            out.leaving_blocks = pool.clients[leaving].stats().namespaces[0].blocks
            out.drained_blocks, out.drained_bytes, out.drain_s = pool.leave(
                leaving, name == "drains", args.drain_bytes, args.drain_seconds
            )
        rest = []
        for tokens in prompts[split:]:
            rest.append(pool.serve(tokens))
            progress.update()
        progress.finish()
        out.after, out.window = _rate(rest), _rate(rest[: args.window])
        out.curve = [_rate(rest[i : i + 50]) for i in range(0, len(rest), 50)]
        return out
    finally:
        pool.close()


def run(args: argparse.Namespace) -> int:
    if args.nodes < 2 or args.requests < 2 or not 0 < args.leave_at < 1:
        raise SystemExit("kvcache bench drain: --nodes >= 2, --requests >= 2, 0 < --leave-at < 1")
    trace = load_trace(args.trace)
    requests = trace.requests[: args.requests or None]
    prompts = [prompt_tokens(r, trace.block_tokens) for r in requests]
    split = int(len(prompts) * args.leave_at)
    reference = _rate(ideal(prompts, split))
    outcomes: dict[str, Outcome] = {}
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-drain-") as work:
        for name in SCENARIOS:
            outcomes[name] = run_scenario(name, prompts, args, work)
    stays = outcomes["stays"]
    rows = []
    for o in outcomes.values():
        rows.append(
            {
                "scenario": o.scenario,
                "before": o.before,
                "after": o.after,
                "vs_stays": o.after / stays.after if stays.after else None,
                "window": o.window,
                "window_vs_stays": o.window / stays.window if stays.window else None,
                "drained": o.drained_blocks if o.scenario == "drains" else None,
                "drain_s": o.drain_s if o.scenario == "drains" else None,
                "gbps": o.drained_bytes / o.drain_s / 1e9 if o.drain_s else None,
            }
        )
    pct = "{:.1%}".format
    print_table(
        rows,
        [
            Column("scenario", "a node"),
            Column("before", "hit before", pct),
            Column("after", "hit after", pct),
            Column("vs_stays", "vs stays", "{:.2f}x"),
            Column("window", f"first {args.window} after", pct),
            Column("window_vs_stays", "vs stays", "{:.2f}x"),
            Column("drained", "blocks handed over"),
            Column("drain_s", "drain s", "{:.2f}"),
            Column("gbps", "GB/s", "{:.3f}"),
        ],
        title=(
            f"{len(prompts)} requests of {os.path.basename(args.trace)} on {args.nodes} nodes "
            f"({args.dram} DRAM each), the busiest leaving after {split}; "
            f"an infinite shared cache would hit {reference:.1%} after it"
        ),
    )
    os.makedirs(args.out, exist_ok=True)
    write_json(
        os.path.join(args.out, "drain.json"),
        {"ideal_after": reference, "outcomes": list(outcomes.values()), "rows": rows},
    )
    with figure(os.path.join(args.out, "drain.png"), figsize=(7, 4)) as (_, ax):
        for o in outcomes.values():
            ax.plot([50 * i for i in range(len(o.curve))], o.curve, label=o.scenario)
        ax.set_xlabel("requests after the leave")
        ax.set_ylabel("hit rate (per 50 requests)")
        ax.legend()
    print(f"wrote {args.out}/drain.json and drain.png")
    return 0
