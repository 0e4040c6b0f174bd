"""ConductorService: a thin gRPC layer over ``core.Conductor``.

With etcd (``conductor.membership_watch``, ``conductor.leader``) membership comes from etcd, so the
registry RPCs answer FAILED_PRECONDITION, and only the elected leader schedules: a standby answers
Schedule / ScheduleBatch / ScheduleStream / Complete / CompleteBatch with FAILED_PRECONDITION naming
the leader.

Security: node membership RPCs (register, heartbeat, unregister) need the admin token (tenant
""). Request keys are scoped to the caller's tenant exactly as the node server scopes them
(``kvstore.keys.scope_keys``), so a tenant's request only ever matches its own blocks; request
ids are per tenant too.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvstore.errors import InvalidArgument, KVStoreError, NotFound, echo
from kvstore.keys import scope_keys, select_keys
from kvstore.layout import KVLayout
from plumbing.registration import LEADER_METADATA
from proto import conductor_pb2 as pb
from proto import conductor_pb2_grpc as pbg
from rpc.cluster import check_node_id
from rpc.server import Auth
from rpc.status import observed, observed_stream, status_for
from rpc.wire import descriptor_from_pb, descriptor_to_pb, load_from_pb, load_to_pb

from .convert import decision_to_pb
from .core import Conductor
from .feed import FeedCounters, FeedManager, FeedOptions
from .leader import Leadership
from .metrics import ConductorMetrics
from .scheduler import NoNodeAvailable, Request, SLORejected

log = logging.getLogger(__name__)
MAX_BLOCKS_PER_REQUEST = 65536
MAX_REQUEST_ID = 256
MAX_BATCH = 1024
DEFAULT_MAX_CONTEXT_TOKENS = 131072  # a request's prompt and output together (--max-context-tokens)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ConductorService"].full_name


class _MetricCounters(FeedCounters):
    def __init__(self, metrics: ConductorMetrics) -> None:
        self._m = metrics

    def events(self, n: int) -> None:
        self._m.events.inc(n)

    def resync(self, reason: str) -> None:
        self._m.resyncs.labels(reason).inc()


class ConductorServicer(pbg.ConductorServiceServicer):
    def __init__(
        self,
        conductor: Conductor,
        auth: Auth,
        feed_options: FeedOptions,
        metrics: ConductorMetrics | None = None,
        heartbeat_interval_s: float | None = None,
        leadership: Leadership | None = None,
        membership_source: str = "",
        max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS,
        max_streams: int = 1,
    ) -> None:
        self.conductor = conductor
        # NOTE: a ScheduleStream holds one of the server's few handler threads for its whole
        # life: past this many, a stream is refused (RESOURCE_EXHAUSTED: the client goes unary)
        # rather than let streams starve every unary call.
        self.max_streams = max_streams
        self._streams = threading.BoundedSemaphore(max_streams) if max_streams > 0 else None
        self.max_context_tokens = max_context_tokens
        # NOTE: read per Schedule call; a plain attribute (Leadership.leading) costs nothing.
        self.leadership = leadership or Leadership()
        self.membership_source = membership_source  # "etcd ...": the registry RPCs are off
        self.auth = auth
        self.metrics = metrics or ConductorMetrics(conductor)
        self.feeds = FeedManager(conductor, feed_options, _MetricCounters(self.metrics))
        lease_s = conductor.registry.lease_s
        self.heartbeat_interval_s = heartbeat_interval_s or lease_s / 4
        # Per registry version: namespace -> (layout, page bytes) of the nodes serving it.
        self._layouts: tuple[int, dict[str, tuple[KVLayout, int]]] = (-1, {})
        self.started = time.monotonic()
        self.address = ""  # where it serves, once it does (the leader while it runs alone)
        self._stop = threading.Event()
        self._upkeep = threading.Thread(target=self._maintain, name="conductor-upkeep", daemon=True)
        self._upkeep.start()

    def close(self) -> None:
        self._stop.set()
        self._upkeep.join(5)
        self.feeds.stop_all()
        self.conductor.close()

    # ---- membership -----------------------------------------------------------------------

    def _tenant(self, context) -> str:
        return self.auth.tenant(context) if self.auth.enabled else ""

    def _admin(self, context) -> None:
        if self._tenant(context) != "":
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "node membership needs the cluster's admin token, not a tenant token",
            )

    def _etcd_membership(self, context) -> None:
        if self.membership_source:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this conductor takes its membership from {self.membership_source}: start the "
                "node with --etcd (and the same --etcd-prefix), not --conductor",
            )

    def _redirect(self, context) -> None:
        """A standby: FAILED_PRECONDITION naming the leader (also in trailing metadata
        ``kvcache-leader``), or UNAVAILABLE while nobody leads; clients retry there."""
        self.metrics.redirects.inc()
        leader = self.leadership.leader_hint()
        if leader:
            context.set_trailing_metadata(((LEADER_METADATA, leader),))
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this conductor is a standby; the leader is {leader} (etcd election "
                f"{self.leadership.name}): send Schedule and Complete there",
            )
        context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"no conductor leads yet (etcd election {self.leadership.name}); retry shortly",
        )

    @observed
    def RegisterNode(self, request, context):
        self._admin(context)
        self._etcd_membership(context)
        desc = descriptor_from_pb(request.node)
        if not desc.address:
            raise InvalidArgument(
                "node.address is required: the conductor reads the node's "
                "Events stream there to index its blocks"
            )
        previous = self.conductor.registry.find(desc.node_id)
        if previous is not None and previous.descriptor.address != desc.address:
            # Two live processes sharing one id would take turns replacing each other.
            log.warning(
                "node id %s re-registered from %s while registered from %s: is the id used twice?",
                desc.node_id,
                desc.address,
                previous.descriptor.address,
            )
        state = self.conductor.register(desc, load_from_pb(request.load))
        self.feeds.start(desc.node_id, state.generation, desc.address)
        log.info(
            "node %s registered (generation %d, role %s, address %s, namespaces %s)",
            desc.node_id,
            state.generation,
            desc.role.value,
            desc.address,
            ", ".join(sorted(desc.namespaces)) or "-",
        )
        return pb.RegisterNodeReply(
            generation=state.generation,
            lease_s=self.conductor.registry.lease_s,
            heartbeat_interval_s=self.heartbeat_interval_s,
        )

    @observed
    def Heartbeat(self, request, context):
        self._admin(context)
        self._etcd_membership(context)
        check_node_id(request.node_id)
        load = load_from_pb(request.load) if request.HasField("load") else None
        self.conductor.heartbeat(request.node_id, load, request.generation)
        return pb.HeartbeatReply(lease_s=self.conductor.registry.lease_s)

    @observed
    def UnregisterNode(self, request, context):
        self._admin(context)
        self._etcd_membership(context)
        check_node_id(request.node_id)
        generation = self.conductor.unregister(request.node_id, request.generation)
        if generation is not None:
            self.feeds.stop(request.node_id, generation)
            log.info("node %s unregistered", request.node_id)
        return pb.UnregisterNodeReply(removed=generation is not None)

    # ---- scheduling -----------------------------------------------------------------------

    @observed
    def Schedule(self, request, context):
        if not self.leadership.leading:
            self._redirect(context)
        return self._schedule(request, self._tenant(context))

    @observed
    def ScheduleBatch(self, request, context):
        if not self.leadership.leading:
            self._redirect(context)
        return self._schedule_batch(request, self._tenant(context))

    def _schedule_batch(self, request, tenant: str) -> pb.ScheduleBatchReply:
        reply = pb.ScheduleBatchReply()
        _each(
            request.requests,
            reply.outcomes.add,
            lambda item: {"reply": self._schedule(item, tenant)},
        )
        return reply

    @observed_stream
    def ScheduleStream(self, requests, context):
        """ScheduleBatch for each message of one long-lived stream, answered in order: a front
        end pays the call's own cost (a new call, its metadata and auth, a worker thread's
        hand-offs) once per stream, not per decision. Leadership is checked per message: it can
        move while the stream is open (a standby ends it as it answers Schedule)."""
        tenant = self._tenant(context)
        slots = self._streams
        if slots is None or not slots.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this conductor serves at most {self.max_streams} ScheduleStream calls at once "
                "(--max-streams: each holds a handler thread); use ScheduleBatch",
            )
            return
        try:
            for request in requests:
                if not self.leadership.leading:
                    self._redirect(context)
                yield self._schedule_batch(request, tenant)
        finally:
            slots.release()

    def _schedule(self, request, tenant: str) -> pb.ScheduleReply:
        if len(request.request_id) > MAX_REQUEST_ID:
            raise InvalidArgument(f"request_id is longer than {MAX_REQUEST_ID} characters")
        sel = request.blocks
        layout, page_bytes = self._layout(sel.namespace)
        raw, prompt = self._raw_keys(sel, layout)
        keys = scope_keys(raw, tenant) if tenant else raw
        if request.prompt_tokens:
            if request.prompt_tokens < prompt:
                raise InvalidArgument(
                    f"prompt_tokens {request.prompt_tokens} is less than the "
                    f"{prompt} tokens the blocks hold"
                )
            prompt = request.prompt_tokens
        if prompt == 0:
            raise InvalidArgument(
                "the request has no prompt: give token ids, keys or prompt_tokens"
            )
        # NOTE: the ledger believes what it is told: a claimed prompt of 2^32 tokens would set
        # every node's queue estimate to years (and every SLO out of reach) until it aged out.
        limit = min(self.max_context_tokens, MAX_BLOCKS_PER_REQUEST * layout.block_tokens)
        if prompt + request.output_tokens > limit:
            raise InvalidArgument(
                f"prompt_tokens {prompt} + output_tokens {request.output_tokens} exceed the "
                f"context of {limit} tokens this conductor schedules (--max-context-tokens)"
            )
        rid = request.request_id or uuid.uuid4().hex
        try:
            decision = self.conductor.schedule(
                Request(
                    request_id=_scoped_id(tenant, rid),
                    keys=keys,
                    prompt_tokens=prompt,
                    block_tokens=layout.block_tokens,
                    output_tokens=request.output_tokens,
                    namespace=sel.namespace,
                    ttft_slo_s=request.ttft_slo_s or None,
                    tbt_slo_s=request.tbt_slo_s or None,
                    block_bytes=page_bytes,
                    exclude=frozenset(request.exclude_nodes),
                    tenant=tenant,
                    aggregated=request.aggregated,
                    disaggregate_above=request.disaggregate_above,
                    policy=request.policy,
                )
            )
        except SLORejected as e:
            self.metrics.rejections.labels(e.slo.lower()).inc()
            raise
        except NoNodeAvailable:
            self.metrics.rejections.labels("no_node").inc()
            raise
        self.metrics.decided(decision)
        reply = decision_to_pb(decision, rid)
        if tenant and decision.transfer is not None:
            # NOTE: a tenant names its keys as it computes them; its messenger scopes them (a
            # tenant's SubmitTransfer moves only its own blocks), so the plan names them so too.
            plan = decision.transfer
            reply.transfers[0].key_bytes = b"".join(
                raw[plan.first_block : plan.first_block + len(plan.keys)]
            )
        return reply

    @observed
    def Complete(self, request, context):
        if not self.leadership.leading:
            self._redirect(context)
        self._complete(request, self._tenant(context))
        return pb.CompleteReply()

    @observed
    def CompleteBatch(self, request, context):
        if not self.leadership.leading:
            self._redirect(context)
        tenant = self._tenant(context)
        reply = pb.CompleteBatchReply()

        def one(item: pb.CompleteRequest) -> dict[str, Any]:
            self._complete(item, tenant)
            return {}  # an empty outcome: done

        _each(request.requests, reply.outcomes.add, one)
        return reply

    def _complete(self, request, tenant: str) -> None:
        if not request.request_id:
            raise InvalidArgument("request_id is required")
        if len(request.request_id) > MAX_REQUEST_ID:  # longer than Schedule takes: never scheduled
            raise InvalidArgument(f"request_id is longer than {MAX_REQUEST_ID} characters")
        rid = _scoped_id(tenant, request.request_id)
        if not request.prefill_seconds >= 0 or not request.transfer_seconds >= 0:
            raise InvalidArgument("prefill_seconds and transfer_seconds must be >= 0")
        measured = request.prefill_seconds or None
        transfer = request.transfer_seconds or None
        try:
            if request.phase == pb.COMPLETE_PHASE_PREFILLED:
                self.conductor.prefill_done(rid, measured, transfer)
            else:
                if measured or transfer:
                    self.conductor.prefill_done(rid, measured, transfer)
                self.conductor.complete(rid)
        except NotFound:
            # A request the previous leader scheduled: its ledger went with it. Within the
            # ledger's horizon of a takeover that is expected, not the caller's mistake.
            since = time.monotonic() - self.leadership.took_lead_at
            if since > self.conductor.scheduler.config.stale_after_s:
                raise

    # ---- queries --------------------------------------------------------------------------

    @observed
    def ListNodes(self, request, context):
        self._tenant(context)
        views = self.conductor.nodes()
        c = self.conductor
        with c.lock:
            keys, pending = len(c.index), c.scheduler.pending()
        decisions, rejections = self.metrics.totals()
        return pb.ListNodesReply(
            policy=c.scheduler.policy.name,
            indexed_keys=keys,
            pending_requests=pending,
            decisions=decisions,
            rejections=rejections,
            uptime_s=time.monotonic() - self.started,
            leader=self.leadership.leader_hint() if self.membership_source else self.address,
            nodes=[
                pb.NodeStatus(
                    node=descriptor_to_pb(v.descriptor),
                    generation=v.generation,
                    load=load_to_pb(v.load),
                    lease_remaining_s=v.lease_remaining_s,
                    indexed_blocks=v.indexed_blocks,
                    last_seq=v.last_seq,
                    resyncing=v.resyncing,
                    queue_s=v.queue_s,
                    prefill_pending=v.prefill_pending,
                    decode_requests=v.decode_requests,
                    decode_tokens=v.decode_tokens,
                )
                for v in views
            ],
        )

    @observed
    def Locate(self, request, context):
        tenant = self._tenant(context)
        layout, _ = self._layout(request.namespace)
        keys, _ = self._keys(request, layout, tenant)
        found = self.conductor.locate(keys)
        return pb.LocateReply(
            total_blocks=len(keys),
            nodes=[
                pb.NodePrefix(node_id=node, blocks=len(tiers), tiers=[int(t) + 1 for t in tiers])
                for node, tiers in sorted(found.items(), key=lambda kv: (-len(kv[1]), kv[0]))
            ],
        )

    # ---- helpers --------------------------------------------------------------------------

    def _layout(self, namespace: str) -> tuple[KVLayout, int]:
        """The layout registered for ``namespace`` and its page bytes."""
        if not namespace:
            raise InvalidArgument(
                "blocks.namespace is required (the model layout fingerprint, "
                "e.g. 'llama|L32|H8|D128|bfloat16|B256')"
            )
        version, layouts = self._layouts
        registry = self.conductor.registry
        if version != registry.version:
            with self.conductor.lock:
                version = registry.version
                layouts = {
                    l.namespace: (l, l.page_bytes)
                    for s in registry.nodes()
                    for l in s.descriptor.layouts
                }
            self._layouts = (version, layouts)
        served = layouts.get(namespace)
        if served is None:
            raise NoNodeAvailable(
                f"no registered node serves namespace {echo(namespace)}; "
                f"served: {', '.join(sorted(layouts)) or 'none'}"
            )
        return served

    @classmethod
    def _keys(cls, sel, layout: KVLayout, tenant: str) -> tuple[list[bytes], int]:
        """The request's keys as stored for ``tenant`` and the tokens they stand for."""
        raw, prompt = cls._raw_keys(sel, layout)
        return (scope_keys(raw, tenant) if tenant else raw), prompt

    @staticmethod
    def _raw_keys(sel, layout: KVLayout) -> tuple[list[bytes], int]:
        """The request's keys as the caller computes them, and the tokens they stand for."""
        return select_keys(
            sel.namespace,
            sel.salt,
            layout.block_tokens,
            MAX_BLOCKS_PER_REQUEST,
            sel.keys,
            sel.token_ids,
            sel.token_bytes,
            sel.key_bytes,
        )

    def _maintain(self) -> None:
        """Drop lapsed nodes (and their feeds), expire stale requests, sweep the index."""
        period = min(0.25, self.conductor.registry.lease_s / 8)
        while not self._stop.wait(period):
            try:
                report = self.conductor.maintain()
            except Exception:  # keep the upkeep thread alive, but say so loudly
                log.exception("conductor upkeep failed")
                continue
            for node_id, generation in report.expired_nodes:
                self.metrics.expirations.inc()
                self.feeds.stop(node_id, generation)
                log.warning("node %s: lease lapsed; dropped from scheduling and the index", node_id)
            if report.stale_requests:
                log.warning(
                    "%d scheduled requests were never completed; dropped from the ledger",
                    len(report.stale_requests),
                )


def _each(
    items: Sequence[Any], add: Callable[..., Any], one: Callable[[Any], dict[str, Any]]
) -> None:
    """A batch RPC's items, each answered on its own: ``add(**one(item))``, or its error's status
    code and message (one bad item fails only itself). NOTE: outcomes are added to the reply
    in place: a list of messages passed to the constructor is copied once more, per outcome."""
    if len(items) > MAX_BATCH:
        raise InvalidArgument(f"{len(items)} requests in one batch; the limit is {MAX_BATCH}")
    for item in items:
        try:
            add(**one(item))
        except (KVStoreError, ValueError) as e:
            code = (
                status_for(e) if isinstance(e, KVStoreError) else grpc.StatusCode.INVALID_ARGUMENT
            )
            add(code=code.value[0], message=str(e))


def _scoped_id(tenant: str, request_id: str) -> str:
    return f"{tenant}\x00{request_id}" if tenant else request_id
