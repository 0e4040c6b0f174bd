"""Wire format of the messenger data port: fixed 48-byte headers, each optionally followed by a
payload of ``length`` bytes.

One connection carries a sequence of requests from the destination (the puller) and, for each,
the source's response in request order. Page payloads are raw page bytes; control payloads are
small binary bodies (``FETCH``, ``RDMA_PIN``) or JSON (the RDMA handshake).

Header: ``magic kind status flags count key length checksum reserved`` (little-endian).
``checksum`` is xxh3-64 of the payload. A header with a wrong magic or an unknown kind means the
peer is not speaking this protocol: the connection is dropped.
"""

from __future__ import annotations

import enum
import errno
import json
import socket
import ssl
import struct
import time
from dataclasses import dataclass

import numpy as np
import xxhash

MAGIC = b"KVM1"
HEADER = struct.Struct("<4sBBHI16sQQI")
HEADER_BYTES = HEADER.size
assert HEADER_BYTES == 48
KEY_BYTES = 16
ZERO_KEY = bytes(KEY_BYTES)

# Bounds on what a request may ask for: anything larger is garbage or abuse.
MAX_KEYS_PER_REQUEST = 4096
MAX_CONTROL_BYTES = 1 << 20
MAX_PAGE_BYTES = 1 << 31
MAX_NAMESPACE_BYTES = 1024
MAX_TOKEN_BYTES = 4096

checksum = xxhash.xxh3_64_intdigest


class Kind(enum.IntEnum):
    FETCH = 1  # dest -> src: body = page_bytes, namespace, keys; count = number of keys
    PAGE = 2  # src -> dest: one key's page (status OK) or its absence
    END = 3  # src -> dest: the response to one FETCH is complete
    ERROR = 4  # src -> dest: the request failed as a whole; payload = utf-8 message
    RDMA_CONNECT = 5  # dest -> src: JSON QP info; reply RDMA_ACCEPT with the source's QP info
    RDMA_ACCEPT = 6
    RDMA_PIN = 7  # dest -> src: like FETCH; reply RDMA_PINNED (lease, offsets, checksums, rkeys)
    RDMA_PINNED = 8
    RDMA_RELEASE = 9  # dest -> src: count = 0, key[:8] = lease id; reply END
    HELLO = 10  # dest -> src, first on a connection when the source wants a token:
    # payload = the token (utf-8); reply END, or ERROR and a hang-up
    GO = 11  # dest -> src, after a FETCH flagged HOLD: payload = one byte per key of the FETCH
    # (1: send its page, 0: skip it); count = number of keys; the FETCH's response follows


# FETCH flags. HOLD: pin the pages now but send the response only after a GO frame, which names
# the pages still wanted: the puller allocates its pages while the source pins (two round trips
# to two nodes at once instead of one after the other) and never pulls a page it holds already.
FLAG_HOLD = 1
# FETCH and RDMA_PIN flags. IDENTITY: the body opens with whom the request is for and its proof
# (identity.py), then the keys body.
FLAG_IDENTITY = 2


class Status(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    UNAVAILABLE = 2  # the source cannot pin pages right now (node down, ...)
    INVALID = 3  # the request is malformed or names an unknown namespace / page size
    INTERNAL = 4
    UNAUTHENTICATED = 5


class ProtocolError(Exception):
    """The peer sent something that is not this protocol; drop the connection."""


class PeerClosed(ConnectionError):
    """The peer closed the connection (EOF)."""


@dataclass(frozen=True, slots=True)
class Header:
    kind: Kind
    status: Status
    count: int
    key: bytes
    length: int
    checksum: int
    flags: int = 0

    def pack(self) -> bytes:
        return pack_header(
            self.kind, self.status, self.count, self.key, self.length, self.checksum, self.flags
        )


def pack_header(
    kind: Kind,
    status: Status = Status.OK,
    count: int = 0,
    key: bytes = ZERO_KEY,
    length: int = 0,
    checksum_: int = 0,
    flags: int = 0,
) -> bytes:
    return HEADER.pack(MAGIC, kind, status, flags, count, key, length, checksum_, 0)


def unpack_header(buf) -> Header:
    magic, kind, status, flags, count, key, length, csum, _ = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(
            f"bad magic {bytes(magic)!r}: the peer does not speak the messenger protocol"
        )
    try:
        kind_ = Kind(kind)
        status_ = Status(status)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind} / status {status}") from None
    return Header(kind_, status_, count, key, length, csum, flags)


