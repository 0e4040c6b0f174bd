"""``kvcache up``: a local cluster on loopback from one TOML config (embedded defaults), or with
``--hosts N`` on N hosts in network namespaces (``kvcache/cluster_hosts.py``).

One conductor, then per node a node server and its messenger, each a separate process. Ports are
chosen up front so that every process can be told its peers' addresses; the launcher waits for each
process's ready line, writes the cluster's state (addresses, pids, logs) to
``<state_dir>/cluster.json`` and prints the addresses. In the foreground it stops everything on
Ctrl-C / SIGTERM; with ``--detach`` it returns and ``kvcache down`` stops the cluster later.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field, replace

from kvstore.shm import pid_alive
from rpc.launch import ServiceProcess, start_service
from rpc.server import wait_for_signal
from rpc.tls import make_local_ca

from .cluster_hosts import (
    HOSTS_TABLE,
    HostsConfig,
    Loopback,
    Namespaced,
    network_record,
    parse_hosts,
    placement,
)

log = logging.getLogger("kvcache.cluster")

DEFAULT_CONFIG = (
    """
[cluster]
host = "127.0.0.1"
state_dir = "out/cluster"
# token = "secret"          # require a bearer token on every service
transport = "tcp"            # messenger transport: tcp | rdma | auto
tls = false                  # TLS on every gRPC link, from a local CA made in state_dir/tls

[conductor]
policy = "global-cache"

[defaults]
# 512-token blocks (the Mooncake trace's) and 256 KiB pages (4 layers x K|V x 512 tokens x 1 head
# x 32 dims x fp16): `make demo` moves a few hundred trace requests' pages through shared memory
# and the messengers' TCP in a few minutes on a 2-core machine. 1 GiB = 4096 pages per node.
layout = "model=demo,num_layers=4,kv_heads=1,head_dim=32,dtype=float16,block_tokens=512"
dram = "1GiB"
ssd = "0"

"""
    + HOSTS_TABLE
    + """
[[node]]
id = "prefill-0"
role = "prefill"

[[node]]
id = "prefill-1"
role = "prefill"

