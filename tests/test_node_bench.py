"""``kvcache bench node`` end to end on a tiny configuration: every figure is produced, finite,
and carries its reference (timings themselves belong to the benchmark's output)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

import bench.micro.node


@pytest.mark.slow
def test_node_benchmark_writes_every_figure(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.micro.node.configure(parser)
    args = parser.parse_args(
        "--total-mib 8 --batch 4 --runs 1 --lookups 20 --lookup-blocks 50 --no-peers --out".split()
        + [str(tmp_path)]
    )
    assert bench.micro.node.run(args) == 0
    doc = json.loads((tmp_path / "node.json").read_text())
    for path in ("in_process", "client_shm", "client_pipelined", "client_streamed"):
        for op in ("write_GBps", "read_GBps"):
            assert math.isfinite(doc[path][op]) and doc[path][op] > 0, (path, op)
    assert doc["memcpy_GBps"] > 0 and doc["mooncake_store"] is None
    names = list(doc["lookup_p50_ms"])
    assert names[0].startswith("empty unary RPC") and len(names) == 3
    assert all(v > 0 for v in doc["lookup_p50_ms"].values())
    out = capsys.readouterr().out
    assert "Lookup of 50 blocks by keys" in out and "x empty RPC" in out
    assert "Mooncake store skipped (--no-peers)" in out
