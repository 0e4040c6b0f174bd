"""Event feeds: the conductor subscribes to every registered node's ``NodeService.Events``.

One thread per registration. It starts with a snapshot (``resync=True``), then applies live
events. Nothing is lost silently:
- a skipped sequence number (``SequenceGap``) reopens the stream with a snapshot;
- a broken stream reconnects with ``after_seq`` = the last applied event (the node re-sends a
  snapshot itself when it no longer has those events), after a short backoff;
- a snapshot cut off halfway is discarded and requested again.
The thread ends when its registration is gone (lease lapsed, node re-registered: ``StaleFeed``)
or the manager stops it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc

from kvstore.errors import KVStoreError
from proto import node_pb2 as npb
from proto import node_pb2_grpc as npbg
from rpc.channel import make_channel

from .core import Conductor, StaleFeed
from .index import SequenceGap

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class FeedOptions:
    token: str | None = None  # admin token of the nodes' Events RPC
    tls_ca_file: str | None = None
    backoff_s: float = 0.2  # first reconnect delay, doubled up to max_backoff_s
    max_backoff_s: float = 2.0


class SnapshotInterrupted(Exception):
    """A snapshot stopped before its last batch: request a new one."""


class FeedCounters:
    """Hooks for metrics; the defaults count nothing."""

    def events(self, n: int) -> None: ...

    def resync(self, reason: str) -> None: ...


class NodeFeed:
    def __init__(
        self,
        conductor: Conductor,
        node_id: str,
        generation: int,
        address: str,
        options: FeedOptions,
        counters: FeedCounters,
    ) -> None:
        self.conductor = conductor
        self.node_id, self.generation, self.address = node_id, generation, address
        self.options = options
        self.counters = counters
        self._stop = threading.Event()
        self._call: grpc.Future | None = None
        self._call_lock = threading.Lock()
        self._failing = False
        self._backoff = options.backoff_s
        self.indexed = threading.Event()  # set once its first snapshot is in the index
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"feed-{node_id}-{generation}"
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, join_s: float = 5.0) -> None:
        self._stop.set()
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(join_s)

    def _run(self) -> None:
        channel = make_channel(self.address, self.options.token, self.options.tls_ca_file)
        try:
            self._loop(npbg.NodeServiceStub(channel))
        except StaleFeed:
            log.info(
                "feed %s generation %d: registration gone; feed stopped",
                self.node_id,
                self.generation,
            )
        finally:
            channel.close()

    def _loop(self, stub: npbg.NodeServiceStub) -> None:
        resync, reason = True, "register"
        while not self._stop.is_set():
            try:
                after = self.conductor.last_seq(self.node_id, self.generation)
                if resync:
                    self.counters.resync(reason)
                self._consume(stub, after, resync)
                resync = False  # the node closed the stream: reconnect where we were
                if self._stop.wait(self._backoff):
                    return
                log.info("feed %s: stream ended; reconnecting", self.node_id)
            except SequenceGap as e:
                log.warning("feed %s: %s", self.node_id, e)
                resync, reason = True, "gap"
                continue
            except SnapshotInterrupted:
                log.warning("feed %s: snapshot cut short; requesting a new one", self.node_id)
                resync, reason = True, "snapshot"
                continue
            except StaleFeed:
                raise
            except (ValueError, KVStoreError) as e:
                # A malformed event (no tier, unknown kind): the node's feed cannot be trusted
                # from here on, so rebuild from a snapshot rather than skip it.
                log.error(
                    "feed %s: bad event stream (%s); resyncing from a snapshot", self.node_id, e
                )
                resync, reason = True, "error"
                if self._stop.wait(self._backoff):
                    return
                self._backoff = min(self._backoff * 2, self.options.max_backoff_s)
                continue
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                if not self._failing:
                    log.warning(
                        "feed %s: Events stream at %s failed (%s: %s); retrying",
                        self.node_id,
                        self.address,
                        e.code().name,
                        e.details(),
                    )
                self._failing = True
                if self.conductor.is_resyncing(self.node_id, self.generation):
                    resync, reason = True, "reconnect"
                if self._stop.wait(self._backoff):
                    return
                self._backoff = min(self._backoff * 2, self.options.max_backoff_s)

    def _consume(self, stub: npbg.NodeServiceStub, after: int, resync: bool) -> None:
        call = stub.Events(npb.EventsRequest(after_seq=after, resync=resync))
        with self._call_lock:
            self._call = call
            if self._stop.is_set():
                call.cancel()
        c, node, gen = self.conductor, self.node_id, self.generation
        in_snapshot = False
        for batch in call:
            if self._failing:
                log.info("feed %s: Events stream at %s is back", node, self.address)
                self._failing, self._backoff = False, self.options.backoff_s
            if batch.snapshot:
                if not in_snapshot:
                    c.begin_resync(node, gen)
                    in_snapshot = True
                c.load_snapshot(node, gen, ((e.key, e.tier) for e in batch.events))
                if batch.snapshot_done:
                    c.finish_resync(node, gen, batch.snapshot_seq)
                    in_snapshot = False
                    self.indexed.set()
                    log.info(
                        "feed %s: index rebuilt from a snapshot at seq %d", node, batch.snapshot_seq
                    )
            else:
                if in_snapshot:
                    raise SnapshotInterrupted()
                self.counters.events(c.apply_events(node, gen, batch.events))
        if in_snapshot:
            raise SnapshotInterrupted()


class FeedManager:
    """Owns the feed threads: one per current registration."""

    def __init__(
        self, conductor: Conductor, options: FeedOptions, counters: FeedCounters | None = None
    ) -> None:
        self.conductor = conductor
        self.options = options
        self.counters = counters or FeedCounters()
        self._feeds: dict[str, NodeFeed] = {}
        self._lock = threading.Lock()

    def start(self, node_id: str, generation: int, address: str) -> None:
        """(Re)subscribe to ``node_id``; a previous registration's feed is stopped first."""
        feed = NodeFeed(self.conductor, node_id, generation, address, self.options, self.counters)
        with self._lock:
            old = self._feeds.get(node_id)
            if old is not None and old.generation > generation:
                return  # a newer registration won a race with this one: its feed stays
            self._feeds[node_id] = feed
        if old is not None:
            old.stop(join_s=0)
        feed.start()

    def stop(self, node_id: str, generation: int | None = None) -> None:
        with self._lock:
            feed = self._feeds.get(node_id)
            if feed is None or (generation is not None and feed.generation != generation):
                return
            del self._feeds[node_id]
        feed.stop(join_s=0)

    def wait_indexed(self, timeout_s: float) -> list[str]:
        """Wait until every feed has loaded its first snapshot; the node ids still loading."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            feeds = list(self._feeds.values())
        for feed in feeds:
            feed.indexed.wait(max(deadline - time.monotonic(), 0.0))
        return sorted(f.node_id for f in feeds if not f.indexed.is_set())

    def stop_all(self) -> None:
        with self._lock:
            feeds, self._feeds = list(self._feeds.values()), {}
        for feed in feeds:
            feed.stop()
