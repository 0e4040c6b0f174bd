"""The scheduler's placements beyond prefill-then-decode: aggregated requests on one node of
role both (by cache hit and load), the per-request switch to disaggregated above an uncached
suffix, the round-robin policy and per-request policies, and a cost model calibrated by what is
measured, so that a transfer is planned only when its measured cost pays (the conductor in
process, real metadata-only stores feeding its index)."""

from __future__ import annotations

import pytest
from test_conductor_core import BT, Cluster, chain
from test_engine_load import VLLM_METRICS

from conductor import FittedCostModel, NodeLoad, Role
from conductor.costmodel import fit_line
from conductor.engine_load import parse_vllm_metrics
from conductor.scheduler import NoNodeAvailable
from kvstore import InvalidArgument

PAGE = 16 << 10  # a tiny model's page: what a transfer of a block moves


def fleet(**kw) -> Cluster:
    """p0 (prefill), d0 (decode), b0 and b1 (both)."""
    c = Cluster(prefill=1, decode=1, **kw)
    c.add("b0", Role.BOTH)
    c.add("b1", Role.BOTH)
    return c


def test_an_aggregated_request_goes_to_the_both_node_holding_its_prefix():
    c = fleet()
    keys = chain(8)
    c.put("b1", keys[:6])
    c.put("p0", keys)  # a prefill-only node holding more is no candidate
    d = c.schedule("r", keys, aggregated=True)
    assert d.aggregated and d.prefill_node == d.decode_node == "b1"
    assert d.local_blocks == 6  # and it may fetch the rest from the prefill node (global-cache)
    assert d.transfer is None or (d.transfer.src.node_id, d.transfer.dst.node_id) == ("p0", "b1")
    # the ledger counts it on that node for both roles
    b1 = c.registry.get("b1")
    assert (b1.prefill_pending, b1.decode_requests) == (1, 1)
    # disaggregated, the same request would have prefilled on the holder of all 8 blocks
    plain = c.schedule("plain", keys)
    assert not plain.aggregated and plain.prefill_node == "p0"


def test_aggregated_placement_weighs_the_decodes_a_node_is_running():
    c = fleet(policy="load")
    busy = NodeLoad(running_decode_requests=40, running_decode_tokens=400_000)
    c.registry.heartbeat("b0", c.now, busy)
    d = c.schedule("r", chain(4), aggregated=True)
    assert d.prefill_node == "b1"  # b0's prefill queue is empty, but it decodes a batch
    step = c.sched.cost_model.decode_step_seconds(40, 400_000)
    assert d.est_queue_s == 0.0
    c.registry.heartbeat("b1", c.now, busy)
    assert c.schedule("r2", chain(4, start=50), aggregated=True).est_queue_s >= step


def test_a_long_uncached_suffix_goes_disaggregated_above_the_threshold():
    c = fleet()
    keys = chain(8)
    c.put("b0", keys[:7])
    near = c.schedule("near", keys, extra_tokens=0, aggregated=True, disaggregate_above=2 * BT)
    assert near.aggregated and near.prefill_node == near.decode_node == "b0"
    far = c.schedule(
        "far", chain(8, start=100), extra_tokens=0, aggregated=True, disaggregate_above=2 * BT
    )
    assert not far.aggregated and far.decode_node != far.prefill_node
    # 0: never disaggregated
    never = c.schedule("never", chain(8, start=200), aggregated=True)
    assert never.aggregated
    # a fleet of both-role nodes only: the decode runs on another node than the prefill
    c = Cluster(prefill=0, decode=0)
    c.add("b0", Role.BOTH)
    c.add("b1", Role.BOTH)
    for i in range(3):
        d = c.schedule(f"f{i}", chain(8, 1000 * i), aggregated=True, disaggregate_above=BT)
        assert not d.aggregated and d.prefill_node != d.decode_node


def test_aggregated_serving_needs_a_both_node():
    c = Cluster(prefill=1, decode=1)
    with pytest.raises(NoNodeAvailable, match="role both"):
        c.schedule("r", chain(2), aggregated=True)
    c.add("b0", Role.BOTH)
    with pytest.raises(NoNodeAvailable, match="role both is left besides the excluded b0"):
        c.schedule("r", chain(2), aggregated=True, exclude=frozenset({"b0"}))


