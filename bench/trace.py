"""Mooncake-format request traces: reading, writing and synthetic generation.

One request per line: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}`` where ``hash_ids[i]`` names the prefix up to the end of block ``i``
(``block_tokens`` tokens per block; the last block may be partial). Equal ids at the same position
mean a shared prefix, so a trace replays through the real kvstore by chaining the ids into block
keys (``kvstore.keys.keys_from_block_ids``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from dataclasses import dataclass, replace

import numpy as np

from kvstore.keys import BlockKey, keys_from_block_ids, root_key

log = logging.getLogger(__name__)

DEFAULT_BLOCK_TOKENS = 512
# The real trace lives in the shared data folder beside the repository (../shared/data).
DEFAULT_TRACE = os.path.normpath(
    os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "..",
        "..",
        "shared",
        "data",
        "conversation_trace.jsonl",
    )
)
TRACE_NAMESPACE = "bench/trace"


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Trace:
    """Requests in timestamp order. ``reordered``: how many lines arrived out of order."""

    requests: list[TraceRequest]
    block_tokens: int
    source: str
    reordered: int = 0

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_blocks(self) -> int:
        return sum(len(r.hash_ids) for r in self.requests)

    @property
    def total_input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    @property
    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        return (self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms) / 1000.0

    def block_keys(self, namespace: str = TRACE_NAMESPACE) -> list[list[BlockKey]]:
        """Chained kvstore keys of every request (computed once, shared by all replays)."""
        root = root_key(namespace)
        return [keys_from_block_ids(r.hash_ids, root) for r in self.requests]


def _field_int(obj: dict, name: str, where: str, minimum: int = 0) -> int:
    value = obj.get(name)
    if value is None:
        raise TraceError(f"{where}: missing field {name!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise TraceError(f"{where}: {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(f"{where}: {name!r} must be >= {minimum}, got {value!r}")
    return int(value)


def parse_request(line: str, where: str, block_tokens: int) -> TraceRequest:
    """One trace line -> a request; ``where`` ("file:line") prefixes every error."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise TraceError(
            f"{where}: 'timestamp' must be a non-negative number of milliseconds, got {ts!r}"
        )
    input_length = _field_int(obj, "input_length", where)
    output_length = _field_int(obj, "output_length", where)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    expected = -(-input_length // block_tokens)
    if len(ids) != expected:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids, but input_length {input_length} in blocks of "
            f"{block_tokens} tokens needs {expected}; is --trace-block-tokens right?"
        )
    return TraceRequest(float(ts), input_length, output_length, tuple(ids))


