"""Per-layer copies between host pages and the caller's KV tensors, on CPU or CUDA.

A client keeps one copier per device for all its requests (``TorchKVClient.copier``):

- ``CpuCopier``: the worker thread copies each ``PageRun``'s slice of the layer straight into /
  out of the caller's tensors with numpy: one strided copy per run for K and one for V (numpy
  copies release the GIL, so they overlap the caller's compute on other cores).
- ``CudaCopier``: one side stream and one set of pinned staging buffers per client, reused by
  every request (a small ring per direction: loads run on the client's one loader thread, stores
  on its one storer thread). Staging keeps the pages' own order, ``[blocks, 2, block_tokens,
  kv_heads, head_dim]``: the host copies a page's layer as one contiguous run (a K/V transpose on
  the host was a strided copy at a fraction of memcpy's rate); the GPU reorders. A layer load
  gathers the runs' slices into pinned staging on the worker thread; then, on the side stream,
  one host->device copy, one scatter kernel into the caller's tensors, ``record_stream`` on them
  (the caller may drop a tensor before the side stream is done with it) and one event, which the
  caller's stream waits on (no host sync). A store runs the other way: an event recorded on the
  caller's stream once the layer is computed, a gather of K and V into one tensor in page order
  and one device->pinned copy on the side stream, then pinned -> pages on the worker.

Pages are host memory (the node's shared memory, or buffers of the streamed path) viewed as
``[layers, 2, block_tokens, kv_heads, head_dim]``; see ``torch_layout.PageRun``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvstore.layout import KVLayout
from kvstore.payload import LayerChecksums

from .torch_layout import KVTensorLayout, PageRun, host_array, torch_dtype


class CpuCopier:
    """Synchronous copies on the worker thread; nothing to wait for on the caller's side."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    def begin(self) -> None:
        """Called on the caller's thread once a load's destination tensors exist."""

    def load_layer(
        self,
        runs: Sequence[PageRun],
        layer: int,
        dst: KVTensorLayout,
        k: torch.Tensor,
        v: torch.Tensor,
        num_tokens: int,
    ) -> torch.cuda.Event | None:
        """Copy layer ``layer`` of the prefix's pages (tokens ``[0, num_tokens)``) into the
        caller's ``k``/``v``; returns what ``wait_loaded`` waits on (nothing on the CPU)."""
        bt = self.layout.block_tokens
        kn, vn = host_array(k), host_array(v)
        for run in runs:
            src = run.pages[:, layer, :, : run.rows]
            np.copyto(dst.blocks(kn, run, run.rows, bt), src[:, 0])
            np.copyto(dst.blocks(vn, run, run.rows, bt), src[:, 1])
        return None

    def wait_loaded(self, done: torch.cuda.Event | None) -> None:
        """Called on the caller's thread before it uses a loaded layer."""

    def mark_computed(self, k: torch.Tensor, v: torch.Tensor) -> torch.cuda.Event | None:
        """Called on the caller's thread when it hands a computed layer to a store; returns
        what ``store_layer`` waits on (``ready``): nothing on the CPU."""
        return None

    def store_layer(
        self,
        runs: Sequence[PageRun],
        layer: int,
        src: KVTensorLayout,
        k: torch.Tensor,
        v: torch.Tensor,
        ready: torch.cuda.Event | None,
        first_block: int,
        blocks: int,
        sums: LayerChecksums | None = None,
    ) -> bool:
        """Copy layer ``layer`` of request blocks ``[first_block, first_block + blocks)`` from
        the caller's ``k``/``v`` into the runs' pages (which cover those blocks, or some).
        ``sums``: the pages' checksums, fed in the same pass where the blocks' rows are
        contiguous (a paged KV cache); returns whether they were (else the caller feeds them)."""
        bt = self.layout.block_tokens
        kn, vn = host_array(k), host_array(v)
        parts = [
            (
                (run.pages[:, layer, 0], src.blocks(kn, run, bt, bt)),
                (run.pages[:, layer, 1], src.blocks(vn, run, bt, bt)),
            )
            for run in runs
        ]
        if sums is not None and sums.copies(layer, parts):
            return True
        for (kd, ks), (vd, vs) in parts:
            np.copyto(kd, ks)
            np.copyto(vd, vs)
        return False


