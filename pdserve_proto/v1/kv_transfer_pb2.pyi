from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Challenge(_message.Message):
    __slots__ = ("protocol_version", "nonce")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    nonce: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class AuthResponse(_message.Message):
    __slots__ = ("nonce", "mac")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    mac: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., mac: _Optional[bytes] = ...) -> None: ...

class AuthResult(_message.Message):
    __slots__ = ("ok", "mac", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    mac: bytes
    message: str
    def __init__(self, ok: _Optional[bool] = ..., mac: _Optional[bytes] = ..., message: _Optional[str] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "layout", "block_bytes", "tp_size", "tp_rank", "transport")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str
    block_bytes: int
    tp_size: int
    tp_rank: int
    transport: str
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layout: _Optional[str] = ..., block_bytes: _Optional[int] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class Handshake(_message.Message):
    __slots__ = ("layout", "nccl_unique_id", "nccl_pair_key", "plane_fields")
    class PlaneFieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NCCL_UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    NCCL_PAIR_KEY_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELDS_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    nccl_unique_id: bytes
    nccl_pair_key: bytes
    plane_fields: _containers.ScalarMap[str, bytes]
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., nccl_unique_id: _Optional[bytes] = ..., nccl_pair_key: _Optional[bytes] = ..., plane_fields: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class HandshakeResult(_message.Message):
    __slots__ = ("ok", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("request_id", "block_ids", "held_block_ids", "lease_deadline", "lease_token", "lease_readers", "follow_key", "follow_max_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_READERS_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_KEY_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    held_block_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_deadline: float
    lease_token: bytes
    lease_readers: int
    follow_key: str
    follow_max_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., held_block_ids: _Optional[_Iterable[int]] = ..., lease_deadline: _Optional[float] = ..., lease_token: _Optional[bytes] = ..., lease_readers: _Optional[int] = ..., follow_key: _Optional[str] = ..., follow_max_blocks: _Optional[int] = ...) -> None: ...

class KVPiece(_message.Message):
    __slots__ = ("layer", "first_block", "num_blocks", "done", "request_id", "block_ids", "error")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    layer: int
    first_block: int
    num_blocks: int
    done: bool
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    error: str
    def __init__(self, layer: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., done: _Optional[bool] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("status", "message", "total_bytes", "num_layers", "num_blocks")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OK: _ClassVar[PullReply.Status]
        UNKNOWN_REQUEST: _ClassVar[PullReply.Status]
        LEASE_EXPIRED: _ClassVar[PullReply.Status]
        BAD_BLOCKS: _ClassVar[PullReply.Status]
    OK: PullReply.Status
    UNKNOWN_REQUEST: PullReply.Status
    LEASE_EXPIRED: PullReply.Status
    BAD_BLOCKS: PullReply.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    status: PullReply.Status
    message: str
    total_bytes: int
    num_layers: int
    num_blocks: int
    def __init__(self, status: _Optional[_Union[PullReply.Status, str]] = ..., message: _Optional[str] = ..., total_bytes: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class NixlOffer(_message.Message):
    __slots__ = ("agent", "metadata", "memory", "device_id", "layer_addresses", "block_ids")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    agent: str
    metadata: bytes
    memory: str
    device_id: int
    layer_addresses: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, agent: _Optional[str] = ..., metadata: _Optional[bytes] = ..., memory: _Optional[str] = ..., device_id: _Optional[int] = ..., layer_addresses: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PullDone(_message.Message):
    __slots__ = ("ok", "received_bytes")
    OK_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    received_bytes: int
    def __init__(self, ok: _Optional[bool] = ..., received_bytes: _Optional[int] = ...) -> None: ...
