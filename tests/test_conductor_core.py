"""The conductor's core in-process: cost model, global index, registry, scheduler, transfer hook.

Scenarios are built with real kvstore stores (metadata only) whose events feed the index, the
same way node servers' event streams do."""

from __future__ import annotations

import logging
import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor import (
    FittedCostModel,
    FlopsCostModel,
    GlobalIndex,
    NodeDescriptor,
    NodeLoad,
    Registry,
    Request,
    Role,
    Scheduler,
    SchedulerConfig,
    SequenceGap,
    SLORejected,
    TransferPlan,
    fit_prefill,
)
from conductor.core import Conductor, StaleFeed
from conductor.costmodel import HardwareSpec, ModelSpec, PrefillSample, with_mfu
from conductor.scheduler import NoNodeAvailable, make_policy
from conductor.transfer import RecordingTransferHook, TransferDispatcher, TransferHook
from kvstore import (
    InvalidArgument,
    KVLayout,
    NotFound,
    StoreConfig,
    Tier,
    TieredStore,
    keys_from_block_ids,
    root_key,
)
from kvstore.events import BlockEvent, EventKind

from helpers import wait_until

BT = 512
LAYOUT = KVLayout(model="m", num_layers=2, kv_heads=1, head_dim=4, block_tokens=BT)


# ---- factories ----------------------------------------------------------------------------------


def chain(n: int, start: int = 0, ns: str = LAYOUT.namespace) -> list[bytes]:
    return keys_from_block_ids(list(range(start, start + n)), root_key(ns))


def make_store(pages: int = 64) -> TieredStore:
    return TieredStore(LAYOUT, StoreConfig(dram_pages=pages, metadata_only=True))


def store_keys(store: TieredStore, keys) -> None:
    lease = store.allocate(keys)
    store.commit(lease.lease_id)


class Cluster:
    """Registry + index + scheduler with real (metadata-only) stores behind each node."""

    def __init__(
        self, prefill: int = 2, decode: int = 1, policy: str = "global-cache", **config
    ) -> None:
        self.now = 0.0
        self.index = GlobalIndex()
        self.registry = Registry(self.index)
        self.sched = Scheduler(
            self.registry,
            policy=policy,
            config=SchedulerConfig(**config),
            clock=lambda: self.now,
            seed=7,
        )
        self.stores: dict[str, TieredStore] = {}
        for i in range(prefill):
            self.add(f"p{i}", Role.PREFILL)
        for i in range(decode):
            self.add(f"d{i}", Role.DECODE)

    def add(self, node_id: str, role: Role) -> None:
        self.registry.register(
            NodeDescriptor(node_id=node_id, role=role, layouts=(LAYOUT,)), self.now
        )
        self.stores[node_id] = make_store()

    def put(self, node_id: str, keys) -> None:
        store_keys(self.stores[node_id], keys)
        self.index.apply_events(node_id, self.stores[node_id].take_events())

    def request(self, rid: str, keys, extra_tokens: int = 100, **kw) -> Request:
        return Request(
            request_id=rid,
            keys=keys,
            prompt_tokens=len(keys) * BT + extra_tokens,
            block_tokens=BT,
            namespace=LAYOUT.namespace,
            **kw,
        )

    def schedule(self, rid: str, keys, **kw):
        return self.sched.schedule(self.request(rid, keys, **kw))


# ---- cost model ---------------------------------------------------------------------------------


