"""The transfer benchmark runs end to end in its quick mode and reports ratios (no timings are
asserted: they belong to the benchmark's output, not to pass/fail)."""

from __future__ import annotations

import json

import pytest

from bench.transfer import main, parse_bytes


@pytest.mark.slow
def test_quick_transfer_benchmark_reports_ratios(tmp_path, capsys):
    out = tmp_path / "transfer.json"
    assert (
        main(
            [
                "--total",
                "8M",
                "--sizes",
                "1M",
                "--runs",
                "1",
                "--lanes",
                "2",
                "--no-mooncake",
                "--e2e",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "x raw socket" in printed and "Mooncake TE skipped" in printed
    data = json.loads(out.read_text())
    methods = [r["method"] for r in data["results"]]
    assert methods == ["raw socket", "messenger tcp x2", "e2e messenger x2"]
    for row in data["results"]:
        assert row["gbps"] > 0 and row["vs_raw"] > 0
        assert row["vs_mooncake"] is None
    assert all(r["note"] == "verified" for r in data["results"][1:])


def test_sizes_parse():
    assert parse_bytes("1G") == 1 << 30 and parse_bytes("4MiB") == 4 << 20
    assert parse_bytes("4096") == 4096
