"""What must fail alone, and how: an undecodable HandleMux frame ends its stream with
INVALID_ARGUMENT / ``INVALID_FRAME`` after the calls read are answered; a reply that cannot be
sent fails its call with INTERNAL while the stream goes on; data at ``MAX_DATA_DEPTH`` goes
everywhere and deeper data nowhere; an oversized call goes unary and fails alone; opening the
CallMux stream is bounded; registry calls time out after 5 s; a nested call's delivery reason is
not forwarded as the handler's own. Real ``reach dev`` processes, or in-process fakes where the
point is a peer that misbehaves."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from conftest import ReachProcess
from reach.v1 import (
    agent_service_pb2,
    agent_service_pb2_grpc,
    envelope_pb2,
    mux_pb2,
    registry_service_pb2,
    registry_service_pb2_grpc,
    router_service_pb2,
    router_service_pb2_grpc,
)
from reach_mesh import (
    MAX_DATA_DEPTH,
    MUX_MAX_MESSAGE_BYTES,
    AgentConfig,
    AgentRuntime,
    CallOptions,
    DataTooDeep,
    HandlerContext,
    MeshClient,
    Message,
    Part,
    ReachError,
    Reason,
    RunningAgent,
    data_part,
    raw_part,
    text_part,
)
from reach_mesh.errors import STATUS_DETAILS_KEY
from reach_mesh.mux import MuxLink

#: The longest any one step of these tests may take, in seconds.
STEP = 10.0


def nested_objects(depth: int) -> Any:
    """``{"a": {"a": ... 1}}``, ``depth`` objects deep."""
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def nested_lists(depth: int) -> Any:
    """``[[... 1]]``, ``depth`` lists deep."""
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def deep_message(objects: int, lists: int = 0) -> envelope_pb2.ReachMessage:
    """A message to ``bounds.echo`` whose data part nests ``objects`` objects, then ``lists``
    lists, around a number: built field by field, as protobuf itself would refuse to copy it."""
    message = envelope_pb2.ReachMessage()
    message.header.capability = "bounds.echo"
    value = message.payload.parts.add().data
    for _ in range(objects):
        value = value.struct_value.fields["a"]
    for _ in range(lists):
        value = value.list_value.values.add()
    value.number_value = 1
    return message


def reason_of(trailing: Any) -> str | None:
    """The ErrorInfo reason in a call's trailers."""
    for key, value in trailing or ():
        if key == STATUS_DETAILS_KEY:
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info.reason
    return None


