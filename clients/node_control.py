"""A same-host client's end of its node's control socket (node/control.py, frames in
rpc/control.py): the node's lease calls at a Unix round trip's cost instead of a gRPC call's.

A few connections, each carrying one call at a time (the client's threads take a free one, or
open another, up to ``MAX_CONNECTIONS``). ``call`` answers None whenever the call was certainly
not made here, so that the caller makes it over gRPC instead: every connection is busy; the
socket cannot be reached (another host or network namespace) or refuses the hello (its
connections are all taken), then gRPC for ``RETRY_S``; or a held connection turns out dead
before the request left (the node restarted: then ``stale`` is set and the client asks the
node for its new socket). A connection that breaks or times out once the request is out fails
the call (UNAVAILABLE, DEADLINE_EXCEEDED), as gRPC would.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import grpc

from kvstore.shm import socket_address
from rpc.control import (
    CODES,
    HELLO,
    METHOD_IDS,
    METHODS,
    FrameError,
    recv_frame,
    send_frame,
)
from rpc.status import KVCacheRpcError

log = logging.getLogger(__name__)
MAX_CONNECTIONS = 4
RETRY_S = 10.0  # after a failed connection, gRPC this long


class ControlChannel:
    def __init__(self, name: str, token: str | None) -> None:
        self.name = name
        self._token = (token or "").encode()
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._opened = 0  # connections open, idle or carrying a call
        self._broken_until = 0.0
        self.stale = False  # the node behind it is gone: the client asks for its new socket

    @property
    def broken(self) -> bool:
        """A connection could not be made or was refused lately: the client uses gRPC (and
        tries again after ``RETRY_S``)."""
        return time.monotonic() < self._broken_until

    def call(self, name: str, request: Any, timeout_s: float) -> Any | None:
        """The reply of ``name`` (raises ``KVCacheRpcError`` as the gRPC call would), or None:
        not made here, make it over gRPC."""
        sock = self._take(timeout_s)
        if sock is None:
            return None
        try:
            sock.settimeout(timeout_s)
            send_frame(sock, METHOD_IDS[name], request.SerializeToString())
        except OSError as e:  # nothing of the request reached a live node: not made
            log.info("control socket %s: %s; asking the node again", self.name, e)
            self._drop(sock)
            self.stale = True
            return None
        try:
            code, payload = recv_frame(sock)
        except TimeoutError:
            self._drop(sock)  # its answer may still come: the connection is out of step
            raise KVCacheRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no answer from the node's control socket within {timeout_s:g} s",
                name,
            ) from None
        except (FrameError, OSError) as e:
            self._drop(sock)
            self.stale = True
            raise KVCacheRpcError(
                grpc.StatusCode.UNAVAILABLE, f"the node's control connection broke: {e}", name
            ) from None
        self._give(sock)
        if code:
            message = payload.decode("utf-8", "replace")
            raise KVCacheRpcError(CODES.get(code, grpc.StatusCode.UNKNOWN), message, name)
        return METHODS[METHOD_IDS[name]][2].FromString(payload)

    def _take(self, timeout_s: float) -> socket.socket | None:
        with self._lock:
            if self.broken or self.stale:
                return None
            if self._idle:
                return self._idle.pop()
            if self._opened >= MAX_CONNECTIONS:
                return None
            self._opened += 1
        try:
            return self._connect(timeout_s)
        except (OSError, FrameError, KVCacheRpcError) as e:
            with self._lock:
                self._opened -= 1
                self._broken_until = time.monotonic() + RETRY_S
            if isinstance(e, TimeoutError):  # a hung node: gRPC would wait as long again
                raise KVCacheRpcError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the node's control socket did not answer within {timeout_s:g} s",
                    "hello",
                ) from None
            log.info("no control connection to the node at %s (%s): using gRPC", self.name, e)
            return None

    def _connect(self, timeout_s: float) -> socket.socket:
        """A connection past its hello. A node that does not answer within ``timeout_s`` (the
        call's deadline: a hung node must not hold the engine longer) fails the call with
        DEADLINE_EXCEEDED, as gRPC would, and sends the next ones to gRPC for a while."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(socket_address(self.name))
            send_frame(sock, HELLO, self._token)
            code, payload = recv_frame(sock)
            if code:
                raise KVCacheRpcError(
                    CODES.get(code, grpc.StatusCode.UNKNOWN), payload.decode(), "hello"
                )
        except BaseException:
            sock.close()
            raise
        return sock

    def _give(self, sock: socket.socket) -> None:
        with self._lock:
            if not self.stale:
                self._idle.append(sock)
                return
            self._opened -= 1
        sock.close()

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._opened -= 1
        sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._opened -= len(idle)
            self.stale = True
        for sock in idle:
            sock.close()
