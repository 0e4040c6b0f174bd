"""Disaggregated serving with real vLLM engines: ``kvcache up`` with [[engines]] and [router]
(2 prefill + 2 decode nodes, each with its messenger and a vLLM OpenAI server with our
connector), driven through the router with the ``openai`` client as a user would.

One cluster serves the whole module (4 engines take a minute or two to start here); the test
that kills a decode engine runs last.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import socket
import time
from collections import Counter
from typing import Iterator

import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.engines.models import MODELS, make_model
from clients.conductor_client import ConductorClient
from kvcache.cluster import Cluster, load_config

from helpers import full_computation, wait_until

pytest.importorskip("vllm")
# Four vLLM servers start in the first test's setup: three processes each, each importing vLLM
# (~7 s of CPU apiece on an idle core), so minutes on a busy 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MODEL = "tiny-llama"
BLOCK = 64  # kvcache block tokens (two vLLM blocks of 32)
rng = np.random.default_rng(19)
PLAIN = [int(x) for x in rng.integers(3, 500, 299)]  # 4 full blocks + 43 tokens
STREAMED = [int(x) for x in rng.integers(3, 500, 299)]
SHARED = [int(x) for x in rng.integers(3, 500, 4 * BLOCK)]
FIRST = SHARED + [int(x) for x in rng.integers(3, 500, 40)]
SECOND = SHARED + [int(x) for x in rng.integers(3, 500, 45)]
MAX_TOKENS = 16
ADMIN_TOKEN = "serving-test-admin-token"

CONFIG = """
[cluster]
host = "127.0.0.1"
state_dir = "{state}"
token = "{token}"

[conductor]
policy = "global-cache"

[defaults]
layout = "model=tiny-llama,num_layers=2,kv_heads=2,head_dim=32,dtype=bfloat16,block_tokens=64"
dram = "64MiB"

[[node]]
id = "prefill-0"
role = "prefill"

[[node]]
id = "prefill-1"
role = "prefill"

[[node]]
id = "decode-0"
role = "decode"

[[node]]
id = "decode-1"
role = "decode"

[engine_defaults]
model = "{model}"
served_model_name = "tiny-llama"
args = ["--block-size", "32", "--max-model-len", "2048", "--max-num-batched-tokens", "2048",
        "--max-num-seqs", "8", "--dtype", "bfloat16", "--enforce-eager",
        "--kv-cache-memory-bytes", "67108864", "--disable-uvicorn-access-log"]
start_timeout_s = 900

[[engines]]
node = "prefill-0"
env = ["VLLM_CPU_OMP_THREADS_BIND=0", "KVCACHE_CONNECTOR_TIMEOUT_MS=10000",
       "KVCACHE_CONNECTOR_MIN_TIMEOUT_MS=10000"]

[[engines]]
node = "prefill-1"
env = ["VLLM_CPU_OMP_THREADS_BIND=1", "KVCACHE_CONNECTOR_TIMEOUT_MS=10000",
       "KVCACHE_CONNECTOR_MIN_TIMEOUT_MS=10000"]

[[engines]]
node = "decode-0"
env = ["VLLM_CPU_OMP_THREADS_BIND=0", "KVCACHE_CONNECTOR_TIMEOUT_MS=10000",
       "KVCACHE_CONNECTOR_MIN_TIMEOUT_MS=10000"]

[[engines]]
node = "decode-1"
env = ["VLLM_CPU_OMP_THREADS_BIND=1", "KVCACHE_CONNECTOR_TIMEOUT_MS=10000",
       "KVCACHE_CONNECTOR_MIN_TIMEOUT_MS=10000"]

