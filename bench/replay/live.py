"""``kvcache bench live``: replay a trace against a running cluster with real page bytes.

The first ``--requests`` requests of a Mooncake-format trace arrive at their timestamps divided by
``--speedup`` and are served by ``--concurrency`` emulated engines
(``bench/replay/live_engine.py``): conductor ``Schedule``, prefix load and synthetic prefill on the
chosen prefill node (through the client library and shared memory), hot-block replication and
prefill -> decode pulls by the messengers over TCP, byte-for-byte verification of every page
loaded or moved, completions.

References measured in the same run: the hit rate an infinite cache shared by all nodes would give
the same requests (so the table prints hit rate as a fraction of it), the bare gRPC round trip
(health check) to the conductor and to a node (schedule and lookup latency are printed as
multiples of it), and the messenger bench between the same nodes (``--reference-runs`` bulk pulls
of ``--reference-bytes`` from the first prefill node to the first decode node through their
messengers, as ``kvcache bench transfer`` times them; half before the replay, half after, outside
the byte counts), of which the prefill -> decode rate while pulls ran is printed as a fraction.
Bytes moved between nodes come from the messengers' Prometheus counters (exact, whoever submitted
the transfer) when ``kvcache up`` exposed them, else from the replies seen here.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.micro.transfer_rig import MessengerPull
from bench.report import Progress, figure, human, parse_bytes, write_json
from clients.conductor_client import ConductorClient
from clients.node_client import KVCacheRpcError, KVStoreClient
from kvstore.keys import block_keys, root_key
from rpc.channel import make_channel

from .live_engine import (
    ClusterInfo,
    Engine,
    EngineOptions,
    LiveError,
    RequestOutcome,
    load_cluster,
    prompt_tokens,
)
from .trace import DEFAULT_BLOCK_TOKENS, DEFAULT_TRACE, TraceError, TraceRequest, load_trace

DEFAULT_CLUSTER = os.path.join("out", "cluster", "cluster.json")
RECEIVED_BYTES = "kvcache_messenger_received_bytes_total"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cluster",
        default=DEFAULT_CLUSTER,
        help="the cluster's state file written by 'kvcache up' (default %(default)s)",
    )
    parser.add_argument(
        "--trace",
        default=DEFAULT_TRACE,
        help="Mooncake-format JSONL trace (default: ../shared/data/conversation_trace.jsonl)",
    )
    parser.add_argument(
        "--trace-block-tokens",
        type=int,
        default=DEFAULT_BLOCK_TOKENS,
        help="tokens per hash_id in the trace (default %(default)s)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=500,
        help="replay the first N requests (0: all; default %(default)s)",
    )
    parser.add_argument(
        "--speedup",
        type=float,
        default=5.0,
        help="time compression: arrivals at timestamp / X (0: all at once; default %(default)s)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="requests in flight at once (emulated engines; default %(default)s)",
    )
    parser.add_argument(
        "--ttft-slo",
        type=float,
        default=0.0,
        help="TTFT SLO in seconds sent with every Schedule (0: none); the "
        "conductor rejects requests whose estimate exceeds it",
    )
    parser.add_argument("--tbt-slo", type=float, default=0.0, help="TBT SLO in seconds (0: none)")
    parser.add_argument(
        "--transfer-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for one transfer batch (default %(default)s)",
    )
    parser.add_argument(
        "--namespace",
        default=None,
        help="layout namespace to use (default: the one the prefill nodes serve)",
    )
    parser.add_argument(
        "--salt",
        default=None,
        help="cache salt of every request (default: a fresh one per run, so each "
        "run starts cold; give a fixed one to reuse an earlier run's cache)",
    )
    parser.add_argument(
        "--reference-runs",
        type=int,
        default=6,
        help="bulk messenger pulls between the first prefill and the first decode node, half "
        "before and half after the replay: the reference of the prefill -> decode rate "
        "(median; 0: skip; default %(default)s)",
    )
    parser.add_argument(
        "--reference-bytes",
        type=parse_bytes,
        default=128 << 20,
        help="bytes of each reference pull (at most a quarter of the nodes' DRAM; default 128M)",
    )
    parser.add_argument("--token", default=None, help="bearer token (default: cluster.json's)")
    parser.add_argument(
        "--out",
        default=os.path.join("out", "bench"),
        help="directory for live.json and live.png (default %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true")


# ---- preparing a run -------------------------------------------------------------------------


def wait_for_nodes(
    conductor: ConductorClient, cluster: ClusterInfo, timeout_s: float = 30.0
) -> None:
    """Nodes register with the conductor after they serve; wait until every node of the cluster
    is registered and its index is loaded (a real readiness signal, with a deadline)."""
    wanted = {n.id for n in cluster.nodes}
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        try:
            reply = conductor.list_nodes()
            ready = {s.node.node_id for s in reply.nodes if not s.resyncing}
        except KVCacheRpcError as e:
            raise LiveError(
                f"conductor {cluster.conductor} does not answer: {e.code.name}: "
                f"{e.details} (is the cluster up? 'kvcache up --detach')"
            ) from None
        if wanted <= ready:
            return
        if time.monotonic() > deadline:
            raise LiveError(
                f"nodes {sorted(wanted - ready)} did not register with the conductor "
                f"within {timeout_s:g} s; see the logs under the cluster's state_dir"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def pick_namespace(node: KVStoreClient, wanted: str | None) -> str:
    served = node.namespaces()
    if wanted:
        if wanted not in served:
            raise LiveError(f"namespace {wanted!r} is not served; the nodes serve {served}")
        return wanted
    if len(served) != 1:
        raise LiveError(f"the nodes serve several namespaces {served}; choose one with --namespace")
    return served[0]


def grpc_rtt_s(
    address: str, token: str | None, tls_ca: str | None = None, rounds: int = 50
) -> float:
    """Median round trip of a gRPC health check: the floor under every call measured here."""
    channel = make_channel(address, token, tls_ca)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        times = []
        for _ in range(rounds + 5):
            t = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            times.append(time.perf_counter() - t)
        return float(np.median(times[5:]))
    finally:
        channel.close()


def received_bytes(cluster: ClusterInfo) -> dict[str, float] | None:
    """Node id -> page bytes its messenger received so far (None: a counter is unreadable)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for node in cluster.nodes:
        if node.messenger_metrics is None:
            return None
        try:
            with urllib.request.urlopen(f"http://{node.messenger_metrics}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return None
        out[node.id] = sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == RECEIVED_BYTES
        )
    return out


