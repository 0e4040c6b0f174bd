"""Issue 33: an RDMA peer reads exactly the pages of its current pin, through its own QP, until the
pin is released (or its connection closes) -- never the rest of the node's memory.

The source registers its memory with MW_BIND only and binds a type-2 memory window per run of
pinned pages through the connection's QP (``messenger/rdma_source.py``); the fake verbs backend
checks windows as an HCA does (bound, bound through the QP the READ arrives on, range, access).

Each attack below posts its own READ on the puller's QP with an rkey the source handed out.
Against the source before memory windows (``WholeSlabSource``: the slab registered with
REMOTE_READ, its one rkey in every RDMA_PINNED) every one of them reads the bytes:
``test_every_attack_reads_the_bytes_with_a_whole_slab_rkey`` shows it, so each test here fails
on that code.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from messenger.frames import Kind, lease_key, pack_keys_body, unpack_pinned
from messenger.rdma import RdmaConfig, RdmaSource, RdmaTransport
from messenger.rdma_source import page_runs
from messenger.transport import Outcome
from messenger.verbs import Access, BindWr, InvalidateWr, ReadWr, VerbsError, WcStatus
from messenger.verbs_fake import FakeFabric, FakeVerbsBackend

from helpers import wait_until
from rdma_helpers import NS, PAGES, PB, Setup, completions


class WholeSlabSource(RdmaSource):
    """The source before issue 33: the region registered with REMOTE_READ, its rkey handed out
    for every page, no windows."""

    mr_access = Access.LOCAL_WRITE | Access.REMOTE_READ

    def _open_windows(self, conn, lease, offsets, page_bytes):
        return np.where(offsets >= 0, lease.mr.rkey, 0).astype(np.uint32)


# ---- the fake checks windows as an HCA does ------------------------------------------------------


def _qps(a, b):
    """A fresh connected pair: ``q`` on ``a`` (the reader), ``peer`` on ``b`` (the source)."""
    q, peer = a.create_qp(), b.create_qp()
    q.connect(peer.info, 0)
    peer.connect(q.info, Access.REMOTE_READ)
    return q, peer


def _revive(q, peer):
    """A requester QP that a denied READ put in the error state, connected again (RESET)."""
    q.to_reset()
    q.connect(peer.info, 0)
    return q


def _status(qp, wr):
    qp.post_send([wr])
    return completions(qp, 1)[0].status


def test_fake_windows_read_only_what_they_bind_through_their_qp():
    fabric = FakeFabric()
    a, b = FakeVerbsBackend(fabric), FakeVerbsBackend(fabric)
    src = np.arange(4 * PB // 8, dtype=np.uint64).view(np.uint8).copy()
    dst = np.zeros(4 * PB, dtype=np.uint8)
    region = b.register(src.ctypes.data, src.nbytes, Access.MW_BIND)
    local = a.register(dst.ctypes.data, dst.nbytes, Access.LOCAL_WRITE)
    q, peer = _qps(a, b)
    mw = b.alloc_mw()
    never_bound = mw.rkey
    bind = BindWr(1, mw, region, src.ctypes.data + PB, 2 * PB, Access.REMOTE_READ, True)
    assert _status(peer, bind) == WcStatus.SUCCESS
    assert mw.rkey != never_bound  # the bind gave it a new key (ibv_inc_rkey)

    def read(rkey, page=1, length=PB):
        return ReadWr(9, dst.ctypes.data, local.lkey, src.ctypes.data + page * PB, rkey, length, 1)

    assert _status(q, read(mw.rkey)) == WcStatus.SUCCESS
    np.testing.assert_array_equal(dst[:PB], src[PB : 2 * PB])
    assert _status(q, read(mw.rkey, page=2)) == WcStatus.SUCCESS

    def denied(wr, reader):
        return _status(reader, wr), fabric.errors[-1]

    # Each denial breaks its requester QP: every case reads through a fresh pair.
    fresh = _qps(a, b)[0]  # another QP of the same two nodes: not the one bound through
    assert denied(read(mw.rkey), fresh) == (
        WcStatus.REM_ACCESS_ERR,
        "wr 9: REM_ACCESS_ERR: memory window is bound to another QP",
    )
    q2, peer2 = _qps(a, b)
    mw2 = b.alloc_mw()
    assert _status(peer2, dataclasses.replace(bind, mw=mw2)) == WcStatus.SUCCESS
    for wr, why in [
        (read(mw2.rkey, page=0), "outside the memory window"),
        (read(mw2.rkey, page=2, length=PB + 1), "outside the memory window"),
        (read(region.rkey), "remote region lacks REMOTE_READ"),  # the MR's own key
        (read(never_bound), "is not the peer's"),
    ]:
        assert denied(wr, _revive(q2, peer2))[0] == WcStatus.REM_ACCESS_ERR
        assert why in fabric.errors[-1]
    assert _status(_revive(q2, peer2), read(mw2.rkey)) == WcStatus.SUCCESS
    # A window without REMOTE_READ, and one never bound, read nothing.
    q3, peer3 = _qps(a, b)
    mw3, mw4 = b.alloc_mw(), b.alloc_mw()
    no_read = dataclasses.replace(bind, mw=mw3, access=0)
    assert _status(peer3, no_read) == WcStatus.SUCCESS
    assert denied(read(mw3.rkey), q3)[0] == WcStatus.REM_ACCESS_ERR
    assert "window lacks REMOTE_READ" in fabric.errors[-1]
    assert denied(read(mw4.rkey), _revive(q3, peer3))[0] == WcStatus.REM_ACCESS_ERR
    assert "not bound" in fabric.errors[-1]

    # Invalidated: the key reads nothing; deallocated: the key names nothing.
    with pytest.raises(VerbsError, match="EBUSY"):
        b.deregister(region)  # windows are bound over it
    assert _status(peer, InvalidateWr(2, mw.rkey, True)) == WcStatus.SUCCESS
    assert denied(read(mw.rkey), q)[0] == WcStatus.REM_ACCESS_ERR
    assert "not bound" in fabric.errors[-1]
    b.dealloc_mw(mw)
    assert denied(read(mw.rkey), _revive(q, peer))[0] == WcStatus.REM_ACCESS_ERR
    assert "is not the peer's" in fabric.errors[-1]


def test_fake_binds_need_mw_bind_a_range_inside_and_a_free_window():
    fabric = FakeFabric()
    b = FakeVerbsBackend(fabric)
    a = FakeVerbsBackend(fabric)
    src = np.zeros(4 * PB, dtype=np.uint8)
    plain = b.register(src.ctypes.data, src.nbytes, Access.REMOTE_READ)
    bindable = b.register(src.ctypes.data, src.nbytes, Access.MW_BIND)
    mw = b.alloc_mw()
    ok = BindWr(1, mw, bindable, src.ctypes.data, PB, Access.REMOTE_READ, True)
    cases = [
        (dataclasses.replace(ok, mr=plain), "region lacks MW_BIND"),
        (dataclasses.replace(ok, addr=src.ctypes.data + 3 * PB, length=2 * PB), "outside"),
        (dataclasses.replace(ok, access=Access.REMOTE_WRITE), "needs LOCAL_WRITE"),
        (dataclasses.replace(ok, mw=a.alloc_mw()), "not ours"),  # another node's window
    ]
    for wr, why in cases:
        _, peer = _qps(a, b)
        assert _status(peer, wr) == WcStatus.MW_BIND_ERR, why
        assert why in fabric.errors[-1]
    q, peer = _qps(a, b)
    assert _status(peer, ok) == WcStatus.SUCCESS
    key = mw.rkey
    _, other = _qps(a, b)
    assert _status(other, dataclasses.replace(ok, wr_id=2)) == WcStatus.MW_BIND_ERR  # bound
    assert "bound already" in fabric.errors[-1]
    _, other = _qps(a, b)
    assert _status(other, InvalidateWr(3, key, True)) == WcStatus.LOC_PROT_ERR
    assert "another QP" in fabric.errors[-1]
    assert _status(peer, InvalidateWr(4, 0xDEAD00, True)) == WcStatus.LOC_PROT_ERR
    assert "names no bound window" in fabric.errors[-1]
    peer.to_reset()  # the failed invalidate broke it; the window stays bound through it
    peer.connect(q.info, Access.REMOTE_READ)
    assert _status(peer, InvalidateWr(5, key, True)) == WcStatus.SUCCESS
    assert _status(peer, dataclasses.replace(ok, wr_id=6)) == WcStatus.SUCCESS  # free again
    assert mw.rkey != key  # a new key: the old one reads nothing


def test_page_runs_merge_adjacent_pages_only():
    offsets = [3 * PB, 0, PB, -1, 7 * PB, PB, -2]
    assert page_runs(offsets, PB) == [(0, 2 * PB), (3 * PB, 4 * PB), (7 * PB, 8 * PB)]
    assert page_runs([-1, -2], PB) == []


# ---- attacks through the puller's own connection -----------------------------------------------


def _pin(session, keys):
    h, body = session.request(Kind.RDMA_PIN, pack_keys_body(NS, PB, keys), count=len(keys))
    assert h.kind is Kind.RDMA_PINNED, body
    return unpack_pinned(body, len(keys))


def _read(s: Setup, session, pinned, slot: int, rkey: int, length: int = PB) -> int:
    """One READ of the source's page ``slot`` on ``session``'s QP with ``rkey``; its status."""
    (local,) = s.rdma.regions.registered()
    wr = ReadWr(
        7, s.dst.ctypes.data, local.lkey, pinned.region_addr + slot * PB, rkey, length, True
    )
    session.qp.post_send([wr])
    return completions(session.qp, 1)[0].status


def _session(s: Setup):
    """A second control connection and QP to the source (another transport's)."""
    other = RdmaTransport(s.dst_backend, RdmaConfig(chain=4, chains_in_flight=2))
    s.others.append(other)
    return other._session(s.server.address)


def attack_outside_the_pin(s: Setup) -> int:
    """Pin pages 0-3, READ page 10 with the rkey of page 0."""
    session = s.rdma._session(s.server.address)
    pinned = _pin(session, s.keys[:4])
    assert _read(s, session, pinned, 0, int(pinned.rkeys[0])) == WcStatus.SUCCESS
    return _read(s, session, pinned, 10, int(pinned.rkeys[0]))


def attack_past_the_pin(s: Setup) -> int:
    """Pin pages 0-3, READ pages 3 and 4 in one READ (one byte past the pin would do)."""
    session = s.rdma._session(s.server.address)
    pinned = _pin(session, s.keys[:4])
    return _read(s, session, pinned, 3, int(pinned.rkeys[3]), 2 * PB)


def attack_after_release(s: Setup) -> int:
    """Pin, READ, RDMA_RELEASE, READ again with the same rkey."""
    session = s.rdma._session(s.server.address)
    pinned = _pin(session, s.keys[5:6])
    assert _read(s, session, pinned, 5, int(pinned.rkeys[0])) == WcStatus.SUCCESS
    h, _ = session.request(Kind.RDMA_RELEASE, key=lease_key(pinned.lease_id))
    assert h.kind is Kind.END and s.source.pins == 0
    return _read(s, session, pinned, 5, int(pinned.rkeys[0]))


def attack_from_another_qp(s: Setup) -> int:
    """Connection one pins (and holds) page 6; connection two, its own QP, READs it with the
    rkey connection one was given."""
    one, two = s.rdma._session(s.server.address), _session(s)
    pinned = _pin(one, s.keys[6:7])
    return _read(s, two, pinned, 6, int(pinned.rkeys[0]))


def attack_after_close(s: Setup) -> int:
    """Connection one pins page 8 and goes away without a release; connection two READs page 8
    with the rkey connection one was given."""
    one, two = s.rdma._session(s.server.address), _session(s)
    pinned = _pin(one, s.keys[8:9])
    s.rdma.drop_session(s.server.address)
    assert wait_until(lambda: s.source.pins == 0)
    return _read(s, two, pinned, 8, int(pinned.rkeys[0]))


# Each attack, and why the source's HCA refuses it.
DENIED = {
    attack_outside_the_pin: "source outside the memory window",
    attack_past_the_pin: "source outside the memory window",
    attack_after_release: "is not the peer's",  # invalidated and deallocated
    attack_from_another_qp: "memory window is bound to another QP",
    attack_after_close: "is not the peer's",
}
ATTACKS = list(DENIED)


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.__name__ for a in ATTACKS])
def test_a_peer_reads_nothing_but_its_pinned_pages_through_its_own_qp(attack):
    """Fails against the whole-slab rkey (see the module docstring): there it reads."""
    s = Setup()
    try:
        assert attack(s) == WcStatus.REM_ACCESS_ERR
        assert "REM_ACCESS_ERR" in s.fabric.errors[-1] and DENIED[attack] in s.fabric.errors[-1]
    finally:
        s.close()


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.__name__ for a in ATTACKS])
def test_every_attack_reads_the_bytes_with_a_whole_slab_rkey(attack):
    """What issue 33 was: each attack above reads through the old source."""
    s = Setup(source_cls=WholeSlabSource)
    try:
        assert attack(s) == WcStatus.SUCCESS
    finally:
        s.close()


