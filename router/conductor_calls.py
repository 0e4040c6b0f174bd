"""The router's calls to the conductor: ``Schedule`` and ``Complete`` of the requests in flight
go in batches (``clients.coalesce``: one call's cost shared by every request that arrived
meanwhile); the schedules, which a request waits on, over one long-lived ``ScheduleStream``
written and read on the event loop (``clients.conductor_aio``; unary ``ScheduleBatch`` where the
conductor refuses streams), the completes, which nobody waits on, from a thread. The
conductor's refusals become the HTTP errors a client reads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging

import grpc

from clients.coalesce import AsyncCoalescer, Coalescer
from clients.conductor_aio import AsyncScheduleStream
from clients.conductor_client import ConductorClient, schedule_results
from proto import conductor_pb2 as cpb
from rpc.status import KVCacheRpcError

from .protocol import RouterError

log = logging.getLogger(__name__)


class ConductorCalls:
    def __init__(self, address: str, token: str | None, tls_ca: str | None) -> None:
        self.address = address
        self.client = ConductorClient(address, token, tls_ca)
        # its unary fallback and leader lookups block: a thread of their own, off the loop's
        self._unary = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="router-sched")
        self.stream = AsyncScheduleStream(self.client, self._unary)  # opened by the first batch
        self._schedules: AsyncCoalescer[cpb.ScheduleRequest, cpb.ScheduleReply] = AsyncCoalescer(
            self._schedule_batch
        )
        self._completes: Coalescer[cpb.CompleteRequest, None] = Coalescer(
            self.client.complete_results, "router-complete"
        )

    def schedule(self, call: cpb.ScheduleRequest) -> asyncio.Future[cpb.ScheduleReply]:
        """The conductor's decision, in the next batch: a future of the event loop's
        (``KVCacheRpcError`` if refused; ``error`` says it as the client hears it)."""
        return self._schedules.submit(call)

    def report(
        self, ledger_id: str, phase: int, prefill_s: float, transfer_s: float
    ) -> concurrent.futures.Future[None] | None:
        """A Complete, in the next batch (batches go in order, so a request's PREFILLED reaches
        the conductor before its FINISHED); its future, to wait on or not (None: the router is
        stopping)."""
        call = cpb.CompleteRequest(
            request_id=ledger_id,
            phase=phase,  # type: ignore[arg-type]
            prefill_seconds=prefill_s,
            transfer_seconds=transfer_s,
        )
        try:
            future = self._completes.submit(call)
        except RuntimeError:  # shutting down: the conductor expires the entry by itself
            log.info("Complete(%s) not sent: the router is stopping", ledger_id)
            return None
        future.add_done_callback(functools.partial(_log_failed_complete, ledger_id))
        return future

    async def aclose(self) -> None:
        """Send what is pending, then close the channels."""
        await self._schedules.aclose()
        await self.stream.aclose()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._completes.close)
        self._unary.shutdown(wait=False, cancel_futures=True)
        await loop.run_in_executor(None, self.client.close)

    def error(self, e: KVCacheRpcError) -> RouterError:
        """A conductor's refusal as the client hears it."""
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # NOTE: the conductor's estimate depends on how much of the prompt is cached, which
            # is not the caller's to learn (app.py): the reason goes out, the figures to the log.
            public, sep, _ = e.details.partition(": best estimate")
            if sep:
                log.info("conductor refused a request: %s", e.details)
                public += "; retry later or relax the SLO"
            return RouterError(429, public, "rate_limit_exceeded")
        if e.code == grpc.StatusCode.INVALID_ARGUMENT:
            return RouterError(400, e.details)
        if e.code == grpc.StatusCode.FAILED_PRECONDITION:
            return RouterError(503, e.details, "service_unavailable")
        return RouterError(
            503,
            f"conductor at {self.address}: {e.code.name}: {e.details}",
            "service_unavailable",
        )

    async def _schedule_batch(
        self, calls: list[cpb.ScheduleRequest]
    ) -> list[cpb.ScheduleReply | KVCacheRpcError]:
        # NOTE: the coalescer sends at most MAX_BATCH calls at once, the conductor's limit
        return schedule_results(await self.stream.schedule_batch(calls))


def _log_failed_complete(ledger_id: str, done: concurrent.futures.Future[None]) -> None:
    error = None if done.cancelled() else done.exception()
    if error is not None:  # it expires on its own (stale ledger entries)
        log.info("Complete(%s) failed: %s", ledger_id, error)
