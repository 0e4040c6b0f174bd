"""Opening a store's tiers: a page pool and an eviction policy per tier the config gives pages,
checked first (a bad config raises ``InvalidArgument`` before any pool exists), and the SSD tier's
pages from an earlier run indexed again. ``_close_pools`` gives the pools back.
"""

from __future__ import annotations

import os

import xxhash

from .blocks import TierState
from .errors import InvalidArgument
from .keys import BlockKey
from .movement import TierMovement
from .policy import make_policy
from .pools import MetadataPool, PagePool, SharedDramPool, TorchSlabPool
from .ssd import SsdPool
from .tiers import Tier


class TierSetup(TierMovement):
    """A mixin of ``TieredStore``: its construction and the release of its pools."""

    def _open_tiers(self) -> None:
        cfg, page = self.config, self.layout.page_bytes
        specs = [
            (Tier.GPU, cfg.gpu_pages, cfg.gpu_policy),
            (Tier.DRAM, cfg.dram_pages, cfg.dram_policy),
            (Tier.SSD, cfg.ssd_pages, cfg.ssd_policy),
        ]
        for tier, pages, _ in specs:
            if pages < 0:
                raise InvalidArgument(f"{tier.name.lower()}_pages must be >= 0, got {pages}")
        q = cfg.quarantine_s
        if q is not None and not 0 <= q < float("inf"):  # NOTE: NaN fails this test too
            raise InvalidArgument(f"quarantine_s must be finite seconds >= 0, got {q!r}")
        if not any(p for _, p, _ in specs):
            raise InvalidArgument("a store needs at least one tier with pages > 0")
        if not cfg.metadata_only and cfg.dram_pages <= 0:
            raise InvalidArgument(
                "a store with data needs a DRAM tier (dram_pages > 0): it is "
                "where writers and shared-memory readers see pages"
            )
        if cfg.write_tier not in [t for t, p, _ in specs if p]:
            raise InvalidArgument(f"write_tier {cfg.write_tier.name} has no pages")
        for tier, pages, policy in specs:
            if not pages:
                continue
            evict = make_policy(policy, pages)  # NOTE: first: a bad name must not leak a pool
            pool = self._make_pool(tier, pages, page)
            budget = {Tier.DRAM: cfg.dram_budget, Tier.SSD: cfg.ssd_budget}.get(tier)
            self._add_tier(TierState(tier, pool, evict, pages, budget=budget))
        self._grow_tree()

    def _make_pool(self, tier: Tier, pages: int, page_bytes: int) -> PagePool:
        cfg = self.config
        if cfg.metadata_only:
            return MetadataPool(tier, pages, page_bytes)
        if tier is Tier.GPU:
            return TorchSlabPool(pages, page_bytes, device=cfg.gpu_device)
        if tier is Tier.DRAM:
            return SharedDramPool(
                pages,
                page_bytes,
                shm_name=cfg.shm_name,
                reserve=cfg.reserve_shm,
                private=cfg.private_dram,
                checksums=cfg.dram_checksums,
                # NOTE: a budget's slab could hold the whole budget: its room is the budget's
                check_room=cfg.dram_budget is None,
            )
        if not cfg.ssd_dir:
            raise InvalidArgument("the SSD tier needs ssd_dir (a directory for its lmdb files)")
        sub = xxhash.xxh64_hexdigest(self.namespace.encode())
        return SsdPool(os.path.join(cfg.ssd_dir, sub), pages, page_bytes, on_damage=cfg.ssd_damaged)

    def _recover_ssd(self) -> None:
        """Re-index pages an earlier run left on the SSD tier (beyond capacity: dropped)."""
        ts = self._tiers.get(Tier.SSD)
        if ts is None or not isinstance(ts.pool, SsdPool):
            return
        keys = ts.pool.stored_keys()
        self._grant(ts, len(keys))
        keep, extra = keys[: len(ts.free)], keys[len(ts.free) :]
        if extra:
            ts.pool.drop_pages([-1] * len(extra), extra)
        slots = []
        for key in keep:
            slots.append(ts.free.pop())
            self._publish(ts, BlockKey(key), slots[-1])
        ts.policy.insert_many(slots, fresh=True)

    def _close_pools(self) -> None:
        for ts in getattr(self, "_tiers", {}).values():
            ts.pool.close()
