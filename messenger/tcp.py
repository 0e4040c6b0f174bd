"""TCP transport, destination side: pull pages over raw sockets straight into page views.

A fetch is split over ``lanes`` connections to the peer (contiguous runs of keys per lane, so the
source pins neighbouring pages together). Each lane sends its keys as requests of at most
``request_bytes`` of pages and keeps ``window`` requests in flight, so the source starts pinning
and streaming the next request while the current one drains. Pages land with
``recv_into(view, MSG_WAITALL)`` directly in the destination's page memory and are verified
against the sender's xxh3-64 checksum; nothing is copied in Python.

Failures are per entry: a missing key, a checksum mismatch, an error reply, or a cut connection
marks the affected entries and never raises to the caller.
"""

from __future__ import annotations

import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from .frames import (
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
    set_io_timeout,
)
from .transport import OK, EntryResult, Outcome, Transport

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
        raise ValueError(f"data address {address!r} must be host:port (port 1-65535)")
    return host.strip("[]"), int(port)


class Unauthenticated(ConnectionError):
    """The peer refused our token."""


def hello(sock: socket.socket, hbuf: bytearray, token: str) -> None:
    """Open a connection to a token-protected data port."""
    body = token.encode()
    send_buffers(sock, [pack_header(Kind.HELLO, length=len(body), checksum_=checksum(body)), body])
    h = recv_header(sock, hbuf)
    if h.kind is Kind.ERROR:
        if h.length > MAX_CONTROL_BYTES:
            raise ProtocolError("oversized ERROR frame")
        msg = bytearray(h.length)
        recv_exact(sock, memoryview(msg))
        text = msg.decode(errors="replace")
        if h.status is Status.UNAUTHENTICATED:
            raise Unauthenticated(f"peer refused the token: {text}")
        raise ConnectionError(f"peer refused the connection: {text}")  # e.g. at its limit
    if h.kind is not Kind.END:
        raise ProtocolError(f"expected END after HELLO, got {h.kind.name}")


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
    lanes: int = 2  # connections per fetch (per peer)
    request_bytes: int = 32 << 20  # pages per request = request_bytes // page_bytes (>= 1)
    window: int = 2  # requests in flight per lane
    io_timeout_s: float = 30.0  # a stalled peer fails the lane after this long
    connect_timeout_s: float = 5.0
    max_idle_per_peer: int = 16
    token: str | None = None  # sent in a HELLO on every new connection

    def __post_init__(self) -> None:
        if self.lanes < 1 or self.window < 1 or self.request_bytes < 1:
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

    __slots__ = ("sock", "header")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.header = bytearray(HEADER_BYTES)

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

    def fetch(
        self, peer: str, namespace: str, keys: Sequence[bytes], views: Sequence[memoryview]
    ) -> list[EntryResult]:
        n = len(keys)
        views = destination_views(keys, views)
        if n == 0:
            return []
        page_bytes = views[0].nbytes
        results: list[EntryResult | None] = [None] * n
        lanes = min(self.config.lanes, n)
        bounds = [n * i // lanes for i in range(lanes + 1)]
        runs = [range(bounds[i], bounds[i + 1]) for i in range(lanes)]
        futures = [
            self._pool.submit(
                self._fetch_lane, peer, namespace, page_bytes, run, keys, views, results
            )
            for run in runs[1:]
        ]
        self._fetch_lane(peer, namespace, page_bytes, runs[0], keys, views, results)
        for f in futures:
            f.result()
        return [
            r if r is not None else EntryResult(Outcome.INTERNAL, "entry left unresolved")
            for r in results
        ]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lanes = [lane for idle in self._idle.values() for lane in idle]
            self._idle.clear()
        for lane in lanes:
            lane.close()
        self._pool.shutdown(wait=True)

    # ---- lanes ---------------------------------------------------------------------------------

    def _fetch_lane(
        self,
        peer,
        namespace,
        page_bytes,
        run: range,
        keys,
        views,
        results,
        allow_reuse: bool = True,
    ) -> None:
        try:
            lane, reused = self._take(peer, allow_reuse)
        except ValueError as e:  # a malformed address: per entry, like every other failure
            self._fail(results, run, Outcome.INVALID, str(e))
            return
        except (OSError, ProtocolError) as e:
            self._fail(results, run, Outcome.UNAVAILABLE, f"cannot connect to peer {peer}: {e}")
            return
        progress = [0]  # responses fully received on this lane
        try:
            self._run_requests(lane, namespace, page_bytes, run, keys, views, results, progress)
        except Exception as e:  # noqa: BLE001 - every failure becomes per-entry results
            lane.close()
            if (
                reused
                and progress[0] == 0
                and is_disconnect(e)
                and all(results[i] is None for i in run)
            ):
                # A pooled connection the peer had closed meanwhile: retry once on a fresh one.
                log.warning("stale pooled connection to %s (%s); reconnecting", peer, e)
                self._fetch_lane(
                    peer, namespace, page_bytes, run, keys, views, results, allow_reuse=False
                )
                return
            with self._lock:
                self.stats.lane_failures += 1
            if isinstance(e, ProtocolError):
                reason = f"protocol error from peer {peer}: {e}"
                outcome = Outcome.UNAVAILABLE
            elif is_disconnect(e):
                reason = f"connection to peer {peer} lost: {e}"
                outcome = Outcome.UNAVAILABLE
            else:
                log.exception("TCP lane to %s failed", peer)
                reason, outcome = f"internal error: {e!r}", Outcome.INTERNAL
            self._fail(results, run, outcome, reason)
            return
        self._give_back(peer, lane)

    def _run_requests(
        self, lane: _Lane, namespace, page_bytes, run: range, keys, views, results, progress
    ) -> None:
        per_request = max(1, min(MAX_KEYS_PER_REQUEST, self.config.request_bytes // page_bytes))
        groups = [
            range(s, min(s + per_request, run.stop))
            for s in range(run.start, run.stop, per_request)
        ]
        window = self.config.window
        for g in groups[:window]:
            self._send_request(lane, namespace, page_bytes, g, keys)
        for gi, g in enumerate(groups):
            self._receive_response(lane, page_bytes, g, keys, views, results)
            progress[0] += 1
            if gi + window < len(groups):
                self._send_request(lane, namespace, page_bytes, groups[gi + window], keys)

    @staticmethod
    def _send_request(lane: _Lane, namespace, page_bytes, group: range, keys) -> None:
        body = pack_keys_body(namespace, page_bytes, [keys[i] for i in group])
        send_buffers(
            lane.sock,
            [
                pack_header(
                    Kind.FETCH, count=len(group), length=len(body), checksum_=checksum(body)
                ),
                body,
            ],
        )

    def _receive_response(
        self, lane: _Lane, page_bytes, group: range, keys, views, results
    ) -> None:
        sock, hbuf = lane.sock, lane.header
        pages = bad = 0
        for i in group:
            h = recv_header(sock, hbuf)
            if h.kind is Kind.ERROR:
                reason = self._read_error(sock, h)
                outcome = _STATUS_OUTCOME.get(h.status, Outcome.INTERNAL)
                for j in range(i, group.stop):
                    results[j] = EntryResult(outcome, reason)
                return
            if h.kind is not Kind.PAGE or h.key != keys[i]:
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
                pages += 1
        h = recv_header(sock, hbuf)
        if h.kind is not Kind.END:
            raise ProtocolError(f"expected END after {len(group)} pages, got {h.kind.name}")
        with self._lock:
            self.stats.pages += pages
            self.stats.bytes += pages * page_bytes
            self.stats.checksum_failures += bad

    @staticmethod
    def _read_error(sock: socket.socket, h) -> str:
        if h.length > MAX_CONTROL_BYTES:
            raise ProtocolError("oversized ERROR frame")
        body = bytearray(h.length)
        recv_exact(sock, memoryview(body))
        return body.decode(errors="replace") or h.status.name

    @staticmethod
    def _fail(results, run: range, outcome: Outcome, reason: str) -> None:
        failure = EntryResult(outcome, reason)
        for i in run:
            if results[i] is None:
                results[i] = failure

    # ---- connection pool -----------------------------------------------------------------------

    def _take(self, peer: str, allow_reuse: bool) -> tuple[_Lane, bool]:
        if allow_reuse:
            with self._lock:
                idle = self._idle.get(peer)
                if idle:
                    return idle.pop(), True
        host, port = parse_address(peer)
        sock = socket.create_connection((host, port), timeout=self.config.connect_timeout_s)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_io_timeout(sock, self.config.io_timeout_s)
        lane = _Lane(sock)
        if self.config.token:
            try:
                hello(sock, lane.header, self.config.token)
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
