"""Bounds on a server's streaming RPCs, so that idle streams cannot starve its unary calls.

A sync gRPC server runs every RPC on one thread of its pool, a stream for as long as it is open:
a client that opens a Get and never reads it, or a Put and never sends, holds a worker, and a few
dozen such clients hold them all, so that no Lookup is answered. A ``StreamGate`` bounds one kind
of stream twice:

- a cap on how many are open at once (and, optionally, from one client address): one more is
  refused at once with RESOURCE_EXHAUSTED, so the pool always keeps workers for unary calls;
- an idle deadline on the peer: a stream blocked for ``idle_timeout_s`` waiting for the client to
  send its next message, or to take the last one sent (flow control: it stopped reading), is cut
  with DEADLINE_EXCEEDED. Time the server spends on its own work never counts: an Events stream
  that waits for new events, and is read whenever there are some, lives as long as its client,
  unless the gate has a ``max_lifetime_s`` (the streams anyone may open without a token).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, TypeVar

import grpc

from kvstore.errors import CapacityExhausted, KVStoreError

log = logging.getLogger(__name__)
T = TypeVar("T")


class StreamIdle(KVStoreError):
    """The peer neither sent nor read for too long; the stream was cut (DEADLINE_EXCEEDED)."""


class StreamWatch:
    """One open stream: when it started waiting on its peer, if it is waiting."""

    def __init__(
        self, gate: StreamGate, method: str, context: grpc.ServicerContext, peer: str = ""
    ) -> None:
        self.gate, self.method, self.context, self.peer = gate, method, context, peer
        self.opened = time.monotonic()
        self.waiting_since: float | None = None
        self.cut = False

    def receive(self, requests: Iterable[T]) -> Iterator[T]:
        """The client's messages; the wait for each one counts toward the idle deadline."""
        it = iter(requests)
        while True:
            self.waiting_since = time.monotonic()
            try:
                item = next(it)
            except StopIteration:
                return
            except grpc.RpcError:
                if self.cut:
                    raise self.gate.idle_error(self.method) from None
                raise
            finally:
                self.waiting_since = None
            yield item

    def send(self, replies: Iterable[T]) -> Iterator[T]:
        """Yield ``replies`` to gRPC; the time until it asks for the next one (it sends the last
        one, and waits while the client's flow-control window is full) counts toward the idle
        deadline. Producing a reply does not."""
        for item in replies:
            self.waiting_since = time.monotonic()
            yield item
            self.waiting_since = None
            if self.cut:  # the call is gone: stop producing
                raise self.gate.idle_error(self.method)


