"""``VerbsBackend`` over pyverbs (rdma-core's Python bindings), for real RDMA devices.

Imported only when RDMA is asked for or probed (``select.py``); nothing else in the package needs
pyverbs. Debian ships it as ``python3-pyverbs`` for the system Python; a venv built from
``/usr/bin/python3`` with ``--system-site-packages`` sees it.

NOTE: this module is the only code that needs hardware to run; it is kept to straight verbs calls
so that everything else is tested with ``verbs_fake``.

Memory windows are written against pyverbs' API as rdma-core's own tests use it
(``tests/test_mr.py``, ``MWTest``: ``MW(pd, IBV_MW_TYPE_2)``, a ``SendWR`` of opcode
``IBV_WR_BIND_MW`` filled by ``set_bind_wr(mw, MWBindInfo(mr, addr, length, access))`` whose
``rkey`` is the window's new key, and ``IBV_WR_LOCAL_INV`` with the key in ``imm_data``, the
union ``ibv_send_wr.invalidate_rkey`` shares). It needs a device with type-2 windows
(``IBV_DEVICE_MEM_WINDOW_TYPE_2B``: mlx5, rxe); elsewhere ``alloc_mw`` fails and the source
answers RDMA_PIN UNAVAILABLE (the puller moves to TCP).
"""

from __future__ import annotations

import itertools
import random
import threading
from typing import Sequence

import pyverbs.device as d  # noqa: F401 - the import itself is the availability check
import pyverbs.enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.mr import MR, MW, MWBindInfo
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, SendWR

from .verbs import (
    BindWr,
    Completion,
    MemoryRegion,
    MemoryWindow,
    QpInfo,
    QueuePair,
    ReadWr,
    SendWr,
    VerbsBackend,
    VerbsError,
)

PORT_ACTIVE = 4  # IBV_PORT_ACTIVE


def find_active_port(device: str | None = None, port: int | None = None) -> tuple[str, int]:
    """The first device/port in the ACTIVE state. Raises ``VerbsError`` when there is none
    (including when ``get_device_list`` itself fails: no RDMA subsystem in the kernel)."""
    try:
        devices = d.get_device_list()
    except PyverbsError as ex:
        raise VerbsError(f"no RDMA devices: {ex}") from None
    for dev in devices:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        if device and name != device:
            continue
        try:
            with d.Context(name=name) as ctx:
                ports = [port] if port else range(1, ctx.query_device().phys_port_cnt + 1)
                for p in ports:
                    if ctx.query_port(p).state == PORT_ACTIVE:
                        return name, p
        except PyverbsError:
            continue
    raise VerbsError("no RDMA port is ACTIVE" + (f" on {device}" if device else ""))


class PyverbsQueuePair(QueuePair):
    def __init__(self, backend: "PyverbsBackend", sq_sig_all: bool = False) -> None:
        self.backend = backend
        self.sq_sig_all = sq_sig_all
        depth = backend.max_send_wr
        self.cq = CQ(backend.ctx, depth * 2)
        cap = QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        # pyverbs' QPInitAttr defaults to sq_sig_all=1 (every WR completes), which would let a
        # chain's first completion pass for its last: say explicitly which one is meant.
        init = QPInitAttr(
            qp_type=e.IBV_QPT_RC,
            scq=self.cq,
            rcq=self.cq,
            cap=cap,
            sq_sig_all=1 if sq_sig_all else 0,
        )
        self.qp = QP(backend.pd, init)
        self._info = QpInfo(
            qpn=self.qp.qp_num,
            psn=random.getrandbits(24),
            lid=backend.port_attr.lid,
            gid=backend.gid,
            mtu=backend.mtu,
            port=backend.port,
        )
        self._keep: list = []  # WR/SGE objects must outlive the post

    @property
    def info(self) -> QpInfo:
        return self._info

    def connect(self, remote: QpInfo, access: int = e.IBV_ACCESS_REMOTE_READ) -> None:
        b = self.backend
        try:
            attr = QPAttr(port_num=b.port)
            attr.qp_access_flags = int(access)
            attr.pkey_index = 0
            self.qp.to_init(attr)
            attr = QPAttr(port_num=b.port)
            attr.path_mtu = min(b.mtu, remote.mtu)
            attr.dest_qp_num = remote.qpn
            attr.rq_psn = remote.psn
            attr.max_dest_rd_atomic = 16
            attr.min_rnr_timer = 12
            if remote.gid:
                gr = GlobalRoute(dgid=GID(remote.gid), sgid_index=b.gid_index)
                attr.ah_attr = AHAttr(port_num=b.port, is_global=1, gr=gr, dlid=remote.lid)
            else:
                attr.ah_attr = AHAttr(port_num=b.port, dlid=remote.lid)
            self.qp.to_rtr(attr)
            attr.sq_psn = self._info.psn
            attr.timeout = 14
            attr.retry_cnt = 7
            attr.rnr_retry = 7
            attr.max_rd_atomic = 16
            self.qp.to_rts(attr)
        except PyverbsError as ex:
            raise VerbsError(f"QP transition failed: {ex}") from None

    def post_send(self, wrs: Sequence[SendWr]) -> None:
        # Build the list back to front so each WR links to the next (one ibv_post_send).
        nxt = None
        keep: list = []
        for wr in reversed(wrs):
            flags = e.IBV_SEND_SIGNALED if wr.signaled else 0
            kwargs = {"next_wr": nxt} if nxt is not None else {}
            if isinstance(wr, ReadWr):
                sge = SGE(wr.local_addr, wr.length, wr.lkey)
                swr = SendWR(
                    wr_id=wr.wr_id,
                    opcode=e.IBV_WR_RDMA_READ,
                    num_sge=1,
                    sg=[sge],
                    send_flags=flags,
                    **kwargs,
                )
                swr.set_wr_rdma(wr.rkey, wr.remote_addr)
                keep += [sge, swr]
            elif isinstance(wr, BindWr):
                info = MWBindInfo(self.backend.mr_of(wr.mr), wr.addr, wr.length, int(wr.access))
                swr = SendWR(wr_id=wr.wr_id, opcode=e.IBV_WR_BIND_MW, send_flags=flags, **kwargs)
                # The new key is ibv_inc_rkey of the window's allocated one (see MemoryWindow).
                swr.set_bind_wr(self.backend.mw_of(wr.mw), info)
                wr.mw.rkey = swr.rkey
                keep += [info, swr]
            else:
                swr = SendWR(wr_id=wr.wr_id, opcode=e.IBV_WR_LOCAL_INV, send_flags=flags, **kwargs)
                swr.imm_data = wr.rkey  # ibv_send_wr.invalidate_rkey (a union with imm_data)
                keep.append(swr)
            nxt = swr
        try:
            self.qp.post_send(nxt)
        except PyverbsError as ex:
            raise VerbsError(f"ibv_post_send failed: {ex}") from None
        self._keep = keep

    def poll(self, max_entries: int) -> list[Completion]:
        try:
            n, wcs = self.cq.poll(num_entries=max_entries)  # ibv_poll_cq: returns at once
        except PyverbsError as ex:
            raise VerbsError(f"ibv_poll_cq failed: {ex}") from None
        return [Completion(wc.wr_id, wc.status) for wc in wcs[: max(n, 0)]]

    def close(self) -> None:
        self.qp.close()
        self.cq.close()