# ---- keyed bodies (FETCH, RDMA_PIN) -------------------------------------------------------------

_BODY_HEAD = struct.Struct("<QH")


def pack_keys_body(namespace: str, page_bytes: int, keys: list[bytes]) -> bytes:
    ns = namespace.encode()
    return _BODY_HEAD.pack(page_bytes, len(ns)) + ns + b"".join(keys)


def unpack_keys_body(body: bytes, count: int) -> tuple[str, int, list[bytes]]:
    if len(body) < _BODY_HEAD.size:
        raise ProtocolError("request body too short")
    page_bytes, ns_len = _BODY_HEAD.unpack_from(body)
    start = _BODY_HEAD.size + ns_len
    if ns_len > MAX_NAMESPACE_BYTES or len(body) != start + count * KEY_BYTES:
        raise ProtocolError(
            f"request body of {len(body)} bytes does not hold a namespace of "
            f"{ns_len} bytes and {count} keys"
        )
    try:
        namespace = body[_BODY_HEAD.size : start].decode()
    except UnicodeDecodeError:
        raise ProtocolError("namespace is not utf-8") from None
    keys = [body[i : i + KEY_BYTES] for i in range(start, len(body), KEY_BYTES)]
    return namespace, page_bytes, keys


# lease id, mapping address and length, and two reserved words (once the whole region's rkey)
_PINNED_HEAD = struct.Struct("<QQQII")
PINNED_BYTES_PER_KEY = 20  # offset, checksum, rkey
# The offset of a key the source did not pin this time (its pin budget granted only the keys
# before it): the puller asks for it again once it released this lease.
DEFERRED = -2


@dataclass(frozen=True, slots=True)
class Pinned:
    """The source's answer to RDMA_PIN: where each page is in the mapping it lives in, and the
    rkey of the memory window that covers it (one per run of pages contiguous on the source,
    bound for this lease through the connection's QP: valid on that QP only, for those pages
    only, until the lease is released)."""

    lease_id: int
    region_addr: int  # the mapping the offsets point into
    region_length: int
    offsets: np.ndarray  # int64 per key; -1: the source does not hold it; DEFERRED: ask again
    checksums: np.ndarray  # uint64 xxh3-64 per key (0 where absent)
    rkeys: np.ndarray  # uint32 per key (0 where absent)


def pack_pinned(p: Pinned) -> bytes:
    return (
        _PINNED_HEAD.pack(p.lease_id, p.region_addr, p.region_length, 0, 0)
        + np.asarray(p.offsets, dtype="<i8").tobytes()
        + np.asarray(p.checksums, dtype="<u8").tobytes()
        + np.asarray(p.rkeys, dtype="<u4").tobytes()
    )


def unpack_pinned(body: bytes, count: int) -> Pinned:
    head = _PINNED_HEAD.size
    if len(body) != head + PINNED_BYTES_PER_KEY * count:
        raise ProtocolError(f"RDMA_PINNED body of {len(body)} bytes for {count} keys")
    lease_id, addr, length, _, _ = _PINNED_HEAD.unpack_from(body)
    offsets = np.frombuffer(body, dtype="<i8", count=count, offset=head)
    checksums = np.frombuffer(body, dtype="<u8", count=count, offset=head + 8 * count)
    rkeys = np.frombuffer(body, dtype="<u4", count=count, offset=head + 16 * count)
    return Pinned(lease_id, addr, length, offsets, checksums, rkeys)


def check_request_size(header: Header) -> None:
    """Raise ``ProtocolError`` when a request header announces more than its kind may carry.
    Checked on the header, before a buffer is allocated: a peer cannot make the server reserve
    memory (or wait for a body) out of proportion to its request."""
    kind, n = header.kind, header.length
    if kind in (Kind.FETCH, Kind.RDMA_PIN, Kind.GO):
        if header.count > MAX_KEYS_PER_REQUEST:
            raise ProtocolError(
                f"{kind.name} of {header.count} keys exceeds the limit of {MAX_KEYS_PER_REQUEST}"
            )
        if kind is Kind.GO:
            limit, what = header.count, f"a GO of {header.count} keys takes {header.count}"
        else:
            limit = _BODY_HEAD.size + MAX_NAMESPACE_BYTES + header.count * KEY_BYTES
            what = f"{header.count} keys and a namespace take at most {limit}"
    else:
        limit = {Kind.HELLO: MAX_TOKEN_BYTES, Kind.RDMA_RELEASE: 0}.get(kind, MAX_CONTROL_BYTES)
        what = f"the limit is {limit}"
    if n > limit:
        raise ProtocolError(f"{kind.name} frame announces a body of {n} bytes; {what}")


