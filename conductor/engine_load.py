"""Engine load, read from the engines: the conductor scrapes each vLLM engine's Prometheus
endpoint and folds what it finds into the load of the node beside it.

    kvcache conductor --engine-metrics http://127.0.0.1:8101/metrics=prefill-0

A node server knows its pages, not the requests its engine is working on; the engine does. From
vLLM's metrics (``vllm:num_requests_running`` / ``_waiting``, ``vllm:kv_cache_usage_perc``, the
KV capacity in ``vllm:cache_config_info`` and the mean prompt tokens a prefill computed,
``vllm:request_prefill_kv_computed_tokens``) each scrape makes a ``NodeLoad``:

- ``queued_prefill_tokens`` = (running + waiting requests) x the mean tokens a prefill computed:
  the engine's prefill backlog, priced by the scheduler's cost model like a heartbeat's;
- ``running_decode_requests`` = running + waiting requests;
- ``running_decode_tokens`` = the KV-cache usage x the engine's KV capacity in tokens.

``Registry.engine_report`` merges it into the node's load (the larger report wins per field). An
engine that answered once and then fails a scrape takes its node out of scheduling until it
answers again; one that never answered yet (starting) is not held against its node.

Between two scrapes, the requests that finished give the cost model its measurements
(``Conductor.engine_samples``): their mean prefill time (``vllm:request_prefill_time_seconds``)
for their mean computed prompt tokens, and the mean inter-token latency
(``vllm:inter_token_latency_seconds``) of a batch holding the KV-cache usage's tokens.
"""

from __future__ import annotations

import http.client
import logging
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvstore.errors import InvalidArgument
from rpc.cluster import NodeLoad

from .core import Conductor
from .costmodel import PrefillSample

log = logging.getLogger(__name__)


def parse_engine_metrics(spec: str) -> tuple[str, str]:
    """``URL=NODE_ID`` -> (url, node id)."""
    url, sep, node_id = spec.rpartition("=")
    if not sep or not node_id or not url.startswith(("http://", "https://")):
        raise InvalidArgument(
            f"--engine-metrics expects URL=NODE_ID with an http(s) URL, e.g. "
            f"http://127.0.0.1:8101/metrics=prefill-0; got {spec!r}"
        )
    return url, node_id


@dataclass(frozen=True, kw_only=True)
class EngineSample:
    """One scrape of a vLLM engine's metrics (summed over its engine cores)."""

    running: int
    waiting: int
    kv_usage: float  # fraction of the KV cache in use, 0..1
    kv_capacity_tokens: int  # tokens its KV cache holds (0: not reported)
    prefill_tokens_mean: float  # tokens a prefill computed, mean over finished requests
    # cumulative counters, for measurements between two scrapes
    prefill_count: float = 0.0
    prefill_seconds: float = 0.0
    computed_tokens: float = 0.0
    itl_count: float = 0.0
    itl_seconds: float = 0.0

    def measured_since(
        self, before: "EngineSample"
    ) -> tuple[list[PrefillSample], list[tuple[int, float]]]:
        """The mean prefill and decode step of what finished since ``before`` (none when the
        counters went back: the engine restarted)."""
        prefills, steps = [], []
        done = self.prefill_count - before.prefill_count
        seconds = self.prefill_seconds - before.prefill_seconds
        tokens = self.computed_tokens - before.computed_tokens
        if done > 0 and seconds >= 0 and tokens > 0:
            prefills.append(PrefillSample(round(tokens / done), 0, seconds / done))
        gaps = self.itl_count - before.itl_count
        seconds = self.itl_seconds - before.itl_seconds
        if gaps > 0 and seconds >= 0:
            steps.append((int(self.kv_usage * self.kv_capacity_tokens), seconds / gaps))
        return prefills, steps

    def load(self) -> NodeLoad:
        requests = self.running + self.waiting
        return NodeLoad(
            queued_prefill_tokens=int(requests * self.prefill_tokens_mean),
            running_decode_requests=requests,
            running_decode_tokens=int(self.kv_usage * self.kv_capacity_tokens),
        )


