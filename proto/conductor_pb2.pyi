from proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_ROLE_UNSPECIFIED: _ClassVar[NodeRole]
    NODE_ROLE_PREFILL: _ClassVar[NodeRole]
    NODE_ROLE_DECODE: _ClassVar[NodeRole]
    NODE_ROLE_BOTH: _ClassVar[NodeRole]

class CompletePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPLETE_PHASE_UNSPECIFIED: _ClassVar[CompletePhase]
    COMPLETE_PHASE_PREFILLED: _ClassVar[CompletePhase]
    COMPLETE_PHASE_FINISHED: _ClassVar[CompletePhase]
NODE_ROLE_UNSPECIFIED: NodeRole
NODE_ROLE_PREFILL: NodeRole
NODE_ROLE_DECODE: NodeRole
NODE_ROLE_BOTH: NodeRole
COMPLETE_PHASE_UNSPECIFIED: CompletePhase
COMPLETE_PHASE_PREFILLED: CompletePhase
COMPLETE_PHASE_FINISHED: CompletePhase

class NodeDescriptor(_message.Message):
    __slots__ = ("node_id", "role", "address", "messenger_address", "layouts", "capacity")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MESSENGER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: NodeRole
    address: str
    messenger_address: str
    layouts: _containers.RepeatedCompositeFieldContainer[_common_pb2.Layout]
    capacity: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierUsage]
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[_Union[NodeRole, str]] = ..., address: _Optional[str] = ..., messenger_address: _Optional[str] = ..., layouts: _Optional[_Iterable[_Union[_common_pb2.Layout, _Mapping]]] = ..., capacity: _Optional[_Iterable[_Union[_common_pb2.TierUsage, _Mapping]]] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node", "load")
    NODE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    node: NodeDescriptor
    load: _common_pb2.NodeLoad
    def __init__(self, node: _Optional[_Union[NodeDescriptor, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.NodeLoad, _Mapping]] = ...) -> None: ...

