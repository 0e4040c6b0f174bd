"""What the engines serve, as they say it: their models (``/v1/models``, every engine asked) and
their token ids for a prompt (``/tokenize``: a completion's text, or a chat's messages rendered
with its template)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from kvstore.errors import echo

from .engines import Engine, EngineClient, EngineError
from .protocol import Completion, RouterError

REFRESH_S = 2.0  # an unknown model name asks the engines again at most this often


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int


class Catalog:
    def __init__(self, engines: dict[str, Engine], http: EngineClient) -> None:
        self.engines = engines
        self.http = http
        self._models: dict[str, ModelInfo] = {}
        self._listed = -REFRESH_S

    async def listing(self) -> list[dict[str, Any]]:
        """Every model any engine serves (its ``/v1/models`` entries, one per id, in the order
        the engines list them); 503 when no engine answers."""
        replies = await asyncio.gather(
            *(self.http.get_json(e, "/v1/models") for e in self.engines.values()),
            return_exceptions=True,
        )
        entries: dict[str, dict[str, Any]] = {}
        errors = []
        for engine, reply in zip(self.engines.values(), replies):
            if isinstance(reply, EngineError):
                errors.append(str(reply))
                continue
            if isinstance(reply, BaseException):
                raise reply
            data = reply.get("data") if isinstance(reply, dict) else None
            if not isinstance(data, list) or not all(
                isinstance(m, dict) and isinstance(m.get("id"), str) for m in data
            ):
                errors.append(f"{engine.node}: /v1/models answered {reply!r:.200}")
                continue
            for m in data:
                entries.setdefault(m["id"], m)
        if not entries:
            raise RouterError(
                503, "no engine answers /v1/models: " + "; ".join(errors), "service_unavailable"
            )
        self._models = {
            name: ModelInfo(name, _int(m.get("max_model_len"))) for name, m in entries.items()
        }
        self._listed = time.monotonic()
        return list(entries.values())

    async def model(self, name: str) -> ModelInfo:
        """The model ``name`` as the engines serve it; 404 when none does."""
        found = self._models.get(name)
        if found is None and time.monotonic() - self._listed >= REFRESH_S:
            await self.listing()
            found = self._models.get(name)
        if found is None:
            raise RouterError(
                404,
                f"model {echo(name)} is not served here; /v1/models lists "
                f"{', '.join(repr(m) for m in self._models)}",
                "invalid_request_error",
                "model",
            )
        return found

    async def tokens(self, call: Completion, model: ModelInfo) -> list[int]:
        """The prompt's token ids: as given, or by the engines' own tokenizer and chat template
        (``/tokenize``: the first engine that answers; an engine's 4xx is the request's)."""
        if call.tokens is not None:
            return call.tokens
        errors = []
        for engine in self.engines.values():
            try:
                return await self.http.tokenize(engine, model.name, call.text, call.chat)
            except EngineError as e:  # tokenizing twice costs nothing: ask the next one
                if 400 <= e.status < 500:
                    raise RouterError(e.status, str(e), body=e.body) from None
                errors.append(str(e))
        raise RouterError(
            503, "no engine could tokenize: " + "; ".join(errors), "service_unavailable"
        )


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0
