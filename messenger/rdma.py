"""RDMA transport: one-sided RDMA READs by the destination into its registered page memory.

Protocol (control over the peer's TCP data port, see ``frames.py``):

1. ``RDMA_CONNECT`` (JSON: our QP's QPN/PSN/LID/GID/MTU) -> ``RDMA_ACCEPT`` (the source's QP
   info). Both sides move their RC QP to RTS towards the other. One QP per peer connection.
2. ``RDMA_PIN`` (namespace, page size, keys) -> ``RDMA_PINNED``: a lease id, the address and
   length of the mapping the pages live in and, per key, the page's offset in it (-1: absent),
   its xxh3-64 checksum and the rkey of the memory window the source bound over its run of
   pages for this lease, through this connection's QP (``rdma_source.py``: nothing else of the
   source's memory is readable, by this QP or any other, and not after the release).
3. The destination plans READs: pages sorted by remote address, runs contiguous on both sides
   (and in one window) merged into one work request, WRs posted in chains of at most ``chain``
   with only the last signaled (the QP is created without ``sq_sig_all``), at most
   ``chains_in_flight`` chains and ``max_send_wr`` WRs outstanding. A chain has landed when
   its last WR's completion arrives (completions come in posting order), never at an earlier
   one; completions are polled without ever blocking inside the verbs library (it would hold
   the GIL).
4. Checksums verified; ``RDMA_RELEASE`` invalidates the windows and unpins. A connection that
   closes releases its leases.

The destination registers the mapping its pages live in (``FetchGroup.region``: a restarted
node's new segment) when it is not registered yet, and drops the registrations of mappings no
longer in use (``rdma_regions.py``).

Failures are per entry. A failed completion fails its chain's entries and every later one (the
QP is in the error state), and the peer's RDMA session is dropped; ``FallbackTransport`` then
retries those entries over TCP and keeps that peer on TCP.
"""

from __future__ import annotations

import itertools
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .data_security import connect
from .frames import (
    DEFERRED,
    HEADER_BYTES,
    MAX_CONTROL_BYTES,
    MAX_KEYS_PER_REQUEST,
    PINNED_BYTES_PER_KEY,
    Header,
    Kind,
    ProtocolError,
    Status,
    checksum,
    is_disconnect,
    lease_key,
    pack_header,
    pack_json,
    recv_exact,
    recv_header,
    send_buffers,
    unpack_json,
    unpack_pinned,
)
from .identity import Identity
from .rdma_regions import Registrations, buffer_address
from .rdma_source import RdmaSource as RdmaSource  # re-exported: the source side moved
from .tcp import destination_views, hello, parse_address, request_body
from .transport import OK, EntryResult, FetchGroup, Outcome, Transport
from .verbs import (
    Access,
    MemoryRegion,
    QpInfo,
    QueuePair,
    ReadWr,
    VerbsBackend,
    VerbsError,
    wc_status_text,
)

log = logging.getLogger(__name__)

_STATUS_OUTCOME = {
    Status.NOT_FOUND: Outcome.NOT_FOUND,
    Status.UNAVAILABLE: Outcome.UNAVAILABLE,
    Status.INVALID: Outcome.INVALID,
    Status.INTERNAL: Outcome.INTERNAL,
    Status.UNAUTHENTICATED: Outcome.UNAVAILABLE,
}


# ---- planning (pure) ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Segment:
    """One READ covering pages that are contiguous on both sides."""

    remote_addr: int
    local_addr: int
    length: int
    entries: tuple[int, ...]  # entry indices, in address order
    rkey: int = 0  # the source's window over these pages


