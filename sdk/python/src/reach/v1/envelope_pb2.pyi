import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReachMessage(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: Header
    payload: Payload
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., payload: _Optional[_Union[Payload, _Mapping]] = ...) -> None: ...

class Header(_message.Message):
    __slots__ = ("message_id", "trace_id", "task_id", "source", "service", "capability", "topic", "capability_version", "protocol_version", "created_at", "ttl", "reply_to", "correlation_id", "turn", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    trace_id: str
    task_id: str
    source: str
    service: str
    capability: str
    topic: str
    capability_version: str
    protocol_version: str
    created_at: _timestamp_pb2.Timestamp
    ttl: _duration_pb2.Duration
    reply_to: str
    correlation_id: str
    turn: int
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, message_id: _Optional[str] = ..., trace_id: _Optional[str] = ..., task_id: _Optional[str] = ..., source: _Optional[str] = ..., service: _Optional[str] = ..., capability: _Optional[str] = ..., topic: _Optional[str] = ..., capability_version: _Optional[str] = ..., protocol_version: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., reply_to: _Optional[str] = ..., correlation_id: _Optional[str] = ..., turn: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("type", "parts")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    type: str
    parts: _containers.RepeatedCompositeFieldContainer[Part]
    def __init__(self, type: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[Part, _Mapping]]] = ...) -> None: ...

class Part(_message.Message):
    __slots__ = ("text", "data", "raw", "url", "media_type", "filename")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    text: str
    data: _struct_pb2.Value
    raw: bytes
    url: str
    media_type: str
    filename: str
    def __init__(self, text: _Optional[str] = ..., data: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., raw: _Optional[bytes] = ..., url: _Optional[str] = ..., media_type: _Optional[str] = ..., filename: _Optional[str] = ...) -> None: ...
