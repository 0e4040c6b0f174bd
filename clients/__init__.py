"""Every client: the node (``KVStoreClient``), the conductor, the messenger, the torch layer-wise
client and the Hugging Face adapter. All raise ``KVCacheRpcError`` on a failed call."""

from .conductor_client import ConductorClient
from .messenger_client import MessengerClient
from .node_client import (
    CommitResult,
    KVCacheRpcError,
    KVStoreClient,
    LookupResult,
    NamespaceInfo,
    ReadLease,
    WriteLease,
)

__all__ = [
    "CommitResult",
    "ConductorClient",
    "KVCacheRpcError",
    "KVStoreClient",
    "LookupResult",
    "MessengerClient",
    "NamespaceInfo",
    "ReadLease",
    "WriteLease",
]
