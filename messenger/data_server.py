"""The source side of the data port: a TCP listener that serves pinned pages to pulling peers.

One thread per connection; each connection carries requests one after another (the puller
pipelines them, so the next request is already waiting when a response ends). ``FETCH`` is served
here; the RDMA transport adds its control requests with ``add_handler``. A FETCH flagged HOLD is
pinned at once but answered only after the puller's GO (which names the pages it still wants,
once its own node has allocated them); the GO must come within the frame timeout. A request
larger than the connection's pin budget is pinned and sent a chunk at a time.

A connection that sends anything but this protocol (bad magic, unknown kind, oversized or
inconsistent bodies, a frame cut short) is dropped with a warning; the process and every other
connection carry on.

Hostile or broken peers are bounded (``DataLimits``): at most ``max_connections`` at once (the
excess is refused at accept), an idle deadline between requests, a deadline for each frame once
its first byte arrived (a peer that trickles bytes is cut), and a deadline for sending a FETCH
response, so a peer that never reads cannot hold pins on the node for long; and what one
connection and one peer may hold pinned at once is a share of the pool (``pin_budget.py``). A
watchdog thread enforces the deadlines by shutting the socket down, which wakes the connection's
thread from any blocked ``recv`` or ``sendmsg``. Accept errors (out of file descriptors) back
off instead of spinning.
"""

from __future__ import annotations

import bisect
import errno
import hmac
import itertools
import logging
import math
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .data_security import NONCE_BYTES, new_nonce, proof, shutdown
from .frames import (
    FLAG_HOLD,
    FLAG_IDENTITY,
    HEADER_BYTES,
    MAX_CONTROL_BYTES,
    MAX_KEYS_PER_REQUEST,
    MAX_TOKEN_BYTES,
    Header,
    Kind,
    ProtocolError,
    Status,
    check_request_size,
    checksum,
    is_disconnect,
    pack_header,
    recv_exact,
    send_buffers,
    set_io_timeout,
    unpack_header,
    unpack_keys_body,
)
from .identity import Identities, stored_keys, unpack_identity
from .pin_budget import PinBudget, PinnedChunk, PinShares, pin_chunk
from .transport import PageSource, PinnedPages

log = logging.getLogger(__name__)

# Pages and bytes per sendmsg call: few syscalls, a bounded iovec count, and pages sent soon
# after their checksum pass read them (still in cache), so the peer starts receiving (and
# checksumming) while the next pages are checksummed here.
_SEND_BATCH_PAGES = 32
_SEND_BATCH_BYTES = 1 << 20
# Accept errors back off from the first to the last delay (doubling): out of file descriptors,
# accept fails at once for as long as a connection waits in the backlog.
_ACCEPT_BACKOFF_S = (0.01, 1.0)
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


