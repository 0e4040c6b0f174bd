"""A small client of ``MessengerService`` (used by the conductor hook, tests and tools)."""

from __future__ import annotations

import time
from typing import Any, Iterable, Sequence

import grpc

from proto import messenger_pb2 as pb
from proto import messenger_pb2_grpc as pbg
from rpc.channel import check_health, make_channel
from rpc.status import KVCacheRpcError, call

MAX_WAIT_S = 600.0  # the longest wait a messenger takes in one call (SubmitTransfer.wait_s)


class MessengerClient:
    def __init__(
        self,
        address: str,
        token: str | None = None,
        tls_ca_file: str | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = make_channel(address, token, tls_ca_file)
        # NOTE: the generated *_pb2_grpc.py stubs carry no annotations (replies are Any).
        self._stub = pbg.MessengerServiceStub(self._channel)  # type: ignore[no-untyped-call]

    def _call(self, name: str, request: Any, timeout_s: float | None = None) -> Any:
        return call(getattr(self._stub, name), name, request, timeout=timeout_s or self.timeout_s)

    def info(self) -> pb.MessengerInfo:
        reply: pb.MessengerInfo = self._call("GetInfo", pb.MessengerInfoRequest())
        return reply

    def submit(
        self,
        namespace: str,
        entries: Iterable[tuple[bytes, str]],
        chain: bool = False,
        urgent: bool = False,
        hold_s: float = 0.0,
        wait_s: float = 0.0,
    ) -> pb.SubmitTransferReply:
        """``entries``: (key, source messenger gRPC address) pairs; ``chain``: their keys are
        one prefix chain in order (a prompt's blocks), linked as such on the destination;
        ``urgent``: a request waits on them (not queued behind bulk jobs); ``hold_s``: the
        destination node keeps them pinned that long once they are there (at most 60 s), so
        the reader this batch's end is for finds them though the node evicts meanwhile;
        ``wait_s``: the messenger answers once the batch finished or that long passed, with its
        status in ``reply.status`` (one round trip for a pull; an older messenger leaves it
        unset)."""
        reply: pb.SubmitTransferReply = self._call(
            "SubmitTransfer",
            pb.SubmitTransferRequest(
                namespace=namespace,
                entries=[pb.TransferEntry(key=k, source=s) for k, s in entries],
                chain=chain,
                urgent=urgent,
                hold_s=hold_s,
                wait_s=wait_s,
            ),
            timeout_s=wait_s + 10 if wait_s else None,
        )
        return reply

    def status(
        self, batch_id: str, wait: bool = False, timeout_s: float = 30.0
    ) -> pb.TransferStatusReply:
        """The batch's status; with ``wait``, once it finished or ``timeout_s`` passed. A
        messenger with many waiting calls answers some at once: then this polls, backing off."""
        deadline = time.monotonic() + timeout_s
        pause = 0.01
        while True:
            left = max(0.001, deadline - time.monotonic())
            reply: pb.TransferStatusReply = self._call(
                "TransferStatus",
                pb.TransferStatusRequest(batch_id=batch_id, wait=wait, timeout_s=left),
                timeout_s=left + 10 if wait else None,
            )
            if not wait or reply.finished or time.monotonic() + pause >= deadline:
                return reply
            time.sleep(pause)
            pause = min(2 * pause, 0.5)

    def status_future(self, batch_id: str, timeout_s: float) -> Any:
        """A TransferStatus(wait) call left in flight (a grpc future: ``done()``, ``result()``
        once done, ``cancel()``): it answers once the batch finished or ``timeout_s`` passed."""
        request = pb.TransferStatusRequest(batch_id=batch_id, wait=True, timeout_s=timeout_s)
        return self._stub.TransferStatus.future(request, timeout=timeout_s + 10)

    def pull(
        self,
        namespace: str,
        keys: Sequence[bytes],
        source: str,
        timeout_s: float = 30.0,
        chain: bool = False,
        urgent: bool = False,
    ) -> pb.TransferStatusReply:
        """Have this messenger fetch ``keys`` from the messenger at ``source`` and wait for the
        batch (keys its node holds already count as done, keys in flight are joined). A batch
        not finished after ``timeout_s`` is cancelled: ``KVCacheRpcError`` DEADLINE_EXCEEDED.
        Entries that failed (e.g. evicted on the source) are in the reply, not raised.
        ``chain``, ``urgent``: as in ``submit``."""
        start = time.monotonic()
        batch = self.submit(
            namespace, [(k, source) for k in keys], chain, urgent, wait_s=min(timeout_s, MAX_WAIT_S)
        )
        status = batch.status
        if not status.finished:  # still running, or a messenger that did not wait
            left = max(0.001, timeout_s - (time.monotonic() - start))
            status = self.status(batch.batch_id, wait=True, timeout_s=left)
        if not status.finished:
            self.cancel(batch.batch_id)
            raise KVCacheRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"transfer of {len(keys)} blocks from {source} to {self.address} not done "
                f"after {timeout_s:g} s (cancelled)",
                "TransferStatus",
            )
        return status

    def cancel(self, batch_id: str) -> pb.TransferStatusReply:
        reply: pb.TransferStatusReply = self._call("Cancel", pb.CancelRequest(batch_id=batch_id))
        return reply

    def stats(self) -> pb.MessengerStats:
        """Transfers in flight and byte totals since start (admin token)."""
        reply: pb.MessengerStats = self._call("Stats", pb.MessengerStatsRequest())
        return reply

    def health(self) -> str:
        """gRPC health: "SERVING", "NOT_SERVING", or why the check failed ("UNAVAILABLE")."""
        return check_health(self._channel, min(self.timeout_s, 5.0))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "MessengerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
