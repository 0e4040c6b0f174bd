"""Type-2 memory windows on the fake verbs backend: it checks them as an HCA does (bound, bound
through the QP the READ arrives on, range, access; binds need MW_BIND and a range inside the
region; invalidated or deallocated windows read nothing), so the RDMA source can narrow a peer's
access to the pages it pinned (issue 33)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from messenger.verbs import Access, BindWr, InvalidateWr, ReadWr, VerbsError, WcStatus
from messenger.verbs_fake import FakeFabric, FakeVerbsBackend

from helpers import wait_until

PB = 16 << 10


def completions(qp, n, timeout_s=10.0):
    """Poll until ``n`` completions arrived (the fake completes on another thread)."""
    got: list = []
    wait_until(lambda: got.extend(qp.poll(16)) or len(got) >= n, timeout_s, f"{n} completions")
    return got


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
