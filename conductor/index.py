"""The global block index: block key -> which nodes hold it, in which tier.

Layout (memory first: 1M keys held by 32 nodes must fit in a few hundred MB):
- Each node is interned to a small integer **slot**; a key maps to ONE Python int packing a 2-bit
  tier code per slot (bits ``2s, 2s+1``): 0 absent, 1 GPU, 2 DRAM, 3 SSD (= proto ``Tier``,
  = ``kvstore.Tier + 1``). No per-key dicts or sets: ~160 bytes per key all told (measured by
  ``kvcache bench conductor``).
- Longest prefix per node walks the request's keys once, AND-ing a bitmask of the nodes still
  matching; it stops at the first key no remaining node holds. O(prefix length), one dict lookup
  and a few int operations per key, independent of the number of indexed keys.

Feeds: every node's events carry node-wide consecutive sequence numbers. ``apply_*`` raises
``SequenceGap`` when one is missing (the caller then resyncs from a snapshot); replays of events
already applied are skipped, so reconnecting with ``after_seq`` is idempotent.

Dropping a node is O(1): its slot is *retired* (masked out of every query at once) and its bits
are cleared later by ``sweep`` in bounded chunks, after which the slot is reused. A resync loads
the snapshot into a fresh *shadow* slot while the old one keeps answering, then swaps them.

Not thread-safe: the owner (``conductor.core.Conductor``) serialises calls with one lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Any, Iterable, Sequence

from kvstore.errors import FailedPrecondition, NotFound, echo
from kvstore.tiers import Tier

_STORED = 1  # == kvstore.EventKind.STORED == proto EVENT_STORED
_EVICTED = 2
_SWEEP_CHUNK = 65536


class SequenceGap(FailedPrecondition):
    """Events from a node skipped a sequence number: its index entries must be resynced."""

    def __init__(self, node_id: str, expected: int, got: int) -> None:
        super().__init__(
            f"node {echo(node_id)}: event seq {got} arrived, expected {expected}; "
            f"{got - expected} event(s) lost, resync from a snapshot"
        )
        self.node_id, self.expected, self.got = node_id, expected, got


@dataclass(slots=True)
class _Feed:
    slot: int
    last_seq: int = 0
    shadow: int = -1  # slot being filled by a resync snapshot, -1 when none
    shadow_blocks: int = 0


@dataclass(frozen=True, slots=True)
class IndexStats:
    keys: int  # distinct keys in the map (retired-only keys until swept)
    nodes: int
    slots: int  # slots ever allocated (live + shadow + retired + free)
    retired_slots: int  # waiting for a sweep
    blocks: dict[str, int]  # indexed blocks per node


class GlobalIndex:
    """Block key -> {node: tier}, fed by per-node event streams with sequence numbers."""

    def __init__(self) -> None:
        self._map: dict[bytes, int] = {}
        self._feeds: dict[str, _Feed] = {}
        self._node_of_slot: list[str | None] = []
        self._blocks_of_slot: list[int] = []
        self._free_slots: list[int] = []
        self._live_low = 0  # bit 2s set for each slot visible to queries
        self._retired = 0  # both bits set for each slot waiting for a sweep
        self._sweep_keys: list[bytes] | None = None
        self._sweep_pos = 0
        self._sweep_clear = 0  # bits the running sweep clears

    # ---- nodes ----------------------------------------------------------------------------

    def add_node(self, node_id: str) -> None:
        """Start indexing ``node_id`` with nothing held and ``last_seq = 0``. A node already
        present is reset (its old entries vanish from queries at once)."""
        if node_id in self._feeds:
            self.drop_node(node_id)
        slot = self._new_slot(node_id)
        self._feeds[node_id] = _Feed(slot=slot)
        self._live_low |= 1 << (2 * slot)

    def drop_node(self, node_id: str) -> bool:
        """Forget ``node_id``: O(1); its bits are cleared by later sweeps. False if unknown."""
        feed = self._feeds.pop(node_id, None)
        if feed is None:
            return False
        self._live_low &= ~(1 << (2 * feed.slot))
        self._retire(feed.slot)
        if feed.shadow >= 0:
            self._retire(feed.shadow)
        return True

    def has_node(self, node_id: str) -> bool:
        return node_id in self._feeds

    def last_seq(self, node_id: str) -> int:
        return self._feed(node_id).last_seq

    def blocks(self, node_id: str) -> int:
        """Blocks indexed for ``node_id`` (O(1))."""
        return self._blocks_of_slot[self._feed(node_id).slot]

    def __len__(self) -> int:
        return len(self._map)

    # ---- events ---------------------------------------------------------------------------

    def apply_events(self, node_id: str, events: Iterable[Any]) -> int:
        """Apply ``kvstore.BlockEvent``-like events (``seq``, ``kind``, ``key``, ``tier`` as a
        ``kvstore.Tier``). Returns how many were applied; raises ``SequenceGap``."""
        return self._apply(node_id, ((e.seq, e.kind, e.key, int(e.tier) + 1) for e in events))

    def apply_proto(self, node_id: str, events: Iterable[Any]) -> int:
        """Apply ``proto.common_pb2.BlockEvent`` messages (tier already encoded 1..3)."""
        return self._apply(node_id, ((e.seq, e.kind, e.key, e.tier) for e in events))

    def _apply(self, node_id: str, events: Iterable[tuple[int, int, bytes, int]]) -> int:
        feed = self._feed(node_id)
        if feed.shadow >= 0:
            raise FailedPrecondition(
                f"node {echo(node_id)} is resyncing: finish the snapshot first"
            )
        shift = 2 * feed.slot
        clear = ~(3 << shift)
        m = self._map
        last = feed.last_seq
        blocks = 0
        applied = 0
        try:
            for seq, kind, key, code in events:
                if seq <= last:
                    continue  # a replay after reconnecting: already applied
                if seq != last + 1:
                    raise SequenceGap(node_id, last + 1, seq)
                old = m.get(key, 0)
                had = (old >> shift) & 3
                if kind == _STORED:
                    if not 1 <= code <= 3:
                        raise ValueError(f"node {echo(node_id)}: stored event {seq} has no tier")
                    m[key] = (old & clear) | (code << shift)
                    blocks += not had
                elif kind == _EVICTED:
                    if had:
                        new = old & clear
                        if new:
                            m[key] = new
                        else:
                            del m[key]
                        blocks -= 1
                else:
                    raise ValueError(f"node {echo(node_id)}: event {seq} has unknown kind {kind}")
                last = seq
                applied += 1
        finally:
            feed.last_seq = last
            self._blocks_of_slot[feed.slot] += blocks
        return applied

    # ---- resync ---------------------------------------------------------------------------

    def begin_resync(self, node_id: str) -> None:
        """Start loading a full snapshot for ``node_id`` into a shadow slot; queries keep
        seeing the old entries until ``finish_resync``. Restarting a resync discards the
        partial shadow."""
        feed = self._feed(node_id)
        if feed.shadow >= 0:
            self._retire(feed.shadow)
        feed.shadow = self._new_slot(node_id)
        feed.shadow_blocks = 0

    def load_snapshot(self, node_id: str, items: Iterable[tuple[bytes, int]]) -> int:
        """Add ``(key, tier_code)`` pairs (code 1..3 as in proto ``Tier``) to the shadow."""
        feed = self._feed(node_id)
        if feed.shadow < 0:
            raise FailedPrecondition(f"node {echo(node_id)}: load_snapshot before begin_resync")
        shift = 2 * feed.shadow
        clear = ~(3 << shift)
        m = self._map
        added = 0
        for key, code in items:
            if not 1 <= code <= 3:
                raise ValueError(f"node {echo(node_id)}: snapshot entry without a tier")
            old = m.get(key, 0)
            added += not (old >> shift) & 3
            m[key] = (old & clear) | (code << shift)
        feed.shadow_blocks += added
        self._blocks_of_slot[feed.shadow] += added
        return added

    def finish_resync(self, node_id: str, snapshot_seq: int) -> None:
        """Make the shadow live (the old slot is retired); live events continue after
        ``snapshot_seq``."""
        feed = self._feed(node_id)
        if feed.shadow < 0:
            raise FailedPrecondition(f"node {echo(node_id)}: finish_resync before begin_resync")
        old = feed.slot
        feed.slot, feed.shadow = feed.shadow, -1
        feed.last_seq = snapshot_seq
        self._live_low = (self._live_low & ~(1 << (2 * old))) | (1 << (2 * feed.slot))
        self._retire(old)

    def is_resyncing(self, node_id: str) -> bool:
        return self._feed(node_id).shadow >= 0

    # ---- queries --------------------------------------------------------------------------

    def prefix_lengths(self, keys: Sequence[bytes]) -> dict[str, int]:
        """For every node holding at least the first key: how many leading ``keys`` it holds
        (in any tier). O(len of the longest held prefix)."""
        alive = self._live_low
        node_of = self._node_of_slot
        out: dict[str, int] = {}
        i = 0
        last = -1
        for i, v in enumerate(map(self._map.get, keys, repeat(0))):
            if v == last:
                continue  # NOTE: a chain's blocks mostly sit alike on the same nodes: same value
            last = v
            held = (v | (v >> 1)) & alive
            if held != alive:
                # NOTE: most nodes lack the first key: they leave at i == 0 with nothing to name.
                gone = alive & ~held if i else 0
                while gone:
                    low = gone & -gone
                    out[node_of[(low.bit_length() - 1) >> 1]] = i  # type: ignore[index]
                    gone ^= low
                alive = held
                if not alive:
                    break
        else:
            i = len(keys)
        if i:
            while alive:
                low = alive & -alive
                out[node_of[(low.bit_length() - 1) >> 1]] = i  # type: ignore[index]
                alive ^= low
        return out

    def holders(self, key: bytes) -> dict[str, Tier]:
        """Nodes holding ``key`` and the tier each holds it in."""
        v = self._map.get(key, 0)
        out = {}
        for node_id, feed in self._feeds.items():
            code = (v >> (2 * feed.slot)) & 3
            if code:
                out[node_id] = Tier(code - 1)
        return out

    def tiers(self, node_id: str, keys: Sequence[bytes]) -> list[Tier | None]:
        """The tier ``node_id`` holds each key in (None: not held)."""
        shift = 2 * self._feed(node_id).slot
        get = self._map.get
        return [Tier(c - 1) if (c := (get(k, 0) >> shift) & 3) else None for k in keys]

    def stats(self) -> IndexStats:
        retired = bin(self._retired).count("1") // 2
        return IndexStats(
            keys=len(self._map),
            nodes=len(self._feeds),
            slots=len(self._node_of_slot),
            retired_slots=retired,
            blocks={n: self._blocks_of_slot[f.slot] for n, f in self._feeds.items()},
        )

    # ---- slots and sweeping ---------------------------------------------------------------

    def sweep(self, max_keys: int | None = None) -> bool:
        """Clear retired slots' bits, visiting at most ``max_keys`` keys (None: finish).
        Returns True when nothing is left to sweep. Slots become reusable once swept."""
        budget = max_keys if max_keys is not None else 1 << 62
        while budget > 0:
            if self._sweep_keys is None:
                if not self._retired:
                    return True
                self._sweep_keys = list(self._map)
                self._sweep_pos = 0
                self._sweep_clear = self._retired
                self._retired = 0
            keys, pos = self._sweep_keys, self._sweep_pos
            end = min(len(keys), pos + min(budget, _SWEEP_CHUNK))
            clear = self._sweep_clear
            keep = ~clear
            m = self._map
            for key in keys[pos:end]:
                v = m.get(key)
                if v is not None and v & clear:
                    v &= keep
                    if v:
                        m[key] = v
                    else:
                        del m[key]
            budget -= end - pos
            self._sweep_pos = end
            if end == len(keys):
                self._finish_sweep()
        return self._sweep_keys is None and not self._retired

    def _finish_sweep(self) -> None:
        clear = self._sweep_clear
        for slot in range(len(self._node_of_slot)):
            if (clear >> (2 * slot)) & 3:
                self._free_slots.append(slot)
        self._sweep_keys, self._sweep_pos, self._sweep_clear = None, 0, 0

    def _retire(self, slot: int) -> None:
        self._node_of_slot[slot] = None
        if self._blocks_of_slot[slot] == 0:
            self._free_slots.append(slot)  # no key has its bits: reusable at once
            return
        self._blocks_of_slot[slot] = 0
        self._retired |= 3 << (2 * slot)

    def _new_slot(self, node_id: str) -> int:
        if self._free_slots:
            slot = min(self._free_slots)  # low slots keep the packed ints small
            self._free_slots.remove(slot)
            self._node_of_slot[slot] = node_id
            self._blocks_of_slot[slot] = 0
            return slot
        self._node_of_slot.append(node_id)
        self._blocks_of_slot.append(0)
        return len(self._node_of_slot) - 1

    def _feed(self, node_id: str) -> _Feed:
        feed = self._feeds.get(node_id)
        if feed is None:
            raise NotFound(
                f"node {echo(node_id)} is not indexed (not registered, or its lease lapsed)"
            )
        return feed
