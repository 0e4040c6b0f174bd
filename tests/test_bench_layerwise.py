"""The layer-wise benchmark runs end to end on a tiny request against a real node and writes
every figure with its reference (timings are its output, not asserted); bad options are clear
errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench.micro.layerwise import main


@pytest.mark.slow
def test_layerwise_benchmark_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--page-kib", "128", "--blocks", "4", "--repeats", "1", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads((out / "layerwise.json").read_text())
    got = {(r["device"], r["op"], r["layout"]) for r in doc["rows"]}
    assert {("cpu", op, t) for op in ("put", "load") for t in ("hf", "paged")} <= got
    for row in doc["rows"]:
        assert math.isfinite(row["value"]) and row["value"] > 0, row
        assert row["reference"] > 0 and row["ratio"] > 0, row
        if row["op"] == "put":
            assert row["copy_ratio"] > 0 and row["publish_ms"] > 0, row
    printed = capsys.readouterr().out
    if not torch.cuda.is_available():
        assert doc["skipped"] == {"cuda": "no CUDA device"}
        assert "cuda: skipped, no CUDA device here" in printed
    assert "vs ref" in printed and doc["page_bytes"] == 128 * 1024


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--blocks", "0"], "--blocks must be positive"),
        (["--repeats", "-1"], "--repeats must be positive"),
        (["--devices", "tpu"], "unknown ['tpu']"),
        (["--page-kib", "100"], "--page-kib must be a positive multiple of 128"),
    ],
)
def test_bad_options_are_clear_errors(argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert message in str(e.value)