def plan_segments(
    entries: Sequence[tuple[int, int, int, int]], page_bytes: int, max_bytes: int
) -> list[Segment]:
    """``entries``: (index, remote_addr, local_addr, rkey) per page. Sorted by remote address,
    and merged where the next page follows on both sides under the same rkey (a READ lies in
    one window), up to ``max_bytes`` per segment."""
    out: list[Segment] = []
    run: list[int] = []
    r0 = l0 = key = 0
    length = 0
    for idx, raddr, laddr, rkey in sorted(entries, key=lambda e: e[1]):
        if (
            run
            and raddr == r0 + length
            and laddr == l0 + length
            and rkey == key
            and length + page_bytes <= max_bytes
        ):
            run.append(idx)
            length += page_bytes
            continue
        if run:
            out.append(Segment(r0, l0, length, tuple(run), key))
        run, r0, l0, key, length = [idx], raddr, laddr, rkey, page_bytes
    if run:
        out.append(Segment(r0, l0, length, tuple(run), key))
    return out


def chain_segments(segments: Sequence[Segment], chain: int) -> list[list[Segment]]:
    return [list(segments[i : i + chain]) for i in range(0, len(segments), chain)]


# ---- destination side ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RdmaConfig:
    chain: int = 16  # WRs per posted chain (only the last one signaled)
    chains_in_flight: int = 4
    max_wr_bytes: int = 64 << 20  # a merged READ never exceeds this
    io_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    token: str | None = None  # HELLO on the control connection (token-protected port)
    tls: ssl.SSLContext | None = None  # the control connection speaks TLS (a client context)

    def __post_init__(self) -> None:
        if self.chain < 1 or self.chains_in_flight < 1 or self.max_wr_bytes < 1:
            raise ValueError("chain, chains_in_flight and max_wr_bytes must be positive")


class RdmaUnavailable(Exception):
    """RDMA cannot be used with this peer (no QP, no registered memory, refused)."""


class _Session:
    """Control connection and RC QP to one peer. Fetches to one peer take turns on it."""

    def __init__(self, sock: socket.socket, qp: QueuePair) -> None:
        self.sock = sock
        self.qp = qp
        self.header = bytearray(HEADER_BYTES)
        self.lock = threading.Lock()
        self.broken = False
        self.nonces = b""  # HELLO's, on a token-protected port

    def close(self) -> None:
        self.broken = True
        try:
            self.sock.close()
        finally:
            self.qp.close()

    def request(
        self,
        kind: Kind,
        body: bytes = b"",
        count: int = 0,
        key: bytes | None = None,
        flags: int = 0,
    ) -> tuple[Header, bytes]:
        head = pack_header(
            kind,
            count=count,
            flags=flags,
            length=len(body),
            checksum_=checksum(body),
            **({"key": key} if key is not None else {}),
        )
        send_buffers(self.sock, [head, body] if body else [head])
        h = recv_header(self.sock, self.header)
        if h.length > MAX_CONTROL_BYTES + PINNED_BYTES_PER_KEY * MAX_KEYS_PER_REQUEST + 64:
            raise ProtocolError(f"oversized {h.kind.name} reply")
        reply = bytearray(h.length)
        if h.length:
            recv_exact(self.sock, memoryview(reply))
        if h.length and checksum(reply) != h.checksum:  # bodiless replies (END) carry 0
            raise ProtocolError(f"{h.kind.name} reply checksum mismatch")
        return h, bytes(reply)


