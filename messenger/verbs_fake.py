"""An in-process stand-in for RDMA hardware: the ``VerbsBackend`` the RDMA transport is tested on.

A ``FakeFabric`` plays the network: every ``FakeVerbsBackend`` attached to it (one per simulated
node, all in one process; one protection domain each) registers memory regions there, and a READ
posted on a connected QP copies bytes from the peer's region into the local one. It is meant to be
as strict as an HCA, so that code which only works by luck on the fake fails here too:

- **asynchronous**: ``post_send`` only queues the WRs; a worker thread per QP executes them in
  order and only then generates completions. A caller that stops waiting too early reads pages
  that have not landed yet (``throttle`` / ``wr_delay_s`` widen that window on purpose);
- **completions**: generated only for signaled WRs, or for every WR on a QP created with
  ``sq_sig_all``; a failed WR, and every WR flushed after it, always completes. An unsignaled WR
  keeps its send-queue slot until a completion for it or a later WR is *polled*; posting past
  ``max_send_wr`` fails with ENOMEM after posting the WRs that fit (as ``ibv_post_send`` does);
  the CQ holds ``2 * max_send_wr`` entries and an overrun breaks the QP;
- **keys**: every region gets an lkey and a different rkey, looked up in separate tables of its
  own protection domain: an rkey used as an lkey (or the other way round) is not found;
- **requester checks** (``LOC_PROT_ERR``): the lkey is ours, grants LOCAL_WRITE and covers the
  destination range;
- **responder checks**: the peer QP exists, is connected back to this QP and is in RTR or RTS
  (else the requester's retries run out: ``RETRY_EXC_ERR``); its QP access flags (set at INIT)
  grant REMOTE_READ, the rkey is the peer's, and names either a region that grants REMOTE_READ
  and covers the range, or a memory window that is bound, was bound through the very QP the
  READ arrives on (type 2), grants REMOTE_READ and covers the range (else ``REM_ACCESS_ERR``);
- **memory windows** (type 2): a bind (``BindWr``, executed in order with the QP's other WRs)
  needs the window free and ours, the region ours, registered with MW_BIND, and covering the
  range (else ``MW_BIND_ERR``); it gives the window the rkey set at post (``ibv_inc_rkey``).
  ``InvalidateWr`` (local invalidate) needs a window bound through the same QP (else
  ``LOC_PROT_ERR``); after it, or ``dealloc_mw``, the rkey reads nothing. A region with windows
  bound over it cannot be deregistered (EBUSY);
- **QP states**: RESET -> INIT -> RTR -> RTS in that order only (``VerbsError`` otherwise);
  posting needs RTS (or ERR, where WRs are flushed); a failed WR moves the QP to ERR and flushes
  everything behind it (``WR_FLUSH_ERR``), as RC QPs do; a closed QP stops copying at once.

``errors`` records, per failed WR, why the fake failed it (one completion status covers several
causes). Test hooks: ``fail_reads(n, status)`` fails the next ``n`` READs; ``corrupt_reads(n)``
flips a byte in what the next ``n`` READs deliver; ``poll_delay`` makes each completion visible
only after that many empty polls; ``throttle(n)`` lets only ``n`` more READs execute until
``unthrottle()``; ``wr_delay_s`` delays every READ; ``wait_idle()`` waits for all queued WRs.
The hooks and the READ counters (``reads_posted``, ``chains_posted``, ``completions``...) leave
the source's window binds and invalidations alone; those have counters of their own.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from .verbs import (
    Access,
    BindWr,
    Completion,
    InvalidateWr,
    MemoryRegion,
    MemoryWindow,
    QpInfo,
    QueuePair,
    ReadWr,
    SendWr,
    VerbsBackend,
    VerbsError,
    WcStatus,
)

MAX_MESSAGE_BYTES = 1 << 31  # ibv_port_attr.max_msg_sz of common HCAs

# QP states (ibv_qp_state) and the transitions ibv_modify_qp accepts for the fields we set.
RESET, INIT, RTR, RTS, ERR = "RESET", "INIT", "RTR", "RTS", "ERR"
_TRANSITIONS = {(RESET, INIT), (INIT, INIT), (INIT, RTR), (RTR, RTS), (RTS, RTS)}


@dataclass(frozen=True, slots=True)
class _PostedBind:
    """A bind in the send queue, with the rkey it was posted with."""

    wr: BindWr
    rkey: int

    @property
    def wr_id(self) -> int:
        return self.wr.wr_id

    @property
    def signaled(self) -> bool:
        return self.wr.signaled


@dataclass
class _Pending:
    """A completion in the CQ: visible after ``polls_left`` empty polls; retires ``wrs`` slots."""

    polls_left: int
    wrs: int
    wc: Completion


def inc_rkey(rkey: int) -> int:
    """``ibv_inc_rkey``: the next key of a window (the low byte is the consumer's)."""
    return (rkey & 0xFFFFFF00) | ((rkey + 1) & 0xFF)


@dataclass(eq=False)
class FakeWindow:
    """The HCA's view of a type-2 memory window."""

    handle: int
    rkey: int
    bound: bool = False
    qpn: int = 0  # the QP it was bound through: the only one remote accesses may arrive on
    addr: int = 0
    length: int = 0
    access: int = 0
    mr_lkey: int = 0

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length


@dataclass
class FakeFabric:
    lock: threading.Condition = field(default_factory=threading.Condition)
    qps: dict[int, "FakeQueuePair"] = field(default_factory=dict)
    poll_delay: int = 0
    wr_delay_s: float = 0.0
    reads_posted: int = 0
    signaled_posted: int = 0
    chains_posted: int = 0
    completions: int = 0  # READ completions generated (successful or not)
    bytes_read: int = 0
    binds_posted: int = 0
    invalidations_posted: int = 0
    mw_completions: int = 0  # completions of binds and invalidations
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._keys = itertools.count(0x1000, 0x101)
        self._windows = itertools.count(0x800000)  # window indices: rkeys above every MR key
        self._qpns = itertools.count(0x100)
        self._lids = itertools.count(1)
        self._failures: deque[int] = deque()
        self._corruptions = 0
        self._budget: int | None = None

    def fail_reads(self, n: int, status: WcStatus = WcStatus.REM_ACCESS_ERR) -> None:
        with self.lock:
            self._failures.extend([status] * n)

    def corrupt_reads(self, n: int) -> None:
        """Flip one byte of what the next ``n`` READs deliver (a bad link; completions succeed)."""
        with self.lock:
            self._corruptions += n

    def throttle(self, n: int) -> None:
        """Let only ``n`` more READs execute (on any QP) until ``unthrottle``."""
        with self.lock:
            self._budget = n
            self.lock.notify_all()

    def unthrottle(self) -> None:
        with self.lock:
            self._budget = None
            self.lock.notify_all()

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until no QP has WRs left to execute."""
        with self.lock:
            return self.lock.wait_for(
                lambda: not any(q._sq for q in self.qps.values()), timeout=timeout_s
            )

    def next_key(self) -> int:
        return next(self._keys)

    def next_window(self) -> int:
        return next(self._windows)

    def next_qpn(self) -> int:
        return next(self._qpns)

    def next_lid(self) -> int:
        return next(self._lids)

    def take_failure(self) -> int | None:
        return self._failures.popleft() if self._failures else None


class FakeQueuePair(QueuePair):
    def __init__(self, backend: "FakeVerbsBackend", sq_sig_all: bool = False) -> None:
        self.backend = backend
        self.sq_sig_all = sq_sig_all
        fabric = backend.fabric
        self._info = QpInfo(
            qpn=fabric.next_qpn(), psn=0x1234, lid=backend.lid, gid=f"fe80::{backend.lid:x}", mtu=5
        )
        self.state = RESET
        self.access = 0  # qp_access_flags, set at INIT
        self.remote: QpInfo | None = None
        self.closed = False
        self._sq: deque[ReadWr | _PostedBind | InvalidateWr] = deque()  # posted, not executed
        self._cq: deque[_Pending] = deque()
        self._cq_overrun = False
        self._outstanding = 0  # WRs holding a send-queue slot (retired when a completion is polled)
        self._unretired = 0  # WRs executed since the last completion was generated
        self._worker: threading.Thread | None = None
        with fabric.lock:
            fabric.qps[self._info.qpn] = self

    @property
    def info(self) -> QpInfo:
        return self._info

    # ---- state machine (ibv_modify_qp) --------------------------------------------------------

    def _modify(self, to: str) -> None:
        """Caller holds the fabric lock."""
        if self.closed:
            raise VerbsError(f"ibv_modify_qp on destroyed QP {self._info.qpn:#x}")
        if to != ERR and to != RESET and (self.state, to) not in _TRANSITIONS:
            raise VerbsError(
                f"ibv_modify_qp {self.state} -> {to} failed (EINVAL): QP {self._info.qpn:#x} "
                "must go RESET -> INIT -> RTR -> RTS"
            )
        self.state = to
        if to == RESET:
            self._sq.clear()
            self._cq.clear()
            self._outstanding = self._unretired = 0
            self.remote = None

    def to_init(self, access: int = Access.REMOTE_READ) -> None:
        with self.backend.fabric.lock:
            self._modify(INIT)
            self.access = int(access)

    def to_rtr(self, remote: QpInfo) -> None:
        # Like ibv_modify_qp, nothing here checks that the remote QP exists: a wrong address
        # shows up as RETRY_EXC_ERR on the first READ.
        if remote.mtu not in (1, 2, 3, 4, 5):
            raise VerbsError(f"ibv_modify_qp INIT -> RTR failed: invalid path MTU {remote.mtu}")
        with self.backend.fabric.lock:
            self._modify(RTR)
            self.remote = remote

    def to_rts(self) -> None:
        with self.backend.fabric.lock:
            self._modify(RTS)

    def to_error(self) -> None:
        with self.backend.fabric.lock:
            self._modify(ERR)

    def to_reset(self) -> None:
        with self.backend.fabric.lock:
            self._modify(RESET)

    def connect(self, remote: QpInfo, access: int = Access.REMOTE_READ) -> None:
        self.to_init(access)
        self.to_rtr(remote)
        self.to_rts()

    # ---- send queue ---------------------------------------------------------------------------

    def post_send(self, wrs: Sequence[SendWr]) -> None:
        fabric = self.backend.fabric
        with fabric.lock:
            if self.closed or self.state not in (RTS, ERR):
                state = "destroyed" if self.closed else self.state
                raise VerbsError(
                    f"ibv_post_send failed (EINVAL): QP {self._info.qpn:#x} is {state}, not RTS"
                )
            fabric.chains_posted += any(isinstance(wr, ReadWr) for wr in wrs)
            full = None
            for k, wr in enumerate(wrs):
                if self._outstanding >= self.backend.max_send_wr:
                    full = (
                        f"ibv_post_send failed (ENOMEM): send queue full, {self._outstanding} "
                        f"WRs outstanding (max_send_wr {self.backend.max_send_wr}); "
                        f"posted {k} of {len(wrs)}, bad_wr {wr.wr_id}"
                    )
                    break
                if isinstance(wr, ReadWr):
                    fabric.reads_posted += 1
                    fabric.signaled_posted += bool(wr.signaled)
                elif isinstance(wr, BindWr):
                    # The consumer picks the key at post (ibv_inc_rkey); it is valid once the
                    # bind has executed.
                    fabric.binds_posted += 1
                    wr.mw.rkey = inc_rkey(wr.mw.rkey)
                    wr = _PostedBind(wr, wr.mw.rkey)
                else:
                    fabric.invalidations_posted += 1
                self._outstanding += 1
                self._sq.append(wr)
            if self._worker is None and self._sq:  # the WRs before bad_wr were posted
                self._worker = threading.Thread(
                    target=self._run, name=f"fake-hca-qp{self._info.qpn:#x}", daemon=True
                )
                self._worker.start()
            if full is not None:
                raise VerbsError(full)

    def _run(self) -> None:
        """The HCA: executes this QP's WRs in order, one at a time, and completes them."""
        fabric = self.backend.fabric
        with fabric.lock:
            try:
                while True:
                    if (
                        fabric.wr_delay_s
                        and self._sq
                        and isinstance(self._sq[0], ReadWr)
                        and not self.closed
                        and self.state != ERR
                    ):
                        deadline = time.monotonic() + fabric.wr_delay_s
                        while not self.closed and (left := deadline - time.monotonic()) > 0:
                            fabric.lock.wait(left)
                    fabric.lock.wait_for(
                        lambda: (
                            self.closed
                            or not self._sq
                            or fabric._budget != 0
                            or not isinstance(self._sq[0], ReadWr)
                        )
                    )
                    if self.closed or not self._sq:
                        return
                    wr = self._sq.popleft()
                    if fabric._budget is not None and isinstance(wr, ReadWr):
                        fabric._budget -= 1
                    self._complete(wr)
                    fabric.lock.notify_all()
            finally:
                self._worker = None
                fabric.lock.notify_all()

    def _complete(self, wr: ReadWr | _PostedBind | InvalidateWr) -> None:
        """Execute one WR and generate its completion if one is due. Caller holds the lock."""
        fabric = self.backend.fabric
        if self.state == ERR:
            status = WcStatus.WR_FLUSH_ERR
        elif isinstance(wr, ReadWr):
            status = self._execute(wr)
        elif isinstance(wr, _PostedBind):
            status = self._bind(wr)
        else:
            status = self._invalidate(wr)
        self._unretired += 1
        if status != WcStatus.SUCCESS:
            self.state = ERR
        if wr.signaled or self.sq_sig_all or status != WcStatus.SUCCESS:
            if isinstance(wr, ReadWr):
                fabric.completions += 1
            else:
                fabric.mw_completions += 1
            if len(self._cq) >= 2 * self.backend.max_send_wr:
                self._cq_overrun = True
                self.state = ERR
                return
            self._cq.append(
                _Pending(fabric.poll_delay, self._unretired, Completion(wr.wr_id, status))
            )
            self._unretired = 0

    def _fail(self, wr: SendWr, status: WcStatus, why: str) -> WcStatus:
        self.backend.fabric.errors.append(f"wr {wr.wr_id}: {status.name}: {why}")
        return status

    def _execute(self, wr: ReadWr) -> WcStatus:
        """The checks requester and responder make, then the copy. Caller holds the lock."""
        fabric = self.backend.fabric
        injected = fabric.take_failure()
        if injected is not None:
            return self._fail(wr, WcStatus(injected), "injected")
        if not 0 < wr.length <= MAX_MESSAGE_BYTES:
            return self._fail(wr, WcStatus.LOC_LEN_ERR, f"length {wr.length}")
        local = self.backend.by_lkey.get(wr.lkey)
        if local is None:
            return self._fail(wr, WcStatus.LOC_PROT_ERR, f"lkey {wr.lkey:#x} is not ours")
        if not local.access & Access.LOCAL_WRITE:
            return self._fail(wr, WcStatus.LOC_PROT_ERR, "local region lacks LOCAL_WRITE")
        if not local.contains(wr.local_addr, wr.length):
            return self._fail(wr, WcStatus.LOC_PROT_ERR, "destination outside the local region")
        # Responder side.
        to = self.remote
        peer = fabric.qps.get(to.qpn) if to is not None else None
        if to is None or peer is None or peer.closed or peer.backend.lid != to.lid:
            return self._fail(wr, WcStatus.RETRY_EXC_ERR, "no peer QP at that address")
        if peer.state not in (RTR, RTS):
            return self._fail(wr, WcStatus.RETRY_EXC_ERR, f"peer QP is in {peer.state}")
        if peer.remote is None or peer.remote.qpn != self._info.qpn:
            return self._fail(wr, WcStatus.RETRY_EXC_ERR, "peer QP is connected elsewhere")
        if not peer.access & Access.REMOTE_READ:
            return self._fail(wr, WcStatus.REM_ACCESS_ERR, "peer QP lacks REMOTE_READ")
        remote = peer.backend.by_rkey.get(wr.rkey)
        window = peer.backend.by_window_rkey.get(wr.rkey) if remote is None else None
        if remote is None and window is None:
            return self._fail(wr, WcStatus.REM_ACCESS_ERR, f"rkey {wr.rkey:#x} is not the peer's")
        if window is not None:
            if not window.bound:
                return self._fail(
                    wr, WcStatus.REM_ACCESS_ERR, "memory window is not bound (invalidated)"
                )
            if window.qpn != peer.info.qpn:
                return self._fail(
                    wr, WcStatus.REM_ACCESS_ERR, "memory window is bound to another QP"
                )
            if not window.access & Access.REMOTE_READ:
                return self._fail(wr, WcStatus.REM_ACCESS_ERR, "memory window lacks REMOTE_READ")
            if not window.contains(wr.remote_addr, wr.length):
                return self._fail(wr, WcStatus.REM_ACCESS_ERR, "source outside the memory window")
        else:
            assert remote is not None
            if not remote.access & Access.REMOTE_READ:
                return self._fail(wr, WcStatus.REM_ACCESS_ERR, "remote region lacks REMOTE_READ")
            if not remote.contains(wr.remote_addr, wr.length):
                return self._fail(wr, WcStatus.REM_ACCESS_ERR, "source outside the remote region")
        ctypes.memmove(wr.local_addr, wr.remote_addr, wr.length)
        fabric.bytes_read += wr.length
        if fabric._corruptions:
            fabric._corruptions -= 1
            byte = ctypes.c_uint8.from_address(wr.local_addr + wr.length // 2)
            byte.value ^= 0xFF
        return WcStatus.SUCCESS

    def _bind(self, posted: "_PostedBind") -> WcStatus:
        """A type-2 bind, executed in order with the QP's other WRs. Caller holds the lock."""
        wr, backend = posted.wr, self.backend
        window = backend.windows.get(wr.mw.handle)
        if window is None:
            return self._fail(wr, WcStatus.MW_BIND_ERR, "memory window is not ours (deallocated?)")
        if window.bound:
            return self._fail(wr, WcStatus.MW_BIND_ERR, "type-2 window is bound already")
        mr = backend.by_lkey.get(wr.mr.lkey)
        if mr is None or mr != wr.mr:
            return self._fail(wr, WcStatus.MW_BIND_ERR, "region is not ours (deregistered?)")
        if not mr.access & Access.MW_BIND:
            return self._fail(wr, WcStatus.MW_BIND_ERR, "region lacks MW_BIND")
        if wr.length <= 0 or not mr.contains(wr.addr, wr.length):
            return self._fail(wr, WcStatus.MW_BIND_ERR, "window range outside the region")
        if wr.access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC) and not (
            mr.access & Access.LOCAL_WRITE
        ):
            return self._fail(wr, WcStatus.MW_BIND_ERR, "remote write needs LOCAL_WRITE")
        backend.by_window_rkey.pop(window.rkey, None)
        window.rkey = posted.rkey
        backend.by_window_rkey[window.rkey] = window
        window.bound, window.qpn = True, self._info.qpn
        window.addr, window.length, window.access = wr.addr, wr.length, int(wr.access)
        window.mr_lkey = mr.lkey
        return WcStatus.SUCCESS

    def _invalidate(self, wr: InvalidateWr) -> WcStatus:
        """A local invalidate of a window's rkey. Caller holds the lock."""
        window = self.backend.by_window_rkey.get(wr.rkey)
        if window is None or not window.bound:
            return self._fail(wr, WcStatus.LOC_PROT_ERR, f"rkey {wr.rkey:#x} names no bound window")
        if window.qpn != self._info.qpn:
            return self._fail(wr, WcStatus.LOC_PROT_ERR, "window is bound through another QP")
        window.bound = False
        return WcStatus.SUCCESS

    def poll(self, max_entries: int) -> list[Completion]:
        out: list[Completion] = []
        with self.backend.fabric.lock:
            if self._cq_overrun:
                raise VerbsError(f"CQ overrun on QP {self._info.qpn:#x}: completions were lost")
            while self._cq and len(out) < max_entries:
                entry = self._cq[0]
                if entry.polls_left > 0:
                    entry.polls_left -= 1
                    break
                self._cq.popleft()
                self._outstanding -= entry.wrs
                out.append(entry.wc)
        return out

    def close(self) -> None:
        """Destroy the QP: after this returns, it copies nothing more."""
        fabric = self.backend.fabric
        with fabric.lock:
            fabric.qps.pop(self._info.qpn, None)
            self.closed = True
            self._sq.clear()
            self.state = RESET
            fabric.lock.notify_all()


class FakeVerbsBackend(VerbsBackend):
    name = "fake"

    def __init__(self, fabric: FakeFabric, max_send_wr: int = 64) -> None:
        self.fabric = fabric
        self.lid = fabric.next_lid()
        self.max_send_wr = max_send_wr
        self.registrations = 0
        self.deregistrations = 0
        self.by_lkey: dict[int, MemoryRegion] = {}  # guarded by the fabric lock
        self.by_rkey: dict[int, MemoryRegion] = {}
        self.windows: dict[int, FakeWindow] = {}  # by handle
        self.by_window_rkey: dict[int, FakeWindow] = {}
        self._qps: list[FakeQueuePair] = []

    def register(self, addr: int, length: int, access: int) -> MemoryRegion:
        if addr <= 0 or length <= 0:
            raise VerbsError(f"ibv_reg_mr failed: bad range addr={addr:#x} length={length}")
        if access & Access.REMOTE_WRITE and not access & Access.LOCAL_WRITE:
            raise VerbsError("ibv_reg_mr failed (EINVAL): REMOTE_WRITE needs LOCAL_WRITE")
        with self.fabric.lock:
            lkey, rkey = self.fabric.next_key(), self.fabric.next_key()
            mr = MemoryRegion(addr=addr, length=length, lkey=lkey, rkey=rkey, access=int(access))
            self.by_lkey[lkey] = mr
            self.by_rkey[rkey] = mr
        self.registrations += 1
        return mr

    def deregister(self, mr: MemoryRegion) -> None:
        """After this returns, no READ touches the region."""
        with self.fabric.lock:
            bound = sum(w.bound and w.mr_lkey == mr.lkey for w in self.windows.values())
            if bound and self.by_lkey.get(mr.lkey) == mr:
                raise VerbsError(
                    f"ibv_dereg_mr failed (EBUSY): {bound} memory windows are bound over it"
                )
            self.by_lkey.pop(mr.lkey, None)
            self.by_rkey.pop(mr.rkey, None)
            self.deregistrations += 1

    def alloc_mw(self) -> MemoryWindow:
        with self.fabric.lock:
            window = FakeWindow(handle=self.fabric.next_window(), rkey=0)
            window.rkey = window.handle << 8
            self.windows[window.handle] = window
            self.by_window_rkey[window.rkey] = window
        return MemoryWindow(window.handle, window.rkey)

    def dealloc_mw(self, mw: MemoryWindow) -> None:
        with self.fabric.lock:
            window = self.windows.pop(mw.handle, None)
            if window is not None:
                self.by_window_rkey.pop(window.rkey, None)

    def window(self, rkey: int) -> FakeWindow | None:
        """The window an rkey names now (None: none, or deallocated), for tests."""
        with self.fabric.lock:
            return self.by_window_rkey.get(rkey)

    def bound_windows(self) -> int:
        with self.fabric.lock:
            return sum(w.bound for w in self.windows.values())

    def create_qp(self, sq_sig_all: bool = False) -> FakeQueuePair:
        qp = FakeQueuePair(self, sq_sig_all)
        self._qps.append(qp)
        return qp

    def close(self) -> None:
        for qp in self._qps:
            qp.close()
        self._qps.clear()
        with self.fabric.lock:
            self.by_lkey.clear()
            self.by_rkey.clear()
            self.windows.clear()
            self.by_window_rkey.clear()
