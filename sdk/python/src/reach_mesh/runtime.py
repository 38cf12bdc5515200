"""The agent runtime: :class:`AgentRuntime` serves ``reach.v1.AgentService`` around your
handlers, registers with the registry, keeps the lease alive and drains on shutdown — on the
wire as the Rust SDK's ``reach_sdk::AgentRuntime`` does.

Lifecycle: serve (``reach.v1.AgentService``, ``grpc.health.v1`` with ``reach.v1.AgentService``
SERVING, reflection) → register (REGISTERED; READY once the registry's health probe passes) →
heartbeat every third of the granted lease, reporting READY, or BUSY while the messages in
flight reach ``max_concurrency`` or every model slot is taken, with the in-flight and model
figures → register again whenever the registry no longer knows the lease (it restarted) →
on shutdown: report DRAINING, refuse new messages with UNAVAILABLE / ``INSTANCE_DRAINING`` (so
the router redelivers them elsewhere), let multiplexed streams answer what they read and end,
wait for in-flight work up to ``max_drain``, deregister, stop serving.

Every message runs in its own task, under three rules shared with the Rust SDK:

- at most ``max_concurrency`` handlers run at once; a message waits for a slot until its
  caller gives up (deadline, cancellation), and is then dropped unhandled;
- a message id handled within ``dedupe_window`` is not handled again: a redelivery gets the
  first outcome (reply or error), a duplicate arriving while the first runs waits for it;
- a caller that goes away (deadline, reset, cancel frame) cancels the handler's context, but
  the handler may finish, and its outcome is remembered for redeliveries.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Union

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from reach.v1 import (
    agent_service_pb2,
    agent_service_pb2_grpc,
    envelope_pb2,
    mux_pb2,
    registry_service_pb2,
    registry_service_pb2_grpc,
)
from reach_mesh import _grpc
from reach_mesh.capability import Capability
from reach_mesh.config import AgentConfig
from reach_mesh.context import HandlerContext
from reach_mesh.dedupe import DedupeCache
from reach_mesh.errors import ReachError, Reason
from reach_mesh.ids import new_message_id
from reach_mesh.message import Message
from reach_mesh.models import ModelSlots
from reach_mesh.parts import MAX_DATA_DEPTH, DataTooDeep, Part, PartError, Payload
from reach_mesh.trust import DirectCallers, peer_identity, vouched_caller

__all__ = ["AGENT_SERVICE", "AgentRuntime", "Handler", "HandlerResult", "RunningAgent", "StreamHandler"]

_log = logging.getLogger("reach_mesh")

#: The gRPC service every agent serves; the registry's health probe checks its status.
AGENT_SERVICE: Final = "reach.v1.AgentService"

#: What a handler returns: a payload (with its message type), one part, or a list of parts.
HandlerResult = Union[Payload, Part, Sequence[Part]]
#: A unary handler: ``async def handle(ctx, message) -> HandlerResult``. Raise
#: :class:`~reach_mesh.ReachError` to answer with a status — except that one with a reason
#: meaning "not delivered" (``ROUTE_NOT_FOUND``, ``INSTANCE_DRAINING``, ``OVERLOADED``,
#: ``INSTANCE_UNAVAILABLE``: a call the handler made failed) answers FAILED_PRECONDITION; any
#: other exception, and a reply that cannot be sent (data deeper than ``MAX_DATA_DEPTH``),
#: answers INTERNAL. A plain (non-async) function works too; it runs on the event loop, so keep
#: it short.
Handler = Callable[[HandlerContext, Message], Union[Awaitable[HandlerResult], HandlerResult]]
#: A stream handler: an async generator ``async def handle(ctx, first, rest)`` that yields a
#: :data:`HandlerResult` per reply; ``rest`` yields the caller's later messages. Returning ends
#: the stream with OK; raising :class:`~reach_mesh.ReachError` ends it with that status (a
#: delivery reason as for :data:`Handler`), after the replies already yielded.
StreamHandler = Callable[[HandlerContext, Message, AsyncIterator[Message]], AsyncIterator[HandlerResult]]

#: Calls one multiplexed stream may have open at once (beyond the handler concurrency they
#: wait for a slot, as unary calls do); more are refused with OVERLOADED.
MAX_OPEN_CALLS_PER_STREAM: Final = 1024
#: The retry hint of a multiplexed call refused because its stream has too many calls open.
_OVERLOADED_RETRY_AFTER: Final = 0.05
#: How long the server lets calls still open at the end of a drain finish before it closes
#: their connections, in seconds.
_SERVER_GRACE_AFTER_DRAIN: Final = 1.0
#: How long a drained instance keeps answering after it deregistered, in seconds, before its
#: server stops: a router that has not yet applied the deregistration still gets an
#: ``INSTANCE_DRAINING`` refusal (and redelivers the message elsewhere), where grpcio's
#: stopping server would cancel the call, which the router cannot tell from one that ran.
_LINGER_AFTER_DEREGISTER: Final = 0.5
#: The registration back-off: 20 ms, doubling, at most 2 s (``Backoff::doubling``).
_BACKOFF_INITIAL: Final = 0.02
_BACKOFF_MAX: Final = 2.0
#: Retry delays are jittered: a nominal delay ``d`` becomes one drawn from ``[d/2, 3d/2]``.
_BACKOFF_JITTER: Final = 0.5
#: The longest a failed heartbeat waits before it is retried (or the heartbeat period, if
#: shorter): an instance finds a registry back from an outage within about a second.
_HEARTBEAT_RETRY_MAX: Final = 1.0
#: The most an instance waits (a random share of it, at most a quarter of its heartbeat
#: period) before registering again when the registry no longer knows its lease, so that the
#: instances of a restarted registry do not all register at once.
_REREGISTER_SPREAD: Final = 0.25


def _jittered(delay: float) -> float:
    """``delay`` spread uniformly over ``[delay/2, 3 delay/2]``."""
    return delay * (1.0 + _BACKOFF_JITTER * random.uniform(-1.0, 1.0))
#: Bytes remembering one outcome costs beyond its own size (id and bookkeeping).
_DEDUPE_ENTRY_OVERHEAD: Final = 256


def _dedupe_key(caller: str | None, message_id: str) -> str:
    """What a handled message's outcome is remembered under: its id, per caller when the
    router verified one. A message id is the caller's to choose (the orchestrator's are derived
    from task ids), so keyed by the id alone one principal's answer could be handed to
    another's redelivery."""
    return f"{caller}\x00{message_id}" if caller else message_id


