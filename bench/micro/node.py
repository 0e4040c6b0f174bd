"""``kvcache bench node``: the node server through the client library, against references
measured in the same run.

Same-host pages (1 MiB, batches of ``--batch``), each figure a ratio to the in-process
``TieredStore`` and to numpy memcpy, and to the peers run beside it:
- write: allocate + copy into the leased shared-memory pages, each checksummed as it is copied
  (``copy_checksum``; the client's ``WriteLease.write``) + commit carrying the checksums;
- read: acquire (pin) + copy out of shared memory + release;
- streamed: the gRPC Put/Get fallback for remote clients, for scale;
- Mooncake's store, zero-copy batch put/get (``batch_put_from`` / ``batch_get_into``), and
  LMCache's server (its shared-memory mode; as a ratio to the memcpy of its own run), when their
  venvs exist (``bench/micro/peers.py``).

Lookup of ``--lookup-blocks`` cached blocks (16-token blocks, vLLM's granularity) by keys and by
token ids (hashed by the server), p50 as a ratio to an empty unary gRPC call (health Check) on the
same channel, interleaved with it; and Mooncake's ``batch_is_exist`` of as many keys.

Every figure is the median of ``--runs`` repetitions (after a warm-up run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Callable

import numpy as np

from bench.micro import peers
from bench.report import Column, print_table, write_json
from kvstore.keys import block_keys, root_key
from kvstore.layout import KVLayout
from kvstore.payload import copy_checksum
from kvstore.store import StoreConfig, TieredStore
from plumbing.launch import start_service

LAYOUT = KVLayout(
    model="bench", num_layers=4, kv_heads=4, head_dim=64, dtype="float16", block_tokens=256
)  # 1 MiB pages
LAYOUT_SPEC = "model=bench,num_layers=4,kv_heads=4,head_dim=64,dtype=float16,block_tokens=256"
LOOKUP_LAYOUT = "model=lookup,num_layers=1,kv_heads=1,head_dim=32,dtype=float16,block_tokens=16"
LOOKUP_GOAL_MS, LOOKUP_GOAL_X = 1.0, 1.5  # p50 <= 1.0 ms, or <= 1.5x an empty call


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--total-mib", type=int, default=256, help="bytes moved per run (MiB)")
    parser.add_argument(
        "--batch",
        type=int,
        default=64,
        help="pages per allocate/acquire call (default 64: 64 MiB, as Mooncake's harness batches)",
    )
    parser.add_argument("--runs", type=int, default=5, help="repetitions (median reported)")
    parser.add_argument("--lookups", type=int, default=400, help="calls per lookup repetition")
    parser.add_argument("--lookup-blocks", type=int, default=1000)
    parser.add_argument("--no-peers", action="store_true", help="skip Mooncake and LMCache")
    parser.add_argument(
        "--dram-checksums",
        choices=["on", "off"],
        default="on",
        help="the node's DRAM page checksums (default on, as a node runs; off: what they cost)",
    )
    parser.add_argument("--out", default="out/bench", help="directory for node.json")


def _keys(run: int, n: int, tag: str) -> list[bytes]:
    tokens = np.arange(n * LAYOUT.block_tokens, dtype=np.int64) + run * 10_000_000
    return block_keys(tokens, LAYOUT.block_tokens, root_key(LAYOUT.namespace, tag))


def _median_gbps(nbytes: int, secs: list[float]) -> float:
    return nbytes / statistics.median(secs) / 1e9


class InProcess:
    """The reference: the same work on an in-process ``TieredStore`` (shared-memory slab), with
    the zero-copy page views the same-host client gets (so the ratio is what the client and the
    node process add: RPCs, leases held by another process)."""

    def __init__(self, pages: int, checksums: bool = True) -> None:
        self.store = TieredStore(LAYOUT, StoreConfig(dram_pages=pages, dram_checksums=checksums))
        self.out = np.empty(LAYOUT.page_bytes, dtype=np.uint8)

    def round(self, run: int, pages: int, batch: int, src: np.ndarray) -> tuple[float, float]:
        store, keys = self.store, _keys(run, pages, "inproc")
        t0 = time.perf_counter()
        for b in range(0, pages, batch):
            lease = store.allocate(keys[b : b + batch])
            sums = np.zeros(len(lease.keys), dtype=np.uint64)
            for i in lease.to_write:  # each page checksummed as it is copied, as the clients do
                sums[i] = copy_checksum(store.page_view(lease, i), src[(b + i) % len(src)])
            store.commit(lease.lease_id, written_in_place=True, checksums=sums)
        t1 = time.perf_counter()
        for b in range(0, pages, batch):
            lease = store.acquire(keys[b : b + batch])
            for i in range(len(lease.keys)):
                np.copyto(self.out, store.page_view(lease, i))
            store.release(lease.lease_id)
        t2 = time.perf_counter()
        store.remove(keys)
        return t1 - t0, t2 - t1

    def close(self) -> None:
        self.store.close()


def _sources(src: np.ndarray, first: int, n: int) -> list[np.ndarray]:
    """The source pages of a batch of ``n`` keys starting at key ``first``, cycling ``src``."""
    return [src[(first + i) % len(src)] for i in range(n)]


class Client:
    """The client library against a node process: shared memory, or the streamed fallback."""

    def __init__(self, address: str, use_shm: bool) -> None:
        from clients import KVStoreClient

        self.c = KVStoreClient(address, use_shm=use_shm, timeout_s=120)
        self.ns = LAYOUT.namespace
        self.use_shm = use_shm
        self.out = np.empty(LAYOUT.page_bytes, dtype=np.uint8)

    def round(self, run: int, pages: int, batch: int, src: np.ndarray) -> tuple[float, float]:
        c, ns, keys = self.c, self.ns, _keys(run, pages, f"client-{self.use_shm}")
        t0 = time.perf_counter()
        for b in range(0, pages, batch):
            chunk = keys[b : b + batch]
            if self.use_shm:
                lease = c.allocate(ns, keys=chunk)
                lease.commit(lease.write(_sources(src, b, len(lease.keys))))
            else:
                c.put(ns, [src[(b + i) % len(src)] for i in range(len(chunk))], keys=chunk)
        t1 = time.perf_counter()
        for b in range(0, pages, batch):
            chunk = keys[b : b + batch]
            if self.use_shm:
                with c.acquire(ns, keys=chunk) as lease:
                    for i in range(len(chunk)):
                        np.copyto(self.out, lease.page(i))
            else:
                c.get(ns, keys=chunk)
        t2 = time.perf_counter()
        c.remove(ns, keys=keys)
        return t1 - t0, t2 - t1

    def close(self) -> None:
        self.c.close()


class PipelinedClient(Client):
    """The shared-memory client as an engine that streams batches would use it: the next
    batch's Allocate / Acquire and this batch's Commit / Release run on the client's background
    thread (``*_async``) while this batch's pages are copied."""

    def round(self, run: int, pages: int, batch: int, src: np.ndarray) -> tuple[float, float]:
        c, ns, keys = self.c, self.ns, _keys(run, pages, "client-pipelined")
        chunks = [keys[b : b + batch] for b in range(0, pages, batch)]
        t0 = time.perf_counter()
        commits = []
        nxt = c.allocate_async(ns, keys=chunks[0])
        for j in range(len(chunks)):
            lease = nxt.result()
            if j + 1 < len(chunks):
                nxt = c.allocate_async(ns, keys=chunks[j + 1])
            sums = lease.write(_sources(src, j * batch, len(lease.keys)))
            commits.append(c.commit_async(lease, sums))
        for f in commits:
            f.result()
        t1 = time.perf_counter()
        releases = []
        nxt_r = c.acquire_async(ns, keys=chunks[0])
        for j, chunk in enumerate(chunks):
            rlease = nxt_r.result()
            if j + 1 < len(chunks):
                nxt_r = c.acquire_async(ns, keys=chunks[j + 1])
            for i in range(len(chunk)):
                np.copyto(self.out, rlease.page(i))
            releases.append(c.release_async(rlease))
        for f in releases:
            f.result()
        t2 = time.perf_counter()
        c.remove(ns, keys=keys)
        return t1 - t0, t2 - t1


