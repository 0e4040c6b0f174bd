"""``kvcache bench schedule``: the real conductor scheduler on small seeded traces."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.replay.schedule import ClusterSim, ClusterSpec, offered_load, simulate
from bench.replay.trace import Trace, TraceRequest

BT = 512
DOC = list(range(1000, 1016))  # a 16-block shared document (8,192 tokens)


def make_trace(items: list[tuple[float, list[int]]], output_tokens: int = 10) -> Trace:
    """(arrival seconds, block ids) per request; prompts are whole blocks."""
    reqs = [TraceRequest(t * 1000.0, BT * len(ids), output_tokens, tuple(ids)) for t, ids in items]
    return Trace(requests=reqs, block_tokens=BT, source="test")


def run_policy(trace: Trace, policy: str, **spec) -> "object":
    spec = ClusterSpec(**{"decode_nodes": 1, "decode_capacity_tokens": 0, **spec})
    return ClusterSim(trace, trace.block_keys(), spec, policy).run()


def test_cached_prefix_shortens_prefill_exactly():
    # One node: the second request reuses the first one's 16 blocks and computes 1 new block.
    trace = make_trace([(0.0, DOC), (100.0, DOC + [1])])
    spec = ClusterSpec(prefill_nodes=1, decode_nodes=1, decode_capacity_tokens=0)
    cost = spec.cost_model()
    r = ClusterSim(trace, trace.block_keys(), spec, "global-cache").run()
    first = cost.prefill_seconds(16 * BT, 0)
    second = cost.prefill_seconds(17 * BT, 16 * BT)
    assert r.admitted == 2 and r.rejected == 0
    assert r.ttft_avg_s == pytest.approx((first + second) / 2)
    assert r.hit_rate == pytest.approx(16 / 33)
    assert r.prefill_gpu_s == pytest.approx(first + second)
    assert r.prefill_gpu_s_no_cache == pytest.approx(first + cost.prefill_seconds(17 * BT, 0))
    assert r.transfers == 0 and r.queue_avg_s == 0.0


def test_global_cache_beats_random_when_a_prefix_is_popular():
    # 24 requests, 20 s apart (no queueing), all quoting one document. Random placement spreads
    # them over 8 nodes that each compute the document once; global-cache fetches it instead.
    trace = make_trace([(20.0 * i, DOC + [i]) for i in range(24)])
    spec = dict(prefill_nodes=8, seed=1)
    rand = run_policy(trace, "random", **spec)
    glob = run_policy(trace, "global-cache", **spec)
    assert glob.ttft_avg_s < rand.ttft_avg_s
    assert glob.hit_rate > rand.hit_rate
    assert glob.prefill_gpu_s < rand.prefill_gpu_s
    assert rand.transfers == 0
    # Same seed, same result.
    again = run_policy(trace, "random", **spec)
    assert again.ttft_avg_s == rand.ttft_avg_s


def test_global_cache_fetches_when_the_holder_is_busy():
    # A burst of 8 requests for the same document right after it was cached on one node:
    # local-cache queues them on the holder or recomputes elsewhere; global-cache copies the
    # document to idle nodes.
    warm = [(0.0, DOC + [0])]
    burst = [(30.0, DOC + [100 + i]) for i in range(8)]
    trace = make_trace(warm + burst)
    local = run_policy(trace, "local-cache", prefill_nodes=4)
    glob = run_policy(trace, "global-cache", prefill_nodes=4)
    assert glob.transfers > 0 and glob.fetched_share > 0
    assert glob.ttft_avg_s < local.ttft_avg_s
    assert local.transfers == 0


def test_ttft_slo_rejections_are_counted():
    # One node, prompts of 16 unique blocks: the first of a burst of 5 meets an SLO of 1.5
    # prefills; the other 4 would queue behind it and are rejected. A later request is admitted.
    spec = ClusterSpec(prefill_nodes=1, decode_nodes=1, decode_capacity_tokens=0)
    one = spec.cost_model().prefill_seconds(16 * BT, 0)
    trace = make_trace(
        [(0.0, [10 * i + b for b in range(16)]) for i in range(1, 6)]
        + [(100.0, list(range(500, 516)))]
    )
    r = run_policy(trace, "load", prefill_nodes=1, ttft_slo_s=1.5 * one)
    assert (r.admitted, r.rejected_ttft, r.rejected_tbt) == (2, 4, 0)
    assert r.ttft_avg_s == pytest.approx(one)


def test_tbt_slo_rejections_are_counted():
    # One decode step of a 70B model reads ~118 GB of weights (~12 ms): a 1 ms TBT SLO rejects
    # everything.
    trace = make_trace([(float(i), [i]) for i in range(5)])
    r = run_policy(trace, "global-cache", prefill_nodes=2, tbt_slo_s=0.001)
    assert (r.admitted, r.rejected_ttft, r.rejected_tbt) == (0, 0, 5)


def test_parallel_policies_match_sequential():
    trace = make_trace([(2.0 * i, DOC[: 4 + i % 5] + [i]) for i in range(30)])
    spec = ClusterSpec(
        prefill_nodes=3, decode_nodes=2, capacity_tokens=20 * BT, decode_capacity_tokens=10 * BT
    )
    policies = ["random", "load", "local-cache", "global-cache"]
    seq = simulate(trace, trace.block_keys(), spec, policies, jobs=1)
    par = simulate(trace, trace.block_keys(), spec, policies, jobs=2)
    assert [r.policy for r in par] == policies
    strip = lambda r: (r.ttft_avg_s, r.hit_rate, r.transfers, r.rejected)  # noqa: E731
    assert [strip(r) for r in par] == [strip(r) for r in seq]


def test_offered_load_and_bad_specs():
    trace = make_trace([(0.0, DOC), (10.0, DOC)])
    spec = ClusterSpec(prefill_nodes=2)
    work = 2 * spec.cost_model().prefill_seconds(16 * BT, 0)
    assert offered_load(trace, spec) == pytest.approx(work / (2 * 10.0))
    with pytest.raises(ValueError, match="less than one 512-token block"):
        ClusterSpec(capacity_tokens=100).check(BT)
    with pytest.raises(ValueError, match="mfu"):
        ClusterSpec(mfu=0.0).check(BT)


def _kvcache(*args: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_smoke(tmp_path):
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        for i in range(12):
            ids = DOC[:8] + [i]
            f.write(
                json.dumps(
                    {
                        "timestamp": 500 * i,
                        "input_length": BT * len(ids) - 100,
                        "output_length": 20,
                        "hash_ids": ids,
                    }
                )
                + "\n"
            )
    out = tmp_path / "r" / "schedule.json"
    proc = _kvcache(
        "schedule",
        "--trace",
        str(path),
        "--prefill-nodes",
        "3",
        "--decode-nodes",
        "2",
        "--capacity",
        "20k",
        "--out",
        str(out),
        "--jobs",
        "2",
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    assert "global-cache" in proc.stdout and "paper" in proc.stdout
    assert "MFU 0.30" in proc.stdout
    doc = json.loads(out.read_text())
    assert [r["policy"] for r in doc["results"]] == [
        "random",
        "load",
        "local-cache",
        "global-cache",
    ]
    assert all(r["detail"]["admitted"] == 12 for r in doc["results"])
    assert doc["paper_comparable"] is False
    assert doc["paper_fig5_avg_ttft_s"]["global-cache"] == 3.07
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_cli_rejects_bad_options(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]})
        + "\n"
    )
    proc = _kvcache("schedule", "--trace", str(path), "--policies", "fastest", cwd=str(tmp_path))
    assert proc.returncode == 2 and "unknown ['fastest']" in proc.stderr
    proc = _kvcache("schedule", "--trace", str(path), "--capacity", "100", cwd=str(tmp_path))
    assert proc.returncode == 2 and "less than one 512-token block" in proc.stderr
    assert "Traceback" not in proc.stderr
