"""Prometheus metrics of the conductor. One registry per service instance (no global state);
gauges are read from the ``Conductor`` at scrape time so the hot path pays nothing for them."""

from __future__ import annotations

import threading
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .core import Conductor
from .scheduler import Decision

_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5)


class _StateCollector(Collector):
    def __init__(self, conductor: Conductor) -> None:
        self._conductor = conductor

    def collect(self) -> Iterable:
        c = self._conductor
        nodes = GaugeMetricFamily("kvcache_conductor_nodes", "Registered nodes", labels=["role"])
        blocks = GaugeMetricFamily(
            "kvcache_conductor_node_blocks", "Blocks indexed per node", labels=["node"]
        )
        keys = GaugeMetricFamily("kvcache_conductor_index_keys", "Distinct keys in the index")
        pending = GaugeMetricFamily(
            "kvcache_conductor_pending_requests", "Scheduled requests not yet completed"
        )
        transfers = CounterMetricFamily(
            "kvcache_conductor_transfer_plans",
            "Transfer plans handed to the hook",
            labels=["result"],
        )
        engine_up = GaugeMetricFamily(
            "kvcache_conductor_engine_up",
            "1 while the engine beside a node answers its metrics scrape, 0 when it stopped",
            labels=["node"],
        )
        engine_requests = GaugeMetricFamily(
            "kvcache_conductor_engine_requests",
            "Running plus waiting requests the engine beside a node reported",
            labels=["node"],
        )
        views = c.nodes()
        for role in ("prefill", "decode", "both"):
            nodes.add_metric([role], sum(v.descriptor.role.value == role for v in views))
        for v in views:
            blocks.add_metric([v.descriptor.node_id], v.indexed_blocks)
        with c.lock:
            keys.add_metric([], len(c.index))
            pending.add_metric([], c.scheduler.pending())
            engines = c.registry.engines()
        for node, load in sorted(engines.items()):
            engine_up.add_metric([node], 0 if load is None else 1)
            if load is not None:
                engine_requests.add_metric([node], load.running_decode_requests)
        if c.dispatcher is not None:
            d = c.dispatcher
            for result, n in (
                ("submitted", d.submitted),
                ("failed", d.failed),
                ("dropped", d.dropped),
            ):
                transfers.add_metric([result], n)
        yield from (nodes, blocks, keys, pending, transfers, engine_up, engine_requests)


class ConductorMetrics:
    def __init__(self, conductor: Conductor) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram(
            "kvcache_conductor_rpc_seconds",
            "Conductor RPC latency",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "kvcache_conductor_rpc_errors",
            "Conductor RPCs failed, by code",
            ["method", "code"],
            registry=r,
        )
        self.rejections = Counter(
            "kvcache_conductor_schedule_rejections",
            "Requests rejected, by the SLO missed",
            ["slo"],
            registry=r,
        )
        self.events = Counter(
            "kvcache_conductor_events", "Node events applied to the index", registry=r
        )
        self.resyncs = Counter(
            "kvcache_conductor_resyncs", "Index rebuilds from snapshots", ["reason"], registry=r
        )
        self.expirations = Counter(
            "kvcache_conductor_lease_expirations",
            "Nodes dropped because their lease lapsed",
            registry=r,
        )
        self.redirects = Counter(
            "kvcache_conductor_redirects",
            "Schedule / Complete calls a standby refused, naming the leader",
            registry=r,
        )
        self.leader = Gauge(
            "kvcache_conductor_leader", "1 while this conductor leads, 0 standing by", registry=r
        )
        self.leader.set(1)
        self._decisions = _DecisionCounts()
        r.register(self._decisions)
        r.register(_StateCollector(conductor))

    def decided(self, decision: Decision) -> None:
        """Count a placed request (decisions by policy and transfer, prompt and reused blocks)."""
        self._decisions.add(decision)

    def totals(self) -> tuple[int, int]:
        """(requests placed, requests rejected) since start: read from the counters, off the
        hot path (ListNodes, for 'kvcache status')."""

        def total(counter: Counter) -> int:
            return int(
                sum(
                    s.value
                    for m in counter.collect()
                    for s in m.samples
                    if s.name.endswith("_total")
                )
            )

        return self._decisions.placed(), total(self.rejections)


class _DecisionCounts(Collector):
    """The counters every ``Schedule`` updates, under one lock (three labelled ``Counter``
    children took a lock each, on the hot path), exported at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._decisions: dict[tuple[str, bool], int] = {}
        self._prompt_blocks = 0
        self._reused_blocks = 0

    def placed(self) -> int:
        with self._lock:
            return sum(self._decisions.values())

    def add(self, d: Decision) -> None:
        key = (d.policy, d.transfer is not None)
        with self._lock:
            self._decisions[key] = self._decisions.get(key, 0) + 1
            self._prompt_blocks += d.total_blocks
            self._reused_blocks += d.reuse_blocks

    def collect(self) -> Iterable:
        decisions = CounterMetricFamily(
            "kvcache_conductor_schedule_decisions", "Requests placed", labels=["policy", "transfer"]
        )
        with self._lock:
            counts = sorted(self._decisions.items())
            prompt, reused = self._prompt_blocks, self._reused_blocks
        for (policy, transfer), n in counts:
            decisions.add_metric([policy, "yes" if transfer else "no"], n)
        yield decisions
        yield CounterMetricFamily(
            "kvcache_conductor_reused_blocks",
            "Prompt blocks the chosen prefill node reuses",
            value=reused,
        )
        yield CounterMetricFamily(
            "kvcache_conductor_prompt_blocks", "Full prompt blocks scheduled", value=prompt
        )