def ideal_hits(
    requests: list[TraceRequest], served: list[bool], trace_block_tokens: int, block_tokens: int
) -> list[int]:
    """Per request, the prefix blocks one infinite cache shared by all nodes would hold when it
    arrives, having kept every block of the earlier served requests (the reference hit rate;
    rejected requests store nothing). Keyed like the nodes key them: chained over tokens."""
    root = root_key("bench/live/ideal")
    seen: set[bytes] = set()
    hits = []
    for r, ok in zip(requests, served):
        keys = block_keys(prompt_tokens(r, trace_block_tokens), block_tokens, root)
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hits.append(n)
        if ok:
            seen.update(keys)
    return hits


# ---- the messenger reference -----------------------------------------------------------------


@dataclass
class Reference:
    """The messenger bench between two nodes of the cluster: bulk pulls of the same pages."""

    source: str  # node ids
    destination: str
    pull: MessengerPull
    runs_s: list[float] = field(default_factory=list)

    def measure(self, rounds: int) -> None:
        try:
            self.pull.store()  # the replay may have evicted them from the source
            for _ in range(rounds):
                self.runs_s.append(self.pull.round())
        except (RuntimeError, KVCacheRpcError) as e:
            raise LiveError(f"messenger reference {self.source} -> {self.destination}: {e}") from e

    @property
    def gbps(self) -> float | None:
        if not self.runs_s:
            return None
        return self.pull.total_bytes / float(np.median(self.runs_s)) / 1e9

    def runs_gbps(self) -> list[float]:
        return [self.pull.total_bytes / t / 1e9 for t in self.runs_s]

    def finish(self) -> None:
        """Check the last round's bytes and remove the reference pages from both nodes."""
        try:
            ok = self.pull.verify()
            self.pull.cleanup()
        except KVCacheRpcError as e:
            raise LiveError(f"messenger reference: {e}") from e
        if not ok:
            raise LiveError(
                f"messenger reference {self.source} -> {self.destination}: wrong bytes arrived"
            )


