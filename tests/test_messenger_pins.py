"""The pin budget on the RDMA control path: leases a connection holds count together.

A real data server and RDMA source in this process (the fake verbs backend: RDMA needs no
hardware here), real TCP control connections, a slab page source of 40 pages: one connection may
hold 10 pinned at once (25%), one peer 20 (50%). The TCP FETCH path is covered against real node
and messenger processes in test_messenger_limits.py.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from messenger.data_server import DataLimits, DataServer
from messenger.frames import (
    DEFERRED,
    Kind,
    Status,
    lease_key,
    pack_keys_body,
    unpack_pinned,
)
from messenger.rdma import RdmaConfig, RdmaSource, RdmaTransport
from messenger.slab_peer import fill_pattern, pattern_keys
from messenger.transport import SlabPageSource
from messenger.verbs_fake import FakeFabric, FakeVerbsBackend

from helpers import wait_until

NS = "rdma|pins"
PAGES = 40
PB = 16 << 10


class Source:
    def __init__(self) -> None:
        self.fabric = FakeFabric()
        self.region = np.empty(PAGES * PB, dtype=np.uint8)
        fill_pattern(self.region.reshape(PAGES, PB))
        self.keys = pattern_keys(PAGES)
        slots = {k: i for i, k in enumerate(self.keys)}
        self.source = SlabPageSource(NS, self.region, PB, slots, pool_pages=PAGES)
        # Pins live as long as their lease; a wait for the pin budget ends after 1 s.
        self.server = DataServer(self.source, limits=DataLimits(fetch_deadline_s=1.0)).start()
        RdmaSource(FakeVerbsBackend(self.fabric), self.source).install(self.server)
        self.backend = FakeVerbsBackend(self.fabric)
        self.transports: list[RdmaTransport] = []

    def transport(self) -> RdmaTransport:
        t = RdmaTransport(self.backend, RdmaConfig(chain=4, chains_in_flight=2))
        self.transports.append(t)
        return t

    def connection(self):
        """A new control connection to the source (each transport opens its own)."""
        return self.transport()._session(self.server.address)

    def close(self) -> None:
        for t in self.transports:
            t.close()
        self.server.stop()


@pytest.fixture
def src():
    s = Source()
    yield s
    s.close()


def pin(session, keys: list[bytes]):
    h, body = session.request(Kind.RDMA_PIN, pack_keys_body(NS, PB, keys), count=len(keys))
    if h.kind is Kind.ERROR:
        return h.status, body.decode()
    assert h.kind is Kind.RDMA_PINNED
    return unpack_pinned(body, len(keys))


def test_a_fetch_larger_than_a_connections_share_is_pinned_in_turns(src):
    t = src.transport()
    dst = np.zeros((PAGES, PB), dtype=np.uint8)
    t.register_local(dst.reshape(-1))
    res = t.fetch(src.server.address, NS, src.keys, [memoryview(p) for p in dst])
    assert all(r.ok for r in res), res[0]
    np.testing.assert_array_equal(dst.reshape(-1), src.region)
    # 40 pages through a budget of 10: four leases, one after the other, all released.
    assert src.server.stats.requests == 1 + 4 + 4  # connect, then pin + release each
    assert src.source.pins == 0 and src.server.budget.pinned == 0


def test_rdma_leases_stay_within_the_connections_and_the_peers_share(src):
    budget = src.server.budget
    one = src.connection()
    first = pin(one, src.keys[:15])  # more than a connection's share: the rest is deferred
    assert (first.offsets[:10] >= 0).all() and (first.offsets[10:] == DEFERRED).all()
    # Holding its whole share, the connection must release before it pins more.
    status, reason = pin(one, src.keys[15:16])
    assert status is Status.UNAVAILABLE and "--pin-share-per-connection" in reason
    two = src.connection()  # the same peer's second connection: the other half of its share
    assert (pin(two, src.keys[20:30]).offsets >= 0).all()
    assert budget.pinned == 20 and src.source.pins == 2
    # A third connection waits for the peer's others, and pins once one releases.
    three, got = src.connection(), []
    waiter = threading.Thread(target=lambda: got.append(pin(three, src.keys[30:35])))
    waiter.start()
    wait_until(lambda: budget.waits == 1, 10, "the third connection to wait")
    h, _ = one.request(Kind.RDMA_RELEASE, key=lease_key(first.lease_id))
    assert h.kind is Kind.END
    waiter.join(10)
    assert (got[0].offsets >= 0).all() and budget.pinned == 15
    # Nothing released this time: the wait ends at the deadline, with the reason.
    assert (pin(one, src.keys[:5]).offsets >= 0).all()  # the rest of the peer's share
    status, reason = pin(src.connection(), src.keys[35:36])
    assert status is Status.UNAVAILABLE
    assert "peer 127.0.0.1 holds 20 pinned pages" in reason and "--pin-share-per-peer" in reason
    assert budget.refusals == 2
    for t in src.transports:  # connections closed: their leases go back
        t.close()
    wait_until(lambda: src.source.pins == 0 and budget.pinned == 0, 10, "every pin released")
