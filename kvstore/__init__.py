"""Prefix-hashed paged KV blocks in tiered GPU / DRAM / SSD pools."""
from .errors import (CapacityExhausted, FailedPrecondition, InvalidArgument, KVStoreError,
                     NotFound, StorageError)
from .events import BlockEvent, EventKind
from .keys import (BlockKey, block_keys, check_keys, keys_from_block_ids, root_key, scope_keys,
                   tokens_as_array)
from .layout import KVLayout
from .policy import POLICIES, EvictionPolicy, LFUPolicy, LRUPolicy, make_policy
from .shm import SharedSlab
from .store import (CommitResult, LookupResult, ReadLease, StoreConfig, StoreStats, TieredStore,
                    TierStats, WriteLease)
from .tiers import Tier

__all__ = [
    "BlockEvent", "BlockKey", "CapacityExhausted", "CommitResult", "EventKind", "EvictionPolicy",
    "FailedPrecondition", "InvalidArgument", "KVLayout", "KVStoreError", "LFUPolicy", "LRUPolicy",
    "LookupResult", "NotFound", "POLICIES", "ReadLease", "SharedSlab", "StorageError",
    "StoreConfig", "StoreStats", "Tier", "TierStats", "TieredStore", "WriteLease", "block_keys",
    "check_keys", "keys_from_block_ids", "make_policy", "root_key", "scope_keys",
    "tokens_as_array",
]