def test_flops_formula_and_table1_defaults():
    m = FlopsCostModel()
    n, l, d = 8192, 80, 8192
    assert m.flops(n) == l * (4 * n * n * d + 22 * n * d * d)
    assert m.model.kv_bytes_per_token == 80 * 2 * (8192 // 8) * 2 == 327_680
    rate = 8 * 312e12 * m.hardware.mfu
    assert m.prefill_seconds(n) == pytest.approx(m.flops(n) / rate)
    # A cached prefix removes its own FLOPs: the suffix still attends to the whole prompt.
    assert m.prefill_seconds(n, 4096) == pytest.approx((m.flops(n) - m.flops(4096)) / rate)
    assert m.prefill_seconds(n, n) == 0.0
    assert m.prefill_seconds(n, 2 * n) == 0.0
    nic = 800e9 / 8 * m.hardware.nic_efficiency
    assert m.transfer_seconds(m.kv_bytes(1000)) == pytest.approx(
        m.hardware.transfer_latency_s + 1000 * 327_680 / nic
    )
    assert m.transfer_seconds(0) == 0.0
    # Decode reads the weights once per step plus every request's KV cache.
    assert m.decode_step_seconds(2, 1000) > m.decode_step_seconds(1, 0) > 0
    assert with_mfu(m, 0.25).prefill_seconds(n) == pytest.approx(2 * m.prefill_seconds(n))
    with pytest.raises(InvalidArgument):
        m.prefill_seconds(-1)
    with pytest.raises(InvalidArgument):
        with_mfu(m, 0.0)


def test_fit_recovers_coefficients_from_measurements():
    truth = FittedCostModel(quad=3e-9, lin=2e-5, const=0.004)
    samples = [
        PrefillSample(n, p, truth.prefill_seconds(n, p))
        for n in (512, 2048, 4096, 8192, 16384)
        for p in (0, n // 4, n // 2)
    ]
    fit = fit_prefill(samples)
    assert fit.quad == pytest.approx(3e-9, rel=1e-6)
    assert fit.lin == pytest.approx(2e-5, rel=1e-6)
    assert fit.const == pytest.approx(0.004, rel=1e-6)
    # The analytic model is the special case const = 0: fitting its own output gives it back.
    flops = FlopsCostModel(model=ModelSpec(layers=32, hidden=4096), hardware=HardwareSpec(mfu=0.4))
    fit = fit_prefill(
        [(n, p, flops.prefill_seconds(n, p)) for n in (1000, 3000, 7000, 12000) for p in (0, 500)],
        base=flops,
    )
    assert (fit.quad, fit.lin) == pytest.approx(flops.coefficients()[:2], rel=1e-6)
    assert fit.const == pytest.approx(0.0, abs=1e-9)
    assert fit.kv_bytes(10) == flops.kv_bytes(10)


def test_fit_rejects_too_few_or_degenerate_samples():
    with pytest.raises(InvalidArgument, match=">= 3 samples"):
        fit_prefill([(100, 0, 1.0), (200, 0, 2.0)])
    with pytest.raises(InvalidArgument, match="vary the suffix"):
        fit_prefill([(100, 0, 1.0)] * 5)
    with pytest.raises(InvalidArgument, match="non-negative"):
        fit_prefill([(100, 0, -1.0), (200, 0, 1.0), (300, 0, 2.0)])


# ---- global index -------------------------------------------------------------------------------


def ev(seq, kind, key, tier=Tier.DRAM):
    return BlockEvent(seq, kind, key, tier)


def test_index_prefix_lengths_follow_stored_and_evicted_events():
    idx = GlobalIndex()
    for n in ("a", "b", "c"):
        idx.add_node(n)
    keys = chain(6)
    idx.apply_events("a", [ev(i + 1, EventKind.STORED, k) for i, k in enumerate(keys[:5])])
    # b holds blocks 0, 1 and 3: its usable prefix stops at the hole.
    idx.apply_events(
        "b",
        [
            ev(1, EventKind.STORED, keys[0]),
            ev(2, EventKind.STORED, keys[1]),
            ev(3, EventKind.STORED, keys[3], Tier.SSD),
        ],
    )
    assert idx.prefix_lengths(keys) == {"a": 5, "b": 2}
    assert idx.holders(keys[3]) == {"a": Tier.DRAM, "b": Tier.SSD}
    idx.apply_events("a", [ev(6, EventKind.EVICTED, keys[2])])
    assert idx.prefix_lengths(keys) == {"a": 2, "b": 2}
    idx.apply_events("a", [ev(7, EventKind.STORED, keys[0], Tier.SSD)])  # demoted
    assert idx.tiers("a", keys[:2]) == [Tier.SSD, Tier.DRAM]
    assert idx.blocks("a") == 4 and idx.blocks("b") == 3
    assert idx.prefix_lengths(chain(3, start=100)) == {}
    assert idx.prefix_lengths([]) == {}


@settings(max_examples=200, deadline=None)
@given(
    held=st.lists(st.sets(st.integers(0, 11)), min_size=1, max_size=5),
    tiers=st.lists(st.sampled_from([Tier.GPU, Tier.DRAM, Tier.SSD]), min_size=12, max_size=12),
    query=st.lists(st.integers(0, 13), max_size=14),
)
def test_index_prefix_lengths_match_a_walk_of_each_node(held, tiers, query):
    """Against the definition: per node, the leading query keys it holds (any tier), nodes
    holding none left out; nodes listed by prefix length (shortest first) then slot."""
    keys = chain(14)
    idx = GlobalIndex()
    for n, blocks in enumerate(held):
        idx.add_node(f"n{n}")
        idx.apply_events(
            f"n{n}",
            [ev(i + 1, EventKind.STORED, keys[b], tiers[b]) for i, b in enumerate(sorted(blocks))],
        )
    asked = [keys[b] for b in query]
    expected = {}
    for n, blocks in enumerate(held):
        length = next((i for i, b in enumerate(query) if b not in blocks), len(query))
        if length:
            expected[f"n{n}"] = length
    got = idx.prefix_lengths(asked)
    assert got == expected
    assert list(got) == sorted(expected, key=lambda n: (expected[n], int(n[1:])))


def test_index_gap_raises_after_applying_what_came_before():
    idx = GlobalIndex()
    idx.add_node("a")
    keys = chain(4)
    with pytest.raises(SequenceGap) as e:
        idx.apply_events(
            "a",
            [
                ev(1, EventKind.STORED, keys[0]),
                ev(2, EventKind.STORED, keys[1]),
                ev(4, EventKind.STORED, keys[3]),
            ],
        )
    assert (e.value.expected, e.value.got) == (3, 4)
    assert "resync" in str(e.value)
    assert idx.last_seq("a") == 2
    assert idx.prefix_lengths(keys) == {"a": 2}
    # Replays of applied events (a reconnect) are skipped, not double counted.
    assert (
        idx.apply_events("a", [ev(2, EventKind.STORED, keys[1]), ev(3, EventKind.STORED, keys[2])])
        == 1
    )
    assert idx.blocks("a") == 3


def test_index_resync_swaps_in_the_snapshot_atomically():
    idx = GlobalIndex()
    idx.add_node("a")
    old, new = chain(4), chain(3, start=50)
    idx.apply_events("a", [ev(i + 1, EventKind.STORED, k) for i, k in enumerate(old)])
    idx.begin_resync("a")
    idx.load_snapshot("a", [(k, int(Tier.DRAM) + 1) for k in new])
    assert idx.is_resyncing("a")
    assert idx.prefix_lengths(old) == {"a": 4}  # queries still see the old entries
    assert idx.prefix_lengths(new) == {}
    with pytest.raises(Exception, match="resyncing"):
        idx.apply_events("a", [ev(5, EventKind.STORED, new[0])])
    idx.finish_resync("a", snapshot_seq=40)
    assert idx.prefix_lengths(old) == {} and idx.prefix_lengths(new) == {"a": 3}
    assert idx.last_seq("a") == 40 and idx.blocks("a") == 3
    with pytest.raises(SequenceGap):
        idx.apply_events("a", [ev(42, EventKind.EVICTED, new[2])])
    assert idx.sweep() is True
    assert len(idx) == 3  # the old keys are gone from memory once swept


def test_index_dropped_node_vanishes_at_once_and_its_slot_is_reused_clean():
    idx = GlobalIndex()
    idx.add_node("a")
    idx.add_node("b")
    keys = chain(3)
    idx.apply_events("a", [ev(i + 1, EventKind.STORED, k) for i, k in enumerate(keys)])
    idx.apply_events("b", [ev(1, EventKind.STORED, keys[0])])
    assert idx.drop_node("a") is True and idx.drop_node("a") is False
    assert idx.prefix_lengths(keys) == {"b": 1}
    with pytest.raises(NotFound):
        idx.apply_events("a", [])
    # Sweep in small steps, as the service's upkeep does.
    steps = 0
    while not idx.sweep(max_keys=1):
        steps += 1
    assert steps >= 2
    idx.add_node("c")  # reuses a's slot: none of a's blocks may show up as c's
    assert idx.stats().slots == 2
    assert idx.prefix_lengths(keys) == {"b": 1}
    assert len(idx) == 1


def test_index_rejects_malformed_events():
    idx = GlobalIndex()
    idx.add_node("a")
    with pytest.raises(ValueError, match="unknown kind"):
        idx.apply_events("a", [BlockEvent(1, 9, chain(1)[0], Tier.DRAM)])
    assert idx.last_seq("a") == 0


# ---- registry -----------------------------------------------------------------------------------


def test_registry_leases_heartbeats_and_reregistration():
    idx = GlobalIndex()
    reg = Registry(idx, lease_s=5.0)
    s1 = reg.register(NodeDescriptor(node_id="n1", role="prefill"), now=0.0)
    reg.register(NodeDescriptor(node_id="n2", role="decode"), now=0.0)
    reg.heartbeat("n1", now=4.0, load=NodeLoad(queued_prefill_tokens=7))
    assert reg.get("n1").load.queued_prefill_tokens == 7
    assert [s.node_id for s in reg.expire(now=6.0)] == ["n2"]
    assert "n2" not in reg and not idx.has_node("n2")
    with pytest.raises(NotFound, match="register again"):
        reg.heartbeat("n2", now=6.0)
    s1b = reg.register(NodeDescriptor(node_id="n1", role="prefill"), now=7.0)
    assert s1b.generation > s1.generation
    with pytest.raises(NotFound):
        reg.heartbeat("n1", now=7.5, generation=s1.generation)  # an old agent's heartbeat
    for bad in ("", "bad id", "x" * 200, "-x"):
        with pytest.raises(InvalidArgument, match="node id"):
            NodeDescriptor(node_id=bad)
    with pytest.raises(InvalidArgument, match="role"):
        NodeDescriptor(node_id="n", role="cook")


# ---- scheduling scenarios -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["local-cache", "global-cache"])
def test_longest_prefix_wins_when_idle(policy):
    c = Cluster(prefill=3, policy=policy)
    keys = chain(16)
    c.put("p0", keys[:4])
    c.put("p2", keys[:12])
    d = c.schedule("r", keys)
    assert (d.prefill_node, d.local_blocks, d.reuse_blocks, d.best_blocks) == ("p2", 12, 12, 12)
    assert d.transfer is None and d.decode_node == "d0"
    assert d.est_prefill_s == pytest.approx(
        c.sched.cost_model.prefill_seconds(16 * BT + 100, 12 * BT)
    )


def test_loaded_holder_loses_to_idle_node_that_fetches():
    c = Cluster(prefill=2)
    keys, other = chain(16), chain(64, start=1000)
    c.put("p0", keys)
    c.put("p0", other[:32])
    busy = c.schedule("busy", other)  # half cached on p0: cheaper there than fetching
    assert busy.prefill_node == "p0" and busy.transfer is None
    assert c.sched.queue_seconds(c.registry.get("p0"), c.now) == pytest.approx(busy.est_prefill_s)
    c.put("p1", keys[:4])
    d = c.schedule("r", keys)
    assert d.prefill_node == "p1"
    assert (d.local_blocks, d.reuse_blocks, d.best_blocks) == (4, 16, 16)
    plan = d.transfer  # only the blocks p1 lacks
    assert plan is not None and plan.src.node_id == "p0" and plan.dst.node_id == "p1"
    assert list(plan.keys) == keys[4:] and plan.first_block == 4
    assert plan.nbytes == 12 * c.sched.cost_model.kv_bytes(BT)
    assert d.est_transfer_s == pytest.approx(c.sched.cost_model.transfer_seconds(plan.nbytes))
    assert d.est_ttft_s == pytest.approx(max(d.est_queue_s, d.est_transfer_s) + d.est_prefill_s)
    assert d.est_ttft_s < busy.est_prefill_s  # better than queueing behind the holder's work


def test_local_cache_policy_never_transfers():
    c = Cluster(prefill=2, policy="local-cache")
    keys = chain(16)
    c.put("p0", keys[:8])
    c.put("p1", keys[:2])
    c.schedule("busy", chain(40, start=5000))  # goes to an idle node, not the holder
    d = c.schedule("r", keys)
    assert d.transfer is None and d.reuse_blocks == d.local_blocks


def test_min_transfer_gain_threshold_blocks_marginal_fetches():
    keys = chain(16)
    for gain, fetches in ((0.0, True), (0.99, False)):
        c = Cluster(prefill=2, min_transfer_gain=gain)
        c.put("p1", keys)
        c.registry.heartbeat("p1", c.now, NodeLoad(queued_prefill_tokens=200_000))
        d = c.schedule("r", keys)
        assert (d.transfer is not None) is fetches
        if fetches:  # the fetch wins by far more than nothing
            assert (d.prefill_node, d.reuse_blocks) == ("p0", 16)


def test_rejections_name_the_slo():
    c = Cluster(prefill=2)
    keys = chain(16)
    with pytest.raises(SLORejected, match="TTFT SLO of 1.0 ms cannot be met") as e:
        c.schedule("r1", keys, ttft_slo_s=0.001)
    assert e.value.slo == "TTFT" and e.value.estimate_s > 0.001
    with pytest.raises(SLORejected, match="TBT SLO"):
        c.schedule("r2", keys, tbt_slo_s=1e-6)
    assert c.sched.pending() == 0  # rejected requests leave no trace in the ledger
    d = c.schedule("r3", keys, ttft_slo_s=100.0, tbt_slo_s=1.0)
    assert d.est_ttft_s < 100.0


def test_ledger_queue_reanchors_on_prefill_done_and_complete_frees_decode():
    c = Cluster(prefill=1, decode=1)
    d1 = c.schedule("a", chain(8, start=0), output_tokens=50)
    d2 = c.schedule("b", chain(8, start=100))
    p0, d0 = c.registry.get("p0"), c.registry.get("d0")
    assert d2.est_queue_s == pytest.approx(d1.est_prefill_s)
    assert d0.decode_requests == 2 and d0.decode_tokens == 2 * (8 * BT + 100) + 50
    c.now = d1.est_prefill_s / 2  # "a" finished early
    c.sched.prefill_done("a", measured_s=d1.est_prefill_s / 2)
    assert c.sched.queue_seconds(p0, c.now) == pytest.approx(d2.est_prefill_s)
    c.sched.complete("a")
    c.sched.complete("b")
    assert (d0.decode_requests, d0.decode_tokens, p0.prefill_pending) == (0, 0, 0)
    assert c.sched.queue_seconds(p0, c.now) == 0.0
    assert [s.seconds for s in c.sched.samples()] == [d1.est_prefill_s / 2]
    with pytest.raises(NotFound):
        c.sched.complete("a")


def test_measured_prefills_refit_the_cost_model():
    c = Cluster(prefill=1, refit_every=6)
    truth = FittedCostModel(quad=1e-9, lin=1e-4, const=0.01)
    base = c.sched.cost_model
    for i in range(6):
        n_blocks = 2 + 3 * i
        d = c.schedule(f"r{i}", chain(n_blocks, start=100 * i), extra_tokens=0)
        c.sched.prefill_done(f"r{i}", measured_s=truth.prefill_seconds(n_blocks * BT))
        c.sched.complete(f"r{i}")
        assert d.reuse_blocks == 0
        assert (c.sched.cost_model is base) is (i < 5)
    fitted = c.sched.cost_model
    assert (fitted.quad, fitted.lin, fitted.const) == pytest.approx((1e-9, 1e-4, 0.01), rel=1e-6)
    assert fitted.base is base  # transfer and decode estimates still come from the base model
    d = c.schedule("next", chain(10, start=9999), extra_tokens=0)
    assert d.est_prefill_s == pytest.approx(truth.prefill_seconds(10 * BT))


def test_heartbeat_load_counts_when_larger_than_the_ledger():
    c = Cluster(prefill=2, policy="load")
    c.registry.heartbeat("p0", c.now, NodeLoad(queued_prefill_tokens=100_000))
    assert c.schedule("r", chain(4)).prefill_node == "p1"


def test_stale_ledger_entries_expire():
    c = Cluster(prefill=1, stale_after_s=10.0)
    c.schedule("lost", chain(4))
    c.now = 5.0
    assert c.sched.expire_stale() == []
    c.now = 100.0
    assert c.sched.expire_stale() == ["lost"] and c.sched.pending() == 0
    # The earliest deadline gone (completed) leaves the next one to expire on time.
    c.schedule("done", chain(4))
    c.now = 200.0
    c.schedule("late", chain(4, start=50))
    c.sched.complete("done")
    assert c.sched.expire_stale() == [] and c.sched.is_pending("late")
    c.now = 400.0
    assert c.sched.expire_stale() == ["late"] and c.sched.pending() == 0


def test_random_and_load_policies():
    c = Cluster(prefill=4, policy="random")
    picks = {c.schedule(f"r{i}", chain(2, start=10 * i)).prefill_node for i in range(40)}
    assert picks == {"p0", "p1", "p2", "p3"}
    c = Cluster(prefill=3, policy="load")
    c.put("p0", chain(8))
    picks = [c.schedule(f"r{i}", chain(8)).prefill_node for i in range(3)]
    assert sorted(picks) == ["p0", "p1", "p2"]  # spread by queue, not drawn to the cache
    with pytest.raises(InvalidArgument, match="unknown scheduling policy"):
        make_policy("fastest")


def test_bad_requests_and_missing_nodes():
    c = Cluster(prefill=1)
    keys = chain(4)
    for bad, match in [
        (dict(request_id=""), "request_id"),
        (dict(prompt_tokens=10), "longer than stated"),
        (dict(prompt_tokens=0, keys=[]), "prompt_tokens must be positive"),
        (dict(output_tokens=-1), "output_tokens"),
        (dict(ttft_slo_s=-1.0), "ttft_slo_s"),
        (dict(block_tokens=0), "block_tokens"),
    ]:
        fields = dict(request_id="r", keys=keys, prompt_tokens=4 * BT, block_tokens=BT)
        fields.update(bad)
        with pytest.raises(InvalidArgument, match=match):
            c.sched.schedule(Request(**fields))
    c.schedule("dup", keys)
    with pytest.raises(InvalidArgument, match="already scheduled"):
        c.schedule("dup", keys)
    with pytest.raises(NoNodeAvailable, match="no live prefill node serving namespace 'other'"):
        c.sched.schedule(
            Request(
                request_id="x", keys=keys, prompt_tokens=4 * BT, block_tokens=BT, namespace="other"
            )
        )
    c.registry.drop("d0")
    with pytest.raises(NoNodeAvailable, match="decode"):
        c.schedule("y", keys)


def test_excluded_nodes_are_not_chosen_even_when_they_hold_the_prefix():
    c = Cluster(prefill=2, decode=2)
    c.put("p0", chain(8))
    assert c.schedule("r0", chain(8)).prefill_node == "p0"  # the holder, when allowed
    d = c.schedule("r1", chain(8), exclude=frozenset({"p0", "d0"}))
    assert (d.prefill_node, d.decode_node) == ("p1", "d1")
    with pytest.raises(NoNodeAvailable, match="no live decode node is left besides the excluded"):
        c.schedule("r2", chain(8), exclude=frozenset({"d0", "d1"}))


def test_both_role_nodes_prefill_and_decode():
    c = Cluster(prefill=0, decode=0)
    c.add("n0", Role.BOTH)
    d = c.schedule("r", chain(2))
    assert d.prefill_node == d.decode_node == "n0"


# ---- the thread-safe facade ---------------------------------------------------------------------


class _ProtoEvent:
    """The attribute shape of a proto BlockEvent (tier already 1..3)."""

    def __init__(self, seq: int, kind: int, key: bytes, tier: int) -> None:
        self.seq, self.kind, self.key, self.tier = seq, kind, key, tier


def test_conductor_refuses_stale_feeds_and_hands_plans_to_the_hook():
    hook = RecordingTransferHook()
    c = Conductor.create(hook=hook)
    try:
        g1 = c.register(NodeDescriptor(node_id="p0", role=Role.PREFILL)).generation
        c.register(NodeDescriptor(node_id="p1", role=Role.PREFILL))
        c.register(NodeDescriptor(node_id="d0", role=Role.DECODE))
        keys = chain(8)
        c.apply_events("p0", g1, [_ProtoEvent(i + 1, 1, k, 2) for i, k in enumerate(keys)])
        assert {n: len(t) for n, t in c.locate(keys).items()} == {"p0": 8}
        g2 = c.register(NodeDescriptor(node_id="p0", role=Role.PREFILL)).generation
        with pytest.raises(StaleFeed):
            c.apply_events("p0", g1, [])
        assert c.locate(keys) == {}  # re-registration: rebuilt from the new feed only
        c.apply_events("p0", g2, [_ProtoEvent(i + 1, 1, k, 2) for i, k in enumerate(keys)])
        c.heartbeat("p0", NodeLoad(queued_prefill_tokens=200_000), g2)  # the holder is busy
        d = c.schedule(Request(request_id="r", keys=keys, prompt_tokens=8 * BT, block_tokens=BT))
        assert d.transfer is not None
        assert hook.wait_for(1, timeout=5.0)
        assert hook.plans()[0].keys == tuple(keys)
    finally:
        c.close()


def _plan(rid: str, dst: str) -> TransferPlan:
    return TransferPlan(
        request_id=rid,
        namespace=LAYOUT.namespace,
        src=NodeDescriptor(node_id="p0", role=Role.PREFILL),
        dst=NodeDescriptor(node_id=dst, role=Role.PREFILL),
        keys=tuple(chain(2)),
        first_block=0,
        nbytes=2,
        est_seconds=0.0,
    )


class _GatedHook(TransferHook):
    """Fails plans to ``failing`` destinations; holds every plan until ``gate`` is set."""

    def __init__(self) -> None:
        self.failing: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)

    def submit(self, plan: TransferPlan) -> None:
        self.entered.release()
        self.gate.wait(10)
        if plan.dst.node_id in self.failing:
            raise ValueError(f"destination node {plan.dst.node_id} registered no messenger")


def test_dispatcher_counts_every_failure_and_logs_it_once_per_episode(caplog):
    hook = _GatedHook()
    hook.failing.add("p1")
    d = TransferDispatcher(hook)
    try:
        with caplog.at_level(logging.WARNING, logger="conductor.transfer"):
            for i in range(5):
                assert d.dispatch(_plan(f"r{i}", "p1"))
            wait_until(lambda: d.failed == 5, what="5 failed plans")
            assert d.submitted == 0
            failures = [r for r in caplog.records if "transfer hook failed" in r.getMessage()]
            assert len(failures) == 1 and failures[0].exc_info is not None  # one traceback
            hook.failing.clear()
            assert d.dispatch(_plan("ok", "p1"))
            wait_until(lambda: d.submitted == 1, what="the plan submitted")
            assert "transfers to p1 work again after 5 failed plans" in caplog.text
    finally:
        d.close()


def test_dispatcher_drops_plans_when_its_queue_is_full_and_says_so_once(caplog):
    hook = _GatedHook()
    hook.gate.clear()  # the hook holds the first plan: the others queue up
    d = TransferDispatcher(hook, max_queued=2)
    try:
        with caplog.at_level(logging.WARNING, logger="conductor.transfer"):
            assert d.dispatch(_plan("r0", "p1")) and hook.entered.acquire(timeout=5)
            assert d.dispatch(_plan("r1", "p1")) and d.dispatch(_plan("r2", "p1"))
            assert not d.dispatch(_plan("r3", "p1")) and not d.dispatch(_plan("r4", "p1"))
            assert d.dropped == 2
            assert caplog.text.count("transfer queue full") == 1
            hook.gate.set()
            wait_until(lambda: d.submitted == 3, what="the queued plans submitted")
            assert d.dispatch(_plan("r5", "p1"))
            assert "transfer queue accepts plans again; 2 were dropped" in caplog.text
    finally:
        d.close()


def test_conductor_is_safe_under_concurrent_feeds_and_schedules():
    c = Conductor.create()
    nodes = [f"p{i}" for i in range(4)]
    gens = {n: c.register(NodeDescriptor(node_id=n, role=Role.BOTH)).generation for n in nodes}
    keys = chain(64)
    errors: list[BaseException] = []

    def feed(node: str) -> None:
        try:
            for i, k in enumerate(keys):
                c.apply_events(node, gens[node], [_ProtoEvent(i + 1, 1, k, 2)])
        except BaseException as e:  # surfaced by the assert below
            errors.append(e)

    def schedule(t: int) -> None:
        try:
            for i in range(50):
                rid = f"t{t}-{i}"
                c.schedule(
                    Request(request_id=rid, keys=keys, prompt_tokens=64 * BT, block_tokens=BT)
                )
                c.complete(rid)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=feed, args=(n,)) for n in nodes]
    threads += [threading.Thread(target=schedule, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert {n: len(t) for n, t in c.locate(keys).items()} == {n: 64 for n in nodes}
    assert c.scheduler.pending() == 0
    c.close()


def test_many_nodes_share_one_packed_int_per_key():
    idx = GlobalIndex()
    keys = [os.urandom(16) for _ in range(10)]
    for n in range(40):
        idx.add_node(f"n{n}")
        idx.apply_events(
            f"n{n}", [ev(i + 1, EventKind.STORED, k) for i, k in enumerate(keys[: n % 10 + 1])]
        )
    lengths = idx.prefix_lengths(keys)
    assert lengths == {f"n{n}": n % 10 + 1 for n in range(40)}
    assert len(idx) == 10