[[node]]
id = "decode-0"
role = "decode"
"""
)


@dataclass
class NodeSpec:
    id: str
    role: str
    layout: str
    dram: str
    ssd: str = "0"


@dataclass
class ClusterConfig:
    host: str
    state_dir: str
    token: str | None
    transport: str
    policy: str
    nodes: list[NodeSpec]
    conductor_args: list[str] = field(default_factory=list)
    tls: bool = False
    hosts: HostsConfig = field(default_factory=HostsConfig)


def load_config(path: str | None) -> ClusterConfig:
    data = tomllib.loads(DEFAULT_CONFIG)
    if path:
        with open(path, "rb") as f:
            user = tomllib.load(f)
        for section in ("cluster", "conductor", "defaults", "hosts"):
            data[section].update(user.get(section, {}))
        if "node" in user:
            data["node"] = user["node"]
    defaults = data["defaults"]
    nodes = []
    for n in data["node"]:
        if "id" not in n or "role" not in n:
            raise SystemExit(f"every [[node]] needs id and role, got {n}")
        nodes.append(
            NodeSpec(
                id=n["id"],
                role=n["role"],
                layout=n.get("layout", defaults["layout"]),
                dram=str(n.get("dram", defaults["dram"])),
                ssd=str(n.get("ssd", defaults.get("ssd", "0"))),
            )
        )
    if len({n.id for n in nodes}) != len(nodes):
        raise SystemExit("node ids must be unique")
    c = data["cluster"]
    return ClusterConfig(
        host=c["host"],
        state_dir=c["state_dir"],
        token=c.get("token") or None,
        transport=c.get("transport", "tcp"),
        policy=data["conductor"]["policy"],
        nodes=nodes,
        conductor_args=list(data["conductor"].get("args", [])),
        tls=bool(c.get("tls", False)),
        hosts=parse_hosts(data["hosts"]),
    )


@dataclass
class Cluster:
    config: ClusterConfig
    detach: bool = False
    procs: list[ServiceProcess] = field(default_factory=list)
    state: dict = field(default_factory=dict)
    place: Loopback | Namespaced | None = None

    def start(self) -> dict:
        cfg = self.config
        os.makedirs(cfg.state_dir, exist_ok=True)
        logs = os.path.join(cfg.state_dir, "logs")
        os.makedirs(logs, exist_ok=True)
        place = placement(cfg.hosts, cfg.host, len(cfg.nodes), cfg.state_dir)
        self.place = place
        try:
            auth: list[str] = []
            if cfg.token:  # a 0600 file, not argv: any local user can read /proc/PID/cmdline
                token_file = os.path.join(cfg.state_dir, "token")
                fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(cfg.token + "\n")
                auth = ["--token-file", token_file]
            # TLS: every service presents one certificate from a local CA; every client of a
            # service (conductor -> nodes and messengers, node -> conductor, messenger -> node and
            # peers, and `kvcache bench live` through cluster.json) verifies it against that CA.
            serve_tls: list[str] = []
            ca: list[str] = []
            tls_ca = None
            if cfg.tls:
                files = make_local_ca(os.path.join(cfg.state_dir, "tls"), place.tls_hosts)
                serve_tls = ["--tls-cert", files.cert, "--tls-key", files.key]
                tls_ca = files.ca_cert
                ca = [tls_ca]
            conductor = self._start(
                [
                    "conductor",
                    "--listen",
                    place.conductor_listen,
                    "--policy",
                    cfg.policy,
                    *auth,
                    *serve_tls,
                    *(["--node-tls-ca", *ca] if ca else []),
                    *cfg.conductor_args,
                ],
                logs,
                place.conductor_wrap,
            )
            state = {
                "conductor": {
                    "address": conductor.address,
                    "pid": conductor.pid,
                    "log": conductor.log_path,
                },
                "nodes": [],
                "token": cfg.token,
                "tls_ca": tls_ca,
                "state_dir": cfg.state_dir,
                "network": place.state(),
            }
            for i, spec in enumerate(cfg.nodes):
                site = place.node(i)
                node_addr, messenger_addr = site.node, site.messenger
                node_args = [
                    "node",
                    "--listen",
                    node_addr,
                    "--node-id",
                    spec.id,
                    "--role",
                    spec.role,
                    "--dram",
                    spec.dram,
                    "--layout",
                    spec.layout,
                    "--conductor",
                    conductor.address,
                    "--messenger",
                    messenger_addr,
                    *auth,
                    *serve_tls,
                    *(["--conductor-tls-ca", *ca] if ca else []),
                ]
                if cfg.token:
                    node_args += ["--conductor-token-file", token_file]
                if spec.ssd not in ("0", ""):
                    node_args += [
                        "--ssd",
                        spec.ssd,
                        "--ssd-dir",
                        os.path.join(cfg.state_dir, "ssd", spec.id),
                    ]
                node = self._start(node_args, logs, site.wrap)
                # NOTE: a metrics port per messenger: `kvcache bench live` reads the bytes each
                # one received (exact totals, whoever submitted the transfer).
                messenger = self._start(
                    [
                        "messenger",
                        "--node",
                        node.address,
                        "--listen",
                        messenger_addr,
                        "--transport",
                        cfg.transport,
                        "--metrics-port",
                        str(site.metrics_port),
                        *(["--data-listen", site.data] if site.data else []),
                        *auth,
                        *serve_tls,
                        *(["--node-tls-ca", *ca] if ca else []),
                    ],
                    logs,
                    site.wrap,
                )
                state["nodes"].append(
                    {
                        "id": spec.id,
                        "role": spec.role,
                        "host": site.host,
                        "address": node.address,
                        "messenger": messenger.address,
                        "shm": node.info.get("shm", {}),
                        "pids": [node.pid, messenger.pid],
                        "logs": [node.log_path, messenger.log_path],
                        "data_address": messenger.info.get("data_address"),
                        "messenger_metrics_port": messenger.info.get("metrics_port"),
                    }
                )
        except BaseException:
            self.stop()
            raise
        state["pids"] = [p.pid for p in self.procs]
        self.state = state
        path = os.path.join(cfg.state_dir, "cluster.json")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the token
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, indent=2)
        return state

    def _start(self, args: list[str], log_dir: str, wrap: list[str]) -> ServiceProcess:
        sp = start_service(args, timeout_s=60, log_dir=log_dir, new_session=self.detach, wrap=wrap)
        self.procs.append(sp)
        return sp

    def stop(self, timeout_s: float = 15.0) -> list[int]:
        """Stop messengers, then node servers, then the conductor, each stage in parallel (one
        by one, their gRPC grace periods would add up); returns exit codes."""
        codes = []
        for role in ("messenger", "node", "conductor"):
            stage = [sp for sp in reversed(self.procs) if sp.role == role]
            for sp in stage:
                if sp.alive():
                    sp.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for sp in stage:
                try:
                    sp.proc.wait(max(deadline - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:
                    log.warning(
                        "%s (pid %d) did not stop in %gs: killed", sp.role, sp.pid, timeout_s
                    )
                    sp.kill()
                codes.append(sp.proc.returncode)
        self.procs.clear()
        if self.place is not None:
            self.place.teardown()
        return codes


def print_state(state: dict, path: str) -> None:
    print(f"conductor  {state['conductor']['address']}")
    for n in state["nodes"]:
        print(f"node       {n['id']:<10} {n['role']:<8} {n['address']}  messenger {n['messenger']}")
    print(f"state      {path}")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="cluster TOML (default: the embedded one below)\n")
    parser.add_argument(
        "--detach",
        action="store_true",
        help="return once the cluster is up; stop it with 'kvcache down'",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="TLS on every gRPC link, with a local CA made in <state_dir>/tls (config: tls = true)",
    )
    parser.add_argument(
        "--hosts",
        type=int,
        default=None,
        metavar="N",
        help="put the nodes on N hosts, each a network namespace with its own address, and the "
        "conductor in another (needs root; config: [hosts] count)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the embedded default config and exit"
    )
    parser.epilog = "Embedded default config:\n" + DEFAULT_CONFIG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def run(args: argparse.Namespace) -> int:
    if args.print_config:
        print(DEFAULT_CONFIG.strip())
        return 0
    cfg = load_config(args.config)
    cfg.tls = cfg.tls or args.tls
    if args.hosts is not None:
        if args.hosts < 1:
            raise SystemExit(f"--hosts {args.hosts}: give the number of hosts, at least 1")
        cfg.hosts = replace(cfg.hosts, count=args.hosts)
    if cfg.tls and not cfg.token:
        # Encrypted links with open doors would be theatre: TLS comes with a cluster token (in
        # cluster.json, 0600 files; the messengers' data ports demand it in their HELLO).
        cfg.token = secrets.token_urlsafe(32)
    state_file = os.path.join(cfg.state_dir, "cluster.json")
    if os.path.exists(state_file) and _any_alive(state_file):
        raise SystemExit(f"a cluster from {state_file} is still running; 'kvcache down' first")
    if os.path.exists(network_record(cfg.state_dir)):
        raise SystemExit(
            f"{network_record(cfg.state_dir)} records host namespaces of an earlier cluster; "
            f"'kvcache down --state-dir {cfg.state_dir}' removes them"
        )
    cluster = Cluster(cfg, detach=args.detach)
    state = cluster.start()
    print_state(state, state_file)
    sys.stdout.flush()
    if args.detach:
        for sp in cluster.procs:  # NOTE: they outlive us; nothing reads their stdout any more
            sp.proc.stdout = None
        return 0
    codes: list[int] = []
    wait_for_signal(
        lambda: codes.extend(cluster.stop()),
        on_ready=lambda: print("cluster up; Ctrl-C stops it", flush=True),
    )
    os.remove(state_file)
    return 0 if all(c == 0 for c in codes) else 1


def _any_alive(state_file: str) -> bool:
    with open(state_file) as f:
        pids = json.load(f).get("pids", [])
    return any(pid_alive(p) for p in pids)
