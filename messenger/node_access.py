"""The messenger's view of its own node: the DRAM slabs mapped by name, and the page source
that serves peers from them.

Calls go through the node client library with the admin token (tenant ""), so keys are used as
stored. Page bytes never pass through the node server: the node hands out offsets in its shared
memory slab and the messenger reads/writes the pages there.
"""

from __future__ import annotations

import logging
import threading

import grpc
import numpy as np

from clients.node_client import KVCacheRpcError, KVStoreClient, NamespaceInfo
from kvstore.errors import StorageError
from kvstore.shm import SharedSlab

from .transport import PageSource, PinnedPages

log = logging.getLogger(__name__)


class NodeAccess:
    """A node client plus this process's own mapping of each namespace's DRAM slab."""

    def __init__(self, client: KVStoreClient) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._slabs: dict[str, SharedSlab] = {}

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
        """The namespace's whole DRAM slab as flat uint8, mapped once per node process.

        NOTE: a node that restarted serves a new segment under a new name; the client notices
        from its Allocate / Acquire replies and refreshes the namespace info, and this mapping
        follows it (a mapping of the dead process's segment would move the wrong bytes)."""
        info = self.info(namespace)
        with self._lock:
            slab = self._slabs.get(namespace)
        if slab is not None and slab.name == info.shm_name:
            return slab.array
        if not info.shm_name:
            raise LookupError(
                f"namespace {namespace!r} has no shared-memory DRAM pool on the "
                "node; the messenger needs one (give the node --dram)"
            )
        try:
            fresh = SharedSlab.attach(info.shm_name)
        except StorageError as e:
            raise LookupError(
                f"cannot map the node's pool {info.shm_name!r}: {e}; the "
                "messenger must run on the node's host"
            ) from None
        with self._lock:
            mine = self._slabs.get(namespace)
            if mine is None or mine.name != info.shm_name:
                # NOTE: an old mapping is dropped, not closed: transfers may still hold views
                self._slabs[namespace] = mine = fresh
        if mine is not fresh:
            fresh.close()
        return mine.array

    def page(self, namespace: str, offset: int, page_bytes: int) -> memoryview:
        return memoryview(self.region(namespace)[offset : offset + page_bytes])

    def close(self) -> None:
        with self._lock:
            slabs, self._slabs = list(self._slabs.values()), {}
        for slab in slabs:
            slab.close()


class NodePageSource(PageSource):
    """Serves peers from the node: pins with ``Acquire`` (a lease of ``pin_ttl_s``, so pins of a
    messenger that dies expire), reads the pinned pages from shared memory, ``Release``s."""

    def __init__(self, node: NodeAccess, pin_ttl_s: float = 30.0) -> None:
        self.node = node
        self.pin_ttl_s = pin_ttl_s

    def page_bytes(self, namespace: str) -> int:
        return self.node.info(namespace).page_bytes

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
        # NOTE: mapped after the Acquire: its reply tells whether the node restarted meanwhile
        region = self.node.region(namespace)
        pb = lease.page_bytes
        mv = memoryview(region)
        views = [mv[off : off + pb] if off >= 0 else None for off in lease.offsets]

        def release() -> None:
            try:
                client.release(lease)
            except KVCacheRpcError as e:
                # NOT_FOUND: the lease expired first (the node already unpinned); both are fine
                # for correctness, but say so: a slow peer or a too short --pin-ttl.
                log.warning("releasing pin lease %d on the node: %s", lease.lease_id, e)

        return PinnedPages(views, list(lease.offsets), release)
