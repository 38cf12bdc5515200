"""An agent's lifecycle in a real mesh: a drain under load loses no call, and an agent comes
back routable after its registry restarts empty."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from conftest import ReachProcess, eventually, python_process
from reach_mesh import AgentConfig, AgentRuntime, CallOptions, HandlerContext, MeshClient, Message, ReachError, data_part

AGENT = Path(__file__).with_name("agent_process.py")


async def read_lines(process: subprocess.Popen[bytes]) -> list[str]:
    """Everything ``process`` printed, once it exited (bounded by the caller's wait)."""
    assert process.stdout is not None
    out = await asyncio.get_running_loop().run_in_executor(None, process.stdout.read)
    return out.decode().splitlines()


async def test_sigterm_under_load_drains_an_instance_without_failing_a_call(dev: ReachProcess, workdir: Path) -> None:
    agents = {
        name: python_process(
            AGENT, "--registry", dev.endpoint, "--service", "drainee", "--instance-id", name, "--delay-ms", "40", cwd=workdir
        )
        for name in ("drainee-a", "drainee-b")
    }
    try:
        await dev.wait_ready("drainee", count=2, timeout=15)
        served: Counter[str] = Counter()
        failures: list[ReachError] = []
        done = 0
        # At most what one instance takes at once (max_concurrency 8): the survivor alone has
        # room for the whole load, so nothing waits for admission.
        total, concurrency = 240, 8
        signalled_at: list[int] = []
        slots = asyncio.Semaphore(concurrency)
        async with MeshClient(dev.endpoint, "pytest.load") as mesh:

            async def one(n: int) -> None:
                nonlocal done
                async with slots:
                    try:
                        reply = await mesh.call("drainee.work", data_part({"n": n}), CallOptions(timeout=15))
                    except ReachError as error:
                        failures.append(error)
                        return
                    assert reply.data["request"] == {"n": n}
                    served[reply.instance_id] += 1
                    done += 1
                    if done == 60:
                        # In the middle of the load, with calls in flight on both instances.
                        signalled_at.append(done)
                        agents["drainee-a"].send_signal(signal.SIGTERM)

            await asyncio.gather(*(one(n) for n in range(total)))
        assert not failures, failures[:3]
        assert sum(served.values()) == total
        assert signalled_at == [60]
        assert served["drainee-a"] > 0 and served["drainee-b"] > 0, served
        # The drained instance exits by itself, having finished its in-flight calls...
        status = await asyncio.get_running_loop().run_in_executor(None, agents["drainee-a"].wait, 20)
        assert status == 0
        lines = await read_lines(agents["drainee-a"])
        handled = json.loads(lines[-1])["handled"]
        assert handled == served["drainee-a"], (handled, served, lines[-5:])
        assert any("draining" in line for line in lines)
        # ...and deregistered (its lease would last 10 s more): only b is left.
        remaining = await eventually(
            lambda: _ids(dev, "drainee", {"drainee-b"}), "the drained instance deregistered", timeout=3
        )
        assert remaining
    finally:
        for process in agents.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in agents.values():
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


async def _ids(dev: ReachProcess, service: str, expected: set[str]) -> bool:
    return {i.spec.instance_id for i in await dev.instances(service)} == expected


async def test_an_agent_registers_again_after_its_registry_restarts(
    processes: Callable[..., ReachProcess],
) -> None:
    registry = processes("registry", "--listen", "127.0.0.1:0", "--admin-listen", "")
    await registry.wait_serving()
    router = processes("router", "--listen", "127.0.0.1:0", "--admin-listen", "", "--registry", registry.endpoint)
    await router.wait_serving()
    runtime = AgentRuntime(
        AgentConfig(service="phoenix", registry_endpoint=registry.endpoint, instance_id="phoenix-1", lease_ttl=0.6)
    )

    @runtime.handler("phoenix.rise", "1.0.0")
    async def rise(ctx: HandlerContext, message: Message) -> object:
        return data_part({"by": ctx.instance_id})

    agent = await runtime.start()
    try:
        await registry.wait_ready("phoenix")
        first_lease = agent.lease_id
        async with MeshClient(router.endpoint, "pytest.phoenix") as mesh:

            async def routable() -> bool:
                try:
                    reply = await mesh.call("phoenix.rise", data_part({}), CallOptions(timeout=2))
                except ReachError:
                    return False
                return reply.data == {"by": "phoenix-1"}

            await eventually(routable, "the agent routable through the router", timeout=10)
            # The registry restarts on the same port with nothing registered.
            port = registry.address.rsplit(":", 1)[1]
            registry.stop(signal.SIGKILL)
            restarted_at = time.monotonic()
            registry = processes("registry", "--listen", f"127.0.0.1:{port}", "--admin-listen", "")
            assert registry.endpoint.endswith(f":{port}")
            await registry.wait_serving()
            # The next heartbeat finds its lease unknown: the agent registers again.
            await registry.wait_ready("phoenix", timeout=10)
            assert agent.lease_id != first_lease
            assert time.monotonic() - restarted_at < 10
            await eventually(routable, "the agent routable again after the restart", timeout=10)
    finally:
        await agent.drain()
