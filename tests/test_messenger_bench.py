"""The transfer benchmark runs end to end in its quick mode and reports ratios (no timings are
asserted: they belong to the benchmark's output, not to pass/fail)."""

from __future__ import annotations

import json
import os

import pytest

from bench.micro.transfer import DEFAULT_MC_PYTHON, DEFAULT_PEERS, main
from bench.report import parse_bytes


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
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "x raw socket" in printed and "Mooncake TE skipped" in printed
    # The figure that counts, against both goals, in the same run.
    assert "the figure that counts: pulls through real node + messenger processes" in printed
    assert "the 0.9x goal) raw socket" in printed
    data = json.loads(out.read_text())
    methods = [r["method"] for r in data["results"]]
    # The data port with and without TLS, in the same run.
    assert methods == ["raw socket", "messenger tcp x2", "messenger tls x2", "node+messenger x2"]
    for row in data["results"]:
        assert row["gbps"] > 0 and row["vs_raw"] > 0
        assert row["vs_mooncake"] is None
    assert all(r["note"] == "verified" for r in data["results"][1:])


def test_sizes_parse():
    assert parse_bytes("1G") == 1 << 30 and parse_bytes("4MiB") == 4 << 20
    assert parse_bytes("4096") == 4096


MOONCAKE_PYTHON = os.environ.get("KVCACHE_MOONCAKE_PYTHON", DEFAULT_MC_PYTHON)


@pytest.mark.slow
@pytest.mark.skipif(
    not (os.path.exists(MOONCAKE_PYTHON) and (DEFAULT_PEERS / "mooncake_te_bench.py").exists()),
    reason="needs a Python with mooncake-transfer-engine-non-cuda (shared/peers/README.md)",
)
def test_mooncake_rounds_are_interleaved_and_verified(tmp_path):
    out = tmp_path / "transfer.json"
    argv = ["--total", "16M", "--sizes", "1M", "--runs", "2", "--lanes", "1", "--no-e2e"]
    assert main([*argv, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    mooncake = next(r for r in data["results"] if r["method"] == "mooncake TE batch read")
    assert len(mooncake["runs"]) == 2 and mooncake["note"] == "verified"
    assert all(r["vs_mooncake"] > 0 for r in data["results"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--runs", "0"], "--runs, --sizes and --lanes need positive values"),
        (["--sizes", "1M,x"], "is not a size like"),
        (["--total", "3M", "--sizes", "2M"], "must be a multiple of page size"),
        (["--sizes", "64K"], "multiples of 131072 bytes"),
    ],
)
def test_bad_options_say_what_to_fix(argv, message):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--no-mooncake"])
    assert message in str(e.value)
