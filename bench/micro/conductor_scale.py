"""``kvcache bench conductor``: the conductor at scale (16 prefill + 16 decode nodes, 1M blocks).

1. **In-process**: the real ``Scheduler`` over a ``GlobalIndex`` filled with ``--blocks``
   distinct block keys held by the nodes (loaded through the same snapshot path a node's event
   feed uses). Decision latency p50 / p99 per policy, printed against the 2 ms p99 target, and
   next to the bare index walk (``GlobalIndex.prefix_lengths``) measured on the same requests.
   The CPU-time p99 (``time.thread_time``) is printed too: on a shared machine the wall-clock
   tail includes time the process was not running at all.
2. **Real conductor process**: ``kvcache conductor`` with 32 registered nodes whose Events
   streams (synthetic node servers in this process: they serve the snapshots only) fill its index;
   its RSS (``VmRSS`` from /proc, after startup and after the index is full) against the 400 MB
   target. Then ``--reps`` interleaved runs, each closed loops of ``--threads`` client threads
   (one channel each, shared by every call kind) issuing ``--grpc-requests`` calls in all: an
   empty RPC (health ``Check``) on the conductor, the reference; ``Schedule`` (goal >= 0.8x the
   empty RPC's rate); ``Schedule`` on a stream (``ScheduleStream``, one per client thread
   through ``ConductorClient.schedule_stream``, a request per message: the conductor gets a
   handler thread per stream and one more, ``--workers`` and ``--max-streams``);
   ``ScheduleBatch`` with ``--batch`` requests per call (a front end batching its arrivals;
   goal >= 10,000 decisions/s); and the empty RPC on a bare sync server and a bare
   ``grpc.aio`` server (``bench.micro.rpc_floor``), the floor of each server kind. Figures are
   medians over the runs; ratios pair runs of the same repetition. The server's CPU time per call
   (from /proc) is printed next to each: on a shared machine it moves less than the rates do. The
   conductor runs with ``--transfer-hook record`` (the synthetic nodes have no messengers).

Workload: ``--blocks`` keys in chains of ``--chain-blocks``; each chain's first holder has all
of it, up to ``--max-holders - 1`` more hold random prefixes of it. A request takes a random
prefix of a random chain plus ``--new-blocks`` uncached blocks (512-token blocks, LLaMA3-70B
layout: Mooncake Table 1). Keys are random 16-byte strings (the conductor treats keys as opaque).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import threading
import time
from collections import deque
from concurrent import futures
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.micro.rpc_floor import KINDS as FLOOR_KINDS
from bench.report import Column, Progress, parse_count, print_table, write_json
from clients.conductor_client import ConductorClient, ScheduleStream
from conductor.cli import DEFAULT_WORKERS
from conductor.index import GlobalIndex
from conductor.registry import NodeDescriptor, Registry, Role
from conductor.scheduler import POLICIES, Request, Scheduler
from kvstore.layout import KVLayout
from node.agent import NodeAgent
from plumbing.launch import ServiceProcess, start_service
from proto import common_pb2 as cpb
from proto import conductor_pb2 as pb
from proto import conductor_pb2_grpc as pbg
from proto import node_pb2 as npb
from proto import node_pb2_grpc as npbg
from rpc.channel import make_channel
from rpc.wire import selector_to_pb

LAYOUT = KVLayout(
    model="llama3-70b", num_layers=80, kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=512
)
P99_TARGET_S = 2e-3
THROUGHPUT_TARGET = 2000.0
RATIO_TARGET = 0.8  # Schedule calls/s over empty calls/s on the same channels
BATCH_TARGET = 10_000.0  # ScheduleBatch decisions/s
RSS_TARGET_MB = 400.0
_DRAM = int(cpb.TIER_DRAM)
_SNAPSHOT_BATCH = 4096


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--blocks", type=parse_count, default=1_000_000, help="distinct indexed blocks (default 1M)"
    )
    parser.add_argument("--chain-blocks", type=int, default=64, help="blocks per prefix chain")
    parser.add_argument("--prefill", type=int, default=16, help="prefill nodes")
    parser.add_argument("--decode", type=int, default=16, help="decode nodes")
    parser.add_argument("--max-holders", type=int, default=3, help="nodes holding a chain, max")
    parser.add_argument(
        "--new-blocks", type=int, default=8, help="uncached blocks appended to every request"
    )
    parser.add_argument(
        "--requests", type=parse_count, default=20_000, help="in-process decisions per policy"
    )
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated policies for the in-process run",
    )
    parser.add_argument("--grpc-policy", default="global-cache", choices=sorted(POLICIES))
    parser.add_argument(
        "--grpc-requests",
        type=parse_count,
        default=1600,
        help="calls of each kind per repetition through gRPC (all threads together)",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=15,
        help="repetitions of the gRPC runs (empty RPC, Schedule, ScheduleBatch and the bare "
        "servers' empty RPC, interleaved); figures are their medians. Many short runs: the "
        "load of a shared machine changes less within one repetition",
    )
    parser.add_argument("--threads", type=int, default=8, help="gRPC client threads")
    parser.add_argument(
        "--batch", type=int, default=16, help="requests per ScheduleBatch call in the batched run"
    )
    parser.add_argument(
        "--skip-grpc", action="store_true", help="in-process only (no conductor process)"
    )
    parser.add_argument("--skip-in-process", action="store_true", help="the conductor process only")
    parser.add_argument(
        "--workers",
        type=int,
        default=DEFAULT_WORKERS,
        help="the conductor's gRPC threads (and the bare servers'); default: the conductor's",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", default="out/bench", help="directory for conductor.json")


# ---- the workload -------------------------------------------------------------------------------


@dataclass
class Workload:
    keys: np.ndarray  # (chains, chain_blocks, 16) uint8
    holders: np.ndarray  # (chains, max_holders) node index, -1: none
    lengths: np.ndarray  # (chains, max_holders) prefix length held
    node_ids: list[str]
    prefill: int
    new_blocks: int

    @property
    def chains(self) -> int:
        return self.keys.shape[0]

    @property
    def distinct_blocks(self) -> int:
        return self.keys.shape[0] * self.keys.shape[1]

    def node_keys(self, node: int) -> list[bytes]:
        """Every key ``node`` holds (its snapshot)."""
        rows = []
        for h in range(self.holders.shape[1]):
            for chain in np.nonzero(self.holders[:, h] == node)[0]:
                rows.append(self.keys[chain, : self.lengths[chain, h]].tobytes())
        buf = b"".join(rows)
        return [buf[i : i + 16] for i in range(0, len(buf), 16)]

    def held_pairs(self) -> int:
        return int(self.lengths[self.holders >= 0].sum())

    def request_keys(self, rng: np.random.Generator) -> list[bytes]:
        chain = int(rng.integers(self.chains))
        n = int(rng.integers(1, self.keys.shape[1] + 1))
        buf = self.keys[chain, :n].tobytes() + rng.bytes(16 * self.new_blocks)
        return [buf[i : i + 16] for i in range(0, len(buf), 16)]


def make_workload(args: argparse.Namespace) -> Workload:
    rng = np.random.default_rng(args.seed)
    chains = max(args.blocks // args.chain_blocks, 1)
    nodes = args.prefill + args.decode
    keys = np.frombuffer(rng.bytes(chains * args.chain_blocks * 16), dtype=np.uint8)
    keys = keys.reshape(chains, args.chain_blocks, 16)
    h = max(min(args.max_holders, nodes), 1)
    holders = np.full((chains, h), -1, dtype=np.int16)
    lengths = np.zeros((chains, h), dtype=np.int32)
    counts = rng.integers(1, h + 1, size=chains)
    for c in range(chains):
        chosen = rng.choice(nodes, size=counts[c], replace=False)
        holders[c, : counts[c]] = chosen
        lengths[c, 0] = args.chain_blocks
        lengths[c, 1 : counts[c]] = rng.integers(1, args.chain_blocks + 1, size=counts[c] - 1)
    node_ids = [f"prefill-{i}" for i in range(args.prefill)] + [
        f"decode-{i}" for i in range(args.decode)
    ]
    return Workload(
        keys=keys,
        holders=holders,
        lengths=lengths,
        node_ids=node_ids,
        prefill=args.prefill,
        new_blocks=args.new_blocks,
    )


def rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# ---- in-process ----------------------------------------------------------------------------------


def build_index(w: Workload, progress: Progress) -> tuple[Registry, float]:
    """Register the nodes and load their snapshots; returns the registry and the RSS growth."""
    gc.collect()
    before = rss_mb()
    registry = Registry(GlobalIndex(), lease_s=1e9)
    for i, node_id in enumerate(w.node_ids):
        role = Role.PREFILL if i < w.prefill else Role.DECODE
        registry.register(NodeDescriptor(node_id=node_id, role=role, layouts=(LAYOUT,)), 0.0)
    index = registry.index
    for i, node_id in enumerate(w.node_ids):
        keys = w.node_keys(i)
        index.begin_resync(node_id)
        index.load_snapshot(node_id, ((k, _DRAM) for k in keys))
        index.finish_resync(node_id, 0)
        progress.update(len(keys))
    del keys
    gc.collect()
    return registry, rss_mb() - before


def bench_in_process(
    w: Workload,
    registry: Registry,
    policies: list[str],
    requests: int,
    seed: int,
    progress: Progress,
) -> list[dict]:
    rows = []
    for policy in policies:
        rng = np.random.default_rng(seed + 1)
        sched = Scheduler(registry, policy=policy, seed=seed, clock=lambda: 0.0)
        index = registry.index
        lat, cpu, walk, reuse = [], [], [], 0
        pending: deque[str] = deque()
        now = 0.0
        for i in range(requests):
            keys = w.request_keys(rng)
            req = Request(
                request_id=f"r{i}",
                keys=keys,
                prompt_tokens=len(keys) * 512 + 100,
                block_tokens=512,
                output_tokens=256,
                namespace=LAYOUT.namespace,
                block_bytes=LAYOUT.page_bytes,
            )
            c0 = time.thread_time()
            t0 = time.perf_counter()
            d = sched.schedule(req, now)
            t1 = time.perf_counter()
            cpu.append(time.thread_time() - c0)
            index.prefix_lengths(keys)
            t2 = time.perf_counter()
            lat.append(t1 - t0)
            walk.append(t2 - t1)
            reuse += d.reuse_blocks
            pending.append(req.request_id)
            now += 0.01
            if len(pending) > 256:  # keep a realistic number of requests in flight
                sched.complete(pending.popleft(), now)
            progress.update()
        while pending:
            sched.complete(pending.popleft(), now)
        p99 = pct(lat, 99)
        rows.append(
            {
                "policy": policy,
                "requests": requests,
                "p50_ms": pct(lat, 50) * 1e3,
                "p99_ms": p99 * 1e3,
                "max_ms": max(lat) * 1e3,
                "cpu_p99_ms": pct(cpu, 99) * 1e3,
                "walk_p50_ms": pct(walk, 50) * 1e3,
                "walk_p99_ms": pct(walk, 99) * 1e3,
                "target_ms": P99_TARGET_S * 1e3,
                "p99_vs_target": p99 / P99_TARGET_S,
                "decisions_per_s": len(lat) / sum(lat),
                "reuse_blocks_avg": reuse / requests,
            }
        )
    return rows


# ---- a real conductor process --------------------------------------------------------------------


class SnapshotNode(npbg.NodeServiceServicer):
    """Serves one node's snapshot on Events, then keeps the stream open with no live events.
    Stands in for a node server holding that many blocks (a real one would need their pages)."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys

    def Events(self, request, context):
        keys = self.keys
        for start in range(0, max(len(keys), 1), _SNAPSHOT_BATCH):
            yield npb.EventBatch(
                events=[
                    cpb.BlockEvent(seq=0, kind=cpb.EVENT_STORED, key=k, tier=cpb.TIER_DRAM)
                    for k in keys[start : start + _SNAPSHOT_BATCH]
                ],
                snapshot=True,
                snapshot_seq=0,
                snapshot_done=start + _SNAPSHOT_BATCH >= len(keys),
            )
        done = threading.Event()
        context.add_callback(done.set)
        done.wait()


