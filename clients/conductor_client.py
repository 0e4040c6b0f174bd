"""``ConductorClient``: a small typed client for ``ConductorService`` (front ends, tests, bench).

Errors raise ``KVCacheRpcError`` with the server's status code and message (for example
RESOURCE_EXHAUSTED naming the SLO that cannot be met).

Several conductors (one leads, the others stand by: ``conductor.leader``): give the client all
their addresses, or etcd's endpoints, or both. A call that meets a standby follows its redirect
(FAILED_PRECONDITION naming the leader in ``kvcache-leader`` metadata); one that finds no
conductor (UNAVAILABLE: the leader died, or nobody leads yet) asks etcd who leads, or tries the
next address, with a short backoff, for up to ``failover_timeout_s``. So a failover costs a
caller time, not an error. With a single address and no etcd, UNAVAILABLE is raised at once, as
before (only redirects are followed).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Sequence

import grpc

from kvstore.errors import KVStoreError
from plumbing.etcd import DEFAULT_PREFIX, EtcdClient, EtcdError, EtcdUnavailable
from plumbing.registration import LEADER_METADATA, ConductorRecord, election_name
from proto import common_pb2 as cpb
from proto import conductor_pb2 as pb
from proto import conductor_pb2_grpc as pbg
from rpc.channel import check_health, make_channel
from rpc.status import KVCacheRpcError
from rpc.wire import selector_to_pb


def selector(
    namespace: str, keys: Sequence[bytes] | None = None, tokens: Any = None, salt: bytes | str = b""
) -> cpb.BlockSelector:
    """A BlockSelector from keys or token ids (tokens travel as packed little-endian uint32)."""
    return selector_to_pb(namespace, keys, tokens, salt)


def schedule_request(
    namespace: str,
    keys: Sequence[bytes] | None = None,
    tokens: Any = None,
    salt: bytes | str = b"",
    request_id: str = "",
    prompt_tokens: int = 0,
    output_tokens: int = 0,
    ttft_slo_s: float = 0.0,
    tbt_slo_s: float = 0.0,
    exclude_nodes: Sequence[str] = (),
    aggregated: bool = False,
    disaggregate_above: int = 0,
    policy: str = "",
) -> pb.ScheduleRequest:
    """What ``ConductorClient.schedule`` sends (for a ``schedule_batch`` too)."""
    return pb.ScheduleRequest(
        request_id=request_id,
        blocks=selector_to_pb(namespace, keys, tokens, salt),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        ttft_slo_s=ttft_slo_s,
        tbt_slo_s=tbt_slo_s,
        exclude_nodes=list(exclude_nodes),
        aggregated=aggregated,
        disaggregate_above=disaggregate_above,
        policy=policy,
    )


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def outcome_error(code: int, message: str, method: str) -> KVCacheRpcError | None:
    """The error a batch call's outcome stands for (None: OK)."""
    if code == 0:
        return None
    return KVCacheRpcError(_CODES.get(code, grpc.StatusCode.UNKNOWN), message, method)


def schedule_results(
    outcomes: Sequence[pb.ScheduleOutcome],
) -> list[pb.ScheduleReply | KVCacheRpcError]:
    """A ScheduleBatch's outcomes as each call's reply or error (a coalescer's results)."""
    return [
        o.reply if (e := outcome_error(o.code, o.message, "Schedule")) is None else e
        for o in outcomes
    ]