@dataclass(frozen=True, kw_only=True)
class DataLimits:
    """Bounds on what peers may hold on the data port (``kvcache messenger`` flags)."""

    max_connections: int = 512  # connections at once; more are refused at accept
    # Connections that have not passed HELLO yet (on a port with a token), from one address;
    # all of them together may hold at most half of max_connections.
    max_unauthenticated_per_peer: int = 16
    idle_timeout_s: float = 300.0  # no request for this long: the connection is closed
    frame_timeout_s: float = 10.0  # a frame must arrive whole this long after its first byte
    fetch_deadline_s: float = 24.0  # a FETCH response must be sent (and its pins released)
    # within this long; keep it under the pin lease so no page is sent after its pin lapsed

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_unauthenticated_per_peer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("idle_timeout_s", "frame_timeout_s", "fetch_deadline_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class SenderFaults:
    """Test-only fault injection on the sending side.

    ``corrupt_every``: flip one byte of every N-th page sent, after its checksum was computed
    (the flip goes into a copy, never into the source's memory).
    ``stall_after``: once N pages have been sent, stop sending for ``stall_s`` seconds (once), so
    a test can act while a transfer is certainly in flight; ``stall_until``: a path whose
    creation ends the stall sooner (a test acts, then lets the transfer go on).
    """

    corrupt_every: int = 0
    stall_after: int = 0
    stall_s: float = 0.0
    stall_until: str = ""


@dataclass
class DataServerStats:
    connections: int = 0
    dropped_connections: int = 0
    refused_connections: int = 0  # over max_connections, or before HELLO over its share
    timed_out_connections: int = 0  # cut by a deadline (idle, slow frame, unread FETCH)
    accept_errors: int = 0
    requests: int = 0
    pages_sent: int = 0
    bytes_sent: int = 0
    missing_pages: int = 0


@dataclass
class PeerConnection:
    """One accepted connection and what must be undone when it closes (RDMA leases, QPs)."""

    sock: socket.socket
    peer: str  # host:port
    conn_id: int
    host: str = ""  # the peer's address, whose connections share a pin budget
    on_close: list[Callable[[], None]] = field(default_factory=list)
    state: dict = field(default_factory=dict)
    # Set by the server under its lock; the watchdog cuts the connection past ``deadline``.
    deadline: float = math.inf
    doing: str = ""  # what did not happen in time when the deadline passes, for the log
    cut: str = ""  # why the watchdog cut it ("" while it was not)
    authenticated: bool = False  # passed HELLO (or the port needs none); under the server lock

    def read_body(self, header: Header, limit: int = MAX_CONTROL_BYTES) -> bytes:
        if header.length > limit:
            raise ProtocolError(
                f"{header.kind.name} body of {header.length} bytes exceeds the limit of {limit}"
            )
        body = bytearray(header.length)
        recv_exact(self.sock, memoryview(body))
        if checksum(body) != header.checksum:
            raise ProtocolError(f"{header.kind.name} body checksum mismatch")
        return bytes(body)

    def send(self, buffers: list) -> None:
        send_buffers(self.sock, buffers)


Handler = Callable[[PeerConnection, Header], None]


_NOTHING_PINNED = PinnedPages([], [], lambda: None)


class DataServer:
    """Serves pages from a ``PageSource`` on ``host:port`` (port 0: pick a free one)."""

    def __init__(
        self,
        source: PageSource,
        host: str = "127.0.0.1",
        port: int = 0,
        io_timeout_s: float = 30.0,
        faults: SenderFaults | None = None,
        token: str | None = None,
        limits: DataLimits | None = None,
        pin_shares: PinShares | None = None,
        tls: ssl.SSLContext | None = None,
        identities: Identities | None = None,
    ) -> None:
        """``token``: when set, a connection must open with a HELLO carrying it (the cluster's
        data token, see data_security.py). ``pin_shares``: how much of the pool a connection and
        a peer may hold pinned. ``tls``: serve TLS (a server context). ``identities``: the
        cluster's token table; with tokens in it, every request must prove whom it is for."""
        self.identities = identities or Identities({})
        self.source = source
        self.budget = PinBudget(pin_shares or PinShares(), source.pool_pages)
        self._token = token.encode() if token else None
        self._tls = tls
        self.io_timeout_s = io_timeout_s
        self.faults = faults or SenderFaults()
        self.limits = limits or DataLimits()
        self.stats = DataServerStats()
        self._handlers: dict[Kind, Handler] = {
            Kind.FETCH: self._serve_fetch,
            Kind.HELLO: self._hello,
        }
        self._lock = threading.Lock()
        self._conns: dict[int, PeerConnection] = {}
        self._ids = itertools.count(1)
        self._pages_seen = 0
        self._pages_streamed = 0
        self._stalled = False
        self._stopped = threading.Event()
        self._listener = socket.create_server((host, port), backlog=128)
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, daemon=True, name=f"data-accept-{self.port}"
        )
        self._watch_thread = threading.Thread(
            target=self._watch_loop, daemon=True, name=f"data-watch-{self.port}"
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def add_handler(self, kind: Kind, handler: Handler) -> None:
        self._handlers[kind] = handler

    def start(self) -> "DataServer":
        self._accept_thread.start()
        self._watch_thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for conn in self._conns.values():
                shutdown(conn.sock)
        self._accept_thread.join(timeout=5)
        self._watch_thread.join(timeout=5)

    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    # ---- connections -------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        delay = 0.0  # > 0 while accept keeps failing (an episode)
        failures, since = 0, 0.0
        refusing = False
        while not self._stopped.is_set():
            try:
                sock, addr = self._listener.accept()
            except OSError as e:
                if self._stopped.is_set():
                    return
                with self._lock:
                    self.stats.accept_errors += 1
                if not delay:
                    # NOTE: once per episode: out of descriptors, accept fails at once for as
                    # long as a connection waits in the backlog; logging each try floods the log.
                    failures, since = 0, time.monotonic()
                    if e.errno in _OUT_OF_FDS:
                        log.error(
                            "data port: out of file descriptors (%s, %d connections open); "
                            "retrying accept with backoff (raise the open-files limit, "
                            "ulimit -n, or lower --max-connections)",
                            e,
                            self.open_connections(),
                        )
                    else:
                        log.warning("data port: accept failed (%s); retrying with backoff", e)
                failures += 1
                self._stopped.wait(delay or _ACCEPT_BACKOFF_S[0])
                delay = min(2 * (delay or _ACCEPT_BACKOFF_S[0]), _ACCEPT_BACKOFF_S[1])
                continue
            if delay:
                log.warning(
                    "data port: accepting again after %d failed accepts over %.1f s",
                    failures,
                    time.monotonic() - since,
                )
                delay = 0.0
            conn = PeerConnection(sock, f"{addr[0]}:{addr[1]}", next(self._ids), addr[0])
            conn.authenticated = self._token is None
            with self._lock:
                full = len(self._conns) >= self.limits.max_connections
                crowded = "" if full else self._crowded(conn.host)
                if full or crowded:
                    self.stats.refused_connections += 1
                else:
                    self._conns[conn.conn_id] = conn
                    self.stats.connections += 1
                    conn.deadline = time.monotonic() + self.limits.frame_timeout_s
                    conn.doing = (
                        f"no request within {self.limits.frame_timeout_s:g} s of connecting"
                    )
            if full:
                if not refusing:  # once per episode of a full server
                    log.warning(
                        "data port: %d connections open (--max-connections); refusing new "
                        "ones until some close (first refused: %s)",
                        self.limits.max_connections,
                        conn.peer,
                    )
                refusing = True
                self._refuse(sock)
                continue
            if crowded:
                log.warning("data port: refused a connection from %s: %s", conn.peer, crowded)
                self._refuse(sock, crowded)
                continue
            refusing = False
            threading.Thread(
                target=self._serve, args=(conn,), daemon=True, name=f"data-conn-{conn.conn_id}"
            ).start()

    def _crowded(self, host: str) -> str:
        """Why one more connection not yet past HELLO is refused from ``host`` ("": it is not).
        Under the lock. Slots held before HELLO cost nothing to take, so an address may hold a
        few, and all such connections together at most half the port's."""
        if self._token is None:
            return ""
        waiting = [c for c in self._conns.values() if not c.authenticated]
        mine = sum(1 for c in waiting if c.host == host)
        per_peer = self.limits.max_unauthenticated_per_peer
        if mine >= per_peer:
            return f"{per_peer} connections from {host} have not said HELLO yet"
        if len(waiting) >= max(1, self.limits.max_connections // 2):
            return f"{len(waiting)} connections have not said HELLO yet"
        return ""

    def _refuse(self, sock: socket.socket, why: str = "") -> None:
        """Close a connection over the limit at once, saying why if the peer can take it."""
        why = why or f"the data port is at its connection limit ({self.limits.max_connections})"
        body = f"{why}; retry later".encode()
        try:
            if self._tls is not None:
                return  # the peer expects a TLS handshake, not a frame: just close
            sock.setblocking(False)  # a peer that does not read must not block the accept loop
            try:  # what the peer already sent: left unread, the close becomes a reset that
                for _ in range(16):  # may discard our ERROR at the peer
                    if not sock.recv(65536):
                        break
            except OSError:
                pass
            sock.send(
                pack_header(
                    Kind.ERROR, Status.UNAVAILABLE, length=len(body), checksum_=checksum(body)
                )
                + body
            )
        except OSError:
            pass
        finally:
            sock.close()

    def _watch_loop(self) -> None:
        """Cut connections past their deadline: shutting the socket down wakes the connection's
        thread from a blocked ``recv`` / ``sendmsg``; it then releases what it holds."""
        lim = self.limits
        tick = min(
            0.5, max(0.02, min(lim.idle_timeout_s, lim.frame_timeout_s, lim.fetch_deadline_s) / 4)
        )
        while not self._stopped.wait(tick):
            now = time.monotonic()
            with self._lock:
                for conn in self._conns.values():
                    if not conn.cut and now > conn.deadline:
                        conn.cut = conn.doing
                        self.stats.timed_out_connections += 1
                        # NOTE: under the lock: _close closes the socket under it too, so this
                        # never shuts down a descriptor number that was reused meanwhile.
                        shutdown(conn.sock)

    def _expect(self, conn: PeerConnection, seconds: float, doing: str) -> None:
        """Cut ``conn`` unless the next step ends within ``seconds``; ``doing`` says what failed
        to happen in time (for the log)."""
        with self._lock:
            conn.deadline = time.monotonic() + seconds
            conn.doing = doing

    def _serve(self, conn: PeerConnection) -> None:
        sock = conn.sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_io_timeout(sock, self.io_timeout_s)
            if self._tls is not None:
                sock = self._handshake(conn)
            buf = bytearray(HEADER_BYTES)
            idle = self.limits.idle_timeout_s
            while not self._stopped.is_set():
                if not self._wait_header(conn, buf):
                    return
                header = unpack_header(buf)
                # Before any buffer is allocated for the body: its announced size must fit.
                check_request_size(header)
                if (
                    self._token is not None
                    and not conn.state.get("authenticated")
                    and header.kind is not Kind.HELLO
                ):
                    self._send_error(
                        conn,
                        Status.UNAUTHENTICATED,
                        "this data port needs a token: open with HELLO (the cluster's data token)",
                    )
                    raise ProtocolError(
                        f"{header.kind.name} without HELLO on a token-protected data port"
                    )
                handler = self._handlers.get(header.kind)
                if handler is None:
                    raise ProtocolError(f"unexpected {header.kind.name} frame from a client")
                with self._lock:
                    self.stats.requests += 1
                handler(conn, header)
                if "qp" in conn.state:
                    # An RDMA session (rdma.py) is a long-lived control channel its puller keeps
                    # per peer and does not reopen when stale: no idle deadline (it passed HELLO
                    # and counts against max_connections).
                    self._expect(conn, math.inf, "")
                else:
                    self._expect(conn, idle, f"idle for more than {idle:g} s")
        except ProtocolError as e:
            log.warning("data port: dropping connection from %s: %s", conn.peer, e)
            with self._lock:
                self.stats.dropped_connections += 1
        except Exception as e:  # noqa: BLE001 - one connection must never take the server down
            if conn.cut:
                log.warning("data port: cut connection from %s: %s", conn.peer, conn.cut)
            elif is_disconnect(e):
                log.info("data port: connection from %s closed: %s", conn.peer, e)
            else:
                log.exception("data port: error serving %s; dropping the connection", conn.peer)
                with self._lock:
                    self.stats.dropped_connections += 1
        finally:
            self._close(conn)

    def _handshake(self, conn: PeerConnection) -> ssl.SSLSocket:
        """TLS on an accepted connection, under the deadline of its first request (the watchdog
        cuts a peer that stalls the handshake)."""
        assert self._tls is not None
        with self._lock:  # NOTE: the watchdog shuts down conn.sock under it (see _watch_loop)
            tsock = self._tls.wrap_socket(
                conn.sock, server_side=True, do_handshake_on_connect=False
            )
            conn.sock = tsock
        try:
            tsock.do_handshake()
        except ssl.SSLError as e:
            if conn.cut:  # the deadline passed: logged as a cut
                raise ConnectionError(str(e)) from None
            raise ProtocolError(f"TLS handshake failed: {e.reason or e}") from None
        return tsock

    def _wait_header(self, conn: PeerConnection, buf: bytearray) -> bool:
        """Wait (idle, under the idle deadline) for the next request header; False on EOF."""
        sock, view = conn.sock, memoryview(buf)
        while not self._stopped.is_set():
            try:
                # NOTE: no MSG_WAITALL: return on the first bytes, so the frame deadline
                # starts then (a peer that trickles a header byte by byte is cut by it).
                got = sock.recv_into(view, HEADER_BYTES)
            except (BlockingIOError, InterruptedError):
                continue  # SO_RCVTIMEO while idle: the watchdog enforces the idle deadline
            if got == 0:
                if conn.cut:
                    log.warning("data port: cut connection from %s: %s", conn.peer, conn.cut)
                return False
            frame = self.limits.frame_timeout_s
            self._expect(
                conn, frame, f"a request frame not complete {frame:g} s after its first byte"
            )
            if got < HEADER_BYTES:
                recv_exact(sock, view[got:])  # the rest of a started frame must come promptly
            return True
        return False

    def _close(self, conn: PeerConnection) -> None:
        for undo in reversed(conn.on_close):
            try:
                undo()
            except Exception:  # noqa: BLE001 - cleanup of one resource must not skip the others
                log.exception("data port: cleanup after %s failed", conn.peer)
        with self._lock:
            self._conns.pop(conn.conn_id, None)
            conn.sock.close()  # under the lock: see _watch_loop

    def _hello(self, conn: PeerConnection, header: Header) -> None:
        """A challenge and response (data_security.py): the puller's nonce, answered with ours
        and our proof; then the puller's proof, answered END, or ERROR and a hang-up."""
        body = conn.read_body(header, limit=MAX_TOKEN_BYTES)
        if self._token is None:  # an open port: nothing to prove
            conn.state["authenticated"] = True
            return conn.send([pack_header(Kind.END)])
        nonces = conn.state.get("nonces")
        if nonces is None:
            if len(body) != NONCE_BYTES:
                self._send_error(conn, Status.UNAUTHENTICATED, "HELLO carries a 32-byte nonce")
                raise ProtocolError("HELLO without a nonce")
            mine = new_nonce()
            conn.state["nonces"] = (body, mine)
            answer = mine + proof(self._token, b"server", body, mine)
            conn.send(
                [pack_header(Kind.HELLO, length=len(answer), checksum_=checksum(answer)), answer]
            )
            return
        theirs, mine = nonces
        if not hmac.compare_digest(body, proof(self._token, b"client", theirs, mine)):
            self._send_error(conn, Status.UNAUTHENTICATED, "wrong token for this data port")
            raise ProtocolError("HELLO with a wrong token")
        conn.state["authenticated"] = True
        with self._lock:
            conn.authenticated = True
        conn.send([pack_header(Kind.END)])

    # ---- FETCH ---------------------------------------------------------------------------------

    def read_request(
        self, conn: PeerConnection, header: Header
    ) -> tuple[str, int, list[bytes], list[bytes]]:
        """A FETCH's or RDMA_PIN's (namespace, page size, keys as asked, keys as stored): the
        identity it names must be proven (identity.py) on a source with tokens, and a tenant's
        keys are scoped to it here. A request that fails is answered UNAUTHENTICATED and the
        connection dropped (``ProtocolError``)."""
        if header.count > MAX_KEYS_PER_REQUEST:
            raise ProtocolError(
                f"{header.kind.name} of {header.count} keys exceeds {MAX_KEYS_PER_REQUEST}"
            )
        body = conn.read_body(header)
        who, why = "", None
        if header.flags & FLAG_IDENTITY:
            who, proof, body = unpack_identity(body)
            nonces = b"".join(conn.state.get("nonces", ()))
            why = self.identities.verify(who, proof, nonces, body)
        elif self.identities.enabled:
            why = "the request names no identity (a messenger older than this source?)"
        if why is not None:
            self._send_error(conn, Status.UNAUTHENTICATED, why)
            raise ProtocolError(f"{header.kind.name}: {why}")
        namespace, page_bytes, keys = unpack_keys_body(body, header.count)
        return namespace, page_bytes, keys, stored_keys(who, keys)

    def _serve_fetch(self, conn: PeerConnection, header: Header) -> None:
        namespace, page_bytes, keys, stored = self.read_request(conn, header)
        # The whole response (pin, GO, send, release) within the deadline: a peer that does not
        # read is cut, which fails the blocked send, and the pins go back in the finally below.
        deadline = self.limits.fetch_deadline_s
        end = time.monotonic() + deadline
        late = f"a FETCH response of {len(keys)} pages not read within {deadline:g} s"
        self._expect(conn, deadline, late)
        todo = list(range(len(keys)))  # the keys still to send, in order
        chunk: PinnedChunk | None = None
        error = self._check_request(namespace, page_bytes)
        try:
            # Pinned a chunk at a time, each within the pin budget (pin_budget.py); the first
            # one before a held request's GO, so it is pinned while the puller allocates.
            if error is None and todo:
                chunk, error = self.pin_chunk(conn, namespace, stored, todo, end, late)
            if header.flags & FLAG_HOLD:
                todo = self._await_go(conn, len(keys), end if error is None else math.inf)
            if error is not None:
                return self._answer_error(conn, error)
            self._expect(conn, end - time.monotonic(), late)
            while chunk is not None:
                send = todo[: bisect.bisect_right(todo, chunk.indices[-1])]
                todo = todo[len(send) :]
                at = {k: j for j, k in enumerate(chunk.indices)}
                chunk_keys = [keys[i] for i in chunk.indices]
                self._stream_pages(
                    conn, chunk_keys, chunk.pinned, [at[i] for i in send], last=not todo
                )
                chunk.release(self.budget)
                chunk = None
                if not todo:
                    return
                chunk, error = self.pin_chunk(conn, namespace, stored, todo, end, late)
                if error is not None:
                    return self._answer_error(conn, error)  # ends the response; pages sent stand
            self._stream_pages(conn, [], _NOTHING_PINNED, [], last=True)  # no key to send
        finally:
            if chunk is not None:
                chunk.release(self.budget)

    def _answer_error(self, conn: PeerConnection, error: tuple[Status, str]) -> None:
        self._expect(conn, self.limits.frame_timeout_s, "an ERROR frame not read")
        self._send_error(conn, *error)

    def _check_request(self, namespace: str, page_bytes: int) -> tuple[Status, str] | None:
        """What to answer instead of pages when the request does not fit this source."""
        try:
            mine = self.source.page_bytes(namespace)
        except LookupError as e:
            return Status.INVALID, str(e)
        if mine != page_bytes:
            return (
                Status.INVALID,
                f"page size mismatch for {namespace!r}: source pages are "
                f"{mine} bytes, the request expects {page_bytes}",
            )
        return None

    def pin_chunk(
        self,
        conn: PeerConnection,
        namespace: str,
        keys: list[bytes],
        todo: list[int],
        end: float,
        late: str,
    ) -> tuple[PinnedChunk | None, tuple[Status, str] | None]:
        """The next keys of ``todo`` pinned (as many as the pin budget grants by ``end``), or
        what to answer instead."""
        # NOTE: waiting for the budget is not the peer's fault: the watchdog leaves it the
        # frame timeout past the deadline to take the ERROR that answers a wait in vain.
        self._expect(conn, end + self.limits.frame_timeout_s - time.monotonic(), late)
        got = pin_chunk(
            self.budget, self.source, namespace, keys, todo, conn.conn_id, conn.host, end
        )
        self._expect(conn, end - time.monotonic(), late)
        return got

    def _await_go(self, conn: PeerConnection, count: int, end: float) -> list[int]:
        """After a HOLD FETCH: the GO frame (within the frame timeout, and the FETCH deadline);
        returns the indices of the pages still wanted."""
        frame = self.limits.frame_timeout_s
        wait = min(frame, end - time.monotonic())
        self._expect(conn, wait, f"no GO within {frame:g} s of a held FETCH")
        buf = bytearray(HEADER_BYTES)
        recv_exact(conn.sock, memoryview(buf))
        h = unpack_header(buf)
        if h.kind is not Kind.GO or h.count != count:
            raise ProtocolError(
                f"expected a GO for {count} keys after a held FETCH, got {h.kind.name} "
                f"for {h.count}"
            )
        check_request_size(h)
        body = conn.read_body(h, limit=count)
        if len(body) != count:
            raise ProtocolError(f"GO of {len(body)} bytes for {count} keys")
        return [i for i, wanted in enumerate(body) if wanted]

    def _stream_pages(
        self,
        conn: PeerConnection,
        keys: list[bytes],
        pinned: PinnedPages,
        wanted: Sequence[int],
        last: bool,
    ) -> None:
        """Send the ``wanted`` pages of a pinned chunk (``keys[i]``: ``pinned.views[i]``), and
        the END of the response after the ``last`` chunk."""
        views = pinned.views
        corrupt: list[int] = []
        batch: list = []
        batch_bytes = pages = sent_bytes = missing = 0
        corrupt_every = self.faults.corrupt_every
        for i in wanted:
            key, view = keys[i], views[i]
            if self.faults.stall_after:
                batch, batch_bytes, sent_bytes = self._maybe_stall(
                    conn, batch, batch_bytes, sent_bytes
                )
            csum = 0 if view is None else checksum(view)
            if view is not None and pinned.expected(i) not in (0, csum):
                corrupt.append(i)  # changed since its commit: sent as missing
                view = None
            if view is None:
                batch.append(pack_header(Kind.PAGE, Status.NOT_FOUND, key=key))
                missing += 1
            else:
                if corrupt_every:
                    view = self._maybe_corrupt(view, corrupt_every)
                batch.append(
                    pack_header(Kind.PAGE, Status.OK, key=key, length=view.nbytes, checksum_=csum)
                )
                batch.append(view)
                batch_bytes += view.nbytes
                pages += 1
            # NOTE: missing keys count too: a run of them is one buffer each, and sendmsg takes
            # at most IOV_MAX (1024) buffers (EMSGSIZE past it).
            if len(batch) >= 2 * _SEND_BATCH_PAGES or batch_bytes >= _SEND_BATCH_BYTES:
                conn.send(batch)
                sent_bytes += batch_bytes
                batch, batch_bytes = [], 0
        if last:
            batch.append(pack_header(Kind.END))
        pinned.corrupt(corrupt)
        # NOTE: count before the END goes out: a peer that saw END may read the stats at once.
        with self._lock:
            self.stats.pages_sent += pages
            self.stats.bytes_sent += sent_bytes + batch_bytes
            self.stats.missing_pages += missing
        if batch:
            conn.send(batch)

    def _maybe_stall(
        self, conn: PeerConnection, batch: list, batch_bytes: int, sent_bytes: int
    ) -> tuple[list, int, int]:
        with self._lock:
            self._pages_streamed += 1
            stall = not self._stalled and self._pages_streamed > self.faults.stall_after
            self._stalled |= stall
        if not stall:
            return batch, batch_bytes, sent_bytes
        conn.send(batch)  # what came before the stall point reaches the peer first
        log.warning("fault injection: stalling the data stream for %.1f s", self.faults.stall_s)
        end = time.monotonic() + self.faults.stall_s
        until = self.faults.stall_until
        while not conn.cut and not self._stopped.wait(min(0.05, max(0.0, end - time.monotonic()))):
            if time.monotonic() >= end or (until and os.path.exists(until)):
                break
        return [], 0, sent_bytes + batch_bytes

    def _maybe_corrupt(self, view: memoryview, every: int) -> memoryview:
        with self._lock:
            self._pages_seen += 1
            hit = self._pages_seen % every == 0
        if not hit:
            return view
        bad = bytearray(view)
        bad[len(bad) // 2] ^= 0xFF
        log.warning("fault injection: corrupting one byte of a page on the wire")
        return memoryview(bad)

    def _send_error(self, conn: PeerConnection, status: Status, message: str) -> None:
        body = message.encode()[:MAX_CONTROL_BYTES]
        conn.send(
            [pack_header(Kind.ERROR, status, length=len(body), checksum_=checksum(body)), body]
        )
