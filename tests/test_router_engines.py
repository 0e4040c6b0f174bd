"""``kvcache router`` as a real process in front of a real conductor and four real nodes, with
engines that misbehave on purpose: aiohttp servers on loopback ports that speak vLLM's OpenAI
API (``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` streamed or not,
``/tokenize``, vLLM's SSE framing and error bodies) and, for the decode, do what the request's
``user`` field names: answer whole, cut the connection at a chosen event, stall, send an
over-long or unparseable event, answer 503 or 500, answer slowly, or hold the request until its
client leaves. The client is the ``openai`` package, as a user's would be (test_router_modes.py
serves chats and aggregated fleets from the same fake engines).

What it pins down: every stream ends with a last chunk carrying ``finish_reason`` or with an
error event, never cut short as if whole; a non-streamed completion slower than the engine
timeout is not timed out; only work an engine never took is retried, on other nodes; a client
that leaves stops its engine requests and frees its ledger entry; the in-flight bound answers
429; request ids go to the engines and come back in every answer; connections to the engines
are reused. Real vLLM engines are
test_serving.py; the request rules themselves are checked directly at the end.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.request
import uuid
from typing import Any, Callable

import openai
import pytest
from aiohttp import web

from clients.conductor_client import ConductorClient
from plumbing.launch import ServiceProcess, start_service
from router import protocol

from conftest import TEST_LAYOUT
from helpers import wait_until

NODE = web.AppKey("node", str)
NODES = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode", "decode-1": "decode"}
ENGINE_TIMEOUT_S = 3.0  # the router's --engine-timeout here
MAX_INFLIGHT = 3
MODEL = "fake"
PROMPT = list(range(1, 41))  # two full 16-token blocks and 8 more
STALL_PREFILL = 499  # a stop token id that makes the fake prefill hang
PREFILL_CACHED = 16  # prompt tokens a fake prefill reports it found cached
DECODE_CACHED = 32  # ... and a fake decode (what it loaded of the prefill's pages)


class FakeEngines:
    """One vLLM-like server per node, in a thread of the test process. ``calls``: (node,
    "prefill" | "decode", X-Request-Id, body) per completion request; ``held`` / ``cancelled``:
    request ids of decodes holding / whose client (the router) went away."""

    def __init__(self, nodes: list[str]) -> None:
        self.calls: list[tuple[str, str, str, dict[str, Any]]] = []
        self.held: list[str] = []
        self.cancelled: list[str] = []
        self.once: set[str] = set()  # behaviours already played once (e.g. 503-first:ID)
        self.dying: set[str] = set()  # nodes whose engine dies after its next answer
        self.dead: set[str] = set()  # ... and died: no longer listening, old connections reset
        self.urls: dict[str, str] = {}
        self.models: dict[str, list[str]] = {node: [MODEL] for node in nodes}
        self.tokenized: list[tuple[str, dict[str, Any]]] = []  # (node, /tokenize body)
        # per node: what its prefill does as a connector would (store the prompt's pages on its
        # node, then report their keys): called with the prompt's token ids, returns the
        # ``kvcache`` report the router reads from ``kv_transfer_params``
        self.stores: dict[str, Callable[[list[int]], dict[str, Any]]] = {}
        # per node: the router's ports of the connections its requests came on
        self.connections: dict[str, set[int]] = {node: set() for node in nodes}
        self._sites: dict[str, web.TCPSite] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runners = [
            asyncio.run_coroutine_threadsafe(self._serve(node), self._loop).result(30)
            for node in nodes
        ]

    async def _serve(self, node: str) -> web.AppRunner:
        app = web.Application()
        app[NODE] = node
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/tokenize", self._tokenize)
        runner = web.AppRunner(app, handler_cancellation=True)  # a left client cancels, as vLLM
        await runner.setup()
        site = self._sites[node] = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        self.urls[node] = f"http://127.0.0.1:{port}"
        return runner

    async def _die(self, node: str) -> None:
        """As a killed engine: nothing listens on its port (a new connection is refused), and
        a request on a connection it had open is reset."""
        await self._sites[node].stop()
        with self._lock:
            self.dead.add(node)

    def revive(self, node: str) -> None:
        async def listen() -> None:
            site = web.TCPSite(self._sites[node]._runner, "127.0.0.1", int(self.urls[node][17:]))
            await site.start()
            self._sites[node] = site

        asyncio.run_coroutine_threadsafe(listen(), self._loop).result(30)
        with self._lock:
            self.dying.discard(node)
            self.dead.discard(node)

    def close(self) -> None:
        for runner in self._runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def decodes(self, rid: str) -> list[str]:
        with self._lock:
            return [node for node, kind, r, _ in self.calls if kind == "decode" and r == rid]

    def prefills(self, rid: str) -> list[str]:
        with self._lock:
            return [node for node, kind, r, _ in self.calls if kind == "prefill" and r == rid]

    async def _models(self, request: web.Request) -> web.Response:
        models = self.models[request.app[NODE]]
        return web.json_response({"data": [{"id": m, "max_model_len": 256} for m in models]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        """A chat's ids: a made-up rendering of its messages and template fields, so that
        any field the router leaves out changes them."""
        body = await request.json()
        with self._lock:
            self.tokenized.append((request.app[NODE], body))
        if "messages" not in body:
            return web.json_response({"tokens": list(body["prompt"].encode())})
        text = json.dumps({k: v for k, v in body.items() if k != "model"}, sort_keys=True)
        return web.json_response({"tokens": [3 + b % 400 for b in text.encode()][:200]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        node, rid = request.app[NODE], request.headers.get("X-Request-Id", "")
        with self._lock:
            self.calls.append((node, "decode", rid, body))
            self.connections[node].add(_peer_port(request))
        n = body.get("max_completion_tokens") or body.get("max_tokens") or 4
        prompt = len(body["kv_transfer_params"]["prompt_token_ids"])
        if body.get("stream"):
            usage = (body.get("stream_options") or {}).get("include_usage")
            return await self._stream(request, rid, "whole", n, chat=prompt if usage else 0)
        message = {"role": "assistant", "content": "a" * n}
        return web.json_response(
            {
                "id": f"chatcmpl-{rid}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
                "usage": _usage(prompt, n, DECODE_CACHED),
            }
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        node, rid = request.app[NODE], request.headers.get("X-Request-Id", "")
        with self._lock:
            self.connections[node].add(_peer_port(request))
        if node in self.dead:
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        kind = "decode" if "user" in body else "prefill"  # the router's prefill names no user
        if node in self.dying:  # it stops listening now, and answers this one on its way out
            await self._die(node)
        with self._lock:
            self.calls.append((node, kind, rid, body))
        if kind == "prefill":
            if body.get("stop_token_ids") == [STALL_PREFILL]:  # the test's cue: a hung prefill
                return await self._hold(rid)
            if (body.get("logprobs") or 0) > 20:  # vLLM's default --max-logprobs
                return _error(
                    400,
                    "Requested sample logprobs of 50, which is greater than max allowed: 20",
                    "logprobs",
                )
            answer = _completion(rid, [7], "length", PREFILL_CACHED)
            store = self.stores.get(node)
            if store is not None:
                report = await asyncio.get_running_loop().run_in_executor(
                    None, store, body["prompt"]
                )
                answer["kv_transfer_params"] = {"kvcache": report}
            return web.json_response(answer)
        behaviour = body["user"]
        if behaviour.startswith("503-first:"):
            with self._lock:
                first = behaviour not in self.once
                self.once.add(behaviour)
            if first:
                return _error(503, "the engine is not taking requests now", None)
            behaviour = "whole"
        n = body["max_tokens"]
        if body.get("stream"):
            return await self._stream(request, rid, behaviour, n)
        if behaviour == "hold":
            return await self._hold(rid)
        if behaviour.startswith("slow:"):
            await asyncio.sleep(float(behaviour[5:]))
        elif behaviour == "cut":
            assert request.transport is not None
            request.transport.abort()  # accepted, then the engine dies
            return web.Response()
        elif behaviour == "500":
            return _error(500, "EngineCore died", None)
        return web.json_response(_completion(rid, list(range(n)), "length"))

    async def _hold(self, rid: str) -> web.Response:
        with self._lock:
            self.held.append(rid)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            with self._lock:
                self.cancelled.append(rid)
            raise
        raise AssertionError("held for an hour")

    async def _stream(
        self, request: web.Request, rid: str, behaviour: str, n: int, chat: int = -1
    ) -> web.StreamResponse:
        """``chat``: a chat's chunks, then (> 0) a usage event for that many prompt tokens."""
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        cut = int(behaviour[4:]) if behaviour.startswith("cut:") else None
        transport = request.transport
        assert transport is not None
        try:
            for i in range(n):
                if i == cut:
                    transport.abort()
                    return response
                if behaviour == "stall" and i == 2:
                    return await self._hold(rid)
                if behaviour == "not-json" and i == 2:
                    await response.write(b'data: {"choices": [{"text": "a"\n\n')
                if behaviour == "long-line" and i == 2:
                    for _ in range(17):  # one event over the router's 16 MiB
                        await response.write(b"data: " + b"x" * (1 << 20))
                finish = "length" if i == n - 1 else None
                chunk = _chunk(rid, i, finish) if chat < 0 else _chat_chunk(rid, finish)
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if chat > 0:
                usage = {"id": f"chatcmpl-{rid}", "choices": []}
                usage["usage"] = _usage(chat, n, DECODE_CACHED)
                await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
            if behaviour == "cut-before-done":
                transport.abort()
                return response
            if behaviour != "no-done":
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:
            pass  # the router left: what it made of the stream is what the test checks
        return response


