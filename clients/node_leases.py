"""The node client's leases (``KVStoreClient.allocate`` / ``acquire``): pages leased for writing
or pinned for reading in the node's shared memory, viewed in place, and the requests that end
them."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from numpy.typing import NDArray

from kvstore.errors import StorageError
from kvstore.layout import KVLayout
from kvstore.payload import copy_bytes, copy_checksum
from kvstore.shm import MemfdSegment, SharedSlab
from kvstore.tiers import Tier
from proto import node_pb2 as pb
from rpc.wire import tier_or_none_from_pb

if TYPE_CHECKING:
    from .node_client import KVStoreClient

# NOTE: a reply's tiers by wire value, one tuple index per page instead of an enum call
TIER_OF_PB: tuple[Tier | None, ...] = tuple(tier_or_none_from_pb(v) for v in range(4))
Mapping = SharedSlab | MemfdSegment  # the node's slab by name, or this tenant's own segment


@dataclass(frozen=True, slots=True)
class CommitResult:
    stored: int
    duplicates: int


@dataclass(eq=False)
class Lease:
    client: "KVStoreClient"
    namespace: str
    lease_id: int
    keys: list[bytes]
    offsets: list[int]
    page_bytes: int
    slab: Mapping | None = field(repr=False)
    # the run of the node that granted it (AllocateReply.node_epoch): sent back with the lease
    node_epoch: int = field(default=0, kw_only=True)

    def page(self, index: int) -> NDArray[np.uint8]:
        """Zero-copy view of page ``index`` in the node's shared memory."""
        off = self.offsets[index]
        if off < 0:
            raise KeyError(f"page #{index} has no shared-memory page in this lease")
        if self.slab is None:
            raise StorageError(
                "the node's shared memory is not mapped here (remote client?); "
                "use put()/get() instead"
            )
        return self.slab.array[off : off + self.page_bytes]

    def layer(self, index: int, layer: int, layout: KVLayout) -> NDArray[np.uint8]:
        off = layout.layer_offset(layer)
        return self.page(index)[off : off + layout.layer_bytes]


@dataclass(eq=False)
class WriteLease(Lease):
    """Pages leased for writing. Write ``page(i)`` for i in ``to_write``, then commit()."""

    @property
    def to_write(self) -> list[int]:
        return [i for i, off in enumerate(self.offsets) if off >= 0]

    def write(self, pages: Sequence[Any]) -> NDArray[np.uint64] | None:
        """Copy ``pages[i]`` (flat uint8, one per key) into ``page(i)`` for each key to write,
        each hashed as it is copied: the checksums for ``commit`` (one per key, 0 where nothing
        was written), so the node does not read the pages back; None if a page is a device
        tensor (copied, not hashed: the node hashes them)."""
        sums: NDArray[np.uint64] | None = np.zeros(len(self.keys), dtype=np.uint64)
        for i in self.to_write:
            dst, src = self.page(i), pages[i]
            if sums is not None and isinstance(src, np.ndarray):
                sums[i] = copy_checksum(dst, src)
            else:
                copy_bytes(dst, src)
                sums = None
        return sums

    def commit(self, checksums: Sequence[int] | NDArray[Any] | None = None) -> CommitResult:
        return self.client.commit(self, checksums)

    def abort(self) -> None:
        self.client.abort(self)

    def __enter__(self) -> "WriteLease":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


@dataclass(eq=False)
class ReadLease(Lease):
    """Pinned pages. ``found`` tells which keys are present; release() when done."""

    tiers: list[Tier | None] = field(default_factory=list)
    checksums: list[int] = field(default_factory=list)  # xxh3-64 per page as committed; 0: none

    @property
    def found(self) -> list[bool]:
        return [t is not None for t in self.tiers]

    @property
    def hit_blocks(self) -> int:
        n = 0
        for t in self.tiers:
            if t is None:
                break
            n += 1
        return n

    def page(self, index: int) -> NDArray[np.uint8]:
        view = super().page(index)
        view = view.view()
        view.flags.writeable = False
        return view

    def release(self) -> None:
        self.client.release(self)

    def __enter__(self) -> "ReadLease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lease_request(lease: Lease) -> pb.LeaseRequest:
    return pb.LeaseRequest(
        namespace=lease.namespace, lease_id=lease.lease_id, node_epoch=lease.node_epoch
    )


def commit_request(lease: WriteLease, checksums: Sequence[int] | NDArray[Any] | None) -> Any:
    """Commit's request; ``checksums`` (uint64, one per key of the lease) packed as the node
    reads them: little-endian, 8 bytes each."""
    request = lease_request(lease)
    if checksums is not None:
        request.checksums = (
            np.asarray(checksums, dtype=np.uint64).astype("<u8", copy=False).tobytes()
        )
    return request


def commit_result(reply: Any) -> CommitResult:
    return CommitResult(reply.stored, reply.duplicates)
