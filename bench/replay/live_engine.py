"""The emulated inference engine of ``kvcache bench live``: one trace request through a running
cluster, with real page bytes.

Per request (``Engine.serve``):

1. prompt tokens from the trace's ``hash_ids`` (``prompt_tokens``): equal hash-id prefixes give
   equal tokens, hence equal block keys on every node;
2. conductor ``Schedule`` -> a plan, or a rejection (``RESOURCE_EXHAUSTED``: an SLO cannot be met);
3. prefill node: ``Lookup``; wait for the plan's transfer (hot-block replication by the
   destination messenger) to land; ``Acquire`` the reusable prefix and verify its bytes in shared
   memory; "compute" the missing full blocks as synthetic pages (``SyntheticKV``: bytes are a
   function of the block key and layer) and store them (allocate / write / commit);
   ``Complete(PREFILLED)``;
4. decode node: its messenger pulls every full block from the prefill node's messenger
   (``SubmitTransfer`` + ``TransferStatus(wait)``) while the prefill node keeps them pinned; the
   pages are verified in the decode node's shared memory; ``Complete(FINISHED)``.

The trailing partial block of a prompt is never cached (only full blocks are), so it is neither
stored nor moved here.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable

import grpc
import numpy as np

from clients.coalesce import Coalescer
from clients.conductor_client import ConductorClient, schedule_request, schedule_results
from clients.messenger_client import MessengerClient
from clients.node_client import KVCacheRpcError, KVStoreClient, ReadLease
from kvstore.layout import KVLayout
from proto import conductor_pb2 as cpb
from proto import messenger_pb2 as mpb
from rpc.wire import transfer_keys

from .trace import TraceRequest


class LiveError(Exception):
    """A request step that went wrong; the message says which step and why."""


# ---- the cluster -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClusterNode:
    id: str
    role: str
    address: str
    messenger: str
    messenger_metrics: str | None  # host:port of the messenger's Prometheus endpoint


@dataclass(frozen=True, kw_only=True)
class ClusterInfo:
    conductor: str
    token: str | None
    nodes: list[ClusterNode]
    source: str
    tls_ca: str | None = None  # the cluster's CA (PEM) when its services serve TLS
    conductors: tuple[str, ...] = ()  # every conductor (with etcd: a leader and standbys)
    etcd: tuple[str, ...] = ()  # etcd endpoints, where the leader is found
    etcd_prefix: str = "/kvcache"
    etcd_tls: tuple[str | None, str | None, str | None] = (None, None, None)  # ca, cert, key

    def by_messenger(self) -> dict[str, ClusterNode]:
        return {n.messenger: n for n in self.nodes}

    def conductor_client(self, timeout_s: float = 10.0) -> ConductorClient:
        """A client of the leading conductor that follows a failover."""
        return ConductorClient(
            list(self.conductors) or self.conductor,
            self.token,
            self.tls_ca,
            timeout_s=timeout_s,
            etcd=list(self.etcd) or None,
            etcd_prefix=self.etcd_prefix,
            etcd_ca=self.etcd_tls[0],
            etcd_cert=self.etcd_tls[1],
            etcd_key=self.etcd_tls[2],
        )


def load_cluster(path: str) -> ClusterInfo:
    """Read ``cluster.json`` as written by ``kvcache up``."""
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except FileNotFoundError:
        raise LiveError(
            f"no cluster state at {path}: start a cluster with 'kvcache up --detach' "
            "(or pass --cluster <state_dir>/cluster.json)"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise LiveError(f"cannot read cluster state {path}: {e}") from None
    try:
        nodes = []
        for n in state["nodes"]:
            host = n["messenger"].rpartition(":")[0]
            port = n.get("messenger_metrics_port")
            metrics = n.get("messenger_metrics") or (f"{host}:{port}" if port else None)
            nodes.append(
                ClusterNode(
                    id=n["id"],
                    role=n["role"],
                    address=n["address"],
                    messenger=n["messenger"],
                    messenger_metrics=metrics,  # where --metrics-host put it
                )
            )
        return ClusterInfo(
            conductor=state["conductor"]["address"],
            token=state.get("token"),
            nodes=nodes,
            source=path,
            tls_ca=state.get("tls_ca"),
            conductors=tuple(c["address"] for c in state.get("conductors") or ()),
            etcd=tuple((state.get("etcd") or {}).get("endpoints") or ()),
            etcd_prefix=(state.get("etcd") or {}).get("prefix") or "/kvcache",
            etcd_tls=tuple(  # type: ignore[arg-type]
                ((state.get("etcd") or {}).get("tls") or {}).get(k) for k in ("ca", "cert", "key")
            ),
        )
    except (KeyError, TypeError) as e:
        raise LiveError(f"{path} is not a 'kvcache up' state file (missing {e})") from None


# ---- prompts and pages ---------------------------------------------------------------------


def prompt_tokens(request: TraceRequest, trace_block_tokens: int) -> np.ndarray:
    """Token ids for a trace request: block ``i`` with id ``h`` is ``h * B + arange(B)``
    (``B`` = the trace's block size), truncated to ``input_length``. Deterministic, so requests
    with equal hash-id prefixes have equal token prefixes. uint32 (ids up to 2**32 / B)."""
    ids = np.asarray(request.hash_ids, dtype=np.uint64)
    if ids.size and int(ids.max()) >= (1 << 32) // trace_block_tokens:
        raise LiveError(
            f"hash id {int(ids.max())} is too large for 32-bit token ids with "
            f"{trace_block_tokens}-token blocks"
        )
    tokens = ids[:, None] * trace_block_tokens + np.arange(trace_block_tokens, dtype=np.uint64)
    return tokens.reshape(-1)[: request.input_length].astype("<u4")


class SyntheticKV:
    """Synthetic KV pages: layer ``l`` of the page of ``key`` is the 16-byte key repeated, each
    byte XOR ``(l * 37 + 1) & 255``. Cheap to make and to check, and distinct per key and layer,
    so a page landing under the wrong key or layer is caught.

    NOTE: one broadcast numpy pass per page, not a tiled copy per layer: the emulated engines
    share the machine with the nodes and messengers they measure (np.resize per layer cost
    ~2 ms per 256 KiB page, a core's worth of CPU in ``bench live``)."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.page_bytes = layout.page_bytes
        self.layer_bytes = layout.layer_bytes
        self._salts = np.array(
            [(layer * 37 + 1) & 0xFF for layer in range(layout.num_layers)], dtype=np.uint8
        )
        self._head = self.layer_bytes - self.layer_bytes % 16  # whole key repeats per layer

    def _pattern(self, key: bytes) -> np.ndarray:
        """(layers, 16): the key XOR each layer's salt."""
        return np.frombuffer(key, np.uint8)[None, :] ^ self._salts[:, None]

    def _parts(self, page: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Views of a (contiguous) page: whole 16-byte repeats (layers, n, 16) and the tails."""
        rows = page.reshape(self.layout.num_layers, self.layer_bytes)
        return rows[:, : self._head].reshape(len(self._salts), -1, 16), rows[:, self._head :]

    def fill(self, page: np.ndarray, key: bytes) -> None:
        pattern = self._pattern(key)
        body, tail = self._parts(page)
        body[:] = pattern[:, None, :]
        tail[:] = pattern[:, : tail.shape[1]]

    def matches(self, page: np.ndarray, key: bytes) -> bool:
        if page.size != self.page_bytes:
            return False
        pattern = self._pattern(key)
        body, tail = self._parts(page)
        return bool((body == pattern[:, None, :]).all()) and np.array_equal(
            tail, pattern[:, : tail.shape[1]]
        )


# ---- one request's outcome -------------------------------------------------------------------


@dataclass(slots=True)
class RequestOutcome:
    """Everything measured for one request (seconds are wall time in this process)."""

    index: int
    request_id: str
    arrival_s: float  # when the trace says it arrives (compressed), from run start
    prompt_tokens: int
    status: str = "pending"  # ok | rejected | failed
    error: str = ""
    start_s: float = 0.0
    end_s: float = 0.0
    prefill_node: str = ""
    decode_node: str = ""
    total_blocks: int = 0  # full blocks of the prompt
    lookup_blocks: int = 0  # cached prefix the prefill node reported at Lookup
    planned_local: int = 0  # the conductor's view: prefix the prefill node holds
    planned_reuse: int = 0  # ... and will hold after the plan's transfer
    reused_blocks: int = 0  # prefix actually loaded at prefill
    fetched_blocks: int = 0  # of those, landed by the plan's transfer
    computed_blocks: int = 0  # pages written by this request's "prefill"
    plan_blocks: int = 0  # blocks the plan asked to move to the prefill node
    plan_failed: int = 0  # plan entries that did not land (they are recomputed)
    schedule_s: float | None = None
    lookup_s: float | None = None
    plan_wait_s: float | None = None
    load_s: float | None = None
    store_s: float | None = None
    decode_at_s: float = 0.0  # when the pull was submitted (run clock)
    decode_s: float | None = None  # the decode messenger's pull, submit to finished
    decode_messenger_s: float | None = None  # the same batch as its messenger timed it
    decode_held: int = 0  # pages the decode node held already (not pulled)
    decode_moved_bytes: int = 0  # bytes the pull moved
    verified_pages: int = 0
    verify_failures: int = 0
    est_ttft_s: float | None = None


# ---- the engine ------------------------------------------------------------------------------


@dataclass(kw_only=True)
class EngineOptions:
    namespace: str
    trace_block_tokens: int
    ttft_slo_s: float = 0.0
    tbt_slo_s: float = 0.0
    transfer_timeout_s: float = 60.0
    run_id: str = field(default_factory=lambda: f"{os.getpid():x}{time.time_ns() & 0xFFFFFF:06x}")
    # NOTE: the cache salt roots every block key; a fresh one per run (the default) makes each
    # replay start from a cold cache even on a cluster that served earlier runs.
    salt: bytes = b""


class Engine:
    """Emulated prefill and decode engines sharing one process; thread-safe (one client per
    node / messenger address, created on first use)."""

    def __init__(self, cluster: ClusterInfo, options: EngineOptions, layout: KVLayout) -> None:
        self.cluster = cluster
        self.options = options
        self.kv = SyntheticKV(layout)
        self.conductor = cluster.conductor_client(timeout_s=30.0)
        # As a front end calls the conductor (kvcache router does the same): the schedules of
        # requests in flight go together over one long-lived ScheduleStream, their Completes
        # together in CompleteBatch calls.
        self._stream = self.conductor.schedule_stream()
        self._schedules: Coalescer[cpb.ScheduleRequest, cpb.ScheduleReply] = Coalescer(
            self._schedule_batch, "live-schedule"
        )
        self._completes: Coalescer[cpb.CompleteRequest, None] = Coalescer(
            self.conductor.complete_results, "live-complete"
        )
        self._nodes: dict[str, KVStoreClient] = {}
        self._messengers: dict[str, MessengerClient] = {}
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def node(self, address: str) -> KVStoreClient:
        with self._lock:
            client = self._nodes.get(address)
            if client is None:
                # NOTE: prefault, as a serving engine would: the engines' page faults (one per
                # 4 KiB they write) would take the CPU the nodes and messengers measured here need.
                client = self._nodes[address] = KVStoreClient(
                    address, self.cluster.token, self.cluster.tls_ca, prefault_shm=True
                )
            return client

    def messenger(self, address: str) -> MessengerClient:
        with self._lock:
            client = self._messengers.get(address)
            if client is None:
                client = self._messengers[address] = MessengerClient(
                    address, self.cluster.token, self.cluster.tls_ca, timeout_s=30.0
                )
            return client

    def close(self) -> None:
        self._schedules.close()
        self._completes.close()
        self._stream.close()
        with self._lock:
            clients = [*self._nodes.values(), *self._messengers.values()]
            self._nodes, self._messengers = {}, {}
        for c in clients:
            c.close()
        self.conductor.close()

    def schedule_calls(self) -> dict[str, int]:
        """How the schedules went: streams opened, batches sent, requests in them."""
        return {
            "streams": self._stream.opened,
            "batches": self._schedules.batches,
            "requests": self._schedules.items,
        }

    def _schedule_batch(
        self, calls: list[cpb.ScheduleRequest]
    ) -> list[cpb.ScheduleReply | KVCacheRpcError]:
        return schedule_results(self._stream.schedule_batch(calls))

    def _complete(self, request_id: str, phase: int) -> None:
        call = cpb.CompleteRequest(request_id=request_id, phase=phase)  # type: ignore[arg-type]
        self._completes.submit(call).result()

    # ---- a request ---------------------------------------------------------------------------

    def serve(self, index: int, request: TraceRequest, arrival_s: float) -> RequestOutcome:
        opts = self.options
        tokens = prompt_tokens(request, opts.trace_block_tokens)
        out = RequestOutcome(
            index=index,
            request_id=f"live-{opts.run_id}-{index}",
            arrival_s=arrival_s,
            prompt_tokens=int(tokens.size),
            start_s=self.now(),
        )
        t = time.perf_counter()
        try:
            call = schedule_request(
                opts.namespace,
                tokens=tokens,
                salt=opts.salt,
                request_id=out.request_id,
                prompt_tokens=int(tokens.size),
                output_tokens=request.output_length,
                ttft_slo_s=opts.ttft_slo_s,
                tbt_slo_s=opts.tbt_slo_s,
            )
            reply = self._schedules.submit(call).result()
        except KVCacheRpcError as e:
            out.schedule_s = time.perf_counter() - t
            if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                out.status, out.error = "rejected", e.details
            else:
                out.status, out.error = "failed", f"Schedule: {_describe(e)}"
            out.end_s = self.now()
            return out
        out.schedule_s = time.perf_counter() - t
        out.prefill_node, out.decode_node = reply.prefill_node, reply.decode_node
        out.total_blocks, out.est_ttft_s = reply.total_blocks, reply.est_ttft_s
        out.planned_local, out.planned_reuse = reply.local_blocks, reply.reuse_blocks
        try:
            keys = self._prefill(reply, tokens, out)
            self._complete(out.request_id, cpb.COMPLETE_PHASE_PREFILLED)
            self._decode(reply, keys, out)
            out.status = "ok" if not out.verify_failures else "failed"
            if out.verify_failures:
                out.error = f"{out.verify_failures} pages differ from what was stored"
        except (LiveError, KVCacheRpcError) as e:
            out.status = "failed"
            out.error = _describe(e)
        finally:
            try:  # free the conductor's ledger entry whatever happened
                self._complete(out.request_id, cpb.COMPLETE_PHASE_FINISHED)
            except KVCacheRpcError as e:
                if out.status == "ok":
                    out.status, out.error = "failed", f"Complete: {_describe(e)}"
            out.end_s = self.now()
        return out

    def _prefill(
        self, reply: cpb.ScheduleReply, tokens: np.ndarray, out: RequestOutcome
    ) -> list[bytes]:
        ns, salt = self.options.namespace, self.options.salt
        node = self.node(reply.prefill_address)
        t = time.perf_counter()
        out.lookup_blocks = node.lookup(ns, tokens=tokens, salt=salt).hit_blocks
        out.lookup_s = time.perf_counter() - t

        landed: set[bytes] = set()  # planned keys the prefill node holds now
        if reply.transfers:
            t = time.perf_counter()
            for plan in reply.transfers:
                landed.update(self._await_plan(plan, out))
            out.plan_wait_s = time.perf_counter() - t

        t = time.perf_counter()
        with node.acquire(ns, tokens=tokens, salt=salt, prefix_only=True) as lease:
            out.reused_blocks = lease.hit_blocks
            self._verify(node, lease, range(lease.hit_blocks), out)
            # NOTE: the plan names exactly the blocks the conductor's index says this node lacks,
            # so a planned block that is here now was fetched (by the hook's batch, or ours when
            # we came first); only an index lagging behind the node's own stores miscounts.
            out.fetched_blocks = sum(1 for k in lease.keys[: lease.hit_blocks] if k in landed)
            out.load_s = time.perf_counter() - t

            t = time.perf_counter()
            write = node.allocate(ns, tokens=tokens, salt=salt)
            try:
                for i in write.to_write:
                    self.kv.fill(write.page(i), write.keys[i])
            except BaseException:
                write.abort()
                raise
            write.commit()
            out.computed_blocks = len(write.to_write)
            out.store_s = time.perf_counter() - t
        return write.keys

    def _await_plan(self, plan: cpb.TransferPlan, out: RequestOutcome) -> set[bytes]:
        """The conductor's hook asked the destination messenger to fetch the plan's keys; its
        batch id is not returned to us, so we submit the same keys there: the messenger joins a
        fetch in flight (or reports keys already present) and gives us a batch to wait on.
        Returns the keys that are there now."""
        keys = transfer_keys(plan)
        out.plan_blocks += len(keys)
        if not keys:
            return set()
        messenger = self.messenger(plan.dst_messenger)
        timeout = self.options.transfer_timeout_s
        try:
            status = messenger.pull(plan.namespace, keys, plan.src_messenger, timeout)
        except KVCacheRpcError as e:
            if e.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            raise LiveError(
                f"planned transfer {plan.src_node} -> {plan.dst_node} of "
                f"{len(keys)} blocks not done after {timeout:g} s"
            ) from None
        landed = set()
        for e in status.entries:
            if e.state == mpb.ENTRY_DONE:
                landed.add(e.key)
            else:
                out.plan_failed += 1  # e.g. the source evicted it: the prefill recomputes it
        return landed

    def _decode(self, reply: cpb.ScheduleReply, keys: list[bytes], out: RequestOutcome) -> None:
        """Pin the pages the decode node holds already (an earlier request's), pull the rest from
        the prefill node (which keeps them pinned until then), verify all in the decode node's
        shared memory. NOTE: pinning first matters: held pages sit at the cold end of the decode
        node's LRU and would be the first evicted by the pages this pull brings in."""
        if not keys:
            return
        ns = self.options.namespace
        prefill = self.node(reply.prefill_address)
        decode = self.node(reply.decode_address)
        with contextlib.ExitStack() as stack:
            held = stack.enter_context(decode.acquire(ns, keys=keys))
            need = [i for i, found in enumerate(held.found) if not found]
            out.decode_held = len(keys) - len(need)
            if need:
                with prefill.acquire(ns, keys=[keys[i] for i in need]) as pin:
                    gone = sum(1 for f in pin.found if not f)
                    if gone:
                        raise LiveError(
                            f"{gone} of {len(need)} pages were evicted from "
                            f"{reply.prefill_node} before the decode node could "
                            "pull them"
                        )
                    self._pull(reply, [keys[i] for i in need], out)
                pulled = stack.enter_context(decode.acquire(ns, keys=[keys[i] for i in need]))
                gone = sum(1 for f in pulled.found if not f)
                if gone:
                    raise LiveError(
                        f"{gone} of {len(need)} pages missing on "
                        f"{reply.decode_node} right after its messenger pulled them"
                    )
                self._verify(decode, pulled, range(len(need)), out)
            self._verify(decode, held, [i for i, f in enumerate(held.found) if f], out)

    def _pull(self, reply: cpb.ScheduleReply, keys: list[bytes], out: RequestOutcome) -> None:
        """The decode node's messenger fetches ``keys`` from the prefill node's messenger."""
        timeout = self.options.transfer_timeout_s
        messenger = self.messenger(reply.decode_messenger)
        out.decode_at_s = self.now()
        t = time.perf_counter()
        try:
            # urgent: the decode of a request waits on it (the messenger's lane for such pulls)
            status = messenger.pull(
                self.options.namespace, keys, reply.prefill_messenger, timeout, urgent=True
            )
        except KVCacheRpcError as e:
            if e.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            raise LiveError(
                f"decode pull {reply.prefill_node} -> {reply.decode_node} of "
                f"{len(keys)} pages not done after {timeout:g} s"
            ) from None
        finally:
            out.decode_s = time.perf_counter() - t
        out.decode_moved_bytes = status.bytes_moved
        out.decode_messenger_s = status.elapsed_s
        if status.failed:
            bad = next(e for e in status.entries if e.state == mpb.ENTRY_FAILED)
            raise LiveError(
                f"decode pull {reply.prefill_node} -> {reply.decode_node}: "
                f"{status.failed} of {len(keys)} pages failed, e.g. {bad.code}: "
                f"{bad.reason}"
            )

    def _verify(
        self, node: KVStoreClient, lease: ReadLease, indices: Iterable[int], out: RequestOutcome
    ) -> None:
        streamed = []
        for i in indices:
            if lease.offsets[i] >= 0:
                page = lease.page(i)
                out.verified_pages += 1
                out.verify_failures += not self.kv.matches(page, lease.keys[i])
            else:
                streamed.append(i)
        if streamed:  # a hit outside shared memory (SSD tier): read a copy
            pages = node.get(lease.namespace, keys=[lease.keys[i] for i in streamed])
            for i, page in zip(streamed, pages):
                out.verified_pages += 1
                out.verify_failures += page is None or not self.kv.matches(page, lease.keys[i])


def _describe(e: BaseException) -> str:
    if isinstance(e, KVCacheRpcError):
        return f"{e.code.name}: {e.details}"
    return str(e)
