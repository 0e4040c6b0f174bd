"""``kvcache bench serve``'s workload: the trace mapped onto token ids a tiny model accepts keeps
its prefix structure (and a salt gives each run its own tokens); its reference hit rate; its
goodput and the global-cache check; its option mistakes. (The replay itself runs against real
engines in ``make serve-demo``; the serving paths are tested in test_serving*.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.replay.serve import (
    arrival_times,
    bucket_quantile,
    global_cache_checks,
    ideal_hit_tokens,
    output_tokens,
    prompt_tokens,
)
from bench.replay.serve_load import Outcome, summarize
from bench.replay.trace import TraceRequest


def _request(ids: list[int], length: int, output: int = 512, at_ms: float = 0.0) -> TraceRequest:
    return TraceRequest(at_ms, length, output, tuple(ids))


def test_equal_hash_ids_give_equal_tokens_and_different_ids_different_ones():
    a = prompt_tokens(_request([1, 2, 3], 1500), 32, 1024, 512)
    b = prompt_tokens(_request([1, 2, 4], 1400), 32, 1024, 512)
    c = prompt_tokens(_request([1 + 509, 2, 3], 1500), 32, 1024, 512)
    assert len(a) == 94 and len(b) == 88  # 1500 and 1400 tokens scaled 32/512, rounded up
    assert a[:64] == b[:64] and a[64:88] != b[64:88]
    assert a[:32] != c[:32]  # no aliasing of ids that differ by the vocabulary size
    assert min(a + b) >= 3 and max(a + b) < 512  # never the tokenizer's special ids
    assert len(prompt_tokens(_request(list(range(40)), 40 * 512), 32, 1024, 512)) == 1024
    # another salt: the same structure, other tokens (a run is not served by another's cache)
    a2 = prompt_tokens(_request([1, 2, 3], 1500), 32, 1024, 512, salt=1)
    b2 = prompt_tokens(_request([1, 2, 4], 1400), 32, 1024, 512, salt=1)
    assert a2[:64] == b2[:64] and a2[:32] != a[:32] and len(a2) == len(a)


def test_outputs_scale_like_prompts_within_bounds():
    assert output_tokens(_request([1], 10, output=512), 32, 64) == 32
    assert output_tokens(_request([1], 10, output=4000), 32, 64) == 64
    assert output_tokens(_request([1], 10, output=1), 32, 64) == 1


def test_arrivals_keep_the_traces_spacing_at_the_given_mean_rate():
    # 5 requests over 72 s of trace at 2/s: the last one 2 s after the first, spacing kept
    trace = [_request([1], 10, at_ms=t) for t in (0, 0, 18_000, 36_000, 72_000)]
    assert arrival_times(trace, 2.0) == pytest.approx([0.0, 0.0, 0.5, 1.0, 2.0])
    assert arrival_times(trace, 0.5) == pytest.approx([0.0, 0.0, 2.0, 4.0, 8.0])
    # all at the same instant: evenly at the rate
    assert arrival_times([_request([1], 10)] * 3, 4.0) == pytest.approx([0.0, 0.25, 0.5])


def test_the_infinite_cache_holds_every_earlier_full_block():
    first = list(range(3, 3 + 100))
    second = first[:64] + [7] * 36
    assert ideal_hit_tokens([first, second, first], 32) == [0, 64, 96]


def _outcome(i: int, ttft: float | None, tpot: float | None, status: str = "ok") -> Outcome:
    o = Outcome(index=i, arrival_s=0.0, prompt_tokens=100, max_tokens=8, status=status)
    o.ttft_s, o.tpot_s, o.cached_tokens = ttft, tpot, 50
    return o


def test_goodput_counts_the_requests_within_both_slos():
    outcomes = [
        _outcome(0, 0.5, 0.05),  # within both
        _outcome(1, 0.5, None),  # one token: no TPOT to miss
        _outcome(2, 1.5, 0.05),  # TTFT missed
        _outcome(3, 0.5, 0.2),  # TPOT missed
        _outcome(4, None, None, "rejected"),
    ]
    s = summarize(outcomes, 2.0, [0, 64, 64, 64, 64], ttft_slo_s=1.0, tpot_slo_s=0.1)
    assert s["goodput_req_s"] == 1.0 and s["slo_attainment"] == 0.4 and s["req_s"] == 2.0
    assert s["hit_rate"] == 0.5 and s["hit_vs_ideal"] == 200 / 192


def test_global_cache_is_held_against_the_best_other_policy_per_mode_and_rate():
    rows = [
        {"mode": "aggregated", "rate": 1.0, "policy": p, "ttft_p50_ms": t}
        for p, t in (("global-cache", 90.0), ("load", 100.0), ("round-robin", 120.0))
    ] + [
        {"mode": "disaggregated", "rate": 1.0, "policy": p, "ttft_p50_ms": t}
        for p, t in (("global-cache", 110.0), ("load", 100.0))
    ]
    assert global_cache_checks(rows) == [
        "aggregated at 1/s: global-cache TTFT p50 = 0.90x the best other (load): no worse",
        "disaggregated at 1/s: global-cache TTFT p50 = 1.10x the best other (load): WORSE",
    ]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--requests", "0"], "--requests must be >= 1"),
        (["--rates", "0"], "--rates positive"),
        (["--rates", "x"], "--rates takes numbers"),
        (["--modes", "both"], "--modes takes aggregated, disaggregated"),
        (["--policies", ","], "--policies is empty"),
        (["--config", "/nonexistent.toml"], "no config /nonexistent.toml"),
    ],
)
def test_option_mistakes_say_what_to_fix(args, says):
    proc = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr


def test_pull_quantiles_come_from_the_engines_histogram_buckets():
    """What bench serve reads of the engines' Lookup-to-load histogram: quantiles interpolated
    within a bucket as Prometheus does, from a real prometheus_client histogram's exposition."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from clients.vllm_stats import REMOTE_LOAD_BUCKETS

    registry = CollectorRegistry()
    h = Histogram("loads", "", buckets=REMOTE_LOAD_BUCKETS, registry=registry)
    for seconds in [0.04] * 50 + [0.12] * 49 + [20.0]:  # one past the last bound
        h.observe(seconds)
    text = generate_latest(registry).decode()
    buckets = {
        float(s.labels["le"]): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "loads_bucket"
    }
    assert bucket_quantile(buckets, 0.5) == pytest.approx(0.05)  # the 50th of 50 in (0.03, 0.05]
    assert 0.1 < bucket_quantile(buckets, 0.9) <= 0.15
    assert bucket_quantile(buckets, 1.0) == 10.0  # past every bound: the largest one
    assert bucket_quantile({}, 0.5) is None
    assert bucket_quantile({0.1: 0.0, float("inf"): 0.0}, 0.99) is None
