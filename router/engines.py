"""The router's HTTP client of vLLM's OpenAI-compatible servers (aiohttp, one pooled session).

Every failure is an ``EngineError`` that says which engine and whether the engine took the work:
only an engine that provably did not (it refused the connection, did not accept it in time, or
answered 503) may be asked again elsewhere; anything after that (a cut, a stall, a 500) would
run the same work twice. A 4xx is the request's own fault (e.g. a token id outside the
vocabulary) and goes back to the client as the engine worded it.

Streams are read event by event (server-sent events, as vLLM writes them) with a deadline per
event, and every way a stream can go wrong (a cut connection, a stall, an event too long or not
JSON, an end without ``[DONE]``) is an ``EngineError``: the relay turns it into an error event,
never into a stream that looks whole.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator

import aiohttp

# One event of a stream, buffered whole before it is relayed: far above what vLLM writes (a
# chunk of merged tokens with their logprobs, or a prompt's ids in the first one), small
# enough that a runaway engine cannot grow the router's memory without bound.
MAX_EVENT_BYTES = 16 << 20
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


class EngineError(Exception):
    """An engine call that failed. ``status``: the engine's HTTP status (0: no answer);
    ``body``: its error response when it gave one (OpenAI's ``{"error": {...}}``);
    ``accepted``: False only when the engine provably did not take the work."""

    def __init__(
        self,
        engine: "Engine",
        what: str,
        status: int = 0,
        body: dict[str, Any] | None = None,
        accepted: bool = True,
    ) -> None:
        super().__init__(f"{engine.node} engine at {engine.url}: {what}")
        self.engine = engine
        self.status = status
        self.body = body
        self.accepted = accepted

    @property
    def retriable(self) -> bool:
        """The work never reached the engine: another one may do it, nothing runs twice."""
        return not self.accepted


@dataclass(frozen=True)
class Engine:
    """A vLLM engine beside node ``node``, serving at ``url`` (``http://host:port``)."""

    node: str
    url: str


@dataclass(frozen=True)
class EngineTimeouts:
    connect_s: float = 5.0
    # Answers that come at once or piece by piece: a prefill, /tokenize, a stream's headers,
    # and the gap between two events of a stream.
    read_s: float = 120.0
    # A non-streamed decode sends nothing until its last token, so no per-read timeout fits
    # it: one deadline for the whole completion (0: none). An engine that dies closes the
    # connection, which ends the wait at once; the deadline only bounds one that hangs.
    decode_s: float = 3600.0


class EngineClient:
    def __init__(self, timeouts: EngineTimeouts = EngineTimeouts()) -> None:
        self.timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            # A connection per request: a request written to a kept-alive connection whose
            # engine died is reset without a word, and the router could not tell whether the
            # engine took it; a new connection to a dead engine is refused, which says it did
            # not (retried elsewhere). A loopback or LAN connect costs far less than a prefill.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True),  # engines queue
            )
        return self._session

    def _timeout(self, total_s: float | None = None) -> aiohttp.ClientTimeout:
        t = self.timeouts
        if total_s is not None:  # the whole answer, however long its silences
            return aiohttp.ClientTimeout(total=total_s or None, sock_connect=t.connect_s)
        return aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s, sock_read=t.read_s)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get_json(self, engine: Engine, path: str) -> Any:
        try:
            async with self._open().get(engine.url + path, timeout=self._timeout()) as r:
                return await _json_or_raise(engine, path, r)
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the caller gets one kind
            raise _failure(engine, f"GET {path}", e) from None

    async def post_json(
        self,
        engine: Engine,
        path: str,
        body: dict[str, Any],
        request_id: str | None = None,
        whole_s: float | None = None,
    ) -> Any:
        """POST ``body``; its JSON answer. ``whole_s``: a deadline for the whole answer instead
        of the per-read timeout (a non-streamed decode)."""
        headers = {"X-Request-Id": request_id} if request_id else None
        try:
            async with self._open().post(
                engine.url + path, json=body, headers=headers, timeout=self._timeout(whole_s)
            ) as r:
                return await _json_or_raise(engine, path, r)
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _failure(engine, f"POST {path}", e) from None

    async def tokenize(self, engine: Engine, model: str, text: str) -> list[int]:
        reply = await self.post_json(engine, "/tokenize", {"model": model, "prompt": text})
        tokens = reply.get("tokens") if isinstance(reply, dict) else None
        if not isinstance(tokens, list):
            raise EngineError(engine, f"/tokenize answered without tokens: {reply!r:.200}")
        return [int(t) for t in tokens]

    async def open_stream(
        self, engine: Engine, body: dict[str, Any], request_id: str | None = None
    ) -> "EngineStream":
        """POST a streamed completion; returns once the engine answered 200 (its events then
        come from ``EngineStream.events``)."""
        headers = {"X-Request-Id": request_id} if request_id else None
        session = self._open()
        try:
            # the headers within read_s; the events are timed by EngineStream itself
            async with asyncio.timeout(self.timeouts.read_s):
                r = await session.post(
                    engine.url + "/v1/completions",
                    json=body,
                    headers=headers,
                    timeout=self._timeout(0),
                )
        except Exception as e:  # noqa: BLE001
            raise _failure(engine, "POST /v1/completions", e) from None
        if r.status != 200:
            try:
                await _json_or_raise(engine, "/v1/completions", r)
            except EngineError:
                raise
            except Exception as e:  # noqa: BLE001
                raise _failure(engine, "POST /v1/completions", e) from None
            finally:
                r.release()
        return EngineStream(engine, r, self.timeouts.read_s)


