"""Trust (the Rust ``reach_trust``'s agent and client side): :class:`TlsConfig` (the PEM files
of a SPIFFE certificate and the mesh CA), the gRPC credentials made from it, and how an agent
tells the caller the router verified (``x-reach-caller``) from a claim anyone could make."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc

from reach_mesh.errors import ReachError, Reason

__all__ = ["CALLER_METADATA", "DEFAULT_TRUST_DOMAIN", "DirectCallers", "TlsConfig"]

_audit = logging.getLogger("reach_mesh.audit")

#: The trust domain when none is configured (``reach_trust::DEFAULT_TRUST_DOMAIN``).
DEFAULT_TRUST_DOMAIN: Final = "reach.local"
#: The metadata key the router names a call's verified caller in.
CALLER_METADATA: Final = "x-reach-caller"


@dataclass(frozen=True)
class TlsConfig:
    """PEM files for TLS (as ``reach certs init`` writes them).

    Attributes:
        ca: the mesh CA certificate (``certs/ca.pem``): peers must chain to it.
        cert: this side's certificate chain (``certs/agent-<service>.pem``): an agent serves
            TLS with it and presents it to the registry. Without one (``None``) a side
            authenticates with a bearer token, where the mesh allows callers without a
            certificate (``client_auth = "optional"``).
        key: the certificate's private key (``certs/agent-<service>-key.pem``).
        server_name: the name the server's certificate must carry, instead of the host of
            the endpoint dialled. Certificates of ``reach certs init`` name ``localhost`` and
            ``127.0.0.1`` (plus any ``--host``); set this (for example ``"localhost"``) to
            reach the mesh at an address its certificate does not name. ``None``: the
            endpoint's host.
    """

    ca: str | Path
    cert: str | Path | None = None
    key: str | Path | None = None
    server_name: str | None = None

    def validate(self, where: str) -> None:
        """Checks the files are set and readable.

        Raises:
            ValueError: naming the setting (``where`` is its prefix, e.g. ``agent.tls``).
        """
        if (self.cert is None) != (self.key is None):
            raise ValueError(f"{where}.cert and {where}.key go together: set both or neither")
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{where}.{name}: {str(path)!r} is not a readable file")

    def _read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        return None if path is None else Path(path).read_bytes()

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials that trust the CA and present the certificate (when set)."""
        return grpc.ssl_channel_credentials(self._read("ca"), self._read("key"), self._read("cert"))

    def channel_options(self) -> list[tuple[str, Any]]:
        """Channel options of the TLS settings (the server name override)."""
        return [] if not self.server_name else [("grpc.ssl_target_name_override", self.server_name)]

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials that serve the certificate and require clients to present one of the
        CA."""
        cert, key = self._read("cert"), self._read("key")
        assert cert is not None and key is not None, "validate() first"
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=self._read("ca"), require_client_auth=True)


def router_identity(trust_domain: str) -> str:
    """The router's SPIFFE ID in ``trust_domain``."""
    return f"spiffe://{trust_domain}/router"


def registry_identity(trust_domain: str) -> str:
    """The registry's SPIFFE ID in ``trust_domain``."""
    return f"spiffe://{trust_domain}/registry"


def peer_identity(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    """The SPIFFE ID of the connection's client certificate: its one URI SAN, which grpcio
    verified chains to the CA and reports as ``peer_spiffe_id`` only when the certificate
    carries exactly one URI SAN and it is a SPIFFE ID (the X.509-SVID rule; host names play
    no part). ``None`` without one (a plaintext connection, or a certificate that is no
    SVID)."""
    for value in context.auth_context().get("peer_spiffe_id", ()):
        text = value.decode(errors="replace")
        if _is_spiffe_id(text):
            return text
    return None


#: The method path prefix of health checks.
_HEALTH_PREFIX: Final = "/grpc.health.v1.Health/"
#: The most characters of a refused method path a refusal repeats.
_MAX_PATH_ECHOED: Final = 128


@dataclass(frozen=True)
class DirectCallers:
    """Who may call an agent's port directly when it serves TLS (as the Rust SDK's
    ``reach_sdk::DirectCallers``): the router identities may call everything (AgentService,
    reflection, health), the probe identities (the registry) only ``grpc.health.v1``; anyone
    else is refused PERMISSION_DENIED with ErrorInfo ``NOT_AUTHORIZED``, so the router's call
    policy cannot be skipped by dialling the agent. The peer is judged by its certificate's
    SPIFFE ID, once per RPC (a multiplexed stream, how routers call agents, is one RPC).

    Attributes:
        routers: SPIFFE IDs that may call everything; their ``x-reach-caller`` is believed.
        probes: SPIFFE IDs that may call ``grpc.health.v1`` besides the routers.
    """

    routers: tuple[str, ...]
    probes: tuple[str, ...]

    @classmethod
    def of(cls, trust_domain: str, routers: Iterable[str] = (), probes: Iterable[str] = ()) -> DirectCallers:
        """From the agent settings: ``routers`` and ``probes`` as SPIFFE IDs of
        ``trust_domain``, each empty meaning its default (``spiffe://<trust_domain>/router``,
        ``spiffe://<trust_domain>/registry``).

        Raises:
            ValueError: naming the setting whose value is not a SPIFFE ID of the trust domain.
        """

        def parse(setting: str, values: Iterable[str], default: str) -> tuple[str, ...]:
            parsed = tuple(values)
            if not parsed:
                return (default,)
            for value in parsed:
                if not _is_spiffe_id(value):
                    raise ValueError(
                        f"agent.{setting}: {value!r} is not a SPIFFE ID; give one like {default}"
                    )
                if value.removeprefix("spiffe://").partition("/")[0] != trust_domain:
                    raise ValueError(
                        f"agent.{setting}: {value!r} is not of the agent's trust domain "
                        f"{trust_domain!r}; peers of other trust domains never get past the TLS handshake"
                    )
            return parsed

        return cls(
            parse("router_identities", routers, router_identity(trust_domain)),
            parse("probe_identities", probes, registry_identity(trust_domain)),
        )

    def refusal(self, method: str, peer: str | None) -> ReachError | None:
        """Why ``peer`` (its SPIFFE ID; ``None``: no certificate) may not call ``method``
        (``/package.Service/Method``), or ``None`` when it may."""
        if peer is not None and peer in self.routers:
            return None
        health = method.startswith(_HEALTH_PREFIX)
        if health and peer is not None and peer in self.probes:
            return None
        routers = ", ".join(self.routers)
        if health:
            reason = (
                f"an agent's health is checked only by the registry ({', '.join(self.probes)}) and "
                f"the routers ({routers}); ask the registry (`reach agents`) how an instance is doing"
            )
        else:
            reason = (
                f"an agent answers only the mesh's routers ({routers}), so that the call policy "
                "cannot be skipped; send the call through a router (reach.v1.RouterService), or add "
                "the identity to the agent's router_identities if it is a router"
            )
        identity = peer if peer is not None else "anonymous"
        target = f"{method[:_MAX_PATH_ECHOED]} on this agent directly"
        return ReachError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{identity} may not call {target}: {reason}",
            Reason.NOT_AUTHORIZED,
            {"identity": identity, "action": "call", "target": target},
        )

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """A server interceptor that refuses every RPC :meth:`refusal` refuses (before the
        handler runs), recording each refusal on the ``reach_mesh.audit`` logger."""
        return _DirectCallersOnly(self)