def _completion(
    rid: str, tokens: list[int], finish: str, cached: int = DECODE_CACHED
) -> dict[str, Any]:
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {"index": 0, "text": "a" * len(tokens), "token_ids": tokens, "finish_reason": finish}
        ],
        "usage": _usage(len(PROMPT), len(tokens), cached),
    }


def _peer_port(request: web.Request) -> int:
    """The router's end of the connection a request came on (a new one, a new port)."""
    assert request.transport is not None
    return int(request.transport.get_extra_info("peername")[1])


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _chat_chunk(rid: str, finish: str | None) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": "a"}, "finish_reason": finish}
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "choices": [choice]}


def _chunk(rid: str, i: int, finish: str | None) -> dict[str, Any]:
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": "a", "token_ids": [i], "finish_reason": finish}],
    }


def _error(status: int, message: str, param: str | None) -> web.Response:
    error = {"message": message, "type": "BadRequestError", "param": param, "code": status}
    return web.json_response({"error": error}, status=status)


class Cluster:
    def __init__(self, conductor: ServiceProcess, router: ServiceProcess, engines: FakeEngines):
        self.conductor, self.router, self.engines = conductor, router, engines
        self.url = f"http://{router.address}"
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60
        )

    def pending(self) -> int:
        with ConductorClient(self.conductor.address) as c:
            return int(c.list_nodes().pending_requests)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[-1])
        return 0.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("router-engines"))
    engines = FakeEngines(list(NODES))
    started: list[ServiceProcess] = []
    try:
        conductor = start_service(["conductor", "--listen", "127.0.0.1:0"], log_dir=logs)
        started.append(conductor)
        for node, role in NODES.items():
            args = ["node", "--listen", "127.0.0.1:0", "--dram", "1MiB", "--layout", TEST_LAYOUT]
            args += ["--conductor", conductor.address, "--node-id", node, "--role", role]
            started.append(start_service(args, log_dir=logs))
        with ConductorClient(conductor.address) as c:
            wait_until(lambda: len(c.list_nodes().nodes) == len(NODES), 30, "nodes to register")
        args = ["router", "--listen", "127.0.0.1:0", "--conductor", conductor.address]
        for node, url in engines.urls.items():
            args += ["--engine", f"{node}={url}"]
        args += ["--engine-timeout", str(ENGINE_TIMEOUT_S), "--max-inflight", str(MAX_INFLIGHT)]
        args += ["--retry-backoff", "0.1", "--debug-headers"]  # no keys: every caller sees
        router = start_service(args, log_dir=logs)
        started.append(router)
        yield Cluster(conductor, router, engines)
    finally:
        for sp in reversed(started):
            sp.stop()
        engines.close()


