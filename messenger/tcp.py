"""TCP transport, destination side: pull pages over raw sockets straight into page views.

A fetch is a sequence of groups of at most ``request_bytes`` of consecutive pages, one FETCH
request each (so the source pins neighbouring pages together). Up to ``lanes`` connections to
the peer (at most one per group: a small fetch stays on one) take groups as they have room,
each keeping ``window`` requests in flight, so the source pins and streams the next group while
the current one drains; ``fetch_groups`` reports each group as soon as it is final (the mover
commits it while the next ones stream). A group handed out before its pages are allocated is
requested with HOLD (the source pins it while the destination allocates) and a GO follows with
the pages still wanted. Pages land with ``recv_into(view, MSG_WAITALL)`` directly in the
destination's page memory and are verified against the sender's xxh3-64 checksum; nothing is
copied in Python.

Failures are per entry: a missing key, a checksum mismatch, an error reply, or a cut connection
marks the affected entries and never raises to the caller.
"""

from __future__ import annotations

import hmac
import logging
import socket
import ssl
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from kvstore.errors import echo

from .data_security import NONCE_BYTES, PROOF_BYTES, connect, new_nonce, proof
from .frames import (
    FLAG_HOLD,
    FLAG_IDENTITY,
    HEADER_BYTES,
    MAX_CONTROL_BYTES,
    MAX_KEYS_PER_REQUEST,
    Kind,
    ProtocolError,
    Status,
    checksum,
    is_disconnect,
    pack_header,
    pack_keys_body,
    recv_exact,
    recv_header,
    send_buffers,
)
from .identity import Identity, pack_identity
from .transport import OK, EntryResult, FetchGroup, Outcome, Transport

log = logging.getLogger(__name__)

_STATUS_OUTCOME = {
    Status.NOT_FOUND: Outcome.NOT_FOUND,
    Status.UNAVAILABLE: Outcome.UNAVAILABLE,
    Status.INVALID: Outcome.INVALID,
    Status.INTERNAL: Outcome.INTERNAL,
    Status.UNAUTHENTICATED: Outcome.UNAVAILABLE,
}


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"data address {echo(address)} must be host:port (port 1-65535)")
    return host.strip("[]"), int(port)


class Unauthenticated(ConnectionError):
    """The peer refused our token."""


class _ConnectFailed(Exception):
    """A new lane could not be opened (refused, unreachable, HELLO refused)."""


class _BadAddress(Exception):
    """The peer's data address is malformed."""


class _InFlight:
    """A group requested on a lane: whether it waits for a GO, its results as they arrive."""

    __slots__ = ("group", "held", "results")

    def __init__(self, group: FetchGroup) -> None:
        self.group = group
        self.held = False
        self.results: list[EntryResult | None] = []


class _Groups:
    """The caller's group iterator, advanced by one lane at a time."""

    def __init__(self, groups: Iterator[FetchGroup]) -> None:
        self._groups = groups
        self._lock = threading.Lock()

    def take(self) -> FetchGroup | None:
        with self._lock:
            return next(self._groups, None)


def hello(sock: socket.socket, hbuf: bytearray, token: str) -> bytes:
    """Open a connection to a token-protected data port: a challenge and response
    (data_security.py); the token never goes on the wire, and nothing else is sent to a port
    that cannot prove it holds the token too. Returns both nonces (the connection's, which the
    proofs of its requests are bound to)."""
    key = token.encode()
    mine = new_nonce()
    _send_hello(sock, mine)
    h = recv_header(sock, hbuf)
    if h.kind is Kind.ERROR:
        _raise_error(sock, h)
    if h.kind is not Kind.HELLO or h.length != NONCE_BYTES + PROOF_BYTES:
        raise ProtocolError(f"expected the port's HELLO (nonce and proof), got {h.kind.name}")
    body = bytearray(h.length)
    recv_exact(sock, memoryview(body))
    theirs, shown = bytes(body[:NONCE_BYTES]), bytes(body[NONCE_BYTES:])
    if not hmac.compare_digest(shown, proof(key, b"server", mine, theirs)):
        raise Unauthenticated("the peer's data port does not hold the cluster's data token")
    _send_hello(sock, proof(key, b"client", mine, theirs))
    h = recv_header(sock, hbuf)
    if h.kind is Kind.ERROR:
        _raise_error(sock, h)
    if h.kind is not Kind.END:
        raise ProtocolError(f"expected END after HELLO, got {h.kind.name}")
    return mine + theirs


def request_body(
    namespace: str,
    page_bytes: int,
    keys: Sequence[bytes],
    identity: Identity | None,
    nonces: bytes,
) -> tuple[bytes, int]:
    """A FETCH's or RDMA_PIN's body and flags: the keys, and whom they are for (identity.py)."""
    body = pack_keys_body(namespace, page_bytes, list(keys))
    if identity is None:
        return body, 0
    return pack_identity(identity, nonces, body) + body, FLAG_IDENTITY


