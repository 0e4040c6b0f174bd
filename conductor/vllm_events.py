"""The conductor fed by vLLM's KV events: engines that publish ``BlockStored`` / ``BlockRemoved``
/ ``AllBlocksCleared`` (``kv_events_config``, ZMQ + msgpack) become nodes of the index, so a
fleet of vLLM engines gets KV-aware routing even for blocks that live only in their own caches.

    kvcache conductor --vllm-layout model=llama3-8b,num_layers=32,kv_heads=8,head_dim=128,\\
        dtype=bfloat16,block_tokens=256 --vllm-events tcp://10.0.0.5:5557=engine-0

Each engine is registered as a node (role both, no NodeService address) whose lease the feed
renews while it runs. vLLM names blocks by its own hashes in ``block_size``-token blocks;
``KeyChain`` follows its parent links and re-chunks the token ids into our ``block_tokens``
blocks, so the index holds the same keys every kvcache client computes (docs/api.md). A block of
ours is held while every vLLM block it spans is. Batches carry sequence numbers: a gap is filled
from the engine's replay socket (``ENDPOINT,REPLAY=NODE_ID``); without one, or when the replay
cannot fill it, the node's entries are cleared and rebuilt from what arrives next, since a missed
event would leave the index wrong, not just stale.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import xxhash
import zmq

from kvstore.errors import InvalidArgument, NotFound
from kvstore.keys import root_key
from kvstore.layout import KVLayout
from proto import common_pb2 as cpb
from rpc.cluster import NodeDescriptor, Role

from .core import Conductor, StaleFeed

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def parse_vllm_events(spec: str) -> tuple[str, str | None, str]:
    """``ENDPOINT[,REPLAY_ENDPOINT]=NODE_ID`` -> (endpoint, replay endpoint or None, node id)."""
    endpoints, sep, node_id = spec.rpartition("=")
    if not sep or not endpoints or not node_id:
        raise InvalidArgument(
            f"--vllm-events expects ENDPOINT[,REPLAY_ENDPOINT]=NODE_ID, got {spec!r}"
        )
    endpoint, _, replay = endpoints.partition(",")
    return endpoint, replay or None, node_id


@dataclass(frozen=True)
class _Chain:
    """Where the chain of our keys stands after one vLLM block."""

    prev: bytes  # our key of the last full block of ours so far
    pending: bytes  # token ids (little-endian uint32) not yet a full block of ours
    span: tuple[Hashable, ...]  # the vLLM blocks whose tokens are in ``pending``


class KeyChain:
    """vLLM block events of one engine -> our STORED / EVICTED keys."""

    def __init__(self, layout: KVLayout, salt: bytes = b"") -> None:
        self.block_bytes = 4 * layout.block_tokens
        self.root = root_key(layout.namespace, salt)
        self._blocks: dict[Hashable, _Chain] = {}
        self._spans: dict[bytes, set[Hashable]] = {}  # our key -> the vLLM blocks it spans
        self.unknown_parents = 0

    def stored(self, hashes: list[Any], parent: Any, token_ids: list[int]) -> list[bytes]:
        """Our keys completed by these vLLM blocks (a key stored again is harmless)."""
        if parent is None:
            state = _Chain(self.root, b"", ())
        else:
            known = self._blocks.get(_hashable(parent))
            if known is None:  # joined after the parent was announced: the chain is unknown
                self.unknown_parents += 1
                return []
            state = known
        data = np.asarray(token_ids, dtype="<u4").tobytes()
        per = len(data) // max(len(hashes), 1)
        out: list[bytes] = []
        for i, h in enumerate(hashes):
            hk = _hashable(h)
            pending = state.pending + data[i * per : (i + 1) * per]
            span, prev = (*state.span, hk), state.prev
            while len(pending) >= self.block_bytes:
                prev = xxhash.xxh3_128_digest(prev + pending[: self.block_bytes])
                pending = pending[self.block_bytes :]
                self._spans.setdefault(prev, set()).update(span)
                out.append(prev)
                span = (hk,) if pending else ()
            state = _Chain(prev, pending, span)
            self._blocks[hk] = state
        return out

    def removed(self, hashes: list[Any]) -> list[bytes]:
        """Our keys no longer held: those spanning any of these vLLM blocks."""
        gone = {_hashable(h) for h in hashes}
        out = [k for k, span in self._spans.items() if span & gone]
        for k in out:
            del self._spans[k]
        for h in gone:
            self._blocks.pop(h, None)
        return out

    def held(self) -> list[bytes]:
        """Our keys the engine holds now."""
        return list(self._spans)

    def cleared(self) -> list[bytes]:
        out = self.held()
        self._spans.clear()
        self._blocks.clear()
        return out


def _hashable(h: Any) -> Hashable:
    """vLLM block hashes decode as bytes or ints (or lists, for tuple hashes)."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    return h if isinstance(h, Hashable) else tuple(h)