def _rid() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def _stream(cluster: Cluster, behaviour: str, rid: str, max_tokens: int = 12):
    """The chunks a streamed completion delivered, and the error it ended with (or None)."""
    chunks = []
    try:
        stream = cluster.client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=max_tokens,
            stream=True,
            user=behaviour,
            extra_headers={"X-Request-Id": rid},
        )
        for chunk in stream:
            chunks.append(chunk)
    except openai.APIError as e:
        return chunks, e
    return chunks, None


# ---- streams end whole or with an error event ---------------------------------------------------


@pytest.mark.parametrize(
    "behaviour, says",
    [
        ("cut:0", "engine at"),  # headers, then the engine dies (a 502 if before they came)
        ("cut:5", "stream cut"),
        ("cut-before-done", "stream cut"),  # every token and finish_reason, then no [DONE]
        ("no-done", "without [DONE]"),  # a clean end of the response, short of [DONE]
        ("not-json", "not a JSON object"),
        ("long-line", "longer than 16777216 bytes"),
        ("stall", f"no event for {ENGINE_TIMEOUT_S:g} s"),  # the router's own read deadline
    ],
)
def test_a_stream_the_engine_fails_ends_with_an_error_event_naming_it(cluster, behaviour, says):
    rid = _rid()
    chunks, error = _stream(cluster, behaviour, rid)
    assert error is not None, f"{behaviour}: {len(chunks)} chunks and no error"
    assert not isinstance(error, openai.APIConnectionError)  # an event, not a dropped connection
    assert "decode failed" in error.message and says in error.message, error.message
    assert isinstance(error.body, dict) and error.body["request_id"] == rid
    assert len(cluster.engines.decodes(rid)) == 1  # a stream is never sent again
    if behaviour == "stall":  # the engine's request was dropped, as a left client's is
        wait_until(lambda: rid in cluster.engines.cancelled, 30, "the stalled decode to be dropped")


