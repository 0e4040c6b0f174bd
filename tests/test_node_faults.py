"""A node process meeting faults of its host: a full SSD filesystem, a small /dev/shm, a damaged
lmdb file, other processes' shared memory. Each gets a clear error or keeps serving; never a crash,
a traceback or a hang."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients import KVStoreClient
from kvstore.shm import shm_free_bytes

from conftest import TEST_PAGE_BYTES
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
