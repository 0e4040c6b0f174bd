"""An in-process stand-in for RDMA hardware: the ``VerbsBackend`` the RDMA transport is tested on.

A ``FakeFabric`` plays the network: every ``FakeVerbsBackend`` attached to it (one per simulated
node, all in one process) registers memory regions there, and a READ posted on a connected QP
copies bytes from the peer's region into the local one, after the checks a real HCA makes:
the remote rkey exists, belongs to the connected peer, grants REMOTE_READ and covers the range;
the local lkey is ours, grants LOCAL_WRITE and covers the range; the QP is in RTS. A failed check
completes the WR with the matching error status, puts the QP into the error state and flushes
every later WR (``WR_FLUSH_ERR``), as RC QPs do.

Test hooks: ``fail_reads(n, status)`` fails the next ``n`` READs; ``corrupt_reads(n)`` flips a
byte in what the next ``n`` READs deliver; ``poll_delay`` makes each
completion visible only after that many empty polls (exercises non-blocking polling).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections import deque
from dataclasses import dataclass
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


@dataclass
class _Mr:
    mr: MemoryRegion
    owner: "FakeVerbsBackend"


class FakeFabric:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._keys = itertools.count(0x1000)
        self._qpns = itertools.count(0x100)
        self._lids = itertools.count(1)
        self.mrs: dict[int, _Mr] = {}  # rkey (== lkey here) -> region
        self.qps: dict[int, "FakeQueuePair"] = {}
        self._failures: deque[int] = deque()
        self._corruptions = 0
        self.poll_delay = 0
        self.reads_posted = 0
        self.signaled_posted = 0
        self.chains_posted = 0
        self.bytes_read = 0

    def fail_reads(self, n: int, status: WcStatus = WcStatus.REM_ACCESS_ERR) -> None:
        with self.lock:
            self._failures.extend([status] * n)

    def corrupt_reads(self, n: int) -> None:
        """Flip one byte of what the next ``n`` READs deliver (a bad link; completions succeed)."""
        with self.lock:
            self._corruptions += n

    def next_key(self) -> int:
        return next(self._keys)

    def next_qpn(self) -> int:
        return next(self._qpns)

    def next_lid(self) -> int:
        return next(self._lids)

    def take_failure(self) -> int | None:
        return self._failures.popleft() if self._failures else None


class FakeQueuePair(QueuePair):
    def __init__(self, backend: "FakeVerbsBackend") -> None:
        self.backend = backend
        fabric = backend.fabric
        self._info = QpInfo(
            qpn=fabric.next_qpn(), psn=0x1234, lid=backend.lid, gid=f"fe80::{backend.lid:x}", mtu=5
        )
        self.state = "INIT"
        self.remote: QpInfo | None = None
        # (polls left before visible, WRs this completion retires from the send queue, wc)
        self._cq: deque[list] = deque()
        self._outstanding = 0  # WRs occupying the send queue (retired when polled)
        self._unretired = 0  # WRs posted since the last completion was generated
        with fabric.lock:
            fabric.qps[self._info.qpn] = self

    @property
    def info(self) -> QpInfo:
        return self._info

    def connect(self, remote: QpInfo, access: int = Access.REMOTE_READ) -> None:
        fabric = self.backend.fabric
        with fabric.lock:
            peer = fabric.qps.get(remote.qpn)
        if peer is None or peer.info.lid != remote.lid or peer.info.psn != remote.psn:
            raise VerbsError(f"modify QP to RTR failed: no QP {remote.qpn:#x} at LID {remote.lid}")
        if remote.mtu not in (1, 2, 3, 4, 5):
            raise VerbsError(f"modify QP to RTR failed: invalid MTU {remote.mtu}")
        self.remote = remote
        self.state = "RTS"

    def post_reads(self, wrs: Sequence[ReadWr]) -> None:
        if self.state not in ("RTS", "ERR"):
            raise VerbsError(f"post_send on a QP in state {self.state}")
        if self._outstanding + len(wrs) > self.backend.max_send_wr:
            raise VerbsError(
                f"send queue full: {self._outstanding} outstanding + {len(wrs)} "
                f"> max_send_wr {self.backend.max_send_wr}"
            )
        fabric = self.backend.fabric
        with fabric.lock:
            fabric.chains_posted += 1
            for wr in wrs:
                fabric.reads_posted += 1
                fabric.signaled_posted += bool(wr.signaled)
                self._outstanding += 1
                self._unretired += 1
                status = WcStatus.WR_FLUSH_ERR if self.state == "ERR" else self._execute(wr)
                if status != WcStatus.SUCCESS:
                    self.state = "ERR"
                if wr.signaled or status != WcStatus.SUCCESS:
                    self._cq.append(
                        [fabric.poll_delay, self._unretired, Completion(wr.wr_id, int(status))]
                    )
                    self._unretired = 0

    def _execute(self, wr: ReadWr) -> WcStatus:
        """Caller holds the fabric lock."""
        fabric = self.backend.fabric
        injected = fabric.take_failure()
        if injected is not None:
            return WcStatus(injected)
        local = fabric.mrs.get(wr.lkey)
        if (
            local is None
            or local.owner is not self.backend
            or not local.mr.access & Access.LOCAL_WRITE
            or not local.mr.contains(wr.local_addr, wr.length)
        ):
            return WcStatus.LOC_PROT_ERR
        remote = fabric.mrs.get(wr.rkey)
        peer = fabric.qps.get(self.remote.qpn) if self.remote else None
        if (
            remote is None
            or peer is None
            or remote.owner is not peer.backend
            or not remote.mr.access & Access.REMOTE_READ
            or not remote.mr.contains(wr.remote_addr, wr.length)
        ):
            return WcStatus.REM_ACCESS_ERR
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
            while self._cq and len(out) < max_entries:
                entry = self._cq[0]
                if entry[0] > 0:
                    entry[0] -= 1
                    break
                self._cq.popleft()
                self._outstanding -= entry[1]
                out.append(entry[2])
        return out

    def close(self) -> None:
        with self.backend.fabric.lock:
            self.backend.fabric.qps.pop(self._info.qpn, None)
        self.state = "RESET"


class FakeVerbsBackend(VerbsBackend):
    name = "fake"

    def __init__(self, fabric: FakeFabric, max_send_wr: int = 64) -> None:
        self.fabric = fabric
        self.lid = fabric.next_lid()
        self.max_send_wr = max_send_wr
        self.registrations = 0

    def register(self, addr: int, length: int, access: int) -> MemoryRegion:
        if addr <= 0 or length <= 0:
            raise VerbsError(f"ibv_reg_mr failed: bad range addr={addr:#x} length={length}")
        key = self.fabric.next_key()
        mr = MemoryRegion(addr=addr, length=length, lkey=key, rkey=key, access=int(access))
        with self.fabric.lock:
            self.fabric.mrs[key] = _Mr(mr, self)
        self.registrations += 1
        return mr

    def deregister(self, mr: MemoryRegion) -> None:
        with self.fabric.lock:
            self.fabric.mrs.pop(mr.rkey, None)

    def create_qp(self) -> FakeQueuePair:
        return FakeQueuePair(self)

    def close(self) -> None:
        with self.fabric.lock:
            for key in [k for k, m in self.fabric.mrs.items() if m.owner is self]:
                del self.fabric.mrs[key]
