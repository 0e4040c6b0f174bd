"""KVStoreClient: the Python client of a node server.

Same-host clients map the node's DRAM slab by name and read/write pages in place (zero copies
through the server). A node with tenant tokens has no slab by name: each tenant maps a segment of
its own instead, handed over as a file descriptor on the node's segment socket for a one-time
ticket from ``OpenShm`` (see node/segments.py). When neither can be mapped (another host, no
permission) every call falls back to the streamed Put/Get path transparently. Errors raise
``KVCacheRpcError`` carrying the gRPC status code and the server's message.

    with KVStoreClient("127.0.0.1:7000") as c:
        ns = c.namespaces()[0]
        c.put(ns, pages, tokens=prompt_ids)
        hit = c.lookup(ns, tokens=prompt_ids).hit_blocks
        with c.acquire(ns, tokens=prompt_ids, prefix_only=True) as lease:
            kv = lease.page(0)          # numpy view into shared memory, no copy
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

import grpc
import numpy as np
from numpy.typing import NDArray

from kvstore.errors import StorageError, echo
from kvstore.layout import KVLayout
from kvstore.payload import as_uint8
from kvstore.shm import MemfdSegment, SharedSlab, prefault, recv_segment
from kvstore.tiers import Tier
from proto import common_pb2 as cpb
from proto import node_pb2 as pb
from proto import node_pb2_grpc as pbg
from rpc.channel import check_health, make_channel
from rpc.control import METHOD_IDS
from rpc.status import KVCacheRpcError as KVCacheRpcError  # re-exported: clients' one error
from rpc.status import call
from rpc.wire import layout_from_pb, layout_to_pb, selector_to_pb, tiers_from_codes

from .node_control import ControlChannel
from .node_leases import TIER_OF_PB, Lease, Mapping, commit_request, commit_result, lease_request
from .node_leases import CommitResult as CommitResult  # re-exported: the leases' types
from .node_leases import ReadLease as ReadLease
from .node_leases import WriteLease as WriteLease
from .node_session import NodeSession
from .node_streams import get_streamed, put_streamed

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
CONTROL_RETRY_S = 1.0  # a gone control socket: GetInfo asked again at most this often

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    namespace: str
    layout: KVLayout
    shm_name: str
    page_bytes: int
    dram_pages: int
    shm_socket: str = ""  # set: shared memory is per tenant (OpenShm + this socket)
    segment_bytes: int = 0


@dataclass(frozen=True, slots=True)
class LookupResult:
    hit_blocks: int
    tiers: list[Tier | None]
    total_blocks: int


def _commit_release(
    write: WriteLease, read: ReadLease, checksums: Sequence[int] | NDArray[Any] | None
) -> pb.CommitReleaseRequest:
    return pb.CommitReleaseRequest(
        commit=commit_request(write, checksums), release=lease_request(read)
    )


class KVStoreClient:
    """Client of one node server. Thread-safe; one gRPC channel; shared memory mapped lazily."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        tls_ca_file: str | None = None,
        use_shm: bool = True,
        timeout_s: float = 30.0,
        prefault_shm: bool = False,
        use_control: bool = True,
    ) -> None:
        """``prefault_shm``: map every page of the node's shared memory in the background as
        soon as it is mapped (``kvstore.shm.prefault``), for long-lived clients that move many
        pages through it (the messenger, an engine): their copies then take no page faults.
        ``use_control``: a same-host client (``use_shm``) makes the node's lease calls on its
        control socket (``clients.node_control``) where it can reach it, else over gRPC."""
        self.address = address
        self._token = token
        self._use_control = use_control and use_shm
        self._control: ControlChannel | None = None
        self._control_asked = 0.0  # when GetInfo last told us the control socket
        self.timeout_s = timeout_s
        self._channel = make_channel(address, token, tls_ca_file)
        # NOTE: the generated *_pb2_grpc.py stubs carry no annotations (replies are Any).
        self._stub = pbg.NodeServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._use_shm = use_shm
        self._prefault = prefault_shm
        self._slabs: dict[str, Mapping | None] = {}
        self._info: dict[str, NamespaceInfo] | None = None
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None  # for *_async calls, made on first use
        self._session_socket = ""  # the node's (GetInfo); this client's session there:
        self._session = NodeSession()

    # ---- plumbing -----------------------------------------------------------------------------

    def _call(self, name: str, request: Any, **kw: Any) -> Any:
        if self._use_control and name in METHOD_IDS:
            channel = self._control_channel()
            if channel is not None:
                reply = channel.call(name, request, kw.get("timeout", self.timeout_s))
                if reply is not None:
                    return reply
        return call(
            getattr(self._stub, name),
            name,
            request,
            timeout=kw.pop("timeout", self.timeout_s),
            **kw,
        )

    def _control_channel(self) -> ControlChannel | None:
        """The node's control socket, learnt from GetInfo (asked again, at most once a second,
        when the node behind it is gone); None: none to use."""
        channel = self._control
        if channel is not None and not channel.stale:
            return None if channel.broken else channel
        now = time.monotonic()
        if self._control_asked and (channel is None or now - self._control_asked < CONTROL_RETRY_S):
            return None  # the node has none, or was asked a moment ago
        self._control_asked = now
        with self._lock:
            self._info = None  # GetInfo again: the control socket (and all) may have changed
        try:
            self._namespaces()
        except KVCacheRpcError:
            return None  # the gRPC call that follows says why
        channel = self._control
        return None if channel is None or channel.broken or channel.stale else channel

    def _call_async(self, name: str, request: Any, convert: Callable[[Any], T]) -> Future[T]:
        """The call made on the client's background thread; ``result()`` raises
        ``KVCacheRpcError``. (grpc's own ``.future()`` starts a polling thread whenever no call
        is in flight: ~0.4 ms a call here, and more under a busy engine.)"""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvcache-rpc")
        return self._executor.submit(lambda: convert(self._call(name, request)))

    def _slab(self, namespace: str) -> Mapping | None:
        """The node's DRAM slab (or, with tenants, this tenant's segment) for ``namespace`` if it
        can be mapped here, else None."""
        with self._lock:
            if namespace in self._slabs:
                return self._slabs[namespace]
        info = self.namespace_info(namespace)
        slab: Mapping | None = None
        if self._use_shm and info.shm_socket:
            slab = self._open_segment(namespace)
        elif self._use_shm and info.shm_name:
            try:
                slab = SharedSlab.attach(info.shm_name)
                if slab.size < info.dram_pages * info.page_bytes:
                    log.warning(
                        "shared memory %s is smaller than the node's pool: not the "
                        "node's segment; using the streamed path",
                        info.shm_name,
                    )
                    slab.close()
                    slab = None
            except StorageError:
                log.info(
                    "cannot map %s (not on the node's host?); using the streamed path",
                    info.shm_name,
                )
        with self._lock:
            mine = self._slabs.setdefault(namespace, slab)
        if mine is not slab and slab is not None:
            slab.close()  # another thread mapped it first
        elif slab is not None and self._prefault:
            # NOTE: the thread holds the array, so a close meanwhile leaves the mapping in place
            # (SharedSlab.close: views still alive) until the thread is done with it.
            threading.Thread(
                target=prefault, args=(slab.array,), daemon=True, name="kvcache-prefault"
            ).start()
        return mine

    def _open_segment(self, namespace: str) -> MemfdSegment | None:
        """This tenant's own segment: a ticket over gRPC, presented on the node's socket."""
        try:
            r = self._call("OpenShm", pb.OpenShmRequest(namespace=namespace))
        except KVCacheRpcError as e:
            log.warning("cannot get a ticket for the node's shared memory (%s); streaming", e)
            return None
        try:
            seg = recv_segment(r.socket, r.ticket)
        except StorageError as e:
            log.info("%s; using the streamed path", e)
            return None
        if seg.size < r.segment_bytes:
            log.warning("the segment handed over is smaller than announced; using the stream")
            seg.close()
            return None
        # A memfd has no name; the socket names the node process that made it, and the node's
        # replies carry that name, so a restarted node's new segment is noticed (_current_slab).
        seg.name = r.socket
        return seg

    def _current_slab(self, namespace: str, slab: Mapping | None, shm_name: str) -> Mapping | None:
        """The slab a reply's offsets point into (``shm_name``: the reply's). A node that
        restarted serves its pool from a new segment under a new name, while ``slab`` may still
        map the dead process's unlinked one: writing there would commit pages the node never
        saw written, reading there would return the dead node's bytes. So the mapping and the
        cached namespace info are dropped and the new segment mapped."""
        if slab is None or not shm_name or slab.name == shm_name:
            return slab
        with self._lock:
            if self._slabs.get(namespace) is slab:
                # NOTE: not closed: leases of other threads may still hold views of it
                del self._slabs[namespace]
            self._info = None
        fresh = self._slab(namespace)
        if fresh is None or fresh.name != shm_name:
            raise KVCacheRpcError(
                grpc.StatusCode.UNAVAILABLE,
                f"the node at {self.address} restarted during the call (its shared memory "
                f"is now {shm_name!r}); retry",
            )
        return fresh

    def _session_id(self) -> bytes:
        """This client's session with the node (``NodeSession``), for callers of shared memory."""
        return self._session.id_for(self._session_socket)

    def shm_available(self, namespace: str) -> bool:
        return self._slab(namespace) is not None

    def shm_region(self, namespace: str) -> NDArray[np.uint8] | None:
        """The mapped shared memory that lease offsets of ``namespace`` point into (flat uint8),
        or None when it cannot be mapped here."""
        slab = self._slab(namespace)
        return None if slab is None else slab.array

    # ---- info ---------------------------------------------------------------------------------

    def info(self) -> pb.NodeInfo:
        reply: pb.NodeInfo = self._call("GetInfo", pb.GetInfoRequest())
        return reply

    def namespaces(self) -> list[str]:
        return list(self._namespaces())

    def _namespaces(self) -> dict[str, NamespaceInfo]:
        if self._info is None:
            out: dict[str, NamespaceInfo] = {}
            info = self.info()
            self._session_socket = info.session_socket
            if self._use_control and (
                self._control is None or self._control.name != info.control_socket
            ):
                old, self._control = (
                    self._control,
                    ControlChannel(info.control_socket, self._token)
                    if info.control_socket
                    else None,
                )
                if old is not None:
                    old.close()
            for n in info.namespaces:
                dram = next((t.capacity_pages for t in n.tiers if t.tier == cpb.TIER_DRAM), 0)
                out[n.namespace] = NamespaceInfo(
                    n.namespace,
                    layout_from_pb(n.layout),
                    n.shm_name,
                    n.page_bytes,
                    dram,
                    n.shm_socket,
                    n.segment_bytes,
                )
            self._info = out
        return self._info

    def namespace_info(self, namespace: str) -> NamespaceInfo:
        info = self._namespaces().get(namespace)
        if info is None and self._info is not None:
            # NOTE: a node without --layout serves layouts registered after we asked (one
            # GetInfo per such call: what a request naming a namespace costs anyway).
            self._info = None
            info = self._namespaces().get(namespace)
        if info is None:
            raise KVCacheRpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"namespace {echo(namespace)} is not served by {self.address} "
                f"(it serves: {', '.join(self._namespaces())})",
            )
        return info

    def layout(self, namespace: str) -> KVLayout:
        return self.namespace_info(namespace).layout

    def register_layout(self, layout: KVLayout) -> bool:
        """Have the node serve ``layout`` from now on (a node started without ``--layout``
        serves the layouts its clients register); False when it served it already.
        FAILED_PRECONDITION from a node started with ``--layout`` that was not given this one;
        RESOURCE_EXHAUSTED past its ``--max-layouts``."""
        r = self._call("RegisterLayout", pb.RegisterLayoutRequest(layout=layout_to_pb(layout)))
        self._info = None  # the namespaces changed: asked again on next use
        return bool(r.added)

    # ---- lookup / leases ------------------------------------------------------------------------

    def lookup(
        self,
        namespace: str,
        keys: Sequence[bytes] | None = None,
        tokens: Any = None,
        salt: bytes | str = b"",
    ) -> LookupResult:
        r = self._call("Lookup", selector_to_pb(namespace, keys, tokens, salt))
        return LookupResult(r.hit_blocks, tiers_from_codes(r.tier_codes), r.total_blocks)

    def allocate(
        self,
        namespace: str,
        keys: Sequence[bytes] | None = None,
        tokens: Any = None,
        salt: bytes | str = b"",
        ttl_s: float = 0.0,
        chained: bool = True,
    ) -> WriteLease:
        """Lease pages for the blocks not stored yet. ``chained``: the keys are one prefix chain
        in order (a prompt's); False for blocks from anywhere (AllocateRequest.unchained)."""
        request, lease = self._allocate_call(namespace, keys, tokens, salt, ttl_s, chained)
        return lease(self._call("Allocate", request))

    def allocate_async(
        self,
        namespace: str,
        keys: Sequence[bytes] | None = None,
        tokens: Any = None,
        salt: bytes | str = b"",
        ttl_s: float = 0.0,
        chained: bool = True,
    ) -> Future[WriteLease]:
        """``allocate`` started now, waited for by ``result()``: the round trip overlaps work."""
        request, lease = self._allocate_call(namespace, keys, tokens, salt, ttl_s, chained)
        return self._call_async("Allocate", request, lease)

    def _allocate_call(
        self,
        namespace: str,
        keys: Sequence[bytes] | None,
        tokens: Any,
        salt: bytes | str,
        ttl_s: float,
        chained: bool = True,
    ) -> tuple[pb.AllocateRequest, Callable[[Any], WriteLease]]:
        """The Allocate request and the conversion of its reply, for both ways of calling."""
        slab = self._slab(namespace)

        def lease(r: Any) -> WriteLease:
            current = self._mapping_of(namespace, slab, r, "Abort")
            return WriteLease(
                self,
                namespace,
                r.lease_id,
                list(r.keys),
                list(r.offsets),
                r.page_bytes,
                current,
                node_epoch=r.node_epoch,
            )

        request = pb.AllocateRequest(
            blocks=selector_to_pb(namespace, keys, tokens, salt),
            ttl_s=ttl_s,
            session=self._session_id() if slab is not None else b"",
            unchained=not chained,
        )
        return request, lease

    def _mapping_of(
        self, namespace: str, slab: Mapping | None, reply: Any, undo: str
    ) -> Mapping | None:
        """The shared memory a lease reply's offsets point into; when it cannot be mapped, the
        lease is given back (``undo``: Abort or Release) before the error is raised."""
        try:
            return self._current_slab(namespace, slab, reply.shm_name)
        except KVCacheRpcError:
            self._undo(namespace, reply, undo)
            raise

    def _undo(self, namespace: str, reply: Any, undo: str) -> None:
        """Give back the lease of an Allocate / Acquire reply (``undo``: Abort or Release)."""
        with contextlib.suppress(KVCacheRpcError):
            request = pb.LeaseRequest(
                namespace=namespace, lease_id=reply.lease_id, node_epoch=reply.node_epoch
            )
            self._call(undo, request)

    def commit(
        self,
        lease: WriteLease,
        checksums: Sequence[int] | NDArray[Any] | None = None,
        hold_s: float = 0.0,
    ) -> CommitResult:
        """Publish the lease's pages. ``checksums``: the xxh3-64 of each page as written, one
        per key of the lease in its order (any value where ``offsets`` is -1), for a writer
        that has them already (it verified the pages): the node keeps them instead of hashing
        every page again. A wrong one makes its page read back as corrupt (dropped, not served);
        a wrong count is ``INVALID_ARGUMENT`` and the lease stays open. ``hold_s``: the node
        keeps the lease's pages pinned that long after (a read lease that lapses), for a reader
        this writer tells they are there."""
        request = commit_request(lease, checksums)
        request.hold_s = hold_s
        return commit_result(self._call("Commit", request))

    def commit_async(
        self, lease: WriteLease, checksums: Sequence[int] | NDArray[Any] | None = None
    ) -> Future[CommitResult]:
        return self._call_async("Commit", commit_request(lease, checksums), commit_result)

    def commit_release(
        self,
        write: WriteLease,
        read: ReadLease,
        checksums: Sequence[int] | NDArray[Any] | None = None,
    ) -> CommitResult:
        """``commit(write, checksums)`` and ``release(read)`` in one round trip (the node's
        CommitRelease): the read lease ends even when the commit fails (whose error is raised)."""
        request = _commit_release(write, read, checksums)
        return commit_result(self._call("CommitRelease", request).commit)

    def commit_release_async(
        self,
        write: WriteLease,
        read: ReadLease,
        checksums: Sequence[int] | NDArray[Any] | None = None,
    ) -> Future[CommitResult]:
        return self._call_async(
            "CommitRelease",
            _commit_release(write, read, checksums),
            lambda r: commit_result(r.commit),
        )

    def abort(self, lease: WriteLease) -> None:
        self._call("Abort", lease_request(lease))

    def acquire(
        self,
        namespace: str,
        keys: Sequence[bytes] | None = None,
        tokens: Any = None,
        salt: bytes | str = b"",
        ttl_s: float = 0.0,
        prefix_only: bool = False,
    ) -> ReadLease:
        request, lease = self._acquire_call(namespace, keys, tokens, salt, ttl_s, prefix_only)
        return lease(self._call("Acquire", request))

    def acquire_async(
        self,
        namespace: str,
        keys: Sequence[bytes] | None = None,
        tokens: Any = None,
        salt: bytes | str = b"",
        ttl_s: float = 0.0,
        prefix_only: bool = False,
    ) -> Future[ReadLease]:
        """``acquire`` started now, waited for by ``result()``: a reader pins its next batch
        while it copies this one."""
        request, lease = self._acquire_call(namespace, keys, tokens, salt, ttl_s, prefix_only)
        return self._call_async("Acquire", request, lease)

    def _acquire_call(
        self,
        namespace: str,
        keys: Sequence[bytes] | None,
        tokens: Any,
        salt: bytes | str,
        ttl_s: float,
        prefix_only: bool,
    ) -> tuple[pb.AcquireRequest, Callable[[Any], ReadLease]]:
        """The Acquire request and the conversion of its reply, for both ways of calling."""
        slab = self._slab(namespace)

        def lease(r: Any) -> ReadLease:
            current = self._mapping_of(namespace, slab, r, "Release")
            return ReadLease(
                self,
                namespace,
                r.lease_id,
                list(r.keys),
                list(r.offsets),
                r.page_bytes,
                current,
                [TIER_OF_PB[t] for t in r.tiers],
                list(r.checksums),
                node_epoch=r.node_epoch,
            )

        request = pb.AcquireRequest(
            blocks=selector_to_pb(namespace, keys, tokens, salt),
            ttl_s=ttl_s,
            prefix_only=prefix_only,
            session=self._session_id() if slab is not None else b"",
        )
        return request, lease

    def acquire_allocate(
        self,
        namespace: str,
        load_keys: Sequence[bytes],
        save_keys: Sequence[bytes],
        ttl_s: float = 0.0,
        allocate_if_loaded: bool = False,
    ) -> tuple[ReadLease, WriteLease | None]:
        """``acquire(load_keys)`` then ``allocate(save_keys)`` in one round trip (the node's
        AcquireAllocate): both leases, or an error and neither. With ``allocate_if_loaded`` the
        write lease is None when a page to load is not in shared memory (a writer whose pages are
        computed from the loaded ones must not store them then)."""
        read_req, read_lease = self._acquire_call(namespace, load_keys, None, b"", ttl_s, False)
        write_req, write_lease = self._allocate_call(namespace, save_keys, None, b"", ttl_s)
        r = self._call(
            "AcquireAllocate",
            pb.AcquireAllocateRequest(
                acquire=read_req, allocate=write_req, allocate_if_loaded=allocate_if_loaded
            ),
        )
        has_write = r.HasField("allocate")
        try:
            read = read_lease(r.acquire)  # a restarted node's reply: released, then raised
        except KVCacheRpcError:
            if has_write:
                self._undo(namespace, r.allocate, "Abort")
            raise
        try:
            write = write_lease(r.allocate) if has_write else None
        except KVCacheRpcError:
            self._undo(namespace, r.acquire, "Release")
            raise
        return read, write

    def release(self, lease: ReadLease) -> None:
        self._call("Release", lease_request(lease))

    def release_async(self, lease: ReadLease) -> Future[None]:
        return self._call_async("Release", lease_request(lease), lambda r: None)

    def extend(self, lease: Lease, ttl_s: float = 0.0) -> float:
        """Keep a lease alive ``ttl_s`` longer (0: the server default); returns seconds left."""
        reply: pb.ExtendLeaseReply = self._call(
            "ExtendLease",
            pb.ExtendLeaseRequest(
                namespace=lease.namespace,
                lease_id=lease.lease_id,
                ttl_s=ttl_s,
                node_epoch=lease.node_epoch,
            ),
        )
        return reply.ttl_s

    # ---- whole pages: shared memory when mapped, else streamed ----------------------------------

    def put(
        self,
        namespace: str,
        pages: Sequence[NDArray[Any] | torch.Tensor | bytes],
        keys: Sequence[bytes] | None = None,
        tokens: Any = None,
        salt: bytes | str = b"",
        timeout_s: float | None = None,
    ) -> CommitResult:
        """Store one page per block (numpy / torch / bytes of page_bytes each). ``timeout_s``:
        the deadline of a streamed Put (default the client's)."""
        info = self.namespace_info(namespace)
        srcs = [
            as_uint8(p, info.page_bytes, info.layout.dtype, f"page #{i}")
            for i, p in enumerate(pages)
        ]
        if self._slab(namespace) is None:
            return self._put_streamed(namespace, srcs, keys, tokens, salt, timeout_s)
        lease = self.allocate(namespace, keys, tokens, salt)
        if len(lease.keys) != len(srcs):
            self.abort(lease)
            raise ValueError(f"{len(srcs)} pages for {len(lease.keys)} full blocks")
        try:
            sums = lease.write(srcs)
        except BaseException:
            self.abort(lease)
            raise
        return self.commit(lease, sums)

    def _put_streamed(
        self,
        namespace: str,
        srcs: Sequence[NDArray[np.uint8] | torch.Tensor],
        keys: Sequence[bytes] | None,
        tokens: Any,
        salt: bytes | str,
        timeout_s: float | None = None,
    ) -> CommitResult:
        selector = selector_to_pb(namespace, keys, tokens, salt)
        return put_streamed(self._stub, selector, srcs, timeout_s or self.timeout_s)

    def get(
        self,
        namespace: str,
        keys: Sequence[bytes] | None = None,
        tokens: Any = None,
        salt: bytes | str = b"",
        prefix_only: bool = False,
        timeout_s: float | None = None,
    ) -> list[NDArray[np.uint8] | None]:
        """Copies of the pages (None where missing). ``timeout_s``: the deadline of a streamed
        Get (default the client's)."""
        if self._slab(namespace) is not None:
            with self.acquire(namespace, keys, tokens, salt, prefix_only=prefix_only) as lease:
                out: list[NDArray[np.uint8] | None] = []
                streamed: list[int] = []
                for i, (off, tier) in enumerate(zip(lease.offsets, lease.tiers)):
                    if off >= 0:
                        out.append(np.array(lease.page(i)))
                    else:
                        out.append(None)
                        if tier is not None:  # present but not in shared memory
                            streamed.append(i)
                if streamed:
                    for i, page in zip(
                        streamed,
                        self._get_streamed(
                            namespace,
                            [lease.keys[i] for i in streamed],
                            None,
                            salt,
                            False,
                            timeout_s,
                        ),
                    ):
                        out[i] = page
                return out
        return self._get_streamed(namespace, keys, tokens, salt, prefix_only, timeout_s)

    def _get_streamed(
        self,
        namespace: str,
        keys: Sequence[bytes] | None,
        tokens: Any,
        salt: bytes | str,
        prefix_only: bool,
        timeout_s: float | None = None,
    ) -> list[NDArray[np.uint8] | None]:
        request = pb.GetRequest(
            blocks=selector_to_pb(namespace, keys, tokens, salt), prefix_only=prefix_only
        )
        return get_streamed(self._stub, request, timeout_s or self.timeout_s)

    def remove(
        self,
        namespace: str,
        keys: Sequence[bytes] | None = None,
        tokens: Any = None,
        salt: bytes | str = b"",
    ) -> int:
        reply: pb.RemoveReply = self._call("Remove", selector_to_pb(namespace, keys, tokens, salt))
        return reply.removed

    def stats(self) -> pb.StatsReply:
        reply: pb.StatsReply = self._call("Stats", pb.StatsRequest())
        return reply

    def drain(
        self,
        max_bytes: int = 0,
        max_seconds: float = 0.0,
        peers: Sequence[str] = (),
        leave: bool = False,
    ) -> pb.DrainReply:
        """Have the node hand its hottest blocks to its peers (admin token only); ``leave``:
        then it stops. The call lasts as long as the hand-over (at most ``max_seconds``)."""
        reply: pb.DrainReply = self._call(
            "Drain",
            pb.DrainRequest(
                max_bytes=max_bytes, max_seconds=max_seconds, peers=list(peers), leave=leave
            ),
            timeout=(max_seconds or 60.0) + 30.0,
        )
        return reply

    def events(self, after_seq: int = 0, resync: bool = False) -> Iterator[pb.EventBatch]:
        """The node's event feed (admin token only); runs until the caller stops iterating."""
        stream = self._stub.Events(pb.EventsRequest(after_seq=after_seq, resync=resync))
        try:
            yield from stream
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise KVCacheRpcError.of(e, "Events") from None
        finally:
            stream.cancel()

    def health(self) -> str:
        """gRPC health: "SERVING", "NOT_SERVING", or why the check failed ("UNAVAILABLE")."""
        return check_health(self._channel, min(self.timeout_s, 5.0))

    # ---- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)  # calls already started finish first
        with self._lock:
            for slab in self._slabs.values():
                if slab is not None:
                    slab.close()
            self._slabs.clear()
        self._session.close()
        if self._control is not None:
            self._control.close()
        self._channel.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
