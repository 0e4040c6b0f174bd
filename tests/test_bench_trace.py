"""Trace reading (errors with line numbers, empty, out of order; token ids and prompt text with a
local tokenizer, optional timestamps) and synthetic generation."""

from __future__ import annotations

import json
import logging
import math

import pytest

from bench.replay.trace import SyntheticSpec, TraceError, load_trace, synthetic_trace, write_trace
from bench.report import parse_count, parse_count_list

from helpers import kvcache_cli


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
    with caplog.at_level(logging.WARNING, logger="bench.replay.trace"):
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


# ---- your own traffic: token ids, prompt text with a local tokenizer, optional timestamps ----


def make_tokenizer(directory) -> str:
    """A small word-level Hugging Face tokenizer built here with the `tokenizers` library and
    saved as a tokenizer directory (tokenizer.json), as save_pretrained would."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = [f"w{i}" for i in range(200)]
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return str(directory)


def test_input_ids_requests_share_prefix_blocks_by_their_tokens(tmp_path):
    shared = list(range(100, 108))  # two 4-token blocks
    lines = [
        json.dumps({"input_ids": shared + [1, 2, 3], "output_length": 5, "timestamp": 0}),
        json.dumps({"input_ids": shared + [9, 9, 9, 9, 7], "timestamp": 250}),
        json.dumps({"input_ids": [5, 5, 5, 5] + shared, "timestamp": 500}),
    ]
    trace = load_trace(_write(tmp_path / "ids.jsonl", lines), block_tokens=4, output_length=64)
    a, b, c = trace.requests
    assert (a.input_length, a.output_length, b.output_length) == (11, 5, 64)
    assert len(a.hash_ids) == 3 and len(b.hash_ids) == 4  # the partial block has an id too
    assert a.hash_ids[:2] == b.hash_ids[:2]  # same tokens, same prefix ids
    assert a.hash_ids[2] != b.hash_ids[2]
    assert not set(c.hash_ids) & set(a.hash_ids)  # the same tokens after another prefix
    assert trace.arrivals == "recorded" and trace.duration_s == pytest.approx(0.5)


def test_prompt_text_through_a_local_tokenizer(tmp_path):
    tokdir = make_tokenizer(tmp_path / "tok")
    system = " ".join(f"w{i}" for i in range(12))
    lines = [json.dumps({"prompt": f"{system} w{50 + i} w{60 + i}"}) for i in range(3)]
    path = _write(tmp_path / "prompts.jsonl", lines)
    trace = load_trace(path, block_tokens=4, tokenizer=tokdir, rate=2.0, seed=1)
    assert [r.input_length for r in trace.requests] == [14, 14, 14]
    ids = [r.hash_ids for r in trace.requests]
    assert ids[0][:3] == ids[1][:3] == ids[2][:3]  # the shared 12-word system prompt
    assert len({i[3] for i in ids}) == 3
    times = [r.timestamp_ms for r in trace.requests]
    assert times[0] == 0 and times == sorted(times) and trace.arrivals == "poisson"
    again = load_trace(path, block_tokens=4, tokenizer=str(tmp_path / "tok" / "tokenizer.json"))
    assert [r.hash_ids for r in again.requests] == ids and again.arrivals == "none"


def test_hitrate_on_your_own_trace_through_the_command(tmp_path):
    tokdir = make_tokenizer(tmp_path / "tok")
    system = " ".join(f"w{i}" for i in range(64))
    lines = [json.dumps({"prompt": f"{system} w{100 + i}"}) for i in range(20)]
    path = _write(tmp_path / "p.jsonl", lines)
    out = tmp_path / "hr.json"
    r = kvcache_cli(
        "bench",
        "hitrate",
        "--trace",
        path,
        "--tokenizer",
        tokdir,
        "--trace-block-tokens",
        "16",
        "--capacities",
        "1K",
        "--policies",
        "lru",
        "--out",
        str(out),
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    # 4 full system-prompt blocks per request: all but the first request's hit them.
    assert doc["theoretical_max"]["hit_blocks"] == 19 * 4
    assert (tmp_path / "hr.png").stat().st_size > 0


@pytest.mark.parametrize(
    "lines, extra, message",
    [
        (['{"prompt": "w1 w2"}'], [], "'prompt' is text: give --tokenizer PATH"),
        (['{"input_ids": [1, -2]}'], [], "'input_ids' must be a list of token ids"),
        (['{"tokens": [1]}'], [], "a request needs 'input_ids'"),
        (
            ['{"input_ids": [1], "timestamp": 5}', '{"input_ids": [2]}'],
            [],
            ":2: no 'timestamp', unlike",
        ),
        (['{"input_ids": [1], "timestamp": 5}'], ["--rate", "3"], "this one has its own"),
        (['{"input_ids": [1]}'], ["--rate", "0"], "--rate must be a positive number"),
        (['{"input_ids": [1]}'], ["--tokenizer", "/nonexistent"], "no tokenizer.json there"),
    ],
)
def test_trace_mistakes_are_messages(tmp_path, lines, extra, message):
    path = _write(tmp_path / "t.jsonl", lines)
    r = kvcache_cli("bench", "hitrate", "--trace", path, "--no-progress", *extra)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_schedule_needs_arrival_times(tmp_path):
    path = _write(tmp_path / "t.jsonl", ['{"input_ids": [1, 2, 3]}'])
    r = kvcache_cli("bench", "schedule", "--trace", path, "--no-progress")
    assert r.returncode == 2
    assert "has no timestamps and scheduling needs arrival times: give --rate" in r.stderr
