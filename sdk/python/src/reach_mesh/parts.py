"""Message content as plain Python values: :class:`Part` (text, JSON data, raw bytes or a URL)
and :class:`Payload` (a message type and its parts), converted to and from ``reach.v1.Part``.

Data parts hold JSON: ``dict`` / ``list`` / ``str`` / ``int`` / ``float`` / ``bool`` /
``None``, carried as ``google.protobuf.Value``. As in the Rust SDK (``reach_proto::json``),
numbers travel as doubles: whole numbers within ±2**53 come back as ``int``, others as
``float``, and integers beyond ±2**53 lose precision, as in JSON itself. A value may nest at
most :data:`MAX_DATA_DEPTH` levels (each object or list is one level).

    >>> part = data_part({"complaint_id": "1", "amounts": [12.5, 300]})
    >>> Part.from_proto(part.to_proto()).data
    {'complaint_id': '1', 'amounts': [12.5, 300]}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Union

from google.protobuf import struct_pb2

from reach.v1 import envelope_pb2

__all__ = [
    "MAX_DATA_DEPTH",
    "DataTooDeep",
    "JsonValue",
    "Part",
    "PartError",
    "PartKind",
    "Payload",
    "data_depth",
    "data_part",
    "from_value",
    "raw_part",
    "text_part",
    "to_value",
    "too_deep_part",
    "url_part",
]

#: A JSON value as Python holds it.
JsonValue = Union[dict[str, Any], list[Any], str, int, float, bool, None]

#: What a part carries.
PartKind = Literal["text", "data", "raw", "url"]

#: Whole numbers of at most this magnitude are exact as doubles and come back as ``int``.
_EXACT_INTEGER = 2**53

#: The deepest a data part's JSON value may nest, in levels: each object or list is one level,
#: a scalar none (``{"a": [1]}`` nests 2). The SDKs refuse to send deeper data, in a call or a
#: reply, and the router refuses deeper messages (INVALID_ARGUMENT / ``INVALID_PAYLOAD``).
#: Protobuf decoders (prost, upb) stop at 100 nested messages, and in a multiplexed frame
#: (``CallMuxRequest``, ``HandleMuxRequest``) the data's outermost ``Value`` is already the 5th
#: (frame, message, payload, part, value); each object level adds 3 (``Struct``, its map entry,
#: the inner ``Value``), each list level 2. 31 object levels end at 98; 32 would end at 101,
#: and an undecodable frame ends the stream every other call on it shares.
MAX_DATA_DEPTH: Final = 31


class PartError(ValueError):
    """A value cannot be carried as a part: not JSON (a set, a NaN, a non-string key), nested
    deeper than :data:`MAX_DATA_DEPTH` (:class:`DataTooDeep`), or the wrong kind of content for
    the part. The message names the offending path."""


class DataTooDeep(PartError):
    """A JSON value nests deeper than :data:`MAX_DATA_DEPTH` levels.

    Attributes:
        depth: how many levels the whole value nests.
        limit: :data:`MAX_DATA_DEPTH`.
        path: where the first level past the limit begins (``$.a.b[0]``).
    """

    def __init__(self, depth: int, path: str) -> None:
        self.depth = depth
        self.limit = MAX_DATA_DEPTH
        self.path = path
        super().__init__(
            f"the data nests {depth} levels deep, over the limit of {MAX_DATA_DEPTH} (MAX_DATA_DEPTH): "
            f"level {MAX_DATA_DEPTH + 1} begins at {path}; flatten it (each object or list is one level)"
        )


class _TooDeep(Exception):
    """Raised inside :func:`_fill` where the value goes past the limit; :func:`to_value`
    measures the whole value and raises :class:`DataTooDeep` instead."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


def data_depth(value: Any) -> int:
    """How many levels ``value`` nests: 0 for a scalar, one more than its deepest element for
    a dict, list or tuple (an empty one nests 1). Walks with an explicit stack, so any value is
    safe to measure."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, level + 1)
        stack.extend((child, level + 1) for child in children)
    return deepest


def _value_depth(value: struct_pb2.Value) -> int:
    """How many levels a ``google.protobuf.Value`` nests (as :func:`data_depth`)."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        item, level = stack.pop()
        kind = item.WhichOneof("kind")
        if kind == "struct_value":
            children: Any = item.struct_value.fields.values()
        elif kind == "list_value":
            children = item.list_value.values
        else:
            continue
        deepest = max(deepest, level + 1)
        stack.extend((child, level + 1) for child in children)
    return deepest


def too_deep_part(payload: envelope_pb2.Payload) -> tuple[int, int] | None:
    """The first data part of ``payload`` nesting deeper than :data:`MAX_DATA_DEPTH`, as
    (part index, depth in levels); ``None`` when every one is within the limit."""
    for index, part in enumerate(payload.parts):
        if part.WhichOneof("content") == "data":
            depth = _value_depth(part.data)
            if depth > MAX_DATA_DEPTH:
                return index, depth
    return None


