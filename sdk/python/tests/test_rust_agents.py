"""A Python MeshClient calls a Rust agent (the example coordinator of ``reach dev``), over
CallMux and over the unary fallback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from conftest import ReachProcess, load_example
from reach.v1 import router_service_pb2, router_service_pb2_grpc
from reach_mesh import CallOptions, MeshClient, ReachError, Reason, data_part

COMPLAINT = {"complaint_id": "7", "narrative": "Equifax shows a derogatory tradeline on my credit report"}


@pytest.fixture
async def dev_with_agents(processes: Callable[..., ReachProcess], workdir: Path) -> ReachProcess:
    """``reach dev`` with its example agents (Rust, through the Rust SDK)."""
    process = processes("dev", "--listen", "127.0.0.1:0", "--admin-listen", "", "--edge-listen", "", "--data-dir", str(workdir / "data"))
    await process.wait_serving()
    await process.wait_ready("coordinator", timeout=15)
    return process


class CallOnlyRouter:
    """A router as an older release (or a proxy) serves it: ``reach.v1.RouterService/Call``
    only, forwarded to the real router with its status and details; any other method, CallMux
    included, is unknown to this server, which answers UNIMPLEMENTED."""

    def __init__(self, upstream: router_service_pb2_grpc.RouterServiceStub) -> None:
        self.upstream = upstream
        self.calls = 0

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "reach.v1.RouterService",
            {
                "Call": grpc.unary_unary_rpc_method_handler(
                    self.call,
                    request_deserializer=router_service_pb2.CallRequest.FromString,
                    response_serializer=router_service_pb2.CallResponse.SerializeToString,
                )
            },
        )

    async def call(
        self, request: router_service_pb2.CallRequest, context: grpc.aio.ServicerContext
    ) -> router_service_pb2.CallResponse:
        self.calls += 1
        metadata = tuple((k, v) for k, v in context.invocation_metadata() if k == "traceparent")
        try:
            return await self.upstream.Call(request, timeout=context.time_remaining(), metadata=metadata)
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "", tuple(error.trailing_metadata() or ()))
            raise


@pytest.fixture
async def call_only_router(dev_with_agents: ReachProcess) -> AsyncIterator[tuple[str, CallOnlyRouter]]:
    upstream = grpc.aio.insecure_channel(dev_with_agents.address)
    router = CallOnlyRouter(router_service_pb2_grpc.RouterServiceStub(upstream))
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((router.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"http://127.0.0.1:{port}", router
    await server.stop(0)
    await upstream.close()


async def test_a_python_client_calls_a_rust_agent_over_call_mux(dev_with_agents: ReachProcess) -> None:
    async with MeshClient(dev_with_agents.endpoint, "pytest.rust") as mesh:
        for _ in range(3):
            reply = await mesh.call("complaint.classify", data_part(COMPLAINT), CallOptions(timeout=10))
            assert reply.data["category"] == "credit_report"
            assert 0 < reply.data["confidence"] <= 1
            assert reply.instance_id == "coordinator-1" and reply.service == "coordinator"
            assert reply.message.trace_id == reply.trace_id
        assert mesh.mux_streams_opened == 1, "every call on one CallMux stream"
        with pytest.raises(ReachError) as missing:
            await mesh.call("complaint.nothing", data_part({}), CallOptions(timeout=5))
        assert missing.value.reason == Reason.ROUTE_NOT_FOUND
        assert missing.value.metadata["capability"] == "complaint.nothing"


async def test_a_python_client_falls_back_to_unary_calls_when_the_router_has_no_call_mux(
    call_only_router: tuple[str, CallOnlyRouter],
) -> None:
    endpoint, router = call_only_router
    async with MeshClient(endpoint, "pytest.fallback") as mesh:
        for _ in range(3):
            reply = await mesh.call("complaint.classify", data_part(COMPLAINT), CallOptions(timeout=10))
            assert reply.data["category"] == "credit_report"
            assert reply.instance_id == "coordinator-1"
        assert mesh.mux_streams_opened == 0
        assert router.calls == 3
        # Errors keep their reasons on the unary path too.
        with pytest.raises(ReachError) as missing:
            await mesh.call("complaint.nothing", data_part({}), CallOptions(timeout=5))
        assert missing.value.reason == Reason.ROUTE_NOT_FOUND and missing.value.code == grpc.StatusCode.NOT_FOUND


async def test_the_python_example_executor_answers_as_the_rust_executor_does(dev_with_agents: ReachProcess) -> None:
    executor = load_example()
    complaint = {
        "complaint_id": "31",
        "narrative": "MOHELA reported me delinquent; I paid {$1,250.00} and $64000 is wrong",
        "company": "None",
        "state": "NY",
    }
    async with MeshClient(dev_with_agents.endpoint, "pytest.twin") as mesh:
        for category in executor.CATEGORIES:
            reply = await mesh.call(
                f"complaint.{category}", data_part({"complaint": complaint}), CallOptions(timeout=10)
            )
            assert reply.instance_id.startswith(f"executor.{category}-"), reply.instance_id
            assert reply.message.type == "complaint.suggestion"
            assert reply.data == executor.suggest(category, complaint, reply.instance_id)
