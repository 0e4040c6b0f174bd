"""Chat and aggregated serving with real vLLM engines: ``kvcache up --hosts 2`` with two nodes of
role both on two hosts in network namespaces (each with a vLLM server beside it in its host, our
connector, the tiny model with a Llama-3-style chat template) and ``kvcache router --mode
aggregated`` outside them; a second router, disaggregated, in front of the same engines. Driven
with the ``openai`` client as a user would.

What it pins down: the ids the router schedules and serves a chat on are the ids the engine
itself renders for it, for several templates and multi-turn conversations; a conversation's
second turn goes to the engine holding the first turn's prompt and reports those tokens cached,
streamed or not, aggregated or disaggregated; and the tokens equal a single engine's.
"""

from __future__ import annotations

import json
import os
import urllib.request

import openai
import pytest
from test_hosts_netns import REASON, free_subnet, unique_prefix

from bench.engines.models import CHAT_TEMPLATES, MODELS, make_model
from clients.conductor_client import ConductorClient
from kvcache.cluster import Cluster, load_config
from plumbing.launch import start_service
from rpc.wire import layout_from_pb

from helpers import full_computation, wait_until

pytest.importorskip("vllm")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}"),
]

MODEL = "tiny-llama"
BLOCK = 64  # kvcache block tokens
VLLM_BLOCK = 32
MAX_TOKENS = 12
# Two conversations (one per router), each a first turn and a second turn that extends it.
TURNS = {
    "aggregated": [
        {"role": "system", "content": "You answer in one word, about caches. " * 3},
        {"role": "user", "content": "Where does the KV cache of a long prompt go? " * 4},
    ],
    "disaggregated": [
        {"role": "user", "content": "What does a decode engine load from its node? " * 5},
    ],
}
REPLY = {"role": "assistant", "content": "Pages."}
FOLLOW_UP = {"role": "user", "content": "And on the second turn, what is computed again?"}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a cache."},
        {"role": "assistant", "content": "LRU."},
        {"role": "user", "content": "Another one, and why?"},
    ],
]

CONFIG = """
[cluster]
host = "127.0.0.1"
state_dir = "{state}"

[conductor]
policy = "global-cache"

# Two hosts in network namespaces: each engine runs in its node's host, the routers outside.
[hosts]
count = 2
prefix = "{prefix}"
subnet = "{subnet}"

# No layout: each node serves the one its engine's connector registers at start.
[defaults]
dram = "64MiB"

[[node]]
id = "node-0"
role = "both"

[[node]]
id = "node-1"
role = "both"

[engine_defaults]
model = "{model}"
served_model_name = "tiny-llama"
args = ["--block-size", "32", "--max-model-len", "2048", "--max-num-batched-tokens", "2048",
        "--max-num-seqs", "8", "--dtype", "bfloat16", "--enforce-eager",
        "--kv-cache-memory-bytes", "67108864", "--disable-uvicorn-access-log",
        "--trust-request-chat-template"]
start_timeout_s = 900
block_tokens = 64

[[engines]]
node = "node-0"
env = ["VLLM_CPU_OMP_THREADS_BIND=0", "KVCACHE_CONNECTOR_MIN_TIMEOUT_MS=1000"]

[[engines]]
node = "node-1"
env = ["VLLM_CPU_OMP_THREADS_BIND=1", "KVCACHE_CONNECTOR_MIN_TIMEOUT_MS=1000"]

[router]
listen = "127.0.0.1:0"
mode = "aggregated"
args = ["--debug-headers"]  # no keys: every caller is the operator who sees the cache's work
"""


def _turns(mode: str) -> tuple[list[dict], list[dict]]:
    first = TURNS[mode]
    return first, [*first, REPLY, FOLLOW_UP]


def _hf_ids(model: str, messages: list[dict]) -> list[int]:
    """The ids Hugging Face's own rendering of the model's template gives (an independent view
    of what vLLM should compute)."""
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(model).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True
    )
    ids = out["input_ids"] if not isinstance(out, list) else out
    return [int(t) for t in ids]


