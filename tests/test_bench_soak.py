"""`kvcache bench soak`: a real local cluster under load while its processes are SIGKILLed.

The slow test runs it for 20 s and checks the invariants of its report: no corrupt page, no
committed page missing without an explanation (an EVICTED event, or a node kill while the page
was not on SSD), every kind of chaos happened, and pages were verified."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from bench.faults import soak


def run_soak(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "soak", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_soak_20s_loses_and_corrupts_nothing(tmp_path):
    out = run_soak(
        "--duration",
        "20",
        "--chaos-interval",
        "2",
        "--work-dir",
        str(tmp_path / "work"),
        "--out",
        str(tmp_path),
        "--no-progress",
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "corrupt (must be 0)" in out.stdout and "lost, unexplained" in out.stdout
    with open(tmp_path / "soak.json") as f:
        report = json.load(f)
    s = report["summary"]
    assert s["corrupt"] == 0 and s["lost"] == 0
    assert s["restart_failures"] == 0 and s["thread_failures"] == 0, report["failures"]
    assert s["pages_verified"] > 0 and s["reads_verified"] > 0
    assert s["pages_put"] > 0 and s["pages_moved"] > 0
    # every committed page is accounted for: present and verified, or missing and explained
    assert s["pages_committed"] >= s["missing_evicted"] + s["missing_killed"]
    kinds = ["messenger", "node", "conductor"]
    if os.geteuid() == 0:  # the SSD filesystem is a tmpfs this mounts: root only
        assert report["ssd_fill"] == "yes"
        kinds.append("ssd-fill")
    for kind in kinds:
        assert report["kills"][kind]["count"] >= 1, (kind, report["kills"])
        assert report["kills"][kind]["failed"] == 0


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    soak.configure(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--duration", "0"], "--duration must be > 0"),
        (["--duration", "-5"], "--duration must be > 0"),
        (["--nodes", "1"], "--nodes must be >= 2"),
        (["--writers", "0"], "--writers must be >= 1"),
        (["--readers", "-1"], "--readers must be >= 0"),
        (["--movers", "-1"], "--movers must be >= 0"),
        (["--chaos-interval", "0"], "--chaos-interval must be > 0"),
        (["--dram-pages", "2"], "--dram-pages must be >= 8"),
        (["--ssd-pages", "0"], "--ssd-pages must be >= 1"),
        (["--op-pause", "-1"], "--op-pause must be >= 0"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(argv, message):
    with pytest.raises(SystemExit) as e:
        soak.check_args(parse(*argv))
    assert message in str(e.value)


def test_the_command_line_reports_bad_options(tmp_path):
    out = run_soak("--nodes", "1", "--out", str(tmp_path))
    assert out.returncode != 0
    assert "kvcache bench soak: --nodes must be >= 2" in out.stderr
    assert not (tmp_path / "soak.json").exists()
    out = run_soak("--duration", "soon")
    assert out.returncode == 2 and "--duration: invalid float value: 'soon'" in out.stderr
