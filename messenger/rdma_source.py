"""The source side of the RDMA transport (``rdma.py``): the data port's RDMA control requests.

A destination connects an RC QP over the control connection (``RDMA_CONNECT``), asks for pages
(``RDMA_PIN``: pinned, then described in ``RDMA_PINNED``), READs them itself and releases them
(``RDMA_RELEASE``); a connection that closes releases its leases.

Remote access is exactly as wide as a lease (issue 33). The mapping the pinned pages live in is
registered with ``MW_BIND`` only: its own rkey reads nothing. Per lease, a type-2 memory window
is bound over each run of pinned pages contiguous in the mapping, through the QP of the
connection that pinned them, with REMOTE_READ only; ``RDMA_PINNED`` carries each page's window
rkey. So the peer reads exactly the pages of its lease, through its own QP, until the lease is
released: then (and when the connection closes) the windows are invalidated (a local invalidate
WR, then ``ibv_dealloc_mw``) before the pages are unpinned. A window is never bound twice (see
``verbs.MemoryWindow``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .data_server import DataServer, PeerConnection
from .frames import (
    DEFERRED,
    MAX_CONTROL_BYTES,
    Header,
    Kind,
    Pinned,
    ProtocolError,
    Status,
    checksum,
    lease_of_key,
    pack_header,
    pack_json,
    pack_pinned,
    unpack_json,
)
from .pin_budget import PinnedChunk
from .rdma_regions import Registrations
from .rdma_regions import buffer_address as buffer_address  # re-exported for rdma.py
from .transport import PageSource
from .verbs import (
    Access,
    BindWr,
    InvalidateWr,
    MemoryRegion,
    MemoryWindow,
    QpInfo,
    QueuePair,
    SendWr,
    VerbsBackend,
    VerbsError,
    wc_status_text,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Lease:
    chunk: PinnedChunk
    mr: MemoryRegion  # the mapping's registration, held while the lease lives
    windows: list[MemoryWindow] = field(default_factory=list)  # bound, one per run of pages


def page_runs(offsets: Sequence[int] | np.ndarray, page_bytes: int) -> list[tuple[int, int]]:
    """(start, end) byte ranges of the pages at ``offsets`` (>= 0; others skipped), merged
    where pages follow each other, in address order."""
    offs = np.unique(np.asarray(offsets, dtype=np.int64))  # sorted; a page asked twice once
    offs = offs[offs >= 0]
    if not len(offs):
        return []
    # NOTE: numpy, not a loop per page: a request has up to 4096 of them
    breaks = np.flatnonzero(np.diff(offs) > page_bytes) + 1  # pages overlap only if equal
    starts = offs[np.concatenate(([0], breaks))]
    ends = offs[np.concatenate((breaks - 1, [len(offs) - 1]))] + page_bytes
    return list(zip(starts.tolist(), ends.tolist()))


class RdmaSource:
    """Adds the RDMA control requests to a ``DataServer``: QP setup, pin, release.

    The mapping a lease's pages live in (``PinnedPages.region``; a restarted node's new segment
    included) is registered at its first pin with ``mr_access`` and deregistered once no lease
    uses it and a newer one replaced it; each lease's pages are readable through windows with
    ``mw_access``; each peer's QP lets that peer READ (and nothing else)."""

    mr_access: int = Access.MW_BIND  # no remote access through the region's own rkey
    mw_access: int = Access.REMOTE_READ
    qp_access: int = Access.REMOTE_READ
    verbs_timeout_s: float = 10.0  # for a bind or invalidate to complete on the source's QP

    def __init__(self, backend: VerbsBackend, source: PageSource) -> None:
        self.backend = backend
        self.source = source
        self.regions = Registrations(backend, self.mr_access)
        self._leases = itertools.count(1)
        self._wr_ids = itertools.count(1)
        self._server: DataServer | None = None

    def install(self, server: DataServer) -> None:
        self._server = server
        server.add_handler(Kind.RDMA_CONNECT, self._connect)
        server.add_handler(Kind.RDMA_PIN, self._pin)
        server.add_handler(Kind.RDMA_RELEASE, self._release)

    def close(self) -> None:
        """Registrations no lease uses go now; the others when their connections close."""
        self.regions.close()

    def _connect(self, conn: PeerConnection, header: Header) -> None:
        request = unpack_json(conn.read_body(header))
        if "qp" in conn.state:
            raise ProtocolError("RDMA_CONNECT twice on one connection")
        try:
            remote = QpInfo.from_dict(request.get("qp", {}))
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        try:
            qp = self.backend.create_qp(sq_sig_all=False)  # posts binds and invalidations only
            conn.on_close.append(qp.close)
            qp.connect(remote, self.qp_access)
        except VerbsError as e:
            return _send_error(conn, Status.UNAVAILABLE, f"source cannot set up an RC QP: {e}")
        conn.state["qp"] = qp
        body = pack_json({"qp": qp.info.to_dict()})
        conn.send([pack_header(Kind.RDMA_ACCEPT, length=len(body), checksum_=checksum(body)), body])

    def _pin(self, conn: PeerConnection, header: Header) -> None:
        server = self._server
        assert server is not None
        namespace, page_bytes, _, keys = server.read_request(conn, header)
        if "qp" not in conn.state:
            return _send_error(conn, Status.INVALID, "RDMA_PIN before RDMA_CONNECT")
        try:
            mine = self.source.page_bytes(namespace)
        except LookupError as e:
            return _send_error(conn, Status.INVALID, str(e))
        if mine != page_bytes:
            return _send_error(
                conn,
                Status.INVALID,
                f"page size mismatch for {namespace!r}: source pages are "
                f"{mine} bytes, the request expects {page_bytes}",
            )
        # Within the pin budget (pin_budget.py), like a FETCH: the leases a connection holds
        # count together; keys past what the budget grants now are DEFERRED (asked again).
        deadline = server.limits.fetch_deadline_s
        end = time.monotonic() + deadline
        chunk, error = server.pin_chunk(
            conn,
            namespace,
            keys,
            list(range(len(keys))),
            end,
            f"an RDMA_PIN reply of {len(keys)} pages not read within {deadline:g} s",
        )
        if chunk is None:
            assert error is not None
            return _send_error(conn, *error)
        pinned, n = chunk.pinned, len(chunk.indices)
        try:
            region = pinned.region if pinned.region is not None else self.source.region(namespace)
            mr = self.regions.hold_region(region, namespace)
        except (LookupError, VerbsError) as e:
            chunk.release(server.budget)
            if isinstance(e, LookupError):
                return _send_error(conn, Status.INVALID, str(e))
            return _send_error(conn, Status.UNAVAILABLE, f"source cannot register memory: {e}")
        lease_id = next(self._leases)
        lease = _Lease(chunk, mr)
        conn.state.setdefault("leases", {})[lease_id] = lease
        if len(conn.state["leases"]) == 1:
            conn.on_close.append(lambda: self._release_all(conn))
        sums = np.zeros(len(keys), dtype=np.uint64)
        sums[:n] = [checksum(v) if v is not None else 0 for v in pinned.views]
        offsets = np.full(len(keys), DEFERRED, dtype=np.int64)
        offsets[:n] = pinned.offsets
        # A page changed since its commit is offered as missing, never as good bytes.
        corrupt = [i for i in range(n) if pinned.expected(i) not in (0, int(sums[i]))]
        for i in corrupt:
            offsets[i], sums[i] = -1, 0
        pinned.corrupt(corrupt)
        rkeys = np.zeros(len(keys), dtype=np.uint32)
        try:
            rkeys[:n] = self._open_windows(conn, lease, offsets[:n], page_bytes)
        except VerbsError as e:
            # The QP is in the error state now (or the device has no windows): answer, then
            # hang up; the puller's next pull opens a new connection and QP (or takes TCP).
            _send_error(conn, Status.UNAVAILABLE, f"source cannot open memory windows: {e}")
            raise ProtocolError(f"RDMA_PIN: memory windows failed: {e}") from None
        body = pack_pinned(Pinned(lease_id, mr.addr, mr.length, offsets, sums, rkeys))
        conn.send(
            [
                pack_header(
                    Kind.RDMA_PINNED, count=len(keys), length=len(body), checksum_=checksum(body)
                ),
                body,
            ]
        )

    def _release(self, conn: PeerConnection, header: Header) -> None:
        if header.length:
            raise ProtocolError("RDMA_RELEASE carries no body")
        lease: _Lease | None = conn.state.get("leases", {}).pop(lease_of_key(header.key), None)
        if lease is not None:
            self._close_lease(conn, lease)
        conn.send([pack_header(Kind.END)])

    def _release_all(self, conn: PeerConnection) -> None:
        leases = conn.state.get("leases", {})
        while leases:
            _, lease = leases.popitem()
            self._close_lease(conn, lease)

    # ---- memory windows ------------------------------------------------------------------------

    def _open_windows(
        self, conn: PeerConnection, lease: _Lease, offsets: np.ndarray, page_bytes: int
    ) -> np.ndarray:
        """Bind a window over each run of the pages at ``offsets`` (>= 0) through the
        connection's QP, wait until the binds completed, and return each page's rkey (0 for
        the others)."""
        runs = page_runs(offsets, page_bytes)
        rkeys = np.zeros(len(offsets), dtype=np.uint32)
        if not runs:
            return rkeys
        mr = lease.mr
        windows: list[MemoryWindow] = []
        try:
            for _ in runs:
                windows.append(self.backend.alloc_mw())
            wrs = [
                BindWr(
                    next(self._wr_ids),
                    mw,
                    mr,
                    mr.addr + start,
                    stop - start,
                    self.mw_access,
                    signaled=False,
                )
                for mw, (start, stop) in zip(windows, runs)
            ]
            self._post_and_wait(conn.state["qp"], wrs)
        except BaseException:
            self._dealloc(windows)  # bound or not, their rkeys read nothing after this
            raise
        lease.windows = windows
        starts = np.array([start for start, _ in runs], dtype=np.int64)
        window_rkeys = np.array([mw.rkey for mw in windows], dtype=np.uint32)
        held = offsets >= 0
        rkeys[held] = window_rkeys[np.searchsorted(starts, offsets[held], side="right") - 1]
        return rkeys

    def _close_lease(self, conn: PeerConnection, lease: _Lease) -> None:
        """Invalidate the lease's windows, then let its registration and its pins go."""
        assert self._server is not None
        try:
            if lease.windows:
                wrs = [InvalidateWr(next(self._wr_ids), mw.rkey, False) for mw in lease.windows]
                try:
                    self._post_and_wait(conn.state["qp"], wrs)
                except VerbsError as e:  # a QP in the error state flushes them: dealloc does it
                    log.info("invalidating %d memory windows: %s", len(wrs), e)
                self._dealloc(lease.windows)
                lease.windows = []
            self.regions.release([lease.mr])
        finally:
            lease.chunk.release(self._server.budget)

    def _dealloc(self, windows: list[MemoryWindow]) -> None:
        for mw in windows:
            try:
                self.backend.dealloc_mw(mw)
            except VerbsError as e:
                log.error("ibv_dealloc_mw failed (the window stays until the device closes): %s", e)

    def _post_and_wait(self, qp: QueuePair, wrs: list[SendWr]) -> None:
        """Post ``wrs`` (binds or invalidations) in chains that fit the send queue, only each
        chain's last signaled, and wait for that completion: it proves the chain executed."""
        depth = self.backend.max_send_wr
        for i in range(0, len(wrs), depth):
            chain = list(wrs[i : i + depth])
            last = chain[-1]
            chain[-1] = last = dataclasses.replace(last, signaled=True)
            qp.post_send(chain)
            deadline = time.monotonic() + self.verbs_timeout_s
            idle = 0
            while True:
                wcs = qp.poll(16)
                for wc in wcs:
                    if not wc.ok:
                        raise VerbsError(
                            f"{type(last).__name__} failed: {wc_status_text(wc.status)}"
                        )
                if any(wc.wr_id == last.wr_id for wc in wcs):
                    break
                if not wcs:
                    if time.monotonic() > deadline:
                        raise VerbsError(f"no completion within {self.verbs_timeout_s:g} s")
                    # NOTE: never block inside the verbs library (it holds the GIL).
                    idle += 1
                    time.sleep(0 if idle < 64 else 50e-6)


def _send_error(conn: PeerConnection, status: Status, message: str) -> None:
    body = message.encode()[:MAX_CONTROL_BYTES]
    conn.send([pack_header(Kind.ERROR, status, length=len(body), checksum_=checksum(body)), body])