class RegisterNodeReply(_message.Message):
    __slots__ = ("generation", "lease_s", "heartbeat_interval_s")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    generation: int
    lease_s: float
    heartbeat_interval_s: float
    def __init__(self, generation: _Optional[int] = ..., lease_s: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "generation", "load")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    generation: int
    load: _common_pb2.NodeLoad
    def __init__(self, node_id: _Optional[str] = ..., generation: _Optional[int] = ..., load: _Optional[_Union[_common_pb2.NodeLoad, _Mapping]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("lease_s",)
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    lease_s: float
    def __init__(self, lease_s: _Optional[float] = ...) -> None: ...

class UnregisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "generation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    generation: int
    def __init__(self, node_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class UnregisterNodeReply(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: bool = ...) -> None: ...

class ScheduleRequest(_message.Message):
    __slots__ = ("request_id", "blocks", "prompt_tokens", "output_tokens", "ttft_slo_s", "tbt_slo_s", "exclude_nodes", "aggregated", "disaggregate_above", "policy")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_S_FIELD_NUMBER: _ClassVar[int]
    TBT_SLO_S_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_NODES_FIELD_NUMBER: _ClassVar[int]
    AGGREGATED_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATE_ABOVE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    blocks: _common_pb2.BlockSelector
    prompt_tokens: int
    output_tokens: int
    ttft_slo_s: float
    tbt_slo_s: float
    exclude_nodes: _containers.RepeatedScalarFieldContainer[str]
    aggregated: bool
    disaggregate_above: int
    policy: str
    def __init__(self, request_id: _Optional[str] = ..., blocks: _Optional[_Union[_common_pb2.BlockSelector, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., ttft_slo_s: _Optional[float] = ..., tbt_slo_s: _Optional[float] = ..., exclude_nodes: _Optional[_Iterable[str]] = ..., aggregated: bool = ..., disaggregate_above: _Optional[int] = ..., policy: _Optional[str] = ...) -> None: ...

class TransferPlan(_message.Message):
    __slots__ = ("src_node", "src_address", "src_messenger", "dst_node", "dst_address", "dst_messenger", "namespace", "keys", "first_block", "bytes", "est_seconds", "key_bytes")
    SRC_NODE_FIELD_NUMBER: _ClassVar[int]
    SRC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SRC_MESSENGER_FIELD_NUMBER: _ClassVar[int]
    DST_NODE_FIELD_NUMBER: _ClassVar[int]
    DST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DST_MESSENGER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    EST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    src_node: str
    src_address: str
    src_messenger: str
    dst_node: str
    dst_address: str
    dst_messenger: str
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    first_block: int
    bytes: int
    est_seconds: float
    key_bytes: bytes
    def __init__(self, src_node: _Optional[str] = ..., src_address: _Optional[str] = ..., src_messenger: _Optional[str] = ..., dst_node: _Optional[str] = ..., dst_address: _Optional[str] = ..., dst_messenger: _Optional[str] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., first_block: _Optional[int] = ..., bytes: _Optional[int] = ..., est_seconds: _Optional[float] = ..., key_bytes: _Optional[bytes] = ...) -> None: ...

class ScheduleReply(_message.Message):
    __slots__ = ("request_id", "policy", "prefill_node", "prefill_address", "prefill_messenger", "decode_node", "decode_address", "decode_messenger", "total_blocks", "local_blocks", "best_blocks", "reuse_blocks", "transfers", "est_queue_s", "est_transfer_s", "est_prefill_s", "est_ttft_s", "est_tbt_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MESSENGER_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MESSENGER_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BEST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REUSE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    EST_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    EST_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    EST_PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    EST_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    EST_TBT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    policy: str
    prefill_node: str
    prefill_address: str
    prefill_messenger: str
    decode_node: str
    decode_address: str
    decode_messenger: str
    total_blocks: int
    local_blocks: int
    best_blocks: int
    reuse_blocks: int
    transfers: _containers.RepeatedCompositeFieldContainer[TransferPlan]
    est_queue_s: float
    est_transfer_s: float
    est_prefill_s: float
    est_ttft_s: float
    est_tbt_s: float
    def __init__(self, request_id: _Optional[str] = ..., policy: _Optional[str] = ..., prefill_node: _Optional[str] = ..., prefill_address: _Optional[str] = ..., prefill_messenger: _Optional[str] = ..., decode_node: _Optional[str] = ..., decode_address: _Optional[str] = ..., decode_messenger: _Optional[str] = ..., total_blocks: _Optional[int] = ..., local_blocks: _Optional[int] = ..., best_blocks: _Optional[int] = ..., reuse_blocks: _Optional[int] = ..., transfers: _Optional[_Iterable[_Union[TransferPlan, _Mapping]]] = ..., est_queue_s: _Optional[float] = ..., est_transfer_s: _Optional[float] = ..., est_prefill_s: _Optional[float] = ..., est_ttft_s: _Optional[float] = ..., est_tbt_s: _Optional[float] = ...) -> None: ...

class ScheduleBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ScheduleRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[ScheduleRequest, _Mapping]]] = ...) -> None: ...

class ScheduleOutcome(_message.Message):
    __slots__ = ("reply", "code", "message")
    REPLY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reply: ScheduleReply
    code: int
    message: str
    def __init__(self, reply: _Optional[_Union[ScheduleReply, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ScheduleBatchReply(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[ScheduleOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[ScheduleOutcome, _Mapping]]] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("request_id", "phase", "prefill_seconds", "transfer_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    phase: CompletePhase
    prefill_seconds: float
    transfer_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., phase: _Optional[_Union[CompletePhase, str]] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ...) -> None: ...

class CompleteReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CompleteBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[CompleteRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[CompleteRequest, _Mapping]]] = ...) -> None: ...

class CompleteOutcome(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class CompleteBatchReply(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[CompleteOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[CompleteOutcome, _Mapping]]] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node", "generation", "load", "lease_remaining_s", "indexed_blocks", "last_seq", "resyncing", "queue_s", "prefill_pending", "decode_requests", "decode_tokens")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    RESYNCING_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PENDING_FIELD_NUMBER: _ClassVar[int]
    DECODE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    node: NodeDescriptor
    generation: int
    load: _common_pb2.NodeLoad
    lease_remaining_s: float
    indexed_blocks: int
    last_seq: int
    resyncing: bool
    queue_s: float
    prefill_pending: int
    decode_requests: int
    decode_tokens: int
    def __init__(self, node: _Optional[_Union[NodeDescriptor, _Mapping]] = ..., generation: _Optional[int] = ..., load: _Optional[_Union[_common_pb2.NodeLoad, _Mapping]] = ..., lease_remaining_s: _Optional[float] = ..., indexed_blocks: _Optional[int] = ..., last_seq: _Optional[int] = ..., resyncing: bool = ..., queue_s: _Optional[float] = ..., prefill_pending: _Optional[int] = ..., decode_requests: _Optional[int] = ..., decode_tokens: _Optional[int] = ...) -> None: ...

class ListNodesReply(_message.Message):
    __slots__ = ("nodes", "policy", "indexed_keys", "pending_requests", "decisions", "rejections", "uptime_s", "leader")
    NODES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    INDEXED_KEYS_FIELD_NUMBER: _ClassVar[int]
    PENDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    policy: str
    indexed_keys: int
    pending_requests: int
    decisions: int
    rejections: int
    uptime_s: float
    leader: str
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., policy: _Optional[str] = ..., indexed_keys: _Optional[int] = ..., pending_requests: _Optional[int] = ..., decisions: _Optional[int] = ..., rejections: _Optional[int] = ..., uptime_s: _Optional[float] = ..., leader: _Optional[str] = ...) -> None: ...

class NodePrefix(_message.Message):
    __slots__ = ("node_id", "blocks", "tiers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[_common_pb2.Tier]
    def __init__(self, node_id: _Optional[str] = ..., blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.Tier, str]]] = ...) -> None: ...

class LocateReply(_message.Message):
    __slots__ = ("nodes", "total_blocks")
    NODES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodePrefix]
    total_blocks: int
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodePrefix, _Mapping]]] = ..., total_blocks: _Optional[int] = ...) -> None: ...
