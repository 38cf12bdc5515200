"""Trust (the Rust ``reach_trust``'s agent and client side): :class:`TlsConfig` (the PEM files
of a SPIFFE certificate and the mesh CA), the gRPC credentials made from it, and how an agent
tells the caller the router verified (``x-reach-caller``) from a claim anyone could make."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc

__all__ = ["CALLER_METADATA", "DEFAULT_TRUST_DOMAIN", "TlsConfig"]

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


def peer_identity(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    """The SPIFFE ID of the connection's client certificate (its URI SAN, which grpcio
    verified chains to the CA); ``None`` without one (a plaintext connection)."""
    properties = context.auth_context()
    for key in ("peer_spiffe_id", "peer_uri"):
        for value in properties.get(key, ()):
            text = value.decode(errors="replace")
            if text.startswith("spiffe://"):
                return text
    return None


def vouched_caller(router: str | None, peer: str | None, metadata: Mapping[str, str]) -> str | None:
    """The caller the router vouches for: the ``x-reach-caller`` value when the connection's
    peer is ``router`` (the agent serves TLS), else ``None`` (anyone else could write it)."""
    if router is None or peer != router:
        return None
    value = metadata.get(CALLER_METADATA)
    return value if value is not None and _is_spiffe_id(value) else None


def _is_spiffe_id(value: str) -> bool:
    rest = value.removeprefix("spiffe://")
    domain, _, path = rest.partition("/")
    return rest != value and bool(domain) and bool(path) and all("!" <= char <= "~" for char in value)
