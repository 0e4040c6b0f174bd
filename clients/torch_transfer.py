"""Per-layer copies between host pages and the caller's KV tensors, on CPU or CUDA.

``make_copier(device)`` returns the engine for the caller's device:

- ``CpuCopier``: the worker thread copies page rows straight into / out of the caller's tensors
  (torch copies release the GIL, so they overlap the caller's compute on other cores).
- ``CudaCopier``: the worker thread gathers one layer's page rows into a pinned staging buffer, then
  issues the host->device copy and the scatter into the caller's tensors on a side stream and
  records one event per layer; the caller's stream waits on that event (no host sync). Stores
  run the other way: an event recorded on the caller's stream after it computed the layer, a
  device->pinned copy on the side stream, then pinned -> page on the worker thread.

Both work on lists of host pages viewed as ``[layers, 2, block_tokens, kv_heads, head_dim]``.
Worker-side methods run under ``torch.inference_mode()``: KV caches never need autograd, and the
caller's tensors may be inference tensors (a prefill under ``inference_mode``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvstore.layout import KVLayout

from .torch_layout import KVTensorLayout, torch_dtype


class CpuCopier:
    """Synchronous copies on the worker thread; nothing to wait for on the caller's side."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    def begin(self) -> None:
        """Called on the caller's thread once the destination tensors exist."""

    @torch.inference_mode()
    def load_layer(
        self,
        pages: Sequence[torch.Tensor],
        rows: Sequence[int],
        layer: int,
        dst: KVTensorLayout,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        bt = self.layout.block_tokens
        for i, (page, n) in enumerate(zip(pages, rows)):
            dst.view(k, i, n, bt).copy_(page[layer, 0, :n])
            dst.view(v, i, n, bt).copy_(page[layer, 1, :n])

    def wait_loaded(self, layer: int) -> None:
        """Called on the caller's thread before it uses a loaded layer."""

    def mark_computed(self, k: torch.Tensor, v: torch.Tensor) -> torch.cuda.Event | None:
        """Called on the caller's thread when it hands a computed layer to a store; returns
        what ``store_layer`` waits on (``ready``): nothing on the CPU."""
        return None

    @torch.inference_mode()
    def store_layer(
        self,
        targets: Sequence[tuple[int, torch.Tensor]],
        layer: int,
        src: KVTensorLayout,
        k: torch.Tensor,
        v: torch.Tensor,
        ready: torch.cuda.Event | None,
    ) -> None:
        bt = self.layout.block_tokens
        for block, page in targets:
            page[layer, 0].copy_(src.view(k, block, bt, bt))
            page[layer, 1].copy_(src.view(v, block, bt, bt))


class CudaCopier(CpuCopier):
    """Side-stream copies with one event per layer and pinned staging (see the module doc)."""

    SLOTS = 2  # pinned staging buffers in flight: layer l+1 fills while layer l's copy runs

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        super().__init__(layout)
        self.device = device
        # NOTE: torch.cuda.Stream() and torch.cuda.Event() (their __new__) are unannotated.
        self.side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._staging: list[torch.Tensor | None] = [None] * self.SLOTS
        self._slot_done: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self._layer_done: dict[int, torch.cuda.Event] = {}

    def _slot(self, index: int, blocks: int) -> torch.Tensor:
        slot = index % self.SLOTS
        done = self._slot_done[slot]
        if done is not None:
            done.synchronize()  # the copy that last read this pinned buffer has finished
        buf = self._staging[slot]
        shape = (blocks, 2, self.layout.block_tokens, self.layout.kv_heads, self.layout.head_dim)
        if buf is None or buf.shape[0] < blocks:
            buf = torch.empty(shape, dtype=torch_dtype(self.layout), pin_memory=True)
            self._staging[slot] = buf
        return buf[:blocks]

    def begin(self) -> None:
        # NOTE: the destination tensors were allocated on the caller's stream; order the side
        # stream after that allocation once, instead of syncing per layer.
        self.side.wait_stream(torch.cuda.current_stream(self.device))

    @torch.inference_mode()
    def load_layer(
        self,
        pages: Sequence[torch.Tensor],
        rows: Sequence[int],
        layer: int,
        dst: KVTensorLayout,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        bt = self.layout.block_tokens
        staging = self._slot(layer, len(pages))
        for i, page in enumerate(pages):
            staging[i].copy_(page[layer])
        with torch.cuda.stream(self.side):
            dev = staging.to(self.device, non_blocking=True)
            for i, n in enumerate(rows):
                dst.view(k, i, n, bt).copy_(dev[i, 0, :n])
                dst.view(v, i, n, bt).copy_(dev[i, 1, :n])
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self.side)
        self._slot_done[layer % self.SLOTS] = done
        self._layer_done[layer] = done

    def wait_loaded(self, layer: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self._layer_done[layer])

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
        targets: Sequence[tuple[int, torch.Tensor]],
        layer: int,
        src: KVTensorLayout,
        k: torch.Tensor,
        v: torch.Tensor,
        ready: torch.cuda.Event | None,
    ) -> None:
        bt = self.layout.block_tokens
        staging = self._slot(layer, len(targets))
        with torch.cuda.stream(self.side):
            assert ready is not None  # this copier's mark_computed always returns an event
            self.side.wait_event(ready)
            for j, (block, _) in enumerate(targets):
                staging[j, 0].copy_(src.view(k, block, bt, bt), non_blocking=True)
                staging[j, 1].copy_(src.view(v, block, bt, bt), non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self.side)
        done.synchronize()
        for j, (_, page) in enumerate(targets):
            page[layer].copy_(staging[j])


def make_copier(layout: KVLayout, device: torch.device) -> CpuCopier:
    if device.type == "cuda":
        return CudaCopier(layout, device)
    if device.type != "cpu":
        raise ValueError(f"device {device} is not supported (cpu or cuda)")
    return CpuCopier(layout)
