"""Trust (issue 17) against the real binary over TLS on 127.0.0.1, with certificates and tokens
made by ``reach certs init`` and ``reach token``: an agent serving TLS registers with its
certificate and, called through the router by a TLS client presenting an operator's bearer
token, sees the caller the router verified; a peer that is not the router calling the agent
directly is refused (only routers may, and the registry may check its health); a plaintext
client is refused on the TLS port; an agent with a join token registers."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import ReachProcess, eventually, reach_bin
from reach.v1 import agent_service_pb2, agent_service_pb2_grpc, envelope_pb2
from reach_mesh import (
    AgentConfig,
    AgentRuntime,
    CallOptions,
    HandlerContext,
    MeshClient,
    Message,
    Payload,
    ReachError,
    Reason,
    TlsConfig,
    text_part,
)
from reach_mesh.ids import new_message_id, new_trace_id

TD = "reach.test"
AGENT = "echo-py"
JOINER = "joiner-py"


def reach(*args: str) -> str:
    """Runs a ``reach`` command to completion; its stdout, stripped."""
    done = subprocess.run([str(reach_bin()), *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.fail(f"reach {' '.join(args)} failed ({done.returncode}): {done.stderr}", pytrace=False)
    return done.stdout.strip()


@pytest.fixture
def pki(workdir: Path) -> Path:
    """Certificates of a ``reach.test`` mesh: ``reach certs init`` (CA, router, registry,
    orchestrator, agent ``echo-py``, operator ``admin``, token signing keys)."""
    directory = workdir / "certs"
    reach(
        "certs", "init", "--dir", str(directory), "--trust-domain", TD, "--agents", AGENT, "--operators", "admin"
    )
    return directory


def operator_token(pki: Path, name: str) -> str:
    return reach(
        "token", "operator", "--key", str(pki / "jwt-key.pem"), "--name", name, "--ttl", "1h", "--trust-domain", TD
    )


def join_token(pki: Path, service: str) -> str:
    return reach(
        "token", "join", "--key", str(pki / "jwt-key.pem"), "--service", service, "--ttl", "1h", "--trust-domain", TD
    )


def identity_tls(pki: Path, name: str) -> TlsConfig:
    """The TLS settings of certificate ``name`` (``agent-echo-py``, ``operator-admin``)."""
    return TlsConfig(ca=pki / "ca.pem", cert=pki / f"{name}.pem", key=pki / f"{name}-key.pem")


@pytest.fixture
async def mesh(processes: Callable[..., ReachProcess], workdir: Path, pki: Path) -> ReachProcess:
    """``reach dev --no-agents`` serving TLS with the router's certificate; callers without
    a certificate may present a bearer token (``client_auth = "optional"``)."""
    config = workdir / "reach.toml"
    config.write_text(
        f"""
[registry]
default_lease_ttl = "2s"
[trust]
trust_domain = "{TD}"

[trust.tls]
cert = "{pki / 'router.pem'}"
key = "{pki / 'router-key.pem'}"
ca = "{pki / 'ca.pem'}"
client_auth = "optional"

