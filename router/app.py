"""The router's HTTP API (ASGI, served by uvicorn): OpenAI's ``/v1/completions`` (token ids or
text) and ``/v1/chat/completions`` (messages, rendered with the model's chat template by the
engines), streamed with server-sent events or not, and ``/v1/models`` (every model the engines
serve), plus ``/health`` and Prometheus ``/metrics``. Each request is served, aggregated or
disaggregated, by ``disagg.Disaggregator``; the response carries ``x-kvcache-*`` headers saying
where it ran and what moved (``Served.headers``). Its ``usage`` (streamed: when the client asks
with ``stream_options.include_usage``, as OpenAI's) counts the prompt tokens served from a cache
in ``prompt_tokens_details.cached_tokens`` (for the operator: see below).

What the cache did for a request is the operator's to see, not the caller's: whether a prompt
was cached tells a caller whether someone sent it before (prompts recovered block by block, the
class of vLLM's CVE-2025-46570). So the ``x-kvcache-*`` headers and the usage's
``prompt_tokens_details`` (the engines' cached tokens) go only to the operator (``admin_key``;
with no key at all, every caller), and only with ``debug_headers`` on; everyone else gets
``x-request-id`` and the token counts alone.

Every completion has a request id: the client's ``X-Request-Id``, or one the router makes. It
is sent to the engines as their ``X-Request-Id`` (vLLM names the request after it in its logs
and its response ``id``), and comes back in the ``x-request-id`` header and in every error body
(``error.request_id``). At most ``max_inflight`` completions are served at once; more are
answered 429 at once. A client that leaves before its answer ends stops the work in flight
(``Disaggregator.serve``, or the engine's stream, is cancelled).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import time
from contextlib import suppress
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import asgi
from .asgi import Receive, Scope, Send
from .catalog import ModelInfo
from .chat import parse_chat
from .disagg import Disaggregator, RouterOptions, Served, with_cached_tokens
from .engines import EngineStream
from .metrics import RouterMetrics
from .protocol import CHAT, COMPLETIONS, Completion, RouterError, parse_completion

log = logging.getLogger(__name__)

_OUTCOME = {429: "rejected", 503: "unavailable"}
MAX_REQUEST_ID = 256
_SSE = b"text/event-stream; charset=utf-8"


class RouterApp:
    """The ASGI application of ``kvcache router`` (``__call__``)."""

    def __init__(
        self,
        options: RouterOptions,
        api_key: str | None = None,
        admin_key: str | None = None,
        debug_headers: bool = False,
    ) -> None:
        self.options = options
        self.metrics = RouterMetrics()
        self.metrics.max_inflight.set(options.max_inflight)
        self.disagg = Disaggregator(options, self.metrics)
        self.inflight = 0  # completions being served (the bound; the gauge mirrors it)
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.operator = f"Bearer {admin_key}".encode() if admin_key else None
        self.debug_headers = debug_headers
        self.routes: dict[str, tuple[str, asgi.Handler]] = {
            "/health": ("GET", self._health),
            "/metrics": ("GET", self._prometheus),
            "/v1/models": ("GET", self._models),
            COMPLETIONS: ("POST", functools.partial(self._completion, parse_completion)),
            CHAT: ("POST", functools.partial(self._completion, parse_chat)),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await asgi.lifespan(receive, send, [self.disagg.close])
            return
        if scope["type"] != "http":
            return  # websockets: not served (the server refuses them)
        route = self.routes.get(scope["path"])
        try:
            if route is None:
                raise RouterError(
                    404,
                    f"no such path {scope['path']!r}: the router serves {sorted(self.routes)}",
                    "not_found_error",
                )
            method, handler = route
            if scope["method"] != method and (method, scope["method"]) != ("GET", "HEAD"):
                raise RouterError(405, f"{scope['path']} takes {method} requests only")
            await handler(scope, receive, send)
        except RouterError as e:
            await self._error(send, e)
        except Exception as e:  # noqa: BLE001 - a clear 500, never a dropped connection
            log.exception("unexpected error serving %s", scope["path"])
            await self._error(
                send, RouterError(500, f"router error: {type(e).__name__}: {e}", "internal_error")
            )

    # ---- who is asking ----------------------------------------------------------------------

    # ``key``: the request's Authorization header, as sent (asgi.header)

    def _is_operator(self, key: bytes) -> bool:
        return self.operator is not None and secrets.compare_digest(key, self.operator)

    def _authorize(self, key: bytes) -> None:
        if (
            self.expected is not None
            and not secrets.compare_digest(key, self.expected)
            and not self._is_operator(key)
        ):
            raise RouterError(
                401, "missing or wrong API key (Authorization: Bearer KEY)", "auth_error"
            )

    def _reveal(self, key: bytes) -> bool:
        """Whether this caller sees what the cache did (``debug_headers``, operator only)."""
        if not self.debug_headers:
            return False
        if self.operator is None and self.expected is None:
            return True  # no keys at all: every caller is the operator (a local demo)
        return self._is_operator(key)

    # ---- the small routes -------------------------------------------------------------------

    async def _error(self, send: Send, e: RouterError, rid: str | None = None) -> None:
        headers = {"x-request-id": rid} if rid else None
        await asgi.send_json(send, e.status, e.body(rid), headers)

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        engines = {e.node: e.url for e in self.options.engines}
        await asgi.send_json(send, 200, {"status": "ok", "engines": engines})

    async def _prometheus(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = generate_latest(self.metrics.registry)
        await asgi.send_bytes(send, 200, body, CONTENT_TYPE_LATEST.encode())

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._authorize(asgi.header(scope, b"authorization"))
        listing = await self.disagg.catalog.listing()
        await asgi.send_json(send, 200, {"object": "list", "data": listing})

    # ---- completions ------------------------------------------------------------------------

    async def _completion(
        self, parse: Callable[..., Completion], scope: Scope, receive: Receive, send: Send
    ) -> None:
        key = asgi.header(scope, b"authorization")
        self._authorize(key)
        given = asgi.header(scope, b"x-request-id").decode("latin-1")
        own = not (0 < len(given) <= MAX_REQUEST_ID and given.isprintable())
        rid = self.disagg.new_request_id() if own else given
        metrics = self.metrics
        try:
            if self.inflight >= self.options.max_inflight:
                metrics.requests.labels("busy").inc()
                raise RouterError(
                    429,
                    f"the router is serving {self.inflight} requests, its limit "
                    "(--max-inflight): retry later",
                    "rate_limit_exceeded",
                )
            self.inflight += 1
            metrics.inflight.inc()
            try:
                await self._complete(receive, send, rid, own, parse, self._reveal(key))
            except RouterError as e:
                metrics.requests.labels(_OUTCOME.get(e.status, _outcome(e.status))).inc()
                raise
            except Exception:
                metrics.requests.labels("failed").inc()
                raise
            finally:
                self.inflight -= 1
                metrics.inflight.dec()
        except RouterError as e:
            await self._error(send, e, rid)
        except Exception as e:  # noqa: BLE001
            log.exception("unexpected error serving request %s", rid)
            error = RouterError(500, f"router error: {type(e).__name__}: {e}", "internal_error")
            await self._error(send, error, rid)

    async def _complete(
        self,
        receive: Receive,
        send: Send,
        rid: str,
        own: bool,
        parse: Callable[..., Completion],
        shown: bool,
    ) -> None:
        t0 = time.perf_counter()
        try:
            body = json.loads(await asgi.read_body(receive))
        except asgi.BodyTooLarge as e:
            raise RouterError(413, f"{e}: send a shorter prompt") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RouterError(400, "the request body is not JSON") from None
        call = parse(body, self.options.ttft_slo_s, self.options.tbt_slo_s)
        model = await self.disagg.catalog.model(call.model)
        # Until the answer has been sent whole, a client that leaves cancels the work (as
        # vLLM's own endpoint does): the schedule, the engines' requests, or the stream.
        answer = _Answer(self, send, rid, t0, shown)
        work = asyncio.ensure_future(answer.run(call, model, own))
        left = asyncio.ensure_future(asgi.disconnected(receive))
        try:
            await asyncio.wait({work, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not work.done():
                work.cancel()
                with suppress(BaseException):
                    await work  # its cleanup (ledger entry, transfers) is under way when it ends
        if work.cancelled():
            log.info("request %s: the client left; its work was cancelled", rid)
            self.metrics.cancelled.labels("request").inc()
            if not answer.started:  # a stream counted itself out
                self.metrics.requests.labels("cut").inc()
            return
        work.result()  # its error, if it failed before answering


class _Answer:
    """One completion's answer: the engine's reply, or its stream relayed event by event."""

    def __init__(self, app: RouterApp, send: Send, rid: str, t0: float, shown: bool) -> None:
        self.app, self.send, self.rid, self.t0, self.shown = app, send, rid, t0, shown
        self.started = False  # a stream's headers were sent

    async def run(self, call: Completion, model: ModelInfo, own: bool) -> None:
        disagg, metrics = self.app.disagg, self.app.metrics
        tokens = await disagg.catalog.tokens(call, model)
        served, result = await disagg.serve(call, tokens, model, self.rid, own)
        headers = served.headers() if self.shown else {"x-request-id": self.rid}
        if isinstance(result, EngineStream):
            await self._relay(result, served, headers)
            return
        metrics.requests.labels("ok").inc()
        metrics.stage.labels("total").observe(time.perf_counter() - self.t0)
        await asgi.send_json(self.send, 200, result if self.shown else _private(result), headers)

    async def _relay(self, stream: EngineStream, served: Served, headers: dict[str, str]) -> None:
        """The decode engine's events as they come; any failure to read them ends the stream
        with an error event (OpenAI's clients raise it) and ``[DONE]``, never a stream that
        ends as if whole."""
        metrics, send = self.app.metrics, self.send
        outcome = "cut"  # the client went away: this is cancelled
        cached = served.cached_tokens
        try:
            await asgi.start_stream(send, 200, _SSE, headers)
            self.started = True
            t = time.perf_counter()
            first = True
            async for batch in stream.batches():
                if first:
                    metrics.stage.labels("first_token").observe(time.perf_counter() - t)
                    first = False
                if not self.shown:  # what the cache did is the operator's to see
                    batch = [
                        _private_event(d) if b"prompt_tokens_details" in d else d for d in batch
                    ]
                elif cached is not None:
                    batch = [_with_cached(d, cached) if b'"usage"' in d else d for d in batch]
                if stream.whole:  # the conductor hears the request is done before the client
                    await self.app.disagg.finished(served)
                await asgi.send_chunk(send, b"".join(b"data: " + d + b"\n\n" for d in batch))
            outcome = "ok"
        except Exception as e:  # noqa: BLE001 - EngineError, or anything unforeseen
            outcome = "failed"
            if not self.started:
                raise  # answered as an error whole
            log.warning("request %s: decode failed mid-stream: %s", self.rid, e)
            error = RouterError(502, f"decode failed mid-stream: {e}", "bad_gateway")
            await asgi.send_chunk(
                send, b"data: " + json.dumps(error.body(self.rid)).encode() + b"\n\n"
            )
            await asgi.send_chunk(send, b"data: [DONE]\n\n")
        finally:
            stream.close()
            self.app.disagg.finish(served)
            metrics.requests.labels(outcome).inc()
            metrics.stage.labels("total").observe(time.perf_counter() - self.t0)
        await asgi.send_chunk(send, b"", more=False)


def _with_cached(data: bytes, cached: int) -> bytes:
    """A stream event whose usage reports ``cached`` prompt tokens from a cache."""
    event = json.loads(data)
    with_cached_tokens(event, cached)
    return json.dumps(event, separators=(",", ":")).encode()


def _private(reply: dict[str, Any]) -> dict[str, Any]:
    """An engine's reply without what its cache did (``usage.prompt_tokens_details``)."""
    usage = reply.get("usage")
    if isinstance(usage, dict) and "prompt_tokens_details" in usage:
        reply = {**reply, "usage": {k: v for k, v in usage.items() if k != "prompt_tokens_details"}}
    return reply


def _private_event(data: bytes) -> bytes:
    try:
        event = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return data  # not an event with usage ([DONE]); nothing to take out
    return (
        json.dumps(_private(event), separators=(",", ":")).encode()
        if isinstance(event, dict)
        else data
    )


def _outcome(status: int) -> str:
    return "invalid" if 400 <= status < 500 else "failed"
