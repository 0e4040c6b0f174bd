"""``kvcache bench node``: the node server through the client library, against the in-process
TieredStore measured in the same run.

- write: allocate + copy 1 MiB pages into the leased shared-memory pages + commit;
- read: acquire (pin) + copy the pages out of shared memory + release;
- lookup: round-trip latency of a 64-block Lookup (keys, and token ids hashed by the server);
- streamed: the gRPC Put/Get fallback for remote clients, for scale.
Each figure is printed as a ratio to the in-process store (target: same-host close to 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from bench.report import Column, print_table, write_json
from kvstore.keys import block_keys, root_key
from kvstore.layout import KVLayout
from kvstore.store import StoreConfig, TieredStore
from rpc.launch import start_service

LAYOUT = KVLayout(
    model="bench", num_layers=4, kv_heads=4, head_dim=64, dtype="float16", block_tokens=256
)  # 1 MiB pages
LAYOUT_SPEC = "model=bench,num_layers=4,kv_heads=4,head_dim=64,dtype=float16,block_tokens=256"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--total-mib", type=int, default=256, help="bytes moved per run (MiB)")
    parser.add_argument("--batch", type=int, default=32, help="pages per allocate/acquire call")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--out", default="out/bench", help="directory for node.json")


def _keys(run: int, n: int, tag: str) -> list[bytes]:
    tokens = np.arange(n * LAYOUT.block_tokens, dtype=np.int64) + run * 10_000_000
    return block_keys(tokens, LAYOUT.block_tokens, root_key(LAYOUT.namespace, tag))


def _median_gbps(nbytes: int, secs: list[float]) -> float:
    return nbytes / statistics.median(secs) / 1e9


def bench_in_process(pages: int, batch: int, runs: int, src: np.ndarray) -> dict:
    page = LAYOUT.page_bytes
    out = np.empty(page, dtype=np.uint8)
    store = TieredStore(LAYOUT, StoreConfig(dram_pages=pages))
    w, r = [], []
    try:
        for run in range(runs + 1):
            keys = _keys(run, pages, "inproc")
            t0 = time.perf_counter()
            for b in range(0, pages, batch):
                lease = store.allocate(keys[b : b + batch])
                for i in range(len(lease.keys)):
                    store.write(lease.lease_id, i, src[(b + i) % len(src)])
                store.commit(lease.lease_id)
            t1 = time.perf_counter()
            for b in range(0, pages, batch):
                lease = store.acquire(keys[b : b + batch])
                for i in range(len(lease.keys)):
                    store.copy_out(lease, i, out)
                store.release(lease.lease_id)
            t2 = time.perf_counter()
            store.remove(keys)
            if run:  # the first run warms up (page faults in the slab)
                w.append(t1 - t0)
                r.append(t2 - t1)
    finally:
        store.close()
    return {"write_GBps": _median_gbps(pages * page, w), "read_GBps": _median_gbps(pages * page, r)}


def bench_client(
    address: str, namespace: str, pages: int, batch: int, runs: int, src: np.ndarray, use_shm: bool
) -> dict:
    from clients import KVStoreClient

    page = LAYOUT.page_bytes
    out = np.empty(page, dtype=np.uint8)
    w, r = [], []
    with KVStoreClient(address, use_shm=use_shm, timeout_s=120) as c:
        for run in range(runs + 1):
            keys = _keys(run, pages, f"client-{use_shm}")
            t0 = time.perf_counter()
            for b in range(0, pages, batch):
                chunk = keys[b : b + batch]
                if use_shm:
                    lease = c.allocate(namespace, keys=chunk)
                    for i in lease.to_write:
                        np.copyto(lease.page(i), src[(b + i) % len(src)])
                    lease.commit()
                else:
                    c.put(
                        namespace, [src[(b + i) % len(src)] for i in range(len(chunk))], keys=chunk
                    )
            t1 = time.perf_counter()
            for b in range(0, pages, batch):
                chunk = keys[b : b + batch]
                if use_shm:
                    with c.acquire(namespace, keys=chunk) as lease:
                        for i in range(len(chunk)):
                            np.copyto(out, lease.page(i))
                else:
                    c.get(namespace, keys=chunk)
            t2 = time.perf_counter()
            c.remove(namespace, keys=keys)
            if run:
                w.append(t1 - t0)
                r.append(t2 - t1)
    return {"write_GBps": _median_gbps(pages * page, w), "read_GBps": _median_gbps(pages * page, r)}


def bench_lookup(address: str, namespace: str, n: int) -> dict:
    from clients import KVStoreClient

    keys = _keys(99, 64, "lookup")
    tokens = np.arange(64 * LAYOUT.block_tokens)
    res = {}
    with KVStoreClient(address) as c:
        for label, kw in (("keys", {"keys": keys}), ("tokens", {"tokens": tokens})):
            for _ in range(50):
                c.lookup(namespace, **kw)
            lat = []
            for _ in range(n):
                t0 = time.perf_counter()
                c.lookup(namespace, **kw)
                lat.append(time.perf_counter() - t0)
            lat.sort()
            res[label] = {
                "p50_us": lat[len(lat) // 2] * 1e6,
                "p99_us": lat[int(len(lat) * 0.99)] * 1e6,
            }
    return res


def bench_memcpy(pages: int, runs: int, src: np.ndarray) -> float:
    dst = np.empty((pages, LAYOUT.page_bytes), dtype=np.uint8)
    dst[:] = 1
    secs = []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        for i in range(pages):
            np.copyto(dst[i], src[i % len(src)])
        secs.append(time.perf_counter() - t0)
    return _median_gbps(pages * LAYOUT.page_bytes, secs[1:])


def run(args: argparse.Namespace) -> int:
    pages = args.total_mib * (1 << 20) // LAYOUT.page_bytes
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (16, LAYOUT.page_bytes), dtype=np.uint8)
    memcpy = bench_memcpy(pages, args.runs, src)
    ref = bench_in_process(pages, args.batch, args.runs, src)
    with tempfile.TemporaryDirectory() as tmp:
        node = start_service(
            [
                "node",
                "--listen",
                "127.0.0.1:0",
                "--dram",
                f"{args.total_mib + 16}MiB",
                "--layout",
                LAYOUT_SPEC,
            ],
            log_dir=tmp,
        )
        try:
            shm = bench_client(
                node.address, LAYOUT.namespace, pages, args.batch, args.runs, src, use_shm=True
            )
            streamed = bench_client(
                node.address,
                LAYOUT.namespace,
                pages // 4,
                args.batch,
                args.runs,
                src,
                use_shm=False,
            )
            lookup = bench_lookup(node.address, LAYOUT.namespace, args.lookups)
        finally:
            node.stop()
    rows = []
    for name, res in (
        ("in-process TieredStore (reference)", ref),
        ("client, shared memory", shm),
        ("client, streamed gRPC", streamed),
    ):
        for op in ("write", "read"):
            gbps = res[f"{op}_GBps"]
            rows.append(
                {
                    "path": name,
                    "op": op
                    + (" (alloc+copy+commit)" if op == "write" else " (acquire+copy+release)"),
                    "GBps": gbps,
                    "vs_store": gbps / ref[f"{op}_GBps"],
                    "vs_memcpy": gbps / memcpy,
                }
            )
    print(
        f"1 MiB pages, {pages} pages per run, batches of {args.batch}, median of {args.runs} "
        f"runs; numpy memcpy reference {memcpy:.2f} GB/s"
    )
    print_table(
        rows,
        [
            Column("path", "path"),
            Column("op", "op"),
            Column("GBps", "GB/s", "{:.2f}"),
            Column("vs_store", "x store", "{:.2f}"),
            Column("vs_memcpy", "x memcpy", "{:.2f}"),
        ],
    )
    print()
    print_table(
        [{"request": f"64-block Lookup by {k}", **v} for k, v in lookup.items()],
        [
            Column("request", "request"),
            Column("p50_us", "p50 us", "{:.0f}"),
            Column("p99_us", "p99 us", "{:.0f}"),
        ],
    )
    result = {
        "memcpy_GBps": memcpy,
        "in_process": ref,
        "client_shm": shm,
        "client_streamed": streamed,
        "lookup_64_blocks": lookup,
        "pages": pages,
        "batch": args.batch,
        "runs": args.runs,
    }
    path = os.path.join(args.out, "node.json")
    write_json(path, result)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    configure(p)
    raise SystemExit(run(p.parse_args()))