def open_reference(
    engine: Engine, cluster: ClusterInfo, namespace: str, total_bytes: int
) -> Reference:
    """Random pages on the first prefill node, pulled by the first decode node's messenger (the
    pair the replay's prefill -> decode pulls run between); one warm-up round."""
    src = next(n for n in cluster.nodes if n.role in ("prefill", "both"))
    dst = next((n for n in cluster.nodes if n.role == "decode"), None) or next(
        (n for n in cluster.nodes if n is not src), None
    )
    if dst is None:
        raise LiveError("the messenger reference needs two nodes (--reference-runs 0 skips it)")
    a, b = engine.node(src.address), engine.node(dst.address)
    info_a, info_b = a.namespace_info(namespace), b.namespace_info(namespace)
    # NOTE: a quarter of the smaller DRAM at most: the pages must fit beside the replay's.
    pages = min(total_bytes // info_a.page_bytes, min(info_a.dram_pages, info_b.dram_pages) // 4)
    salt = f"bench-live-reference-{engine.options.run_id}".encode()
    try:
        pull = MessengerPull(
            a, b, engine.messenger(dst.messenger), src.messenger, namespace, max(1, pages), salt
        )
        pull.round()
    except (RuntimeError, KVCacheRpcError) as e:
        raise LiveError(f"messenger reference {src.id} -> {dst.id}: {e}") from e
    return Reference(src.id, dst.id, pull)


# ---- the replay ------------------------------------------------------------------------------


def replay(
    engine: Engine,
    requests: list[TraceRequest],
    speedup: float,
    concurrency: int,
    progress: Progress,
) -> list[RequestOutcome]:
    """Release each request at its (compressed) arrival time to a pool of ``concurrency``
    engines; a request arriving while all are busy waits (its queueing delay is measured)."""
    t0 = requests[0].timestamp_ms
    lock = threading.Lock()
    tally = Counter()

    def done(f: Future) -> None:
        if f.exception() is not None:
            return  # re-raised below by f.result()
        o = f.result()
        with lock:
            tally[o.status] += 1
            tally["blocks"] += o.total_blocks
            tally["reused"] += o.reused_blocks
            hit = tally["reused"] / tally["blocks"] if tally["blocks"] else 0.0
            progress.update(
                1,
                f"ok {tally['ok']} rejected {tally['rejected']} failed "
                f"{tally['failed']} hit {hit:.1%}",
            )

    futures: list[Future] = []
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="engine")
    try:
        start = engine.now()
        for i, r in enumerate(requests):
            arrival = start + ((r.timestamp_ms - t0) / 1000.0 / speedup if speedup else 0.0)
            delay = arrival - engine.now()
            if delay > 0:
                time.sleep(delay)  # pacing the arrivals, not waiting for a result
            f = pool.submit(engine.serve, i, r, arrival)
            f.add_done_callback(done)
            futures.append(f)
    except BaseException:  # Ctrl-C: requests not started yet are dropped, running ones finish
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return [f.result() for f in futures]


# ---- the summary -----------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, -np.inf
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


