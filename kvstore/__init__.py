"""Prefix-hashed paged KV blocks in tiered GPU / DRAM / SSD pools.

The library alone: no gRPC, no process code. Names resolve lazily (PEP 562), so
``import kvstore.keys`` loads the key code, not the store, lmdb or torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "errors": [
        "CapacityExhausted",
        "FailedPrecondition",
        "InvalidArgument",
        "KVStoreError",
        "NotFound",
        "StorageError",
    ],
    "events": ["BlockEvent", "EventKind"],
    "keys": [
        "BlockKey",
        "block_keys",
        "check_keys",
        "keys_from_block_ids",
        "root_key",
        "scope_keys",
        "tokens_as_array",
    ],
    "layout": ["KVLayout"],
    "policy": ["POLICIES", "EvictionPolicy", "LFUPolicy", "LRUPolicy", "make_policy"],
    "shm": ["SharedSlab"],
    "store": [
        "CommitResult",
        "LookupResult",
        "ReadLease",
        "StoreConfig",
        "StoreStats",
        "TieredStore",
        "TierStats",
        "WriteLease",
    ],
    "tiers": ["Tier"],
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kvstore.{module}"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .errors import (
        CapacityExhausted,
        FailedPrecondition,
        InvalidArgument,
        KVStoreError,
        NotFound,
        StorageError,
    )
    from .events import BlockEvent, EventKind
    from .keys import (
        BlockKey,
        block_keys,
        check_keys,
        keys_from_block_ids,
        root_key,
        scope_keys,
        tokens_as_array,
    )
    from .layout import KVLayout
    from .policy import POLICIES, EvictionPolicy, LFUPolicy, LRUPolicy, make_policy
    from .shm import SharedSlab
    from .store import (
        CommitResult,
        LookupResult,
        ReadLease,
        StoreConfig,
        StoreStats,
        TieredStore,
        TierStats,
        WriteLease,
    )
    from .tiers import Tier
