from reach.v1 import envelope_pb2 as _envelope_pb2
from reach.v1 import mux_pb2 as _mux_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CallRequest(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: _envelope_pb2.ReachMessage
    def __init__(self, message: _Optional[_Union[_envelope_pb2.ReachMessage, _Mapping]] = ...) -> None: ...

class CallResponse(_message.Message):
    __slots__ = ("message", "route")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    message: _envelope_pb2.ReachMessage
    route: RouteInfo
    def __init__(self, message: _Optional[_Union[_envelope_pb2.ReachMessage, _Mapping]] = ..., route: _Optional[_Union[RouteInfo, _Mapping]] = ...) -> None: ...

class CallMuxRequest(_message.Message):
    __slots__ = ("frame",)
    FRAME_FIELD_NUMBER: _ClassVar[int]
    frame: _mux_pb2.CallFrame
    def __init__(self, frame: _Optional[_Union[_mux_pb2.CallFrame, _Mapping]] = ...) -> None: ...

class CallMuxResponse(_message.Message):
    __slots__ = ("frame", "route")
    FRAME_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    frame: _mux_pb2.ReplyFrame
    route: RouteInfo
    def __init__(self, frame: _Optional[_Union[_mux_pb2.ReplyFrame, _Mapping]] = ..., route: _Optional[_Union[RouteInfo, _Mapping]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: _envelope_pb2.ReachMessage
    def __init__(self, message: _Optional[_Union[_envelope_pb2.ReachMessage, _Mapping]] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: _envelope_pb2.ReachMessage
    def __init__(self, message: _Optional[_Union[_envelope_pb2.ReachMessage, _Mapping]] = ...) -> None: ...

class RouteInfo(_message.Message):
    __slots__ = ("instance_id", "service", "trace_id", "message_id")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    service: str
    trace_id: str
    message_id: str
    def __init__(self, instance_id: _Optional[str] = ..., service: _Optional[str] = ..., trace_id: _Optional[str] = ..., message_id: _Optional[str] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: _envelope_pb2.ReachMessage
    def __init__(self, message: _Optional[_Union[_envelope_pb2.ReachMessage, _Mapping]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("delivered", "failed", "failures", "message_id")
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    delivered: int
    failed: int
    failures: _containers.RepeatedCompositeFieldContainer[PublishFailure]
    message_id: str
    def __init__(self, delivered: _Optional[int] = ..., failed: _Optional[int] = ..., failures: _Optional[_Iterable[_Union[PublishFailure, _Mapping]]] = ..., message_id: _Optional[str] = ...) -> None: ...

class PublishFailure(_message.Message):
    __slots__ = ("instance_id", "code", "message")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    code: str
    message: str
    def __init__(self, instance_id: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ReplyRequest(_message.Message):
    __slots__ = ("message", "reply_to")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    message: _envelope_pb2.ReachMessage
    reply_to: str
    def __init__(self, message: _Optional[_Union[_envelope_pb2.ReachMessage, _Mapping]] = ..., reply_to: _Optional[str] = ...) -> None: ...

class ReplyResponse(_message.Message):
    __slots__ = ("delivered",)
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    delivered: bool
    def __init__(self, delivered: _Optional[bool] = ...) -> None: ...