class PinnedRing:
    """Pinned host staging buffers, ``[blocks, 2, block_tokens, kv_heads, head_dim]`` (page order),
    reused round-robin by one thread; a slot is refilled only after the copy that last used it
    has completed. Buffers grow to the largest request seen and are kept."""

    SLOTS = 2  # layer l+1 fills while layer l's copy runs

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._buffers: list[torch.Tensor | None] = [None] * self.SLOTS
        self._done: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self._next = 0

    def take(self, blocks: int) -> tuple[int, torch.Tensor]:
        slot, self._next = self._next, (self._next + 1) % self.SLOTS
        done = self._done[slot]
        if done is not None:
            done.synchronize()  # the copy that last read or wrote this buffer has finished
        L = self.layout
        shape = (blocks, 2, L.block_tokens, L.kv_heads, L.head_dim)
        need = int(np.prod(shape))
        buf = self._buffers[slot]
        if buf is None or buf.numel() < need:
            buf = torch.empty(need, dtype=torch_dtype(L), pin_memory=True)
            self._buffers[slot] = buf
        return slot, buf[:need].view(shape)

    def used(self, slot: int, done: torch.cuda.Event) -> None:
        self._done[slot] = done


class CudaCopier(CpuCopier):
    """Side-stream copies through pinned staging, one event per layer (see the module doc)."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        super().__init__(layout)
        self.device = device
        # NOTE: torch.cuda.Stream() and torch.cuda.Event() (their __new__) are unannotated.
        self.side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._loads = PinnedRing(layout)  # used by the client's loader thread only
        self._stores = PinnedRing(layout)  # used by the client's storer thread only

    def begin(self) -> None:
        # NOTE: the destination tensors were allocated on the caller's stream; order the side
        # stream after that allocation once, instead of syncing per layer.
        self.side.wait_stream(torch.cuda.current_stream(self.device))

    @torch.inference_mode()
    def load_layer(
        self,
        runs: Sequence[PageRun],
        layer: int,
        dst: KVTensorLayout,
        k: torch.Tensor,
        v: torch.Tensor,
        num_tokens: int,
    ) -> torch.cuda.Event | None:
        if not runs:
            return None
        blocks = runs[-1].first + len(runs[-1])  # a load's runs cover blocks [0, blocks)
        slot, staging = self._loads.take(blocks)
        st = host_array(staging)
        for run in runs:
            a, n = run.first, len(run)
            np.copyto(st[a : a + n, :, : run.rows], run.pages[:, layer, :, : run.rows])
        with torch.cuda.stream(self.side):
            dev = staging.to(self.device, non_blocking=True)
            dst.scatter(k, dev[:, 0], num_tokens)
            dst.scatter(v, dev[:, 1], num_tokens)
            # NOTE: k/v were allocated on the caller's stream and are written on the side
            # stream: without this, a caller that drops them early lets the allocator hand
            # their memory out while the copy still runs.
            k.record_stream(self.side)
            v.record_stream(self.side)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self.side)
        self._loads.used(slot, done)
        return done

    def wait_loaded(self, done: torch.cuda.Event | None) -> None:
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def mark_computed(self, k: torch.Tensor, v: torch.Tensor) -> torch.cuda.Event:
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(self.device))
        # NOTE: the side stream reads k/v later; keep the allocator from reusing their memory.
        k.record_stream(self.side)
        v.record_stream(self.side)
        return ready

    @torch.inference_mode()
    def store_layer(
        self,
        runs: Sequence[PageRun],
        layer: int,
        src: KVTensorLayout,
        k: torch.Tensor,
        v: torch.Tensor,
        ready: torch.cuda.Event | None,
        first_block: int,
        blocks: int,
        sums: LayerChecksums | None = None,
    ) -> bool:
        bt = self.layout.block_tokens
        slot, staging = self._stores.take(blocks)
        with torch.cuda.stream(self.side):
            assert ready is not None  # this copier's mark_computed always returns an event
            self.side.wait_event(ready)
            both = torch.stack(
                (src.gather(k, first_block, blocks, bt), src.gather(v, first_block, blocks, bt)),
                dim=1,
            )  # in page order, contiguous: one device->pinned copy
            staging.copy_(both, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self.side)
        self._stores.used(slot, done)
        done.synchronize()
        st = host_array(staging)
        for run in runs:
            a, n = run.first - first_block, len(run)
            np.copyto(run.pages[:, layer], st[a : a + n])
        return False  # NOTE: the caller hashes the layer from the pages


def make_copier(layout: KVLayout, device: torch.device) -> CpuCopier:
    if device.type == "cuda":
        return CudaCopier(layout, device)
    if device.type != "cpu":
        raise ValueError(f"device {device} is not supported (cpu or cuda)")
    return CpuCopier(layout)
