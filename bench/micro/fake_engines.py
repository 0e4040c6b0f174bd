"""Fake vLLM engines that stream canned tokens, for measuring what sits in front of them.

``python -m bench.micro.fake_engines --engines 2 --tokens 16 --ttft-ms 20 --itl-ms 5`` serves
that many engines (one aiohttp app per port, one event loop: the fakes take as little CPU as
they can) speaking the part of vLLM's OpenAI API the router uses: ``/v1/models``, ``/health``,
``/tokenize`` (a text's bytes), and ``/v1/completions`` / ``/v1/chat/completions``, streamed
with vLLM's server-sent events or not. A completion waits ``--ttft-ms``, then sends ``max_tokens``
(at most ``--tokens``) chunks ``--itl-ms`` apart, each prepared once. Prints the ready line
(``{"event": "ready", "urls": [...]}``) and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from typing import Any

from aiohttp import web

MODEL = "fake"


class Engine:
    def __init__(self, tokens: int, ttft_s: float, itl_s: float) -> None:
        self.tokens, self.ttft_s, self.itl_s = tokens, ttft_s, itl_s
        chunk = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": MODEL}
        self.chunk = _event({**chunk, "choices": [{"index": 0, "text": "a", "token_ids": [7]}]})
        last = [{"index": 0, "text": "a", "token_ids": [7], "finish_reason": "length"}]
        self.last = _event({**chunk, "choices": last})
        chat = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0}
        delta = [{"index": 0, "delta": {"content": "a"}}]
        self.chat_chunk = _event({**chat, "model": MODEL, "choices": delta})
        done = [{"index": 0, "delta": {"content": "a"}, "finish_reason": "length"}]
        self.chat_last = _event({**chat, "model": MODEL, "choices": done})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/completions", self.completion)
        app.router.add_post("/v1/chat/completions", self.completion)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL, "max_model_len": 1 << 20}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = body.get("prompt") or json.dumps(body.get("messages"))
        return web.json_response({"tokens": list(text.encode())})

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = min(int(body.get("max_tokens") or body.get("max_completion_tokens") or 1), self.tokens)
        prompt = body.get("prompt") or body.get("kv_transfer_params", {}).get("prompt_token_ids")
        usage = _usage(len(prompt or ()), n)
        await asyncio.sleep(self.ttft_s)
        chat = request.path.endswith("chat/completions")
        if not body.get("stream"):
            await asyncio.sleep(self.itl_s * (n - 1))
            return web.json_response(_answer(chat, n, usage))
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        chunk, last = (self.chat_chunk, self.chat_last) if chat else (self.chunk, self.last)
        for i in range(n):
            if i:
                await asyncio.sleep(self.itl_s)
            await response.write(last if i == n - 1 else chunk)
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(_event({"id": "cmpl-fake", "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _answer(chat: bool, n: int, usage: dict[str, Any]) -> dict[str, Any]:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": "a" * n}}
        return {"id": "chatcmpl-fake", "object": "chat.completion", "model": MODEL,
                "choices": [{**choice, "finish_reason": "length"}], "usage": usage}  # fmt: skip
    choice = {"index": 0, "text": "a" * n, "finish_reason": "length"}
    return {"id": "cmpl-fake", "object": "text_completion", "model": MODEL,
            "choices": [choice], "usage": usage}  # fmt: skip


async def serve(args: argparse.Namespace) -> None:
    engine = Engine(args.tokens, args.ttft_ms / 1e3, args.itl_ms / 1e3)
    runners, urls = [], []
    for _ in range(args.engines):
        runner = web.AppRunner(engine.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, 0, backlog=4096)
        await site.start()
        runners.append(runner)
        urls.append(f"http://{args.host}:{runner.addresses[0][1]}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(json.dumps({"event": "ready", "role": "fake-engines", "address": urls[0][7:],
                      "urls": urls, "pid": os.getpid()}), flush=True)  # fmt: skip
    await stop.wait()
    for runner in runners:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.fake_engines", description=__doc__)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per completion at most")
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="before the first token")
    parser.add_argument("--itl-ms", type=float, default=5.0, help="between two tokens")
    asyncio.run(serve(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
