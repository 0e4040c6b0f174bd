"""OpenAI's chat completions request as the router reads it.

A chat is served on the very token ids its engine computes: the router asks an engine's
``/tokenize`` for the messages with the request's template fields (``chat_body``: vLLM renders
them with the same template code its chat endpoint uses), schedules on those ids, and hands them
to the serving engine with the request (``kv_transfer_params.prompt_token_ids``, which vLLM's
chat endpoint takes instead of rendering the messages again): the ids the conductor's keys were
made from are the ids the engine computes, whatever the template does (a date in it, a
tokenizer that differs between hosts). A separate prefill (disaggregated serving) gets them as a
completion's prompt.

The request is checked by vLLM's rules (``ChatCompletionRequest``'s validators and the sampling
rules ``protocol`` shares with completions) before anything is scheduled, each error naming its
field; every field then goes to the engine as the client sent it.
"""

from __future__ import annotations

from typing import Any

from .protocol import (
    CHAT,
    ROUTER_FIELDS,
    Completion,
    boolean,
    int_list,
    invalid,
    is_int,
    output_rules,
    sampling_rules,
    show,
    slo_fields,
)

# Fields of a chat that decide its prompt's ids: what ``/tokenize`` gets besides the messages.
TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "tools",
    "mm_processor_kwargs",
    "media_io_kwargs",
)
# Read by the engine against its model: a separate prefill request carries them (as a
# completion's fields), so a bad value is refused before the pages move.
PREFILL_CHECKED = ("logit_bias", "allowed_token_ids", "stop_token_ids")


def parse_chat(body: Any, default_ttft_s: float, default_tbt_s: float) -> Completion:
    """Validate a chat completions body; ``RouterError`` 400 naming the field to fix."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required: the model name /v1/models lists", "model")
    _messages(body.get("messages"))
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens"):  # vLLM: the first one set wins
        value = body.get(name)
        if value is None:
            continue
        if not is_int(value) or value < 1:
            raise invalid(f"'{name}' must be an integer >= 1, got {show(value)}", name)
        if max_tokens is None:
            max_tokens = value
    stream = boolean(body, "stream", optional=True) or False
    ttft_slo_s, tbt_slo_s = slo_fields(body, default_ttft_s, default_tbt_s)
    sampling_rules(body, max_tokens, stream)
    top_logprobs = _logprobs(body, stream)
    output_rules(body, stream)
    _template(body)
    forward = {k: v for k, v in body.items() if k not in ROUTER_FIELDS}
    checked = {k: body[k] for k in PREFILL_CHECKED if body.get(k) is not None}
    if body.get("logprobs"):
        checked["logprobs"] = top_logprobs  # a completion's logprobs: how many per token
    return Completion(
        model=model,
        tokens=None,
        text=None,
        max_tokens=max_tokens,
        stream=stream,
        truncate_prompt_tokens=body.get("truncate_prompt_tokens"),
        forward=forward,
        prefill_checked=checked,
        path=CHAT,
        chat=chat_body(body),
        ttft_slo_s=ttft_slo_s,
        tbt_slo_s=tbt_slo_s,
    )


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The ``/tokenize`` request that renders ``body``'s messages as its chat endpoint does:
    the template fields, and the template arguments the chat endpoint adds itself
    (``documents``, ``reasoning_effort`` and the ``enable_thinking`` it implies)."""
    out: dict[str, Any] = {"messages": body["messages"]}
    out.update({k: body[k] for k in TEMPLATE_FIELDS if body.get(k) is not None})
    kwargs = dict(body.get("chat_template_kwargs") or {})
    for name in ("documents", "reasoning_effort"):
        if body.get(name) is not None:
            kwargs[name] = body[name]
    effort = body.get("reasoning_effort")
    if effort is not None and "enable_thinking" not in (body.get("chat_template_kwargs") or {}):
        kwargs["enable_thinking"] = effort != "none"
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    return out


def _messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' is required: a non-empty list of messages", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(
                f"'messages[{i}]' must be an object with a 'role' (got {show(message)})",
                "messages",
            )


def _logprobs(body: dict[str, Any], stream: bool) -> int:
    """vLLM's chat logprobs rules; the top logprobs asked per token."""
    boolean(body, "logprobs", optional=True)
    for name in ("top_logprobs", "prompt_logprobs"):
        value = body.get(name)
        if value is not None and (not is_int(value) or (value < 0 and value != -1)):
            raise invalid(f"'{name}' must be an integer >= 0, or -1 (all), got {show(value)}", name)
    top = body.get("top_logprobs") or 0
    if top and not body.get("logprobs"):
        raise invalid("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    prompt = body.get("prompt_logprobs")
    if stream and prompt is not None and (prompt > 0 or prompt == -1):
        raise invalid("'prompt_logprobs' are not available when stream is true", "prompt_logprobs")
    if int_list(body, "logprob_token_ids") and not body.get("logprobs"):
        raise invalid("'logprob_token_ids' needs 'logprobs' set to true", "logprob_token_ids")
    return int(top)


def _template(body: dict[str, Any]) -> None:
    """The template and tool fields' shapes, and vLLM's rules that bind them."""
    for name in ("add_generation_prompt", "continue_final_message", "add_special_tokens", "echo"):
        boolean(body, name, optional=True)
    if body.get("add_generation_prompt") and body.get("continue_final_message"):
        raise invalid(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true",
            "continue_final_message",
        )
    for name in ("chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise invalid(f"'{name}' must be an object", name)
    if body.get("chat_template") is not None and not isinstance(body["chat_template"], str):
        raise invalid("'chat_template' must be a string (a Jinja template)", "chat_template")
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not tools or not all(isinstance(t, dict) for t in tools)
    ):
        raise invalid("'tools' must be a non-empty list of tool objects", "tools")
    choice = body.get("tool_choice")
    if choice not in (None, "none") and tools is None:
        raise invalid("'tool_choice' needs 'tools'", "tool_choice")
    if (
        choice is not None
        and choice not in ("none", "auto", "required")
        and (not isinstance(choice, dict))
    ):
        raise invalid("'tool_choice' must be none, auto, required or a named tool", "tool_choice")
