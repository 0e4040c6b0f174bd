"""``kvcache bench serve``: the conversation trace through ``kvcache router`` and real vLLM
engines, disaggregated, once per scheduling policy.

For each policy (default ``global-cache`` then ``random``) the command starts the serving cluster
of ``--config`` (``kvcache up --config ... --policy P --detach``: conductor, nodes, messengers,
vLLM engines, router), warms every engine up, replays the first ``--requests`` requests of the
trace at ``--rate`` requests per second (the trace's own arrival times, compressed), and stops
the cluster. With ``--cluster`` it replays once against a running cluster instead.

A trace request becomes token ids the tiny model accepts: each of its 512-token hash blocks is
``--tokens-per-block`` tokens derived from the hash id (equal ids, equal tokens: the trace's
prefix structure survives), the prompt cut at ``--max-prompt``; its output is the trace's
output length scaled the same way (at most ``--max-output``), generated with ``ignore_eos``.
Every request is streamed (``stream_options.include_usage``); the client here measures

- TTFT: request sent to its first token event; TPOT: (last token - first token) / (tokens - 1);
- throughput: output tokens per second of the replay;
- cache hit rate: prompt tokens the prefill engines did not compute (their own cache or a
  prefix loaded from their node: ``x-kvcache-prefill-cached-tokens``) over all prompt tokens,
  beside the reference measured on the same requests: one infinite cache shared by all nodes;
- KV bytes moved between nodes: the messengers' received-bytes counters (decode pulls into
  decode nodes, the conductor's transfers into prefill nodes).

References in the same run: the random policy for global-cache's TTFT, the infinite cache for
the hit rate. Prints a table, writes ``serve.json`` and ``serve.png`` under ``--out``.
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
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.engines.models import MODELS, make_model
from bench.report import Column, figure, print_table, write_json
from clients.conductor_client import ConductorClient
from clients.node_client import KVCacheRpcError
from kvstore.keys import block_keys, root_key

from .live import received_bytes
from .live_engine import LiveError, load_cluster
from .trace import DEFAULT_BLOCK_TOKENS, DEFAULT_TRACE, TraceError, TraceRequest, load_trace

DEFAULT_CONFIG = os.path.join("configs", "serve.toml")
SPECIAL_TOKENS = 3  # ids the tiny tokenizer keeps for <unk>, <s>, </s>


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help="serving cluster TOML with [[engines]] and [router] (default %(default)s)",
    )
    parser.add_argument(
        "--policies",
        default="global-cache,random",
        help="conductor policies, one cluster each (default %(default)s)",
    )
    parser.add_argument(
        "--cluster",
        default=None,
        help="replay once against this running cluster (its cluster.json) instead",
    )
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    parser.add_argument("--requests", type=int, default=200, help="first N requests (default 200)")
    parser.add_argument(
        "--rate", type=float, default=1.0, help="mean arrivals per second (default %(default)s)"
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


# ---- the workload ------------------------------------------------------------------------------


def prompt_tokens(r: TraceRequest, per_block: int, max_prompt: int, vocab: int) -> list[int]:
    """Tokens of hash block ``h``: splitmix64 of ``(h, position in block)`` into ``[3, vocab)``,
    so equal hash-id prefixes give equal token prefixes (and different ids, different blocks)."""
    per = max(1, -(-r.input_length * per_block // DEFAULT_BLOCK_TOKENS))
    x = np.asarray(r.hash_ids, dtype=np.uint64)[:, None] * np.uint64(per_block)
    x = (x + np.arange(per_block, dtype=np.uint64)).reshape(-1)[: min(per, max_prompt)]
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as splitmix64 means it to
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    tokens = z % np.uint64(vocab - SPECIAL_TOKENS) + np.uint64(SPECIAL_TOKENS)
    return [int(t) for t in tokens]


def output_tokens(r: TraceRequest, per_block: int, max_output: int) -> int:
    return max(1, min(max_output, r.output_length * per_block // DEFAULT_BLOCK_TOKENS))


def arrival_times(requests: list[TraceRequest], rate: float) -> list[float]:
    """Seconds after the start at which each request is sent: the trace's own arrival times,
    compressed (or stretched) so that they come at ``rate`` requests per second on average."""
    t0 = requests[0].timestamp_ms
    span_s = (requests[-1].timestamp_ms - t0) / 1000.0
    if len(requests) < 2 or not span_s:  # no spacing to keep: evenly at the rate
        return [i / rate for i in range(len(requests))]
    scale = (len(requests) - 1) / rate / span_s  # replay seconds per trace second
    return [(r.timestamp_ms - t0) / 1000.0 * scale for r in requests]


def ideal_hit_tokens(prompts: list[list[int]], block_tokens: int) -> list[int]:
    """Per request, the prefix tokens one infinite cache shared by every node would hold when it
    arrives (full blocks of every earlier prompt; what a prefill can skip at best)."""
    root = root_key("bench/serve/ideal")
    seen: set[bytes] = set()
    hits = []
    for tokens in prompts:
        keys = block_keys(tokens, block_tokens, root)
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hits.append(min(n * block_tokens, len(tokens) - 1))  # the last token is always computed
        seen.update(keys)
    return hits


# ---- one request -------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Outcome:
    index: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    status: str = "pending"  # ok | rejected | failed
    error: str = ""
    http_status: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prefill_node: str = ""
    decode_node: str = ""
    prefill_cached_tokens: int = 0
    decode_cached_tokens: int = 0
    pulled_bytes: int = 0
    attempts: int = 0


async def _request(
    session: Any, url: str, model: str, tokens: list[int], out: Outcome, timeout_s: float
) -> None:
    import aiohttp

    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": out.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    times: list[float] = []
    try:
        async with session.post(
            url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            out.http_status = r.status
            if r.status != 200:
                text = await r.text()
                try:
                    out.error = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    out.error = text[:200]
                out.status = "rejected" if r.status == 429 else "failed"
                return
            h = r.headers
            out.prefill_node = h.get("x-kvcache-prefill-node", "")
            out.decode_node = h.get("x-kvcache-decode-node", "")
            out.prefill_cached_tokens = int(h.get("x-kvcache-prefill-cached-tokens", 0))
            out.pulled_bytes = int(h.get("x-kvcache-pulled-bytes", 0))
            out.attempts = int(h.get("x-kvcache-attempts", 0))
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise LiveError(event["error"].get("message", "error event"))
                if event.get("choices"):
                    times.append(time.perf_counter())
                usage = event.get("usage")
                if usage:
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    out.decode_cached_tokens = int(details.get("cached_tokens") or 0)
        out.status = "ok"
    except (LiveError, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        out.status, out.error = "failed", f"{type(e).__name__}: {e}"
    finally:
        out.e2e_s = time.perf_counter() - t0
        if times:
            out.ttft_s = times[0] - t0
            if len(times) > 1:
                out.tpot_s = (times[-1] - times[0]) / (len(times) - 1)


async def _replay(
    url: str,
    model: str,
    prompts: list[list[int]],
    outputs: list[int],
    arrivals: list[float],
    timeout_s: float,
) -> tuple[list[Outcome], float]:
    import aiohttp

    outcomes = [
        Outcome(index=i, arrival_s=a, prompt_tokens=len(p), max_tokens=o)
        for i, (p, o, a) in enumerate(zip(prompts, outputs, arrivals))
    ]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        tasks = []
        for out, tokens in zip(outcomes, prompts):
            delay = start + out.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing the arrivals
            tasks.append(asyncio.create_task(_request(session, url, model, tokens, out, timeout_s)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return outcomes, wall


async def _warm_up(url: str, model: str, vocab: int, engines: int) -> None:
    """A few requests on prompts of their own (first requests of an engine are slow), one
    after another, so every engine has served before the clock starts."""
    import aiohttp

    rng = np.random.default_rng(0)
    async with aiohttp.ClientSession() as session:
        for i in range(2 * engines):
            tokens = [int(x) for x in rng.integers(SPECIAL_TOKENS, vocab, 200 + 37 * i)]
            out = Outcome(index=-1, arrival_s=0.0, prompt_tokens=len(tokens), max_tokens=4)
            await _request(session, url, model, tokens, out, 300)
            if out.status != "ok":
                raise LiveError(f"warm-up request failed: {out.error}")


# ---- a cluster per policy ----------------------------------------------------------------------


def _cluster_up(config: str, policy: str, state_dir: str) -> str:
    """``kvcache up --config C --policy P --state-dir D --detach``; returns its cluster.json.
    Builds the random tiny Llama where the config's engines expect a model and find none."""
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
    print(f"serve: starting the cluster of {config} with policy {policy} ...", flush=True)
    t = time.perf_counter()
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "kvcache.cli", "up", "--config", config),
            *("--policy", policy, "--state-dir", state_dir, "--detach"),
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
    if "router" not in state or not state.get("engines"):
        raise LiveError(f"{state_file} has no router and engines: start one with [router]")
    return state


