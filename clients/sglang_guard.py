"""The HiCache backend's calls to its node, bounded: SGLang's storage threads must never wait on a
node that does not answer. Every call has the client's short deadline; a call that fails for want
of the node (deadline, unavailable) opens the breaker, and while it is open no call is made (a
miss, a failed write) until a background probe finds the node answering again."""

from __future__ import annotations

import logging
import threading
from typing import Callable, TypeVar

from .node_client import KVCacheRpcError, KVStoreClient
from .node_guard import BreakerOpen, node_gone

log = logging.getLogger(__name__)
T = TypeVar("T")


class Breaker:
    """Whether the node answers; ``call`` makes a call only while it does."""

    def __init__(
        self, client: KVStoreClient, retry_s: float, probe: Callable[[], KVStoreClient]
    ) -> None:
        """``probe`` makes the client the probe asks (its own: the backend's client may be closed
        meanwhile; no shared memory)."""
        self.client = client
        self.retry_s = retry_s
        self._make_probe = probe
        self.trips = 0  # outages seen
        self.skipped = 0  # calls not made while open
        self._open = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_open(self) -> bool:
        return self._open

    def call(self, fn: Callable[[], T]) -> T:
        if self._open:
            self.skipped += 1
            raise BreakerOpen(self.client.address)
        try:
            return fn()
        except KVCacheRpcError as e:
            self.failed(e)
            raise

    def failed(self, e: KVCacheRpcError) -> None:
        if not node_gone(e):
            return
        with self._lock:
            if self._open or self._stop.is_set():
                return
            self._open = True
            self.trips += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._probe, daemon=True, name="kvcache-hicache-probe"
                )
                self._thread.start()
        log.warning(
            "kvcache node %s does not answer (%s): HiCache L3 misses and skips writes until "
            "it does; asking again every %.1f s",
            self.client.address,
            e,
            self.retry_s,
        )

    def _probe(self) -> None:
        probe = self._make_probe()
        try:
            while not self._stop.wait(self.retry_s):
                try:
                    probe.info()
                except KVCacheRpcError:
                    continue
                with self._lock:
                    self._open = False
                log.warning("kvcache node %s answers again", self.client.address)
                return
        finally:
            probe.close()

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(self.client.timeout_s + 1.0)
