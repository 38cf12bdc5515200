from reach.v1 import envelope_pb2 as _envelope_pb2
from reach.v1 import mux_pb2 as _mux_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandleRequest(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: _envelope_pb2.ReachMessage
    def __init__(self, message: _Optional[_Union[_envelope_pb2.ReachMessage, _Mapping]] = ...) -> None: ...

class HandleResponse(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: _envelope_pb2.ReachMessage
    def __init__(self, message: _Optional[_Union[_envelope_pb2.ReachMessage, _Mapping]] = ...) -> None: ...

class HandleStreamRequest(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: _envelope_pb2.ReachMessage
    def __init__(self, message: _Optional[_Union[_envelope_pb2.ReachMessage, _Mapping]] = ...) -> None: ...

class HandleStreamResponse(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: _envelope_pb2.ReachMessage
    def __init__(self, message: _Optional[_Union[_envelope_pb2.ReachMessage, _Mapping]] = ...) -> None: ...

class HandleMuxRequest(_message.Message):
    __slots__ = ("frame",)
    FRAME_FIELD_NUMBER: _ClassVar[int]
    frame: _mux_pb2.CallFrame
    def __init__(self, frame: _Optional[_Union[_mux_pb2.CallFrame, _Mapping]] = ...) -> None: ...

class HandleMuxResponse(_message.Message):
    __slots__ = ("frame",)
    FRAME_FIELD_NUMBER: _ClassVar[int]
    frame: _mux_pb2.ReplyFrame
    def __init__(self, frame: _Optional[_Union[_mux_pb2.ReplyFrame, _Mapping]] = ...) -> None: ...
