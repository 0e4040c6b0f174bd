"""Client libraries: the node client (``KVStoreClient``) and the torch layer-wise client."""
from .node_client import (CommitResult, KVCacheRpcError, KVStoreClient, LookupResult,
                          NamespaceInfo, ReadLease, WriteLease)

__all__ = ["CommitResult", "KVCacheRpcError", "KVStoreClient", "LookupResult", "NamespaceInfo",
           "ReadLease", "WriteLease"]
