"""The pool's time to first token: a prompt another node holds (a remote hit: found in the
conductor's index, pulled into the engine's node by its messenger, loaded), the same prompt
again (a local hit on the engine's node), and prompts nobody holds (recomputed), each timed
as one request of ``max_tokens`` 1 on a real vLLM CPU engine with a random model.

    python -m bench.micro.pool_ttft --shape 100m --prompt-tokens 2048 --prompts 4

A conductor and two nodes (A, B) with their messengers run as processes; an engine on A stores
the prompts; an engine on B with the connector's ``conductor`` set serves them twice, then the
fresh prompts. Prints the median of each and its ratio to the recompute, the pull's GB/s (pages
moved / the worker's wait for them) against one bulk pull of ``--bulk-mib`` between the same
two nodes' messengers in the same run (the messenger bench's node+messenger figure), and the
connector's time from the scheduler's Locate to the load's end per pull. Loopback on one host:
the pull's bytes cross no network.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np

from bench.engines.models import MODELS, make_model
from clients.conductor_client import ConductorClient
from clients.messenger_client import MessengerClient
from clients.node_client import KVStoreClient
from plumbing.launch import ServiceProcess, free_port, start_service

BLOCK_TOKENS = 256


def start_pool(
    start: Callable[..., ServiceProcess], layout: str | None, node_ids: Sequence[str], dram: str
) -> tuple[ServiceProcess, dict[str, ServiceProcess], dict[str, ServiceProcess]]:
    """A conductor and one node per id, each with its messenger and registered with it (their
    processes through ``start(*args)``): (conductor, nodes, messengers) by node id. ``layout``
    None: the nodes serve the layouts their clients register."""
    conductor = start("conductor", "--listen", "127.0.0.1:0")
    nodes, messengers = {}, {}
    for node_id in node_ids:
        messenger_at = f"127.0.0.1:{free_port('127.0.0.1')}"
        nodes[node_id] = start(
            "node", "--listen", "127.0.0.1:0", "--dram", dram,
            *(["--layout", layout] if layout else []),
            "--node-id", node_id, "--messenger", messenger_at, "--conductor", conductor.address,
        )  # fmt: skip
        messengers[node_id] = start(
            "messenger", "--node", nodes[node_id].address, "--listen", messenger_at
        )
    return conductor, nodes, messengers


def bulk_pull(source_node: str, messengers: dict[str, ServiceProcess], nbytes: int) -> float:
    """GB/s of one SubmitTransfer of ``nbytes`` of fresh pages from node A to node B through
    their messengers (the messenger bench's node+messenger figure, between the same nodes),
    from the submit to the finished status."""
    with KVStoreClient(source_node) as a:
        (ns,) = a.namespaces()
        page = a.namespace_info(ns).page_bytes
        rng = np.random.default_rng(1)
        keys = [rng.bytes(16) for _ in range(max(1, nbytes // page))]
        for i in range(0, len(keys), 64):
            chunk = keys[i : i + 64]
            a.put(ns, [rng.integers(0, 255, page, dtype=np.uint8) for _ in chunk], keys=chunk)
    source = messengers["A"].address
    with MessengerClient(messengers["B"].address, timeout_s=60) as m:
        t0 = time.perf_counter()
        batch = m.submit(ns, [(k, source) for k in keys])
        status = m.status(batch.batch_id, wait=True, timeout_s=300)
        took = time.perf_counter() - t0
    if not status.finished or status.failed:
        raise RuntimeError(f"the bulk pull did not finish: {status}")
    return len(keys) * page / took / 1e9


def engine(model: str, connector: dict[str, Any] | None, runs: list[dict[str, Any]]) -> Any:
    """One vLLM engine in a process of its own (bench.engines.vllm_engine): each run timed."""
    spec = {
        "model": model,
        "connector": connector,
        "prefix_caching": False,  # every repeat asks the connector
        "max_model_len": 4096,
        "kv_cache_bytes": 256 << 20,
        "runs": runs,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engines.vllm_engine"],
        input=json.dumps(spec),
        stdout=subprocess.PIPE,
        text=True,
        timeout=1800,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])["runs"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=4, help="prompts of each kind")
    parser.add_argument(
        "--bulk-mib", type=int, default=256, help="the bulk pull the prompts' are compared with"
    )
    parser.add_argument("--work", default=None, help="model and logs (default: a temp dir)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    configure(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    work = args.work or tempfile.mkdtemp(prefix="kvcache-pool-ttft-")
    shape = MODELS[args.shape]
    model = os.path.join(work, f"{args.shape}-llama")
    make_model(model, shape, max_len=4096)
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    layout = (
        f"model={os.path.basename(model)},num_layers={shape['num_hidden_layers']},"
        f"kv_heads={kv},head_dim={shape['hidden_size'] // heads},dtype=bfloat16,"
        f"block_tokens={BLOCK_TOKENS}"
    )
    rng = np.random.default_rng(0)

    def prompt() -> list[int]:
        return [int(x) for x in rng.integers(3, shape["vocab_size"], args.prompt_tokens)]

    stored = [prompt() for _ in range(args.prompts)]
    fresh = [prompt() for _ in range(args.prompts)]
    procs: list[ServiceProcess] = []

    def start(*a: str) -> ServiceProcess:
        sp = start_service(list(a), log_dir=work)
        procs.append(sp)
        return sp

    try:
        conductor, nodes, messengers = start_pool(start, layout, ("A", "B"), "2GiB")
        one = [{"prompts": [p], "max_tokens": 1} for p in stored]
        engine(model, {"node": nodes["A"].address}, one)  # A stores them
        pages = args.prompts * ((args.prompt_tokens - 1) // BLOCK_TOKENS)
        with ConductorClient(conductor.address) as c:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if any(n.indexed_blocks >= pages for n in c.list_nodes().nodes):
                    break
                time.sleep(0.1)
        # every pull made: this measures the pull, not the gate that decides whether to make it
        pool = {"node": nodes["B"].address, "conductor": conductor.address, "pull_max_cost": "inf"}
        runs = one + one + [{"prompts": [p], "max_tokens": 1} for p in fresh]
        out = engine(model, pool, runs)
        bulk = bulk_pull(nodes["A"].address, messengers, args.bulk_mib << 20)
    finally:
        for sp in reversed(procs):
            sp.stop()
    n = args.prompts
    remote = [r["seconds"] for r in out[:n]]
    local = [r["seconds"] for r in out[n : 2 * n]]
    recompute = [r["seconds"] for r in out[2 * n :]]
    stats = out[-1]["stats"]
    base = statistics.median(recompute)
    print(f"{args.shape} model, {args.prompt_tokens}-token prompts, {n} of each, loopback")
    for name, xs in (("remote hit", remote), ("local hit", local), ("recompute", recompute)):
        med = statistics.median(xs)
        p99 = float(np.percentile(xs, 99))
        print(
            f"  {name:11s} TTFT p50 {med * 1e3:8.1f} ms, p99 {p99 * 1e3:8.1f} ms  "
            f"({med / base:.2f}x recompute)"
        )
    pulls = max(1, stats["remote_pulls"])
    moved = stats["loaded_bytes"] / 2  # half the loads were the remote ones, half local
    pull_gbs = moved / max(stats["remote_wait_s"], 1e-9) / 1e9
    print(
        f"  pulls {stats['remote_pulls']} (failed {stats['remote_failed']}): "
        f"{pull_gbs:.2f} GB/s over the worker's wait, "
        f"Locate + submit {stats['remote_lookup_s'] / pulls * 1e3:.1f} ms per pull, "
        f"wait for the pages {stats['remote_wait_s'] / pulls * 1e3:.1f} ms per pull"
    )
    print(
        f"  one bulk pull of {args.bulk_mib} MiB between the same nodes' messengers: "
        f"{bulk:.2f} GB/s; a prompt's pull {pull_gbs / bulk:.2f}x that"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
