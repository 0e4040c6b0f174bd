"""The node's lease RPCs, mixed into ``NodeServicer``: same-host writes (Allocate, then Commit or
Abort), same-host reads (Acquire, then Release), ExtendLease, and an engine step's calls merged into
one round trip each: AcquireAllocate (an Acquire, then an Allocate) and CommitRelease (a Commit,
then a Release)."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import numpy as np

from kvstore.errors import CapacityExhausted, InvalidArgument, KVStoreError, NotFound
from kvstore.leases import check_hold
from kvstore.store import ReadLease, TieredStore
from kvstore.tiers import Tier
from proto import common_pb2 as cpb
from proto import node_pb2 as pb
from rpc.server import Auth
from rpc.status import observed
from rpc.wire import tier_to_pb

from .node import Node, Selection

log = logging.getLogger("node.service")
MAX_LEASE_TTL_S = 3600.0  # a lease pins pages; a client cannot pin them for longer
MAX_SESSION_BYTES = 64


@dataclass(frozen=True, slots=True)
class _Ask:
    """One Acquire's or Allocate's arguments, checked: nothing is leased yet."""

    sel: Selection
    tenant: str
    session: bytes
    ttl: float


class LeaseRpcs:
    node: Node
    auth: Auth

    def _select(self, sel: cpb.BlockSelector, context) -> tuple[Selection, str]:
        """A request's blocks as the caller's tenant stores them (every RPC that names blocks)."""
        tenant = self.auth.tenant(context)
        return self.node.select(
            sel.namespace,
            tenant,
            sel.salt,
            sel.keys,
            sel.token_ids,
            sel.token_bytes,
            sel.key_bytes,
        ), tenant

    # ---- arguments ------------------------------------------------------------------------------

    @staticmethod
    def _ttl(ttl_s: float) -> float | None:
        # NOTE: NaN compares false with everything: test for the good range, not the bad one.
        if not 0 <= ttl_s <= MAX_LEASE_TTL_S:
            raise InvalidArgument(
                f"ttl_s must be within [0, {MAX_LEASE_TTL_S:g}] seconds (0: the server's "
                f"default), got {ttl_s}"
            )
        return ttl_s or None

    @staticmethod
    def _session(raw: bytes) -> bytes:
        """AllocateRequest / AcquireRequest.session: an id the session socket handed out."""
        if len(raw) > MAX_SESSION_BYTES:
            raise InvalidArgument(
                f"session must be an id from the node's session socket ({MAX_SESSION_BYTES} "
                f"bytes at most), got {len(raw)} bytes"
            )
        return raw

    def _lease_ttl(
        self, store: TieredStore, tenant: str, ttl_s: float, lease_id: int | None = None
    ) -> float:
        """The lease time asked for (0: the node's default), within a tenant's lease lifetime."""
        ttl = self._ttl(ttl_s) or store.config.lease_ttl_s
        return self.node.quotas.ttl(store.namespace, lease_id, tenant, ttl)

    def _ask(self, request, context) -> _Ask:
        """An AllocateRequest's or AcquireRequest's blocks, session and lease time."""
        sel, tenant = self._select(request.blocks, context)
        session = self._session(request.session)
        return _Ask(sel, tenant, session, self._lease_ttl(sel.store, tenant, request.ttl_s))

    def _segment_name(self, store: TieredStore) -> str:
        """What a lease's offsets point into: the /dev/shm slab's name, or with tenants the
        name of this node process's segment socket (a tenant's memfd has no name of its own);
        either way a client holding a restarted node's old mapping sees the change."""
        if self.node.segments is not None:
            return self.node.segments.socket_name
        return store.shm_name or ""

    # ---- writes ---------------------------------------------------------------------------------

    @observed
    def Allocate(self, request, context):
        return self._allocate(self._ask(request, context), chained=not request.unchained)

    def _allocate(self, ask: _Ask, chained: bool = True) -> pb.AllocateReply:
        sel, tenant, store = ask.sel, ask.tenant, ask.sel.store
        quotas = self.node.quotas
        with quotas.reserve(tenant, store.namespace, len(sel.keys)) as held:
            quotas.make_room(store, tenant, len(sel.keys))
            lease = store.allocate(sel.keys, ask.ttl, chained=chained)
            held.bind(lease.lease_id, len(lease.to_write), [lease.keys[i] for i in lease.to_write])
        self.node.own(store.namespace, lease.lease_id, tenant, lease.expires_at, ask.session)
        if self.node.segments is not None:  # written in the tenant's segment, copied at Commit
            self.node.segments.hold(store.namespace, lease.lease_id, tenant, lease.slots)
        page = store.layout.page_bytes
        return pb.AllocateReply(
            lease_id=lease.lease_id,
            shm_name=self._segment_name(store),
            page_bytes=page,
            offsets=[s * page if s >= 0 else -1 for s in lease.slots],
            ttl_s=lease.expires_at - time.monotonic(),
            keys=sel.raw,
            node_epoch=self.node.epoch,
        )

    def _end_lease(self, request, context, end):
        """Commit / abort / release a lease the caller's tenant owns; ``end(store, lease_id)``."""
        store = self.node.check_owner(
            request.namespace, request.lease_id, self.auth.tenant(context), request.node_epoch
        )
        result = end(store, request.lease_id)
        self.node.disown(request.namespace, request.lease_id)
        return result

    @staticmethod
    def _checksums(raw: bytes) -> np.ndarray | None:
        """LeaseRequest.checksums: packed little-endian uint64, one per key of the lease."""
        if not raw:
            return None
        if len(raw) % 8:
            raise InvalidArgument(
                f"checksums must be packed little-endian uint64 (8 bytes per key of the lease), "
                f"got {len(raw)} bytes"
            )
        return np.frombuffer(raw, dtype="<u8")

    @observed
    def Commit(self, request, context):
        return self._commit(request, context)

    def _commit(self, request, context) -> pb.CommitReply:
        segs = self.node.segments
        sums = self._checksums(request.checksums)
        hold_s = check_hold(request.hold_s)
        tenant = self.auth.tenant(context)

        def commit(store: TieredStore, lease_id: int):
            if segs is not None:
                try:
                    segs.fill(store, lease_id)  # the tenant's pages into the store's
                except BaseException:
                    try:
                        store.abort(lease_id)
                    except KVStoreError:
                        pass  # expired already
                    raise
            with contextlib.ExitStack() as stack:
                held = None
                if hold_s:
                    try:  # the pin is a read lease of the tenant's, within its share
                        held = stack.enter_context(
                            self.node.quotas.reserve(tenant, store.namespace, 0)
                        )
                    except CapacityExhausted as e:
                        log.info("commit without its hold: %s", e)
                # Written by the client or by fill; a length mismatch leaves the lease as it was.
                result = store.commit(
                    lease_id,
                    written_in_place=True,
                    checksums=sums,
                    hold_s=hold_s if held is not None else 0.0,
                )
                if result.hold is not None:
                    self._hold(store, held, result.hold, tenant)
            self.node.quotas.committed(store.namespace, lease_id)
            return result

        res = self._end_lease(request, context, commit)
        return pb.CommitReply(stored=res.stored, duplicates=res.duplicates)

    def _hold(self, store: TieredStore, held, lease: ReadLease, tenant: str) -> None:
        """Count a commit's pin against its tenant's share like any read lease; over the share
        there is no pin (the commit stands: the pin only spares its reader a miss)."""
        try:
            self._bind_read(store, held, lease)
        except CapacityExhausted as e:
            log.info("commit's hold of %d pages not kept: %s", lease.found, e)
            return
        # no session: nobody's exit ends it; it lapses at its deadline (the node's reaper)
        self.node.own(store.namespace, lease.lease_id, tenant, lease.expires_at)

    @observed
    def Abort(self, request, context):
        self._end_lease(request, context, TieredStore.abort)
        return pb.Empty()

    # ---- reads ----------------------------------------------------------------------------------

    @observed
    def Acquire(self, request, context):
        return self._acquire(self._ask(request, context), request.prefix_only)

    def _acquire(self, ask: _Ask, prefix_only: bool) -> pb.AcquireReply:
        sel, tenant, store, keys = ask.sel, ask.tenant, ask.sel.store, ask.sel.keys
        if prefix_only:
            keys = self._prefix(store, keys)
        n = len(keys)
        with self.node.quotas.reserve(tenant, store.namespace, 0) as held:
            lease = store.acquire(keys, ask.ttl, into=Tier.DRAM)
            self._bind_read(store, held, lease)
        self.node.own(store.namespace, lease.lease_id, tenant, lease.expires_at, ask.session)
        offsets = self._offsets(store, lease)
        tiers = [tier_to_pb(t) for t in lease.tiers]
        if self.node.segments is not None:
            self._stage_reads(store, lease, tenant, offsets, tiers)
        return pb.AcquireReply(
            lease_id=lease.lease_id,
            shm_name=self._segment_name(store),
            page_bytes=store.layout.page_bytes,
            offsets=offsets,
            tiers=tiers,
            ttl_s=lease.expires_at - time.monotonic(),
            keys=sel.raw[:n],
            checksums=store.checksums(lease),
            node_epoch=self.node.epoch,
        )

    @staticmethod
    def _prefix(store: TieredStore, keys: list) -> list:
        present = store.contains(keys)
        n = present.index(False) if False in present else len(keys)
        return keys[:n]

    def _offsets(self, store: TieredStore, lease: ReadLease) -> list[int]:
        pb_ = store.layout.page_bytes
        return [
            s * pb_ if s >= 0 and t is Tier.DRAM else -1 for s, t in zip(lease.slots, lease.tiers)
        ]

    def _stage_reads(
        self, store: TieredStore, lease: ReadLease, tenant: str, offsets: list, tiers: list
    ) -> None:
        """Copy a read lease's DRAM pages into the tenant's segment (checking their checksums: a
        page that fails is dropped and reported missing)."""
        segs = self.node.segments
        assert segs is not None
        page = store.layout.page_bytes
        slots = [off // page if off >= 0 else -1 for off in offsets]
        segs.hold(store.namespace, lease.lease_id, tenant, slots)
        for i, slot in enumerate(slots):
            if slot >= 0 and not store.copy_out(lease, i, segs.page(store.namespace, tenant, slot)):
                log.warning("dropped a corrupt DRAM page of %s on Acquire", store.namespace)
                offsets[i], tiers[i] = -1, cpb.TIER_UNSPECIFIED

    @staticmethod
    def _bind_read(store: TieredStore, held, lease: ReadLease) -> None:
        """Count a read lease's pins against its tenant's share; over it, the lease ends."""
        try:
            held.bind(lease.lease_id, lease.found)
        except CapacityExhausted:
            store.release(lease.lease_id)
            raise

    @observed
    def Release(self, request, context):
        self._end_lease(request, context, TieredStore.release)
        return pb.Empty()

    # ---- both -----------------------------------------------------------------------------------

    @observed
    def ExtendLease(self, request, context):
        tenant = self.auth.tenant(context)
        store = self.node.check_owner(
            request.namespace, request.lease_id, tenant, request.node_epoch
        )
        ttl = self._lease_ttl(store, tenant, request.ttl_s, request.lease_id)
        deadline = store.extend(request.lease_id, ttl)
        self.node.own(request.namespace, request.lease_id, tenant, deadline)
        return pb.ExtendLeaseReply(ttl_s=deadline - time.monotonic())

    @observed
    def AcquireAllocate(self, request, context):
        if not request.HasField("acquire") or not request.HasField("allocate"):
            raise InvalidArgument(
                "AcquireAllocate takes both halves, acquire and allocate (for one of them, "
                "call Acquire or Allocate)"
            )
        # Both halves' arguments are checked before anything is leased.
        load = self._ask(request.acquire, context)
        save = self._ask(request.allocate, context)
        read = self._acquire(load, request.acquire.prefix_only)
        try:
            missing = len(read.offsets) < len(load.sel.keys) or min(read.offsets, default=0) < 0
            if request.allocate_if_loaded and missing:
                return pb.AcquireAllocateReply(acquire=read)
            saved = self._allocate(save, chained=not request.allocate.unchained)
            return pb.AcquireAllocateReply(acquire=read, allocate=saved)
        except BaseException:
            # The Allocate failed: the call fails as a whole, with nothing leased.
            self._drop_read(load.sel.store, read.lease_id)
            raise

    def _drop_read(self, store: TieredStore, lease_id: int) -> None:
        try:
            store.release(lease_id)
        except KVStoreError:
            pass  # ended already (its holder's session ended)
        self.node.disown(store.namespace, lease_id)

    @observed
    def CommitRelease(self, request, context):
        if not request.HasField("commit") or not request.HasField("release"):
            raise InvalidArgument(
                "CommitRelease takes both halves, commit and release (for one of them, call "
                "Commit or Release)"
            )
        self.node.store(request.release.namespace)  # INVALID_ARGUMENT before anything ends
        try:
            reply = self._commit(request.commit, context)
        finally:  # the read lease ends whatever the commit's outcome
            released = self._release_held(request.release, context)
        return pb.CommitReleaseReply(commit=reply, released=released)

    def _release_held(self, request, context) -> bool:
        """Release a read lease; False when it had ended already (as a Release's NOT_FOUND)."""
        try:
            self._end_lease(request, context, TieredStore.release)
        except NotFound:
            return False
        return True