def to_value(value: Any) -> struct_pb2.Value:
    """``value`` (JSON: dict with str keys, list/tuple, str, int, float, bool, None) as a
    ``google.protobuf.Value``.

    Raises:
        PartError: ``value`` is not JSON; the message gives the path of the bad element
            (for example ``$.items[2]``).
        DataTooDeep: ``value`` nests deeper than :data:`MAX_DATA_DEPTH` levels.
    """
    out = struct_pb2.Value()
    try:
        _fill(out, value, "$", 0)
    except _TooDeep as too_deep:
        raise DataTooDeep(data_depth(value), too_deep.path) from None
    return out


def _fill(out: struct_pb2.Value, value: Any, path: str, level: int) -> None:
    """Fills ``out`` with ``value``, found at ``path`` inside ``level`` containers."""
    # bool before int: bool is a subclass of int.
    if value is None:
        out.null_value = struct_pb2.NULL_VALUE
    elif isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, (int, float)):
        number = float(value)
        if not math.isfinite(number):
            raise PartError(f"{path} is {value!r}; JSON has no NaN or infinity, send null or a string")
        out.number_value = number
    elif isinstance(value, str):
        out.string_value = value
    elif isinstance(value, Mapping):
        if level == MAX_DATA_DEPTH:
            raise _TooDeep(path)
        fields = out.struct_value.fields
        for key, item in value.items():
            if not isinstance(key, str):
                raise PartError(f"{path} has the key {key!r}; JSON object keys must be strings")
            _fill(fields[key], item, f"{path}.{key}", level + 1)
        if not value:
            out.struct_value.SetInParent()
    elif isinstance(value, (list, tuple)):
        if level == MAX_DATA_DEPTH:
            raise _TooDeep(path)
        items = out.list_value.values
        for index, item in enumerate(value):
            _fill(items.add(), item, f"{path}[{index}]", level + 1)
        if not value:
            out.list_value.SetInParent()
    else:
        raise PartError(
            f"{path} is a {type(value).__name__}, which is not JSON; send dicts, lists, "
            "strings, numbers, booleans and None"
        )


def from_value(value: struct_pb2.Value) -> JsonValue:
    """A ``google.protobuf.Value`` as JSON: whole numbers within ±2**53 as ``int``, other
    numbers as ``float``, non-finite numbers as ``None`` (as the Rust SDK reads them)."""
    kind = value.WhichOneof("kind")
    if kind is None or kind == "null_value":
        return None
    if kind == "bool_value":
        return value.bool_value
    if kind == "number_value":
        number = value.number_value
        if not math.isfinite(number):
            return None
        if number.is_integer() and abs(number) <= _EXACT_INTEGER:
            return int(number)
        return number
    if kind == "string_value":
        return value.string_value
    if kind == "list_value":
        return [from_value(item) for item in value.list_value.values]
    return {key: from_value(item) for key, item in value.struct_value.fields.items()}


@dataclass(frozen=True)
class Part:
    """One piece of content: text, JSON data, raw bytes or a URL, with an optional IANA
    ``media_type`` and ``filename``. Build parts with :func:`text_part`, :func:`data_part`,
    :func:`raw_part` and :func:`url_part`; read them with :attr:`text`, :attr:`data`,
    :attr:`raw` and :attr:`url` (each ``None`` unless the part is of that kind)."""

    kind: PartKind
    #: The content: ``str`` for text and url, ``bytes`` for raw, a JSON value for data.
    content: Any
    media_type: str = ""
    filename: str = ""

    @property
    def text(self) -> str | None:
        """The text of a text part; ``None`` for other kinds."""
        return self.content if self.kind == "text" else None

    @property
    def data(self) -> Any:
        """The JSON value of a data part (a ``dict`` for a JSON object); ``None`` for other
        kinds (check :attr:`kind` to tell a JSON ``null`` apart)."""
        return self.content if self.kind == "data" else None

    @property
    def raw(self) -> bytes | None:
        """The bytes of a raw part; ``None`` for other kinds."""
        return self.content if self.kind == "raw" else None

    @property
    def url(self) -> str | None:
        """The URL of a url part; ``None`` for other kinds."""
        return self.content if self.kind == "url" else None

    def to_proto(self) -> envelope_pb2.Part:
        """This part as a ``reach.v1.Part``.

        Raises:
            PartError: a data part's content is not JSON, or nests deeper than
                :data:`MAX_DATA_DEPTH` (:class:`DataTooDeep`).
        """
        part = envelope_pb2.Part(media_type=self.media_type, filename=self.filename)
        if self.kind == "text":
            part.text = self.content
        elif self.kind == "data":
            part.data.CopyFrom(to_value(self.content))
        elif self.kind == "raw":
            part.raw = self.content
        else:
            part.url = self.content
        return part

    @classmethod
    def from_proto(cls, part: envelope_pb2.Part) -> Part:
        """A ``reach.v1.Part`` as a :class:`Part`. A part with no content set reads as empty
        text."""
        kind = part.WhichOneof("content")
        content: Any
        if kind == "data":
            content = from_value(part.data)
        elif kind == "raw":
            content = part.raw
        elif kind == "url":
            content = part.url
        else:
            kind, content = "text", part.text
        return cls(kind=kind, content=content, media_type=part.media_type, filename=part.filename)


