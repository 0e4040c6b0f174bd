"""An in-process stand-in for RDMA hardware: the ``VerbsBackend`` the RDMA transport is tested on.

A ``FakeFabric`` plays the network: every ``FakeVerbsBackend`` attached to it (one per simulated
node, all in one process; one protection domain each) registers memory regions there, and a READ
posted on a connected QP copies bytes from the peer's region into the local one. It is meant to be
as strict as an HCA, so that code which only works by luck on the fake fails here too:

- **asynchronous**: ``post_reads`` only queues the WRs; a worker thread per QP executes them in
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
  grant REMOTE_READ, the rkey is the peer's, its region grants REMOTE_READ and covers the range
  (else ``REM_ACCESS_ERR``);
- **QP states**: RESET -> INIT -> RTR -> RTS in that order only (``VerbsError`` otherwise);
  posting needs RTS (or ERR, where WRs are flushed); a failed WR moves the QP to ERR and flushes
  everything behind it (``WR_FLUSH_ERR``), as RC QPs do; a closed QP stops copying at once.

``errors`` records, per failed WR, why the fake failed it (one completion status covers several
causes). Test hooks: ``fail_reads(n, status)`` fails the next ``n`` READs; ``corrupt_reads(n)``
flips a byte in what the next ``n`` READs deliver; ``poll_delay`` makes each completion visible
only after that many empty polls; ``throttle(n)`` lets only ``n`` more WRs execute until
``unthrottle()``; ``wr_delay_s`` delays every WR; ``wait_idle()`` waits for all queued WRs.
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
    Completion,
    MemoryRegion,
    QpInfo,
    QueuePair,
    ReadWr,
    VerbsBackend,
    VerbsError,
    WcStatus,
)

MAX_MESSAGE_BYTES = 1 << 31  # ibv_port_attr.max_msg_sz of common HCAs

# QP states (ibv_qp_state) and the transitions ibv_modify_qp accepts for the fields we set.
RESET, INIT, RTR, RTS, ERR = "RESET", "INIT", "RTR", "RTS", "ERR"
_TRANSITIONS = {(RESET, INIT), (INIT, INIT), (INIT, RTR), (RTR, RTS), (RTS, RTS)}


@dataclass
class _Pending:
    """A completion in the CQ: visible after ``polls_left`` empty polls; retires ``wrs`` slots."""

    polls_left: int
    wrs: int
    wc: Completion


@dataclass
class FakeFabric:
    lock: threading.Condition = field(default_factory=threading.Condition)
    qps: dict[int, "FakeQueuePair"] = field(default_factory=dict)
    poll_delay: int = 0
    wr_delay_s: float = 0.0
    reads_posted: int = 0
    signaled_posted: int = 0
    chains_posted: int = 0
    completions: int = 0  # completions generated (successful or not)
    bytes_read: int = 0
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._keys = itertools.count(0x1000, 0x101)
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
        """Let only ``n`` more WRs execute (on any QP) until ``unthrottle``."""
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
        self._sq: deque[ReadWr] = deque()  # posted, not executed yet
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

    def post_reads(self, wrs: Sequence[ReadWr]) -> None:
        fabric = self.backend.fabric
        with fabric.lock:
            if self.closed or self.state not in (RTS, ERR):
                state = "destroyed" if self.closed else self.state
                raise VerbsError(
                    f"ibv_post_send failed (EINVAL): QP {self._info.qpn:#x} is {state}, not RTS"
                )
            fabric.chains_posted += 1
            full = None
            for k, wr in enumerate(wrs):
                if self._outstanding >= self.backend.max_send_wr:
                    full = (
                        f"ibv_post_send failed (ENOMEM): send queue full, {self._outstanding} "
                        f"WRs outstanding (max_send_wr {self.backend.max_send_wr}); "
                        f"posted {k} of {len(wrs)}, bad_wr {wr.wr_id}"
                    )
                    break
                fabric.reads_posted += 1
                fabric.signaled_posted += bool(wr.signaled)
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
                    if fabric.wr_delay_s and self._sq and not self.closed and self.state != ERR:
                        deadline = time.monotonic() + fabric.wr_delay_s
                        while not self.closed and (left := deadline - time.monotonic()) > 0:
                            fabric.lock.wait(left)
                    fabric.lock.wait_for(lambda: self.closed or not self._sq or fabric._budget != 0)
                    if self.closed or not self._sq:
                        return
                    wr = self._sq.popleft()
                    if fabric._budget is not None:
                        fabric._budget -= 1
                    self._complete(wr)
                    fabric.lock.notify_all()
            finally:
                self._worker = None
                fabric.lock.notify_all()

    def _complete(self, wr: ReadWr) -> None:
        """Execute one WR and generate its completion if one is due. Caller holds the lock."""
        fabric = self.backend.fabric
        status = WcStatus.WR_FLUSH_ERR if self.state == ERR else self._execute(wr)
        self._unretired += 1
        if status != WcStatus.SUCCESS:
            self.state = ERR
        if wr.signaled or self.sq_sig_all or status != WcStatus.SUCCESS:
            fabric.completions += 1
            if len(self._cq) >= 2 * self.backend.max_send_wr:
                self._cq_overrun = True
                self.state = ERR
                return
            self._cq.append(
                _Pending(fabric.poll_delay, self._unretired, Completion(wr.wr_id, status))
            )
            self._unretired = 0

    def _fail(self, wr: ReadWr, status: WcStatus, why: str) -> WcStatus:
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
        if remote is None:
            return self._fail(wr, WcStatus.REM_ACCESS_ERR, f"rkey {wr.rkey:#x} is not the peer's")
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
        self.by_lkey: dict[int, MemoryRegion] = {}  # guarded by the fabric lock
        self.by_rkey: dict[int, MemoryRegion] = {}
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
            self.by_lkey.pop(mr.lkey, None)
            self.by_rkey.pop(mr.rkey, None)

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