class VllmEventFeed:
    """One engine's event stream into the conductor's index, on a thread of its own."""

    def __init__(
        self,
        conductor: Conductor,
        layout: KVLayout,
        endpoint: str,
        replay: str | None,
        node_id: str,
        topic: str = "",
        poll_ms: int = 200,
    ) -> None:
        self.conductor, self.layout, self.node_id = conductor, layout, node_id
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay, topic
        self.chain = KeyChain(layout)
        self.last_vllm_seq = -1
        self.applied = 0
        self.resets = 0
        self._seq = 0  # our own event numbers for the index
        self._generation = 0
        self._poll_ms = poll_ms
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"vllm-events-{node_id}", daemon=True
        )
        self._decoder = msgspec.msgpack.Decoder()

    def start(self) -> "VllmEventFeed":
        self._register()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.conductor.unregister(self.node_id, self._generation)

    # ---- membership: the engine cannot heartbeat, so its feed does ---------------------------

    def _register(self) -> None:
        state = self.conductor.register(
            NodeDescriptor(node_id=self.node_id, role=Role.BOTH, layouts=(self.layout,))
        )
        self._generation, self._seq = state.generation, 0
        # A new registration starts with empty index entries; the engine still holds its blocks.
        self._apply([(cpb.EVENT_STORED, k) for k in self.chain.held()])

    def _renew(self) -> None:
        try:
            self.conductor.heartbeat(self.node_id, None, self._generation)
        except NotFound:  # the lease lapsed: register again, re-announce what the engine holds
            log.warning("vLLM engine %s: lease lapsed; registering it again", self.node_id)
            self._register()

    # ---- the stream ---------------------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        lease = self.conductor.registry.lease_s
        try:
            while not self._stop.is_set():
                self._renew()
                waited = 0.0
                while waited < lease / 4 and not self._stop.is_set():
                    if sub.poll(self._poll_ms):
                        self._receive(sub.recv_multipart())
                    waited += self._poll_ms / 1000
        except Exception:  # noqa: BLE001 - a feed must not kill the conductor; say so loudly
            log.exception("vLLM event feed of %s stopped", self.node_id)
        finally:
            sub.close(0)

    def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            log.warning("vLLM engine %s: malformed message of %d frames", self.node_id, len(frames))
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq <= self.last_vllm_seq:
            return
        if seq != self.last_vllm_seq + 1 and not self._replay(self.last_vllm_seq + 1, seq):
            log.warning(
                "vLLM engine %s: events %d..%d lost; clearing its index entries",
                self.node_id,
                self.last_vllm_seq + 1,
                seq - 1,
            )
            self.resets += 1
            self._apply([(cpb.EVENT_EVICTED, k) for k in self.chain.cleared()])
        self._batch(seq, payload)

    def _replay(self, first: int, upto: int) -> bool:
        """Fetch batches ``first..upto-1`` from the engine's replay socket; True when all came."""
        if self.replay_endpoint is None:
            return False
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart([b"", first.to_bytes(8, "big")])
            while sock.poll(2000):
                frames = sock.recv_multipart()
                if len(frames) < 4 or frames[-2] == END_SEQ:
                    break
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == self.last_vllm_seq + 1 and seq < upto:
                    self._batch(seq, frames[-1])
        finally:
            sock.close(0)
        return self.last_vllm_seq + 1 == upto

    def _batch(self, seq: int, payload: bytes) -> None:
        self.last_vllm_seq = seq
        try:
            batch = self._decoder.decode(payload)
            events = batch[1]
        except (msgspec.DecodeError, IndexError, TypeError) as e:
            log.warning("vLLM engine %s: undecodable batch %d (%s)", self.node_id, seq, e)
            return
        out: list[tuple[int, bytes]] = []
        for ev in events:
            kind = ev.get("type") if isinstance(ev, dict) else None
            if kind == "BlockStored":
                keys = self.chain.stored(
                    ev.get("block_hashes") or [],
                    ev.get("parent_block_hash"),
                    ev.get("token_ids") or [],
                )
                out += [(cpb.EVENT_STORED, k) for k in keys]
            elif kind == "BlockRemoved":
                out += [
                    (cpb.EVENT_EVICTED, k) for k in self.chain.removed(ev.get("block_hashes") or [])
                ]
            elif kind == "AllBlocksCleared":
                out += [(cpb.EVENT_EVICTED, k) for k in self.chain.cleared()]
        self._apply(out)

    def _apply(self, events: Iterable[tuple[int, bytes]]) -> None:
        msgs = []
        for kind, key in events:
            self._seq += 1
            msgs.append(cpb.BlockEvent(seq=self._seq, kind=kind, key=key, tier=cpb.TIER_GPU))
        if not msgs:
            return
        try:
            self.applied += self.conductor.apply_events(self.node_id, self._generation, msgs)
        except StaleFeed:  # dropped meanwhile: the next renewal registers it again
            log.info("vLLM engine %s: feed is stale; events dropped", self.node_id)