class RdmaTransport(Transport):
    name = "rdma"
    # The destination only issues READs: its pages are written by READ responses (LOCAL_WRITE)
    # and the peer may do nothing to its memory through the QP.
    local_access: int = Access.LOCAL_WRITE
    qp_access: int = 0

    def __init__(self, backend: VerbsBackend, config: RdmaConfig | None = None) -> None:
        self.backend = backend
        self.config = config or RdmaConfig()
        if self.config.chain * self.config.chains_in_flight > backend.max_send_wr:
            raise ValueError(
                f"chain x chains_in_flight exceeds the send queue ({backend.max_send_wr} WRs)"
            )
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self.regions = Registrations(backend, self.local_access)
        self._wr_ids = itertools.count(1)

    # ---- local memory ----------------------------------------------------------------------

    def register_local(self, region: np.ndarray, namespace: str | None = None) -> None:
        if namespace is None:
            self.regions.keep(region)
        else:  # replaced once a group's pages live in another mapping (a node restart)
            self.regions.register(region, namespace)

    # ---- sessions --------------------------------------------------------------------------

    def _session(self, peer: str) -> _Session:
        with self._lock:
            s = self._sessions.get(peer)
            if s is not None and not s.broken:
                return s
        host, port = parse_address(peer)
        try:
            sock = connect(
                host,
                port,
                connect_timeout_s=self.config.connect_timeout_s,
                io_timeout_s=self.config.io_timeout_s,
                tls=self.config.tls,
            )
        except OSError as e:
            raise RdmaUnavailable(f"cannot connect to peer {peer}: {e}") from None
        try:
            qp = self.backend.create_qp(sq_sig_all=False)  # only the WRs we flag complete
        except VerbsError as e:
            sock.close()
            raise RdmaUnavailable(f"cannot create a QP: {e}") from None
        session = _Session(sock, qp)
        try:
            if self.config.token:
                session.nonces = hello(sock, session.header, self.config.token)
            h, body = session.request(Kind.RDMA_CONNECT, pack_json({"qp": qp.info.to_dict()}))
            if h.kind is Kind.ERROR:
                raise RdmaUnavailable(f"peer {peer} refused RDMA: {body.decode(errors='replace')}")
            if h.kind is not Kind.RDMA_ACCEPT:
                raise ProtocolError(f"expected RDMA_ACCEPT, got {h.kind.name}")
            remote = QpInfo.from_dict(unpack_json(body).get("qp", {}))
            qp.connect(remote, self.qp_access)
        except (VerbsError, ValueError, ProtocolError, OSError) as e:
            session.close()
            raise RdmaUnavailable(f"RDMA handshake with {peer} failed: {e}") from None
        except RdmaUnavailable:
            session.close()
            raise
        with self._lock:
            old = self._sessions.get(peer)
            self._sessions[peer] = session
        if old is not None:
            old.close()
        return session

    def drop_session(self, peer: str) -> None:
        with self._lock:
            s = self._sessions.pop(peer, None)
        if s is not None:
            s.close()

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for s in sessions:
            s.close()
        self.regions.close()

    # ---- fetch -------------------------------------------------------------------------------

    def fetch(
        self,
        peer: str,
        namespace: str,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        identity: Identity | None = None,
    ) -> list[EntryResult]:
        return self._fetch(peer, namespace, keys, views, identity)[0]

    def fetch_group(self, peer: str, namespace: str, group: FetchGroup) -> list[EntryResult]:
        # Every page READ is checked whole against the source's checksum: pass those on.
        assert group.views is not None
        results, verified = self._fetch(
            peer, namespace, group.keys, group.views, group.identity, group.region
        )
        group.checksums = [verified.get(i, 0) for i in range(len(group.keys))]
        return results

    def _fetch(
        self,
        peer: str,
        namespace: str,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        identity: Identity | None = None,
        region: np.ndarray | None = None,
    ) -> tuple[list[EntryResult], dict[int, int]]:
        """``fetch``, and the checksum each page that came in whole was verified against.
        ``region``: the mapping the views point into, registered here if it is not yet."""
        n = len(keys)
        views = destination_views(keys, views)
        if n == 0:
            return [], {}
        held: list[MemoryRegion | None] = []
        try:
            if region is not None:
                held.append(self.regions.hold_region(region, namespace))
            return self._fetch_held(peer, namespace, keys, views, identity, held)
        except VerbsError as e:  # the region could not be registered
            reason = f"cannot register destination memory for RDMA: {e}"
            return [EntryResult(Outcome.UNAVAILABLE, reason)] * n, {}
        finally:
            self.regions.release(held)  # after the session's READs stopped (or it was dropped)

    def _fetch_held(
        self,
        peer: str,
        namespace: str,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        identity: Identity | None,
        held: list[MemoryRegion | None],
    ) -> tuple[list[EntryResult], dict[int, int]]:
        verified: dict[int, int] = {}
        n = len(keys)
        page_bytes = views[0].nbytes
        results: list[EntryResult | None] = [None] * n
        local = [buffer_address(v) for v in views]
        mrs = self.regions.hold([(addr, page_bytes) for addr in local])
        held += mrs
        lkeys = []
        for i, mr in enumerate(mrs):
            if mr is None:
                results[i] = EntryResult(
                    Outcome.UNAVAILABLE, "destination page is not in RDMA-registered memory"
                )
            lkeys.append(mr.lkey if mr else 0)
        todo = [i for i in range(n) if results[i] is None]
        try:
            session = self._session(peer)
        except RdmaUnavailable as e:
            return self._finish(results, Outcome.UNAVAILABLE, str(e)), verified
        with session.lock:
            try:
                while todo and not session.broken:
                    group, todo = todo[:MAX_KEYS_PER_REQUEST], todo[MAX_KEYS_PER_REQUEST:]
                    checked, deferred = self._fetch_group(
                        session,
                        namespace,
                        page_bytes,
                        group,
                        keys,
                        views,
                        local,
                        lkeys,
                        results,
                        identity,
                    )
                    verified.update(checked)
                    todo = deferred + todo  # past the source's pin budget: asked again
            except Exception as e:  # noqa: BLE001 - every failure becomes per-entry results
                session.broken = True
                if isinstance(e, (ProtocolError, VerbsError)) or is_disconnect(e):
                    reason = f"RDMA session with {peer} failed: {e}"
                else:
                    log.exception("RDMA fetch from %s failed", peer)
                    reason = f"internal error: {e!r}"
                self._finish(results, Outcome.UNAVAILABLE, reason)
        if session.broken:
            self.drop_session(peer)
        reason = f"RDMA session with {peer} failed"
        return self._finish(results, Outcome.UNAVAILABLE, reason), verified

    @staticmethod
    def _finish(results, outcome: Outcome, reason: str) -> list[EntryResult]:
        for i, r in enumerate(results):
            if r is None:
                results[i] = EntryResult(outcome, reason)
        return results

    def _fetch_group(
        self,
        session: _Session,
        namespace,
        page_bytes,
        group,
        keys,
        views,
        local,
        lkeys,
        results,
        identity: Identity | None,
    ) -> tuple[dict[int, int], list[int]]:
        """READ one request's pages; returns the checksum each good page was verified against,
        and the entries the source deferred (not pinned this time, to stay within its budget)."""
        body, flags = request_body(
            namespace, page_bytes, [keys[i] for i in group], identity, session.nonces
        )
        h, reply = session.request(Kind.RDMA_PIN, body, count=len(group), flags=flags)
        if h.kind is Kind.ERROR:
            outcome = _STATUS_OUTCOME.get(h.status, Outcome.INTERNAL)
            reason = reply.decode(errors="replace") or h.status.name
            for i in group:
                results[i] = EntryResult(outcome, reason)
            if h.status is Status.UNAUTHENTICATED:
                session.broken = True  # the source hangs up after it
            return {}, []
        if h.kind is not Kind.RDMA_PINNED or h.count != len(group):
            raise ProtocolError(f"expected RDMA_PINNED for {len(group)} keys, got {h.kind.name}")
        pinned = unpack_pinned(reply, len(group))
        verified: dict[int, int] = {}
        deferred: list[int] = []
        try:
            entries = []
            region_end = pinned.region_addr + pinned.region_length
            for j, i in enumerate(group):
                off = int(pinned.offsets[j])
                if off == DEFERRED:
                    deferred.append(i)
                    continue
                if off < 0:
                    results[i] = EntryResult(Outcome.NOT_FOUND, "source does not hold the key")
                    continue
                raddr = pinned.region_addr + off
                if raddr + page_bytes > region_end:
                    raise ProtocolError(f"page offset {off} outside the source region")
                entries.append((i, raddr, local[i], int(pinned.rkeys[j])))
            segments = plan_segments(entries, page_bytes, self.config.max_wr_bytes)
            self._read(session, segments, lkeys, results)
            sums = dict(zip(group, pinned.checksums.tolist()))
            for i, _, _, _ in entries:
                if results[i] is not None:
                    continue
                if checksum(views[i]) == sums[i]:
                    results[i] = OK
                    verified[i] = sums[i]
                else:
                    results[i] = EntryResult(
                        Outcome.DATA_LOSS, "checksum mismatch: page corrupted in transit"
                    )
        except BaseException:
            session.broken = True  # closing the control connection releases the source's pins
            raise
        h, _ = session.request(Kind.RDMA_RELEASE, key=lease_key(pinned.lease_id))
        if h.kind is not Kind.END:
            raise ProtocolError(f"expected END after RDMA_RELEASE, got {h.kind.name}")
        if len(deferred) == len(group):  # never granted nothing: a broken source
            raise ProtocolError(f"the source deferred every key of an RDMA_PIN of {len(group)}")
        return verified, deferred

    def _read(self, session: _Session, segments: list[Segment], lkeys, results) -> None:
        """Post the segments as chained READs and wait until every one has landed; a failed
        chain fails its entries.

        Only the last WR of a chain is signaled, and a chain counts as landed only when the
        completion of *that* WR arrives: completions of one send queue come in posting order,
        so it proves that every earlier WR of the chain has landed too. A completion for any
        other WR (a QP created with ``sq_sig_all`` would deliver one per WR) proves nothing
        about the rest of its chain; it only frees send-queue slots. Waiting for the first
        completion of a batch instead would return while pages are still being written.

        The send queue is accounted here as the HCA does: a WR holds its slot from its post
        until a completion for it or a later WR is polled, and a chain is posted only when all
        its WRs fit in ``max_send_wr`` (unsignaled WRs would otherwise overflow it)."""
        cfg = self.config
        qp = session.qp
        depth = self.backend.max_send_wr
        chains = chain_segments(segments, cfg.chain)
        in_flight: dict[int, list[Segment]] = {}  # a chain's last (signaled) wr_id -> the chain
        last_of: dict[int, int] = {}  # every posted wr_id -> the last wr_id of its chain
        seq_of: dict[int, int] = {}  # every posted wr_id -> its place in posting order (1-based)
        posted = retired = 0  # WRs posted / retired (slots freed) on this QP during this read
        next_chain = 0
        deadline = time.monotonic() + cfg.io_timeout_s
        idle_polls = 0
        while next_chain < len(chains) or in_flight:
            while (
                next_chain < len(chains)
                and len(in_flight) < cfg.chains_in_flight
                and posted - retired + len(chains[next_chain]) <= depth
                and not session.broken
            ):
                chain = chains[next_chain]
                next_chain += 1
                wrs = [
                    ReadWr(
                        wr_id=next(self._wr_ids),
                        local_addr=seg.local_addr,
                        lkey=lkeys[seg.entries[0]],
                        remote_addr=seg.remote_addr,
                        rkey=seg.rkey,
                        length=seg.length,
                        signaled=k == len(chain) - 1,
                    )
                    for k, seg in enumerate(chain)
                ]
                last = wrs[-1].wr_id
                for wr in wrs:
                    posted += 1
                    seq_of[wr.wr_id] = posted
                    last_of[wr.wr_id] = last
                in_flight[last] = chain
                qp.post_reads(wrs)
            if session.broken and next_chain < len(chains):
                for chain in chains[next_chain:]:
                    _fail_chain(chain, results, "not posted: the RDMA queue pair failed")
                next_chain = len(chains)
            completions = qp.poll(16)
            if not completions:
                if time.monotonic() > deadline:
                    session.broken = True
                    for chain in in_flight.values():
                        _fail_chain(chain, results, "RDMA READ timed out")
                    return
                # NOTE: never block inside the verbs library (it holds the GIL): back off here.
                idle_polls += 1
                time.sleep(0 if idle_polls < 64 else 50e-6)
                continue
            idle_polls = 0
            deadline = time.monotonic() + cfg.io_timeout_s
            for wc in completions:
                seq = seq_of.pop(wc.wr_id, None)
                if seq is None:
                    raise VerbsError(f"completion for a work request never posted ({wc.wr_id})")
                retired = max(retired, seq)
                last = last_of.pop(wc.wr_id)
                if not wc.ok:
                    session.broken = True
                    chain = in_flight.pop(last, None)
                    if chain is not None:
                        _fail_chain(
                            chain, results, f"RDMA READ failed: {wc_status_text(wc.status)}"
                        )
                elif wc.wr_id == last:
                    in_flight.pop(last, None)  # the chain's last WR: the whole chain landed
            if session.broken:
                # The QP is in the error state: what is still in flight is flushed, not read.
                for chain in in_flight.values():
                    _fail_chain(chain, results, "RDMA READ flushed after an earlier error")
                in_flight.clear()


