"""The OpenAI completions request as the router reads it, and its error responses.

The router reads only what it needs (the prompt, ``max_tokens``, ``stream``, ``model`` and its own
SLO fields) and passes every other field to the decode engine untouched, so sampling options
behave exactly as vLLM documents them. Errors use OpenAI's shape, as vLLM does:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_TOKEN_ID = (1 << 32) - 1  # token ids travel to the conductor as uint32
# The router's own request fields: SLOs for the conductor, never sent to an engine.
ROUTER_FIELDS = ("ttft_slo_s", "tbt_slo_s")


class RouterError(Exception):
    """A request the router answers with an HTTP error instead of a completion."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self._body = body

    def body(self) -> dict[str, Any]:
        """OpenAI's error object (an engine's own, passed through, when it gave one)."""
        if self._body is not None:
            return self._body
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


def invalid(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, "invalid_request_error", param)


@dataclass(kw_only=True)
class Completion:
    """A parsed ``/v1/completions`` body: ``tokens`` or ``text`` (one of them), the fields the
    router acts on, and ``forward``: the body the decode engine gets (prompt set later)."""

    model: str
    tokens: list[int] | None
    text: str | None
    max_tokens: int
    stream: bool
    ttft_slo_s: float
    tbt_slo_s: float
    forward: dict[str, Any] = field(default_factory=dict)


def parse_completion(body: Any, default_ttft_s: float, default_tbt_s: float) -> Completion:
    """Validate a completions body; ``RouterError`` 400 naming the field to fix."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required: the model name /v1/models lists", "model")
    tokens, text = _prompt(body.get("prompt"))
    max_tokens = body.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise invalid(f"'max_tokens' must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid(f"'stream' must be true or false, got {stream!r}", "stream")
    slos = {}
    for name, default in (("ttft_slo_s", default_ttft_s), ("tbt_slo_s", default_tbt_s)):
        value = body.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise invalid(f"'{name}' must be a number of seconds >= 0 (0: none)", name)
        slos[name] = float(value)
    forward = {k: v for k, v in body.items() if k not in ROUTER_FIELDS}
    return Completion(
        model=model,
        tokens=tokens,
        text=text,
        max_tokens=max_tokens,
        stream=stream,
        forward=forward,
        **slos,
    )


def _prompt(prompt: Any) -> tuple[list[int] | None, str | None]:
    """A string, a list of token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        raise invalid(
            f"one prompt per request ({len(prompt)} given): send each as its own request",
            "prompt",
        )
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("'prompt' is empty", "prompt")
        return None, prompt
    if isinstance(prompt, list):
        if not prompt:
            raise invalid("'prompt' is an empty list of token ids", "prompt")
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID
            for t in prompt
        ):
            raise invalid("'prompt' token ids must be integers in [0, 2**32)", "prompt")
        return list(prompt), None
    raise invalid("'prompt' is required: a string or a list of token ids", "prompt")
