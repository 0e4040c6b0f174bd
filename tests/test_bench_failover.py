"""``kvcache bench failover`` end to end (small: 4 prompts, a 2 s lease), and its option errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "failover", *args],
        capture_output=True,
        text=True,
        timeout=400,
    )


def test_bad_options_say_what_to_fix(tmp_path):
    r = bench("--prompts", "1", "--out", str(tmp_path))
    assert r.returncode != 0 and "--prompts >= 2" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_failover_bench_prints_its_figures(tmp_path):
    r = bench(
        *("--ttl", "2", "--prompts", "4", "--blocks", "2", "--rounds", "1"), "--out", str(tmp_path)
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for figure in ("failover: SIGKILL", "hit rate before", "requests failed", "registration"):
        assert figure in r.stdout
    report = json.loads((tmp_path / "failover.json").read_text())
    etcd, embedded = report["etcd"], report["embedded"]
    assert etcd["failed"] == 0 and etcd["client_failovers"] >= 1
    assert etcd["hit_after_first"] == etcd["hit_before"] > 0
    assert etcd["failover_s"] > 0 and embedded["recovery_s"] > 0
    assert (tmp_path / "failover.png").stat().st_size > 0
