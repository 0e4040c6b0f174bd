"""The pool's gate (clients.pull_gate): what it learns of the engine's compute from the
scheduler's steps, what it learns of pulls, and when it lets a pull be made."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.pull_gate import CHUNK, EXPLORE, PullGate
from clients.vllm_setup import ConnectorConfig


def run_engine(
    gate: PullGate,
    fixed_s: float,
    per_token_s: float,
    steps: list[int],
    *,
    shifted: bool,
    rng: random.Random,
    start: float = 0.0,
) -> float:
    """Feed ``gate`` the scheduler's view of a busy engine whose step of n tokens takes
    ``fixed_s + per_token_s * n`` (+-5%). ``shifted``: vLLM's asynchronous scheduling, where the
    step is scheduled while the one before it still runs (each interval holds the step before)."""
    now = start
    before = 0.0
    for i, n in enumerate(steps):
        gate.step(now, n, continued=i > 0)
        took = (fixed_s + per_token_s * n) * rng.uniform(0.95, 1.05)
        now += before if shifted else took
        before = took
    return now


@settings(max_examples=40, deadline=None)
@given(
    fixed_ms=st.floats(1, 50),
    per_token_us=st.floats(5, 2000),
    shifted=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_the_compute_per_token_is_learned_from_busy_steps(fixed_ms, per_token_us, shifted, seed):
    """Prefills of hundreds of tokens among decode steps of a few, scheduled one after another or
    a step ahead: the seconds 1000 more tokens add come out within 25% of the truth."""
    rng = random.Random(seed)
    gate = PullGate(1.0, lag=int(shifted))
    steps = [rng.choice([rng.randint(1, 8), rng.randint(100, 2048)]) for _ in range(CHUNK * 40)]
    run_engine(gate, fixed_ms / 1e3, per_token_us / 1e6, steps, shifted=shifted, rng=rng)
    got = gate.compute_s(1000)
    assert got is not None
    want = per_token_us / 1e6 * 1000
    assert abs(got - want) <= 0.25 * want, (got, want)


def test_an_idle_engine_between_requests_is_not_counted_as_compute():
    """A step after the engine idled (no request ran on from the step before) starts a new run:
    an hour between two requests is not an hour of compute."""
    rng = random.Random(1)
    gate = PullGate(1.0)
    now = 0.0
    for _ in range(30):
        now = run_engine(gate, 0.005, 1e-4, [512, 4, 4, 4, 300, 4, 4, 4, 4], shifted=False,
                         rng=rng, start=now)  # fmt: skip
        now += 3600.0  # idle; the next request's first step does not continue a running one
        gate.step(now, 0, continued=False)
    got = gate.compute_s(1000)
    assert got is not None and got < 0.2, got


def test_pulls_are_made_while_either_side_is_unmeasured():
    gate = PullGate(1.0)
    assert gate.compute_s(1000) is None and gate.pull_s(4) is None
    assert gate.worth(4, 1000)  # nothing measured: pull (that is how pulls get measured)
    gate.pulled(4, 10.0)
    assert gate.worth(4, 1000)  # the compute is still unknown


def test_a_small_model_computes_what_a_slow_pull_would_bring_and_a_large_one_pulls_it():
    """The figures measured here (bench.micro.pool_ttft): a 2-layer model computes 1000 tokens
    in ~41 ms where a remote hit waits ~80 ms; a 125M model takes ~3 s for 2048 tokens where the
    pull waits ~350 ms."""
    rng = random.Random(2)
    tiny, big = PullGate(1.0, lag=1), PullGate(1.0, lag=1)
    steps = [rng.choice([2, 3, 1000, 400]) for _ in range(CHUNK * 20)]
    run_engine(tiny, 0.006, 35e-6, steps, shifted=True, rng=rng)
    run_engine(big, 0.030, 1.45e-3, steps, shifted=True, rng=rng)
    for pages, wait in [(4, 0.080), (2, 0.070), (8, 0.095)]:
        tiny.pulled(pages, wait)
        big.pulled(pages * 2, wait * 4.4)
    assert not tiny.worth(4, 1000)
    assert big.worth(8, 2048)
    # a slower pull is still made while it costs at most pull_max_cost times the compute
    lenient = PullGate(3.0, lag=1)
    run_engine(lenient, 0.006, 35e-6, steps, shifted=True, rng=rng)
    lenient.pulled(4, 0.080)
    assert lenient.worth(4, 1000)  # 80 ms <= 3 x ~35 ms


def test_one_refused_pull_in_explore_is_made_so_a_pool_that_got_faster_is_seen():
    rng = random.Random(3)
    gate = PullGate(1.0)
    run_engine(gate, 0.006, 35e-6, [2, 1000] * (CHUNK * 5), shifted=False, rng=rng)
    gate.pulled(4, 0.5)
    made = sum(gate.worth(4, 1000) for _ in range(EXPLORE * 3))
    assert made == 3
    for _ in range(64):  # the pool got faster: the pulls made anyway measured it
        gate.pulled(4, 0.001)
    assert gate.worth(4, 1000)


def test_always_pull_and_bad_settings():
    gate = PullGate(math.inf)
    gate.pulled(4, 100.0)
    run_engine(gate, 0.001, 1e-6, [2, 1000] * CHUNK * 4, shifted=False, rng=random.Random(4))
    assert all(gate.worth(4, 10) for _ in range(100))
    for value, want in (("inf", math.inf), (2, 2.0)):
        config = ConnectorConfig.from_extra({"node": "h:1", "pull_max_cost": value})
        assert config.pull_max_cost == want
    for bad in (0, -1, "lots", None, "nan"):
        with pytest.raises(ValueError, match="pull_max_cost must be a number > 0"):
            ConnectorConfig.from_extra({"node": "h:1", "pull_max_cost": bad})
    with pytest.raises(ValueError, match="pull_max_cost"):
        PullGate(0)
