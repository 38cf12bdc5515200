"""gRPC plumbing shared by the runtime and the client: endpoints, channels, limits, times."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import grpc
from google.protobuf import duration_pb2, timestamp_pb2

if TYPE_CHECKING:
    from reach_mesh.trust import TlsConfig

#: Bytes a multiplexed frame spends around its message (call id, deadline, metadata, tags):
#: a peer's frame limit is its message limit plus this (``reach_rpc::mux::FRAME_OVERHEAD_BYTES``).
FRAME_OVERHEAD_BYTES: Final = 16 * 1024
#: The most per-call metadata a multiplexed frame may carry, keys plus values, in bytes.
MAX_CALL_METADATA_BYTES: Final = 8 * 1024
#: HTTP/2 keepalive of the agent's server: a ping every 30 s, the connection closed when one
#: goes unanswered for 20 s (``reach_rpc::http2::KEEPALIVE_INTERVAL`` / ``KEEPALIVE_TIMEOUT``).
KEEPALIVE_OPTIONS: Final = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
)


def target_of(endpoint: str) -> tuple[str, bool]:
    """The grpcio target of ``endpoint`` and whether it uses TLS: ``http://host:port`` (as
    Reach writes endpoints) and a bare ``host:port`` are plaintext, ``https://host:port`` is
    TLS.

    Raises:
        ValueError: ``endpoint`` has another scheme, a path, or no port.
    """
    secure = endpoint.startswith("https://")
    rest = endpoint.split("://", 1)[1] if "://" in endpoint else endpoint
    if "://" in endpoint and not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"endpoint {endpoint!r} must be http://host:port or https://host:port")
    rest = rest.rstrip("/")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit() or "/" in rest:
        raise ValueError(
            f"endpoint {endpoint!r} must be host:port, http://host:port or https://host:port "
            "(for example http://127.0.0.1:7070)"
        )
    return rest, secure


#: Hosts grpcio's local credentials accept in plaintext.
_LOOPBACK: Final = frozenset({"127.0.0.1", "localhost", "[::1]"})


def channel(
    endpoint: str,
    options: Sequence[tuple[str, Any]] = (),
    *,
    tls: TlsConfig | None = None,
    token: str | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel to ``endpoint`` (see :func:`target_of`); create it inside the event
    loop that uses it. With ``tls`` it is TLS whatever the scheme (as Reach writes endpoints
    ``http://`` even where the mesh serves TLS), trusting ``tls.ca`` and presenting
    ``tls.cert``; an ``https://`` endpoint without it uses the system's roots. ``token`` goes
    as ``authorization: Bearer <token>`` on every call: over TLS, or in plaintext only to a
    loopback address (grpcio sends credentials nowhere else unencrypted).

    Raises:
        ValueError: ``endpoint`` is malformed.
    """
    target, secure = target_of(endpoint)
    # One channel per client: a separate subchannel pool keeps clients in one process from
    # sharing (and closing) each other's connections. Reconnects back off from 20 ms to at
    # most 1 s (grpcio's default grows to 120 s): a registry or router back from an outage is
    # reached within a second, so an agent registers again well within the routers' grace.
    merged = [
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.initial_reconnect_backoff_ms", 20),
        ("grpc.max_reconnect_backoff_ms", 1000),
        *options,
    ]
    credentials: grpc.ChannelCredentials | None = None
    if tls is not None:
        credentials = tls.channel_credentials()
        merged.extend(tls.channel_options())
    elif secure:
        credentials = grpc.ssl_channel_credentials()
    if token:
        if credentials is None and target.rpartition(":")[0] not in _LOOPBACK:
            raise ValueError(
                f"a bearer token goes only over TLS (set tls, or use https://) or to a loopback "
                f"address, not in plaintext to {target}"
            )
        bearer = grpc.access_token_call_credentials(token.strip())
        transport = credentials or grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        credentials = grpc.composite_channel_credentials(transport, bearer)
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options=merged)
    return grpc.aio.insecure_channel(target, options=merged)


def size_options(max_bytes: int) -> list[tuple[str, int]]:
    """Channel or server options that send and receive messages of up to ``max_bytes``."""
    return [
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes),
    ]


def now() -> timestamp_pb2.Timestamp:
    """The current time as a ``google.protobuf.Timestamp``."""
    stamp = timestamp_pb2.Timestamp()
    stamp.GetCurrentTime()
    return stamp


def duration(seconds: float) -> duration_pb2.Duration:
    """``seconds`` as a ``google.protobuf.Duration``."""
    value = duration_pb2.Duration()
    value.FromNanoseconds(round(seconds * 1e9))
    return value


def seconds(value: duration_pb2.Duration) -> float:
    """A ``google.protobuf.Duration`` in seconds."""
    return value.ToNanoseconds() / 1e9


def timeout_ms(timeout: float) -> int:
    """``timeout`` seconds in whole milliseconds, rounded up, at least 1 (0 means no
    deadline in a ``CallFrame``) and at most ``2**32 - 1``."""
    return min(max(1, math.ceil(timeout * 1000)), 2**32 - 1)


def metadata_bytes(metadata: dict[str, str]) -> int:
    """The bytes of per-call metadata, keys plus values (what the frame limit counts)."""
    return sum(len(key.encode()) + len(value.encode()) for key, value in metadata.items())
