"""What the engine clients' breakers (``vllm_guard``, ``sglang_guard``) agree on: which failed
calls mean the node is not there, and the error of a call not made while it is not."""

from __future__ import annotations

import grpc

from rpc.status import KVCacheRpcError

# The node is not there (or too slow to be worth waiting for): a breaker opens. Other codes
# (NOT_FOUND, INVALID_ARGUMENT, DATA_LOSS, ...) are answers, the node is there.
GONE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
    }
)


class BreakerOpen(KVCacheRpcError):
    """The node did not answer lately: the call was not made."""

    def __init__(self, address: str) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE, f"kvcache node {address} not answering (breaker open)"
        )


def node_gone(e: KVCacheRpcError) -> bool:
    """``e`` says the node did not answer (not a call a breaker already refused)."""
    return e.code in GONE and not isinstance(e, BreakerOpen)
