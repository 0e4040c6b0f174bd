"""One pull job of the messenger's (``messenger.mover``) as a pipeline of groups: each group's
pages allocated on this node one group ahead of the transport, fetched straight into the leased
pages, committed in the background as soon as every page landed verified (pinned with the
batch's ``hold_s``), the rest republished or aborted."""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Iterator

import grpc
import numpy as np

from clients.node_client import KVCacheRpcError, WriteLease

from .identity import Identity
from .transport import OK, EntryResult, FetchGroup, Outcome

if TYPE_CHECKING:
    from .mover import Mover, _Entry

log = logging.getLogger(__name__)

_CANCELLED = EntryResult(Outcome.CANCELLED, "the batch was cancelled")
RPC_OUTCOME = {  # a node's refusal of an Allocate, as the entries' outcome
    grpc.StatusCode.RESOURCE_EXHAUSTED: Outcome.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INVALID_ARGUMENT: Outcome.INVALID,
    grpc.StatusCode.NOT_FOUND: Outcome.NOT_FOUND,
}


class Pipeline:
    """One job as a pipeline of groups (the transport's ``group_pages`` each): a group's pages
    are allocated on this node one group ahead of the transport asking for it, and each group is
    committed as soon as it landed, while the next groups are on the wire. So the destination
    node's Allocate and Commit overlap the transfer instead of adding to it, and pages become
    visible group by group. A Commit carries the checksums the transport verified the pages
    against, so the node does not pass over every page again to take its own."""

    def __init__(
        self,
        mover: Mover,
        namespace: str,
        page_bytes: int,
        entries: list[_Entry],
        identity: Identity,
        chained: bool = False,
    ):
        self.mover, self.client = mover, mover.node.client
        self.identity = identity
        # A group's keys are linked as a chain on the node only when they are one (the batch
        # said so, and nothing was taken out of it); else no block is the parent of another
        # it was never the parent of, which prefix-aware eviction would drop with it.
        self.chained = chained
        self.namespace, self.page_bytes = namespace, page_bytes
        per = mover.transport.group_pages(page_bytes)
        self.chunks = [entries[s : s + per] for s in range(0, len(entries), per)]
        self.unavailable = False  # some page failed to arrive: the source may have moved
        self._lock = threading.Condition()
        self._open: dict[int, WriteLease] = {}  # handed to the transport, not back yet
        self._committing = 0
        self._groups: Iterator[FetchGroup] | None = None
        self._unsettled: list[FetchGroup] = []  # handed out before their pages were allocated

    # ---- the transport's side ------------------------------------------------------------------

    def groups(self) -> Iterator[FetchGroup]:
        self._groups = self._make_groups()
        return self._groups

    def _make_groups(self) -> Iterator[FetchGroup]:
        ahead: deque[tuple[list[_Entry], Future[WriteLease]]] = deque()
        chunks = iter(self.chunks)
        rpc = self.mover._rpc

        def allocate_next() -> None:
            for whole in chunks:
                chunk = self._live(whole)
                if chunk:
                    keys = [e.key for e in chunk]
                    ttl = self.mover.config.write_ttl_s
                    chained = self.chained and len(chunk) == len(whole)
                    pending = rpc.submit(
                        self.client.allocate, self.namespace, keys, ttl_s=ttl, chained=chained
                    )
                    ahead.append((chunk, pending))
                    return

        try:
            allocate_next()
            while ahead:
                chunk, pending = ahead.popleft()
                allocate_next()  # its Allocate runs while this group is fetched
                if not pending.done():
                    # Not allocated yet (the job's first group, mostly): handed out now, so the
                    # transport can have the source pin it while this node allocates.
                    yield self._early(chunk, pending)
                    continue
                group = self._group(chunk, pending)
                if group is not None:
                    yield group
        finally:
            for _, pending in ahead:  # allocated but never asked for: the fetch stopped early
                if pending.exception() is None:
                    self.mover._abort(pending.result())

    def _live(self, chunk: list[_Entry]) -> list[_Entry]:
        """The chunk's entries not cancelled meanwhile; the cancelled ones are resolved."""
        gone = {i: _CANCELLED for i, e in enumerate(chunk) if e.cancelled}
        if gone:
            self.mover._resolve(chunk, gone, self.page_bytes)
        return [e for e in chunk if not e.cancelled] if gone else chunk

    def _early(self, chunk: list[_Entry], pending: Future[WriteLease]) -> FetchGroup:
        """A group whose views come when the transport settles it (``FetchGroup.settle``)."""
        group = FetchGroup([e.name or e.key for e in chunk], None, identity=self.identity)

        def settle() -> list[memoryview | None]:
            ready = self._group(chunk, pending)
            views: list[memoryview | None] = [None] * len(chunk)
            if ready is not None:
                group.tag, group.region = ready.tag, ready.region
                assert ready.views is not None
                for i, view in zip(ready.tag[2], ready.views):
                    views[i] = view
            return views

        group.settle = settle
        with self._lock:
            self._unsettled.append(group)
        return group

    def _group(self, chunk: list[_Entry], pending: Future[WriteLease]) -> FetchGroup | None:
        try:
            lease = pending.result()
        except KVCacheRpcError as e:
            outcome = RPC_OUTCOME.get(e.code, Outcome.UNAVAILABLE)
            reason = f"destination node cannot allocate {len(chunk)} pages: {e.details}"
            failed = EntryResult(outcome, reason)
            self.mover._resolve(chunk, dict.fromkeys(range(len(chunk)), failed), self.page_bytes)
            return None
        # Keys the node holds already (offset -1) are done at once; nothing moves for them.
        present = {i for i, off in enumerate(lease.offsets) if off < 0}
        todo = [i for i in range(len(chunk)) if i not in present]
        hold = _hold(chunk)
        if not todo and hold:
            # Nothing to move, but a reader was promised them pinned (a group's Commit pins every
            # key of its lease, present ones too): this empty lease's Commit pins them, and they
            # are done once it answered (the batch's end tells the reader they are there).
            self._commit_present(lease, chunk, present, hold)
            return None
        if present:
            self.mover._resolve(chunk, dict.fromkeys(present, OK), self.page_bytes, present)
        if not todo:
            self.mover._abort(lease)
            return None
        # NOTE: views of the mapping the lease's offsets point into, not the node's current one:
        # after a restart they differ, and the new node's pages at these offsets are others'.
        views = [memoryview(lease.page(i)) for i in todo]
        with self._lock:
            self._open[lease.lease_id] = lease
        keys = [chunk[i].name or chunk[i].key for i in todo]
        region = lease.slab.array if lease.slab is not None else None  # RDMA registers it
        return FetchGroup(keys, views, (lease, chunk, todo), identity=self.identity, region=region)

    def _commit_present(
        self, lease: WriteLease, chunk: list[_Entry], present: set[int], hold: float
    ) -> None:
        def pinned(f: Future[Any]) -> None:
            try:
                e = f.exception()
                if e is not None:  # the pages are there all the same: only the pin is missing
                    log.info("pin of %d pages already on the node: %s", len(present), e)
                    if not isinstance(e, KVCacheRpcError) or e.code not in (
                        grpc.StatusCode.NOT_FOUND,
                        grpc.StatusCode.FAILED_PRECONDITION,
                    ):
                        self.mover._abort(lease)
                self.mover._resolve(chunk, dict.fromkeys(present, OK), self.page_bytes, present)
            finally:
                with self._lock:
                    self._committing -= 1
                    self._lock.notify_all()

        future = self.mover._rpc.submit(self.client.commit, lease, None, hold)
        with self._lock:
            self._committing += 1
        future.add_done_callback(pinned)

    def done(self, group: FetchGroup, fetched: list[EntryResult]) -> None:
        """A group landed (or failed): commit it in the background when every page is good,
        else publish the verified pages now (a local copy; failures only)."""
        lease, chunk, todo = group.tag
        with self._lock:
            self._open.pop(lease.lease_id, None)
        results = dict(zip(todo, fetched))
        try:
            if any(r.outcome is Outcome.UNAVAILABLE for r in fetched):
                self.unavailable = True
            for i in todo:  # a cancel that came in meanwhile wins: do not publish it
                if chunk[i].cancelled and results[i].ok:
                    results[i] = _CANCELLED
            if all(results[i].ok for i in todo):
                sums = self._verified_sums(lease, todo, group.checksums)
                hold = _hold(chunk)
                future = self.mover._rpc.submit(self.client.commit, lease, sums, hold)
                with self._lock:
                    self._committing += 1  # the callback (maybe at once, here) counts it down
                future.add_done_callback(lambda f: self._committed(f, lease, chunk, results))
                return
            results.update(self.mover._publish(lease, todo, results, self.namespace, _hold(chunk)))
        except Exception as e:  # noqa: BLE001 - every entry of the group gets a result
            log.exception("publishing a transfer group failed")
            results = {i: EntryResult(Outcome.INTERNAL, f"internal error: {e!r}") for i in todo}
        self.mover._resolve(chunk, results, self.page_bytes)

    @staticmethod
    def _verified_sums(
        lease: WriteLease, todo: list[int], verified: list[int] | None
    ) -> np.ndarray | None:
        """The checksums the transport verified the group's pages against, one per key of the
        lease (0 where it had no page), for the node to keep instead of hashing each page
        again; None (the node hashes them) unless every page has one."""
        if verified is None or len(verified) != len(todo) or 0 in verified:
            return None
        sums = np.zeros(len(lease.keys), dtype=np.uint64)
        sums[todo] = verified
        return sums

    def _committed(
        self,
        future: Future[Any],
        lease: WriteLease,
        chunk: list[_Entry],
        results: dict[int, EntryResult],
    ) -> None:
        try:
            e = future.exception()
            if isinstance(e, KVCacheRpcError):
                results = self.mover._commit_failed(lease, list(results), e)
            elif e is not None:
                results = {i: EntryResult(Outcome.INTERNAL, f"commit: {e!r}") for i in results}
            self.mover._resolve(chunk, results, self.page_bytes)
        finally:
            with self._lock:
                self._committing -= 1
                self._lock.notify_all()

    # ---- the job's side -------------------------------------------------------------------------

    def close(self) -> None:
        """Abort every lease the transport did not hand back, wait for the commits."""
        if self._groups is not None:
            self._groups.close()  # type: ignore[attr-defined] # a generator
        for group in self._unsettled:
            group.resolve()  # no-op unless the transport stopped before it did (its lease opens)
        with self._lock:
            left = list(self._open.values())
            self._open.clear()
        for lease in left:
            self.mover._abort(lease)
        with self._lock:
            while self._committing:
                self._lock.wait()


def _hold(entries: list[_Entry]) -> float:
    """How long the node pins a group's pages once committed: the most any of them was asked."""
    return max((e.hold_s for e in entries), default=0.0)
