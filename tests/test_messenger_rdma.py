"""RDMA transport logic against the fake verbs backend (real TCP control channel, real threads).

The fake copies between in-memory regions only after the checks an HCA makes (lkey and rkey,
bounds, access flags, QP states), on a thread of its own, and completes only signaled WRs (every
WR on a QP created with sq_sig_all), so a wrong key, offset, flag or completion rule in the
transport fails these tests.
Tests that need real verbs are marked ``rdma`` and skipped with the reason on machines without.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
import time
import types

import numpy as np
import pytest
import xxhash

from messenger import rdma as rdma_module
from messenger.data_server import DataServer
from messenger.identity import Identities, Identity
from messenger.rdma import (
    FallbackTransport,
    RdmaConfig,
    RdmaSource,
    RdmaTransport,
    Segment,
    chain_segments,
    plan_segments,
)
from messenger.select import choose_transport, open_rdma_backend
from messenger.slab_peer import fill_pattern, pattern_keys
from messenger.tcp import TcpTransport
from messenger.transport import FetchGroup, Outcome, SlabPageSource
from messenger.verbs import (
    Access,
    BindWr,
    InvalidateWr,
    QpInfo,
    ReadWr,
    VerbsError,
    WcStatus,
)
from messenger.verbs_fake import FakeFabric, FakeQueuePair, FakeVerbsBackend

from helpers import CommitLog, wait_until
from rdma_helpers import NS, PAGES, PB, Setup, completions

# ---- planning ---------------------------------------------------------------------------------


def test_plan_merges_runs_contiguous_on_both_sides():
    # Remote pages 0..3 land in local pages 10..13 (contiguous), page 5 elsewhere, 4 goes to a
    # non-adjacent local slot, so it cannot extend the first run.
    entries = [
        (0, 0, 10 * PB, 7),
        (1, PB, 11 * PB, 7),
        (2, 2 * PB, 12 * PB, 7),
        (3, 3 * PB, 13 * PB, 7),
        (4, 4 * PB, 20 * PB, 7),
        (5, 5 * PB, 21 * PB, 7),
        (6, 9 * PB, 22 * PB, 8),
    ]
    got = plan_segments(list(reversed(entries)), PB, max_bytes=1 << 30)
    assert got == [
        Segment(0, 10 * PB, 4 * PB, (0, 1, 2, 3), 7),
        Segment(4 * PB, 20 * PB, 2 * PB, (4, 5), 7),
        Segment(9 * PB, 22 * PB, PB, (6,), 8),
    ]


def test_plan_never_merges_pages_of_two_windows():
    # Contiguous on both sides, but the source bound two windows (a READ lies in one).
    entries = [(0, 0, 0, 5), (1, PB, PB, 5), (2, 2 * PB, 2 * PB, 6)]
    got = plan_segments(entries, PB, max_bytes=1 << 30)
    assert got == [Segment(0, 0, 2 * PB, (0, 1), 5), Segment(2 * PB, 2 * PB, PB, (2,), 6)]


def test_plan_caps_segment_size():
    entries = [(i, i * PB, i * PB, 1) for i in range(10)]
    got = plan_segments(entries, PB, max_bytes=3 * PB)
    assert [s.entries for s in got] == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9,)]
    assert all(s.length <= 3 * PB for s in got)


# ---- the fake backend enforces what hardware enforces --------------------------------------------


def _pair(fabric, max_send_wr=64, sq_sig_all=False):
    a, b = FakeVerbsBackend(fabric, max_send_wr), FakeVerbsBackend(fabric, max_send_wr)
    qa, qb = a.create_qp(sq_sig_all=sq_sig_all), b.create_qp()
    qa.connect(qb.info)
    qb.connect(qa.info)
    return a, b, qa


def _buffers(fabric, a, b, pages=4):
    src = np.arange(pages * PB // 8, dtype=np.uint64).view(np.uint8).copy()
    dst = np.zeros(pages * PB, dtype=np.uint8)
    readable = b.register(src.ctypes.data, src.nbytes, Access.REMOTE_READ)
    writable = a.register(dst.ctypes.data, dst.nbytes, Access.LOCAL_WRITE)
    return src, dst, readable, writable


def _chain(src, dst, readable, writable, pages=4, first_id=1, last_signaled=True):
    """One WR per page, page i of ``src`` into page i of ``dst``; only the last one signaled."""
    return [
        ReadWr(
            first_id + i,
            dst.ctypes.data + i * PB,
            writable.lkey,
            src.ctypes.data + i * PB,
            readable.rkey,
            PB,
            last_signaled and i == pages - 1,
        )
        for i in range(pages)
    ]


def test_fake_backend_checks_keys_bounds_access_and_flushes_after_an_error():
    fabric = FakeFabric()
    a, b, qp = _pair(fabric)
    src, dst, readable, writable = _buffers(fabric, a, b)
    assert readable.lkey != readable.rkey and writable.lkey != writable.rkey
    ok = ReadWr(1, dst.ctypes.data, writable.lkey, src.ctypes.data, readable.rkey, PB, True)
    qp.post_reads([ok])
    assert [c.status for c in completions(qp, 1)] == [WcStatus.SUCCESS]
    np.testing.assert_array_equal(dst[:PB], src[:PB])

    def status_of(wr):
        q, peer = a.create_qp(), b.create_qp()  # a fresh QP from a to b for each case
        q.connect(peer.info)
        peer.connect(q.info)
        q.post_reads([wr])
        return completions(q, 1)[0].status, fabric.errors[-1]

    def read(**change):
        return dataclasses.replace(ok, **change)

    no_remote_read = b.register(src.ctypes.data, src.nbytes, Access.LOCAL_WRITE)
    read_only_local = a.register(dst.ctypes.data, dst.nbytes, Access.REMOTE_READ)
    cases = {
        "rkey 0xdead is not the peer's": (read(rkey=0xDEAD), WcStatus.REM_ACCESS_ERR),
        "lkey used as rkey": (read(rkey=readable.lkey), WcStatus.REM_ACCESS_ERR),
        "rkey used as lkey": (read(lkey=writable.rkey), WcStatus.LOC_PROT_ERR),
        "source outside the remote region": (
            read(remote_addr=src.ctypes.data + 3 * PB + 1),
            WcStatus.REM_ACCESS_ERR,
        ),
        "destination outside the local region": (
            read(local_addr=dst.ctypes.data + 3 * PB + 1),
            WcStatus.LOC_PROT_ERR,
        ),
        "remote region lacks REMOTE_READ": (
            read(rkey=no_remote_read.rkey),
            WcStatus.REM_ACCESS_ERR,
        ),
        "local region lacks LOCAL_WRITE": (
            read(lkey=read_only_local.lkey),
            WcStatus.LOC_PROT_ERR,
        ),
    }
    for name, (wr, expected) in cases.items():
        status, why = status_of(wr)
        assert status == expected, name
        assert ("is not" in why) if "used as" in name else (name in why), (name, why)
    # A deregistered region is gone for good.
    b.deregister(readable)
    assert status_of(ok)[0] == WcStatus.REM_ACCESS_ERR
    readable = b.register(src.ctypes.data, src.nbytes, Access.REMOTE_READ)
    ok = read(rkey=readable.rkey)

    # After an error the QP flushes everything behind it, unsignaled WRs included.
    qp.post_reads([read(rkey=0xDEAD), dataclasses.replace(ok, signaled=False), ok])
    assert [c.status for c in completions(qp, 3)] == [
        WcStatus.REM_ACCESS_ERR,
        WcStatus.WR_FLUSH_ERR,
        WcStatus.WR_FLUSH_ERR,
    ]
    with pytest.raises(VerbsError, match="RESET, not RTS"):
        a.create_qp().post_reads([ok])  # never connected


def test_fake_completes_only_signaled_wrs_on_another_thread_after_the_copy():
    fabric = FakeFabric()
    a, b, qp = _pair(fabric)
    src, dst, readable, writable = _buffers(fabric, a, b)
    fabric.throttle(0)  # the "HCA" holds the WRs: posting copies nothing
    qp.post_reads(_chain(src, dst, readable, writable))
    assert qp.poll(16) == [] and not dst.any()
    fabric.unthrottle()
    (wc,) = completions(qp, 1)
    assert wc.wr_id == 4 and wc.ok  # the last, signaled WR only
    np.testing.assert_array_equal(dst, src)  # and it completed after every copy ran
    assert fabric.wait_idle() and qp.poll(16) == []
    assert fabric.completions == 1

    # A QP created with sq_sig_all completes every WR, whatever its flag.
    a, b, qp = _pair(fabric, sq_sig_all=True)
    src, dst, readable, writable = _buffers(fabric, a, b)
    qp.post_reads(_chain(src, dst, readable, writable))
    assert [c.wr_id for c in completions(qp, 4)] == [1, 2, 3, 4]


def test_waiting_for_the_first_completion_of_a_sig_all_batch_reads_pages_in_flight():
    # The bug: pyverbs creates QPs with sq_sig_all=1 by default, so the first WR of a chain
    # completes too, and a waiter that takes "a completion arrived" for "the chain landed"
    # goes on while the later WRs are still being executed.
    fabric = FakeFabric()
    a, b, qp = _pair(fabric, sq_sig_all=True)
    src, dst, readable, writable = _buffers(fabric, a, b)
    fabric.throttle(1)  # the HCA is slower than the waiter: one WR done, three in flight
    qp.post_reads(_chain(src, dst, readable, writable))
    first = completions(qp, 1)
    assert [(c.wr_id, c.ok) for c in first] == [(1, True)]
    pages = dst.reshape(4, PB)
    assert np.array_equal(pages[0], src[:PB]) and not pages[1:].any()  # stale data
    fabric.unthrottle()
    assert [c.wr_id for c in completions(qp, 3)] == [2, 3, 4]
    np.testing.assert_array_equal(dst, src)


def test_send_queue_overflow_fails_like_ibv_post_send():
    fabric = FakeFabric()
    a, b, qp = _pair(fabric, max_send_wr=4)
    src, dst, readable, writable = _buffers(fabric, a, b, pages=4)
    chain = _chain(src, dst, readable, writable)
    qp.post_reads(chain)
    assert fabric.wait_idle()  # all four executed, but their slots are freed only by a poll
    extra = dataclasses.replace(chain[-1], wr_id=9)
    with pytest.raises(VerbsError, match=r"ENOMEM.*max_send_wr 4.*posted 0 of 1"):
        qp.post_reads([extra])
    assert len(completions(qp, 1)) == 1  # the signaled WR retires the whole chain
    qp.post_reads([extra])
    assert [c.wr_id for c in completions(qp, 1)] == [9]
    # Unsignaled WRs alone never free their slots: the queue fills up and stays full.
    unsignaled = _chain(src, dst, readable, writable, first_id=20, last_signaled=False)
    with pytest.raises(VerbsError, match="posted 4 of 5"):
        qp.post_reads(unsignaled + [extra])
    assert fabric.wait_idle() and qp.poll(16) == []
    with pytest.raises(VerbsError, match="ENOMEM"):
        qp.post_reads([extra])


def test_fake_qp_state_machine_and_responder_checks():
    fabric = FakeFabric()
    a, b = FakeVerbsBackend(fabric), FakeVerbsBackend(fabric)
    src, dst, readable, writable = _buffers(fabric, a, b, pages=1)
    wr = _chain(src, dst, readable, writable, pages=1)
    qa, qb = a.create_qp(), b.create_qp()
    with pytest.raises(VerbsError, match="RESET -> RTS"):
        qa.to_rts()
    qa.to_init(0)
    with pytest.raises(VerbsError, match="INIT, not RTS"):
        qa.post_reads(wr)
    with pytest.raises(VerbsError, match="invalid path MTU"):
        qa.to_rtr(dataclasses.replace(qb.info, mtu=9))
    qa.to_rtr(qb.info)
    with pytest.raises(VerbsError, match="RTR, not RTS"):
        qa.post_reads(wr)
    qa.to_rts()

    def read_status(q):
        q.post_reads(wr)
        return completions(q, 1)[0].status, fabric.errors[-1]

    # The responder never left INIT: its HCA drops the requests and the requester gives up.
    qb.to_init(Access.REMOTE_READ)
    assert read_status(qa) == (WcStatus.RETRY_EXC_ERR, "wr 1: RETRY_EXC_ERR: peer QP is in INIT")
    with pytest.raises(VerbsError, match="ERR -> RTR"):
        qa.to_rtr(qb.info)  # an errored QP goes back through RESET only
    qa.to_reset()

    def fresh(access):
        q, peer = a.create_qp(), b.create_qp()
        q.connect(peer.info, 0)
        peer.connect(q.info, access)
        return q, peer

    q, peer = fresh(0)  # the responder's QP does not allow remote READs
    assert read_status(q) == (
        WcStatus.REM_ACCESS_ERR,
        "wr 1: REM_ACCESS_ERR: peer QP lacks REMOTE_READ",
    )
    q, peer = fresh(Access.REMOTE_READ)
    assert read_status(q)[0] == WcStatus.SUCCESS
    peer.close()  # the peer went away
    assert read_status(q)[0] == WcStatus.RETRY_EXC_ERR
    # Connecting to an address nobody owns succeeds (as ibv_modify_qp does); READs fail later.
    lonely = a.create_qp()
    lonely.connect(QpInfo(qpn=1, psn=0, lid=99, gid="", mtu=5))
    assert read_status(lonely)[0] == WcStatus.RETRY_EXC_ERR
    assert "no peer QP" in fabric.errors[-1]


# ---- transport against a source server -----------------------------------------------------------


@pytest.fixture
def setup():
    s = Setup()
    yield s
    s.close()


def test_rdma_fetch_moves_exact_bytes_with_merged_chained_reads(setup):
    setup.fabric.poll_delay = 3  # completions show up late: polling must not block or give up
    res = setup.rdma.fetch(setup.server.address, NS, setup.keys, setup.views())
    assert all(r.ok for r in res), res[0]
    np.testing.assert_array_equal(setup.dst.reshape(-1), setup.src_region)
    # Both sides contiguous: the whole batch is one READ, one chain, one signaled WR.
    assert setup.fabric.reads_posted == 1
    assert setup.fabric.signaled_posted == setup.fabric.chains_posted == 1
    assert setup.source.pins == 0  # released after the fetch
    assert setup.src_backend.registrations == 1
    # A second fetch reuses the session and the source's registration.
    setup.dst[:] = 0
    res = setup.rdma.fetch(setup.server.address, NS, setup.keys[:3], setup.views()[:3])
    assert all(r.ok for r in res)
    assert setup.src_backend.registrations == 1


def test_scattered_destination_pages_use_many_chains_only_last_signaled(setup):
    order = list(range(PAGES))[::-1]  # page i lands in slot PAGES-1-i: nothing merges
    res = setup.rdma.fetch(setup.server.address, NS, setup.keys, setup.views(order))
    assert all(r.ok for r in res)
    expected = setup.src_region.reshape(PAGES, PB)
    np.testing.assert_array_equal(setup.dst[::-1], expected)
    assert setup.fabric.reads_posted == PAGES
    assert setup.fabric.chains_posted == PAGES // 4
    assert setup.fabric.signaled_posted == setup.fabric.chains_posted


# ---- completions: wait for the ones that prove the whole batch landed ----------------------------


class PreFixTransport(RdmaTransport):
    """The completion loop before the fix, in short: a chain counted as landed at the first
    completion naming any of its WRs. Right only while nothing but a chain's last WR completes,
    which a QP created with sq_sig_all (pyverbs' default) does not guarantee."""

    def _read(self, session, segments, lkeys, results):
        chains = chain_segments(segments, self.config.chain)
        in_flight: dict[int, list] = {}
        owner_of: dict[int, int] = {}
        while chains or in_flight:
            while chains and len(in_flight) < self.config.chains_in_flight:
                chain = chains.pop(0)
                wrs = [
                    ReadWr(
                        next(self._wr_ids),
                        seg.local_addr,
                        lkeys[seg.entries[0]],
                        seg.remote_addr,
                        seg.rkey,
                        seg.length,
                        k == len(chain) - 1,
                    )
                    for k, seg in enumerate(chain)
                ]
                session.qp.post_reads(wrs)
                in_flight[wrs[-1].wr_id] = chain
                owner_of.update((wr.wr_id, wrs[-1].wr_id) for wr in wrs)
            for wc in session.qp.poll(16):
                in_flight.pop(owner_of.get(wc.wr_id, wc.wr_id), None)


class SigAllBackend(FakeVerbsBackend):
    """QPs created with sq_sig_all=1 whatever is asked (pyverbs' QPInitAttr default)."""

    def create_qp(self, sq_sig_all=False):
        return super().create_qp(sq_sig_all=True)


REVERSED4 = [3, 2, 1, 0]  # key i lands in slot 3-i: nothing merges, one chain of four WRs


def test_pre_fix_completion_rule_returns_while_pages_are_in_flight():
    s = Setup(transport_cls=PreFixTransport, dst_backend_cls=SigAllBackend)
    try:
        s.fabric.throttle(1)  # the HCA has done one READ of the chain when the waiter looks
        res = s.rdma.fetch(s.server.address, NS, s.keys[:4], s.views(REVERSED4))
        assert [r.outcome for r in res] == [Outcome.OK] + [Outcome.DATA_LOSS] * 3
        assert not s.dst[:3].any()  # what it checked: pages still being written
        s.fabric.unthrottle()
        assert s.fabric.wait_idle()
        # Its RDMA_RELEASE came while they were in flight, and the source invalidated the
        # windows: they fail at the source instead of landing after the fetch returned.
        assert not s.dst[:3].any()
        assert s.fabric.errors and "REM_ACCESS_ERR" in s.fabric.errors[0]
    finally:
        s.close()


def test_pre_fix_completion_rule_overflows_the_send_queue():
    # Two chains of four fill an 8-deep send queue; the first completion retires one WR but
    # the old rule takes it for the whole chain and posts four more.
    s = Setup(transport_cls=PreFixTransport, dst_backend_cls=SigAllBackend, max_send_wr=8)
    try:
        s.fabric.throttle(1)
        res = s.rdma.fetch(s.server.address, NS, s.keys[:12], s.views(range(11, -1, -1)))
        assert {r.outcome for r in res} == {Outcome.UNAVAILABLE}
        assert "ENOMEM" in res[0].reason and "send queue full" in res[0].reason
    finally:
        s.close()


@pytest.mark.parametrize(
    "backend_cls", [FakeVerbsBackend, SigAllBackend], ids=["signaled", "sig_all"]
)
def test_fetch_waits_for_the_completion_that_proves_the_batch_landed(backend_cls):
    s = Setup(dst_backend_cls=backend_cls, max_send_wr=8)
    try:
        for n, order in ((4, REVERSED4), (12, list(range(11, -1, -1)))):
            s.dst[:] = 0
            s.fabric.throttle(1)
            timer = threading.Timer(0.3, s.fabric.unthrottle)
            timer.start()
            t0 = time.monotonic()
            res = s.rdma.fetch(s.server.address, NS, s.keys[:n], s.views(order))
            elapsed = time.monotonic() - t0
            timer.join()
            assert all(r.ok for r in res), res
            assert elapsed >= 0.25  # it waited for the throttled HCA
            np.testing.assert_array_equal(s.dst[:n][::-1], s.src_region.reshape(PAGES, PB)[:n])
    finally:
        s.close()


@pytest.mark.parametrize(
    "backend_cls", [FakeVerbsBackend, SigAllBackend], ids=["signaled", "sig_all"]
)
def test_fetch_moves_every_byte_through_a_slow_asynchronous_hca(backend_cls):
    s = Setup(dst_backend_cls=backend_cls, max_send_wr=8)
    try:
        s.fabric.wr_delay_s = 1e-3
        s.fabric.poll_delay = 2
        order = list(range(PAGES))[::-1]
        res = s.rdma.fetch(s.server.address, NS, s.keys, s.views(order))
        assert all(r.ok for r in res), res
        np.testing.assert_array_equal(s.dst[::-1], s.src_region.reshape(PAGES, PB))
        assert s.fabric.reads_posted == PAGES and s.fabric.chains_posted == PAGES // 4
        assert s.fabric.signaled_posted == PAGES // 4  # only each chain's last WR
        expected = PAGES if backend_cls is SigAllBackend else PAGES // 4
        assert s.fabric.completions == expected
        # Nothing left behind on the QP: the session is reused for the next fetch.
        s.dst[:] = 0
        res = s.rdma.fetch(s.server.address, NS, s.keys, s.views())
        assert all(r.ok for r in res)
        np.testing.assert_array_equal(s.dst.reshape(-1), s.src_region)
    finally:
        s.close()


# ---- wrong keys, flags and states fail the entries with the reason -------------------------------


class LkeyForRkeySource(RdmaSource):
    def _open_windows(self, conn, lease, offsets, page_bytes):
        rkeys = super()._open_windows(conn, lease, offsets, page_bytes)
        return np.where(rkeys != 0, lease.mr.lkey, 0)


class RegionRkeySource(RdmaSource):
    """Hands out the rkey of the region itself (registered without REMOTE_READ), as the
    source did before memory windows, with REMOTE_READ on the region."""

    def _open_windows(self, conn, lease, offsets, page_bytes):
        rkeys = super()._open_windows(conn, lease, offsets, page_bytes)
        return np.where(rkeys != 0, lease.mr.rkey, 0)


class UnreadableWindowSource(RdmaSource):
    mw_access = 0


class UnreadableQpSource(RdmaSource):
    qp_access = 0


class ReadOnlyDestination(RdmaTransport):
    local_access = Access.REMOTE_READ


class _StuckInInit(FakeQueuePair):
    def connect(self, remote, access=Access.REMOTE_READ):
        self.to_init(access)  # never reaches RTR: the HCA drops the peer's requests


class StuckBackend(FakeVerbsBackend):
    def create_qp(self, sq_sig_all=False):
        return _StuckInInit(self, sq_sig_all)


@pytest.mark.parametrize(
    "kwargs, status, cause",
    [
        ({"source_cls": LkeyForRkeySource}, "REM_ACCESS_ERR", "is not the peer's"),
        ({"source_cls": RegionRkeySource}, "REM_ACCESS_ERR", "region lacks REMOTE_READ"),
        ({"source_cls": UnreadableWindowSource}, "REM_ACCESS_ERR", "window lacks REMOTE_READ"),
        ({"source_cls": UnreadableQpSource}, "REM_ACCESS_ERR", "peer QP lacks REMOTE_READ"),
        ({"transport_cls": ReadOnlyDestination}, "LOC_PROT_ERR", "lacks LOCAL_WRITE"),
    ],
    ids=[
        "lkey-as-rkey",
        "region-rkey",
        "window-no-remote-read",
        "qp-no-remote-read",
        "no-local-write",
    ],
)
def test_wrong_key_flag_or_qp_state_fails_entries_with_a_clear_reason(kwargs, status, cause):
    s = Setup(**kwargs)
    try:
        res = s.rdma.fetch(s.server.address, NS, s.keys[:8], s.views(range(7, -1, -1)))
        assert {r.outcome for r in res} == {Outcome.UNAVAILABLE}
        first = res[0].reason
        assert first.startswith(f"RDMA READ failed: {status} (") and first.endswith(")"), first
        assert cause in s.fabric.errors[0]
        assert s.server.address not in s.rdma._sessions  # the broken session was dropped
        assert s.source.pins == 0
    finally:
        s.close()


def test_source_qp_not_in_rts_cannot_bind_windows_and_hangs_up():
    # A responder QP short of RTS would only time the READs out (RETRY_EXC_ERR, see the fake's
    # own test); the source cannot even post its window binds, and says so.
    s = Setup(src_backend_cls=StuckBackend)
    try:
        res = s.rdma.fetch(s.server.address, NS, s.keys[:8], s.views()[:8])
        assert {r.outcome for r in res} == {Outcome.UNAVAILABLE}
        assert res[0].reason.startswith("source cannot open memory windows: ibv_post_send")
        assert "is INIT, not RTS" in res[0].reason
        assert s.fabric.reads_posted == 0
        assert wait_until(lambda: s.source.pins == 0)  # the source hung up and unpinned
        assert s.src_backend.bound_windows() == 0 and not s.src_backend.windows
    finally:
        s.close()


def test_own_qp_not_in_rts_fails_the_fetch_with_the_state():
    s = Setup(dst_backend_cls=StuckBackend)
    try:
        res = s.rdma.fetch(s.server.address, NS, s.keys[:4], s.views()[:4])
        assert {r.outcome for r in res} == {Outcome.UNAVAILABLE}
        assert "ibv_post_send failed (EINVAL)" in res[0].reason
        assert "is INIT, not RTS" in res[0].reason
        assert s.fabric.reads_posted == 0
        assert wait_until(lambda: s.source.pins == 0)  # the dropped connection unpins
    finally:
        s.close()


def test_missing_keys_fail_not_found_rest_complete():
    s = Setup(missing=(2, 30))
    try:
        res = s.rdma.fetch(s.server.address, NS, s.keys, s.views())
    finally:
        s.close()
    assert {i for i, r in enumerate(res) if not r.ok} == {2, 30}
    assert res[2].outcome is Outcome.NOT_FOUND
    exp = s.src_region.reshape(PAGES, PB)
    np.testing.assert_array_equal(s.dst[3:30], exp[3:30])


def test_corruption_on_the_link_is_caught_by_the_checksum(setup):
    setup.fabric.corrupt_reads(1)
    res = setup.rdma.fetch(setup.server.address, NS, setup.keys[:1], setup.views()[:1])
    assert res[0].outcome is Outcome.DATA_LOSS


def test_completion_error_fails_entries_and_drops_the_session(setup):
    order = list(range(PAGES))[::-1]
    setup.fabric.fail_reads(1, WcStatus.RETRY_EXC_ERR)
    res = setup.rdma.fetch(setup.server.address, NS, setup.keys, setup.views(order))
    # READs are planned in remote-address order: the first chain covers keys 0..3 and fails;
    # nothing after it may be reported done (the QP is in the error state).
    assert not any(r.ok for r in res)
    assert {r.outcome for r in res} == {Outcome.UNAVAILABLE}
    assert all("RETRY_EXC_ERR" in r.reason for r in res[:4])
    assert any("flushed" in r.reason or "not posted" in r.reason for r in res[4:])
    # Pins are released even though the QP failed; a new session works again.
    assert setup.source.pins == 0
    res = setup.rdma.fetch(setup.server.address, NS, setup.keys, setup.views())
    assert all(r.ok for r in res)


def test_a_group_hands_back_the_checksums_its_pages_were_verified_against(setup):
    group = FetchGroup(list(setup.keys), setup.views())
    assert all(r.ok for r in setup.rdma.fetch_group(setup.server.address, NS, group))
    assert group.checksums == [xxhash.xxh3_64_intdigest(page) for page in setup.dst]
    transport = FallbackTransport(setup.rdma, TcpTransport())
    try:
        setup.fabric.fail_reads(1)
        setup.dst[:] = 0
        group = FetchGroup(list(setup.keys), setup.views())
        assert all(r.ok for r in transport.fetch_group(setup.server.address, NS, group))
        np.testing.assert_array_equal(setup.dst.reshape(-1), setup.src_region)
        assert group.checksums is None  # some pages came over TCP: the node hashes them all
    finally:
        transport.fallback.close()


def test_fallback_retries_failed_entries_over_tcp_and_keeps_the_peer_on_tcp(setup):
    transport = FallbackTransport(setup.rdma, TcpTransport())
    try:
        setup.fabric.fail_reads(1)
        res = transport.fetch(setup.server.address, NS, setup.keys, setup.views())
        assert all(r.ok for r in res)
        np.testing.assert_array_equal(setup.dst.reshape(-1), setup.src_region)
        assert setup.server.address in transport.tcp_only_peers()
        posted = setup.fabric.reads_posted
        setup.dst[:] = 0
        res = transport.fetch(setup.server.address, NS, setup.keys, setup.views())
        assert all(r.ok for r in res)
        assert setup.fabric.reads_posted == posted  # the second fetch did not use RDMA
        np.testing.assert_array_equal(setup.dst.reshape(-1), setup.src_region)
    finally:
        transport.fallback.close()


def test_peer_without_rdma_falls_back_to_tcp():
    s = Setup(with_rdma_source=False)
    transport = FallbackTransport(s.rdma, TcpTransport())
    try:
        only_rdma = s.rdma.fetch(s.server.address, NS, s.keys[:2], s.views()[:2])
        assert {r.outcome for r in only_rdma} == {Outcome.UNAVAILABLE}
        res = transport.fetch(s.server.address, NS, s.keys, s.views())
        assert all(r.ok for r in res)
        np.testing.assert_array_equal(s.dst.reshape(-1), s.src_region)
    finally:
        transport.fallback.close()
        s.close()


def test_unregistered_destination_memory_is_a_per_entry_failure(setup):
    stray = np.zeros((2, PB), dtype=np.uint8)
    res = setup.rdma.fetch(
        setup.server.address,
        NS,
        setup.keys[:3],
        [memoryview(stray[0]), memoryview(setup.dst[1]), memoryview(stray[1])],
    )
    assert [r.ok for r in res] == [False, True, False]
    assert "not in RDMA-registered memory" in res[0].reason


def test_token_protected_control_channel():
    s = Setup(token="k", config=RdmaConfig(chain=4, chains_in_flight=2, token="k"))
    try:
        res = s.rdma.fetch(s.server.address, NS, s.keys, s.views())
        assert all(r.ok for r in res)
        stranger = RdmaTransport(FakeVerbsBackend(s.fabric))
        stranger.register_local(s.dst.reshape(-1))
        res = stranger.fetch(s.server.address, NS, s.keys[:2], s.views()[:2])
        assert {r.outcome for r in res} == {Outcome.UNAVAILABLE}
        stranger.close()
    finally:
        s.close()


def test_an_rdma_pin_is_for_an_identity_the_source_checks():
    """RDMA_PIN, like FETCH, names whom it is for (identity.py): the data token alone pins
    nothing, and a tenant's keys are scoped to it at the source."""
    tokens = {"adm": "", "ali": "alice"}
    s = Setup(
        token="k",
        identities=Identities(tokens),
        config=RdmaConfig(chain=4, chains_in_flight=2, token="k"),
    )
    try:
        res = s.rdma.fetch(s.server.address, NS, s.keys[:2], s.views()[:2])
        assert {r.outcome for r in res} == {Outcome.UNAVAILABLE}
        assert "names no identity" in res[0].reason
        res = s.rdma.fetch(s.server.address, NS, s.keys, s.views(), Identity("alice", b"ali"))
        assert {r.outcome for r in res} == {Outcome.NOT_FOUND}, res  # the admin's keys, not hers
        res = s.rdma.fetch(s.server.address, NS, s.keys, s.views(), Identity("", b"adm"))
        assert all(r.ok for r in res)
        assert np.array_equal(s.dst.reshape(-1), s.src_region)
    finally:
        s.close()


def test_unknown_namespace_is_invalid(setup):
    res = setup.rdma.fetch(setup.server.address, "nope", setup.keys[:2], setup.views()[:2])
    assert {r.outcome for r in res} == {Outcome.INVALID}


def test_send_queue_is_never_overrun():
    # 4 WRs per chain x 2 chains in flight fits an 8-deep send queue only if unsignaled WRs are
    # retired by their chain's signaled completion and the transport waits for it.
    s = Setup(config=RdmaConfig(chain=4, chains_in_flight=2), max_send_wr=8)
    try:
        res = s.rdma.fetch(s.server.address, NS, s.keys, s.views(list(range(PAGES))[::-1]))
        assert all(r.ok for r in res)
        with pytest.raises(ValueError, match="send queue"):
            RdmaTransport(s.dst_backend, RdmaConfig(chain=8, chains_in_flight=2))
    finally:
        s.close()


def test_session_and_qp_survive_fetches_of_many_groups(setup, monkeypatch):
    # RDMA_RELEASE's END reply has no body and a zero checksum; taking that for a corrupt reply
    # broke the session after every group: later groups of the fetch failed and every fetch
    # paid a new QP handshake.
    monkeypatch.setattr(rdma_module, "MAX_KEYS_PER_REQUEST", 8)
    res = setup.rdma.fetch(setup.server.address, NS, setup.keys, setup.views())
    assert all(r.ok for r in res), res[-1]
    np.testing.assert_array_equal(setup.dst.reshape(-1), setup.src_region)
    session = setup.rdma._sessions[setup.server.address]
    assert not session.broken and setup.source.pins == 0
    setup.dst[:] = 0
    res = setup.rdma.fetch(setup.server.address, NS, setup.keys[:3], setup.views()[:3])
    assert all(r.ok for r in res)
    assert setup.rdma._sessions[setup.server.address] is session
    assert len(setup.fabric.qps) == 2  # one QP on each side, from the first handshake


def test_closing_the_control_connection_releases_source_pins(setup):
    # A pin whose release never comes (the destination dies) is undone when the connection goes.
    session = setup.rdma._session(setup.server.address)
    from messenger.frames import Kind, pack_keys_body

    h, _ = session.request(Kind.RDMA_PIN, pack_keys_body(NS, PB, setup.keys[:4]), count=4)
    assert h.kind is Kind.RDMA_PINNED and setup.source.pins == 1
    setup.rdma.drop_session(setup.server.address)
    assert wait_until(lambda: setup.source.pins == 0)


# ---- selection -----------------------------------------------------------------------------------


def test_auto_selects_tcp_here_and_says_why(caplog):
    backend, reason = open_rdma_backend()
    if backend is not None:
        backend.close()
        pytest.skip("this machine has RDMA")
    with caplog.at_level("INFO", logger="messenger.select"):
        choice = choose_transport("auto")
    try:
        assert choice.transport.name == "tcp" and choice.backend is None
        assert "RDMA unavailable" in choice.description
        assert any("transport: tcp" in r.message for r in caplog.records)
    finally:
        choice.transport.close()
    with pytest.raises(RuntimeError, match="RDMA is unavailable"):
        choose_transport("rdma")
    with pytest.raises(ValueError, match="unknown transport"):
        choose_transport("udp")


def test_rdma_mode_with_a_backend_falls_back_per_peer():
    fabric = FakeFabric()
    choice = choose_transport("rdma", backend=FakeVerbsBackend(fabric))
    try:
        assert isinstance(choice.transport, FallbackTransport)
        assert choice.transport.name == "rdma+tcp"
    finally:
        choice.transport.close()


def _real_rdma_reason() -> str | None:
    backend, reason = open_rdma_backend()
    if backend is None:
        return reason
    backend.close()
    return None


class _Rec:
    """Records how a pyverbs class was constructed."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def _stub_pyverbs(calls: dict) -> dict[str, types.ModuleType]:
    """Just enough of pyverbs' API for verbs_pyverbs to import and build QPs and WRs."""

    class PyverbsError(Exception):
        pass

    class QP:
        def __init__(self, pd, init_attr):
            calls["init_attr"] = init_attr
            calls["qp"] = self
            self.qp_num = 0x42
            self.posted: list = []
            self.transitions: list = []

        def to_init(self, attr):
            self.transitions.append(("INIT", attr.qp_access_flags))

        def to_rtr(self, attr):
            self.transitions.append(("RTR", attr.dest_qp_num))

        def to_rts(self, attr):
            self.transitions.append(("RTS", attr.sq_psn))

        def post_send(self, wr):
            self.posted.append(wr)

        def close(self):
            pass

    class QPAttr:
        def __init__(self, port_num=1):
            self.port_num = port_num

    class SendWR(_Rec):
        def set_wr_rdma(self, rkey, addr):
            self.rdma = (rkey, addr)

        def set_bind_wr(self, mw, bind_info):  # as pyverbs: the new key is inc_rkey(mw.rkey)
            self.bind = (mw, bind_info)
            self.rkey = (mw.rkey & ~0xFF) | ((mw.rkey + 1) & 0xFF)

    class MR(_Rec):
        lkey, rkey = 0x11, 0x22

        def close(self):
            calls.setdefault("closed", []).append(self)

    class MW(_Rec):
        rkey = 0x3300

        def close(self):
            calls.setdefault("closed", []).append(self)

    class CQ(_Rec):
        def poll(self, num_entries=1):
            return 0, []

        def close(self):
            pass

    enums = {
        "IBV_QPT_RC": 2,
        "IBV_SEND_SIGNALED": 2,
        "IBV_WR_RDMA_READ": 4,
        "IBV_ACCESS_REMOTE_READ": 4,
        "IBV_WR_LOCAL_INV": 7,
        "IBV_WR_BIND_MW": 8,
        "IBV_MW_TYPE_2": 2,
    }
    contents = {
        "pyverbs": {},
        "pyverbs.device": {"Context": _Rec, "get_device_list": lambda: []},
        "pyverbs.enums": enums,
        "pyverbs.addr": {"GID": _Rec, "AHAttr": _Rec, "GlobalRoute": _Rec},
        "pyverbs.cq": {"CQ": CQ},
        "pyverbs.mr": {"MR": MR, "MW": MW, "MWBindInfo": _Rec},
        "pyverbs.pd": {"PD": _Rec},
        "pyverbs.pyverbs_error": {"PyverbsError": PyverbsError},
        "pyverbs.qp": {"QP": QP, "QPAttr": QPAttr, "QPCap": _Rec, "QPInitAttr": _Rec},
        "pyverbs.wr": {"SGE": _Rec, "SendWR": SendWR},
    }
    modules = {}
    for name, attrs in contents.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        modules[name] = module
        if "." in name:
            setattr(modules["pyverbs"], name.split(".")[1], module)
    return modules


def test_pyverbs_backend_signals_like_the_fake(monkeypatch):
    """No RDMA here: run verbs_pyverbs against a recording stub of pyverbs to check that it
    asks for what the transport relies on (and the fake enforces): no sq_sig_all (pyverbs'
    QPInitAttr defaults to 1), a send queue of max_send_wr, IBV_SEND_SIGNALED only where the WR
    asks, the chain linked in posting order, and the QP access flags it is given."""
    calls: dict = {}
    for name, module in _stub_pyverbs(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    saved = sys.modules.pop("messenger.verbs_pyverbs", None)
    try:
        vp = importlib.import_module("messenger.verbs_pyverbs")
        backend = object.__new__(vp.PyverbsBackend)  # no device: only what create_qp reads
        backend.ctx = backend.pd = None
        backend.max_send_wr, backend.port, backend.gid_index = 8, 1, 0
        backend.port_attr = types.SimpleNamespace(lid=7)
        backend.gid, backend.mtu = "", 5
        qp = backend.create_qp()
        init = calls["init_attr"].kwargs
        assert init["sq_sig_all"] == 0 and not qp.sq_sig_all
        assert init["cap"].kwargs["max_send_wr"] == 8
        assert backend.create_qp(sq_sig_all=True).sq_sig_all
        assert calls["init_attr"].kwargs["sq_sig_all"] == 1

        qp = backend.create_qp()
        qp.connect(QpInfo(qpn=0x99, psn=5, lid=3, gid="", mtu=5), 0)
        stub = calls["qp"]
        assert stub.transitions == [("INIT", 0), ("RTR", 0x99), ("RTS", qp.info.psn)]
        wrs = [ReadWr(10 + i, 0x1000 * i, 1, 0x9000 + i, 2, 64, i == 2) for i in range(3)]
        qp.post_reads(wrs)
        (head,) = stub.posted
        chain = []
        wr = head
        while wr is not None:
            chain.append(wr)
            wr = wr.kwargs.get("next_wr")
        assert [w.kwargs["wr_id"] for w in chain] == [10, 11, 12]
        assert [w.kwargs["send_flags"] for w in chain] == [0, 0, 2]
        assert [w.rdma for w in chain] == [(2, 0x9000), (2, 0x9001), (2, 0x9002)]

        # Memory windows as rdma-core's pyverbs tests bind and invalidate them (test_mr.py).
        backend._mrs, backend._mws, backend._lock = {}, {}, threading.Lock()
        backend._mw_ids = iter(range(1, 100))
        mr = backend.register(0x5000, 4 * 64, Access.MW_BIND)
        window = backend.alloc_mw()
        assert calls.get("closed") is None and window.rkey == 0x3300
        bind = BindWr(20, window, mr, 0x5040, 128, Access.REMOTE_READ, False)
        qp.post_send([bind, InvalidateWr(21, 0x3301, True)])
        first, second = stub.posted[-1], stub.posted[-1].kwargs["next_wr"]
        assert first.kwargs["opcode"] == 8 and first.kwargs["send_flags"] == 0
        mw_stub, info = first.bind
        assert isinstance(mw_stub, backend._mws[window.handle].__class__)
        assert info.args[1:] == (0x5040, 128, Access.REMOTE_READ)
        assert window.rkey == 0x3301  # the key the peer will use
        assert second.kwargs["opcode"] == 7 and second.kwargs["send_flags"] == 2
        assert second.imm_data == 0x3301  # ibv_send_wr.invalidate_rkey shares imm_data's union
        backend.dealloc_mw(window)
        backend.deregister(mr)
        assert len(calls["closed"]) == 2 and not backend._mws and not backend._mrs
    finally:
        import messenger

        sys.modules.pop("messenger.verbs_pyverbs", None)
        if saved is not None:
            sys.modules["messenger.verbs_pyverbs"] = saved
            messenger.verbs_pyverbs = saved
        elif hasattr(messenger, "verbs_pyverbs"):
            delattr(messenger, "verbs_pyverbs")


@pytest.mark.rdma
def test_real_verbs_loopback_read():
    reason = _real_rdma_reason()
    if reason:
        pytest.skip(f"needs pyverbs and an ACTIVE RDMA port: {reason}")
    from messenger.verbs_pyverbs import PyverbsBackend

    src_b, dst_b = PyverbsBackend(), PyverbsBackend()
    src = np.arange(PB, dtype=np.uint8)
    dst = np.zeros(PB, dtype=np.uint8)
    try:
        rmr = src_b.register(src.ctypes.data, PB, Access.LOCAL_WRITE | Access.REMOTE_READ)
        lmr = dst_b.register(dst.ctypes.data, PB, Access.LOCAL_WRITE)
        qa, qb = dst_b.create_qp(), src_b.create_qp()
        qa.connect(qb.info)
        qb.connect(qa.info)
        qa.post_reads([ReadWr(1, dst.ctypes.data, lmr.lkey, src.ctypes.data, rmr.rkey, PB, True)])
        completions = []
        assert wait_until(lambda: bool(completions.extend(qa.poll(4)) or completions))
        assert completions[0].ok
        np.testing.assert_array_equal(dst, src)
    finally:
        src_b.close()
        dst_b.close()


@pytest.mark.rdma
def test_real_verbs_transport_end_to_end():
    reason = _real_rdma_reason()
    if reason:
        pytest.skip(f"needs pyverbs and an ACTIVE RDMA port: {reason}")
    from messenger.verbs_pyverbs import PyverbsBackend

    src_region = np.empty(PAGES * PB, dtype=np.uint8)
    fill_pattern(src_region.reshape(PAGES, PB))
    keys = pattern_keys(PAGES)
    source = SlabPageSource(NS, src_region, PB, {k: i for i, k in enumerate(keys)})
    server = DataServer(source).start()
    src_b, dst_b = PyverbsBackend(), PyverbsBackend()
    RdmaSource(src_b, source).install(server)
    transport = RdmaTransport(dst_b)
    dst = np.zeros((PAGES, PB), dtype=np.uint8)
    transport.register_local(dst.reshape(-1))
    try:
        res = transport.fetch(server.address, NS, keys, [memoryview(dst[i]) for i in range(PAGES)])
        assert all(r.ok for r in res), res[0]
        np.testing.assert_array_equal(dst.reshape(-1), src_region)
    finally:
        transport.close()
        server.stop()
        src_b.close()
        dst_b.close()


def test_rdma_between_real_nodes_through_the_mover(start_node):
    """The RDMA path on real node processes: the source pins through node A and registers its
    shared-memory slab; the mover allocates on node B, READs into B's slab, verifies, commits."""
    from clients.node_client import KVStoreClient
    from kvstore.keys import keys_from_block_ids, root_key
    from messenger.mover import DataAddressResolver, EntryRequest, Mover
    from messenger.node_access import NodeAccess, NodePageSource

    from conftest import TEST_NAMESPACE as NS_NODE
    from conftest import TEST_PAGE_BYTES

    node_a, node_b = start_node(), start_node()
    ca, cb = KVStoreClient(node_a.address), CommitLog(node_b.address)
    keys = keys_from_block_ids(list(range(20)), root_key(NS_NODE, b"rdma"))
    pages = np.random.default_rng(5).integers(0, 256, (20, TEST_PAGE_BYTES), dtype=np.uint8)
    ca.put(NS_NODE, list(pages), keys=keys)
    fabric = FakeFabric()
    src_access, dst_access = NodeAccess(ca), NodeAccess(cb)
    source = NodePageSource(src_access, pin_ttl_s=10)
    server = DataServer(source).start()
    rdma_source = RdmaSource(FakeVerbsBackend(fabric), source)
    rdma_source.install(server)
    transport = FallbackTransport(RdmaTransport(FakeVerbsBackend(fabric)), TcpTransport())
    mover = Mover(dst_access, transport, DataAddressResolver(lambda _: server.address))
    try:
        batch_id, _ = mover.submit(NS_NODE, [EntryRequest(k, "source:1") for k in keys])
        snap = mover.status(batch_id, wait=True, timeout_s=30)
        assert snap.finished and snap.count("done") == 20, snap.entries[0]
        assert fabric.reads_posted >= 1 and fabric.bytes_read == 20 * TEST_PAGE_BYTES
        assert not transport.tcp_only_peers()  # no fallback was needed
        # The commit carries the checksums the READ pages were verified against.
        (lease, sums), *more = cb.commits
        assert not more and lease.keys == keys and sums is not None
        assert sums.tolist() == [xxhash.xxh3_64_intdigest(p) for p in pages]
        with KVStoreClient(node_b.address, use_shm=False) as reader:  # checked on the way out
            got = reader.get(NS_NODE, keys=keys)
        assert all(np.array_equal(g, p) for g, p in zip(got, pages))
        stats = ca.stats().namespaces[0]
        assert sum(t.pinned_blocks for t in stats.tiers) == 0
    finally:
        mover.close()
        transport.close()
        server.stop()
        rdma_source.close()
        src_access.close()
        dst_access.close()
        ca.close()
        cb.close()


class _CheckedSource(SlabPageSource):
    """Pins carry the checksums taken at commit, as the node's do; page 5 changed since."""

    dropped: list[bytes]

    def pin(self, namespace, keys):
        import xxhash

        pinned = super().pin(namespace, keys)
        pinned.checksums = [
            xxhash.xxh3_64_intdigest(v) if v is not None else 0 for v in pinned.views
        ]
        if len(keys) > 5 and pinned.views[5] is not None:
            pinned.checksums[5] ^= 1  # as if the page was scribbled on after its commit
        self.dropped = []
        pinned.drop = lambda idx: self.dropped.extend(keys[i] for i in idx)
        return pinned


@pytest.mark.parametrize("transport", ["rdma", "tcp"])
def test_a_page_that_changed_since_its_commit_is_offered_as_missing(setup, transport):
    from messenger.tcp import TcpConfig

    src = _CheckedSource(NS, setup.src_region, PB, dict(setup.source.slots))
    setup.server.source = src
    if hasattr(setup, "rdma_source"):
        setup.rdma_source.source = src
    t = setup.rdma if transport == "rdma" else TcpTransport(TcpConfig(lanes=1))
    try:
        res = t.fetch(setup.server.address, NS, setup.keys[:8], setup.views()[:8])
    finally:
        if transport == "tcp":
            t.close()
    assert [r.ok for r in res] == [i != 5 for i in range(8)]
    assert res[5].outcome is Outcome.NOT_FOUND
    assert src.dropped == [setup.keys[5]]
