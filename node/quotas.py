"""Fair shares of a node between tenants: what one tenant may hold, and whose blocks go first.

Every tenant's pages share one DRAM pool per namespace under one eviction policy (node/segments.py
says why). Without bounds, one tenant could lease the whole pool with hour-long leases extended
forever and never committed (every other tenant's writes then fail and its blocks are evicted),
or fill it with committed blocks that push everyone else's out. So, per tenant (the admin, tenant
"", is the operator's own messengers and tools and is not limited):

- ``lease_share``: the pages its live leases hold (pages leased to write, blocks pinned to read,
  and the pages of its open Put / Get streams) stay within this share of the namespace's DRAM
  pool; a lease asking for more is refused with RESOURCE_EXHAUSTED (a write counted on the keys
  asked for, before the store evicts anything for it; a read on the blocks it found);
- ``max_leases``: live leases at once (each costs the node bookkeeping until it ends);
- ``max_lease_lifetime_s``: a lease lives at most this long from its grant, extensions included;
- under pressure, room for a tenant's write is made from the blocks of the tenant furthest over
  an even share of the pool first (its oldest blocks, which are dropped), and only then by the
  store's own eviction policy.

Streams per tenant are capped by the servicer's ``StreamGate`` (``--max-streams-per-tenant``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from kvstore.errors import CapacityExhausted, FailedPrecondition, InvalidArgument, echo
from kvstore.store import TieredStore
from kvstore.tiers import Tier

ADMIN = ""


@dataclass(frozen=True, kw_only=True)
class TenantLimits:
    lease_share: float = 0.5
    max_leases: int = 1024
    max_lease_lifetime_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 < self.lease_share <= 1:
            raise InvalidArgument(
                f"--tenant-lease-share must be in (0, 1], got {self.lease_share:g}"
            )
        if self.max_leases < 1:
            raise InvalidArgument(f"--tenant-max-leases must be >= 1, got {self.max_leases}")
        if not 0 < self.max_lease_lifetime_s < float("inf"):
            raise InvalidArgument(
                "--tenant-lease-lifetime must be finite seconds > 0, got "
                f"{self.max_lease_lifetime_s:g}"
            )


@dataclass(slots=True)
class _Held:
    tenant: str
    namespace: str
    pages: int
    born: float
    writes: list[bytes]  # a write lease's keys to write (as stored), for ``committed``


@dataclass
class TenantUse:
    """One tenant's use of the node (``kvcache status``)."""

    tenant: str
    leases: int = 0
    leased_pages: int = 0  # pages its leases and streams hold, all namespaces
    stored_blocks: int = 0  # blocks it wrote that the node still holds (approximately)
    streams: int = 0


@dataclass
class _Reservation:
    quotas: "TenantQuotas"
    tenant: str
    namespace: str
    pages: int
    bound: bool = False

    def bind(self, lease_id: int, pages: int, writes: Sequence[bytes] = ()) -> None:
        """The lease was granted with ``pages`` pages; ``writes``: a write lease's keys to be
        written. More pages than reserved (a read reserves none: it counts what it found) are
        checked against the share now: CapacityExhausted, and the caller ends the lease."""
        self.quotas._bind(self, lease_id, pages, writes)
        self.bound = True


@dataclass
class _Blocks:
    """The keys a tenant wrote into one namespace, oldest first (some may be gone since)."""

    keys: OrderedDict[bytes, None] = field(default_factory=OrderedDict)