def test_round_robin_and_a_policy_named_per_request():
    c = Cluster(prefill=3, decode=2, policy="round-robin")
    c.put("p2", chain(8))
    picks = [c.schedule(f"r{i}", chain(8)) for i in range(6)]
    assert [d.prefill_node for d in picks] == ["p0", "p1", "p2"] * 2  # the cache is no draw
    assert [d.decode_node for d in picks] == ["d0", "d1"] * 3
    # the scheduler's own policy, global-cache, or the one a request names
    c = Cluster(prefill=3, decode=1)
    c.put("p2", chain(8))
    assert c.schedule("g", chain(8)).prefill_node == "p2"
    named = [c.schedule(f"n{i}", chain(8), policy="round-robin") for i in range(3)]
    assert [d.prefill_node for d in named] == ["p0", "p1", "p2"]
    assert {d.policy for d in named} == {"round-robin"}
    with pytest.raises(InvalidArgument, match="unknown scheduling policy"):
        c.schedule("x", chain(8), policy="fastest")


def test_a_transfer_is_planned_only_while_its_measured_cost_pays():
    """A tiny model's prefill (fitted) beside the analytic transfer estimate (1 ms): fetching
    the prefix to an idle node looks better than queueing 10 ms behind its holder, until the
    router reports what the transfers really took (133 ms each): then the holder wins."""
    tiny = FittedCostModel(quad=0.0, lin=2e-6, const=1e-3)
    c = Cluster(prefill=2, refit_every=4)
    c.sched.cost_model = c.sched.calibration.base = tiny
    keys = chain(16)
    c.put("p0", keys)

    def place(rid: str):
        c.registry.heartbeat("p0", c.now, NodeLoad(queued_prefill_tokens=5_000))  # 10 ms
        return c.schedule(rid, keys, block_bytes=PAGE)

    fetched = [place(f"f{i}") for i in range(4)]
    assert all(d.prefill_node == "p1" and d.transfer is not None for d in fetched)
    assert fetched[0].est_transfer_s < 0.01
    for d in fetched:
        c.sched.prefill_done(d.request_id, transfer_s=0.133)  # what the router waited
        c.sched.complete(d.request_id)
    d = place("after")
    assert d.prefill_node == "p0" and d.transfer is None
    assert c.sched.cost_model.transfer_seconds(16 * PAGE) == pytest.approx(0.133)
    assert c.sched.cost_model.prefill_seconds(1000) == tiny.prefill_seconds(1000)  # kept


def test_engine_metrics_calibrate_prefill_and_decode_estimates():
    """Between two scrapes, finished requests give their mean prefill time for their mean
    computed tokens, and the mean inter-token latency of the batch's context."""
    extra = (
        'vllm:request_prefill_time_seconds_count{{engine="0"}} {n}\n'
        'vllm:request_prefill_time_seconds_sum{{engine="0"}} {s}\n'
        'vllm:inter_token_latency_seconds_count{{engine="0"}} {g}\n'
        'vllm:inter_token_latency_seconds_sum{{engine="0"}} {t}\n'
    )
    after = parse_vllm_metrics(
        VLLM_METRICS.replace(
            'tokens_count{engine="0",model_name="tiny-llama"} 4.0',
            'tokens_count{engine="0",model_name="tiny-llama"} 6.0',
        ).replace(
            'tokens_sum{engine="0",model_name="tiny-llama"} 1200.0',
            'tokens_sum{engine="0",model_name="tiny-llama"} 2000.0',
        )
        + extra.format(n=6, s=0.9, g=110, t=1.5)
    )
    before = parse_vllm_metrics(VLLM_METRICS + extra.format(n=4, s=0.5, g=10, t=0.5))
    prefills, steps = after.measured_since(before)
    assert [(p.tokens, p.prefix_tokens) for p in prefills] == [(400, 0)]
    assert prefills[0].seconds == pytest.approx(0.2)
    assert steps == [(32768, pytest.approx(0.01))]
    assert before.measured_since(after) == ([], [])  # counters went back: a restarted engine
    # fed to the scheduler, they refit the model
    c = Cluster(prefill=1, refit_every=4)
    for i in range(4):
        c.sched.engine_samples(
            [type(prefills[0])(100 * (i + 1), 0, 0.001 + 1e-4 * 100 * (i + 1))],
            [(1000 * (i + 1), 0.005 + 1e-6 * 1000 * (i + 1))],
        )
    m = c.sched.cost_model
    assert m.prefill_seconds(500) == pytest.approx(0.051, rel=1e-3)
    assert m.decode_step_seconds(3, 2000) == pytest.approx(0.007, rel=1e-3)


def test_fit_line_keeps_terms_non_negative():
    assert fit_line([(1, 2), (2, 3)]) is None  # too few
    assert fit_line([(0, 1), (1, 3), (2, 5)]) == pytest.approx((1.0, 2.0))
    assert fit_line([(5, 1), (5, 3), (5, 2)]) == pytest.approx((2.0, 0.0))  # one size: a mean
    assert fit_line([(0, 5), (1, 3), (2, 1)]) == pytest.approx((3.0, 0.0))  # falling: a mean
