"""The conductor side of cluster membership in etcd: the registry follows the node and messenger
records under ``<prefix>/`` (written by the members: ``plumbing.registration``) through a watch,
instead of RegisterNode / Heartbeat RPCs.

Leader and standbys alike run this (and so subscribe to every node's event stream): a standby's
index is as warm as the leader's when it takes over.

- A node record with a new incarnation (a restarted node process) or a new address registers a
  new generation: its index entries are rebuilt from its event feed's snapshot. The same
  incarnation written again (a load refresh, a new lease after an etcd outage, its messenger
  appearing) updates the registration in place: generation and index stay.
- A deleted record (the lease lapsed: the node died, or it stopped and revoked it) drops the node
  from scheduling and the index, and stops its feed.
- The registry's own leases do not apply to these nodes (etcd's do): when etcd is out of reach
  the conductor keeps routing with the membership it knows. Reconnecting lists the keys again
  and reconciles, so no change made meanwhile is missed, even by an etcd that lost its data.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import replace
from typing import Callable

from kvstore.errors import KVStoreError
from plumbing.etcd import EtcdClient, EtcdUnavailable, KeyValue, Watch, WatchCompacted, WatchIdle
from plumbing.registration import MessengerRecord, NodeRecord, messengers_prefix, nodes_prefix

from .core import Conductor
from .feed import FeedManager

log = logging.getLogger(__name__)

WATCH_IDLE_S = 15.0  # a watch silent this long is reopened (etcd sends progress notifications)


class EtcdMembership:
    def __init__(
        self,
        conductor: Conductor,
        feeds: FeedManager,
        etcd: EtcdClient,
        prefix: str,
        on_dropped: Callable[[str], None] = lambda node_id: None,
    ) -> None:
        self.conductor, self.feeds, self.etcd = conductor, feeds, etcd
        self.prefix = prefix
        self._nodes, self._messengers = nodes_prefix(prefix), messengers_prefix(prefix)
        self._on_dropped = on_dropped
        self._records: dict[str, NodeRecord] = {}  # the nodes etcd registered here
        self._messenger_of: dict[str, str] = {}  # node id -> its messenger's gRPC address
        self.synced = threading.Event()  # the first listing is applied
        self._stop = threading.Event()
        self._watch: Watch | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="etcd-membership")

    def start(self) -> "EtcdMembership":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        watch = self._watch
        if watch is not None:
            watch.close()
        self._thread.join(5)

    def node_ids(self) -> list[str]:
        return sorted(self._records)

    # ---- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        revision, listed, failing = 0, False, False
        backoff = 0.2
        while not self._stop.is_set():
            try:
                if not listed:
                    revision, kvs = self.etcd.get_prefix(self.prefix + "/")
                    self._reconcile(kvs)
                    listed = True
                    self.synced.set()
                    if failing:
                        log.info("etcd reachable again: membership reconciled at rev %d", revision)
                    failing, backoff = False, 0.2
                self._watch = self.etcd.watch_prefix(self.prefix + "/", revision + 1, WATCH_IDLE_S)
                if self._stop.is_set():
                    break
                for batch in self._watch:
                    for event in batch.events:
                        self._apply(event.kv, event.deleted)
                        revision = max(revision, event.kv.mod_revision)
                    if not batch.events:  # a progress notification: all up to here was sent
                        revision = max(revision, batch.revision)
            except WatchCompacted as e:
                log.warning("etcd: membership watch %s; listing again", e)
                listed = False
            except WatchIdle:
                continue  # silent, not broken: watch on from the last revision
            except EtcdUnavailable as e:
                if self._stop.is_set():
                    break
                if not failing:
                    log.warning(
                        "etcd unreachable (%s): routing goes on with the %d nodes known; retrying",
                        e,
                        len(self._records),
                    )
                failing, listed = True, False
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            except Exception:  # never leave the registry unwatched silently
                log.exception("etcd membership watch failed; listing again")
                listed = False
                self._stop.wait(1.0)

    # ---- applying records -------------------------------------------------------------------

    def _reconcile(self, kvs: list[KeyValue]) -> None:
        """Make the registry match a full listing."""
        nodes: dict[str, KeyValue] = {}
        self._messenger_of.clear()
        for kv in kvs:
            if kv.key.startswith(self._messengers):
                self._apply(kv, deleted=False)
            elif kv.key.startswith(self._nodes):
                nodes[kv.key] = kv
        for kv in nodes.values():
            self._apply(kv, deleted=False)
        listed = {kv.key[len(self._nodes) :] for kv in nodes.values()}
        for node_id in set(self._records) - listed:
            self._drop(node_id)

    def _apply(self, kv: KeyValue, deleted: bool) -> None:
        if kv.key.startswith(self._nodes):
            node_id = kv.key[len(self._nodes) :]
            if deleted:
                self._drop(node_id)
            else:
                self._upsert(node_id, kv)
        elif kv.key.startswith(self._messengers):
            node_id = kv.key[len(self._messengers) :]
            if deleted:
                self._messenger_of.pop(node_id, None)
            else:
                try:
                    self._messenger_of[node_id] = MessengerRecord.decode(kv.value).address
                except KVStoreError as e:
                    log.error("etcd key %s ignored: %s", kv.key, e)
                    return
            record = self._records.get(node_id)
            if record is not None:  # the node's descriptor names its messenger
                self._upsert_record(node_id, record)

    def _upsert(self, node_id: str, kv: KeyValue) -> None:
        try:
            record = NodeRecord.decode(kv.value)
        except KVStoreError as e:
            log.error("etcd key %s ignored: %s", kv.key, e)
            return
        if record.descriptor.node_id != node_id:
            log.error(
                "etcd key %s ignored: it holds the record of node %r",
                kv.key,
                record.descriptor.node_id,
            )
            return
        self._upsert_record(node_id, record)

    def _upsert_record(self, node_id: str, record: NodeRecord) -> None:
        desc = record.descriptor
        if not desc.messenger_address and node_id in self._messenger_of:
            desc = replace(desc, messenger_address=self._messenger_of[node_id])
        c = self.conductor
        previous = self._records.get(node_id)
        state = c.registry.find(node_id)
        if (
            previous is None
            or state is None
            or previous.incarnation != record.incarnation
            or state.descriptor.address != desc.address
        ):
            state = c.register(desc, record.load, lease_s=math.inf)
            self.feeds.start(node_id, state.generation, desc.address)
            log.info(
                "node %s joined through etcd (generation %d, role %s, address %s, messenger %s)",
                node_id,
                state.generation,
                desc.role.value,
                desc.address,
                desc.messenger_address or "-",
            )
        else:
            if state.descriptor != desc:
                c.update(desc)
            c.heartbeat(node_id, record.load, state.generation)
        self._records[node_id] = record

    def _drop(self, node_id: str) -> None:
        if self._records.pop(node_id, None) is None:
            return
        generation = self.conductor.unregister(node_id)
        if generation is not None:
            self.feeds.stop(node_id, generation)
        self._on_dropped(node_id)
        log.warning("node %s left: its etcd record is gone (lease lapsed or it stopped)", node_id)
