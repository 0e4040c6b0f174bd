"""An SGLang HiCache L3 storage backend on a kvcache node.

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kvcache", "module_path": "clients.sglang_hicache",
          "class_name": "KVCacheHiCacheStorage", "node": "127.0.0.1:7000",
          "token_file": "/etc/kvcache/token", "interface_v1": 1}'

Each rank keys its pages by SGLang's page hash under its own identity (model, page format,
TP/PP/CP share, key epoch: clients/sglang_keys.py), in the node layout whose page size and dtype
are the host pool's. Every call is one RPC for the whole batch: ``batch_exists`` one ``Lookup``
(the leading run of hits, SGLang's semantics), ``batch_get_v1`` one ``Acquire`` + one copy per
page from the node's shared memory into the host pool (viewed in the pool's dtype) + ``Release``
(pages the node holds outside shared memory, on SSD say, streamed), ``batch_set_v1`` one
``Allocate`` + one copy per page out of the host pool + ``Commit``. With the node on another
host, pages are streamed. Errors are misses or failed writes, never exceptions into SGLang's
storage threads; every call has a short deadline (``timeout_s``) and a node that does not answer
opens a breaker (clients/sglang_guard.py), so SGLang's threads never wait on it. The node is first
asked (for its layouts) when SGLang registers the host pool: a node that is down or hung then costs
one deadline, and the engine starts with misses until the node answers.

Only the KV pool is stored: models whose cache has other pools too (hybrid, DSA, Mamba, sliding
window: SGLang's v2 interface) are refused when SGLang registers them. Extra config: ``node``
(required), ``token_file`` (or ``token``, which SGLang prints with its server arguments),
``tls_ca_file``, ``namespace``, ``timeout_s`` (2), ``retry_s`` (5), ``key_epoch``, ``use_shm``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, TypeVar

import numpy as np
import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
)

from kvstore.errors import KVStoreError

from . import sglang_keys as sk
from .conductor_client import ConductorClient
from .node_client import KVCacheRpcError, KVStoreClient
from .node_guard import BreakerOpen
from .remote_pool import RemotePool, messengers
from .sglang_guard import Breaker

log = logging.getLogger(__name__)
T = TypeVar("T")
# The key epoch of each identity in this process: a backend attached again after clear() keeps it.
_EPOCHS: dict[bytes, str] = {}
_EPOCHS_LOCK = threading.Lock()


def _positive(extra: dict[str, Any], name: str, default: float) -> float:
    value = float(extra.get(name, default))
    if not value > 0:
        raise ValueError(f"kvcache HiCache backend: '{name}' must be > 0 seconds, got {value}")
    return value


def _logical_kv_dtype() -> str:
    """SGLang's --kv-cache-dtype where published (fp8 KV is stored as uint8 either way)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return str(get_server_args().kv_cache_dtype)
    except Exception:  # noqa: BLE001 - not published in this process
        return ""


class KVCacheHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if not extra.get("node"):
            raise ValueError(
                "kvcache HiCache backend: the extra config needs 'node' "
                "(the kvcache node's host:port)"
            )
        token = extra.get("token")
        if token:
            log.warning(
                "kvcache HiCache backend: 'token' in the extra config is printed with SGLang's "
                "server arguments; put the token in a file and name it with 'token_file'"
            )
        if extra.get("token_file"):
            with open(extra["token_file"]) as f:
                token = f.read().strip()
        if storage_config.should_split_heads:
            raise ValueError(
                "kvcache HiCache backend: tp_lcm_size (heads split across TP sizes) is not "
                "supported; leave it out of the extra config"
            )
        self.config = storage_config
        self.timeout_s = _positive(extra, "timeout_s", 2.0)
        address, tls = str(extra["node"]), extra.get("tls_ca_file")
        # No call here: the node is asked at registration, where a failure is a miss, not an error.
        self.client = KVStoreClient(
            address,
            token=token,
            tls_ca_file=tls,
            use_shm=bool(extra.get("use_shm", True)),
            timeout_s=self.timeout_s,
        )
        self.breaker = Breaker(
            self.client,
            _positive(extra, "retry_s", 5.0),
            lambda: KVStoreClient(address, token, tls, use_shm=False, timeout_s=self.timeout_s),
        )
        # The cluster's pool (clients.remote_pool): with a conductor, pages other nodes hold are
        # counted by batch_exists and pulled into this node by batch_get.
        self._pool_args = (
            (str(extra["conductor"]), str(extra.get("messenger") or ""), token, tls)
            if extra.get("conductor")
            else None
        )
        self._remote_timeout_s = _positive(extra, "remote_timeout_s", 0.1)
        self._pull_timeout_s = _positive(extra, "pull_timeout_s", 10.0)
        self._pool: RemotePool | None = None
        self._pool_retry_at = 0.0
        self._wanted_ns: str | None = extra.get("namespace") or None
        self._key_epoch = str(extra.get("key_epoch", ""))
        self.namespace: str | None = None
        self.format: sk.PageFormat | None = None
        self.refused: str | None = None  # why this backend stores nothing (found after start)
        self._base: bytes = b""  # the identity at the configured epoch
        self._prefix: bytes = b""  # the identity at the current epoch: the keys' prefix
        self._lock = threading.Lock()
        self._metrics: dict[str, list[float]] = {}
        self._reset_metrics()

    # ---- registration ----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.format = sk.page_format(mem_pool_host)
        logical = _logical_kv_dtype() if self.format.dtype == "uint8" else ""
        self._base = sk.identity(self.config, self.format, logical, self._key_epoch)
        with _EPOCHS_LOCK:
            epoch = _EPOCHS.get(self._base)
        self._prefix = (
            sk.identity(self.config, self.format, logical, epoch) if epoch else self._base
        )
        self._resolve(at_start=True)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if str(host_pool_name) == PoolName.KV.value and host_pool is self.mem_pool_host:
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        self.refused = (
            f"this model's cache has a {host_pool_name} pool besides its KV "
            "(hybrid, DSA, Mamba or sliding-window attention), which the kvcache backend does "
            "not store"
        )
        raise ValueError(
            f"kvcache HiCache backend: {self.refused}; run it without "
            "--hicache-storage-backend, or with a backend that implements SGLang's v2 interface"
        )

    def _resolve(self, at_start: bool = False) -> bool:
        """Whether pages can move: the node layout is chosen (asking the node the first time it
        answers). A layout that does not fit fails the start, or, found later, turns this
        backend off (logged)."""
        if self.namespace is not None:
            return True
        if self.refused is not None or self.format is None:
            return False
        try:
            names = self.breaker.call(self.client.namespaces)
            infos = {ns: self.client.namespace_info(ns) for ns in names}
        except KVCacheRpcError as e:
            if at_start:
                log.warning("kvcache node not reachable at start (%s): misses until it is", e)
            return False
        try:
            try:
                self.namespace = sk.choose_namespace(
                    infos, self.format, self.config.model_name or "", self._wanted_ns
                )
            except ValueError:
                registered = None if self._wanted_ns else self._register()
                if registered is None:
                    raise
                self.namespace = registered
        except ValueError as e:
            if at_start:
                raise
            self.refused = str(e)
            log.error("%s; the kvcache HiCache backend stores nothing", e)
            return False
        log.info(
            "kvcache HiCache backend: node %s, namespace %s", self.client.address, self.namespace
        )
        return True

    def _register(self) -> str | None:
        """No layout of the node fits this pool: have it serve one that does (a node started
        without --layout serves the layouts its clients register); its namespace, or None
        when the node refuses (started with --layout, or at its --max-layouts)."""
        assert self.format is not None
        layout = sk.layout_for(self.format, self.config.model_name or "")
        try:
            added = self.breaker.call(lambda: self.client.register_layout(layout))
        except KVCacheRpcError as e:
            log.warning("kvcache node %s did not register %s: %s", self.client.address, layout, e)
            return None
        log.info(
            "kvcache node %s serves %s (%s)",
            self.client.address,
            layout.namespace,
            "registered now" if added else "registered already",
        )
        return layout.namespace

    def _keys(self, names: list[str]) -> list[bytes]:
        return sk.page_keys(self._prefix, names)

    def _call(self, fn: Callable[[], T]) -> T:
        return self.breaker.call(fn)

    @staticmethod
    def _failed(what: str, e: Exception) -> None:
        # NOTE: while the breaker is open every call fails the same way: logged once, by it.
        (log.debug if isinstance(e, BreakerOpen) else log.warning)(
            "kvcache %s failed (%s)", what, e
        )

    # ---- existence -------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        if not keys or not self._resolve():
            return 0
        ns = self.namespace
        assert ns is not None
        node_keys = self._keys(keys)
        try:
            hit = int(self._call(lambda: self.client.lookup(ns, keys=node_keys)).hit_blocks)
        except KVCacheRpcError as e:
            self._failed("lookup", e)
            return 0
        pool = self._remote_pool() if hit < len(keys) else None
        if pool is not None:
            try:
                found = pool.find(ns, node_keys, hit)
                if found is not None:
                    return found[0]  # batch_get pulls them first
            except KVCacheRpcError as e:
                self._failed("pool lookup", e)
        return hit

    def _remote_pool(self) -> RemotePool | None:
        """The pool, made on first use; None without a conductor, or for a while after it could
        not be made (a miss: pages of this node only)."""
        if self._pool_args is None:
            return None
        if self._pool is not None or time.monotonic() < self._pool_retry_at:
            return self._pool
        conductor, messenger, token, tls = self._pool_args
        try:
            node_id = self._call(self.client.info).node_id
            if not messenger:
                with ConductorClient(conductor, token, tls, self._remote_timeout_s) as c:
                    messenger = messengers(c).get(node_id, "")
            if not messenger:
                raise KVStoreError(f"node {node_id} registered no messenger: set 'messenger'")
            self._pool = RemotePool(
                conductor,
                messenger,
                node_id,
                token,
                tls,
                self._remote_timeout_s,
                self._pull_timeout_s,
            )
        except (KVCacheRpcError, KVStoreError) as e:
            self._failed("pool setup", e)
            self._pool_retry_at = time.monotonic() + self.breaker.retry_s
        return self._pool

    def _pull(self, ns: str, node_keys: list[bytes], found: list[bool]) -> list[int]:
        """Pull the pages from the first one this node lacks on, from the node that holds the
        most of them; returns the indices that may now be here."""
        pool = self._remote_pool()
        first = found.index(False) if False in found else len(found)
        if pool is None or first == len(found):
            return []
        where = pool.find(ns, node_keys, first)
        if where is None:
            return []
        pages, source = where
        batch = pool.pull(ns, node_keys[first:pages], source)
        pool.wait(batch)
        return [i for i in range(first, pages) if not found[i]]

    # ---- pages of the host pool (interface_v1) ---------------------------------------------------

    def _starts(self, host_indices: torch.Tensor, n: int) -> list[int]:
        step = self.mem_pool_host.page_size
        return [int(i) for i in host_indices[::step][:n]]

    def _as_pool(self, page: np.ndarray[Any, Any]) -> torch.Tensor:
        """A node page (bytes) as a flat tensor of the pool's dtype, no copy."""
        return torch.from_numpy(page).view(self.mem_pool_host.dtype)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if not keys or not self._resolve():
            return [False] * len(keys)
        ns = self.namespace
        assert ns is not None
        starts, node_keys, t0 = (
            self._starts(host_indices, len(keys)),
            self._keys(keys),
            time.perf_counter(),
        )
        found = [False] * len(keys)
        try:
            shared = self._call(lambda: self.client.shm_available(ns))
            self._load_into(ns, shared, list(range(len(keys))), node_keys, starts, found)
            if not all(found) and self._pool_args is not None:
                pulled = self._pull(ns, node_keys, found)
                if pulled:  # now on this node: read as its own pages are
                    self._load_into(ns, shared, pulled, node_keys, starts, found)
        except Exception as e:  # noqa: BLE001 - a miss, never an error in SGLang's threads
            self._failed(f"load of {len(keys)} pages", e)
        self._metric("prefetch", sum(found), t0)
        return found

    def _load_into(
        self,
        ns: str,
        shared: bool,
        which: list[int],
        node_keys: list[bytes],
        starts: list[int],
        found: list[bool],
    ) -> None:
        """Pages ``which`` of ``node_keys`` into the host pool at ``starts``: out of the node's
        shared memory under one read lease (``shared``), streamed where they are not in it."""
        if not shared:
            self._stream_into(ns, which, node_keys, starts, found)
            return
        pool = self.mem_pool_host
        lease = self._call(lambda: self.client.acquire(ns, keys=[node_keys[i] for i in which]))
        elsewhere = []
        try:
            region = lease.slab.array if lease.slab is not None else None
            size = lease.page_bytes
            for j, i in enumerate(which):
                off = lease.offsets[j]
                if off >= 0 and region is not None:
                    pool.set_from_flat_data_page(starts[i], self._as_pool(region[off : off + size]))
                    found[i] = True
                elif lease.tiers[j] is not None:  # stored, but not in shared memory
                    elsewhere.append(i)
        finally:
            with contextlib.suppress(KVCacheRpcError):
                self.client.release(lease)  # else it expires by itself
        if elsewhere:
            self._stream_into(ns, elsewhere, node_keys, starts, found)

    def _stream_into(
        self,
        ns: str,
        which: list[int],
        node_keys: list[bytes],
        starts: list[int],
        found: list[bool],
    ) -> None:
        pages = self._call(lambda: self.client.get(ns, keys=[node_keys[i] for i in which]))
        for i, page in zip(which, pages):
            if page is not None:
                self.mem_pool_host.set_from_flat_data_page(starts[i], self._as_pool(page))
                found[i] = True

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if not keys or not self._resolve():
            return [False] * len(keys)
        ns, pool = self.namespace, self.mem_pool_host
        assert ns is not None
        starts, node_keys, t0 = (
            self._starts(host_indices, len(keys)),
            self._keys(keys),
            time.perf_counter(),
        )
        try:
            if not self._call(lambda: self.client.shm_available(ns)):
                pages = [pool.get_data_page(s, flat=True).view(torch.uint8) for s in starts]
                self._call(lambda: self.client.put(ns, pages, keys=node_keys))
            else:
                lease = self._call(lambda: self.client.allocate(ns, keys=node_keys))
                try:
                    region = lease.slab.array if lease.slab is not None else None
                    if region is None:
                        raise KVStoreError("the node's shared memory is not mapped")
                    size = lease.page_bytes
                    sums = np.zeros(len(lease.keys), dtype=np.uint64)
                    for i in lease.to_write:  # one copy: host pool -> the node's page
                        src = pool.get_data_page(starts[i], flat=False)
                        off = lease.offsets[i]
                        self._as_pool(region[off : off + size]).view(src.shape).copy_(src)
                        # hashed while the copy left it in cache: the node keeps the checksum
                        # instead of reading the page back at commit
                        sums[i] = xxhash.xxh3_64_intdigest(region[off : off + size].data)
                except BaseException:
                    with contextlib.suppress(KVCacheRpcError):
                        self.client.abort(lease)
                    raise
                self._call(lambda: self.client.commit(lease, sums))
        except Exception as e:  # noqa: BLE001 - a failed write, never an error in SGLang's threads
            self._failed(f"save of {len(keys)} pages", e)
            return [False] * len(keys)
        self._metric("backup", len(keys), t0)
        return [True] * len(keys)

    # ---- flat tensors (SGLang's legacy interface, without interface_v1) --------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        targets = [target_location] if target_location is not None else None
        return self.batch_get([key], targets)[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        if not keys or not self._resolve():
            return [None] * len(keys)
        ns = self.namespace
        assert ns is not None
        t0 = time.perf_counter()
        try:
            pages = self._call(lambda: self.client.get(ns, keys=self._keys(keys)))
        except KVCacheRpcError as e:
            self._failed(f"get of {len(keys)} pages", e)
            return [None] * len(keys)
        out: list[torch.Tensor | None] = []
        for i, page in enumerate(pages):
            if page is None:
                out.append(None)
            elif target_locations is not None and target_locations[i] is not None:
                dst = target_locations[i]
                dst.view(-1).view(torch.uint8).copy_(torch.from_numpy(page))
                out.append(dst)
            else:
                out.append(self._as_pool(page))
        self._metric("prefetch", sum(p is not None for p in out), t0)
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
        if not keys or values is None or not self._resolve():
            return False
        ns = self.namespace
        assert ns is not None
        t0 = time.perf_counter()
        pages = [
            v.detach().contiguous().view(-1).view(torch.uint8).cpu()
            if isinstance(v, torch.Tensor)
            else v
            for v in values
        ]
        try:
            self._call(lambda: self.client.put(ns, pages, keys=self._keys(keys)))
        except (KVCacheRpcError, KVStoreError, ValueError) as e:
            self._failed(f"put of {len(keys)} pages", e)
            return False
        self._metric("backup", len(keys), t0)
        return True

    # ---- control ---------------------------------------------------------------------------------

    def clear(self) -> None:
        """Nothing this engine stored before can be loaded by it any more (weights updated in
        place, say): its keys move to a new epoch, in this process until it ends. Other engines
        keep their pages; the old ones leave by the node's eviction. A model whose KV is the same
        on every TP rank (MLA) is written by rank 0 and read by all, and its ranks cannot agree
        on a new epoch without talking: refused (SGLang reports the failure)."""
        if self.format is None:
            raise RuntimeError(
                "kvcache HiCache backend: clear() before the host pool is registered"
            )
        if self.config.is_mla_model and self.config.tp_size > 1:
            raise RuntimeError(
                "kvcache HiCache backend: clear() cannot move the key epoch of a model whose KV "
                f"is shared by its {self.config.tp_size} TP ranks (MLA); restart the engine "
                "with a new 'key_epoch' in --hicache-storage-backend-extra-config"
            )
        epoch = f"{self._key_epoch}/{os.urandom(8).hex()}"
        logical = _logical_kv_dtype() if self.format.dtype == "uint8" else ""
        with _EPOCHS_LOCK:
            _EPOCHS[self._base] = epoch
        self._prefix = sk.identity(self.config, self.format, logical, epoch)
        log.info("kvcache HiCache backend: cleared (new key epoch %s)", epoch)

    def _reset_metrics(self) -> None:
        self._metrics = {k: [] for k in ("prefetch_pgs", "prefetch_bw", "backup_pgs", "backup_bw")}

    def _metric(self, kind: str, pages: int, t0: float) -> None:
        if not self.config.enable_storage_metrics or pages == 0 or self.format is None:
            return
        seconds = max(time.perf_counter() - t0, 1e-9)
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bw"].append(pages * self.format.page_bytes / seconds / (1 << 30))

    def get_stats(self) -> Any:
        """SGLang's storage metrics since the last call (pages and GB/s per load and save)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            m = self._metrics
            self._reset_metrics()
        return StorageMetrics(
            prefetch_pgs=[int(p) for p in m["prefetch_pgs"]],
            backup_pgs=[int(p) for p in m["backup_pgs"]],
            prefetch_bandwidth=m["prefetch_bw"],
            backup_bandwidth=m["backup_bw"],
        )

    def close(self) -> None:
        self.breaker.close()
        self.client.close()