class StreamGate:
    """At most ``limit`` open streams of one kind (and at most ``per_peer_limit`` from one
    client address); each is cut after ``idle_timeout_s`` waiting on its peer, or once open for
    ``max_lifetime_s``. ``on_refused`` / ``on_cut`` get the method name (for metrics)."""

    def __init__(
        self,
        kind: str,
        limit: int,
        idle_timeout_s: float,
        on_refused: Callable[[str], None] = lambda method: None,
        on_cut: Callable[[str], None] = lambda method: None,
        per_peer_limit: int | None = None,
        max_lifetime_s: float | None = None,
    ) -> None:
        if limit < 1 or not idle_timeout_s > 0:
            raise ValueError(f"{kind} streams: need limit >= 1 and idle_timeout_s > 0")
        self.kind, self.limit, self.idle_timeout_s = kind, limit, idle_timeout_s
        self.per_peer_limit = per_peer_limit or limit
        self.max_lifetime_s = max_lifetime_s
        self._on_refused, self._on_cut = on_refused, on_cut
        self._lock = threading.Lock()
        self._open: set[StreamWatch] = set()
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def open_streams(self) -> int:
        with self._lock:
            return len(self._open)

    def open_by_owner(self) -> dict[str, int]:
        """Open streams per owner (client address or what ``enter`` was given)."""
        with self._lock:
            out: dict[str, int] = {}
            for w in self._open:
                out[w.peer] = out.get(w.peer, 0) + 1
            return out

    def idle_error(self, method: str) -> StreamIdle:
        return StreamIdle(
            f"{method} stream cut: the client neither sent nor read for {self.idle_timeout_s:g} s"
        )

    def _why_cut(self, watch: StreamWatch, now: float) -> str | None:
        if watch.waiting_since is not None and now - watch.waiting_since > self.idle_timeout_s:
            return str(self.idle_error(watch.method))
        if self.max_lifetime_s is not None and now - watch.opened > self.max_lifetime_s:
            return f"{watch.method} stream ended after {self.max_lifetime_s:g} s; open it again"
        return None

    @contextmanager
    def open(
        self, method: str, context: grpc.ServicerContext, owner: str | None | object = ...
    ) -> Iterator[StreamWatch]:
        watch = self.enter(method, context, owner)
        try:
            yield watch
        finally:
            self.leave(watch)

    def enter(
        self, method: str, context: grpc.ServicerContext, owner: str | None | object = ...
    ) -> StreamWatch:
        """Admit one stream (``CapacityExhausted`` when at a cap); ``leave`` it when it ends.
        ``owner``: whose share of ``per_peer_limit`` it takes (default: the client's address;
        None: nobody's, only the total cap applies)."""
        peer = _peer_host(context) if owner is ... else owner
        watch = StreamWatch(self, method, context, peer if isinstance(peer, str) else "")
        with self._lock:
            from_peer = sum(1 for w in self._open if w.peer == peer) if peer is not None else 0
            if len(self._open) >= self.limit:
                refused = f"this server already has {self.limit} open {self.kind} streams"
            elif peer is not None and from_peer >= self.per_peer_limit:
                refused = (
                    f"{peer or 'this client'} already has {self.per_peer_limit} open "
                    f"{self.kind} streams here"
                )
            else:
                refused = ""
                self._open.add(watch)
                if self._watchdog is None:
                    self._watchdog = threading.Thread(
                        target=self._watch, name=f"{self.kind}-stream-watchdog", daemon=True
                    )
                    self._watchdog.start()
        if refused:
            self._on_refused(method)
            raise CapacityExhausted(
                f"{method}: {refused}; retry later (or read and close the ones you hold)"
            )
        return watch

    def leave(self, watch: StreamWatch) -> None:
        with self._lock:
            self._open.discard(watch)

    def _watch(self) -> None:
        shortest = min(self.idle_timeout_s, self.max_lifetime_s or math.inf)
        period = min(0.5, shortest / 4)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                stuck = []
                for w in self._open:
                    why = None if w.cut else self._why_cut(w, now)
                    if why is not None:
                        w.cut = True
                        stuck.append((w, why))
            for w, why in stuck:
                log.info("%s", why)
                self._on_cut(w.method)
                _cancel(w.context, why)

    def close(self) -> None:
        self._stop.set()


def _peer_host(context: grpc.ServicerContext) -> str:
    """The client's address without its port (``ipv4:10.0.0.7:51234`` -> ``ipv4:10.0.0.7``)."""
    try:
        peer = str(context.peer())
    except Exception:  # noqa: BLE001 - a context without a peer: one shared bucket
        return ""
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


def _cancel(context: grpc.ServicerContext, details: str) -> None:
    """End the call now, from any thread: the handler blocked on the peer wakes up, and the
    client gets DEADLINE_EXCEEDED with ``details`` (trailers are not held back by flow control)."""
    # NOTE: grpc's public ServicerContext.cancel() sends a bare CANCELLED; the core call's
    # cancel-with-status says why. Fall back to the public one if the internals move.
    try:
        from grpc._cython import cygrpc  # type: ignore[attr-defined]

        context._rpc_event.call.cancel(  # type: ignore[attr-defined]
            cygrpc.StatusCode.deadline_exceeded, details
        )
    except Exception:  # noqa: BLE001 - any change of grpc internals: cancel plainly
        context.cancel()  # type: ignore[no-untyped-call]
