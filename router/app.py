"""The router's HTTP API (FastAPI): OpenAI's ``/v1/completions`` (token ids or text, streamed
with server-sent events or not) and ``/v1/models``, plus ``/health`` and Prometheus
``/metrics``. Each completion is served disaggregated by ``disagg.Disaggregator``; the response
carries ``x-kvcache-*`` headers saying where it ran and what moved (``Served.headers``).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from kvstore.errors import echo

from .disagg import Disaggregator, RouterOptions, Served
from .engines import EngineError, EngineStream
from .metrics import RouterMetrics
from .protocol import RouterError, parse_completion

log = logging.getLogger(__name__)

_OUTCOME = {429: "rejected", 503: "unavailable"}


def create_app(options: RouterOptions, api_key: str | None = None) -> FastAPI:
    metrics = RouterMetrics()
    disagg = Disaggregator(options, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await disagg.close()

    app = FastAPI(title="kvcache router", lifespan=lifespan)
    app.state.disagg = disagg

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def _authorize(request: Request, call_next: Any) -> Response:
            given = request.headers.get("authorization", "").encode()
            if request.url.path.startswith("/v1/") and not secrets.compare_digest(given, expected):
                error = RouterError(
                    401, "missing or wrong API key (Authorization: Bearer KEY)", "auth_error"
                )
                return JSONResponse(error.body(), status_code=401)
            response: Response = await call_next(request)
            return response

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, e: RouterError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s", request.url.path)
        error = RouterError(500, f"router error: {type(e).__name__}: {e}", "internal_error")
        return JSONResponse(error.body(), status_code=500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "engines": {e.node: e.url for e in options.engines}}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = await disagg.model()
        return {
            "object": "list",
            "data": [
                {
                    "id": model.name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "kvcache",
                    "max_model_len": model.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        metrics.inflight.inc()
        streaming = False
        try:
            response = await _complete(request)
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
                metrics.inflight.dec()

    async def _complete(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RouterError(400, "the request body is not JSON") from None
        call = parse_completion(body, options.ttft_slo_s, options.tbt_slo_s)
        model = await disagg.model()
        if call.model != model.name:
            raise RouterError(
                404,
                f"model {echo(call.model)} is not served here; /v1/models lists {model.name!r}",
                "invalid_request_error",
                "model",
            )
        tokens = await disagg.tokens(call, model)
        served, result = await disagg.serve(call, tokens, model)
        if isinstance(result, EngineStream):
            relay = _Relay(result, served, t0)
            return StreamingResponse(
                relay.events(),
                media_type="text/event-stream",
                headers=served.headers(),
                background=BackgroundTask(relay.close),
            )
        metrics.requests.labels("ok").inc()
        metrics.stage.labels("total").observe(time.perf_counter() - t0)
        return JSONResponse(result, headers=served.headers())

    class _Relay:
        """The decode engine's events as they come; a failure mid-stream ends the stream with
        an error event (OpenAI's clients raise it) and ``[DONE]``, never a hung connection.
        ``close`` runs once: when the stream ends, or after the response if it never began
        (the client left first)."""

        def __init__(self, stream: EngineStream, served: Served, t0: float) -> None:
            self.stream, self.served, self.t0 = stream, served, t0
            self.closed = False

        async def events(self) -> AsyncIterator[bytes]:
            outcome = "cut"  # the client went away: the generator is closed or cancelled
            t = time.perf_counter()
            first = True
            try:
                async for data in self.stream.events():
                    if first:
                        metrics.stage.labels("first_token").observe(time.perf_counter() - t)
                        first = False
                    yield b"data: " + data + b"\n\n"
                outcome = "ok"
            except EngineError as e:
                outcome = "failed"
                log.warning("request %s: decode failed mid-stream: %s", self.served.request_id, e)
                error = RouterError(502, f"decode failed mid-stream: {e}", "bad_gateway")
                yield b"data: " + json.dumps(error.body()).encode() + b"\n\n"
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
            metrics.inflight.dec()

    return app


def _outcome(status: int) -> str:
    return "invalid" if 400 <= status < 500 else "failed"
