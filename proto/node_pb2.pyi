from proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterLayoutRequest(_message.Message):
    __slots__ = ("layout",)
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.Layout
    def __init__(self, layout: _Optional[_Union[_common_pb2.Layout, _Mapping]] = ...) -> None: ...

class RegisterLayoutReply(_message.Message):
    __slots__ = ("namespace", "added")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    namespace: NamespaceInfo
    added: bool
    def __init__(self, namespace: _Optional[_Union[NamespaceInfo, _Mapping]] = ..., added: bool = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("namespace", "layout", "shm_name", "page_bytes", "tiers", "shm_socket", "segment_bytes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout: _common_pb2.Layout
    shm_name: str
    page_bytes: int
    tiers: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierUsage]
    shm_socket: str
    segment_bytes: int
    def __init__(self, namespace: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.Layout, _Mapping]] = ..., shm_name: _Optional[str] = ..., page_bytes: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.TierUsage, _Mapping]]] = ..., shm_socket: _Optional[str] = ..., segment_bytes: _Optional[int] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "namespaces", "hostname", "pid", "session_socket", "messenger_address", "control_socket")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SOCKET_FIELD_NUMBER: _ClassVar[int]
    MESSENGER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    hostname: str
    pid: int
    session_socket: str
    messenger_address: str
    control_socket: str
    def __init__(self, node_id: _Optional[str] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., session_socket: _Optional[str] = ..., messenger_address: _Optional[str] = ..., control_socket: _Optional[str] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("hit_blocks", "total_blocks", "tier_codes")
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_CODES_FIELD_NUMBER: _ClassVar[int]
    hit_blocks: int
    total_blocks: int
    tier_codes: bytes
    def __init__(self, hit_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., tier_codes: _Optional[bytes] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("blocks", "ttl_s", "session", "unchained")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    UNCHAINED_FIELD_NUMBER: _ClassVar[int]
    blocks: _common_pb2.BlockSelector
    ttl_s: float
    session: bytes
    unchained: bool
    def __init__(self, blocks: _Optional[_Union[_common_pb2.BlockSelector, _Mapping]] = ..., ttl_s: _Optional[float] = ..., session: _Optional[bytes] = ..., unchained: bool = ...) -> None: ...

class AllocateReply(_message.Message):
    __slots__ = ("lease_id", "shm_name", "page_bytes", "offsets", "ttl_s", "keys", "node_epoch")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NODE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    shm_name: str
    page_bytes: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    ttl_s: float
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    node_epoch: int
    def __init__(self, lease_id: _Optional[int] = ..., shm_name: _Optional[str] = ..., page_bytes: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., ttl_s: _Optional[float] = ..., keys: _Optional[_Iterable[bytes]] = ..., node_epoch: _Optional[int] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("namespace", "lease_id", "checksums", "node_epoch", "hold_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    NODE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    lease_id: int
    checksums: bytes
    node_epoch: int
    hold_s: float
    def __init__(self, namespace: _Optional[str] = ..., lease_id: _Optional[int] = ..., checksums: _Optional[bytes] = ..., node_epoch: _Optional[int] = ..., hold_s: _Optional[float] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("stored", "duplicates")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    stored: int
    duplicates: int
    def __init__(self, stored: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("blocks", "ttl_s", "prefix_only", "session")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ONLY_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    blocks: _common_pb2.BlockSelector
    ttl_s: float
    prefix_only: bool
    session: bytes
    def __init__(self, blocks: _Optional[_Union[_common_pb2.BlockSelector, _Mapping]] = ..., ttl_s: _Optional[float] = ..., prefix_only: bool = ..., session: _Optional[bytes] = ...) -> None: ...

class AcquireReply(_message.Message):
    __slots__ = ("lease_id", "shm_name", "page_bytes", "offsets", "tiers", "ttl_s", "keys", "checksums", "node_epoch")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    NODE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    shm_name: str
    page_bytes: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    tiers: _containers.RepeatedScalarFieldContainer[_common_pb2.Tier]
    ttl_s: float
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    node_epoch: int
    def __init__(self, lease_id: _Optional[int] = ..., shm_name: _Optional[str] = ..., page_bytes: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.Tier, str]]] = ..., ttl_s: _Optional[float] = ..., keys: _Optional[_Iterable[bytes]] = ..., checksums: _Optional[_Iterable[int]] = ..., node_epoch: _Optional[int] = ...) -> None: ...

class AcquireAllocateRequest(_message.Message):
    __slots__ = ("acquire", "allocate", "allocate_if_loaded")
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_IF_LOADED_FIELD_NUMBER: _ClassVar[int]
    acquire: AcquireRequest
    allocate: AllocateRequest
    allocate_if_loaded: bool
    def __init__(self, acquire: _Optional[_Union[AcquireRequest, _Mapping]] = ..., allocate: _Optional[_Union[AllocateRequest, _Mapping]] = ..., allocate_if_loaded: bool = ...) -> None: ...

class AcquireAllocateReply(_message.Message):
    __slots__ = ("acquire", "allocate")
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    acquire: AcquireReply
    allocate: AllocateReply
    def __init__(self, acquire: _Optional[_Union[AcquireReply, _Mapping]] = ..., allocate: _Optional[_Union[AllocateReply, _Mapping]] = ...) -> None: ...

class CommitReleaseRequest(_message.Message):
    __slots__ = ("commit", "release")
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    commit: LeaseRequest
    release: LeaseRequest
    def __init__(self, commit: _Optional[_Union[LeaseRequest, _Mapping]] = ..., release: _Optional[_Union[LeaseRequest, _Mapping]] = ...) -> None: ...

class CommitReleaseReply(_message.Message):
    __slots__ = ("commit", "released")
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    commit: CommitReply
    released: bool
    def __init__(self, commit: _Optional[_Union[CommitReply, _Mapping]] = ..., released: bool = ...) -> None: ...

class OpenShmRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class OpenShmReply(_message.Message):
    __slots__ = ("ticket", "socket", "segment_bytes", "ttl_s")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    socket: str
    segment_bytes: int
    ttl_s: float
    def __init__(self, ticket: _Optional[bytes] = ..., socket: _Optional[str] = ..., segment_bytes: _Optional[int] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class ExtendLeaseRequest(_message.Message):
    __slots__ = ("namespace", "lease_id", "ttl_s", "node_epoch")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    NODE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    lease_id: int
    ttl_s: float
    node_epoch: int
    def __init__(self, namespace: _Optional[str] = ..., lease_id: _Optional[int] = ..., ttl_s: _Optional[float] = ..., node_epoch: _Optional[int] = ...) -> None: ...

class ExtendLeaseReply(_message.Message):
    __slots__ = ("ttl_s",)
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ttl_s: float
    def __init__(self, ttl_s: _Optional[float] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _common_pb2.BlockSelector
    def __init__(self, blocks: _Optional[_Union[_common_pb2.BlockSelector, _Mapping]] = ...) -> None: ...

class PutChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("blocks", "prefix_only", "chunk_bytes")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ONLY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks: _common_pb2.BlockSelector
    prefix_only: bool
    chunk_bytes: int
    def __init__(self, blocks: _Optional[_Union[_common_pb2.BlockSelector, _Mapping]] = ..., prefix_only: bool = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class GetHeader(_message.Message):
    __slots__ = ("found", "page_bytes")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    found: _containers.RepeatedScalarFieldContainer[bool]
    page_bytes: int
    def __init__(self, found: _Optional[_Iterable[bool]] = ..., page_bytes: _Optional[int] = ...) -> None: ...

class GetChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: GetHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[GetHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RemoveReply(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("max_bytes", "max_seconds", "peers", "leave")
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    max_bytes: int
    max_seconds: float
    peers: _containers.RepeatedScalarFieldContainer[str]
    leave: bool
    def __init__(self, max_bytes: _Optional[int] = ..., max_seconds: _Optional[float] = ..., peers: _Optional[_Iterable[str]] = ..., leave: bool = ...) -> None: ...

class DrainPeer(_message.Message):
    __slots__ = ("messenger", "node_id", "blocks", "bytes", "failed")
    MESSENGER_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    messenger: str
    node_id: str
    blocks: int
    bytes: int
    failed: int
    def __init__(self, messenger: _Optional[str] = ..., node_id: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("offered", "blocks", "bytes", "seconds", "peers")
    OFFERED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    offered: int
    blocks: int
    bytes: int
    seconds: float
    peers: _containers.RepeatedCompositeFieldContainer[DrainPeer]
    def __init__(self, offered: _Optional[int] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., peers: _Optional[_Iterable[_Union[DrainPeer, _Mapping]]] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace", "tiers", "blocks", "hits", "misses", "evictions", "demotions", "promotions", "corrupt_pages", "bytes_written", "bytes_read", "write_leases", "read_leases", "expired_leases")
    class HitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class EvictionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    WRITE_LEASES_FIELD_NUMBER: _ClassVar[int]
    READ_LEASES_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    tiers: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierUsage]
    blocks: int
    hits: _containers.ScalarMap[str, int]
    misses: int
    evictions: _containers.ScalarMap[str, int]
    demotions: int
    promotions: int
    corrupt_pages: int
    bytes_written: int
    bytes_read: int
    write_leases: int
    read_leases: int
    expired_leases: int
    def __init__(self, namespace: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.TierUsage, _Mapping]]] = ..., blocks: _Optional[int] = ..., hits: _Optional[_Mapping[str, int]] = ..., misses: _Optional[int] = ..., evictions: _Optional[_Mapping[str, int]] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., corrupt_pages: _Optional[int] = ..., bytes_written: _Optional[int] = ..., bytes_read: _Optional[int] = ..., write_leases: _Optional[int] = ..., read_leases: _Optional[int] = ..., expired_leases: _Optional[int] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "leases", "leased_pages", "stored_blocks", "streams")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    LEASED_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    leases: int
    leased_pages: int
    stored_blocks: int
    streams: int
    def __init__(self, tenant: _Optional[str] = ..., leases: _Optional[int] = ..., leased_pages: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., streams: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("namespaces", "tenants")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("after_seq", "resync")
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    resync: bool
    def __init__(self, after_seq: _Optional[int] = ..., resync: bool = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("events", "snapshot", "snapshot_done", "snapshot_seq")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DONE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_SEQ_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockEvent]
    snapshot: bool
    snapshot_done: bool
    snapshot_seq: int
    def __init__(self, events: _Optional[_Iterable[_Union[_common_pb2.BlockEvent, _Mapping]]] = ..., snapshot: bool = ..., snapshot_done: bool = ..., snapshot_seq: _Optional[int] = ...) -> None: ...