# ---- windows follow their leases ---------------------------------------------------------------


class UnpinChecks(RdmaSource):
    """Records, at every unpin, whether any of the source's windows was still bound."""

    bound_at_unpin: list[int]

    def _close_lease(self, conn, lease):
        release = lease.chunk.pinned.release

        def checked() -> None:
            self.bound_at_unpin.append(self.backend.bound_windows())
            release()

        lease.chunk.pinned.release = checked
        super()._close_lease(conn, lease)


@pytest.mark.parametrize("how", ["release", "close"])
def test_windows_are_invalidated_before_their_pages_are_unpinned(how):
    """Fails against the whole-slab rkey: its rkey still names readable memory afterwards."""
    UnpinChecks.bound_at_unpin = []
    s = Setup(source_cls=UnpinChecks)
    try:
        session = s.rdma._session(s.server.address)
        pinned = _pin(session, s.keys[:3] + s.keys[20:22])  # two runs: two windows
        rkeys = set(pinned.rkeys.tolist())
        assert len(rkeys) == 2 and s.src_backend.bound_windows() == 2
        assert all(s.src_backend.window(k).bound for k in rkeys)
        if how == "release":
            h, _ = session.request(Kind.RDMA_RELEASE, key=lease_key(pinned.lease_id))
            assert h.kind is Kind.END
        else:
            s.rdma.drop_session(s.server.address)
        assert wait_until(lambda: s.source.pins == 0)
        assert UnpinChecks.bound_at_unpin == [0]
        assert all(s.src_backend.window(k) is None for k in rkeys)  # deallocated too
        assert s.fabric.invalidations_posted == 2 and not s.src_backend.windows
    finally:
        s.close()


