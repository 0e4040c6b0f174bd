"""The destination side of the messenger: batches of keys pulled from peers into this node.

Per job (one source, up to ``job_bytes`` of pages), a pipeline of groups
(``messenger.pipeline``; the transport's ``group_pages`` each, 64 MiB over TCP):

1. ``Allocate`` a group's keys on this node (a write lease; keys the node already holds come
   back with offset -1 and are done at once, nothing moves for them), one group ahead of the
   transport, so the round trip overlaps the transfer;
2. ``transport.fetch_groups`` from the source's data address straight into the leased pages;
3. ``Commit`` each group in the background as soon as every page of it arrived and verified,
   while the next groups are on the wire, with the checksums it was verified against (the node
   keeps them instead of hashing every page again). When only some did, the verified pages are
   republished through a second lease (a local copy, failures only) and the first lease is
   aborted: a failed or cut page is never visible. Nothing arrived: ``Abort``.

A key being fetched is fetched once: later submissions (any batch) join the entry in flight.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import grpc
import numpy as np

from clients.node_client import KVCacheRpcError, WriteLease
from kvstore.errors import CapacityExhausted, FailedPrecondition, InvalidArgument, NotFound, echo
from kvstore.keys import check_keys

from .identity import Identities
from .node_access import NodeAccess
from .pipeline import RPC_OUTCOME, Pipeline
from .tcp import parse_address
from .transport import EntryResult, Outcome, Transport

log = logging.getLogger(__name__)

MAX_BATCH_ENTRIES = 1 << 17


@dataclass(frozen=True, kw_only=True)
class MoverConfig:
    workers: int = 4  # jobs running at once
    # Pages per job = job_bytes // page_bytes (>= 1). A job leases its pages a group at a time,
    # so jobs can be large: one job per source streams over the transport's lanes, and only its
    # last groups' commits are not hidden behind the transfer (several jobs at once would end,
    # and commit, together).
    job_bytes: int = 1 << 30
    write_ttl_s: float = 120.0  # write lease while pages arrive
    keep_batches: int = 4096  # finished batches kept for TransferStatus
    # Keys being fetched at once (all batches; a joined key counts once), and one submitter's
    # share of them: past either, SubmitTransfer is RESOURCE_EXHAUSTED instead of queueing
    # without end (one tenant must not hold the queue for every other).
    max_fetching: int = 1 << 20
    owner_share: float = 0.5
    # Pulls a request waits on (an engine's prefix, a decode's prompt) run on workers of their
    # own, never queued behind bulk jobs; a batch marked urgent but larger than urgent_bytes
    # runs as a bulk one (the lane is for small, latency-bound pulls).
    urgent_workers: int = 2
    urgent_bytes: int = 256 << 20


@dataclass(frozen=True, slots=True)
class EntryRequest:
    key: bytes
    source: str  # the source messenger's gRPC address
    source_data: str = ""


@dataclass(slots=True, eq=False)
class _Entry:
    namespace: str
    key: bytes
    source: str
    source_data: str
    result: EntryResult | None = None  # None while pending
    already_present: bool = False
    refs: int = 0  # batches still waiting for it
    cancelled: bool = False
    owner: str = ""  # whom it is fetched for (the first batch's submitter)
    name: bytes = b""  # the key as the owner named it (a tenant's, unscoped); b"": ``key``
    hold_s: float = 0.0  # pin it on the node that long once committed (the most a batch asked)
    # (batch, position) of every batch waiting on it: its result updates exactly those, not
    # every entry of every open batch.
    waiters: list[tuple["Batch", int]] = field(default_factory=list)


@dataclass(eq=False)
class Batch:
    batch_id: str
    namespace: str
    entries: list[_Entry]
    created: float
    overrides: dict[int, EntryResult] = field(default_factory=dict)  # cancelled positions
    finished_at: float | None = None
    owner: str = ""  # who submitted it: only they (or anyone, for owner None) see or cancel it
    names: list[bytes] | None = None  # the keys as the owner named them (a tenant's, unscoped)
    pending: int = 0  # positions without a result yet
    moved_bytes: int = 0

    def result_of(self, i: int) -> EntryResult | None:
        return self.overrides.get(i, self.entries[i].result)


@dataclass(frozen=True, slots=True)
class EntrySnapshot:
    key: bytes
    result: EntryResult | None  # None: pending
    already_present: bool


@dataclass(frozen=True, slots=True)
class BatchSnapshot:
    batch_id: str
    entries: list[EntrySnapshot]
    finished: bool
    bytes_moved: int
    elapsed_s: float

    def count(self, state: str) -> int:
        if state == "pending":
            return sum(1 for e in self.entries if e.result is None)
        if state == "done":
            return sum(1 for e in self.entries if e.result is not None and e.result.ok)
        return sum(1 for e in self.entries if e.result is not None and not e.result.ok)


class DataAddressResolver:
    """Source messenger gRPC address -> its data address (``GetInfo``, cached)."""

    def __init__(self, lookup: Callable[[str], str]) -> None:
        self._lookup = lookup
        self._lock = threading.Lock()
        self._cache: dict[str, str] = {}

    def resolve(self, source: str) -> str:
        with self._lock:
            hit = self._cache.get(source)
        if hit:
            return hit
        address = self._lookup(source)
        with self._lock:
            self._cache[source] = address
        return address

    def forget(self, source: str) -> None:
        with self._lock:
            self._cache.pop(source, None)


class Mover:
    def __init__(
        self,
        node: NodeAccess,
        transport: Transport,
        resolver: DataAddressResolver,
        config: MoverConfig | None = None,
        on_entry: Callable[[str, EntryResult, int], None] | None = None,
        on_job: Callable[[float, int], None] | None = None,
        identities: Identities | None = None,
    ) -> None:
        """``identities``: the token table whose tokens prove to sources whom a pull is for."""
        self.node = node
        self.identities = identities or Identities({})
        self.transport = transport
        self.resolver = resolver
        self.config = config or MoverConfig()
        self._on_entry = on_entry or (lambda ns, result, nbytes: None)
        self._on_job = on_job or (lambda seconds, pages: None)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._inflight: dict[tuple[str, bytes], _Entry] = {}
        self._fetching: dict[str, int] = {}  # entries not final yet, by owner
        self._batches: dict[str, Batch] = {}
        self._pool = ThreadPoolExecutor(max_workers=self.config.workers, thread_name_prefix="mover")
        self._urgent = ThreadPoolExecutor(
            max_workers=self.config.urgent_workers, thread_name_prefix="mover-urgent"
        )
        # NOTE: the jobs' Allocate and Commit calls, run beside their transfers: a pool of their
        # own (the node client's one background thread would queue every job's calls behind
        # each other's: 5-9 ms per call in make demo, where four pulls run at once).
        self._rpc = ThreadPoolExecutor(
            max_workers=2 * (self.config.workers + self.config.urgent_workers),
            thread_name_prefix="mover-rpc",
        )
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(3)
        self._closed = False
        for ns in node.namespaces():
            try:
                transport.register_local(node.region(ns), ns)
            except LookupError as e:
                log.warning("namespace %s cannot receive transfers: %s", ns, e)

    # ---- API -------------------------------------------------------------------------------------

    def submit(
        self,
        namespace: str,
        requests: Sequence[EntryRequest],
        owner: str = "",
        names: Sequence[bytes] | None = None,
        chain: bool = False,
        urgent: bool = False,
        hold_s: float = 0.0,
    ) -> tuple[str, int]:
        """Start a batch; returns (batch id, entries joined to fetches already in flight).
        ``owner``: who may see and cancel it; ``names``: the keys as the owner named them,
        shown in its status instead of the keys as stored; ``chain``: the keys are one prefix
        chain in order (see ``messenger.pipeline``); ``urgent``: a request waits on it (see
        ``MoverConfig.urgent_workers``); ``hold_s``: the node pins the pages that long once
        committed (Commit's ``hold_s``), for a reader the batch's end tells they are there."""
        if not requests:
            raise InvalidArgument("a transfer batch needs at least one entry")
        if len(requests) > MAX_BATCH_ENTRIES:
            raise InvalidArgument(
                f"{len(requests)} entries in one batch; the limit is {MAX_BATCH_ENTRIES}: split it"
            )
        try:
            info = self.node.info(namespace)
            self.node.region(namespace)
        except LookupError as e:
            raise InvalidArgument(str(e)) from None
        keys = check_keys([r.key for r in requests])
        for i, r in enumerate(requests):
            if not r.source or ":" not in r.source:
                raise InvalidArgument(
                    f"entry #{i}: source must be the source messenger's host:port, "
                    f"got {echo(r.source)}"
                )
            if r.source_data:
                try:
                    parse_address(r.source_data)
                except ValueError as e:
                    raise InvalidArgument(f"entry #{i}: source_data: {e}") from None
        new: dict[tuple[str, str], list[_Entry]] = {}
        joined = 0
        with self._lock:
            if self._closed:
                raise FailedPrecondition("the messenger is shutting down")
            self._check_room_locked(namespace, keys, owner)
            batch_id = f"{self._prefix}-{next(self._ids)}"
            entries = []
            for i, (key, r) in enumerate(zip(keys, requests)):
                entry = self._inflight.get((namespace, key))
                # A cancelled fetch ends without publishing: a new batch starts its own.
                if entry is None or entry.cancelled:
                    name = names[i] if names is not None else b""
                    entry = _Entry(namespace, key, r.source, r.source_data, owner=owner, name=name)
                    self._fetching[owner] = self._fetching.get(owner, 0) + 1
                    self._inflight[(namespace, key)] = entry
                    new.setdefault((r.source, r.source_data), []).append(entry)
                else:
                    joined += 1
                entry.hold_s = max(entry.hold_s, hold_s)  # read at its commit
                entry.refs += 1
                entries.append(entry)
            batch = Batch(
                batch_id,
                namespace,
                entries,
                time.monotonic(),
                owner=owner,
                names=list(names) if names is not None else None,
                pending=len(entries),
            )
            for i, entry in enumerate(entries):
                entry.waiters.append((batch, i))
            self._batches[batch_id] = batch
            self._trim_locked()
        per_job = max(1, self.config.job_bytes // info.page_bytes)
        # Fetched as the chain it is only when nothing is missing from it: no key joined
        # another batch's fetch, none comes from another source.
        chained = chain and joined == 0 and len(new) == 1
        fresh = sum(len(g) for g in new.values())
        pool = (
            self._urgent
            if urgent and fresh * info.page_bytes <= self.config.urgent_bytes
            else self._pool
        )
        for (source, source_data), group in new.items():
            for s in range(0, len(group), per_job):
                pool.submit(
                    self._run_job,
                    namespace,
                    info.page_bytes,
                    source,
                    source_data,
                    group[s : s + per_job],
                    chained,
                )
        return batch_id, joined

    def status(
        self,
        batch_id: str,
        wait: bool = False,
        timeout_s: float = 30.0,
        owner: str | None = None,
    ) -> BatchSnapshot:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            batch = self._batch_locked(batch_id, owner)
            if wait:
                while not self._finished_locked(batch):
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._changed.wait(left):
                        break
            return self._snapshot_locked(batch)

    def cancel(self, batch_id: str, owner: str | None = None) -> BatchSnapshot:
        with self._lock:
            batch = self._batch_locked(batch_id, owner)
            cancelled = EntryResult(Outcome.CANCELLED, "the batch was cancelled")
            for i, entry in enumerate(batch.entries):
                if entry.result is None and i not in batch.overrides:
                    batch.overrides[i] = cancelled
                    self._settled_locked(batch)
                    entry.refs -= 1
                    if entry.refs <= 0:
                        entry.cancelled = True  # no other batch wants it: stop fetching it
            self._changed.notify_all()
            return self._snapshot_locked(batch)

    def in_flight(self) -> tuple[int, int]:
        """(batches not finished, keys being fetched now)."""
        with self._lock:
            batches = sum(1 for b in self._batches.values() if b.finished_at is None)
            return batches, len(self._inflight)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for entry in self._inflight.values():
                entry.cancelled = True
        self._pool.shutdown(wait=True)
        self._urgent.shutdown(wait=True)
        self._rpc.shutdown(wait=True)

    # ---- bookkeeping (caller holds the lock) -----------------------------------------------------

    def _check_room_locked(self, namespace: str, keys: Sequence[bytes], owner: str) -> None:
        """RESOURCE_EXHAUSTED when the keys this batch would add to the fetches under way pass
        the messenger's bound or the submitter's share of it."""
        more = 0
        for key in keys:
            entry = self._inflight.get((namespace, key))
            more += entry is None or entry.cancelled
        total = sum(self._fetching.values()) + more
        mine = self._fetching.get(owner, 0) + more
        share = int(self.config.max_fetching * self.config.owner_share)
        if total > self.config.max_fetching or mine > share:
            raise CapacityExhausted(
                f"this messenger is fetching {total - more} keys ({mine - more} of them for "
                f"this submitter); {more} more would pass its bound of {self.config.max_fetching} "
                f"({share} per submitter): wait for batches to finish and submit again"
            )

    def _batch_locked(self, batch_id: str, owner: str | None = None) -> Batch:
        """The batch; another owner's answers exactly as one that does not exist."""
        batch = self._batches.get(batch_id)
        if batch is None or (owner is not None and batch.owner != owner):
            raise NotFound(
                f"no transfer batch {echo(batch_id)} (never submitted, or finished long "
                "ago and forgotten)"
            )
        return batch

    @staticmethod
    def _finished_locked(batch: Batch) -> bool:
        return batch.pending == 0

    @staticmethod
    def _settled_locked(batch: Batch) -> None:
        """One more position of ``batch`` has its result."""
        batch.pending -= 1
        if batch.pending == 0:
            batch.finished_at = time.monotonic()

    def _snapshot_locked(self, batch: Batch) -> BatchSnapshot:
        entries = [
            EntrySnapshot(
                e.key if batch.names is None else batch.names[i],
                batch.result_of(i),
                e.already_present,
            )
            for i, e in enumerate(batch.entries)
        ]
        end = batch.finished_at or time.monotonic()
        return BatchSnapshot(
            batch.batch_id,
            entries,
            batch.finished_at is not None,
            batch.moved_bytes,
            end - batch.created,
        )

    def _trim_locked(self) -> None:
        excess = len(self._batches) - self.config.keep_batches
        if excess <= 0:
            return
        for bid in [b for b, batch in self._batches.items() if batch.finished_at][:excess]:
            del self._batches[bid]

    def _resolve(
        self,
        entries: list[_Entry],
        results: dict[int, EntryResult],
        page_bytes: int,
        present: set[int] = frozenset(),
    ) -> None:
        """Publish final results (index in ``entries`` -> result) and wake waiters."""
        with self._lock:
            for i, result in results.items():
                entry = entries[i]
                if entry.result is not None:
                    continue  # final already
                entry.result = result
                entry.already_present = i in present
                left = self._fetching.get(entry.owner, 1) - 1
                if left:
                    self._fetching[entry.owner] = left
                else:
                    self._fetching.pop(entry.owner, None)
                if self._inflight.get((entry.namespace, entry.key)) is entry:
                    del self._inflight[(entry.namespace, entry.key)]
                moved = page_bytes if result.ok and i not in present else 0
                for batch, at in entry.waiters:
                    if at not in batch.overrides:  # a cancelled position is settled already
                        batch.moved_bytes += moved
                        self._settled_locked(batch)
                entry.waiters.clear()
            self._changed.notify_all()
        for i, result in results.items():
            self._on_entry(
                entries[i].namespace, result, page_bytes if result.ok and i not in present else 0
            )

    # ---- a job -----------------------------------------------------------------------------------

    def _run_job(
        self,
        namespace: str,
        page_bytes: int,
        source: str,
        source_data: str,
        entries: list[_Entry],
        chained: bool = False,
    ) -> None:
        t0 = time.monotonic()
        try:
            self._job(namespace, page_bytes, source, source_data, entries, chained)
            self._on_job(time.monotonic() - t0, len(entries))
        except Exception as e:  # noqa: BLE001 - a job must resolve its entries whatever happens
            log.exception("transfer job from %s failed", source)
            self._resolve(
                entries,
                {
                    i: EntryResult(Outcome.INTERNAL, f"internal error: {e!r}")
                    for i, en in enumerate(entries)
                    if en.result is None
                },
                page_bytes,
            )

    def _job(
        self, namespace, page_bytes, source, source_data, entries: list[_Entry], chained: bool
    ) -> None:
        cancelled = {
            i: EntryResult(Outcome.CANCELLED, "the batch was cancelled")
            for i, e in enumerate(entries)
            if e.cancelled
        }
        if cancelled:
            self._resolve(entries, cancelled, page_bytes)
            entries = [e for e in entries if not e.cancelled]
            if not entries:
                return
        try:
            data_address = source_data or self.resolver.resolve(source)
        except Exception as e:  # noqa: BLE001 - any lookup failure fails these entries
            reason = f"cannot reach source messenger {source}: {e}"
            self._resolve(
                entries,
                {i: EntryResult(Outcome.UNAVAILABLE, reason) for i in range(len(entries))},
                page_bytes,
            )
            return
        # A job's entries are one batch's: one owner, for whom the source is asked.
        identity = self.identities.of(entries[0].owner)
        if identity is None:
            reason = "this messenger holds no token to prove the pull's identity to the source"
            self._resolve(
                entries,
                {i: EntryResult(Outcome.INTERNAL, reason) for i in range(len(entries))},
                page_bytes,
            )
            return
        job = Pipeline(self, namespace, page_bytes, entries, identity, chained)
        try:
            stopped = self.transport.fetch_groups(
                data_address, namespace, page_bytes, len(entries), job.groups(), job.done
            )
        finally:
            # At once: pages of a job that stopped must not stay leased until --write-ttl.
            job.close()
        if job.unavailable and not source_data:
            self.resolver.forget(source)  # the peer may have restarted on another port
        # Groups the transport never took (its lanes to the peer broke): that failure is theirs.
        rest = stopped or EntryResult(Outcome.INTERNAL, "entry left unresolved")
        left = {i: rest for i, e in enumerate(entries) if e.result is None}
        if left and stopped is None:
            log.error("transfer job from %s left %d entries unresolved", source, len(left))
        if left:
            self._resolve(entries, left, page_bytes)

    def _publish(
        self,
        lease: WriteLease,
        todo: list[int],
        results: dict[int, EntryResult],
        namespace: str,
        hold_s: float = 0.0,
    ) -> dict[int, EntryResult]:
        """Commit the verified pages of ``lease``; returns results that changed."""
        good = [i for i in todo if results[i].ok]
        client = self.node.client
        if len(good) == len(todo):
            try:
                client.commit(lease, hold_s=hold_s)
                return {}
            except KVCacheRpcError as e:
                return self._commit_failed(lease, good, e)
        if not good:
            self._abort(lease)
            return {}
        # Some pages failed: publish only the verified ones, through a lease of their own.
        try:
            second = client.allocate(  # the verified pages only: gaps, so no chain
                namespace,
                keys=[lease.keys[i] for i in good],
                ttl_s=self.config.write_ttl_s,
                chained=False,
            )
        except KVCacheRpcError as e:
            self._abort(lease)
            outcome = RPC_OUTCOME.get(e.code, Outcome.UNAVAILABLE)
            return {
                i: EntryResult(outcome, f"cannot republish the verified pages: {e.details}")
                for i in good
            }
        # Each lease's own mapping: if the node restarted in between, the verified pages are in
        # the old one and the second lease's in the new one.
        for j, i in enumerate(good):
            if second.offsets[j] >= 0:  # -1: another writer stored it meanwhile
                np.copyto(second.page(j), lease.page(i))
        self._abort(lease)
        try:
            client.commit(second, hold_s=hold_s)
        except KVCacheRpcError as e:
            return self._commit_failed(second, good, e)
        return {}

    def _commit_failed(
        self, lease: WriteLease, good: list[int], e: KVCacheRpcError
    ) -> dict[int, EntryResult]:
        """The results of a Commit that failed; a lease it may have left open is aborted (its
        pages would stay leased until --write-ttl, then quarantined)."""
        reason = f"destination commit failed: {e.details}"
        if e.code == grpc.StatusCode.FAILED_PRECONDITION:
            reason += " (the write lease expired: raise the messenger's --write-ttl)"
        if e.code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
            self._abort(lease)  # gone already (NOT_FOUND) if the node did commit it after all
        return {i: EntryResult(Outcome.UNAVAILABLE, reason) for i in good}

    def _abort(self, lease: WriteLease) -> None:
        try:
            self.node.client.abort(lease)
        except KVCacheRpcError as e:
            log.warning("abort of write lease %d: %s (it expires on its own)", lease.lease_id, e)
