from reach.v1 import envelope_pb2 as _envelope_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CallFrame(_message.Message):
    __slots__ = ("call_id", "message", "timeout_ms", "metadata", "cancel")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    message: _envelope_pb2.ReachMessage
    timeout_ms: int
    metadata: _containers.ScalarMap[str, str]
    cancel: bool
    def __init__(self, call_id: _Optional[int] = ..., message: _Optional[_Union[_envelope_pb2.ReachMessage, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class ReplyFrame(_message.Message):
    __slots__ = ("call_id", "reply", "error")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    reply: _envelope_pb2.ReachMessage
    error: CallError
    def __init__(self, call_id: _Optional[int] = ..., reply: _Optional[_Union[_envelope_pb2.ReachMessage, _Mapping]] = ..., error: _Optional[_Union[CallError, _Mapping]] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "message", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    details: bytes
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., details: _Optional[bytes] = ...) -> None: ...
