"""What a handler knows about the message it handles: :class:`HandlerContext` (the Rust SDK's
``HandlerContext``): the request's header fields, its deadline and cancellation, the
instance, the reply's header metadata, and the model slots."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Final

from reach.v1 import envelope_pb2
from reach_mesh.message import Message
from reach_mesh.models import ModelSlots
from reach_mesh.parts import Payload

__all__ = [
    "ACK_PAYLOAD_TYPE",
    "MAX_REPLY_METADATA_ENTRIES",
    "MAX_REPLY_METADATA_KEY_BYTES",
    "MAX_REPLY_METADATA_VALUE_BYTES",
    "HandlerContext",
]

_log = logging.getLogger("reach_mesh")

#: The payload type of an acknowledgement: the answer follows later (``MeshClient.reply``).
ACK_PAYLOAD_TYPE: Final = "reach.ack"
#: The most reply metadata entries a handler may set.
MAX_REPLY_METADATA_ENTRIES: Final = 64
#: The longest reply metadata key, in bytes.
MAX_REPLY_METADATA_KEY_BYTES: Final = 128
#: The longest reply metadata value, in bytes.
MAX_REPLY_METADATA_VALUE_BYTES: Final = 1024


class HandlerContext:
    """The context of one handled message (or stream).

    Attributes:
        message: the request (for a stream: the message that opened it).
        instance_id: this instance's id.
        deadline: when the caller stops waiting, in :func:`time.monotonic` seconds; ``None``
            when it set no deadline.
        call_metadata: the call's request metadata: ``traceparent`` / ``tracestate`` and any
            ``x-`` keys the caller sent (a unary call's gRPC metadata, or a multiplexed call's
            ``CallFrame.metadata``).
        model_slots: this instance's model call slots; wrap each model call in
            ``async with ctx.model_slots.acquire():`` so heartbeats report the model's load.
        caller: the caller's SPIFFE ID as the router verified it
            (``spiffe://reach.local/operator/alice``, ``.../user/<sub>`` for a bearer token's
            subject): the call's ``x-reach-caller``, believed only when the agent serves TLS
            (:attr:`reach_mesh.AgentConfig.tls`) and the connection's client certificate is
            the router's (``spiffe://<trust_domain>/router``); ``None`` otherwise (a plaintext
            agent, a caller that dialled the agent directly, or an anonymous caller).
    """

    def __init__(
        self,
        message: Message,
        instance_id: str,
        deadline: float | None,
        call_metadata: Mapping[str, str],
        model_slots: ModelSlots,
        caller: str | None = None,
    ) -> None:
        self.message = message
        self.caller = caller
        self.instance_id = instance_id
        self.deadline = deadline
        self.call_metadata = dict(call_metadata)
        self.model_slots = model_slots
        self._cancelled = asyncio.Event()
        self._reply_metadata: dict[str, str] = {}

    @property
    def header(self) -> envelope_pb2.Header:
        """The request's header."""
        return self.message.header

    @property
    def trace_id(self) -> str:
        """The request's W3C trace id."""
        return self.message.trace_id

    @property
    def task_id(self) -> str:
        """The request's task id (``""`` when none)."""
        return self.message.task_id

    @property
    def message_id(self) -> str:
        """The request's message id."""
        return self.message.message_id

    @property
    def turn(self) -> int:
        """The request's ``header.turn``. A call made on its behalf goes at ``turn + 1``
        (:meth:`reach_mesh.CallOptions.within`); the router refuses turns above its
        ``max_turn``."""
        return self.message.turn

    @property
    def capability(self) -> str:
        """The capability the request addressed (``""`` when it addressed the service)."""
        return self.message.capability

    @property
    def reply_to(self) -> str:
        """Where an asynchronous reply goes (``""`` when the caller waits for the handler's
        return value). When set, a handler may return :meth:`ack` at once and send the answer
        later with :meth:`reach_mesh.MeshClient.reply`."""
        return self.message.header.reply_to

    @property
    def traceparent(self) -> str | None:
        """The caller's W3C ``traceparent`` (its span), for joining the trace."""
        return self.call_metadata.get("traceparent")

    def time_remaining(self) -> float | None:
        """Seconds left before the deadline (0 once it passed); ``None`` without a deadline."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())

    def is_cancelled(self) -> bool:
        """Whether the caller gave up (it cancelled, went away, or its deadline passed)."""
        return self._cancelled.is_set()

    async def cancelled(self) -> None:
        """Returns once the caller gave up. Long work should race it and stop, for example
        ``asyncio.wait([work, asyncio.ensure_future(ctx.cancelled())], return_when=FIRST_COMPLETED)``."""
        await self._cancelled.wait()

    def cancel(self) -> None:
        """Marks the call as given up (the runtime calls it; a handler need not)."""
        self._cancelled.set()

    @staticmethod
    def ack() -> Payload:
        """The acknowledgement payload: return it to answer asynchronously later."""
        return Payload(type=ACK_PAYLOAD_TYPE)

    def set_reply_metadata(self, key: str, value: str) -> bool:
        """Adds ``key`` = ``value`` to the reply's ``header.metadata`` (for example the model
        tokens the reply cost); setting a key again replaces it. Bounded as in the Rust SDK:
        at most 64 entries, keys of 1 to 128 bytes and values of at most 1024 bytes; an entry
        past a bound is dropped with a warning. Returns whether it was kept."""
        key_bytes, value_bytes = len(key.encode()), len(value.encode())
        if not key or key_bytes > MAX_REPLY_METADATA_KEY_BYTES:
            _log.warning(
                "reply metadata key empty or too long; dropped (%d bytes, limit %d)",
                key_bytes,
                MAX_REPLY_METADATA_KEY_BYTES,
            )
            return False
        if value_bytes > MAX_REPLY_METADATA_VALUE_BYTES:
            _log.warning(
                "reply metadata value too long; dropped (key %s, %d bytes, limit %d)",
                key,
                value_bytes,
                MAX_REPLY_METADATA_VALUE_BYTES,
            )
            return False
        if len(self._reply_metadata) >= MAX_REPLY_METADATA_ENTRIES and key not in self._reply_metadata:
            _log.warning(
                "too many reply metadata entries; dropped (key %s, limit %d)",
                key,
                MAX_REPLY_METADATA_ENTRIES,
            )
            return False
        self._reply_metadata[key] = value
        return True

    def take_reply_metadata(self) -> dict[str, str]:
        """The reply metadata set so far, leaving none (the runtime copies it into each
        reply)."""
        taken, self._reply_metadata = self._reply_metadata, {}
        return taken