def _send_hello(sock: socket.socket, body: bytes) -> None:
    send_buffers(sock, [pack_header(Kind.HELLO, length=len(body), checksum_=checksum(body)), body])


def _raise_error(sock: socket.socket, h) -> None:
    if h.length > MAX_CONTROL_BYTES:
        raise ProtocolError("oversized ERROR frame")
    msg = bytearray(h.length)
    recv_exact(sock, memoryview(msg))
    text = msg.decode(errors="replace")
    if h.status is Status.UNAUTHENTICATED:
        raise Unauthenticated(f"peer refused the token: {text}")
    raise ConnectionError(f"peer refused the connection: {text}")  # e.g. at its limit


def page_view(view) -> memoryview:
    mv = memoryview(view)
    if mv.readonly:
        raise ValueError("destination page views must be writable")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def destination_views(keys: Sequence[bytes], views: Sequence) -> list[memoryview]:
    """Validate a fetch's destination pages: one per key, all of one page size."""
    if len(views) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(views)} views")
    out = [page_view(v) for v in views]
    if out and any(v.nbytes != out[0].nbytes for v in out):
        raise ValueError("every destination view must have the same page size")
    return out


@dataclass(frozen=True, kw_only=True)
class TcpConfig:
    lanes: int = 2  # connections per fetch (per peer), at most one per group
    # Pages per request (a group) = request_bytes // page_bytes (>= 1). Each costs the source
    # node an Acquire and a Release, and the mover an Allocate and a Commit: ~1 ms of CPU each
    # in Python gRPC on both ends, so groups are large; the mover commits one while the next
    # streams, so only the last group's commit is not hidden.
    request_bytes: int = 64 << 20
    window: int = 2  # requests in flight per lane
    io_timeout_s: float = 30.0  # a stalled peer fails the lane after this long
    connect_timeout_s: float = 5.0
    max_idle_per_peer: int = 16
    token: str | None = None  # sent in a HELLO on every new connection (the data token)
    tls: ssl.SSLContext | None = None  # a client context: the peers' data ports speak TLS

    def __post_init__(self) -> None:
        if min(self.lanes, self.window, self.request_bytes) < 1:
            raise ValueError("lanes, window and request_bytes must be positive")


@dataclass
class TcpStats:
    pages: int = 0
    bytes: int = 0
    checksum_failures: int = 0
    connections_opened: int = 0
    lane_failures: int = 0


