"""``kvcache bench serve``'s workload and client: the conversation trace as token ids a tiny model
accepts, replayed through a router as streamed completions, and what each request got.

A trace request becomes token ids: each of its 512-token hash blocks is ``tokens_per_block``
tokens derived from the hash id and a ``salt`` (equal ids, equal tokens: the trace's prefix
structure survives; another salt, other tokens: one run's cache does not serve another's), the
prompt cut at ``max_prompt``; its output is the trace's output length scaled the same way (at
most ``max_output``), generated with ``ignore_eos``. The client measures per request:

- TTFT: request sent to its first token event; TPOT: (last token - first token) / (tokens - 1);
- the prompt tokens served from a cache (the answer's ``usage.prompt_tokens_details``: the
  engine's own cache or a prefix loaded from its node; disaggregated, the prefill's).

``summarize`` adds goodput (DistServe's measure): requests per second that met both the TTFT
and the TPOT SLO.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.keys import block_keys, root_key

from .live_engine import LiveError
from .trace import DEFAULT_BLOCK_TOKENS, TraceRequest

SPECIAL_TOKENS = 3  # ids the tiny tokenizer keeps for <unk>, <s>, </s>


def prompt_tokens(
    r: TraceRequest, per_block: int, max_prompt: int, vocab: int, salt: int = 0
) -> list[int]:
    """Tokens of hash block ``h``: splitmix64 of ``(salt, h, position in block)`` into
    ``[3, vocab)``, so equal hash-id prefixes give equal token prefixes (and different ids, or
    salts, different blocks)."""
    per = max(1, -(-r.input_length * per_block // DEFAULT_BLOCK_TOKENS))
    x = np.asarray(r.hash_ids, dtype=np.uint64)[:, None] * np.uint64(per_block)
    x = (x + np.arange(per_block, dtype=np.uint64)).reshape(-1)[: min(per, max_prompt)]
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as splitmix64 means it to
        z = x + np.uint64(0x9E3779B97F4A7C15) + np.uint64(salt) * np.uint64(0xD1B54A32D192ED03)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    tokens = z % np.uint64(vocab - SPECIAL_TOKENS) + np.uint64(SPECIAL_TOKENS)
    return [int(t) for t in tokens]


def output_tokens(r: TraceRequest, per_block: int, max_output: int) -> int:
    return max(1, min(max_output, r.output_length * per_block // DEFAULT_BLOCK_TOKENS))


def arrival_times(requests: list[TraceRequest], rate: float) -> list[float]:
    """Seconds after the start at which each request is sent: the trace's own arrival times,
    compressed (or stretched) so that they come at ``rate`` requests per second on average."""
    t0 = requests[0].timestamp_ms
    span_s = (requests[-1].timestamp_ms - t0) / 1000.0
    if len(requests) < 2 or not span_s:  # no spacing to keep: evenly at the rate
        return [i / rate for i in range(len(requests))]
    scale = (len(requests) - 1) / rate / span_s  # replay seconds per trace second
    return [(r.timestamp_ms - t0) / 1000.0 * scale for r in requests]


def ideal_hit_tokens(prompts: list[list[int]], block_tokens: int) -> list[int]:
    """Per request, the prefix tokens one infinite cache shared by every node would hold when it
    arrives (full blocks of every earlier prompt; what a prefill can skip at best)."""
    root = root_key("bench/serve/ideal")
    seen: set[bytes] = set()
    hits = []
    for tokens in prompts:
        keys = block_keys(tokens, block_tokens, root)
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hits.append(min(n * block_tokens, len(tokens) - 1))  # the last token is always computed
        seen.update(keys)
    return hits


@dataclass(kw_only=True)
class Outcome:
    index: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    status: str = "pending"  # ok | rejected | failed
    error: str = ""
    http_status: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    mode: str = ""  # how the router served it: aggregated or disaggregated
    prefill_node: str = ""
    decode_node: str = ""
    cached_tokens: int = 0  # prompt tokens served from a cache (the answer's usage)
    attempts: int = 0


async def request(
    session: Any, url: str, model: str, tokens: list[int], out: Outcome, timeout_s: float
) -> None:
    """One streamed completion through ``url``, measured into ``out``."""
    import aiohttp

    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": out.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    times: list[float] = []
    try:
        async with session.post(
            url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            out.http_status = r.status
            if r.status != 200:
                text = await r.text()
                try:
                    out.error = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    out.error = text[:200]
                out.status = "rejected" if r.status == 429 else "failed"
                return
            h = r.headers
            out.mode = h.get("x-kvcache-mode", "")
            out.prefill_node = h.get("x-kvcache-prefill-node", "")
            out.decode_node = h.get("x-kvcache-decode-node", "")
            out.attempts = int(h.get("x-kvcache-attempts", 0))
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise LiveError(event["error"].get("message", "error event"))
                if event.get("choices"):
                    times.append(time.perf_counter())
                usage = event.get("usage")
                if usage:
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = int(details.get("cached_tokens") or 0)
        out.status = "ok"
    except (LiveError, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        out.status, out.error = "failed", f"{type(e).__name__}: {e}"
    finally:
        out.e2e_s = time.perf_counter() - t0
        if times:
            out.ttft_s = times[0] - t0
            if len(times) > 1:
                out.tpot_s = (times[-1] - times[0]) / (len(times) - 1)


async def replay(
    url: str,
    model: str,
    prompts: list[list[int]],
    outputs: list[int],
    arrivals: list[float],
    timeout_s: float,
) -> tuple[list[Outcome], float]:
    """Every prompt sent at its arrival time (open loop); the outcomes and the wall seconds."""
    import aiohttp

    outcomes = [
        Outcome(index=i, arrival_s=a, prompt_tokens=len(p), max_tokens=o)
        for i, (p, o, a) in enumerate(zip(prompts, outputs, arrivals))
    ]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        tasks = []
        for out, tokens in zip(outcomes, prompts):
            delay = start + out.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing the arrivals
            tasks.append(asyncio.create_task(request(session, url, model, tokens, out, timeout_s)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return outcomes, wall


async def warm_up(url: str, model: str, vocab: int, engines: int) -> None:
    """A few requests on prompts of their own (first requests of an engine are slow), one
    after another, so every engine has served before the clock starts."""
    import aiohttp

    rng = np.random.default_rng(0)
    async with aiohttp.ClientSession() as session:
        for i in range(2 * engines):
            tokens = [int(x) for x in rng.integers(SPECIAL_TOKENS, vocab, 200 + 37 * i)]
            out = Outcome(index=-1, arrival_s=0.0, prompt_tokens=len(tokens), max_tokens=4)
            await request(session, url, model, tokens, out, 300)
            if out.status != "ok":
                raise LiveError(f"warm-up request failed: {out.error}")


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def meets(o: Outcome, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    """Served, with its TTFT and TPOT within the SLOs (a one-token answer has no TPOT)."""
    return (
        o.status == "ok"
        and o.ttft_s is not None
        and o.ttft_s <= ttft_slo_s
        and (o.tpot_s is None or o.tpot_s <= tpot_slo_s)
    )


def summarize(
    outcomes: list[Outcome],
    wall_s: float,
    ideal: list[int],
    ttft_slo_s: float,
    tpot_slo_s: float,
) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == "ok"]
    ttft = [o.ttft_s * 1e3 for o in ok if o.ttft_s is not None]
    tpot = [o.tpot_s * 1e3 for o in ok if o.tpot_s is not None]
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    best = sum(ideal[o.index] for o in ok)
    good = sum(meets(o, ttft_slo_s, tpot_slo_s) for o in outcomes)
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "rejected": sum(o.status == "rejected" for o in outcomes),
        "failed": sum(o.status == "failed" for o in outcomes),
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p99_ms": _pct(ttft, 99),
        "tpot_p50_ms": _pct(tpot, 50),
        "tpot_p99_ms": _pct(tpot, 99),
        "output_tok_s": sum(o.output_tokens for o in ok) / wall_s if wall_s else None,
        "req_s": len(ok) / wall_s if wall_s else None,
        "goodput_req_s": good / wall_s if wall_s else None,
        "slo_attainment": good / len(outcomes) if outcomes else None,
        "hit_rate": cached / prompt if prompt else None,
        "ideal_hit_rate": best / prompt if prompt else None,
        "hit_vs_ideal": cached / best if best else None,
        "disaggregated": sum(o.mode == "disaggregated" for o in ok),
        "retried": sum(o.attempts > 1 for o in ok),
        "wall_s": wall_s,
        "errors": sorted({o.error for o in outcomes if o.status != "ok"})[:5],
    }