_Check = Callable[[grpc.aio.ServicerContext[Any, Any]], Awaitable[None]]


class _DirectCallersOnly(grpc.aio.ServerInterceptor):
    """Wraps every method handler in a check of the peer's identity (:class:`DirectCallers`)."""

    def __init__(self, callers: DirectCallers) -> None:
        self._callers = callers

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method: str = handler_call_details.method
        callers = self._callers

        async def check(context: grpc.aio.ServicerContext[Any, Any]) -> None:
            refusal = callers.refusal(method, peer_identity(context))
            if refusal is not None:
                _audit.warning(
                    "denied: %s",
                    refusal.message,
                    extra={
                        "who": refusal.metadata["identity"],
                        "action": "call",
                        "target": refusal.metadata["target"],
                        "decision": "denied",
                        "reason": refusal.message,
                    },
                )
                await context.abort(refusal.code, refusal.message, trailing_metadata=refusal.trailing_metadata())

        return _guarded(handler, check)


async def _result(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _relay(value: Any) -> AsyncIterator[Any]:
    """The responses of a streaming handler's ``value``: an (async) iterator's items; nothing
    for a coroutine that writes with ``context.write`` (it is awaited)."""
    if hasattr(value, "__aiter__"):
        async for item in value:
            yield item
    elif inspect.isawaitable(value):
        await value
    elif value is not None:
        for item in value:
            yield item


def _guarded(handler: grpc.RpcMethodHandler[Any, Any], check: _Check) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with ``check`` awaited before its behaviour runs."""
    serializers: dict[str, Any] = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        unary_unary: Any = handler.unary_unary

        async def checked_unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await check(context)
            return await _result(unary_unary(request, context))

        return grpc.unary_unary_rpc_method_handler(checked_unary_unary, **serializers)
    if handler.unary_stream is not None:
        unary_stream: Any = handler.unary_stream

        async def checked_unary_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            await check(context)
            async for item in _relay(unary_stream(request, context)):
                yield item

        return grpc.unary_stream_rpc_method_handler(checked_unary_stream, **serializers)
    if handler.stream_unary is not None:
        stream_unary: Any = handler.stream_unary

        async def checked_stream_unary(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await check(context)
            return await _result(stream_unary(requests, context))

        return grpc.stream_unary_rpc_method_handler(checked_stream_unary, **serializers)
    stream_stream: Any = handler.stream_stream
    assert stream_stream is not None

    async def checked_stream_stream(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        await check(context)
        async for item in _relay(stream_stream(requests, context)):
            yield item

    return grpc.stream_stream_rpc_method_handler(checked_stream_stream, **serializers)


def vouched_caller(routers: tuple[str, ...], peer: str | None, metadata: Mapping[str, str]) -> str | None:
    """The caller the router vouches for: the ``x-reach-caller`` value when the connection's
    peer is one of ``routers`` (the agent serves TLS), else ``None`` (anyone else could write
    it)."""
    if peer is None or peer not in routers:
        return None
    value = metadata.get(CALLER_METADATA)
    return value if value is not None and _is_spiffe_id(value) else None


def _is_spiffe_id(value: str) -> bool:
    rest = value.removeprefix("spiffe://")
    domain, _, path = rest.partition("/")
    return rest != value and bool(domain) and bool(path) and all("!" <= char <= "~" for char in value)