@dataclass(kw_only=True)
class LiveSummary:
    requests: int
    scheduled: int
    rejected: int
    failed: int
    ok: int
    wall_s: float
    blocks: int
    reused_blocks: int
    local_blocks: int
    fetched_blocks: int
    computed_blocks: int
    hit_rate: float | None
    local_hit_rate: float | None
    fetched_hit_rate: float | None
    ideal_hit_rate: float | None
    hit_vs_ideal: float | None
    plans: int
    plan_blocks: int
    plan_failed: int
    latency_ms: dict[str, dict[str, float | None]]
    conductor_rtt_ms: float
    node_rtt_ms: float
    page_bytes: int
    written_bytes: int
    decode_bytes: float
    replication_bytes: float
    bytes_source: str
    decode_busy_s: float
    decode_gbps: float | None
    decode_held: int
    verified_pages: int
    verify_failures: int
    errors: dict[str, int]
    rejections: dict[str, int]
    per_node: dict[str, dict[str, int]] = field(default_factory=dict)
    # The messenger bench between the same nodes in this run (None: not measured).
    reference_gbps: float | None = None
    reference_runs_gbps: list[float] = field(default_factory=list)
    reference_pair: str = ""
    reference_bytes: int = 0
    decode_vs_reference: float | None = None
    schedule_calls: dict[str, int] = field(default_factory=dict)  # LiveEngine.schedule_calls


