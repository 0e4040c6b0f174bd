"""Scheduling policies: what the scheduler prices (``PrefillContext``: every prefill candidate
with the prefix it holds, and the fetch of the best prefix priced on demand) and how each policy
chooses from it (``POLICIES``, by name: ``random``, ``round-robin``, ``load``, ``local-cache``,
``global-cache``)."""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.errors import InvalidArgument

from .costmodel import CostModel
from .registry import NodeState

if TYPE_CHECKING:
    from .scheduler import Request


# ---- options the policies choose from -------------------------------------------------------


@dataclass(slots=True)
class PrefillOption:
    node: NodeState
    local_blocks: int
    queue_s: float
    reuse_blocks: int
    transfer_s: float
    prefill_s: float
    ttft_s: float
    source: NodeState | None = None  # fetch [local_blocks, reuse_blocks) from here


@dataclass(slots=True)
class DecodeOption:
    node: NodeState
    requests: int  # after adding this request
    tokens: int
    tbt_s: float


def _min_index(values: list[float]) -> int:
    """Index of the first smallest value (as ``min`` picks among equals)."""
    return values.index(min(values))


class PrefillContext:
    """What a policy sees: every prefill candidate priced with the prefix it holds, as parallel
    lists (one entry per candidate, in candidate order), and the fetch of the best prefix priced
    on demand.

    NOTE: a policy picks an index and materialises only that option (``option(i)``,
    ``fetched_option(i)``): building an option object per candidate per request was a measurable
    share of a decision. ``options`` and ``fetch`` give the objects for policies that want them.
    """

    __slots__ = (
        "request",
        "nodes",
        "local_blocks",
        "queue_s",
        "prefill_s",
        "ttft_s",
        "best_blocks",
        "best_source",
        "_cost",
        "_block_bytes",
        "_keep",
        "_prefill_best",
        "_transfer",
        "_fetched",
    )

    def __init__(
        self,
        request: Request,
        nodes: list[NodeState],
        local_blocks: list[int],
        queue_s: list[float],
        prefill_s: list[float],
        ttft_s: list[float],
        best_blocks: int,
        best_source: NodeState | None,
        cost: CostModel,
        block_bytes: int,
        keep: float,
        prefill_best: float | None,
    ) -> None:
        self.request = request
        self.nodes = nodes
        self.local_blocks = local_blocks
        self.queue_s = queue_s
        self.prefill_s = prefill_s
        self.ttft_s = ttft_s
        self.best_blocks = best_blocks
        self.best_source = best_source
        self._cost = cost
        self._block_bytes = block_bytes
        self._keep = keep  # a fetch must bring TTFT below ttft * keep
        self._prefill_best = prefill_best  # prefill after fetching best_blocks (None: not yet)
        self._transfer: dict[int, float] = {}  # by local prefix length
        self._fetched: list[float | None] | None = None

    def option(self, i: int) -> PrefillOption:
        """Candidate ``i`` computing all but its own prefix."""
        local = self.local_blocks[i]
        return PrefillOption(
            self.nodes[i], local, self.queue_s[i], local, 0.0, self.prefill_s[i], self.ttft_s[i]
        )

    @property
    def options(self) -> list[PrefillOption]:
        return [self.option(i) for i in range(len(self.nodes))]

    def fetched_ttft(self) -> list[float | None]:
        """Per candidate: the TTFT if it first fetches blocks ``[local, best)`` from
        ``best_source`` (``max(queue, transfer) + prefill(prompt, best)``: the fetch runs while
        the request queues), or None where there is nothing to fetch or the fetch does not cut
        TTFT by the ``min_transfer_gain`` fraction."""
        if self._fetched is not None:
            return self._fetched
        best = self.best_blocks
        if self.best_source is None:
            self._fetched = [None] * len(self.nodes)
            return self._fetched
        prefill = self._prefill_at_best()
        transfer_of = self._transfer
        keep = self._keep
        out: list[float | None] = []
        for local, queue, ttft in zip(self.local_blocks, self.queue_s, self.ttft_s):
            if local >= best:
                out.append(None)
                continue
            transfer = transfer_of.get(local)
            if transfer is None:
                transfer = transfer_of[local] = self._cost.transfer_seconds(
                    (best - local) * self._block_bytes
                )
            fetched = (queue if queue >= transfer else transfer) + prefill
            out.append(None if fetched >= ttft * keep else fetched)
        self._fetched = out
        return out

    def fetched_option(self, i: int) -> PrefillOption:
        """Candidate ``i`` fetching the best prefix first (``fetched_ttft()[i]`` is not None)."""
        ttft = self.fetched_ttft()[i]
        assert ttft is not None, "fetched_option of a candidate with nothing worth fetching"
        local = self.local_blocks[i]
        return PrefillOption(
            self.nodes[i],
            local,
            self.queue_s[i],
            self.best_blocks,
            self._transfer[local],
            self._prefill_at_best(),
            ttft,
            self.best_source,
        )

    def fetch(self, option: PrefillOption) -> PrefillOption | None:
        """``option`` (one of ``options``) fetching the best prefix first, or None (see
        ``fetched_ttft``)."""
        i = self.nodes.index(option.node)
        return self.fetched_option(i) if self.fetched_ttft()[i] is not None else None

    def _prefill_at_best(self) -> float:
        if self._prefill_best is None:
            r = self.request
            self._prefill_best = self._cost.prefill_seconds(
                r.prompt_tokens, self.best_blocks * r.block_tokens
            )
        return self._prefill_best


