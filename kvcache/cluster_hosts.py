"""Where ``kvcache up`` puts each process and which addresses it serves on.

Two placements: ``Loopback`` (the default: every process on the cluster's host, free ports) and
``Namespaced`` (``[hosts] count = N`` or ``kvcache up --hosts N``): the conductor in a control
namespace (``<prefix>-ctl``), the nodes spread round-robin over N host namespaces
(``<prefix>-h0`` ...), each node beside its messenger, all joined by a bridge whose address the
root namespace holds (``rpc/netns.py``). In that mode every address comes from the ``[hosts]``
table: the subnet gives each namespace its address, the ports are fixed per role (the k-th node of
a host adds k to each), and nothing listens on loopback.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

from rpc.netns import HostNetwork, NetnsError, NetSpec, unavailable_reason

HOSTS_TABLE = """
[hosts]
count = 0                    # N > 0: N hosts in network namespaces (kvcache up --hosts N)
subnet = "10.77.0.0/24"      # the bridge takes the first address, the conductor's host the next
prefix = "kvc"               # names: netns <prefix>-ctl, <prefix>-h0 ..., bridge <prefix>-br
rate = ""                    # tc tbf cap on every link, each way, e.g. "10gbit" ("": none)
mtu = 1500
node_port = 7000             # fixed ports on each host's own address
messenger_port = 7100
data_port = 7200             # the messenger's data port (page bytes)
metrics_port = 9100          # the messenger's Prometheus port
conductor_port = 7300
"""

PORT_KEYS = ("node_port", "messenger_port", "data_port", "metrics_port", "conductor_port")


@dataclass(frozen=True)
class HostsConfig:
    count: int = 0
    net: NetSpec = field(default_factory=NetSpec)
    ports: dict[str, int] = field(default_factory=dict)


def parse_hosts(table: dict[str, Any]) -> HostsConfig:
    """The ``[hosts]`` table; a bad value is a SystemExit naming the key."""
    try:
        count = int(table.get("count", 0))
        ports = {k: int(table[k]) for k in PORT_KEYS}
        net = NetSpec(
            prefix=str(table["prefix"]),
            subnet=str(table["subnet"]),
            rate=str(table.get("rate") or ""),
            mtu=int(table["mtu"]),
        )
    except (TypeError, ValueError, KeyError) as e:
        raise SystemExit(f"[hosts]: {e}: count, mtu and the ports are integers") from None
    if count < 0:
        raise SystemExit(f"[hosts] count = {count}: 0 (loopback) or the number of hosts")
    for key, port in ports.items():
        if not 1 <= port <= 65535:
            raise SystemExit(f"[hosts] {key} = {port}: not a TCP port")
    if len(set(ports.values())) != len(ports):
        raise SystemExit(f"[hosts] ports must differ: {ports}")
    return HostsConfig(count=count, net=net, ports=ports)


@dataclass(frozen=True)
class NodeSite:
    """One node and its messenger: their listen addresses and how to run them there."""

    host: str  # the host's name ("h0"), or "" on loopback
    wrap: list[str]
    node: str
    messenger: str
    data: str | None  # --data-listen (None: the messenger's host, any free port)
    metrics_port: int  # 0: any free one


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Loopback:
    """Everything on ``host`` (127.0.0.1 by default), ports picked free."""

    def __init__(self, host: str) -> None:
        self.ip = host
        self.tls_hosts = [host]
        self.conductor_wrap: list[str] = []
        self.conductor_listen = f"{host}:0"

    def node(self, index: int) -> NodeSite:
        h = self.ip
        return NodeSite("", [], f"{h}:{free_port(h)}", f"{h}:{free_port(h)}", None, 0)

    def state(self) -> dict[str, Any] | None:
        return None

    def teardown(self) -> None:
        pass


class Namespaced:
    """The conductor in ``<prefix>-ctl``, node ``i`` in host ``h{i % count}``."""

    def __init__(self, cfg: HostsConfig, nodes: int, state_dir: str) -> None:
        if nodes < cfg.count:
            raise SystemExit(
                f"{cfg.count} hosts but {nodes} [[node]] tables: every host needs a node"
            )
        why = unavailable_reason()
        if why:
            raise SystemExit(f"kvcache up --hosts: {why}")
        self.cfg = cfg
        names = ["ctl", *(f"h{i}" for i in range(cfg.count))]
        try:
            self.net = HostNetwork.create(cfg.net, names, network_record(state_dir))
        except NetnsError as e:
            raise SystemExit(f"kvcache up --hosts: {e}") from None
        ctl = self.net.host("ctl")
        self.tls_hosts = [h.address for h in self.net.record.hosts]
        self.conductor_wrap = self.net.exec_prefix("ctl")
        self.conductor_listen = f"{ctl.address}:{cfg.ports['conductor_port']}"

    def node(self, index: int) -> NodeSite:
        name, slot = f"h{index % self.cfg.count}", index // self.cfg.count
        ip, p = self.net.host(name).address, self.cfg.ports
        return NodeSite(
            name,
            self.net.exec_prefix(name),
            f"{ip}:{p['node_port'] + slot}",
            f"{ip}:{p['messenger_port'] + slot}",
            f"{ip}:{p['data_port'] + slot}",
            p["metrics_port"] + slot,
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


def placement(hosts: HostsConfig, host: str, nodes: int, state_dir: str) -> Loopback | Namespaced:
    if hosts.count:
        return Namespaced(hosts, nodes, state_dir)
    return Loopback(host)


def teardown_network(state_dir: str) -> list[str]:
    """Remove the namespaces, links and bridge recorded under ``state_dir`` (also those of a
    cluster whose launcher crashed); [] when there are none."""
    path = network_record(state_dir)
    if not os.path.exists(path):
        return []
    return HostNetwork.load(path).teardown()