def _fail_chain(chain: list[Segment], results, reason: str) -> None:
    failure = EntryResult(Outcome.UNAVAILABLE, reason)
    for seg in chain:
        for i in seg.entries:
            if results[i] is None:
                results[i] = failure


# ---- fallback ------------------------------------------------------------------------------------

_RETRYABLE = (Outcome.UNAVAILABLE, Outcome.INTERNAL)


class FallbackTransport(Transport):
    """RDMA first; entries that fail for transport reasons are retried over TCP, and a peer whose
    RDMA failed stays on TCP (logged once per peer)."""

    def __init__(self, primary: Transport, fallback: Transport) -> None:
        self.primary, self.fallback = primary, fallback
        self.name = f"{primary.name}+{fallback.name}"
        self._lock = threading.Lock()
        self._tcp_only: dict[str, str] = {}

    def tcp_only_peers(self) -> dict[str, str]:
        with self._lock:
            return dict(self._tcp_only)

    def register_local(self, region: np.ndarray, namespace: str | None = None) -> None:
        self.primary.register_local(region, namespace)
        self.fallback.register_local(region, namespace)

    def fetch(
        self,
        peer: str,
        namespace: str,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        identity: Identity | None = None,
    ) -> list[EntryResult]:
        group = FetchGroup(list(keys), list(views), identity=identity)
        return self.fetch_group(peer, namespace, group)

    def fetch_group(self, peer: str, namespace: str, group: FetchGroup) -> list[EntryResult]:
        with self._lock:
            demoted = peer in self._tcp_only
        if demoted:
            return self.fallback.fetch_group(peer, namespace, group)
        results = self.primary.fetch_group(peer, namespace, group)
        retry = [i for i, r in enumerate(results) if r.outcome in _RETRYABLE]
        if not retry:
            return results
        group.checksums = None  # the retried pages' are not known here: the node hashes them
        keys, views = group.keys, group.views
        assert views is not None
        reason = results[retry[0]].reason
        with self._lock:
            first = peer not in self._tcp_only
            self._tcp_only[peer] = reason
        if first:
            log.warning(
                "%s to peer %s failed (%s); using %s for this peer from now on",
                self.primary.name,
                peer,
                reason,
                self.fallback.name,
            )
        again = self.fallback.fetch_group(
            peer,
            namespace,
            FetchGroup(
                [keys[i] for i in retry], [views[i] for i in retry], identity=group.identity
            ),
        )
        for i, r in zip(retry, again):
            results[i] = r
        return results

    def close(self) -> None:
        try:
            self.primary.close()
        finally:
            self.fallback.close()
