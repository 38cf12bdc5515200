"""Identifiers on the wire, made as the Rust SDK makes them (``reach_rpc::trace``):

- trace ids: W3C Trace Context trace ids, 16 random bytes as 32 lowercase hex characters,
  never all zero — the id OpenTelemetry uses, so the envelope's ``header.trace_id``, the
  ``traceparent`` header and exported spans line up;
- ``traceparent`` values: ``00-<trace id>-<span id>-01`` (version 00, a fresh random 8-byte
  span id, sampled), what the Rust ``MeshClient`` sends for a new call's client span;
- message ids: UUIDv7 (RFC 9562, time-ordered), hyphenated lowercase.
"""

from __future__ import annotations

import re
import secrets
import sys
import uuid

__all__ = [
    "TRACEPARENT",
    "is_trace_id",
    "new_message_id",
    "new_span_id",
    "new_trace_id",
    "trace_id_of_traceparent",
    "traceparent",
]

#: The metadata key of the W3C ``traceparent`` header.
TRACEPARENT = "traceparent"

_TRACE_ID = re.compile(r"[0-9a-f]{32}")
_HEX = re.compile(r"[0-9a-f]+")

if sys.version_info >= (3, 14):
    _uuid7 = uuid.uuid7
else:
    from uuid6 import uuid7 as _uuid7


def new_trace_id() -> str:
    """A fresh random W3C trace id: 32 lowercase hex characters, not all zero."""
    while True:
        trace_id = secrets.token_hex(16)
        if trace_id != "0" * 32:
            return trace_id


def new_span_id() -> str:
    """A fresh random W3C span (parent) id: 16 lowercase hex characters, not all zero."""
    while True:
        span_id = secrets.token_hex(8)
        if span_id != "0" * 16:
            return span_id


def is_trace_id(text: str) -> bool:
    """Whether ``text`` is a valid W3C trace id (what the router accepts in
    ``header.trace_id``; anything else it refuses with ``INVALID_TRACE_ID``)."""
    return bool(_TRACE_ID.fullmatch(text)) and text != "0" * 32


def traceparent(trace_id: str, span_id: str | None = None, *, sampled: bool = True) -> str:
    """The W3C ``traceparent`` value naming span ``span_id`` (fresh when ``None``) of trace
    ``trace_id``: ``00-<trace_id>-<span_id>-01`` (``-00`` when not ``sampled``).

    Raises:
        ValueError: ``trace_id`` or ``span_id`` is malformed.
    """
    if not is_trace_id(trace_id):
        raise ValueError(
            f"trace id {trace_id!r} must be 32 lowercase hex characters, not all zero"
        )
    span = new_span_id() if span_id is None else span_id
    if len(span) != 16 or not _HEX.fullmatch(span) or span == "0" * 16:
        raise ValueError(f"span id {span!r} must be 16 lowercase hex characters, not all zero")
    return f"00-{trace_id}-{span}-{'01' if sampled else '00'}"


def trace_id_of_traceparent(value: str) -> str | None:
    """The trace id a ``traceparent`` value names; ``None`` when the value is malformed by
    W3C Trace Context §3.2 (as ``TraceId::from_traceparent`` reads it): a field of the wrong
    length or not lowercase hex, version ``ff``, an all-zero trace or parent id, or trailing
    fields after a version ``00`` value."""
    fields = value.strip().split("-")
    if len(fields) < 4:
        return None
    version, trace_id, parent_id, flags = fields[:4]

    def is_hex(field: str, length: int) -> bool:
        return len(field) == length and bool(_HEX.fullmatch(field))

    if (
        not is_hex(version, 2)
        or version == "ff"
        or (version == "00" and len(fields) > 4)
        or not is_hex(parent_id, 16)
        or parent_id == "0" * 16
        or not is_hex(flags, 2)
        or not is_trace_id(trace_id)
    ):
        return None
    return trace_id


def new_message_id() -> str:
    """A fresh message id: a UUIDv7, hyphenated lowercase (the dedupe key agents use)."""
    return str(_uuid7())
