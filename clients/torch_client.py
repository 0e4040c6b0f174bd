"""Layer-wise KV load and store between torch tensors and a kvcache node.

``TorchKVClient`` binds a node client (``KVStoreClient``) to one model layout (its namespace) and
moves one request's KV cache layer by layer:

    kv = TorchKVClient.connect("127.0.0.1:7000", layout)
    req = kv.request(prompt_ids)                  # block keys, computed once
    n = kv.lookup(req)                            # cached prefix, tokens (full blocks only)
    with kv.load(req, n) as load:                 # layer 0 starts loading now
        for layer in range(L):
            k, v = load.layer(layer)              # waits for layer l; layer l+1 loads meanwhile
            ...compute layer l over the uncached suffix...
    store = kv.store(req, first_block=n // block_tokens, tensor_layout=HFLayout(start=n))
    for layer in range(L):
        store.put_layer(layer, k_new, v_new)      # copied in the background
    store.finish()                                # pages published atomically (or store.abort())

Data paths. Same host: pages are read from and written to the node's shared-memory slab in place
(one copy between the caller's tensors and the page, nothing through the server). Remote node
(or ``use_shm=False``): loads fetch pages with streamed ``Get`` calls into host memory, stores
assemble pages in host memory and send them with one streamed ``Put`` at ``finish()``. A page
holds every layer of its block, so a streamed load has all pages before layer 0 is ready; only
the per-layer copies into the caller's tensors then overlap compute.

Failure. A load that loses the node part-way keeps the blocks it received, logs a warning and
reports the shorter prefix in ``num_tokens``: the caller recomputes the rest. A shared-memory load
whose pages are already pinned needs no more calls to the node: the pages stay mapped and the
load completes; only the final release fails (logged). Store failures raise ``KVCacheRpcError``
from ``finish()``; callers that treat the store as a cache (``hf_adapter``) log and go on.

Tensor layouts: ``HFLayout`` (``[1, kv_heads, seq, head_dim]``) and ``PagedLayout``
(``[num_blocks, block_tokens, kv_heads, head_dim]`` + block table); see ``torch_layout``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import grpc
import numpy as np
import torch
from numpy.typing import NDArray

from kvstore.keys import BlockKey, block_keys, root_key, tokens_as_array
from kvstore.layout import KVLayout
from kvstore.payload import LayerChecksums

from .node_client import KVCacheRpcError, KVStoreClient, ReadLease, WriteLease
from .torch_layout import HFLayout, KVTensorLayout, PagedLayout, PageRun, page_runs
from .torch_transfer import CpuCopier, make_copier

log = logging.getLogger(__name__)


class LayoutMismatchError(ValueError):
    """The node serves no namespace for the model's KV layout."""


class LoadError(RuntimeError):
    """A layer could not be loaded; the caller must recompute the prefix."""


@dataclass(frozen=True, slots=True)
class KVRequest:
    """One request's token ids and the chained keys of its full blocks (computed once)."""

    tokens: NDArray[np.uint32]
    keys: list[BlockKey]
    block_tokens: int

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def full_blocks(self) -> int:
        return len(self.keys)


@dataclass(frozen=True, slots=True)
class LoadProgress:
    """Reported from the loader thread: ``stage`` "blocks" (pages received over the streamed
    path, ``done`` of ``total``) or "layer" (layer ``done - 1`` is loaded, of ``total``)."""

    stage: str
    done: int
    total: int


@dataclass(frozen=True, slots=True)
class StoreResult:
    blocks: int  # full blocks this store covered
    written: int  # pages written by this client
    stored: int  # pages newly published by the node
    duplicates: int  # pages another writer published first


