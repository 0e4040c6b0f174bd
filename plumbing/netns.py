"""Several hosts on one machine: Linux network namespaces on a bridge (``ip netns``, ``tc``).

Each host is a network namespace with one veth pair: ``eth0`` inside, holding an address from the
subnet, and its peer on a bridge in the root namespace. The bridge holds the subnet's first
address, so a process in the root namespace (``kvcache bench live``, a test) reaches every host,
and the hosts reach each other through the bridge, as machines on one switch do. Nothing else is
routed: a namespace has no default route, so no traffic leaves the machine.

Links can be shaped with a ``tc`` token bucket (``tbf``) on both ends of every veth, so each host
sends and receives at most ``rate``, like a NIC (``netem`` is not available on every kernel).

Every object is recorded in a JSON file the moment it exists (``record_path``), so ``teardown``
removes exactly what was made, also after the process that made it crashed. Processes run in a
host with ``exec_prefix(host) + argv`` (``ip netns exec NS ...``: same process, same PID, same
file system and ``/dev/shm``; only the network differs).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field

PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")  # interface names stay under 16 characters
HOST_RE = re.compile(r"^[a-z0-9]{1,16}$")
RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be made or removed; the message says what to fix."""


def parse_rate(text: str) -> float:
    """'10gbit', '800mbit', '1.5gbit' -> bits per second (tc's units; 'mb' would be bytes in tc,
    so only the unambiguous bit units are taken)."""
    m = RATE_RE.match(text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise NetnsError(f"link rate {text!r} is not like 10gbit, 800mbit or 100kbit")
    return float(m.group(1)) * RATE_UNITS[m.group(2)]


@dataclass(frozen=True, kw_only=True)
class NetSpec:
    """What to build: names start with ``prefix``; addresses come from ``subnet``."""

    prefix: str = "kvc"
    subnet: str = "10.77.0.0/24"
    rate: str = ""  # tc tbf rate each way per link, e.g. "10gbit"; "" leaves links unshaped
    mtu: int = 1500

    def check(self, hosts: int) -> ipaddress.IPv4Network:
        """Validate against ``hosts`` hosts; returns the subnet."""
        check_prefix(self.prefix)
        net = check_subnet(self.subnet, hosts)
        if self.rate:
            parse_rate(self.rate)
        check_mtu(self.mtu)
        return net


# NOTE: one check per setting, so the cluster config names the key that is wrong.


def check_prefix(prefix: str) -> None:
    if not PREFIX_RE.match(prefix):
        raise NetnsError(
            f"network prefix {prefix!r} must be 1-8 lowercase letters or digits, "
            "starting with a letter (interface names are at most 15 characters)"
        )


def check_subnet(subnet: str, hosts: int = 1) -> ipaddress.IPv4Network:
    """The subnet, with room for the bridge and ``hosts`` hosts."""
    try:
        net = ipaddress.ip_network(subnet, strict=True)
    except ValueError as e:
        raise NetnsError(f"subnet {subnet!r} is not a network like 10.77.0.0/24: {e}") from None
    if not isinstance(net, ipaddress.IPv4Network):
        raise NetnsError(f"subnet {subnet!r}: only IPv4 subnets are supported")
    if net.num_addresses - 2 < hosts + 1:
        raise NetnsError(
            f"subnet {subnet} has room for {max(net.num_addresses - 3, 0)} hosts "
            f"beside the bridge, not {hosts}: pick a larger one"
        )
    return net


def check_mtu(mtu: int) -> None:
    if not 576 <= mtu <= 65535:
        raise NetnsError(f"mtu {mtu} is outside 576..65535")


@dataclass
class Host:
    name: str
    netns: str
    address: str  # the host's IPv4 address on the bridge
    veth: str  # the root-namespace end of its link


@dataclass
class Record:
    """What exists, as saved in the record file."""

    prefix: str
    subnet: str
    gateway: str
    rate: str = ""
    bridge: str | None = None
    hosts: list[Host] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)  # made, in order
    links: list[str] = field(default_factory=list)  # root-namespace links made (veths)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise NetnsError("the 'ip' command (iproute2) is not installed") from None
    if check and proc.returncode:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _tc(netns: str | None, *args: str) -> None:
    argv = ["tc", *args] if netns is None else ["ip", "netns", "exec", netns, "tc", *args]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise NetnsError("the 'tc' command (iproute2) is not installed") from None
    if proc.returncode:
        raise NetnsError(f"{' '.join(argv)}: {proc.stderr.strip()}")