class _LogEvent(logging.Handler):
    """Sets :attr:`seen` when the SDK logs a record whose message contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


@pytest.fixture
def decode_failures() -> Iterator[_LogEvent]:
    """Set once the agent logged that a HandleMux frame could not be decoded."""
    watcher = _LogEvent("could not be decoded")
    logger = logging.getLogger("reach_mesh")
    logger.addHandler(watcher)
    yield watcher
    logger.removeHandler(watcher)


async def bounds_agent(dev: ReachProcess) -> tuple[RunningAgent, dict[str, Any]]:
    """An agent serving ``bounds.echo``, which replies by the request's ``shape``:

    - ``hold``: waits for ``state["release"]``, then echoes;
    - ``deep``: ``data_part`` of 40 nested objects (refused inside the handler);
    - ``bypass``: a data :class:`Part` of 40 nested lists, built without ``data_part``;
    - ``nested``: calls a capability nobody serves and lets its ROUTE_NOT_FOUND escape;
    - ``overloaded``: raises OVERLOADED itself;
    - anything else: echoes the request's data.

    Its stream handler yields one echo, then the 40-deep ``bypass`` part.
    """
    state: dict[str, Any] = {"runs": 0, "release": asyncio.Event(), "started": asyncio.Event()}
    runtime = AgentRuntime(
        AgentConfig(service="bounds", registry_endpoint=dev.endpoint, instance_id="bounds-1", lease_ttl=1.0)
    )

    @runtime.handler("bounds.echo", "1.0.0")
    async def echo(ctx: HandlerContext, message: Message) -> Any:
        state["runs"] += 1
        data = message.data if isinstance(message.data, dict) else {}
        shape = data.get("shape")
        if shape == "hold":
            state["started"].set()
            await state["release"].wait()
        elif shape == "deep":
            return data_part(nested_objects(40))
        elif shape == "bypass":
            return Part("data", nested_lists(40))
        elif shape == "nested":
            async with MeshClient(dev.endpoint, "bounds.inner") as inner:
                await inner.call("nobody.serves.this", data_part({}), CallOptions.within(ctx))
        elif shape == "overloaded":
            raise ReachError(grpc.StatusCode.UNAVAILABLE, "too busy", Reason.OVERLOADED)
        return [part for part in message.parts]

    @runtime.stream_handler("bounds.echo")
    async def stream(ctx: HandlerContext, first: Message, rest: AsyncIterator[Message]) -> AsyncIterator[Any]:
        yield text_part("one")
        yield Part("data", nested_lists(40))

    agent = await runtime.start()
    await dev.wait_ready("bounds")
    return agent, state


def mux_frame(call_id: int, data: Any, timeout_ms: int = 10_000) -> bytes:
    """A HandleMuxRequest starting call ``call_id`` to ``bounds.echo`` with ``data``, encoded."""
    message = envelope_pb2.ReachMessage(payload=envelope_pb2.Payload(parts=[data_part(data).to_proto()]))
    message.header.capability = "bounds.echo"
    message.header.message_id = f"0190a000-0000-7000-8000-{call_id:012d}"
    return agent_service_pb2.HandleMuxRequest(
        frame=mux_pb2.CallFrame(call_id=call_id, message=message, timeout_ms=timeout_ms)
    ).SerializeToString()


def raw_handle_mux(channel: grpc.aio.Channel) -> Any:
    """A HandleMux call that sends frames as given bytes."""
    return channel.stream_stream(
        "/reach.v1.AgentService/HandleMux",
        request_serializer=lambda frame: frame,
        response_deserializer=agent_service_pb2.HandleMuxResponse.FromString,
    )()


def too_deep_frame(call_id: int) -> bytes:
    """A HandleMuxRequest whose data nests one object past what protobuf decodes in a frame."""
    request = agent_service_pb2.HandleMuxRequest(frame=mux_pb2.CallFrame(call_id=call_id))
    request.frame.message.CopyFrom(deep_message(MAX_DATA_DEPTH + 1))
    return request.SerializeToString()


@pytest.mark.parametrize(
    "bad_frame, why",
    [(b"\xff\xff\xff", "Wire format was corrupt"), (too_deep_frame(2), "MaxDepth")],
    ids=["garbage", "too-deep"],
)
async def test_an_undecodable_frame_ends_the_stream_invalid_frame_once_the_calls_read_are_answered(
    dev: ReachProcess, decode_failures: _LogEvent, bad_frame: bytes, why: str
) -> None:
    agent, state = await bounds_agent(dev)
    try:
        async with grpc.aio.insecure_channel(agent.endpoint.removeprefix("http://")) as channel:
            stream = raw_handle_mux(channel)
            await stream.write(mux_frame(1, {"shape": "hold"}))
            await asyncio.wait_for(state["started"].wait(), STEP)
            # Call 1 is running when the bad frame arrives; call 3 comes after it.
            await stream.write(bad_frame)
            await stream.write(mux_frame(3, {"shape": "echo"}))
            await asyncio.wait_for(decode_failures.seen.wait(), STEP)
            state["release"].set()

            first = await asyncio.wait_for(stream.read(), STEP)
            assert first.frame.call_id == 1 and first.frame.WhichOneof("result") == "reply"
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(stream.read(), STEP)
            assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = ended.value.details() or ""
            assert "could not be decoded" in details and why in details, details
            assert "calls without a reply were not handled" in details
            assert reason_of(ended.value.trailing_metadata()) == Reason.INVALID_FRAME
        assert state["runs"] == 1, "no frame after the undecodable one was read"
    finally:
        await agent.drain()


async def test_an_undecodable_stream_message_ends_that_stream_invalid_argument(dev: ReachProcess) -> None:
    agent, _ = await bounds_agent(dev)
    try:
        async with grpc.aio.insecure_channel(agent.endpoint.removeprefix("http://")) as channel:
            stream = channel.stream_stream(
                "/reach.v1.AgentService/HandleStream",
                request_serializer=lambda frame: frame,
                response_deserializer=agent_service_pb2.HandleStreamResponse.FromString,
            )()
            await stream.write(b"\xff\xff\xff")
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(stream.read(), STEP)
            assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "could not be decoded" in (ended.value.details() or "")
    finally:
        await agent.drain()


async def test_a_reply_that_cannot_be_sent_fails_its_call_internal_and_the_stream_goes_on(dev: ReachProcess) -> None:
    agent, _ = await bounds_agent(dev)
    try:
        async with grpc.aio.insecure_channel(agent.endpoint.removeprefix("http://")) as channel:
            stream = raw_handle_mux(channel)
            await stream.write(mux_frame(1, {"shape": "deep"}))
            await stream.write(mux_frame(2, {"shape": "bypass"}))
            await stream.write(mux_frame(3, {"shape": "echo", "n": 3}))
            answers = {}
            for _ in range(3):
                response = await asyncio.wait_for(stream.read(), STEP)
                answers[response.frame.call_id] = response.frame
            for call_id in (1, 2):
                error = ReachError.from_call_error(answers[call_id].error)
                assert error.code == grpc.StatusCode.INTERNAL, error
                assert f"the handler's reply nests 40 levels deep, over the limit of {MAX_DATA_DEPTH}" in error.message
            assert answers[3].WhichOneof("result") == "reply"
            await stream.done_writing()
            assert await asyncio.wait_for(stream.read(), STEP) is grpc.aio.EOF
            assert await stream.code() == grpc.StatusCode.OK

            # The unary Handle and HandleStream fail the same way.
            stub = agent_service_pb2_grpc.AgentServiceStub(channel)
            message = envelope_pb2.ReachMessage(payload=envelope_pb2.Payload(parts=[data_part({"shape": "deep"}).to_proto()]))
            message.header.capability = "bounds.echo"
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await stub.Handle(agent_service_pb2.HandleRequest(message=message), timeout=STEP)
            assert unary.value.code() == grpc.StatusCode.INTERNAL
            assert "nests 40 levels deep" in (unary.value.details() or "")

            async def one() -> AsyncIterator[agent_service_pb2.HandleStreamRequest]:
                yield agent_service_pb2.HandleStreamRequest(message=message)

            replies = []
            with pytest.raises(grpc.aio.AioRpcError) as streamed:
                async for reply in stub.HandleStream(one(), timeout=STEP):
                    replies.append(reply.message.payload.parts[0].text)
            assert replies == ["one"]
            assert streamed.value.code() == grpc.StatusCode.INTERNAL
            assert "nests 40 levels deep" in (streamed.value.details() or "")
    finally:
        await agent.drain()


async def test_every_multiplexed_call_is_answered_even_when_handling_it_fails_unexpectedly(
    dev: ReachProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent, _ = await bounds_agent(dev)
    core = agent._core
    handle = core.handle

    async def failing(message: envelope_pb2.ReachMessage, *args: Any) -> envelope_pb2.ReachMessage:
        if Message(message).data.get("shape") == "unencodable":
            # What protobuf raised copying a too-deep reply into its frame.
            raise DecodeError("Error parsing message with type 'reach.v1.ReachMessage'")
        return await handle(message, *args)

    monkeypatch.setattr(core, "handle", failing)
    try:
        async with grpc.aio.insecure_channel(agent.endpoint.removeprefix("http://")) as channel:
            stream = raw_handle_mux(channel)
            await stream.write(mux_frame(1, {"shape": "unencodable"}))
            response = await asyncio.wait_for(stream.read(), STEP)
            error = ReachError.from_call_error(response.frame.error)
            assert response.frame.call_id == 1 and error.code == grpc.StatusCode.INTERNAL, error
            assert "DecodeError" in error.message
            await stream.write(mux_frame(2, {"shape": "echo"}))
            response = await asyncio.wait_for(stream.read(), STEP)
            assert response.frame.call_id == 2 and response.frame.WhichOneof("result") == "reply"
            assert agent.in_flight == 0
    finally:
        await agent.drain()


async def test_data_at_the_depth_limit_goes_through_callmux_and_handlemux_and_deeper_data_is_refused(
    dev: ReachProcess,
) -> None:
    agent, state = await bounds_agent(dev)
    try:
        async with MeshClient(dev.endpoint, "pytest.bounds") as mesh:
            # The deepest data allowed, as objects (the costliest nesting for protobuf), both
            # ways through the router over the multiplexed streams.
            deepest = {"shape": "echo", "data": nested_objects(MAX_DATA_DEPTH - 1)}
            reply = await mesh.call("bounds.echo", data_part(deepest), CallOptions(timeout=STEP))
            assert reply.data == deepest
            assert mesh.mux_streams_opened == 1

            with pytest.raises(DataTooDeep) as refused:
                data_part({"shape": "echo", "data": nested_objects(MAX_DATA_DEPTH)})
            assert (refused.value.depth, refused.value.limit) == (MAX_DATA_DEPTH + 1, MAX_DATA_DEPTH)

            runs = state["runs"]
            with pytest.raises(ReachError) as invalid:
                await mesh.send(deep_message(MAX_DATA_DEPTH + 1), timeout=STEP)
            assert invalid.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert invalid.value.reason == Reason.INVALID_PAYLOAD
            assert invalid.value.metadata == {"depth": str(MAX_DATA_DEPTH + 1), "limit": str(MAX_DATA_DEPTH)}
            assert state["runs"] == runs, "nothing was sent"

            again = await mesh.call("bounds.echo", data_part({"n": 1}), CallOptions(timeout=STEP))
            assert again.data == {"n": 1} and mesh.mux_streams_opened == 1
    finally:
        await agent.drain()


async def test_a_call_whose_frame_cannot_be_built_fails_alone_and_the_link_goes_on(dev: ReachProcess) -> None:
    agent, _ = await bounds_agent(dev)
    try:
        async with grpc.aio.insecure_channel(dev.address) as channel:
            link = MuxLink(router_service_pb2_grpc.RouterServiceStub(channel).CallMux, "the router")
            # Deep enough that protobuf copies the message but not the frame around it.
            with pytest.raises(ReachError) as unencodable:
                await asyncio.wait_for(link.call(deep_message(1, 47), STEP, {}), STEP)
            assert unencodable.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert unencodable.value.reason == Reason.INVALID_PAYLOAD
            ok = envelope_pb2.ReachMessage(payload=envelope_pb2.Payload(parts=[data_part({"n": 2}).to_proto()]))
            ok.header.capability = "bounds.echo"
            response = await asyncio.wait_for(link.call(ok, STEP, {}), STEP)
            assert response.frame.WhichOneof("result") == "reply"
            await link.close()
    finally:
        await agent.drain()


async def test_an_oversized_call_goes_unary_and_fails_alone_while_concurrent_calls_go_on(dev: ReachProcess) -> None:
    agent, state = await bounds_agent(dev)
    try:
        async with MeshClient(dev.endpoint, "pytest.large") as mesh:
            held = asyncio.ensure_future(
                mesh.call("bounds.echo", data_part({"shape": "hold"}), CallOptions(timeout=STEP))
            )
            await asyncio.wait_for(state["started"].wait(), STEP)
            # Over the router's limit (4 MiB), and over its transport limit for a frame.
            for size in (MUX_MAX_MESSAGE_BYTES + 1024, 9 << 20):
                with pytest.raises(ReachError) as large:
                    await mesh.call("bounds.echo", raw_part(b"x" * size), CallOptions(timeout=STEP))
                assert large.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, large.value
            state["release"].set()
            reply = await asyncio.wait_for(held, STEP)
            assert reply.data == {"shape": "hold"}
            assert mesh.mux_streams_opened == 1, "the shared stream never broke"
    finally:
        await agent.drain()


class _SilentRouter(router_service_pb2_grpc.RouterServiceServicer):
    """A router that takes CallMux streams and never answers their headers."""

    async def CallMux(self, request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await asyncio.Event().wait()
        yield router_service_pb2.CallMuxResponse()  # never reached: makes this a stream


@pytest.fixture
async def silent_router() -> AsyncIterator[str]:
    """The address of a :class:`_SilentRouter` on a free 127.0.0.1 port."""
    server = grpc.aio.server()
    router_service_pb2_grpc.add_RouterServiceServicer_to_server(_SilentRouter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def test_a_call_timeout_covers_opening_the_stream_and_opening_is_bounded(silent_router: str) -> None:
    async with MeshClient(f"http://{silent_router}", "pytest.silent") as mesh:
        started = time.monotonic()
        # Two calls at once: neither waits behind the other's opening.
        results = await asyncio.wait_for(
            asyncio.gather(
                *(mesh.call("any.thing", text_part("hi"), CallOptions(timeout=0.3)) for _ in range(2)),
                return_exceptions=True,
            ),
            STEP,
        )
        assert time.monotonic() - started < 3
        for result in results:
            assert isinstance(result, ReachError) and result.code == grpc.StatusCode.DEADLINE_EXCEEDED, result
            assert "did not open" in result.message and "nothing was delivered" in result.message

    async with grpc.aio.insecure_channel(silent_router) as channel:
        link = MuxLink(router_service_pb2_grpc.RouterServiceStub(channel).CallMux, "the router", open_timeout=0.3)
        # Without a timeout the call still ends, once opening gives up.
        with pytest.raises(ReachError) as unanswered:
            await asyncio.wait_for(link.call(envelope_pb2.ReachMessage(), None, {}), STEP)
        assert unanswered.value.code == grpc.StatusCode.UNAVAILABLE
        assert "did not answer the multiplexed stream" in unanswered.value.message
        await link.close()


class _RecordingRegistry(registry_service_pb2_grpc.RegistryServiceServicer):
    """A registry that refuses every registration UNAVAILABLE, noting each call's deadline."""

    def __init__(self) -> None:
        self.remaining: list[float] = []
        self.called = asyncio.Event()

    async def Register(
        self, request: registry_service_pb2.RegisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> registry_service_pb2.RegisterResponse:
        remaining = context.time_remaining()
        self.remaining.append(float("inf") if remaining is None else remaining)
        self.called.set()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "not now")
        raise AssertionError("unreachable: abort raises")


