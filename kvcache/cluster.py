"""``kvcache up``: a local cluster on loopback from one TOML config (embedded defaults; the
schema, precedence and errors are ``cluster_config``'s), or with ``--hosts N`` on N hosts in
network namespaces (``cluster_hosts``: where each process runs and on which address).

One conductor, then per node a node server and its messenger, each a separate process. Ports are
chosen up front so that every process can be told its peers' addresses; the launcher waits for each
process's ready line, writes the cluster's state (addresses, pids, logs) to
``<state_dir>/cluster.json`` and prints the addresses. In the foreground it stops everything on
Ctrl-C / SIGTERM; with ``--detach`` it returns and ``kvcache down`` stops the cluster later.

With ``[etcd] enabled`` (``--etcd``) membership and the conductors' election live in etcd
(``kvcache/etcd_server.py`` starts one unless ``endpoints`` names it) and ``[conductor] replicas``
conductors run: one leader, the others hot standbys. With both, etcd and the conductors share the
control namespace and every process registers there by its host's address.
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
from dataclasses import dataclass, field

from kvstore.shm import pid_alive
from plumbing.launch import ServiceProcess, process_identity, reserve_port, start_service
from rpc.server import wait_for_signal
from rpc.tls import TlsFiles, make_local_ca

from .cluster_config import (
    ClusterConfig,
    ConfigError,
    NodeSpec,
    add_flags,
    from_args,
    load_config,
    render,
)
from .cluster_hosts import (
    WILDCARDS,
    Loopback,
    Namespaced,
    Site,
    check_hosts,
    network_record,
    placement,
)
from .engines import EngineSite, Serving, ServingConfig, serving_config
from .etcd_server import etcd_role_args, start_etcd

__all__ = ["Cluster", "ClusterConfig", "NodeSpec", "load_config"]
SERVING_TENANT = "serving"  # the tenant of a cluster's engines and router

log = logging.getLogger("kvcache.cluster")


@dataclass
class Cluster:
    config: ClusterConfig
    detach: bool = False
    procs: list[ServiceProcess] = field(default_factory=list)
    state: dict = field(default_factory=dict)
    place: Loopback | Namespaced | None = None
    serving: Serving | None = None  # [[engines]] and [router] (kvcache/engines.py)

    def start(self) -> dict:
        cfg = self.config
        wanted = serving_config(cfg)  # ConfigError before any process starts
        os.makedirs(cfg.state_dir, exist_ok=True)
        logs = os.path.join(cfg.state_dir, "logs")
        os.makedirs(logs, exist_ok=True)
        self.place = place = placement(cfg)
        try:
            return self._start_all(place, logs, wanted)
        except BaseException:
            self.stop()
            raise

    def _start_all(
        self, place: Loopback | Namespaced, logs: str, wanted: ServingConfig | None
    ) -> dict:
        cfg = self.config
        auth: list[str] = []
        data_auth: list[str] = []
        service: list[str] = []
        token_file = serving_token = None
        if cfg.token:  # 0600 files, not argv: any local user can read /proc/PID/cmdline
            token_file = self._secret("token", cfg.token)
            auth = ["--token-file", token_file]
            # Least privilege: the messengers' data ports take a credential of their own; the
            # conductor's event feeds and transfer hook a service token that may do only that;
            # engines and the router a tenant's token (one compromised engine is one tenant,
            # not the cluster's admin).
            data_auth = ["--data-token-file", self._secret("data-token")]
            service = ["--service-token-file", self._secret("service-token")]
            if wanted is not None:
                serving_token = self._secret("serving-token")
                with open(serving_token) as f:
                    line = f"{f.read().strip()}={SERVING_TENANT}"
                auth += ["--tenant-tokens-file", self._secret("tenant-tokens", line)]
        # TLS: every service presents one certificate from a local CA; every client of a
        # service (conductor -> nodes and messengers, node -> conductor, messenger -> node and
        # peers, and `kvcache bench live` through cluster.json) verifies it against that CA.
        serve_tls: list[str] = []
        ca: list[str] = []
        tls_ca = files = None
        if cfg.tls:
            files = make_local_ca(os.path.join(cfg.state_dir, "tls"), place.tls_hosts)
            serve_tls = ["--tls-cert", files.cert, "--tls-key", files.key]
            tls_ca = files.ca_cert
            ca = [tls_ca]
        conductor_args = cfg.conductor_args
        if wanted is not None:  # engine ports first: the conductor scrapes their load
            self.serving = Serving(wanted, cfg.host)
            sites = {}
            if place.fixed:  # namespaced hosts: each engine beside its node, in its host
                for i, spec in enumerate(cfg.nodes):
                    site = place.node(i)
                    port = cfg.get("hosts", "engine_port") + i // cfg.get("hosts", "count")
                    sites[spec.id] = EngineSite(site.wrap, site.ip, port)
            conductor_args = [*conductor_args, *self.serving.plan(reserve_port, sites)]
        etcd = (
            self._start_etcd(place, files if cfg.tls else None)
            if cfg.get("etcd", "enabled")
            else None
        )
        etcd_args = etcd_role_args(etcd, cfg) if etcd else []
        conductors = []
        for i in range(cfg.get("conductor", "replicas")):
            listen = place.conductor_listen(i)
            conductors.append(
                self._start(
                    [
                        "conductor",
                        "--listen",
                        listen,
                        *self._advertise(place, listen),
                        "--policy",
                        cfg.policy,
                        *auth,
                        *(["--node-token-file", service[1]] if service else []),
                        *serve_tls,
                        *(["--node-tls-ca", *ca] if ca else []),
                        *self._metrics(
                            place.ctl, cfg.get("conductor", "metrics_port") if i == 0 else 0
                        ),
                        *etcd_args,
                        *conductor_args,
                    ],
                    logs,
                    place.ctl,
                )
            )
        conductor = conductors[0]
        state = {
            "conductor": {
                "address": conductor.address,
                "pid": conductor.pid,
                "log": conductor.log_path,
                "metrics": self._metrics_address(conductor, place.ctl),
            },
            "conductors": [
                {
                    "address": c.address,
                    "pid": c.pid,
                    "log": c.log_path,
                    "metrics": self._metrics_address(c, place.ctl),
                }
                for c in conductors
            ],
            "etcd": etcd,
            "nodes": [],
            "token": cfg.token,
            "tls_ca": tls_ca,
            "state_dir": cfg.state_dir,
            "network": place.state(),
        }
        for i, spec in enumerate(cfg.nodes):
            site = place.node(i)
            node_args = [
                "node",
                "--listen",
                site.node,
                *self._advertise(place, site.node),
                "--node-id",
                spec.id,
                "--role",
                spec.role,
                "--dram",
                spec.dram,
                *(["--layout", spec.layout] if spec.layout else []),
                *(etcd_args or ["--conductor", conductor.address]),
                "--messenger",
                site.messenger,
                *auth,
                *service,
                *serve_tls,
                *(["--conductor-tls-ca", *ca] if ca else []),
                *self._metrics(site, spec.settings.get("metrics_port", 0)),
            ]
            if cfg.token and not etcd_args:
                node_args += ["--conductor-token-file", token_file]
            if spec.ssd not in ("0", ""):
                node_args += [
                    "--ssd",
                    spec.ssd,
                    "--ssd-dir",
                    os.path.join(cfg.state_dir, "ssd", spec.id),
                ]
            node = self._start(node_args, logs, site)
            # NOTE: a metrics port per messenger: `kvcache bench live` reads the bytes each
            # one received (exact totals, whoever submitted the transfer).
            messenger = self._start(
                [
                    "messenger",
                    "--node",
                    node.address,
                    "--listen",
                    site.messenger,
                    *self._advertise(place, site.messenger),
                    *(["--data-listen", site.data] if site.data else []),
                    "--transport",
                    cfg.transport,
                    *self._metrics(site, spec.settings.get("messenger_metrics_port", 0)),
                    *auth,
                    *data_auth,
                    *service,
                    *serve_tls,
                    *(["--node-tls-ca", *ca] if ca else []),
                    *etcd_args,
                ],
                logs,
                site,
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
                    "metrics": self._metrics_address(node, site),
                    "messenger_metrics": self._metrics_address(messenger, site),
                }
            )
        if self.serving is not None:
            layouts = {n.id: n.layout for n in cfg.nodes}
            nodes = {n["id"]: {**n, "layout": layouts[n["id"]]} for n in state["nodes"]}
            # every conductor: the router's client follows a standby's redirect to the leader
            addresses = ",".join(c.address for c in conductors)
            state.update(
                self.serving.start(nodes, logs, addresses, serving_token, tls_ca, self.detach)
            )
        roles = [(p.pid, p.role) for p in self.procs]
        roles += [(e["pid"], "engine") for e in state.get("engines", [])]
        if "router" in state:
            roles.append((state["router"]["pid"], "router"))
        state["pids"] = [pid for pid, _ in roles]
        # NOTE: `kvcache down` signals a pid only while it is still the process started here
        # (a pid is reused once its process is gone).
        state["processes"] = [
            {"pid": pid, "role": role, **process_identity(pid)} for pid, role in roles
        ]
        self.state = state
        path = os.path.join(cfg.state_dir, "cluster.json")
        write_secret(path, json.dumps(state, indent=2))  # it holds the token
        write_prometheus_targets(state, os.path.join(cfg.state_dir, "prometheus-targets.json"))
        return state

    @staticmethod
    def _advertise(place: Loopback | Namespaced, listen: str) -> list[str]:
        """On hosts every address is fixed up front: each process publishes the one it
        listens on (in etcd, or to the conductor), never one looked up from its hostname."""
        return ["--advertise", listen] if place.fixed else []

    def _metrics(self, site: Site, port: int) -> list[str]:
        """Every process serves Prometheus metrics (port 0: any free one, in cluster.json)."""
        host = site.metrics_host(self.config.get("cluster", "metrics_host"))
        return ["--metrics-host", host, "--metrics-port", str(port)]

    def _metrics_address(self, sp: ServiceProcess, site: Site) -> str | None:
        port = sp.info.get("metrics_port")
        host = site.metrics_host(self.config.get("cluster", "metrics_host"))
        if host in WILDCARDS:
            host = site.ip  # bound everywhere: reachable where the process serves
        return f"{host}:{port}" if port else None

    def _start_etcd(self, place: Loopback | Namespaced, tls: TlsFiles | None) -> dict:
        """``[etcd] enabled``: our own etcd server unless ``endpoints`` names one (on hosts: in
        the control namespace, on its address); what cluster.json keeps of it. With ``tls``
        (``--tls``) our etcd serves TLS and takes only clients with a certificate of the
        cluster's CA; every role gets the services' certificate as its client certificate."""
        cfg = self.config
        endpoints, pid = list(cfg.get("etcd", "endpoints")), None
        if not endpoints:
            client_url, peer_url = place.etcd_urls() or (None, None)
            if tls is not None and client_url:
                client_url = "https://" + client_url.split("://", 1)[1]
            server = start_etcd(
                os.path.join(cfg.state_dir, "etcd"),
                place.ctl.ip,
                client_url=client_url,
                peer_url=peer_url,
                wrap=place.ctl.wrap,
                tls=tls,
            )
            self.procs.append(server.process)
            endpoints, pid = [server.endpoint], server.pid
        out = {"endpoints": endpoints, "prefix": cfg.get("etcd", "prefix"), "pid": pid}
        if tls is not None:
            out["tls"] = {"ca": tls.ca_cert, "cert": tls.cert, "key": tls.key}
        return out

    def _secret(self, name: str, value: str | None = None) -> str:
        """``<state_dir>/<name>``, 0600, holding ``value`` (default: a new random token)."""
        path = os.path.join(self.config.state_dir, name)
        write_secret(path, secrets.token_urlsafe(32) if value is None else value)
        return path

    def _start(self, args: list[str], log_dir: str, site: Site) -> ServiceProcess:
        # A service that fails exits at once with its reason; the deadline only bounds one that
        # hangs, and a busy 2-core machine (engines importing vLLM) took a conductor past 60 s.
        sp = start_service(
            args, timeout_s=120, log_dir=log_dir, new_session=self.detach, wrap=site.wrap
        )
        self.procs.append(sp)
        return sp

    def stop(self, timeout_s: float = 15.0) -> list[int]:
        """Stop the router and engines, then messengers, then node servers, then the conductors,
        then etcd, each stage in parallel (one by one, their gRPC grace periods would add up),
        then remove the hosts' network; returns exit codes."""
        codes = self.serving.stop(timeout_s) if self.serving is not None else []
        for role in ("messenger", "node", "conductor", "etcd"):
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
            self.place = None
        return codes


