"""RDMA transport over the fake verbs backend: what the transport's own work costs per pull.

``python -m bench.micro.rdma_fake`` runs an ``RdmaTransport`` against a ``DataServer`` with an
``RdmaSource`` in this process, on ``messenger.verbs_fake`` (no RDMA hardware here). The fake
copies with ``memmove`` on a thread per QP under one lock, so these are **not hardware
numbers**: they show the transport's control-path cost (RDMA_PIN round trips, the source's
registrations / window binds and invalidations, posting, polling, checksums) and how it scales
with the number of contiguous runs a pin has (``contiguous``: the pages fill the source's slab
in order, one run per request; ``scattered``: they sit in every other slot of a slab twice as
large, so every page is a run of its own, one window each).

Each case: median of ``--runs`` timed fetches of ``--total`` bytes after one warm-up; GB/s =
1e9 bytes/s; ms per RDMA_PIN request (of at most 4096 pages).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.report import parse_bytes
from messenger.data_server import DataServer
from messenger.rdma import RdmaConfig, RdmaSource, RdmaTransport
from messenger.slab_peer import fill_pattern, pattern_keys
from messenger.transport import SlabPageSource
from messenger.verbs_fake import FakeFabric, FakeVerbsBackend

NS = "bench|rdma-fake"


def run_case(total: int, page_bytes: int, scattered: bool, runs: int) -> dict:
    pages = total // page_bytes
    spread = 2 if scattered else 1  # scattered: every other slot, no two pages adjacent
    fabric = FakeFabric()
    region = np.empty(spread * pages * page_bytes, dtype=np.uint8)
    fill_pattern(region.reshape(spread * pages, page_bytes))
    keys = pattern_keys(pages)
    slots = [spread * i for i in range(pages)]
    source = SlabPageSource(NS, region, page_bytes, dict(zip(keys, slots)))
    server = DataServer(source).start()
    rdma_source = RdmaSource(FakeVerbsBackend(fabric, 256), source)
    rdma_source.install(server)
    transport = RdmaTransport(FakeVerbsBackend(fabric, 256), RdmaConfig())
    dst = np.zeros((pages, page_bytes), dtype=np.uint8)
    transport.register_local(dst.reshape(-1))
    views = [memoryview(p) for p in dst]
    times = []
    try:
        for i in range(runs + 1):
            t0 = time.perf_counter()
            res = transport.fetch(server.address, NS, keys, views)
            dt = time.perf_counter() - t0
            if not all(r.ok for r in res):
                raise RuntimeError(f"fetch failed: {next(r for r in res if not r.ok)}")
            if i:
                times.append(dt)
        expected = region.reshape(spread * pages, page_bytes)[slots]
        if not np.array_equal(dst, expected):
            raise RuntimeError("wrong bytes")
    finally:
        transport.close()
        server.stop()
        rdma_source.close()
    t = statistics.median(times)
    requests = max(1, -(-pages // 4096))
    return {
        "pages": pages,
        "page_bytes": page_bytes,
        "layout": "scattered" if scattered else "contiguous",
        "seconds": t,
        "gbps": total / t / 1e9,
        "ms_per_request": 1e3 * t / requests,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total", default="64M", help="bytes per fetch (default 64M)")
    p.add_argument("--sizes", default="16K,256K,1M", help="page sizes (default 16K,256K,1M)")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args(argv)
    total = parse_bytes(args.total)
    print("RDMA over the FAKE verbs backend (memmove in-process; not hardware numbers)")
    print(f"{'page':>6} {'pages':>6} {'layout':>10} {'GB/s':>7} {'ms/request':>11}")
    for size in args.sizes.split(","):
        page_bytes = parse_bytes(size)
        for scattered in (False, True):
            r = run_case(total, page_bytes, scattered, args.runs)
            print(
                f"{size:>6} {r['pages']:>6} {r['layout']:>10} {r['gbps']:>7.2f} "
                f"{r['ms_per_request']:>11.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