async def test_registry_calls_time_out_after_five_seconds() -> None:
    registry = _RecordingRegistry()
    server = grpc.aio.server()
    registry_service_pb2_grpc.add_RegistryServiceServicer_to_server(registry, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    runtime = AgentRuntime(AgentConfig(service="timed", registry_endpoint=f"http://127.0.0.1:{port}"))
    runtime.handler("timed.echo")(lambda ctx, message: text_part("x"))
    agent = await runtime.start()
    try:
        await asyncio.wait_for(registry.called.wait(), STEP)
        # 5 s as the server sees it: a little more or less, never the 10 s it was.
        assert 4.0 < registry.remaining[0] < 5.5, registry.remaining
    finally:
        await agent.drain()
        await server.stop(0)


async def test_a_nested_calls_delivery_reason_is_not_the_handlers_own_outcome(dev: ReachProcess) -> None:
    agent, state = await bounds_agent(dev)
    try:
        async with MeshClient(dev.endpoint, "pytest.nested") as mesh:
            for shape in ("nested", "overloaded"):
                with pytest.raises(ReachError) as failed:
                    await mesh.call("bounds.echo", data_part({"shape": shape}), CallOptions(timeout=STEP))
                assert failed.value.code == grpc.StatusCode.FAILED_PRECONDITION, failed.value
                assert failed.value.reason is None
                assert failed.value.message.startswith("a call this handler made failed: ")
            # Each ran once: the router took neither answer for "not delivered".
            assert state["runs"] == 2
    finally:
        await agent.drain()
