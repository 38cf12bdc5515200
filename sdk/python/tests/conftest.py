"""Fixtures: real ``reach`` processes on 127.0.0.1 (the binary named by ``REACH_BIN``, default
``<repo>/target/debug/reach``), each on a port it picks itself (``--listen 127.0.0.1:0``) and
read back from its banner, stopped (SIGTERM, then SIGKILL) at the end of its test; and
:func:`eventually`, which waits for a condition with a bounded deadline."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from reach.v1 import registry_service_pb2, registry_service_pb2_grpc
from reach_mesh import TlsConfig

REPO = Path(__file__).resolve().parents[3]
#: How long a process may take to serve, or to stop after SIGTERM.
START_TIMEOUT = 15.0
STOP_TIMEOUT = 15.0

T = TypeVar("T")


def reach_bin() -> Path:
    """The reach binary: ``$REACH_BIN``, else ``<repo>/target/debug/reach`` (what ``cargo
    test`` builds)."""
    path = Path(os.environ.get("REACH_BIN", REPO / "target/debug/reach"))
    if not path.is_file():
        pytest.fail(
            f"{path} does not exist: build it with `cargo build -p reach` or point REACH_BIN at a reach binary",
            pytrace=False,
        )
    return path


async def eventually(
    check: Callable[[], Awaitable[T | None] | T | None], what: str, timeout: float = 10.0, every: float = 0.02
) -> T:
    """The first truthy value ``check`` returns, polling every ``every`` seconds; fails the
    test naming ``what`` (and the last value) when ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        value = check()
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            value = await value
        last = value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            pytest.fail(f"{what}: not within {timeout}s (last: {last!r})", pytrace=False)
        await asyncio.sleep(every)