def test_a_whole_stream_ends_with_finish_reason_and_carries_the_request_id(cluster):
    rid = _rid()
    chunks, error = _stream(cluster, "whole", rid)
    assert error is None
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == list(range(12))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.id == f"cmpl-{rid}" for c in chunks)  # the engine named it after our id
    assert cluster.engines.prefills(rid) and cluster.engines.decodes(rid)


# ---- non-streamed: long ones, retries, errors ---------------------------------------------------


def test_a_non_streamed_completion_slower_than_the_engine_timeout_is_not_timed_out(cluster):
    rid = _rid()
    raw = cluster.client.completions.with_raw_response.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        user=f"slow:{ENGINE_TIMEOUT_S * 1.5}",  # silent for longer than --engine-timeout
        extra_headers={"X-Request-Id": rid},
    )
    out = raw.parse()
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    assert raw.headers["x-request-id"] == rid and raw.headers["x-kvcache-attempts"] == "1"
    assert len(cluster.engines.decodes(rid)) == 1 and len(cluster.engines.prefills(rid)) == 1


def test_an_engine_that_did_not_take_the_request_is_retried_on_another_node(cluster):
    rid = _rid()
    raw = cluster.client.completions.with_raw_response.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        user=f"503-first:{rid}",
        extra_headers={"X-Request-Id": rid},
    )
    assert raw.parse().usage.completion_tokens == 4
    first, second = cluster.engines.decodes(rid)
    assert second != first  # the conductor was told to leave out the node that refused
    assert raw.headers["x-kvcache-decode-node"] == second
    assert raw.headers["x-kvcache-attempts"] == "2"
    wait_until(lambda: cluster.pending() == 0, 30, "both attempts' ledger entries to be freed")


