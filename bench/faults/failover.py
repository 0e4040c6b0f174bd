"""``kvcache bench failover``: what a conductor failover costs, against the embedded mode.

1. **etcd mode** (``kvcache up --etcd``: its own etcd server, 2 conductors, 2 nodes with their
   messengers, all real processes). Prompts are stored on the nodes (``--prompts`` x
   ``--blocks`` cached blocks, half on each node); a client of the library
   (``ConductorClient(etcd=...)``) schedules them, each with one new block, in a loop. Then the
   leading conductor gets SIGKILL. Figures: **failover time** (SIGKILL -> the first decision by
   the new leader, as the client sees it), **hit rate** (reused / prompt blocks) of the old
   leader's decisions and of the new leader's first decisions (one per prompt: a cold index
   would show here), **requests failed** (errors the client's retry did not absorb; must be 0)
   and the client's retries.
2. **registration to first routed request**: a new node process started with ``--etcd``, a
   prompt stored on it right after it serves; the time until the leader routes that prompt to it
   (etcd lease + put, the conductors' watch, the node's event-feed snapshot, then Schedule).
3. **the reference, measured in the same run**: the embedded mode (``kvcache up``, one
   conductor) with its conductor SIGKILLed and restarted at once on the same address (as fast
   as a supervisor could): the time until it decides again with the same hit rate (the nodes
   re-register on their next heartbeat and their snapshots rebuild its index). The failover time
   is printed as a ratio to it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.report import Column, figure, print_table, write_json
from clients.conductor_client import ConductorClient
from clients.node_client import KVStoreClient
from plumbing.launch import ServiceProcess, start_service
from rpc.channel import make_channel
from rpc.status import KVCacheRpcError

LAYOUT = "model=bench,num_layers=2,kv_heads=2,head_dim=32,dtype=float16,block_tokens=16"
NAMESPACE = "bench|L2|H2|D32|float16|B16"
BLOCK_TOKENS = 16
PAGE_BYTES = 8192
SERVICE = "kvcache.v1.ConductorService"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ttl", type=int, default=5, help="etcd lease TTL of every process, s (default 5)"
    )
    parser.add_argument("--prompts", type=int, default=16, help="cached prompts (default 16)")
    parser.add_argument(
        "--blocks", type=int, default=8, help="cached blocks per prompt (default 8)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="decisions per prompt before the kill (default 3)"
    )
    parser.add_argument("--out", default="out/bench-failover", help="directory for JSON and PNG")


@dataclass
class Decision:
    t: float  # monotonic
    conductor: str
    prompt: int
    reuse: int
    total: int


@dataclass
class Load:
    """A client thread scheduling the prompts round robin (each completed at once)."""

    client: ConductorClient
    prompts: list[list[int]]
    decisions: list[Decision] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            p = i % len(self.prompts)
            try:
                r = self.client.schedule(NAMESPACE, tokens=self.prompts[p] + _tokens(10**6 + i, 1))
                self.client.complete(r.request_id)
                self.decisions.append(
                    Decision(
                        time.monotonic(), self.client.address, p, r.reuse_blocks, r.total_blocks
                    )
                )
            except KVCacheRpcError as e:
                self.errors.append(str(e))
            i += 1

    def by(self, conductor: str, since: float = 0.0) -> list[Decision]:
        return [d for d in self.decisions if d.conductor == conductor and d.t >= since]


def _tokens(seed: int, blocks: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, blocks * BLOCK_TOKENS).tolist()


def _hit(decisions: list[Decision]) -> float:
    total = sum(d.total for d in decisions)
    return sum(d.reuse for d in decisions) / total if total else 0.0


def _first_per_prompt(decisions: list[Decision]) -> list[Decision]:
    first: dict[int, Decision] = {}
    for d in decisions:
        first.setdefault(d.prompt, d)
    return list(first.values())


def _kvcache(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcache.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _up(state_dir: str, etcd: bool, ttl: int) -> dict:
    shutil.rmtree(state_dir, ignore_errors=True)
    os.makedirs(state_dir)
    config = os.path.join(state_dir, "cluster.toml")
    with open(config, "w") as f:
        f.write(
            f'[cluster]\nstate_dir = "{state_dir}"\n'
            f'[conductor]\nreplicas = {2 if etcd else 1}\nargs = ["--transfer-hook", "record"]\n'
            f"[etcd]\nenabled = {str(etcd).lower()}\nttl = {ttl}\n"
            f'[defaults]\nlayout = "{LAYOUT}"\ndram = "64MiB"\n'
            '[[node]]\nid = "n0"\nrole = "both"\n[[node]]\nid = "n1"\nrole = "both"\n'
        )
    r = _kvcache("up", "--config", config, "--detach")
    if r.returncode != 0:
        raise SystemExit(f"kvcache bench failover: kvcache up failed:\n{r.stdout}{r.stderr}")
    with open(os.path.join(state_dir, "cluster.json")) as f:
        return dict(json.load(f))


def _down(state_dir: str) -> None:
    _kvcache("down", "--state-dir", state_dir)


def _serving(address: str) -> bool:
    try:
        with make_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=2
            )
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except Exception:
        return False


def _wait(probe, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"kvcache bench failover: timed out after {timeout_s:g} s: {what}")
        time.sleep(0.02)


def _store(state: dict, prompts: list[list[int]]) -> None:
    page = np.full(PAGE_BYTES, 7, np.uint8)
    nodes = state["nodes"]
    for i, p in enumerate(prompts):
        with KVStoreClient(nodes[i % len(nodes)]["address"]) as kv:
            kv.put(NAMESPACE, [page] * (len(p) // BLOCK_TOKENS), tokens=p)


def _indexed(address: str, prompts: list[list[int]]) -> bool:
    try:
        with ConductorClient(address) as c:
            return all(max(c.locate(NAMESPACE, tokens=p).values(), default=0) for p in prompts)
    except KVCacheRpcError:
        return False


def _until_killed(load: Load, pid: int, rounds: int) -> float:
    thread = threading.Thread(target=load.run, daemon=True)
    thread.start()
    _wait(lambda: len(load.decisions) >= rounds * len(load.prompts), 60, "decisions before kill")
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return killed


def bench_etcd(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    state_dir = os.path.abspath(os.path.join(args.out, "cluster-etcd"))
    state = _up(state_dir, etcd=True, ttl=args.ttl)
    try:
        conductors = [c["address"] for c in state["conductors"]]
        endpoints = state["etcd"]["endpoints"]
        leader = _wait(lambda: [c for c in conductors if _serving(c)], 60, "a leader")[0]
        standby = next(c for c in conductors if c != leader)
        _store(state, prompts)
        for c in conductors:
            _wait(lambda c=c: _indexed(c, prompts), 60, f"the index of {c}")
        load = Load(ConductorClient(etcd=endpoints, timeout_s=5), prompts)
        pid = next(c["pid"] for c in state["conductors"] if c["address"] == leader)
        killed = _until_killed(load, pid, args.rounds)
        _wait(lambda: len(load.by(standby, killed)) >= len(prompts) * 2, 120, "the new leader")
        load.stop.set()
        before, after = load.by(leader), load.by(standby, killed)
        first = _first_per_prompt(after)
        failover = after[0].t - killed

        # a new node: ready -> stores a prompt -> the leader routes that prompt to it
        prompt = _tokens(7_777, args.blocks)
        t_start = time.monotonic()
        node: ServiceProcess = start_service(
            [
                "node",
                *("--listen", "127.0.0.1:0", "--node-id", "n-new", "--dram", "16MiB"),
                *("--layout", LAYOUT, "--etcd", ",".join(endpoints)),
                *("--etcd-ttl", str(args.ttl), "--log-level", "WARNING"),
            ],
            log_dir=state_dir,
        )
        try:
            t_ready = time.monotonic()
            _store({"nodes": [{"address": node.address}]}, [prompt])
            client = load.client

            def routed() -> bool:
                reply = client.schedule(NAMESPACE, tokens=prompt)
                client.complete(reply.request_id)
                return reply.prefill_node == "n-new"

            _wait(routed, 60, "a request routed to the new node")
            t_routed = time.monotonic()
        finally:
            node.stop()
        load.client.close()
        return {
            "ttl_s": args.ttl,
            "leader": leader,
            "standby": standby,
            "failover_s": failover,
            "decisions_before": len(before),
            "decisions_after": len(after),
            "hit_before": _hit(before),
            "hit_after_first": _hit(first),
            "hit_after": _hit(after),
            "failed": len(load.errors),
            "errors": load.errors[:5],
            "client_failovers": load.client.failovers,
            "register_to_routed_s": t_routed - t_ready,
            "start_to_routed_s": t_routed - t_start,
            "timeline": [
                (d.t - killed, d.conductor == standby, d.reuse / d.total) for d in load.decisions
            ],
        }
    finally:
        _down(state_dir)


def bench_embedded(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """One conductor, SIGKILLed and restarted at once on its address: until it decides with
    the hit rate it had."""
    state_dir = os.path.abspath(os.path.join(args.out, "cluster-embedded"))
    state = _up(state_dir, etcd=False, ttl=args.ttl)
    restarted: ServiceProcess | None = None
    try:
        address = state["conductor"]["address"]
        _store(state, prompts)
        _wait(lambda: _indexed(address, prompts), 60, "the index")
        load = Load(ConductorClient(address, timeout_s=5), prompts)
        killed = _until_killed(load, state["conductor"]["pid"], args.rounds)
        load.stop.set()
        before = list(load.decisions)
        restarted = start_service(
            [
                "conductor",
                "--listen",
                address,
                "--transfer-hook",
                "record",
                "--log-level",
                "WARNING",
            ],
            log_dir=state_dir,
        )
        up_at = time.monotonic()
        hit = _hit(before)
        recovered: list[Decision] = []

        def warm() -> bool:  # one full round of prompts at the old hit rate
            round_ = []
            for p, tokens in enumerate(prompts):
                try:
                    r = load.client.schedule(NAMESPACE, tokens=tokens + _tokens(2 * 10**6 + p, 1))
                except KVCacheRpcError:
                    return False
                round_.append(
                    Decision(time.monotonic(), address, p, r.reuse_blocks, r.total_blocks)
                )
            recovered[:] = round_
            return _hit(round_) >= hit

        _wait(warm, 120, "the restarted conductor to decide as before")
        load.client.close()
        return {
            "restart_s": up_at - killed,
            "recovery_s": recovered[0].t - killed,
            "hit_before": hit,
            "hit_recovered": _hit(recovered),
        }
    finally:
        if restarted is not None:
            restarted.stop()
        _down(state_dir)


def plot(path: str, timeline: list[tuple[float, bool, float]]) -> None:
    with figure(path, figsize=(7, 4), dpi=120) as (fig, ax):
        for new, label, color in (
            (False, "old leader", "tab:blue"),
            (True, "new leader", "tab:red"),
        ):
            pts = [(t, h) for t, n, h in timeline if n == new]
            if pts:
                ax.plot(*zip(*pts), ".", color=color, label=label, markersize=4)
        ax.axvline(0, color="grey", linestyle="--", linewidth=1)
        ax.annotate("SIGKILL", (0, 0.05), textcoords="offset points", xytext=(3, 0), fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("seconds since the leader's SIGKILL")
        ax.set_ylabel("hit rate of the decision (reused / prompt blocks)")
        ax.set_title("conductor failover: decisions as the client saw them")
        ax.legend()


def run(args: argparse.Namespace) -> int:
    if args.ttl < 1 or args.prompts < 2 or args.blocks < 1 or args.rounds < 1:
        raise SystemExit(
            "kvcache bench failover: --ttl, --blocks and --rounds must be >= 1, --prompts >= 2"
        )
    os.makedirs(args.out, exist_ok=True)
    prompts = [_tokens(i, args.blocks) for i in range(args.prompts)]
    etcd = bench_etcd(args, prompts)
    ref = bench_embedded(args, prompts)
    rows = [
        {
            "what": "failover: SIGKILL -> first decision",
            "value": f"{etcd['failover_s']:.2f} s",
            "vs": f"{etcd['failover_s'] / ref['recovery_s']:.2f}x the embedded restart "
            f"({ref['recovery_s']:.2f} s); lease TTL {etcd['ttl_s']} s",
        },
        {
            "what": "hit rate before / new leader's first",
            "value": f"{etcd['hit_before']:.1%} / {etcd['hit_after_first']:.1%}",
            "vs": f"{etcd['hit_after_first'] / etcd['hit_before']:.2f}x (1.00x: no cold index)",
        },
        {
            "what": "requests failed",
            "value": str(etcd["failed"]),
            "vs": f"of {etcd['decisions_before'] + etcd['decisions_after']} decided; "
            f"{etcd['client_failovers']} client failover(s)",
        },
        {
            "what": "registration -> first routed request",
            "value": f"{etcd['register_to_routed_s']:.2f} s",
            "vs": f"{etcd['start_to_routed_s']:.2f} s from the node process's start",
        },
    ]
    print_table(
        rows,
        [Column("what", "figure"), Column("value", "measured"), Column("vs", "reference")],
        title="conductor failover (etcd mode, 2 conductors, 2 nodes) vs an embedded restart",
    )
    json_path = os.path.join(args.out, "failover.json")
    png_path = os.path.join(args.out, "failover.png")
    write_json(
        json_path,
        {"command": "failover", "etcd": etcd, "embedded": ref, "options": vars(args)},
    )
    plot(png_path, etcd["timeline"])
    print(f"wrote {json_path} and {png_path}")
    return 0 if etcd["failed"] == 0 else 1