[router]
listen = "127.0.0.1:0"
args = ["--retry-backoff", "1.0", "--debug-headers"]
"""


class Serving:
    def __init__(self, cluster: Cluster, state: dict, reference: dict[str, list[int]]) -> None:
        self.cluster = cluster
        self.state = state
        self.reference = reference
        self.url = state["router"]["url"]
        self.engines = {e["node"]: e["url"] for e in state["engines"]}
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )

    def engine_metric(self, node: str, name: str, **labels: str) -> float:
        import urllib.request

        with urllib.request.urlopen(self.engines[node] + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def computed(self, node: str) -> dict[str, float]:
        """Prompt tokens the node's engine computed, found in its cache, loaded from kvcache."""
        return {
            source: self.engine_metric(node, "vllm:prompt_tokens_by_source_total", source=source)
            for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
        }

    def counted(self, node: str, before: dict[str, float], **expected: int) -> None:
        """The engine's prompt-token counters moved by exactly ``expected`` since ``before``
        (they are recorded beside the response, so wait until they moved at all)."""

        def delta() -> dict[str, float]:
            now = self.computed(node)
            return {k: now[k] - before[k] for k in expected}

        wait_until(lambda: all(delta()[k] >= v for k, v in expected.items()), 10, "counters")
        assert delta() == expected

    def node_status(self, node: str):
        with ConductorClient(self.state["conductor"]["address"], self.state.get("token")) as c:
            return next(s for s in c.list_nodes().nodes if s.node.node_id == node)


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    work = tmp_path_factory.mktemp("serving")
    model = str(work / MODEL)
    make_model(model, MODELS["tiny"], max_len=2048, tokenizer=True)
    config = work / "serve.toml"
    config.write_text(CONFIG.format(state=work / "state", model=model, token=ADMIN_TOKEN))
    cluster = Cluster(load_config(str(config)))
    try:
        state = cluster.start()
        # What a single engine computes in full (no prefix to load), from one of the cluster's
        # own engines: no fifth engine to start.
        url = state["engines"][0]["url"]
        prompts = [PLAIN, STREAMED, FIRST, SECOND]
        outputs = full_computation(url, MODEL, prompts, MAX_TOKENS)
        reference = dict(zip(("plain", "streamed", "first", "second"), outputs))
        yield Serving(cluster, state, reference)
    finally:
        cluster.stop()


def test_engines_and_the_router_hold_a_tenants_token_not_the_admins(serving):
    # One compromised engine (or router) is one tenant, not the cluster's admin: they were given
    # the admin token file, because pulls were admin-only.
    state_dir = serving.cluster.config.state_dir
    with open(os.path.join(state_dir, "serving-token")) as f:
        tenant_token = f.read().strip()
    assert tenant_token and tenant_token != ADMIN_TOKEN
    pids = [e["pid"] for e in serving.state["engines"]] + [serving.state["router"]["pid"]]
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace")
        assert os.path.join(state_dir, "serving-token") in cmdline, cmdline
        admin_file = os.path.join(state_dir, "token")
        assert admin_file + "\x00" not in cmdline and admin_file + '"' not in cmdline
        assert ADMIN_TOKEN not in cmdline


def _token_ids(choice) -> list[int]:
    return list(choice.model_extra["token_ids"])


