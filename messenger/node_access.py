"""The messenger's view of its own node: the DRAM slabs mapped through the node client, and the
page source that serves peers from them.

Calls go through the node client library with the admin token (tenant ""), so keys are used as
stored. Page bytes never pass through the node server: the node hands out offsets in its shared
memory and the messenger reads/writes the pages there. That memory is the node's slab by name, or,
on a node with tenant tokens, the admin identity's own segment (handed over as a descriptor; see
node/segments.py). The node's checksum of each pinned page travels with it
(``PinnedPages.checksums``): servers check it as they checksum the page for the wire.
"""

from __future__ import annotations

import logging

import grpc
import numpy as np

from clients.node_client import KVCacheRpcError, KVStoreClient, NamespaceInfo

from .transport import PageSource, PinnedPages

log = logging.getLogger(__name__)


class NodeAccess:
    """A node client and its mapping of each namespace's shared memory."""

    def __init__(self, client: KVStoreClient) -> None:
        self.client = client

    def namespaces(self) -> list[str]:
        return self.client.namespaces()

    def info(self, namespace: str) -> NamespaceInfo:
        """Raises ``LookupError`` when the node does not serve the namespace."""
        try:
            return self.client.namespace_info(namespace)
        except KVCacheRpcError as e:
            if e.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise LookupError(e.details) from None
            raise

    def region(self, namespace: str) -> np.ndarray:
        """The namespace's shared memory as flat uint8, mapped once (by the client)."""
        info = self.info(namespace)
        if not info.shm_name and not info.shm_socket:
            raise LookupError(
                f"namespace {namespace!r} has no shared-memory DRAM pool on the "
                "node; the messenger needs one (give the node --dram)"
            )
        try:
            region = self.client.shm_region(namespace)
        except KVCacheRpcError as e:
            raise LookupError(f"cannot open the node's shared memory: {e}") from None
        if region is None:
            raise LookupError(
                f"cannot map the node's shared memory of {namespace!r}; the messenger must run "
                "on the node's host"
            )
        return region

    def close(self) -> None:
        """The mappings go with the client (``KVStoreClient.close``)."""


class NodePageSource(PageSource):
    """Serves peers from the node: pins with ``Acquire`` (a lease of ``pin_ttl_s``, so pins of a
    messenger that dies expire), reads the pinned pages from shared memory, ``Release``s."""

    def __init__(self, node: NodeAccess, pin_ttl_s: float = 30.0) -> None:
        self.node = node
        self.pin_ttl_s = pin_ttl_s

    def page_bytes(self, namespace: str) -> int:
        return self.node.info(namespace).page_bytes

    def pool_pages(self, namespace: str) -> int:
        try:
            return self.node.info(namespace).dram_pages
        except KVCacheRpcError as e:
            raise ConnectionError(f"node Info failed: {e}") from None

    def region(self, namespace: str) -> np.ndarray:
        return self.node.region(namespace)

    def pin(self, namespace: str, keys: list[bytes]) -> PinnedPages:
        self.node.region(namespace)  # LookupError for unknown namespaces, before any pin
        client = self.node.client
        try:
            lease = client.acquire(namespace, keys=keys, ttl_s=self.pin_ttl_s)
        except KVCacheRpcError as e:
            if e.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise LookupError(e.details) from None
            raise ConnectionError(f"node Acquire failed: {e}") from None
        # NOTE: the lease's own mapping (the reply tells whether the node restarted meanwhile)
        views = [
            memoryview(lease.page(i)) if off >= 0 else None for i, off in enumerate(lease.offsets)
        ]

        def release() -> None:
            # NOTE: not in the background: a Release still pending when the node restarts
            # would put the channel into reconnect backoff, failing the next pins for a second.
            try:
                client.release(lease)
            except KVCacheRpcError as e:
                # NOT_FOUND: the lease expired first (the node already unpinned); both are fine
                # for correctness, but say so: a slow peer or a too short --pin-ttl.
                log.warning("releasing pin lease %d on the node: %s", lease.lease_id, e)

        def drop(indices: list[int]) -> None:
            # A page changed after its commit (a same-host writer scribbled on it): it was not
            # sent; drop it on the node so that nobody else is served it either.
            log.warning("%d pinned pages failed their checksum; dropping them", len(indices))
            try:
                client.remove(namespace, keys=[lease.keys[i] for i in indices])
            except KVCacheRpcError as e:
                log.warning("could not drop corrupt pages on the node: %s", e)

        region = lease.slab.array if lease.slab is not None else None
        return PinnedPages(
            views, list(lease.offsets), release, list(lease.checksums), drop, region=region
        )
