"""Page pools: fixed-size pages addressed by slot id, one pool per tier.

Every pool speaks the same small interface so that the store moves pages between tiers without
knowing where they live: slab pools (DRAM in shared memory, GPU/host torch slabs) address pages by
slot; the SSD pool (``ssd.py``) addresses them by key and uses the slot only for accounting.
``MetadataPool`` holds no bytes at all: the hit-rate benchmark replays traces through the real index
and policies with it.
"""

from __future__ import annotations

import mmap
from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np
import xxhash

from .payload import ByteView, copy_bytes, copy_checksum
from .shm import MemfdSegment, SharedSlab, page_up, unique_shm_name
from .tiers import Tier


class PagePool(ABC):
    tier: Tier
    num_pages: int
    page_bytes: int
    has_data: bool = True
    checksums: bool = False  # seals its pages with their xxh3-64 (``seal``)

    @abstractmethod
    def page_view(self, slot: int) -> ByteView | None:
        """A writable flat uint8 view of the page (numpy or torch), or None if not addressable."""

    def write_pages(
        self, slots: Sequence[int], keys: Sequence[bytes], datas: Sequence[ByteView]
    ) -> None:
        for slot, data in zip(slots, datas):
            copy_bytes(self.page_view(slot), data)

    def write_range(self, slots: Sequence[int], offset: int, rows: ByteView) -> None:
        """Copy ``rows[i]`` (``[len(slots), size]`` uint8) into bytes ``[offset, offset + size)``
        of page ``slots[i]``: one layer of a batch of pages."""
        size = rows.shape[1]
        for slot, row in zip(slots, rows):
            view = self.page_view(slot)
            if view is not None:
                copy_bytes(view[offset : offset + size], row)

    def read_page_into(self, slot: int, key: bytes, out: ByteView) -> bool:
        """Copy a page into ``out``; False when the page is gone or corrupt (its checksum): then
        ``out`` may hold any bytes, and the caller treats the page as missing."""
        copy_bytes(out, self.page_view(slot))
        return True

    def drop_pages(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        """Forget pages (slab pools need not do anything)."""

    def release(self, slots: Sequence[int]) -> None:
        """Free slots given back to a shared budget: their memory may go back to the system."""

    def seal(self, slot: int, checksum: int | None = None) -> None:
        """The page's bytes are final (committed, or moved in): remember its checksum, if this
        pool keeps them. ``checksum``: the page's xxh3-64 as its writer verified it, adopted
        instead of hashing the page again (a pool without checksums ignores it)."""

    def checksum(self, slot: int) -> int | None:
        """xxh3-64 of the page as sealed, or None when this pool keeps no checksums."""
        return None

    def close(self) -> None:
        """Release the backing memory or files."""


class SharedDramPool(PagePool):
    """DRAM pages in one shared-memory slab: a named one in /dev/shm that other processes map by
    ``shm_name``, or (``private``) an anonymous memfd no other process can open by name.

    Every committed page carries an xxh3-64 checksum (``seal``, at commit and when a page moves
    in; at commit the writer's own when it sent one); ``read_page_into`` checks it, so a page
    scribbled on after its commit (a same-host writer keeps its view of the shared slab) is
    reported corrupt instead of served. ``checksums=False``
    skips them (the commit's pass over every page's bytes), and with them that protection.
    """

    tier = Tier.DRAM

    def __init__(
        self,
        num_pages: int,
        page_bytes: int,
        shm_name: str | None = None,
        reserve: bool = True,
        private: bool = False,
        checksums: bool = True,
        check_room: bool = True,
    ) -> None:
        self.num_pages, self.page_bytes = num_pages, page_bytes
        self.checksums = checksums
        size = num_pages * page_bytes
        self.slab: SharedSlab | MemfdSegment
        if private:
            self.slab = MemfdSegment(size, label="kvcache-dram", reserve=reserve)
            self.shm_name: str | None = None
        else:
            self.slab = SharedSlab.create(
                shm_name or unique_shm_name(), size, reserve=reserve, check_room=check_room
            )
            self.shm_name = self.slab.name
        self._pages = self.slab.array.reshape(num_pages, page_bytes)
        self._sums = np.zeros(num_pages, dtype=np.uint64)
        self._sealed = np.zeros(num_pages, dtype=bool)

    def page_view(self, slot: int) -> ByteView:
        page: ByteView = self._pages[slot]
        return page

    def write_pages(
        self, slots: Sequence[int], keys: Sequence[bytes], datas: Sequence[ByteView]
    ) -> None:
        super().write_pages(slots, keys, datas)
        for slot in slots:
            self.seal(slot)

    def write_range(self, slots: Sequence[int], offset: int, rows: ByteView) -> None:
        if not isinstance(rows, np.ndarray):
            super().write_range(slots, offset, rows)  # a device tensor: copied page by page
            return
        # NOTE: one fancy-indexed assignment for the batch, not a Python call per page: one
        # layer's 32 KiB slices of a 1 MiB page cost about what the call around them costs.
        self._pages[np.asarray(slots, dtype=np.intp), offset : offset + rows.shape[1]] = rows

    def seal(self, slot: int, checksum: int | None = None) -> None:
        if not self.checksums:
            self._sealed[slot] = False  # NOTE: a slot's previous occupant may have been sealed
            return
        # NOTE: a wrong adopted value makes the page fail its check on read (dropped, never
        # served): only its writer's own page suffers.
        self._sums[slot] = (
            xxhash.xxh3_64_intdigest(self._pages[slot]) if checksum is None else checksum
        )
        self._sealed[slot] = True

    def checksum(self, slot: int) -> int | None:
        return int(self._sums[slot]) if self._sealed[slot] else None

    def read_page_into(self, slot: int, key: bytes, out: ByteView) -> bool:
        page = self._pages[slot]
        if not self._sealed[slot]:
            copy_bytes(out, page)
            return True
        if isinstance(out, np.ndarray):
            # NOTE: checked as it is copied, one pass; a page that fails leaves ``out`` holding
            # its bytes, which every caller then treats as missing (read_page_into's contract).
            return copy_checksum(out, page) == int(self._sums[slot])
        if xxhash.xxh3_64_intdigest(page) != int(self._sums[slot]):
            return False
        copy_bytes(out, page)
        return True

    def drop_pages(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        for slot in slots:
            self._sealed[slot] = False

    def release(self, slots: Sequence[int]) -> None:
        # The pages' memory goes back to the system (a hole punched in the shared memory file):
        # what budgeted stores hold together stays within their budget. Runs of adjacent slots
        # are punched at once; only whole system pages inside a run can go.
        self.drop_pages(slots, [])
        for first, count in _runs(sorted(slots)):
            start = page_up(first * self.page_bytes)
            end = (first + count) * self.page_bytes // mmap.PAGESIZE * mmap.PAGESIZE
            if end > start:
                self.slab.punch(start, end - start)

    def close(self) -> None:
        self._pages = None  # type: ignore[assignment]
        self.slab.close()
        self.slab.unlink()


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """Sorted slots as (first, count) runs of adjacent ones."""
    runs: list[tuple[int, int]] = []
    for s in slots:
        if runs and runs[-1][0] + runs[-1][1] == s:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((s, 1))
    return runs


class TorchSlabPool(PagePool):
    """Pages in one preallocated torch tensor: the GPU tier on ``cuda``, testable on ``cpu``."""

    def __init__(
        self, num_pages: int, page_bytes: int, device: str = "cuda", tier: Tier = Tier.GPU
    ) -> None:
        import torch

        if device.startswith("cuda") and not torch.cuda.is_available():
            from .errors import StorageError

            raise StorageError("the GPU tier needs a CUDA device; set gpu_pages=0 on this machine")
        self.tier = tier
        self.num_pages, self.page_bytes = num_pages, page_bytes
        self.device = torch.device(device)
        self._pages = torch.empty((num_pages, page_bytes), dtype=torch.uint8, device=self.device)

    def page_view(self, slot: int) -> ByteView:
        return self._pages[slot]

    def close(self) -> None:
        self._pages = None  # type: ignore[assignment]


class MetadataPool(PagePool):
    """Capacity without bytes: for trace replays through the real index and policies."""

    has_data = False

    def __init__(self, tier: Tier, num_pages: int, page_bytes: int = 0) -> None:
        self.tier, self.num_pages, self.page_bytes = tier, num_pages, page_bytes

    def page_view(self, slot: int) -> None:
        return None

    def write_pages(
        self, slots: Sequence[int], keys: Sequence[bytes], datas: Sequence[ByteView]
    ) -> None:
        pass

    def read_page_into(self, slot: int, key: bytes, out: ByteView) -> bool:
        return True
