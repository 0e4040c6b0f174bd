"""Per-tenant shared memory: each tenant maps a memfd segment of its own, never the node's pages.

With tenant tokens configured, the node keeps its DRAM pages in a private memfd (``private_dram``:
no name in /dev/shm, never handed out) and gives every (tenant, namespace) a segment of its own:
an anonymous, sealed memfd handed to the tenant's client as a file descriptor over the node's
Unix-domain *segment socket*. The client earns it with a one-time ticket that ``OpenShm`` issues
over the authenticated gRPC channel (the bearer token never crosses the socket), bound to the
caller's tenant and the namespace and void after ``TICKET_TTL_S``.

The segment is a window onto the tenant's own leases, by copy: page ``slot`` of the store's DRAM
pool appears at offset ``slot * page_bytes`` of the segment of the tenant that leased it.
``Allocate`` hands out those offsets and ``Commit`` copies the written pages into the store (under
the store's lock, through ``TieredStore.write``, which refuses an expired lease); ``Acquire``
copies pinned pages in (through ``copy_out``, which checks their checksums). An offset a tenant is
told is computed from its own lease and always read against its own segment: no reply and no
descriptor of tenant A ever reaches B's pages, and a tenant's scribbles after a commit never reach
the store.

DRAM budget: ``--dram`` stays the store's pool, shared by all tenants under one eviction policy
as before (no static split that strands one tenant's share while another thrashes). Segments are
sparse (pages are backed when written) and a page is given back (``punch``) when the last lease of
the tenant on it ends, so they hold only the pages of live leases: at most another ``--dram`` in
all, when every DRAM page is leased at once, and usually a small fraction of it. The price is one
node-side copy per page written or read, instead of true zero copy.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from numpy.typing import NDArray

from kvstore.shm import MemfdSegment, deny, read_hello, send_segment, socket_address
from kvstore.store import TieredStore
from kvstore.tiers import Tier

log = logging.getLogger(__name__)
TICKET_TTL_S = 10.0
HANDSHAKE_TIMEOUT_S = 2.0
MAX_TICKETS = 4096  # outstanding tickets; the oldest go first
MAX_HANDSHAKES = 64  # connections being answered at once; more are closed at once


@dataclass(frozen=True, slots=True)
class _Ticket:
    tenant: str
    namespace: str
    deadline: float


@dataclass(frozen=True, slots=True)
class _Staged:
    tenant: str
    slots: list[int]  # per key of the lease: the pool slot shown at slot * page_bytes, or -1


class TenantSegments:
    """Segments per (namespace, tenant), tickets, the segment socket, and the staged leases."""

    def __init__(self, stores: dict[str, TieredStore]) -> None:
        self._stores = stores
        self.socket_name = f"@kvcache-shm-{os.getpid()}-{secrets.token_hex(8)}"
        self._segments: dict[tuple[str, str], MemfdSegment] = {}
        self._tickets: dict[bytes, _Ticket] = {}
        self._holds: dict[tuple[str, str, int], int] = {}
        self._leases: dict[tuple[str, int], _Staged] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(socket_address(self.socket_name))
        self._server.listen(64)
        self._server.settimeout(0.25)
        self._thread = threading.Thread(target=self._accept, name="shm-segments", daemon=True)
        self._thread.start()

    def segment_bytes(self, namespace: str) -> int:
        store = self._stores[namespace]
        return store.capacity(Tier.DRAM) * store.layout.page_bytes

    # ---- tickets and the socket ---------------------------------------------------------------

    def ticket(self, namespace: str, tenant: str) -> bytes:
        """A one-time ticket for ``tenant``'s segment of ``namespace``."""
        ticket = secrets.token_bytes(32)
        now = time.monotonic()
        with self._lock:
            for t in [t for t, v in self._tickets.items() if v.deadline < now]:
                del self._tickets[t]
            while len(self._tickets) >= MAX_TICKETS:
                del self._tickets[next(iter(self._tickets))]
            self._tickets[ticket] = _Ticket(tenant, namespace, now + TICKET_TTL_S)
        return ticket

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            # NOTE: anyone on the host can connect; a flood of silent connections must not pile
            # up threads (each waits HANDSHAKE_TIMEOUT_S at most).
            if not self._handshakes.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(
                target=self._handshake, args=(conn,), name="shm-handshake", daemon=True
            ).start()

    def _handshake(self, conn: socket.socket) -> None:
        try:
            self._answer(conn)
        finally:
            self._handshakes.release()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                presented = read_hello(conn, HANDSHAKE_TIMEOUT_S)  # the whole line, not a read
            except OSError:
                return
            with self._lock:
                entry = self._tickets.pop(presented, None) if presented else None
            if entry is None or entry.deadline < time.monotonic():
                log.warning("segment socket: refused a connection without a valid ticket")
                deny(conn, "no valid ticket (get a fresh one with OpenShm; each works once)")
                return
            try:
                send_segment(conn, self.segment(entry.namespace, entry.tenant))
            except OSError as e:
                log.info("segment socket: the client left before its segment was sent: %s", e)

    # ---- segments and staged leases ----------------------------------------------------------

    def segment(self, namespace: str, tenant: str) -> MemfdSegment:
        with self._lock:
            seg = self._segments.get((namespace, tenant))
            if seg is None:
                seg = MemfdSegment(self.segment_bytes(namespace), label="kvcache-tenant")
                self._segments[(namespace, tenant)] = seg
            return seg

    def page(self, namespace: str, tenant: str, slot: int) -> NDArray[np.uint8]:
        page = self._stores[namespace].layout.page_bytes
        view: NDArray[np.uint8] = self.segment(namespace, tenant).array[
            slot * page : (slot + 1) * page
        ]
        return view

    def hold(self, namespace: str, lease_id: int, tenant: str, slots: Sequence[int]) -> None:
        """Show a lease's pages in its tenant's segment until ``drop``."""
        self.segment(namespace, tenant)
        with self._lock:
            self._leases[(namespace, lease_id)] = _Staged(tenant, list(slots))
            for slot in slots:
                if slot >= 0:
                    k = (namespace, tenant, slot)
                    self._holds[k] = self._holds.get(k, 0) + 1

    def staged(self, namespace: str, lease_id: int) -> _Staged | None:
        with self._lock:
            return self._leases.get((namespace, lease_id))

    def fill(self, store: TieredStore, lease_id: int) -> None:
        """Copy a write lease's pages from its tenant's segment into the store's pages."""
        staged = self.staged(store.namespace, lease_id)
        if staged is None:
            return
        for i, slot in enumerate(staged.slots):
            if slot >= 0:
                store.write(lease_id, i, self.page(store.namespace, staged.tenant, slot))

    def drop(self, namespace: str, lease_id: int) -> None:
        """The lease ended: give back the segment pages no other lease of its tenant shows.
        (Under the lock: a ``hold`` of the same page meanwhile must not lose what it copies in.)"""
        page = self._stores[namespace].layout.page_bytes
        with self._lock:
            staged = self._leases.pop((namespace, lease_id), None)
            if staged is None:
                return
            seg = self._segments.get((namespace, staged.tenant))
            for slot in staged.slots:
                if slot < 0:
                    continue
                k = (namespace, staged.tenant, slot)
                n = self._holds.get(k, 0) - 1
                if n > 0:
                    self._holds[k] = n
                    continue
                self._holds.pop(k, None)
                if seg is not None and seg.array is not None:
                    seg.punch(slot * page, page)

    def close(self) -> None:
        self._stop.set()
        try:
            self._server.close()
        except OSError:
            pass
        self._thread.join(timeout=2.0)
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
            self._leases.clear()
            self._holds.clear()
            self._tickets.clear()
        for seg in segments:
            seg.close()
