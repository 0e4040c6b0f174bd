"""The source side of the RDMA transport (``rdma.py``): the data port's RDMA control requests.

A destination connects an RC QP over the control connection (``RDMA_CONNECT``), asks for pages
(``RDMA_PIN``: pinned, then described in ``RDMA_PINNED``), READs them itself and releases them
(``RDMA_RELEASE``); a connection that closes releases its leases.
"""

from __future__ import annotations

import itertools
import threading
import time

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
from .transport import PageSource
from .verbs import Access, MemoryRegion, QpInfo, VerbsBackend, VerbsError


def buffer_address(buf) -> int:
    """Address of the first byte of a buffer (numpy array or memoryview)."""
    if isinstance(buf, np.ndarray):
        return buf.ctypes.data
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


class RdmaSource:
    """Adds the RDMA control requests to a ``DataServer``: QP setup, pin, release.

    Each namespace's region is registered once (lazily, at the first pin) with REMOTE_READ;
    each peer's QP lets that peer READ (and nothing else)."""

    mr_access: int = Access.LOCAL_WRITE | Access.REMOTE_READ
    qp_access: int = Access.REMOTE_READ

    def __init__(self, backend: VerbsBackend, source: PageSource) -> None:
        self.backend = backend
        self.source = source
        self._lock = threading.Lock()
        self._mrs: dict[str, MemoryRegion] = {}
        self._leases = itertools.count(1)
        self._server: DataServer | None = None

    def install(self, server: DataServer) -> None:
        self._server = server
        server.add_handler(Kind.RDMA_CONNECT, self._connect)
        server.add_handler(Kind.RDMA_PIN, self._pin)
        server.add_handler(Kind.RDMA_RELEASE, self._release)

    def close(self) -> None:
        with self._lock:
            mrs, self._mrs = list(self._mrs.values()), {}
        for mr in mrs:
            self.backend.deregister(mr)

    def region_mr(self, namespace: str) -> MemoryRegion:
        with self._lock:
            mr = self._mrs.get(namespace)
            if mr is None:
                region = self.source.region(namespace)
                mr = self.backend.register(buffer_address(region), region.nbytes, self.mr_access)
                self._mrs[namespace] = mr
            return mr

    def _connect(self, conn: PeerConnection, header: Header) -> None:
        request = unpack_json(conn.read_body(header))
        if "qp" in conn.state:
            raise ProtocolError("RDMA_CONNECT twice on one connection")
        try:
            remote = QpInfo.from_dict(request.get("qp", {}))
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        try:
            qp = self.backend.create_qp(sq_sig_all=False)  # posts nothing; responds to READs
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
            if mine != page_bytes:
                return _send_error(
                    conn,
                    Status.INVALID,
                    f"page size mismatch for {namespace!r}: source pages are "
                    f"{mine} bytes, the request expects {page_bytes}",
                )
            mr = self.region_mr(namespace)
        except LookupError as e:
            return _send_error(conn, Status.INVALID, str(e))
        except VerbsError as e:
            return _send_error(conn, Status.UNAVAILABLE, f"source cannot register memory: {e}")
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
        lease_id = next(self._leases)
        conn.state.setdefault("leases", {})[lease_id] = chunk
        if len(conn.state["leases"]) == 1:
            conn.on_close.append(lambda: _release_all(conn, server))
        pinned, n = chunk.pinned, len(chunk.indices)
        sums = np.zeros(len(keys), dtype=np.uint64)
        sums[:n] = [checksum(v) if v is not None else 0 for v in pinned.views]
        offsets = np.full(len(keys), DEFERRED, dtype=np.int64)
        offsets[:n] = pinned.offsets
        # A page changed since its commit is offered as missing, never as good bytes.
        corrupt = [i for i in range(n) if pinned.expected(i) not in (0, int(sums[i]))]
        for i in corrupt:
            offsets[i], sums[i] = -1, 0
        pinned.corrupt(corrupt)
        body = pack_pinned(Pinned(lease_id, mr.addr, mr.length, mr.rkey, offsets, sums))
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
        chunk: PinnedChunk | None = conn.state.get("leases", {}).pop(lease_of_key(header.key), None)
        if chunk is not None:
            assert self._server is not None
            chunk.release(self._server.budget)
        conn.send([pack_header(Kind.END)])


def _release_all(conn: PeerConnection, server: DataServer) -> None:
    leases = conn.state.get("leases", {})
    while leases:
        _, chunk = leases.popitem()
        chunk.release(server.budget)


def _send_error(conn: PeerConnection, status: Status, message: str) -> None:
    body = message.encode()[:MAX_CONTROL_BYTES]
    conn.send([pack_header(Kind.ERROR, status, length=len(body), checksum_=checksum(body)), body])
