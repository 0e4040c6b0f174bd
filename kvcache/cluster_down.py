"""``kvcache down``: stop a cluster that ``kvcache up --detach`` started.

SIGTERM to the router and the vLLM engines (each engine's whole process group), then the
messengers, then the node servers, then the conductor (each stage at once; each
process shuts down cleanly: leases dropped, lmdb closed, shared memory unlinked), SIGKILL for any
that does not exit in time, then a check that
no shared-memory segment of the cluster is left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

from kvstore.shm import SharedSlab, pid_alive


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir", default="out/cluster", help="the cluster's state_dir (holds cluster.json)"
    )
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds to wait per process")


def stop_pids(pids: list[int], timeout_s: float, groups: frozenset[int] = frozenset()) -> bool:
    """SIGTERM all of ``pids`` at once, wait for them together, SIGKILL the ones that do not
    exit in time. ``groups``: pids that lead a process group, signalled as a group (an
    engine's server and its engine-core child). True if all exited on SIGTERM."""

    def send(pid: int, signum: int) -> None:
        try:
            (os.killpg if pid in groups else os.kill)(pid, signum)
        except ProcessLookupError:
            pass

    for pid in pids:
        send(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    left = [p for p in pids if pid_alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(delay)  # not our children: no wait() to block on
        delay = min(delay * 2, 0.2)
        left = [p for p in left if pid_alive(p)]
    for pid in left:
        send(pid, signal.SIGKILL)
    for pid in groups & set(pids):  # children the group leader left behind
        send(pid, signal.SIGKILL)
    return not left


def stop_stages(state: dict) -> list[list[int]]:
    """The router, then the engines (their connectors hold leases on the nodes), then
    messengers, then node servers, then the conductor; each stage stops in parallel (every
    server takes its gRPC grace period, so one by one would add those up)."""
    nodes = state.get("nodes", [])
    router = [state["router"]["pid"]] if "router" in state else []
    engines = engine_groups(state)
    messengers = [n["pids"][1] for n in nodes if len(n.get("pids", [])) > 1]
    servers = [n["pids"][0] for n in nodes if n.get("pids")]
    staged = set(router) | set(engines) | set(messengers) | set(servers)
    rest = [p for p in reversed(state.get("pids", [])) if p not in staged]
    return [s for s in (router, sorted(engines), messengers, servers, rest) if s]


def engine_groups(state: dict) -> frozenset[int]:
    """Engine pids: each leads its process group (``kvcache up`` starts them in a session)."""
    return frozenset(e["pid"] for e in state.get("engines", []))


def run(args: argparse.Namespace) -> int:
    path = os.path.join(args.state_dir, "cluster.json")
    if not os.path.exists(path):
        print(f"no cluster state at {path}; nothing to stop")
        return 0
    with open(path) as f:
        state = json.load(f)
    clean = True
    for stage in stop_stages(state):
        clean &= stop_pids(stage, args.timeout, engine_groups(state))
    leftovers = []
    for node in state.get("nodes", []):
        for name in node.get("shm", {}).values():
            if os.path.exists(f"/dev/shm/{name}"):
                leftovers.append(name)
                SharedSlab.remove(name)
    os.remove(path)
    print(
        f"cluster stopped ({len(state.get('pids', []))} processes"
        f"{'' if clean else ', some needed SIGKILL'})"
    )
    if leftovers:
        print(f"removed leftover shared memory: {', '.join(leftovers)}")
    return 0 if clean and not leftovers else 1
