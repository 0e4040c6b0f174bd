"""``kvcache bench hitrate``: replays through the real kvstore with hand-computed hit rates."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import cli as bench_cli
from bench.replay.hitrate import CacheSetup, replay, run_setups, theoretical_max
from bench.replay.trace import Trace, TraceRequest, load_trace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BT = 4  # tokens per block in these hand-made traces


def make_trace(prompts: list[list[int]], input_lengths: list[int] | None = None) -> Trace:
    """One request per prompt (a list of block ids), 1 ms apart; full blocks unless told."""
    lengths = input_lengths or [BT * len(p) for p in prompts]
    reqs = [
        TraceRequest(float(i), n, 1, tuple(p)) for i, (p, n) in enumerate(zip(prompts, lengths))
    ]
    return Trace(requests=reqs, block_tokens=BT, source="test")


def hit_blocks(trace: Trace, **setup) -> int:
    result = replay(trace, trace.block_keys(), CacheSetup(**setup))
    assert result.counts.blocks == trace.total_blocks
    return result.counts.hit_blocks


# A A A B C A B with room for 2 blocks:
#   LRU: A hits twice; C evicts A (least recent), so A misses, evicting B, so B misses -> 2/7.
#   LFU: A (3 uses) survives; C evicts B (1 use); A hits; B evicts C -> 3/7.
#   Infinite cache: A, A, A, B hit -> 4/7.
FAVOURS_LFU = [[1], [1], [1], [2], [3], [1], [2]]
# A A A B C B C B C with room for 2: LFU keeps the once-hot A and thrashes B/C (2/9);
# LRU drops A and keeps B and C (2 + 4 = 6/9).
FAVOURS_LRU = [[1], [1], [1], [2], [3], [2], [3], [2], [3]]


def test_lru_and_lfu_differ_where_they_should():
    lfu_trace, lru_trace = make_trace(FAVOURS_LFU), make_trace(FAVOURS_LRU)
    cap = 2 * BT
    assert hit_blocks(lfu_trace, capacity_tokens=cap, policy="lru") == 2
    assert hit_blocks(lfu_trace, capacity_tokens=cap, policy="lfu") == 3
    assert theoretical_max(lfu_trace, lfu_trace.block_keys()).hit_blocks == 4
    assert hit_blocks(lru_trace, capacity_tokens=cap, policy="lru") == 6
    assert hit_blocks(lru_trace, capacity_tokens=cap, policy="lfu") == 2
    # With room for everything both reach the theoretical maximum.
    for policy in ("lru", "lfu"):
        assert hit_blocks(lfu_trace, capacity_tokens=3 * BT, policy=policy) == 4


# [1,2,3] then [9] with room for 3: LRU evicts block 1 (the chain's root, touched first) and the
# repeat of [1,2,3] hits nothing; prefix evicts the leaf 3 and the repeat hits 1 and 2.
FAVOURS_PREFIX = [[1, 2, 3], [9], [1, 2, 3]]


def test_prefix_policy_keeps_the_head_lru_evicts():
    trace = make_trace(FAVOURS_PREFIX)
    assert hit_blocks(trace, capacity_tokens=3 * BT, policy="lru") == 0
    assert hit_blocks(trace, capacity_tokens=3 * BT, policy="prefix") == 2
    assert hit_blocks(trace, capacity_tokens=4 * BT, policy="prefix") == 3


def test_hits_are_prefixes_and_token_rate_caps_the_partial_block():
    # [1,2,3] (10 tokens: 4+4+2), again (3 hits, 10 tokens), [1,2,9] (2 hits), [5,2] (0: block 2
    # after 5 is a different prefix), [1] (1 hit).
    trace = make_trace([[1, 2, 3], [1, 2, 3], [1, 2, 9], [5, 2], [1]], [10, 10, 12, 8, 4])
    result = replay(trace, trace.block_keys(), CacheSetup(capacity_tokens=100, policy="lru"))
    c = result.counts
    assert (c.blocks, c.hit_blocks) == (12, 6)
    assert (c.input_tokens, c.hit_tokens) == (44, 10 + 8 + 4)
    assert c.block_hit_rate == pytest.approx(6 / 12)
    assert c.token_hit_rate == pytest.approx(22 / 44)
    best = theoretical_max(trace, trace.block_keys())
    assert (best.hit_blocks, best.hit_tokens) == (6, 22)
    assert result.evictions == 0


def test_prompt_longer_than_the_cache_keeps_its_first_blocks():
    trace = make_trace([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]])
    # 2 pages: the second request finds blocks 1 and 2.
    assert hit_blocks(trace, capacity_tokens=2 * BT, policy="lru") == 2


def test_ssd_tier_catches_dram_evictions_and_promotes_hits():
    # DRAM holds 1 block, SSD 2: B demotes A to SSD; A hits from SSD and moves back to DRAM
    # (demoting B); B then hits from SSD too.
    trace = make_trace([[1], [2], [1], [2]])
    setup = CacheSetup(capacity_tokens=BT, ssd_capacity_tokens=2 * BT, policy="lru")
    result = replay(trace, trace.block_keys(), setup)
    assert result.counts.hit_blocks == 2
    assert result.ssd_hit_blocks == 2
    assert result.evictions == 0
    # Without the SSD tier, every request misses.
    assert hit_blocks(trace, capacity_tokens=BT, policy="lru") == 0


def test_local_pools_and_routing():
    trace = make_trace([[1, 2], [1, 2], [1, 2], [1, 2]])
    base = dict(capacity_tokens=16 * BT, policy="lru", pools=2)
    # Round robin alternates pools: the first visit to each pool misses.
    assert hit_blocks(trace, routing="round-robin", **base) == 4
    # Session hash sends every repeat to the same pool.
    assert hit_blocks(trace, routing="session-hash", **base) == 6
    # The capacity is split: 2 pools of 1 block each cannot hold a 2-block prompt's tail.
    assert (
        hit_blocks(trace, capacity_tokens=2 * BT, policy="lru", pools=2, routing="session-hash")
        == 3
    )


def test_bad_setups_are_refused():
    trace = make_trace([[1]])
    with pytest.raises(ValueError, match="less than one 4-token block"):
        replay(trace, trace.block_keys(), CacheSetup(capacity_tokens=3, policy="lru"))
    with pytest.raises(ValueError, match="unknown eviction policy"):
        replay(trace, trace.block_keys(), CacheSetup(capacity_tokens=8, policy="mru"))
    with pytest.raises(ValueError, match="unknown routing"):
        replay(
            trace,
            trace.block_keys(),
            CacheSetup(capacity_tokens=8, policy="lru", pools=2, routing="nearest"),
        )


def test_empty_trace_replays_to_zero_rates():
    trace = make_trace([])
    result = replay(trace, [], CacheSetup(capacity_tokens=8, policy="lru"))
    assert result.counts.block_hit_rate == 0.0 and result.counts.token_hit_rate == 0.0


def test_parallel_workers_match_sequential():
    trace = make_trace(FAVOURS_LFU + FAVOURS_LRU)
    keys = trace.block_keys()
    setups = [
        CacheSetup(capacity_tokens=c * BT, policy=p) for p in ("lru", "lfu") for c in (1, 2, 3)
    ]
    seq = run_setups(trace, keys, setups, jobs=1)
    par = run_setups(trace, keys, setups, jobs=2)
    assert [r.setup for r in par] == setups
    assert [r.counts for r in par] == [r.counts for r in seq]


def _kvcache(*args: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _write_trace(path, prompts: list[list[int]]) -> str:
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(
                json.dumps(
                    {"timestamp": i, "input_length": BT * len(p), "output_length": 1, "hash_ids": p}
                )
                + "\n"
            )
    return str(path)


def test_cli_compares_prefix_with_lru(tmp_path):
    trace = _write_trace(tmp_path / "t.jsonl", FAVOURS_PREFIX)
    out = tmp_path / "hitrate.json"
    proc = _kvcache(
        "hitrate",
        "--trace",
        trace,
        "--trace-block-tokens",
        str(BT),
        "--capacities",
        "12,16",
        "--policies",
        "lru,prefix",
        "--out",
        str(out),
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    assert "prefix-aware eviction vs LRU" in proc.stdout
    rows = {r["capacity"]: r for r in json.loads(out.read_text())["prefix_vs_lru"]}
    assert rows[12]["prefix"] == pytest.approx(2 / 7) and rows[12]["lru"] == 0.0
    assert rows[12]["at_least"] and rows[16]["points"] == 0.0


def test_cli_smoke(tmp_path):
    trace = _write_trace(tmp_path / "t.jsonl", FAVOURS_LFU)
    out = tmp_path / "res" / "hitrate.json"
    proc = _kvcache(
        "hitrate",
        "--trace",
        trace,
        "--trace-block-tokens",
        str(BT),
        "--capacities",
        "8,12",
        "--policies",
        "lru,lfu",
        "--jobs",
        "2",
        "--out",
        str(out),
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    assert "block hit" in proc.stdout and "lfu" in proc.stdout
    doc = json.loads(out.read_text())
    got = {
        (r["setup"]["policy"], r["setup"]["capacity_tokens"]): r["hit_blocks"]
        for r in doc["results"]
    }
    assert got == {("lru", 8): 2, ("lfu", 8): 3, ("lru", 12): 4, ("lfu", 12): 4}
    assert doc["theoretical_max"]["hit_blocks"] == 4
    assert doc["trace"]["requests"] == 7
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_reports_bad_and_empty_traces(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 1, "input_length": 4\n'
    )
    proc = _kvcache(
        "hitrate", "--trace", str(bad), "--trace-block-tokens", str(BT), cwd=str(tmp_path)
    )
    assert proc.returncode == 2
    assert f"{bad}:2: not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = _kvcache("hitrate", "--trace", str(empty), cwd=str(tmp_path))
    assert proc.returncode == 1
    assert "has no requests" in proc.stderr
    proc = _kvcache("hitrate", "--trace", str(empty), "--capacities", "1M,zz", cwd=str(tmp_path))
    assert proc.returncode == 2 and "'zz' is not a count" in proc.stderr


def test_cli_out_of_order_trace_warns(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": t, "input_length": BT, "output_length": 1, "hash_ids": [i]}
        for i, t in enumerate([5, 1, 3])
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = _kvcache(
        "hitrate",
        "--trace",
        str(path),
        "--trace-block-tokens",
        str(BT),
        "--capacities",
        "8",
        "--policies",
        "lru",
        "--no-progress",
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    assert "out of timestamp order" in proc.stderr
    assert "(2 reordered)" in proc.stdout


@pytest.mark.slow
def test_synthetic_cli_is_seeded(tmp_path):
    args = [
        "hitrate",
        "--synthetic",
        "--synthetic-requests",
        "300",
        "--capacities",
        "200k,2M",
        "--policies",
        "lru",
        "--no-progress",
        "--seed",
        "3",
    ]
    a = _kvcache(*args, "--out", str(tmp_path / "a.json"), cwd=str(tmp_path))
    b = _kvcache(*args, "--out", str(tmp_path / "b.json"), cwd=str(tmp_path))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    ra = json.loads((tmp_path / "a.json").read_text())["results"]
    rb = json.loads((tmp_path / "b.json").read_text())["results"]
    assert [r["hit_blocks"] for r in ra] == [r["hit_blocks"] for r in rb]
    assert ra[0]["hit_blocks"] <= ra[1]["hit_blocks"]
    assert ra[1]["hit_blocks"] > 0


def test_bench_dispatcher_reports_missing_modules(monkeypatch):
    monkeypatch.setitem(bench_cli.COMMANDS, "ghost", ("bench.ghost_not_written", "test"))
    with pytest.raises(SystemExit, match="not available yet"):
        bench_cli.load_command("ghost")
    assert bench_cli.load_command("hitrate").__name__ == "bench.replay.hitrate"


def test_real_trace_prefix_reaches_its_documented_maximum():
    """The shared conversation trace: with infinite cache about 36.6% of blocks are hits."""
    path = os.path.join(REPO, "..", "shared", "data", "conversation_trace.jsonl")
    if not os.path.exists(path):
        pytest.skip("the shared conversation trace is not present")
    trace = load_trace(path)
    best = theoretical_max(trace, trace.block_keys())
    assert best.block_hit_rate == pytest.approx(0.366, abs=0.001)