class ReachProcess:
    """A ``reach`` subcommand running as a process of its own, serving gRPC at
    :attr:`endpoint` (``http://127.0.0.1:PORT``). With ``tls`` (a mesh serving TLS) the
    fixture's own calls (health, instances) go over TLS with those credentials."""

    #: Banner lines to wait for besides ``grpc``: name → a pattern whose first group is the
    #: value kept in :attr:`banner_values` (each ends past the port, so a line read in half
    #: does not match). Subclasses for processes with more endpoints (edges, console) set it.
    banner_lines: ClassVar[dict[str, bytes]] = {}
    #: What the process printed up to its last awaited banner line.
    banner: str
    #: The values of :attr:`banner_lines`, by name.
    banner_values: dict[str, str]

    def __init__(
        self,
        args: list[str],
        cwd: Path,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        self.args = args
        self.tls = tls
        self.cwd = cwd
        self.log_path = log or cwd / f"reach-{args[0]}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [str(reach_bin()), *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, "REACH_LOG": "warn", **(env or {})},
        )
        self.endpoint = self._read_endpoint()
        self.address = self.endpoint.split("://", 1)[1]

    def channel(self) -> grpc.aio.Channel:
        """A channel to the process: over TLS when it was started with ``tls``."""
        if self.tls is None:
            return grpc.aio.insecure_channel(self.address)
        return grpc.aio.secure_channel(self.address, self.tls.channel_credentials())

    def _read_endpoint(self) -> str:
        assert self.process.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT
        seen = b""
        os.set_blocking(self.process.stdout.fileno(), False)
        while time.monotonic() < deadline:
            chunk = self.process.stdout.read() or b""
            seen += chunk
            match = re.search(rb"grpc\s+(https?://127\.0\.0\.1:\d+)", seen)
            found = {name: re.search(pattern, seen) for name, pattern in self.banner_lines.items()}
            if match and all(found.values()):
                self.banner = seen.decode(errors="replace")
                self.banner_values = {name: m.group(1).decode() for name, m in found.items() if m}
                return match.group(1).decode()
            if self.process.poll() is not None:
                break
            time.sleep(0.01)
        self.stop()
        wanted = ", ".join(["grpc", *self.banner_lines])
        pytest.fail(
            f"reach {' '.join(self.args)} did not print its banner lines ({wanted}): "
            f"{seen.decode(errors='replace')}\n{self.log_path.read_text(errors='replace')}",
            pytrace=False,
        )

    async def wait_serving(self) -> None:
        """Waits until the process answers ``grpc.health.v1`` SERVING."""
        async with self.channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def serving() -> bool:
                try:
                    answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                except grpc.aio.AioRpcError:
                    return False
                return answer.status == health_pb2.HealthCheckResponse.SERVING

            await eventually(serving, f"reach {self.args[0]} serving", timeout=START_TIMEOUT)

    async def cli(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Runs a ``reach`` client subcommand against this process (``--endpoint`` added),
        without blocking the event loop (agents of the test run on it)."""
        child = await asyncio.create_subprocess_exec(
            str(reach_bin()),
            *args,
            "--endpoint",
            self.endpoint,
            cwd=self.cwd,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            stdout, stderr = await asyncio.wait_for(child.communicate(), timeout)
        except asyncio.TimeoutError:
            child.kill()
            await child.wait()
            pytest.fail(f"reach {' '.join(args)} did not finish within {timeout}s", pytrace=False)
        assert child.returncode is not None
        return subprocess.CompletedProcess(list(args), child.returncode, stdout.decode(), stderr.decode())

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Stops the process (``sig``, then SIGKILL after :data:`STOP_TIMEOUT`); returns its
        exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()
        return self.process.returncode

    async def instances(self, service: str = "") -> list[registry_service_pb2.Instance]:
        """The registry's instances of ``service`` (all when empty)."""
        async with self.channel() as channel:
            stub = registry_service_pb2_grpc.RegistryServiceStub(channel)
            response = await stub.ListInstances(registry_service_pb2.ListInstancesRequest(service=service), timeout=5)
            return list(response.instances)

    async def wait_ready(self, service: str, count: int = 1, timeout: float = 10.0) -> list[registry_service_pb2.Instance]:
        """Waits until ``count`` instances of ``service`` are READY (routable)."""

        async def ready() -> list[registry_service_pb2.Instance] | None:
            found = [i for i in await self.instances(service) if i.state == registry_service_pb2.INSTANCE_STATE_READY]
            return found if len(found) >= count else None

        return await eventually(ready, f"{count} READY instance(s) of {service}", timeout=timeout)


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A temporary directory to run processes in: outside the repository, so ``reach dev``
    loads no example flows or protocol registry unless a test gives them."""
    with tempfile.TemporaryDirectory(prefix="reach-py-") as path:
        yield Path(path)


@pytest.fixture
async def processes(workdir: Path) -> AsyncIterator[Callable[..., ReachProcess]]:
    """Starts ``reach`` processes (``processes("dev", "--no-agents")``) and stops every one
    at the end of the test."""
    started: list[ReachProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, tls: TlsConfig | None = None) -> ReachProcess:
        process = ReachProcess(list(args), workdir, env, tls=tls)
        started.append(process)
        return process

    yield start
    for process in reversed(started):
        process.stop()


@pytest.fixture
async def dev(processes: Callable[..., ReachProcess], workdir: Path) -> ReachProcess:
    """``reach dev`` without the example agents: registry, router and orchestrator on one
    port, tasks in the test's directory. The router waits at most 300 ms for a full agent
    (``admission.max_wait``) so overload tests are quick."""
    process = processes(
        "dev",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "",
        "--edge-listen",
        "",
        "--no-agents",
        "--data-dir",
        str(workdir / "data"),
        env={"REACH_ROUTER__ADMISSION__MAX_WAIT": "300ms"},
    )
    await process.wait_serving()
    return process


def python_process(script: Path, *args: str, cwd: Path) -> subprocess.Popen[bytes]:
    """Runs ``script`` with this interpreter (the venv's), stdout piped."""
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def load_example() -> ModuleType:
    """``sdk/python/examples/complaint_executor.py`` as a module."""
    path = REPO / "sdk/python/examples/complaint_executor.py"
    spec = importlib.util.spec_from_file_location("complaint_executor", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["complaint_executor"] = module
    spec.loader.exec_module(module)
    return module
