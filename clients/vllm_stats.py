"""What the vLLM connector did: counters in this process (``STATS``, read by the benchmarks), and
the same counters through vLLM's connector stats (``KVCacheConnectorStats``: logged as "KV Transfer
metrics" and exported as ``vllm:kvcache_*`` Prometheus metrics by ``vllm serve``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass
class ConnectorStats:
    """Counters (and seconds) of the connectors of this process, both sides; cumulative."""

    lookups: int = 0
    lookup_s: float = 0.0
    hit_tokens: int = 0  # tokens offered to vLLM from the node
    loaded_pages: int = 0
    loaded_bytes: int = 0
    load_failed_blocks: int = 0  # vLLM blocks reported back for recomputation
    resumed_loads: int = 0  # loads given to preempted requests when they resume
    saved_pages: int = 0
    saved_bytes: int = 0
    saves_dropped: int = 0  # pages not committed because a load of their step failed
    checksummed_pages: int = 0  # saved pages committed with the checksums the worker took
    acquire_s: float = 0.0  # Acquire / streamed Get of the pages to load (AcquireAllocate too)
    allocate_s: float = 0.0  # waiting for the Allocate of the pages to save
    load_copy_s: float = 0.0  # shared memory -> vLLM blocks, all layers
    save_copy_s: float = 0.0  # vLLM blocks -> shared memory, all layers
    finish_s: float = 0.0  # sending Commit + Release or CommitRelease (or the streamed Put)
    steps: int = 0  # worker steps with loads or saves
    step_s: float = 0.0  # time inside the worker hooks of those steps
    breaker_trips: int = 0
    breaker_skipped: int = 0  # node calls not made while the breaker was open
    breaker_open: int = 0  # 1 while open (a gauge; the sum over processes)
    resets: int = 0
    remote_pulls: int = 0  # requests whose pages were pulled from another node (the pool)
    remote_lookup_s: float = 0.0  # the conductor's Locate and the SubmitTransfer
    remote_wait_s: float = 0.0  # worker: waiting for pulls (in the background)
    remote_failed: int = 0  # pulls that did not bring every page in time (the rest recomputed)
    remote_skipped: int = 0  # pulls not made: computing their tokens was predicted faster
    decode_holds: int = 0  # P/D prefills whose pages were pinned for the decode side


STATS = ConnectorStats()
_COUNTERS = [f.name for f in fields(ConnectorStats) if f.name != "breaker_open"]
# Per pull from the pool: seconds from the scheduler's Lookup to vLLM told the load is done (the
# pages in the request's blocks, or load errors). An interval's data carries them as a list
# under REMOTE_LOAD_S; REMOTE_LOAD has every one of this process (read by the benchmarks).
REMOTE_LOAD_S = "remote_load_s"
REMOTE_LOAD: list[float] = []
# From a local hit's cost to a pull's deadline (pull_timeout_s, 10 s by default).
REMOTE_LOAD_BUCKETS = (
    0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
    5.0, 7.5, 10.0,
)  # fmt: skip


def delta(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """``now`` minus ``before`` (both snapshots), with the breaker's state in ``now``. Both are
    snapshots, so what changes while this runs is counted in the next interval, not lost."""
    out: dict[str, Any] = {k: now[k] - before.get(k, 0) for k in _COUNTERS}
    out["breaker_open"] = now["breaker_open"]
    return out


def snapshot(stats: ConnectorStats) -> dict[str, Any]:
    return asdict(stats)


class Intervals:
    """Cuts a live ``ConnectorStats`` into intervals (what vLLM's stats calls report): each
    interval is what changed since the last, counted from one read of the counters."""

    def __init__(self) -> None:
        self._last: dict[str, Any] = {}

    def take(self, stats: ConnectorStats) -> dict[str, Any]:
        now = snapshot(stats)
        d, self._last = delta(now, self._last), now
        return d


def add(into: ConnectorStats, more: ConnectorStats) -> None:
    """Adds ``more``'s counters to ``into``'s."""
    for k in _COUNTERS:
        setattr(into, k, getattr(into, k) + getattr(more, k))


class KVCacheConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """One interval's counters (a dict of numbers: it crosses processes)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = {k: 0 for k in _COUNTERS}
        self.data["breaker_open"] = 0

    def aggregate(self, other: KVConnectorStats) -> "KVCacheConnectorStats":
        for k, v in (other.data or {}).items():
            if k == "breaker_open":
                self.data[k] = max(self.data.get(k, 0), v)
            elif k == REMOTE_LOAD_S:
                self.data[k] = [*self.data.get(k, ()), *v]
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        steps = d.get("steps", 0)
        return {
            "hit_tokens": d.get("hit_tokens", 0),
            "loaded_pages": d.get("loaded_pages", 0),
            "saved_pages": d.get("saved_pages", 0),
            "loaded_MiB": round(d.get("loaded_bytes", 0) / 2**20, 2),
            "saved_MiB": round(d.get("saved_bytes", 0) / 2**20, 2),
            "load_failed_blocks": d.get("load_failed_blocks", 0),
            "ms_per_step": round(1e3 * d.get("step_s", 0.0) / steps, 3) if steps else 0.0,
            "breaker_open": d.get("breaker_open", 0),
            "breaker_trips": d.get("breaker_trips", 0),
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in self.data)


_PROM = {  # stats key -> (metric name, help)
    "hit_tokens": ("vllm:kvcache_hit_tokens", "Prompt tokens found on the kvcache node"),
    "loaded_pages": ("vllm:kvcache_loaded_pages", "Pages loaded from the kvcache node"),
    "loaded_bytes": ("vllm:kvcache_loaded_bytes", "Bytes loaded from the kvcache node"),
    "saved_pages": ("vllm:kvcache_saved_pages", "Pages saved to the kvcache node"),
    "saved_bytes": ("vllm:kvcache_saved_bytes", "Bytes saved to the kvcache node"),
    "load_failed_blocks": (
        "vllm:kvcache_load_failed_blocks",
        "vLLM blocks the kvcache connector could not load (recomputed)",
    ),
    "steps": ("vllm:kvcache_steps", "Engine steps with kvcache loads or saves"),
    "step_s": ("vllm:kvcache_step_seconds", "Seconds the kvcache connector took in those steps"),
    "lookup_s": ("vllm:kvcache_lookup_seconds", "Seconds of the scheduler's kvcache lookups"),
    "remote_pulls": (
        "vllm:kvcache_remote_pulls",
        "Requests whose pages were pulled from another kvcache node (the pool)",
    ),
    "remote_failed": (
        "vllm:kvcache_remote_failed",
        "Pulls from the pool that did not bring every page in time (the rest recomputed)",
    ),
    "remote_skipped": (
        "vllm:kvcache_remote_skipped",
        "Pulls not made: computing their tokens was predicted faster",
    ),
    "remote_wait_s": (
        "vllm:kvcache_remote_wait_seconds",
        "Seconds the workers waited for pulled pages (in the background)",
    ),
    "breaker_trips": (
        "vllm:kvcache_breaker_trips",
        "Times the kvcache node stopped answering (the connector went idle)",
    ),
}


class KVCacheConnectorPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    def __init__(
        self,
        vllm_config: "VllmConfig",
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in _PROM.items():
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self.counters[key] = _per_engine(metric, per_engine_labelvalues)
        gauge = self._gauge_cls(
            name="vllm:kvcache_breaker_open",
            documentation="1 while the kvcache node does not answer (the connector is idle)",
            labelnames=labelnames,
        )
        self.breaker = _per_engine(gauge, per_engine_labelvalues)
        histogram = self._histogram_cls(
            name="vllm:kvcache_remote_load_seconds",
            documentation="Seconds from a request's kvcache Lookup to its pull from the pool "
            "loaded (or failed: recomputed)",
            labelnames=labelnames,
            buckets=REMOTE_LOAD_BUCKETS,
        )
        self.remote_load = _per_engine(histogram, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, children in self.counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                children[engine_idx].inc(value)
        self.breaker[engine_idx].set(transfer_stats_data.get("breaker_open", 0))
        for seconds in transfer_stats_data.get(REMOTE_LOAD_S, ()):
            self.remote_load[engine_idx].observe(seconds)


def _per_engine(metric: Any, per_engine_labelvalues: dict[int, list[object]]) -> dict[int, Any]:
    return {i: metric.labels(*values) for i, values in per_engine_labelvalues.items()}
