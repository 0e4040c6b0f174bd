"""The store benchmark runs end to end on a tiny configuration and writes every figure.

Timings are not checked here (they belong to the benchmark's own output), only that each figure
is produced, finite and carries its reference."""

from __future__ import annotations

import argparse
import json
import math

import pytest

import bench.micro.store


@pytest.mark.slow
def test_store_benchmark_writes_every_figure(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.micro.store.configure(parser)
    args = parser.parse_args(
        [
            "--page-kib",
            "128",
            "--pages",
            "8",
            "--batch",
            "4",
            "--ssd-pages",
            "8",
            "--ssd-dir",
            str(tmp_path),
            "--tokens",
            "4096",
            "--lookup-blocks",
            "16",
            "--index-blocks",
            "2000",
            "--repeats",
            "1",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert bench.micro.store.run(args) == 0
    doc = json.loads((tmp_path / "out" / "store.json").read_text())
    groups = {f["group"] for f in doc["figures"]}
    assert groups == {
        "DRAM tier",
        "shared budget",
        "SSD tier",
        "hashing",
        "lookup",
        "eviction policy",
        "index memory",
    }
    for fig in doc["figures"]:
        assert math.isfinite(fig["value"]) and fig["value"] > 0, fig
        if fig["group"] != "index memory":
            assert fig["reference"] > 0 and fig["ratio"] > 0, fig
    assert doc["page_bytes"] == 128 * 1024
    table = capsys.readouterr().out
    assert "put: allocate+copy+commit" in table and "store.json" in table
    assert list(tmp_path.iterdir()) != [] and not any(
        p.name.startswith("kvcache-bench-ssd-") for p in tmp_path.iterdir()
    )  # lmdb cleaned up
