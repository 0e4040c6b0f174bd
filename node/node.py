"""The node: one TieredStore per served layout, the event hub, lease ownership and the reaper.

The gRPC servicer (``service.py``) is a thin layer over this object; everything here is plain
Python and testable in-process.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.budget import SharedBudget
from kvstore.errors import (
    CapacityExhausted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    echo,
)
from kvstore.keys import BlockKey, scope_keys, select_keys
from kvstore.layout import KVLayout
from kvstore.shm import ShmBallast, check_shm_room, sweep_orphans
from kvstore.store import StoreConfig, TieredStore
from kvstore.tiers import Tier

from .config import NodeConfig
from .events import EventHub
from .quotas import TenantLimits, TenantQuotas
from .segments import TenantSegments
from .sessions import Sessions

log = logging.getLogger(__name__)
REAP_INTERVAL_S = 0.5
MAX_SALT_BYTES = 1024
MAX_MODEL_NAME_BYTES = 256  # of a layout registered at run time
MIN_PAGE_BYTES = 4096  # of a layout registered at run time


@dataclass(frozen=True, slots=True)
class Selection:
    """A request's blocks resolved against a store: keys as stored (tenant-scoped)."""

    store: TieredStore
    keys: list[BlockKey]  # as stored: scoped to the tenant
    raw: list[BlockKey]  # as the client names them (what replies echo back)


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.node_id = config.node_id or f"{socket.gethostname()}-{id(self) & 0xFFFF:04x}"
        self.hub = EventHub()
        # Names this run: lease ids restart at 1 with the process, so a lease request carries the
        # epoch of the reply that granted it (a restarted node's new leases are not its own).
        self.epoch = secrets.randbits(64) or 1
        self.drained = False  # handed its blocks to its peers (Drain with leave): not again
        self.stores: dict[str, TieredStore] = {}
        # (namespace, lease id) -> (tenant, deadline, session id or b"")
        self._owners: dict[tuple[str, int], tuple[str, float, bytes]] = {}
        self._owners_lock = threading.Lock()
        self._stop = threading.Event()
        self.segments: TenantSegments | None = None
        self.sessions: Sessions | None = None
        limits = TenantLimits(
            lease_share=config.tenant_lease_share,
            max_leases=config.tenant_max_leases,
            max_lease_lifetime_s=config.tenant_lease_lifetime_s,
        )  # NOTE: checked before any shared memory exists
        # With tenants, shared memory is per tenant (node/segments.py): the DRAM pool lives in a
        # private memfd, and no /dev/shm name is ever created.
        private = bool(config.tenant_tokens)
        orphans = sweep_orphans()
        if orphans:
            log.warning(
                "removed %d shared-memory slabs left by dead processes: %s",
                len(orphans),
                ", ".join(orphans),
            )
        # With no --layout, every layout's tier draws on one budget (kvstore/budget.py).
        self.budgets: dict[Tier, SharedBudget] = {}
        self._ballast: ShmBallast | None = None
        self._layouts_lock = threading.Lock()
        self._registrants: dict[str, str] = {}  # namespace -> the tenant that registered it
        self.on_layouts: list[Callable[[], None]] = []  # called after a layout is registered
        try:
            if config.fixed_layouts:
                # NOTE: all layouts' slabs at once, before any exists: one clear message naming
                # --dram instead of a failed reservation halfway (or, with --no-reserve-shm,
                # sparse slabs and a SIGBUS at the first write /dev/shm has no room for).
                slabs = sum(
                    config.pages(layout)[1] * layout.page_bytes for layout in config.start_layouts
                )
            else:
                if config.gpu:
                    raise InvalidArgument(
                        "--gpu needs --layout: the GPU tier is split between the layouts named "
                        "at start, not shared with layouts registered at run time"
                    )
                if config.max_layouts < 1:
                    raise InvalidArgument(f"--max-layouts must be >= 1, got {config.max_layouts}")
                if config.dram <= 0:
                    raise InvalidArgument(f"--dram must be positive, got {config.dram}")
                slabs = config.dram  # what the shared budget lets the slabs hold together
                if not private and config.reserve_shm:
                    # NOTE: the slabs are sparse; this holds their room in /dev/shm instead.
                    check_shm_room(slabs, "--dram")
                    self._ballast = ShmBallast(config.dram)
                self.budgets[Tier.DRAM] = SharedBudget(Tier.DRAM, config.dram, self._ballast)
                if config.ssd:
                    self.budgets[Tier.SSD] = SharedBudget(Tier.SSD, config.ssd)
            if not private and self._ballast is None:
                check_shm_room(slabs, "--dram")
            seen = set()
            for layout in config.start_layouts:
                if layout.namespace in seen:
                    raise InvalidArgument(f"layout {layout.namespace} is configured twice")
                seen.add(layout.namespace)
                self.stores[layout.namespace] = self._open_store(layout)
            self.quotas = TenantQuotas(self.stores, limits)
            if private:
                self.segments = TenantSegments(self.stores)
                _not_dumpable()
            self.sessions = Sessions(self.holders_gone)
        except BaseException:
            self.close()
            raise
        self.hub.attach(list(self.stores.values()))
        self._reaper = threading.Thread(target=self._reap, name="lease-reaper", daemon=True)
        self._reaper.start()

    def _open_store(self, layout: KVLayout) -> TieredStore:
        config = self.config
        gpu, dram, ssd = config.pages(layout)
        if dram <= 0:
            raise InvalidArgument(
                f"--dram {config.dram} bytes is less than one {layout.page_bytes}-byte "
                f"page per layout for {layout.namespace}; give the node more DRAM"
            )
        shared = not config.fixed_layouts
        return TieredStore(
            layout,
            StoreConfig(
                gpu_pages=gpu,
                dram_pages=dram,
                ssd_pages=ssd,
                ssd_dir=config.ssd_dir,
                gpu_policy=config.gpu_policy,
                dram_policy=config.dram_policy,
                ssd_policy=config.ssd_policy,
                promote_on_hit=config.promote_on_hit,
                # NOTE: a shared budget's slabs are sparse (each could hold the whole budget):
                # the room for the budget is checked once, at start.
                reserve_shm=config.reserve_shm and not shared,
                dram_checksums=config.dram_checksums,
                private_dram=bool(config.tenant_tokens),
                ssd_damaged=config.ssd_damaged,
                lease_ttl_s=config.lease_ttl_s,
                quarantine_s=config.write_quarantine_s,
                on_event=self.hub.notify,
                dram_budget=self.budgets.get(Tier.DRAM),
                ssd_budget=self.budgets.get(Tier.SSD),
            ),
        )

    def register_layout(self, layout: KVLayout, tenant: str) -> tuple[TieredStore, bool]:
        """Serve ``layout`` from now on (a node started without --layout); the store, and
        whether it is new. Registering a served layout again is a no-op. The admin may register
        up to ``max_layouts`` in all, a tenant up to half of them."""
        if self.config.fixed_layouts:
            store = self.stores.get(layout.namespace)
            if store is not None:
                return store, False
            raise FailedPrecondition(
                f"this node serves only the layouts it was started with (--layout: "
                f"{', '.join(sorted(self.stores))}), not {layout.namespace}; start it without "
                "--layout to serve the layouts its clients register"
            )
        if len(layout.model.encode()) > MAX_MODEL_NAME_BYTES:
            raise InvalidArgument(
                f"layout.model is {len(layout.model.encode())} bytes; at most "
                f"{MAX_MODEL_NAME_BYTES}"
            )
        if layout.page_bytes < MIN_PAGE_BYTES and layout.namespace not in self.stores:
            # NOTE: per-page bookkeeping is sized for the whole budget up front: tiny pages
            # would cost the node more memory in metadata than the pages hold.
            raise InvalidArgument(
                f"layout {layout.namespace} has {layout.page_bytes}-byte pages; a layout "
                f"registered at run time needs pages of at least {MIN_PAGE_BYTES} bytes (more "
                "tokens per block)"
            )
        with self._layouts_lock:
            store = self.stores.get(layout.namespace)
            if store is not None:
                return store, False
            if len(self.stores) >= self.config.max_layouts:
                raise CapacityExhausted(
                    f"this node serves {len(self.stores)} layouts, its --max-layouts; "
                    f"{layout.namespace} cannot be added (serve it from another node, or raise "
                    "--max-layouts)"
                )
            share = max(1, self.config.max_layouts // 2)
            if tenant and sum(1 for t in self._registrants.values() if t == tenant) >= share:
                raise CapacityExhausted(
                    f"tenant {echo(tenant)} registered {share} layouts on this node, its share "
                    "of --max-layouts"
                )
            store = self._open_store(layout)
            self._registrants[layout.namespace] = tenant
            self.stores[layout.namespace] = store
            self.hub.add(store)
        log.info(
            "serving layout %s (registered by %s; page %d bytes, up to %d DRAM pages)",
            layout.namespace,
            f"tenant {tenant}" if tenant else "the admin",
            layout.page_bytes,
            store.capacity(Tier.DRAM),
        )
        for hook in list(self.on_layouts):
            try:
                hook()
            except Exception:  # noqa: BLE001 - a listener must not fail the registration
                log.exception("a listener of new layouts failed")
        return store, True

    # ---- request resolution ---------------------------------------------------------------

    def store(self, namespace: str) -> TieredStore:
        store = self.stores.get(namespace)
        if store is None:
            served = ", ".join(sorted(self.stores)) or "none"
            raise InvalidArgument(
                f"namespace {echo(namespace)} is not served by this node (it serves:"
                f" {served}); the model layout must match the node's"
            )
        return store

    def select(
        self,
        namespace: str,
        tenant: str,
        salt: bytes = b"",
        keys: Sequence[bytes] = (),
        token_ids: Sequence[int] = (),
        token_bytes: bytes = b"",
        key_bytes: bytes = b"",
    ) -> Selection:
        """Resolve keys or token ids into the keys as stored for ``tenant``."""
        if len(salt) > MAX_SALT_BYTES:
            raise InvalidArgument(f"salt is {len(salt)} bytes; at most {MAX_SALT_BYTES}")
        store = self.store(namespace)
        raw, _ = select_keys(
            namespace,
            salt,
            store.layout.block_tokens,
            self.config.max_keys_per_request,
            keys,
            token_ids,
            token_bytes,
            key_bytes,
        )
        return Selection(store, scope_keys(raw, tenant), raw)

    # ---- lease ownership: a tenant may only touch its own leases ---------------------------

    def own(
        self,
        namespace: str,
        lease_id: int,
        tenant: str,
        deadline: float,
        session: bytes | None = None,
    ) -> None:
        """Record a lease's owner and deadline; ``session``: the caller's session id, whose end
        ends the lease (None: keep the one recorded, as ExtendLease does)."""
        key = (namespace, lease_id)
        with self._owners_lock:
            if session is None:
                session = self._owners.get(key, ("", 0.0, b""))[2]
            self._owners[key] = (tenant, deadline, session)
        if session and self.sessions is not None and not self.sessions.attach(session, key):
            # Its client died while the call was on its way: nobody will write or release it.
            self.holders_gone(0, [key])
            raise FailedPrecondition("the caller's session ended (its process exited)")

    def check_owner(
        self, namespace: str, lease_id: int, tenant: str, epoch: int = 0
    ) -> TieredStore:
        """The store of a lease ``tenant`` took through Allocate / Acquire. Another tenant's lease,
        and the leases a streamed Put / Get holds inside the node, answer exactly as a lease that
        does not exist: NOT_FOUND, revealing nothing. So does a lease of an earlier run of the
        node (``epoch``, from the reply that granted it; 0: not checked)."""
        store = self.store(namespace)
        if epoch and epoch != self.epoch:
            raise NotFound(
                f"lease {lease_id} was granted by an earlier run of this node (it restarted "
                "since): its pages are gone"
            )
        with self._owners_lock:
            owner = self._owners.get((namespace, lease_id))
        if owner is None or owner[0] != tenant:
            raise NotFound(f"lease {lease_id} does not exist (expired or released)")
        return store

    def disown(self, namespace: str, lease_id: int) -> None:
        self.quotas.ended(namespace, lease_id)
        with self._owners_lock:
            owner = self._owners.pop((namespace, lease_id), None)
        if owner is not None and owner[2] and self.sessions is not None:
            self.sessions.detach(owner[2], (namespace, lease_id))
        if self.segments is not None:
            self.segments.drop(namespace, lease_id)

    def holders_gone(self, pid: int, keys: list) -> None:
        """The process holding these leases is gone (``Sessions``): nobody can write into their
        pages any more, so they end now instead of at their deadline plus the quarantine."""
        pages = 0
        for namespace, lease_id in keys:
            store = self.stores.get(namespace)
            if store is not None:
                pages += store.forget_holder(lease_id)
            self.disown(namespace, lease_id)
        if keys:
            log.info(
                "client pid %d is gone: ended its %d leases, %d pages free again",
                pid,
                len(keys),
                pages,
            )

    def _reap(self) -> None:
        """Expire leases of dead or slow clients: their pins drop and their pages are freed."""
        while not self._stop.wait(REAP_INTERVAL_S):
            for budget in self.budgets.values():
                try:
                    budget.rebalance()
                except Exception:  # noqa: BLE001 - keep reaping; log loudly
                    log.exception("rebalancing the %s budget failed", budget.tier.name)
            for store in list(self.stores.values()):
                try:
                    n = store.expire_leases()
                except Exception:  # noqa: BLE001 - keep reaping other stores; log loudly
                    log.exception("lease expiry failed for %s", store.namespace)
                    continue
                if n:
                    log.info("expired %d leases in %s", n, store.namespace)
            now = time.monotonic()
            # NOTE: owners outlive their lease by the quarantine, so a late Commit reaches the
            # store and hears why it failed (quarantined, content not trusted), not NOT_FOUND.
            keep = max([1.0, *(s.quarantine_s for s in list(self.stores.values()))])
            with self._owners_lock:
                stale = [k for k, (_, deadline, _) in self._owners.items() if deadline < now - keep]
            for ns, lease_id in stale:
                self.disown(ns, lease_id)

    # ---- lifetime -------------------------------------------------------------------------------

    def usage(self) -> dict[str, list]:
        return {ns: store.stats().tiers for ns, store in list(self.stores.items())}

    def close(self) -> None:
        """Drop leases, close lmdb, unlink shared memory."""
        self._stop.set()
        self.hub.close()
        if self.sessions is not None:
            self.sessions.close()
        if self.segments is not None:
            self.segments.close()
        for store in list(self.stores.values()):
            store.close()
        if self._ballast is not None:
            self._ballast.close()


def _not_dumpable() -> None:
    """Make /proc/<pid>/fd and /proc/<pid>/mem of the node closed to other processes of its user
    (PR_SET_DUMPABLE 0): a tenant running as the node's user cannot open the node's memfds
    through /proc. Root still can; tenants should run as other users."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
            log.warning("cannot make the node non-dumpable (errno %d)", ctypes.get_errno())
    except (OSError, AttributeError) as e:
        log.warning("cannot make the node non-dumpable: %s", e)
