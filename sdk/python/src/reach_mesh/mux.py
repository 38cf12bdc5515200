"""The caller's side of a multiplexed call stream (``RouterService.CallMux``): many concurrent
calls over one long-lived gRPC stream, each a ``CallFrame`` out and a ``ReplyFrame`` back,
matched by ``call_id`` — ``reach_rpc::mux::MuxLink`` in Python.

:class:`MuxLink` opens the stream on first use (within the call's timeout, and at most
:data:`OPEN_TIMEOUT` seconds), sends a call's first frame only once the router has answered the
stream's headers, matches replies (which arrive in completion order) to waiting calls, sends a
cancel frame for a call whose caller gave up (deadline or cancellation) and keeps its id
reserved until the router acknowledges it, fails every waiting call with UNAVAILABLE when the
stream breaks, and opens a new stream for the next call. A
router that answers the stream with UNIMPLEMENTED makes :meth:`MuxLink.call` raise
:class:`Unsupported` for a minute, so the caller sends unary ``Call`` s meanwhile. A call whose
frame cannot be built or sent fails alone; the stream and the other calls go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any, Final

import grpc

from reach.v1 import envelope_pb2, mux_pb2, router_service_pb2
from reach_mesh import _grpc
from reach_mesh.errors import STATUS_DETAILS_KEY, ReachError, Reason

__all__ = ["OPEN_TIMEOUT", "UNSUPPORTED_RETRY_AFTER", "MuxLink", "Unsupported"]

#: How long a link remembers that the router does not serve the stream before trying again,
#: in seconds (a router may be upgraded in place).
UNSUPPORTED_RETRY_AFTER: Final = 60.0
#: The longest opening the stream may take, in seconds: until the router answers its headers.
#: A router that never does fails the calls waiting for it with UNAVAILABLE, even calls
#: without a timeout.
OPEN_TIMEOUT: Final = 10.0
#: Frames queued towards the router before a new call waits for room.
_OUTBOUND_QUEUE: Final = 1024


class Unsupported(Exception):
    """The router does not serve ``CallMux``: send the call as a unary ``Call``. Nothing was
    sent."""


class _Session:
    """One open CallMux stream."""

    def __init__(self, peer: str, rpc: Any) -> None:
        self.peer = peer
        #: The CallMux RPC (a ``grpc.aio.StreamStreamCall``).
        self.rpc = rpc
        self.next_call_id = 1
        self.waiting: dict[int, asyncio.Future[router_service_pb2.CallMuxResponse]] = {}
        #: Cancelled calls whose acknowledgement has not arrived: their ids stay reserved.
        self.cancelled: set[int] = set()
        #: Why the stream ended; no call may wait on it any more.
        self.broken: ReachError | None = None
        self.outbound: asyncio.Queue[router_service_pb2.CallMuxRequest] = asyncio.Queue(_OUTBOUND_QUEUE)
        self.writer = asyncio.ensure_future(self._write())
        self.reader = asyncio.ensure_future(self._read())

    @property
    def live(self) -> bool:
        return self.broken is None

    async def _write(self) -> None:
        """Sends the queued frames in order until the stream ends. A frame that cannot be
        serialized fails its own call, never the writer."""
        try:
            while True:
                request = await self.outbound.get()
                try:
                    await self.rpc.write(request)
                except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                    raise
                except Exception as error:  # the request serializer's: nothing was sent
                    self._unsent(request.frame.call_id, error)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as error:
            # The stream ended; the reader reports why and fails the waiting calls.
            self._end(ReachError(grpc.StatusCode.UNAVAILABLE, f"cannot send on the stream: {error}"))

    def _unsent(self, call_id: int, error: Exception) -> None:
        """Fails the call ``call_id``, whose frame could not be sent (``error``)."""
        waiter = self.waiting.pop(call_id, None)
        self.cancelled.discard(call_id)
        if waiter is not None and not waiter.done():
            waiter.set_exception(_unencodable(error))

    async def _read(self) -> None:
        ended: ReachError
        try:
            while True:
                response = await self.rpc.read()
                if response is grpc.aio.EOF:
                    code = await self.rpc.code()
                    if code == grpc.StatusCode.OK:
                        ended = ReachError(grpc.StatusCode.UNAVAILABLE, "the callee ended the stream")
                    else:
                        ended = ReachError.from_status(
                            code, await self.rpc.details() or "", _details(await self.rpc.trailing_metadata())
                        )
                    break
                call_id = response.frame.call_id
                waiter = self.waiting.pop(call_id, None)
                if waiter is None:
                    # The call was cancelled: this is its acknowledgement (or its answer), and
                    # its id is free now.
                    self.cancelled.discard(call_id)
                elif not waiter.done():
                    waiter.set_result(response)
        except grpc.aio.AioRpcError as error:
            ended = ReachError.from_rpc_error(error)
        except asyncio.CancelledError:
            ended = ReachError(grpc.StatusCode.UNAVAILABLE, "the client closed the stream")
        self._end(ended)

    def _end(self, ended: ReachError) -> None:
        if self.broken is not None:
            return
        self.broken = ended
        self.cancelled.clear()
        waiting, self.waiting = self.waiting, {}
        drained = ended.reason == Reason.INSTANCE_DRAINING
        for waiter in waiting.values():
            if waiter.done():
                continue
            if drained:
                # The router answered every call it read before it ended the stream.
                waiter.set_exception(ended)
            else:
                waiter.set_exception(
                    ReachError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"the connection broke while the call was in flight ({ended.code.name}: the "
                        f"stream to {self.peer} ended: {ended.message}); the message may or may not "
                        "have been handled: retry with the same message_id to be safe",
                    )
                )
        self.writer.cancel()

    async def call(
        self, message: envelope_pb2.ReachMessage, timeout: float | None, metadata: Mapping[str, str]
    ) -> router_service_pb2.CallMuxResponse:
        if self.broken is not None:
            raise ReachError(
                grpc.StatusCode.UNAVAILABLE,
                f"the stream to {self.peer} had ended ({self.broken.message}); nothing was delivered",
            )
        call_id = self.next_call_id
        self.next_call_id += 1
        try:
            request = router_service_pb2.CallMuxRequest(
                frame=mux_pb2.CallFrame(
                    call_id=call_id,
                    message=message,
                    timeout_ms=0 if timeout is None else _grpc.timeout_ms(timeout),
                    metadata=metadata,
                )
            )
        except Exception as error:  # protobuf refuses to copy the message (DecodeError: too deep)
            raise _unencodable(error) from None
        reply: asyncio.Future[router_service_pb2.CallMuxResponse] = asyncio.get_running_loop().create_future()
        self.waiting[call_id] = reply
        try:
            await self.outbound.put(request)
        except asyncio.CancelledError:
            # Never sent: nothing to cancel.
            self.waiting.pop(call_id, None)
            raise
        try:
            return await reply
        except asyncio.CancelledError:
            if self.waiting.pop(call_id, None) is not None and self.broken is None:
                # The id stays reserved until the router acknowledges the cancel.
                self.cancelled.add(call_id)
                cancel = router_service_pb2.CallMuxRequest(frame=mux_pb2.CallFrame(call_id=call_id, cancel=True))
                try:
                    self.outbound.put_nowait(cancel)
                except asyncio.QueueFull:
                    asyncio.ensure_future(self.outbound.put(cancel))
            raise

    async def close(self) -> None:
        self.rpc.cancel()
        self.reader.cancel()
        self.writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(self.reader, self.writer, return_exceptions=True)


def _unencodable(error: Exception) -> ReachError:
    """INVALID_ARGUMENT / ``INVALID_PAYLOAD`` for a call whose frame protobuf could not build
    or serialize (``error``); nothing was sent."""
    return ReachError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the message cannot be encoded as a call frame ({type(error).__name__}: {error}); nothing was "
        "sent: is its data nested too deep?",
        Reason.INVALID_PAYLOAD,
    )


def _details(trailing: Any) -> bytes:
    """The encoded ``google.rpc.Status`` in a call's trailers (empty when there is none)."""
    for key, value in trailing or ():
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            return value
    return b""


