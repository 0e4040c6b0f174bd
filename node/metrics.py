"""Prometheus metrics of a node: RPC latency/errors, streamed bytes, and the stores' counters
(collected from ``TieredStore.stats()`` at scrape time, so the hot path pays nothing)."""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.store import TieredStore

_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 2.0)


class _StoreCollector(Collector):
    def __init__(self, stores: Callable[[], dict[str, TieredStore]]) -> None:
        self._stores = stores

    def collect(self) -> Iterable:
        hits = CounterMetricFamily(
            "kvcache_store_hits", "Lookup hits", labels=["namespace", "tier"]
        )
        misses = CounterMetricFamily(
            "kvcache_store_misses", "Lookup misses (blocks)", labels=["namespace"]
        )
        evictions = CounterMetricFamily(
            "kvcache_store_evictions", "Blocks evicted from a tier", labels=["namespace", "tier"]
        )
        moves = CounterMetricFamily(
            "kvcache_store_tier_moves",
            "Blocks moved between tiers",
            labels=["namespace", "direction"],
        )
        corrupt = CounterMetricFamily(
            "kvcache_store_corrupt_pages", "Pages failing checksums", labels=["namespace"]
        )
        demotion_failures = CounterMetricFamily(
            "kvcache_store_demotion_failures",
            "Blocks a lower tier refused to take (e.g. a full SSD filesystem): dropped instead",
            labels=["namespace"],
        )
        pages = GaugeMetricFamily(
            "kvcache_store_pages", "Pages per tier by state", labels=["namespace", "tier", "state"]
        )
        written = CounterMetricFamily(
            "kvcache_store_written_bytes",
            "Page bytes written into the store (committed pages of clients, streams, messengers)",
            labels=["namespace"],
        )
        read = CounterMetricFamily(
            "kvcache_store_read_bytes", "Page bytes copied out (streamed Get)", labels=["namespace"]
        )
        for ns, store in list(self._stores().items()):
            s = store.stats()
            misses.add_metric([ns], s.misses)
            moves.add_metric([ns, "demote"], s.demotions)
            moves.add_metric([ns, "promote"], s.promotions)
            corrupt.add_metric([ns], s.corrupt_pages)
            demotion_failures.add_metric([ns], s.demotion_failures)
            written.add_metric([ns], s.bytes_written)
            read.add_metric([ns], s.bytes_read)
            for t in s.tiers:
                tier = t.tier.name.lower()
                hits.add_metric([ns, tier], t.hits)
                evictions.add_metric([ns, tier], t.evictions)
                for state, value in (
                    ("used", t.used_pages),
                    ("leased", t.leased_pages),
                    ("free", t.free_pages),
                    ("quarantined", t.quarantined_pages),
                    ("pinned", t.pinned_blocks),
                ):
                    pages.add_metric([ns, tier, state], value)
        yield from (
            hits,
            misses,
            evictions,
            moves,
            corrupt,
            demotion_failures,
            pages,
            written,
            read,
        )


class NodeMetrics:
    def __init__(self, stores: Callable[[], dict[str, TieredStore]]) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "kvcache_node_rpc_seconds",
            "Node RPC latency",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "kvcache_node_rpc_errors",
            "Node RPCs failed, by status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.stream_bytes = Counter(
            "kvcache_node_stream_bytes",
            "Page bytes over streamed RPCs",
            ["direction"],
            registry=self.registry,
        )
        self.streams_refused = Counter(
            "kvcache_node_streams_refused",
            "Streams refused because the server had its maximum of that kind open",
            ["method"],
            registry=self.registry,
        )
        self.streams_cut = Counter(
            "kvcache_node_streams_cut",
            "Streams cut because the client neither sent nor read for --stream-idle-timeout",
            ["method"],
            registry=self.registry,
        )
        self.lookup_blocks = Counter(
            "kvcache_node_lookup_blocks", "Blocks looked up", ["result"], registry=self.registry
        )
        self.registry.register(_StoreCollector(stores))
