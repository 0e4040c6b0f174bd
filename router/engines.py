"""The router's HTTP client of vLLM's OpenAI-compatible servers (aiohttp, one pooled session).

Every failure is an ``EngineError`` that says which engine and whether a retry elsewhere can
help: the engine not answering, cutting the connection or answering 5xx is retriable; a 4xx is
the request's own fault (e.g. a token id outside the vocabulary) and goes back to the client as
the engine worded it.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

import aiohttp


class EngineError(Exception):
    """An engine call that failed. ``status``: the engine's HTTP status (0: no answer);
    ``body``: its error response when it gave one (OpenAI's ``{"error": {...}}``)."""

    def __init__(
        self, engine: "Engine", what: str, status: int = 0, body: dict[str, Any] | None = None
    ) -> None:
        super().__init__(f"{engine.node} engine at {engine.url}: {what}")
        self.engine = engine
        self.status = status
        self.body = body

    @property
    def retriable(self) -> bool:
        """No answer, a cut connection or a server error: another engine may do better."""
        return self.status == 0 or self.status >= 500


@dataclass(frozen=True)
class Engine:
    """A vLLM engine beside node ``node``, serving at ``url`` (``http://host:port``)."""

    node: str
    url: str


@dataclass(frozen=True)
class EngineTimeouts:
    connect_s: float = 5.0
    # Between two reads of a response: a prefill, or the gap between streamed tokens.
    read_s: float = 120.0


class EngineClient:
    def __init__(self, timeouts: EngineTimeouts = EngineTimeouts()) -> None:
        self.timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=self.timeouts.connect_s,
                    sock_read=self.timeouts.read_s,
                ),
                connector=aiohttp.TCPConnector(limit=0),  # the engines bound their own queues
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get_json(self, engine: Engine, path: str) -> Any:
        try:
            async with self._open().get(engine.url + path) as r:
                return await _json_or_raise(engine, path, r)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise EngineError(engine, f"GET {path}: {_describe(e)}") from None

    async def post_json(self, engine: Engine, path: str, body: dict[str, Any]) -> Any:
        try:
            async with self._open().post(engine.url + path, json=body) as r:
                return await _json_or_raise(engine, path, r)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise EngineError(engine, f"POST {path}: {_describe(e)}") from None

    async def tokenize(self, engine: Engine, model: str, text: str) -> list[int]:
        reply = await self.post_json(engine, "/tokenize", {"model": model, "prompt": text})
        tokens = reply.get("tokens") if isinstance(reply, dict) else None
        if not isinstance(tokens, list):
            raise EngineError(engine, f"/tokenize answered without tokens: {reply!r:.200}")
        return [int(t) for t in tokens]

    async def open_stream(self, engine: Engine, body: dict[str, Any]) -> "EngineStream":
        """POST a streamed completion; returns once the engine answered 200 (its events then
        come from ``EngineStream.events``)."""
        session = self._open()
        try:
            r = await session.post(engine.url + "/v1/completions", json=body)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise EngineError(engine, f"POST /v1/completions: {_describe(e)}") from None
        if r.status != 200:
            try:
                await _json_or_raise(engine, "/v1/completions", r)
            finally:
                r.release()
        return EngineStream(engine, r)


class EngineStream:
    """A streamed completion from an engine: server-sent events, passed through as they come."""

    def __init__(self, engine: Engine, response: aiohttp.ClientResponse) -> None:
        self.engine = engine
        self._response = response

    async def events(self) -> AsyncIterator[bytes]:
        """Each ``data: ...`` payload (without the prefix and blank line), ``[DONE]`` last.
        ``EngineError`` when the engine cuts the stream, stalls past the read timeout, or
        ends it without ``[DONE]``."""
        try:
            async for line in self._response.content:
                line = line.strip()
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    yield data
                    if data == b"[DONE]":
                        return
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise EngineError(self.engine, f"stream cut: {_describe(e)}") from None
        raise EngineError(self.engine, "stream ended without [DONE]")

    def close(self) -> None:
        """Drop the connection (an engine aborts a request whose client went away)."""
        self._response.close()


async def _json_or_raise(engine: Engine, path: str, r: aiohttp.ClientResponse) -> Any:
    text = await r.text()
    try:
        body = json.loads(text) if text else None
    except json.JSONDecodeError:
        body = None
    if r.status != 200:
        message = text[:300]
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            message = str(body["error"].get("message", message))
        raise EngineError(
            engine,
            f"{path} answered {r.status}: {message}",
            r.status,
            body if isinstance(body, dict) else None,
        )
    if body is None:
        raise EngineError(engine, f"{path} answered 200 without JSON: {text[:200]!r}", 502)
    return body


def _describe(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "no answer in time"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