#: The longest a Register, a draining Heartbeat or a Deregister call may take before it counts
#: as failed, in seconds (the Rust and TypeScript SDKs' 5 s): a hung registry cannot stall the
#: registration loop past a lease.
_REGISTRY_CALL_TIMEOUT: Final = 5.0
#: Reasons that tell a caller its message was not delivered, so it may be sent elsewhere or
#: again (``docs/errors.md``). A handler that lets a nested call's error with one of them
#: escape answers FAILED_PRECONDITION instead (see :func:`_handler_outcome`).
_DELIVERY_REASONS: Final = frozenset(
    {Reason.ROUTE_NOT_FOUND, Reason.INSTANCE_DRAINING, Reason.OVERLOADED, Reason.INSTANCE_UNAVAILABLE}
)

#: The outcome of one handled message: the reply envelope, or the error the handler (or the
#: runtime, for an oversized reply) answered with. Remembered for redeliveries.
_Outcome = Union[envelope_pb2.ReachMessage, ReachError]


class _NotHandled(Exception):
    """The message never got a handler slot (its caller gave up while it waited): nothing is
    remembered, so a redelivery of its id runs it."""

    def __init__(self, error: ReachError) -> None:
        super().__init__(error.message)
        self.error = error


def _too_large(what: str, size: int, limit: int) -> ReachError:
    return ReachError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the {what} is {size} bytes, over this agent's limit of {limit} bytes "
        "(max_message_bytes); send large content by url, or raise the limit",
        Reason.PAYLOAD_TOO_LARGE,
        {"size_bytes": str(size), "limit_bytes": str(limit)},
    )


async def _abort(context: grpc.aio.ServicerContext[Any, Any], error: ReachError) -> None:
    await context.abort(error.code, error.message, trailing_metadata=error.trailing_metadata())


def _handler_failed(capability: str, trace_id: str) -> ReachError:
    """What a handler that raised something other than :class:`ReachError` answers: INTERNAL
    with a generic message and an error id; the exception (its text may hold anything the
    handler had at hand) goes to the agent's log under that id, never to the caller. Call it
    while handling the exception (the log takes it from there)."""
    error_id = uuid.uuid4()
    _log.exception("handler for %s failed; error id %s (trace %s)", capability, error_id, trace_id)
    return ReachError(grpc.StatusCode.INTERNAL, f"handler failed; error id {error_id}; see the agent's log")


def _handler_outcome(error: ReachError) -> ReachError:
    """What a handler's unhandled ``error`` answers its caller: the error itself, unless it
    carries a delivery reason (``ROUTE_NOT_FOUND``, ``INSTANCE_DRAINING``, ``OVERLOADED``,
    ``INSTANCE_UNAVAILABLE``). Such an error came from a call the handler made; forwarded as
    it is, the router, the orchestrator and callers would take this message for "not
    delivered" and send it again or elsewhere, although the handler ran. It answers
    FAILED_PRECONDITION, without a reason, with the message prefixed ``a call this handler
    made failed:`` instead."""
    if error.reason not in _DELIVERY_REASONS:
        return error
    return ReachError(grpc.StatusCode.FAILED_PRECONDITION, f"a call this handler made failed: {error.message}")


def _unsendable_reply(capability: str, error: Exception) -> ReachError:
    """INTERNAL for a handler's reply that cannot be sent: its data nests deeper than
    :data:`~reach_mesh.parts.MAX_DATA_DEPTH` (the router could not decode it inside the
    multiplexed stream other calls share), is not JSON, or cannot be encoded."""
    _log.error("handler for %s returned content that cannot be sent: %s", capability or "the service", error)
    if isinstance(error, DataTooDeep):
        return ReachError(
            grpc.StatusCode.INTERNAL,
            f"the handler's reply nests {error.depth} levels deep, over the limit of {error.limit} "
            f"(level {error.limit + 1} begins at {error.path}); the reply was not sent: flatten it",
        )
    what = str(error) if isinstance(error, PartError) else f"{type(error).__name__}: {error}"
    return ReachError(grpc.StatusCode.INTERNAL, f"the handler's reply cannot be sent: {what}")