def summarize(
    outcomes: list[RequestOutcome],
    ideal: list[int],
    cluster: ClusterInfo,
    page_bytes: int,
    wall_s: float,
    rtts: tuple[float, float],
    before: dict[str, float] | None,
    after: dict[str, float] | None,
    reference: Reference | None = None,
) -> LiveSummary:
    scheduled = [o for o in outcomes if o.prefill_node]
    blocks = sum(o.total_blocks for o in scheduled)
    reused = sum(o.reused_blocks for o in scheduled)
    fetched = sum(o.fetched_blocks for o in scheduled)
    ideal_blocks = sum(ideal[o.index] for o in scheduled)

    def rate(n: float) -> float | None:
        return n / blocks if blocks else None

    def lat(values: list[float | None]) -> dict[str, float | None]:
        vals = [v * 1e3 for v in values if v is not None]
        return {"p50": _pct(vals, 50), "p99": _pct(vals, 99), "n": len(vals)}

    latency = {
        "schedule": lat([o.schedule_s for o in outcomes]),
        "lookup": lat([o.lookup_s for o in scheduled]),
        "plan_wait": lat([o.plan_wait_s for o in scheduled]),
        "load": lat([o.load_s for o in scheduled]),
        "store": lat([o.store_s for o in scheduled]),
        "decode_pull": lat([o.decode_s for o in scheduled]),
        "decode_pull_messenger": lat([o.decode_messenger_s for o in scheduled]),
        "queueing": lat([max(o.start_s - o.arrival_s, 0.0) for o in outcomes]),
        "end_to_end": lat([o.end_s - o.arrival_s for o in scheduled]),
    }
    decode_ids = {n.id for n in cluster.nodes if n.role == "decode"}
    if before is not None and after is not None:
        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        decode_bytes = sum(v for k, v in delta.items() if k in decode_ids)
        replication = sum(v for k, v in delta.items() if k not in decode_ids)
        source = "messenger counters"
    else:
        decode_bytes = float(sum(o.decode_moved_bytes for o in scheduled))
        replication = float(sum(o.fetched_blocks for o in scheduled) * page_bytes)
        source = "replies seen by this run (approximate)"
    busy = _busy_seconds(
        [
            (o.decode_at_s, o.decode_at_s + o.decode_s)
            for o in scheduled
            if o.decode_s is not None and o.decode_moved_bytes
        ]
    )
    per_node: dict[str, dict[str, int]] = {n.id: {"prefill": 0, "decode": 0} for n in cluster.nodes}
    for o in scheduled:
        per_node.setdefault(o.prefill_node, {"prefill": 0, "decode": 0})["prefill"] += 1
        per_node.setdefault(o.decode_node, {"prefill": 0, "decode": 0})["decode"] += 1
    decode_gbps = decode_bytes / busy / 1e9 if busy else None
    ref_gbps = reference.gbps if reference is not None else None
    errors = Counter(o.error for o in outcomes if o.status == "failed")
    rejections = Counter(o.error.split(":")[0] for o in outcomes if o.status == "rejected")
    return LiveSummary(
        requests=len(outcomes),
        scheduled=len(scheduled),
        rejected=sum(o.status == "rejected" for o in outcomes),
        failed=sum(o.status == "failed" for o in outcomes),
        ok=sum(o.status == "ok" for o in outcomes),
        wall_s=wall_s,
        blocks=blocks,
        reused_blocks=reused,
        local_blocks=reused - fetched,
        fetched_blocks=fetched,
        computed_blocks=sum(o.computed_blocks for o in scheduled),
        hit_rate=rate(reused),
        local_hit_rate=rate(reused - fetched),
        fetched_hit_rate=rate(fetched),
        ideal_hit_rate=rate(ideal_blocks),
        hit_vs_ideal=reused / ideal_blocks if ideal_blocks else None,
        plans=sum(1 for o in scheduled if o.plan_blocks),
        plan_blocks=sum(o.plan_blocks for o in scheduled),
        plan_failed=sum(o.plan_failed for o in scheduled),
        latency_ms=latency,
        conductor_rtt_ms=rtts[0] * 1e3,
        node_rtt_ms=rtts[1] * 1e3,
        page_bytes=page_bytes,
        written_bytes=sum(o.computed_blocks for o in scheduled) * page_bytes,
        decode_bytes=decode_bytes,
        replication_bytes=replication,
        bytes_source=source,
        decode_busy_s=busy,
        decode_held=sum(o.decode_held for o in scheduled),
        decode_gbps=decode_gbps,
        verified_pages=sum(o.verified_pages for o in outcomes),
        verify_failures=sum(o.verify_failures for o in outcomes),
        errors=dict(errors.most_common(10)),
        rejections=dict(rejections.most_common(5)),
        per_node=per_node,
        reference_gbps=ref_gbps,
        reference_runs_gbps=reference.runs_gbps() if reference is not None else [],
        reference_pair=f"{reference.source} -> {reference.destination}" if reference else "",
        reference_bytes=reference.pull.total_bytes if reference is not None else 0,
        decode_vs_reference=decode_gbps / ref_gbps if decode_gbps and ref_gbps else None,
    )


# ---- output ----------------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms"


