"""``kvcache bench router``: what ``kvcache router`` itself costs, against fake engines that stream
canned tokens (``bench.micro.fake_engines``), so that only the router is measured.

The command starts a conductor, ``--nodes`` nodes of role both, the fake engines (one process)
and a router per configuration (``aggregated``: the router's default, connections kept alive;
``aggregated-connect``: ``--connection-per-request``), then, for each ``--concurrency``, keeps
that many streamed completions in flight for ``--duration`` seconds (closed loop, a new request
as soon as one ends) straight at the engines (round robin: the reference) and through each
router, one after another, ``--reps`` times over (so that a machine whose load changes meanwhile
weighs on all alike). Per request it measures the time to the first token event (TTFT) and to
``[DONE]`` (end to end). Prints requests per second and TTFT / end-to-end p50 and p99, and what
the router adds over the direct calls measured in the same run (the goal: under 2 ms at p50 with
128 streams), writes ``router.json`` and ``router.png`` under ``--out``.

The client, the router, the conductor and the engines share the machine: on a small one the
client's own work is part of every figure, the same in the reference and through the router.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.report import Column, figure, print_table, write_json
from plumbing.launch import ServiceProcess, start_service

# The nodes' layout (the router reads it to make block keys); its pages are never written here.
LAYOUT = "model=fake,num_layers=2,kv_heads=2,head_dim=32,dtype=bfloat16,block_tokens=32"
CONFIGS = {
    "aggregated": ["--mode", "aggregated"],
    "aggregated-connect": ["--mode", "aggregated", "--connection-per-request"],
    "disaggregated": [],
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--concurrency",
        default="1,16,128",
        help="streams kept in flight, comma-separated (default %(default)s)",
    )
    parser.add_argument(
        "--duration", type=float, default=4.0, help="seconds per measurement (default 4)"
    )
    parser.add_argument(
        "--reps", type=int, default=2, help="measurements per target and level (default 2)"
    )
    parser.add_argument(
        "--configs",
        default="aggregated,aggregated-connect",
        help=f"router configurations, from {', '.join(CONFIGS)} (default %(default)s)",
    )
    parser.add_argument("--nodes", type=int, default=2, help="nodes (and engines) of role both")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens (default 256)")
    parser.add_argument("--tokens", type=int, default=16, help="output tokens (default 16)")
    parser.add_argument(
        "--ttft-ms", type=float, default=20.0, help="the fake engines' time to first token"
    )
    parser.add_argument(
        "--itl-ms", type=float, default=10.0, help="the fake engines' time between tokens"
    )
    parser.add_argument("--out", default=os.path.join("out", "bench"), help="output directory")


@dataclass
class Point:
    target: str  # direct, or a router configuration
    concurrency: int
    ttft_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        def pct(values: list[float], q: float) -> float | None:
            return float(np.percentile(values, q)) if values else None

        return {
            "target": self.target,
            "concurrency": self.concurrency,
            "requests": len(self.e2e_ms),
            "errors": self.errors,
            "req_s": len(self.e2e_ms) / self.seconds if self.seconds else None,
            "ttft_p50_ms": pct(self.ttft_ms, 50),
            "ttft_p99_ms": pct(self.ttft_ms, 99),
            "e2e_p50_ms": pct(self.e2e_ms, 50),
            "e2e_p99_ms": pct(self.e2e_ms, 99),
        }


async def _load(urls: list[str], point: Point, prompt: int, tokens: int, duration: float) -> None:
    """``point.concurrency`` closed loops of streamed completions for ``duration`` seconds."""
    import aiohttp

    rng = np.random.default_rng(point.concurrency)
    prompts = [[int(x) for x in rng.integers(3, 500, prompt)] for _ in range(64)]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        deadline = time.perf_counter() + duration
        turn = [0]

        async def loop(worker: int) -> None:
            while time.perf_counter() < deadline:
                i = turn[0] = turn[0] + 1
                body = {
                    "model": "fake",
                    "prompt": prompts[i % len(prompts)],
                    "max_tokens": tokens,
                    "stream": True,
                }
                t0 = time.perf_counter()
                first = None
                try:
                    async with session.post(
                        urls[i % len(urls)] + "/v1/completions", json=body
                    ) as r:
                        if r.status != 200:
                            point.errors += 1
                            await r.read()
                            continue
                        done = None
                        async for line in r.content:  # to its end: the connection is reused
                            if first is None and line.startswith(b"data: {"):
                                first = time.perf_counter()
                            if line.startswith(b"data: [DONE]"):
                                done = time.perf_counter()
                except aiohttp.ClientError:
                    point.errors += 1
                    continue
                end = done
                if first is None or end is None:
                    point.errors += 1
                    continue
                point.ttft_ms.append((first - t0) * 1e3)
                point.e2e_ms.append((end - t0) * 1e3)

        t = time.perf_counter()
        await asyncio.gather(*(loop(w) for w in range(point.concurrency)))
        point.seconds = time.perf_counter() - t


def measure(
    urls: list[str], target: str, concurrency: int, args: argparse.Namespace, point: Point
) -> Point:
    """One more measurement into ``point`` (its samples and seconds add up)."""
    asyncio.run(_load(urls, Point(target, 1), args.prompt, args.tokens, 0.5))  # warm up
    run = Point(target, concurrency)
    asyncio.run(_load(urls, run, args.prompt, args.tokens, args.duration))
    point.ttft_ms += run.ttft_ms
    point.e2e_ms += run.e2e_ms
    point.errors += run.errors
    point.seconds += run.seconds
    s = run.summary()
    print(
        f"router: {target:>20} x{concurrency:<4} {s['req_s']:7.0f} req/s, TTFT p50 "
        f"{s['ttft_p50_ms']:.1f} ms, e2e p50 {s['e2e_p50_ms']:.1f} ms, {run.errors} errors",
        flush=True,
    )
    return point


def _start(logs: str, args: argparse.Namespace) -> tuple[list[ServiceProcess], list[str], dict]:
    """The conductor, the nodes and the fake engines; their processes, the engines' URLs and
    the router arguments that name them."""
    started = []
    conductor = start_service(["conductor", "--listen", "127.0.0.1:0"], log_dir=logs)
    started.append(conductor)
    for i in range(args.nodes):
        started.append(
            start_service(
                [
                    *("node", "--listen", "127.0.0.1:0", "--dram", "1MiB", "--layout", LAYOUT),
                    *("--conductor", conductor.address, "--node-id", f"n{i}", "--role", "both"),
                ],
                log_dir=logs,
            )
        )
    fakes = start_service(
        [
            *("--engines", str(args.nodes), "--tokens", str(args.tokens)),
            *("--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms)),
        ],
        log_dir=logs,
        module="bench.micro.fake_engines",
    )
    started.append(fakes)
    urls = list(fakes.info["urls"])
    router_args = ["--conductor", conductor.address]
    for i, url in enumerate(urls):
        router_args += ["--engine", f"n{i}={url}"]
    return started, urls, {"args": router_args, "conductor": conductor.address}


def _wait_nodes(conductor: str, n: int) -> None:
    from clients.conductor_client import ConductorClient

    with ConductorClient(conductor) as c:
        deadline = time.monotonic() + 60
        while len(c.list_nodes().nodes) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} nodes did not register in 60 s")
            time.sleep(0.1)


COLUMNS = [
    Column("target", "target"),
    Column("concurrency", "streams"),
    Column("req_s", "req/s", "{:.0f}"),
    Column("req_vs_direct", "req/s vs direct", "{:.2f}x"),
    Column("ttft_p50_ms", "TTFT p50 ms", "{:.2f}"),
    Column("ttft_p99_ms", "TTFT p99 ms", "{:.2f}"),
    Column("added_ttft_p50_ms", "added p50 ms", "{:+.2f}"),
    Column("added_ttft_p99_ms", "added p99 ms", "{:+.2f}"),
    Column("e2e_p50_ms", "e2e p50 ms", "{:.1f}"),
    Column("added_e2e_p50_ms", "added e2e p50", "{:+.2f}"),
    Column("errors", "errors"),
]


def run(args: argparse.Namespace) -> int:
    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    except ValueError:
        print("kvcache bench router: --concurrency takes integers, e.g. 1,16,128", file=sys.stderr)
        return 2
    unknown = [c for c in configs if c not in CONFIGS]
    bad = args.nodes < 1 or args.reps < 1 or not args.duration > 0
    if not levels or min(levels) < 1 or unknown or bad:
        print(
            f"kvcache bench router: --concurrency, --nodes, --reps >= 1, --duration > 0 and "
            f"--configs from {', '.join(CONFIGS)} (unknown: {unknown})",
            file=sys.stderr,
        )
        return 2
    logs = tempfile.mkdtemp(prefix="kvcache-bench-router-")
    started, urls, cluster = _start(logs, args)
    points: list[Point] = []
    try:
        _wait_nodes(cluster["conductor"], args.nodes)
        targets = {"direct": urls}
        for config in configs:
            router = start_service(
                ["router", "--listen", "127.0.0.1:0", *cluster["args"], *CONFIGS[config]],
                log_dir=logs,
            )
            started.append(router)
            targets[config] = [f"http://{router.address}"]
        for level in levels:
            mine = {target: Point(target, level) for target in targets}
            for _ in range(args.reps):
                for target, where in targets.items():
                    measure(where, target, level, args, mine[target])
            points += mine.values()
    finally:
        for sp in reversed(started):
            sp.stop()
    rows = [p.summary() for p in points]
    direct = {r["concurrency"]: r for r in rows if r["target"] == "direct"}
    for r in rows:
        d = direct[r["concurrency"]]
        for key in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms"):
            if r[key] is not None and d[key] is not None:
                r["added_" + key] = r[key] - d[key]
        if r["req_s"] and d["req_s"]:
            r["req_vs_direct"] = r["req_s"] / d["req_s"]
    print(
        f"\nrouter: {args.nodes} fake engines ({args.tokens} tokens, first after "
        f"{args.ttft_ms:g} ms, then every {args.itl_ms:g} ms), prompts of {args.prompt} tokens, "
        f"{args.reps} x {args.duration:g} s per row, targets taking turns; 'added': through the "
        "router minus direct, same run"
    )
    print_table(rows, COLUMNS)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "router.json")
    png_path = os.path.join(args.out, "router.png")
    write_json(json_path, {"command": "router", "options": vars(args), "rows": rows})
    with figure(png_path, 1, 1, figsize=(7, 4.5), dpi=110) as (fig, ax):
        for target in dict.fromkeys(r["target"] for r in rows if r["target"] != "direct"):
            mine = [r for r in rows if r["target"] == target and "added_ttft_p50_ms" in r]
            xs = [r["concurrency"] for r in mine]
            ax.plot(xs, [r["added_ttft_p50_ms"] for r in mine], "o-", label=f"{target} p50")
            ax.plot(xs, [r["added_ttft_p99_ms"] for r in mine], "x--", label=f"{target} p99")
        ax.axhline(2.0, color="grey", lw=0.8, ls=":", label="goal: 2 ms at p50")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("TTFT added by the router (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    print(f"wrote {json_path} and {png_path}")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcache bench router", description=__doc__)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