[trust.jwt]
keys = ["{pki / 'jwt-public.pem'}"]
"""
    )
    process = processes(
        "dev",
        "--config",
        str(config),
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "",
        "--edge-listen",
        "",
        "--no-agents",
        "--data-dir",
        str(workdir / "data"),
        tls=identity_tls(pki, "operator-admin"),
    )
    await process.wait_serving()
    return process


def whoami(service: str, endpoint: str, tls: TlsConfig, join_token: str = "") -> AgentRuntime:
    """An agent of ``service`` whose ``<service>.whoami`` answers the caller it was told."""
    runtime = AgentRuntime(
        AgentConfig(
            service=service, registry_endpoint=endpoint, lease_ttl=2.0, trust_domain=TD, tls=tls, join_token=join_token
        )
    )

    @runtime.handler(f"{service}.whoami", "1.0.0")
    async def answer(ctx: HandlerContext, message: Message) -> object:
        return text_part(ctx.caller or "nobody")

    return runtime


async def test_a_tls_agent_sees_the_caller_the_router_verified(mesh: ReachProcess, pki: Path) -> None:
    agent = await whoami(AGENT, mesh.endpoint, tls=identity_tls(pki, f"agent-{AGENT}")).start()
    try:
        await mesh.wait_ready(AGENT)
        # A script at the edge: trusts the CA, presents no certificate, an operator's token.
        async with MeshClient(
            mesh.endpoint, source="ops.script", tls=TlsConfig(ca=pki / "ca.pem"), token=operator_token(pki, "alice")
        ) as client:
            reply = await client.call(f"{AGENT}.whoami", text_part(""), CallOptions(timeout=10))
            assert reply.text == f"spiffe://{TD}/operator/alice"
        # Unary too (no CallMux stream).
        async with MeshClient(
            mesh.endpoint,
            tls=TlsConfig(ca=pki / "ca.pem"),
            token=operator_token(pki, "bob"),
            multiplex=False,
        ) as client:
            reply = await client.call(f"{AGENT}.whoami", text_part(""), CallOptions(timeout=10))
            assert reply.text == f"spiffe://{TD}/operator/bob"

        # A peer that is not the router dialling the agent directly is refused (issue 33): an
        # operator's certificate, another agent's, the registry's (except for health checks).
        target = agent.endpoint.removeprefix("http://")
        header = envelope_pb2.Header(message_id=new_message_id(), trace_id=new_trace_id(), capability=f"{AGENT}.whoami")
        request = agent_service_pb2.HandleRequest(
            message=envelope_pb2.ReachMessage(header=header, payload=Payload.of(text_part("")).to_proto())
        )
        for name in ("operator-admin", f"agent-{AGENT}", "registry"):
            async with grpc.aio.secure_channel(target, identity_tls(pki, name).channel_credentials()) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await agent_service_pb2_grpc.AgentServiceStub(channel).Handle(
                        request, metadata=(("x-reach-caller", f"spiffe://{TD}/operator/root"),), timeout=10
                    )
                error = ReachError.from_rpc_error(refused.value)
                assert error.code == grpc.StatusCode.PERMISSION_DENIED, error
                assert error.reason == Reason.NOT_AUTHORIZED, error
                assert error.metadata["identity"] == f"spiffe://{TD}/{name.replace('-', '/', 1)}", error
                assert f"spiffe://{TD}/router" in error.message and "through a router" in error.message
                # The multiplexed stream (how routers call agents) is refused as a whole.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    stream = agent_service_pb2_grpc.AgentServiceStub(channel).HandleMux(timeout=10)
                    await stream.read()
                assert ReachError.from_rpc_error(refused.value).reason == Reason.NOT_AUTHORIZED
                check = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="reach.v1.AgentService"), timeout=10
                )
                if name == "registry":
                    assert (await check).status == health_pb2.HealthCheckResponse.SERVING
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await check
                    assert ReachError.from_rpc_error(refused.value).reason == Reason.NOT_AUTHORIZED
        # The router's identity is answered (and its x-reach-caller believed).
        async with grpc.aio.secure_channel(target, identity_tls(pki, "router").channel_credentials()) as channel:
            response = await agent_service_pb2_grpc.AgentServiceStub(channel).Handle(
                request, metadata=(("x-reach-caller", f"spiffe://{TD}/operator/root"),), timeout=10
            )
            assert response.message.payload.parts[0].text == f"spiffe://{TD}/operator/root"

        # The agent requires a client certificate: a plaintext caller, or one trusting the CA
        # without presenting a certificate, does not get in.
        async with grpc.aio.insecure_channel(target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await agent_service_pb2_grpc.AgentServiceStub(channel).Handle(
                    agent_service_pb2.HandleRequest(), timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.secure_channel(target, TlsConfig(ca=pki / "ca.pem").channel_credentials()) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await agent_service_pb2_grpc.AgentServiceStub(channel).Handle(
                    agent_service_pb2.HandleRequest(), timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await agent.drain()


async def test_a_plaintext_client_is_refused_on_the_tls_port(mesh: ReachProcess) -> None:
    async with MeshClient(mesh.endpoint, multiplex=False) as client:
        with pytest.raises(ReachError) as refused:
            await client.call("anything.at.all", text_part(""), CallOptions(timeout=5))
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE


async def test_an_agent_with_a_join_token_registers(mesh: ReachProcess, pki: Path) -> None:
    # No certificate of its own: it trusts the CA and registers over TLS with the token.
    agent = await whoami(
        JOINER, mesh.endpoint, tls=TlsConfig(ca=pki / "ca.pem"), join_token=join_token(pki, JOINER)
    ).start()
    try:
        await eventually(lambda: agent.lease_id, "the join-token agent's lease", timeout=10)
        (instance,) = await mesh.instances(JOINER)
        assert instance.spec.instance_id == agent.instance_id
    finally:
        await agent.drain()


async def test_a_join_token_agent_keeps_its_lease(mesh: ReachProcess, pki: Path) -> None:
    # Heartbeats authenticate with the lease id alone.
    agent = await whoami(
        JOINER, mesh.endpoint, tls=TlsConfig(ca=pki / "ca.pem"), join_token=join_token(pki, JOINER)
    ).start()
    try:
        first = await eventually(lambda: agent.lease_id, "the join-token agent's lease", timeout=10)
        (instance,) = await mesh.instances(JOINER)
        assert instance.spec.instance_id == agent.instance_id
        # Past two lease TTLs (2 s): still the first lease, renewed by heartbeats.
        await asyncio.sleep(4.5)
        (instance,) = await mesh.instances(JOINER)
        assert instance.spec.instance_id == agent.instance_id
        assert agent.lease_id == first
    finally:
        await agent.drain()


async def test_a_registration_without_the_right_is_refused_for_good(mesh: ReachProcess, pki: Path) -> None:
    # echo-py's certificate names service echo-py: it may not register as another service.
    runtime = whoami("other-py", mesh.endpoint, tls=identity_tls(pki, f"agent-{AGENT}"))
    agent = await runtime.start()
    try:
        error = await asyncio.wait_for(agent.registration_refused(), timeout=10)
        assert error.code == grpc.StatusCode.PERMISSION_DENIED, error
        assert agent.lease_id is None
    finally:
        await agent.drain()