def text_part(text: str, *, media_type: str = "text/plain") -> Part:
    """A text part (media type ``text/plain`` unless given, as the Rust SDK's ``Part::text``).

    Raises:
        PartError: ``text`` is not a ``str``.
    """
    if not isinstance(text, str):
        raise PartError(f"a text part holds a str, not a {type(text).__name__}")
    return Part("text", text, media_type=media_type)


def data_part(value: Any, *, media_type: str = "application/json") -> Part:
    """A data part holding the JSON ``value`` — usually a ``dict`` (media type
    ``application/json`` unless given, as the Rust SDK's ``Part::data``). The value is checked
    and copied now, so later changes to ``value`` do not change the part.

    Raises:
        PartError: ``value`` is not JSON; the message gives the path of the bad element.
        DataTooDeep: ``value`` nests deeper than :data:`MAX_DATA_DEPTH` levels; the message
            gives its depth, the limit and where the first level past it begins.
    """
    return Part("data", from_value(to_value(value)), media_type=media_type)


def raw_part(content: bytes, *, media_type: str = "application/octet-stream", filename: str = "") -> Part:
    """A raw bytes part described by ``media_type`` (and optionally ``filename``).

    Raises:
        PartError: ``content`` is not bytes.
    """
    if not isinstance(content, (bytes, bytearray, memoryview)):
        raise PartError(f"a raw part holds bytes, not a {type(content).__name__}")
    return Part("raw", bytes(content), media_type=media_type, filename=filename)


def url_part(url: str, *, media_type: str = "", filename: str = "") -> Part:
    """A part pointing at content by URL (for content too large to send inline).

    Raises:
        PartError: ``url`` is not a ``str``.
    """
    if not isinstance(url, str):
        raise PartError(f"a url part holds a str, not a {type(url).__name__}")
    return Part("url", url, media_type=media_type, filename=filename)


@dataclass(frozen=True)
class Payload:
    """A message's content: its ``type`` (a message type of the protocol registry, for
    example ``complaint.suggestion``; may be empty) and its ``parts`` in order."""

    type: str = ""
    parts: tuple[Part, ...] = ()

    @property
    def data(self) -> Any:
        """The JSON value of the first data part (as the Rust SDK's ``first_json``); ``None``
        when there is none."""
        return next((part.content for part in self.parts if part.kind == "data"), None)

    @property
    def text(self) -> str | None:
        """The first text part's text; ``None`` when there is none."""
        return next((part.content for part in self.parts if part.kind == "text"), None)

    def to_proto(self) -> envelope_pb2.Payload:
        """This payload as a ``reach.v1.Payload``.

        Raises:
            PartError: a data part's content is not JSON, or nests deeper than
                :data:`MAX_DATA_DEPTH` (:class:`DataTooDeep`).
        """
        return envelope_pb2.Payload(type=self.type, parts=[part.to_proto() for part in self.parts])

    @classmethod
    def from_proto(cls, payload: envelope_pb2.Payload) -> Payload:
        """A ``reach.v1.Payload`` as a :class:`Payload`."""
        return cls(type=payload.type, parts=tuple(Part.from_proto(part) for part in payload.parts))

    @classmethod
    def of(cls, content: Payload | Part | Sequence[Part], message_type: str = "") -> Payload:
        """``content`` as a payload: a :class:`Payload` as it is, one :class:`Part` or a
        sequence of parts with the type ``message_type``.

        Raises:
            PartError: ``content`` is none of those (the message says what it was).
        """
        if isinstance(content, Payload):
            return content
        if isinstance(content, Part):
            return cls(type=message_type, parts=(content,))
        if isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
            parts = tuple(content)
            for index, part in enumerate(parts):
                if not isinstance(part, Part):
                    raise PartError(
                        f"parts[{index}] is a {_type_name(part)}; build parts with text_part(...) "
                        "or data_part({...})"
                    )
            return cls(type=message_type, parts=parts)
        raise PartError(
            f"expected a Payload, a Part or a list of Parts, got a {_type_name(content)}; wrap "
            "a dict in data_part({...}) and a str in text_part(...)"
        )


def _type_name(value: object) -> str:
    """The name of ``value``'s type, for error messages."""
    return type(value).__name__
