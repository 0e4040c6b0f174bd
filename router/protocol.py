"""The OpenAI completions request as the router reads it, and its error responses.

The whole request is checked before anything is scheduled, by the rules vLLM's OpenAI server
applies (its ``CompletionRequest`` validators and ``SamplingParams._verify_args``): a value vLLM
would refuse gets the same 400 here, naming the parameter, instead of failing at the decode engine
after the prefill and the page transfers already ran. Every field is then passed to the decode
engine untouched (``max_tokens`` normalized as vLLM does), so sampling behaves as vLLM documents.
The rules that need the model (its vocabulary, the engine's ``--max-logprobs``) are the engine's:
the fields they read go with the prefill request too (``PREFILL_CHECKED``), which is refused
before the pages move to the decode node and before the decode. Errors use OpenAI's shape, as
vLLM does: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_TOKEN_ID = (1 << 32) - 1  # token ids travel to the conductor as uint32
# The router's own request fields: SLOs for the conductor, never sent to an engine.
ROUTER_FIELDS = ("ttft_slo_s", "tbt_slo_s")
# vLLM's CompletionRequest: a null max_tokens is its default (normalize_null_max_tokens).
DEFAULT_MAX_TOKENS = 16
MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
INT64 = (-(2**63), 2**63 - 1)
SAMPLING_EPS = 1e-5  # below it vLLM samples greedily (and then n must be 1)
# Checked by the engine against its model: the prefill request carries them (cheap for one
# token), so a bad value is refused there, before the pulls and the decode.
PREFILL_CHECKED = (
    "logprobs",
    "logprob_token_ids",
    "logit_bias",
    "allowed_token_ids",
    "stop_token_ids",
)
# bool fields: vLLM's ``bool | None`` ones take null, the others need a bool.
_OPTIONAL_BOOLS = ("echo", "return_token_ids", "return_tokens_as_token_ids", "watermarking")
_BOOLS = (
    "use_beam_search",
    "include_stop_str_in_output",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "add_special_tokens",
)


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

    def body(self, request_id: str | None = None) -> dict[str, Any]:
        """OpenAI's error object (an engine's own, passed through, when it gave one), with the
        router's request id (``error.request_id``) when given."""
        if self._body is not None and isinstance(self._body.get("error"), dict):
            body = {**self._body, "error": dict(self._body["error"])}
        else:
            body = {
                "error": {
                    "message": self.message,
                    "type": self.kind,
                    "param": self.param,
                    "code": self.status,
                }
            }
        if request_id is not None:
            body["error"]["request_id"] = request_id
        return body


def invalid(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, "invalid_request_error", param)


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(kw_only=True)
class Completion:
    """A parsed ``/v1/completions`` or ``/v1/chat/completions`` body: ``tokens`` or ``text``
    (a completion's prompt) or ``chat`` (a chat's ``/tokenize`` body: its messages and template
    fields), the fields the router acts on, ``forward``: the body the serving engine gets (the
    prompt's token ids set later), and ``prefill_checked``: what a separate prefill request
    carries besides its own fields. ``max_tokens`` None: what the context leaves (a chat's
    default)."""

    model: str
    tokens: list[int] | None
    text: str | None
    max_tokens: int | None
    stream: bool
    ttft_slo_s: float
    tbt_slo_s: float
    truncate_prompt_tokens: int | None = None
    forward: dict[str, Any] = field(default_factory=dict)
    prefill_checked: dict[str, Any] = field(default_factory=dict)
    path: str = COMPLETIONS  # the engine endpoint that serves it
    chat: dict[str, Any] | None = None


