"""The router's HTTP API (FastAPI): OpenAI's ``/v1/completions`` (token ids or text) and
``/v1/chat/completions`` (messages, rendered with the model's chat template by the engines),
streamed with server-sent events or not, and ``/v1/models`` (every model the engines serve),
plus ``/health`` and Prometheus ``/metrics``. Each request is served, aggregated or
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
answered 429 at once. A client that leaves before its answer stops the work in flight
(``Disaggregator.serve`` is cancelled).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager, suppress
from typing import Any, AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from .catalog import ModelInfo
from .chat import parse_chat
from .disagg import Disaggregator, RouterOptions, Served, with_cached_tokens
from .engines import EngineStream
from .metrics import RouterMetrics
from .protocol import CHAT, COMPLETIONS, Completion, RouterError, parse_completion

log = logging.getLogger(__name__)

_OUTCOME = {429: "rejected", 503: "unavailable"}
MAX_REQUEST_ID = 256


def create_app(
    options: RouterOptions,
    api_key: str | None = None,
    admin_key: str | None = None,
    debug_headers: bool = False,
) -> FastAPI:
    metrics = RouterMetrics()
    metrics.max_inflight.set(options.max_inflight)
    disagg = Disaggregator(options, metrics)
    inflight = [0]  # completions being served (the bound; the gauge mirrors it)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await disagg.close()

    app = FastAPI(title="kvcache router", lifespan=lifespan)
    app.state.disagg = disagg
    expected = f"Bearer {api_key}".encode() if api_key else None
    operator = f"Bearer {admin_key}".encode() if admin_key else None

    def is_operator(request: Request) -> bool:
        given = request.headers.get("authorization", "").encode()
        return operator is not None and secrets.compare_digest(given, operator)

    def reveal(request: Request) -> bool:
        """Whether this caller sees what the cache did (``debug_headers``, operator only)."""
        if not debug_headers:
            return False
        if operator is None and expected is None:
            return True  # no keys at all: every caller is the operator (a local demo)
        return is_operator(request)

    # A dependency of the /v1 routes rather than an HTTP middleware (which wraps the request's
    # receive channel): a completion watches that channel, as uvicorn gives it, for its client
    # leaving.
    async def authorize(request: Request) -> None:  # async: no thread hop per request
        given = request.headers.get("authorization", "").encode()
        if (
            expected is not None
            and not secrets.compare_digest(given, expected)
            and not is_operator(request)
        ):
            raise RouterError(
                401, "missing or wrong API key (Authorization: Bearer KEY)", "auth_error"
            )

    def error_response(request: Request, e: RouterError) -> JSONResponse:
        rid = getattr(request.state, "request_id", None)
        headers = {"x-request-id": rid} if rid else None
        return JSONResponse(e.body(rid), status_code=e.status, headers=headers)

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, e: RouterError) -> JSONResponse:
        return error_response(request, e)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s", request.url.path)
        error = RouterError(500, f"router error: {type(e).__name__}: {e}", "internal_error")
        return error_response(request, error)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "engines": {e.node: e.url for e in options.engines}}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": await disagg.catalog.listing()}

    def done() -> None:
        inflight[0] -= 1
        metrics.inflight.dec()

    @app.post(COMPLETIONS, dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        return await _served(request, parse_completion)

    @app.post(CHAT, dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Response:
        return await _served(request, parse_chat)

    async def _served(request: Request, parse: Callable[..., Completion]) -> Response:
        given = request.headers.get("x-request-id", "")
        own = not (0 < len(given) <= MAX_REQUEST_ID and given.isprintable())
        rid = request.state.request_id = disagg.new_request_id() if own else given
        if inflight[0] >= options.max_inflight:
            metrics.requests.labels("busy").inc()
            raise RouterError(
                429,
                f"the router is serving {inflight[0]} requests, its limit (--max-inflight): "
                "retry later",
                "rate_limit_exceeded",
            )
        inflight[0] += 1
        metrics.inflight.inc()
        streaming = False
        try:
            response = await _complete(request, rid, own, parse)
            streaming = isinstance(response, StreamingResponse)
            return response
        except RouterError as e:
            metrics.requests.labels(_OUTCOME.get(e.status, _outcome(e.status))).inc()
            raise
        except Exception:
            metrics.requests.labels("failed").inc()
            raise
        finally:
            if not streaming:  # a stream counts itself out when it ends
                done()

    async def _complete(
        request: Request, rid: str, own: bool, parse: Callable[..., Completion]
    ) -> Response:
        t0 = time.perf_counter()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RouterError(400, "the request body is not JSON") from None
        call = parse(body, options.ttft_slo_s, options.tbt_slo_s)
        model = await disagg.catalog.model(call.model)
        # Until the answer (or a stream's headers) is ready, a client that leaves cancels it,
        # as vLLM's own endpoint does; a stream then watches for that itself.
        work = asyncio.ensure_future(_serve(call, model, rid, own))
        left = asyncio.ensure_future(_disconnected(request))
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
            metrics.cancelled.labels("request").inc()
            metrics.requests.labels("cut").inc()
            return Response(status_code=499, headers={"x-request-id": rid})
        served, result = work.result()
        shown = reveal(request)
        headers = served.headers() if shown else {"x-request-id": rid}
        if isinstance(result, EngineStream):
            relay = _Relay(result, served, t0, shown)
            return StreamingResponse(
                relay.events(),
                media_type="text/event-stream",
                headers=headers,
                background=BackgroundTask(relay.close),
            )
        metrics.requests.labels("ok").inc()
        metrics.stage.labels("total").observe(time.perf_counter() - t0)
        return JSONResponse(result if shown else _private(result), headers=headers)

    async def _serve(
        call: Completion, model: ModelInfo, rid: str, own: bool
    ) -> tuple[Served, dict[str, Any] | EngineStream]:
        tokens = await disagg.catalog.tokens(call, model)
        return await disagg.serve(call, tokens, model, rid, own)

    class _Relay:
        """The decode engine's events as they come; any failure to read them ends the stream
        with an error event (OpenAI's clients raise it) and ``[DONE]``, never a stream that
        ends as if whole. ``close`` runs once: when the stream ends, or after the response if
        it never began (the client left first)."""

        def __init__(self, stream: EngineStream, served: Served, t0: float, shown: bool) -> None:
            self.stream, self.served, self.t0, self.shown = stream, served, t0, shown
            self.closed = False

        async def events(self) -> AsyncIterator[bytes]:
            outcome = "cut"  # the client went away: the generator is closed or cancelled
            t = time.perf_counter()
            first = True
            try:
                cached = self.served.cached_tokens
                async for batch in self.stream.batches():
                    if first:
                        metrics.stage.labels("first_token").observe(time.perf_counter() - t)
                        first = False
                    if not self.shown:  # what the cache did is the operator's to see
                        batch = [
                            _private_event(d) if b"prompt_tokens_details" in d else d for d in batch
                        ]
                    elif cached is not None:
                        batch = [_with_cached(d, cached) if b'"usage"' in d else d for d in batch]
                    yield b"".join(b"data: " + data + b"\n\n" for data in batch)
                outcome = "ok"
            except Exception as e:  # noqa: BLE001 - EngineError, or anything unforeseen
                outcome = "failed"
                rid = self.served.request_id
                log.warning("request %s: decode failed mid-stream: %s", rid, e)
                error = RouterError(502, f"decode failed mid-stream: {e}", "bad_gateway")
                yield b"data: " + json.dumps(error.body(rid)).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                await self.close(outcome)

        async def close(self, outcome: str = "cut") -> None:
            if self.closed:
                return
            self.closed = True
            self.stream.close()
            disagg.finish(self.served)
            metrics.requests.labels(outcome).inc()
            metrics.stage.labels("total").observe(time.perf_counter() - self.t0)
            done()

    return app


def _with_cached(data: bytes, cached: int) -> bytes:
    """A stream event whose usage reports ``cached`` prompt tokens from a cache."""
    event = json.loads(data)
    with_cached_tokens(event, cached)
    return json.dumps(event, separators=(",", ":")).encode()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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
