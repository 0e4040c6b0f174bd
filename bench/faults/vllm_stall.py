"""A node that hangs must not slow the engine: the time of a run of requests on a real vLLM engine
(CPU, tiny model) whose kvcache node is SIGSTOPped from before the engine starts, against the same
engine without the connector; then the node is resumed (SIGCONT) and the time until hits come
back is measured.

    python -m bench.faults.vllm_stall [--requests 20] [--timeout-ms 1000] [--min-timeout-ms 200]
        [--stop running]

Each engine runs in a process of its own (in-process vLLM mode); requests go one at a time, so
each is a new request the scheduler would look up. ``--stop running``: the node hangs once the
engine serves instead (the run then holds the one deadline that opens the breaker). Prints a
table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

LAYOUT = "model=tiny-llama,num_layers=2,kv_heads=2,head_dim=32,dtype=bfloat16,block_tokens=64"


def _prompts(n: int, length: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(7)
    return [[int(x) for x in rng.integers(1, 500, length)] for _ in range(n)]


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One engine: start, the timed run (node stopped), then (with the connector) SIGCONT and
    the time until a prompt is loaded from the node."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = dict(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=1024,
        block_size=32,
        dtype="bfloat16",
        seed=0,
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=False,
    )
    if args.child == "connector":
        kw["kv_transfer_config"] = {
            "kv_connector": "KVCacheConnector",
            "kv_connector_module_path": "clients.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "node": args.node,
                "block_tokens": 64,
                "timeout_ms": args.timeout_ms,
                "min_timeout_ms": args.min_timeout_ms,
                "retry_s": args.retry_s,
            },
        }
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start_s = time.perf_counter() - t0
    if args.stop == "running":  # the node hangs once the engine serves
        os.kill(args.node_pid, signal.SIGSTOP)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    prompts = _prompts(args.requests, args.prompt_tokens)
    t0 = time.perf_counter()  # the first request included: it meets the first deadline
    for p in prompts:
        llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    run_s = time.perf_counter() - t0
    out: dict[str, Any] = {"engine": args.child, "start_s": start_s, "run_s": run_s}
    if args.child == "connector":
        os.kill(args.node_pid, signal.SIGCONT)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 120:
            (res,) = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)
            if res.num_cached_tokens:
                out["hits_back_s"] = time.perf_counter() - t0
                out["cached_tokens"] = res.num_cached_tokens
                break
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout-ms", type=float, default=1000.0)
    ap.add_argument(
        "--min-timeout-ms",
        type=float,
        default=200.0,
        help="the connector's shortest deadline (min_timeout_ms; >= --timeout-ms: fixed)",
    )
    ap.add_argument("--retry-s", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each engine, alternated")
    ap.add_argument(
        "--stop",
        choices=["before", "running"],
        default="before",
        help="SIGSTOP the node before the engine starts, or once it serves",
    )
    ap.add_argument("--child", choices=["none", "connector"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--node", help=argparse.SUPPRESS)
    ap.add_argument("--node-pid", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0

    from plumbing.launch import start_service

    from ..engines.models import MODELS, make_model

    work = tempfile.mkdtemp(prefix="kvcache-stall-")
    model = os.path.join(work, "tiny-llama")
    make_model(model, MODELS["tiny"], max_len=1024)
    node = start_service(["node", "--listen", "127.0.0.1:0", "--dram", "64MiB", "--layout", LAYOUT])
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "connector": []}
    try:
        for mode in ("none", "connector") * args.repeat:
            if args.stop == "before":
                os.kill(node.pid, signal.SIGSTOP)
            cmd = [sys.executable, "-m", "bench.faults.vllm_stall", *(argv or sys.argv[1:])]
            cmd += ["--child", mode, "--model", model, "--node", node.address]
            cmd += ["--node-pid", str(node.pid)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            runs[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    finally:
        os.kill(node.pid, signal.SIGCONT)
        node.stop()
    # the best of the alternated runs of each: the machine's other load is not the engine's
    none, conn = (min(runs[m], key=lambda r: r["run_s"]) for m in ("none", "connector"))
    ratio = conn["run_s"] / none["run_s"]
    when = "before the engine starts" if args.stop == "before" else "once the engine serves"
    print(f"{args.requests} requests of {args.prompt_tokens} tokens, node SIGSTOPped {when}:")
    print(f"  {'engine':<22}{'start s':>10}{'run s':>10}")
    print(f"  {'no connector':<22}{none['start_s']:>10.2f}{none['run_s']:>10.2f}")
    print(f"  {'connector':<22}{conn['start_s']:>10.2f}{conn['run_s']:>10.2f}   ({ratio:.2f}x)")
    back = conn.get("hits_back_s")
    print(f"  after SIGCONT: hits back in {back:.2f} s" if back else "  no hits after SIGCONT")
    print(json.dumps({"runs": runs, "ratio": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
