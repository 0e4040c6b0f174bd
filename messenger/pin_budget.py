"""How much of a namespace's DRAM pool the data port's peers may hold pinned at once.

A page pinned for a peer cannot be evicted; a peer that asks for pages and never reads the
response holds its pins until the FETCH deadline, and the node's writers get
RESOURCE_EXHAUSTED once every page is pinned. So the pages one connection, and one peer (all its
connections together), may hold pinned at once are bounded, as a share of the pool:

- per connection (``connection``, default 25%): a TCP connection pins one request at a time, and
  a request larger than the budget is served in chunks that fit (each pinned only while it is
  sent); an RDMA connection's unreleased leases count together;
- per peer (``peer``, default 50%): by host address; beyond it a request waits for the peer's
  other connections, up to its FETCH deadline. The data port's token is the cluster's one admin
  token, so an authenticated peer has no identity narrower than its address (and on a port with
  a token, a peer without HELLO is refused before anything is pinned).

Why these defaults: a destination messenger pins at most ``--workers`` (4) x ``--lanes`` (2)
requests of 64 MiB (one per connection) at once on one source, 512 MiB: within 50% of a node's
default 1 GiB pool, and one 64 MiB request within 25%, so the bounds never slow a legit pull with
the defaults (smaller pools: requests take turns, or go in chunks). Against any one peer, writers
keep half the pool to evict from.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .frames import Status
from .transport import PageSource, PinnedPages


class OverBudget(Exception):
    """No pages could be granted; the message says why and which flag sets the bound."""


@dataclass(frozen=True, kw_only=True)
class PinShares:
    """Shares of a namespace's DRAM pool (``kvcache messenger --pin-share-*``)."""

    connection: float = 0.25
    peer: float = 0.5

    def __post_init__(self) -> None:
        for name in ("connection", "peer"):
            share = getattr(self, name)
            if not 0 < share <= 1:
                raise ValueError(f"{name} pin share must be in (0, 1], got {share}")


@dataclass(frozen=True, slots=True)
class Grant:
    """Pages reserved for one connection (and its peer) until ``PinBudget.give_back``."""

    namespace: str
    conn_id: int
    host: str
    pages: int


class PinBudget:
    """Reservations of pages against the per-connection and per-peer bounds. ``pool_pages``
    tells a namespace's DRAM pool size in pages (0: unknown, no bound)."""

    def __init__(self, shares: PinShares, pool_pages: Callable[[str], int]) -> None:
        self.shares = shares
        self._pool_pages = pool_pages
        self._cond = threading.Condition()
        self._conns: dict[tuple[str, int], int] = {}
        self._peers: dict[tuple[str, str], int] = {}
        self.pinned = 0  # pages reserved now, all namespaces
        self.waits = 0  # requests that waited for their peer's other connections
        self.refusals = 0  # requests refused (over budget at their deadline, or at once)

    def limits(self, namespace: str) -> tuple[int, int]:
        """(per connection, per peer) in pages; at least one page each."""
        pool = self._pool_pages(namespace)
        if pool <= 0:
            return sys.maxsize, sys.maxsize
        return (
            max(1, int(pool * self.shares.connection)),
            max(1, int(pool * self.shares.peer)),
        )

    def take(self, namespace: str, conn_id: int, host: str, want: int, until: float) -> Grant:
        """Reserve up to ``want`` pages, and at least a quarter of the per-connection budget
        (or ``want`` if less: no crawl of tiny chunks while the peer's budget is nearly used up);
        waits until ``until`` (monotonic) for the peer's other connections to release theirs.
        Raises ``OverBudget`` at once when this connection holds its whole budget itself (only
        it can release: waiting cannot help), or at the deadline."""
        conn_limit, peer_limit = self.limits(namespace)
        ckey, pkey = (namespace, conn_id), (namespace, host)
        waited = False
        with self._cond:
            while True:
                conn_room = conn_limit - self._conns.get(ckey, 0)
                peer_room = peer_limit - self._peers.get(pkey, 0)
                if conn_room <= 0:
                    self.refusals += 1
                    raise OverBudget(
                        f"this connection holds {conn_limit - conn_room} pinned pages of "
                        f"{namespace!r}, its budget ({self.shares.connection:g} of the pool, "
                        "--pin-share-per-connection); release some first"
                    )
                grant = min(want, conn_room, peer_room)
                if grant >= min(want, conn_room, max(1, conn_limit // 4)):
                    break
                left = until - time.monotonic()
                if left <= 0:
                    self.refusals += 1
                    raise OverBudget(
                        f"peer {host} holds {peer_limit - peer_room} pinned pages of "
                        f"{namespace!r} on its other connections, its budget "
                        f"({self.shares.peer:g} of the pool, --pin-share-per-peer), and none "
                        "were released in time"
                    )
                if not waited:
                    waited = True
                    self.waits += 1
                self._cond.wait(left)
            self._conns[ckey] = self._conns.get(ckey, 0) + grant
            self._peers[pkey] = self._peers.get(pkey, 0) + grant
            self.pinned += grant
        return Grant(namespace, conn_id, host, grant)

    def give_back(self, grant: Grant) -> None:
        with self._cond:
            _less(self._conns, (grant.namespace, grant.conn_id), grant.pages)
            _less(self._peers, (grant.namespace, grant.host), grant.pages)
            self.pinned -= grant.pages
            self._cond.notify_all()


def _less(held: dict, key: tuple, pages: int) -> None:
    left = held[key] - pages
    if left:
        held[key] = left
    else:
        del held[key]


@dataclass
class PinnedChunk:
    """Keys of a request pinned together (``pinned.views[j]``: the key at ``indices[j]``)."""

    indices: list[int]
    pinned: PinnedPages
    grant: Grant

    def release(self, budget: PinBudget) -> None:
        try:
            self.pinned.release()
        finally:
            budget.give_back(self.grant)


def pin_chunk(
    budget: PinBudget,
    source: PageSource,
    namespace: str,
    keys: list[bytes],
    todo: list[int],
    conn_id: int,
    host: str,
    until: float,
) -> tuple[PinnedChunk | None, tuple[Status, str] | None]:
    """The first keys of ``todo`` (indices into ``keys``) pinned on ``source``, as many as
    ``budget`` grants the connection by ``until``; or what to answer the peer instead."""
    try:
        grant = budget.take(namespace, conn_id, host, len(todo), until)
    except OverBudget as e:
        return None, (Status.UNAVAILABLE, f"source cannot pin pages now: {e}")
    except LookupError as e:
        return None, (Status.INVALID, str(e))
    except ConnectionError as e:
        return None, (Status.UNAVAILABLE, f"source cannot pin pages: {e}")
    indices = todo[: grant.pages]
    try:
        return PinnedChunk(indices, source.pin(namespace, [keys[i] for i in indices]), grant), None
    except LookupError as e:
        error = Status.INVALID, str(e)
    except ConnectionError as e:
        error = Status.UNAVAILABLE, f"source cannot pin pages: {e}"
    budget.give_back(grant)
    return None, error