class _Lane:
    """One pooled connection."""

    __slots__ = ("sock", "header", "nonces")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.header = bytearray(HEADER_BYTES)
        self.nonces = b""  # HELLO's, on a token-protected port

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, config: TcpConfig | None = None) -> None:
        self.config = config or TcpConfig()
        self.stats = TcpStats()
        self._lock = threading.Lock()
        self._idle: dict[str, list[_Lane]] = {}
        self._closed = False
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, self.config.lanes * 4), thread_name_prefix="tcp-lane"
        )

    # ---- public ------------------------------------------------------------------------------

    def group_pages(self, page_bytes: int) -> int:
        return max(1, min(MAX_KEYS_PER_REQUEST, self.config.request_bytes // page_bytes))

    def fetch(
        self,
        peer: str,
        namespace: str,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        identity: Identity | None = None,
    ) -> list[EntryResult]:
        n = len(keys)
        checked = destination_views(keys, views)
        if n == 0:
            return []
        results: list[EntryResult | None] = [None] * n
        per = self.group_pages(checked[0].nbytes)
        groups = (
            FetchGroup(list(keys[s : s + per]), checked[s : s + per], s, identity=identity)
            for s in range(0, n, per)
        )

        def done(group: FetchGroup, res: list[EntryResult]) -> None:
            results[group.tag : group.tag + len(res)] = res

        stopped = self.fetch_groups(peer, namespace, checked[0].nbytes, n, groups, done)
        rest = stopped or EntryResult(Outcome.INTERNAL, "entry left unresolved")
        return [r if r is not None else rest for r in results]

    def fetch_groups(
        self,
        peer: str,
        namespace: str,
        page_bytes: int,
        pages: int,
        groups: Iterator[FetchGroup],
        done: Callable[[FetchGroup, list[EntryResult]], None],
    ) -> EntryResult | None:
        """Lanes take groups as they have room (``window`` requests in flight each, one request
        per group), so groups finish roughly in order and a group is committed while the next
        ones stream; a fetch of one group stays on one lane. A lane that broke takes no more
        groups: when every lane broke, what broke the first is returned."""
        lanes = max(1, min(self.config.lanes, -(-pages // self.group_pages(page_bytes))))
        source = _Groups(groups)
        futures = [
            self._pool.submit(self._lane, peer, namespace, page_bytes, source, done)
            for _ in range(lanes - 1)
        ]
        broken: list[EntryResult | None] = []
        try:
            broken.append(self._lane(peer, namespace, page_bytes, source, done))
        finally:
            broken += [f.result() for f in futures]
        return broken[0] if all(b is not None for b in broken) else None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lanes = [lane for idle in self._idle.values() for lane in idle]
            self._idle.clear()
        for lane in lanes:
            lane.close()
        self._pool.shutdown(wait=True)

    # ---- lanes ---------------------------------------------------------------------------------

    def _lane(
        self, peer: str, namespace: str, page_bytes: int, source: "_Groups", done
    ) -> EntryResult | None:
        """One connection's loop: keep ``window`` groups requested, receive them in order, and
        report each; a failure fails the groups in flight and ends the lane (the peer is gone
        or broken: the groups no lane took are the caller's to fail, never allocated for
        nothing), except a pooled connection found stale before it delivered anything, which
        is retried once on a fresh connection.

        A group handed out before its pages were allocated is requested with HOLD (the source
        pins it meanwhile) and resolved when it is next to be received: then a GO names the
        pages still wanted, and the requests behind it are sent."""
        inflight: deque[_InFlight] = deque()
        lane: _Lane | None = None
        reused = retried = False
        received = 0  # responses received on this connection
        broken: EntryResult | None = None  # set: fail whatever this lane takes
        while True:
            try:
                if lane is None and inflight and broken is None:  # requests lost with a stale lane
                    lane, reused = self._take(peer, allow_reuse=False)
                    received = 0
                    for f in inflight:
                        self._send_request(lane, namespace, page_bytes, f)
                # NOTE: nothing is sent behind a held request before its GO: the source reads
                # the GO next.
                while (
                    broken is None
                    and len(inflight) < self.config.window
                    and not any(f.held for f in inflight)
                ):
                    group = source.take()
                    if group is None:
                        break
                    f = _InFlight(group)
                    inflight.append(f)
                    if lane is None:
                        lane, reused = self._take(peer, allow_reuse=not retried)
                        received = 0
                    self._send_request(lane, namespace, page_bytes, f)
                if not inflight:
                    break
                f = inflight[0]
                if broken is None:
                    assert lane is not None
                    if f.held:
                        self._go(lane, f)
                        continue  # requests behind it go out before its pages are received
                    assert f.group.views is not None
                    f.group.checksums = self._receive_response(
                        lane, page_bytes, f.group.keys, f.group.views, f.results
                    )
                    received += 1
            except _BadAddress as e:  # per entry, like every other failure
                broken = EntryResult(Outcome.INVALID, str(e))
            except _ConnectFailed as e:
                broken = EntryResult(Outcome.UNAVAILABLE, f"cannot connect to peer {peer}: {e}")
            except Exception as e:  # noqa: BLE001 - every failure becomes per-entry results
                if lane is not None:
                    lane.close()
                    lane = None
                untouched = all(r is None for f in inflight for r in f.results)
                if reused and received == 0 and untouched and not retried and is_disconnect(e):
                    # A pooled connection the peer had closed meanwhile: retry once on a fresh
                    # one (every request in flight is sent again).
                    log.warning("stale pooled connection to %s (%s); reconnecting", peer, e)
                    retried = True
                    continue
                broken = self._lane_failure(peer, e)
            if broken is not None:
                for f in inflight:
                    f.group.resolve()  # the caller learns which pages it set up, and fails them
                    if len(f.results) != len(f.group.keys):  # never sent, or not resolved
                        f.results = [None] * len(f.group.keys)
                    if f.group.keys:
                        done(f.group, [r if r is not None else broken for r in f.results])
                inflight.clear()
                continue
            inflight.popleft()
            if f.group.keys:
                done(f.group, f.results)

        if lane is not None:
            self._give_back(peer, lane)
        return broken

    @staticmethod
    def _send_request(lane: _Lane, namespace: str, page_bytes: int, f: "_InFlight") -> None:
        """FETCH the group's keys; HOLD while its pages are not allocated yet."""
        keys = f.group.keys
        f.held = f.group.settle is not None
        f.results = [None] * len(keys)
        body, flags = request_body(namespace, page_bytes, keys, f.group.identity, lane.nonces)
        send_buffers(
            lane.sock,
            [
                pack_header(
                    Kind.FETCH,
                    count=len(keys),
                    length=len(body),
                    checksum_=checksum(body),
                    flags=flags | (FLAG_HOLD if f.held else 0),
                ),
                body,
            ],
        )

    @staticmethod
    def _go(lane: _Lane, f: "_InFlight") -> None:
        """Resolve a held group (wait for its pages) and tell the source which to send."""
        count = len(f.group.keys)
        mask = bytes(f.group.resolve())
        f.held = False
        f.results = [None] * len(f.group.keys)
        send_buffers(
            lane.sock,
            [pack_header(Kind.GO, count=count, length=count, checksum_=checksum(mask)), mask],
        )

    def _lane_failure(self, peer: str, e: Exception) -> EntryResult:
        with self._lock:
            self.stats.lane_failures += 1
        if isinstance(e, ProtocolError):
            return EntryResult(Outcome.UNAVAILABLE, f"protocol error from peer {peer}: {e}")
        if is_disconnect(e):
            return EntryResult(Outcome.UNAVAILABLE, f"connection to peer {peer} lost: {e}")
        log.exception("TCP lane to %s failed", peer)
        return EntryResult(Outcome.INTERNAL, f"internal error: {e!r}")

    def _receive_response(
        self,
        lane: _Lane,
        page_bytes: int,
        keys: list[bytes],
        views: list[memoryview],
        results: list[EntryResult | None],
    ) -> list[int]:
        """Receive one FETCH response into ``views``, setting ``results`` as pages arrive (those
        set before a failure stand). Returns the checksum each page was verified against (0
        where none was): every page comes as one frame whose payload is exactly the page."""
        sock, hbuf = lane.sock, lane.header
        pages = bad = 0
        sums = [0] * len(keys)
        for i, key in enumerate(keys):
            h = recv_header(sock, hbuf)
            if h.kind is Kind.ERROR:
                reason = self._read_error(sock, h)
                outcome = _STATUS_OUTCOME.get(h.status, Outcome.INTERNAL)
                for j in range(i, len(keys)):
                    results[j] = EntryResult(outcome, reason)
                return sums
            if h.kind is not Kind.PAGE or h.key != key:
                raise ProtocolError(
                    f"expected the page of key #{i}, got {h.kind.name} for key {h.key.hex()}"
                )
            if h.status is not Status.OK:
                if h.length:
                    raise ProtocolError("a non-OK PAGE frame carries no payload")
                outcome = _STATUS_OUTCOME.get(h.status, Outcome.INTERNAL)
                results[i] = EntryResult(
                    outcome,
                    "source does not hold the key"
                    if outcome is Outcome.NOT_FOUND
                    else h.status.name,
                )
                continue
            if h.length != page_bytes:
                raise ProtocolError(f"page of {h.length} bytes, expected {page_bytes}")
            view = views[i]
            recv_exact(sock, view)
            if checksum(view) != h.checksum:
                results[i] = EntryResult(
                    Outcome.DATA_LOSS, "checksum mismatch: page corrupted in transit"
                )
                bad += 1
            else:
                results[i] = OK
                sums[i] = h.checksum
                pages += 1
        h = recv_header(sock, hbuf)
        if h.kind is not Kind.END:
            raise ProtocolError(f"expected END after {len(keys)} pages, got {h.kind.name}")
        with self._lock:
            self.stats.pages += pages
            self.stats.bytes += pages * page_bytes
            self.stats.checksum_failures += bad
        return sums

    @staticmethod
    def _read_error(sock: socket.socket, h) -> str:
        if h.length > MAX_CONTROL_BYTES:
            raise ProtocolError("oversized ERROR frame")
        body = bytearray(h.length)
        recv_exact(sock, memoryview(body))
        return body.decode(errors="replace") or h.status.name

    # ---- connection pool -----------------------------------------------------------------------

    def _take(self, peer: str, allow_reuse: bool) -> tuple[_Lane, bool]:
        if allow_reuse:
            with self._lock:
                idle = self._idle.get(peer)
                if idle:
                    return idle.pop(), True
        try:
            host, port = parse_address(peer)
        except ValueError as e:
            raise _BadAddress(str(e)) from None
        try:
            sock = connect(
                host,
                port,
                connect_timeout_s=self.config.connect_timeout_s,
                io_timeout_s=self.config.io_timeout_s,
                tls=self.config.tls,
            )
        except OSError as e:  # ssl.SSLError too: the peer is not who it should be, or no TLS
            raise _ConnectFailed(str(e)) from None
        lane = _Lane(sock)
        if self.config.token:
            try:
                lane.nonces = hello(sock, lane.header, self.config.token)
            except (OSError, ProtocolError) as e:
                lane.close()
                raise _ConnectFailed(str(e)) from None
            except BaseException:
                lane.close()
                raise
        with self._lock:
            self.stats.connections_opened += 1
        return lane, False

    def _give_back(self, peer: str, lane: _Lane) -> None:
        with self._lock:
            idle = self._idle.setdefault(peer, [])
            if not self._closed and len(idle) < self.config.max_idle_per_peer:
                idle.append(lane)
                return
        lane.close()
