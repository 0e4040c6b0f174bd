"""``MessengerService`` over gRPC: a thin servicer over ``Mover``; protobuf <-> domain here only."""

from __future__ import annotations

import threading
import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.errors import InvalidArgument
from kvstore.keys import check_keys, scope_keys
from kvstore.leases import check_hold
from proto import common_pb2 as cpb
from proto import messenger_pb2 as pb
from proto import messenger_pb2_grpc as pbg
from rpc.server import SERVICE, Auth
from rpc.status import observed

from .data_server import DataServer
from .mover import BatchSnapshot, EntryRequest, Mover
from .transport import EntryResult, Outcome

CODE_OF: dict[Outcome, str] = {
    Outcome.OK: "OK",
    Outcome.NOT_FOUND: grpc.StatusCode.NOT_FOUND.name,
    Outcome.DATA_LOSS: grpc.StatusCode.DATA_LOSS.name,
    Outcome.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE.name,
    Outcome.INVALID: grpc.StatusCode.INVALID_ARGUMENT.name,
    Outcome.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED.name,
    Outcome.CANCELLED: grpc.StatusCode.CANCELLED.name,
    Outcome.INTERNAL: grpc.StatusCode.INTERNAL.name,
}
DEFAULT_WAIT_S = 30.0
MAX_WAIT_S = 600.0
# A waiting TransferStatus holds a gRPC worker thread while it waits: at most this many wait at
# once (of the server's 32 workers); more are answered at once, as a status without wait, and
# the client library polls (MessengerClient.status). Waits never starve the other calls.
MAX_WAITING = 16