def test_greedy_completions_equal_a_single_engine_and_decode_loads_the_prompt(serving):
    before = {n: serving.computed(n) for n in serving.engines}
    raw = serving.client.completions.with_raw_response.create(
        model=MODEL,
        prompt=PLAIN,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    out = raw.parse()
    prefill, decode = raw.headers["x-kvcache-prefill-node"], raw.headers["x-kvcache-decode-node"]
    assert prefill.startswith("prefill-") and decode.startswith("decode-")
    assert _token_ids(out.choices[0]) == serving.reference["plain"]
    # The decode engine loaded the 4 full blocks its node's messenger pulled from the prefill
    # node, and computed only the last 43 tokens.
    assert raw.headers["x-kvcache-pulled-pages"] == "4"
    # The usage's cached tokens are those the prefill did not compute (none: a new prompt), not
    # what the decode engine loaded from the prefill's pages.
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    serving.counted(
        decode,
        before[decode],
        external_kv_transfer=4 * BLOCK,
        local_compute=len(PLAIN) - 4 * BLOCK,
    )
    serving.counted(prefill, before[prefill], local_compute=len(PLAIN), external_kv_transfer=0)

    # Streamed: the same tokens, event by event.
    with serving.client.completions.with_streaming_response.create(
        model=MODEL,
        prompt=STREAMED,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = list(response.parse())
    tokens = [t for c in chunks for ch in c.choices for t in _token_ids(ch)]
    assert tokens == serving.reference["streamed"]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_text_prompts_are_tokenized_by_the_engines(serving):
    text = "Prefill here, decode there, and the KV cache moves between them. " * 3
    out = serving.client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)
    assert out.usage.prompt_tokens == len(text.encode())  # a byte-level tokenizer
    assert out.usage.completion_tokens == 8 or out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # a new prompt for the prefill


def test_a_shared_prefix_goes_to_its_holder_whose_prefill_computes_only_the_suffix(serving):
    first = serving.client.completions.with_raw_response.create(
        model=MODEL,
        prompt=FIRST,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    holder = first.headers["x-kvcache-prefill-node"]
    assert _token_ids(first.parse().choices[0]) == serving.reference["first"]
    # Until the conductor's next scrape of the holder's engine, it may still count FIRST as
    # queued there, and then fetching the prefix to the idle prefill node is the better plan.
    wait_until(
        lambda: serving.node_status(holder).load.queued_prefill_tokens == 0,
        10,
        "the conductor to see the holder's engine idle",
    )
    before = serving.computed(holder)
    second = serving.client.completions.with_raw_response.create(
        model=MODEL,
        prompt=SECOND,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert second.headers["x-kvcache-prefill-node"] == holder  # the global-cache policy
    assert second.headers["x-kvcache-reuse-blocks"] == "4"
    assert second.headers["x-kvcache-prefill-cached-tokens"] == str(4 * BLOCK)
    serving.counted(holder, before, local_compute=len(SECOND) - 4 * BLOCK)
    assert _token_ids(second.parse().choices[0]) == serving.reference["second"]
    # The decode node pulled the 4 full blocks, or held them already (FIRST's decode node).
    moved = int(second.headers["x-kvcache-pulled-pages"])
    held = int(second.headers["x-kvcache-held-pages"])
    assert moved + held == 4
    if second.headers["x-kvcache-decode-node"] == first.headers["x-kvcache-decode-node"]:
        assert held == 4


def test_a_request_the_conductor_rejects_is_429_naming_the_slo(serving):
    with pytest.raises(openai.RateLimitError) as e:
        serving.client.completions.create(
            model=MODEL, prompt=PLAIN, max_tokens=4, extra_body={"ttft_slo_s": 1e-6}
        )
    assert e.value.status_code == 429
    assert "TTFT SLO" in e.value.message


@pytest.mark.parametrize(
    "body, status, says",
    [
        ({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": []}, 400, "empty"),
        ({"model": MODEL, "prompt": [[1, 2], [3, 4]]}, 400, "one prompt per request"),
        ({"model": MODEL, "prompt": [1, -2]}, 400, "token ids"),
        ({"model": MODEL, "prompt": [5, 100000], "max_tokens": 2}, 400, "100000"),
        ({"model": MODEL, "prompt": [5] * 2048, "max_tokens": 1}, 400, "context"),
        ({"model": MODEL, "prompt": [5, 6], "max_tokens": 4096}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": [5, 6], "n": 2, "temperature": 0}, 400, "'n'"),
        ({"model": "gpt-9", "prompt": [1, 2]}, 404, "gpt-9"),
        ({"prompt": [1, 2]}, 400, "model"),
        ({"model": MODEL, "prompt": [1, 2], "ttft_slo_s": -1}, 400, "ttft_slo_s"),
    ],
)
def test_bad_requests_get_a_clear_error(serving, body, status, says):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        serving.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=60)
    assert e.value.code == status
    error = json.loads(e.value.read())["error"]
    assert says in error["message"], error


@contextlib.contextmanager
def long_stream(
    serving: Serving, prompt: list[int], max_tokens: int = 1500, first_event: bool = True
) -> Iterator[tuple[str, Iterator]]:
    """A streamed completion of ``max_tokens`` tokens, opened (its headers, and with
    ``first_event`` its first event, read): (its decode node, the rest of its events); the
    client leaves when the block ends."""
    response = serving.client.completions.with_streaming_response.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    with response as stream:
        events = iter(stream.parse())
        if first_event:
            next(events)
        yield stream.headers["x-kvcache-decode-node"], events


def test_the_conductor_learns_engine_load_from_the_engines(serving):
    """While a long stream decodes, the conductor's view of the decode node (ListNodes, fed by
    scraping the engine's metrics) counts it; when the client leaves, the engine drops it."""

    def running(node: str) -> int:
        return int(serving.node_status(node).load.running_decode_requests)

    # A stream can end before the conductor's next good scrape of its engine (one every
    # 0.5 s; a busy engine on a loaded machine answers late): then another one is opened,
    # until one is seen, for minutes (a conductor that never sees one fails).
    seen = None
    deadline = time.monotonic() + 300
    while seen != "seen" and time.monotonic() < deadline:
        with long_stream(serving, PLAIN, 2048 - len(PLAIN)) as (decode, _):
            seen = wait_until(
                lambda: (
                    "seen"
                    if running(decode) >= 1
                    else "ended"
                    if serving.engine_metric(decode, "vllm:num_requests_running") == 0
                    else None
                ),
                120,
                "the conductor to see the running request, or the request to end",
            )
    assert seen == "seen", "for 5 minutes, streams of 1749 tokens ended unseen by the conductor"
    wait_until(lambda: running(decode) == 0, 60, "the engine to drop the abandoned request")


class Reading:
    """A streamed completion read by the openai client: the tokens its chunks carried
    (``return_token_ids``: vLLM merges several tokens into one chunk when its server falls
    behind), the last chunk's ``finish_reason``, and the error it ended with."""

    def __init__(self, serving: Serving, prompt: list[int], max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.stream = serving.client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        self.node = self.stream.response.headers["x-kvcache-decode-node"]
        self.events = iter(self.stream)
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.error: openai.APIError | None = None
        self.ended = False

    def read(self, until: int | None = None) -> "Reading":
        """Read until ``until`` tokens came (None: to the end of the stream)."""
        try:
            while until is None or len(self.tokens) < until:
                chunk = next(self.events)
                for choice in chunk.choices:
                    self.tokens += _token_ids(choice)
                    self.finish = choice.finish_reason
                if self.finish is not None and until is not None:
                    break
        except StopIteration:
            self.ended = True
        except openai.APIError as e:
            self.error, self.ended = e, True
        return self

    def close(self) -> None:
        self.stream.close()

    def assert_whole_or_failed(self) -> None:
        """A stream ends with a last chunk carrying finish_reason, every token there, or with
        the router's error event; never cut short as if whole."""
        assert self.ended
        if self.error is not None:
            assert not isinstance(self.error, openai.APIConnectionError), self.error
            assert "decode failed" in self.error.message, self.error.message
            return
        assert len(self.tokens) == self.max_tokens and self.finish == "length", (
            f"a stream cut after {len(self.tokens)} of {self.max_tokens} tokens ended "
            f"without an error (finish_reason {self.finish!r})"
        )


def _dead(engine) -> bool:
    """The killed engine is gone: its server exited and its port refuses connections (while the
    kernel tears the processes down, a connection can still be accepted, then reset)."""
    if engine.alive():
        return False
    host, port = engine.url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def _whole_or_failed(serving: Serving, prompt: list[int], max_tokens: int) -> dict:
    """A non-streamed completion: whole (every token, finish_reason length) or a 502."""
    try:
        out = serving.client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    except openai.APIStatusError as e:
        assert e.status_code == 502 and "failed" in e.message, e.message
        return {"error": e.message}
    choice = out.choices[0]
    assert len(_token_ids(choice)) == max_tokens and choice.finish_reason == "length"
    return {"ok": True}


def test_killing_the_decode_engine_at_any_moment_ends_every_request_whole_or_with_an_error(
    serving,
):
    """One decode engine is killed while streams on it are at different moments (just opened,
    half read, read to their finish_reason) and non-streamed requests run: each ends whole or
    with an error, whichever the kill found; the cluster keeps serving on the other one."""
    max_tokens = 2048 - len(STREAMED)
    readings: list[Reading] = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            # The conductor spreads streams over both decode nodes: open until three share one.
            while max(Counter(r.node for r in readings).values(), default=0) < 3:
                assert len(readings) < 8, "the conductor put no three of 8 streams on one node"
                readings.append(Reading(serving, STREAMED, max_tokens))
            victim = Counter(r.node for r in readings).most_common(1)[0][0]
            opened, half, end = [r for r in readings if r.node == victim][:3]
            half.read(max_tokens // 2)
            end.read(max_tokens)  # to the chunk with finish_reason; [DONE] is still to come
            plain = [pool.submit(_whole_or_failed, serving, PLAIN, max_tokens) for _ in range(2)]
            engine = next(e for e in serving.cluster.serving.engines if e.spec.node == victim)
            engine.kill()  # its server, engine core and workers at once: a crash (shm removed)
            for r in readings:
                r.read().assert_whole_or_failed()
            for f in plain:
                f.result(timeout=300)
        finally:
            for r in readings:
                r.close()
    # The next requests decode elsewhere: the conductor stopped scheduling the dead engine's
    # node, or the router's retry left it out. (A request that reaches an engine in the
    # moment it dies is a 502: it may have taken it, so it is not run twice.)
    wait_until(lambda: _dead(engine), 60, "the killed engine to be gone")
    for prompt in (PLAIN, FIRST):
        raw = serving.client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=4, temperature=0
        )
        assert raw.headers["x-kvcache-decode-node"] != victim
        assert raw.parse().usage.completion_tokens == 4


def test_killing_a_prefill_engine_mid_request_ends_it_whole_or_with_an_error(serving):
    """A prefill engine killed while it computes prompts: each request ends whole or with a
    502 (its prefill engine had taken it: not run twice), and the cluster serves on."""
    prompts = [[int(x) for x in rng.integers(3, 500, 1800)] for _ in range(3)]
    prefills = [e for e in serving.cluster.serving.engines if e.spec.node.startswith("prefill-")]

    def busy() -> str | None:
        return next(
            (
                e.spec.node
                for e in prefills
                if serving.engine_metric(e.spec.node, "vllm:num_requests_running") > 0
            ),
            None,
        )

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_whole_or_failed, serving, p, 16) for p in prompts]
        # Killed as soon as one computes a prompt; if they were all faster than the probe,
        # the first prefill engine is killed anyway: the rest must hold either way.
        victim = wait_until(
            lambda: busy() or (all(f.done() for f in futures) and prefills[0].spec.node),
            120,
            "a prefill engine to compute a prompt",
        )
        engine = next(e for e in prefills if e.spec.node == victim)
        engine.kill()
        for f in futures:
            f.result(timeout=300)
    wait_until(lambda: _dead(engine), 60, "the killed engine to be gone")
    raw = serving.client.completions.with_raw_response.create(
        model=MODEL, prompt=PLAIN, max_tokens=4, temperature=0
    )
    assert raw.headers["x-kvcache-prefill-node"] != victim
    assert raw.parse().usage.completion_tokens == 4