class Serving:
    def __init__(self, model: str, state: dict, reference: dict, ids: dict) -> None:
        self.model = model  # its directory
        self.state = state
        self.reference = reference  # greedy tokens of a single engine, per (mode, turn)
        self.ids = ids  # Hugging Face's ids of each turn
        self.engines = {e["node"]: e["url"] for e in state["engines"]}
        self.clients: dict[str, openai.OpenAI] = {}
        self.salts: dict[str, bytes] = {}  # node -> its engine's key salt

    def client(self, url: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def idle(self, node: str) -> bool:
        """The conductor's view of ``node`` (its engine's load, scraped) shows no work."""
        with ConductorClient(self.state["conductor"]["address"], self.state.get("token")) as c:
            load = next(s for s in c.list_nodes().nodes if s.node.node_id == node).load
            return load.running_decode_requests == 0 and load.queued_prefill_tokens == 0

    def held(self, node: str, tokens: list[int]) -> int:
        """Leading blocks of ``tokens`` the conductor knows ``node`` holds (keys salted as the
        engines salt them: asked once of the node's engine's connector, as the router asks)."""
        if node not in self.salts:  # fixed for the engine's life: not asked on every poll
            ask = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
            ask["kv_transfer_params"] = {"kvcache_keys": True}
            request = urllib.request.Request(
                self.engines[node] + "/v1/completions",
                json.dumps(ask).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as r:
                kv = json.load(r)["kv_transfer_params"]["kvcache"]
            self.salts[node] = bytes.fromhex(kv["engine"])
        salt = self.salts[node]
        with ConductorClient(self.state["conductor"]["address"], self.state.get("token")) as c:
            layouts = map(layout_from_pb, c.list_nodes().nodes[0].node.layouts)
            (ns,) = [x.namespace for x in layouts if x.model == MODEL]  # not the demo's
            return c.locate(ns, tokens=tokens, salt=salt).get(node, 0)


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    work = tmp_path_factory.mktemp("serving-chat")
    model = str(work / MODEL)
    make_model(model, MODELS["tiny"], max_len=2048, tokenizer=True)
    ids = {(mode, n): _hf_ids(model, turn) for mode in TURNS for n, turn in enumerate(_turns(mode))}
    config = work / "serve.toml"
    config.write_text(
        CONFIG.format(
            state=work / "state", model=model, prefix=unique_prefix(), subnet=free_subnet()
        )
    )
    cluster = Cluster(load_config(str(config)))
    router = None
    try:
        state = cluster.start()
        # What a single engine computes in full (no prefix to load), from one of the cluster's
        # own engines: no third engine to start.
        url = state["engines"][0]["url"]
        outputs = full_computation(url, MODEL, list(ids.values()), MAX_TOKENS)
        reference = dict(zip(ids, outputs))
        s = Serving(model, state, reference, ids)
        router = start_service(
            ["router", "--listen", "127.0.0.1:0", "--debug-headers"]
            + ["--cluster", str(work / "state/cluster.json")],
            log_dir=str(work),
        )
        s.clients = {
            "aggregated": s.client(state["router"]["url"]),
            "disaggregated": s.client(f"http://{router.address}"),
        }
        yield s
    finally:
        if router is not None:
            router.stop()
        cluster.stop()


def test_each_engine_serves_beside_its_node_in_that_hosts_network_namespace(serving):
    """``kvcache up --hosts 2``: an engine listens on its node's host address, in that host's
    network namespace (not the test's), and the routers outside reach it over the bridge; in
    the foreground it stays in the cluster's session."""
    nodes = {n["id"]: n for n in serving.state["nodes"]}
    own = os.readlink("/proc/self/ns/net")
    for engine in serving.state["engines"]:
        node = nodes[engine["node"]]
        host = node["address"].rsplit(":", 1)[0]
        assert engine["url"].startswith(f"http://{host}:") and host != "127.0.0.1"
        assert os.readlink(f"/proc/{engine['pid']}/ns/net") != own
        # a process group of its own (stopped with its children) in the cluster's session: not
        # a scheduling group of its own where the kernel groups by session (sched_autogroup)
        assert os.getpgid(engine["pid"]) == engine["pid"]
        assert os.getsid(engine["pid"]) == os.getsid(0)
    # The nodes were started without a layout: each serves the one its engine registered
    # (beside the demo's, which such a node serves from start), the one the router routes on.
    for node in nodes.values():
        with open(f"/proc/{node['pids'][0]}/cmdline", "rb") as f:
            assert b"--layout" not in f.read().split(b"\0")
    with ConductorClient(serving.state["conductor"]["address"], serving.state.get("token")) as c:
        for status in c.list_nodes().nodes:
            layouts = [layout_from_pb(x) for x in status.node.layouts]
            (layout,) = [x for x in layouts if x.model == MODEL]
            assert (layout.block_tokens, layout.kv_heads) == (BLOCK, 2)


@pytest.mark.parametrize("template", sorted(CHAT_TEMPLATES))
def test_the_router_serves_a_chat_on_the_ids_the_engine_renders(serving, template):
    """For each template and conversation, the ids the engine got through the router (the
    router's rendering, by /tokenize) equal the ids the engine renders itself when asked
    directly, and (the model's own template) Hugging Face's."""
    default = template == "llama3"  # the one in the tokenizer's config
    extra: dict = {"return_token_ids": True}
    if not default:
        extra["chat_template"] = CHAT_TEMPLATES[template]
    direct = serving.client(serving.engines["node-1"])
    for messages in CONVERSATIONS:
        routed = serving.clients["aggregated"].chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, temperature=0, extra_body=extra
        )
        own = direct.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, temperature=0, extra_body=extra
        )
        ids = routed.model_extra["prompt_token_ids"]
        assert ids == own.model_extra["prompt_token_ids"], (template, messages)
        if default:
            assert ids == _hf_ids(serving.model, messages)


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_a_second_turn_hits_the_first_turns_cache(serving, mode):
    first, second = _turns(mode)
    client = serving.clients[mode]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=first,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    out = raw.parse()
    assert out.model_extra["prompt_token_ids"] == serving.ids[(mode, 0)]
    assert out.choices[0].model_extra["token_ids"] == serving.reference[(mode, 0)]
    # a new conversation: at most the template's opening block was seen before
    assert out.usage.prompt_tokens_details.cached_tokens <= VLLM_BLOCK
    node = raw.headers["x-kvcache-prefill-node"]
    assert raw.headers["x-kvcache-mode"] == mode
    assert (node == raw.headers["x-kvcache-decode-node"]) is (mode == "aggregated")
    prompt = serving.ids[(mode, 0)]
    # the conductor learns from the node (its engine stored the prompt's full blocks there), and
    # that the first turn is over (an engine still running it weighs against its node)
    wait_until(
        lambda: serving.held(node, prompt) == len(prompt) // BLOCK, 60, "the first turn's pages"
    )
    wait_until(lambda: serving.idle(node), 60, "the conductor to see the first turn's engine idle")
    with client.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=second,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    ) as response:
        assert response.headers["x-kvcache-mode"] == mode
        if mode == "aggregated":  # where the first turn is (disaggregated: its decode node
            # holds the prompt's pages too, pulled from the prefill node)
            assert response.headers["x-kvcache-prefill-node"] == node
        chunks = list(response.parse())
    tokens = [t for c in chunks for ch in c.choices for t in ch.model_extra.get("token_ids") or []]
    assert tokens == serving.reference[(mode, 1)]
    # the engine that computed the second turn's prompt found the first's in its cache
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert cached == len(prompt) // VLLM_BLOCK * VLLM_BLOCK, (cached, len(prompt))
