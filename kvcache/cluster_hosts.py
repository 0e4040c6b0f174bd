"""Where ``kvcache up`` puts each process and which addresses it serves on.

Two placements: ``Loopback`` (the default: every process on the cluster's host, free ports) and
``Namespaced`` (``[hosts] count = N`` or ``kvcache up --hosts N``): the conductors (and with
``[etcd] enabled`` our etcd) in a control namespace (``<prefix>-ctl``), the nodes spread
round-robin over N host namespaces (``<prefix>-h0`` ...), each node beside its messenger, all
joined by a bridge whose address the root namespace holds (``plumbing/netns.py``). In that mode
every address comes from the ``[hosts]`` keys (``cluster_config``): the subnet gives each namespace
its address, the ports are fixed per role (the k-th node of a host adds k to each, the i-th
conductor adds i), metrics bind the host's address, and nothing listens on loopback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from plumbing.launch import free_port
from plumbing.netns import HostNetwork, NetnsError, NetSpec, check_subnet, unavailable_reason

from .cluster_config import ClusterConfig, ConfigError

WILDCARDS = ("0.0.0.0", "::", "")
# [hosts] ports: (key, who adds its index: "node" per node of a host, "conductor" per replica)
PORTS = (
    ("node_port", "node"),
    ("messenger_port", "node"),
    ("data_port", "node"),
    ("engine_port", "node"),
    ("conductor_port", "conductor"),
    ("etcd_port", None),
    ("etcd_peer_port", None),
)


def check_hosts(cfg: ClusterConfig) -> None:
    """What no single ``[hosts]`` key shows: enough nodes for the hosts, and ports that do not
    collide once each host's k-th node and the i-th conductor add their index."""
    h = cfg.settings["hosts"]
    count = h["count"]
    if not count:
        return
    if len(cfg.nodes) < count:
        raise ConfigError(
            f"[hosts] count = {count} but {len(cfg.nodes)} [[node]] tables: every host needs a "
            "node (fewer hosts, or more [[node]] tables)"
        )
    try:
        check_subnet(h["subnet"], count + 1)  # the hosts and the control namespace
    except NetnsError as e:
        raise ConfigError(f"[hosts] subnet: {e}") from None
    per_host = -(-len(cfg.nodes) // count)
    spans = {"node": per_host, "conductor": cfg.get("conductor", "replicas"), None: 1}
    taken: dict[int, str] = {}
    for key, by in PORTS:
        for i in range(spans[by]):
            port, name = h[key] + i, key if i == 0 else f"{key} + {i}"
            if port > 65535:
                raise ConfigError(f"[hosts] {name} = {port} is not a TCP port")
            if port in taken:
                raise ConfigError(
                    f"[hosts] {name} and {taken[port]} are both port {port} (with "
                    f"{per_host} nodes per host and {spans['conductor']} conductors): "
                    "space the ports apart"
                )
            taken[port] = name


@dataclass(frozen=True)
class Site:
    """Where one process (or a node and its messenger) runs: ``wrap`` runs a command there
    (``ip netns exec NS``), ``ip`` is the address it serves on."""

    host: str  # the host's name ("h0", "ctl"), or "" on loopback
    wrap: list[str]
    ip: str

    def metrics_host(self, configured: str) -> str:
        """A namespaced host's metrics bind its address (or every address, when asked):
        never loopback only."""
        if not self.host or configured in WILDCARDS:
            return configured
        return self.ip


@dataclass(frozen=True)
class NodeSite(Site):
    node: str = ""  # listen addresses
    messenger: str = ""
    data: str | None = None  # --data-listen (None: the messenger's host, any free port)


class Loopback:
    """Everything on ``host`` (127.0.0.1 by default), ports picked free."""

    fixed = False  # addresses known only once a process serves (port 0)

    def __init__(self, host: str) -> None:
        self.ctl = Site("", [], host)
        self.tls_hosts = [host]

    def conductor_listen(self, index: int) -> str:
        return f"{self.ctl.ip}:0"

    def etcd_urls(self) -> tuple[str, str] | None:
        return None  # free ports: kvcache/etcd_server.py picks them

    def node(self, index: int) -> NodeSite:
        h = self.ctl.ip
        return NodeSite("", [], h, f"{h}:{free_port(h)}", f"{h}:{free_port(h)}", None)

    def state(self) -> dict[str, Any] | None:
        return None

    def teardown(self) -> None:
        pass


class Namespaced:
    """Conductors and etcd in ``<prefix>-ctl``, node ``i`` in host ``h{i % count}``."""

    fixed = True

    def __init__(self, cfg: ClusterConfig) -> None:
        h = cfg.settings["hosts"]
        why = unavailable_reason()
        if why:
            raise NetnsError(f"kvcache up --hosts: {why}")
        self.count, self.ports = h["count"], h
        spec = NetSpec(prefix=h["prefix"], subnet=h["subnet"], rate=h["rate"], mtu=h["mtu"])
        names = ["ctl", *(f"h{i}" for i in range(self.count))]
        self.net = HostNetwork.create(spec, names, network_record(cfg.state_dir))
        ctl = self.net.host("ctl")
        self.ctl = Site("ctl", self.net.exec_prefix("ctl"), ctl.address)
        self.tls_hosts = [x.address for x in self.net.record.hosts]

    def conductor_listen(self, index: int) -> str:
        return f"{self.ctl.ip}:{self.ports['conductor_port'] + index}"

    def etcd_urls(self) -> tuple[str, str] | None:
        ip, p = self.ctl.ip, self.ports
        return f"http://{ip}:{p['etcd_port']}", f"http://{ip}:{p['etcd_peer_port']}"

    def node(self, index: int) -> NodeSite:
        name, slot = f"h{index % self.count}", index // self.count
        ip, p = self.net.host(name).address, self.ports
        return NodeSite(
            name,
            self.net.exec_prefix(name),
            ip,
            f"{ip}:{p['node_port'] + slot}",
            f"{ip}:{p['messenger_port'] + slot}",
            f"{ip}:{p['data_port'] + slot}",
        )

    def state(self) -> dict[str, Any] | None:
        rec = self.net.record
        return {
            "subnet": rec.subnet,
            "gateway": rec.gateway,
            "rate": rec.rate,
            "bridge": rec.bridge,
            "hosts": {h.name: {"netns": h.netns, "address": h.address} for h in rec.hosts},
            "record": self.net.record_path,
        }

    def teardown(self) -> None:
        self.net.teardown()


def network_record(state_dir: str) -> str:
    return os.path.join(state_dir, "network.json")


def placement(cfg: ClusterConfig) -> Loopback | Namespaced:
    """``NetnsError`` when the hosts cannot be made (the message says why)."""
    if cfg.get("hosts", "count"):
        return Namespaced(cfg)
    return Loopback(cfg.host)


def teardown_network(state_dir: str) -> list[str]:
    """Remove the namespaces, links and bridge recorded under ``state_dir`` (also those of a
    cluster whose launcher crashed); [] when there are none."""
    path = network_record(state_dir)
    if not os.path.exists(path):
        return []
    return HostNetwork.load(path).teardown()