def router_stages(url: str) -> dict[str, tuple[float, float]]:
    """The router's ``kvcache_router_stage_seconds``: stage -> (sum of seconds, count)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, tuple[float, float]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            stage = sample.labels.get("stage")
            if stage and sample.name.startswith("kvcache_router_stage_seconds_"):
                total, count = out.get(stage, (0.0, 0.0))
                if sample.name.endswith("_sum"):
                    out[stage] = (total + sample.value, count)
                elif sample.name.endswith("_count"):
                    out[stage] = (total, count + sample.value)
    return out


def _stage_means(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean milliseconds per stage between two ``router_stages`` readings."""
    means = {}
    for stage, (total, count) in after.items():
        t0, c0 = before.get(stage, (0.0, 0.0))
        if count > c0:
            means[stage] = (total - t0) / (count - c0) * 1e3
    return means


def _run_policy(
    state_file: str,
    args: argparse.Namespace,
    prompts: list[list[int]],
    outputs: list[int],
    arrivals: list[float],
) -> tuple[str, list[Outcome], float, dict[str, float] | None, int, dict[str, float]]:
    """Warm up and replay against one running cluster: (its policy, outcomes, wall seconds,
    bytes its messengers received {decode, plan} or None, its block tokens, the router's mean
    milliseconds per stage)."""
    state = _state(state_file)
    cluster = load_cluster(state_file)
    url, model = state["router"]["url"], state["engines"][0]["model"]
    with ConductorClient(cluster.conductor, cluster.token, cluster.tls_ca) as c:
        reply = c.list_nodes()
    if not reply.nodes:
        raise LiveError(f"no node registered with the conductor of {state_file}")
    block_tokens = reply.nodes[0].node.layouts[0].block_tokens
    asyncio.run(_warm_up(url, model, args.vocab, len(state["engines"])))
    before = received_bytes(cluster)
    stages = router_stages(url)
    print(
        f"serve: replaying {len(prompts)} requests at {args.rate:g}/s through {url} "
        f"(policy {reply.policy})",
        flush=True,
    )
    outcomes, wall = asyncio.run(_replay(url, model, prompts, outputs, arrivals, args.timeout))
    after = received_bytes(cluster)
    stage_ms = _stage_means(stages, router_stages(url))
    moved = None
    if before is not None and after is not None:
        decode_ids = {n.id for n in cluster.nodes if n.role == "decode"}
        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        moved = {
            "decode": sum(v for k, v in delta.items() if k in decode_ids),
            "plan": sum(v for k, v in delta.items() if k not in decode_ids),
        }
    return reply.policy, outcomes, wall, moved, block_tokens, stage_ms