def memcpy_round(dst: np.ndarray, src: np.ndarray) -> float:
    t0 = time.perf_counter()
    for i in range(len(dst)):
        np.copyto(dst[i], src[i % len(src)])
    return time.perf_counter() - t0


def bench_pages(
    address: str, pages: int, batch: int, runs: int, src: np.ndarray, checksums: bool = True
) -> dict:
    """memcpy, the in-process store, the shared-memory client and the streamed client, one
    round of each per repetition (interleaved: a busy spell of the machine hits them alike);
    GB/s of the median round, after a warm-up repetition."""
    page = LAYOUT.page_bytes
    dst = np.ones((pages, page), dtype=np.uint8)
    ref, shm, streamed = InProcess(pages, checksums), Client(address, True), Client(address, False)
    piped = PipelinedClient(address, True)
    small = max(batch, pages // 4)  # the streamed path is slow: fewer pages
    secs: dict[str, list[float]] = {}
    try:
        for run in range(runs + 1):
            rounds = {
                "memcpy": (memcpy_round(dst, src),),
                "in_process": ref.round(run, pages, batch, src),
                "client_shm": shm.round(run, pages, batch, src),
                "client_pipelined": piped.round(run, pages, batch, src),
                "client_streamed": streamed.round(run, small, batch, src),
            }
            if run == 0:
                continue  # warm-up: page faults in the slabs
            for name, times in rounds.items():
                for op, t in zip(("write", "read"), times):
                    secs.setdefault(f"{name}.{op}", []).append(t)
    finally:
        for x in (ref, shm, piped, streamed):
            x.close()
    out: dict = {"memcpy_GBps": _median_gbps(pages * page, secs["memcpy.write"])}
    for name in ("in_process", "client_shm", "client_pipelined", "client_streamed"):
        n = small if name == "client_streamed" else pages
        out[name] = {
            f"{op}_GBps": _median_gbps(n * page, secs[f"{name}.{op}"]) for op in ("write", "read")
        }
    return out


def _p50_ms(call: Callable[[], object], n: int) -> float:
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat) * 1e3


