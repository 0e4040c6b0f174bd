"""A node process meeting faults of its host: a full SSD filesystem, a small /dev/shm, a damaged
lmdb file, other processes' shared memory. Each gets a clear error or keeps serving; never a crash,
a traceback or a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients import KVStoreClient
from kvstore.shm import shm_free_bytes

from conftest import TEST_LAYOUT, TEST_PAGE_BYTES
from kvstore_helpers import small_tmpfs


def metric(port: int, name: str, **labels: str) -> float:
    """One sample of the node's Prometheus metrics, by name and labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (name, name + "_total") and sample.labels == labels:
                return float(sample.value)
    raise AssertionError(f"{name}{labels} not in the node's metrics")


def test_a_node_with_a_full_ssd_filesystem_keeps_taking_writes(start_node, tmp_path):
    with small_tmpfs(tmp_path / "ssd") as ssd_dir:
        node = start_node(
            "--ssd", "4MiB", "--ssd-dir", str(ssd_dir), "--metrics-port", "0", dram="64KiB"
        )
        port = node.info["metrics_port"]
        with KVStoreClient(node.address) as c:
            ns = c.namespaces()[0]

            def put(i: int) -> None:
                page = np.full(TEST_PAGE_BYTES, i % 251, np.uint8)
                assert c.put(ns, [page], keys=[i.to_bytes(16, "little")]).stored == 1

            for i in range(120):  # 8 pages of DRAM; the filesystem fills after ~60
                put(i)
            failures = metric(port, "kvcache_store_demotion_failures", namespace=ns)
            assert failures > 0
            (ssd_dir / "ballast").unlink()  # space returns: demotion resumes
            demoted = metric(port, "kvcache_store_tier_moves", namespace=ns, direction="demote")
            for i in range(120, 130):
                put(i)
            assert metric(port, "kvcache_store_demotion_failures", namespace=ns) == failures
            moves = metric(port, "kvcache_store_tier_moves", namespace=ns, direction="demote")
            assert moves == demoted + 10
            assert c.get(ns, keys=[(125).to_bytes(16, "little")])[0][0] == 125
        assert node.alive()
        assert node.stop() == 0
        assert "Traceback" not in node.log()


def run_node_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``kvcache node ARGS`` that is expected to exit by itself (refusing to start)."""
    return subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "node", "--listen", "127.0.0.1:0", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("reserve", [False, True])
def test_dram_beyond_the_free_shared_memory_is_refused_at_start(reserve):
    free = shm_free_bytes()
    if free is None:
        pytest.skip("/dev/shm has no size limit here")
    dram = free + (1 << 30)  # sparse: creating it would work, and writes would later SIGBUS
    proc = run_node_cli("--dram", str(dram), *(["--reserve-shm"] if reserve else []))
    assert proc.returncode != 0 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert "--dram needs" in proc.stderr and "/dev/shm has only" in proc.stderr
    assert "lower --dram" in proc.stderr


def test_a_node_refuses_a_damaged_ssd_file_unless_told_to_move_it_aside(start_node, tmp_path):
    ssd = ["--ssd", "1MiB", "--ssd-dir", str(tmp_path / "ssd")]
    node = start_node(*ssd)
    shm = Path("/dev/shm") / next(iter(node.info["shm"].values()))
    assert shm.stat().st_mode & 0o777 == 0o600
    with KVStoreClient(node.address) as c:  # NOTE: serving, so a SIGTERM now stops it cleanly
        c.namespaces()
    node.stop()
    [data] = (tmp_path / "ssd").glob("*/data.mdb")
    assert data.stat().st_mode & 0o777 == 0o600
    os.truncate(data, 8192)  # the meta pages only: the first read of the tree was a SIGBUS
    proc = run_node_cli("--dram", "1MiB", "--layout", TEST_LAYOUT, *ssd)
    assert proc.returncode == 1 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert "is damaged" in proc.stderr and "--ssd-damaged=move-aside" in proc.stderr
    node = start_node(*ssd, "--ssd-damaged", "move-aside")
    assert [p.name[:17] for p in data.parent.glob("data.mdb.damaged-*")] == ["data.mdb.damaged-"]
    assert "moved it to" in node.log()
