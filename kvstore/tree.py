"""Parent / child links between cached blocks, for prefix-aware eviction.

Keys are chained: a block can only be hit through its parent, so a block whose parent left the
store is dead weight. ``PrefixTree`` links every block (by handle, ``slot << 2 | tier``) to its
parent and its children, in flat per-slot arrays of each tier:

- ``parent``: the parent's handle (-1: none known: the first block of a chain, or a block whose
  writer did not name its predecessor);
- ``first`` / ``nsib`` / ``psib``: the children as a doubly linked sibling list, so a block that
  moves between tiers re-links in O(its children) and one that leaves detaches in O(1);
- ``tkids``: how many children sit in the block's own tier; ``kids``: how many in all. The
  ``prefix`` policy evicts a block only when it has none (a leaf): none in its tier where
  eviction demotes (the block stays reachable one tier down), none at all in the last tier,
  where eviction drops. So tails go before their heads.

The store calls ``link`` when a block is published, ``move`` when it changes tier or slot, and
``detach`` when it leaves the store; ``detach`` returns the orphaned descendants, which the store
drops too, but for pinned ones: a reader holds them, they stay cached (as roots of their own
subtrees). Parents come from the order of a write lease's keys: key i's parent is key i - 1.
"""

from __future__ import annotations

from array import array
from typing import Callable

Handle = int


class PrefixTree:
    def __init__(self, capacities: list[int]) -> None:
        """``capacities``: pages per tier, by tier number (0: the tier is absent)."""

        def ints(n: int, fill: int) -> array[int]:
            return array("i", [fill]) * n

        self.parent = [ints(n, -1) for n in capacities]
        self.first = [ints(n, -1) for n in capacities]
        self.nsib = [ints(n, -1) for n in capacities]
        self.psib = [ints(n, -1) for n in capacities]
        self.tkids = [ints(n, 0) for n in capacities]
        self.kids = [ints(n, 0) for n in capacities]

    def link(self, h: Handle, parent: Handle) -> None:
        """``h`` (new, unlinked) is a child of ``parent`` (-1: no known parent)."""
        if parent < 0:
            return
        t, s, pt, ps = h & 3, h >> 2, parent & 3, parent >> 2
        self.parent[t][s] = parent
        head = self.first[pt][ps]
        self.nsib[t][s] = head
        self.psib[t][s] = -1
        if head >= 0:
            self.psib[head & 3][head >> 2] = h
        self.first[pt][ps] = h
        self.kids[pt][ps] += 1
        if pt == t:
            self.tkids[pt][ps] += 1

    def unlink(self, h: Handle) -> Handle:
        """Take ``h`` out of its parent's children (it keeps its own); returns the parent."""
        p = self.parent[h & 3][h >> 2]
        self._unlink(h)
        return p

    def _unlink(self, h: Handle) -> None:
        """Take ``h`` out of its parent's children."""
        t, s = h & 3, h >> 2
        p = self.parent[t][s]
        if p < 0:
            return
        prev, nxt = self.psib[t][s], self.nsib[t][s]
        if prev >= 0:
            self.nsib[prev & 3][prev >> 2] = nxt
        else:
            self.first[p & 3][p >> 2] = nxt
        if nxt >= 0:
            self.psib[nxt & 3][nxt >> 2] = prev
        self.kids[p & 3][p >> 2] -= 1
        if p & 3 == t:
            self.tkids[t][p >> 2] -= 1
        self.parent[t][s] = self.nsib[t][s] = self.psib[t][s] = -1

    def move(self, old: Handle, new: Handle, parent: Handle | None = None) -> None:
        """The block at ``old`` now lives at ``new`` (another tier or slot). ``parent``: its
        parent, where ``unlink`` took it out already."""
        ot, os_, nt, ns = old & 3, old >> 2, new & 3, new >> 2
        p = self.parent[ot][os_] if parent is None else parent
        self._unlink(old)
        self.link(new, p)
        # Its children follow: their parent is the new handle; count those in the new tier.
        c = self.first[ot][os_]
        self.first[nt][ns] = c
        self.first[ot][os_] = -1
        self.kids[nt][ns] = self.kids[ot][os_]
        self.kids[ot][os_] = 0
        self.tkids[ot][os_] = 0
        here = 0
        while c >= 0:
            self.parent[c & 3][c >> 2] = new
            here += c & 3 == nt
            c = self.nsib[c & 3][c >> 2]
        self.tkids[nt][ns] = here

    def detach(self, h: Handle, keep: Callable[[Handle], bool]) -> list[Handle]:
        """``h`` leaves the store: unlink it and its descendants; returns the descendants to
        drop, each unlinked. A descendant ``keep`` says to keep (pinned) becomes a root instead,
        with its own subtree left in place."""
        self._unlink(h)
        orphans: list[Handle] = []
        stack = [h]
        while stack:
            x = stack.pop()
            c = self.first[x & 3][x >> 2]
            while c >= 0:
                nxt = self.nsib[c & 3][c >> 2]
                self._unlink(c)
                if not keep(c):
                    orphans.append(c)
                    stack.append(c)
                c = nxt
        return orphans

    def children(self, h: Handle) -> list[Handle]:
        out, c = [], self.first[h & 3][h >> 2]
        while c >= 0:
            out.append(c)
            c = self.nsib[c & 3][c >> 2]
        return out
