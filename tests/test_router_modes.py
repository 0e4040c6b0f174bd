"""``kvcache router`` in front of a fleet of both-role nodes (each prefills and decodes), with the
fake vLLM engines of test_router_engines.py: one router aggregated (``--disaggregate-above``),
one disaggregated, both real processes beside a real conductor and real nodes.

What it pins down: an aggregated request goes to the engine of the node holding its prefix, and
to it alone; a long uncached suffix goes disaggregated; a chat is scheduled and served on the
very ids the engine's ``/tokenize`` gave for its messages and template fields; a disaggregated
answer reports the prefill's cached tokens (streamed or not); ``/v1/models`` lists every
engine's models; the chat request rules name their field. Real vLLM engines and templates are
test_serving_chat.py.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from typing import Any

import numpy as np
import openai
import pytest
from test_router_engines import DECODE_CACHED, MODEL, PREFILL_CACHED, FakeEngines

from clients.conductor_client import ConductorClient
from clients.node_client import KVStoreClient
from plumbing.launch import ServiceProcess, start_service
from router import chat, protocol

from conftest import TEST_LAYOUT
from helpers import wait_until

NODES = ("b0", "b1", "b2")
BLOCK = 16  # TEST_LAYOUT's block tokens
THRESHOLD = 3 * BLOCK  # the aggregated router's --disaggregate-above
LORA = "fake-lora"  # a model only b2's engine serves
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What moves between prefill and decode?"},
    {"role": "assistant", "content": "The KV cache."},
    {"role": "user", "content": "And between two turns?"},
]


class Fleet:
    def __init__(
        self,
        conductor: ServiceProcess,
        nodes: dict[str, ServiceProcess],
        routers: dict[str, ServiceProcess],
        engines: FakeEngines,
    ) -> None:
        self.conductor, self.nodes, self.engines = conductor, nodes, engines
        self.clients = {
            mode: openai.OpenAI(
                base_url=f"http://{r.address}/v1", api_key="unused", max_retries=0, timeout=60
            )
            for mode, r in routers.items()
        }
        self.urls = {mode: f"http://{r.address}" for mode, r in routers.items()}

    def hold(self, node: str, tokens: list[int]) -> None:
        """``node`` holds the pages of ``tokens``' full blocks (as if its engine stored them),
        and the conductor knows it."""
        with KVStoreClient(self.nodes[node].address) as c:
            ns = c.namespaces()[0]
            info = c.namespace_info(ns)
            blocks = len(tokens) // BLOCK
            c.put(ns, [bytes(info.page_bytes)] * blocks, tokens=tokens)

        def held() -> bool:
            with ConductorClient(self.conductor.address) as c:
                return c.locate(ns, tokens=tokens).get(node, 0) == blocks

        wait_until(held, 30, f"the conductor to index {node}'s blocks")

    def calls(self, rid: str) -> list[tuple[str, str]]:
        with self.engines._lock:
            return [(node, kind) for node, kind, r, _ in self.engines.calls if r == rid]

    def bodies(self, rid: str) -> list[dict[str, Any]]:
        with self.engines._lock:
            return [body for _, _, r, body in self.engines.calls if r == rid]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("router-modes"))
    engines = FakeEngines(list(NODES))
    engines.models["b2"] = [MODEL, LORA]
    started: list[ServiceProcess] = []
    try:
        conductor = start_service(["conductor", "--listen", "127.0.0.1:0"], log_dir=logs)
        started.append(conductor)
        nodes = {}
        for node in NODES:
            args = ["node", "--listen", "127.0.0.1:0", "--dram", "1MiB", "--layout", TEST_LAYOUT]
            args += ["--conductor", conductor.address, "--node-id", node, "--role", "both"]
            nodes[node] = start_service(args, log_dir=logs)
            started.append(nodes[node])
        with ConductorClient(conductor.address) as c:
            wait_until(lambda: len(c.list_nodes().nodes) == len(NODES), 30, "nodes to register")
        routers = {}
        for mode, extra in (
            ("aggregated", ["--mode", "aggregated", "--disaggregate-above", str(THRESHOLD)]),
            ("disaggregated", []),
        ):
            args = ["router", "--listen", "127.0.0.1:0", "--conductor", conductor.address]
            args += ["--debug-headers"]  # no keys: every caller sees what the cache did
            for node, url in engines.urls.items():
                args += ["--engine", f"{node}={url}"]
            routers[mode] = start_service([*args, *extra], log_dir=logs)
            started.append(routers[mode])
        yield Fleet(conductor, nodes, routers, engines)
    finally:
        for sp in reversed(started):
            sp.stop()
        engines.close()


def _rid() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def _prompt(n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng().integers(3, 500, n)]


# ---- aggregated ----------------------------------------------------------------------------------


def test_an_aggregated_request_goes_to_the_engine_holding_its_prefix_alone(fleet):
    prompt = _prompt(4 * BLOCK + 5)
    fleet.hold("b1", prompt)
    for stream in (False, True):
        rid = _rid()
        raw = fleet.clients["aggregated"].completions.with_raw_response.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=3,
            user="whole",
            stream=stream,
            extra_headers={"X-Request-Id": rid},
        )
        assert raw.headers["x-kvcache-mode"] == "aggregated"
        assert raw.headers["x-kvcache-prefill-node"] == raw.headers["x-kvcache-decode-node"]
        assert raw.headers["x-kvcache-reuse-blocks"] == "4"
        out = raw.parse()
        if stream:
            assert [c.choices[0].finish_reason for c in out][-1] == "length"
        else:
            # one engine's answer, as it gave it: what it found cached included
            assert out.usage.prompt_tokens_details.cached_tokens == DECODE_CACHED
        assert fleet.calls(rid) == [("b1", "decode")]  # no separate prefill, no other engine
        assert fleet.bodies(rid)[0]["prompt"] == prompt


def test_a_long_uncached_suffix_goes_disaggregated(fleet):
    prompt = _prompt(4 * BLOCK + 5)  # nobody holds it: 69 uncached tokens > THRESHOLD
    rid = _rid()
    raw = fleet.clients["aggregated"].completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=3, user="whole", extra_headers={"X-Request-Id": rid}
    )
    assert raw.headers["x-kvcache-mode"] == "disaggregated"
    prefill, decode = raw.headers["x-kvcache-prefill-node"], raw.headers["x-kvcache-decode-node"]
    assert prefill != decode and fleet.calls(rid) == [(prefill, "prefill"), (decode, "decode")]
    # the answer reports the prefill's cached tokens, not the decode's load of its pages
    assert raw.parse().usage.prompt_tokens_details.cached_tokens == PREFILL_CACHED
    # held but for a short suffix: aggregated
    fleet.hold("b0", prompt)
    again = fleet.clients["aggregated"].completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=3, user="whole"
    )
    assert again.headers["x-kvcache-mode"] == "aggregated"
    assert again.headers["x-kvcache-decode-node"] == "b0"


# ---- chat ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_is_served_on_the_ids_the_engine_rendered(fleet, mode, stream):
    rid = _rid()
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    documents = [{"title": "t", "text": "kv"}]
    # what the router must ask an engine to render: the template fields, with the template
    # arguments vLLM's chat endpoint adds itself (documents) ...
    rendering = {
        "messages": MESSAGES,
        "chat_template": template,
        "add_generation_prompt": True,
        "chat_template_kwargs": {"custom": 1, "documents": documents},
    }
    ids = [3 + b % 400 for b in json.dumps(rendering, sort_keys=True).encode()][:200]
    if mode == "aggregated":
        fleet.hold("b2", ids)  # a short uncached suffix: served aggregated, where it is held
    raw = fleet.clients[mode].chat.completions.with_raw_response.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=4,
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
        seed=7,
        stop=["\n\n"],
        user="whole",
        extra_body={
            "chat_template": template,
            "chat_template_kwargs": {"custom": 1},
            "documents": documents,
            "add_generation_prompt": True,
        },
        extra_headers={"X-Request-Id": rid},
    )
    out = raw.parse()
    _, asked = fleet.engines.tokenized[-1]
    assert {k: v for k, v in asked.items() if k != "model"} == rendering
    # ... and the serving engine computed those very ids, given with the client's fields
    served = [b for b in fleet.bodies(rid) if "messages" in b]
    assert len(served) == 1 and served[0]["kv_transfer_params"]["prompt_token_ids"] == ids
    assert (served[0]["seed"], served[0]["stop"], served[0]["messages"]) == (7, ["\n\n"], MESSAGES)
    assert raw.headers["x-kvcache-mode"] == mode
    if mode == "disaggregated":  # the prefill computed the same ids, as a completion's prompt
        prefill = [b for b in fleet.bodies(rid) if "prompt" in b]
        assert len(prefill) == 1 and prefill[0]["prompt"] == ids
    else:
        assert raw.headers["x-kvcache-decode-node"] == "b2"
    cached = DECODE_CACHED if mode == "aggregated" else PREFILL_CACHED
    if stream:
        chunks = list(out)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "aaaa"
        usage = chunks[-1].usage
    else:
        assert out.choices[0].message.content == "aaaa"
        usage = out.usage
    assert usage.prompt_tokens == len(ids) and usage.prompt_tokens_details.cached_tokens == cached


def test_models_are_every_engines_and_a_request_may_name_any(fleet):
    with urllib.request.urlopen(fleet.urls["aggregated"] + "/v1/models", timeout=30) as r:
        listed = [m["id"] for m in json.loads(r.read())["data"]]
    assert listed == [MODEL, LORA]
    out = fleet.clients["disaggregated"].chat.completions.create(
        model=LORA, messages=MESSAGES[:2], max_tokens=2, user="whole"
    )
    assert out.choices[0].message.content == "aa"
    with pytest.raises(openai.NotFoundError) as e:
        fleet.clients["aggregated"].chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert e.value.body["param"] == "model" and LORA in e.value.message


BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
        ({"n": 2, "temperature": 0}, "n"),
        ({"n": 0}, "n"),
        ({"stop": ""}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"seed": 2**64}, "seed"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"kv_transfer_params": {"prompt_token_ids": [1]}}, "kv_transfer_params"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": []}, "tools"),
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"chat_template": 5}, "chat_template"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"temperature": 3}, "temperature"),
    ],
)
def test_chat_rules_name_their_field(extra, param):
    with pytest.raises(protocol.RouterError) as e:
        chat.parse_chat({**BASE, **extra}, 0.0, 0.0)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_a_chat_vllm_accepts_is_accepted_with_what_its_template_reads():
    call = chat.parse_chat(
        {
            **BASE,
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "logprobs": True,
            "top_logprobs": 3,
            "n": 2,
            "temperature": 0.5,
            "reasoning_effort": "low",
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "none",
            "ttft_slo_s": 1,
        },
        0.0,
        0.0,
    )
    assert call.max_tokens == 7 and call.path == protocol.CHAT and call.ttft_slo_s == 1.0
    assert "ttft_slo_s" not in call.forward and call.forward["n"] == 2
    assert call.prefill_checked == {"logprobs": 3}
    assert call.chat == {
        "messages": BASE["messages"],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"reasoning_effort": "low", "enable_thinking": True},
    }
    # no max tokens: what the context leaves
    assert protocol.check_context(chat.parse_chat(BASE, 0, 0), 100, 256) == 156
    with pytest.raises(protocol.RouterError) as e:
        protocol.check_context(chat.parse_chat(BASE, 0, 0), 256, 256)
    assert e.value.param == "messages"
