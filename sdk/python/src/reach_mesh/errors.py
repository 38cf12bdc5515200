"""Errors as Reach sends them: a gRPC status code, a lowercase message that says what to fix,
and, where a program must branch, a ``google.rpc.ErrorInfo`` in the domain ``reach.dev`` with
a stable :class:`Reason` and string metadata (plus a ``google.rpc.RetryInfo`` when the caller
should come back later). ``docs/errors.md`` lists every reason.

:class:`ReachError` is both what the SDK raises (a failed call, task or registration) and
what a handler raises to answer with a status::

    raise ReachError(grpc.StatusCode.INVALID_ARGUMENT, "the payload needs complaint_id")

Branch on :attr:`ReachError.reason`, never on the message text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from reach.v1 import mux_pb2

__all__ = ["ERROR_DOMAIN", "STATUS_DETAILS_KEY", "ReachError", "Reason", "code_of"]

#: The ErrorInfo domain of every Reach error.
ERROR_DOMAIN: Final = "reach.dev"

#: The trailer that carries the encoded ``google.rpc.Status`` with its details.
STATUS_DETAILS_KEY: Final = "grpc-status-details-bin"

_CODES: Final = {code.value[0]: code for code in grpc.StatusCode}


def code_of(number: int) -> grpc.StatusCode:
    """The status code numbered ``number`` (``google.rpc.Code``); UNKNOWN for a number gRPC
    does not define."""
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


class Reason:
    """The stable ErrorInfo reasons Reach returns (``reach_rpc::errors::reason``); each is
    described, with its status code and metadata keys, in ``docs/errors.md``."""

    # === trust (every service with [trust] on) ===
    NOT_AUTHORIZED: Final = "NOT_AUTHORIZED"
    UNAUTHENTICATED: Final = "UNAUTHENTICATED"
    # === routing (router) ===
    ROUTE_NOT_FOUND: Final = "ROUTE_NOT_FOUND"
    PAYLOAD_TOO_LARGE: Final = "PAYLOAD_TOO_LARGE"
    INVALID_TRACE_ID: Final = "INVALID_TRACE_ID"
    INVALID_TARGET: Final = "INVALID_TARGET"
    DEADLINE_EXCEEDED: Final = "DEADLINE_EXCEEDED"
    INSTANCE_DRAINING: Final = "INSTANCE_DRAINING"
    INSTANCE_UNAVAILABLE: Final = "INSTANCE_UNAVAILABLE"
    INSTANCE_LOST: Final = "INSTANCE_LOST"
    REPLY_PEER_UNAVAILABLE: Final = "REPLY_PEER_UNAVAILABLE"
    OVERLOADED: Final = "OVERLOADED"
    MESSAGE_EXPIRED: Final = "MESSAGE_EXPIRED"
    VERSION_NOT_SUPPORTED: Final = "VERSION_NOT_SUPPORTED"
    INVALID_PAYLOAD: Final = "INVALID_PAYLOAD"
    INVALID_HEADER: Final = "INVALID_HEADER"
    TURN_LIMIT_EXCEEDED: Final = "TURN_LIMIT_EXCEEDED"
    ADAPTER_FAILED: Final = "ADAPTER_FAILED"
    # === multiplexed calls (CallMux, HandleMux) ===
    CALL_ID_IN_USE: Final = "CALL_ID_IN_USE"
    INVALID_FRAME: Final = "INVALID_FRAME"
    # === registry ===
    LEASE_NOT_FOUND: Final = "LEASE_NOT_FOUND"
    INSTANCE_DRAINED: Final = "INSTANCE_DRAINED"
    CAPABILITY_NOT_DECLARED: Final = "CAPABILITY_NOT_DECLARED"
    TOO_MANY_WATCHES: Final = "TOO_MANY_WATCHES"
    PROBE_RATE_LIMITED: Final = "PROBE_RATE_LIMITED"
    # === agents (the SDK's AgentService) ===
    CAPABILITY_NOT_HANDLED: Final = "CAPABILITY_NOT_HANDLED"
    # === agent kit: model calls ===
    MODEL_RATE_LIMITED: Final = "MODEL_RATE_LIMITED"
    MODEL_TIMEOUT: Final = "MODEL_TIMEOUT"
    MODEL_BAD_RESPONSE: Final = "MODEL_BAD_RESPONSE"
    MODEL_UNAVAILABLE: Final = "MODEL_UNAVAILABLE"
    MODEL_REFUSED: Final = "MODEL_REFUSED"
    # === orchestrator ===
    TASK_NOT_FOUND: Final = "TASK_NOT_FOUND"
    INVALID_TASK_ID: Final = "INVALID_TASK_ID"
    INVALID_LABELS: Final = "INVALID_LABELS"
    TASK_ID_IN_USE: Final = "TASK_ID_IN_USE"
    TASK_NOT_WAITING: Final = "TASK_NOT_WAITING"
    NODE_NOT_WAITING: Final = "NODE_NOT_WAITING"
    INVALID_INPUT: Final = "INVALID_INPUT"
    TASK_ENDED: Final = "TASK_ENDED"
    TASK_NOT_RETRYABLE: Final = "TASK_NOT_RETRYABLE"
    TASK_CONTENDED: Final = "TASK_CONTENDED"
    FLOW_NOT_FOUND: Final = "FLOW_NOT_FOUND"
    FLOW_NOT_LOADED: Final = "FLOW_NOT_LOADED"
    INVALID_FLOW: Final = "INVALID_FLOW"
    FLOW_VERSION_CONFLICT: Final = "FLOW_VERSION_CONFLICT"
    INVALID_PAGE_TOKEN: Final = "INVALID_PAGE_TOKEN"
    STORE_UNAVAILABLE: Final = "STORE_UNAVAILABLE"
    STORE_CONFLICT: Final = "STORE_CONFLICT"
    STORE_CORRUPT: Final = "STORE_CORRUPT"
    INVALID_WEBHOOK: Final = "INVALID_WEBHOOK"
    TOO_MANY_WEBHOOKS: Final = "TOO_MANY_WEBHOOKS"
    WEBHOOK_NOT_FOUND: Final = "WEBHOOK_NOT_FOUND"


class ReachError(Exception):
    """A gRPC status with Reach's error details.

    Attributes:
        code: the gRPC status code.
        message: what was wrong and how to fix it.
        reason: the ErrorInfo reason (a :class:`Reason` constant), or ``None`` when the status
            carries no ErrorInfo.
        metadata: the ErrorInfo metadata (for example ``size_bytes`` and ``limit_bytes`` of
            ``PAYLOAD_TOO_LARGE``); empty without ErrorInfo.
        retry_after: the ``google.rpc.RetryInfo`` delay in seconds, when the status says to
            retry later (``OVERLOADED``).
        status: the full ``google.rpc.Status``, details included (``BadRequest`` field
            violations, for example), as it travels in ``grpc-status-details-bin``.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata: dict[str, str] = dict(metadata or {})
        self.retry_after = retry_after
        self.status = self._build_status()

    def _build_status(self) -> status_pb2.Status:
        status = status_pb2.Status(code=self.code.value[0], message=self.message)
        if self.reason is not None:
            info = error_details_pb2.ErrorInfo(
                reason=self.reason, domain=ERROR_DOMAIN, metadata=self.metadata
            )
            status.details.add().Pack(info)
        if self.retry_after is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(round(self.retry_after * 1e9))
            status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        return status

    def __str__(self) -> str:
        reason = f" ({self.reason})" if self.reason else ""
        return f"{self.code.name}: {self.message}{reason}"

    def __repr__(self) -> str:
        return f"ReachError({self.code.name}, {self.message!r}, reason={self.reason!r})"

    # === to and from the wire ===

    @classmethod
    def from_status(cls, code: grpc.StatusCode, message: str, details: bytes) -> ReachError:
        """The error a status carries: ``code``, ``message`` and ``details``, the encoded
        ``google.rpc.Status`` of ``grpc-status-details-bin`` (empty when there is none).
        Undecodable details are ignored (the code and message still tell what failed)."""
        error = cls(code, message)
        if not details:
            return error
        status = status_pb2.Status()
        try:
            status.ParseFromString(details)
        except Exception:  # a peer's garbage must not hide the status itself
            return error
        error.status = status
        for detail in status.details:
            _read_detail(error, detail)
        return error

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> ReachError:
        """The error a failed grpcio call raised (``grpc.aio.AioRpcError``), with the details
        of its ``grpc-status-details-bin`` trailer."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        message = error.details() if hasattr(error, "details") else str(error)
        details = b""
        trailing: Any = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
        for key, value in trailing or ():
            if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
                details = value
        return cls.from_status(code or grpc.StatusCode.UNKNOWN, message or "", details)

    @classmethod
    def from_call_error(cls, error: mux_pb2.CallError) -> ReachError:
        """The error of a failed multiplexed call (``CallError``: code, message and the
        encoded ``google.rpc.Status``)."""
        return cls.from_status(code_of(error.code), error.message, error.details)

    def details_bytes(self) -> bytes:
        """The encoded ``google.rpc.Status`` (what ``grpc-status-details-bin`` and
        ``CallError.details`` carry); empty when there are no details to send."""
        return self.status.SerializeToString() if self.status.details else b""

    def to_call_error(self) -> mux_pb2.CallError:
        """This error as a multiplexed call's ``CallError``."""
        return mux_pb2.CallError(
            code=self.code.value[0], message=self.message, details=self.details_bytes()
        )

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        """The trailers that carry this error's details on a unary or streaming RPC."""
        details = self.details_bytes()
        return ((STATUS_DETAILS_KEY, details),) if details else ()


def _read_detail(error: ReachError, detail: any_pb2.Any) -> None:
    if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
        info = error_details_pb2.ErrorInfo()
        detail.Unpack(info)
        if info.domain == ERROR_DOMAIN or error.reason is None:
            error.reason = info.reason
            error.metadata = dict(info.metadata)
    elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
        info_retry = error_details_pb2.RetryInfo()
        detail.Unpack(info_retry)
        error.retry_after = info_retry.retry_delay.ToNanoseconds() / 1e9
