"""The mesh client: :class:`MeshClient` calls, streams and publishes through the router,
addressing capabilities or services, and starts and follows orchestrator tasks — on the wire
as the Rust SDK's ``reach_sdk::MeshClient``.

Calls go over one multiplexed ``RouterService.CallMux`` stream per client (opened on first
use, reopened after it breaks; see :mod:`reach_mesh.mux`), so a call costs one frame each way
instead of a new HTTP/2 stream; a router that does not serve CallMux gets unary ``Call`` s, and
so does a message larger than :data:`MUX_MAX_MESSAGE_BYTES` (the router refuses it alone).
Data nesting deeper than :data:`~reach_mesh.parts.MAX_DATA_DEPTH` is refused before anything is
sent.
Each new message gets a fresh UUIDv7 ``message_id`` and, unless the options continue a trace,
a fresh W3C trace id; each call carries a W3C ``traceparent`` naming a fresh client span of
that trace (in the frame's metadata, or as gRPC metadata on a unary call).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Union

import grpc

from reach.v1 import (
    envelope_pb2,
    orchestrator_service_pb2 as orchestrator_pb2,
    orchestrator_service_pb2_grpc as orchestrator_grpc,
    router_service_pb2,
    router_service_pb2_grpc,
)
from reach_mesh import _grpc
from reach_mesh.context import HandlerContext
from reach_mesh.errors import ReachError, Reason
from reach_mesh.ids import TRACEPARENT, is_trace_id, new_message_id, new_trace_id, traceparent
from reach_mesh.message import Message, Reply
from reach_mesh.mux import MuxLink, Unsupported
from reach_mesh.parts import MAX_DATA_DEPTH, Part, Payload, to_value, too_deep_part
from reach_mesh.tasks import ENDED, Task, TaskEvent, TaskStatus
from reach_mesh.trust import TlsConfig

__all__ = ["MUX_MAX_MESSAGE_BYTES", "CallOptions", "MeshClient", "PublishFailure", "PublishResult"]

#: The largest message the client sends or accepts, in bytes; the router enforces its own,
#: usually smaller, limit with PAYLOAD_TOO_LARGE.
MAX_MESSAGE_BYTES: Final = 64 << 20
#: The largest message (encoded, in bytes) sent as a CallMux frame: the router's default
#: ``max_message_bytes``. A larger one goes as a unary ``Call``: as a frame above the router's
#: transport limit it would end the stream every concurrent call of this client shares,
#: where a unary Call is refused (PAYLOAD_TOO_LARGE) alone.
MUX_MAX_MESSAGE_BYTES: Final = 4 << 20
#: The most calls waiting on the CallMux stream at once; more go as unary Calls meanwhile.
#: The stream's bookkeeping (frames, futures, one writer and one reader coroutine) runs in
#: Python, where grpcio's unary path runs in its C core: the stream is the faster path for a
#: few concurrent calls, unary Calls for many (docs/benchmarks.md measures both).
MUX_MAX_OUTSTANDING: Final = 8

#: What a call sends: a payload, one part, or a list of parts.
Content = Union[Payload, Part, Sequence[Part]]


@dataclass(frozen=True)
class CallOptions:
    """Options of one call (``reach_sdk::CallOptions``).

    Attributes:
        timeout: the deadline in seconds, enforced by the client, the router and the agent;
            ``None``: none.
        trace_id: the trace to continue; ``None`` starts a new trace (a new task's first
            message).
        task_id: the task the message belongs to.
        capability_version: a semver requirement on the capability version (``^1.2``).
        message_id: the message id; ``None`` assigns a fresh UUIDv7. Set it so that resending
            the same logical message is deduplicated by the agent.
        turn: the message's ``header.turn`` (agent hops so far); ``None`` sends 0.
    """

    timeout: float | None = None
    trace_id: str | None = None
    task_id: str | None = None
    capability_version: str | None = None
    message_id: str | None = None
    turn: int | None = None

    @classmethod
    def within(cls, ctx: HandlerContext) -> CallOptions:
        """Options for a call a handler makes on behalf of the message ``ctx`` describes: the
        same trace and task, ``turn`` one more, and a timeout of what is left of ``ctx``'s
        deadline (none when it has none). Change other fields with ``dataclasses.replace``."""
        return cls(
            timeout=ctx.time_remaining(),
            trace_id=ctx.trace_id or None,
            task_id=ctx.task_id or None,
            turn=min(ctx.turn + 1, 2**32 - 1),
        )


@dataclass(frozen=True)
class PublishFailure:
    """A subscriber that did not take a published message: its ``instance_id`` and the gRPC
    ``code`` name and ``message`` it answered."""

    instance_id: str
    code: str
    message: str


@dataclass(frozen=True)
class PublishResult:
    """How a publish went: subscribers that took the message (``delivered``), that failed
    (``failed``, with ``failures``), and the message id it carried."""

    delivered: int
    failed: int
    failures: tuple[PublishFailure, ...]
    message_id: str


class MeshClient:
    """A client of the mesh: every call goes through a router, addressed by capability or
    service; tasks go to the orchestrator. Create it inside the event loop that uses it, and
    close it (or use ``async with``)::

        async with MeshClient("http://127.0.0.1:7070", source="billing.main") as mesh:
            reply = await mesh.call("complaint.classify", data_part({"complaint_id": "1", "narrative": "..."}))
            print(reply.data["category"], reply.instance_id)

    Args:
        endpoint: the router (``http://127.0.0.1:7070``, the ``reach dev`` port).
        source: the sending service, dotted, stamped on every message (``ingest.main``).
        orchestrator_endpoint: the orchestrator for the task methods; default ``endpoint``
            (``reach dev`` serves both on one port).
        multiplex: ``False`` sends every call as a unary ``Call`` (what generated clients do),
            for comparison or for proxies that do not carry long-lived streams.
        tls: for a mesh serving TLS: the CA to trust and, optionally, a certificate to
            present (:class:`reach_mesh.TlsConfig`; ``cert``/``key`` may stay ``None`` where
            the mesh allows callers without one). Used for every endpoint, whatever its
            scheme. ``None``: plaintext (or, for ``https://``, TLS with the system's roots).
        token: a bearer token (``reach token operator``, an identity provider's JWT) sent as
            ``authorization: Bearer <token>`` on every call; the router verifies it and
            names the caller to agents. It needs TLS, or a loopback endpoint.

    Raises:
        ValueError: an endpoint or the TLS settings are malformed.
    """

    def __init__(
        self,
        endpoint: str = "http://127.0.0.1:7070",
        source: str = "python.client",
        *,
        orchestrator_endpoint: str | None = None,
        multiplex: bool = True,
        tls: TlsConfig | None = None,
        token: str | None = None,
    ) -> None:
        self.source = source
        if tls is not None:
            tls.validate("tls")
        options = _grpc.size_options(MAX_MESSAGE_BYTES + _grpc.FRAME_OVERHEAD_BYTES)
        self._channel = _grpc.channel(endpoint, options, tls=tls, token=token)
        self._router = router_service_pb2_grpc.RouterServiceStub(self._channel)
        self._link = MuxLink(self._router.CallMux, "the router") if multiplex else None
        #: Calls on the CallMux stream now (at most MUX_MAX_OUTSTANDING; more go unary).
        self._mux_calls = 0
        if orchestrator_endpoint is None or orchestrator_endpoint == endpoint:
            self._orchestrator_channel: grpc.aio.Channel | None = None
            self._orchestrator = orchestrator_grpc.OrchestratorServiceStub(self._channel)
        else:
            self._orchestrator_channel = _grpc.channel(orchestrator_endpoint, tls=tls, token=token)
            self._orchestrator = orchestrator_grpc.OrchestratorServiceStub(self._orchestrator_channel)

    async def __aenter__(self) -> MeshClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the multiplexed stream and the channels; calls still waiting fail."""
        if self._link is not None:
            await self._link.close()
        await self._channel.close()
        if self._orchestrator_channel is not None:
            await self._orchestrator_channel.close()

    @property
    def mux_streams_opened(self) -> int:
        """How many CallMux streams this client opened: 1 while the first lives, more after
        reconnects, 0 while calls go unary. For diagnostics and tests."""
        return 0 if self._link is None else self._link.streams_opened

    # === messages ===

    def message_to_capability(
        self, capability: str, content: Content, options: CallOptions | None = None
    ) -> envelope_pb2.ReachMessage:
        """A message to ``capability`` carrying ``content``, with a fresh message id and,
        unless ``options`` continue a trace, a fresh trace id.

        Raises:
            PartError: ``content`` is not a payload, part or list of parts, or holds data
                that is not JSON.
        """
        header = self._header(options or CallOptions())
        header.capability = capability
        return envelope_pb2.ReachMessage(header=header, payload=Payload.of(content).to_proto())

    def message_to_service(
        self, service: str, content: Content, options: CallOptions | None = None
    ) -> envelope_pb2.ReachMessage:
        """A message to any instance of ``service`` carrying ``content`` (see
        :meth:`message_to_capability`)."""
        header = self._header(options or CallOptions())
        header.service = service
        return envelope_pb2.ReachMessage(header=header, payload=Payload.of(content).to_proto())

    def _header(self, options: CallOptions) -> envelope_pb2.Header:
        return envelope_pb2.Header(
            message_id=options.message_id or new_message_id(),
            trace_id=options.trace_id or new_trace_id(),
            task_id=options.task_id or "",
            source=self.source,
            capability_version=options.capability_version or "",
            protocol_version="1.0",
            created_at=_grpc.now(),
            turn=options.turn or 0,
        )

    # === calls ===

    async def call(self, capability: str, content: Content, options: CallOptions | None = None) -> Reply:
        """Calls ``capability`` with ``content`` and returns the reply and where it was
        handled.

        Raises:
            ReachError: the router's or the agent's status: ``NOT_FOUND`` /
                ``ROUTE_NOT_FOUND``, ``UNAVAILABLE`` / ``OVERLOADED``, ``DEADLINE_EXCEEDED``,
                the handler's own error, ... (branch on ``.reason``).
            PartError: ``content`` holds data that is not JSON, or nests deeper than
                :data:`~reach_mesh.parts.MAX_DATA_DEPTH` (:class:`~reach_mesh.DataTooDeep`);
                nothing was sent.
        """
        options = options or CallOptions()
        # The content was checked (depth included) while the message was built.
        return await self._deliver(self.message_to_capability(capability, content, options), options.timeout)

    async def call_service(self, service: str, content: Content, options: CallOptions | None = None) -> Reply:
        """Calls any instance of ``service`` (see :meth:`call`)."""
        options = options or CallOptions()
        return await self._deliver(self.message_to_service(service, content, options), options.timeout)

    async def send(self, message: envelope_pb2.ReachMessage, timeout: float | None = None) -> Reply:
        """Sends a prepared message through the router: over CallMux, or as a unary Call to a
        router that does not serve it or when the message is larger than
        :data:`MUX_MAX_MESSAGE_BYTES`.

        Raises:
            ReachError: as :meth:`call`; INVALID_ARGUMENT / ``INVALID_PAYLOAD`` (metadata
                ``depth``, ``limit``), without sending, when a data part nests deeper than
                :data:`~reach_mesh.parts.MAX_DATA_DEPTH`; DEADLINE_EXCEEDED when ``timeout``
                (seconds) passes first; UNAVAILABLE when the connection to the router broke
                while the call was in flight (it may have been handled: resend with the same
                ``message_id``).
        """
        too_deep = too_deep_part(message.payload)
        if too_deep is not None:
            part, depth = too_deep
            raise ReachError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"payload.parts[{part}] nests {depth} levels deep, over the limit of {MAX_DATA_DEPTH}; "
                "flatten the data (each object or list is one level)",
                Reason.INVALID_PAYLOAD,
                {"depth": str(depth), "limit": str(MAX_DATA_DEPTH)},
            )
        return await self._deliver(message, timeout)

    async def _deliver(self, message: envelope_pb2.ReachMessage, timeout: float | None) -> Reply:
        """Sends ``message``, whose data is within the depth limit (see :meth:`send`)."""
        metadata = {}
        if is_trace_id(message.header.trace_id):
            metadata[TRACEPARENT] = traceparent(message.header.trace_id)
        link = self._link
        if (
            link is not None
            and not link.is_unsupported()
            and self._mux_calls < MUX_MAX_OUTSTANDING
            and message.ByteSize() <= MUX_MAX_MESSAGE_BYTES
        ):
            self._mux_calls += 1
            try:
                response = await link.call(message, timeout, metadata)
            except Unsupported:
                response = None  # not served: the call goes as a unary Call
            finally:
                self._mux_calls -= 1
            if response is not None:
                frame = response.frame
                if frame.WhichOneof("result") == "reply":
                    return Reply.of(frame.reply, response.route)
                if frame.WhichOneof("result") == "error":
                    raise ReachError.from_call_error(frame.error)
                raise ReachError(
                    grpc.StatusCode.INTERNAL, "the router sent a reply frame with neither a reply nor an error"
                )
        try:
            unary = await self._router.Call(
                router_service_pb2.CallRequest(message=message),
                timeout=timeout,
                metadata=tuple(metadata.items()),
            )
        except grpc.aio.AioRpcError as error:
            raise ReachError.from_rpc_error(error) from None
        return Reply.of(unary.message, unary.route)

    async def publish(self, topic: str, content: Content, options: CallOptions | None = None) -> PublishResult:
        """Publishes ``content`` to every routable subscriber of ``topic``.

        Raises:
            ReachError: the router's status (for example INVALID_ARGUMENT for an empty topic).
        """
        options = options or CallOptions()
        header = self._header(options)
        header.topic = topic
        message = envelope_pb2.ReachMessage(header=header, payload=Payload.of(content).to_proto())
        try:
            response = await self._router.Publish(
                router_service_pb2.PublishRequest(message=message), timeout=options.timeout
            )
        except grpc.aio.AioRpcError as error:
            raise ReachError.from_rpc_error(error) from None
        return PublishResult(
            delivered=response.delivered,
            failed=response.failed,
            failures=tuple(PublishFailure(f.instance_id, f.code, f.message) for f in response.failures),
            message_id=response.message_id,
        )

    async def reply(self, ctx: HandlerContext, content: Content) -> bool:
        """Sends the asynchronous answer to the request ``ctx`` describes (a handler that
        returned :meth:`HandlerContext.ack`); any router replica takes it. Returns whether a
        caller was still waiting.

        Raises:
            ReachError: INVALID_ARGUMENT when the request asked for no asynchronous reply; the
                router's status otherwise.
        """
        if not ctx.reply_to:
            raise ReachError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the request carried no reply_to; return the answer from the handler instead",
            )
        message = envelope_pb2.ReachMessage(
            header=envelope_pb2.Header(
                message_id=new_message_id(),
                trace_id=ctx.trace_id,
                task_id=ctx.task_id,
                source=self.source,
                correlation_id=ctx.message_id,
                protocol_version="1.0",
                created_at=_grpc.now(),
            ),
            payload=Payload.of(content).to_proto(),
        )
        try:
            response = await self._router.Reply(
                router_service_pb2.ReplyRequest(message=message, reply_to=ctx.reply_to)
            )
        except grpc.aio.AioRpcError as error:
            raise ReachError.from_rpc_error(error) from None
        return bool(response.delivered)

    async def stream(
        self,
        first: envelope_pb2.ReachMessage,
        rest: AsyncIterable[envelope_pb2.ReachMessage] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[Message]:
        """Opens a stream through the router: ``first`` picks the instance, ``rest`` follows
        it there; yields the instance's messages until it closes the stream. Leaving the
        iteration early cancels the stream.

        Raises:
            ReachError: the status that ended the stream (after the messages before it).
        """

        async def outbound() -> AsyncIterator[router_service_pb2.StreamRequest]:
            yield router_service_pb2.StreamRequest(message=first)
            if rest is not None:
                async for message in rest:
                    yield router_service_pb2.StreamRequest(message=message)

        metadata = (
            ((TRACEPARENT, traceparent(first.header.trace_id)),) if is_trace_id(first.header.trace_id) else ()
        )
        call = self._router.Stream(outbound(), timeout=timeout, metadata=metadata)
        try:
            async for response in call:
                yield Message(response.message)
        except grpc.aio.AioRpcError as error:
            raise ReachError.from_rpc_error(error) from None
        finally:
            call.cancel()

    # === tasks (the orchestrator) ===

    async def start_task(
        self,
        flow_id: str,
        input: Any = None,
        *,
        task_id: str = "",
        flow_version: int = 0,
        timeout: float | None = None,
    ) -> Task:
        """Starts a task of ``flow_id`` (its latest version unless ``flow_version``) with the
        JSON ``input`` (default ``{}``). Starting an existing ``task_id`` again returns that
        task, so retrying is safe.

        Raises:
            ReachError: ``FLOW_NOT_FOUND``, ``INVALID_TASK_ID``, ``TASK_ID_IN_USE``, ...
            PartError: ``input`` is not JSON.
        """
        request = orchestrator_pb2.StartTaskRequest(
            flow_id=flow_id,
            flow_version=flow_version,
            input=to_value({} if input is None else input),
            task_id=task_id,
        )
        response = await self._orchestrate(self._orchestrator.StartTask, request, timeout)
        return Task.from_proto(response.task)

    async def get_task(self, task_id: str, *, timeout: float | None = None) -> Task:
        """The task with its node history.

        Raises:
            ReachError: ``TASK_NOT_FOUND``.
        """
        request = orchestrator_pb2.GetTaskRequest(task_id=task_id)
        response = await self._orchestrate(self._orchestrator.GetTask, request, timeout)
        return Task.from_proto(response.task)

    async def resume_task(
        self, task_id: str, input: Any, *, node_id: str = "", timeout: float | None = None
    ) -> Task:
        """Gives a person's JSON ``input`` to a task waiting in a ``human`` node (``node_id``,
        or the node it waits in).

        Raises:
            ReachError: ``TASK_NOT_WAITING``, ``NODE_NOT_WAITING``, ``INVALID_INPUT`` (the input
                does not match the node's schema), ``TASK_NOT_FOUND``.
        """
        request = orchestrator_pb2.ResumeTaskRequest(task_id=task_id, node_id=node_id, input=to_value(input))
        response = await self._orchestrate(self._orchestrator.ResumeTask, request, timeout)
        return Task.from_proto(response.task)

    async def cancel_task(self, task_id: str, reason: str = "", *, timeout: float | None = None) -> Task:
        """Cancels an unfinished task.

        Raises:
            ReachError: ``TASK_ENDED``, ``TASK_NOT_FOUND``.
        """
        request = orchestrator_pb2.CancelTaskRequest(task_id=task_id, reason=reason)
        response = await self._orchestrate(self._orchestrator.CancelTask, request, timeout)
        return Task.from_proto(response.task)

    async def apply_flow(self, yaml: str, source: str = "api", *, timeout: float | None = None) -> bool:
        """Validates the flow ``yaml`` and makes it the latest version of its id; returns
        ``False`` when the same version with the same text was applied already.

        Raises:
            ReachError: ``INVALID_FLOW`` (with a ``file:line:column`` per problem in the
                message), ``FLOW_VERSION_CONFLICT``.
        """
        request = orchestrator_pb2.ApplyFlowRequest(yaml=yaml, source=source)
        response = await self._orchestrate(self._orchestrator.ApplyFlow, request, timeout)
        return bool(response.changed)

    async def watch_task(self, task_id: str, after_sequence: int = 0) -> AsyncIterator[TaskEvent]:
        """The task's events: those recorded after ``after_sequence``, then new ones as they
        happen; ends after the event that ends the task.

        Raises:
            ReachError: ``TASK_NOT_FOUND``.
        """
        call = self._orchestrator.WatchTask(
            orchestrator_pb2.WatchTaskRequest(task_id=task_id, after_sequence=after_sequence)
        )
        try:
            async for response in call:
                yield TaskEvent.from_proto(response.event)
        except grpc.aio.AioRpcError as error:
            raise ReachError.from_rpc_error(error) from None
        finally:
            call.cancel()

    async def wait_task(
        self,
        task_id: str,
        *,
        until: frozenset[TaskStatus] = ENDED | {TaskStatus.WAITING_HUMAN},
        timeout: float,
    ) -> Task:
        """Waits until the task's status is one of ``until`` (default: ended, or waiting for
        a person), or until it ended, and returns it with its node history.

        Raises:
            ReachError: DEADLINE_EXCEEDED when ``timeout`` seconds pass first (the message says
                where the task was); ``TASK_NOT_FOUND``.
        """

        async def watch() -> None:
            async for event in self.watch_task(task_id):
                if event.status in until:
                    return

        task = await self.get_task(task_id, timeout=timeout)
        if task.status in until:
            return task
        try:
            await asyncio.wait_for(watch(), timeout)
        except asyncio.TimeoutError:
            task = await self.get_task(task_id)
            raise ReachError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"task {task_id} is still {task.status.value} at {task.current_node or 'no node'} "
                f"after {timeout:g}s; waited for {', '.join(sorted(s.value for s in until))}",
            ) from None
        return await self.get_task(task_id, timeout=timeout)

    async def _orchestrate(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as error:
            raise ReachError.from_rpc_error(error) from None