class ConductorClient:
    def __init__(
        self,
        address: str | Sequence[str] = "",
        token: str | None = None,
        tls_ca_file: str | None = None,
        timeout_s: float = 10.0,
        *,
        etcd: str | Sequence[str] | None = None,
        etcd_prefix: str = DEFAULT_PREFIX,
        failover_timeout_s: float = 30.0,
        etcd_ca: str | None = None,
        etcd_cert: str | None = None,
        etcd_key: str | None = None,
    ) -> None:
        """``address``: one conductor, or several (a list or comma-separated); ``etcd``:
        endpoints to look the leader up in (election ``<etcd_prefix>/conductor/leader``), with
        ``etcd_ca`` / ``etcd_cert`` / ``etcd_key`` for an etcd serving TLS. A ``token`` goes to a
        leader learned from etcd or a standby's redirect only over TLS (``tls_ca_file``):
        whoever writes etcd or answers as a standby would collect it."""
        items = address.split(",") if isinstance(address, str) else list(address)
        self.addresses = [a.strip() for a in items if a.strip()]
        self._etcd = (
            EtcdClient(etcd, ca_file=etcd_ca, cert_file=etcd_cert, key_file=etcd_key)
            if etcd
            else None
        )
        if not self.addresses and self._etcd is None:
            raise ValueError("give a conductor address, several, or etcd endpoints")
        self._election = election_name(etcd_prefix.rstrip("/"))
        self._token, self._tls_ca_file = token, tls_ca_file
        self.timeout_s = timeout_s
        self.failover_timeout_s = failover_timeout_s
        self.failovers = 0  # times the client moved to another conductor
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self.address = ""
        self.stub: Any = None
        self._channel: grpc.Channel | None = None
        if self.addresses:
            self._use(self.addresses[0])

    def schedule(
        self,
        namespace: str,
        keys: Sequence[bytes] | None = None,
        tokens: Any = None,
        salt: bytes | str = b"",
        request_id: str = "",
        prompt_tokens: int = 0,
        output_tokens: int = 0,
        ttft_slo_s: float = 0.0,
        tbt_slo_s: float = 0.0,
        exclude_nodes: Sequence[str] = (),
        aggregated: bool = False,
        disaggregate_above: int = 0,
        policy: str = "",
    ) -> pb.ScheduleReply:
        reply: pb.ScheduleReply = self._call(
            "Schedule",
            schedule_request(
                namespace, keys, tokens, salt, request_id, prompt_tokens, output_tokens,
                ttft_slo_s, tbt_slo_s, exclude_nodes, aggregated, disaggregate_above, policy,
            ),
        )  # fmt: skip
        return reply

    def schedule_batch(self, requests: Sequence[pb.ScheduleRequest]) -> list[pb.ScheduleOutcome]:
        """One outcome per request, in order (``code`` 0: ``reply`` is set)."""
        return list(
            self._call("ScheduleBatch", pb.ScheduleBatchRequest(requests=requests)).outcomes
        )

    def schedule_stream(self) -> "ScheduleStream":
        """ScheduleBatch over one long-lived ScheduleStream call (``ScheduleStream``)."""
        return ScheduleStream(self)

    def prefilled(
        self, request_id: str, prefill_seconds: float = 0.0, transfer_seconds: float = 0.0
    ) -> None:
        self._call(
            "Complete",
            pb.CompleteRequest(
                request_id=request_id,
                phase=pb.COMPLETE_PHASE_PREFILLED,
                prefill_seconds=prefill_seconds,
                transfer_seconds=transfer_seconds,
            ),
        )

    def complete(self, request_id: str, transfer_seconds: float = 0.0) -> None:
        self._call(
            "Complete",
            pb.CompleteRequest(
                request_id=request_id,
                phase=pb.COMPLETE_PHASE_FINISHED,
                transfer_seconds=transfer_seconds,
            ),
        )

    def complete_batch(self, requests: Sequence[pb.CompleteRequest]) -> list[pb.CompleteOutcome]:
        """One outcome per Complete, in order (``code`` 0: done)."""
        return list(
            self._call("CompleteBatch", pb.CompleteBatchRequest(requests=requests)).outcomes
        )

    def complete_results(
        self, requests: Sequence[pb.CompleteRequest]
    ) -> list[None | KVCacheRpcError]:
        """``complete_batch`` as each Complete's error, None where done (a coalescer's
        results)."""
        return [outcome_error(o.code, o.message, "Complete") for o in self.complete_batch(requests)]

    def list_nodes(self) -> pb.ListNodesReply:
        reply: pb.ListNodesReply = self._call("ListNodes", pb.ListNodesRequest())
        return reply

    def locate(
        self,
        namespace: str,
        keys: Sequence[bytes] | None = None,
        tokens: Any = None,
        salt: bytes | str = b"",
    ) -> dict[str, int]:
        """Node id -> how many leading blocks it holds."""
        reply = self._call("Locate", selector_to_pb(namespace, keys, tokens, salt))
        return {n.node_id: n.blocks for n in reply.nodes}

    @property
    def token(self) -> str | None:
        return self._token

    @property
    def tls_ca_file(self) -> str | None:
        return self._tls_ca_file

    def health(self) -> str:
        """gRPC health: "SERVING", "NOT_SERVING", or why the check failed ("UNAVAILABLE")."""
        if self._channel is None:  # only etcd given, no call made yet: find the leader
            leader = self._lookup_leader()
            if not leader:
                return "UNAVAILABLE"
            self._use(leader)
        assert self._channel is not None
        return check_health(self._channel, min(self.timeout_s, 5.0))

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
        if self._etcd is not None:
            self._etcd.close()

    # ---- finding the leader -------------------------------------------------------------------

    def _use(self, address: str) -> None:
        """Send calls to ``address`` from now on (channels are kept for switching back)."""
        if self._token and not self._tls_ca_file and address not in self.addresses:
            raise KVCacheRpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the leader {address} was learned from etcd or a redirect: the token goes "
                "there only over TLS (give tls_ca_file, the cluster's CA), never in clear",
                "connect",
            )
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = make_channel(
                    address, self._token, self._tls_ca_file
                )
            # NOTE: the generated *_pb2_grpc.py stubs carry no annotations (replies are Any).
            self.stub = pbg.ConductorServiceStub(channel)  # type: ignore[no-untyped-call]
            self.address, self._channel = address, channel

    def _call(self, name: str, request: Any) -> Any:
        """One RPC to the leader, following redirects and failovers (module docstring)."""
        deadline = 0.0
        backoff = 0.05
        while True:
            if self.stub is None:
                failed: grpc.RpcError | None = None
            else:
                try:
                    return getattr(self.stub, name)(request, timeout=self.timeout_s)
                except grpc.RpcError as e:
                    failed = e
            leader = redirect_of(failed)
            fail_over = failed is None or (
                failed.code() == grpc.StatusCode.UNAVAILABLE
                and (self._etcd is not None or len(self.addresses) > 1)
            )
            if failed is not None and leader is None and not fail_over:
                raise KVCacheRpcError.of(failed, name) from None
            now = time.monotonic()
            deadline = deadline or now + self.failover_timeout_s
            if now > deadline:
                code = failed.code() if failed is not None else grpc.StatusCode.UNAVAILABLE
                why = failed.details() if failed is not None else "no conductor found"
                raise KVCacheRpcError(
                    code, f"{why} (no conductor led within {self.failover_timeout_s:g} s)", name
                )
            if leader is None or leader == self.address:
                time.sleep(backoff)  # the leader is gone, or nobody leads yet
                backoff = min(backoff * 2, 0.5)
                leader = self._lookup_leader()
            if leader and leader != self.address:
                self.failovers += bool(self.address)  # the first lookup is no failover
                self._use(leader)

    def _lookup_leader(self) -> str:
        """Who leads, by etcd; without an answer from etcd, the next address given."""
        if self._etcd is not None:
            try:
                kv = self._etcd.leader(self._election)
                if kv is not None:
                    return ConductorRecord.decode(kv.value).address
                return ""  # nobody leads yet: wait for the election
            except (EtcdUnavailable, EtcdError, KVStoreError):
                pass
        if not self.addresses:
            return ""
        i = self.addresses.index(self.address) if self.address in self.addresses else -1
        return self.addresses[(i + 1) % len(self.addresses)]

    def __enter__(self) -> "ConductorClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ScheduleStream:
    """``schedule_batch`` over one ScheduleStream call of ``client``'s, opened at the first and
    kept for the next: the gRPC call's own cost (about half of a unary Schedule's here) is paid
    once per stream. One message in flight (a lock): its answer is the next reply, read by the
    stream's own thread, and waited for at most the client's ``timeout_s`` (then the stream is
    cancelled and DEADLINE_EXCEEDED raised: never a hang). A stream that a standby ends
    (redirect) or that finds no conductor (UNAVAILABLE) is dropped and that batch goes as a
    unary ScheduleBatch, which follows redirects and failovers as every call of the client does;
    the next batch opens a new stream to wherever the client then points. Any other failure
    ends the stream too and raises ``KVCacheRpcError``. A conductor that refuses the stream (its
    ``--max-streams`` are taken, or it predates ScheduleStream) gets unary ScheduleBatch calls
    for ``REFUSED_S`` before the next try. Thread-safe; ``close()`` ends the call."""

    _ENDED = object()  # the server closed the stream with OK (not something it does)
    REFUSED_S = 30.0  # after a refused stream, unary calls this long before asking again

    def __init__(self, client: ConductorClient) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._sent: queue.SimpleQueue[pb.ScheduleBatchRequest | None] | None = None
        self._got: queue.SimpleQueue[Any] | None = None  # replies, an RpcError, or _ENDED
        self._call: Any = None
        self._unary_until = 0.0
        self.opened = 0  # streams opened (the tests and the bench read it)

    def schedule_batch(self, requests: Sequence[pb.ScheduleRequest]) -> list[pb.ScheduleOutcome]:
        """One outcome per request, in order (``code`` 0: ``reply`` is set)."""
        message = pb.ScheduleBatchRequest(requests=requests)
        with self._lock:
            if self._call is None and (time.monotonic() < self._unary_until or not self._open()):
                return self.client.schedule_batch(requests)  # it finds a conductor or says why
            assert self._sent is not None and self._got is not None
            self._sent.put(message)
            try:
                got = self._got.get(timeout=self.client.timeout_s)
            except queue.Empty:
                self._end()
                raise KVCacheRpcError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no answer on the stream within {self.client.timeout_s:g} s",
                    "ScheduleStream",
                ) from None
            if isinstance(got, pb.ScheduleBatchReply):
                return list(got.outcomes)
            self._end()
            if isinstance(got, grpc.RpcError) and stream_refused(got, "ScheduleStream"):
                self._unary_until = time.monotonic() + self.REFUSED_S
        return self.client.schedule_batch(requests)

    @property
    def streaming(self) -> bool:
        """A stream is open (False before the first batch, after a failure, and while the
        conductor's refusal sends batches unary)."""
        return self._call is not None

    def _open(self) -> bool:
        if self.client.stub is None:  # no call made yet (only etcd given): find the leader
            self.client.health()
        if self.client.stub is None:
            return False
        sent: queue.SimpleQueue[pb.ScheduleBatchRequest | None] = queue.SimpleQueue()
        got: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # NOTE: no deadline on the call: the stream lives as long as its front end; each
        # message's answer is waited for with the client's timeout instead.
        call = self.client.stub.ScheduleStream(iter(sent.get, None))
        threading.Thread(
            target=self._read, args=(call, got), name="schedule-stream", daemon=True
        ).start()
        self._sent, self._got, self._call = sent, got, call
        self.opened += 1
        return True

    @classmethod
    def _read(cls, call: Any, got: "queue.SimpleQueue[Any]") -> None:
        try:
            for reply in call:
                got.put(reply)
            got.put(cls._ENDED)
        except grpc.RpcError as e:  # the call's end: its status (CANCELLED after _end)
            got.put(e)

    def _end(self) -> None:
        if self._sent is not None:
            self._sent.put(None)  # ends the request iterator: the call half-closes
        if self._call is not None:
            self._call.cancel()
        self._sent = self._got = self._call = None

    def close(self) -> None:
        with self._lock:
            self._end()

    def __enter__(self) -> "ScheduleStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stream_refused(error: grpc.RpcError, method: str) -> bool:
    """What ends a ScheduleStream with ``error`` means for its batch, which then goes unary:
    True where the conductor refuses streams (its ``--max-streams`` are taken, or it predates
    ScheduleStream: ask again later), False for a redirect or no conductor (a unary call
    follows the one and fails over from the other). Anything else is the batch's own failure:
    raised as ``KVCacheRpcError``."""
    if error.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED):
        return True
    if redirect_of(error) is None and error.code() != grpc.StatusCode.UNAVAILABLE:
        raise KVCacheRpcError.of(error, method) from None
    return False


def redirect_of(error: grpc.RpcError | None) -> str | None:
    """The leader a standby named in its FAILED_PRECONDITION, else None."""
    if error is None or error.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    trailing: Callable[[], Any] | None = getattr(error, "trailing_metadata", None)
    for key, value in (trailing() if trailing else None) or ():
        if key == LEADER_METADATA:
            return str(value)
    return None