def bench_lookup(address: str, n_blocks: int, calls: int, runs: int) -> dict:
    """p50 of Lookup by keys and by tokens, and of an empty call on the same channel, per
    repetition (interleaved); medians over the repetitions."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from clients import KVStoreClient

    with KVStoreClient(address) as c:
        ns = c.namespaces()[0]
        bt = c.layout(ns).block_tokens
        tokens = np.random.default_rng(7).integers(0, 128_000, n_blocks * bt, dtype=np.int64)
        lease = c.allocate(ns, tokens=tokens)
        keys = list(lease.keys)
        lease.commit()
        assert c.lookup(ns, keys=keys).hit_blocks == n_blocks
        stub = health_pb2_grpc.HealthStub(c._channel)  # the client's own channel
        empty = health_pb2.HealthCheckRequest()
        subjects: dict[str, Callable[[], object]] = {
            "empty unary RPC (health Check)": lambda: stub.Check(empty),
            f"Lookup of {n_blocks} blocks by keys": lambda: c.lookup(ns, keys=keys),
            f"Lookup of {n_blocks} blocks by tokens": lambda: c.lookup(ns, tokens=tokens),
        }
        for f in subjects.values():  # warm-up
            _p50_ms(f, 50)
        per: dict[str, list[float]] = {k: [] for k in subjects}
        for _ in range(runs):
            for name, f in subjects.items():
                per[name].append(_p50_ms(f, calls))
    return {name: statistics.median(v) for name, v in per.items()}


def _node(tmp: str, layout: str, dram_mib: int, checksums: bool = True):
    args = ["node", "--listen", "127.0.0.1:0", "--dram", f"{dram_mib}MiB", "--layout", layout]
    return start_service(args + ([] if checksums else ["--no-dram-checksums"]), log_dir=tmp)


def run(args: argparse.Namespace) -> int:
    pages = args.total_mib * (1 << 20) // LAYOUT.page_bytes
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (16, LAYOUT.page_bytes), dtype=np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        checksums = args.dram_checksums == "on"
        node = _node(tmp, LAYOUT_SPEC, args.total_mib + 16, checksums)
        try:
            got = bench_pages(node.address, pages, args.batch, args.runs, src, checksums)
        finally:
            node.stop()
        node = _node(tmp, LOOKUP_LAYOUT, 16)
        try:
            lookup = bench_lookup(node.address, args.lookup_blocks, args.lookups, args.runs)
        finally:
            node.stop()
    mc, mc_note = (None, "Mooncake store skipped (--no-peers)")
    lm, lm_note = (None, "LMCache server skipped (--no-peers)")
    if not args.no_peers:
        print("  running Mooncake's store (shared/peers/mooncake_store_bench.py) ...", flush=True)
        mc, mc_note = peers.mooncake_store(
            LAYOUT.page_bytes, pages * LAYOUT.page_bytes, args.runs, args.lookup_blocks
        )
        print("  running LMCache's server (shared/peers/lmcache/storage_bench.py) ...", flush=True)
        lm, lm_note = peers.lmcache_server(args.total_mib / 1024, args.runs)
    memcpy, ref, shm, piped, streamed = (
        got["memcpy_GBps"],
        got["in_process"],
        got["client_shm"],
        got["client_pipelined"],
        got["client_streamed"],
    )
    rows = []
    paths = [
        ("in-process TieredStore (reference)", ref),
        ("client, shared memory", shm),
        ("client, shared memory, pipelined (*_async)", piped),
        ("client, streamed gRPC", streamed),
    ]
    if mc is not None:
        paths.append(
            ("Mooncake store, zcopy batch", {"write_GBps": mc.put_GBps, "read_GBps": mc.get_GBps})
        )
    for name, res in paths:
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
                    "vs_mooncake": gbps / (mc.put_GBps if op == "write" else mc.get_GBps)
                    if mc is not None
                    else None,
                }
            )
    if lm is not None:
        for op, gbps, x in (
            ("write (store)", lm.store_GBps, lm.store_vs_memcpy),
            ("read (retrieve)", lm.retrieve_GBps, lm.retrieve_vs_memcpy),
        ):
            rows.append(
                {"path": "LMCache server (its own memcpy)", "op": op, "GBps": gbps, "vs_memcpy": x}
            )
    print(
        f"1 MiB pages, {pages} pages per round, batches of {args.batch}, median of {args.runs} "
        f"interleaved rounds, DRAM checksums {args.dram_checksums}; numpy memcpy reference "
        f"{memcpy:.2f} GB/s (Mooncake and LMCache ran after, in their own processes)"
    )
    print_table(
        rows,
        [
            Column("path", "path"),
            Column("op", "op"),
            Column("GBps", "GB/s", "{:.2f}"),
            Column("vs_store", "x store", "{:.2f}"),
            Column("vs_memcpy", "x memcpy", "{:.2f}"),
            Column("vs_mooncake", "x Mooncake", "{:.2f}"),
        ],
    )
    print(f"peers: {mc_note}; {lm_note}")
    print()
    empty = next(iter(lookup.values()))
    lrows = [
        {
            "request": name,
            "p50_ms": ms,
            "vs_empty": ms / empty,
            "goal": None
            if name.startswith("empty")
            else ("met" if ms <= LOOKUP_GOAL_MS or ms / empty <= LOOKUP_GOAL_X else "not met"),
        }
        for name, ms in lookup.items()
    ]
    if mc is not None:
        lrows.append(
            {
                "request": f"Mooncake batch_is_exist of {mc.exist_keys} keys (its own run)",
                "p50_ms": mc.batch_is_exist_ms,
                "vs_empty": mc.batch_is_exist_ms / empty,
            }
        )
    print_table(
        lrows,
        [
            Column("request", "request"),
            Column("p50_ms", "p50 ms", "{:.3f}"),
            Column("vs_empty", "x empty RPC", "{:.2f}"),
            Column("goal", f"goal (<= {LOOKUP_GOAL_MS} ms or <= {LOOKUP_GOAL_X}x)"),
        ],
        title=f"Lookup p50, median of {args.runs} repetitions of {args.lookups} calls",
    )
    result = {
        "memcpy_GBps": memcpy,
        "in_process": ref,
        "client_shm": shm,
        "client_pipelined": piped,
        "client_streamed": streamed,
        "mooncake_store": vars(mc) if mc is not None else None,
        "lmcache_server": vars(lm) if lm is not None else None,
        "peers": [mc_note, lm_note],
        "lookup_p50_ms": lookup,
        "lookup_blocks": args.lookup_blocks,
        "pages": pages,
        "batch": args.batch,
        "runs": args.runs,
        "dram_checksums": args.dram_checksums,
    }
    path = os.path.join(args.out, "node.json")
    write_json(path, result)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    configure(p)
    raise SystemExit(run(p.parse_args()))
