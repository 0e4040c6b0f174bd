"""The connector's calls to its node, bounded: a cache must never make the engine slower than no
cache. Every call on the engine's path has a short deadline (the client's ``timeout_s``); a call
that fails for want of the node (deadline, unavailable) opens the breaker, and while it is open
the connector is a no-op (no lookups, loads or saves) and costs the engine nothing. A background
probe asks the node for its info every ``retry_s`` and closes the breaker when it answers."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, TypeVar

import grpc

from rpc.status import KVCacheRpcError

from .node_client import KVStoreClient

log = logging.getLogger(__name__)
T = TypeVar("T")

# The node is not there (or too slow to be worth waiting for): the breaker opens. Other codes
# (NOT_FOUND, INVALID_ARGUMENT, DATA_LOSS, ...) are answers, the node is there.
_GONE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
}


class BreakerOpen(KVCacheRpcError):
    """The node did not answer lately: the call was not made."""

    def __init__(self, address: str) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE, f"kvcache node {address} not answering (breaker open)"
        )


class NodeGuard:
    """Deadlines and the circuit breaker around one connector's ``KVStoreClient``."""

    def __init__(self, client: KVStoreClient, retry_s: float) -> None:
        self.client = client
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._open = False
        self._probe: threading.Thread | None = None
        self._closed = threading.Event()  # shutdown
        self.trips = 0
        self.skipped = 0  # calls not made while open
        self.open_s = 0.0  # seconds spent open, closed spells only
        self._opened_at = 0.0

    @property
    def is_open(self) -> bool:
        return self._open

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` (a call of ``self.client``) unless the breaker is open (``BreakerOpen``);
        a failure for want of the node opens it."""
        if self._open:
            with self._lock:
                self.skipped += 1
            raise BreakerOpen(self.client.address)
        try:
            return fn()
        except KVCacheRpcError as e:
            self.failed(e)
            raise

    def result(self, pending: Future[T], timeout_s: float | None = None) -> T:
        """The result of an async call started through the client (deadline included)."""
        try:
            return pending.result(timeout=timeout_s)
        except KVCacheRpcError as e:
            self.failed(e)
            raise

    def failed(self, e: KVCacheRpcError) -> None:
        if e.code not in _GONE or isinstance(e, BreakerOpen):
            return
        with self._lock:
            if self._open:
                return
            self._open = True
            self.trips += 1
            self._opened_at = time.monotonic()
            if self._probe is None or not self._probe.is_alive():
                self._probe = threading.Thread(
                    target=self._probing, daemon=True, name="kvcache-breaker"
                )
                self._probe.start()
        log.warning(
            "kvcache node %s does not answer (%s): the connector does nothing (no loads, no "
            "saves) until it does; asking again every %.1f s",
            self.client.address,
            e,
            self.retry_s,
        )

    def _probing(self) -> None:
        while not self._closed.wait(self.retry_s):
            try:
                self.client.info()
            except KVCacheRpcError:
                continue
            except Exception:  # noqa: BLE001 - e.g. the channel closed at shutdown
                return
            with self._lock:
                self._open = False
                self.open_s += time.monotonic() - self._opened_at
            log.warning(
                "kvcache node %s answers again: loads and saves resume", self.client.address
            )
            return

    def close(self) -> None:
        self._closed.set()