def parse_vllm_metrics(text: str) -> EngineSample:
    """vLLM's Prometheus text -> an ``EngineSample``; ``InvalidArgument`` if it is not vLLM's."""
    values: dict[str, float] = {}
    capacity = 0
    usage: list[float] = []
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "vllm:kv_cache_usage_perc":
                    usage.append(s.value)
                elif s.name == "vllm:cache_config_info":
                    blocks, size = s.labels.get("num_gpu_blocks"), s.labels.get("block_size")
                    if blocks and size and blocks.isdigit() and size.isdigit():
                        capacity += int(blocks) * int(size)
                elif s.name.startswith("vllm:"):
                    values[s.name] = values.get(s.name, 0.0) + s.value
    except ValueError as e:
        raise InvalidArgument(f"not Prometheus text: {e}") from None
    if "vllm:num_requests_running" not in values:
        raise InvalidArgument("no vllm:num_requests_running metric: is this a vLLM engine?")
    computed = values.get("vllm:request_prefill_kv_computed_tokens_count", 0.0)
    return EngineSample(
        prefill_count=values.get("vllm:request_prefill_time_seconds_count", 0.0),
        prefill_seconds=values.get("vllm:request_prefill_time_seconds_sum", 0.0),
        computed_tokens=values.get("vllm:request_prefill_kv_computed_tokens_sum", 0.0),
        itl_count=values.get("vllm:inter_token_latency_seconds_count", 0.0),
        itl_seconds=values.get("vllm:inter_token_latency_seconds_sum", 0.0),
        running=int(values["vllm:num_requests_running"]),
        waiting=int(values.get("vllm:num_requests_waiting", 0.0)),
        kv_usage=max(usage) if usage else 0.0,
        kv_capacity_tokens=capacity,
        prefill_tokens_mean=(
            values.get("vllm:request_prefill_kv_computed_tokens_sum", 0.0) / computed
            if computed
            else 0.0
        ),
    )


class EngineLoadFeed:
    """Scrapes one engine every ``interval_s`` on a thread of its own and reports its load (or
    that it does not answer) to the conductor; logs each change between the two once.

    An engine that refuses the connection is gone: its node leaves scheduling at once. One that
    is slow to answer (a busy API server on a loaded host, a long pause) is not: its last load
    stands until it has not answered for ``down_after_s``."""

    def __init__(
        self,
        conductor: Conductor,
        url: str,
        node_id: str,
        interval_s: float = 0.5,
        timeout_s: float = 2.0,
        down_after_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.conductor, self.url, self.node_id = conductor, url, node_id
        self.interval_s, self.timeout_s, self.down_after_s = interval_s, timeout_s, down_after_s
        self.clock = clock
        self.scrapes = 0
        self.failures = 0
        self._answering: bool | None = None
        self._last: EngineSample | None = None
        self._last_load: NodeLoad | None = None
        self._answered_at = -math.inf
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"engine-load-{node_id}", daemon=True
        )

    def start(self) -> "EngineLoadFeed":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 1)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.poll()
                self._stop.wait(self.interval_s)
        except Exception:  # noqa: BLE001 - a feed must not kill the conductor; say so loudly
            log.exception("engine load feed of %s stopped", self.node_id)

    def poll(self) -> NodeLoad | None:
        """One scrape, reported; returns the load, or None when the engine did not answer."""
        load: NodeLoad | None = None
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as r:
                text = r.read().decode("utf-8", "replace")
            sample = parse_vllm_metrics(text)
            load = sample.load()
            if self._last is not None:
                prefills, steps = sample.measured_since(self._last)
                if prefills or steps:
                    self.conductor.engine_samples(prefills, steps)
            self._last = sample
            self._last_load, self._answered_at = load, self.clock()
            self.scrapes += 1
            if self._answering is not True:
                log.info("engine of %s answers at %s", self.node_id, self.url)
        # refused, reset, timed out, an HTTP error status, a cut response, not vLLM's metrics
        except (OSError, http.client.HTTPException, InvalidArgument) as e:
            self.failures += 1
            if not _refused(e) and self.clock() - self._answered_at < self.down_after_s:
                # slow, not gone (yet): scheduled on what it said last
                self.conductor.engine_report(self.node_id, self._last_load)
                return None
            if self._answering is True:
                log.warning(
                    "engine of %s at %s does not answer (%s): node out of scheduling",
                    self.node_id,
                    self.url,
                    e,
                )
        self._answering = load is not None
        self.conductor.engine_report(self.node_id, load)
        return load


def _refused(e: BaseException) -> bool:
    """The engine's port refused the connection: nothing listens there (urllib wraps it)."""
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    return isinstance(reason, ConnectionRefusedError)