def test_connections_to_the_engines_are_kept_alive_and_reused(cluster):
    """A connect per engine request was a measurable share of the router's own latency."""
    before = {node: set(ports) for node, ports in cluster.engines.connections.items()}
    for _ in range(4):
        cluster.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, user="whole")
        _stream(cluster, "whole", _rid(), max_tokens=3)
    new = sum(len(ports - before[n]) for n, ports in cluster.engines.connections.items())
    assert new <= len(NODES), f"{new} new connections for 8 requests (16 engine requests)"


def test_an_engine_that_died_since_its_last_answer_is_retried_not_a_502(cluster):
    """A kept-alive connection to an engine killed since is reset without an answer (did it take
    the request?); the router then finds the engine refusing new connections: gone, its work
    with it, so the request is retried on another node."""
    before = cluster.client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, user="whole"
    )
    victim = before.headers["x-kvcache-decode-node"]
    cluster.engines.dying.add(victim)
    try:
        for _ in range(10):  # until one is decoded there (the conductor prefers it when idle)
            cluster.client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=2, user="whole"
            )
            if victim in cluster.engines.dead:
                break
        assert victim in cluster.engines.dead
        for _ in range(3):  # the next ones may be placed on the dead engine's node first
            rid = _rid()
            raw = cluster.client.completions.with_raw_response.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=2,
                user="whole",
                extra_headers={"X-Request-Id": rid},
            )
            assert raw.parse().usage.completion_tokens == 2
            assert raw.headers["x-kvcache-decode-node"] != victim
    finally:
        cluster.engines.revive(victim)


@pytest.mark.parametrize("behaviour, says", [("cut", "POST /v1/completions"), ("500", "500")])
def test_an_engine_that_failed_after_taking_the_request_is_a_502_not_a_second_run(
    cluster, behaviour, says
):
    rid = _rid()
    with pytest.raises(openai.APIStatusError) as e:
        cluster.client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=4,
            user=behaviour,
            extra_headers={"X-Request-Id": rid},
        )
    assert e.value.status_code == 502
    assert "decode failed" in e.value.message and says in e.value.message
    assert e.value.body["request_id"] == rid and e.value.response.headers["x-request-id"] == rid
    assert len(cluster.engines.decodes(rid)) == 1 and len(cluster.engines.prefills(rid)) == 1


def test_a_prefill_silent_past_the_engine_timeout_is_a_502_and_is_dropped(cluster):
    rid = _rid()
    with pytest.raises(openai.APIStatusError) as e:
        cluster.client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=4,
            user="whole",
            extra_body={"stop_token_ids": [STALL_PREFILL]},  # the prefill request carries it
            extra_headers={"X-Request-Id": rid},
        )
    assert e.value.status_code == 502
    assert "prefill failed" in e.value.message and "no answer in time" in e.value.message
    assert len(cluster.engines.prefills(rid)) == 1 and not cluster.engines.decodes(rid)
    wait_until(lambda: rid in cluster.engines.cancelled, 30, "the hung prefill to be dropped")
    wait_until(lambda: cluster.pending() == 0, 30, "its ledger entry to be freed")


def test_a_value_the_model_refuses_fails_at_the_prefill_before_any_decode(cluster):
    rid = _rid()
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=4,
            logprobs=50,
            user="whole",
            extra_headers={"X-Request-Id": rid},
        )
    assert "max allowed: 20" in e.value.message and e.value.body["request_id"] == rid
    assert cluster.engines.prefills(rid) and not cluster.engines.decodes(rid)


def test_bad_requests_are_refused_before_any_engine_with_the_request_id(cluster):
    rid = _rid()
    with pytest.raises(openai.BadRequestError) as e:
        cluster.client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            n=2,
            temperature=0,
            extra_headers={"X-Request-Id": rid},
        )
    assert e.value.body["param"] == "n" and e.value.body["request_id"] == rid
    assert e.value.response.headers["x-request-id"] == rid
    assert not cluster.engines.prefills(rid)
    # max_tokens null is vLLM's default, 16, as the engine would read it
    raw = cluster.client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=None, user="whole", extra_body={"max_tokens": None}
    )
    out = raw.parse()
    assert out.usage.completion_tokens == protocol.DEFAULT_MAX_TOKENS
    # no X-Request-Id given: the router's own names the request, at the engines too
    own = raw.headers["x-request-id"]
    assert out.id == f"cmpl-{own}" and raw.headers["x-kvcache-request-id"] == f"{own}.1"


