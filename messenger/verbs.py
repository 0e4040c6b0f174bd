"""The small verbs backend interface the RDMA transport is written against.

Everything the RDMA transport does that is not a verbs call (bootstrap over the TCP control
channel, work-request planning, chaining, completion handling, failures, fallback) lives in
``rdma.py`` in plain Python and runs against this interface. Two backends implement it:
``verbs_pyverbs.PyverbsBackend`` (real hardware, imported lazily) and
``verbs_fake.FakeVerbsBackend`` (copies between in-memory regions on a thread of its own, as
strict as an HCA about signaling, keys, bounds, access flags, memory windows, QP states and
send-queue depth; injects completion errors) for tests on machines without RDMA.

Remote access goes through type-2 memory windows: a region is registered with ``MW_BIND`` only
(its own rkey reads nothing), and a window bound over part of it through a QP (``BindWr``) gives
an rkey valid only for accesses arriving on that QP, inside the bound range, with the bound
access, until it is invalidated (``InvalidateWr``) or deallocated.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Sequence


class Access(enum.IntFlag):
    """ibv_access_flags values."""

    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8
    MW_BIND = 16  # memory windows may be bound over the region


class WcStatus(enum.IntEnum):
    """The ibv_wc_status values the transport distinguishes (others keep their number)."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    MW_BIND_ERR = 6
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13
    GENERAL_ERR = 21


def wc_status_name(status: int) -> str:
    try:
        return WcStatus(status).name
    except ValueError:
        return f"status {status}"


_WC_STATUS_MEANING = {
    WcStatus.LOC_LEN_ERR: "local length error: the WR is longer than the port allows",
    WcStatus.LOC_QP_OP_ERR: "local QP operation error: the WR is malformed",
    WcStatus.LOC_PROT_ERR: (
        "local protection error: the lkey names no local region with LOCAL_WRITE covering the "
        "destination buffer"
    ),
    WcStatus.WR_FLUSH_ERR: "flushed: the QP went to the error state after an earlier failure",
    WcStatus.MW_BIND_ERR: (
        "memory window bind error: the region lacks MW_BIND, the range lies outside it, or the "
        "window is bound already"
    ),
    WcStatus.REM_INV_REQ_ERR: "remote invalid request: the peer refused the operation",
    WcStatus.REM_ACCESS_ERR: (
        "remote access error: the rkey names no region or bound window of the peer, the region, "
        "window or peer's QP lacks REMOTE_READ, the window is bound to another QP, or the range "
        "lies outside it"
    ),
    WcStatus.REM_OP_ERR: "remote operation error: the peer could not complete the READ",
    WcStatus.RETRY_EXC_ERR: (
        "transport retries exceeded: the peer QP is gone, not connected to this QP, or not in "
        "RTR/RTS"
    ),
    WcStatus.RNR_RETRY_EXC_ERR: "receiver-not-ready retries exceeded",
}


def wc_status_text(status: int) -> str:
    """The status name with what it means for an RDMA READ (for error messages)."""
    name = wc_status_name(status)
    try:
        meaning = _WC_STATUS_MEANING.get(WcStatus(status))
    except ValueError:
        meaning = None
    return f"{name} ({meaning})" if meaning else name


class VerbsError(Exception):
    """A verbs call failed (device, registration, QP transition, post)."""


