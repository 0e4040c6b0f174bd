"""``kvcache bench soak``: a real local cluster under load while processes are SIGKILLed.

It starts 1 conductor and ``--nodes`` nodes, each with its messenger (separate processes, fixed
ports, so a restarted process comes back at the same addresses). Nodes have a small DRAM tier and
an SSD tier (lmdb) that fills up; as root the SSD tiers live on one small tmpfs so that the chaos
thread can also fill that filesystem with a ballast file (later removed). Then, for ``--duration``
seconds:

- ``--writers`` threads ``put`` pages to random nodes (token chains from a per-writer generator;
  every page's bytes derive from its block key, itself the chained hash of the tokens, so any page
  read back can be verified byte for byte);
- ``--readers`` threads ``get`` committed pages and verify them;
- ``--movers`` threads have one node's messenger pull committed pages from another's
  (``SubmitTransfer`` + ``TransferStatus``);
- one thread asks the conductor to ``Schedule`` recently written prompts;
- one event watcher per node follows the node's ``Events`` feed (EVICTED events);
- the chaos thread, every ``--chaos-interval`` seconds, SIGKILLs a messenger, a node or the
  conductor and restarts it with the same arguments (a node restarts on its SSD state), or fills
  the SSD filesystem for 1-3 s (a ballast file, while holding a read snapshot of each node's lmdb
  so that its file must grow: warm lmdb files otherwise reuse their free pages and a full
  filesystem refuses nothing), in a shuffled rotation so every kind happens.

Then it stops the load, brings every process back, and reads every page it ever tried to write on
every node it tried (fresh clients, streamed ``Get``, nodes run with ``--no-promote`` so the check
moves nothing).

**What counts.** A page is *committed* on a node when ``put`` returned OK there, or when the
node's messenger reported its transfer entry DONE (not ``already_present``). Its *start* is when
the put or the transfer batch was submitted. A committed page missing at the end is *explained*
when:

1. *evicted*: the node's event feed carried an ``EVICTED`` event for that key (at any time in the
   run: a key evicted once, committed again and then lost would pass as explained), or a resync
   snapshot after a gap in the feed no longer listed it; or
2. *killed*: the node was SIGKILLed after the page's start, and the page was not in the node's
   SSD lmdb file right after that kill (read by this tool, read-only, while the node was down):
   it was in DRAM (lost with the process) or left the SSD in the last moments whose events died
   with the process. A page that was in the SSD file at a kill must come back after the restart
   (or be evicted later).

Every other missing committed page is *lost* (unexplained), and any page whose bytes differ from
what its key says is *corrupt*. The command exits 1 when either count is > 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import grpc
import numpy as np
import xxhash

from bench.report import Column, print_table, write_json
from clients.conductor_client import ConductorClient
from clients.messenger_client import MessengerClient
from clients.node_client import KVCacheRpcError, KVStoreClient
from kvstore.keys import block_keys, root_key
from kvstore.layout import KVLayout
from plumbing.launch import ServiceProcess, start_service
from proto import common_pb2 as cpb
from proto import messenger_pb2 as mpb

# 8 KiB pages: 2 layers x K|V x 16 tokens x 1 head x 64 dims x fp16.
LAYOUT = "model=soak,num_layers=2,kv_heads=1,head_dim=64,dtype=float16,block_tokens=16"
KINDS = ("messenger", "node", "conductor", "ssd-fill")
HOST = "127.0.0.1"
DEMOTION_FAILURES = "kvcache_store_demotion_failures"


class SoakError(Exception):
    """The soak could not run (a process did not start): not a verdict on the system."""


# ---- options -------------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration",
        type=float,
        default=60.0,
        help="seconds of load and chaos (default %(default)s; e.g. 600 for a long soak)",
    )
    parser.add_argument("--nodes", type=int, default=2, help="nodes (>= 2; default %(default)s)")
    parser.add_argument(
        "--writers", type=int, default=2, help="writer threads (default %(default)s)"
    )
    parser.add_argument(
        "--readers", type=int, default=1, help="reader threads (default %(default)s)"
    )
    parser.add_argument(
        "--movers",
        type=int,
        default=1,
        help="threads submitting messenger transfers between nodes (default %(default)s)",
    )
    parser.add_argument(
        "--chaos-interval",
        type=float,
        default=5.0,
        help="seconds between chaos actions (default %(default)s)",
    )
    parser.add_argument(
        "--dram-pages", type=int, default=64, help="DRAM pages per node (default %(default)s)"
    )
    parser.add_argument(
        "--ssd-pages", type=int, default=128, help="SSD pages per node (default %(default)s)"
    )
    parser.add_argument(
        "--op-pause",
        type=float,
        default=0.005,
        help="seconds each load thread sleeps between operations (default %(default)s)",
    )
    parser.add_argument(
        "--no-fill",
        action="store_true",
        help="do not fill the SSD filesystem (done only as root, on a tmpfs this mounts)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    parser.add_argument(
        "--work-dir",
        default=None,
        help="where logs and SSD files go (default: a fresh temporary directory, removed "
        "after a clean run)",
    )
    parser.add_argument(
        "--out",
        default=os.path.join("out", "bench"),
        help="directory for soak.json (default %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true")


def check_args(args: argparse.Namespace) -> None:
    def bad(msg: str) -> None:
        raise SystemExit(f"kvcache bench soak: {msg}")

    if not args.duration > 0:
        bad(f"--duration must be > 0 seconds, got {args.duration:g}")
    if args.nodes < 2:
        bad(f"--nodes must be >= 2 (transfers need two nodes), got {args.nodes}")
    if args.nodes > 16:
        bad(f"--nodes must be <= 16, got {args.nodes}")
    if args.writers < 1:
        bad(f"--writers must be >= 1, got {args.writers}")
    for name in ("readers", "movers"):
        if getattr(args, name) < 0:
            bad(f"--{name} must be >= 0, got {getattr(args, name)}")
    if not args.chaos_interval > 0:
        bad(f"--chaos-interval must be > 0 seconds, got {args.chaos_interval:g}")
    if args.dram_pages < 8:
        bad(f"--dram-pages must be >= 8, got {args.dram_pages}")
    if args.ssd_pages < 1:
        bad(f"--ssd-pages must be >= 1, got {args.ssd_pages}")
    if args.op_pause < 0:
        bad(f"--op-pause must be >= 0, got {args.op_pause:g}")


# ---- deterministic pages -------------------------------------------------------------------------


def page_for(key: bytes, page_bytes: int) -> np.ndarray:
    """The bytes a page with this key must hold: a PRNG stream seeded by the key."""
    seed = int.from_bytes(xxhash.xxh3_64_digest(key), "little")
    return np.random.Generator(np.random.PCG64(seed)).integers(0, 256, page_bytes, dtype=np.uint8)


# ---- processes -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """One role process with fixed arguments: killed and started again at the same addresses."""

    kind: str
    index: int
    args: list[str]
    log_dir: str
    sp: ServiceProcess | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return self.kind if self.kind == "conductor" else f"{self.kind}-{self.index}"

    def start(self, timeout_s: float = 60.0) -> None:
        try:
            self.sp = start_service(self.args, timeout_s=timeout_s, log_dir=self.log_dir)
        except (RuntimeError, TimeoutError) as e:
            raise SoakError(f"{self.name} did not start: {e}") from None

    def alive(self) -> bool:
        return self.sp is not None and self.sp.alive()

    def kill(self) -> None:
        if self.sp is not None:
            self.sp.kill()

    def stop(self) -> None:
        if self.sp is not None and self.sp.alive():
            self.sp.stop(timeout_s=15)


@dataclass
class NodeProcs:
    index: int
    address: str
    messenger: str
    metrics_port: int
    ssd_dir: str
    node: Proc
    mess: Proc


class Cluster:
    def __init__(self, args: argparse.Namespace, work: str, ssd_root: str) -> None:
        self.log_dir = os.path.join(work, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self.conductor_address = f"{HOST}:{free_port()}"
        self.conductor = Proc(
            "conductor",
            0,
            ["conductor", "--listen", self.conductor_address, "--log-level", "WARNING"],
            self.log_dir,
        )
        layout = KVLayout(**_layout_items(LAYOUT))
        page = layout.page_bytes
        self.nodes: list[NodeProcs] = []
        for i in range(args.nodes):
            addr, maddr, daddr = (f"{HOST}:{free_port()}" for _ in range(3))
            metrics = free_port()
            ssd_dir = os.path.join(ssd_root, f"node-{i}")
            node_args = [
                "node",
                "--listen",
                addr,
                "--node-id",
                f"soak-{i}",
                "--layout",
                LAYOUT,
                "--dram",
                str(args.dram_pages * page),
                "--ssd",
                str(args.ssd_pages * page),
                "--ssd-dir",
                ssd_dir,
                "--no-promote",
                "--metrics-port",
                str(metrics),
                "--lease-ttl",
                "10",
                "--conductor",
                self.conductor_address,
                "--messenger",
                maddr,
                "--log-level",
                "WARNING",
            ]
            mess_args = [
                "messenger",
                "--node",
                addr,
                "--listen",
                maddr,
                "--data-listen",
                daddr,
                "--node-wait",
                "60",
                "--log-level",
                "WARNING",
            ]
            self.nodes.append(
                NodeProcs(
                    i,
                    addr,
                    maddr,
                    metrics,
                    ssd_dir,
                    Proc("node", i, node_args, self.log_dir),
                    Proc("messenger", i, mess_args, self.log_dir),
                )
            )

    def demotion_failures(self) -> int:
        """Pages the nodes' SSD tiers refused so far (their Prometheus counters; a node that
        does not answer counts 0)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        total = 0.0
        for n in self.nodes:
            try:
                url = f"http://{HOST}:{n.metrics_port}/metrics"
                with urllib.request.urlopen(url, timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                continue
            total += sum(
                s.value
                for fam in text_string_to_metric_families(text)
                for s in fam.samples
                if s.name.startswith(DEMOTION_FAILURES)
            )
        return int(total)

    def procs(self) -> Iterator[Proc]:
        yield self.conductor
        for n in self.nodes:
            yield n.node
            yield n.mess

    def start(self) -> None:
        self.conductor.start()
        for n in self.nodes:
            n.node.start()
            n.mess.start()

    def stop(self) -> None:
        """Messengers, then nodes, then the conductor (as ``kvcache down``)."""
        for group in (
            [n.mess for n in self.nodes],
            [n.node for n in self.nodes],
            [self.conductor],
        ):
            for p in group:
                if p.sp is not None and p.sp.alive():
                    p.sp.proc.send_signal(signal.SIGTERM)
            for p in group:
                if p.sp is not None:
                    try:
                        p.sp.proc.wait(20)
                    except subprocess.TimeoutExpired:
                        p.sp.kill()
                    p.sp.kill()  # removes shared memory a killed process left


def _layout_items(spec: str) -> dict[str, Any]:
    items: dict[str, Any] = dict(part.split("=", 1) for part in spec.split(","))
    for k in ("num_layers", "kv_heads", "head_dim", "block_tokens"):
        items[k] = int(items[k])
    return items


def ssd_keys(ssd_dir: str) -> set[bytes]:
    """Keys in a (stopped) node's SSD lmdb files, read-only: the SSD's state at a kill."""
    import lmdb

    out: set[bytes] = set()
    if not os.path.isdir(ssd_dir):
        return out
    for sub in os.listdir(ssd_dir):
        path = os.path.join(ssd_dir, sub)
        if not os.path.exists(os.path.join(path, "data.mdb")):
            continue
        env = lmdb.open(path, readonly=True, lock=False, max_dbs=2, subdir=True)
        try:
            pages = env.open_db(b"pages", create=False)
            with env.begin() as txn:
                out.update(bytes(k) for k in txn.cursor(db=pages).iternext(values=False))
        finally:
            env.close()
    return out


@contextlib.contextmanager
def _read_snapshot(ssd_dir: str) -> Iterator[None]:
    """A read transaction on a running node's SSD lmdb environments (lmdb's lock file makes the
    node's writer respect it: pages freed while it lasts are not reused)."""
    import lmdb

    envs = []
    try:
        for sub in os.listdir(ssd_dir) if os.path.isdir(ssd_dir) else []:
            path = os.path.join(ssd_dir, sub)
            if os.path.exists(os.path.join(path, "data.mdb")):
                env = lmdb.open(path, readonly=True, lock=True, max_dbs=2, subdir=True)
                envs.append((env, env.begin()))
        yield
    finally:
        for env, txn in envs:
            txn.abort()
            env.close()


# ---- the ledger ----------------------------------------------------------------------------------


@dataclass
class Kill:
    at: float
    ssd: set[bytes]  # keys in the node's SSD file right after the kill


class Ledger:
    """What was written where, what the event feeds said, what chaos did. Thread-safe."""

    def __init__(self, nodes: int) -> None:
        self.lock = threading.Lock()
        self.attempted: list[set[bytes]] = [set() for _ in range(nodes)]
        self.committed: list[dict[bytes, float]] = [{} for _ in range(nodes)]  # key -> start
        self.order: list[list[bytes]] = [[] for _ in range(nodes)]  # committed keys, in order
        self.evicted: list[set[bytes]] = [set() for _ in range(nodes)]
        self.gap_missing: list[set[bytes]] = [set() for _ in range(nodes)]
        self.kills: list[list[Kill]] = [[] for _ in range(nodes)]
        self.errors: Counter[tuple[str, str]] = Counter()  # (code, op)
        self.counts: Counter[str] = Counter()
        self.chaos: Counter[str] = Counter()
        self.chaos_failed: Counter[str] = Counter()
        self.restart_s: dict[str, list[float]] = defaultdict(list)
        self.corrupt: list[str] = []
        self.failures: list[str] = []  # chaos actions that failed, load threads that died
        self.origin: dict[tuple[int, bytes], str] = {}  # how a page was committed: put | move
        self.recent: list[tuple[int, np.ndarray]] = []  # (node, tokens) for Schedule

    def error(self, op: str, code: str) -> None:
        with self.lock:
            self.errors[(code, op)] += 1

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n

    def commit(self, node: int, keys: list[bytes], start: float, how: str) -> None:
        with self.lock:
            c = self.committed[node]
            for k in keys:
                if k not in c:
                    c[k] = start
                    self.order[node].append(k)
                    self.origin[(node, k)] = how

    def pick(self, rng: random.Random, node: int | None = None) -> tuple[int, bytes] | None:
        with self.lock:
            nodes = [node] if node is not None else [i for i, c in enumerate(self.committed) if c]
            nodes = [i for i in nodes if self.committed[i]]
            if not nodes:
                return None
            i = rng.choice(nodes)
            # NOTE: newest keys mostly (what is still cached), older ones sometimes
            keys = self.order[i]
            n = len(keys)
            return i, keys[n - 1 - min(int(rng.expovariate(1 / 64)), n - 1)]


# ---- load threads --------------------------------------------------------------------------------


class Soak:
    def __init__(self, args: argparse.Namespace, cluster: Cluster, fill_dir: str | None) -> None:
        self.args = args
        self.cluster = cluster
        self.fill_dir = fill_dir
        self.ledger = Ledger(args.nodes)
        self.stop_load = threading.Event()
        self.stop_watch = threading.Event()
        self.layout = KVLayout(**_layout_items(LAYOUT))
        self.namespace = ""
        self.root = b""
        self.generation = [0] * args.nodes  # node restarts, for the event watchers
        self.t0 = time.monotonic()

    # -- clients --

    def node_client(self, i: int, shm: bool = True) -> KVStoreClient:
        return KVStoreClient(self.cluster.nodes[i].address, use_shm=shm, timeout_s=10)

    def _rpc_error(self, op: str, e: BaseException) -> None:
        if isinstance(e, KVCacheRpcError):
            self.ledger.error(op, e.code.name)
        else:
            self.ledger.error(op, type(e).__name__)

    def _pause(self) -> None:
        if self.args.op_pause:
            self.stop_load.wait(self.args.op_pause)

    # -- writers --

    def writer(self, w: int) -> None:
        rng = np.random.default_rng([self.args.seed, 1, w])
        pick = random.Random(f"{self.args.seed}-w{w}")
        clients = [self.node_client(i) for i in range(self.args.nodes)]
        bt, page = self.layout.block_tokens, self.layout.page_bytes
        try:
            while not self.stop_load.is_set():
                i = pick.randrange(self.args.nodes)
                blocks = pick.randint(1, 4)
                tokens = rng.integers(0, 1 << 31, blocks * bt, dtype=np.uint32)
                keys = [bytes(k) for k in block_keys(tokens, bt, self.root)]
                pages = [page_for(k, page) for k in keys]
                with self.ledger.lock:
                    self.ledger.attempted[i].update(keys)
                start = time.monotonic()
                try:
                    clients[i].put(self.namespace, pages, tokens=tokens)
                except Exception as e:  # counted by type: the run goes on
                    self._rpc_error("put", e)
                    self.stop_load.wait(0.05)
                    continue
                self.ledger.commit(i, keys, start, "put")
                self.ledger.count("put_pages", len(keys))
                with self.ledger.lock:
                    self.ledger.recent.append((i, tokens))
                    del self.ledger.recent[:-64]
                self._pause()
        finally:
            for c in clients:
                c.close()

    # -- readers --

    def reader(self, r: int) -> None:
        pick = random.Random(f"{self.args.seed}-r{r}")
        clients = [self.node_client(i) for i in range(self.args.nodes)]
        page = self.layout.page_bytes
        try:
            while not self.stop_load.is_set():
                got = self.ledger.pick(pick)
                if got is None:
                    self.stop_load.wait(0.05)
                    continue
                i, key = got
                try:
                    data = clients[i].get(self.namespace, keys=[key])[0]
                except Exception as e:  # counted by type: the run goes on
                    self._rpc_error("get", e)
                    self.stop_load.wait(0.05)
                    continue
                if data is None:
                    self.ledger.count("read_misses")
                elif np.array_equal(data, page_for(key, page)):
                    self.ledger.count("read_verified")
                else:
                    self.ledger.count("read_corrupt")
                    with self.ledger.lock:
                        self.ledger.corrupt.append(f"read node {i} key {key.hex()}")
                self._pause()
        finally:
            for c in clients:
                c.close()

    # -- messenger transfers --

    def mover(self, m: int) -> None:
        pick = random.Random(f"{self.args.seed}-m{m}")
        n = self.args.nodes
        clients = [MessengerClient(nd.messenger, timeout_s=10) for nd in self.cluster.nodes]
        try:
            while not self.stop_load.is_set():
                src = pick.randrange(n)
                dst = (src + pick.randrange(1, n)) % n
                keys = []
                for _ in range(pick.randint(1, 4)):
                    got = self.ledger.pick(pick, src)
                    if got is not None and got[1] not in keys:
                        keys.append(got[1])
                if not keys:
                    self.stop_load.wait(0.05)
                    continue
                with self.ledger.lock:
                    self.ledger.attempted[dst].update(keys)
                start = time.monotonic()
                source = self.cluster.nodes[src].messenger
                try:
                    sub = clients[dst].submit(self.namespace, [(k, source) for k in keys])
                    st = clients[dst].status(sub.batch_id, wait=True, timeout_s=15)
                except Exception as e:  # counted by type: the run goes on
                    self._rpc_error("transfer", e)
                    self.stop_load.wait(0.05)
                    continue
                done = []
                for ent in st.entries:
                    if ent.state == mpb.ENTRY_DONE and not ent.already_present:
                        done.append(bytes(ent.key))
                    elif ent.state == mpb.ENTRY_FAILED:
                        self.ledger.error("transfer entry", ent.code or "UNKNOWN")
                    elif ent.state == mpb.ENTRY_PENDING:
                        self.ledger.count("transfer_pending")
                self.ledger.commit(dst, done, start, "move")
                self.ledger.count("moved_pages", len(done))
                self._pause()
        finally:
            for c in clients:
                c.close()

    # -- the conductor --

    def scheduler(self) -> None:
        pick = random.Random(f"{self.args.seed}-s")
        client = ConductorClient(self.cluster.conductor_address, timeout_s=5)
        try:
            while not self.stop_load.is_set():
                with self.ledger.lock:
                    recent = list(self.ledger.recent)
                if not recent:
                    self.stop_load.wait(0.1)
                    continue
                _, tokens = pick.choice(recent)
                try:
                    client.schedule(self.namespace, tokens=tokens, prompt_tokens=len(tokens))
                    self.ledger.count("schedules")
                except Exception as e:  # counted by type: the run goes on
                    self._rpc_error("schedule", e)
                self.stop_load.wait(0.05)
        finally:
            client.close()

    # -- event feeds --

    def watcher(self, i: int) -> None:
        """Follows node ``i``'s Events feed from its first event (``after_seq=0``, no snapshot:
        a restarted node's events between its start and this subscription count too)."""
        cursor, gen = 0, -1
        while not self.stop_watch.is_set():
            with self.ledger.lock:
                now_gen = self.generation[i]
            if now_gen != gen:  # a restarted node numbers its events from 1 again
                cursor, gen = 0, now_gen
            client = self.node_client(i, shm=False)
            snap: set[bytes] | None = None
            try:
                for batch in client.events(after_seq=cursor):
                    if batch.snapshot:  # the node's ring no longer held our cursor: a gap
                        snap = (snap or set()) | {bytes(e.key) for e in batch.events}
                        if batch.snapshot_done:
                            self._gap(i, snap, gen)
                            snap, cursor = None, batch.snapshot_seq
                    else:
                        with self.ledger.lock:
                            for e in batch.events:
                                if e.kind == cpb.EVENT_EVICTED:
                                    self.ledger.evicted[i].add(bytes(e.key))
                        if batch.events:
                            cursor = batch.events[-1].seq
                    if self.stop_watch.is_set():
                        break
            except (KVCacheRpcError, OSError):
                pass  # the node is down: try again
            finally:
                client.close()
            self.stop_watch.wait(0.2)

    def _gap(self, i: int, snapshot: set[bytes], gen: int) -> None:
        """Events were lost (the node's ring overflowed): committed keys the snapshot no longer
        lists count as evicted in the gap."""
        with self.ledger.lock:
            if gen != self.generation[i]:
                return  # restarted meanwhile: the watcher starts over from seq 0
            missing = set(self.ledger.committed[i]) - snapshot - self.ledger.evicted[i]
            self.ledger.gap_missing[i].update(missing)
            self.ledger.counts["feed_gaps"] += 1

    # -- chaos --

    def chaos(self) -> None:
        rng = random.Random(f"{self.args.seed}-chaos")
        kinds = [k for k in KINDS if k != "ssd-fill" or self.fill_dir]
        # NOTE: a fill first, while the SSD lmdb files still grow: once a file has reached its
        # working size, lmdb reuses its own free pages and a full filesystem refuses nothing
        # (the report counts the pages refused during fills).
        cycle: list[str] = ["ssd-fill"] if self.fill_dir else []
        while not self.stop_load.wait(self.args.chaos_interval):
            if not cycle:
                cycle = rng.sample(kinds, len(kinds))
            kind = cycle.pop(0)
            try:
                self._act(kind, rng)
            except Exception as e:  # a failed restart is a finding, not a crash
                with self.ledger.lock:
                    self.ledger.chaos_failed[kind] += 1
                    self.ledger.failures.append(f"{kind}: {type(e).__name__}: {e}")
                print(f"soak: {kind}: {e}", file=sys.stderr)

    def _act(self, kind: str, rng: random.Random) -> None:
        if kind == "ssd-fill":
            self._fill(rng)
            return
        if kind == "conductor":
            proc = self.cluster.conductor
        else:
            nd = self.cluster.nodes[rng.randrange(len(self.cluster.nodes))]
            proc = nd.node if kind == "node" else nd.mess
        with proc.lock:
            if kind == "node":
                with self.ledger.lock:
                    self.generation[proc.index] += 1
            proc.kill()
            if kind == "node":
                at = time.monotonic()
                keys = ssd_keys(self.cluster.nodes[proc.index].ssd_dir)
                with self.ledger.lock:
                    self.ledger.kills[proc.index].append(Kill(at, keys))
            with self.ledger.lock:
                self.ledger.chaos[kind] += 1
            self.stop_load.wait(rng.uniform(0.0, 1.0))
            t = time.monotonic()
            proc.start()
            with self.ledger.lock:
                self.ledger.restart_s[kind].append(time.monotonic() - t)

    def _fill(self, rng: random.Random) -> None:
        """Fill the SSD filesystem with a ballast file for 1-3 s, then remove it.

        NOTE: an lmdb file that has reached its working size reuses its own free pages, so a full
        filesystem alone refuses nothing once the SSD tiers are warm. During the fill this also
        holds a read snapshot of every node's SSD environment (as a backup or a slow reader
        would): pages freed after it began cannot be reused, the files must grow, and the full
        filesystem refuses their writes (counted from the nodes' demotion-failure counters).
        """
        assert self.fill_dir is not None
        path = os.path.join(self.fill_dir, "ballast")
        with self.ledger.lock:
            self.ledger.chaos["ssd-fill"] += 1
        before = self.cluster.demotion_failures()
        with contextlib.ExitStack() as stack:
            for nd in self.cluster.nodes:
                stack.enter_context(_read_snapshot(nd.ssd_dir))
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    for size in (1 << 20, 4096):  # big chunks, then the last few pages
                        chunk = b"\0" * size
                        with contextlib.suppress(OSError):  # ENOSPC: full
                            while os.write(fd, chunk) == size:
                                pass
                finally:
                    os.close(fd)
                self.stop_load.wait(rng.uniform(1.0, 3.0))
                self.ledger.count("ssd_refused", self.cluster.demotion_failures() - before)
            finally:
                with contextlib.suppress(OSError):
                    os.remove(path)

    # -- the run --

    def prepare(self) -> None:
        with self.node_client(0, shm=False) as c:
            self.namespace = c.namespaces()[0]
        self.root = bytes(root_key(self.namespace))
        with ConductorClient(self.cluster.conductor_address) as cc:
            deadline = time.monotonic() + 30
            while True:
                ids = {s.node.node_id for s in cc.list_nodes().nodes if not s.resyncing}
                if len(ids) >= self.args.nodes:
                    break
                if time.monotonic() > deadline:
                    raise SoakError(f"nodes did not register with the conductor: {ids}")
                time.sleep(0.1)

    def _thread(self, target: Callable[..., None], args: tuple[Any, ...]) -> threading.Thread:
        def guarded() -> None:
            try:
                target(*args)
            except BaseException as e:
                with self.ledger.lock:
                    self.ledger.failures.append(f"{target.__name__}{args} died: {e!r}")
                raise

        return threading.Thread(target=guarded, name=f"soak-{target.__name__}", daemon=True)

    def run(self) -> None:
        a = self.args
        spawn = [(self.watcher, (i,)) for i in range(a.nodes)]
        load: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
            (self.writer, (w,)) for w in range(a.writers)
        ]
        load += [(self.reader, (r,)) for r in range(a.readers)]
        load += [(self.mover, (m,)) for m in range(a.movers)]
        load += [(self.scheduler, ()), (self.chaos, ())]
        watchers = [self._thread(f, x) for f, x in spawn]
        loaders = [self._thread(f, x) for f, x in load]
        for t in watchers + loaders:
            t.start()
        t0 = self.t0 = time.monotonic()
        while time.monotonic() - t0 < a.duration:
            time.sleep(min(5.0, max(a.duration - (time.monotonic() - t0), 0.0)))
            if not a.no_progress:
                c = self.ledger.counts
                print(
                    f"soak: {time.monotonic() - t0:6.1f} s  put {c['put_pages']}  "
                    f"read {c['read_verified']}  moved {c['moved_pages']}  "
                    f"chaos {dict(self.ledger.chaos)}",
                    file=sys.stderr,
                    flush=True,
                )
        self.stop_load.set()
        for t in loaders:
            t.join(120)
        # every process up again (a chaos restart may have failed), feeds caught up
        for p in self.cluster.procs():
            if not p.alive():
                p.start()
        time.sleep(2.0)

    def verify(self) -> dict[str, Any]:
        """Read every page ever attempted on each node; classify the committed ones missing."""
        page = self.layout.page_bytes
        out: Counter[str] = Counter()
        lost_keys: list[str] = []
        for i in range(self.args.nodes):
            with self.ledger.lock:
                keys = sorted(self.ledger.attempted[i])
            present: set[bytes] = set()
            with self.node_client(i, shm=False) as c:
                for s in range(0, len(keys), 32):
                    part = keys[s : s + 32]
                    pages = _retry(lambda part=part: c.get(self.namespace, keys=part))
                    for k, data in zip(part, pages):
                        if data is None:
                            continue
                        present.add(k)
                        if np.array_equal(data, page_for(k, page)):
                            out["verified"] += 1
                        else:
                            out["corrupt"] += 1
                            with self.ledger.lock:
                                self.ledger.corrupt.append(
                                    f"final node {i} key {k.hex()} {self.ledger.origin.get((i, k))}"
                                )
            time.sleep(0.5)  # EVICTED events the reads caused (none: --no-promote) arrive
            with self.ledger.lock:
                committed = dict(self.ledger.committed[i])
                evicted = set(self.ledger.evicted[i]) | self.ledger.gap_missing[i]
                kills = list(self.ledger.kills[i])
            out["committed"] += len(committed)
            out["uncommitted_present"] += len(present - set(committed))
            for k, start in committed.items():
                if k in present:
                    continue
                if k in evicted:
                    out["missing_evicted"] += 1
                elif any(kl.at > start and k not in kl.ssd for kl in kills):
                    out["missing_killed"] += 1
                else:
                    out["lost"] += 1
                    at = [f"{kl.at - self.t0:.1f}" for kl in kills]
                    held = [k in kl.ssd for kl in kills]
                    lost_keys.append(
                        f"node {i} key {k.hex()} {self.ledger.origin.get((i, k))} at "
                        f"{start - self.t0:.1f} s; node kills at {at} s, on SSD then: {held}"
                    )
        return {"counts": dict(out), "lost_keys": lost_keys[:50]}


