"""The node client's streamed page bytes (``Put`` / ``Get``), for clients that cannot map the
node's shared memory (another host): pages sent and received in chunks over gRPC."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Sequence

import grpc
import numpy as np
from numpy.typing import NDArray

from proto import common_pb2 as cpb
from proto import node_pb2 as pb
from rpc.status import KVCacheRpcError

from .node_leases import CommitResult

if TYPE_CHECKING:
    import torch

STREAM_CHUNK_BYTES = 1 << 20


def put_streamed(
    stub: Any,
    selector: cpb.BlockSelector,
    srcs: Sequence[NDArray[np.uint8] | torch.Tensor],
    timeout_s: float,
) -> CommitResult:
    """One page per selected block, each ``page_bytes`` long, in order."""

    def chunks() -> Iterator[pb.PutChunk]:
        yield pb.PutChunk(header=pb.PutHeader(blocks=selector))
        for src in srcs:
            if not isinstance(src, np.ndarray):
                src = src.cpu().numpy()
            # NOTE: numpy's stubs give ndarray __buffer__ on Python >= 3.12 only.
            mv = memoryview(src)  # type: ignore[arg-type]
            for off in range(0, len(mv), STREAM_CHUNK_BYTES):
                yield pb.PutChunk(data=bytes(mv[off : off + STREAM_CHUNK_BYTES]))

    try:
        r = stub.Put(chunks(), timeout=timeout_s)
    except grpc.RpcError as e:
        raise KVCacheRpcError.of(e, "Put") from None
    return CommitResult(r.stored, r.duplicates)


def get_streamed(
    stub: Any, request: pb.GetRequest, timeout_s: float
) -> list[NDArray[np.uint8] | None]:
    """Copies of the selected pages (None where missing)."""
    try:
        stream = stub.Get(request, timeout=timeout_s)
        header = next(stream).header
        page = header.page_bytes
        out: list[NDArray[np.uint8] | None] = [
            np.empty(page, np.uint8) if f else None for f in header.found
        ]
        targets = iter([p for p in out if p is not None])
        cur: NDArray[np.uint8]  # bound at the first byte: pos starts at page
        pos = page
        for chunk in stream:
            data = chunk.data
            off = 0
            while off < len(data):
                if pos == page:
                    cur, pos = next(targets), 0
                take = min(page - pos, len(data) - off)
                cur[pos : pos + take] = np.frombuffer(data, np.uint8, take, off)
                pos += take
                off += take
    except grpc.RpcError as e:
        raise KVCacheRpcError.of(e, "Get") from None
    return out
