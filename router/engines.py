"""The router's HTTP client of vLLM's OpenAI-compatible servers (aiohttp, pooled connections).

Every failure is an ``EngineError`` that says which engine and whether the engine took the work:
only an engine that provably did not (it refused the connection, did not accept it in time, or
answered 503) may be asked again elsewhere; anything after that (a cut, a stall, a 500) would
run the same work twice. A 4xx is the request's own fault (e.g. a token id outside the
vocabulary) and goes back to the client as the engine worded it.

Connections are kept alive and reused (a connect per request cost the router a measurable share
of its added latency, ``kvcache bench router``). A request whose kept-alive connection ends
before any answer (reset or closed) may or may not have reached the engine; the router then
tries to connect to the engine anew: refused, the engine is gone and the work with it (retried
elsewhere, as a refused connection always is); accepted, the engine lives and may have taken the
request (a 502, not run twice). The router lets idle connections go before vLLM's server does
(``KEEPALIVE_S``), so an engine closing an idle one as a request is written is rare.

Streams are read event by event (server-sent events, as vLLM writes them) with a deadline per
event, and every way a stream can go wrong (a cut connection, a stall, an event too long or not
JSON, an end without ``[DONE]``) is an ``EngineError``: the relay turns it into an error event,
never into a stream that looks whole.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any, AsyncIterator

import aiohttp
import orjson

from .protocol import COMPLETIONS

# One event of a stream, buffered whole before it is relayed: far above what vLLM writes (a
# chunk of merged tokens with their logprobs, or a prompt's ids in the first one), small
# enough that a runaway engine cannot grow the router's memory without bound.
MAX_EVENT_BYTES = 16 << 20
# Below the keep-alive timeout of vLLM's server (uvicorn's, VLLM_HTTP_TIMEOUT_KEEP_ALIVE=5 s):
# the router lets an idle connection go before the engine does, so it rarely writes to one the
# engine is closing.
KEEPALIVE_S = 4.0
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
    def __init__(self, timeouts: EngineTimeouts = EngineTimeouts(), pooled: bool = True) -> None:
        self.timeouts = timeouts
        self.pooled = pooled  # False: a new connection per request (the fallback's behaviour)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = (
                aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)  # engines queue
                if self.pooled
                else aiohttp.TCPConnector(limit=0, force_close=True)
            )
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def _send(
        self,
        method: str,
        engine: Engine,
        path: str,
        timeout: aiohttp.ClientTimeout,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> aiohttp.ClientResponse:
        """The engine's response (its headers read). A connection that ends before any answer
        is an ``EngineError`` that says whether the engine is gone (see the module's doc)."""
        data = None
        if body is not None:
            data = _dumps(body)
            headers = {**(headers or {}), "Content-Type": "application/json"}
        try:
            return await self._open().request(
                method, engine.url + path, data=data, headers=headers, timeout=timeout
            )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
            raise  # not connected: nothing was sent
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            if not await self._refused(engine):
                raise
            raise EngineError(
                engine,
                f"{method} {path}: {_describe(e)}, and the engine no longer accepts connections",
                accepted=False,
            ) from None

    async def _refused(self, engine: Engine) -> bool:
        """Whether a new connection to ``engine`` fails (it is gone)."""
        url = urllib.parse.urlsplit(engine.url)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            async with asyncio.timeout(self.timeouts.connect_s):
                _, writer = await asyncio.open_connection(url.hostname, port)
        except (OSError, TimeoutError):
            return True
        writer.close()
        return False

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
            async with await self._send("GET", engine, path, self._timeout()) as r:
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
            async with await self._send(
                "POST", engine, path, self._timeout(whole_s), body, headers
            ) as r:
                return await _json_or_raise(engine, path, r)
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _failure(engine, f"POST {path}", e) from None

    async def tokenize(
        self,
        engine: Engine,
        model: str,
        text: str | None = None,
        chat: dict[str, Any] | None = None,
    ) -> list[int]:
        """The engine's token ids of a completion's ``text``, or of a ``chat`` (its messages
        and template fields: ``chat.chat_body``), as its own endpoints compute them."""
        body = {"model": model, **chat} if chat is not None else {"model": model, "prompt": text}
        reply = await self.post_json(engine, "/tokenize", body)
        tokens = reply.get("tokens") if isinstance(reply, dict) else None
        if not isinstance(tokens, list):
            raise EngineError(engine, f"/tokenize answered without tokens: {reply!r:.200}")
        return [int(t) for t in tokens]

    async def open_stream(
        self,
        engine: Engine,
        body: dict[str, Any],
        request_id: str | None = None,
        path: str = COMPLETIONS,
    ) -> "EngineStream":
        """POST a streamed completion (or chat, ``path``); returns once the engine answered 200
        (its events then come from ``EngineStream.batches``)."""
        headers = {"X-Request-Id": request_id} if request_id else None
        try:
            # the headers within read_s; the events are timed by EngineStream itself
            async with asyncio.timeout(self.timeouts.read_s):
                r = await self._send("POST", engine, path, self._timeout(0), body, headers)
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _failure(engine, f"POST {path}", e) from None
        if r.status != 200:
            try:
                await _json_or_raise(engine, path, r)
            except EngineError:
                raise
            except Exception as e:  # noqa: BLE001
                raise _failure(engine, f"POST {path}", e) from None
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
        self.whole = False  # [DONE] came

    async def batches(self) -> AsyncIterator[list[bytes]]:
        """The events' ``data`` (JSON objects, ``[DONE]`` last) as they come: each list holds
        the events one read of the connection completed (several when the router fell behind:
        relayed in one write). ``EngineError`` for any failure to read the stream: the
        connection cut or closed before ``[DONE]``, no whole event within ``read_s``, an event
        over ``max_event_bytes`` or not JSON (the events before it are yielded first)."""
        content = self._response.content
        loop = asyncio.get_running_loop()
        buf = bytearray()
        scanned = 0  # bytes of buf searched for an event's end already
        # A stall fails the read itself (no timer context per read: one per event cost a
        # measured share of the router's time), and only while this waits for the engine: the
        # client's own pace does not count.
        waiting = [loop.time()]  # since when this waits for an event; [] while it yields

        def watch() -> None:
            now = loop.time()
            due = waiting[0] + self.read_s if waiting else now + self.read_s
            if waiting and now >= due:
                content.set_exception(TimeoutError())
            else:
                timer[0] = loop.call_at(due, watch)

        timer = [loop.call_at(waiting[0] + self.read_s, watch)]
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    break  # the end of the response: whole only if [DONE] came
                buf += chunk
                batch: list[bytes] = []
                while True:
                    end = _EVENT_END.search(buf, max(scanned - 3, 0))
                    if end is None:
                        scanned = len(buf)
                        break
                    raw = bytes(buf[: end.start()])
                    del buf[: end.end()]
                    scanned = 0
                    data = _data(raw)
                    if data is None:
                        continue  # a comment (keep-alive) or an event without data
                    if data != b"[DONE]" and not _is_json_object(data):
                        if batch:
                            yield batch
                        raise EngineError(
                            self.engine, f"an event that is not a JSON object: {data[:200]!r}"
                        )
                    batch.append(data)
                    if data == b"[DONE]":
                        self.whole = True
                        break
                if batch:
                    waiting.clear()
                    yield batch
                    if self.whole:
                        return
                    waiting.append(loop.time())
                if len(buf) > self.max_event_bytes:
                    raise EngineError(
                        self.engine, f"an event longer than {self.max_event_bytes} bytes"
                    )
        except EngineError:
            raise
        except TimeoutError:
            raise EngineError(
                self.engine, f"stream stalled: no event for {self.read_s:g} s"
            ) from None
        except Exception as e:  # noqa: BLE001 - every failure ends the stream the same way
            raise EngineError(self.engine, f"stream cut: {_describe(e)}") from None
        finally:
            timer[0].cancel()
        raise EngineError(self.engine, "stream ended without [DONE]")

    def close(self) -> None:
        """A whole stream's connection goes back to the pool; any other is dropped (an engine
        aborts a request whose client went away)."""
        if self.whole and self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


def _dumps(body: dict[str, Any]) -> bytes:
    """``body`` as JSON, byte for byte what ``json.dumps`` means: orjson (C; a prompt's token ids
    are most of every request) unless it cannot say the same. It writes NaN and infinities as
    null and refuses integers past 64 bits: then json, which writes what the client sent."""
    try:
        data = orjson.dumps(body)
        if b"null" not in data:  # no float turned into null (a real None costs the slow path)
            return data
    except TypeError:  # orjson.JSONEncodeError
        pass
    return json.dumps(body, separators=(",", ":")).encode()


def _is_json_object(data: bytes) -> bool:
    try:  # C, several times json's speed: every event of every stream
        return isinstance(orjson.loads(data), dict)
    except orjson.JSONDecodeError:
        pass
    try:  # what only Python's json reads (NaN, Infinity, integers past 64 bits)
        return isinstance(json.loads(data), dict)
    except ValueError:
        return False


def _data(raw: bytes) -> bytes | None:
    """The ``data`` field of one server-sent event (its lines joined), None without one."""
    if raw.startswith(b"data: ") and b"\n" not in raw and b"\r" not in raw:
        return raw[6:]  # one line, as vLLM writes every event
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