class TorchKVClient:
    """A node client bound to one model layout; see the module docstring.

    ``lease_ttl_s``: pin / write-lease time asked of the node (0: the node's default); make it
    longer than a prefill. ``fetch_blocks``: pages per streamed ``Get``. ``prefetch_layers``:
    layers loaded ahead of the one the caller waits for.
    """

    def __init__(
        self,
        client: KVStoreClient,
        layout: KVLayout,
        salt: bytes | str = b"",
        device: str | torch.device = "cpu",
        lease_ttl_s: float = 0.0,
        fetch_blocks: int = 16,
        prefetch_layers: int = 1,
        owns_client: bool = False,
    ) -> None:
        if fetch_blocks <= 0 or prefetch_layers < 0:
            raise ValueError("fetch_blocks must be positive and prefetch_layers >= 0")
        self.client = client
        self.layout = layout
        self.namespace = layout.namespace
        self.salt = salt.encode() if isinstance(salt, str) else salt
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device}: no CUDA device here; use device='cpu'")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device} is not supported (cpu or cuda)")
        self.lease_ttl_s = lease_ttl_s
        self.fetch_blocks = fetch_blocks
        self.prefetch_layers = prefetch_layers
        self._owns_client = owns_client
        check_layout_served(client, layout)
        self._root = root_key(self.namespace, self.salt)
        self.shared_memory = client.shm_available(self.namespace)
        # One copier per device for every request: on CUDA one side stream and one set of
        # pinned staging buffers, not one per request.
        self._copiers: dict[torch.device, CpuCopier] = {}
        self._copiers_lock = threading.Lock()
        # One worker each: loads run in layer order, stores in hand-over order, and a load never
        # waits behind a store.
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        self._storer = ThreadPoolExecutor(1, thread_name_prefix="kv-store")

    @classmethod
    def connect(
        cls,
        address: str,
        layout: KVLayout,
        token: str | None = None,
        use_shm: bool = True,
        salt: bytes | str = b"",
        device: str | torch.device = "cpu",
        lease_ttl_s: float = 0.0,
        fetch_blocks: int = 16,
        prefetch_layers: int = 1,
    ) -> "TorchKVClient":
        client = KVStoreClient(address, token=token, use_shm=use_shm)
        try:
            return cls(
                client,
                layout,
                salt,
                device,
                lease_ttl_s,
                fetch_blocks,
                prefetch_layers,
                owns_client=True,
            )
        except BaseException:
            client.close()
            raise

    # ---- requests ------------------------------------------------------------------------------

    def request(self, tokens: Any) -> KVRequest:
        """Token ids (list / numpy / 1-D torch) -> their block keys (a trailing partial block
        has none and is never cached)."""
        arr = tokens_as_array(tokens)
        return KVRequest(
            arr, block_keys(arr, self.layout.block_tokens, self._root), self.layout.block_tokens
        )

    def _as_request(self, tokens_or_request: KVRequest | Any) -> KVRequest:
        if isinstance(tokens_or_request, KVRequest):
            return tokens_or_request
        return self.request(tokens_or_request)

    def lookup(self, tokens_or_request: KVRequest | Any) -> int:
        """Cached prefix length in tokens (a multiple of block_tokens)."""
        req = self._as_request(tokens_or_request)
        if not req.keys:
            return 0
        hit = self.client.lookup(self.namespace, keys=req.keys).hit_blocks
        return hit * self.layout.block_tokens

    # ---- layer-wise load / store -------------------------------------------------------------

    def load(
        self,
        tokens_or_request: KVRequest | Any,
        num_tokens: int | None = None,
        tensor_layout: KVTensorLayout | None = None,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        on_progress: Callable[[LoadProgress], None] | None = None,
    ) -> "LayerwiseLoad":
        """Start loading the cached prefix (at most ``num_tokens``; default: all cached blocks).

        ``tensor_layout``: ``HFLayout(capacity=...)`` (default; the load allocates each layer's
        K and V) or ``PagedLayout(block_table)`` with ``kv_caches`` = per layer (K, V) caches to
        fill. Raises ``KVCacheRpcError`` if the node cannot pin the pages.
        """
        req = self._as_request(tokens_or_request)
        cached = req.full_blocks * self.layout.block_tokens
        num_tokens = cached if num_tokens is None else num_tokens
        if not 0 <= num_tokens <= req.num_tokens:
            raise ValueError(f"num_tokens={num_tokens} outside [0, {req.num_tokens}]")
        num_tokens = min(num_tokens, cached)
        return LayerwiseLoad(
            self, req, num_tokens, tensor_layout or HFLayout(), kv_caches, on_progress
        )

    def store(
        self,
        tokens_or_request: KVRequest | Any,
        first_block: int = 0,
        tensor_layout: KVTensorLayout | None = None,
    ) -> "LayerwiseStore":
        """Store the request's full blocks from ``first_block`` on, one layer at a time.

        ``tensor_layout``: where ``put_layer``'s tensors hold the request's tokens; default
        ``HFLayout(start=first_block * block_tokens)`` (the K/V of the new tokens only).
        Allocates the pages now (raises ``KVCacheRpcError`` if the node cannot).
        """
        req = self._as_request(tokens_or_request)
        if not 0 <= first_block <= req.full_blocks:
            raise ValueError(
                f"first_block={first_block} outside [0, {req.full_blocks}] (the "
                "request's full blocks)"
            )
        if tensor_layout is None:
            tensor_layout = HFLayout(start=first_block * self.layout.block_tokens)
        return LayerwiseStore(self, req, first_block, tensor_layout)

    # ---- plumbing ------------------------------------------------------------------------------

    def copier(self, device: torch.device) -> CpuCopier:
        """This client's copier for ``device`` (made on first use, then shared by requests)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with self._copiers_lock:
            copier = self._copiers.get(device)
            if copier is None:
                copier = self._copiers[device] = make_copier(self.layout, device)
            return copier

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        self._storer.shutdown(wait=True)
        self._copiers.clear()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> "TorchKVClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_layout_served(client: KVStoreClient, layout: KVLayout) -> None:
    """Raise ``LayoutMismatchError`` naming the differing fields if the node does not serve it
    and will not (a node started without --layout registers it)."""
    served = {ns: client.layout(ns) for ns in client.namespaces()}
    if layout.namespace in served:
        return
    try:
        client.register_layout(layout)
        return
    except KVCacheRpcError as e:
        if e.code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED):
            raise
        refused = f" ({e.details})"
    mine = layout.to_dict()
    lines = []
    for ns, other in served.items():
        diff = [f"{k} {mine[k]!r} vs {v!r}" for k, v in other.to_dict().items() if mine[k] != v]
        lines.append(f"  {ns}: differs in {', '.join(diff)}")
    raise LayoutMismatchError(
        f"node {client.address} does not serve the model's KV layout {layout.namespace}"
        f"{refused}; it serves:\n"
        + ("\n".join(lines) or "  (nothing)")
        + "\nstart the node with --layout "
        + ",".join(f"{k}={v}" for k, v in mine.items())
        + " or build the client with the node's layout"
    )


class LayerwiseLoad:
    """One request's cached prefix, loaded layer by layer in the background.

    ``layer(l)`` returns layer ``l``'s (K, V) once loaded and keeps ``prefetch_layers`` layers
    loading ahead; ``num_tokens`` is the prefix actually loaded (shorter than asked if the node
    evicted blocks or was lost part-way: ``error`` says why). ``close()`` releases the pins.
    """

    def __init__(
        self,
        kv: TorchKVClient,
        req: KVRequest,
        num_tokens: int,
        tensor_layout: KVTensorLayout,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
        on_progress: Callable[[LoadProgress], None] | None,
    ) -> None:
        self._kv = kv
        self._req = req
        self._layout = kv.layout
        self._on_progress = on_progress
        self._tensor_layout = tensor_layout
        self._futures: dict[int, Future[None]] = {}
        self._lease: ReadLease | None = None
        self._closed = False
        self.error: Exception | None = None
        self.requested_tokens = num_tokens
        self.wait_s = 0.0  # time the caller spent blocked in layer(): load not hidden by compute
        bt = self._layout.block_tokens
        want = math.ceil(num_tokens / bt)
        L = self._layout.num_layers

        # Destination tensors exist before any copy (on the caller's stream, for CUDA).
        if isinstance(tensor_layout, PagedLayout):
            if kv_caches is None or len(kv_caches) != L:
                raise ValueError(f"a paged load needs kv_caches: one (K, V) per layer ({L})")
            for l, (k, v) in enumerate(kv_caches):
                tensor_layout.check(k, v, self._layout, 0, num_tokens, f"kv_caches[{l}]")
            self._dst: list[tuple[torch.Tensor, ...]] = [tuple(pair) for pair in kv_caches]
            device = kv_caches[0][0].device
        else:
            if tensor_layout.start != 0:
                raise ValueError("a load fills the prefix from token 0: HFLayout(start=0)")
            device = kv.device
            self._dst = [tensor_layout.allocate(self._layout, num_tokens, device) for _ in range(L)]
        self._copier = kv.copier(device)
        self._copier.begin()
        self._ready: dict[int, torch.cuda.Event | None] = {}  # per layer: what the caller awaits

        self._extent: Future[tuple[list[PageRun], int]] = Future()
        if want == 0:
            self._extent.set_result(([], 0))
        elif kv.shared_memory:
            self._extent.set_result(self._pin(want))
        else:
            self._extent = kv._loader.submit(self._fetch_streamed, want)
        for l in range(min(1 + kv.prefetch_layers, L)):
            self._submit(l)

    # ---- sources -------------------------------------------------------------------------------

    def _runs(self, pages: Sequence[NDArray[np.uint8]]) -> tuple[list[PageRun], int]:
        """The runs of the prefix's pages received, and its tokens (the last block may be cut)."""
        bt = self._layout.block_tokens
        n = min(len(pages) * bt, self.requested_tokens)
        blocks = math.ceil(n / bt)
        runs = page_runs(
            range(blocks), pages[:blocks], self._layout, self._tensor_layout, n - (blocks - 1) * bt
        )
        return runs, n

    def _pin(self, want: int) -> tuple[list[PageRun], int]:
        kv = self._kv
        lease = kv.client.acquire(
            kv.namespace, keys=self._req.keys[:want], prefix_only=True, ttl_s=kv.lease_ttl_s
        )
        self._lease = lease
        hit = lease.hit_blocks
        in_slab = next((i for i in range(hit) if lease.offsets[i] < 0), hit)
        if in_slab < hit:
            log.info(
                "kvcache: blocks %d.. of the prefix are not in shared memory; loading %d "
                "of %d cached blocks",
                in_slab,
                in_slab,
                hit,
            )
        return self._runs([lease.page(i) for i in range(in_slab)])

    def _fetch_streamed(self, want: int) -> tuple[list[PageRun], int]:
        kv = self._kv
        keys = self._req.keys[:want]
        pages: list[NDArray[np.uint8]] = []
        try:
            for a in range(0, want, kv.fetch_blocks):
                got = kv.client.get(
                    kv.namespace, keys=keys[a : a + kv.fetch_blocks], prefix_only=True
                )
                for page in got:
                    if page is None:
                        break
                    pages.append(page)
                if len(pages) < min(a + kv.fetch_blocks, want):
                    break  # evicted since the lookup: the prefix ends here
                self._report("blocks", len(pages), want)
        except KVCacheRpcError as e:
            self.error = e
            log.warning(
                "kvcache: lost node %s while loading (%s); received %d of %d blocks, the "
                "caller recomputes the rest",
                kv.client.address,
                e,
                len(pages),
                want,
            )
        return self._runs(pages)

    # ---- layers --------------------------------------------------------------------------------

    def _report(self, stage: str, done: int, total: int) -> None:
        if self._on_progress is not None:
            self._on_progress(LoadProgress(stage, done, total))

    def _submit(self, layer: int) -> None:
        if layer not in self._futures and not self._closed:
            self._futures[layer] = self._kv._loader.submit(self._load_layer, layer)

    def _load_layer(self, layer: int) -> None:
        runs, n = self._extent.result()
        k, v = self._dst[layer]
        self._ready[layer] = self._copier.load_layer(runs, layer, self._tensor_layout, k, v, n)
        self._report("layer", layer + 1, self._layout.num_layers)

    @property
    def num_tokens(self) -> int:
        """Tokens of prefix loaded (waits for the streamed fetch to finish)."""
        return self._extent.result()[1]

    @property
    def cached_blocks(self) -> int:
        return math.ceil(self.num_tokens / self._layout.block_tokens)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s (K, V) holding the prefix: HF ``[1, H, num_tokens, D]`` (or
        ``capacity`` long), paged: the caller's caches with the prefix blocks filled."""
        if self._closed:
            raise LoadError("the load is closed")
        if not 0 <= layer < self._layout.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self._layout.num_layers})")
        for l in range(layer, min(layer + 1 + self._kv.prefetch_layers, self._layout.num_layers)):
            self._submit(l)
        t0 = time.perf_counter()
        try:
            self._futures[layer].result()
        except Exception as e:
            raise LoadError(f"loading layer {layer} failed: {e}") from e
        finally:
            self.wait_s += time.perf_counter() - t0
        self._copier.wait_loaded(self._ready.get(layer))
        k, v = self._dst[layer]
        if isinstance(self._tensor_layout, HFLayout) and self._tensor_layout.capacity is None:
            n = self.num_tokens
            return k[:, :, :n], v[:, :, :n]
        return k, v

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        for l in range(self._layout.num_layers):
            yield (l, *self.layer(l))

    def close(self) -> None:
        """Stop prefetching and release the pins (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for f in self._futures.values():
            f.cancel()
        # NOTE: running copies read the pinned pages: let them end before unpinning.
        running: list[Future[Any]] = [self._extent, *self._futures.values()]
        wait(running)
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                lease.release()
            except KVCacheRpcError as e:
                log.warning(
                    "kvcache: could not release the load's pins on %s (%s); the node "
                    "frees them when the lease expires",
                    self._kv.client.address,
                    e,
                )

    def __enter__(self) -> "LayerwiseLoad":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LayerwiseStore:
    """Store the request's full blocks ``[first_block, full_blocks)`` layer by layer.

    ``put_layer(l, k, v)`` queues layer ``l``'s copy (the caller must not modify ``k``/``v`` in
    place until ``finish()``); ``finish()`` waits for the copies and publishes every page at once;
    ``abort()`` drops them. Leaving a ``with`` block without ``finish()`` aborts.
    """

    def __init__(
        self, kv: TorchKVClient, req: KVRequest, first_block: int, tensor_layout: KVTensorLayout
    ) -> None:
        self._kv = kv
        self._layout = kv.layout
        self._tensor_layout = tensor_layout
        self.first_block = first_block
        self._keys = req.keys[first_block:]
        self._end_token = req.full_blocks * self._layout.block_tokens
        self._put = [False] * self._layout.num_layers
        self._futures: list[Future[None]] = []
        self._copier: CpuCopier | None = None
        self._lease: WriteLease | None = None
        self._buffer: NDArray[np.uint8] | None = None
        self._done = False
        self._targets: tuple[list[int], list[NDArray[np.uint8]]] = ([], [])  # blocks, pages
        self._runs: list[PageRun] | None = None  # made at the first put_layer (tables checked)
        self._written = 0  # pages this store writes (keys not stored yet)
        self.copy_s = 0.0  # worker time spent copying layers (overlaps the caller's compute)
        self.finish_s = 0.0  # time finish() made the caller wait: last copies + publish
        self.publish_s = 0.0  # the publish alone: Commit (the node seals each page) or the Put
        if not self._keys:
            return
        if kv.shared_memory:
            lease = kv.client.allocate(kv.namespace, keys=self._keys, ttl_s=kv.lease_ttl_s)
            self._lease = lease
            todo = lease.to_write
            self._targets = ([first_block + i for i in todo], [lease.page(i) for i in todo])
        else:
            self._buffer = np.empty((len(self._keys), self._layout.page_bytes), dtype=np.uint8)
            self._targets = (
                list(range(first_block, first_block + len(self._keys))),
                list(self._buffer),
            )
        self._written = len(self._targets[0])
        # NOTE: each layer's slices are hashed right after the worker copies them (from cache),
        # and the Commit carries the checksums: the node would read every page back to hash it
        # (bench layerwise: 10 ms of a 64 MiB put's ~30). Layers put out of order: no checksums.
        self._sums: LayerChecksums | None = None
        if self._lease is not None:
            self._sums = LayerChecksums.make(self._targets[1], self._layout.layer_bytes)

    @property
    def blocks(self) -> int:
        return len(self._keys)

    def put_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Hand over layer ``layer``'s K and V (in the store's tensor layout)."""
        if self._done:
            raise RuntimeError("the store is finished or aborted")
        if not 0 <= layer < self._layout.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self._layout.num_layers})")
        if self._put[layer]:
            raise ValueError(f"layer {layer} was already stored")
        if self._keys:
            self._tensor_layout.check(
                k, v, self._layout, self.first_block, self._end_token, f"layer {layer}"
            )
        self._put[layer] = True
        if not self._written:
            return
        if self._runs is None:
            self._runs = page_runs(*self._targets, self._layout, self._tensor_layout)
        if self._copier is None:
            self._copier = self._kv.copier(k.device)
        ready = self._copier.mark_computed(k, v)
        self._futures.append(self._kv._storer.submit(self._copy_layer, layer, k, v, ready))

    def _copy_layer(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, ready: torch.cuda.Event | None
    ) -> None:
        t0 = time.perf_counter()
        # put_layer sets both before it queues a copy
        assert self._copier is not None and self._runs is not None
        # the one worker thread: layers hashed in the order put
        hashed = self._copier.store_layer(
            self._runs,
            layer,
            self._tensor_layout,
            k,
            v,
            ready,
            self.first_block,
            self.blocks,
            self._sums,
        )
        if self._sums is not None and not hashed:
            self._sums.layer(layer)
        self.copy_s += time.perf_counter() - t0

    def finish(self) -> StoreResult:
        """Wait for the copies, publish the pages; raises ``KVCacheRpcError`` if the node fails."""
        if self._done:
            raise RuntimeError("the store is finished or aborted")
        missing = [l for l, put in enumerate(self._put) if not put]
        if missing and self._keys:
            self.abort()
            raise ValueError(f"layers {missing} were never stored; the pages were dropped")
        t0 = time.perf_counter()
        try:
            for f in self._futures:
                f.result()  # a failed copy raises here, before anything is published
        except BaseException:
            self.abort()
            raise
        self._done = True
        lease, buffer, self._lease, self._buffer = self._lease, self._buffer, None, None
        written = self._written
        self._targets, self._runs = ([], []), None
        t1 = time.perf_counter()
        try:
            if lease is not None:
                sums, self._sums = self._sums, None
                n, layers = len(lease.keys), self._layout.num_layers
                r = lease.commit(sums.sums(n, lease.to_write, layers) if sums is not None else None)
            elif buffer is not None:
                r = self._kv.client.put(self._kv.namespace, list(buffer), keys=self._keys)
            else:
                return StoreResult(self.blocks, 0, 0, 0)
        finally:
            t2 = time.perf_counter()
            self.finish_s, self.publish_s = t2 - t0, t2 - t1
        return StoreResult(self.blocks, written, r.stored, r.duplicates)

    def abort(self) -> None:
        """Drop the pages (idempotent); a lost node is logged, its lease expires there."""
        if self._done and self._lease is None and self._buffer is None:
            return  # finished (published or failed) or aborted already
        self._done = True
        for f in self._futures:
            f.cancel()
        wait(self._futures)
        lease, self._lease, self._buffer = self._lease, None, None
        if lease is not None:
            try:
                lease.abort()
            except KVCacheRpcError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:
                    log.warning(
                        "kvcache: could not abort the store's lease on %s (%s); the "
                        "node frees the pages when the lease expires",
                        self._kv.client.address,
                        e,
                    )

    def __enter__(self) -> "LayerwiseStore":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self.abort()
