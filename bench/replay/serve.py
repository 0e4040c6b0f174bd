"""``kvcache bench serve``: the conversation trace through ``kvcache router`` and real vLLM engines,
for every serving mode x scheduling policy x request rate, over the same engines.

The command starts the serving cluster of ``--config`` once (``kvcache up --detach``:
conductor, nodes, messengers, vLLM engines; with ``--cluster`` it uses a running one instead),
warms every engine up, then for each ``--modes`` x ``--policies`` starts a router of its own
(``kvcache router --mode M --policy P``) and replays the first ``--requests`` requests of the
trace at each of ``--rates`` requests per second (the trace's own arrival times, compressed),
streamed (``bench.replay.serve_load``). Each run's prompts carry a salt of their own, so no run
is served from another's cache. Aggregated serving needs nodes of role both (the default config
has only those: either mode runs on them); a fleet without any skips it.

Per run: TTFT and TPOT p50/p99, output tokens per second, the cache hit rate (prompt tokens an
engine did not compute, as the answers' usage says, beside the same requests' hit rate on one
infinite cache shared by all nodes), the engines' own count of it
(``vllm:prompt_tokens_by_source``: their prefix caches and what they loaded from kvcache, which
includes the pool's asynchronous loads the usage leaves out), goodput (requests per second within
both ``--ttft-slo-ms`` and ``--tpot-slo-ms``), and what the router moved and waited for (KV pages
to decode nodes; the conductor's transfer plans and the wait for them). The report compares
global-cache's TTFT p50 with the best of the other policies measured in the same run, per mode and
rate. Prints a table, writes ``serve.json`` and ``serve.png`` (goodput and TTFT p50 against the
rate) under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import tomllib
import urllib.request
from typing import Any

import numpy as np

from bench.engines.models import MODELS, make_model
from bench.report import Column, figure, print_table, write_json
from clients.conductor_client import ConductorClient
from clients.node_client import KVCacheRpcError
from plumbing.launch import start_service

from .live_engine import LiveError, load_cluster
from .serve_load import (
    SPECIAL_TOKENS,
    arrival_times,
    ideal_hit_tokens,
    output_tokens,
    prompt_tokens,
    replay,
    summarize,
    warm_up,
)
from .trace import DEFAULT_TRACE, TraceError, load_trace

__all__ = ["arrival_times", "ideal_hit_tokens", "output_tokens", "prompt_tokens"]

DEFAULT_CONFIG = os.path.join("configs", "serve.toml")
MODES = ("aggregated", "disaggregated")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help="serving cluster TOML with [[engines]] (default %(default)s)",
    )
    parser.add_argument(
        "--cluster",
        default=None,
        help="use this running cluster (its cluster.json) instead of starting --config's",
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="router modes, comma-separated (default %(default)s)",
    )
    parser.add_argument(
        "--policies",
        default="global-cache,load,round-robin",
        help="conductor policies, comma-separated, a router each (default %(default)s)",
    )
    parser.add_argument(
        "--rates",
        default="0.5,1,2",
        help="mean arrivals per second, comma-separated (default %(default)s)",
    )
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    parser.add_argument(
        "--requests", type=int, default=60, help="first N requests per run (default 60)"
    )
    parser.add_argument(
        "--ttft-slo-ms",
        type=float,
        default=1000.0,
        help="TTFT SLO of the goodput (default %(default)s)",
    )
    parser.add_argument(
        "--tpot-slo-ms",
        type=float,
        default=100.0,
        help="TPOT SLO of the goodput (default %(default)s)",
    )
    parser.add_argument(
        "--tokens-per-block",
        type=int,
        default=32,
        help="tokens per 512-token trace block (default %(default)s: one block of the serving "
        "demo's layout, so the trace's shared blocks are shared kvcache blocks)",
    )
    parser.add_argument(
        "--max-prompt", type=int, default=1024, help="prompt tokens at most (default 1024)"
    )
    parser.add_argument(
        "--max-output", type=int, default=32, help="output tokens at most (default 32)"
    )
    parser.add_argument(
        "--vocab", type=int, default=MODELS["tiny"]["vocab_size"], help="model vocabulary size"
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a request may take (default 300)"
    )
    parser.add_argument("--out", default=os.path.join("out", "bench"), help="output directory")


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _check(args: argparse.Namespace) -> tuple[list[str], list[str], list[float]]:
    modes, policies = _names(args.modes), _names(args.policies)
    if not modes or any(m not in MODES for m in modes):
        raise LiveError(f"--modes takes {', '.join(MODES)}")
    if not policies:
        raise LiveError("--policies is empty")
    try:
        rates = [float(x) for x in _names(args.rates)]
    except ValueError:
        raise LiveError("--rates takes numbers, e.g. 0.5,1,2") from None
    if args.requests < 1 or not rates or not all(r > 0 for r in rates):
        raise LiveError("--requests must be >= 1 and --rates positive")
    if args.tokens_per_block < 1 or args.max_prompt < 2 or args.max_output < 1:
        raise LiveError("--tokens-per-block, --max-output >= 1 and --max-prompt >= 2")
    if args.vocab <= SPECIAL_TOKENS or not args.timeout > 0:
        raise LiveError(f"--vocab must be > {SPECIAL_TOKENS} and --timeout positive")
    if not args.ttft_slo_ms > 0 or not args.tpot_slo_ms > 0:
        raise LiveError("--ttft-slo-ms and --tpot-slo-ms must be positive")
    if args.cluster is None and not os.path.exists(args.config):
        raise LiveError(f"no config {args.config}: give --config (or --cluster)")
    return modes, policies, rates


# ---- the cluster and its routers ---------------------------------------------------------------


def _cluster_up(config: str, state_dir: str) -> str:
    """``kvcache up --config C --state-dir D --detach`` (without the config's router); returns
    its cluster.json. Builds the random tiny Llama where the config's engines expect a model and
    find none."""
    with open(config, "rb") as f:
        data = tomllib.load(f)
    base = os.path.dirname(os.path.abspath(config))  # relative paths in it are relative to it
    default = data.get("engine_defaults", {}).get("model")
    models = {e.get("model", default) for e in data.get("engines", [])}
    for model in sorted(m for m in models if m):
        path = os.path.join(base, model)
        if not os.path.exists(path):
            print(f"serve: building the random tiny Llama at {path}", flush=True)
            make_model(path, MODELS["tiny"], max_len=4096, tokenizer=True)
    print(f"serve: starting the cluster of {config} ...", flush=True)
    t = time.perf_counter()
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "kvcache.cli", "up", "--config", config),
            *("--state-dir", state_dir, "--detach"),
            *("--set", "router.listen="),  # no router of the config's: a router per run here
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if proc.returncode != 0:
        raise LiveError(f"kvcache up failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    print(f"serve: cluster up in {time.perf_counter() - t:.0f} s", flush=True)
    return os.path.join(state_dir, "cluster.json")


def _cluster_down(state_file: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "down", "--state-dir", os.path.dirname(state_file)],
        stdout=subprocess.DEVNULL,
        check=False,
    )


def _state(state_file: str) -> dict[str, Any]:
    with open(state_file, encoding="utf-8") as f:
        state: dict[str, Any] = json.load(f)
    if not state.get("engines"):
        raise LiveError(f"{state_file} has no engines: start a cluster with [[engines]]")
    return state


def router_metrics(url: str) -> dict[tuple[str, str], float]:
    """The router's stage seconds (``stage`` sums and counts) and KV bytes (``kind``):
    (sample name, label) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(("kvcache_router_stage_seconds_", "kvcache_router_kv_")):
                label = s.labels.get("stage") or s.labels.get("kind") or ""
                if "result" in s.labels:
                    label += "/" + s.labels["result"]
                out[(s.name, label)] = out.get((s.name, label), 0.0) + s.value
    return out


SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


REMOTE_LOAD = "vllm:kvcache_remote_load_seconds_bucket"


def engine_sources(urls: list[str]) -> dict[str, float]:
    """The engines' prompt tokens by where they came from (vLLM's
    ``vllm:prompt_tokens_by_source``), summed, and the buckets of their pulls' Lookup-to-load
    seconds (``le=...`` keys, summed). The usage's ``cached_tokens`` misses what an engine
    loaded asynchronously (the pool's pulls): these counters have it."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(SOURCES, 0.0)
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "vllm:prompt_tokens_by_source_total" and s.labels.get("source") in out:
                    out[s.labels["source"]] += s.value
                elif s.name == REMOTE_LOAD:
                    le = "le=" + s.labels["le"]
                    out[le] = out.get(le, 0.0) + s.value
    return out


def bucket_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile of a Prometheus histogram's cumulative ``buckets`` (upper bound ->
    count), interpolated within its bucket as Prometheus' histogram_quantile does; None for
    no observations; the largest finite bound for one past it."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if not total:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            return (
                lower + (bound - lower) * (rank - below) / (count - below)
                if count > below
                else bound
            )
        lower, below = bound, count
    return lower


def _engine_figures(urls: list[str], before: dict[str, float], prompt: int) -> dict[str, Any]:
    """Hit rates from the engines' own counters over a run (any cache, and kvcache's part), and
    the pool's pulls: how many, and their Lookup-to-load milliseconds p50/p99."""
    deadline = time.monotonic() + 10
    while True:  # recorded beside each response: wait until every prompt token is counted
        after = engine_sources(urls)
        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        total = sum(delta[k] for k in SOURCES)
        if total >= prompt or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    buckets = {float(k[3:]): v for k, v in delta.items() if k.startswith("le=")}
    p50, p99 = bucket_quantile(buckets, 0.5), bucket_quantile(buckets, 0.99)
    return {
        "engine_hit_rate": (delta["local_cache_hit"] + delta["external_kv_transfer"]) / total
        if total
        else 0.0,
        "kvcache_hit_rate": delta["external_kv_transfer"] / total if total else 0.0,
        "pool_pulls": int(buckets.get(float("inf"), 0)),
        "pool_load_p50_ms": None if p50 is None else p50 * 1e3,
        "pool_load_p99_ms": None if p99 is None else p99 * 1e3,
    }


