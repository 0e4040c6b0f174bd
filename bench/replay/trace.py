"""Request traces: reading (Mooncake's format and your own requests), writing, synthetic ones.

One request per line (docs/traces.md), in one of three forms:

- Mooncake's: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
  "hash_ids": [...]}`` where ``hash_ids[i]`` names the prefix up to the end of block ``i``
  (``block_tokens`` tokens per block; the last block may be partial);
- token ids: ``{"input_ids": [...], "output_length": n, "timestamp": ms}``;
- text: ``{"prompt": "...", ...}``, tokenized by a local Hugging Face tokenizer (``--tokenizer``).

``timestamp`` is optional in the last two (every line has one, or none does: then ``--rate``
gives Poisson arrivals), ``output_length`` too (``--output-length``). Token ids become hash ids by
the block-key chain itself (``kvstore.keys.block_keys``), so equal prefixes get equal ids; a trace
replays through the real kvstore by chaining the ids into block keys
(``kvstore.keys.keys_from_block_ids``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from dataclasses import dataclass, replace

import numpy as np

from kvstore.keys import BlockKey, block_keys, keys_from_block_ids, root_key

log = logging.getLogger(__name__)

DEFAULT_BLOCK_TOKENS = 512
# The real trace lives in the shared data folder beside the repository (../shared/data).
DEFAULT_TRACE = os.path.normpath(
    os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "..",
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
    """Requests in timestamp order. ``reordered``: how many lines arrived out of order;
    ``arrivals``: "recorded" (the trace's timestamps), "poisson" (made with --rate) or "none"
    (no timestamps: file order, all at time 0)."""

    requests: list[TraceRequest]
    block_tokens: int
    source: str
    reordered: int = 0
    arrivals: str = "recorded"

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
    """One Mooncake-format trace line -> a request; ``where`` ("file:line") prefixes every
    error."""
    obj = _json_object(line, where)
    ts = _timestamp(obj, where)
    if ts is None:
        raise TraceError(f"{where}: missing field 'timestamp' (milliseconds)")
    return _mooncake(obj, ts, where, block_tokens)


def _json_object(line: str, where: str) -> dict:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _timestamp(obj: dict, where: str) -> float | None:
    if "timestamp" not in obj:
        return None
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise TraceError(
            f"{where}: 'timestamp' must be a non-negative number of milliseconds, got {ts!r}"
        )
    return float(ts)


def _mooncake(obj: dict, ts: float, where: str, block_tokens: int) -> TraceRequest:
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
    return TraceRequest(ts, input_length, output_length, tuple(ids))


@dataclass(frozen=True, slots=True)
class _Line:
    """A request before its hash ids are known: token ids, or text still to tokenize."""

    where: str
    timestamp_ms: float | None
    output_length: int
    tokens: np.ndarray | None = None
    prompt: str | None = None
    request: TraceRequest | None = None  # Mooncake's form, complete already


def _parse_line(line: str, where: str, block_tokens: int, default_output: int) -> _Line:
    obj = _json_object(line, where)
    ts = _timestamp(obj, where)
    if "hash_ids" in obj:
        if ts is None:
            raise TraceError(f"{where}: missing field 'timestamp' (Mooncake's form needs it)")
        return _Line(where, ts, 0, request=_mooncake(obj, ts, where, block_tokens))
    out = default_output
    if "output_length" in obj:
        out = _field_int(obj, "output_length", where)
    if "input_ids" in obj:
        ids = obj["input_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 32 for i in ids
        ):
            raise TraceError(f"{where}: 'input_ids' must be a list of token ids (0 <= id < 2**32)")
        return _Line(where, ts, out, tokens=np.asarray(ids, dtype=np.uint32))
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise TraceError(f"{where}: 'prompt' must be a string")
        return _Line(where, ts, out, prompt=obj["prompt"])
    raise TraceError(
        f"{where}: a request needs 'input_ids' (token ids), 'prompt' (text, with --tokenizer) "
        "or 'hash_ids' (Mooncake's form)"
    )


class _TokenNamer:
    """Token ids -> hash ids: a full block's id is its chained block key's (so equal prefixes
    get equal ids, as in Mooncake's traces), a trailing partial block's is its parent key's plus
    its tokens."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._root = root_key(TRACE_NAMESPACE + "/tokens")
        self._ids: dict[bytes, int] = {}

    def hash_ids(self, tokens: np.ndarray) -> tuple[int, ...]:
        keys = block_keys(tokens, self.block_tokens, self._root)
        names = list(keys)
        tail = tokens[len(keys) * self.block_tokens :]
        if tail.size:
            parent = keys[-1] if keys else self._root
            names.append(b"partial" + parent + tail.astype("<u4").tobytes())
        return tuple(self._ids.setdefault(k, len(self._ids)) for k in names)


def load_tokenizer(path: str):
    """A local Hugging Face tokenizer (a directory holding tokenizer.json, or the file): read
    with the ``tokenizers`` library from disk only, never from the hub."""
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise TraceError(
            f"--tokenizer {path}: no tokenizer.json there (give a local Hugging Face tokenizer "
            "directory, as save_pretrained writes it, or its tokenizer.json; nothing is "
            "downloaded)"
        )
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TraceError(
            "--tokenizer needs the 'tokenizers' package: pip install 'kvcache[hf]'"
        ) from None
    try:
        return Tokenizer.from_file(file)
    except Exception as e:  # the library raises its own exception types for a bad file
        raise TraceError(
            f"--tokenizer {file}: not a tokenizer file the library reads ({e})"
        ) from None


def load_trace(
    path: str,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    tokenizer: str | None = None,
    rate: float | None = None,
    seed: int = 0,
    output_length: int = 256,
) -> Trace:
    """Read a JSONL trace in any of the module's forms. Blank lines are skipped; out-of-order
    timestamps are sorted (stable) with a warning; any malformed line raises ``TraceError``
    naming its line. ``rate``: requests/s of Poisson arrivals for a trace without timestamps;
    ``output_length``: for requests that do not say."""
    if block_tokens <= 0:
        raise TraceError(f"block_tokens must be positive, got {block_tokens}")
    if rate is not None and not 0 < rate < math.inf:
        raise TraceError(f"--rate must be a positive number of requests per second, got {rate}")
    if output_length < 0:
        raise TraceError(f"--output-length must be >= 0, got {output_length}")
    tok = load_tokenizer(tokenizer) if tokenizer else None  # a wrong path fails even unused
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot open trace {path!r}: {e.strerror}") from None
    lines: list[_Line] = []
    with f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                lines.append(_parse_line(line, f"{path}:{lineno}", block_tokens, output_length))
    timed = [ln.timestamp_ms is not None for ln in lines]
    if lines and any(timed) and not all(timed):
        odd = lines[timed.index(not timed[0])]
        raise TraceError(
            f"{odd.where}: {'no' if timed[0] else 'a'} 'timestamp', unlike {lines[0].where}: "
            "give every request a timestamp, or none (and --rate for Poisson arrivals)"
        )
    has_times = bool(lines) and timed[0]
    if has_times and rate is not None:
        raise TraceError(
            f"{path}: --rate makes arrivals for a trace without timestamps; this one has its own"
        )
    prompts = [ln for ln in lines if ln.prompt is not None]
    encoded: dict[int, np.ndarray] = {}
    if prompts:
        if tok is None:
            raise TraceError(
                f"{prompts[0].where}: 'prompt' is text: give --tokenizer PATH (a local Hugging "
                "Face tokenizer directory) to turn it into token ids"
            )
        for ln, enc in zip(prompts, tok.encode_batch([ln.prompt for ln in prompts])):
            encoded[id(ln)] = np.asarray(enc.ids, dtype=np.uint32)
    namer = _TokenNamer(block_tokens)
    if not has_times and rate is not None:
        gaps = np.random.default_rng(seed).exponential(1000.0 / rate, size=len(lines))
        times = np.cumsum(gaps) - (gaps[0] if len(lines) else 0.0)
    requests: list[TraceRequest] = []
    for i, ln in enumerate(lines):
        if ln.request is not None:
            requests.append(ln.request)
            continue
        toks = ln.tokens if ln.tokens is not None else encoded[id(ln)]
        if ln.timestamp_ms is not None:
            ts = ln.timestamp_ms
        else:
            ts = round(float(times[i]), 3) if rate is not None else 0.0
        requests.append(TraceRequest(ts, int(toks.size), ln.output_length, namer.hash_ids(toks)))
    reordered, last = 0, -math.inf
    for r in requests:
        if r.timestamp_ms < last:
            reordered += 1
        last = max(last, r.timestamp_ms)
    if reordered:
        log.warning(
            "%s: %d requests are out of timestamp order; replaying them sorted by timestamp",
            path,
            reordered,
        )
        requests.sort(key=lambda r: r.timestamp_ms)
    arrivals = "recorded" if has_times else ("poisson" if rate is not None else "none")
    return Trace(
        requests=requests,
        block_tokens=block_tokens,
        source=path,
        reordered=reordered,
        arrivals=arrivals,
    )


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
        "--trace",
        default=DEFAULT_TRACE,
        help="JSONL trace: Mooncake's hash_ids, or your requests' input_ids or prompt text "
        "(docs/traces.md; default: %(default)s)",
    )
    src.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a local Hugging Face tokenizer directory (or its tokenizer.json) for a trace of "
        "'prompt' text; nothing is downloaded",
    )
    src.add_argument(
        "--rate",
        type=float,
        help="requests/s of Poisson arrivals, for a trace without timestamps",
    )
    src.add_argument(
        "--output-length",
        type=int,
        default=256,
        help="output tokens of a request whose line does not say (default: %(default)s)",
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
        if args.rate is not None or args.tokenizer:
            raise ValueError("--rate and --tokenizer are for a --trace file, not --synthetic")
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
        trace = load_trace(
            args.trace,
            args.trace_block_tokens,
            tokenizer=args.tokenizer,
            rate=args.rate,
            seed=args.seed,
            output_length=args.output_length,
        )
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
        + {"recorded": "", "poisson": " (Poisson arrivals, --rate)", "none": " (no timestamps)"}[
            trace.arrivals
        ]
    )
