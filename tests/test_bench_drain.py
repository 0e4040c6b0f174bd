"""``kvcache bench drain`` end to end, on a few requests of the trace: three pools of real
processes, a node leaving with and without handing over, the table and the JSON."""

from __future__ import annotations

import json

import pytest

from helpers import kvcache_cli

pytestmark = pytest.mark.slow


def test_drain_bench_prints_the_hit_rate_after_a_node_leaves_with_and_without(tmp_path):
    out = kvcache_cli(
        "bench", "drain", "--requests", "40", "--nodes", "2", "--dram", "4MiB", "--window", "10",
        "--out", str(tmp_path), timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.split()[:1] == ["stays"] and "1.00x" in line for line in lines)
    assert any(line.split()[:1] == ["leaves"] for line in lines)
    report = json.loads((tmp_path / "drain.json").read_text())
    by = {o["scenario"]: o for o in report["outcomes"]}
    assert set(by) == {"stays", "leaves", "drains"}
    assert by["drains"]["drained_blocks"] > 0 and by["leaves"]["drained_blocks"] == 0
    assert all(0 <= by[s]["after"] <= report["ideal_after"] + 1e-9 for s in by)
    assert (tmp_path / "drain.png").stat().st_size > 0