def _router_figures(before: dict, after: dict) -> dict[str, float]:
    """Mean milliseconds per stage, KV MiB moved per kind and plans waited for, in a run."""

    def delta(name: str, label: str) -> float:
        return after.get((name, label), 0.0) - before.get((name, label), 0.0)

    out = {}
    stages = {label for name, label in after if name == "kvcache_router_stage_seconds_count"}
    for stage in stages:
        count = delta("kvcache_router_stage_seconds_count", stage)
        if count:
            out[f"{stage}_ms"] = delta("kvcache_router_stage_seconds_sum", stage) / count * 1e3
    out["plans"] = delta("kvcache_router_stage_seconds_count", "plan_wait")
    for kind in ("decode_pull", "plan"):
        out[f"{kind}_mib"] = delta("kvcache_router_kv_bytes_total", kind) / 2**20
    return out


def _run(
    router_url: str,
    model: str,
    prompts: list[list[int]],
    outputs: list[int],
    rate: float,
    args: argparse.Namespace,
    requests: list,
    block_tokens: int,
    engines: list[str],
) -> tuple[dict[str, Any], list]:
    arrivals = arrival_times(requests, rate)
    before = router_metrics(router_url)
    sources = engine_sources(engines)
    outcomes, wall = asyncio.run(
        replay(router_url, model, prompts, outputs, arrivals, args.timeout)
    )
    summary = summarize(
        outcomes,
        wall,
        ideal_hit_tokens(prompts, block_tokens),
        args.ttft_slo_ms / 1e3,
        args.tpot_slo_ms / 1e3,
    )
    summary["router"] = _router_figures(before, router_metrics(router_url))
    prompt = sum(o.prompt_tokens for o in outcomes if o.status == "ok")
    summary.update(_engine_figures(engines, sources, prompt))
    if summary.get("ideal_hit_rate"):
        summary["engine_vs_ideal"] = summary["engine_hit_rate"] / summary["ideal_hit_rate"]
    return summary, outcomes


