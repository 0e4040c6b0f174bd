"""``kvcache down``: stop a cluster that ``kvcache up --detach`` started.

SIGTERM to the router and the vLLM engines (each engine's whole process group), then the
messengers, then the node servers, then the conductor (each stage at once; each
process shuts down cleanly: leases dropped, lmdb closed, shared memory unlinked), SIGKILL for any
that does not exit in time, then a check that
no shared-memory segment of the cluster is left behind. A cluster on hosts in network namespaces
(``kvcache up --hosts N``) also loses its namespaces, links and bridge, as recorded in
``<state_dir>/network.json`` when they were made: also after its launcher crashed, when
whatever still runs in them is stopped first.

The state dir comes from ``--state-dir``, else from the cluster config (``--config``,
``$KVCACHE_STATE_DIR``, the defaults: see ``cluster_config``), as ``kvcache up`` found it. A pid is
signalled only while it is still the process ``kvcache up`` started (start time and command line,
recorded in cluster.json): a pid reused by another program is left alone. Exits 1 when there was
nothing to stop.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from kvstore.shm import SharedSlab, pid_alive
from plumbing.launch import group_shm, release_shm, still_same_process
from plumbing.netns import NetnsError

from .cluster_config import ENV_PREFIX, ConfigError, load_config
from .cluster_hosts import network_record, teardown_network


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        help="the cluster's state_dir (holds cluster.json; default: the config's, as "
        "'kvcache up' resolved it)",
    )
    parser.add_argument(
        "--config",
        default=os.environ.get(ENV_PREFIX + "CONFIG") or None,
        help="the cluster TOML 'kvcache up' was given (its state_dir; default: $KVCACHE_CONFIG)",
    )
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds to wait per process")


def state_dir_of(args: argparse.Namespace) -> tuple[str, str]:
    """(absolute state dir, where it came from)."""
    if args.state_dir:
        return os.path.abspath(args.state_dir), "--state-dir"
    cfg = load_config(args.config)
    return cfg.state_dir, cfg.sources["cluster.state_dir"]


def _running(pid: int) -> bool:
    """Alive and not a zombie (a process that exited but whose parent has not reaped it yet,
    e.g. a test's child, counts as stopped)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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
    left = [p for p in pids if _running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(delay)  # not our children: no wait() to block on
        delay = min(delay * 2, 0.2)
        left = [p for p in left if _running(p)]
    for pid in left:
        send(pid, signal.SIGKILL)
    for pid in groups & set(pids):  # children the group leader left behind
        send(pid, signal.SIGKILL)
    # Exited processes are zombies until their parent (init, once 'kvcache up' is gone) reaps
    # them: give it a moment, so that a caller finds them gone.
    reap_by = time.monotonic() + 2.0
    while any(_exists(p) for p in pids) and time.monotonic() < reap_by:
        time.sleep(0.02)
    return not left


def _exists(pid: int) -> bool:
    import psutil

    return bool(psutil.pid_exists(pid))


def stop_stages(state: dict) -> list[list[int]]:
    """The router, then the engines (their connectors hold leases on the nodes), then
    messengers, then node servers, then the conductors, then our etcd; each stage stops in
    parallel (every server takes its gRPC grace period, so one by one would add those up)."""
    nodes = state.get("nodes", [])
    router = [state["router"]["pid"]] if "router" in state else []
    engines = engine_groups(state)
    messengers = [n["pids"][1] for n in nodes if len(n.get("pids", [])) > 1]
    servers = [n["pids"][0] for n in nodes if n.get("pids")]
    etcd = [(state.get("etcd") or {}).get("pid")]
    etcd = [p for p in etcd if p]  # last: the conductors hand over their leases first
    staged = set(router) | set(engines) | set(messengers) | set(servers) | set(etcd)
    rest = [p for p in reversed(state.get("pids", [])) if p not in staged]
    return [s for s in (router, sorted(engines), messengers, servers, rest, etcd) if s]


def engine_groups(state: dict) -> frozenset[int]:
    """Engine pids: each leads its process group (``kvcache up`` starts them in a session)."""
    return frozenset(e["pid"] for e in state.get("engines", []))


def _checked(state: dict) -> tuple[set[int], list[str]]:
    """The pids still running what ``kvcache up`` started, and notes on the others."""
    known = {int(p["pid"]): p for p in state.get("processes", [])}
    ok: set[int] = set()
    notes = []
    for pid in state.get("pids", []):
        proc = known.get(pid)
        if proc is None:  # a cluster.json from before identities were recorded
            proc = {"role": "process", "started": None}
        why = (
            still_same_process(pid, proc)
            if proc.get("started") is not None
            else (None if pid_alive(pid) else "exited")
        )
        if why is None:
            ok.add(pid)
        elif why != "exited":
            notes.append(f"pid {pid} ({proc['role']}) is {why}: not signalled")
        else:
            notes.append(f"pid {pid} ({proc['role']}) had exited already")
    return ok, notes


def run(args: argparse.Namespace) -> int:
    try:
        state_dir, source = state_dir_of(args)
    except ConfigError as e:
        print(f"kvcache down: {e}", file=sys.stderr)
        return 2
    path = os.path.join(state_dir, "cluster.json")
    if not os.path.exists(path):
        if os.path.exists(network_record(state_dir)):
            return _remove_network(state_dir, 0)
        print(
            f"kvcache down: no cluster state at {path} (state dir from {source}); nothing was "
            "stopped. Name the cluster's state dir as 'kvcache up' printed it "
            "(--state-dir DIR) or the config it was started with (--config FILE).",
            file=sys.stderr,
        )
        return 1
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        print(f"kvcache down: cannot read {path}: {e}", file=sys.stderr)
        return 1
    running, notes = _checked(state)
    for note in notes:
        print(f"kvcache down: {note}", file=sys.stderr)
    # vLLM's shared memory: what the engines held at start and hold now, removed once they
    # are gone (an engine that needs SIGKILL, or crashed, cannot unlink it).
    engine_pids, engine_shm = (
        set[int](),
        {n for e in state.get("engines", []) for n in e.get("shm", [])},
    )
    for pid in engine_groups(state) & running:
        pids, names = group_shm(pid)
        engine_pids |= pids
        engine_shm |= names
    clean = True
    for stage in stop_stages(state):
        stage = [p for p in stage if p in running]
        if stage:
            clean &= stop_pids(stage, args.timeout, engine_groups(state))
    leftovers = []
    for node in state.get("nodes", []):
        for name in node.get("shm", {}).values():
            if os.path.exists(f"/dev/shm/{name}"):
                leftovers.append(name)
                SharedSlab.remove(name)
    leftovers += release_shm(engine_pids, engine_shm)
    os.remove(path)
    if not running:
        print(
            f"kvcache down: no process of the cluster in {state_dir} was running; removed its "
            "stale state",
            file=sys.stderr,
        )
        return _remove_network(state_dir, 1)
    print(f"cluster stopped ({len(running)} processes{'' if clean else ', some needed SIGKILL'})")
    if leftovers:
        print(f"removed leftover shared memory: {', '.join(leftovers)}")
    return _remove_network(state_dir, 0 if clean and not leftovers else 1)


def _remove_network(state_dir: str, code: int) -> int:
    if not os.path.exists(network_record(state_dir)):
        return code
    try:
        removed = teardown_network(state_dir)
    except NetnsError as e:
        print(f"kvcache down: {e}", file=sys.stderr)
        return 1
    print(f"removed host network: {', '.join(removed) or 'nothing was left'}")
    return code
