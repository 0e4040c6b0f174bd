"""``kvcache bench serve``'s workload: the trace mapped onto token ids a tiny model accepts keeps
its prefix structure; its reference hit rate; its option mistakes. (The replay itself runs
against real engines in ``make serve-demo``; the serving paths are tested in test_serving.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.replay.serve import arrival_times, ideal_hit_tokens, output_tokens, prompt_tokens
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


@pytest.mark.parametrize(
    "args, says",
    [
        (["--requests", "0"], "--requests must be >= 1"),
        (["--rate", "0"], "--rate positive"),
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
