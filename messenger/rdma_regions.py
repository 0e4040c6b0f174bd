"""Memory registrations per mapping: the shared-memory segment a node's pages live in.

A node that restarts serves its pool from a new segment while leases of its earlier run (and
their views) still point into the old one (``clients/node_client.py``, ``_current_slab``). So
both RDMA ends register the mapping the pages at hand actually live in, not a region looked up
once: each namespace has a *current* mapping (the one used last), and a mapping stays registered
while it is some namespace's current one or while a pin (source) or a fetch (destination) uses
it; once neither, it is deregistered, and its array let go (a registration holds the array, so
the mapping cannot be unmapped under the HCA).
"""

from __future__ import annotations

import bisect
import logging
import threading
from dataclasses import dataclass, field

import numpy as np

from .verbs import MemoryRegion, VerbsBackend, VerbsError

log = logging.getLogger(__name__)


def buffer_address(buf) -> int:
    """Address of the first byte of a buffer (numpy array or memoryview)."""
    if isinstance(buf, np.ndarray):
        return buf.ctypes.data
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


@dataclass(eq=False)
class _Registration:
    mr: MemoryRegion
    array: np.ndarray  # held: the mapping stays while the HCA may touch it
    users: int = 0
    current_for: set[str] = field(default_factory=set)
    kept: bool = False  # ``keep``: until ``close``

    @property
    def unused(self) -> bool:
        return not self.users and not self.current_for and not self.kept


class Registrations:
    """One registration with ``access`` per mapping; thread-safe."""

    def __init__(self, backend: VerbsBackend, access: int) -> None:
        self.backend = backend
        self.access = access
        self._lock = threading.Lock()
        self._live: dict[int, _Registration] = {}  # by lkey: every one not deregistered yet
        self._index: dict[int, _Registration] = {}  # by address: the ones lookups find
        self._addrs: list[int] = []  # the index's addresses, sorted
        self._current: dict[str, _Registration] = {}
        self._closed = False

    def keep(self, region: np.ndarray) -> MemoryRegion:
        """Register ``region`` until ``close``, whatever the namespaces' current mappings."""
        reg = self._take(region, None, hold=False)
        with self._lock:
            reg.kept = True
        return reg.mr

    def register(self, region: np.ndarray, namespace: str) -> MemoryRegion:
        """Make ``region`` ``namespace``'s current mapping: registered (once), the previous one
        retired (deregistered once unused)."""
        return self._take(region, namespace, hold=False).mr

    def hold_region(self, region: np.ndarray, namespace: str) -> MemoryRegion:
        """Make ``region`` ``namespace``'s current mapping (registered once, the previous one
        retired), and hold its registration until ``release``."""
        return self._take(region, namespace, hold=True).mr

    def hold(self, spans: list[tuple[int, int]]) -> list[MemoryRegion | None]:
        """The registration covering each (address, length), held once per span until
        ``release``; None where no registered mapping covers it."""
        out: list[MemoryRegion | None] = []
        with self._lock:
            for addr, length in spans:
                reg = self._lookup(addr, length)
                if reg is not None:
                    reg.users += 1
                out.append(reg.mr if reg is not None else None)
        return out

    def release(self, mrs: list[MemoryRegion | None]) -> None:
        """Give back what ``hold`` / ``hold_region`` returned; deregisters the mappings left
        unused and current for no namespace."""
        gone = []
        with self._lock:
            for mr in mrs:
                reg = self._live.get(mr.lkey) if mr is not None else None
                if reg is None:
                    continue
                reg.users -= 1
                if reg.unused:
                    gone.append(self._forget(reg))
        self._deregister(gone)

    def close(self) -> None:
        """No mapping is current or kept any more: the unused ones go now, the rest when their
        last user releases them."""
        with self._lock:
            self._closed = True
            self._current.clear()
            gone = []
            for reg in list(self._live.values()):
                reg.current_for.clear()
                reg.kept = False
                if reg.unused:
                    gone.append(self._forget(reg))
        self._deregister(gone)

    def registered(self) -> list[MemoryRegion]:
        """Every registration not deregistered yet (for tests and stats)."""
        with self._lock:
            return [r.mr for r in self._live.values()]

    # ---- internals (the lock is held where a method says so) ------------------------------------

    def _take(self, region: np.ndarray, namespace: str | None, hold: bool) -> _Registration:
        addr, nbytes = buffer_address(region), region.nbytes
        with self._lock:
            reg = self._lookup(addr, nbytes)
        spare = None
        if reg is None:  # registering is slow (the kernel pins the pages): not under the lock
            spare = _Registration(self.backend.register(addr, nbytes, self.access), region)
        gone = []
        with self._lock:
            reg = self._lookup(addr, nbytes)
            if reg is None:
                assert spare is not None
                reg, spare = spare, None
                self._add(reg, gone)
            if hold:
                reg.users += 1
            if namespace is not None and not self._closed:
                old = self._current.get(namespace)
                if old is not reg:
                    self._current[namespace] = reg
                    reg.current_for.add(namespace)
                    if old is not None:
                        old.current_for.discard(namespace)
                        if old.unused:
                            gone.append(self._forget(old))
        if spare is not None:  # another thread registered the mapping meanwhile
            gone.append(spare)
        self._deregister(gone)
        return reg

    def _lookup(self, addr: int, length: int) -> _Registration | None:
        """Lock held."""
        i = bisect.bisect_right(self._addrs, addr) - 1
        if i < 0:
            return None
        reg = self._index[self._addrs[i]]
        return reg if reg.mr.contains(addr, length) else None

    def _add(self, reg: _Registration, gone: list[_Registration]) -> None:
        """Lock held. A shorter registration at the same address leaves the index (it stays
        registered while used)."""
        addr = reg.mr.addr
        self._live[reg.mr.lkey] = reg
        old = self._index.get(addr)
        if old is None:
            bisect.insort(self._addrs, addr)
        self._index[addr] = reg
        if old is not None and old.unused:
            gone.append(self._forget(old))

    def _forget(self, reg: _Registration) -> _Registration:
        """Lock held."""
        self._live.pop(reg.mr.lkey, None)
        addr = reg.mr.addr
        if self._index.get(addr) is reg:
            del self._index[addr]
            self._addrs.remove(addr)
        for ns in list(reg.current_for):
            if self._current.get(ns) is reg:
                del self._current[ns]
        reg.current_for.clear()
        return reg

    def _deregister(self, regs: list[_Registration]) -> None:
        for reg in regs:
            try:
                self.backend.deregister(reg.mr)
            except VerbsError as e:  # the device keeps it until the backend closes
                log.warning("deregistering %d bytes of RDMA memory failed: %s", reg.mr.length, e)
