"""Hot-block replication: what the conductor does with a plan that moves blocks to a non-holder.

``TransferHook.submit(plan)`` starts moving ``plan.keys`` from ``plan.src`` to ``plan.dst``
(normally: ask the destination's messenger to fetch them). The real hook is
``conductor.messenger_hook.make_transfer_hook(token, tls_ca_file) -> TransferHook`` (``kvcache
conductor --transfer-hook auto|messenger``); ``RecordingTransferHook`` keeps the plans for
inspection (``--transfer-hook record``).

``TransferDispatcher`` calls a hook from its own thread so that a slow hook (a gRPC call to a
messenger) never delays a ``Schedule`` reply. Its queue is bounded: when it is full a plan is
dropped and counted (the request still runs; its prefill recomputes what did not move).
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections import deque

from .scheduler import TransferPlan

log = logging.getLogger(__name__)


class TransferHook(ABC):
    """Starts a block transfer. May block briefly; raise to report a failure."""

    @abstractmethod
    def submit(self, plan: TransferPlan) -> None: ...


class RecordingTransferHook(TransferHook):
    """Keeps the last ``keep`` plans (thread-safe); moves nothing."""

    def __init__(self, keep: int = 1024) -> None:
        self._plans: deque[TransferPlan] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.submitted = 0

    def submit(self, plan: TransferPlan) -> None:
        with self._cond:
            self._plans.append(plan)
            self.submitted += 1
            self._cond.notify_all()
        log.debug(
            "transfer plan for %s: %d blocks %s -> %s",
            plan.request_id,
            len(plan.keys),
            plan.src.node_id,
            plan.dst.node_id,
        )

    def plans(self) -> list[TransferPlan]:
        with self._lock:
            return list(self._plans)

    def wait_for(self, count: int, timeout: float) -> bool:
        """Wait until at least ``count`` plans were submitted in total."""
        with self._cond:
            return self._cond.wait_for(lambda: self.submitted >= count, timeout)


class TransferDispatcher:
    """Runs ``hook.submit`` on a background thread; ``dispatch`` never blocks.

    Failures and drops are counted per plan but logged once per episode (the first failure of
    transfers to a destination, and again when they work again; the first drop of a full queue,
    and the count when plans are queued again): a node registered without a messenger would
    otherwise log a traceback per ``Schedule``."""

    def __init__(self, hook: TransferHook, max_queued: int = 4096) -> None:
        self.hook = hook
        # NOTE: SimpleQueue (C) instead of Queue (a Python lock and condition per put): dispatch
        # runs for most decisions of the global-cache policy. Bounded by the qsize check.
        self._queue: queue.SimpleQueue[TransferPlan | None] = queue.SimpleQueue()
        self.max_queued = max_queued
        self.dropped = 0
        self.failed = 0
        self.submitted = 0
        self._dropping = 0  # plans dropped since the queue was last found full
        self._failing: dict[str, int] = {}  # destination node -> failed plans this episode
        self._thread = threading.Thread(target=self._run, name="transfer-hook", daemon=True)
        self._thread.start()

    def dispatch(self, plan: TransferPlan) -> bool:
        """Queue ``plan``; False (counted) when the queue is full."""
        if self._queue.qsize() >= self.max_queued:
            self.dropped += 1
            self._dropping += 1
            if self._dropping == 1:
                log.warning(
                    "transfer queue full (%d plans): dropping plans, first for request %s "
                    "(%d blocks %s -> %s); their prefills recompute those blocks",
                    self.max_queued,
                    plan.request_id,
                    len(plan.keys),
                    plan.src.node_id,
                    plan.dst.node_id,
                )
            return False
        if self._dropping:
            log.warning("transfer queue accepts plans again; %d were dropped", self._dropping)
            self._dropping = 0
        self._queue.put(plan)
        return True

    def _run(self) -> None:
        while True:
            plan = self._queue.get()
            if plan is None:
                return
            dst = plan.dst.node_id
            try:
                self.hook.submit(plan)
            except Exception:  # a failed transfer must not kill the dispatcher: log and count
                self.failed += 1
                failed = self._failing[dst] = self._failing.get(dst, 0) + 1
                if failed == 1:
                    log.warning(
                        "transfer hook failed for request %s (%s -> %s); further failures of "
                        "transfers to %s are counted, not logged, until one succeeds",
                        plan.request_id,
                        plan.src.node_id,
                        dst,
                        dst,
                        exc_info=True,
                    )
                continue
            self.submitted += 1
            if self._failing:
                failed = self._failing.pop(dst, 0)
                if failed:
                    log.warning("transfers to %s work again after %d failed plans", dst, failed)

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "transfer hook still busy at shutdown: %d plans not submitted",
                self._queue.qsize(),
            )
