from proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EntryState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENTRY_STATE_UNSPECIFIED: _ClassVar[EntryState]
    ENTRY_PENDING: _ClassVar[EntryState]
    ENTRY_DONE: _ClassVar[EntryState]
    ENTRY_FAILED: _ClassVar[EntryState]
ENTRY_STATE_UNSPECIFIED: EntryState
ENTRY_PENDING: EntryState
ENTRY_DONE: EntryState
ENTRY_FAILED: EntryState

class TransferEntry(_message.Message):
    __slots__ = ("key", "source", "source_data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DATA_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    source: str
    source_data: str
    def __init__(self, key: _Optional[bytes] = ..., source: _Optional[str] = ..., source_data: _Optional[str] = ...) -> None: ...

class SubmitTransferRequest(_message.Message):
    __slots__ = ("namespace", "entries", "destination_tier", "chain", "urgent", "hold_s", "wait_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_TIER_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    URGENT_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    entries: _containers.RepeatedCompositeFieldContainer[TransferEntry]
    destination_tier: _common_pb2.Tier
    chain: bool
    urgent: bool
    hold_s: float
    wait_s: float
    def __init__(self, namespace: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[TransferEntry, _Mapping]]] = ..., destination_tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., chain: bool = ..., urgent: bool = ..., hold_s: _Optional[float] = ..., wait_s: _Optional[float] = ...) -> None: ...

class SubmitTransferReply(_message.Message):
    __slots__ = ("batch_id", "entries", "deduplicated", "status")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    entries: int
    deduplicated: int
    status: TransferStatusReply
    def __init__(self, batch_id: _Optional[str] = ..., entries: _Optional[int] = ..., deduplicated: _Optional[int] = ..., status: _Optional[_Union[TransferStatusReply, _Mapping]] = ...) -> None: ...

class EntryStatus(_message.Message):
    __slots__ = ("key", "state", "code", "reason", "already_present")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    state: EntryState
    code: str
    reason: str
    already_present: bool
    def __init__(self, key: _Optional[bytes] = ..., state: _Optional[_Union[EntryState, str]] = ..., code: _Optional[str] = ..., reason: _Optional[str] = ..., already_present: bool = ...) -> None: ...

class TransferStatusRequest(_message.Message):
    __slots__ = ("batch_id", "wait", "timeout_s")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    wait: bool
    timeout_s: float
    def __init__(self, batch_id: _Optional[str] = ..., wait: bool = ..., timeout_s: _Optional[float] = ...) -> None: ...

class TransferStatusReply(_message.Message):
    __slots__ = ("batch_id", "entries", "pending", "done", "failed", "finished", "bytes_moved", "elapsed_s")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    entries: _containers.RepeatedCompositeFieldContainer[EntryStatus]
    pending: int
    done: int
    failed: int
    finished: bool
    bytes_moved: int
    elapsed_s: float
    def __init__(self, batch_id: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[EntryStatus, _Mapping]]] = ..., pending: _Optional[int] = ..., done: _Optional[int] = ..., failed: _Optional[int] = ..., finished: bool = ..., bytes_moved: _Optional[int] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    def __init__(self, batch_id: _Optional[str] = ...) -> None: ...

class MessengerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MessengerInfo(_message.Message):
    __slots__ = ("node", "data_address", "transport", "lanes", "namespaces")
    NODE_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    node: str
    data_address: str
    transport: str
    lanes: int
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node: _Optional[str] = ..., data_address: _Optional[str] = ..., transport: _Optional[str] = ..., lanes: _Optional[int] = ..., namespaces: _Optional[_Iterable[str]] = ...) -> None: ...

class MessengerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MessengerStats(_message.Message):
    __slots__ = ("batches_in_flight", "entries_in_flight", "entries_done", "entries_failed", "bytes_received", "bytes_sent", "pages_sent", "open_connections", "uptime_s")
    BATCHES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_DONE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    OPEN_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    batches_in_flight: int
    entries_in_flight: int
    entries_done: int
    entries_failed: int
    bytes_received: int
    bytes_sent: int
    pages_sent: int
    open_connections: int
    uptime_s: float
    def __init__(self, batches_in_flight: _Optional[int] = ..., entries_in_flight: _Optional[int] = ..., entries_done: _Optional[int] = ..., entries_failed: _Optional[int] = ..., bytes_received: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., pages_sent: _Optional[int] = ..., open_connections: _Optional[int] = ..., uptime_s: _Optional[float] = ...) -> None: ...