class PyverbsBackend(VerbsBackend):
    name = "pyverbs"

    def __init__(
        self,
        device: str | None = None,
        port: int | None = None,
        gid_index: int = 0,
        max_send_wr: int = 256,
    ) -> None:
        name, self.port = find_active_port(device, port)
        self.device = name
        self.max_send_wr = max_send_wr
        self.gid_index = gid_index
        self._lock = threading.Lock()
        try:
            self.ctx = d.Context(name=name)
            self.pd = PD(self.ctx)
            self.port_attr = self.ctx.query_port(self.port)
            self.mtu = int(self.port_attr.active_mtu)
            gid = self.ctx.query_gid(port_num=self.port, index=gid_index)
            self.gid = (
                "" if str(gid) in ("", "0000:0000:0000:0000:0000:0000:0000:0000") else str(gid)
            )
        except PyverbsError as ex:
            raise VerbsError(f"cannot open RDMA device {name}: {ex}") from None
        self._mrs: dict[int, MR] = {}
        self._mws: dict[int, MW] = {}
        self._mw_ids = itertools.count(1)

    def register(self, addr: int, length: int, access: int) -> MemoryRegion:
        try:
            mr = MR(self.pd, length, int(access), address=addr)
        except PyverbsError as ex:
            raise VerbsError(f"ibv_reg_mr of {length} bytes failed: {ex}") from None
        with self._lock:
            self._mrs[mr.rkey] = mr
        return MemoryRegion(
            addr=addr, length=length, lkey=mr.lkey, rkey=mr.rkey, access=int(access)
        )

    def deregister(self, region: MemoryRegion) -> None:
        with self._lock:
            mr = self._mrs.get(region.rkey)
        if mr is None:
            return
        try:
            mr.close()  # ibv_dereg_mr: EBUSY while windows are bound over it
        except PyverbsError as ex:
            raise VerbsError(f"ibv_dereg_mr failed: {ex}") from None
        with self._lock:
            self._mrs.pop(region.rkey, None)

    def mr_of(self, region: MemoryRegion) -> MR:
        with self._lock:
            mr = self._mrs.get(region.rkey)
        if mr is None:
            raise VerbsError("the memory region is not registered (deregistered?)")
        return mr

    def alloc_mw(self) -> MemoryWindow:
        try:
            mw = MW(self.pd, e.IBV_MW_TYPE_2)
        except PyverbsError as ex:
            raise VerbsError(f"ibv_alloc_mw(IBV_MW_TYPE_2) failed: {ex}") from None
        handle = next(self._mw_ids)
        with self._lock:
            self._mws[handle] = mw
        return MemoryWindow(handle, mw.rkey)

    def mw_of(self, window: MemoryWindow) -> MW:
        with self._lock:
            mw = self._mws.get(window.handle)
        if mw is None:
            raise VerbsError("the memory window was deallocated")
        return mw

    def dealloc_mw(self, window: MemoryWindow) -> None:
        with self._lock:
            mw = self._mws.pop(window.handle, None)
        if mw is not None:
            try:
                mw.close()  # ibv_dealloc_mw: the rkey is invalid from here on
            except PyverbsError as ex:
                raise VerbsError(f"ibv_dealloc_mw failed: {ex}") from None

    def create_qp(self, sq_sig_all: bool = False) -> PyverbsQueuePair:
        try:
            return PyverbsQueuePair(self, sq_sig_all)
        except PyverbsError as ex:
            raise VerbsError(f"cannot create an RC QP: {ex}") from None

    def close(self) -> None:
        with self._lock:
            mws, self._mws = list(self._mws.values()), {}
            mrs, self._mrs = list(self._mrs.values()), {}
        for mw in mws:  # windows first: a region with windows bound over it stays (EBUSY)
            mw.close()
        for mr in mrs:
            mr.close()
        self.pd.close()
        self.ctx.close()