class SchedulingPolicy(ABC):
    """Chooses among the options the scheduler prices. Registered by name in ``POLICIES``."""

    name: str = ""

    @abstractmethod
    def pick_prefill(self, ctx: PrefillContext) -> PrefillOption: ...

    def pick_decode(self, tbt_s: list[float]) -> int:
        """Index of the decode node to use, given each candidate's predicted TBT."""
        return _min_index(tbt_s)


class RandomPolicy(SchedulingPolicy):
    """Uniformly random prefill and decode nodes (a node still reuses its own prefix)."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick_prefill(self, ctx: PrefillContext) -> PrefillOption:
        return ctx.option(self._rng.randrange(len(ctx.nodes)))

    def pick_decode(self, tbt_s: list[float]) -> int:
        return self._rng.randrange(len(tbt_s))


class RoundRobinPolicy(SchedulingPolicy):
    """Prefill and decode candidates in turn (a node still reuses its own prefix): the
    baseline of routers that know neither caches nor load."""

    name = "round-robin"

    def __init__(self) -> None:
        self._prefill = itertools.count()
        self._decode = itertools.count()

    def pick_prefill(self, ctx: PrefillContext) -> PrefillOption:
        return ctx.option(next(self._prefill) % len(ctx.nodes))

    def pick_decode(self, tbt_s: list[float]) -> int:
        return next(self._decode) % len(tbt_s)


class LoadPolicy(SchedulingPolicy):
    """Shortest prefill queue, ignoring the cache; least-loaded decode node."""

    name = "load"

    def pick_prefill(self, ctx: PrefillContext) -> PrefillOption:
        return ctx.option(_min_index(ctx.queue_s))


class LocalCachePolicy(SchedulingPolicy):
    """Minimum TTFT counting only the prefix each node already holds: no transfers."""

    name = "local-cache"

    def pick_prefill(self, ctx: PrefillContext) -> PrefillOption:
        return ctx.option(_min_index(ctx.ttft_s))


class GlobalCachePolicy(SchedulingPolicy):
    """Mooncake Algorithm 1: minimum TTFT where a node may fetch the best prefix first."""

    name = "global-cache"

    def pick_prefill(self, ctx: PrefillContext) -> PrefillOption:
        fetched = ctx.fetched_ttft()
        ttfts = [t if f is None else f for t, f in zip(ctx.ttft_s, fetched)]
        i = _min_index(ttfts)
        return ctx.option(i) if fetched[i] is None else ctx.fetched_option(i)


POLICIES: dict[str, type[SchedulingPolicy]] = {
    p.name: p
    for p in (RandomPolicy, RoundRobinPolicy, LoadPolicy, LocalCachePolicy, GlobalCachePolicy)
}


def make_policy(name: str, seed: int | None = None) -> SchedulingPolicy:
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidArgument(f"unknown scheduling policy {name!r}; use one of {sorted(POLICIES)}")
    return cls(seed) if cls is RandomPolicy else cls()