def write_secret(path: str, secret: str) -> None:
    """A 0600 file holding ``secret``; an existing file is replaced, not rewritten in place, so
    that it never keeps looser permissions (or another owner) of an earlier one."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_prometheus_targets(state: dict, path: str) -> None:
    """Every metrics endpoint, labelled with its role and node, for a Prometheus
    ``file_sd_configs`` job (docs/operations.md)."""
    conductors = state.get("conductors") or [state["conductor"]]
    targets = [{"targets": [c["metrics"]], "labels": {"role": "conductor"}} for c in conductors]
    for n in state["nodes"]:
        for role, key in (("node", "metrics"), ("messenger", "messenger_metrics")):
            targets.append({"targets": [n[key]], "labels": {"role": role, "node_id": n["id"]}})
    for e in state.get("engines", []):  # vLLM's own /metrics
        address = e["url"].split("://", 1)[-1]
        targets.append({"targets": [address], "labels": {"role": "engine", "node_id": e["node"]}})
    if "router" in state:
        targets.append({"targets": [state["router"]["address"]], "labels": {"role": "router"}})
    with open(path, "w") as f:
        json.dump([t for t in targets if t["targets"][0]], f, indent=2)


def print_state(state: dict, path: str) -> None:
    if state.get("network"):
        net = state["network"]
        hosts = ", ".join(f"{h} {v['address']}" for h, v in net["hosts"].items())
        rate = f" (links capped at {net['rate']})" if net["rate"] else ""
        print(f"network    {net['bridge']} {net['subnet']}{rate}: {hosts}")
    if state.get("etcd"):
        etcd = state["etcd"]
        print(f"etcd       {','.join(etcd['endpoints'])}  prefix {etcd['prefix']}")
    for c in state.get("conductors") or [state["conductor"]]:
        print(f"conductor  {c['address']}")
    for n in state["nodes"]:
        where = f"  on {n['host']}" if n.get("host") else ""
        print(
            f"node       {n['id']:<10} {n['role']:<8} {n['address']}  messenger {n['messenger']}"
            f"{where}"
        )
    for e in state.get("engines", []):
        print(f"engine     {e['node']:<10} {e['kv_role']:<8} {e['url']}  ({e['model']})")
    if "router" in state:
        api = "/v1/completions, /v1/chat/completions, /v1/models"
        print(f"router     {state['router']['url']}  (OpenAI API: {api})")
    print(f"state      {path}")
    print(f"status     kvcache status --cluster {path}")
    print(f"security   {security_note(state)}")


def security_note(state: dict) -> str:
    """What protects the cluster, in one line: a local demo may be open, and says so."""
    if not state.get("token"):
        return (
            "OPEN: no token, no TLS, every caller is the admin (a demo on loopback; on a shared "
            "host or network: kvcache up --tls)"
        )
    tls = "TLS on every link" if state.get("tls_ca") else "no TLS: every link in clear"
    return f"tokens in {state.get('state_dir')} (0600), {tls}"


def configure(parser: argparse.ArgumentParser) -> None:
    add_flags(parser)
    parser.add_argument(
        "--detach",
        action="store_true",
        help="return once the cluster is up; stop it with 'kvcache down'",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the merged config (flags > $KVCACHE_* > --config file > defaults, each "
        "value's source as a comment) and exit",
    )
    parser.epilog = (
        "Config precedence: flags (--set, --state-dir, ...) > environment ($KVCACHE_<KEY> for "
        "[cluster] keys, $KVCACHE_<SECTION>_<KEY> otherwise) > --config file > defaults. "
        "'kvcache up --print-config' shows the result."
    )


def run(args: argparse.Namespace) -> int:
    try:
        cfg = from_args(args)
        serving_config(cfg)  # [[engines]] / [router] mistakes before anything starts
    except ConfigError as e:
        print(f"kvcache up: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(render(cfg), end="")
        return 0
    replicas = cfg.get("conductor", "replicas")
    if replicas > 1 and not cfg.get("etcd", "enabled"):
        print(
            f"kvcache up: [conductor] replicas = {replicas} needs [etcd] enabled = true (or "
            "--etcd): one conductor leads by etcd election, the others stand by",
            file=sys.stderr,
        )
        return 2
    try:
        check_hosts(cfg)
    except ConfigError as e:
        print(f"kvcache up: {e}", file=sys.stderr)
        return 2
    if cfg.token and cfg.get("etcd", "enabled") and not cfg.tls:
        print(
            "kvcache up: a token with [etcd] needs --tls: the conductors and clients send tokens "
            "to addresses learned from etcd, and only TLS says who answers there",
            file=sys.stderr,
        )
        return 2
    if cfg.tls and not cfg.token:
        # Encrypted links with open doors would be theatre: TLS comes with a cluster token (in
        # cluster.json, 0600 files; the messengers' data ports demand it in their HELLO).
        cfg.token = secrets.token_urlsafe(32)
    state_file = os.path.join(cfg.state_dir, "cluster.json")
    if os.path.exists(state_file) and _any_alive(state_file):
        print(
            f"kvcache up: a cluster from {state_file} is still running; "
            f"'kvcache down --state-dir {cfg.state_dir}' first",
            file=sys.stderr,
        )
        return 1
    if os.path.exists(network_record(cfg.state_dir)):
        print(
            f"kvcache up: {network_record(cfg.state_dir)} records host namespaces of an earlier "
            f"cluster; 'kvcache down --state-dir {cfg.state_dir}' removes them",
            file=sys.stderr,
        )
        return 1
    cluster = Cluster(cfg, detach=args.detach)
    try:
        state = cluster.start()
    except (RuntimeError, TimeoutError, OSError) as e:
        # A process that failed to start: its own message (the last lines of its log) says why;
        # hosts that could not be made (NetnsError): what to fix.
        print(f"kvcache up: the cluster did not start: {e}", file=sys.stderr)
        return 1
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
    try:
        with open(state_file) as f:
            pids = json.load(f).get("pids", [])
    except (OSError, ValueError, AttributeError):
        return False  # not a state file 'kvcache up' wrote: nothing of it can be running
    return any(pid_alive(p) for p in pids if isinstance(p, int))
