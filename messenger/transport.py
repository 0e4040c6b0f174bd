"""The transport interface: move pages named by keys from a peer's memory into local page views.

Both ends are abstract here:
- the **destination** calls ``Transport.fetch(peer, namespace, keys, views)``: one writable view
  per key (a page leased on the destination node), filled in place, and gets one ``EntryResult``
  per key. A transport never commits anything; the caller commits only entries that came back
  ``ok``. ``fetch_groups`` is the pipelined form: the caller hands out groups of pages as the
  transport asks for them (allocating each group's pages then) and is told when each group is
  final (so it commits it while later groups are still on the wire).
- the **source** serves pages from a ``PageSource``: pin a batch of keys, hand out read-only views
  (and offsets in its registered region, for RDMA), release when done.

TCP (``tcp.py``) and RDMA (``rdma.py``) implement the same interface; the messenger does not care
which one moved the bytes.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .identity import Identity


class Outcome(enum.Enum):
    """Per-entry result of a transfer; the names map to gRPC status codes in the service."""

    OK = "ok"
    NOT_FOUND = "not_found"  # the source does not hold the key
    DATA_LOSS = "data_loss"  # checksum mismatch: the bytes were corrupted in flight
    UNAVAILABLE = "unavailable"  # connection failed or cut, source could not pin
    INVALID = "invalid"  # namespace / page size mismatch, bad request
    RESOURCE_EXHAUSTED = "resource_exhausted"  # destination has no room
    CANCELLED = "cancelled"
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class EntryResult:
    outcome: Outcome
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


OK = EntryResult(Outcome.OK)


@dataclass(slots=True, eq=False)
class FetchGroup:
    """Pages fetched together and then published together (one write lease on the destination):
    ``views[i]`` receives the page of ``keys[i]``. ``tag`` is the caller's.

    A group handed out before its pages are allocated has no views yet but ``settle``, which
    waits for them and returns one view per key, None for a key no longer wanted (the
    destination holds it, or could not allocate it). A transport may ask the source for the
    keys first (so the source pins while the destination allocates) and must ``resolve`` the
    group before any page moves."""

    keys: list[bytes]
    views: list[memoryview] | None
    tag: Any = None
    settle: Callable[[], list[memoryview | None]] | None = None
    # Set by a transport that checked each page whole, as it landed in its view, against the
    # source's xxh3-64: that value per key (0 where a page failed). The caller's node can keep
    # them instead of hashing the pages again at commit. None: not known.
    checksums: list[int] | None = None
    # Whom the pages are pulled for (the source checks it, identity.py); None: named by no one
    # (a pull of a cluster without tokens, tests and benchmarks). ``keys`` are as it names them.
    identity: Identity | None = None
    # The mapping ``views`` point into (flat uint8): RDMA registers it when it is not yet (a
    # restarted node's new segment). None: memory declared with ``register_local``.
    region: np.ndarray | None = None

    def resolve(self) -> list[bool]:
        """Settle a group handed out early: keeps only the wanted keys (and their views);
        returns, per key it had, whether it is wanted."""
        if self.settle is None:
            return [True] * len(self.keys)
        views = self.settle()  # sets ``region`` too
        wanted = [v is not None for v in views]
        self.keys = [k for k, w in zip(self.keys, wanted) if w]
        self.views = [v for v in views if v is not None]
        self.settle = None
        return wanted


class Transport(ABC):
    """Pulls pages from peers. Thread-safe: several fetches may run at once."""

    name: str

    @abstractmethod
    def fetch(
        self,
        peer: str,
        namespace: str,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        identity: Identity | None = None,
    ) -> list[EntryResult]:
        """Fill ``views[i]`` with the page of ``keys[i]`` held by ``peer`` (its data address,
        ``host:port``), pulled for ``identity`` (``FetchGroup.identity``). Every view has the
        namespace's page size. Never raises for per-entry or connection failures: they come
        back as results."""

    def fetch_groups(
        self,
        peer: str,
        namespace: str,
        page_bytes: int,
        pages: int,
        groups: Iterator[FetchGroup],
        done: Callable[[FetchGroup, list[EntryResult]], None],
    ) -> EntryResult | None:
        """Fetch every group ``groups`` yields (``pages`` in all, each ``page_bytes``) and call
        ``done(group, results)`` once per group, as soon as its results are final. ``groups`` is
        advanced only when the transport is ready for one more group (so the caller allocates a
        group's pages late), from one thread at a time; ``done`` may be called from any thread
        and groups may finish out of order. Never raises for per-entry or connection failures.

        A group left with no keys once resolved is not reported (the caller settled it). A
        transport that stops taking groups (the peer is gone) returns why: the failure of every
        group it did not take.

        This default fetches one group after the other; ``group_pages`` says how big the
        transport wants groups to be."""
        for group in groups:
            group.resolve()
            if group.keys:
                done(group, self.fetch_group(peer, namespace, group))
        return None

    def fetch_group(self, peer: str, namespace: str, group: FetchGroup) -> list[EntryResult]:
        """``fetch`` of one resolved group for the default ``fetch_groups``; a transport that
        verifies each page whole against the source's checksum sets ``group.checksums``."""
        assert group.views is not None
        return self.fetch(peer, namespace, group.keys, group.views, group.identity)

    def group_pages(self, page_bytes: int) -> int:
        """Pages per group for ``fetch_groups``: the unit a transport moves (and a caller
        commits) at a time."""
        return max(1, (64 << 20) // page_bytes)

    def register_local(self, region: np.ndarray, namespace: str | None = None) -> None:
        """Declare memory that views will point into (RDMA registers it; TCP ignores it):
        ``namespace``'s mapping on the node (replaced by a group's ``region`` once the node
        restarted), or, without one, memory kept registered until ``close``."""

    @abstractmethod
    def close(self) -> None:
        """Close connections and free resources."""


@dataclass(slots=True)
class PinnedPages:
    """A batch of pages pinned on the source. ``views[i]`` is None when ``keys[i]`` is absent."""

    views: list[memoryview | None]
    offsets: list[int]  # byte offset of each page in ``region``; -1: absent
    release: Callable[[], None]
    # The node's xxh3-64 of each page as committed (0, or none at all: not known). A server
    # checks the page against it while it checksums the page for the wire (one pass), and
    # sends a page that changed since its commit as missing, never as good bytes.
    checksums: list[int] = field(default_factory=list)
    # Told the indices of pages that failed their checksum (the node drops them).
    drop: Callable[[list[int]], None] | None = None
    # The mapping the offsets point into (flat uint8): a restarted node's pins live in its new
    # segment. None: ``PageSource.region`` of the namespace.
    region: np.ndarray | None = None

    def expected(self, index: int) -> int:
        return self.checksums[index] if index < len(self.checksums) else 0

    def corrupt(self, indices: list[int]) -> None:
        if indices and self.drop is not None:
            self.drop(indices)


class PageSource(ABC):
    """The source side: where the pages a peer asks for live."""

    @abstractmethod
    def page_bytes(self, namespace: str) -> int:
        """Page size of the namespace; raises ``LookupError`` for an unknown namespace."""

    @abstractmethod
    def pin(self, namespace: str, keys: list[bytes]) -> PinnedPages:
        """Pin the keys' pages so they cannot move until ``release``. Raises ``LookupError`` for
        an unknown namespace, ``ConnectionError`` when pages cannot be pinned right now."""

    def pool_pages(self, namespace: str) -> int:
        """Pages in the namespace's pool, which the pin budget is a share of (0: no budget)."""
        return 0

    def region(self, namespace: str) -> np.ndarray:
        """The whole memory region (flat uint8) the namespace's pages live in (for RDMA)."""
        raise LookupError(f"namespace {namespace!r} has no registrable region")


class SlabPageSource(PageSource):
    """Pages in one flat buffer addressed by a key -> slot map (tests and benchmarks).

    The node-backed source (``node_source.py``) is the real one; this one lets the transports be
    exercised with nothing but a numpy array or a ``SharedSlab``.
    """

    def __init__(
        self,
        namespace: str,
        region: np.ndarray,
        page_bytes: int,
        slots: dict[bytes, int] | None = None,
        pool_pages: int = 0,
    ) -> None:
        """``pool_pages``: the pool size the pin budget is a share of (0: no budget)."""
        assert region.dtype == np.uint8 and region.ndim == 1
        self.namespace = namespace
        self._region = region
        self._page_bytes = page_bytes
        self.slots: dict[bytes, int] = dict(slots or {})
        self.pins = 0  # outstanding pinned batches, for tests
        self._pool_pages = pool_pages

    def pool_pages(self, namespace: str) -> int:
        self._check(namespace)
        return self._pool_pages

    def page_bytes(self, namespace: str) -> int:
        self._check(namespace)
        return self._page_bytes

    def region(self, namespace: str) -> np.ndarray:
        self._check(namespace)
        return self._region

    def pin(self, namespace: str, keys: list[bytes]) -> PinnedPages:
        self._check(namespace)
        pb = self._page_bytes
        mv = memoryview(self._region)
        views: list[memoryview | None] = []
        offsets: list[int] = []
        for key in keys:
            slot = self.slots.get(key)
            if slot is None:
                views.append(None)
                offsets.append(-1)
            else:
                views.append(mv[slot * pb : (slot + 1) * pb])
                offsets.append(slot * pb)
        self.pins += 1

        def release() -> None:
            self.pins -= 1

        return PinnedPages(views, offsets, release, region=self._region)

    def _check(self, namespace: str) -> None:
        if namespace != self.namespace:
            raise LookupError(f"unknown namespace {namespace!r}")
