"""Stored / evicted events with sequence numbers, drained by one consumer (the node server)."""

from __future__ import annotations

from collections import deque
from enum import IntEnum
from typing import Callable, NamedTuple

from .keys import BlockKey
from .tiers import Tier


class EventKind(IntEnum):
    STORED = 1  # the node now holds the key in ``tier`` (also sent when a block changes tier)
    EVICTED = 2  # the node no longer holds the key (``tier`` is where it was last)


class BlockEvent(NamedTuple):  # NOTE: a tuple: one is built per block stored or evicted
    seq: int
    kind: EventKind
    key: BlockKey
    tier: Tier


class EventLog:
    """A bounded FIFO of events. When full, the oldest are dropped; consumers see the gap in
    ``seq`` and resynchronise from a snapshot instead of silently missing events."""

    def __init__(self, max_events: int, notify: Callable[[], None] | None = None) -> None:
        self._events: deque[BlockEvent] = deque(maxlen=max_events)
        self._notify = notify
        self.last_seq = 0
        self.dropped = 0

    def append(self, kind: EventKind, key: BlockKey, tier: Tier) -> None:
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self.last_seq += 1
        self._events.append(BlockEvent(self.last_seq, kind, key, tier))
        if self._notify is not None:
            self._notify()

    def take(self, max_events: int | None = None) -> list[BlockEvent]:
        n = len(self._events) if max_events is None else min(max_events, len(self._events))
        pop = self._events.popleft
        return [pop() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._events)
