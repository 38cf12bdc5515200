"""Python agents in a real mesh (``reach dev --no-agents``): registration with descriptors, a
flow's task node, a Rust client (``reach call``), multiplexed calls, the concurrency bound,
dedupe and streams."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import ReachProcess, eventually, load_example
from reach.v1 import agent_service_pb2, agent_service_pb2_grpc, registry_service_pb2
from reach_mesh.client import MUX_MAX_OUTSTANDING
from reach_mesh import (
    AgentConfig,
    AgentRuntime,
    CallOptions,
    HandlerContext,
    MeshClient,
    Message,
    ReachError,
    Reason,
    RegistrationRefused,
    RunningAgent,
    TaskStatus,
    data_part,
    text_part,
)


executor = load_example()

COMPLAINT = {
    "complaint_id": "c-17",
    "narrative": "Nelnet misapplied my autopay of {$412.50} and charged a late fee; my credit score dropped.",
    "company": "",
    "state": "TX",
}


async def start_executor(dev: ReachProcess, instance_id: str = "py-servicing-1") -> RunningAgent:
    agent = await executor.build("servicing", dev.endpoint, instance_id).start()
    await dev.wait_ready("executor.servicing")
    return agent


async def test_a_python_agent_registers_its_capability_with_description_and_schemas(dev: ReachProcess) -> None:
    agent = await start_executor(dev)
    try:
        listed = await dev.cli("capabilities", "--prefix", "complaint.", "--json")
        assert listed.returncode == 0, listed.stderr
        (capability,) = [c for c in json.loads(listed.stdout) if c["name"] == "complaint.servicing"]
        assert capability["description"] == "suggest a resolution for a servicing complaint (Python executor)"
        assert capability["input_schema"] == executor.COMPLAINT_SCHEMA
        assert capability["output_schema"] == executor.SUGGESTION_SCHEMA
        assert capability["versions"] == ["1.0.0"]
        assert capability["routable_instances"] == 1
    finally:
        await agent.drain()


async def test_a_registration_the_registry_refuses_ends_run_with_its_reason(dev: ReachProcess) -> None:
    runtime = AgentRuntime(AgentConfig(service="bad.schema", registry_endpoint=dev.endpoint))

    # A schema the registry cannot compile ("type" must be a string or a list): retrying
    # cannot help, so run() drains and raises instead of retrying forever.
    @runtime.handler("bad.schema.echo", "1.0.0", input_schema={"type": 12})
    async def echo(ctx: HandlerContext, message: Message) -> Any:
        return text_part("never")

    with pytest.raises(RegistrationRefused) as refused:
        await asyncio.wait_for(runtime.run(), timeout=10)
    assert refused.value.error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "input_schema" in str(refused.value), refused.value


async def test_a_flow_task_node_calls_the_python_agent(dev: ReachProcess, workdir: Path) -> None:
    agent = await start_executor(dev)
    flow = workdir / "py-flow.yaml"
    flow.write_text(
        "id: py-servicing\n"
        "version: 1\n"
        "initial: handle\n"
        "states:\n"
        "  handle:\n"
        "    type: task\n"
        "    capability: complaint.servicing\n"
        '    input: {complaint: "input", classification: "{\'category\': \'servicing\'}"}\n'
        "    timeout: 10s\n"
        "    next: done\n"
        "  done: {type: succeed}\n"
    )
    try:
        applied = await dev.cli("flow", "apply", str(flow))
        assert applied.returncode == 0, applied.stderr
        started = await dev.cli("task", "start", "--flow", "py-servicing", "--input", json.dumps(COMPLAINT), "--json")
        assert started.returncode == 0, started.stderr
        task_id = json.loads(started.stdout)["task_id"]
        async with MeshClient(dev.endpoint) as mesh:
            task = await mesh.wait_task(task_id, timeout=20)
        assert task.status is TaskStatus.SUCCEEDED, task.error
        expected = executor.suggest("servicing", COMPLAINT, "py-servicing-1")
        assert task.output == expected
        node = task.node("handle")
        assert node is not None and node.output == expected and node.input["complaint"] == COMPLAINT
        assert expected["priority"] == "high" and expected["fields"]["company"] == "Nelnet, Inc."
        assert expected["fields"]["amounts_usd"] == [412.5]
    finally:
        await agent.drain()


async def test_a_rust_mesh_client_calls_the_python_agent(dev: ReachProcess) -> None:
    agent = await start_executor(dev)
    try:
        called = await dev.cli("call", "complaint.servicing", "--json", json.dumps(COMPLAINT), "--timeout-ms", "5000")
        assert called.returncode == 0, called.stderr
        reply = json.loads(called.stdout)
        assert reply["instance_id"] == "py-servicing-1"
        assert re.fullmatch(r"[0-9a-f]{32}", reply["trace_id"])
        assert reply["parts"] == [
            {"data": executor.suggest("servicing", COMPLAINT, "py-servicing-1"), "media_type": "application/json"}
        ]

        refused = await dev.cli("call", "complaint.servicing", "--text", "not a complaint")
        assert refused.returncode != 0
        assert "complaint_id and narrative" in refused.stderr, refused.stderr
    finally:
        await agent.drain()


async def echo_agent(
    dev: ReachProcess, service: str, *, max_concurrency: int = 8, lease_ttl: float = 10.0
) -> tuple[AgentRuntime, dict[str, Any]]:
    """A runtime whose ``<service>.echo`` handler sleeps ``delay_ms`` (from the data part),
    waits for ``state["release"]`` when the data says ``block``, and echoes its data."""
    state: dict[str, Any] = {"calls": 0, "release": asyncio.Event(), "ids": []}
    runtime = AgentRuntime(
        AgentConfig(
            service=service,
            registry_endpoint=dev.endpoint,
            instance_id=f"{service}-1",
            max_concurrency=max_concurrency,
            lease_ttl=lease_ttl,
        )
    )

    @runtime.handler(f"{service}.echo", "1.0.0")
    async def echo(ctx: HandlerContext, message: Message) -> Any:
        state["calls"] += 1
        state["ids"].append(ctx.message_id)
        data = message.data
        if data.get("block"):
            await state["release"].wait()
        await asyncio.sleep(data.get("delay_ms", 0) / 1000)
        return data_part({"echo": data, "traceparent": ctx.traceparent, "trace_id": ctx.trace_id})

    @runtime.stream_handler(f"{service}.echo")
    async def count(ctx: HandlerContext, first: Message, rest: AsyncIterator[Message]) -> AsyncIterator[Any]:
        seen = 1
        yield text_part(f"{seen}: {first.text}")
        async for message in rest:
            seen += 1
            yield text_part(f"{seen}: {message.text}")

    return runtime, state


async def test_the_mux_client_matches_out_of_order_replies(dev: ReachProcess) -> None:
    runtime, _ = await echo_agent(dev, "sleeper", max_concurrency=32)
    agent = await runtime.start()
    await dev.wait_ready("sleeper")
    try:
        async with MeshClient(dev.endpoint, "pytest.mux") as mesh:
            completed: list[int] = []

            async def call(index: int) -> None:
                # The first calls sleep longest: replies come back in the reverse order.
                reply = await mesh.call("sleeper.echo", data_part({"i": index, "delay_ms": (16 - index) * 15}))
                assert reply.data["echo"]["i"] == index
                assert reply.message.correlation_id == reply.message_id
                # The traceparent the call carried names the message's own trace.
                assert reply.data["traceparent"].split("-")[1] == reply.trace_id == reply.data["trace_id"]
                completed.append(index)

            await asyncio.gather(*(call(i) for i in range(16)))
            assert sorted(completed) == list(range(16))
            assert completed != list(range(16)), "replies came back in completion order"
            assert completed[:4] != [0, 1, 2, 3]
            assert mesh.mux_streams_opened == 1

            # Streams go through the router frame by frame (HandleStream).
            first = mesh.message_to_capability("sleeper.echo", text_part("a"))

            async def more() -> AsyncIterator[Any]:
                for text in ("b", "c"):
                    yield mesh.message_to_capability("sleeper.echo", text_part(text))

            replies = [m.text async for m in mesh.stream(first, more(), timeout=10)]
            assert replies == ["1: a", "2: b", "3: c"]
    finally:
        await agent.drain()


async def test_calls_beyond_the_streams_share_go_unary_meanwhile(dev: ReachProcess) -> None:
    runtime, state = await echo_agent(dev, "wide", max_concurrency=32)
    agent = await runtime.start()
    await dev.wait_ready("wide")
    try:
        async with MeshClient(dev.endpoint, "pytest.wide") as mesh:
            total = MUX_MAX_OUTSTANDING + 4
            held = [
                asyncio.ensure_future(mesh.call("wide.echo", data_part({"block": True, "n": n}), CallOptions(timeout=20)))
                for n in range(total)
            ]
            await eventually(lambda: state["calls"] == total, f"{total} handlers running")
            # The stream carries its share; the rest went as unary Calls, and all run at once.
            assert mesh._mux_calls == MUX_MAX_OUTSTANDING
            state["release"].set()
            replies = await asyncio.gather(*held)
            assert sorted(r.data["echo"]["n"] for r in replies) == list(range(total))
            assert mesh.mux_streams_opened == 1
    finally:
        await agent.drain()


async def test_the_ninth_concurrent_call_is_refused_while_eight_run(dev: ReachProcess) -> None:
    # max_concurrency 8 (the default); a short lease so heartbeats report the load quickly.
    runtime, state = await echo_agent(dev, "full", lease_ttl=0.3)
    agent = await runtime.start()
    await dev.wait_ready("full")
    try:
        async with MeshClient(dev.endpoint, "pytest.full") as mesh:
            eight = [
                asyncio.ensure_future(mesh.call("full.echo", data_part({"block": True, "n": n}), CallOptions(timeout=20)))
                for n in range(8)
            ]
            await eventually(lambda: state["calls"] == 8, "eight handlers running")
            # The heartbeat reports the load: BUSY with 8 in flight.
            busy = await eventually(
                lambda: _state_of(dev, "full"), "the instance reported BUSY with 8 in flight"
            )
            assert busy.in_flight == 8
            # The router sends an instance at most its max_concurrency calls: the ninth waits
            # for room (admission.max_wait, 300 ms here), then is shed, undelivered.
            with pytest.raises(ReachError) as refused:
                await mesh.call("full.echo", data_part({"n": 9}), CallOptions(timeout=5))
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            assert refused.value.reason == Reason.OVERLOADED
            assert refused.value.retry_after is not None and refused.value.retry_after > 0
            assert state["calls"] == 8

            # Straight to the agent (no router), the ninth waits for a slot, and when its
            # caller gives up first it is dropped unhandled.
            async with grpc.aio.insecure_channel(agent.endpoint.removeprefix("http://")) as channel:
                stub = agent_service_pb2_grpc.AgentServiceStub(channel)
                ninth = mesh.message_to_capability("full.echo", data_part({"n": 9}))
                with pytest.raises(grpc.aio.AioRpcError) as expired:
                    await stub.Handle(agent_service_pb2.HandleRequest(message=ninth), timeout=0.3)
                assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            state["release"].set()
            replies = await asyncio.gather(*eight)
            assert sorted(r.data["echo"]["n"] for r in replies) == list(range(8))
            assert state["calls"] == 8, "the ninth never ran"
            again = await mesh.call("full.echo", data_part({"n": 10}), CallOptions(timeout=5))
            assert again.data["echo"]["n"] == 10
    finally:
        await agent.drain()


async def _state_of(dev: ReachProcess, service: str) -> registry_service_pb2.Instance | None:
    (instance,) = await dev.instances(service)
    return instance if instance.state == registry_service_pb2.INSTANCE_STATE_BUSY else None


async def test_a_redelivered_message_id_gets_the_first_reply_without_running_again(dev: ReachProcess) -> None:
    runtime, state = await echo_agent(dev, "once")
    agent = await runtime.start()
    await dev.wait_ready("once")
    try:
        async with MeshClient(dev.endpoint, "pytest.once") as mesh:
            options = CallOptions(message_id="0190a000-0000-7000-8000-000000000001", timeout=5)
            # Concurrent duplicates wait for the first; later ones get its remembered reply.
            first, second = await asyncio.gather(
                mesh.call("once.echo", data_part({"delay_ms": 100}), options),
                mesh.call("once.echo", data_part({"delay_ms": 100}), options),
            )
            third = await mesh.call("once.echo", data_part({"other": "payload"}), options)
            assert state["calls"] == 1
            assert first.message.message_id == second.message.message_id == third.message.message_id
            assert third.data["echo"] == {"delay_ms": 100}, "the first delivery's reply"
            fresh = await mesh.call("once.echo", data_part({"x": 1}), CallOptions(timeout=5))
            assert fresh.data["echo"] == {"x": 1} and state["calls"] == 2
    finally:
        await agent.drain()


async def test_a_failing_handler_answers_a_generic_message_with_an_error_id_it_logs(
    dev: ReachProcess, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = AgentRuntime(AgentConfig(service="fails.py", registry_endpoint=dev.endpoint))

    @runtime.handler("fails.py.unary", "1.0.0")
    async def unary(ctx: HandlerContext, message: Message) -> Any:
        raise ValueError("db password hunter2 rejected")

    @runtime.stream_handler("fails.py.stream", "1.0.0")
    async def stream(ctx: HandlerContext, first: Message, rest: AsyncIterator[Message]) -> AsyncIterator[Any]:
        yield text_part("one")
        raise KeyError("internal table t_secret")

    agent = await runtime.start()
    try:
        await dev.wait_ready("fails.py")
        async with MeshClient(dev.endpoint) as client:
            with pytest.raises(ReachError) as failed:
                await client.call("fails.py.unary", text_part(""), CallOptions(timeout=10))
            first = client.message_to_capability("fails.py.stream", text_part(""))
            replies: list[str] = []
            with pytest.raises(ReachError) as stream_failed:
                async for reply in client.stream(first, timeout=10):
                    replies.append(reply.text)
            assert replies == ["one"]
        for error, detail in ((failed.value, "hunter2"), (stream_failed.value, "t_secret")):
            assert error.code == grpc.StatusCode.INTERNAL, error
            match = re.fullmatch(r"handler failed; error id ([0-9a-f-]{36}); see the agent's log", error.message)
            assert match is not None, error.message
            assert detail not in error.message
            # The agent's log has the detail under the same id.
            logged = [r for r in caplog.records if match.group(1) in r.getMessage()]
            assert logged, "the error id is logged"
            assert any(detail in str(r.exc_info[1]) for r in logged if r.exc_info), logged
    finally:
        await agent.drain()
