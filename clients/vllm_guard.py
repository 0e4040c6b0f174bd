"""The connector's calls to its node, bounded: a cache must never make the engine slower than no
cache. Every call on the engine's path has a short deadline (at most the client's ``timeout_s``,
less for a node that has answered fast: ``Latency``); a call that fails for want of the node
(deadline, unavailable) opens the node's breaker, and while it is open the connector is a no-op
(no lookups, loads or saves) and costs the engine nothing. A background probe asks the node for
its info every ``retry_s`` and closes the breaker when it answers. The connectors of one process
that use the same node (vLLM's scheduler and worker sides) share its breaker: an outage costs
the engine one deadline, not one per side."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, TypeVar

from rpc.status import KVCacheRpcError

from .node_client import KVStoreClient
from .node_guard import BreakerOpen, node_gone

log = logging.getLogger(__name__)
T = TypeVar("T")


class Latency:
    """How fast a node has answered lately, and the deadline that gives its next call: TCP's
    retransmission timer (RFC 6298: a smoothed latency and its mean deviation), times a margin,
    between ``min_s`` and ``max_s``. A node that answers in a millisecond is given up on after
    ``min_s``, not ``max_s``; one that slows down under load gets longer deadlines before any
    call of it is cut. (A call cut too early only costs hits: the engine computes, as it would
    without a cache.)"""

    MARGIN = 4.0

    def __init__(self, min_s: float, max_s: float) -> None:
        self.min_s, self.max_s = min(min_s, max_s), max_s
        self._srtt: float | None = None
        self._var = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            if self._srtt is None:
                self._srtt, self._var = seconds, seconds / 2
            else:
                self._var = 0.75 * self._var + 0.25 * abs(self._srtt - seconds)
                self._srtt = 0.875 * self._srtt + 0.125 * seconds

    def deadline(self) -> float:
        """Seconds the next call may take; ``max_s`` until a call was timed."""
        srtt = self._srtt
        if srtt is None:
            return self.max_s
        return min(self.max_s, max(self.min_s, self.MARGIN * (srtt + 4 * self._var)))


class Breaker:
    """Whether one node answers, for every connector of this process that uses it, and how fast
    (``latency``: the deadline of the next call)."""

    def __init__(self, probe: KVStoreClient, retry_s: float, latency: Latency) -> None:
        self.probe = probe  # its own client: a connector's may be closed at its shutdown
        self.retry_s = retry_s
        self.latency = latency
        self.users = 0
        self._lock = threading.Lock()
        self._open = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_open(self) -> bool:
        return self._open

    def trip(self, e: KVCacheRpcError) -> bool:
        """Opens on a failure for want of the node; True if this call opened it."""
        if not node_gone(e):
            return False
        with self._lock:
            if self._open:
                return False
            self._open = True
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._probing, daemon=True, name="kvcache-breaker"
                )
                self._thread.start()
        log.warning(
            "kvcache node %s does not answer (%s): the connector does nothing (no loads, no "
            "saves) until it does; asking again every %.1f s",
            self.probe.address,
            e,
            self.retry_s,
        )
        return True

    def _probing(self) -> None:
        while not self._stop.wait(self.retry_s):
            try:
                self.probe.info()
            except KVCacheRpcError:
                continue
            except Exception:  # noqa: BLE001 - e.g. the channel closed at shutdown
                return
            with self._lock:
                self._open = False
            log.warning("kvcache node %s answers again: loads and saves resume", self.probe.address)
            return

    def close(self) -> None:
        self._stop.set()
        self.probe.close()


_BREAKERS: dict[tuple[str, str | None, str | None], Breaker] = {}
_REGISTRY = threading.Lock()


class NodeGuard:
    """Deadlines and the node's shared breaker around one connector's ``KVStoreClient``; counts
    what this connector saw (``trips``: outages it found, ``skipped``: calls it did not make)."""

    def __init__(
        self,
        client: KVStoreClient,
        retry_s: float,
        token: str | None = None,
        tls_ca_file: str | None = None,
        min_timeout_s: float | None = None,
    ) -> None:
        """``client.timeout_s``: the longest deadline; ``min_timeout_s``: the shortest (None:
        every call gets the longest)."""
        self.client = client
        self._key = (client.address, token, tls_ca_file)
        self._max_s = client.timeout_s
        with _REGISTRY:
            breaker = _BREAKERS.get(self._key)
            if breaker is None:
                probe = KVStoreClient(
                    client.address, token, tls_ca_file, use_shm=False, timeout_s=client.timeout_s
                )
                latency = Latency(min_timeout_s or client.timeout_s, client.timeout_s)
                breaker = _BREAKERS[self._key] = Breaker(probe, retry_s, latency)
            breaker.users += 1
        self.breaker = breaker
        self.trips = 0
        self.skipped = 0
        self._closed = False

    @property
    def is_open(self) -> bool:
        return self.breaker.is_open

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` (a call of ``self.client``) unless the breaker is open (``BreakerOpen``);
        a failure for want of the node opens it."""
        if self.breaker.is_open:
            self.skipped += 1
            raise BreakerOpen(self.client.address)
        # NOTE: the client's calls (and the async ones it starts meanwhile) read timeout_s
        # when they are made: this connector's calls follow the node's latency.
        self.client.timeout_s = min(self._max_s, self.breaker.latency.deadline())
        t0 = time.perf_counter()
        try:
            out = fn()
        except KVCacheRpcError as e:
            self.failed(e)
            raise
        self.breaker.latency.observe(time.perf_counter() - t0)
        return out

    def result(self, pending: Future[T], timeout_s: float | None = None) -> T:
        """The result of an async call started through the client (deadline included)."""
        try:
            return pending.result(timeout=timeout_s)
        except KVCacheRpcError as e:
            self.failed(e)
            raise

    def failed(self, e: KVCacheRpcError) -> None:
        if self.breaker.trip(e):
            self.trips += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _REGISTRY:
            self.breaker.users -= 1
            if self.breaker.users == 0:
                _BREAKERS.pop(self._key, None)
                self.breaker.close()
