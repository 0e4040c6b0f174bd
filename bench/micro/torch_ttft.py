"""``kvcache bench torch``: time to first token of a real transformer with and without the store.

A seeded random ``LlamaForCausalLM`` (no downloads) big enough that prefill costs something on a
CPU prefills prompts through ``clients.hf_adapter.prefill_with_store`` against a real
``kvcache node`` process. TTFT here is token ids in -> next-token logits out, including key
hashing, lookup, the layer-wise load, the suffix forward and the store's commit. Every figure is a
ratio to the full prefill without the store measured in the same run (best over best: the least
disturbed samples, as the CPU may be shared; the per-run paired median and the ratio of CPU
seconds are shown next to it):

- cold prefill + layer-wise store (nothing cached; every full block stored as layers finish):
  the store's overhead, target <= 1.10;
- prefill with a ~90% cached prefix (shared memory, layer l+1 loading while layer l computes):
  target <= 0.30; also shown without prefetch and over the streamed gRPC path.

Each run uses fresh prompts (P_i for the cold runs; Q = P_i's cached prefix + a new suffix for
the cached runs), medians over ``--runs``. ``--devices cpu,cuda`` adds the CUDA variant (side
stream + events); it is skipped, and says so, without CUDA.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from bench.report import Column, print_table, write_json
from plumbing.launch import start_service

log = logging.getLogger("kvcache.bench.torch")

STORE_OVERHEAD_TARGET = 1.10
CACHED_TTFT_TARGET = 0.30


def configure(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("model (LlamaConfig, random seeded weights)")
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--hidden", type=int, default=1024)
    m.add_argument("--heads", type=int, default=16)
    m.add_argument("--kv-heads", type=int, default=8)
    m.add_argument("--intermediate", type=int, default=2816)
    m.add_argument("--vocab", type=int, default=32000)
    r = parser.add_argument_group("requests")
    r.add_argument("--prompt", type=int, default=4096, help="prompt tokens (default 4096)")
    r.add_argument(
        "--cached-fraction",
        type=float,
        default=0.9,
        help="share of the prompt cached, rounded to blocks (default 0.9)",
    )
    r.add_argument("--block-tokens", type=int, default=128)
    r.add_argument("--runs", type=int, help="timed runs per scenario (default 4; 3 with --quick)")
    r.add_argument(
        "--quick", action="store_true", help="4 layers, 2560-token prompt, 3 runs: about a minute"
    )
    o = parser.add_argument_group("run")
    o.add_argument(
        "--devices",
        default="cpu,cuda",
        help="comma-separated: cpu, cuda (cuda is skipped without a GPU)",
    )
    o.add_argument("--dram", default="2GiB", help="the node's DRAM pool (default 2GiB)")
    o.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--out", default="out/bench/torch_ttft.json", help="JSON results path")


@dataclass
class Row:
    device: str
    scenario: str
    path: str
    ttft_s: float  # median over runs
    ratio: float  # median over runs of (this run's TTFT / this run's full prefill)
    best_ratio: float  # best TTFT / best full prefill (least disturbed by other load)
    cpu_ratio: float  # median per-run ratio of this process's CPU seconds (all threads)
    cached_tokens: int
    load_wait_ms: float | None  # median time the forward waited for layers (load not hidden)
    store_copy_ms: float | None  # median background copy time of the layer-wise store
    store_finish_ms: float | None  # median time after the forward until the pages were published
    target: str
    met: bool | None
    samples: list[float]


def _model(args, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(4096, 2 * args.prompt),
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def _median(values) -> float | None:
    return statistics.median(values) if values else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device):
    """(wall seconds, CPU seconds of this process's threads, result)."""
    gc.collect()
    _sync(device)
    c0, t0 = time.process_time(), time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - t0, time.process_time() - c0, result


def bench_device(args, device: torch.device, tmp: str) -> tuple[list[Row], dict]:
    from clients.hf_adapter import connect_for_model, kv_layout_for, prefill_with_store

    dtype = torch.float32 if device.type == "cpu" else torch.float16
    model = _model(args, device, dtype)
    layout = kv_layout_for(
        model, f"bench-llama-{args.layers}x{args.hidden}-s{args.seed}", args.block_tokens
    )
    spec = ",".join(f"{k}={v}" for k, v in layout.to_dict().items())
    bt, total = args.block_tokens, args.prompt
    cached = max(1, round(args.cached_fraction * total / bt)) * bt
    if cached >= total:
        raise SystemExit("--cached-fraction leaves nothing to compute; lower it")
    gen = torch.Generator().manual_seed(args.seed + 1)

    def fresh(n: int) -> torch.Tensor:
        return torch.randint(0, args.vocab, (n,), generator=gen)

    node = start_service(
        ["node", "--listen", "127.0.0.1:0", "--dram", args.dram, "--layout", spec], log_dir=tmp
    )
    clients = {}
    try:
        common = dict(lease_ttl_s=600.0)
        clients["shm"] = connect_for_model(node.address, model, layout.model, bt, **common)
        clients["streamed"] = connect_for_model(
            node.address, model, layout.model, bt, use_shm=False, **common
        )
        clients["shm, no prefetch"] = connect_for_model(
            node.address, model, layout.model, bt, **common
        )
        clients["shm, no prefetch"].prefetch_layers = 0
        assert clients["shm"].shared_memory and not clients["streamed"].shared_memory

        print(f"[{device}] warm-up", flush=True)
        prefill_with_store(model, fresh(total), None)
        for kv in clients.values():  # channels, worker threads, shared-memory mapping
            prefill_with_store(model, fresh(2 * bt + 1), kv)
        times: dict[tuple[str, str], list[float]] = {}
        waits: dict[tuple[str, str], list[float]] = {}
        cpus: dict[tuple[str, str], list[float]] = {}
        store_ms: dict[tuple[str, str], list[tuple[float, float]]] = {}
        check: dict = {}
        for run in range(args.runs):
            p_shm, p_streamed = fresh(total), fresh(total)
            # NOTE: each closure runs in this iteration; defaults bind this run's prompts.
            cold = [
                ("full prefill", "no store", lambda p=p_shm: prefill_with_store(model, p, None)),
                (
                    "cold prefill + layer-wise store",
                    "shm",
                    lambda p=p_shm: prefill_with_store(model, p, clients["shm"]),
                ),
                (
                    "cold prefill + layer-wise store",
                    "streamed",
                    lambda p=p_streamed: prefill_with_store(model, p, clients["streamed"]),
                ),
            ]
            if run % 2:
                cold[0], cold[1] = cold[1], cold[0]  # alternate order against drift
            for scenario, path, fn in cold:
                secs, cpu, res = _timed(fn, device)
                assert res.cached_tokens == 0 and not res.notes, res.notes
                times.setdefault((scenario, path), []).append(secs)
                cpus.setdefault((scenario, path), []).append(cpu)
                if path != "no store":
                    store_ms.setdefault((scenario, path), []).append(
                        (res.store_copy_s * 1e3, res.store_finish_s * 1e3)
                    )
                print(
                    f"[{device}] run {run + 1}/{args.runs} {scenario} ({path}): {secs:.3f} s",
                    flush=True,
                )
            for path in ("shm", "shm, no prefetch", "streamed"):
                prompt = torch.cat(
                    [(p_shm if path != "streamed" else p_streamed)[:cached], fresh(total - cached)]
                )
                secs, cpu, res = _timed(
                    lambda p=prompt, c=clients[path]: prefill_with_store(model, p, c), device
                )
                assert res.cached_tokens == cached and not res.notes, (res.cached_tokens, res.notes)
                key = (f"{cached / total:.0%} cached prefix", path)
                times.setdefault(key, []).append(secs)
                cpus.setdefault(key, []).append(cpu)
                waits.setdefault(key, []).append(res.load_wait_s * 1e3)
                print(
                    f"[{device}] run {run + 1}/{args.runs} cached ({path}): {secs:.3f} s",
                    flush=True,
                )
                if run == 0 and path == "shm":  # the output must not change: check once
                    ref = prefill_with_store(model, prompt, None)
                    check = {
                        "max_abs_logit_diff": float((res.logits - ref.logits).abs().max()),
                        "same_next_token": bool(res.logits.argmax() == ref.logits.argmax()),
                    }
    finally:
        for kv in clients.values():
            kv.close()
        node.stop()

    full = times[("full prefill", "no store")]
    rows = []
    for (scenario, path), samples in times.items():
        med = statistics.median(samples)
        # NOTE: on a shared CPU the wall-clock samples swing by 2x; the best/best ratio (least
        # disturbed samples) carries the targets, the paired median and the CPU-time ratio show
        # how far the noise goes. The CPU ratio counts this process only (not the node's work).
        ratio = statistics.median(t / f for t, f in zip(samples, full))
        best = min(samples) / min(full)
        cpu_ratio = statistics.median(
            c / f for c, f in zip(cpus[(scenario, path)], cpus[("full prefill", "no store")])
        )
        if scenario.startswith("cold"):
            target, met = f"<= {STORE_OVERHEAD_TARGET:.2f}", best <= STORE_OVERHEAD_TARGET
        elif "cached" in scenario:
            target, met = f"<= {CACHED_TTFT_TARGET:.2f}", best <= CACHED_TTFT_TARGET
        else:
            target, met = "reference", None
        rows.append(
            Row(
                str(device),
                scenario,
                path,
                med,
                ratio,
                best,
                cpu_ratio,
                cached if "cached" in scenario else 0,
                _median(waits.get((scenario, path))),
                _median([c for c, _ in store_ms.get((scenario, path), [])]),
                _median([f for _, f in store_ms.get((scenario, path), [])]),
                target,
                met,
                samples,
            )
        )
    info = {
        "layout": layout.to_dict(),
        "page_bytes": layout.page_bytes,
        "prompt_tokens": total,
        "cached_tokens": cached,
        "dtype": str(dtype),
        **check,
    }
    return rows, info


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.layers, args.prompt = 4, 2560
    if args.runs is None:
        args.runs = 3 if args.quick else 4
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "WARNING")), logging.WARNING)
    )
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    unknown = [d for d in devices if d not in ("cpu", "cuda")]
    if unknown:
        raise SystemExit(f"unknown devices {unknown}: use cpu and/or cuda")
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
        f"({args.kv_heads} KV), prompt {args.prompt} tokens, block {args.block_tokens}, "
        f"{args.runs} runs, torch threads {torch.get_num_threads()}, "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    rows: list[Row] = []
    result: dict = {
        "config": {k: v for k, v in vars(args).items() if k != "log_level"},
        "devices": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in devices:
            if name == "cuda" and not torch.cuda.is_available():
                print("[cuda] GPU variant skipped: no CUDA device here", flush=True)
                result["devices"]["cuda"] = {"skipped": "no CUDA device"}
                continue
            dev_rows, info = bench_device(args, torch.device(name), tmp)
            rows += dev_rows
            result["devices"][name] = {**info, "rows": dev_rows}
    print()
    print_table(
        [vars(r) for r in rows],
        [
            Column("device", "device"),
            Column("scenario", "scenario"),
            Column("path", "path"),
            Column("ttft_s", "TTFT s", "{:.3f}"),
            Column("ratio", "x full (paired)", "{:.3f}"),
            Column("best_ratio", "x full (best)", "{:.3f}"),
            Column("cpu_ratio", "x full (CPU s)", "{:.3f}"),
            Column("load_wait_ms", "layer wait ms", "{:.1f}"),
            Column("store_copy_ms", "store copy ms", "{:.0f}"),
            Column("store_finish_ms", "finish ms", "{:.0f}"),
            Column("target", "target"),
            Column("met", "met", lambda m: "-" if m is None else ("yes" if m else "NO")),
        ],
        title="TTFT: median seconds; ratios to the full prefill without the store (median of "
        "per-run ratios; best over best; CPU seconds); targets apply to best over best",
    )
    for r in rows:
        if r.store_copy_ms is not None:
            full = next(x.ttft_s for x in rows if x.device == r.device and x.path == "no store")
            work = (r.store_copy_ms + r.store_finish_ms) / 1e3 / full
            print(
                f"[{r.device}] layer-wise store ({r.path}): copies {r.store_copy_ms:.0f} ms in "
                f"the background + {r.store_finish_ms:.0f} ms to publish = {work:.1%} of a full "
                "prefill (the work behind the overhead, less noisy than the TTFT ratio)"
            )
    for name, info in result["devices"].items():
        if "max_abs_logit_diff" in info:
            print(
                f"[{name}] cached vs full prefill: max |logit diff| "
                f"{info['max_abs_logit_diff']:.2e}, same next token: {info['same_next_token']}"
            )
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.micro.torch_ttft")
    configure(p)
    raise SystemExit(run(p.parse_args()))