class TenantQuotas:
    def __init__(self, stores: dict[str, TieredStore], limits: TenantLimits) -> None:
        self._stores = stores
        self.limits = limits
        self._lock = threading.Lock()
        self._held: dict[tuple[str, int], _Held] = {}
        self._pages: dict[tuple[str, str], int] = {}  # (tenant, namespace) -> pages held
        self._count: dict[str, int] = {}  # tenant -> live leases (streams included)
        self._blocks: dict[tuple[str, str], _Blocks] = {}  # (namespace, tenant)

    # ---- leases ---------------------------------------------------------------------------

    def _limit(self, namespace: str) -> int:
        return max(1, int(self.limits.lease_share * self._stores[namespace].capacity(Tier.DRAM)))

    @contextmanager
    def reserve(self, tenant: str, namespace: str, pages: int) -> Iterator[_Reservation]:
        """Room for a lease of at most ``pages`` pages: ``bind`` it to the lease granted, or the
        reservation ends with the block. CapacityExhausted when over the tenant's share."""
        r = _Reservation(self, tenant, namespace, pages)
        if tenant != ADMIN:
            with self._lock:
                used = self._pages.get((tenant, namespace), 0)
                limit = self._limit(namespace)
                count = self._count.get(tenant, 0)
                if count >= self.limits.max_leases:
                    raise CapacityExhausted(
                        f"tenant {echo(tenant)} holds {count} leases, the most one tenant may "
                        "(--tenant-max-leases): commit, abort or release some first"
                    )
                if used + pages > limit:
                    raise self._over(tenant, namespace, used, pages, limit)
                self._pages[(tenant, namespace)] = used + pages
                self._count[tenant] = count + 1
        try:
            yield r
        finally:
            if not r.bound:
                self._unreserve(tenant, namespace, pages)

    def _over(
        self, tenant: str, namespace: str, used: int, pages: int, limit: int
    ) -> CapacityExhausted:
        return CapacityExhausted(
            f"tenant {echo(tenant)} holds {used} pages of {echo(namespace)} under leases; "
            f"{pages} more would pass its share of {limit} of the "
            f"{self._stores[namespace].capacity(Tier.DRAM)} DRAM pages (--tenant-lease-share): "
            "commit, abort or release some first"
        )

    def _bind(self, r: _Reservation, lease_id: int, pages: int, writes: Sequence[bytes]) -> None:
        with self._lock:
            if r.tenant != ADMIN and pages > r.pages:  # checked now: a read's pages found
                used = self._pages.get((r.tenant, r.namespace), 0)
                limit = self._limit(r.namespace)
                if used + pages - r.pages > limit:
                    raise self._over(r.tenant, r.namespace, used - r.pages, pages, limit)
            self._held[(r.namespace, lease_id)] = _Held(
                r.tenant, r.namespace, pages, time.monotonic(), [bytes(k) for k in writes]
            )
            if r.tenant != ADMIN:
                key = (r.tenant, r.namespace)
                self._pages[key] = self._pages.get(key, 0) - r.pages + pages

    def _unreserve(self, tenant: str, namespace: str, pages: int) -> None:
        if tenant == ADMIN:
            return
        with self._lock:
            key = (tenant, namespace)
            left = self._pages.get(key, 0) - pages
            if left > 0:
                self._pages[key] = left
            else:
                self._pages.pop(key, None)
            n = self._count.get(tenant, 0) - 1
            if n > 0:
                self._count[tenant] = n
            else:
                self._count.pop(tenant, None)

    def committed(self, namespace: str, lease_id: int) -> None:
        """A write lease was committed: its keys are its tenant's blocks now."""
        with self._lock:
            held = self._held.get((namespace, lease_id))
        if held is not None:
            self.stored(namespace, held.tenant, held.writes)

    def ended(self, namespace: str, lease_id: int) -> None:
        """The lease ended (committed, aborted, released, expired, its holder gone)."""
        with self._lock:
            held = self._held.pop((namespace, lease_id), None)
        if held is not None:
            self._unreserve(held.tenant, held.namespace, held.pages)

    def ttl(self, namespace: str, lease_id: int | None, tenant: str, ttl_s: float) -> float:
        """A tenant's lease time, within its lifetime from its grant (``lease_id`` None: a new
        lease). FailedPrecondition once a lease has lived its lifetime."""
        if tenant == ADMIN:
            return ttl_s
        life = self.limits.max_lease_lifetime_s
        if lease_id is None:
            return min(ttl_s, life)
        with self._lock:
            held = self._held.get((namespace, lease_id))
        if held is None:
            return min(ttl_s, life)
        left = held.born + life - time.monotonic()
        if left <= 0:
            raise FailedPrecondition(
                f"lease {lease_id} has lived the {life:g} s a tenant's lease may "
                "(--tenant-lease-lifetime); commit, abort or release it and take a new one"
            )
        return min(ttl_s, left)

    # ---- stored blocks and fair eviction --------------------------------------------------

    def stored(self, namespace: str, tenant: str, keys: Sequence[bytes]) -> None:
        """``tenant`` wrote ``keys`` (as stored) into ``namespace``."""
        if tenant == ADMIN or not keys:
            return
        store = self._stores[namespace]
        cap = sum(store.capacity(t) for t in store.tiers)
        with self._lock:
            blocks = self._blocks.setdefault((namespace, tenant), _Blocks())
            for k in keys:
                blocks.keys[bytes(k)] = None
                blocks.keys.move_to_end(bytes(k))
            while len(blocks.keys) > cap:  # more than the store holds: the oldest are gone
                blocks.keys.popitem(last=False)

    def make_room(self, store: TieredStore, tenant: str, pages: int) -> int:
        """Before ``tenant`` writes ``pages`` pages: when the DRAM pool has fewer free pages,
        drop the oldest blocks of the tenants furthest over an even share of it (the writer
        included) until it has them, or nobody is over. Returns the blocks dropped."""
        if tenant == ADMIN:
            return 0
        ns = store.namespace
        dropped = 0
        while True:
            dram = next(t for t in store.stats().tiers if t.tier is Tier.DRAM)
            need = pages - dram.free_pages
            if need <= 0:
                return dropped
            victim = self._over_share(store, tenant, dram.capacity_pages)
            if victim is None:
                return dropped
            keys = self._oldest(ns, victim, need)
            if not keys:
                return dropped
            gone = store.remove(keys)
            dropped += gone
            if not gone:
                return dropped

    def _over_share(self, store: TieredStore, writer: str, capacity: int) -> str | None:
        ns = store.namespace
        with self._lock:
            tenants = {t for (n, t) in self._blocks if n == ns} | {writer}
            counts = {t: len(b.keys) for (n, t), b in self._blocks.items() if n == ns}
        fair = capacity // max(1, len(tenants))
        over = {t: n - fair for t, n in counts.items() if n > fair}
        return max(over, key=over.__getitem__) if over else None

    def _oldest(self, namespace: str, tenant: str, n: int) -> list[bytes]:
        """Up to ``n`` of the tenant's oldest blocks that the store holds in DRAM, taken off its
        list (the ones found gone are forgotten on the way; those in other tiers stay)."""
        store = self._stores[namespace]
        out: list[bytes] = []
        skip = 0  # oldest keys kept on the list (held in another tier)
        while len(out) < n:
            with self._lock:
                blocks = self._blocks.get((namespace, tenant))
                if blocks is None:
                    return out
                batch = list(itertools.islice(blocks.keys, skip, skip + 2 * (n - len(out))))
            if not batch:
                return out
            tiers = store.tiers_of(batch)
            with self._lock:
                for key, tier in zip(batch, tiers):
                    if tier is Tier.DRAM and len(out) < n:
                        out.append(key)
                        blocks.keys.pop(key, None)
                    elif tier is None:
                        blocks.keys.pop(key, None)
                    else:
                        skip += 1
        return out

    # ---- views ----------------------------------------------------------------------------

    def usage(self, streams: dict[str, int] | None = None) -> list[TenantUse]:
        with self._lock:
            out: dict[str, TenantUse] = {}
            for held in self._held.values():
                u = out.setdefault(held.tenant, TenantUse(held.tenant))
                u.leases += 1
                u.leased_pages += held.pages
            for (_, tenant), blocks in self._blocks.items():
                out.setdefault(tenant, TenantUse(tenant)).stored_blocks += len(blocks.keys)
        for tenant, n in (streams or {}).items():
            out.setdefault(tenant, TenantUse(tenant)).streams = n
        return sorted(out.values(), key=lambda u: u.tenant)
