"""``kvcache down``: stop a cluster that ``kvcache up --detach`` started.

SIGTERM to the messengers, then the node servers, then the conductor (each stage at once; each
process shuts down cleanly: leases dropped, lmdb closed, shared memory unlinked), SIGKILL for any
that does not exit in time, then a check that
no shared-memory segment of the cluster is left behind. A cluster on hosts in network namespaces
(``kvcache up --hosts N``) also loses its namespaces, links and bridge, as recorded in
``<state_dir>/network.json`` when they were made: also after its launcher crashed, when
whatever still runs in them is stopped first.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

from kvstore.shm import SharedSlab, pid_alive
from rpc.netns import NetnsError

from .cluster_hosts import network_record, teardown_network


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir", default="out/cluster", help="the cluster's state_dir (holds cluster.json)"
    )
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds to wait per process")


def stop_pids(pids: list[int], timeout_s: float) -> bool:
    """SIGTERM all of ``pids`` at once, wait for them together, SIGKILL the ones that do not
    exit in time. True if all exited on SIGTERM."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    left = [p for p in pids if pid_alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(delay)  # not our children: no wait() to block on
        delay = min(delay * 2, 0.2)
        left = [p for p in left if pid_alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return not left


def stop_stages(state: dict) -> list[list[int]]:
    """Messengers, then node servers, then the conductor; each stage stops in parallel (every
    server takes its gRPC grace period, so one by one would add those up)."""
    nodes = state.get("nodes", [])
    messengers = [n["pids"][1] for n in nodes if len(n.get("pids", [])) > 1]
    servers = [n["pids"][0] for n in nodes if n.get("pids")]
    staged = set(messengers) | set(servers)
    rest = [p for p in reversed(state.get("pids", [])) if p not in staged]
    return [s for s in (messengers, servers, rest) if s]


def run(args: argparse.Namespace) -> int:
    path = os.path.join(args.state_dir, "cluster.json")
    if not os.path.exists(path):
        if os.path.exists(network_record(args.state_dir)):
            return _remove_network(args.state_dir, 0)
        print(f"no cluster state at {path}; nothing to stop")
        return 0
    with open(path) as f:
        state = json.load(f)
    clean = True
    for stage in stop_stages(state):
        clean &= stop_pids(stage, args.timeout)
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
    return _remove_network(args.state_dir, 0 if clean and not leftovers else 1)


def _remove_network(state_dir: str, code: int) -> int:
    if not os.path.exists(network_record(state_dir)):
        return code
    try:
        removed = teardown_network(state_dir)
    except NetnsError as e:
        print(f"kvcache down: {e}")
        return 1
    print(f"removed host network: {', '.join(removed) or 'nothing was left'}")
    return code
