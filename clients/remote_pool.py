"""The pool beyond an engine's own node: a prefix cached on any node of the cluster is found in
the conductor's index (one ``Locate``, short deadline) and pulled into the engine's node by that
node's messenger; the engine then loads it from its own node as any hit, and the pages stay
there (the next request on that node hits locally).

vLLM (``clients.vllm_scheduler`` / ``vllm_worker``): the scheduler finds and submits the pull
(one RPC each: its thread never waits for pages), the request waits in vLLM's
``WAITING_FOR_REMOTE_KVS`` (``load_async``) while the worker waits for the batch in the
background, copies the pages into the request's blocks and reports it (``get_finished``); pages
that did not arrive are load errors, which vLLM recomputes. SGLang (``clients.sglang_hicache``):
``batch_exists`` counts what the pool holds, ``batch_get`` pulls what is elsewhere first (both
run on HiCache's prefetch threads, never on the scheduler's).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from rpc.status import KVCacheRpcError

from .conductor_client import ConductorClient
from .messenger_client import MessengerClient

log = logging.getLogger(__name__)

NODES_TTL_S = 10.0  # how long the cluster's node -> messenger map is trusted
HOLD_S = 5.0  # pulled pages stay pinned on the engine's node this long (its next steps load them)


def messengers(conductor: ConductorClient) -> dict[str, str]:
    """Node id -> the messenger it registered ("" when none), from the conductor."""
    return {s.node.node_id: str(s.node.messenger_address) for s in conductor.list_nodes().nodes}


class RemotePool:
    """The conductor's index and this engine's messenger, with deadlines."""

    def __init__(
        self,
        conductor: str | None,
        messenger: str,
        node_id: str,
        token: str | None,
        tls_ca_file: str | None,
        timeout_s: float,
        pull_timeout_s: float,
    ) -> None:
        self.conductor = (
            ConductorClient(conductor, token, tls_ca_file, timeout_s=timeout_s)
            if conductor
            else None
        )
        self.messenger = MessengerClient(messenger, token, tls_ca_file, timeout_s=timeout_s)
        self.node_id = node_id
        self.pull_timeout_s = pull_timeout_s
        # as long as the engine may take to load what arrived (by its deadline at the latest)
        self.hold_s = min(HOLD_S, pull_timeout_s)
        self._lock = threading.Lock()
        self._nodes: dict[str, str] = {}
        self._nodes_at = 0.0

    def find(self, namespace: str, keys: Sequence[bytes], local: int) -> tuple[int, str] | None:
        """(pages, source messenger) of the node that holds the most leading pages of ``keys``
        beyond ``local`` (what this engine's node holds); None when no other holds more, or
        without a conductor."""
        if self.conductor is None:
            return None
        held = self.conductor.locate(namespace, keys=keys)
        best = max(
            ((n, node) for node, n in held.items() if node != self.node_id and n > local),
            default=None,
        )
        if best is None:
            return None
        messenger = self._messenger_of(best[1])
        return (best[0], messenger) if messenger else None

    def _messenger_of(self, node_id: str) -> str:
        with self._lock:
            fresh = time.monotonic() - self._nodes_at < NODES_TTL_S
            if fresh and node_id in self._nodes:
                return self._nodes[node_id]
        assert self.conductor is not None
        nodes = messengers(self.conductor)
        with self._lock:
            self._nodes, self._nodes_at = nodes, time.monotonic()
        return nodes.get(node_id, "")

    def pull(self, namespace: str, keys: list[bytes], source: str, chain: bool = True) -> str:
        """Submit the pull of ``keys`` (``chain``: one prefix chain, in order) from ``source``;
        the batch id."""
        # urgent: a request waits on it, it must not queue behind the messenger's bulk jobs;
        # held: the pages stay pinned on this engine's node until it has loaded them (it loads
        # them in the step after it hears the pull is done), whatever the node evicts meanwhile
        batch = self.messenger.submit(
            namespace, [(k, source) for k in keys], chain, True, hold_s=self.hold_s
        )
        return batch.batch_id

    def wait(self, batch_id: str) -> bool:
        """Wait for a pull at most ``pull_timeout_s``: True once it finished. One that did not
        finish in time is cancelled; what did not arrive is the engine's to compute."""
        try:
            status = self.messenger.status(batch_id, wait=True, timeout_s=self.pull_timeout_s)
            if not status.finished:
                self.messenger.cancel(batch_id)
            return bool(status.finished)
        except KVCacheRpcError as e:
            log.warning("kvcache pull %s: %s; its pages are recomputed", batch_id, e)
            return False

    def close(self) -> None:
        if self.conductor is not None:
            self.conductor.close()
        self.messenger.close()
