"""The destination side of the messenger: batches of keys pulled from peers into this node.

Per job (one source, up to ``job_bytes`` of pages):

1. ``Allocate`` the keys on this node (a write lease; keys the node already holds come back
   with offset -1 and are done at once, nothing moves);
2. ``transport.fetch`` from the source's data address straight into the leased pages;
3. ``Commit`` when every page arrived and verified. When only some did, the verified pages are
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
from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound
from kvstore.keys import check_keys

from .node_access import NodeAccess
from .tcp import parse_address
from .transport import EntryResult, Outcome, Transport

log = logging.getLogger(__name__)

MAX_BATCH_ENTRIES = 1 << 17
_RPC_OUTCOME = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: Outcome.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INVALID_ARGUMENT: Outcome.INVALID,
    grpc.StatusCode.NOT_FOUND: Outcome.NOT_FOUND,
}


@dataclass(frozen=True, kw_only=True)
class MoverConfig:
    workers: int = 4  # jobs running at once
    job_bytes: int = 256 << 20  # pages per job = job_bytes // page_bytes (>= 1)
    write_ttl_s: float = 120.0  # write lease while pages arrive
    keep_batches: int = 4096  # finished batches kept for TransferStatus


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


@dataclass(eq=False)
class Batch:
    batch_id: str
    namespace: str
    entries: list[_Entry]
    created: float
    overrides: dict[int, EntryResult] = field(default_factory=dict)  # cancelled positions
    finished_at: float | None = None

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
    ) -> None:
        self.node = node
        self.transport = transport
        self.resolver = resolver
        self.config = config or MoverConfig()
        self._on_entry = on_entry or (lambda ns, result, nbytes: None)
        self._on_job = on_job or (lambda seconds, pages: None)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._inflight: dict[tuple[str, bytes], _Entry] = {}
        self._batches: dict[str, Batch] = {}
        self._bytes: dict[str, int] = {}
        self._pool = ThreadPoolExecutor(max_workers=self.config.workers, thread_name_prefix="mover")
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(3)
        self._closed = False
        for ns in node.namespaces():
            try:
                transport.register_local(node.region(ns))
            except LookupError as e:
                log.warning("namespace %s cannot receive transfers: %s", ns, e)

    # ---- API -------------------------------------------------------------------------------------

    def submit(self, namespace: str, requests: Sequence[EntryRequest]) -> tuple[str, int]:
        """Start a batch; returns (batch id, entries joined to fetches already in flight)."""
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
                    f"entry #{i}: source must be the source messenger's host:port, got {r.source!r}"
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
            batch_id = f"{self._prefix}-{next(self._ids)}"
            entries = []
            for key, r in zip(keys, requests):
                entry = self._inflight.get((namespace, key))
                if entry is None:
                    entry = _Entry(namespace, key, r.source, r.source_data)
                    self._inflight[(namespace, key)] = entry
                    new.setdefault((r.source, r.source_data), []).append(entry)
                else:
                    joined += 1
                entry.refs += 1
                entries.append(entry)
            self._batches[batch_id] = Batch(batch_id, namespace, entries, time.monotonic())
            self._bytes[batch_id] = 0
            self._trim_locked()
        per_job = max(1, self.config.job_bytes // info.page_bytes)
        for (source, source_data), group in new.items():
            for s in range(0, len(group), per_job):
                self._pool.submit(
                    self._run_job,
                    namespace,
                    info.page_bytes,
                    source,
                    source_data,
                    group[s : s + per_job],
                )
        return batch_id, joined

    def status(self, batch_id: str, wait: bool = False, timeout_s: float = 30.0) -> BatchSnapshot:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            batch = self._batch_locked(batch_id)
            if wait:
                while not self._finished_locked(batch):
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._changed.wait(left):
                        break
            return self._snapshot_locked(batch)

    def cancel(self, batch_id: str) -> BatchSnapshot:
        with self._lock:
            batch = self._batch_locked(batch_id)
            cancelled = EntryResult(Outcome.CANCELLED, "the batch was cancelled")
            for i, entry in enumerate(batch.entries):
                if entry.result is None and i not in batch.overrides:
                    batch.overrides[i] = cancelled
                    entry.refs -= 1
                    if entry.refs <= 0:
                        entry.cancelled = True  # no other batch wants it: stop fetching it
            self._note_finished_locked(batch)
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

    # ---- bookkeeping (caller holds the lock) -----------------------------------------------------

    def _batch_locked(self, batch_id: str) -> Batch:
        batch = self._batches.get(batch_id)
        if batch is None:
            raise NotFound(
                f"no transfer batch {batch_id!r} (never submitted, or finished long "
                "ago and forgotten)"
            )
        return batch

    @staticmethod
    def _finished_locked(batch: Batch) -> bool:
        return all(batch.result_of(i) is not None for i in range(len(batch.entries)))

    def _note_finished_locked(self, batch: Batch) -> None:
        if batch.finished_at is None and self._finished_locked(batch):
            batch.finished_at = time.monotonic()

    def _snapshot_locked(self, batch: Batch) -> BatchSnapshot:
        entries = [
            EntrySnapshot(e.key, batch.result_of(i), e.already_present)
            for i, e in enumerate(batch.entries)
        ]
        end = batch.finished_at or time.monotonic()
        return BatchSnapshot(
            batch.batch_id,
            entries,
            batch.finished_at is not None,
            self._bytes.get(batch.batch_id, 0),
            end - batch.created,
        )

    def _trim_locked(self) -> None:
        excess = len(self._batches) - self.config.keep_batches
        if excess <= 0:
            return
        for bid in [b for b, batch in self._batches.items() if batch.finished_at][:excess]:
            del self._batches[bid]
            self._bytes.pop(bid, None)

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
                entry.result = result
                entry.already_present = i in present
                self._inflight.pop((entry.namespace, entry.key), None)
            moved = {id(entries[i]) for i, r in results.items() if r.ok and i not in present}
            for batch in self._batches.values():
                if batch.finished_at is not None:
                    continue
                if moved:
                    self._bytes[batch.batch_id] += page_bytes * sum(
                        1 for e in batch.entries if id(e) in moved
                    )
                self._note_finished_locked(batch)
            self._changed.notify_all()
        for i, result in results.items():
            self._on_entry(
                entries[i].namespace, result, page_bytes if result.ok and i not in present else 0
            )

    # ---- a job -----------------------------------------------------------------------------------

    def _run_job(
        self, namespace: str, page_bytes: int, source: str, source_data: str, entries: list[_Entry]
    ) -> None:
        t0 = time.monotonic()
        try:
            self._job(namespace, page_bytes, source, source_data, entries)
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

    def _job(self, namespace, page_bytes, source, source_data, entries: list[_Entry]) -> None:
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
        keys = [e.key for e in entries]
        try:
            lease = self.node.client.allocate(namespace, keys=keys, ttl_s=self.config.write_ttl_s)
        except KVCacheRpcError as e:
            outcome = _RPC_OUTCOME.get(e.code, Outcome.UNAVAILABLE)
            reason = f"destination node cannot allocate {len(keys)} pages: {e.details}"
            self._resolve(
                entries, {i: EntryResult(outcome, reason) for i in range(len(keys))}, page_bytes
            )
            return
        try:
            results, present = self._fill(
                lease, namespace, page_bytes, source, source_data, data_address, entries
            )
        except BaseException:
            # At once: the pages must not stay leased (and unusable) until --write-ttl.
            self._abort(lease)
            raise
        self._resolve(entries, results, page_bytes, present)

    def _fill(
        self,
        lease: WriteLease,
        namespace: str,
        page_bytes: int,
        source: str,
        source_data: str,
        data_address: str,
        entries: list[_Entry],
    ) -> tuple[dict[int, EntryResult], set[int]]:
        """Fetch into ``lease`` and publish what arrived; returns (results, already present)."""
        keys = [e.key for e in entries]
        present = {i for i, off in enumerate(lease.offsets) if off < 0}
        todo = [i for i in range(len(keys)) if i not in present]
        results: dict[int, EntryResult] = {i: EntryResult(Outcome.OK) for i in present}
        if todo:
            views = [self.node.page(namespace, lease.offsets[i], page_bytes) for i in todo]
            fetched = self.transport.fetch(data_address, namespace, [keys[i] for i in todo], views)
            if any(r.outcome is Outcome.UNAVAILABLE for r in fetched) and not source_data:
                self.resolver.forget(source)  # the peer may have restarted on another port
            for i, r in zip(todo, fetched):
                results[i] = r
            for i in todo:  # a cancel that came in meanwhile wins: do not publish it
                if entries[i].cancelled and results[i].ok:
                    results[i] = EntryResult(Outcome.CANCELLED, "the batch was cancelled")
            results.update(self._publish(lease, todo, results, namespace, page_bytes))
        else:
            self._abort(lease)
        return results, present

    def _publish(
        self,
        lease: WriteLease,
        todo: list[int],
        results: dict[int, EntryResult],
        namespace: str,
        page_bytes: int,
    ) -> dict[int, EntryResult]:
        """Commit the verified pages of ``lease``; returns results that changed."""
        good = [i for i in todo if results[i].ok]
        client = self.node.client
        if len(good) == len(todo):
            try:
                client.commit(lease)
                return {}
            except KVCacheRpcError as e:
                return self._commit_failed(good, e)
        if not good:
            self._abort(lease)
            return {}
        # Some pages failed: publish only the verified ones, through a lease of their own.
        try:
            second = client.allocate(
                namespace, keys=[lease.keys[i] for i in good], ttl_s=self.config.write_ttl_s
            )
        except KVCacheRpcError as e:
            self._abort(lease)
            outcome = _RPC_OUTCOME.get(e.code, Outcome.UNAVAILABLE)
            return {
                i: EntryResult(outcome, f"cannot republish the verified pages: {e.details}")
                for i in good
            }
        region = self.node.region(namespace)
        for j, i in enumerate(good):
            dst = second.offsets[j]
            if dst >= 0:  # -1: another writer stored it meanwhile
                src = lease.offsets[i]
                np.copyto(region[dst : dst + page_bytes], region[src : src + page_bytes])
        self._abort(lease)
        try:
            client.commit(second)
        except KVCacheRpcError as e:
            return self._commit_failed(good, e)
        return {}

    @staticmethod
    def _commit_failed(good: list[int], e: KVCacheRpcError) -> dict[int, EntryResult]:
        reason = f"destination commit failed: {e.details}"
        if e.code == grpc.StatusCode.FAILED_PRECONDITION:
            reason += " (the write lease expired: raise the messenger's --write-ttl)"
        return {i: EntryResult(Outcome.UNAVAILABLE, reason) for i in good}

    def _abort(self, lease: WriteLease) -> None:
        try:
            self.node.client.abort(lease)
        except KVCacheRpcError as e:
            log.warning("abort of write lease %d: %s (it expires on its own)", lease.lease_id, e)
