"""Several hosts on one machine, for real: network namespaces on a bridge (``plumbing/netns.py``),
``kvcache up --hosts N`` / ``kvcache down``, and pages moved between hosts by real messengers,
verified byte for byte. Needs root (``ip netns add``); skipped with the reason otherwise."""

from __future__ import annotations

import ipaddress
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
import tomllib

import grpc
import pytest
from test_cluster_e2e import (
    BLOCK,
    PAGE_BYTES,
    SESSIONS,
    ctrl_c,
    expected_hits,
    kvcache,
    run_live,
    up_in_the_foreground,
    write_trace,
)

from plumbing.netns import HostNetwork, NetnsError, NetSpec, namespace_pids, unavailable_reason

import leftovers
from helpers import wait_until

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")


def ip_json(*args: str) -> list[dict]:
    out = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out or "[]")


def free_subnet() -> str:
    """A /24 in 10.77.100-250 that no interface of this machine is on; each pytest-xdist
    worker picks from its own share of them (two workers never race for one)."""
    taken = [
        ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False)
        for dev in ip_json("-4", "addr", "show")
        for a in dev.get("addr_info", [])
    ]
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    mine = [t for t in range(100, 251) if t % workers == worker % workers]
    for third in random.sample(mine, len(mine)):
        net = ipaddress.ip_network(f"10.77.{third}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return str(net)
    raise AssertionError("no free 10.77.x.0/24 subnet")


def unique_prefix() -> str:
    # This run's prefix (the leftover check looks for it) and 3 hex digits of this test's.
    return leftovers.net_prefix() + secrets.token_hex(2)[:3]


def namespaces(prefix: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return sorted(n for n in names if n.startswith(f"{prefix}-"))


def links(prefix: str) -> list[str]:
    return sorted(d["ifname"] for d in ip_json("link", "show") if d["ifname"].startswith(prefix))


def assert_network_gone(prefix: str) -> None:
    assert namespaces(prefix) == [] and links(prefix) == []


def hosts_config(
    tmp_path, prefix: str, subnet: str, extra: str = "", nodes: str = "", dram: str = "64MiB"
) -> tuple:
    state = tmp_path / "state"
    config = tmp_path / "cluster.toml"
    config.write_text(
        f'[cluster]\nstate_dir = "{state}"\n\n[defaults]\ndram = "{dram}"\n\n'
        f'[hosts]\nprefix = "{prefix}"\nsubnet = "{subnet}"\n{extra}\n{nodes}'
    )
    return str(config), str(state)


@pytest.fixture
def net_prefix():
    """A fresh name prefix; whatever a test leaves under it is removed afterwards."""
    prefix = unique_prefix()
    yield prefix
    for link in links(prefix):
        subprocess.run(["ip", "link", "del", link], capture_output=True)
    for ns in namespaces(prefix):
        for pid in namespace_pids(ns):
            os.kill(pid, signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def running(pid: int) -> bool:
    """Alive and not a zombie (a stopped detached process waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def listening(netns: str) -> list[str]:
    """Local addresses of the TCP listeners in ``netns``."""
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "ss", "-Hltn"], capture_output=True, text=True, check=True
    ).stdout
    return [line.split()[3] for line in out.splitlines() if line.strip()]


def up_detached(config: str, *args: str) -> tuple[str, dict]:
    """``kvcache up --config CONFIG --detach ARGS``: (its cluster.json, what it holds)."""
    up = kvcache("up", "--config", config, "--detach", *args)
    assert up.returncode == 0, up.stdout + up.stderr
    state_dir = tomllib.loads(open(config).read())["cluster"]["state_dir"]
    cluster_json = os.path.join(state_dir, "cluster.json")
    with open(cluster_json) as f:
        return cluster_json, json.load(f)


def assert_nothing_on_loopback(network: dict) -> None:
    """Each namespace's TCP listeners bind its own address only (not loopback, not any)."""
    for host, info in network["hosts"].items():
        bound = {a.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")
                 for a in listening(info["netns"])}  # fmt: skip
        assert bound == {info["address"]}, (host, bound)


def test_network_is_made_shaped_recorded_and_removed(tmp_path, net_prefix):
    subnet = free_subnet()
    record = str(tmp_path / "network.json")
    net = HostNetwork.create(
        NetSpec(prefix=net_prefix, subnet=subnet, rate="10gbit"), ["a", "b"], record
    )
    try:
        hosts = list(ipaddress.ip_network(subnet).hosts())
        assert net.gateway == str(hosts[0])
        assert [net.host(n).address for n in ("a", "b")] == [str(hosts[1]), str(hosts[2])]
        assert namespaces(net_prefix) == [f"{net_prefix}-a", f"{net_prefix}-b"]
        with open(record) as f:  # on disk before anything runs in the hosts
            saved = json.load(f)
        assert saved["netns"] == [f"{net_prefix}-a", f"{net_prefix}-b"]
        assert saved["bridge"] == f"{net_prefix}-br" and len(saved["links"]) == 2
        # Both ends of every link carry a 10 Gbit/s token bucket.
        for h in ("a", "b"):
            host = net.host(h)
            outer = ip_json_tc(None, host.veth)
            inner = ip_json_tc(host.netns, "eth0")
            for q in (outer, inner):
                assert q["kind"] == "tbf" and q["options"]["rate"] == 10_000_000_000 // 8
        # The hosts reach each other, and the root namespace reaches them, through the bridge.
        probe = [*net.exec_prefix("a"), "python3", "-c",
                 "import socket,sys; socket.create_connection((sys.argv[1], 9), 5)",
                 net.host("b").address]  # fmt: skip
        r = subprocess.run(probe, capture_output=True, text=True)
        assert "ConnectionRefused" in r.stderr  # b answered: nothing listens on port 9
        net.shape(None)
        assert ip_json_tc(None, net.host("a").veth)["kind"] != "tbf"
    finally:
        removed = net.teardown()
    assert f"{net_prefix}-br" in removed and f"{net_prefix}-a" in removed
    assert not os.path.exists(record)
    assert_network_gone(net_prefix)


def ip_json_tc(netns: str | None, dev: str) -> dict:
    argv = ["tc", "-j", "qdisc", "show", "dev", dev, "root"]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]


def test_bad_network_specs_are_refused_and_leave_nothing(tmp_path, net_prefix):
    record = str(tmp_path / "network.json")
    cases = [
        (NetSpec(prefix="Bad-Prefix"), "lowercase letters or digits"),
        (NetSpec(prefix=net_prefix, subnet="10.77.0.0/30"), "room for 1 hosts"),
        (NetSpec(prefix=net_prefix, subnet="not-a-net"), "not a network like"),
        (NetSpec(prefix=net_prefix, subnet="10.77.0.1/24"), "host bits set"),
        (NetSpec(prefix=net_prefix, subnet="fd00::/64"), "only IPv4"),
        (NetSpec(prefix=net_prefix, subnet=free_subnet(), rate="10gb"), "not like 10gbit"),
        (NetSpec(prefix=net_prefix, subnet="127.1.0.0/24"), "overlaps lo"),
    ]
    for spec, message in cases:
        with pytest.raises(NetnsError, match=message):
            HostNetwork.create(spec, ["a", "b", "c"], record)
        assert_network_gone(net_prefix)
        assert not os.path.exists(record)
    # A name already taken is not touched.
    subprocess.run(["ip", "netns", "add", f"{net_prefix}-a"], check=True)
    with pytest.raises(NetnsError, match="already exists"):
        HostNetwork.create(NetSpec(prefix=net_prefix, subnet=free_subnet()), ["a"], record)
    assert namespaces(net_prefix) == [f"{net_prefix}-a"]


def test_pages_move_between_hosts_through_the_messengers(tmp_path, net_prefix):
    from bench.micro.transfer_rig import NodePair

    net = HostNetwork.create(
        NetSpec(prefix=net_prefix, subnet=free_subnet(), rate="1gbit"),
        ["src", "dst"],
        str(tmp_path / "network.json"),
    )
    try:
        sites = [(net.exec_prefix(h), net.host(h).address) for h in ("src", "dst")]
        pair = NodePair(4 << 20, 128 << 10, 2, sites)  # 32 pages of 128 KiB
        try:
            # Node and messenger of each host run in its namespace, serving on its address only.
            for sp, host in zip(pair.procs, ("src", "src", "dst", "dst")):
                assert sp.pid in namespace_pids(net.host(host).netns)
                assert sp.address.startswith(net.host(host).address + ":")
            for h in ("src", "dst"):
                ip = net.host(h).address
                assert {a.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:") for a in
                        listening(net.host(h).netns)} == {ip}  # fmt: skip
            pair.round()
            pair.verify()  # all 32 pages, byte for byte, on the destination host
        finally:
            pair.close()
    finally:
        net.teardown()
    assert_network_gone(net_prefix)


def test_up_refuses_bad_host_options(tmp_path, net_prefix):
    """Each mistake is a message naming the [hosts] key (exit 2) before anything is made."""
    config, state = hosts_config(tmp_path, net_prefix, free_subnet())
    for args, message in [
        (["--hosts", "-1"], "--hosts: the number of hosts (0: every process on loopback)"),
        (["--hosts", "4"], "[hosts] count = 4 but 3 [[node]] tables"),
        (["--hosts", "3", "--set", "hosts.prefix=Kv"], "--set hosts.prefix: network prefix 'Kv'"),
        (["--hosts", "1", "--set", "hosts.messenger_port=7001"], "messenger_port and node_port"),
        (["--hosts", "1", "--set", "hosts.data_port=7102"], "data_port and messenger_port + 2"),
        (
            [*"--hosts 3 --etcd --set conductor.replicas=3 --set hosts.etcd_port=7302".split()],
            "etcd_port and conductor_port + 2",
        ),
    ]:
        r = kvcache("up", "--config", config, "--detach", *args)
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    for extra, args, message in [
        ("count = 3", [], "[hosts] subnet: subnet 10.77.0.0/30 has room for 1 hosts"),
        ('rate = "fast"', ["--hosts", "3"], "[hosts] rate: link rate 'fast' is not like 10gbit"),
        ("node_port = 99999", ["--hosts", "3"], "[hosts] node_port: a port is 1..65535"),
        (
            "engine_port = 7000",
            ["--hosts", "3"],
            "[hosts] engine_port and node_port are both port 7000",
        ),
    ]:
        subnet = "10.77.0.0/30" if "count" in extra else free_subnet()
        bad, state = hosts_config(tmp_path, net_prefix, subnet, extra=extra)
        r = kvcache("up", "--config", bad, "--detach", *args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert_network_gone(net_prefix)
    assert not os.path.exists(os.path.join(state, "network.json"))


@pytest.mark.slow
def test_up_hosts_replays_the_trace_across_namespaced_hosts(tmp_path, net_prefix):
    subnet = free_subnet()
    config, state_dir = hosts_config(tmp_path, net_prefix, subnet)
    cluster_json, state = up_detached(config, "--hosts", "3")
    try:
        network = state["network"]
        assert sorted(network["hosts"]) == ["ctl", "h0", "h1", "h2"]
        addr = {h: v["address"] for h, v in network["hosts"].items()}
        assert all(ipaddress.ip_address(a) in ipaddress.ip_network(subnet) for a in addr.values())
        assert state["conductor"]["address"] == f"{addr['ctl']}:7300"
        assert [n["host"] for n in state["nodes"]] == ["h0", "h1", "h2"]
        for n in state["nodes"]:
            ip, ns = addr[n["host"]], network["hosts"][n["host"]]["netns"]
            assert n["address"] == f"{ip}:7000" and n["messenger"] == f"{ip}:7100"
            assert n["data_address"] == f"{ip}:7200"
            assert set(n["pids"]) <= set(namespace_pids(ns))
        assert_nothing_on_loopback(network)

        trace = tmp_path / "sessions.jsonl"
        write_trace(trace)
        result = run_live(
            cluster_json, tmp_path / "live", "--trace", str(trace), "--speedup", "10",
            "--concurrency", "1",
        )  # fmt: skip
        summary, requests = result["summary"], result["requests"]
        assert summary["scheduled"] == summary["ok"] == len(SESSIONS) and summary["failed"] == 0
        assert [r["reused_blocks"] for r in requests] == expected_hits()
        assert summary["verify_failures"] == 0 and summary["verified_pages"] > 0
        # The decode host pulled every distinct block from the prefill hosts over the bridge.
        distinct = len({tuple(ids[: i + 1]) for ids, n in SESSIONS for i in range(n // BLOCK)})
        assert summary["bytes_source"] == "messenger counters"
        assert summary["decode_bytes"] == distinct * PAGE_BYTES
    finally:
        down = kvcache("down", "--state-dir", state_dir)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "removed host network" in down.stdout
    assert_network_gone(net_prefix)
    assert not os.path.exists(os.path.join(state_dir, "network.json"))
    assert [p for p in state["pids"] if running(p)] == []


def conductor_serving(address: str) -> bool:
    """The ConductorService's health: SERVING only on the elected leader."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from conductor.service import SERVICE_NAME
    from rpc.channel import make_channel

    try:
        with make_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5
            )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


KILL_AT_S = 5.0  # into bench live's replay of 40 trace requests at speedup 1 (~14 s of arrivals)


@pytest.mark.slow
def test_up_hosts_with_etcd_replays_the_trace_through_a_leader_sigkill(tmp_path, net_prefix):
    """``kvcache up --hosts 3 --etcd`` with 2 conductors: etcd and the conductors in the control
    namespace on its address, every node and messenger registered in etcd by its host's address,
    nothing on loopback. ``bench live`` (in the root namespace, through the bridge) replays trace
    requests while the leading conductor is SIGKILLed: none fails, pages verified; ``kvcache
    down`` stops everything and removes the network."""
    # 1024 pages per node, as part A's loopback test: with 256 the decode node once ran out
    # (RESOURCE_EXHAUSTED: its pages pinned or leased) when the requests that queued during the
    # takeover pulled at once.
    config, state_dir = hosts_config(
        tmp_path,
        net_prefix,
        free_subnet(),
        nodes="[conductor]\nreplicas = 2\n[etcd]\nttl = 2\n",
        dram="256MiB",
    )
    cluster_json, state = up_detached(config, "--hosts", "3", "--etcd")
    try:
        network = state["network"]
        addr = {h: v["address"] for h, v in network["hosts"].items()}
        ctl_ns = network["hosts"]["ctl"]["netns"]
        # etcd: kvcache up's own, in the control namespace on its address, on [hosts] etcd_port.
        assert state["etcd"]["endpoints"] == [f"http://{addr['ctl']}:2379"]
        assert state["etcd"]["pid"] in namespace_pids(ctl_ns)
        conductors = state["conductors"]
        assert [c["address"] for c in conductors] == [f"{addr['ctl']}:7300", f"{addr['ctl']}:7301"]
        assert {c["pid"] for c in conductors} <= set(namespace_pids(ctl_ns))
        assert_nothing_on_loopback(network)
        # Membership from etcd: each node and messenger by its host's address (--advertise).
        from plumbing.etcd import EtcdClient
        from plumbing.registration import (
            MessengerRecord,
            NodeRecord,
            messengers_prefix,
            nodes_prefix,
        )

        with EtcdClient(state["etcd"]["endpoints"][0]) as etcd:
            _, node_kvs = etcd.get_prefix(nodes_prefix("/kvcache"))
            _, messenger_kvs = etcd.get_prefix(messengers_prefix("/kvcache"))
        nodes = [NodeRecord.decode(kv.value) for kv in node_kvs]
        messengers = [MessengerRecord.decode(kv.value) for kv in messenger_kvs]
        want = {n["id"]: (n["address"], n["messenger"]) for n in state["nodes"]}
        assert {n.descriptor.node_id: n.descriptor.address for n in nodes} == {
            k: v[0] for k, v in want.items()
        }
        assert {m.node_id: m.address for m in messengers} == {k: v[1] for k, v in want.items()}

        leader = wait_until(
            lambda: [c for c in conductors if conductor_serving(c["address"])], 30, "a leader"
        )[0]
        live = subprocess.Popen(
            [sys.executable, "-m", "kvcache.cli", "bench", "live", "--cluster", cluster_json,
             "--requests", "40", "--speedup", "1", "--out", str(tmp_path / "live"),
             "--no-progress"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        time.sleep(KILL_AT_S)
        os.kill(leader["pid"], signal.SIGKILL)
        out, _ = live.communicate(timeout=300)
        assert live.returncode == 0, out
        with open(tmp_path / "live" / "live.json") as f:
            report = json.load(f)
        summary = report["summary"]
        assert summary["failed"] == 0 and summary["scheduled"] > 0, out
        assert summary["verify_failures"] == 0 and summary["verified_pages"] > 0, out
        # Arrivals after the kill were placed by the standby, now the leader.
        late = [r for r in report["requests"] if r["arrival_s"] > KILL_AT_S + 1]
        assert late and all(r["status"] in ("ok", "rejected") for r in late)
        other = next(c for c in conductors if c is not leader)
        assert conductor_serving(other["address"])
    finally:
        down = kvcache("down", "--state-dir", state_dir)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "removed host network" in down.stdout
    assert_network_gone(net_prefix)
    assert [p for p in state["pids"] if running(p)] == []


@pytest.mark.slow
def test_down_cleans_up_after_a_crashed_launcher(tmp_path, net_prefix):
    """The launcher died before it wrote cluster.json: ``kvcache down`` still finds the
    namespaces (network.json), stops what runs in them and removes them. Two hosts for three
    nodes: the first host runs two nodes on its next ports."""
    config, state_dir = hosts_config(tmp_path, net_prefix, free_subnet())
    _, state = up_detached(config, "--hosts", "2")
    h0 = state["network"]["hosts"]["h0"]["address"]
    assert [n["host"] for n in state["nodes"]] == ["h0", "h1", "h0"]
    assert state["nodes"][2]["address"] == f"{h0}:7001"
    os.remove(os.path.join(state_dir, "cluster.json"))  # as if it never got that far
    again = kvcache("up", "--config", config, "--detach", "--hosts", "2")
    assert again.returncode != 0 and "kvcache down --state-dir" in again.stderr
    down = kvcache("down", "--state-dir", state_dir)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "removed host network" in down.stdout
    assert [p for p in state["pids"] if running(p)] == []
    assert_network_gone(net_prefix)
    shm = [name for n in state["nodes"] for name in n["shm"].values()]
    assert [name for name in shm if os.path.exists(f"/dev/shm/{name}")] == []


def test_transfer_bench_across_hosts_reports_ratios_per_link(tmp_path, net_prefix, capsys):
    from bench.micro.transfer import main

    out = tmp_path / "hosts.json"
    args = ["--hosts", "--total", "8M", "--sizes", "1M", "--runs", "1", "--rates", "none,1gbit",
            "--net-prefix", net_prefix, "--subnet", free_subnet(), "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["link"], r["method"]) for r in rows] == [
        ("unshaped", "raw socket"),
        ("unshaped", "messenger x2"),
        ("tbf 1gbit", "raw socket"),
        ("tbf 1gbit", "messenger x2"),
    ]
    assert all(r["gbps"] > 0 and r["vs_raw"] > 0 for r in rows)
    assert [r["note"] for r in rows if r["method"] != "raw socket"] == ["verified"] * 2
    assert rows[3]["vs_link"] is not None and rows[1]["vs_link"] is None
    assert "x raw socket" in capsys.readouterr().out
    assert_network_gone(net_prefix)
    with pytest.raises(SystemExit, match="--rates"):
        main(["--hosts", "--rates", "none,fast", "--net-prefix", net_prefix])


@pytest.mark.slow
def test_up_hosts_in_the_foreground_removes_its_network_on_ctrl_c(tmp_path, net_prefix):
    config, state_dir = hosts_config(tmp_path, net_prefix, free_subnet())
    proc = up_in_the_foreground("--config", config, "--hosts", "1")
    try:
        with open(os.path.join(state_dir, "cluster.json")) as f:
            state = json.load(f)
        assert namespaces(net_prefix) == [f"{net_prefix}-ctl", f"{net_prefix}-h0"]
        assert [n["host"] for n in state["nodes"]] == ["h0"] * 3  # 3 nodes on one host
    finally:
        code = ctrl_c(proc)
    assert code == 0, proc.stderr.read().decode()
    assert_network_gone(net_prefix)
    assert not os.path.exists(os.path.join(state_dir, "network.json"))
    assert [p for p in state["pids"] if running(p)] == []
