from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_SSD: _ClassVar[Tier]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_STORED: _ClassVar[EventKind]
    EVENT_EVICTED: _ClassVar[EventKind]
TIER_UNSPECIFIED: Tier
TIER_GPU: Tier
TIER_DRAM: Tier
TIER_SSD: Tier
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_STORED: EventKind
EVENT_EVICTED: EventKind

class Layout(_message.Message):
    __slots__ = ("model", "num_layers", "kv_heads", "head_dim", "dtype", "block_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    def __init__(self, model: _Optional[str] = ..., num_layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_tokens: _Optional[int] = ...) -> None: ...

class BlockSelector(_message.Message):
    __slots__ = ("namespace", "salt", "keys", "token_ids", "token_bytes", "key_bytes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    salt: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_bytes: bytes
    key_bytes: bytes
    def __init__(self, namespace: _Optional[str] = ..., salt: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., token_ids: _Optional[_Iterable[int]] = ..., token_bytes: _Optional[bytes] = ..., key_bytes: _Optional[bytes] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("seq", "kind", "key", "tier")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: EventKind
    key: bytes
    tier: Tier
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[EventKind, str]] = ..., key: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class TierUsage(_message.Message):
    __slots__ = ("tier", "capacity_pages", "used_pages", "free_pages", "pinned_blocks", "page_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_pages: int
    used_pages: int
    free_pages: int
    pinned_blocks: int
    page_bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_pages: _Optional[int] = ..., used_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., page_bytes: _Optional[int] = ...) -> None: ...

class NodeLoad(_message.Message):
    __slots__ = ("queued_prefill_tokens", "running_decode_requests", "running_decode_tokens", "tiers")
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_DECODE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    queued_prefill_tokens: int
    running_decode_requests: int
    running_decode_tokens: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierUsage]
    def __init__(self, queued_prefill_tokens: _Optional[int] = ..., running_decode_requests: _Optional[int] = ..., running_decode_tokens: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierUsage, _Mapping]]] = ...) -> None: ...