def fill_conductor(conductor, w: Workload, progress: Progress):
    """Start the snapshot servers and register every node; wait until the index is full."""
    servers, agents = [], []
    for i, node_id in enumerate(w.node_ids):
        server = grpc.server(futures.ThreadPoolExecutor(2))
        npbg.add_NodeServiceServicer_to_server(SnapshotNode(w.node_keys(i)), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        role = Role.PREFILL if i < w.prefill else Role.DECODE
        agents.append(
            NodeAgent(
                conductor.address,
                None,
                NodeDescriptor(
                    node_id=node_id, role=role, address=f"127.0.0.1:{port}", layouts=(LAYOUT,)
                ),
                load=lambda: None,
            ).start()
        )  # type: ignore[arg-type, return-value]
    stub = pbg.ConductorServiceStub(make_channel(conductor.address))
    expected = w.held_pairs()
    deadline = time.monotonic() + 600
    while True:
        reply = stub.ListNodes(pb.ListNodesRequest(), timeout=30)
        held = sum(n.indexed_blocks for n in reply.nodes)
        progress.update(held - progress.done)
        if len(reply.nodes) == len(w.node_ids) and held == expected:
            break
        if time.monotonic() > deadline or not conductor.alive():
            raise RuntimeError(f"conductor index not full: {held}/{expected} blocks")
        time.sleep(0.2)
    return servers, agents, reply.indexed_keys


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Phase:
    """One timed closed loop: ``calls`` issued by all threads, ``units`` decisions (or calls)."""

    wall_s: float
    latencies: list[float]
    units: int
    server_cpu_s: float

    @property
    def rate(self) -> float:
        return self.units / self.wall_s

    @property
    def p50_ms(self) -> float:
        return pct(self.latencies, 50) * 1e3

    @property
    def p99_ms(self) -> float:
        return pct(self.latencies, 99) * 1e3

    @property
    def cpu_us(self) -> float:
        """Server CPU per unit (decision or call), microseconds."""
        return self.server_cpu_s / self.units * 1e6


def _closed_loop(calls: list[Callable[[int], object]], per: int, pid: int, units: int) -> Phase:
    """One thread per entry of ``calls``, each issuing ``per`` calls back to back (after one
    untimed warm-up call, ``call(-1)``); ``pid``'s CPU time is read around the timed part."""
    lat: list[list[float]] = [[] for _ in calls]
    errors: list[BaseException] = []
    start = threading.Barrier(len(calls) + 1)

    def client(t: int) -> None:
        call = calls[t]
        try:
            call(-1)
            start.wait()
            out = lat[t]
            clock = time.perf_counter
            for i in range(per):
                t0 = clock()
                call(i)
                out.append(clock() - t0)
        except BaseException as e:  # reported after the join
            errors.append(e)
            start.abort()

    pool = [threading.Thread(target=client, args=(t,)) for t in range(len(calls))]
    for t in pool:
        t.start()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        pass
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    for t in pool:
        t.join()
    wall, cpu1 = time.perf_counter() - t0, cpu_seconds(pid)
    if errors:
        raise errors[0]
    return Phase(wall, [x for part in lat for x in part], units, cpu1 - cpu0)


def _health_calls(channels: list[grpc.Channel]) -> list[Callable[[int], object]]:
    req = health_pb2.HealthCheckRequest()

    def make(stub: health_pb2_grpc.HealthStub) -> Callable[[int], object]:
        return lambda i: stub.Check(req, timeout=30)

    return [make(health_pb2_grpc.HealthStub(c)) for c in channels]


def _median(phases: list[Phase], value: Callable[[Phase], float]) -> float:
    return float(statistics.median(value(p) for p in phases))


def bench_grpc(w: Workload, args: argparse.Namespace) -> dict:
    # The synthetic nodes have no messengers: the default hook would fail (and log) every
    # transfer plan; ``record`` keeps the plans, as a hook that hands them on would.
    conductor = start_service(
        [
            "conductor",
            "--listen",
            "127.0.0.1:0",
            "--lease",
            "60",
            "--policy",
            args.grpc_policy,
            "--workers",
            str(max(args.workers, args.threads + 1)),
            "--max-streams",
            str(args.threads),
            "--transfer-hook",
            "record",
            # the bench measures Schedule alone: its requests are never completed, and more of
            # them than the default cap per tenant (1024) stay in the ledger
            "--max-pending-per-tenant",
            "0",
            "--log-level",
            "WARNING",
        ]
    )
    floors: dict[str, ServiceProcess] = {}
    servers, agents = [], []
    channels: list[grpc.Channel] = []
    clients: list[ConductorClient] = []
    streams: list[ScheduleStream] = []
    try:
        for kind in FLOOR_KINDS:
            floors[kind] = start_service(
                [kind, "--workers", str(args.workers)], module="bench.micro.rpc_floor"
            )
        rss_idle = rss_mb(conductor.pid)
        progress = Progress(
            w.held_pairs(), "conductor process: index via Events", enabled=not args.no_progress
        )
        servers, agents, indexed_keys = fill_conductor(conductor, w, progress)
        progress.finish(f"{indexed_keys} keys")
        gc.collect()
        rss_full = rss_mb(conductor.pid)

        # Requests are built outside the timed loops, keys packed as ConductorClient sends them;
        # one list per repetition and thread (request ids are unique: the ledger keeps them).
        rng = np.random.default_rng(args.seed + 2)
        threads, per = args.threads, max(args.grpc_requests // args.threads, 1)
        calls = per * threads

        def requests(tag: str) -> list[list[pb.ScheduleRequest]]:
            return [
                [
                    pb.ScheduleRequest(
                        request_id=f"{tag}-{t}-{i}",
                        output_tokens=256,
                        blocks=selector_to_pb(LAYOUT.namespace, keys=w.request_keys(rng)),
                    )
                    for i in range(per)
                ]
                for t in range(threads)
            ]

        def batched(mine: list[pb.ScheduleRequest]) -> list[pb.ScheduleBatchRequest]:
            return [
                pb.ScheduleBatchRequest(requests=mine[i : i + args.batch])
                for i in range(0, len(mine), args.batch)
            ]

        unary = [requests(f"u{r}") for r in range(args.reps)]
        streamed = [requests(f"s{r}") for r in range(args.reps)]
        batches = [[batched(mine) for mine in requests(f"b{r}")] for r in range(args.reps)]
        n_batches = len(batches[0][0])
        warm = selector_to_pb(LAYOUT.namespace, keys=w.request_keys(rng))

        # One channel per client thread, shared by the empty RPC, Schedule and ScheduleBatch.
        channels = [make_channel(conductor.address) for _ in range(threads)]
        stubs = [pbg.ConductorServiceStub(c) for c in channels]
        floor_channels = {
            k: [make_channel(p.address) for _ in range(threads)] for k, p in floors.items()
        }
        channels += [c for cs in floor_channels.values() for c in cs]

        def schedule_calls(rep: int) -> list[Callable[[int], object]]:
            def make(stub, mine):
                def call(i: int) -> object:
                    if i < 0:
                        return stub.Locate(warm, timeout=30)
                    return stub.Schedule(mine[i], timeout=30)

                return call

            return [make(stubs[t], unary[rep][t]) for t in range(threads)]

        def batch_calls(rep: int) -> list[Callable[[int], object]]:
            def make(stub, mine):
                def call(i: int) -> object:
                    if i < 0:
                        return stub.Locate(warm, timeout=30)
                    reply = stub.ScheduleBatch(mine[i], timeout=30)
                    bad = [o for o in reply.outcomes if o.code]
                    if bad:
                        raise RuntimeError(f"ScheduleBatch outcome {bad[0].code}: {bad[0].message}")
                    return reply

                return call

            return [make(stubs[t], batches[rep][t]) for t in range(threads)]

        # Schedule on a stream: one ScheduleStream per client thread, through ConductorClient's
        # ScheduleStream (its reader thread and hand-off included), one request per message.
        clients += [ConductorClient(conductor.address) for _ in range(threads)]
        streams += [c.schedule_stream() for c in clients]

        def stream_calls(rep: int) -> list[Callable[[int], object]]:
            def make(stream, mine):
                def call(i: int) -> object:
                    if i < 0:  # the stream opens in the warm-up (a Schedule of its own)
                        warm_id = f"warm-{id(stream)}-{stream.opened}-{rep}"
                        return stream.schedule_batch(
                            [pb.ScheduleRequest(request_id=warm_id, blocks=warm)]
                        )
                    (outcome,) = stream.schedule_batch([mine[i]])
                    if outcome.code:
                        raise RuntimeError(f"ScheduleStream: {outcome.code} {outcome.message}")
                    return outcome

                return call

            return [make(streams[t], streamed[rep][t]) for t in range(threads)]

        # Interleaved, so that the ratios compare runs under the same machine load.
        phases: dict[str, list[Phase]] = {
            k: [] for k in ("empty", "schedule", "stream", "batch", *FLOOR_KINDS)
        }
        empty_calls = _health_calls(channels[:threads])
        for rep in range(args.reps):
            phases["empty"].append(_closed_loop(empty_calls, per, conductor.pid, calls))
            phases["schedule"].append(_closed_loop(schedule_calls(rep), per, conductor.pid, calls))
            phases["stream"].append(_closed_loop(stream_calls(rep), per, conductor.pid, calls))
            phases["batch"].append(_closed_loop(batch_calls(rep), n_batches, conductor.pid, calls))
            for kind, p in floors.items():
                phases[kind].append(
                    _closed_loop(_health_calls(floor_channels[kind]), per, p.pid, calls)
                )
        rss_after = rss_mb(conductor.pid)
    finally:
        for c in channels:
            c.close()
        for stream in streams:
            stream.close()
        for client in clients:
            client.close()
        for agent in agents:
            agent.stop(unregister=False)
        conductor.stop()
        for p in floors.values():
            p.stop()
        for server in servers:
            server.stop(0)

    empty, sched, batch = phases["empty"], phases["schedule"], phases["batch"]
    ratios = [s.rate / e.rate for s, e in zip(sched, empty)]
    stream_ratios = [s.rate / e.rate for s, e in zip(phases["stream"], empty)]
    rate = _median(sched, lambda p: p.rate)
    b_rate = _median(batch, lambda p: p.rate)
    rows = [
        _phase_row("empty RPC (health Check), conductor", empty, empty),
        _phase_row("Schedule", sched, empty),
        _phase_row("Schedule on a stream (ScheduleStream)", phases["stream"], empty),
        _phase_row(f"ScheduleBatch, {args.batch} per call (decisions)", batch, empty),
        *(_phase_row(f"empty RPC, bare {k} server", phases[k], empty) for k in FLOOR_KINDS),
    ]
    return {
        "policy": args.grpc_policy,
        "threads": threads,
        "reps": args.reps,
        "decisions": calls,
        "decisions_per_s": rate,
        "target_per_s": THROUGHPUT_TARGET,
        "rate_vs_target": rate / THROUGHPUT_TARGET,
        "p50_ms": _median(sched, lambda p: p.p50_ms),
        "p99_ms": _median(sched, lambda p: p.p99_ms),
        "batch": args.batch,
        "batched_decisions_per_s": b_rate,
        "batched_rate_vs_target": b_rate / BATCH_TARGET,
        "batch_target_per_s": BATCH_TARGET,
        "batch_call_p50_ms": _median(batch, lambda p: p.p50_ms),
        "batch_call_p99_ms": _median(batch, lambda p: p.p99_ms),
        "empty_rpc_per_s": _median(empty, lambda p: p.rate),
        "empty_rpc_p50_ms": _median(empty, lambda p: p.p50_ms),
        "rate_vs_empty_rpc": float(statistics.median(ratios)),
        "rate_vs_empty_rpc_runs": ratios,
        "stream_per_s": _median(phases["stream"], lambda p: p.rate),
        "stream_vs_empty_rpc": float(statistics.median(stream_ratios)),
        "stream_vs_empty_rpc_runs": stream_ratios,
        "ratio_target": RATIO_TARGET,
        "phases": rows,
        "indexed_keys": int(indexed_keys),
        "held_pairs": w.held_pairs(),
        "rss_idle_mb": rss_idle,
        "rss_full_mb": rss_full,
        "rss_after_mb": rss_after,
        "rss_index_mb": rss_full - rss_idle,
        "rss_target_mb": RSS_TARGET_MB,
        "rss_vs_target": max(rss_full, rss_after) / RSS_TARGET_MB,
    }


def _phase_row(name: str, phases: list[Phase], empty: list[Phase]) -> dict:
    """Medians over the repetitions; ``vs_empty`` pairs each run with the empty RPC run of the
    same repetition."""
    return {
        "phase": name,
        "per_s": _median(phases, lambda p: p.rate),
        "p50_ms": _median(phases, lambda p: p.p50_ms),
        "p99_ms": _median(phases, lambda p: p.p99_ms),
        "server_cpu_us": _median(phases, lambda p: p.cpu_us),
        "vs_empty": float(statistics.median(p.rate / e.rate for p, e in zip(phases, empty))),
        "runs_per_s": [p.rate for p in phases],
    }


# ---- the command ---------------------------------------------------------------------------------

IN_PROCESS_COLUMNS = [
    Column("policy", "policy"),
    Column("requests", "decisions"),
    Column("p50_ms", "p50 ms", "{:.3f}"),
    Column("p99_ms", "p99 ms", "{:.3f}"),
    Column("max_ms", "max ms", "{:.2f}"),
    Column("p99_vs_target", "p99/2ms", "{:.2f}"),
    Column("cpu_p99_ms", "CPU p99 ms", "{:.3f}"),
    Column("walk_p50_ms", "index walk p50", "{:.3f}"),
    Column("decisions_per_s", "decisions/s (1 thread)", "{:,.0f}"),
    Column("reuse_blocks_avg", "reused blocks", "{:.1f}"),
]


GRPC_COLUMNS = [
    Column("phase", "gRPC (same client threads and channels)"),
    Column("per_s", "calls/s", "{:,.0f}"),
    Column("p50_ms", "p50 ms", "{:.2f}"),
    Column("p99_ms", "p99 ms", "{:.2f}"),
    Column("server_cpu_us", "server CPU us/call", "{:,.0f}"),
    Column("vs_empty", "vs empty RPC", "{:.2f}"),
]


def run_in_process(w: Workload, policies: list[str], args: argparse.Namespace) -> dict:
    progress = Progress(w.held_pairs(), "in-process index", enabled=not args.no_progress)
    registry, index_mb = build_index(w, progress)
    progress.finish(f"{len(registry.index):,} keys")
    progress = Progress(
        args.requests * len(policies), "in-process schedule", enabled=not args.no_progress
    )
    rows = bench_in_process(w, registry, policies, args.requests, args.seed, progress)
    progress.finish()
    print_table(
        rows,
        IN_PROCESS_COLUMNS,
        title=(
            f"\nin-process Schedule decisions, {len(registry.index):,} indexed blocks, "
            f"{len(w.node_ids)} nodes (target p99 < {P99_TARGET_S * 1e3:.0f} ms)"
        ),
    )
    print(
        f"in-process index memory: {index_mb:.0f} MB RSS growth for {len(registry.index):,} "
        f"keys / {w.held_pairs():,} (key, node) pairs = "
        f"{index_mb * 2**20 / max(len(registry.index), 1):.0f} B per key"
    )
    keys = len(registry.index)
    del registry
    gc.collect()
    return {"in_process": rows, "in_process_index_rss_mb": index_mb, "in_process_keys": keys}


def print_grpc(g: dict) -> None:
    print(
        f"\nreal conductor process ({g['indexed_keys']:,} keys, {g['held_pairs']:,} "
        f"(key, node) pairs from 32 Events streams):"
    )
    print(
        f"  RSS (VmRSS): {g['rss_idle_mb']:.0f} MB idle -> {g['rss_full_mb']:.0f} MB "
        f"indexed -> {g['rss_after_mb']:.0f} MB after the Schedule runs; "
        f"index {g['rss_index_mb']:.0f} MB; target <= {RSS_TARGET_MB:.0f} MB: "
        f"ratio {g['rss_vs_target']:.2f}"
    )
    print_table(
        g["phases"],
        GRPC_COLUMNS,
        title=(
            f"\n{g['threads']} client threads, {g['decisions']:,} calls (decisions) of each kind "
            f"per run, median of {g['reps']} interleaved runs; policy {g['policy']}; "
            "ScheduleBatch: decisions/s, p50/p99 per call, CPU per decision"
        ),
    )
    print(
        f"\nreference, empty RPC (health Check) on the conductor: {g['empty_rpc_per_s']:,.0f} "
        f"calls/s, p50 {g['empty_rpc_p50_ms']:.2f} ms"
    )
    print(
        f"Schedule on a stream (ScheduleStream): {g['stream_per_s']:,.0f} decisions/s = "
        f"{g['stream_vs_empty_rpc']:.2f} x the empty RPC (goal >= {RATIO_TARGET})"
    )
    print(
        f"Schedule: {g['decisions_per_s']:,.0f} calls/s, p50 {g['p50_ms']:.2f} ms; "
        f"Schedule / empty RPC = {g['rate_vs_empty_rpc']:.2f} (goal >= {RATIO_TARGET}; runs: "
        + ", ".join(f"{r:.2f}" for r in g["rate_vs_empty_rpc_runs"])
        + ")"
    )
    print(
        f"ScheduleBatch ({g['batch']} per call): {g['batched_decisions_per_s']:,.0f} "
        f"decisions/s (goal >= {BATCH_TARGET:,.0f}: ratio {g['batched_rate_vs_target']:.2f})"
    )


def run(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(
            f"kvcache bench conductor: unknown policies {unknown}; choose from {sorted(POLICIES)}"
        )
    if (
        args.prefill < 1
        or args.decode < 1
        or args.chain_blocks < 1
        or args.threads < 1
        or args.reps < 1
        or not 1 <= args.batch <= 1024
    ):
        raise SystemExit(
            "kvcache bench conductor: need >= 1 prefill and decode node, chain "
            "block, thread and repetition, and --batch in [1, 1024]"
        )
    # The 32 node agents in this process would log every registration: keep the output a table.
    logging.getLogger("node.agent").setLevel(logging.WARNING)
    w = make_workload(args)
    print(
        f"workload: {w.distinct_blocks:,} distinct blocks in {w.chains:,} chains, "
        f"{w.held_pairs():,} (block, node) pairs on {len(w.node_ids)} nodes "
        f"({args.prefill} prefill + {args.decode} decode)"
    )

    result: dict = {
        "workload": {
            "blocks": w.distinct_blocks,
            "chains": w.chains,
            "held_pairs": w.held_pairs(),
            "nodes": len(w.node_ids),
        }
    }
    if not args.skip_in_process:
        result.update(run_in_process(w, policies, args))
    if not args.skip_grpc:
        g = bench_grpc(w, args)
        result["grpc"] = g
        print_grpc(g)
    path = os.path.join(args.out, "conductor.json")
    write_json(path, result)
    print(f"\nwrote {path}")
    return 0