# ---- clients that leave, and the in-flight bound ------------------------------------------------


def _post(address: str, body: dict[str, Any], rid: str) -> socket.socket:
    """A completion request on a raw connection, left open (closing it is the client leaving)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {rid}\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def test_a_client_that_leaves_stops_its_decode_and_frees_its_ledger_entry(cluster):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "user": "hold"}
    rids = [_rid() for _ in range(MAX_INFLIGHT)]
    socks = [_post(cluster.router.address, body, rid) for rid in rids]
    try:
        wait_until(lambda: set(rids) <= set(cluster.engines.held), 30, "the decodes to start")
        # the bound: one more is refused at once, naming it
        with pytest.raises(openai.RateLimitError) as e:
            cluster.client.completions.create(model=MODEL, prompt=PROMPT, user="whole")
        assert "--max-inflight" in e.value.message
        assert cluster.metric('kvcache_router_requests_total{outcome="busy"}') >= 1
        wait_until(lambda: cluster.pending() == MAX_INFLIGHT, 30, "one ledger entry each")
    finally:
        for sock in socks:
            sock.close()
    wait_until(
        lambda: set(rids) <= set(cluster.engines.cancelled), 30, "the engines to see them go"
    )
    wait_until(lambda: cluster.pending() == 0, 30, "the ledger entries to be freed")
    wait_until(
        lambda: cluster.metric("kvcache_router_inflight_requests") == 0, 30, "in-flight to drop"
    )
    assert cluster.metric('kvcache_router_cancelled_total{what="request"}') >= MAX_INFLIGHT
    # and the router serves again
    out = cluster.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, user="whole")
    assert out.usage.completion_tokens == 3


# ---- the request rules (vLLM's), checked directly -----------------------------------------------

BASE = {"model": "m", "prompt": [1, 2, 3]}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 0}, "n"),
        ({"n": "2"}, "n"),
        ({"n": 2, "temperature": 0}, "n"),
        ({"logprobs": -2}, "logprobs"),
        ({"logprobs": "5"}, "logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"logprob_token_ids": [1]}, "logprob_token_ids"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a", ""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"echo": "yes"}, "echo"),
        ({"ignore_eos": None}, "ignore_eos"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"use_beam_search": True, "stream": True}, "use_beam_search"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
    ],
)
def test_request_rules_are_vllms_each_naming_its_parameter(extra, param):
    with pytest.raises(protocol.RouterError) as e:
        protocol.parse_completion({**BASE, **extra}, 0.0, 0.0)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_requests_vllm_accepts_are_accepted_and_normalized_as_vllm_does():
    call = protocol.parse_completion(
        {
            **BASE,
            "max_tokens": None,
            "n": 3,
            "temperature": 0.7,
            "stop": "x",
            "logprobs": 0,
            "seed": -1,
            "top_k": -1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logit_bias": {"5": -100},
            "ttft_slo_s": 2,
        },
        0.0,
        0.0,
    )
    assert call.max_tokens == protocol.DEFAULT_MAX_TOKENS and call.forward["max_tokens"] == 16
    assert "ttft_slo_s" not in call.forward and call.ttft_slo_s == 2.0
    assert call.prefill_checked == {"logprobs": 0, "logit_bias": {"5": -100}}
    # vLLM clamps the output to the context, and refuses only what cannot fit at all
    assert (
        protocol.check_context(
            protocol.parse_completion({**BASE, "max_tokens": 100}, 0, 0), 2000, 2048
        )
        == 48
    )
    for prompt, max_tokens, param in ((2048, 1, "prompt"), (10, 4096, "max_tokens")):
        with pytest.raises(protocol.RouterError) as e:
            protocol.check_context(
                protocol.parse_completion({**BASE, "max_tokens": max_tokens}, 0, 0), prompt, 2048
            )
        assert e.value.param == param