class MessengerMetrics:
    def __init__(self, data_server: DataServer) -> None:
        self.registry = CollectorRegistry()
        self.entries = Counter(
            "kvcache_messenger_transfer_entries",
            "Transfer entries finished on this (destination) messenger",
            ["outcome"],
            registry=self.registry,
        )
        self.bytes = Counter(
            "kvcache_messenger_received_bytes",
            "Page bytes received and committed",
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvcache_messenger_rpc_seconds",
            "Messenger RPC latency",
            ["method"],
            registry=self.registry,
        )
        self.errors = Counter(
            "kvcache_messenger_rpc_errors",
            "Messenger RPCs failed, by code",
            ["method", "code"],
            registry=self.registry,
        )
        self.job_seconds = Histogram(
            "kvcache_messenger_job_seconds",
            "Time of one transfer job (allocate, fetch, commit)",
            buckets=(1e-3, 5e-3, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
            registry=self.registry,
        )
        self.status_waits = Gauge(
            "kvcache_messenger_status_waits",
            f"TransferStatus calls waiting now (each holds a worker; at most {MAX_WAITING})",
            registry=self.registry,
        )
        self.registry.register(_DataServerCollector(data_server))
        # Plain totals for the Stats RPC (kvcache status), beside the Prometheus series.
        self._lock = threading.Lock()
        self.entries_done = self.entries_failed = self.bytes_received = 0

    def totals(self) -> tuple[int, int, int]:
        """(entries done, entries failed, page bytes received) since start."""
        with self._lock:
            return self.entries_done, self.entries_failed, self.bytes_received

    def on_job(self, seconds: float, pages: int) -> None:
        self.job_seconds.observe(seconds)

    def on_entry(self, namespace: str, result: EntryResult, nbytes: int) -> None:
        self.entries.labels(result.outcome.value).inc()
        if nbytes:
            self.bytes.inc(nbytes)
        with self._lock:
            if result.ok:
                self.entries_done += 1
            else:
                self.entries_failed += 1
            self.bytes_received += nbytes


class _DataServerCollector(Collector):
    def __init__(self, server: DataServer) -> None:
        self._server = server

    def collect(self):
        s = self._server.stats
        sent_pages = CounterMetricFamily(
            "kvcache_messenger_sent_pages", "Pages served to peers on the data port"
        )
        sent_pages.add_metric([], s.pages_sent)
        sent_bytes = CounterMetricFamily(
            "kvcache_messenger_sent_bytes", "Bytes served to peers on the data port"
        )
        sent_bytes.add_metric([], s.bytes_sent)
        dropped = CounterMetricFamily(
            "kvcache_messenger_dropped_connections",
            "Data-port connections dropped for protocol violations",
        )
        dropped.add_metric([], s.dropped_connections)
        refused = CounterMetricFamily(
            "kvcache_messenger_refused_connections",
            "Data-port connections refused at accept: --max-connections were open",
        )
        refused.add_metric([], s.refused_connections)
        timed_out = CounterMetricFamily(
            "kvcache_messenger_timed_out_connections",
            "Data-port connections cut by a deadline (idle, slow frame, FETCH response not read)",
        )
        timed_out.add_metric([], s.timed_out_connections)
        accept_errors = CounterMetricFamily(
            "kvcache_messenger_accept_errors",
            "Failed accepts on the data port (e.g. out of file descriptors)",
        )
        accept_errors.add_metric([], s.accept_errors)
        open_ = GaugeMetricFamily(
            "kvcache_messenger_open_connections", "Data-port connections open now"
        )
        open_.add_metric([], self._server.open_connections())
        budget = self._server.budget
        pinned = GaugeMetricFamily(
            "kvcache_messenger_pinned_pages",
            "Pages pinned on the node for peers now (reserved against the pin budget)",
        )
        pinned.add_metric([], budget.pinned)
        waits = CounterMetricFamily(
            "kvcache_messenger_pin_budget_waits",
            "Requests that waited for their peer's other connections to release pins "
            "(--pin-share-per-peer)",
        )
        waits.add_metric([], budget.waits)
        refusals = CounterMetricFamily(
            "kvcache_messenger_pin_budget_refusals",
            "Requests refused for want of pin budget (--pin-share-per-*)",
        )
        refusals.add_metric([], budget.refusals)
        yield from (sent_pages, sent_bytes, dropped, refused, timed_out, accept_errors, open_)
        yield from (pinned, waits, refusals)


def status_reply(snap: BatchSnapshot) -> pb.TransferStatusReply:
    entries = []
    for e in snap.entries:
        if e.result is None:
            entries.append(pb.EntryStatus(key=e.key, state=pb.ENTRY_PENDING))
        elif e.result.ok:
            entries.append(
                pb.EntryStatus(key=e.key, state=pb.ENTRY_DONE, already_present=e.already_present)
            )
        else:
            entries.append(
                pb.EntryStatus(
                    key=e.key,
                    state=pb.ENTRY_FAILED,
                    code=CODE_OF[e.result.outcome],
                    reason=e.result.reason,
                )
            )
    return pb.TransferStatusReply(
        batch_id=snap.batch_id,
        entries=entries,
        pending=snap.count("pending"),
        done=snap.count("done"),
        failed=snap.count("failed"),
        finished=snap.finished,
        bytes_moved=snap.bytes_moved,
        elapsed_s=snap.elapsed_s,
    )


class MessengerServicer(pbg.MessengerServiceServicer):
    def __init__(
        self,
        mover: Mover,
        info: pb.MessengerInfo,
        auth: Auth | None = None,
        metrics: MessengerMetrics | None = None,
    ) -> None:
        self.mover = mover
        self.info = info
        self.auth = auth or Auth()
        self.metrics = metrics  # RPC latency and errors (rpc.status.observed), when given
        self.data_server: DataServer | None = None  # for Stats: bytes sent, connections
        self._waiting = threading.BoundedSemaphore(MAX_WAITING)
        self.started = time.monotonic()

    def _owner(self, context) -> tuple[str, str | None]:
        """(the caller's identity, the owner whose batches it may see: None for all)."""
        who = self.auth.identity(context)
        return who, (None if who in ("", SERVICE) else who)

    @observed
    def SubmitTransfer(self, request: pb.SubmitTransferRequest, context) -> pb.SubmitTransferReply:
        # NOTE: the admin and the service (the conductor's hook) name keys as stored; a tenant
        # names them as it wrote them, and they are scoped to it here, so its pull moves only
        # its own blocks, whatever keys it names.
        who, owner = self._owner(context)
        wait = self._timeout(request.wait_s, "wait_s") if request.wait_s else 0.0
        if request.destination_tier not in (cpb.TIER_UNSPECIFIED, cpb.TIER_DRAM):
            raise InvalidArgument(
                f"destination tier {cpb.Tier.Name(request.destination_tier)} is not supported: "
                "the messenger writes into the node's shared DRAM pool (TIER_DRAM); the node's "
                "eviction policy moves blocks between tiers"
            )
        if not request.namespace:
            raise InvalidArgument("namespace is required")
        check_hold(request.hold_s)
        names = [e.key for e in request.entries]
        tenant = who not in ("", SERVICE)
        keys = scope_keys(check_keys(names), who) if tenant else names
        entries = [EntryRequest(k, e.source, e.source_data) for k, e in zip(keys, request.entries)]
        batch_id, joined = self.mover.submit(
            request.namespace,
            entries,
            owner=who,
            names=names if tenant else None,
            chain=request.chain,
            urgent=request.urgent,
            hold_s=request.hold_s,
        )
        reply = pb.SubmitTransferReply(batch_id=batch_id, entries=len(entries), deduplicated=joined)
        if wait:
            reply.status.CopyFrom(self._status(batch_id, wait, owner, context))
        return reply

    @observed
    def TransferStatus(self, request: pb.TransferStatusRequest, context) -> pb.TransferStatusReply:
        _, owner = self._owner(context)
        timeout = self._timeout(request.timeout_s or DEFAULT_WAIT_S, "timeout_s")
        if not request.wait:
            return status_reply(self.mover.status(request.batch_id, False, timeout, owner))
        return self._status(request.batch_id, timeout, owner, context)

    @staticmethod
    def _timeout(seconds: float, name: str) -> float:
        if not 0 < seconds <= MAX_WAIT_S:  # NOTE: NaN fails it too
            raise InvalidArgument(f"{name} must be in (0, {MAX_WAIT_S}], got {seconds}")
        return seconds

    def _status(
        self, batch_id: str, timeout: float, owner: str | None, context
    ) -> pb.TransferStatusReply:
        """The batch's status once finished or ``timeout`` passed (within the call's own
        deadline); at once while ``MAX_WAITING`` calls wait already (each holds a worker)."""
        if context.time_remaining() is not None:
            timeout = min(timeout, max(0.0, context.time_remaining() - 0.1))
        if not self._waiting.acquire(blocking=False):
            return status_reply(self.mover.status(batch_id, False, timeout, owner))
        waits = self.metrics.status_waits if self.metrics is not None else None
        if waits is not None:
            waits.inc()
        try:
            return status_reply(self.mover.status(batch_id, True, timeout, owner))
        finally:
            if waits is not None:
                waits.dec()
            self._waiting.release()

    @observed
    def Cancel(self, request: pb.CancelRequest, context) -> pb.TransferStatusReply:
        _, owner = self._owner(context)
        return status_reply(self.mover.cancel(request.batch_id, owner))

    def GetInfo(self, request, context) -> pb.MessengerInfo:
        return self.info

    @observed
    def Stats(self, request, context) -> pb.MessengerStats:
        self.auth.require_admin(context, "Stats")
        batches, entries = self.mover.in_flight()
        reply = pb.MessengerStats(
            batches_in_flight=batches,
            entries_in_flight=entries,
            uptime_s=time.monotonic() - self.started,
        )
        if self.metrics is not None:
            reply.entries_done, reply.entries_failed, reply.bytes_received = self.metrics.totals()
        if self.data_server is not None:
            s = self.data_server.stats
            reply.bytes_sent, reply.pages_sent = s.bytes_sent, s.pages_sent
            reply.open_connections = self.data_server.open_connections()
        return reply