class MuxLink:
    """The multiplexed CallMux stream of one client to its router (see the module docs).

    ``open_stream`` starts the RPC (``RouterServiceStub.CallMux``); ``peer`` names the router
    in error messages; ``open_timeout`` bounds opening the stream, in seconds.
    """

    def __init__(self, open_stream: Any, peer: str, open_timeout: float = OPEN_TIMEOUT) -> None:
        self._open_stream = open_stream
        self._peer = peer
        self._open_timeout = open_timeout
        self._session: _Session | None = None
        #: The stream being opened, shared by every call waiting for it; a caller that gives
        #: up does not stop it for the others.
        self._opening: asyncio.Task[_Session] | None = None
        self._unsupported_since: float | None = None
        #: How many streams this link opened (1 while the first lives; more after breaks).
        self.streams_opened = 0

    def is_unsupported(self) -> bool:
        """Whether the router is known not to serve CallMux (calls go unary meanwhile)."""
        if self._unsupported_since is None:
            return False
        if time.monotonic() - self._unsupported_since >= UNSUPPORTED_RETRY_AFTER:
            self._unsupported_since = None
            return False
        return True

    async def call(
        self, message: envelope_pb2.ReachMessage, timeout: float | None, metadata: Mapping[str, str]
    ) -> router_service_pb2.CallMuxResponse:
        """Sends one call and waits for its reply frame. ``timeout`` (seconds; ``None``: none)
        covers opening the stream too; cancelling the wait (or ``timeout`` passing) once the
        frame went sends a cancel frame.

        Raises:
            Unsupported: the router does not serve CallMux (nothing was sent).
            ReachError: the stream could not be opened, or the router did not answer its
                headers within :data:`OPEN_TIMEOUT` (UNAVAILABLE; nothing was delivered);
                DEADLINE_EXCEEDED when ``timeout`` passed first; INVALID_ARGUMENT /
                ``INVALID_PAYLOAD`` when the message cannot be encoded as a frame (nothing was
                sent); UNAVAILABLE when the stream broke while the call was in flight (it may
                have been handled), or with ``INSTANCE_DRAINING`` when the router closed the
                stream without reading it.
        """
        if self.is_unsupported():
            raise Unsupported()
        if timeout is None:
            session = await self._live_session()
            return await session.call(message, None, metadata)
        deadline = time.monotonic() + timeout
        try:
            session = await asyncio.wait_for(self._live_session(), timeout)
        except asyncio.TimeoutError:
            raise ReachError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the multiplexed stream to {self._peer} did not open within the call's timeout of "
                f"{timeout:g}s; nothing was delivered",
                Reason.DEADLINE_EXCEEDED,
            ) from None
        remaining = max(0.0, deadline - time.monotonic())
        try:
            return await asyncio.wait_for(session.call(message, remaining, metadata), remaining)
        except asyncio.TimeoutError:
            raise ReachError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no reply within the call's timeout of {timeout:g}s",
                Reason.DEADLINE_EXCEEDED,
            ) from None

    async def _live_session(self) -> _Session:
        """The open stream; opens one (or joins the opening under way) when there is none.

        Raises:
            Unsupported, ReachError: as :meth:`_open`.
        """
        session = self._session
        if session is not None and session.live:
            return session
        if self.is_unsupported():
            raise Unsupported()
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
            self._opening.add_done_callback(self._opened)
        # Shielded: a caller that gives up (its timeout, a cancellation) leaves the opening to
        # the others; it is bounded by the open timeout anyway.
        return await asyncio.shield(self._opening)

    def _opened(self, opening: asyncio.Task[_Session]) -> None:
        """Forgets a finished opening, so the next call opens again if it failed."""
        if self._opening is opening:
            self._opening = None
        if not opening.cancelled():
            opening.exception()  # retrieved: every caller may have given up on it

    async def _open(self) -> _Session:
        """Opens a stream and waits until the router answers its headers (or ends it).

        Raises:
            Unsupported: the router answered UNIMPLEMENTED.
            ReachError: the router refused the stream (its status), or did not answer within
                the open timeout (UNAVAILABLE); nothing was delivered either way.
        """
        call = self._open_stream()
        # The first frame goes once the router answered the stream's headers (or ended it).
        try:
            await asyncio.wait_for(call.initial_metadata(), self._open_timeout)
        except asyncio.TimeoutError:
            call.cancel()
            raise ReachError(
                grpc.StatusCode.UNAVAILABLE,
                f"{self._peer} did not answer the multiplexed stream (CallMux) within "
                f"{self._open_timeout:g}s; nothing was delivered: check that the endpoint is a "
                "reachable Reach router",
            ) from None
        except grpc.aio.AioRpcError as error:
            raise self._refused(ReachError.from_rpc_error(error)) from None
        if call.done():
            code = await call.code()
            refusal = ReachError.from_status(code, await call.details() or "", _details(await call.trailing_metadata()))
            raise self._refused(refusal)
        self.streams_opened += 1
        self._session = _Session(self._peer, call)
        return self._session

    def _refused(self, error: ReachError) -> Exception:
        if error.code == grpc.StatusCode.UNIMPLEMENTED:
            self._unsupported_since = time.monotonic()
            return Unsupported()
        return ReachError(
            error.code,
            f"cannot open the multiplexed stream to {self._peer}: {error.message}; nothing was delivered",
            error.reason,
            error.metadata,
            error.retry_after,
        )

    async def close(self) -> None:
        """Ends the stream; calls still waiting fail with UNAVAILABLE."""
        if self._session is not None:
            await self._session.close()
            self._session = None
