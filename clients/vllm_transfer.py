"""The worker side of the vLLM connector: one engine step's loads and saves between vLLM's paged
KV blocks and the node's pages (shared memory, or the streamed Get / Put).

A step first pins the pages to load (one ``Acquire``), then leases the pages to save (one
``Allocate``): a step in which any load failed commits nothing, since what it computed attended
to blocks that were never filled (vLLM recomputes from the first failed block, and the pages are
saved then). A step that does both through shared memory makes them one ``AcquireAllocate``
(one round trip instead of two), in which the node pins first and leases pages to save only when
every page to load was found (``allocate_if_loaded``); a node that refuses it is asked the two
calls, which tell which half failed. Pages are copied per layer, just before that layer's
attention (loads) and as it completes (saves); ``finish`` commits and releases."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.payload import LayerChecksums

from .node_client import KVCacheRpcError, ReadLease, WriteLease
from .node_guard import BreakerOpen, node_gone
from .vllm_identity import rank_keys
from .vllm_stats import ConnectorStats

if TYPE_CHECKING:
    from .vllm_connector import KVCacheConnector

log = logging.getLogger("clients.vllm_connector")


@dataclass
class _Transfer:
    """Pages ``first_page ..`` of one request and the vLLM blocks they map to.

    ``keys`` are the request's chain keys (each rank derives its own from them);
    ``vblocks[i]`` is the vLLM block id of the request's vLLM block ``first_vblock + i``; page
    ``p`` covers request vLLM blocks ``[p * ratio, (p + 1) * ratio)``."""

    req_id: str
    keys: list[bytes]
    first_page: int
    first_vblock: int
    vblocks: list[int]


@dataclass
class KVCacheConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)
    # (request, messenger, its batch, pages): loaded in the background once the pull finished
    # (request, this node's messenger, namespace -> its pull's batch, the blocks to load)
    remote: list[tuple[str, str, dict[str, str], _Transfer]] = field(default_factory=list)


class _Pages:
    """Rows of ``vblock_bytes`` over page bytes: the node's shared memory, or a host buffer
    for the streamed path. ``rows(offsets, ...)`` indexes the rows of given pages and layer."""

    def __init__(self, data: np.ndarray, vblock_bytes: int, word: torch.dtype) -> None:
        usable = data.shape[0] // vblock_bytes * vblock_bytes
        rows = torch.from_numpy(data[:usable]).view(-1, vblock_bytes)
        # shm is page-aligned, numpy's buffers 16-byte aligned: both take any word up to 8 bytes
        assert rows.data_ptr() % word.itemsize == 0
        self.rows_view = rows.view(word)
        self.vblock_bytes = vblock_bytes


class _RowMap:
    """Which page row goes with which vLLM block. Runs consecutive on both sides (vLLM hands out
    free blocks in order, so a fresh prompt is mostly one run per page) copy as slices, i.e.
    memcpy; scattered rows go through one indexed gather / scatter, on the side that holds them
    and then across (an index tensor indexes only its own device's tensors)."""

    def __init__(self, page_rows: list[int], vblocks: list[int]) -> None:
        p = np.asarray(page_rows, dtype=np.int64)
        b = np.asarray(vblocks, dtype=np.int64)
        self.count = len(p)
        cut = np.flatnonzero((np.diff(p) != 1) | (np.diff(b) != 1)) + 1
        starts = np.concatenate([[0], cut]) if self.count else np.zeros(0, np.int64)
        ends = np.concatenate([cut, [self.count]]) if self.count else starts
        self.runs = [(int(p[a]), int(b[a]), int(e - a)) for a, e in zip(starts, ends)]
        self.sliced = len(self.runs) <= max(8, self.count // 4)
        self.page_rows = torch.from_numpy(p)
        self.vblocks = torch.from_numpy(b)
        self._on: dict[torch.device, torch.Tensor] = {}

    def _vblocks_on(self, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self.vblocks
        if device not in self._on:
            self._on[device] = self.vblocks.to(device)
        return self._on[device]

    def to_blocks(self, rows: torch.Tensor, offset: int, blocks: torch.Tensor) -> None:
        if self.sliced:
            for pr, vb, n in self.runs:
                blocks[vb : vb + n].copy_(rows[offset + pr : offset + pr + n])
        else:
            gathered = rows[self.page_rows + offset]
            blocks[self._vblocks_on(blocks.device)] = gathered.to(blocks.device)

    def to_pages(self, blocks: torch.Tensor, rows: torch.Tensor, offset: int) -> None:
        if self.sliced:
            for pr, vb, n in self.runs:
                rows[offset + pr : offset + pr + n].copy_(blocks[vb : vb + n])
        else:
            gathered = blocks[self._vblocks_on(blocks.device)]
            rows[self.page_rows + offset] = gathered.to(rows.device)


def _word_for(row_bytes: int, pointers: list[int]) -> torch.dtype:
    """The widest integer type whose size divides the row size and every base address."""
    for word in (torch.int64, torch.int32, torch.int16):
        if row_bytes % word.itemsize == 0 and all(p % word.itemsize == 0 for p in pointers):
            return word
    return torch.uint8


class _Step:
    """One engine step's loads and saves: leases taken up front (one RPC each), copies per layer,
    commit and release at the end."""

    def __init__(
        self,
        conn: "KVCacheConnector",
        meta: KVCacheConnectorMetadata,
        stats: ConnectorStats | None = None,
    ) -> None:
        self.conn = conn
        self.meta = meta
        # A pull thread's step counts into its own (merged on the engine's thread, see
        # KVCacheConnector._load_remote): two threads adding to one counter lose counts.
        self.stats = conn.stats if stats is None else stats
        assert conn.layout is not None  # caches registered
        self.layout = layout = conn.layout
        self.vblock_bytes = layout.layer_bytes // conn.ratio
        self.layer_rows = layout.layer_bytes // self.vblock_bytes
        self.read: ReadLease | None = None
        self.write: WriteLease | None = None
        self.load_plan: tuple[_Pages, _RowMap] | None = None
        self.save_plan: tuple[_Pages, _RowMap] | None = None
        self.save_keys: list[bytes] = []
        self._slots: list[int] = []  # per saved key: its index among the unique keys, or -1
        self.loaded_layers: set[int] = set()
        self.saved_layers: set[int] = set()
        self.streamed_out: np.ndarray | None = None
        self._allocating: Future[WriteLease] | None = None
        self.saves: list[_Transfer] = []
        # Each saved layer's slices hashed right after their copy (from cache); the Commit
        # carries the checksums, so the node does not read the pages back to hash them.
        self._sums: LayerChecksums | None = None
        self._written: list[int] = []  # the write lease's keys with a page to write
        self.load_failed = False
        if meta.loads and meta.saves and self._start_both(meta.loads, meta.saves):
            return
        if meta.loads:
            self._start_loads(meta.loads)
        if meta.saves and self.load_failed:
            self._drop_saves(meta.saves)
        elif meta.saves:
            self._start_saves(meta.saves)

    def _drop_saves(self, saves: list[_Transfer]) -> None:
        # What this step computes attends to blocks a failed load left unfilled: none of it may
        # be stored. vLLM recomputes from the first failed block; those pages are saved then
        # (the scheduler side plans them again).
        self.stats.saves_dropped += sum(len(t.keys) for t in saves)

    # -- plans: page rows <-> vLLM block ids for layer 0; layer l adds l * layer_rows ----------

    def _rows(self, t: _Transfer, pages: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """Row (in page space) and vLLM block id of every vLLM block of ``t`` in ``pages``, given
        as (request page index, the page's first row)."""
        ratio = self.conn.ratio
        src: list[int] = []
        dst: list[int] = []
        for p, base in pages:
            lo = max(p * ratio, t.first_vblock)
            hi = min((p + 1) * ratio, t.first_vblock + len(t.vblocks))
            for j in range(lo, hi):
                src.append(base + j - p * ratio)
                dst.append(t.vblocks[j - t.first_vblock])
        return src, dst

    def _start_both(self, loads: list[_Transfer], saves: list[_Transfer]) -> bool:
        """Loads and saves through shared memory in one round trip (AcquireAllocate): the pages
        to load are pinned before the pages to save are leased, and those only when every page
        to load was found. False: this step takes the separate calls (no shared memory, or the
        node answered the merged call with an error, which they tell apart)."""
        conn = self.conn
        if not conn.merge_calls or conn.guard.is_open:
            return False
        t0 = time.perf_counter()
        try:
            if not conn.guard.call(lambda: conn.client.shm_available(conn.namespace)):
                return False
            load_keys = rank_keys([k for t in loads for k in t.keys], conn.rank)
            save_keys = self._save_keys(saves)
            try:
                self.read, write = conn.guard.call(
                    lambda: conn.client.acquire_allocate(
                        conn.namespace,
                        load_keys,
                        save_keys,
                        ttl_s=conn.config.lease_ttl_s,
                        allocate_if_loaded=True,
                    )
                )
            except KVCacheRpcError as e:
                if node_gone(e) or isinstance(e, BreakerOpen):  # as an Acquire would have
                    self._loads_failed(loads, len(load_keys), e)
                    self._drop_saves(saves)
                    return True
                if e.code == grpc.StatusCode.UNIMPLEMENTED:  # an older node
                    conn.merge_calls = False
                log.debug("kvcache AcquireAllocate refused (%s); separate calls this step", e)
                return False
        except KVCacheRpcError:
            return False  # the separate calls meet the same error and handle it
        finally:
            self.stats.acquire_s += time.perf_counter() - t0
        self._plan_loads(loads, *self._read_pages(self.read))
        if self.load_failed:
            self._drop_saves(saves)
            if write is not None:  # found, but not where this step can read it
                self._give_back(write)
        elif write is not None:
            self.write = write
            self._plan_write()
        return True

    def _give_back(self, write: WriteLease) -> None:
        try:
            self.conn.guard.call(write.abort)
        except KVCacheRpcError as e:
            log.info("kvcache abort failed (%s); the lease expires by itself", e)

    def _start_loads(self, loads: list[_Transfer]) -> None:
        t0 = time.perf_counter()
        try:
            self._take_loads(loads)
        finally:
            self.stats.acquire_s += time.perf_counter() - t0

    def _take_loads(self, loads: list[_Transfer]) -> None:
        conn = self.conn
        keys = rank_keys([k for t in loads for k in t.keys], conn.rank)
        page_bytes = self.layout.page_bytes
        try:
            if conn.guard.call(lambda: conn.client.shm_available(conn.namespace)):
                self.read = conn.guard.call(
                    lambda: conn.client.acquire(
                        conn.namespace, keys=keys, ttl_s=conn.config.lease_ttl_s
                    )
                )
                pages, offsets = self._read_pages(self.read)
            else:
                wait = conn.bulk_timeout(len(keys) * page_bytes)
                got = conn.guard.call(
                    lambda: conn.client.get(conn.namespace, keys=keys, timeout_s=wait)
                )
                buf = np.zeros((len(keys), page_bytes), np.uint8)
                offsets = []
                for i, page in enumerate(got):
                    if page is not None:
                        buf[i] = page
                    offsets.append(i * page_bytes if page is not None else -1)
                pages = _Pages(buf.reshape(-1), self.vblock_bytes, conn._word)
        except KVCacheRpcError as e:
            self._loads_failed(loads, len(keys), e)
            return
        self._plan_loads(loads, pages, offsets)

    def _read_pages(self, read: ReadLease) -> tuple[_Pages, list[int]]:
        """The shared memory a read lease's offsets point into, and its pages' offsets (-1: not
        found)."""
        assert read.slab is not None
        pages = _Pages(read.slab.array, self.vblock_bytes, self.conn._word)
        return pages, [o if t is not None else -1 for o, t in zip(read.offsets, read.tiers)]

    def _loads_failed(self, loads: list[_Transfer], pages: int, e: KVCacheRpcError) -> None:
        conn = self.conn
        log.warning("kvcache load of %d pages failed (%s); vLLM recomputes them", pages, e)
        for t in loads:
            conn._failed(t.vblocks)
        self.stats.load_failed_blocks += sum(len(t.vblocks) for t in loads)
        self.load_failed = True

    def _plan_loads(self, loads: list[_Transfer], pages: _Pages, offsets: list[int]) -> None:
        conn, page_bytes = self.conn, self.layout.page_bytes
        src: list[int] = []
        dst: list[int] = []
        i = 0
        for t in loads:
            offs = offsets[i : i + len(t.keys)]
            i += len(t.keys)
            # Only a leading run of pages is usable: the chain breaks at the first missing one.
            n = next((k for k, o in enumerate(offs) if o < 0 or o % self.vblock_bytes), len(offs))
            s, d = self._rows(
                t, [(t.first_page + k, o // self.vblock_bytes) for k, o in enumerate(offs[:n])]
            )
            src += s
            dst += d
            missing = t.vblocks[len(d) :]
            if missing:
                conn._failed(missing)
                self.stats.load_failed_blocks += len(missing)
                self.load_failed = True
            self.stats.loaded_pages += n
            self.stats.loaded_bytes += n * page_bytes
        self.load_plan = (pages, _RowMap(src, dst))

    def _start_saves(self, saves: list[_Transfer]) -> None:
        t0 = time.perf_counter()
        try:
            self._send_allocate(saves)
        finally:
            self.stats.allocate_s += time.perf_counter() - t0

    def _save_keys(self, saves: list[_Transfer]) -> list[bytes]:
        """The keys to allocate for ``saves``. Requests of one step that share a prefix save the
        same blocks: each key is written once, by its first request (``_slots``: the key's place
        among the unique keys, -1 for a repeat); the node refuses an Allocate that names a key
        twice."""
        unique: dict[bytes, int] = {}
        self._slots = []
        for k in rank_keys([k for t in saves for k in t.keys], self.conn.rank):
            self._slots.append(-1 if k in unique else unique.setdefault(k, len(unique)))
        self.saves = saves
        return list(unique)

    def _send_allocate(self, saves: list[_Transfer]) -> None:
        conn = self.conn
        keys = self._save_keys(saves)
        ttl = conn.config.lease_ttl_s
        try:
            shm = conn.guard.call(lambda: conn.client.shm_available(conn.namespace))
            if shm and conn.overlap:
                self._allocating = conn.guard.call(
                    lambda: conn.client.allocate_async(conn.namespace, keys=keys, ttl_s=ttl)
                )
            elif shm:
                lease = conn.guard.call(
                    lambda: conn.client.allocate(conn.namespace, keys=keys, ttl_s=ttl)
                )
                self._allocating = Future()
                self._allocating.set_result(lease)
        except KVCacheRpcError as e:  # a cache: a failed save only costs a future hit
            log.warning("kvcache save of %d pages skipped (%s)", len(keys), e)
            return
        if not shm:
            page_bytes = self.layout.page_bytes
            self.streamed_out = np.zeros((len(keys), page_bytes), np.uint8)
            self.save_keys = keys
            self._plan_saves(
                _Pages(self.streamed_out.reshape(-1), self.vblock_bytes, conn._word),
                [j * page_bytes if j >= 0 else -1 for j in self._slots],
            )

    def _take_saves(self) -> None:
        """Wait for the step's Allocate (sent at the step's start) and plan the copies."""
        allocating, self._allocating = self._allocating, None
        if allocating is None:
            return
        t0 = time.perf_counter()
        try:
            self.write = self.conn.guard.result(allocating, self.conn.client.timeout_s + 1)
        except KVCacheRpcError as e:  # a cache: a failed save only costs a future hit
            n = sum(len(t.keys) for t in self.saves)
            log.warning("kvcache save of %d pages skipped (%s)", n, e)
            return
        finally:
            self.stats.allocate_s += time.perf_counter() - t0
        self._plan_write()

    def _plan_write(self) -> None:
        assert self.write is not None and self.write.slab is not None
        pages = _Pages(self.write.slab.array, self.vblock_bytes, self.conn._word)
        offsets = self.write.offsets
        self._plan_saves(pages, [offsets[j] if j >= 0 else -1 for j in self._slots])
        self._written = [j for j, o in enumerate(offsets) if o >= 0]
        if self._written:
            pb, slab = self.layout.page_bytes, self.write.slab.array
            views = [slab[offsets[j] : offsets[j] + pb] for j in self._written]
            self._sums = LayerChecksums.make(views, self.layout.layer_bytes)

    def _plan_saves(self, pages: _Pages, offsets: list[int]) -> None:
        src: list[int] = []
        dst: list[int] = []
        i = 0
        for t in self.saves:
            offs = offsets[i : i + len(t.keys)]
            i += len(t.keys)
            # A page already stored (by anyone) has offset -1: skipped.
            todo = [
                (t.first_page + k, o // self.vblock_bytes) for k, o in enumerate(offs) if o >= 0
            ]
            s, d = self._rows(t, todo)
            src += s
            dst += d
            self.stats.saved_pages += len(todo)
            self.stats.saved_bytes += len(todo) * self.layout.page_bytes
        if src:
            self.save_plan = (pages, _RowMap(src, dst))

    # -- per layer ------------------------------------------------------------------------------

    def load_layer(self, layer: int) -> None:
        if self.load_plan is None or layer in self.loaded_layers:
            return
        self.loaded_layers.add(layer)
        pages, rows = self.load_plan
        if rows.count:
            t0 = time.perf_counter()
            rows.to_blocks(pages.rows_view, layer * self.layer_rows, self.conn._layers[layer])
            self.stats.load_copy_s += time.perf_counter() - t0

    def load_all(self) -> None:
        for layer in range(self.layout.num_layers):
            self.load_layer(layer)

    def save_layer(self, layer: int) -> None:
        self._take_saves()
        if self.save_plan is None or layer in self.saved_layers:
            return
        self.saved_layers.add(layer)
        pages, rows = self.save_plan
        t0 = time.perf_counter()
        rows.to_pages(self.conn._layers[layer], pages.rows_view, layer * self.layer_rows)
        if self._sums is not None:
            self._sums.layer(layer)
        self.stats.save_copy_s += time.perf_counter() - t0

    def _checksums(self) -> np.ndarray | None:
        """The write lease's checksums, one per key (0: a key it had nothing to write for);
        None unless every layer was hashed, in order (the node then hashes the pages)."""
        taken, self._sums = self._sums, None
        if taken is None or self.write is None:
            return None
        sums = taken.sums(len(self.write.keys), self._written, self.layout.num_layers)
        if sums is not None:
            self.stats.checksummed_pages += len(self._written)
        return sums

    def finish(self) -> None:
        conn = self.conn
        for layer in range(self.layout.num_layers):  # layers no save_kv_layer call reached
            self.save_layer(layer)
        t0 = time.perf_counter()
        sums = self._checksums()
        try:
            if self.write is not None and self.read is not None and conn.merge_calls:
                # One round trip ends both leases (the read one whatever the commit's outcome).
                write, read, self.read = self.write, self.read, None
                if conn.overlap:
                    conn._send("commit", conn.client.commit_release_async(write, read, sums))
                else:
                    conn.guard.call(lambda: conn.client.commit_release(write, read, sums))
            elif self.write is not None and conn.overlap:
                # The pages are written: vLLM may reuse its blocks; the commit needs no waiting.
                write = self.write
                conn._send("commit", conn.client.commit_async(write, sums))
            elif self.write is not None:
                write = self.write
                conn.guard.call(lambda: write.commit(sums))
            elif self.streamed_out is not None and self.save_plan is not None:
                out, keys = list(self.streamed_out), self.save_keys
                wait = conn.bulk_timeout(len(out) * self.layout.page_bytes)
                conn.guard.call(
                    lambda: conn.client.put(conn.namespace, out, keys=keys, timeout_s=wait)
                )
        except KVCacheRpcError as e:
            log.warning("kvcache commit failed (%s); those blocks stay uncached", e)
        finally:
            self.write = None
            self._release()
            self.stats.finish_s += time.perf_counter() - t0

    def abort(self) -> None:
        try:
            self._take_saves()
            if self.write is not None:
                self.conn.guard.call(self.write.abort)
        except KVCacheRpcError:
            pass
        self.write = None
        self._release()

    def _release(self) -> None:
        read, self.read = self.read, None
        if read is None:
            return
        if self.conn.overlap:
            self.conn._send("release", self.conn.client.release_async(read))
            return
        try:
            self.conn.guard.call(read.release)
        except KVCacheRpcError as e:
            log.info("kvcache release failed (%s); the lease expires by itself", e)
