"""The conductor's transfer hook: a plan becomes a ``SubmitTransfer`` on the destination's
messenger, naming the source's messenger for every key (``kvcache conductor --transfer-hook
messenger``). The conductor calls it from its dispatcher thread; it returns once the destination
messenger accepted the batch (the bytes move asynchronously)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

from clients.messenger_client import MessengerClient

from .scheduler import TransferPlan
from .transfer import TransferHook

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SubmittedBatch:
    request_id: str
    messenger: str  # the destination messenger that runs it
    batch_id: str
    blocks: int


class MessengerTransferHook(TransferHook):
    def __init__(
        self,
        token: str | None = None,
        tls_ca_file: str | None = None,
        timeout_s: float = 10.0,
        keep: int = 1024,
    ) -> None:
        self._token, self._tls, self._timeout = token, tls_ca_file, timeout_s
        self._lock = threading.Lock()
        self._clients: dict[str, MessengerClient] = {}
        self._recent: deque[SubmittedBatch] = deque(maxlen=keep)

    def submit(self, plan: TransferPlan) -> None:
        dst, src = plan.dst.messenger_address, plan.src.messenger_address
        if not dst:
            raise ValueError(
                f"destination node {plan.dst.node_id} registered no messenger "
                "(start it with --messenger ADDR)"
            )
        if not src:
            raise ValueError(f"source node {plan.src.node_id} registered no messenger")
        if not plan.keys:
            return
        reply = self._client(dst).submit(plan.namespace, [(k, src) for k in plan.keys])
        batch = SubmittedBatch(plan.request_id, dst, reply.batch_id, len(plan.keys))
        with self._lock:
            self._recent.append(batch)
        log.info(
            "request %s: %d blocks %s -> %s, batch %s on %s",
            plan.request_id,
            len(plan.keys),
            plan.src.node_id,
            plan.dst.node_id,
            reply.batch_id,
            dst,
        )

    def recent(self) -> list[SubmittedBatch]:
        with self._lock:
            return list(self._recent)

    def _client(self, address: str) -> MessengerClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = MessengerClient(address, self._token, self._tls, self._timeout)
                self._clients[address] = client
            return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()


def make_transfer_hook(
    token: str | None = None, tls_ca_file: str | None = None
) -> MessengerTransferHook:
    return MessengerTransferHook(token, tls_ca_file)