class AgentRuntime:
    """An agent process: handlers by capability, served and registered.

    ::

        runtime = AgentRuntime(AgentConfig(service="echo", registry_endpoint="http://127.0.0.1:7070"))

        @runtime.handler("echo", "1.0.0", description="returns its input")
        async def echo(ctx: HandlerContext, message: Message) -> list[Part]:
            return list(message.parts)

        asyncio.run(runtime.run())   # until SIGTERM or Ctrl-C, then drain
    """

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        #: This agent's model call slots (``config.model_slots`` of them), shared with every
        #: handler through :attr:`HandlerContext.model_slots`.
        self.model_slots = ModelSlots(config.model_slots)
        self._handlers: dict[str, Handler] = {}
        self._stream_handlers: dict[str, StreamHandler] = {}
        self._capabilities: dict[str, Capability] = {}
        self._problems: list[str] = []

    def handle(self, capability: Capability, handler: Handler) -> AgentRuntime:
        """Serves unary messages (Handle, HandleMux) for ``capability`` with ``handler`` and
        registers the capability with its description and schemas. Returns the runtime."""
        self._handlers[capability.name] = handler
        self._declare(capability)
        return self

    def handle_stream(self, capability: Capability, handler: StreamHandler) -> AgentRuntime:
        """Serves streams (HandleStream) for ``capability`` with ``handler``; declares the
        capability as :meth:`handle` does. Returns the runtime."""
        self._stream_handlers[capability.name] = handler
        self._declare(capability)
        return self

    def handler(
        self,
        name: str,
        version: str = "",
        *,
        description: str = "",
        input_schema: dict[str, Any] | bool | None = None,
        output_schema: dict[str, Any] | bool | None = None,
    ) -> Callable[[Handler], Handler]:
        """A decorator form of :meth:`handle`: ``@runtime.handler("echo", "1.0.0", ...)``."""

        def register(function: Handler) -> Handler:
            self.handle(Capability(name, version, description, input_schema, output_schema), function)
            return function

        return register

    def stream_handler(
        self,
        name: str,
        version: str = "",
        *,
        description: str = "",
        input_schema: dict[str, Any] | bool | None = None,
        output_schema: dict[str, Any] | bool | None = None,
    ) -> Callable[[StreamHandler], StreamHandler]:
        """A decorator form of :meth:`handle_stream`."""

        def register(function: StreamHandler) -> StreamHandler:
            self.handle_stream(Capability(name, version, description, input_schema, output_schema), function)
            return function

        return register

    def _declare(self, capability: Capability) -> None:
        """Declares ``capability`` once: a unary and a stream handler of one name share it,
        the first declaration's version stays, and a later one's non-empty description and
        schemas fill in."""
        try:
            capability.check()
        except ValueError as problem:
            self._problems.append(str(problem))
        existing = self._capabilities.get(capability.name)
        if existing is None:
            self._capabilities[capability.name] = capability
            return
        self._capabilities[capability.name] = Capability(
            name=existing.name,
            version=existing.version,
            description=capability.description or existing.description,
            input_schema=capability.input_schema if capability.input_schema is not None else existing.input_schema,
            output_schema=capability.output_schema if capability.output_schema is not None else existing.output_schema,
        )

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> RunningAgent:
        """Starts serving on ``host:port`` (0: a free port) and registering; returns the
        running agent, to :meth:`RunningAgent.drain` later. Registration goes on in the
        background: retried (20 ms doubling to 2 s) while the registry is unreachable or
        busy, repeated whenever the registry has lost the lease, and given up when the
        registry refuses the spec itself (INVALID_ARGUMENT or FAILED_PRECONDITION) or the
        agent's right to register (PERMISSION_DENIED, UNAUTHENTICATED; see
        :meth:`RunningAgent.registration_refused`). With :attr:`AgentConfig.tls` the agent
        serves TLS requiring client certificates of the CA.

        Raises:
            ValueError: the config, or a declared capability, is invalid (the message names
                the setting or field), or no handler was added.
            RuntimeError: the port cannot be bound.
        """
        config = self.config
        config.validate()
        if self._problems:
            raise ValueError(self._problems[0])
        if not self._capabilities:
            raise ValueError("the agent serves nothing: add a handler with handle() or @handler first")
        if not config.advertise_host and host in ("0.0.0.0", "::", ""):
            raise ValueError(
                f"the agent listens on {host!r}, a wildcard address the router cannot dial: set "
                "AgentConfig.advertise_host to the address others reach it at (a pod IP, a DNS "
                "name), or listen on a specific address"
            )
        instance_id = config.instance_id or f"{config.service}-{uuid.uuid4().hex[:8]}"
        core = _Core(config, instance_id, dict(self._handlers), dict(self._stream_handlers), self.model_slots)

        frame_limit = config.max_message_bytes + _grpc.FRAME_OVERHEAD_BYTES
        server = grpc.aio.server(
            # Serving TLS, the agent answers only routers (and the registry's health probes).
            interceptors=() if core.callers is None else (core.callers.interceptor(),),
            options=[
                *_grpc.size_options(frame_limit),
                *_grpc.KEEPALIVE_OPTIONS,
                # A port given explicitly must not be shared with another process silently.
                ("grpc.so_reuseport", 0),
            ]
        )
        agent_service_pb2_grpc.add_AgentServiceServicer_to_server(_AgentServicer(core), server)
        health_servicer = health.aio.HealthServicer()
        await health_servicer.set(AGENT_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (AGENT_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        try:
            if config.tls is not None and config.tls.cert is not None:
                bound = server.add_secure_port(f"{host}:{port}", config.tls.server_credentials())
            else:
                bound = server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as error:
            raise RuntimeError(f"cannot listen on {host}:{port}: {error}") from None
        await server.start()
        advertised = config.advertise_host or host
        endpoint = f"http://[{advertised}]:{bound}" if ":" in advertised else f"http://{advertised}:{bound}"

        spec = registry_service_pb2.InstanceSpec(
            service=config.service,
            instance_id=instance_id,
            endpoint=endpoint,
            capabilities=[capability.to_proto() for capability in self._capabilities.values()],
            protocol_version=config.protocol_version,
            weight=config.weight,
            max_concurrency=min(config.max_concurrency, 2**32 - 1),
            topics=config.topics,
            labels=config.labels,
        )
        registry = _grpc.channel(config.registry_endpoint, tls=config.tls)
        agent = RunningAgent(core, server, health_servicer, registry, spec, endpoint)
        agent._start_registering()
        _log.info("agent serving: instance %s at %s", instance_id, endpoint)
        return agent

    async def run(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Starts (as :meth:`start`), serves until SIGTERM or SIGINT, then drains (as
        :meth:`RunningAgent.drain`); a second signal during the drain stops waiting for
        in-flight work. Returns once the instance has left the mesh. Call it from the main
        thread (signal handlers), for example with ``asyncio.run(runtime.run())``.

        Raises:
            ValueError, RuntimeError: as :meth:`start`.
            RegistrationRefused: the registry refused the registration for good (raised
                after draining).
        """
        agent = await self.start(host, port)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        signals = (signal.SIGTERM, signal.SIGINT)

        def second_signal() -> None:
            _log.warning("second signal: no longer waiting for in-flight work")
            agent._core.abandon.set()

        def first_signal() -> None:
            stop.set()
            for sig in signals:
                loop.add_signal_handler(sig, second_signal)

        for sig in signals:
            loop.add_signal_handler(sig, first_signal)
        stopped = asyncio.ensure_future(stop.wait())
        refused = asyncio.ensure_future(agent.registration_refused())
        try:
            await asyncio.wait((stopped, refused), return_when=asyncio.FIRST_COMPLETED)
            await agent.drain()
            if refused.done():
                raise RegistrationRefused(refused.result())
        finally:
            stopped.cancel()
            refused.cancel()
            for sig in signals:
                loop.remove_signal_handler(sig)


class RegistrationRefused(Exception):
    """The registry refused the agent's registration for good: no retry can succeed until
    the spec (what the registry's message names) is fixed. ``error`` is the registry's."""

    def __init__(self, error: ReachError) -> None:
        super().__init__(
            f"the registry refused this agent's registration: {error}; it cannot succeed as "
            "configured: fix what it names and start the agent again"
        )
        self.error = error


# === the running agent ===

#: Registration refusals no retry can fix: the spec itself, or the right to register.
_FINAL_REFUSALS: Final = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
)


class RunningAgent:
    """A started agent. Call :meth:`drain` to take it out of the mesh."""

    def __init__(
        self,
        core: _Core,
        server: grpc.aio.Server,
        health_servicer: health.aio.HealthServicer,
        registry: grpc.aio.Channel,
        spec: registry_service_pb2.InstanceSpec,
        endpoint: str,
    ) -> None:
        self._core = core
        self._server = server
        self._health = health_servicer
        self._registry_channel = registry
        self._registry = registry_service_pb2_grpc.RegistryServiceStub(registry)
        self._spec = spec
        #: Where this instance serves AgentService (``http://127.0.0.1:50051``), as registered.
        self.endpoint = endpoint
        self._lease_id: str | None = None
        self._registering: asyncio.Task[None] | None = None
        self._refused: asyncio.Future[ReachError] = asyncio.get_running_loop().create_future()

    @property
    def instance_id(self) -> str:
        """This instance's id."""
        return self._core.instance_id

    @property
    def in_flight(self) -> int:
        """Messages (and streams) being handled now."""
        return self._core.in_flight

    @property
    def lease_id(self) -> str | None:
        """The current lease id; ``None`` until the first registration succeeded."""
        return self._lease_id

    @property
    def model_slots(self) -> ModelSlots:
        """This instance's model call slots."""
        return self._core.model_slots

    async def registration_refused(self) -> ReachError:
        """Waits until the registry refuses the registration for good (INVALID_ARGUMENT or
        FAILED_PRECONDITION: a bad name, version or descriptor, an undeclared capability, an
        instance an operator drained; PERMISSION_DENIED or UNAUTHENTICATED: the certificate
        or join token does not allow it, the token is expired or used), and returns the registry's error; never returns
        while the registration stands or is being retried. :meth:`AgentRuntime.run` drains
        and raises :class:`RegistrationRefused` then."""
        return await asyncio.shield(self._refused)

    def _start_registering(self) -> None:
        self._registering = asyncio.ensure_future(self._keep_registered())

    async def _keep_registered(self) -> None:
        """Registers, then heartbeats every third of the granted lease; registers again
        whenever the registry no longer knows the lease. Ends when the registry drained the
        instance (an operator's ``DELETE /agents/{service}``), or when cancelled."""
        config = self._core.config
        backoff = _BACKOFF_INITIAL
        # The join token proves the right to register; heartbeats then authenticate with the
        # lease id the registration granted.
        token = config.join_token.strip()
        credentials = (("authorization", f"Bearer {token}"),) if token else None
        while True:
            request = registry_service_pb2.RegisterRequest(
                instance=self._spec, lease_ttl=_grpc.duration(config.lease_ttl)
            )
            try:
                response = await self._registry.Register(
                    request, timeout=_REGISTRY_CALL_TIMEOUT, metadata=credentials
                )
            except grpc.aio.AioRpcError as failure:
                error = ReachError.from_rpc_error(failure)
                if failure.code() in _FINAL_REFUSALS:
                    _log.error("the registry refused the registration; not retrying: %s", error)
                    self._refused.set_result(error)
                    return
                delay = _jittered(backoff)
                _log.warning("registration failed; retrying in %.2fs: %s", delay, error)
                await asyncio.sleep(delay)
                backoff = min(backoff * 2, _BACKOFF_MAX)
                continue
            backoff = _BACKOFF_INITIAL
            granted = _grpc.seconds(response.lease_ttl) if response.HasField("lease_ttl") else config.lease_ttl
            self._lease_id = response.lease_id
            _log.info("registered: instance %s, lease %.3fs", self.instance_id, granted)
            if not await self._heartbeat_until_lost(response.lease_id, granted):
                return

    async def _heartbeat_until_lost(self, lease_id: str, granted: float) -> bool:
        """Heartbeats on ``lease_id``; returns ``True`` when the registry lost the lease
        (register again, after a random share of the spread), ``False`` when it drained the
        instance (stop). A failed heartbeat is retried sooner than the period, with jittered
        doubling back-off up to a second."""
        core = self._core
        period = max(granted / 3, 0.01)
        wait = period
        retry = _BACKOFF_INITIAL
        while True:
            sleep = asyncio.ensure_future(asyncio.sleep(wait))
            changed = asyncio.ensure_future(core.model_slots.changed())
            try:
                await asyncio.wait((sleep, changed), return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleep.cancel()
                changed.cancel()
            in_flight = core.in_flight
            load = core.model_slots.load()
            busy = in_flight >= core.config.max_concurrency or load.saturated
            beat = registry_service_pb2.HeartbeatRequest(
                instance_id=self.instance_id,
                lease_id=lease_id,
                state=registry_service_pb2.INSTANCE_STATE_BUSY if busy else registry_service_pb2.INSTANCE_STATE_READY,
                in_flight=min(in_flight, 1_000_000),
                model_calls_in_flight=load.in_flight,
                model_slots_free=load.free,
            )
            try:
                answer = await self._registry.Heartbeat(beat, timeout=max(period, 1.0))
            except grpc.aio.AioRpcError as failure:
                error = ReachError.from_rpc_error(failure)
                if error.reason == Reason.INSTANCE_DRAINED:
                    _log.warning("the registry drained this instance; no longer taking new work through it")
                    return False
                if error.code == grpc.StatusCode.NOT_FOUND:
                    delay = random.uniform(0.0, min(period / 4, _REREGISTER_SPREAD))
                    _log.warning("registry lost the lease; registering again in %.3fs", delay)
                    await asyncio.sleep(delay)
                    return True
                wait = min(_jittered(retry), period)
                retry = min(retry * 2, _HEARTBEAT_RETRY_MAX, period)
                _log.warning("heartbeat failed; retrying in %.2fs: %s", wait, error)
                continue
            wait = period
            retry = _BACKOFF_INITIAL
            if answer.state == registry_service_pb2.INSTANCE_STATE_DRAINING:
                _log.warning("the registry drained this instance; no longer taking new work through it")
                return False

    async def drain(self) -> None:
        """Takes the instance out of the mesh: reports DRAINING, refuses new messages (the
        router redelivers them elsewhere), lets multiplexed streams answer what they read,
        waits up to ``max_drain`` for in-flight work, deregisters and stops serving."""
        core = self._core
        core.draining = True
        core.closing.set()
        await self._health.enter_graceful_shutdown()
        if self._registering is not None:
            self._registering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._registering
        lease_id = self._lease_id
        if lease_id is not None:
            load = core.model_slots.load()
            report = registry_service_pb2.HeartbeatRequest(
                instance_id=self.instance_id,
                lease_id=lease_id,
                state=registry_service_pb2.INSTANCE_STATE_DRAINING,
                in_flight=min(core.in_flight, 1_000_000),
                model_calls_in_flight=load.in_flight,
                model_slots_free=load.free,
            )
            try:
                await self._registry.Heartbeat(report, timeout=_REGISTRY_CALL_TIMEOUT)
            except grpc.aio.AioRpcError as failure:
                _log.warning("could not report draining: %s", ReachError.from_rpc_error(failure))
        _log.info("draining: instance %s, %d in flight", self.instance_id, core.in_flight)
        idle = asyncio.ensure_future(core.idle.wait())
        abandon = asyncio.ensure_future(core.abandon.wait())
        try:
            await asyncio.wait((idle, abandon), timeout=core.config.max_drain, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            abandon.cancel()
        if core.in_flight:
            _log.warning(
                "drain time exceeded; abandoning in-flight work: instance %s, %d in flight",
                self.instance_id,
                core.in_flight,
            )
        if lease_id is not None:
            request = registry_service_pb2.DeregisterRequest(instance_id=self.instance_id, lease_id=lease_id)
            try:
                await self._registry.Deregister(request, timeout=_REGISTRY_CALL_TIMEOUT)
            except grpc.aio.AioRpcError as failure:
                _log.warning(
                    "could not deregister; the lease will expire: %s", ReachError.from_rpc_error(failure)
                )
        await asyncio.sleep(_LINGER_AFTER_DEREGISTER)
        await self._server.stop(grace=_SERVER_GRACE_AFTER_DRAIN)
        core.abandon_runs()
        await self._registry_channel.close()
        _log.info("agent stopped: instance %s", self.instance_id)


# === the handling core, shared by every RPC ===


@dataclass
class _Core:
    config: AgentConfig
    instance_id: str
    handlers: dict[str, Handler]
    stream_handlers: dict[str, StreamHandler]
    model_slots: ModelSlots
    in_flight: int = 0
    draining: bool = False
    #: Set when draining begins: multiplexed streams stop reading calls, answer what they
    #: read and end.
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set while nothing is in flight; a drain waits for it.
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set by a second signal: the drain stops waiting for in-flight work.
    abandon: asyncio.Event = field(default_factory=asyncio.Event)
    #: The handler runs under way (they outlive their callers); kept so they are not
    #: garbage-collected, and cancelled when the agent stops.
    runs: set[asyncio.Task[_Outcome]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.source = f"{self.config.service}.{self.instance_id}"
        #: Who may call this agent (the routers, whose ``x-reach-caller`` is believed): only
        #: when serving TLS.
        tls = self.config.tls
        self.callers: DirectCallers | None = (
            self.config.direct_callers() if tls is not None and tls.cert is not None else None
        )
        self.permits = asyncio.Semaphore(self.config.max_concurrency)
        self.dedupe: DedupeCache[_Outcome] = DedupeCache(
            self.config.dedupe_window, self.config.dedupe_capacity, self.config.dedupe_max_bytes
        )
        self.idle.set()

    # --- accounting ---

    @contextlib.contextmanager
    def entered(self) -> Any:
        """Counts one message (or stream) in flight for the body; the last one out sets
        :attr:`idle`."""
        self.in_flight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    def _finished(self, run: asyncio.Task[_Outcome]) -> None:
        self.runs.discard(run)
        # A run whose caller went away has nobody to read its outcome; a message that never
        # got a slot (_NotHandled) is not an error worth reporting.
        if not run.cancelled() and not isinstance(run.exception(), (_NotHandled, type(None))):
            _log.error("handler run failed: %s", run.exception())

    def abandon_runs(self) -> None:
        for run in list(self.runs):
            run.cancel()

    # --- refusals ---

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise ReachError(
                grpc.StatusCode.UNAVAILABLE,
                f"instance {self.instance_id} is draining and takes no new work; send it elsewhere",
                Reason.INSTANCE_DRAINING,
                {"instance_id": self.instance_id},
            )

    def pick(self, handlers: Mapping[str, Any], message: envelope_pb2.ReachMessage) -> Any:
        """The handler for ``message``: by the addressed capability, else (service-addressed)
        by the payload type when it names a capability, else the only handler there is.

        Raises:
            ReachError: UNIMPLEMENTED / ``CAPABILITY_NOT_HANDLED``, listing what it handles.
        """
        header = message.header
        wanted: str | None
        if header.WhichOneof("target") == "capability":
            wanted = header.capability
        else:
            wanted = message.payload.type if message.payload.type in handlers else None
        if wanted is not None:
            found = handlers.get(wanted)
        else:
            found = next(iter(handlers.values())) if len(handlers) == 1 else None
        if found is None:
            what = f"capability {wanted!r}" if wanted is not None else "this message (address a capability)"
            raise ReachError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"instance {self.instance_id} has no handler for {what}; it handles: "
                + ", ".join(sorted(handlers)),
                Reason.CAPABILITY_NOT_HANDLED,
            )
        return found

    # --- envelopes ---

    def reply(
        self, request: envelope_pb2.Header, payload: Payload, metadata: Mapping[str, str]
    ) -> envelope_pb2.ReachMessage:
        """The reply envelope for ``payload``, answering ``request``: same trace and task,
        ``correlation_id`` = the request's id, ``turn`` one more.

        Raises:
            PartError: a data part is not JSON.
        """
        return envelope_pb2.ReachMessage(
            header=envelope_pb2.Header(
                message_id=new_message_id(),
                trace_id=request.trace_id,
                task_id=request.task_id,
                source=self.source,
                protocol_version=self.config.protocol_version,
                created_at=_grpc.now(),
                correlation_id=request.message_id,
                turn=min(request.turn + 1, 2**32 - 1),
                metadata=metadata,
            ),
            payload=payload.to_proto(),
        )

    def context(
        self,
        message: envelope_pb2.ReachMessage,
        deadline: float | None,
        metadata: Mapping[str, str],
        peer: str | None = None,
    ) -> HandlerContext:
        """The handler context of ``message``; ``peer`` is the connection's client identity
        (:func:`reach_mesh.trust.peer_identity`), which decides whether ``x-reach-caller`` in
        ``metadata`` is believed."""
        caller = vouched_caller(self.callers.routers if self.callers is not None else (), peer, metadata)
        return HandlerContext(Message(message), self.instance_id, deadline, metadata, self.model_slots, caller)

    def peer(self, context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
        """The SPIFFE ID of ``context``'s client certificate; ``None`` when not serving TLS."""
        return peer_identity(context) if self.callers is not None else None

    # --- handling one message ---

    async def handle(
        self,
        message: envelope_pb2.ReachMessage,
        deadline: float | None,
        metadata: Mapping[str, str],
        cancelled: asyncio.Event | None,
        peer: str | None = None,
    ) -> envelope_pb2.ReachMessage:
        """Handles one message (Handle, and each HandleMux call) and returns the reply.

        ``cancelled`` is a multiplexed call's cancel (its caller gave up): when it fires, or
        the deadline passes, the handler is told (its context's cancellation) and this returns
        only once the handler has finished, so the router counts the call against this
        instance while its handler runs. A unary Handle (``None``) answers at the deadline at
        once.

        Raises:
            ReachError: the outcome's error, PAYLOAD_TOO_LARGE, CAPABILITY_NOT_HANDLED,
                DEADLINE_EXCEEDED, CANCELLED.
        """
        size = message.ByteSize()
        if size > self.config.max_message_bytes:
            raise _too_large("message", size, self.config.max_message_bytes)
        handler: Handler = self.pick(self.handlers, message)
        ctx = self.context(message, deadline, metadata, peer)
        run = asyncio.ensure_future(self._run(handler, ctx, message))
        self.runs.add(run)
        run.add_done_callback(self._finished)
        waited: set[asyncio.Future[Any]] = {run}
        cancel_wait = asyncio.ensure_future(cancelled.wait()) if cancelled is not None else None
        if cancel_wait is not None:
            waited.add(cancel_wait)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait(waited, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # The RPC went away (reset, or grpcio's own deadline): the handler is told and
            # may finish; its outcome is remembered for a redelivery.
            ctx.cancel()
            raise
        finally:
            if cancel_wait is not None:
                cancel_wait.cancel()
        if run.done():
            return self._outcome(run)
        ctx.cancel()
        settle = cancelled is not None
        if settle:
            # A multiplexed call answers once its handler has finished.
            await asyncio.wait((run,))
        if cancelled is not None and cancelled.is_set():
            raise ReachError(
                grpc.StatusCode.CANCELLED,
                "the caller cancelled the call; the handler was told and has finished",
            )
        raise ReachError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "the caller's deadline passed before the handler finished",
            Reason.DEADLINE_EXCEEDED,
        )

    @staticmethod
    def _outcome(run: asyncio.Task[_Outcome]) -> envelope_pb2.ReachMessage:
        try:
            outcome = run.result()
        except _NotHandled as not_handled:
            raise not_handled.error from None
        if isinstance(outcome, ReachError):
            raise outcome
        return outcome

    async def _run(self, handler: Handler, ctx: HandlerContext, message: envelope_pb2.ReachMessage) -> _Outcome:
        """The deduplicated run: counted in flight until the handler returns (even after the
        caller went away; a drain waits for it)."""
        with self.entered():
            message_id = message.header.message_id
            if not message_id:
                return await self._attempt(handler, ctx, message)
            slot = self.dedupe.slot(_dedupe_key(ctx.caller, message_id))
            return await slot.get_or_init(lambda: self._attempt(handler, ctx, message))

    async def _attempt(self, handler: Handler, ctx: HandlerContext, message: envelope_pb2.ReachMessage) -> _Outcome:
        """Takes a handler slot (waiting until one frees, or until the caller gives up:
        :class:`_NotHandled`), runs the handler and charges its outcome to the dedupe memory."""
        if self.permits.locked():
            acquire = asyncio.ensure_future(self.permits.acquire())
            gone = asyncio.ensure_future(ctx.cancelled())
            await asyncio.wait((acquire, gone), return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not acquire.done() or acquire.cancelled():
                acquire.cancel()
                raise _NotHandled(
                    ReachError(
                        grpc.StatusCode.CANCELLED,
                        "the caller gave up while the message waited for a handler slot; it was not handled",
                    )
                )
        else:
            await self.permits.acquire()
        if ctx.is_cancelled():
            # The caller gave up while the slot was being taken (both can become ready in the
            # same turn of the loop): the message is not handled.
            self.permits.release()
            raise _NotHandled(
                ReachError(
                    grpc.StatusCode.CANCELLED,
                    "the caller gave up while the message waited for a handler slot; it was not handled",
                )
            )
        try:
            outcome = await self._call(handler, ctx, message)
        finally:
            self.permits.release()
        if message.header.message_id:
            cost = outcome.ByteSize() if isinstance(outcome, envelope_pb2.ReachMessage) else (
                len(outcome.message.encode()) + len(outcome.details_bytes())
            )
            self.dedupe.charge(_dedupe_key(ctx.caller, message.header.message_id), _DEDUPE_ENTRY_OVERHEAD + cost)
        return outcome

    async def _call(self, handler: Handler, ctx: HandlerContext, message: envelope_pb2.ReachMessage) -> _Outcome:
        """Runs the handler and builds its reply envelope; every failure becomes an outcome
        (remembered like replies): the handler's :class:`ReachError` (see
        :func:`_handler_outcome`), INTERNAL for any other exception, for content that cannot
        be sent (data deeper than :data:`~reach_mesh.parts.MAX_DATA_DEPTH`, not JSON, not
        encodable), and PAYLOAD_TOO_LARGE for a reply over ``max_message_bytes``."""
        try:
            result = handler(ctx, ctx.message)
            if inspect.isawaitable(result):
                result = await result
        except ReachError as error:
            return _handler_outcome(error)
        except PartError as error:
            # data_part() and friends refused what the handler was building its reply from.
            return _unsendable_reply(ctx.capability, error)
        except Exception:
            return _handler_failed(ctx.capability or "the service", ctx.trace_id)
        try:
            reply = self.reply(message.header, Payload.of(result), ctx.take_reply_metadata())
            size = reply.ByteSize()
        except Exception as error:  # PartError, DataTooDeep, or protobuf's own refusal
            return _unsendable_reply(ctx.capability, error)
        if size > self.config.max_message_bytes:
            return _too_large("reply", size, self.config.max_message_bytes)
        return reply


# === reach.v1.AgentService ===


def _request_metadata(context: grpc.aio.ServicerContext[Any, Any]) -> dict[str, str]:
    """A unary or streaming call's text metadata (``traceparent``, ``x-*``, ...)."""
    return {key: value for key, value in (context.invocation_metadata() or ()) if isinstance(value, str)}


def _deadline(context: grpc.aio.ServicerContext[Any, Any]) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class _AgentServicer(agent_service_pb2_grpc.AgentServiceServicer):
    """The ``reach.v1.AgentService`` face of the runtime."""

    def __init__(self, core: _Core) -> None:
        self._core = core

    async def Handle(
        self, request: agent_service_pb2.HandleRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> agent_service_pb2.HandleResponse:
        core = self._core
        try:
            core.refuse_if_draining()
            if not request.HasField("message"):
                raise ReachError(grpc.StatusCode.INVALID_ARGUMENT, "the request has no message")
            reply = await core.handle(
                request.message, _deadline(context), _request_metadata(context), None, core.peer(context)
            )
        except ReachError as error:
            await _abort(context, error)
            raise AssertionError("unreachable: abort raises") from None
        try:
            return agent_service_pb2.HandleResponse(message=reply)
        except Exception as error:  # the reply cannot be copied into the response
            await _abort(context, _unsendable_reply(request.message.header.capability, error))
            raise AssertionError("unreachable: abort raises") from None

    async def HandleMux(
        self, request_iterator: AsyncIterator[agent_service_pb2.HandleMuxRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[agent_service_pb2.HandleMuxResponse]:
        try:
            self._core.refuse_if_draining()
        except ReachError as error:
            await _abort(context, error)
        # The caller sends its first frame once the stream's headers are answered.
        await context.send_initial_metadata(())
        session = _MuxSession(self._core, context)
        async for reply in session.serve():
            yield reply
        if session.end is not None:
            await _abort(context, session.end)

    async def HandleStream(
        self, request_iterator: AsyncIterator[agent_service_pb2.HandleStreamRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[agent_service_pb2.HandleStreamResponse]:
        core = self._core
        try:
            core.refuse_if_draining()
            first = await _read_stream(context)
            if first is grpc.aio.EOF or not first.HasField("message"):
                raise ReachError(grpc.StatusCode.INVALID_ARGUMENT, "the stream closed before its first message")
            handler: StreamHandler = core.pick(core.stream_handlers, first.message)
        except ReachError as error:
            await _abort(context, error)
            return
        ctx = core.context(first.message, _deadline(context), _request_metadata(context), core.peer(context))
        # Each reply answers the latest message the handler has read: the first, until it
        # reads another.
        answering = [first.message.header]

        async def rest() -> AsyncIterator[Message]:
            while True:
                item = await _read_stream(context)
                if item is grpc.aio.EOF:
                    return
                answering[0] = item.message.header
                yield Message(item.message)

        failure: ReachError | None = None
        with core.entered():
            try:
                async for result in handler(ctx, ctx.message, rest()):
                    try:
                        reply = core.reply(answering[0], Payload.of(result), ctx.take_reply_metadata())
                        response = agent_service_pb2.HandleStreamResponse(message=reply)
                    except Exception as error:  # PartError, DataTooDeep, protobuf's own refusal
                        failure = _unsendable_reply(ctx.capability, error)
                        break
                    yield response
            except ReachError as error:
                failure = _handler_outcome(error)
            except PartError as error:
                failure = _unsendable_reply(ctx.capability, error)
            except Exception as error:
                if isinstance(error, grpc.aio.AbortError):
                    raise
                failure = _handler_failed(ctx.capability, ctx.trace_id)
            finally:
                ctx.cancel()
        if failure is not None:
            await _abort(context, failure)


async def _read_stream(context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    """The next request of a HandleStream RPC; ``grpc.aio.EOF`` once the caller half-closed.

    Raises:
        ReachError: INVALID_ARGUMENT when the request cannot be decoded.
        grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.CancelledError: the caller went
            away.
    """
    try:
        return await context.read()
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.CancelledError):
        raise
    except Exception as error:  # the request deserializer's (DecodeError)
        raise ReachError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a message on the stream could not be decoded ({_undecodable(error)}); send "
            "HandleStreamRequests whose data nests at most "
            f"{MAX_DATA_DEPTH} levels (MAX_DATA_DEPTH)",
        ) from None


def _undecodable(error: Exception) -> str:
    """Why a request could not be decoded, for a status message."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class _MuxSession:
    """The calls of one HandleMux stream (the callee's side of ``reach_rpc::mux::serve``):
    every call frame runs as its own task and is answered as it finishes, in completion
    order; a cancel frame tells the call's handler and the call answers once it stopped; at
    most :data:`MAX_OPEN_CALLS_PER_STREAM` calls are open (answered or acknowledged) at once.
    Every call read gets exactly one answer.

    The session stops reading frames, answers every call it read, and ends the stream with a
    status when the agent drains (UNAVAILABLE / ``INSTANCE_DRAINING``) or a frame cannot be
    decoded (INVALID_ARGUMENT / ``INVALID_FRAME``): calls without a reply were not read, so
    the caller may send them again or elsewhere."""

    def __init__(self, core: _Core, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self._core = core
        self._context = context
        #: The connection's client identity: every call on the stream comes from it.
        self._peer = core.peer(context)
        # Bounded: a caller that stops reading replies stops the reading of its frames too.
        self._replies: asyncio.Queue[agent_service_pb2.HandleMuxResponse | None] = asyncio.Queue(
            MAX_OPEN_CALLS_PER_STREAM
        )
        # call id -> (the call's task, its cancel event)
        self._open: dict[int, tuple[asyncio.Task[None], asyncio.Event]] = {}
        #: Calls accepted and not yet answered (counted until their reply is queued).
        self._unanswered = 0
        #: The status the stream ends with, when not OK.
        self.end: ReachError | None = None

    async def serve(self) -> AsyncIterator[agent_service_pb2.HandleMuxResponse]:
        reader = asyncio.ensure_future(self._read())
        try:
            while True:
                reply = await self._replies.get()
                if reply is None:
                    return
                yield reply
        finally:
            reader.cancel()
            for task, _ in self._open.values():
                task.cancel()

    @staticmethod
    def _refusal(call_id: int, error: ReachError) -> agent_service_pb2.HandleMuxResponse:
        return agent_service_pb2.HandleMuxResponse(
            frame=mux_pb2.ReplyFrame(call_id=call_id, error=error.to_call_error())
        )

    async def _read(self) -> None:
        """Reads frames and starts or cancels calls until the caller half-closes, the agent
        drains or a frame cannot be decoded; then waits for the calls read to be answered and
        ends the reply stream. Ends at once when the caller went away. Never dies silently:
        an unexpected failure ends the stream with INTERNAL."""
        try:
            await self._read_frames()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            _log.exception("multiplexed stream failed; ending it")
            self._gone()
            self.end = ReachError(
                grpc.StatusCode.INTERNAL,
                f"the callee failed while reading this stream ({type(error).__name__}: {error}); calls "
                "without a reply may or may not have been handled",
            )
            await self._replies.put(None)

    def _gone(self) -> None:
        """Stops every open call (their handlers are told); nobody will read their replies."""
        for task, _ in self._open.values():
            task.cancel()

    async def _read_frames(self) -> None:
        core = self._core
        closing = asyncio.ensure_future(core.closing.wait())
        read: asyncio.Future[Any] | None = None
        try:
            while True:
                read = asyncio.ensure_future(self._context.read())
                await asyncio.wait((read, closing), return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    # Draining: no further frame is read; the calls read are answered, then
                    # the stream ends saying the rest were not handled.
                    self.end = ReachError(
                        grpc.StatusCode.UNAVAILABLE,
                        "the callee is shutting down and read no more calls from this stream; "
                        "calls without a reply were not handled, send them elsewhere",
                        Reason.INSTANCE_DRAINING,
                    )
                    break
                try:
                    request = read.result()
                except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.CancelledError):
                    # The caller went away: its open calls stop (their handlers are told).
                    self._gone()
                    with contextlib.suppress(asyncio.QueueFull):
                        self._replies.put_nowait(None)
                    return
                except Exception as error:  # the request deserializer's (DecodeError)
                    # Its call id is unknown, so it cannot be refused alone: no further frame
                    # is read; the calls read are answered, then the stream ends saying the
                    # rest were not handled.
                    why = _undecodable(error)
                    _log.warning("a HandleMux frame could not be decoded; ending the stream: %s", why)
                    self.end = ReachError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"a frame on this stream could not be decoded ({why}); send HandleMuxRequests "
                        f"whose data nests at most {MAX_DATA_DEPTH} levels (MAX_DATA_DEPTH). No frame "
                        "after it was read: calls without a reply were not handled, send them again",
                        Reason.INVALID_FRAME,
                    )
                    break
                if request is grpc.aio.EOF:
                    break
                refusal = self._accept(request.frame)
                if refusal is not None:
                    await self._replies.put(refusal)
            while self._open:
                await asyncio.wait([task for task, _ in self._open.values()])
            await self._replies.put(None)
        finally:
            closing.cancel()
            if read is not None and not read.done():
                read.cancel()

    def _accept(self, frame: mux_pb2.CallFrame) -> agent_service_pb2.HandleMuxResponse | None:
        """Starts the call ``frame`` starts, or cancels the one it cancels; returns the
        refusal to send instead when the frame cannot start a call."""
        call_id = frame.call_id
        if frame.cancel:
            # The call stays open until it has stopped and its answer is on its way.
            call = self._open.get(call_id)
            if call is not None:
                call[1].set()
            return None
        if call_id in self._open:
            return self._refusal(
                call_id,
                ReachError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"call_id {call_id} is already open on this stream; use a new id per call "
                    "(the open call still gets its own reply)",
                    Reason.CALL_ID_IN_USE,
                    {"call_id": str(call_id)},
                ),
            )
        if self._unanswered >= MAX_OPEN_CALLS_PER_STREAM:
            # Not read into a handler: safe to send elsewhere or again later.
            return self._refusal(
                call_id,
                ReachError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{MAX_OPEN_CALLS_PER_STREAM} calls are already open on this stream; the call "
                    "was not handled: retry after the hint, or wait for replies",
                    Reason.OVERLOADED,
                    {"max_open_calls": str(MAX_OPEN_CALLS_PER_STREAM)},
                    retry_after=_OVERLOADED_RETRY_AFTER,
                ),
            )
        size = _grpc.metadata_bytes(dict(frame.metadata))
        if size > _grpc.MAX_CALL_METADATA_BYTES:
            return self._refusal(
                call_id,
                ReachError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"call {call_id}'s metadata is {size} bytes, over the limit of "
                    f"{_grpc.MAX_CALL_METADATA_BYTES} bytes; put large values in the message",
                    Reason.PAYLOAD_TOO_LARGE,
                    {"size_bytes": str(size), "limit_bytes": str(_grpc.MAX_CALL_METADATA_BYTES)},
                ),
            )
        if not frame.HasField("message"):
            return self._refusal(
                call_id,
                ReachError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the frame for call_id {call_id} carries no message and is not a cancel (an "
                    'empty frame?); send {"call_id": N, "message": {...}} to start a call or '
                    '{"call_id": N, "cancel": true} to cancel one',
                    Reason.INVALID_FRAME,
                    {"call_id": str(call_id)},
                ),
            )
        cancel = asyncio.Event()
        deadline = time.monotonic() + frame.timeout_ms / 1000 if frame.timeout_ms else None
        self._unanswered += 1
        task = asyncio.ensure_future(self._call(call_id, frame, deadline, cancel))
        self._open[call_id] = (task, cancel)
        return None

    async def _call(self, call_id: int, frame: mux_pb2.CallFrame, deadline: float | None, cancel: asyncio.Event) -> None:
        """Handles one call and queues its one answer: the reply, or its error — INTERNAL
        when the reply cannot be put in a frame, or handling failed unexpectedly, so that the
        caller (which counts the call against ``max_concurrency`` until it is answered) never
        waits for an answer that cannot come."""
        try:
            try:
                self._core.refuse_if_draining()
                reply = await self._core.handle(frame.message, deadline, dict(frame.metadata), cancel, self._peer)
                response = agent_service_pb2.HandleMuxResponse(
                    frame=mux_pb2.ReplyFrame(call_id=call_id, reply=reply)
                )
            except ReachError as error:
                response = self._refusal(call_id, error)
            except Exception as error:  # DecodeError copying the reply, or a bug
                _log.exception("call %d on a multiplexed stream could not be answered with its reply", call_id)
                response = self._refusal(
                    call_id,
                    ReachError(
                        grpc.StatusCode.INTERNAL,
                        f"the handler's reply cannot be sent: {type(error).__name__}: {error}",
                    ),
                )
            # The id is closed before the reply goes, so the caller may reuse it once the
            # reply arrives.
            self._open.pop(call_id, None)
            await self._replies.put(response)
        finally:
            self._open.pop(call_id, None)
            self._unanswered -= 1