def load_trace(path: str, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Trace:
    """Read a Mooncake-format JSONL trace. Blank lines are skipped; out-of-order timestamps are
    sorted (stable) with a warning; any malformed line raises ``TraceError`` naming its line."""
    if block_tokens <= 0:
        raise TraceError(f"block_tokens must be positive, got {block_tokens}")
    requests: list[TraceRequest] = []
    reordered = 0
    last = -math.inf
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot open trace {path!r}: {e.strerror}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            req = parse_request(line, f"{path}:{lineno}", block_tokens)
            if req.timestamp_ms < last:
                reordered += 1
            last = max(last, req.timestamp_ms)
            requests.append(req)
    if reordered:
        log.warning(
            "%s: %d requests are out of timestamp order; replaying them sorted by timestamp",
            path,
            reordered,
        )
        requests.sort(key=lambda r: r.timestamp_ms)
    return Trace(requests=requests, block_tokens=block_tokens, source=path, reordered=reordered)


def write_trace(path: str, trace: Trace) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in trace.requests:
            ts = int(r.timestamp_ms) if r.timestamp_ms == int(r.timestamp_ms) else r.timestamp_ms
            f.write(
                json.dumps(
                    {
                        "timestamp": ts,
                        "input_length": r.input_length,
                        "output_length": r.output_length,
                        "hash_ids": list(r.hash_ids),
                    }
                )
                + "\n"
            )


# ---- synthetic traces ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SyntheticSpec:
    """A seeded workload of multi-turn chat sessions.

    Each session starts at a Poisson arrival, uses one of ``system_prompts`` shared prompts, with
    probability ``doc_prob`` quotes a document drawn Zipf(``zipf_s``)-popular from ``documents``,
    and runs a geometric number of turns; turn ``t``'s prompt is the whole conversation so far plus
    a new user message, so later turns share the earlier turns' prefix.
    """

    requests: int = 5000
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    sessions_per_s: float = 2.0
    system_prompts: int = 8
    system_prompt_tokens: tuple[int, int] = (500, 3000)
    documents: int = 2000
    document_tokens: tuple[int, int] = (1000, 12000)
    doc_prob: float = 0.6
    zipf_s: float = 1.1
    mean_turns: float = 3.0
    user_tokens: tuple[int, int] = (50, 1500)
    output_tokens: tuple[int, int] = (20, 800)
    think_time_s: tuple[float, float] = (5.0, 120.0)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 0 or self.block_tokens <= 0 or self.sessions_per_s <= 0:
            raise ValueError("requests >= 0, block_tokens > 0 and sessions_per_s > 0 required")
        if self.system_prompts < 1 or self.documents < 1 or self.mean_turns < 1:
            raise ValueError("system_prompts, documents and mean_turns must be >= 1")
        if not 0 <= self.doc_prob <= 1 or self.zipf_s <= 0:
            raise ValueError("doc_prob must be in [0, 1] and zipf_s > 0")


class _BlockNamer:
    """Assigns trace ids to prefix blocks: a block's id is determined by its parent's id and the
    content pieces (segment id, start, end) inside it, so equal prefixes get equal ids."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._ids: dict[tuple, int] = {}

    def hash_ids(self, segments: list[tuple[int, int]]) -> list[int]:
        """``segments``: (content id, length) in prompt order. One id per (possibly partial)
        block."""
        out: list[int] = []
        parent, pieces, filled = -1, [], 0
        for seg, length in segments:
            pos = 0
            while pos < length:
                take = min(length - pos, self.block_tokens - filled)
                pieces.append((seg, pos, pos + take))
                pos += take
                filled += take
                if filled == self.block_tokens:
                    parent = self._name(parent, pieces)
                    out.append(parent)
                    pieces, filled = [], 0
        if pieces:
            out.append(self._name(parent, pieces))
        return out

    def _name(self, parent: int, pieces: list[tuple[int, int, int]]) -> int:
        key = (parent, tuple(pieces))
        return self._ids.setdefault(key, len(self._ids))


def synthetic_trace(spec: SyntheticSpec) -> Trace:
    """Generate ``spec.requests`` requests (deterministic for a given spec, seed included)."""
    rng = np.random.default_rng(spec.seed)

    def uniform_int(bounds: tuple[int, int]) -> int:
        return int(rng.integers(bounds[0], bounds[1] + 1))

    # Content ids: system prompts, documents, then one fresh id per message.
    sys_len = [uniform_int(spec.system_prompt_tokens) for _ in range(spec.system_prompts)]
    doc_len = [uniform_int(spec.document_tokens) for _ in range(spec.documents)]
    doc_base = spec.system_prompts
    next_id = doc_base + spec.documents
    ranks = np.arange(1, spec.documents + 1, dtype=np.float64)
    doc_p = ranks**-spec.zipf_s
    doc_p /= doc_p.sum()

    namer = _BlockNamer(spec.block_tokens)
    events: list[tuple[float, int, list[tuple[int, int]], int]] = []  # (ms, seq, segments, out)
    t = 0.0
    # NOTE: sessions keep starting until no new session can add one of the first ``requests``
    # requests by time; then the earliest ``requests`` are kept. Stopping at the count instead
    # would leave a thin tail of late turns and overstate the arrival rate of the rest.
    cutoff = math.inf if spec.requests else -math.inf
    sessions = 0
    while t <= cutoff:
        t += rng.exponential(1.0 / spec.sessions_per_s)
        prompt = int(rng.integers(spec.system_prompts))
        segments = [(prompt, sys_len[prompt])]
        if rng.random() < spec.doc_prob:
            doc = int(rng.choice(spec.documents, p=doc_p))
            segments.append((doc_base + doc, doc_len[doc]))
        turns = int(rng.geometric(1.0 / spec.mean_turns))
        turn_t = t
        for _ in range(turns):
            segments.append((next_id, uniform_int(spec.user_tokens)))
            next_id += 1
            out = uniform_int(spec.output_tokens)
            events.append((turn_t * 1000.0, len(events), list(segments), out))
            segments.append((next_id, out))  # the answer becomes part of the next prompt
            next_id += 1
            turn_t += rng.uniform(*spec.think_time_s)
        sessions += 1
        if len(events) >= spec.requests and (math.isinf(cutoff) or sessions % 32 == 0):
            times = np.fromiter((e[0] for e in events), dtype=np.float64, count=len(events))
            cutoff = float(np.partition(times, spec.requests - 1)[spec.requests - 1]) / 1000.0
    events.sort(key=lambda e: (e[0], e[1]))
    del events[spec.requests :]
    requests = [
        TraceRequest(round(ms, 3), sum(n for _, n in segs), out, tuple(namer.hash_ids(segs)))
        for ms, _, segs, out in events
    ]
    return Trace(
        requests=requests, block_tokens=spec.block_tokens, source=f"synthetic(seed={spec.seed})"
    )


# ---- command-line options shared by the trace-driven commands -----------------------------------


def add_trace_args(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("trace")
    src.add_argument(
        "--trace", default=DEFAULT_TRACE, help="Mooncake-format JSONL trace (default: %(default)s)"
    )
    src.add_argument(
        "--trace-block-tokens",
        type=int,
        default=DEFAULT_BLOCK_TOKENS,
        help="tokens per hash_id block in the trace (default: %(default)s)",
    )
    src.add_argument(
        "--synthetic",
        action="store_true",
        help="generate a synthetic trace instead (shared system prompts, multi-turn "
        "sessions, Zipf-popular documents; seeded by --seed)",
    )
    src.add_argument("--synthetic-requests", type=int, default=SyntheticSpec.requests)
    src.add_argument("--synthetic-documents", type=int, default=SyntheticSpec.documents)
    src.add_argument(
        "--synthetic-zipf",
        type=float,
        default=SyntheticSpec.zipf_s,
        help="Zipf exponent of document popularity (default: %(default)s)",
    )
    src.add_argument(
        "--synthetic-sessions-per-s",
        type=float,
        default=SyntheticSpec.sessions_per_s,
        help="new sessions per second (default: %(default)s)",
    )
    src.add_argument("--save-trace", help="also write the trace replayed to this JSONL file")
    src.add_argument(
        "--requests", type=int, default=0, help="replay only the first N requests (default: all)"
    )


def trace_from_args(args: argparse.Namespace) -> Trace:
    """The trace the options name (``TraceError`` / ``ValueError`` on bad input)."""
    if args.synthetic:
        spec = SyntheticSpec(
            requests=args.synthetic_requests,
            block_tokens=args.trace_block_tokens,
            documents=args.synthetic_documents,
            zipf_s=args.synthetic_zipf,
            sessions_per_s=args.synthetic_sessions_per_s,
            seed=args.seed,
        )
        trace = synthetic_trace(spec)
    else:
        trace = load_trace(args.trace, args.trace_block_tokens)
    if args.requests < 0:
        raise ValueError(f"--requests must be >= 0, got {args.requests}")
    if args.requests:
        trace = replace(trace, requests=trace.requests[: args.requests])
    if args.save_trace:
        write_trace(args.save_trace, trace)
    return trace


def describe(trace: Trace) -> str:
    return (
        f"trace: {trace.source}: {len(trace):,} requests, {trace.total_blocks:,} blocks of "
        f"{trace.block_tokens} tokens, {trace.total_input_tokens:,} input tokens over "
        f"{trace.duration_s:,.0f} s"
        + (f" ({trace.reordered} reordered)" if trace.reordered else "")
    )
