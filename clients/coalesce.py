"""Calls to the conductor from many requests in flight, made as one batch RPC (group commit):
while a batch is on the wire the calls that arrive wait, then go together in the next. A call
alone goes at once, so one stream pays what a unary call costs; 128 streams pay a fraction of a
call each instead of a call each (the router's profile at 128 streams: 60% of its time in
threads waiting on the conductor's Schedule and Complete, most of it gRPC's per-call cost on
both sides). Front ends use it: ``kvcache router`` and ``bench live``."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from typing import Any, Awaitable, Callable, Generic, Sequence, TypeVar

log = logging.getLogger(__name__)

I = TypeVar("I")  # noqa: E741 - an item of a batch
R = TypeVar("R")

MAX_BATCH = 1024  # the conductor's limit per batch RPC


class _Batches:
    """What both coalescers do with a batch's answer: count it, and hand each call its own
    result or exception (a future done meanwhile: its caller left, and handles that)."""

    def __init__(self) -> None:
        self.batches = 0  # batch RPCs made (what the tests and metrics read)
        self.items = 0

    def _settle(
        self, futures: Sequence[Future[Any] | asyncio.Future[Any]], results: Sequence[Any]
    ) -> None:
        if len(results) != len(futures):  # a send that miscounts fails every call
            results = [RuntimeError(f"{len(results)} results for {len(futures)} calls")] * len(
                futures
            )
        self.batches += 1
        self.items += len(futures)
        for future, result in zip(futures, results):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


class Coalescer(_Batches, Generic[I, R]):
    """``submit(item)`` -> a future of its result. ``send(items)`` makes one batch RPC and
    returns each item's result or exception, in order; an exception it raises fails them all."""

    def __init__(
        self,
        send: Callable[[list[I]], Sequence[R | BaseException]],
        name: str,
        max_batch: int = MAX_BATCH,
    ) -> None:
        self._send = send
        self._max = max_batch
        self._cond = threading.Condition()
        self._pending: list[tuple[I, Future[R]]] = []
        self._closed = False
        super().__init__()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: I) -> Future[R]:
        future: Future[R] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("closed: the front end is stopping")
            self._pending.append((item, future))
            self._cond.notify()
        return future

    def close(self) -> None:
        """Send what is pending, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return  # closed, nothing left
                batch, self._pending = self._pending[: self._max], self._pending[self._max :]
            live = [(item, f) for item, f in batch if f.set_running_or_notify_cancel()]
            if not live:
                continue
            try:
                results = self._send([item for item, _ in live])
            except BaseException as e:  # noqa: BLE001 - every caller hears of it
                results = [e] * len(live)
            self._settle([f for _, f in live], results)


class AsyncCoalescer(_Batches, Generic[I, R]):
    """The same group commit on an event loop: ``submit(item)`` -> an asyncio future of its
    result; ``send(items)`` is awaited, one batch at a time (a task runs while calls wait).
    A future cancelled before its batch goes is left out of it."""

    def __init__(
        self,
        send: Callable[[list[I]], Awaitable[Sequence[R | BaseException]]],
        max_batch: int = MAX_BATCH,
    ) -> None:
        self._send = send
        self._max = max_batch
        self._pending: list[tuple[I, asyncio.Future[R]]] = []
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        super().__init__()

    def submit(self, item: I) -> asyncio.Future[R]:
        if self._closed:
            raise RuntimeError("closed: the front end is stopping")
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        return future

    async def aclose(self) -> None:
        """Send what is pending, then take no more."""
        self._closed = True
        if self._task is not None:
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[: self._max], self._pending[self._max :]
                live = [(item, f) for item, f in batch if not f.done()]
                if not live:
                    continue
                try:
                    results = await self._send([item for item, _ in live])
                except Exception as e:  # noqa: BLE001 - every caller hears of it
                    results = [e] * len(live)
                self._settle([f for _, f in live], results)
        finally:
            self._task = None