def _pct_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _schedule_calls(calls: dict[str, int]) -> str:
    if not calls:
        return "not counted"
    return (
        f"{calls['requests']} schedules in {calls['batches']} batches over "
        f"{calls['streams']} ScheduleStream call(s)"
    )


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def report_rows(s: LiveSummary) -> list[dict]:
    lat = s.latency_ms
    rows = [
        {
            "what": "requests",
            "value": f"{s.scheduled} scheduled / {s.requests}",
            "detail": f"{s.rejected} rejected (SLO), {s.failed} failed, {s.ok} ok; "
            f"{s.wall_s:.1f} s wall, {s.requests / s.wall_s:.2f} req/s",
        },
        {
            "what": "cache hit rate",
            "value": _pct_s(s.hit_rate),
            "detail": f"{s.reused_blocks} of {s.blocks} blocks reused: local "
            f"{_pct_s(s.local_hit_rate)}, fetched by transfer {_pct_s(s.fetched_hit_rate)}",
        },
        {
            "what": "  vs infinite cache",
            "value": "-" if s.hit_vs_ideal is None else f"{s.hit_vs_ideal:.2f}x",
            "detail": f"ideal (one infinite cache, same requests) {_pct_s(s.ideal_hit_rate)}",
        },
        {
            "what": "schedule latency",
            "value": f"p50 {_ms(lat['schedule']['p50'])}",
            "detail": f"p99 {_ms(lat['schedule']['p99'])}; p50 = "
            f"{(lat['schedule']['p50'] or 0) / s.conductor_rtt_ms:.1f}x a bare gRPC "
            f"round trip ({_ms(s.conductor_rtt_ms)}); " + _schedule_calls(s.schedule_calls),
        },
        {
            "what": "lookup latency",
            "value": f"p50 {_ms(lat['lookup']['p50'])}",
            "detail": f"p99 {_ms(lat['lookup']['p99'])}; p50 = "
            f"{(lat['lookup']['p50'] or 0) / s.node_rtt_ms:.1f}x a bare gRPC round "
            f"trip ({_ms(s.node_rtt_ms)})",
        },
        {
            "what": "prefill -> decode",
            "value": _mib(s.decode_bytes),
            "detail": "-"
            if s.decode_gbps is None
            else f"{s.decode_gbps:.2f} GB/s while pulls ran ({s.decode_busy_s:.1f} s); pull p50 "
            f"{_ms(lat['decode_pull']['p50'])}, p99 {_ms(lat['decode_pull']['p99'])} "
            f"(in the messenger p50 {_ms(lat['decode_pull_messenger']['p50'])}); "
            f"{s.decode_held} pages already on the decode node",
        },
        {
            "what": "  vs messenger bench",
            "value": "-" if s.decode_vs_reference is None else f"{s.decode_vs_reference:.2f}x",
            "detail": "not measured (--reference-runs 0)"
            if s.reference_gbps is None
            else f"bulk pulls {s.reference_pair} in this run: {s.reference_gbps:.2f} GB/s "
            f"(median of {len(s.reference_runs_gbps)}, {human(s.reference_bytes)} each)",
        },
        {
            "what": "hot-block replication",
            "value": _mib(s.replication_bytes),
            "detail": f"{s.plans} plans, {s.plan_blocks} blocks planned, {s.plan_failed} did not "
            f"land; wait p50 {_ms(lat['plan_wait']['p50'])}",
        },
        {
            "what": "written by prefill",
            "value": _mib(s.written_bytes),
            "detail": f"{s.computed_blocks} synthetic pages of {s.page_bytes // 1024} KiB; store "
            f"p50 {_ms(lat['store']['p50'])}, load p50 {_ms(lat['load']['p50'])}",
        },
        {
            "what": "placement",
            "value": f"{len(s.per_node)} nodes",
            "detail": ", ".join(
                f"{node} {c['prefill']} prefills"
                if not c["decode"]
                else f"{node} {c['decode']} decodes"
                for node, c in s.per_node.items()
            ),
        },
        {
            "what": "verification failures",
            "value": str(s.verify_failures),
            "detail": f"{s.verified_pages} pages checked byte for byte (prefix loads and decode "
            "pulls)",
        },
        {
            "what": "end to end",
            "value": f"p50 {_ms(lat['end_to_end']['p50'])}",
            "detail": f"p99 {_ms(lat['end_to_end']['p99'])}; queueing p50 "
            f"{_ms(lat['queueing']['p50'])}, p99 {_ms(lat['queueing']['p99'])}",
        },
    ]
    return rows


def format_report(rows: list[dict]) -> str:
    """Measure (left), value (right), detail (left, unpadded: it is the last column)."""
    w0 = max(len(r["what"]) for r in rows)
    w1 = max(len(r["value"]) for r in rows)
    return "\n".join(f"{r['what'].ljust(w0)}  {r['value'].rjust(w1)}  {r['detail']}" for r in rows)


