"""The node's control channel for same-host clients: its lease calls over a Unix connection.

Every gRPC call costs ~0.5 ms of the Python gRPC stack's own work here (an empty call: 0.55 ms
round trip, 0.08 ms of it in the handler), and an engine step makes two or three of them. The
same protobuf messages in length-prefixed frames on a Unix socket cost ~0.035 ms a round trip.
gRPC stays the node's API for everything else and for everyone off the host.

Frames, both ways a header then a payload:

    request: u32 payload length, u8 method (``METHODS``), payload = the request message
    reply:   u32 payload length, u8 status (a ``grpc.StatusCode`` value, 0 OK),
             payload = the reply message, or the error's UTF-8 message

A connection opens with a hello (method ``HELLO``, payload the caller's bearer token, empty
without one), answered OK or UNAUTHENTICATED (then the node closes it): the caller's identity
is the connection's. One call at a time per connection, answered in order.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import grpc

from proto import common_pb2 as cpb
from proto import node_pb2 as pb

HEADER = struct.Struct("<IB")
MAX_FRAME = 64 << 20  # as gRPC's largest message (rpc/server.py)
HELLO = 0
# method id -> (name, request type, reply type): NodeService's unary lease calls
METHODS: dict[int, tuple[str, Any, Any]] = {
    1: ("Lookup", cpb.BlockSelector, pb.LookupReply),
    2: ("Allocate", pb.AllocateRequest, pb.AllocateReply),
    3: ("Commit", pb.LeaseRequest, pb.CommitReply),
    4: ("Abort", pb.LeaseRequest, pb.Empty),
    5: ("Acquire", pb.AcquireRequest, pb.AcquireReply),
    6: ("Release", pb.LeaseRequest, pb.Empty),
    7: ("ExtendLease", pb.ExtendLeaseRequest, pb.ExtendLeaseReply),
    8: ("AcquireAllocate", pb.AcquireAllocateRequest, pb.AcquireAllocateReply),
    9: ("CommitRelease", pb.CommitReleaseRequest, pb.CommitReleaseReply),
}
METHOD_IDS = {name: i for i, (name, _, _) in METHODS.items()}
CODES = {c.value[0]: c for c in grpc.StatusCode}


class FrameError(Exception):
    """The peer closed the connection, or sent a frame that cannot be one."""


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """``n`` bytes; ``deadline`` (monotonic): all of them by then (``TimeoutError``), not each
    read within the socket's timeout (a peer trickling a byte at a time would hold us)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the frame did not arrive in time")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if not k:
            raise FrameError("the connection was closed")
        got += k
    return buf


def recv_frame(
    sock: socket.socket, max_bytes: int = MAX_FRAME, deadline: float | None = None
) -> tuple[int, bytes]:
    """(method or status, payload) of the next frame, of at most ``max_bytes``."""
    length, tag = HEADER.unpack(recv_exact(sock, HEADER.size, deadline))
    if length > max_bytes:
        raise FrameError(f"a frame of {length} bytes (at most {max_bytes})")
    return tag, bytes(recv_exact(sock, length, deadline)) if length else b""


def send_frame(sock: socket.socket, tag: int, payload: bytes) -> None:
    sock.sendall(HEADER.pack(len(payload), tag) + payload)


class ControlAbort(Exception):
    """A call's error status (what ``context.abort`` raises on this channel)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class ControlContext:
    """As much of ``grpc.ServicerContext`` as the node's unary handlers use."""

    def __init__(self, metadata: tuple[tuple[str, str], ...], peer: str) -> None:
        self._metadata, self._peer = metadata, peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise ControlAbort(code, details)

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> float | None:
        return None