# ---- the summary -------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(
    policy: str,
    outcomes: list[Outcome],
    wall_s: float,
    moved: dict[str, float] | None,
    ideal: list[int],
) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == "ok"]
    ttft = [o.ttft_s * 1e3 for o in ok if o.ttft_s is not None]
    tpot = [o.tpot_s * 1e3 for o in ok if o.tpot_s is not None]
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.prefill_cached_tokens for o in ok)
    best = sum(ideal[o.index] for o in ok)
    return {
        "policy": policy,
        "requests": len(outcomes),
        "ok": len(ok),
        "rejected": sum(o.status == "rejected" for o in outcomes),
        "failed": sum(o.status == "failed" for o in outcomes),
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p99_ms": _pct(ttft, 99),
        "tpot_p50_ms": _pct(tpot, 50),
        "tpot_p99_ms": _pct(tpot, 99),
        "output_tok_s": sum(o.output_tokens for o in ok) / wall_s if wall_s else None,
        "req_s": len(ok) / wall_s if wall_s else None,
        "hit_rate": cached / prompt if prompt else None,
        "ideal_hit_rate": best / prompt if prompt else None,
        "hit_vs_ideal": cached / best if best else None,
        "decode_cached_rate": (
            sum(o.decode_cached_tokens for o in ok) / prompt if prompt else None
        ),
        "moved_decode_mib": None if moved is None else moved["decode"] / 2**20,
        "moved_plan_mib": None if moved is None else moved.get("plan", 0.0) / 2**20,
        "retried": sum(o.attempts > 1 for o in ok),
        "wall_s": wall_s,
        "errors": sorted({o.error for o in outcomes if o.status != "ok"})[:5],
    }