@dataclass(frozen=True, slots=True)
class QpInfo:
    """What a peer needs to connect an RC QP to ours (exchanged over the TCP control channel)."""

    qpn: int
    psn: int
    lid: int
    gid: str  # "" when the port has no GID (IB with LID routing)
    mtu: int  # ibv_mtu enum value (1: 256 ... 5: 4096)
    port: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "QpInfo":
        try:
            return cls(
                qpn=int(d["qpn"]),
                psn=int(d["psn"]) & 0xFFFFFF,
                lid=int(d["lid"]),
                gid=str(d.get("gid", "")),
                mtu=int(d["mtu"]),
                port=int(d.get("port", 1)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad QP info {d!r}: {e}") from None


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    addr: int
    length: int
    lkey: int
    rkey: int
    access: int

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length


@dataclass(frozen=True, slots=True)
class ReadWr:
    """One RDMA READ: ``length`` bytes from the peer's ``remote_addr`` into ``local_addr``."""

    wr_id: int
    local_addr: int
    lkey: int
    remote_addr: int
    rkey: int
    length: int
    signaled: bool


@dataclass(slots=True, eq=False)
class MemoryWindow:
    """A type-2 memory window (``ibv_alloc_mw(pd, IBV_MW_TYPE_2)``) of the backend that made it.

    ``rkey``: the key the last bind posted over it gives it (set by ``post_send``; the peer uses
    it once that bind has completed). A window is bound once, then invalidated and deallocated:
    pyverbs derives a bind's key from the key the window was allocated with, so a second bind
    of one window would hand out the same rkey again."""

    handle: int
    rkey: int


@dataclass(frozen=True, slots=True)
class BindWr:
    """``IBV_WR_BIND_MW``: bind ``mw`` over ``[addr, addr + length)`` of ``mr`` with ``access``,
    for accesses arriving on the QP it is posted on (type 2)."""

    wr_id: int
    mw: MemoryWindow
    mr: MemoryRegion
    addr: int
    length: int
    access: int
    signaled: bool


@dataclass(frozen=True, slots=True)
class InvalidateWr:
    """``IBV_WR_LOCAL_INV`` of a window's rkey: once it completed, the rkey reads nothing."""

    wr_id: int
    rkey: int
    signaled: bool


SendWr = ReadWr | BindWr | InvalidateWr


@dataclass(frozen=True, slots=True)
class Completion:
    wr_id: int
    status: int

    @property
    def ok(self) -> bool:
        return self.status == WcStatus.SUCCESS


class QueuePair(ABC):
    """An RC queue pair with its own completion queue.

    Completion rules (what hardware does, and what the transport relies on):
    - a WR produces a completion only when it is posted with ``signaled`` set, or when the QP was
      created with ``sq_sig_all``; a WR that fails (and every WR flushed after it) always does;
    - completions of one send queue arrive in posting order, so a successful completion proves
      that every WR posted before it on this QP has landed too;
    - a WR occupies a send-queue slot from its post until a completion for it or for a later WR
      is polled; posting more than ``max_send_wr`` unretired WRs fails (ENOMEM).
    """

    sq_sig_all: bool = False  # created with sq_sig_all: every WR completes

    @property
    @abstractmethod
    def info(self) -> QpInfo: ...

    @abstractmethod
    def connect(self, remote: QpInfo, access: int = Access.REMOTE_READ) -> None:
        """RESET -> INIT (``access``: what the peer may do to memory through this QP) -> RTR
        (towards ``remote``) -> RTS."""

    @abstractmethod
    def post_send(self, wrs: Sequence[SendWr]) -> None:
        """Post the WRs as one chained list (one doorbell), in order; a ``BindWr`` sets its
        window's new ``rkey``. Raises ``VerbsError`` when the QP is not in RTS (or the error
        state) or the send queue has no room."""

    def post_reads(self, wrs: Sequence[ReadWr]) -> None:
        self.post_send(wrs)

    @abstractmethod
    def poll(self, max_entries: int) -> list[Completion]:
        """Completions available now; never blocks."""

    @abstractmethod
    def close(self) -> None: ...


class VerbsBackend(ABC):
    """One device port and protection domain."""

    name: str
    max_send_wr: int = 256

    @abstractmethod
    def register(self, addr: int, length: int, access: int) -> MemoryRegion:
        """Register existing memory (no copy, no allocation) as one memory region."""

    @abstractmethod
    def deregister(self, mr: MemoryRegion) -> None:
        """Raises ``VerbsError`` while windows are bound over the region (EBUSY)."""

    @abstractmethod
    def alloc_mw(self) -> MemoryWindow:
        """A type-2 memory window, not bound (its rkey reads nothing). Raises ``VerbsError``
        when the device has none (no type-2 window support)."""

    @abstractmethod
    def dealloc_mw(self, mw: MemoryWindow) -> None:
        """Free the window: after this returns its rkey reads nothing, bound or not."""

    @abstractmethod
    def create_qp(self, sq_sig_all: bool = False) -> QueuePair:
        """An RC QP in RESET with a send queue of ``max_send_wr``. ``sq_sig_all``: every WR
        completes, whatever its ``signaled`` flag (the transport never asks for it)."""

    @abstractmethod
    def close(self) -> None: ...
