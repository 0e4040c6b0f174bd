"""Prometheus metrics of the router (one registry per router, served at ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Stages of one request: conductor round trips are milliseconds, prefills and token streams up
# to minutes on a CPU.
_BUCKETS = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvcache_router_requests",
            "Completion requests by outcome: ok, rejected (SLO, HTTP 429), busy (more than "
            "--max-inflight requests, HTTP 429), invalid (4xx), unavailable (no node, 503), "
            "failed (an engine or node failed), cut (client left)",
            ["outcome"],
            registry=r,
        )
        self.stage = Histogram(
            "kvcache_router_stage_seconds",
            "Time per stage of a request: schedule, plan_wait (the conductor's transfer to the "
            "prefill node), prefill, decode_pull (pages to the decode node), first_token "
            "(streamed: decode start to first event), total",
            ["stage"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvcache_router_prompt_tokens", "Prompt tokens of scheduled requests", registry=r
        )
        self.prefill_cached_tokens = Counter(
            "kvcache_router_prefill_cached_tokens",
            "Prompt tokens the prefill engines did not compute (their cache or kvcache)",
            registry=r,
        )
        self.kv_bytes = Counter(
            "kvcache_router_kv_bytes",
            "KV page bytes moved between nodes for requests: decode_pull (prefill -> decode "
            "node), plan (the conductor's transfer plans to prefill nodes)",
            ["kind"],
            registry=r,
        )
        self.kv_pages = Counter(
            "kvcache_router_kv_pages",
            "Pages asked of the messengers, by kind and result: moved, held (already there), "
            "failed (the engine recomputes them)",
            ["kind", "result"],
            registry=r,
        )
        self.retries = Counter(
            "kvcache_router_retries",
            "Requests sent again after an engine failed before the client got a byte",
            ["stage"],
            registry=r,
        )
        self.inflight = Gauge(
            "kvcache_router_inflight_requests", "Requests being served", registry=r
        )
        self.max_inflight = Gauge(
            "kvcache_router_max_inflight_requests",
            "Requests served at once above which the router answers 429 (--max-inflight)",
            registry=r,
        )
        self.cancelled = Counter(
            "kvcache_router_cancelled",
            "Work stopped because its client left: request (a completion whose engine "
            "requests were dropped and ledger entry freed), pull (a page transfer batch)",
            ["what"],
            registry=r,
        )