def plot(path: str, outcomes: list[RequestOutcome], ideal: list[int]) -> None:
    """Left: cumulative block hit rate over (compressed) arrival time, local and fetched, beside
    the infinite-cache reference. Right: latency CDFs."""
    sched = sorted((o for o in outcomes if o.prefill_node), key=lambda o: o.arrival_s)
    with figure(path, 1, 2, figsize=(12, 4.5), dpi=110) as (fig, (left, right)):
        if sched:
            x = [o.arrival_s for o in sched]
            total = np.maximum(np.cumsum([o.total_blocks for o in sched]), 1)
            reused = np.cumsum([o.reused_blocks for o in sched])
            fetched = np.cumsum([o.fetched_blocks for o in sched])
            best = np.cumsum([ideal[o.index] for o in sched])
            left.plot(x, reused / total, label="reused (local + fetched)")
            left.plot(x, fetched / total, label="fetched by transfer")
            left.plot(x, best / total, "--", color="grey", label="infinite cache")
        left.set_xlabel("arrival time (s, compressed)")
        left.set_ylabel("cumulative block hit rate")
        left.set_title("cache hits over time")
        left.grid(True, alpha=0.3)
        left.legend()
        for name, values in (
            ("schedule", [o.schedule_s for o in outcomes]),
            ("lookup", [o.lookup_s for o in sched]),
            ("decode pull", [o.decode_s for o in sched]),
            ("end to end", [o.end_s - o.arrival_s for o in sched]),
        ):
            ms = np.sort([v * 1e3 for v in values if v is not None and v > 0])
            if ms.size:
                right.plot(ms, np.arange(1, ms.size + 1) / ms.size, label=name)
        right.set_xscale("log")
        right.set_xlabel("latency (ms)")
        right.set_ylabel("fraction of requests")
        right.set_title("latency CDF")
        right.grid(True, which="both", alpha=0.3)
        right.legend()


# ---- the command -----------------------------------------------------------------------------


