"""Received messages as Python values: :class:`Message` (a ``reach.v1.ReachMessage`` with its
header fields and decoded parts) and :class:`Reply` (a call's reply and where it was
handled)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from reach.v1 import envelope_pb2, router_service_pb2
from reach_mesh.parts import Part, Payload

__all__ = ["Message", "Reply"]


class Message:
    """A ``reach.v1.ReachMessage``: its header's fields as attributes, its content as a
    :class:`~reach_mesh.Payload` of :class:`~reach_mesh.Part` values. The envelope itself is
    :attr:`proto`."""

    def __init__(self, proto: envelope_pb2.ReachMessage) -> None:
        self.proto = proto

    @property
    def header(self) -> envelope_pb2.Header:
        """The envelope's header (``reach.v1.Header``)."""
        return self.proto.header

    @property
    def message_id(self) -> str:
        """The message id (a UUIDv7; the dedupe key)."""
        return self.proto.header.message_id

    @property
    def trace_id(self) -> str:
        """The W3C trace id (32 lowercase hex)."""
        return self.proto.header.trace_id

    @property
    def task_id(self) -> str:
        """The task the message belongs to (``""`` when none)."""
        return self.proto.header.task_id

    @property
    def source(self) -> str:
        """The sending service, dotted."""
        return self.proto.header.source

    @property
    def capability(self) -> str:
        """The addressed capability (``""`` when the message addressed a service or topic)."""
        header = self.proto.header
        return header.capability if header.WhichOneof("target") == "capability" else ""

    @property
    def service(self) -> str:
        """The addressed service (``""`` when the message addressed a capability or topic)."""
        header = self.proto.header
        return header.service if header.WhichOneof("target") == "service" else ""

    @property
    def turn(self) -> int:
        """How many agent hops this conversation has taken (the router's loop guard)."""
        return self.proto.header.turn

    @property
    def correlation_id(self) -> str:
        """The ``message_id`` of the message this one answers (``""`` for a request)."""
        return self.proto.header.correlation_id

    @property
    def metadata(self) -> dict[str, str]:
        """The header's free-form metadata (a copy)."""
        return dict(self.proto.header.metadata)

    @property
    def type(self) -> str:
        """The payload's message type (``complaint.submitted``); may be empty."""
        return self.proto.payload.type

    @cached_property
    def payload(self) -> Payload:
        """The payload, decoded."""
        return Payload.from_proto(self.proto.payload)

    @property
    def parts(self) -> tuple[Part, ...]:
        """The payload's parts, in order."""
        return self.payload.parts

    @property
    def data(self) -> Any:
        """The JSON value of the first data part (usually a ``dict``); ``None`` when the
        message has no data part."""
        return self.payload.data

    @property
    def text(self) -> str | None:
        """The first text part's text; ``None`` when the message has none."""
        return self.payload.text

    def __repr__(self) -> str:
        target = self.capability or self.service or self.proto.header.topic
        return f"Message(id={self.message_id!r}, target={target!r}, type={self.type!r}, parts={self.parts!r})"


@dataclass(frozen=True)
class Reply:
    """A call's reply and where the router delivered it.

    Attributes:
        message: the instance's reply (its ``correlation_id`` is the request's message id).
        instance_id: the instance that handled the call.
        service: that instance's service.
        trace_id: the trace id the request carried (assigned by the router if it had none).
        message_id: the request's message id.
    """

    message: Message
    instance_id: str
    service: str
    trace_id: str
    message_id: str

    @classmethod
    def of(cls, message: envelope_pb2.ReachMessage, route: router_service_pb2.RouteInfo) -> Reply:
        """The reply in ``message``, routed as ``route`` says."""
        return cls(
            message=Message(message),
            instance_id=route.instance_id,
            service=route.service,
            trace_id=route.trace_id,
            message_id=route.message_id,
        )

    @property
    def parts(self) -> tuple[Part, ...]:
        """The reply's parts."""
        return self.message.parts

    @property
    def data(self) -> Any:
        """The JSON value of the reply's first data part; ``None`` when it has none."""
        return self.message.data

    @property
    def text(self) -> str | None:
        """The reply's first text part; ``None`` when it has none."""
        return self.message.text