def lease_key(lease_id: int) -> bytes:
    return struct.pack("<Q", lease_id) + bytes(8)


def lease_of_key(key: bytes) -> int:
    return struct.unpack_from("<Q", key)[0]


def pack_json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def unpack_json(body: bytes) -> dict:
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"bad JSON control body: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("JSON control body must be an object")
    return obj


# ---- socket helpers ----------------------------------------------------------------------------


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Kernel-level send/receive timeouts (SO_RCVTIMEO / SO_SNDTIMEO).

    NOTE: the Python socket stays in blocking mode, so ``recv_into(..., MSG_WAITALL)`` waits in
    the kernel for a whole page (one syscall) instead of Python's poll-then-recv loop.
    """
    sec = int(seconds)
    tv = struct.pack("ll", sec, int((seconds - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from the socket. Raises ``PeerClosed`` on EOF, ``TimeoutError`` when the
    kernel timeout fires past ``deadline`` (or at once with no deadline), or when a TLS socket's
    own timeout does."""
    pos, n = 0, len(view)
    # NOTE: a TLS socket takes no flags; it returns a record (up to 16 KiB) per call.
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    while pos < n:
        try:
            got = sock.recv_into(view[pos:], n - pos, flags)
        except (BlockingIOError, InterruptedError) as e:
            if isinstance(e, BlockingIOError) and (
                deadline is None or time.monotonic() >= deadline
            ):
                raise TimeoutError(
                    f"no data from the peer for too long ({pos}/{n} bytes)"
                ) from None
            continue
        if got == 0:
            raise PeerClosed(f"peer closed the connection ({pos}/{n} bytes of a frame)")
        pos += got


def recv_header(sock: socket.socket, buf: bytearray, deadline: float | None = None) -> Header:
    recv_exact(sock, memoryview(buf), deadline)
    return unpack_header(buf)


def send_buffers(sock: socket.socket, buffers: list) -> None:
    """``sendmsg`` a gather list (headers and page views, no copies); finishes partial sends."""
    if isinstance(sock, ssl.SSLSocket):
        return _send_tls(sock, buffers)
    total = sum(len(b) if not isinstance(b, memoryview) else b.nbytes for b in buffers)
    try:
        sent = sock.sendmsg(buffers)
    except BlockingIOError:
        raise TimeoutError("the peer did not read for too long") from None
    if sent == total:
        return
    # Rare (signals, SO_SNDTIMEO): send the rest buffer by buffer.
    for b in buffers:
        mv = memoryview(b).cast("B")
        if sent >= mv.nbytes:
            sent -= mv.nbytes
            continue
        try:
            sock.sendall(mv[sent:])
        except BlockingIOError:
            raise TimeoutError("the peer did not read for too long") from None
        sent = 0


# Buffers smaller than this are copied together before a TLS write (each write is at least one
# record and one syscall: a 48-byte header would be one of its own); larger ones go as they are.
_TLS_COALESCE_BYTES = 64 << 10


def _send_tls(sock: ssl.SSLSocket, buffers: list) -> None:
    """TLS has no gather write: small buffers are joined, page views are encrypted in place."""
    pending = bytearray()
    try:
        for b in buffers:
            mv = memoryview(b).cast("B")
            if mv.nbytes < _TLS_COALESCE_BYTES:
                pending += mv
                if len(pending) < _TLS_COALESCE_BYTES:
                    continue
            elif pending:
                sock.sendall(pending)
                pending.clear()
            if pending:
                sock.sendall(pending)
                pending.clear()
            else:
                sock.sendall(mv)
        if pending:
            sock.sendall(pending)
    except (BlockingIOError, ssl.SSLWantWriteError):
        raise TimeoutError("the peer did not read for too long") from None


def is_disconnect(exc: BaseException) -> bool:
    """A peer that went away or stalled (a broken TLS session included), not a bug here."""
    if isinstance(exc, ssl.SSLError):
        return True
    return isinstance(exc, (PeerClosed, ConnectionError, TimeoutError)) or (
        isinstance(exc, OSError)
        and exc.errno
        in (errno.EPIPE, errno.ECONNRESET, errno.EBADF, errno.ENOTCONN, errno.ETIMEDOUT)
    )