class EngineStream:
    """A streamed completion from an engine: server-sent events, passed through as they come."""

    def __init__(
        self,
        engine: Engine,
        response: aiohttp.ClientResponse,
        read_s: float,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        self.engine = engine
        self._response = response
        self.read_s = read_s
        self.max_event_bytes = max_event_bytes

    async def events(self) -> AsyncIterator[bytes]:
        """Each event's ``data`` (a JSON object), ``[DONE]`` last. ``EngineError`` for any
        failure to read the stream: the connection cut or closed before ``[DONE]``, no whole
        event within ``read_s``, an event over ``max_event_bytes`` or not JSON."""
        try:
            async for data in self._events():
                yield data
                if data == b"[DONE]":
                    return
        except EngineError:
            raise
        except TimeoutError:
            raise EngineError(
                self.engine, f"stream stalled: no event for {self.read_s:g} s"
            ) from None
        except Exception as e:  # noqa: BLE001 - every failure ends the stream the same way
            raise EngineError(self.engine, f"stream cut: {_describe(e)}") from None
        raise EngineError(self.engine, "stream ended without [DONE]")

    async def _events(self) -> AsyncIterator[bytes]:
        content = self._response.content
        loop = asyncio.get_running_loop()
        buf = bytearray()
        scanned = 0  # bytes of buf searched for an event's end already
        deadline = loop.time() + self.read_s
        while True:
            end = _EVENT_END.search(buf, max(scanned - 3, 0))
            if end is None:
                scanned = len(buf)
                if len(buf) > self.max_event_bytes:
                    raise EngineError(
                        self.engine, f"an event longer than {self.max_event_bytes} bytes"
                    )
                async with asyncio.timeout_at(deadline):
                    chunk = await content.readany()
                if not chunk:
                    return  # the end of the response (events() says whether it was whole)
                buf += chunk
                continue
            raw = bytes(buf[: end.start()])
            del buf[: end.end()]
            scanned = 0
            data = _data(raw)
            if data is None:
                continue  # a comment (keep-alive) or an event without data
            if data != b"[DONE]":
                try:
                    parsed = json.loads(data)
                except ValueError:
                    parsed = None
                if not isinstance(parsed, dict):
                    raise EngineError(
                        self.engine, f"an event that is not a JSON object: {data[:200]!r}"
                    )
            yield data
            deadline = loop.time() + self.read_s  # the client's own pace does not count

    def close(self) -> None:
        """Drop the connection (an engine aborts a request whose client went away)."""
        self._response.close()


def _data(raw: bytes) -> bytes | None:
    """The ``data`` field of one server-sent event (its lines joined), None without one."""
    lines = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    values = []
    for line in lines:
        if line.startswith(b"data:"):
            value = line[5:]
            values.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(values) if values else None


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
            accepted=r.status != 503,  # vLLM's 503: it is not taking requests now
        )
    if body is None:
        raise EngineError(engine, f"{path} answered 200 without JSON: {text[:200]!r}", 502)
    return body


def _failure(engine: Engine, what: str, e: BaseException) -> EngineError:
    """A call that got no answer. Refused or not connected in time: the engine never saw it."""
    never_sent = isinstance(e, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))
    return EngineError(engine, f"{what}: {_describe(e)}", accepted=not never_sent)


def _describe(e: BaseException) -> str:
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return "not connected in time"
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
        return "no answer in time"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
