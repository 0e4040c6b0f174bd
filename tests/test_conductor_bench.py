"""`kvcache bench conductor` runs end to end on a tiny configuration and writes every figure.

Timings are not checked (they belong to the benchmark's output), only that each figure is
produced, finite, and comes with its target or reference; the index counts are exact."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_conductor_benchmark_writes_every_figure(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcache.cli",
            "bench",
            "conductor",
            "--blocks",
            "4096",
            "--chain-blocks",
            "16",
            "--prefill",
            "3",
            "--decode",
            "2",
            "--requests",
            "200",
            "--grpc-requests",
            "640",  # 2 reps x (unary + batched): more requests than a tenant may hold pending
            "--threads",
            "2",
            "--batch",
            "8",
            "--reps",
            "2",
            "--no-progress",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads((tmp_path / "conductor.json").read_text())
    assert doc["workload"]["blocks"] == 4096 and doc["workload"]["nodes"] == 5
    assert [r["policy"] for r in doc["in_process"]] == [
        "random",
        "round-robin",
        "load",
        "local-cache",
        "global-cache",
    ]
    for row in doc["in_process"]:
        assert row["requests"] == 200 and row["target_ms"] == 2.0
        for key in ("p50_ms", "p99_ms", "p99_vs_target", "walk_p50_ms", "decisions_per_s"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    g = doc["grpc"]
    assert g["indexed_keys"] == 4096 and g["held_pairs"] == doc["workload"]["held_pairs"]
    assert g["decisions"] == 640 and g["target_per_s"] == 2000.0 and g["reps"] == 2
    for key in (
        "decisions_per_s",
        "p50_ms",
        "batched_decisions_per_s",
        "empty_rpc_per_s",
        "empty_rpc_p50_ms",
        "rate_vs_empty_rpc",
        "rss_full_mb",
        "rss_vs_target",
    ):
        assert math.isfinite(g[key]) and g[key] > 0, key
    assert len(g["rate_vs_empty_rpc_runs"]) == 2
    # The conductor's empty RPC, Schedule, Schedule on a stream, ScheduleBatch, and the bare
    # sync and aio servers.
    assert len(g["phases"]) == 6 and "aio" in g["phases"][-1]["phase"]
    assert g["stream_per_s"] > 0 and len(g["stream_vs_empty_rpc_runs"]) == 2
    for row in g["phases"]:
        assert len(row["runs_per_s"]) == 2 and row["per_s"] > 0 and row["p50_ms"] > 0, row
    assert "Schedule / empty RPC" in out.stdout and "p99/2ms" in out.stdout
    assert "Schedule on a stream (ScheduleStream)" in out.stdout
    assert "ScheduleBatch (8 per call)" in out.stdout


def test_conductor_benchmark_rejects_bad_options(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcache.cli",
            "bench",
            "conductor",
            "--policies",
            "fastest",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "unknown policies ['fastest']" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "conductor", "--reps", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "repetition" in out.stderr