# ---- the report ---------------------------------------------------------------------------------

COLUMNS = [
    Column("mode", "mode"),
    Column("policy", "policy"),
    Column("rate", "req/s in", "{:g}"),
    Column("ok", "ok"),
    Column("failed", "failed"),
    Column("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    Column("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    Column("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
    Column("tpot_p99_ms", "TPOT p99 ms", "{:.1f}"),
    Column("hit_rate", "hit rate", "{:.1%}"),
    Column("hit_vs_ideal", "vs infinite", "{:.2f}x"),
    Column("engine_hit_rate", "engines' hit", "{:.1%}"),
    Column("kvcache_hit_rate", "from kvcache", "{:.1%}"),
    Column("engine_vs_ideal", "vs infinite", "{:.2f}x"),
    Column("pool_pulls", "pulls"),
    Column("pool_load_p50_ms", "Lookup->load p50 ms", "{:.0f}"),
    Column("pool_load_p99_ms", "p99 ms", "{:.0f}"),
    Column("goodput_req_s", "goodput req/s", "{:.2f}"),
    Column("slo_attainment", "in SLO", "{:.0%}"),
    Column("decode_pull_mib", "KV to decode MiB", "{:.1f}"),
    Column("plans", "plans"),
    Column("plan_wait_ms", "plan wait ms", "{:.0f}"),
]


def global_cache_checks(rows: list[dict[str, Any]]) -> list[str]:
    """Per mode and rate: global-cache's TTFT p50 against the best other policy's."""
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for rate in dict.fromkeys(r["rate"] for r in rows):
            same = [r for r in rows if (r["mode"], r["rate"]) == (mode, rate) and r["ttft_p50_ms"]]
            g = [r for r in same if r["policy"] == "global-cache"]
            others = [r for r in same if r["policy"] != "global-cache"]
            if not g or not others:
                continue
            best = min(others, key=lambda r: r["ttft_p50_ms"])
            ratio = g[0]["ttft_p50_ms"] / best["ttft_p50_ms"]
            verdict = "no worse" if ratio <= 1.0 else "WORSE"
            lines.append(
                f"{mode} at {rate:g}/s: global-cache TTFT p50 = {ratio:.2f}x the best other "
                f"({best['policy']}): {verdict}"
            )
    return lines


def plot(path: str, rows: list[dict[str, Any]], ttft_slo_ms: float, tpot_slo_ms: float) -> None:
    """Left: goodput against the offered rate, per mode and policy. Right: TTFT p50."""
    with figure(path, 1, 2, figsize=(12, 4.5), dpi=110) as (fig, (left, right)):
        styles = {"aggregated": "-", "disaggregated": "--"}
        for mode, policy in dict.fromkeys((r["mode"], r["policy"]) for r in rows):
            mine = sorted(
                (r for r in rows if (r["mode"], r["policy"]) == (mode, policy)),
                key=lambda r: r["rate"],
            )
            xs = [r["rate"] for r in mine]
            label = f"{mode} {policy}"
            left.plot(xs, [r["goodput_req_s"] or 0 for r in mine], "o" + styles[mode], label=label)
            right.plot(xs, [r["ttft_p50_ms"] or np.nan for r in mine], "o" + styles[mode])
        left.plot(
            [0, max(r["rate"] for r in rows)], [0, max(r["rate"] for r in rows)], ":", c="grey"
        )
        left.set_xlabel("offered load (requests/s)")
        left.set_ylabel("goodput (requests/s within both SLOs)")
        left.set_title(f"goodput: TTFT <= {ttft_slo_ms:g} ms and TPOT <= {tpot_slo_ms:g} ms")
        left.grid(True, alpha=0.3)
        left.legend(fontsize=8)
        right.set_xlabel("offered load (requests/s)")
        right.set_ylabel("TTFT p50 (ms)")
        right.set_yscale("log")
        right.set_title("time to first token through the router")
        right.grid(True, which="both", alpha=0.3)


def run(args: argparse.Namespace) -> int:
    try:
        modes, policies, rates = _check(args)
        trace = load_trace(args.trace)
    except (LiveError, TraceError) as e:
        print(f"kvcache bench serve: {e}", file=sys.stderr)
        return 2
    requests = trace.requests[: args.requests]
    outputs = [output_tokens(r, args.tokens_per_block, args.max_output) for r in requests]
    rows: list[dict[str, Any]] = []
    every: dict[str, list] = {}
    state_file = args.cluster
    logs = os.path.join(args.out, "serve-logs")
    os.makedirs(logs, exist_ok=True)
    try:
        if state_file is None:
            state_file = _cluster_up(args.config, os.path.join(args.out, "serve-cluster"))
        state = _state(state_file)
        cluster = load_cluster(state_file)
        model = state["engines"][0]["model"]
        with ConductorClient(cluster.conductor, cluster.token, cluster.tls_ca) as c:
            reply = c.list_nodes()
        if not reply.nodes:
            raise LiveError(f"no node registered with the conductor of {state_file}")
        block_tokens = reply.nodes[0].node.layouts[0].block_tokens
        if "aggregated" in modes and not any(n.role == "both" for n in cluster.nodes):
            print("serve: no node of role both: aggregated serving skipped", flush=True)
            modes = [m for m in modes if m != "aggregated"]
        warmed = False
        salt = 0
        for mode in modes:
            for policy in policies:
                router = start_service(
                    [
                        *("router", "--listen", "127.0.0.1:0", "--cluster", state_file),
                        *("--mode", mode, "--policy", policy),
                        # what the cache did (usage's cached tokens, x-kvcache-* headers) is
                        # the operator's to see, and this bench is the operator
                        "--debug-headers",
                    ],
                    log_dir=logs,
                )
                url = f"http://{router.address}"
                try:
                    if not warmed:
                        asyncio.run(warm_up(url, model, args.vocab, len(state["engines"])))
                        warmed = True
                    for rate in rates:
                        salt += 1
                        prompts = [
                            prompt_tokens(
                                r, args.tokens_per_block, args.max_prompt, args.vocab, salt
                            )
                            for r in requests
                        ]
                        print(
                            f"serve: {mode} {policy}: {len(prompts)} requests at {rate:g}/s",
                            flush=True,
                        )
                        summary, outcomes = _run(
                            url,
                            model,
                            prompts,
                            outputs,
                            rate,
                            args,
                            requests,
                            block_tokens,
                            [e["url"] for e in state["engines"]],
                        )
                        if any(o.status == "ok" for o in outcomes) and not any(
                            o.mode for o in outcomes
                        ):
                            raise RuntimeError(
                                "the router hid what the cache did (no x-kvcache-* headers, "
                                "no cached tokens): its hit rates would read 0"
                            )
                        summary.update(mode=mode, policy=policy, rate=rate, **summary["router"])
                        rows.append(summary)
                        every[f"{mode}/{policy}/{rate:g}"] = outcomes
                finally:
                    router.stop()
    except (LiveError, KVCacheRpcError, OSError, RuntimeError) as e:
        print(f"kvcache bench serve: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nkvcache bench serve: interrupted; no report written", file=sys.stderr)
        return 130
    finally:
        if args.cluster is None and state_file is not None:
            _cluster_down(state_file)
    mean_prompt = int(np.mean([len(prompt_tokens(r, args.tokens_per_block, args.max_prompt,
                                                  args.vocab)) for r in requests]))  # fmt: skip
    print(
        f"\nserve: {len(requests)} requests of {os.path.basename(trace.source)} per run "
        f"({args.tokens_per_block} tokens per trace block, prompts {mean_prompt} tokens on "
        f"average, outputs {np.mean(outputs):.0f}); goodput SLOs: TTFT {args.ttft_slo_ms:g} ms, "
        f"TPOT {args.tpot_slo_ms:g} ms"
    )
    print_table(rows, COLUMNS)
    for line in global_cache_checks(rows):
        print(line)
    for r in rows:
        for error in r["errors"]:
            print(f"  {r['mode']} {r['policy']} {r['rate']:g}/s: {error}")
    json_path = os.path.join(args.out, "serve.json")
    png_path = os.path.join(args.out, "serve.png")
    write_json(
        json_path,
        {
            "command": "serve",
            "trace": trace.source,
            "config": args.cluster or args.config,
            "options": {
                "requests": len(requests),
                "rates": rates,
                "ttft_slo_ms": args.ttft_slo_ms,
                "tpot_slo_ms": args.tpot_slo_ms,
                "tokens_per_block": args.tokens_per_block,
                "max_prompt": args.max_prompt,
                "max_output": args.max_output,
            },
            "summaries": rows,
            "requests": every,
        },
    )
    plot(png_path, rows, args.ttft_slo_ms, args.tpot_slo_ms)
    print(f"wrote {json_path} and {png_path}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1
