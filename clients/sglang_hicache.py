"""An SGLang HiCache L3 storage backend on a kvcache node.

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kvcache", "module_path": "clients.sglang_hicache",
          "class_name": "KVCacheHiCacheStorage", "node": "127.0.0.1:7000", "interface_v1": 1}'

SGLang names each page of its host KV pool by its own chained hash (a string); the node stores
the page under ``xxh3_128`` of that name, in the node's layout whose page size equals SGLang's
(``namespace`` in the extra config; by default the node's only one, or the one whose page
size matches the host pool). Every call is one RPC for the whole batch: ``batch_exists`` is
one ``Lookup`` (the node answers the leading run of hits, SGLang's semantics), ``batch_get_v1``
one ``Acquire`` + copies from the node's shared memory into the host pool + ``Release``,
``batch_set_v1`` one ``Allocate`` + copies out of the host pool + ``Commit``. The legacy
``batch_get`` / ``batch_set`` move flat tensors the same way (streamed when the node is on
another host). Errors are misses or failed writes, never exceptions into SGLang's cache
controller. Extra config: ``node`` (required), ``token`` or ``token_file``, ``tls_ca_file``,
``namespace``.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvstore.errors import KVStoreError

from .node_client import KVCacheRpcError, KVStoreClient

log = logging.getLogger(__name__)


def page_key(name: str) -> bytes:
    """The node key of an SGLang page name."""
    return xxhash.xxh3_128_digest(b"sglang/page/v1\x00" + name.encode())


class KVCacheHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if not extra.get("node"):
            raise ValueError(
                "kvcache HiCache backend: the extra config needs 'node' "
                "(the kvcache node's host:port)"
            )
        token = extra.get("token")
        if extra.get("token_file"):
            with open(extra["token_file"]) as f:
                token = f.read().strip()
        self.config = storage_config
        self.client = KVStoreClient(
            extra["node"], token=token, tls_ca_file=extra.get("tls_ca_file")
        )
        self._wanted_ns = extra.get("namespace")
        self.namespace: str | None = None
        self.page_bytes = 0
        if self._wanted_ns or len(self.client.namespaces()) == 1:
            self._use(self._wanted_ns or self.client.namespaces()[0])

    def _use(self, namespace: str) -> None:
        self.page_bytes = self.client.namespace_info(namespace).page_bytes
        self.namespace = namespace

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        flat = mem_pool_host.get_dummy_flat_data_page()
        nbytes = flat.numel() * flat.element_size()
        if self.namespace is None:  # the layout whose page is the pool's page
            match = [
                ns
                for ns in self.client.namespaces()
                if self.client.namespace_info(ns).page_bytes == nbytes
            ]
            if len(match) != 1:
                raise ValueError(
                    f"kvcache HiCache backend: the host pool's page is {nbytes} "
                    f"bytes; the node serves {len(match)} layouts of that size: "
                    "name one with 'namespace' in the extra config"
                )
            self._use(match[0])
        elif nbytes != self.page_bytes:
            raise ValueError(
                f"kvcache HiCache backend: the host pool's page is {nbytes} bytes, "
                f"the node's {self.namespace} pages {self.page_bytes}"
            )

    # ---- existence -----------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        if not keys or self.namespace is None:
            return 0
        try:
            return int(
                self.client.lookup(self.namespace, keys=[page_key(k) for k in keys]).hit_blocks
            )
        except KVCacheRpcError as e:
            log.warning("kvcache lookup failed (%s): a miss", e)
            return 0

    # ---- zero-copy on the host pool (interface_v1) ---------------------------------------------

    def _pages(self, host_indices: torch.Tensor, n: int) -> list[int]:
        step = self.mem_pool_host.page_size
        return [int(i) for i in host_indices[::step][:n]]

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if not keys or self.namespace is None:
            return [False] * len(keys)
        pool, starts = self.mem_pool_host, self._pages(host_indices, len(keys))
        if not self.client.shm_available(self.namespace):  # node on another host: streamed
            pages = self.batch_get(keys)
            for start, page in zip(starts, pages):
                if page is not None:
                    pool.set_from_flat_data_page(start, page)
            return [p is not None for p in pages]
        try:
            lease = self.client.acquire(self.namespace, keys=[page_key(k) for k in keys])
        except KVCacheRpcError as e:
            log.warning("kvcache acquire failed (%s): %d misses", e, len(keys))
            return [False] * len(keys)
        try:
            found = []
            for i, start in enumerate(starts):
                ok = lease.offsets[i] >= 0 and lease.tiers[i] is not None
                if ok:
                    pool.set_from_flat_data_page(start, torch.from_numpy(lease.page(i)))
                found.append(ok)
            return found
        finally:
            try:
                lease.release()
            except KVCacheRpcError:
                pass  # the lease expires by itself

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if not keys or self.namespace is None:
            return [False] * len(keys)
        pool, starts = self.mem_pool_host, self._pages(host_indices, len(keys))
        pages = [pool.get_data_page(s, flat=True) for s in starts]
        return [self.batch_set(keys, pages)] * len(keys)

    # ---- flat tensors (the legacy interface) ---------------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        targets = [target_location] if target_location is not None else None
        return self.batch_get([key], targets)[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        if not keys or self.namespace is None:
            return [None] * len(keys)
        try:
            pages = self.client.get(self.namespace, keys=[page_key(k) for k in keys])
        except KVCacheRpcError as e:
            log.warning("kvcache get failed (%s): %d misses", e, len(keys))
            return [None] * len(keys)
        out: list[torch.Tensor | None] = []
        for i, page in enumerate(pages):
            if page is None:
                out.append(None)
                continue
            src = torch.from_numpy(page)
            if target_locations is not None and target_locations[i] is not None:
                dst = target_locations[i]
                dst.view(-1).view(torch.uint8).copy_(src)
                out.append(dst)
            else:
                out.append(src)
        return out

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if not keys or values is None or self.namespace is None:
            return False
        pages = [
            np.asarray(v.detach().contiguous().view(-1).view(torch.uint8).cpu())
            if isinstance(v, torch.Tensor)
            else v
            for v in values
        ]
        try:
            self.client.put(self.namespace, pages, keys=[page_key(k) for k in keys])
            return True
        except (KVCacheRpcError, KVStoreError, ValueError) as e:
            log.warning("kvcache put of %d pages failed (%s)", len(keys), e)
            return False

    def clear(self) -> None:
        """Nothing to do: pages are the node's and leave by its eviction."""

    def close(self) -> None:
        self.client.close()
