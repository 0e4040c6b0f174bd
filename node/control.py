"""The node's control socket: its lease calls for same-host clients, without gRPC's per-call
cost (frames and method ids in ``rpc.control``).

Each call runs the very handler gRPC runs (``NodeServicer``'s, with its checks, tenant scoping,
metrics and error mapping), given a context that carries the connection's token. A connection
is authenticated once, by its hello; a wrong token is refused and the connection closed. Each
connection is served by a thread of its own (a client holds one or a few for its life), so
connections are capped like sessions: at most ``MAX_CONNECTIONS``, ``MAX_PER_UID`` of them for
one user (the kernel names the peer: SO_PEERCRED); one more is closed at once, and its client
goes on over gRPC. A hello (at most ``MAX_HELLO`` bytes) must arrive whole within
``HELLO_TIMEOUT_S``.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvstore.shm import socket_address
from rpc.control import (
    HELLO,
    METHODS,
    ControlAbort,
    ControlContext,
    FrameError,
    recv_frame,
    send_frame,
)
from rpc.logs import CURRENT, RequestContext
from rpc.server import Auth

from .sessions import peer_of

log = logging.getLogger(__name__)
MAX_CONNECTIONS = 256
MAX_PER_UID = 64
HELLO_TIMEOUT_S = 5.0  # the whole hello must arrive by then
MAX_HELLO = 4096  # bytes: a bearer token
_SERVICE = "/kvcache.v1.NodeService/"


class ControlServer:
    """Serves ``servicer``'s lease calls on an abstract Unix socket (``socket_name``)."""

    def __init__(self, servicer: Any, auth: Auth) -> None:
        self._servicer, self._auth = servicer, auth
        self.socket_name = f"@kvcache-control-{os.getpid()}-{secrets.token_hex(8)}"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(socket_address(self.socket_name))
        self._server.listen(64)
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, int] = {}  # open connection -> its peer's uid
        self._closed = False
        threading.Thread(target=self._accept, name="control-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed (shutdown), or EMFILE: its client goes on over gRPC
                if self._closed:
                    return
                threading.Event().wait(0.1)
                continue
            try:
                pid, uid = peer_of(conn)
            except OSError:
                conn.close()
                continue
            with self._lock:
                full = self._closed or len(self._conns) >= MAX_CONNECTIONS
                mine = sum(1 for u in self._conns.values() if u == uid)
                if not full and mine < MAX_PER_UID:
                    self._conns[conn] = uid
            if full or mine >= MAX_PER_UID:
                log.warning("control socket: refused a connection of pid %d (uid %d)", pid, uid)
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn, pid), name="control-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, pid: int) -> None:
        try:
            metadata = self._hello(conn)
            if metadata is None:
                return
            context = ControlContext(metadata, f"unix:pid={pid}")
            while True:
                method, payload = recv_frame(conn)
                code, out = self._call(method, payload, context, metadata)
                send_frame(conn, code, out)
        except (FrameError, OSError):
            pass  # the client left (or broke the framing): its connection ends
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _hello(self, conn: socket.socket) -> tuple[tuple[str, str], ...] | None:
        # NOTE: small and soon: a stranger's connection holds a thread (and a buffer) until then
        try:
            method, token = recv_frame(conn, MAX_HELLO, time.monotonic() + HELLO_TIMEOUT_S)
        except TimeoutError:
            return None
        metadata = (("authorization", "Bearer " + token.decode("utf-8", "replace")),)
        if method != HELLO or self._auth.check_metadata(metadata) is None:
            send_frame(
                conn,
                grpc.StatusCode.UNAUTHENTICATED.value[0],
                b"missing or wrong bearer token in the control socket's hello",
            )
            return None
        conn.settimeout(None)  # a client holds its connection between calls
        send_frame(conn, 0, b"")
        return metadata

    def _call(
        self, method: int, payload: bytes, context: ControlContext, metadata: Any
    ) -> tuple[int, bytes]:
        known = METHODS.get(method)
        if known is None:
            return grpc.StatusCode.UNIMPLEMENTED.value[0], f"no method #{method}".encode()
        name, request_type, _ = known
        try:
            request = request_type.FromString(payload)
        except DecodeError as e:
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], f"bad {name} request: {e}".encode()
        token = CURRENT.set(RequestContext(_SERVICE + name, metadata, request))
        try:
            reply = getattr(self._servicer, name)(request, context)
        except ControlAbort as e:
            return e.code.value[0], e.details.encode()
        except Exception as e:  # noqa: BLE001 - as gRPC answers a handler's bug: INTERNAL
            log.exception("control socket: %s failed", name)
            return grpc.StatusCode.INTERNAL.value[0], f"{name}: {type(e).__name__}".encode()
        finally:
            CURRENT.reset(token)
        return 0, reply.SerializeToString()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), {}
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._server.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes its thread's read
            except OSError:
                pass
