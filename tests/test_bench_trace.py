"""Trace reading (errors with line numbers, empty, out of order) and synthetic generation."""

from __future__ import annotations

import json
import logging
import math

import pytest

from bench.report import parse_count, parse_count_list
from bench.trace import SyntheticSpec, TraceError, load_trace, synthetic_trace, write_trace


def _write(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _req(ts, input_length, ids, out=10) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": input_length, "output_length": out, "hash_ids": ids}
    )


def test_reads_requests_and_skips_blank_lines(tmp_path):
    path = _write(tmp_path / "t.jsonl", [_req(0, 10, [1, 2, 3]), "", _req(5, 4, [1])])
    trace = load_trace(path, block_tokens=4)
    assert len(trace) == 2
    assert trace.requests[0].hash_ids == (1, 2, 3)
    assert trace.total_blocks == 4 and trace.total_input_tokens == 14
    assert trace.duration_s == pytest.approx(0.005)
    assert trace.reordered == 0


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"input_length": 4, "output_length": 1, "hash_ids": [1]}), "'timestamp'"),
        (_req(-1, 4, [1]), "'timestamp' must be a non-negative"),
        (
            json.dumps({"timestamp": 0, "output_length": 1, "hash_ids": [1]}),
            "missing field 'input_length'",
        ),
        (_req(0, "4", [1]), "'input_length' must be an integer"),
        (_req(0, 4, [1], out=-3), "'output_length' must be >= 0"),
        (_req(0, 4, "1"), "'hash_ids' must be a list of integers"),
        (_req(0, 4, [1, 2.5]), "'hash_ids' must be a list of integers"),
        (_req(0, 9, [1, 2]), "needs 3; is --trace-block-tokens right?"),
    ],
)
def test_parse_errors_name_the_line(tmp_path, bad, message):
    path = _write(tmp_path / "t.jsonl", [_req(0, 4, [1]), "", bad, _req(9, 4, [1])])
    with pytest.raises(TraceError) as err:
        load_trace(path, block_tokens=4)
    assert f"{path}:3:" in str(err.value)
    assert message in str(err.value)


def test_missing_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="cannot open trace"):
        load_trace(str(tmp_path / "absent.jsonl"))


def test_empty_trace(tmp_path):
    trace = load_trace(_write(tmp_path / "t.jsonl", ["", "  "]), block_tokens=4)
    assert len(trace) == 0
    assert trace.total_blocks == 0 and trace.duration_s == 0.0


def test_out_of_order_timestamps_are_sorted_with_a_warning(tmp_path, caplog):
    path = _write(
        tmp_path / "t.jsonl", [_req(10, 4, [1]), _req(3, 4, [2]), _req(7, 4, [3]), _req(12, 4, [4])]
    )
    with caplog.at_level(logging.WARNING, logger="bench.trace"):
        trace = load_trace(path, block_tokens=4)
    assert [r.timestamp_ms for r in trace.requests] == [3, 7, 10, 12]
    assert [r.hash_ids for r in trace.requests] == [(2,), (3,), (1,), (4,)]
    assert trace.reordered == 2
    assert "2 requests are out of timestamp order" in caplog.text


def test_equal_timestamps_keep_file_order(tmp_path):
    path = _write(tmp_path / "t.jsonl", [_req(5, 4, [1]), _req(5, 4, [2]), _req(1, 4, [3])])
    trace = load_trace(path, block_tokens=4)
    assert [r.hash_ids[0] for r in trace.requests] == [3, 1, 2]


def test_synthetic_trace_is_seeded_and_well_formed(tmp_path):
    spec = SyntheticSpec(requests=300, block_tokens=64, documents=50, seed=7)
    a, b = synthetic_trace(spec), synthetic_trace(spec)
    assert a.requests == b.requests
    assert (
        synthetic_trace(SyntheticSpec(requests=300, block_tokens=64, documents=50, seed=8)).requests
        != a.requests
    )
    assert len(a) == 300
    ts = [r.timestamp_ms for r in a.requests]
    assert ts == sorted(ts)
    for r in a.requests:
        assert len(r.hash_ids) == math.ceil(r.input_length / 64)
    # Round trip through the file format.
    path = str(tmp_path / "s.jsonl")
    write_trace(path, a)
    again = load_trace(path, block_tokens=64)
    assert [r.hash_ids for r in again.requests] == [r.hash_ids for r in a.requests]
    assert [r.input_length for r in again.requests] == [r.input_length for r in a.requests]


def test_synthetic_trace_shares_prefixes():
    """System prompts are shared by everyone; documents and earlier turns make longer prefixes
    seen before (the system prompts here span at most 2 blocks)."""
    spec = SyntheticSpec(
        requests=400,
        block_tokens=64,
        system_prompts=2,
        system_prompt_tokens=(64, 128),
        documents=20,
        mean_turns=4,
        seed=1,
    )
    trace = synthetic_trace(spec)
    assert len({r.hash_ids[0] for r in trace.requests}) <= 2
    seen: set[tuple[int, ...]] = set()
    long_reuse = 0
    for r in trace.requests:
        prefixes = [r.hash_ids[:n] for n in range(1, len(r.hash_ids) + 1)]
        reused = sum(1 for p in prefixes if p in seen)
        long_reuse += reused > 2
        seen.update(prefixes)
    assert long_reuse > len(trace) // 3


def test_synthetic_spec_rejects_nonsense():
    with pytest.raises(ValueError):
        SyntheticSpec(doc_prob=1.5)
    with pytest.raises(ValueError):
        SyntheticSpec(block_tokens=0)


def test_parse_count():
    assert parse_count("3M") == 3_000_000
    assert parse_count("512k") == 512_000
    assert parse_count("1.5G") == 1_500_000_000
    assert parse_count("4096") == 4096
    assert parse_count_list("1M, 2M") == [1_000_000, 2_000_000]
    for bad in ("", "abc", "1.5", "3X"):
        with pytest.raises(ValueError):
            parse_count(bad)
