"""Eviction policies: O(1) per operation over fixed-capacity slot ids.

A policy orders only *evictable* slots (committed and unpinned). The store removes a slot while it
is pinned and inserts it back on unpin, so ``pop_victim`` never sees a pinned block and never scans.
Links live in preallocated ``array`` buffers (intrusive doubly linked lists with sentinels, as in
vLLM's ``FreeKVCacheBlockQueue``): no Python objects are allocated per operation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from typing import Callable, Sequence

import numpy as np

from .errors import InvalidArgument

_lru_touch: Callable[..., None] | None
try:
    from ._native import lru_touch as _lru_touch
except ImportError:  # pragma: no cover - depends on the build
    _lru_touch = None


class EvictionPolicy(ABC):
    name: str

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def insert(self, slot: int, fresh: bool = True) -> None:
        """Make ``slot`` evictable. ``fresh``: a new block (reset its history)."""

    @abstractmethod
    def touch(self, slot: int) -> None:
        """Record an access to ``slot`` (evictable or not)."""

    def touch_many(self, slots: Sequence[int]) -> None:
        """Record an access to each of ``slots``, a prefix in chain order (root first)."""
        touch = self.touch
        for slot in slots:
            touch(slot)

    def insert_many(self, slots: Sequence[int], fresh: bool = True) -> None:
        """``insert`` each of ``slots``, given in chain order (root first)."""
        for slot in slots:
            self.insert(slot, fresh)

    def attach_tree(self, tkids: array[int]) -> None:
        """The tier's per-slot count of children in the tier (``tree.PrefixTree.tkids``), for
        policies that order by the prefix tree; others ignore it."""

    wants_tree = False  # whether the store must keep the prefix tree for this policy

    @abstractmethod
    def remove(self, slot: int) -> None:
        """Stop considering ``slot`` for eviction (pinned or removed). No-op if absent."""

    def forget(self, slot: int) -> None:
        """A different block now occupies ``slot`` (not evictable yet): drop the old history."""

    @abstractmethod
    def pop_victim(self) -> int | None:
        """Remove and return the next slot to evict, or None when nothing is evictable."""

    @abstractmethod
    def order(self) -> list[int]:
        """Evictable slots, next victim first (O(n): a drain's plan, tests)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of evictable slots."""

    @abstractmethod
    def __contains__(self, slot: int) -> bool: ...


class _LinkedSlots:
    """Intrusive doubly linked lists over slot ids plus ``num_lists`` sentinels."""

    def __init__(self, capacity: int, num_lists: int) -> None:
        n = capacity + num_lists
        self.prev = array("i", [-1]) * n
        self.next = array("i", [-1]) * n
        for s in range(capacity, n):
            self.prev[s] = s
            self.next[s] = s

    def link_tail(self, sentinel: int, slot: int) -> None:
        prev, nxt = self.prev, self.next
        tail = prev[sentinel]
        prev[slot] = tail
        nxt[slot] = sentinel
        nxt[tail] = slot
        prev[sentinel] = slot

    def unlink(self, slot: int) -> None:
        prev, nxt = self.prev, self.next
        p, n = prev[slot], nxt[slot]
        nxt[p] = n
        prev[n] = p
        prev[slot] = -1
        nxt[slot] = -1

    def linked(self, slot: int) -> bool:
        return self.prev[slot] != -1


class LRUPolicy(EvictionPolicy):
    """Least recently used first; an unpinned block counts as just used."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._lists = _LinkedSlots(capacity, 1)
        self._head = capacity
        self._len = 0

    def insert(self, slot: int, fresh: bool = True) -> None:
        assert not self._lists.linked(slot), f"slot {slot} already evictable"
        self._lists.link_tail(self._head, slot)
        self._len += 1

    def touch(self, slot: int) -> None:
        self._touch_py((slot,))

    def touch_many(self, slots: Sequence[int]) -> None:
        if _lru_touch is not None:  # one C loop over the same arrays (kvstore/_native.c)
            buf = slots if isinstance(slots, np.ndarray) else np.asarray(slots, dtype=np.int32)
            _lru_touch(self._lists.prev, self._lists.next, self._head, buf.astype(np.int32))
            return
        self._touch_py(slots)

    def _touch_py(self, slots: Sequence[int]) -> None:
        # NOTE: unlink + link_tail inlined: this ran once per hit block of every lookup.
        prev, nxt, head = self._lists.prev, self._lists.next, self._head
        for slot in slots:
            p = prev[slot]
            if p == -1:
                continue  # pinned: not evictable, nothing to reorder
            n = nxt[slot]
            if n == head:
                continue  # already the most recent
            nxt[p] = n
            prev[n] = p
            tail = prev[head]
            prev[slot] = tail
            nxt[slot] = head
            nxt[tail] = slot
            prev[head] = slot

    def remove(self, slot: int) -> None:
        if self._lists.linked(slot):
            self._lists.unlink(slot)
            self._len -= 1

    def pop_victim(self) -> int | None:
        if not self._len:
            return None
        slot = self._lists.next[self._head]
        self._lists.unlink(slot)
        self._len -= 1
        return slot

    def order(self) -> list[int]:
        """Evictable slots, next victim first (O(n): a drain's plan, tests)."""
        out, nxt, s = [], self._lists.next, self._lists.next[self._head]
        while s != self._head:
            out.append(s)
            s = nxt[s]
        return out

    def __len__(self) -> int:
        return self._len

    def __contains__(self, slot: int) -> bool:
        return self._lists.linked(slot)


class LFUPolicy(EvictionPolicy):
    """Least frequently used first, least recently used among equals.

    Access counts saturate at ``max_count`` (like Redis' 8-bit LFU counter) so that the buckets
    are a fixed set of lists; the lowest non-empty bucket is found with one bit trick on a mask,
    which keeps every operation O(1) even when pins take slots out of the middle of a bucket.
    """

    name = "lfu"

    def __init__(self, capacity: int, max_count: int = 255) -> None:
        super().__init__(capacity)
        self.max_count = max_count
        self._lists = _LinkedSlots(capacity, max_count + 1)
        self._count = array("H", [0]) * capacity
        self._mask = 0  # bit f set <=> bucket f holds an evictable slot
        self._len = 0

    def _sentinel(self, count: int) -> int:
        return self.capacity + count

    def _link(self, slot: int) -> None:
        c = self._count[slot]
        self._lists.link_tail(self._sentinel(c), slot)
        self._mask |= 1 << c

    def _unlink(self, slot: int) -> None:
        c = self._count[slot]
        self._lists.unlink(slot)
        s = self._sentinel(c)
        if self._lists.next[s] == s:
            self._mask &= ~(1 << c)

    def insert(self, slot: int, fresh: bool = True) -> None:
        assert not self._lists.linked(slot), f"slot {slot} already evictable"
        if fresh or not self._count[slot]:
            self._count[slot] = 1
        self._link(slot)
        self._len += 1

    def touch(self, slot: int) -> None:
        linked = self._lists.linked(slot)
        if linked:
            self._unlink(slot)
        if self._count[slot] < self.max_count:
            self._count[slot] += 1
        if linked:
            self._link(slot)

    def remove(self, slot: int) -> None:
        if self._lists.linked(slot):
            self._unlink(slot)
            self._len -= 1

    def forget(self, slot: int) -> None:
        assert not self._lists.linked(slot), f"slot {slot} is evictable; remove it first"
        self._count[slot] = 0  # the next insert(fresh=False) starts it at 1

    def pop_victim(self) -> int | None:
        if not self._mask:
            return None
        c = (self._mask & -self._mask).bit_length() - 1
        slot = self._lists.next[self._sentinel(c)]
        self._unlink(slot)
        self._len -= 1
        return slot

    def count(self, slot: int) -> int:
        return self._count[slot]

    def order(self) -> list[int]:
        """Evictable slots, next victim first (O(n): a drain's plan, tests)."""
        out = []
        nxt = self._lists.next
        for c in range(self.max_count + 1):
            sent = self._sentinel(c)
            s = nxt[sent]
            while s != sent:
                out.append(s)
                s = nxt[s]
        return out

    def __len__(self) -> int:
        return self._len

    def __contains__(self, slot: int) -> bool:
        return self._lists.linked(slot)


class PrefixPolicy(LRUPolicy):
    """Leaves first: a block goes before its parent; among leaves, least recently used first.

    Keys are chained, so a block is useless once its parent is gone, and LRU evicts a hot head
    before its cold tail (a prefix is touched root first, which leaves the root least recent).
    This policy touches and inserts a prefix deepest block first, so that a parent is more recent
    than its children, and ``pop_victim`` passes over blocks that still have children in the
    tier (``tkids``, kept by the store's ``tree.PrefixTree``, which also drops the descendants
    of a block that leaves the store). Every operation is O(1): the reverse-order touches keep
    the least recent blocks leaves, so a victim is found at once but where a writer stored a
    block's children without touching the block; past ``max_skip`` such blocks the least
    recent one goes anyway (its children become orphans and are dropped).
    """

    name = "prefix"
    wants_tree = True
    max_skip = 64

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._tkids: array[int] = array("i", [0]) * capacity

    def attach_tree(self, tkids: array[int]) -> None:
        assert len(tkids) == self.capacity
        self._tkids = tkids

    def touch_many(self, slots: Sequence[int]) -> None:
        super().touch_many(slots[::-1])

    def insert_many(self, slots: Sequence[int], fresh: bool = True) -> None:
        super().insert_many(slots[::-1], fresh)

    def pop_victim(self) -> int | None:
        if not self._len:
            return None
        nxt, tkids, head = self._lists.next, self._tkids, self._head
        slot = nxt[head]
        for _ in range(self.max_skip):
            if not tkids[slot]:
                break
            s = nxt[slot]
            if s == head:  # every evictable block has children here: take the least recent
                slot = nxt[head]
                break
            slot = s
        else:
            if tkids[slot]:
                slot = nxt[head]
        self._lists.unlink(slot)
        self._len -= 1
        return slot


POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "prefix": PrefixPolicy,
}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    try:
        cls = POLICIES[name.lower()]
    except KeyError:
        raise InvalidArgument(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
    return cls(capacity)