def _check_args(args: argparse.Namespace) -> None:
    if args.requests < 0:
        raise LiveError(f"--requests must be >= 0 (0: all), got {args.requests}")
    if not args.speedup >= 0:
        raise LiveError(f"--speedup must be >= 0 (0: no pacing), got {args.speedup}")
    if args.concurrency < 1:
        raise LiveError(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.ttft_slo < 0 or args.tbt_slo < 0:
        raise LiveError("--ttft-slo and --tbt-slo must be >= 0 (0: none)")
    if not args.transfer_timeout > 0:
        raise LiveError(f"--transfer-timeout must be positive, got {args.transfer_timeout}")
    if args.reference_runs < 0:
        raise LiveError(f"--reference-runs must be >= 0 (0: skip), got {args.reference_runs}")


def run(args: argparse.Namespace) -> int:
    try:
        _check_args(args)
        trace = load_trace(args.trace, args.trace_block_tokens)
        cluster = load_cluster(args.cluster)
    except (LiveError, TraceError) as e:
        print(f"kvcache bench live: {e}", file=sys.stderr)
        return 2
    requests = trace.requests[: args.requests] if args.requests else trace.requests
    if not requests:
        print(
            f"kvcache bench live: the trace {trace.source} has no requests; nothing to replay",
            file=sys.stderr,
        )
        return 2
    if args.token:
        cluster = ClusterInfo(
            conductor=cluster.conductor,
            token=args.token,
            nodes=cluster.nodes,
            source=cluster.source,
        )
    engine = None
    try:
        prefill = next((n for n in cluster.nodes if n.role in ("prefill", "both")), None)
        if prefill is None:
            raise LiveError(f"{cluster.source} has no prefill node")
        with cluster.conductor_client() as conductor:
            wait_for_nodes(conductor, cluster)
        with KVStoreClient(prefill.address, cluster.token, cluster.tls_ca) as node:
            namespace = pick_namespace(node, args.namespace)
            layout = node.layout(namespace)
        options = EngineOptions(
            namespace=namespace,
            trace_block_tokens=args.trace_block_tokens,
            ttft_slo_s=args.ttft_slo,
            tbt_slo_s=args.tbt_slo,
            transfer_timeout_s=args.transfer_timeout,
        )
        options.salt = (args.salt if args.salt is not None else f"live-{options.run_id}").encode()
        engine = Engine(cluster, options, layout)
        rtts = (
            grpc_rtt_s(cluster.conductor, cluster.token, cluster.tls_ca),
            grpc_rtt_s(prefill.address, cluster.token, cluster.tls_ca),
        )
        span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0
        roles = Counter(n.role for n in cluster.nodes)
        print(
            f"live: {len(requests)} requests of {os.path.basename(trace.source)} "
            f"({span:.0f} s of trace"
            + (
                f" at {args.speedup:g}x: {span / args.speedup:.1f} s)"
                if args.speedup
                else ", all at once)"
            )
            + f", concurrency {args.concurrency}; cluster {cluster.source}: "
            + ", ".join(f"{v} {k}" for k, v in sorted(roles.items()))
            + f"; namespace {namespace}, {layout.page_bytes // 1024} KiB pages, "
            f"{layout.block_tokens}-token blocks",
            flush=True,
        )
        reference = None
        if args.reference_runs:
            # NOTE: outside the byte counts below; half the rounds before the replay and half
            # after, so load that changes during the run weighs on the reference as on the replay.
            reference = open_reference(engine, cluster, namespace, args.reference_bytes)
            reference.measure((args.reference_runs + 1) // 2)
        before = received_bytes(cluster)
        progress = Progress(len(requests), "live", enabled=not args.no_progress)
        t = time.perf_counter()
        outcomes = replay(engine, requests, args.speedup, args.concurrency, progress)
        wall = time.perf_counter() - t
        schedule_calls = engine.schedule_calls()
        progress.finish()
        after = received_bytes(cluster)
        if reference is not None:
            reference.measure(args.reference_runs // 2)
            reference.finish()
        ideal = ideal_hits(
            requests,
            [bool(o.prefill_node) for o in outcomes],
            args.trace_block_tokens,
            layout.block_tokens,
        )
    except (LiveError, KVCacheRpcError, grpc.RpcError, OSError) as e:
        detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
        print(f"kvcache bench live: {detail}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nkvcache bench live: interrupted; no report written", file=sys.stderr)
        return 130
    finally:
        if engine is not None:
            engine.close()

    summary = summarize(
        outcomes, ideal, cluster, layout.page_bytes, wall, rtts, before, after, reference
    )
    summary.schedule_calls = schedule_calls
    print(
        f"\nlive replay against {cluster.source} (bytes between nodes from {summary.bytes_source})"
    )
    print(format_report(report_rows(summary)))
    if summary.rejections:
        print("rejections: " + "; ".join(f"{n} x {r}" for r, n in summary.rejections.items()))
    if summary.errors:
        print("errors:")
        for msg, n in summary.errors.items():
            print(f"  {n} x {msg}")
    json_path = os.path.join(args.out, "live.json")
    png_path = os.path.join(args.out, "live.png")
    write_json(
        json_path,
        {
            "command": "live",
            "trace": trace.source,
            "cluster": cluster.source,
            "namespace": namespace,
            "page_bytes": layout.page_bytes,
            "block_tokens": layout.block_tokens,
            "options": {
                "requests": len(requests),
                "speedup": args.speedup,
                "concurrency": args.concurrency,
                "ttft_slo_s": args.ttft_slo,
                "tbt_slo_s": args.tbt_slo,
                "reference_runs": args.reference_runs,
                "reference_bytes": args.reference_bytes,
            },
            "summary": summary,
            "requests": outcomes,
        },
    )
    plot(png_path, outcomes, ideal)
    print(f"wrote {json_path} and {png_path}")
    return 0 if summary.failed == 0 and summary.verify_failures == 0 else 1
