"""The conductor's view of engine load: vLLM's metrics -> a node's load, and what an engine that
stops answering does to scheduling (a real Conductor, in process; the scrape of a real vLLM
engine runs in test_serving.py)."""

from __future__ import annotations

import pytest

from conductor.core import Conductor
from conductor.engine_load import EngineLoadFeed, parse_engine_metrics, parse_vllm_metrics
from conductor.scheduler import NoNodeAvailable, Request
from kvstore.errors import InvalidArgument
from kvstore.layout import KVLayout
from rpc.cluster import NodeDescriptor, NodeLoad, Role

# Lines of a vLLM 0.32 CPU engine's /metrics (two requests running, one waiting).
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.25
# HELP vllm:request_prefill_kv_computed_tokens Histogram of new KV tokens computed during prefill
# TYPE vllm:request_prefill_kv_computed_tokens histogram
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="+Inf",model_name="tiny-llama"} 4.0
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="tiny-llama"} 4.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="tiny-llama"} 1200.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="4096"} 1.0
"""

LAYOUT = KVLayout(
    model="t", num_layers=2, kv_heads=2, head_dim=32, dtype="bfloat16", block_tokens=64
)


def test_vllm_metrics_become_a_node_load():
    sample = parse_vllm_metrics(VLLM_METRICS)
    assert (sample.running, sample.waiting, sample.kv_usage) == (2, 1, 0.25)
    assert sample.kv_capacity_tokens == 4096 * 32 and sample.prefill_tokens_mean == 300
    assert sample.load() == NodeLoad(
        queued_prefill_tokens=3 * 300, running_decode_requests=3, running_decode_tokens=32768
    )


@pytest.mark.parametrize("text", ["", "# nothing\n", 'node_cpu{a="1"} 3\n', "vllm:x{ 1\n"])
def test_metrics_that_are_not_vllms_are_refused(text):
    with pytest.raises(InvalidArgument):
        parse_vllm_metrics(text)


@pytest.mark.parametrize("spec", ["p0", "=p0", "ftp://x/metrics=p0", "http://x/metrics="])
def test_a_bad_engine_metrics_flag_says_the_format(spec):
    with pytest.raises(InvalidArgument, match="URL=NODE_ID"):
        parse_engine_metrics(spec)


def _cluster() -> Conductor:
    c = Conductor.create(policy="load")
    for node, role in (("p0", Role.PREFILL), ("p1", Role.PREFILL), ("d0", Role.DECODE)):
        c.register(NodeDescriptor(node_id=node, role=role, layouts=(LAYOUT,)))
    return c


def _schedule(c: Conductor, i: int) -> str:
    d = c.schedule(
        Request(
            request_id=f"r{i}",
            keys=[],
            prompt_tokens=100,
            block_tokens=64,
            namespace=LAYOUT.namespace,
        )
    )
    c.complete(d.request_id)
    return d.prefill_node


def test_engine_load_counts_for_its_node_and_a_silent_engine_takes_it_out():
    c = _cluster()
    busy = NodeLoad(queued_prefill_tokens=50_000, running_decode_requests=3)
    c.engine_report("p0", None)  # never answered (starting): not held against the node
    c.engine_report("p1", busy)
    assert _schedule(c, 0) == "p0"
    # A busy engine's queue is its node's, as a heartbeat's would be (the load policy picks
    # the shortest queue).
    view = {v.descriptor.node_id: v for v in c.nodes()}
    assert view["p1"].load.queued_prefill_tokens == 50_000 and view["p1"].queue_s > 0
    c.engine_report("p1", NodeLoad())
    c.engine_report("p0", busy)
    assert _schedule(c, 1) == "p1"
    # p0's engine stops answering: never scheduled, even with p1 busier, even after p0's node
    # registers again.
    c.engine_report("p0", None)
    c.engine_report("p1", busy)
    c.register(NodeDescriptor(node_id="p0", role=Role.PREFILL, layouts=(LAYOUT,)))
    assert {_schedule(c, i) for i in range(2, 8)} == {"p1"}
    c.engine_report("p0", NodeLoad())  # it answers again
    assert _schedule(c, 8) == "p0"


def test_no_decode_engine_answering_is_no_node_available_naming_them():
    c = _cluster()
    c.engine_report("d0", NodeLoad())
    c.engine_report("d0", None)
    with pytest.raises(NoNodeAvailable, match="engines of d0 do not answer"):
        _schedule(c, 0)


def test_a_feed_of_an_engine_not_there_reports_nothing_against_its_node():
    c = _cluster()
    c.engine_report("p1", NodeLoad(queued_prefill_tokens=50_000))
    feed = EngineLoadFeed(c, "http://127.0.0.1:9/metrics", "p0", timeout_s=1)  # discard port
    assert feed.poll() is None and feed.failures == 1
    assert "p0" not in c.registry.engines()  # never answered: unknown, still schedulable
    assert _schedule(c, 0) == "p0"


class _SlowMetrics:
    """An engine's /metrics on a real loopback port that answers, or holds each scrape past
    the feed's timeout (a busy API server on a loaded host), or is closed (the engine died)."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.slow = threading.Event()
        self.release = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if outer.slow.is_set():
                    outer.release.wait(30)
                body = VLLM_METRICS.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # a scrape the feed gave up on: its reply has nowhere to go

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_a_slow_engine_keeps_its_node_until_down_after_s_and_a_closed_one_leaves_at_once():
    """Before: one scrape slower than 2 s took the node out of scheduling (test_serving, two
    engines' API servers busy on a loaded machine: 'no live prefill node')."""
    c = _cluster()
    now = [0.0]
    metrics = _SlowMetrics()
    try:
        feed = EngineLoadFeed(
            c, metrics.url, "p0", timeout_s=0.2, down_after_s=10.0, clock=lambda: now[0]
        )
        assert feed.poll() is not None
        c.engine_report("p1", None)
        c.engine_report("p1", None)  # never answered: not held against p1
        metrics.slow.set()
        now[0] = 9.0
        assert feed.poll() is None and feed.failures == 1
        assert not c.registry.get("p0").engine_down
        assert c.registry.engines()["p0"].running_decode_requests == 3  # its last load
        now[0] = 10.5  # no answer for longer than down_after_s: out
        assert feed.poll() is None and feed.failures == 2
        assert c.registry.get("p0").engine_down
        metrics.slow.clear()
        metrics.release.set()
        assert feed.poll() is not None  # answers again: back
        assert not c.registry.get("p0").engine_down
    finally:
        metrics.close()
    # Closed: the port refuses, and the node leaves at once, within down_after_s.
    now[0] = 11.0
    assert feed.poll() is None
    assert c.registry.get("p0").engine_down
