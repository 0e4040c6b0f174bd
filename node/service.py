"""NodeService: a thin gRPC layer over ``Node``; protobuf <-> domain conversion lives here (the
lease RPCs in ``service_leases``)."""

from __future__ import annotations

import logging
import time
from typing import Iterator

import grpc
import numpy as np

from kvstore.errors import FailedPrecondition, InvalidArgument, KVStoreError
from kvstore.events import EventKind
from proto import common_pb2 as cpb
from proto import node_pb2 as pb
from proto import node_pb2_grpc as pbg
from rpc.server import Auth
from rpc.status import observed, observed_stream
from rpc.streams import StreamGate
from rpc.wire import layout_from_pb, layout_to_pb, tier_to_pb, usage_of, usage_to_pb

from .drain import drain, leave_soon
from .metrics import NodeMetrics
from .node import Node, Selection
from .segments import TICKET_TTL_S
from .service_leases import LeaseRpcs

log = logging.getLogger(__name__)
STREAM_CHUNK_BYTES = 1 << 20
EVENT_BATCH = 4096
_EVENT_KIND = {EventKind.STORED: cpb.EVENT_STORED, EventKind.EVICTED: cpb.EVENT_EVICTED}


class NodeServicer(LeaseRpcs, pbg.NodeServiceServicer):
    def __init__(
        self,
        node: Node,
        auth: Auth,
        metrics: NodeMetrics,
        max_streams: int = 16,
        max_event_streams: int = 4,
        stream_idle_timeout_s: float = 30.0,
        max_streams_per_tenant: int | None = None,
    ) -> None:
        self.node = node
        self.auth = auth
        self.metrics = metrics
        self.stopping = False
        self.control_socket = ""  # node.control.ControlServer's, once it serves (GetInfo)
        # NOTE: every open stream holds a worker of the server's pool for its whole life: cap them
        # below the pool's size (Get/Put apart from the long-lived Events feeds) so unary calls
        # always find a worker, and cut streams whose client stopped sending or reading.
        refused = lambda m: metrics.streams_refused.labels(m).inc()  # noqa: E731
        cut = lambda m: metrics.streams_cut.labels(m).inc()  # noqa: E731
        # One tenant holds at most its share of them (the admin's are not bucketed).
        per_tenant = max_streams_per_tenant or max(1, max_streams // 2)
        self.streams = StreamGate(
            "Get/Put", max_streams, stream_idle_timeout_s, refused, cut, per_peer_limit=per_tenant
        )
        self.event_streams = StreamGate(
            "Events", max_event_streams, stream_idle_timeout_s, refused, cut
        )

    # ---- unary ----------------------------------------------------------------------------------

    @observed
    def GetInfo(self, request, context):
        import os
        import socket

        namespaces = [self._namespace_info(ns, st) for ns, st in list(self.node.stores.items())]
        return pb.NodeInfo(
            node_id=self.node.node_id,
            namespaces=namespaces,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            session_socket=self.node.sessions.socket_name if self.node.sessions else "",
            messenger_address=self.node.config.messenger,
            control_socket=self.control_socket,
        )

    def _namespace_info(self, namespace: str, store) -> pb.NamespaceInfo:
        page = store.layout.page_bytes
        segs = self.node.segments
        return pb.NamespaceInfo(
            namespace=namespace,
            layout=layout_to_pb(store.layout),
            shm_name=store.shm_name or "",
            page_bytes=page,
            tiers=[usage_to_pb(usage_of(t, page)) for t in store.stats().tiers],
            shm_socket=segs.socket_name if segs else "",
            segment_bytes=segs.segment_bytes(namespace) if segs else 0,
        )

    @observed
    def RegisterLayout(self, request, context):
        tenant = self.auth.tenant(context)  # the admin or a tenant; not the service token
        if not request.HasField("layout"):
            raise InvalidArgument("RegisterLayout needs a layout")
        if self.stopping:
            raise FailedPrecondition("the node is stopping")
        store, added = self.node.register_layout(layout_from_pb(request.layout), tenant)
        return pb.RegisterLayoutReply(
            namespace=self._namespace_info(store.namespace, store), added=added
        )

    @observed
    def Lookup(self, request, context):
        sel, _ = self._select(request, context)
        res = sel.store.lookup(sel.keys)
        self.metrics.lookup_blocks.labels("hit").inc(res.hits)
        self.metrics.lookup_blocks.labels("miss").inc(len(sel.keys) - res.hits)
        return pb.LookupReply(
            hit_blocks=res.hits, total_blocks=len(sel.keys), tier_codes=res.tier_codes
        )

    @observed
    def OpenShm(self, request, context):
        segs = self.node.segments
        if segs is None:
            raise FailedPrecondition(
                "this node has no per-tenant shared memory (no tenant tokens): map the "
                "namespace's shm_name from GetInfo instead"
            )
        tenant = self.auth.tenant(context)
        self.node.store(request.namespace)  # INVALID_ARGUMENT for a namespace not served
        return pb.OpenShmReply(
            ticket=segs.ticket(request.namespace, tenant),
            socket=segs.socket_name,
            segment_bytes=segs.segment_bytes(request.namespace),
            ttl_s=TICKET_TTL_S,
        )

    @observed
    def Remove(self, request, context):
        sel, _ = self._select(request, context)
        return pb.RemoveReply(removed=sel.store.remove(sel.keys))

    @observed
    def Drain(self, request, context):
        # Moves every tenant's blocks and names peers to pull from this node: the admin's.
        self.auth.require_admin(context, "Drain")
        if self.stopping:
            raise FailedPrecondition("the node is stopping")
        result = drain(
            self.node,
            self.node.config,
            request.max_bytes,
            request.max_seconds,
            list(request.peers),
        )
        if request.leave:
            self.node.drained = True
            leave_soon()
        return pb.DrainReply(
            offered=result.offered,
            blocks=result.blocks,
            bytes=result.bytes,
            seconds=result.seconds,
            peers=[
                pb.DrainPeer(
                    messenger=p.messenger,
                    node_id=p.node_id,
                    blocks=p.blocks,
                    bytes=p.bytes,
                    failed=p.failed,
                )
                for p in result.peers
            ],
        )

    @observed
    def Stats(self, request, context):
        # Blocks, hits and leases of every tenant together: not for a tenant's eyes.
        self.auth.require_admin(context, "Stats")
        out = []
        for ns, store in list(self.node.stores.items()):
            s = store.stats()
            page = store.layout.page_bytes
            out.append(
                pb.NamespaceStats(
                    namespace=ns,
                    tiers=[usage_to_pb(usage_of(t, page)) for t in s.tiers],
                    blocks=s.blocks,
                    hits={t.tier.name.lower(): t.hits for t in s.tiers},
                    misses=s.misses,
                    evictions={t.tier.name.lower(): t.evictions for t in s.tiers},
                    demotions=s.demotions,
                    promotions=s.promotions,
                    corrupt_pages=s.corrupt_pages,
                    bytes_written=s.bytes_written,
                    bytes_read=s.bytes_read,
                    write_leases=s.write_leases,
                    read_leases=s.read_leases,
                    expired_leases=s.expired_leases,
                )
            )
        streams = {k: v for k, v in self.streams.open_by_owner().items() if k}
        tenants = [
            pb.TenantUsage(
                tenant=u.tenant,
                leases=u.leases,
                leased_pages=u.leased_pages,
                stored_blocks=u.stored_blocks,
                streams=u.streams,
            )
            for u in self.node.quotas.usage(streams)
        ]
        return pb.StatsReply(namespaces=out, tenants=tenants)

    # ---- streamed page bytes ----------------------------------------------------------------

    def _stream_owner(self, context) -> str | None:
        """Whose share of the streams a stream takes: its tenant's (None: the admin's, which
        are not bucketed)."""
        return self.auth.tenant(context) or None

    @observed
    def Put(self, request_iterator, context):
        with self.streams.open("Put", context, owner=self._stream_owner(context)) as watch:
            return self._put(watch.receive(request_iterator), context)

    def _put(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidArgument("a Put stream must start with a header naming the blocks")
        sel, tenant = self._select(first.header.blocks, context)
        store, quotas = sel.store, self.node.quotas
        with quotas.reserve(tenant, store.namespace, len(sel.keys)) as held:
            quotas.make_room(store, tenant, len(sel.keys))
            lease = store.allocate(sel.keys)
            held.bind(lease.lease_id, len(lease.to_write), [lease.keys[i] for i in lease.to_write])
        try:
            reply = self._put_pages(request_iterator, sel, lease)
            quotas.committed(store.namespace, lease.lease_id)
            return reply
        finally:
            quotas.ended(store.namespace, lease.lease_id)

    def _put_pages(self, request_iterator, sel: Selection, lease):
        store, page = sel.store, sel.store.layout.page_bytes
        ttl = store.config.lease_ttl_s
        views = [store.page_view(lease, i) if s >= 0 else None for i, s in enumerate(lease.slots)]
        total, pos = len(sel.keys) * page, 0
        renew_at = time.monotonic() + ttl / 3
        try:
            for chunk in request_iterator:
                if chunk.WhichOneof("part") != "data":
                    raise InvalidArgument("a Put stream carries one header, then only data")
                data = memoryview(chunk.data)
                if pos + len(data) > total:
                    raise InvalidArgument(
                        f"Put stream carries more than the {total} bytes "
                        f"of {len(sel.keys)} pages of {page} bytes"
                    )
                if time.monotonic() > renew_at:  # keep our pages ours while a slow client sends
                    store.extend(lease.lease_id)
                    renew_at = time.monotonic() + ttl / 3
                off = 0
                while off < len(data):
                    i, within = divmod(pos, page)
                    take = min(page - within, len(data) - off)
                    if views[i] is not None:
                        views[i][within : within + take] = np.frombuffer(
                            data[off : off + take], dtype=np.uint8
                        )
                    pos += take
                    off += take
            if pos != total:
                raise InvalidArgument(
                    f"Put stream ended after {pos} bytes; {len(sel.keys)} pages need {total}"
                )
            self.metrics.stream_bytes.labels("put").inc(pos)
            res = store.commit(lease.lease_id, written_in_place=True)
        except BaseException:
            try:
                store.abort(lease.lease_id)
            except KVStoreError:
                pass  # expired already: its pages are back in the pool
            raise
        return pb.CommitReply(stored=res.stored, duplicates=res.duplicates)

    @observed_stream
    def Get(self, request, context) -> Iterator[pb.GetChunk]:
        with self.streams.open("Get", context, owner=self._stream_owner(context)) as watch:
            yield from watch.send(self._get(request, context))

    def _get(self, request, context) -> Iterator[pb.GetChunk]:
        sel, tenant = self._select(request.blocks, context)
        store, page = sel.store, sel.store.layout.page_bytes
        keys = self._prefix(store, sel.keys) if request.prefix_only else sel.keys
        chunk = request.chunk_bytes or STREAM_CHUNK_BYTES
        if chunk > 16 << 20:
            raise InvalidArgument("chunk_bytes must be <= 16 MiB")
        with self.node.quotas.reserve(tenant, store.namespace, 0) as held:
            lease = store.acquire(keys)
            self._bind_read(store, held, lease)
        try:
            found = [s >= 0 for s in lease.slots] + [False] * (len(sel.keys) - len(keys))
            yield pb.GetChunk(header=pb.GetHeader(found=found, page_bytes=page))
            buf = np.empty(page, dtype=np.uint8)
            for i, slot in enumerate(lease.slots):
                if slot < 0:
                    continue
                if not store.copy_out(lease, i, buf):
                    context.abort(
                        grpc.StatusCode.DATA_LOSS,
                        f"page #{i} failed its checksum and was dropped; retry the Get",
                    )
                for off in range(0, page, chunk):
                    yield pb.GetChunk(data=buf[off : off + chunk].tobytes())
                self.metrics.stream_bytes.labels("get").inc(page)
        finally:
            self.node.quotas.ended(store.namespace, lease.lease_id)
            try:
                store.release(lease.lease_id)
            except KVStoreError:
                pass  # expired while a slow client read: pins are gone already

    # ---- events ----------------------------------------------------------------------------------

    @observed_stream
    def Events(self, request, context) -> Iterator[pb.EventBatch]:
        self.auth.require_admin(context, "the event feed (Events)", service_ok=True)
        # An Events stream waiting for events is not idle: only a send its client does not take
        # counts, so the conductor's feed lives on, and a feed nobody reads is cut.
        with self.event_streams.open("Events", context) as watch:
            yield from watch.send(self._events(request, context))

    def _events(self, request, context) -> Iterator[pb.EventBatch]:
        hub = self.node.hub
        cursor, need_snapshot = request.after_seq, request.resync
        while context.is_active() and not self.stopping:
            if need_snapshot:
                seq, items = hub.snapshot()
                for start in range(0, max(len(items), 1), EVENT_BATCH):
                    part = items[start : start + EVENT_BATCH]
                    yield pb.EventBatch(
                        events=[
                            cpb.BlockEvent(
                                seq=seq, kind=cpb.EVENT_STORED, key=k, tier=tier_to_pb(t)
                            )
                            for k, t in part
                        ],
                        snapshot=True,
                        snapshot_seq=seq,
                        snapshot_done=start + EVENT_BATCH >= len(items),
                    )
                cursor, need_snapshot = seq, False
            events = hub.read_after(cursor, EVENT_BATCH, timeout_s=0.5)
            if events is None:
                need_snapshot = True
                continue
            if events:
                yield pb.EventBatch(
                    events=[
                        cpb.BlockEvent(
                            seq=e.seq, kind=_EVENT_KIND[e.kind], key=e.key, tier=tier_to_pb(e.tier)
                        )
                        for e in events
                    ]
                )
                cursor = events[-1].seq