def test_fetches_bind_one_window_per_run_and_leave_none_behind():
    # Every other slot: 20 runs in one pin, more than an 8-deep send queue holds at once.
    s = Setup(max_send_wr=8)
    try:
        n = PAGES // 2
        s.source.slots = {k: 2 * i for i, k in enumerate(s.keys[:n])}
        res = s.rdma.fetch(s.server.address, NS, s.keys[:n], s.views()[:n])
        assert all(r.ok for r in res), res[0]
        np.testing.assert_array_equal(s.dst[:n], s.src_region.reshape(PAGES, PB)[::2])
        assert s.fabric.binds_posted == n and s.fabric.invalidations_posted == n
        assert s.src_backend.bound_windows() == 0 and not s.src_backend.windows
        assert s.source.pins == 0
    finally:
        s.close()


class NoMwBindSource(RdmaSource):
    mr_access = 0


def test_a_region_that_cannot_take_windows_fails_the_pin_and_unpins():
    s = Setup(source_cls=NoMwBindSource)
    try:
        res = s.rdma.fetch(s.server.address, NS, s.keys[:4], s.views()[:4])
        assert {r.outcome for r in res} == {Outcome.UNAVAILABLE}
        assert "cannot open memory windows" in res[0].reason
        assert "MW_BIND_ERR" in res[0].reason
        assert s.fabric.reads_posted == 0
        assert wait_until(lambda: s.source.pins == 0)
        assert not s.src_backend.windows
        # Its QP may be in the error state: the source hung up (the next pull reconnects).
        assert wait_until(lambda: s.server.open_connections() == 0)
    finally:
        s.close()