def unavailable_reason() -> str | None:
    """None when this process may make network namespaces, else why not (for skips and errors)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    probe = f"kvcprobe{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except NetnsError as e:
        return str(e)
    if made.returncode:
        return f"'ip netns add' is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _overlaps(net: ipaddress.IPv4Network) -> str | None:
    """The device whose address already lies in ``net`` (a clash with a real network)."""
    out = _ip("-j", "-4", "addr", "show").stdout
    for dev in json.loads(out or "[]"):
        for a in dev.get("addr_info", []):
            other = ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False)
            if other.overlaps(net):
                return f"{dev['ifname']} ({a['local']}/{a['prefixlen']})"
    return None


class HostNetwork:
    """Hosts in network namespaces on one bridge. ``create`` builds, ``teardown`` removes."""

    def __init__(self, record: Record, record_path: str) -> None:
        self.record = record
        self.record_path = record_path

    @property
    def gateway(self) -> str:
        """The bridge's address: how the root namespace is reached from every host."""
        return self.record.gateway

    def host(self, name: str) -> Host:
        for h in self.record.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def exec_prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.host(name).netns]

    @classmethod
    def create(cls, spec: NetSpec, names: list[str], record_path: str) -> HostNetwork:
        """Make the bridge and one namespace per name (addresses in order after the bridge's).
        On any failure what was made is removed again and ``NetnsError`` says why."""
        net = spec.check(len(names))
        for name in names:
            if not HOST_RE.match(name):
                raise NetnsError(f"host name {name!r} must be 1-16 lowercase letters or digits")
        if len(set(names)) != len(names):
            raise NetnsError(f"host names must be unique: {names}")
        addrs = list(net.hosts())
        bridge = f"{spec.prefix}-br"
        existing = set(_ip("netns", "list").stdout.split())
        taken = [f"{spec.prefix}-{n}" for n in names if f"{spec.prefix}-{n}" in existing]
        if taken or _ip("link", "show", bridge, check=False).returncode == 0:
            raise NetnsError(
                f"network '{spec.prefix}' already exists ({', '.join(taken) or bridge}): "
                "another cluster uses it, or an earlier one was not taken down "
                "('kvcache down --state-dir ...'); or pick another prefix"
            )
        clash = _overlaps(net)
        if clash:
            raise NetnsError(
                f"subnet {net} overlaps {clash}, a network this machine is on: pick another"
            )
        self = cls(
            Record(prefix=spec.prefix, subnet=str(net), gateway=str(addrs[0]), rate=spec.rate),
            record_path,
        )
        try:
            self._build(spec, net, names, addrs, bridge)
        except BaseException:
            self.teardown()
            raise
        return self

    def _build(
        self,
        spec: NetSpec,
        net: ipaddress.IPv4Network,
        names: list[str],
        addrs: list[ipaddress.IPv4Address],
        bridge: str,
    ) -> None:
        rec = self.record
        _ip("link", "add", bridge, "type", "bridge")
        rec.bridge = bridge
        self.save()
        _ip("link", "set", bridge, "mtu", str(spec.mtu))
        _ip("addr", "add", f"{addrs[0]}/{net.prefixlen}", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, name in enumerate(names):
            ns, veth, address = f"{spec.prefix}-{name}", f"{spec.prefix}-v{i}", str(addrs[i + 1])
            _ip("netns", "add", ns)
            rec.netns.append(ns)
            self.save()
            _ip("link", "add", veth, "mtu", str(spec.mtu), "type", "veth", "peer", "name",
                "eth0", "mtu", str(spec.mtu), "netns", ns)  # fmt: skip
            rec.links.append(veth)
            rec.hosts.append(Host(name=name, netns=ns, address=address, veth=veth))
            self.save()
            _ip("link", "set", veth, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{address}/{net.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        if spec.rate:
            self.shape(spec.rate)

    def shape(self, rate: str | None) -> None:
        """Cap every link at ``rate`` each way (a tbf qdisc on both veth ends); None or ""
        removes the caps."""
        bps = parse_rate(rate) if rate else 0.0
        # NOTE: the bucket holds ~4 ms of traffic (at least 256 KiB): enough for the 64 KiB
        # segments veth passes (GSO) at any rate, small enough that the rate holds within ms.
        burst = str(max(int(bps / 8 / 250), 256 << 10))
        for h in self.record.hosts:
            for netns, dev in ((None, h.veth), (h.netns, "eth0")):
                if rate:
                    _tc(netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                        "burst", burst, "latency", "20ms")  # fmt: skip
                else:
                    _tc(netns, "qdisc", "replace", "dev", dev, "root", "pfifo_fast")
        self.record.rate = rate or ""
        self.save()

    def save(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.record_path)), exist_ok=True)
        tmp = f"{self.record_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(self.record), f, indent=2)
        os.replace(tmp, self.record_path)

    @classmethod
    def load(cls, record_path: str) -> HostNetwork:
        with open(record_path) as f:
            data = json.load(f)
        hosts = [Host(**h) for h in data.pop("hosts", [])]
        return cls(Record(**data, hosts=hosts), record_path)

    def teardown(self, timeout_s: float = 10.0) -> list[str]:
        """Stop what still runs in the namespaces (SIGTERM, then SIGKILL after ``timeout_s``),
        remove the links, namespaces and bridge that were made, then the record file. Objects
        already gone are skipped. Returns what was removed."""
        rec = self.record
        kill_in_namespaces(rec.netns, timeout_s)
        removed = []
        # NOTE: veths first: a namespace's own end goes with it only later, in a kernel worker.
        for link in rec.links:
            if _ip("link", "del", link, check=False).returncode == 0:
                removed.append(link)
        for ns in rec.netns:
            if _ip("netns", "del", ns, check=False).returncode == 0:
                removed.append(ns)
        if rec.bridge and _ip("link", "del", rec.bridge, check=False).returncode == 0:
            removed.append(rec.bridge)
        left = [ns for ns in rec.netns if ns in _ip("netns", "list").stdout.split()]
        if left:
            raise NetnsError(f"network namespaces {left} could not be removed")
        try:
            os.remove(self.record_path)
        except FileNotFoundError:
            pass
        return removed


def namespace_pids(netns: str) -> list[int]:
    """The processes whose network namespace is ``netns`` (found through /proc: this
    iproute2's ``ip netns pids`` lists none for a namespace entered with ``ip netns exec``)."""
    try:
        st = os.stat(f"/run/netns/{netns}")
    except FileNotFoundError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ns = os.stat(f"/proc/{entry}/ns/net")
        except OSError:  # gone, or a kernel thread
            continue
        if (ns.st_dev, ns.st_ino) == (st.st_dev, st.st_ino):
            pids.append(int(entry))
    return pids


def kill_in_namespaces(names: list[str], timeout_s: float) -> list[int]:
    """SIGTERM every process in the namespaces, SIGKILL those left after ``timeout_s``."""
    pids = [p for ns in names for p in namespace_pids(ns)]
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    left = pids
    while left and time.monotonic() < deadline:
        time.sleep(0.05)  # not necessarily our children: nothing to wait() on
        left = [p for ns in names for p in namespace_pids(ns)]
    for pid in left:
        _signal(pid, signal.SIGKILL)
    return pids


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
