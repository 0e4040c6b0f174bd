"""An operator's day on a real ``kvcache up --detach`` cluster (conductor, two nodes, their
messengers: separate processes): ``kvcache status`` as tables and JSON after real traffic, the
metrics every process exports (and the Grafana dashboard built on them), ``Stats.bytes_written``
on client paths, and ``kvcache down --config`` from another directory."""

from __future__ import annotations

import json
import os
import re
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients import ConductorClient, KVStoreClient, MessengerClient
from kvstore.keys import block_keys, root_key

from helpers import kvcache_cli, wait_until

DASHBOARD = os.path.join(os.path.dirname(__file__), "..", "docs", "grafana-dashboard.json")
LAYOUT = "model=ops,num_layers=2,kv_heads=1,head_dim=16,dtype=float16,block_tokens=16"
PAGE = 2 * 2 * 16 * 1 * 16 * 2  # layers x K|V x tokens x heads x dims x fp16 = 2 KiB
BT = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A detached cluster whose config names a relative state_dir (relative to the file)."""
    home = tmp_path_factory.mktemp("ops")
    config = home / "cluster.toml"
    config.write_text(
        '[cluster]\nstate_dir = "state"\n\n[defaults]\n'
        f'layout = "{LAYOUT}"\ndram = "1MiB"\n\n'
        '[[node]]\nid = "p0"\nrole = "prefill"\n\n[[node]]\nid = "d0"\nrole = "decode"\n'
    )
    up = kvcache_cli("up", "--config", str(config), "--detach", cwd=str(home))
    assert up.returncode == 0, up.stderr
    with open(home / "state" / "cluster.json") as f:
        state = json.load(f)
    yield str(config), state
    kvcache_cli("down", "--config", str(config))  # a no-op when the last test stopped it


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read().decode()


def exported_names(text: str) -> set[str]:
    """Every series name a /metrics page declares (a labelled counter with no sample yet
    included: it is declared with HELP and TYPE)."""
    names = set()
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "info": ("_info",),
        "summary": ("_sum", "_count", "_created"),
    }
    for fam in text_string_to_metric_families(text):
        names.update(fam.name + s for s in suffixes.get(fam.type, ("",)))
        names.update(s.name for s in fam.samples)
    return names


def tokens(n_blocks: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n_blocks * BT, dtype=np.uint32)


def status_json(config: str, *extra: str, cwd: str = "/") -> dict:
    r = kvcache_cli("status", "--config", config, "--json", "--interval", "0.5", *extra, cwd=cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_status_shows_what_the_traffic_did(cluster):
    config, state = cluster
    nodes = {n["id"]: n for n in state["nodes"]}
    conductor = state["conductor"]["address"]
    with (
        KVStoreClient(nodes["p0"]["address"]) as shm,
        KVStoreClient(nodes["p0"]["address"], use_shm=False) as streamed,
        ConductorClient(conductor) as cc,
    ):
        ns = shm.namespaces()[0]
        assert shm.shm_available(ns)
        wait_until(lambda: len(cc.list_nodes().nodes) == 2, what="both nodes registered")
        pages = [np.full(PAGE, i, dtype=np.uint8) for i in range(4)]
        shm.put(ns, pages, tokens=tokens(4))  # allocate + commit through shared memory
        streamed.put(ns, pages[:2], tokens=tokens(2, start=10_000))  # a streamed Put
        assert shm.lookup(ns, tokens=tokens(4)).hit_blocks == 4
        assert shm.lookup(ns, tokens=tokens(2, start=50_000)).hit_blocks == 0
        lease = shm.acquire(ns, tokens=tokens(3))  # 3 pages pinned while status looks
        wait_until(lambda: cc.locate(ns, tokens=tokens(4)).get("p0") == 4, what="indexed")
        for i in range(3):
            cc.schedule(ns, tokens=tokens(4), request_id=f"r{i}")
        # d0's messenger pulls two of p0's blocks: bytes received on d0, sent by p0.
        keys = block_keys(tokens(2), BT, root_key(ns))
        with MessengerClient(nodes["d0"]["messenger"]) as mc:
            batch = mc.submit(ns, [(k, nodes["p0"]["messenger"]) for k in keys]).batch_id
            assert mc.status(batch, wait=True).done == 2
        try:
            doc = status_json(config)  # from another directory: the config names the cluster
        finally:
            lease.release()
    c = doc["conductor"]
    assert c["health"] == "SERVING" and c["leader"] == conductor
    assert c["decisions"] == 3 and c["rejections"] == 0 and c["decisions_per_s"] is not None
    assert c["registered_nodes"] == 2 and doc["problems"] == []
    by_id = {n["id"]: n for n in doc["nodes"]}
    p0, d0 = by_id["p0"], by_id["d0"]
    assert (p0["role"], p0["health"], p0["registered"]) == ("prefill", "SERVING", True)
    layout = p0["layouts"][0]
    assert layout["namespace"] == ns
    assert (layout["hits"], layout["misses"]) == (4, 2) and p0["hit_rate"] == pytest.approx(4 / 6)
    assert p0["pinned_pages"] == 3
    dram = layout["tiers"][0]
    assert dram["tier"] == "dram" and dram["used_pages"] == 6
    assert dram["fill"] == pytest.approx(6 / dram["capacity_pages"])
    # Stats.bytes_written counts pages clients wrote in place: shared memory and the stream.
    assert layout["bytes_written"] == 6 * PAGE
    assert d0["layouts"][0]["bytes_written"] == 2 * PAGE  # the messenger's commit
    assert d0["messenger"]["bytes_received"] == 2 * PAGE
    assert p0["messenger"]["bytes_sent"] >= 2 * PAGE
    assert p0["messenger"]["transport"] == "tcp"
    assert d0["messenger"]["entries_done"] == 2 and d0["messenger"]["entries_in_flight"] == 0
    assert d0["messenger"]["recv_gbps"] is not None


def test_status_table_for_people(cluster):
    config, state = cluster
    r = kvcache_cli("status", "--config", config, "--interval", "0.2", env={"COLUMNS": "120"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"conductor {state['conductor']['address']} SERVING" in out
    assert "decisions/s" in out and "policy global-cache" in out
    for n in state["nodes"]:
        assert n["id"] in out and n["address"] in out and n["messenger"] in out
    assert "DRAM fill" in out and "hit rate" in out and "GB/s" in out


def test_status_by_conductor_address_and_watch_as_json_lines(cluster):
    config, state = cluster
    r = kvcache_cli(
        "status", "--conductor", state["conductor"]["address"], "--json", "--interval", "0.2"
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {n["id"] for n in doc["nodes"]} == {"p0", "d0"}  # the nodes the conductor lists
    assert all(n["messenger"]["health"] == "SERVING" for n in doc["nodes"])


def test_every_process_exports_process_and_build_metrics(cluster):
    _, state = cluster
    addresses = [state["conductor"]["metrics"]] + [
        a for n in state["nodes"] for a in (n["metrics"], n["messenger_metrics"])
    ]
    assert len(addresses) == 5 and all(addresses)
    for address in addresses:
        text = scrape(address)
        names = exported_names(text)
        assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= names
        assert re.search(r'kvcache_build_info\{.*version="[^"]+".*\} 1\.0', text), address
    messenger = scrape(state["nodes"][0]["messenger_metrics"])
    assert "kvcache_messenger_sent_bytes_total" in messenger
    assert "kvcache_messenger_sent_pages_total" in messenger
    assert 'unit="' not in messenger  # bytes and pages are separate metrics now
    with open(os.path.join(state["state_dir"], "prometheus-targets.json")) as f:
        targets = json.load(f)
    assert sorted(t["targets"][0] for t in targets) == sorted(addresses)


def promql_metrics(expr: str) -> set[str]:
    """Metric names a PromQL expression reads: identifiers that are not functions, keywords,
    label names (inside {} or by/without (...)), ranges or template variables."""
    expr = re.sub(r"\$\w+", "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r'"[^"]*"', "", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[m.end() :].lstrip()
        if rest.startswith("("):
            continue  # a function or an aggregation
        if m.group() in ("and", "or", "unless", "bool", "offset"):
            continue
        names.add(m.group())
    return names


def test_dashboard_queries_name_metrics_the_processes_export(cluster):
    _, state = cluster
    exported = set()
    for address in [state["conductor"]["metrics"]] + [
        a for n in state["nodes"] for a in (n["metrics"], n["messenger_metrics"])
    ]:
        exported |= exported_names(scrape(address))
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    queries = [
        (p["title"], t["expr"])
        for p in dashboard["panels"]
        if p["type"] != "row"
        for t in p["targets"]
    ]
    assert len(queries) >= 20
    missing = []
    for title, expr in queries:
        names = promql_metrics(expr)
        assert names, f"{title}: no metric in {expr}"
        missing += [f"{title}: {n}" for n in sorted(names - exported)]
    assert missing == []


def test_promql_metric_extraction():
    expr = (
        'histogram_quantile(0.99, sum by (le, method) (rate(kvcache_node_rpc_seconds_bucket{m="x"}'
        "[$__rate_interval]))) / sum(rate(process_cpu_seconds_total[5m]))"
    )
    assert promql_metrics(expr) == {"kvcache_node_rpc_seconds_bucket", "process_cpu_seconds_total"}


def test_down_by_config_from_another_directory_then_status_says_none(cluster, tmp_path):
    config, state = cluster
    r = kvcache_cli("down", "--config", config, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "cluster stopped (5 processes)" in r.stdout
    r = kvcache_cli("status", "--config", config, cwd=str(tmp_path))
    assert r.returncode == 2
    assert "no cluster state at" in r.stderr and "kvcache up --detach" in r.stderr
    r = kvcache_cli("down", "--config", config, cwd=str(tmp_path))
    assert r.returncode == 1 and "nothing was stopped" in r.stderr