def parse_completion(body: Any, default_ttft_s: float, default_tbt_s: float) -> Completion:
    """Validate a completions body; ``RouterError`` 400 naming the field to fix."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required: the model name /v1/models lists", "model")
    if body.get("prompt_embeds") is not None:
        raise invalid("'prompt_embeds' is not served by the router: send a prompt", "prompt_embeds")
    tokens, text = _prompt(body.get("prompt"))
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    elif not is_int(max_tokens) or max_tokens < 1:
        raise invalid(f"'max_tokens' must be an integer >= 1, got {show(max_tokens)}", "max_tokens")
    stream = boolean(body, "stream", optional=True) or False
    ttft_slo_s, tbt_slo_s = slo_fields(body, default_ttft_s, default_tbt_s)
    sampling_rules(body, max_tokens, stream)
    _outputs(body, stream)
    forward = {k: v for k, v in body.items() if k not in ROUTER_FIELDS}
    forward["max_tokens"] = max_tokens
    return Completion(
        model=model,
        tokens=tokens,
        text=text,
        max_tokens=max_tokens,
        stream=stream,
        truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
        forward=forward,
        prefill_checked={k: body[k] for k in PREFILL_CHECKED if body.get(k) is not None},
        ttft_slo_s=ttft_slo_s,
        tbt_slo_s=tbt_slo_s,
    )


def slo_fields(
    body: dict[str, Any], default_ttft_s: float, default_tbt_s: float
) -> tuple[float, float]:
    """The router's own SLO fields, TTFT and TBT (seconds; 0: none), the defaults where not
    given."""
    slos = []
    for name, default in (("ttft_slo_s", default_ttft_s), ("tbt_slo_s", default_tbt_s)):
        value = body.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise invalid(f"'{name}' must be a number of seconds >= 0 (0: none)", name)
        slos.append(float(value))
    return slos[0], slos[1]


def check_context(call: Completion, prompt_tokens: int, max_model_len: int) -> int:
    """vLLM's length rules: ``max_tokens`` above the context, or a prompt that leaves no room
    for one output token, is a 400; otherwise the output is clamped to what the context holds
    (vLLM's ``get_max_tokens``). Returns the output tokens the decode may generate."""
    if call.max_tokens is None:  # a chat's default: the rest of the context
        if max_model_len and prompt_tokens + 1 > max_model_len:
            raise invalid(
                f"the prompt ({prompt_tokens} tokens) leaves no room for an output token in "
                f"the model's context of {max_model_len} tokens",
                "messages",
            )
        return max(max_model_len - prompt_tokens, 1) if max_model_len else DEFAULT_MAX_TOKENS
    if not max_model_len:
        return call.max_tokens
    if call.max_tokens > max_model_len:
        raise invalid(
            f"'max_tokens' {call.max_tokens} is more than the model's context of "
            f"{max_model_len} tokens",
            "max_tokens",
        )
    limit = call.truncate_prompt_tokens
    if limit is not None and limit > max_model_len:
        raise invalid(
            f"'truncate_prompt_tokens' {limit} is more than the model's context of "
            f"{max_model_len} tokens",
            "truncate_prompt_tokens",
        )
    if limit is not None:
        prompt_tokens = min(prompt_tokens, max_model_len if limit == -1 else limit)
    if prompt_tokens + 1 > max_model_len:
        raise invalid(
            f"the prompt ({prompt_tokens} tokens) leaves no room for an output token in the "
            f"model's context of {max_model_len} tokens",
            "prompt" if call.chat is None else "messages",
        )
    return min(call.max_tokens, max_model_len - prompt_tokens)


def sampling_rules(body: dict[str, Any], max_tokens: int | None, stream: bool) -> None:
    """vLLM's sampling parameter rules (``SamplingParams._verify_args``), for completions and
    chats."""
    for name in ("presence_penalty", "frequency_penalty"):
        _number(body, name, -2.0, 2.0, "in [-2, 2]")
    rep = _number(body, "repetition_penalty")
    if rep is not None and rep <= 0:
        raise invalid(
            f"'repetition_penalty' must be greater than 0, got {rep}", "repetition_penalty"
        )
    temperature = _number(body, "temperature", 0.0, 2.0, "in [0, 2]")
    top_p = _number(body, "top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise invalid(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    _integer(body, "top_k", -1, None, "0 (disabled) or at least 1")
    _number(body, "min_p", 0.0, 1.0, "in [0, 1]")
    n = body.get("n", 1)
    if not is_int(n) or not 1 <= n <= MAX_N:
        raise invalid(f"'n' must be an integer in [1, {MAX_N}], got {show(n)}", "n")
    if n > 1 and temperature is not None and temperature < SAMPLING_EPS:
        raise invalid(f"'n' must be 1 when sampling greedily (temperature 0), got {n}", "n")
    _integer(body, "seed", *INT64, "a 64-bit integer")
    min_tokens = _integer(body, "min_tokens", 0, None, ">= 0")
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise invalid(
            f"'min_tokens' must be at most max_tokens={max_tokens}, got {min_tokens}", "min_tokens"
        )
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and (
        not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)
    ):
        raise invalid(f"'stop' must be a string or a list of strings, got {show(stop)}", "stop")
    if stops is not None and not all(stops):
        raise invalid("'stop' cannot contain an empty string", "stop")
    int_list(body, "stop_token_ids")
    bad_words = body.get("bad_words")
    if bad_words is not None and (
        not isinstance(bad_words, list) or not all(isinstance(w, str) and w for w in bad_words)
    ):
        raise invalid("'bad_words' must be a list of non-empty strings", "bad_words")
    allowed = int_list(body, "allowed_token_ids")
    if allowed is not None and not allowed:
        raise invalid(
            "'allowed_token_ids' is empty: leave it out to allow every token", "allowed_token_ids"
        )
    bias = body.get("logit_bias")
    if bias is not None and (
        not isinstance(bias, dict)
        or not all(_is_int_text(k) and _is_number(v) for k, v in bias.items())
    ):
        raise invalid("'logit_bias' must map token ids (as strings) to numbers", "logit_bias")
    for name in _BOOLS:
        boolean(body, name)
    for name in _OPTIONAL_BOOLS:
        boolean(body, name, optional=True)
    if body.get("use_beam_search") and stream:
        raise invalid("streaming is not supported with beam search", "use_beam_search")
    _integer(body, "priority", *INT64, "a 64-bit integer")
    _integer(body, "truncate_prompt_tokens", -1, INT64[1], "-1 (the context) or >= 0")
    _integer(body, "stream_interval", 1, None, ">= 1")


def _outputs(body: dict[str, Any], stream: bool) -> None:
    """vLLM's rules for a completion's logprobs, then ``output_rules``."""
    logprobs = body.get("logprobs")
    for name in ("logprobs", "prompt_logprobs"):
        value = body.get(name)
        if value is not None and (not is_int(value) or (value < 0 and value != -1)):
            raise invalid(f"'{name}' must be an integer >= 0, or -1 (all), got {show(value)}", name)
    prompt_logprobs = body.get("prompt_logprobs")
    if stream and prompt_logprobs is not None and (prompt_logprobs > 0 or prompt_logprobs == -1):
        raise invalid("'prompt_logprobs' are not available when stream is true", "prompt_logprobs")
    if int_list(body, "logprob_token_ids") and logprobs is None:
        raise invalid("'logprob_token_ids' needs 'logprobs' set", "logprob_token_ids")
    output_rules(body, stream)


def output_rules(body: dict[str, Any], stream: bool) -> None:
    """vLLM's rules for stream options and structured outputs (completions and chats)."""
    if body.get("kv_transfer_params") is not None:
        raise invalid(
            "'kv_transfer_params' is set by the router for its engines: leave it out",
            "kv_transfer_params",
        )
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("'stream_options' must be an object", "stream_options")
        if options and not stream:
            raise invalid(
                "'stream_options' can only be given when stream is true", "stream_options"
            )
        for name in ("include_usage", "continuous_usage_stats"):
            if options.get(name) is not None and not isinstance(options[name], bool):
                raise invalid(f"'stream_options.{name}' must be true or false", "stream_options")
    for name in ("user", "suffix"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise invalid(f"'{name}' must be a string", name)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= 1024):
        raise invalid("'cache_salt' must be a string of 1 to 1024 characters", "cache_salt")
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in (
            "text",
            "json_object",
            "json_schema",
            "structural_tag",
        ):
            raise invalid(
                "'response_format' must be an object whose type is text, json_object, "
                "json_schema or structural_tag",
                "response_format",
            )
        if fmt["type"] == "json_schema" and fmt.get("json_schema") is None:
            raise invalid(
                "a response_format of type json_schema needs its 'json_schema'", "response_format"
            )
    structured = body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise invalid("'structured_outputs' must be an object", "structured_outputs")
        if sum(structured.get(k) is not None for k in ("json", "regex", "choice")) > 1:
            raise invalid(
                "'structured_outputs' takes one kind of constraint ('json', 'regex' or 'choice')",
                "structured_outputs",
            )


def show(value: Any, limit: int = 64) -> str:
    """A client's value in an error message, cut short (a megabyte value, a short message)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int_text(value: Any) -> bool:
    try:
        int(value)
    except (TypeError, ValueError):
        return False
    return True


def _number(
    body: dict[str, Any],
    name: str,
    lo: float | None = None,
    hi: float | None = None,
    what: str = "",
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value) or not math.isfinite(value):
        raise invalid(f"'{name}' must be a finite number, got {show(value)}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise invalid(f"'{name}' must be {what}, got {value}", name)
    return float(value)


def _integer(
    body: dict[str, Any], name: str, lo: int | None, hi: int | None, what: str
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise invalid(f"'{name}' must be an integer, got {show(value)}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise invalid(f"'{name}' must be {what}, got {value}", name)
    return int(value)


def int_list(body: dict[str, Any], name: str) -> list[int] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise invalid(f"'{name}' must be a list of integers", name)
    return value


def boolean(body: dict[str, Any], name: str, optional: bool = False) -> bool | None:
    value = body.get(name)
    if value is None and (optional or name not in body):
        return None
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be true or false, got {show(value)}", name)
    return value


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
        # NOTE: type() is int leaves out bools; the set of types, min and max loop in C (a
        # prompt is thousands of ids)
        if not (
            set(map(type, prompt)) == {int} and min(prompt) >= 0 and max(prompt) <= MAX_TOKEN_ID
        ):
            raise invalid("'prompt' token ids must be integers in [0, 2**32)", "prompt")
        return prompt, None
    raise invalid("'prompt' is required: a string or a list of token ids", "prompt")
