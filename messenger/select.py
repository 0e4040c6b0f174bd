"""Choosing the transport: ``--transport tcp|rdma|auto``.

``auto`` uses RDMA when pyverbs imports and a port is ACTIVE, else TCP, and says which once.
``rdma`` insists (a clear error when it cannot work). Either RDMA mode falls back to TCP per peer
(``FallbackTransport``): a peer without RDMA, or whose READs fail, is served over TCP.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .rdma import FallbackTransport, RdmaConfig, RdmaTransport
from .tcp import TcpConfig, TcpTransport
from .transport import Transport
from .verbs import VerbsBackend, VerbsError

log = logging.getLogger(__name__)

MODES = ("tcp", "rdma", "auto")


@dataclass
class TransportChoice:
    transport: Transport
    backend: VerbsBackend | None  # also serves the source side (RdmaSource) when set
    description: str


def open_rdma_backend() -> tuple[VerbsBackend | None, str]:
    """A real verbs backend, or None and the reason it is unavailable."""
    try:
        from .verbs_pyverbs import PyverbsBackend  # lazy: pyverbs is optional
    except ImportError as e:
        return None, f"pyverbs is not importable ({e})"
    try:
        return PyverbsBackend(), "pyverbs"
    except VerbsError as e:
        return None, str(e)


def choose_transport(
    mode: str,
    tcp: TcpConfig | None = None,
    rdma: RdmaConfig | None = None,
    backend: VerbsBackend | None = None,
) -> TransportChoice:
    """``backend``: a verbs backend to use instead of probing (tests pass the fake one)."""
    if mode not in MODES:
        raise ValueError(f"unknown transport {mode!r}; choose one of {', '.join(MODES)}")
    tcp_transport = TcpTransport(tcp)
    if mode == "tcp":
        log.info("transport: tcp (--transport tcp)")
        return TransportChoice(tcp_transport, None, "tcp")
    reason = "a verbs backend was given"
    if backend is None:
        backend, reason = open_rdma_backend()
    if backend is None:
        if mode == "rdma":
            tcp_transport.close()
            raise RuntimeError(
                f"--transport rdma: RDMA is unavailable: {reason}; use --transport tcp or auto"
            )
        log.info("transport: tcp (auto: RDMA unavailable: %s)", reason)
        return TransportChoice(tcp_transport, None, f"tcp (RDMA unavailable: {reason})")
    transport = FallbackTransport(RdmaTransport(backend, rdma), tcp_transport)
    log.info("transport: rdma via %s, TCP fallback per peer", backend.name)
    return TransportChoice(transport, backend, f"rdma ({backend.name}) with tcp fallback")
