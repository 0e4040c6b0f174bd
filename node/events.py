"""Node-wide event feed: merges every store's stored/evicted events under one sequence.

Stores call ``notify`` when they log events; a pump thread drains them into a bounded ring that
subscribers (the conductor, via the Events RPC) read from a cursor. A subscriber that falls behind
the ring's start gets ``None`` (a gap) and must resynchronise from ``snapshot``. So does every
subscriber whose cursor predates events a store dropped before the pump took them (a gap in that
store's own sequence): the node's sequence never hides a lost event.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import NamedTuple

from kvstore.events import EventKind
from kvstore.keys import BlockKey
from kvstore.store import TieredStore
from kvstore.tiers import Tier


class NodeEvent(NamedTuple):  # NOTE: a tuple: one is built per block stored or evicted
    seq: int
    kind: EventKind
    key: BlockKey
    tier: Tier


class EventHub:
    def __init__(self, capacity: int = 1 << 18) -> None:
        self._cond = threading.Condition()
        self._ring: deque[NodeEvent] = deque(maxlen=capacity)
        self._stores: list[TieredStore] = []
        self._wake = threading.Event()
        self._stopped = False
        self.last_seq = 0
        self._store_seq: dict[int, int] = {}  # id(store) -> the last store seq taken
        # Cursors before this seq missed events a store dropped: they must resync.
        self.lost_through = 0
        self._thread = threading.Thread(target=self._run, name="event-pump", daemon=True)

    def attach(self, stores: list[TieredStore]) -> None:
        self._stores = list(stores)
        self._thread.start()

    def add(self, store: TieredStore) -> None:
        """A store opened after start (a layout registered at run time)."""
        with self._cond:
            self._stores = [*self._stores, store]

    def notify(self) -> None:
        """Called by stores (under their lock) after logging events: must stay cheap. Setting a
        set Event takes its lock (1 us per event logged): skipped, as the pump clears the flag
        before it takes the events, so an event logged while it is set is taken anyway."""
        if not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            self.pump()

    def pump(self) -> None:
        """Move pending store events into the ring, numbering them node-wide."""
        with self._cond:
            added = 0
            for store in self._stores:
                for ev in store.take_events():
                    if ev.seq != self._store_seq.get(id(store), 0) + 1:
                        self.lost_through = self.last_seq + 1
                    self._store_seq[id(store)] = ev.seq
                    self.last_seq += 1
                    self._ring.append(NodeEvent(self.last_seq, ev.kind, ev.key, ev.tier))
                    added += 1
            if added:
                self._cond.notify_all()

    def read_after(
        self, after_seq: int, max_events: int = 4096, timeout_s: float | None = None
    ) -> list[NodeEvent] | None:
        """Events with seq > after_seq (waiting up to ``timeout_s`` for some), or None when some
        of them are no longer in the ring (the caller must resync)."""
        with self._cond:
            if self.last_seq <= after_seq and timeout_s:
                self._cond.wait_for(lambda: self.last_seq > after_seq or self._stopped, timeout_s)
            first = self._ring[0].seq if self._ring else self.last_seq + 1
            if after_seq + 1 < first or after_seq < self.lost_through:
                return None
            count = self.last_seq - after_seq
            if count <= 0:
                return []
            if count <= max_events:  # the common case: a subscriber near the tail
                newest = list(itertools.islice(reversed(self._ring), count))
                newest.reverse()
                return newest
            start = after_seq + 1 - first
            return list(itertools.islice(self._ring, start, start + max_events))

    def snapshot(self) -> tuple[int, list[tuple[BlockKey, Tier]]]:
        """Every stored key and the seq it is current to. Events logged while the snapshot is
        taken may be delivered again afterwards; applying STORED/EVICTED in order is idempotent."""
        with self._cond:
            self.pump()
            seq = self.last_seq
            items: list[tuple[BlockKey, Tier]] = []
            for store in self._stores:
                items.extend(store.snapshot()[1])
            return seq, items

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._wake.set()
