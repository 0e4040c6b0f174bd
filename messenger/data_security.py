"""The data port's protection: TLS and the data-plane credential.

- TLS: a messenger that serves gRPC with TLS (``--tls-cert``) serves its data port with the same
  certificate, and pulls from its peers' data ports over TLS verified against ``--node-tls-ca``
  (every tenant's pages, and the HELLO's credential, travel encrypted; a peer is who its
  certificate says). A cluster is all TLS or all plain (``kvcache up --tls``).
- The credential is the cluster's *data token* (``--data-token-file``; ``kvcache up`` writes
  one), never the admin token: whoever holds it may pull pages from the data ports, but is not
  the node's or the conductor's admin. Without a data token file a messenger with an admin
  token derives one from it (HMAC-SHA256, one-way).
- The token itself never crosses the network, not even encrypted: HELLO is a challenge and
  response. The puller sends a nonce; the port answers its own nonce and a proof over both
  (HMAC-SHA256 keyed with the token); the puller checks that proof before it sends anything
  else, then sends its own proof. A port that does not hold the token (a listener a tenant
  named as a transfer's source, on a cluster without TLS) learns nothing it can use elsewhere,
  and is sent no request.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import ssl

from .frames import set_io_timeout

_DERIVE_LABEL = b"kvcache data port v1"


NONCE_BYTES = 32
PROOF_BYTES = 32


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(token: bytes, side: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What one side (``b"server"`` / ``b"client"``) shows it holds ``token``, for this
    connection's nonces only."""
    return hmac.new(token, side + client_nonce + server_nonce, hashlib.sha256).digest()


def derive_data_token(admin_token: str) -> str:
    """The data token every messenger with ``admin_token`` agrees on, which does not reveal it."""
    return hmac.new(admin_token.encode(), _DERIVE_LABEL, hashlib.sha256).hexdigest()


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


def client_context(ca_file: str) -> ssl.SSLContext:
    """Verifies a peer's certificate against ``ca_file`` and its name (host or IP) against the
    address it was reached at."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def connect(
    host: str,
    port: int,
    *,
    connect_timeout_s: float,
    io_timeout_s: float,
    tls: ssl.SSLContext | None = None,
) -> socket.socket:
    """A connection to a data port: TCP_NODELAY, I/O timeouts, and TLS (handshake done, peer
    verified) when ``tls`` is given. ``OSError`` (``ssl.SSLError`` included) when it fails."""
    sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is None:
            # NOTE: a blocking socket with kernel timeouts: recv_into(MSG_WAITALL) waits for a
            # whole page in one syscall (frames.set_io_timeout).
            sock.settimeout(None)
            set_io_timeout(sock, io_timeout_s)
            return sock
        tsock = tls.wrap_socket(sock, server_hostname=host)  # handshake under connect timeout
    except BaseException:
        sock.close()
        raise
    # NOTE: Python-level timeouts: a blocking TLS socket retries a read that the kernel timeout
    # ended, and would never time out.
    tsock.settimeout(io_timeout_s)
    return tsock


def shutdown(sock: socket.socket) -> None:
    """Shut a connection down from another thread (waking one blocked in recv or send). On a TLS
    socket this is the plain socket's shutdown: ``SSLSocket.shutdown`` would drop its TLS state
    under the thread still using it."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # closed or never connected: nothing to wake