COLUMNS = [
    Column("policy", "policy"),
    Column("ok", "ok"),
    Column("rejected", "rejected"),
    Column("failed", "failed"),
    Column("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    Column("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    Column("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
    Column("tpot_p99_ms", "TPOT p99 ms", "{:.1f}"),
    Column("output_tok_s", "out tok/s", "{:.0f}"),
    Column("hit_rate", "hit rate", "{:.1%}"),
    Column("hit_vs_ideal", "vs infinite", "{:.2f}x"),
    Column("moved_decode_mib", "KV to decode MiB", "{:.1f}"),
    Column("moved_plan_mib", "KV fetched MiB", "{:.1f}"),
]


def plot(path: str, runs: list[tuple[dict[str, Any], list[Outcome]]]) -> None:
    """Left: TTFT CDF per policy. Right: hit rate per policy beside the infinite cache."""
    with figure(path, 1, 2, figsize=(12, 4.5), dpi=110) as (fig, (left, right)):
        for summary, outcomes in runs:
            ms = np.sort([o.ttft_s * 1e3 for o in outcomes if o.status == "ok" and o.ttft_s])
            if ms.size:
                left.plot(ms, np.arange(1, ms.size + 1) / ms.size, label=summary["policy"])
        left.set_xscale("log")
        left.xaxis.set_minor_formatter("")  # log ticks between decades overlap otherwise
        left.set_xlabel("TTFT (ms)")
        left.set_ylabel("fraction of requests")
        left.set_title("time to first token through the router")
        left.grid(True, which="both", alpha=0.3)
        left.legend()
        names = [s["policy"] for s, _ in runs]
        xs = np.arange(len(names))
        right.bar(xs - 0.2, [s["hit_rate"] or 0 for s, _ in runs], 0.4, label="prefill hit rate")
        right.bar(
            xs + 0.2, [s["ideal_hit_rate"] or 0 for s, _ in runs], 0.4, label="infinite cache"
        )
        right.set_xticks(xs, names)
        right.set_ylabel("prompt tokens not computed")
        right.set_title("cache hits")
        right.grid(True, axis="y", alpha=0.3)
        right.legend()


def _check(args: argparse.Namespace) -> list[str]:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise LiveError("--policies is empty")
    if args.requests < 1 or not args.rate > 0:
        raise LiveError("--requests must be >= 1 and --rate positive")
    if args.tokens_per_block < 1 or args.max_prompt < 2 or args.max_output < 1:
        raise LiveError("--tokens-per-block, --max-output >= 1 and --max-prompt >= 2")
    if args.vocab <= SPECIAL_TOKENS or not args.timeout > 0:
        raise LiveError(f"--vocab must be > {SPECIAL_TOKENS} and --timeout positive")
    if args.cluster is None and not os.path.exists(args.config):
        raise LiveError(f"no config {args.config}: give --config (or --cluster)")
    return policies


def run(args: argparse.Namespace) -> int:
    try:
        policies = _check(args)
        trace = load_trace(args.trace)
    except (LiveError, TraceError) as e:
        print(f"kvcache bench serve: {e}", file=sys.stderr)
        return 2
    requests = trace.requests[: args.requests]
    prompts = [
        prompt_tokens(r, args.tokens_per_block, args.max_prompt, args.vocab) for r in requests
    ]
    outputs = [output_tokens(r, args.tokens_per_block, args.max_output) for r in requests]
    arrivals = arrival_times(requests, args.rate)
    results: list[tuple[dict[str, Any], list[Outcome]]] = []
    targets = [(None, args.cluster)] if args.cluster else [(p, None) for p in policies]
    try:
        for policy, cluster in targets:
            state_file = cluster or _cluster_up(
                args.config, policy or "", os.path.join(args.out, "serve-cluster")
            )
            try:
                name, outcomes, wall, moved, block_tokens, stage_ms = _run_policy(
                    state_file, args, prompts, outputs, arrivals
                )
            finally:
                if cluster is None:
                    _cluster_down(state_file)
            ideal = ideal_hit_tokens(prompts, block_tokens)
            summary = summarize(name, outcomes, wall, moved, ideal)
            summary["router_stage_ms"] = stage_ms
            results.append((summary, outcomes))
    except (LiveError, KVCacheRpcError, OSError) as e:
        print(f"kvcache bench serve: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nkvcache bench serve: interrupted; no report written", file=sys.stderr)
        return 130
    print(
        f"\nserve: {len(requests)} requests of {os.path.basename(trace.source)} at "
        f"{args.rate:g}/s ({args.tokens_per_block} tokens per trace block, prompts "
        f"{int(np.mean([len(p) for p in prompts]))} tokens on average, outputs "
        f"{np.mean(outputs):.0f})"
    )
    print_table([s for s, _ in results], COLUMNS)
    summaries = {s["policy"]: s for s, _ in results}
    if "global-cache" in summaries and "random" in summaries:
        g, r = summaries["global-cache"], summaries["random"]
        for key, what in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99")):
            if g[key] and r[key]:
                print(f"global-cache {what} = {g[key] / r[key]:.2f}x random's (same run)")
        if g["hit_rate"] is not None and r["hit_rate"]:
            print(f"global-cache hit rate = {g['hit_rate'] / r['hit_rate']:.2f}x random's")
    for s in summaries.values():
        ms = s["router_stage_ms"]
        print(
            f"{s['policy']}: the router's mean per request: "
            + ", ".join(
                f"{stage} {ms[stage]:.0f} ms"
                for stage in ("schedule", "plan_wait", "prefill", "decode_pull", "first_token")
                if stage in ms
            )
        )
        for error in s["errors"]:
            print(f"  {s['policy']}: {error}")
    json_path = os.path.join(args.out, "serve.json")
    png_path = os.path.join(args.out, "serve.png")
    write_json(
        json_path,
        {
            "command": "serve",
            "trace": trace.source,
            "config": args.config if not args.cluster else args.cluster,
            "options": {
                "requests": len(requests),
                "rate": args.rate,
                "tokens_per_block": args.tokens_per_block,
                "max_prompt": args.max_prompt,
                "max_output": args.max_output,
            },
            "summaries": [s for s, _ in results],
            "requests": {s["policy"]: o for s, o in results},
        },
    )
    plot(png_path, results)
    print(f"wrote {json_path} and {png_path}")
    return 0 if all(s["failed"] == 0 for s, _ in results) else 1
