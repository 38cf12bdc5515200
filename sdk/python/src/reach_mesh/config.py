"""Agent settings: :class:`AgentConfig`, with the Rust SDK's defaults (``reach_sdk::AgentConfig``).
Durations are in seconds, sizes in bytes."""

from __future__ import annotations

from dataclasses import dataclass, field

from reach_mesh.capability import is_name
from reach_mesh.trust import DEFAULT_TRUST_DOMAIN, DirectCallers, TlsConfig

__all__ = ["AgentConfig"]

#: The most topics, and the most labels, an instance may declare (the registry's bound).
_MAX_LIST = 256
#: The most bytes of label keys and values an instance may declare (the registry's bound).
_MAX_LABEL_BYTES = 16 * 1024


@dataclass
class AgentConfig:
    """How an agent registers and behaves.

    Attributes:
        service: the service its instances share (``executor.servicing``); required.
        registry_endpoint: the registry to register with (``http://127.0.0.1:7070``).
        instance_id: this instance's id; empty means ``<service>-<8 random hex>``.
        advertise_host: the host the router should dial; empty means the address the agent
            listens on.
        protocol_version: the protocol version this agent speaks.
        max_concurrency: messages handled at once (default 8); more wait for a slot within
            their deadline, and the router sends at most this many at once.
        max_drain: the longest a drain waits for in-flight work, in seconds.
        lease_ttl: the lease to ask for, in seconds; heartbeats go every third of the
            granted lease.
        dedupe_window: how long a handled message id is remembered, in seconds, so a
            redelivery gets the first reply instead of running the handler again.
        dedupe_capacity: the most message ids remembered at once.
        dedupe_max_bytes: the most bytes of remembered outcomes (encoded replies); past it the
            oldest ids are forgotten first, and a reply larger than it is not remembered.
        weight: the relative weight for weighted balancing.
        topics: topics to subscribe to (``RouterService.Publish``).
        labels: free-form labels shown by ``reach agents``.
        max_message_bytes: the largest message accepted or reply sent, in encoded bytes;
            larger ones are refused with ``PAYLOAD_TOO_LARGE``.
        model_slots: how many model (LLM) calls run at once (:class:`reach_mesh.ModelSlots`);
            heartbeats report the model's load and the instance reports BUSY while every slot
            is taken. 0: unlimited and unreported.
        trust_domain: the mesh's SPIFFE trust domain (default ``reach.local``): the router
            whose ``x-reach-caller`` is believed is ``spiffe://<trust_domain>/router``.
        tls: this agent's certificate (``spiffe://<trust_domain>/agent/<service>``), key and
            the mesh CA (:class:`reach_mesh.TlsConfig`). When set, the agent serves TLS
            requiring client certificates of the CA, registers over TLS presenting its
            certificate (whatever the registry endpoint's scheme), and reads the caller the
            router verified (:attr:`reach_mesh.HandlerContext.caller`). With ``ca`` alone (an
            agent registering with a :attr:`join_token` instead of a certificate) it
            registers over TLS but serves plaintext, which only a router dialling instances
            in plaintext can reach. ``None``: plaintext.
        join_token: a join token (``reach token join``), sent as ``authorization: Bearer``
            on Register only (heartbeats authenticate with the lease), for an agent without a
            certificate of its service; ``""`` sends none. A one-time token registers once:
            an agent that must register again (after a registry restart) needs a reusable one.
        router_identities: when the agent serves TLS, the SPIFFE IDs that may call it (its
            AgentService, reflection, health) and whose ``x-reach-caller`` is believed; every
            other peer is refused PERMISSION_DENIED / ``NOT_AUTHORIZED``, so the router's call
            policy cannot be skipped by dialling the agent (:class:`reach_mesh.DirectCallers`).
            Empty (the default): ``spiffe://<trust_domain>/router``.
        probe_identities: when the agent serves TLS, the SPIFFE IDs that may call
            ``grpc.health.v1`` besides the routers. Empty (the default):
            ``spiffe://<trust_domain>/registry``, whose health probe makes an instance READY.
    """

    service: str
    registry_endpoint: str = "http://127.0.0.1:7070"
    instance_id: str = ""
    advertise_host: str = ""
    protocol_version: str = "1.0"
    max_concurrency: int = 8
    max_drain: float = 30.0
    lease_ttl: float = 10.0
    dedupe_window: float = 300.0
    dedupe_capacity: int = 100_000
    dedupe_max_bytes: int = 64 * 1024 * 1024
    weight: int = 1
    topics: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    max_message_bytes: int = 4 * 1024 * 1024
    model_slots: int = 0
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    tls: TlsConfig | None = None
    join_token: str = ""
    router_identities: list[str] = field(default_factory=list)
    probe_identities: list[str] = field(default_factory=list)

    def direct_callers(self) -> DirectCallers:
        """Who may call this agent directly when it serves TLS (:attr:`router_identities`,
        :attr:`probe_identities`, or their defaults).

        Raises:
            ValueError: an identity is not a SPIFFE ID of the trust domain.
        """
        return DirectCallers.of(self.trust_domain, self.router_identities, self.probe_identities)

    def validate(self) -> None:
        """Checks the settings, including what the registry would refuse (names, counts), so
        a bad setting fails the start instead of a registration retried forever.

        Raises:
            ValueError: naming the setting to fix.
        """
        if not is_name(self.service):
            raise ValueError(
                f"agent.service {self.service!r} must be a dotted name of ASCII letters, digits, "
                "'_' and '-' (for example \"executor.servicing\")"
            )
        if self.instance_id and (
            len(self.instance_id) > 256
            or not all("!" <= char <= "~" for char in self.instance_id)
        ):
            raise ValueError(
                f"agent.instance_id {self.instance_id!r} must be 1 to 256 printable ASCII "
                "characters without spaces"
            )
        if not self.registry_endpoint:
            raise ValueError("agent.registry_endpoint must be set (for example \"http://127.0.0.1:7070\")")
        for name, value, low in (
            ("max_concurrency", self.max_concurrency, 1),
            ("dedupe_capacity", self.dedupe_capacity, 1),
            ("max_message_bytes", self.max_message_bytes, 1),
            ("dedupe_max_bytes", self.dedupe_max_bytes, 0),
            ("model_slots", self.model_slots, 0),
            ("weight", self.weight, 0),
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"agent.{name} must be an integer of at least {low}, not {value!r}")
        for name, seconds in (
            ("lease_ttl", self.lease_ttl),
            ("max_drain", self.max_drain),
            ("dedupe_window", self.dedupe_window),
        ):
            if not seconds > 0:
                raise ValueError(f"agent.{name} must be above zero seconds, not {seconds!r}")
        if len(self.topics) > _MAX_LIST or len(self.labels) > _MAX_LIST:
            raise ValueError(f"an agent may declare at most {_MAX_LIST} topics and {_MAX_LIST} labels")
        for index, topic in enumerate(self.topics):
            if not is_name(topic):
                raise ValueError(f"agent.topics[{index}] {topic!r} must be a dotted name")
        if not self.trust_domain or not all(
            char.isascii() and (char.isalnum() or char in "-._") for char in self.trust_domain
        ):
            raise ValueError(
                f"agent.trust_domain {self.trust_domain!r} must be a DNS-like name (for example \"reach.local\")"
            )
        if self.tls is not None:
            self.tls.validate("agent.tls")
        self.direct_callers()
        token = self.join_token.strip()
        if token and not all("!" <= char <= "~" for char in token):
            raise ValueError("agent.join_token is not a valid token (it must be printable ASCII)")
        label_bytes = sum(len(k.encode()) + len(v.encode()) for k, v in self.labels.items())
        if label_bytes > _MAX_LABEL_BYTES:
            raise ValueError(
                f"agent.labels hold {label_bytes} bytes; the limit is {_MAX_LABEL_BYTES} "
                "(labels are for short metadata)"
            )
