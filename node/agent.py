"""``NodeAgent``: runs inside a node server process; keeps the node registered with the conductor.

It registers (descriptor: id, role, addresses, layouts, capacity), then heartbeats every
``heartbeat_interval_s`` the conductor suggests, carrying the node's current load. When the
conductor answers NOT_FOUND (the lease lapsed, or the conductor restarted) it registers again,
which makes the conductor rebuild the node's index entries from a snapshot. An unreachable
conductor is retried with backoff and reported once per outage, not once per attempt.

The block events themselves do not go through the agent: the conductor subscribes to the node's
``Events`` stream at the registered address.

With ``--etcd`` the node registers in etcd instead (``start_etcd_registration``): no conductor
address to know, and every conductor (leader and standbys) learns of it from its watch.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from plumbing.etcd import EtcdClient
from plumbing.registration import NodeRecord, Registration, new_incarnation, nodes_prefix
from proto import conductor_pb2 as pb
from proto import conductor_pb2_grpc as pbg
from rpc.channel import make_channel
from rpc.cluster import NodeDescriptor, NodeLoad, Role
from rpc.wire import descriptor_to_pb, load_to_pb, usage_of

from .config import NodeConfig
from .node import Node

log = logging.getLogger(__name__)


class NodeAgent:
    def __init__(
        self,
        conductor: str,
        token: str | None,
        descriptor: NodeDescriptor,
        load: Callable[[], NodeLoad],
        tls_ca_file: str | None = None,
        rpc_timeout_s: float = 3.0,
        retry_s: float = 0.5,
        max_retry_s: float = 5.0,
    ) -> None:
        self.conductor = conductor
        self.descriptor = descriptor
        self._load = load
        self._channel = make_channel(conductor, token, tls_ca_file)
        self._stub = pbg.ConductorServiceStub(self._channel)
        self._timeout = rpc_timeout_s
        self._retry_s, self._max_retry_s = retry_s, max_retry_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._stale = False  # the descriptor changed since the last registration
        self.registered = threading.Event()
        self.generation = 0
        self.interval_s = 1.0
        self.registrations = 0
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"agent-{descriptor.node_id}"
        )

    def start(self) -> "NodeAgent":
        self._thread.start()
        return self

    def update(self, descriptor: NodeDescriptor) -> None:
        """The node serves other layouts now: register again with ``descriptor`` (the
        conductor then reads the node's event feed from a snapshot)."""
        self.descriptor = descriptor
        self._stale = True
        self._wake.set()

    def wait_registered(self, timeout: float) -> bool:
        return self.registered.wait(timeout)

    def stop(self, unregister: bool = True) -> None:
        """Stop heartbeating; with ``unregister`` tell the conductor to drop the node now
        (otherwise its lease lapses)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(self._timeout + 1)
        if unregister and self.generation:
            try:
                self._stub.UnregisterNode(
                    pb.UnregisterNodeRequest(
                        node_id=self.descriptor.node_id, generation=self.generation
                    ),
                    timeout=self._timeout,
                )
            except grpc.RpcError as e:
                log.info("unregister from conductor %s failed: %s", self.conductor, e.code().name)
        self._channel.close()

    # ---- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = self._retry_s
        failing = False
        while not self._stop.is_set():
            try:
                if not self.registered.is_set() or self._stale:
                    self._stale = False
                    self._register()
                else:
                    self._heartbeat()
                if failing:
                    log.info("conductor %s reachable again", self.conductor)
                failing, backoff = False, self._retry_s
                wait = self.interval_s
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning(
                        "conductor %s forgot node %s (%s); registering again",
                        self.conductor,
                        self.descriptor.node_id,
                        e.details(),
                    )
                    self.registered.clear()
                    continue
                if not failing:
                    log.warning(
                        "conductor %s: %s %s; retrying", self.conductor, e.code().name, e.details()
                    )
                failing = True
                wait, backoff = backoff, min(backoff * 2, self._max_retry_s)
            self._wake.wait(wait)
            self._wake.clear()

    def _current_load(self) -> NodeLoad | None:
        try:
            return self._load()
        except Exception:  # a broken load probe must not stop the lease: heartbeat without it
            log.exception("reading node load failed; heartbeating without load")
            return None

    def _register(self) -> None:
        load = self._current_load() or NodeLoad()
        reply = self._stub.RegisterNode(
            pb.RegisterNodeRequest(node=descriptor_to_pb(self.descriptor), load=load_to_pb(load)),
            timeout=self._timeout,
        )
        self.generation = reply.generation
        self.interval_s = max(reply.heartbeat_interval_s, 0.05)
        self.registrations += 1
        self.registered.set()
        log.info(
            "registered node %s with conductor %s (generation %d, heartbeat %.2fs)",
            self.descriptor.node_id,
            self.conductor,
            reply.generation,
            self.interval_s,
        )

    def _heartbeat(self) -> None:
        load = self._current_load()
        request = pb.HeartbeatRequest(node_id=self.descriptor.node_id, generation=self.generation)
        if load is not None:
            request.load.CopyFrom(load_to_pb(load))
        self._stub.Heartbeat(request, timeout=self._timeout)


# ---- the node server's side ---------------------------------------------------------------------


def node_load(node: Node) -> NodeLoad:
    """A node's pools as a NodeLoad (one TierUsage per namespace and tier). Engine-side load
    (queued prefill, running decode) is unknown to the node server: 0."""
    return NodeLoad(
        tiers=tuple(
            usage_of(t, node.stores[ns].layout.page_bytes)
            for ns, stats in node.usage().items()
            for t in stats
        )
    )


def _descriptor(cfg: NodeConfig, node: Node, address: str) -> NodeDescriptor:
    return NodeDescriptor(
        node_id=node.node_id,
        role=Role.parse(cfg.role or "both"),
        address=address,
        messenger_address=cfg.messenger or "",
        layouts=tuple(store.layout for store in list(node.stores.values())),
        capacity=node_load(node).tiers,
    )


def start_node_agent(cfg: NodeConfig, node: Node, address: str) -> NodeAgent:
    """Start an agent for ``kvcache node --conductor ADDR`` (``address``: where others reach
    its NodeService)."""
    assert cfg.conductor, "start_node_agent needs cfg.conductor"
    descriptor = _descriptor(cfg, node, address)
    agent = NodeAgent(
        cfg.conductor,
        cfg.conductor_token,
        descriptor,
        lambda: node_load(node),
        tls_ca_file=cfg.conductor_tls_ca,
    )
    node.on_layouts.append(lambda: agent.update(_descriptor(cfg, node, address)))
    return agent.start()


def start_etcd_registration(cfg: NodeConfig, node: Node, address: str) -> Registration:
    """``kvcache node --etcd URLS``: the node's record (descriptor, load, incarnation) under
    ``<prefix>/nodes/<node_id>`` with a lease; conductors learn the membership by watching."""
    assert cfg.etcd, "start_etcd_registration needs cfg.etcd"
    incarnation = new_incarnation()

    def record() -> bytes:
        # NOTE: described anew each time: layouts registered at run time join the record.
        return NodeRecord(
            descriptor=_descriptor(cfg, node, address),
            load=node_load(node),
            incarnation=incarnation,
        ).encode()

    return Registration(
        EtcdClient(cfg.etcd, ca_file=cfg.etcd_ca, cert_file=cfg.etcd_cert, key_file=cfg.etcd_key),
        nodes_prefix(cfg.etcd_prefix) + node.node_id,
        record,
        ttl_s=cfg.etcd_ttl_s,
    ).start()
