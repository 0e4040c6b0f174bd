"""``kvcache down``: stop a cluster that ``kvcache up --detach`` started.

SIGTERM to every process in reverse start order (each shuts down cleanly: leases dropped, lmdb
closed, shared memory unlinked), SIGKILL for any that does not exit in time, then a check that
no shared-memory segment of the cluster is left behind.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

from kvstore.shm import SharedSlab


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", default="out/cluster",
                        help="the cluster's state_dir (holds cluster.json)")
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds to wait per process")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours counts as gone
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def stop_pid(pid: int, timeout_s: float) -> bool:
    """SIGTERM, wait, SIGKILL. True if it exited on SIGTERM."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(delay)  # not our child: no wait() to block on
        delay = min(delay * 2, 0.2)
    os.kill(pid, signal.SIGKILL)
    return False


def run(args: argparse.Namespace) -> int:
    path = os.path.join(args.state_dir, "cluster.json")
    if not os.path.exists(path):
        print(f"no cluster state at {path}; nothing to stop")
        return 0
    with open(path) as f:
        state = json.load(f)
    clean = True
    for pid in reversed(state.get("pids", [])):
        clean &= stop_pid(pid, args.timeout)
    leftovers = []
    for node in state.get("nodes", []):
        for name in node.get("shm", {}).values():
            if os.path.exists(f"/dev/shm/{name}"):
                leftovers.append(name)
                SharedSlab.remove(name)
    os.remove(path)
    print(f"cluster stopped ({len(state.get('pids', []))} processes"
          f"{'' if clean else ', some needed SIGKILL'})")
    if leftovers:
        print(f"removed leftover shared memory: {', '.join(leftovers)}")
    return 0 if clean and not leftovers else 1