def _retry(fn: Any, tries: int = 20) -> Any:
    for n in range(tries):
        try:
            return fn()
        except KVCacheRpcError as e:
            if n == tries - 1 or e.code not in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ):
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


# ---- the SSD filesystem --------------------------------------------------------------------------


@contextlib.contextmanager
def ssd_filesystem(
    work: str, nodes: int, ssd_pages: int, page: int, want: bool
) -> Iterator[tuple[str, str | None, str]]:
    """(ssd root, the directory to fill or None, why not). As root, a tmpfs just large enough for
    every node's SSD tier (lmdb overhead included) and a little slack; else a plain directory."""
    root = os.path.join(work, "ssd")
    os.makedirs(root, exist_ok=True)
    if not want:
        yield root, None, "--no-fill"
        return
    if os.geteuid() != 0:
        yield root, None, "not root (needs a tmpfs mount)"
        return
    # an lmdb value of one page takes ceil((page + 16) / 4096) overflow pages, plus its checksum
    per_node = ssd_pages * (-(-(page + 16) // 4096) + 1) * 4096 * 2 + (1 << 20)
    size = nodes * per_node + (2 << 20)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", root],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        yield root, None, f"mount failed: {r.stderr.strip()}"
        return
    try:
        yield root, root, ""
    finally:
        if subprocess.run(["umount", root], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", root], capture_output=True)


# ---- report --------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    check_args(args)
    work = args.work_dir or tempfile.mkdtemp(prefix="kvcache-soak-")
    os.makedirs(work, exist_ok=True)
    page = KVLayout(**_layout_items(LAYOUT)).page_bytes
    with ssd_filesystem(work, args.nodes, args.ssd_pages, page, not args.no_fill) as (
        ssd_root,
        fill_dir,
        no_fill,
    ):
        cluster = Cluster(args, work, ssd_root)
        soak = Soak(args, cluster, fill_dir)
        t0 = time.monotonic()
        try:
            cluster.start()
            soak.prepare()
            soak.run()
            result = soak.verify()
        except SoakError as e:
            raise SystemExit(f"kvcache bench soak: {e} (logs in {cluster.log_dir})") from None
        finally:
            soak.stop_load.set()
            soak.stop_watch.set()
            cluster.stop()
        elapsed = time.monotonic() - t0
    report = build_report(args, soak.ledger, result, elapsed, no_fill, work)
    print_report(report)
    path = os.path.join(args.out, "soak.json")
    write_json(path, report)
    print(f"\nwrote {path}")
    failed = report["summary"]["corrupt"] > 0 or report["summary"]["lost"] > 0
    failed = failed or report["summary"]["restart_failures"] > 0
    failed = failed or report["summary"]["thread_failures"] > 0
    if failed:
        print(f"soak FAILED; logs in {cluster.log_dir}", file=sys.stderr)
        return 1
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def build_report(
    args: argparse.Namespace,
    ledger: Ledger,
    result: dict[str, Any],
    elapsed: float,
    no_fill: str,
    work: str,
) -> dict[str, Any]:
    c = result["counts"]
    lc = ledger.counts
    summary = {
        "duration_s": args.duration,
        "elapsed_s": elapsed,
        "pages_committed": c.get("committed", 0),
        "pages_put": lc.get("put_pages", 0),
        "pages_moved": lc.get("moved_pages", 0),
        "pages_verified": c.get("verified", 0),
        "reads_verified": lc.get("read_verified", 0),
        "read_misses": lc.get("read_misses", 0),
        "corrupt": c.get("corrupt", 0) + lc.get("read_corrupt", 0),
        "corrupt_final": c.get("corrupt", 0),
        "corrupt_reads": lc.get("read_corrupt", 0),
        "missing_evicted": c.get("missing_evicted", 0),
        "missing_killed": c.get("missing_killed", 0),
        "lost": c.get("lost", 0),
        "uncommitted_present": c.get("uncommitted_present", 0),
        "schedules": lc.get("schedules", 0),
        "ssd_refused_in_fills": lc.get("ssd_refused", 0),
        "feed_gaps": lc.get("feed_gaps", 0),
        "restart_failures": sum(ledger.chaos_failed.values()),
        "thread_failures": len(ledger.failures) - sum(ledger.chaos_failed.values()),
    }
    kills = {
        k: {
            "count": ledger.chaos.get(k, 0),
            "failed": ledger.chaos_failed.get(k, 0),
            "restart_s_mean": float(np.mean(ledger.restart_s[k])) if ledger.restart_s[k] else None,
            "restart_s_max": float(np.max(ledger.restart_s[k])) if ledger.restart_s[k] else None,
        }
        for k in KINDS
    }
    errors: dict[str, dict[str, int]] = defaultdict(dict)
    for (code, op), n in sorted(ledger.errors.items()):
        errors[code][op] = n
    return {
        "options": {k: v for k, v in vars(args).items() if k != "log_level"},
        "summary": summary,
        "kills": kills,
        "ssd_fill": no_fill or "yes",
        "errors": dict(errors),
        "corrupt_examples": ledger.corrupt[:50],
        "failures": ledger.failures[:50],
        "lost_examples": result["lost_keys"],
        "work_dir": work,
    }


def print_report(report: dict[str, Any]) -> None:
    s = report["summary"]
    rows = [
        {"what": "pages committed (put OK, transfer DONE)", "n": s["pages_committed"]},
        {
            "what": "  of which put / moved by messengers",
            "n": f"{s['pages_put']} / {s['pages_moved']}",
        },
        {"what": "pages verified at the end", "n": s["pages_verified"]},
        {"what": "reads verified during the run", "n": s["reads_verified"]},
        {"what": "missing: evicted (EVICTED event)", "n": s["missing_evicted"]},
        {"what": "missing: not on SSD at a node kill", "n": s["missing_killed"]},
        {"what": "corrupt (must be 0)", "n": s["corrupt"]},
        {"what": "lost, unexplained (must be 0)", "n": s["lost"]},
        {"what": "restart failures (must be 0)", "n": s["restart_failures"]},
        {"what": "load threads died (must be 0)", "n": s["thread_failures"]},
        {"what": "SSD pages refused while filled (dropped)", "n": s["ssd_refused_in_fills"]},
        {"what": "conductor schedules OK", "n": s["schedules"]},
    ]
    print_table(
        rows,
        [Column("what", "soak"), Column("n", "count")],
        title=f"kvcache bench soak: {s['elapsed_s']:.0f} s, SSD fill: {report['ssd_fill']}",
    )
    print()
    krows = [{"kind": k, **v} for k, v in report["kills"].items() if v["count"] or k != "ssd-fill"]
    print_table(
        krows,
        [
            Column("kind", "chaos"),
            Column("count", "count"),
            Column("failed", "failed"),
            Column("restart_s_mean", "restart s (mean)", "{:.2f}"),
            Column("restart_s_max", "restart s (max)", "{:.2f}"),
        ],
    )
    print()
    erows = [
        {"code": code, "n": sum(ops.values()), "ops": ", ".join(f"{o} {n}" for o, n in ops.items())}
        for code, ops in report["errors"].items()
    ]
    print_table(
        erows or [{"code": "-", "n": 0, "ops": ""}],
        [Column("code", "error code"), Column("n", "count"), Column("ops", "by operation")],
    )
