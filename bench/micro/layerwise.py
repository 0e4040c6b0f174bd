"""``kvcache bench layerwise``: the torch client's layer-wise put and load against raw copies.

A real ``kvcache node`` process and a ``TorchKVClient`` on shared memory move one request of
``--blocks`` pages (1 MiB by default: 32 layers of a Llama-3-8B-like layout, so one ``put_layer``
writes 32 KiB of each page) between torch tensors and the node:

- **put**: ``store()`` (Allocate) + one ``put_layer`` per layer + ``finish()`` (the copies, then
  Commit), from tensors in the Hugging Face layout ``[1, kv_heads, seq, head_dim]`` (a transpose
  per block) and in vLLM's paged layout ``[blocks, block_tokens, kv_heads, head_dim]``. Reference:
  ``np.copyto`` of the same bytes between prefaulted page arrays. Target >= 0.8. The copies alone
  (the client's worker time, which hashes each layer as it copies it) and the publish (Commit,
  carrying those checksums) are shown beside it.
- **load**: ``load()`` (Acquire) + ``layer(l)`` for every layer + ``close()`` (Release), into new
  HF tensors (allocated by the load, as for a prefill) or the caller's paged caches. Same
  reference.
- **CUDA** (``--devices cpu,cuda``; skipped, and said so, without a CUDA device): the load into
  device tensors (pages -> pinned staging -> device on the client's side stream) against the
  least any path from pageable host memory (the node's pages) does: an ``np.copyto`` of the same
  bytes into pinned memory, then one pinned host->device ``copy_``; the put from device tensors
  against one device->pinned ``copy_``, then the copy out to pageable memory. (One pinned
  ``copy_`` alone, DMA at tens of GB/s, is printed beside it: the host copy bounds both paths.)

Every figure is the median of ``--repeats`` runs, subject and reference interleaved, after an
untimed warm-up; the ratio is reference time / subject time (> 1 would beat the reference).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

from bench.micro.store import bench_layout, gbps, prefaulted
from bench.report import MET, Column, print_table, targets_summary, write_json
from plumbing.launch import start_service

PUT_TARGET = 0.8


@dataclass(frozen=True)
class Row:
    device: str
    op: str
    layout: str
    value: float  # GB/s, median
    reference: float  # GB/s of the reference, median
    ratio: float  # reference time / subject time (medians)
    copy_ratio: float | None  # puts: the worker's copies alone vs the reference
    publish_ms: float | None  # puts: median time of the Commit (the node seals every page)
    target: str
    met: bool | None
    samples_s: list[float]
    reference_s: list[float]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--page-kib",
        type=int,
        default=1024,
        help="page size in KiB, a multiple of 128 (default 1024: 32 layers x 32 KiB)",
    )
    parser.add_argument(
        "--blocks", type=int, default=64, help="pages per request (default 64: 64 MiB)"
    )
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed runs per figure; the median is kept"
    )
    parser.add_argument(
        "--devices",
        default="cpu,cuda",
        help="comma-separated: cpu, cuda (cuda is skipped without a GPU)",
    )
    parser.add_argument(
        "--dram-checksums",
        choices=["on", "off"],
        default="on",
        help="the node's DRAM page checksums (default on, as a node runs; off: what they cost)",
    )
    parser.add_argument("--out", default="out/bench", help="directory for layerwise.json")


def _median_pair(
    ref: Callable[[], object], subject: Callable[[], object], repeats: int
) -> tuple[list[float], list[float]]:
    """Interleaved samples (seconds) of each, so a noisy neighbour hurts both alike."""
    refs, subs = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ref()
        refs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        subject()
        subs.append(time.perf_counter() - t0)
    return refs, subs


class _Rig:
    """A node, a client on ``device`` and one request's K/V in both tensor layouts."""

    def __init__(self, args: argparse.Namespace, device: torch.device, tmp: str) -> None:
        from clients.torch_client import TorchKVClient

        self.layout = L = bench_layout(args.page_kib)
        self.device = device
        self.blocks = n = args.blocks
        self.nbytes = n * L.page_bytes
        spec = ",".join(f"{k}={v}" for k, v in L.to_dict().items())
        # Room for the loaded request and two put rounds: each put evicts an older one.
        self.dram_pages = 3 * n + 8
        dram = self.dram_pages * L.page_bytes
        extra = ["--no-dram-checksums"] if args.dram_checksums == "off" else []
        self.node = start_service(
            ["node", "--listen", "127.0.0.1:0", "--dram", str(dram), "--layout", spec, *extra],
            log_dir=tmp,
        )
        try:
            self.kv = TorchKVClient.connect(self.node.address, L, device=device, lease_ttl_s=600)
        except BaseException:
            self.node.stop()
            raise
        if not self.kv.shared_memory:
            self.close()
            raise SystemExit("the node's shared memory cannot be mapped here")
        dtype = torch.float16
        g = torch.Generator().manual_seed(1)
        seq, bt = n * L.block_tokens, L.block_tokens
        hf = (1, L.kv_heads, seq, L.head_dim)
        paged = (n + 2, bt, L.kv_heads, L.head_dim)

        def rand(shape: tuple[int, ...]) -> torch.Tensor:
            return torch.randn(shape, generator=g).to(dtype).to(device)

        self.hf = [(rand(hf), rand(hf)) for _ in range(L.num_layers)]
        self.paged = [(rand(paged), rand(paged)) for _ in range(L.num_layers)]
        self.paged_dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in self.paged]
        self.table = list(range(2, n + 2))  # cache blocks 2.. (0 and 1 stay unused)
        self._round = 0
        self.loaded = self._tokens()  # the request every load reads (stored by store_loaded)

    def _tokens(self) -> torch.Tensor:
        self._round += 1
        g = torch.Generator().manual_seed(1000 + self._round)
        return torch.randint(0, 128_000, (self.blocks * self.layout.block_tokens,), generator=g)

    def _tensor_layout(self, name: str):
        from clients.torch_layout import HFLayout, PagedLayout

        return HFLayout() if name == "hf" else PagedLayout(self.table)

    def put(self, name: str, tokens: torch.Tensor | None = None) -> tuple[float, float]:
        """One layer-wise store of a new request; (worker copy seconds, Commit seconds)."""
        req = self.kv.request(self._tokens() if tokens is None else tokens)
        src = self.hf if name == "hf" else self.paged
        store = self.kv.store(req, tensor_layout=self._tensor_layout(name))
        for layer, (k, v) in enumerate(src):
            store.put_layer(layer, k, v)
        result = store.finish()
        if result.stored + result.duplicates != self.blocks:
            raise RuntimeError(f"the put stored {result.stored} of {self.blocks} pages")
        return store.copy_s, store.publish_s

    def warm_up(self, name: str) -> None:
        """The channel, the worker, and every page of the node's pool touched once by this
        process: a long-running client has them all mapped (a first touch faults)."""
        for _ in range(-(-self.dram_pages // self.blocks) + 1):
            self.put(name)

    def store_loaded(self) -> None:
        """(Re)store the request the loads read: puts of new requests evict older ones."""
        self.put("paged", self.loaded)

    def load(self, name: str) -> None:
        kw = {} if name == "hf" else {"kv_caches": self.paged_dst}
        with self.kv.load(self.loaded, tensor_layout=self._tensor_layout(name), **kw) as load:
            if load.num_tokens != self.blocks * self.layout.block_tokens:
                raise RuntimeError(f"the load found {load.num_tokens} tokens, not the request")
            for layer in range(self.layout.num_layers):
                load.layer(layer)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.kv.close()
        self.node.stop()


def _row(
    device: str,
    op: str,
    layout: str,
    nbytes: int,
    refs: list[float],
    subs: list[float],
    target: float | None,
    copy_s: list[float] | None = None,
    publish_s: list[float] | None = None,
) -> Row:
    ref, sub = statistics.median(refs), statistics.median(subs)
    ratio = ref / sub
    return Row(
        device,
        op,
        layout,
        gbps(nbytes, sub),
        gbps(nbytes, ref),
        ratio,
        ref / statistics.median(copy_s) if copy_s else None,
        statistics.median(publish_s) * 1e3 if publish_s else None,
        f">= {target}" if target else "report",
        None if target is None else ratio >= target,
        subs,
        refs,
    )


def bench_cpu(rig: _Rig, repeats: int) -> list[Row]:
    ref_src = prefaulted(rig.blocks, rig.layout.page_bytes)
    ref_dst = prefaulted(rig.blocks, rig.layout.page_bytes)

    def memcpy() -> None:
        for i in range(rig.blocks):
            np.copyto(ref_dst[i], ref_src[i])

    rows = []
    for name in ("hf", "paged"):
        copies: list[float] = []
        commits: list[float] = []

        def put(name: str = name, copies: list[float] = copies, commits=commits) -> None:
            c, f = rig.put(name)
            copies.append(c)
            commits.append(f)

        rig.warm_up(name)
        refs, subs = _median_pair(memcpy, put, repeats)
        rows.append(_row("cpu", "put", name, rig.nbytes, refs, subs, PUT_TARGET, copies, commits))
    rig.store_loaded()
    for name in ("hf", "paged"):
        rig.load(name)
        refs, subs = _median_pair(memcpy, lambda name=name: rig.load(name), repeats)
        rows.append(_row("cpu", "load", name, rig.nbytes, refs, subs, None))
    return rows


def bench_cuda(rig: _Rig, repeats: int) -> list[Row]:
    dev = rig.device
    pinned = torch.empty(rig.nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    on_dev = torch.empty(rig.nbytes, dtype=torch.uint8, device=dev).fill_(1)

    pageable = np.ones(rig.nbytes, np.uint8)  # prefaulted, as the node's pages are
    staged = pinned.numpy()

    def dma_h2d() -> None:
        on_dev.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize(dev)

    def dma_d2h() -> None:
        pinned.copy_(on_dev, non_blocking=True)
        torch.cuda.synchronize(dev)

    def h2d() -> None:
        np.copyto(staged, pageable)
        dma_h2d()

    def d2h() -> None:
        dma_d2h()
        np.copyto(pageable, staged)

    rows = []
    rig.store_loaded()
    for name in ("hf", "paged"):
        rig.load(name)
        refs, subs = _median_pair(h2d, lambda name=name: rig.load(name), repeats)
        rows.append(_row("cuda", "load (host -> device)", name, rig.nbytes, refs, subs, None))
    for name in ("hf", "paged"):
        rig.warm_up(name)
        refs, subs = _median_pair(d2h, lambda name=name: rig.put(name), repeats)
        rows.append(_row("cuda", "put (device -> host)", name, rig.nbytes, refs, subs, None))
    dma, _ = _median_pair(dma_h2d, dma_h2d, repeats)
    print(
        f"  cuda: one pinned copy_ alone (DMA) {rig.nbytes / statistics.median(dma) / 1e9:.1f} GB/s"
    )
    return rows


def run(args: argparse.Namespace) -> int:
    for name in ("blocks", "repeats"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name} must be positive")
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    unknown = [d for d in devices if d not in ("cpu", "cuda")]
    if unknown or not devices:
        raise SystemExit(f"--devices: unknown {unknown or devices}; use cpu and/or cuda")
    layout = bench_layout(args.page_kib)
    started = time.perf_counter()
    print(
        f"layer-wise benchmark: {layout.page_bytes // 1024} KiB pages of {layout.num_layers} "
        f"layers, {args.blocks} pages per request, median of {args.repeats}",
        flush=True,
    )
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-layerwise-") as tmp:
        for name in devices:
            if name == "cuda" and not torch.cuda.is_available():
                skipped["cuda"] = "no CUDA device"
                print("  cuda: skipped, no CUDA device here", flush=True)
                continue
            t0 = time.perf_counter()
            rig = _Rig(args, torch.device(name), tmp)
            try:
                step = bench_cpu if name == "cpu" else bench_cuda
                rows += step(rig, args.repeats)
            finally:
                rig.close()
            print(f"  {name}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    print()
    print_table(
        [asdict(r) | {"met": MET[r.met]} for r in rows],
        [
            Column("device", "device"),
            Column("op", "operation"),
            Column("layout", "tensors"),
            Column("value", "GB/s", "{:.2f}"),
            Column("reference", "reference GB/s", "{:.2f}"),
            Column("ratio", "vs ref", "{:.2f}"),
            Column("copy_ratio", "copies vs ref", "{:.2f}"),
            Column("publish_ms", "Commit ms", "{:.1f}"),
            Column("target", "target"),
            Column("met", "met"),
        ],
    )
    print(
        "\nreference: np.copyto of the same bytes between prefaulted arrays (cpu); that copy into "
        "pinned memory and one pinned copy_ to the device, or back (cuda); vs ref = reference "
        "time / ours (medians).\n"
        "copies vs ref: the client's worker time copying layers alone (it overlaps the "
        "caller's compute; it checksums each layer as it copies it); Commit ms: the publish, "
        "which carries those checksums."
    )
    missed = [f"{r.device} {r.op} {r.layout}" for r in rows if r.met is False]
    elapsed = time.perf_counter() - started
    path = os.path.join(args.out, "layerwise.json")
    write_json(
        path,
        {
            "bench": "layerwise",
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "cpus": os.cpu_count(),
            "elapsed_s": elapsed,
            "args": {k: v for k, v in vars(args).items() if k != "log_level"},
            "layout": layout.to_dict(),
            "page_bytes": layout.page_bytes,
            "rows": rows,
            "skipped": skipped,
            "missed": missed,
        },
    )
    print(f"{targets_summary([r.met for r in rows], missed)}. {elapsed:.1f} s. Wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro.layerwise", description=__doc__.split("\n")[0]
    )
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
