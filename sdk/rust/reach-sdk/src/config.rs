//! Agent configuration.

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How an agent registers and behaves.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// The service name instances of this agent share (for example `executor.servicing`).
    pub service: String,
    /// This instance's id; empty means `<service>-<random>`.
    pub instance_id: String,
    /// The registry to register with (`http://127.0.0.1:7070`).
    pub registry_endpoint: String,
    /// The host the router should dial; empty means the listener's IP address.
    pub advertise_host: String,
    /// The protocol version this agent speaks.
    pub protocol_version: String,
    /// How many messages are handled at once; more wait (within their deadline). Default 8.
    pub max_concurrency: usize,
    /// The longest a drain waits for in-flight work before the process exits anyway.
    #[serde(with = "humantime_serde")]
    pub max_drain: Duration,
    /// The lease TTL to ask for; heartbeats go every third of the granted TTL.
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// How long a handled message id is remembered, so a redelivery gets the first reply
    /// instead of running the handler again.
    #[serde(with = "humantime_serde")]
    pub dedupe_window: Duration,
    /// The most message ids remembered at once.
    pub dedupe_capacity: usize,
    /// The most bytes of remembered replies (their encoded size); past it the oldest ids are
    /// forgotten first, and a reply larger than it is not remembered (0 remembers none).
    pub dedupe_max_bytes: usize,
    /// The relative weight for weighted balancing.
    pub weight: u32,
    /// Topics to subscribe to.
    pub topics: Vec<String>,
    /// Free-form labels shown by `reach agents`.
    pub labels: HashMap<String, String>,
    /// The largest message accepted or sent, in bytes.
    pub max_message_bytes: usize,
    /// How many model (LLM) calls this agent makes at once ([`crate::ModelSlots`]); heartbeats
    /// report the model's load and the instance reports BUSY while every slot is taken.
    /// 0 (the default): unlimited and unreported.
    pub model_slots: u32,
    /// Limits on the agent's own listener: connections at once, handshake time, bytes of
    /// partly received messages (see [`reach_rpc::ConnectionLimits`]).
    pub server: reach_rpc::ConnectionLimits,
    /// The mesh's SPIFFE trust domain (default `reach.local`).
    pub trust_domain: String,
    /// This agent's certificate (`spiffe://<trust-domain>/agent/<service>`), key and the mesh
    /// CA: when set, the agent serves TLS requiring client certificates of the CA, connects
    /// to the registry over TLS presenting it, and trusts `x-reach-caller` from the router
    /// (see [`crate::HandlerContext::caller`]). `None` (the default): plaintext.
    pub tls: Option<reach_trust::tls::TlsConfig>,
    /// A join token (`reach token join`), sent as `authorization: Bearer` on Register, for an
    /// agent without a certificate of its service; "" sends none. A one-time token registers
    /// once: an agent that must re-register (after a registry restart) needs a reusable one.
    pub join_token: String,
    /// When the agent serves TLS: the identities (SPIFFE IDs of the trust domain) that may call
    /// it — its AgentService, its own gRPC services, reflection — and whose `x-reach-caller`
    /// is believed. Everyone else is refused PERMISSION_DENIED / NOT_AUTHORIZED, so the
    /// router's call policy cannot be skipped by dialing the agent (see
    /// [`crate::callers`]). Empty (the default): `spiffe://<trust_domain>/router`.
    pub router_identities: Vec<String>,
    /// When the agent serves TLS: the identities that may call `grpc.health.v1` besides the
    /// routers. Empty (the default): `spiffe://<trust_domain>/registry`, whose first health
    /// probe makes an instance READY.
    pub probe_identities: Vec<String>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            service: String::new(),
            instance_id: String::new(),
            registry_endpoint: "http://127.0.0.1:7070".into(),
            advertise_host: String::new(),
            protocol_version: "1.0".into(),
            max_concurrency: 8,
            max_drain: Duration::from_secs(30),
            lease_ttl: Duration::from_secs(10),
            dedupe_window: Duration::from_secs(300),
            dedupe_capacity: 100_000,
            dedupe_max_bytes: 64 * 1024 * 1024,
            weight: 1,
            topics: Vec::new(),
            labels: HashMap::new(),
            max_message_bytes: 4 * 1024 * 1024,
            model_slots: 0,
            server: reach_rpc::ConnectionLimits::default(),
            trust_domain: reach_trust::DEFAULT_TRUST_DOMAIN.into(),
            tls: None,
            join_token: String::new(),
            router_identities: Vec::new(),
            probe_identities: Vec::new(),
        }
    }
}

impl AgentConfig {
    /// A config for `service` registering with `registry_endpoint`, defaults elsewhere.
    pub fn new(service: impl Into<String>, registry_endpoint: impl Into<String>) -> Self {
        Self {
            service: service.into(),
            registry_endpoint: registry_endpoint.into(),
            ..Self::default()
        }
    }

    /// Sets the instance id.
    pub fn with_instance_id(mut self, id: impl Into<String>) -> Self {
        self.instance_id = id.into();
        self
    }

    /// Sets the host the router dials (a pod IP or DNS name): needed when the agent
    /// listens on a wildcard address (`0.0.0.0`, `::`). Empty keeps the listener's address.
    pub fn with_advertise_host(mut self, host: impl Into<String>) -> Self {
        self.advertise_host = host.into();
        self
    }

    /// Serves and connects over TLS with `tls` (see [`AgentConfig::tls`]).
    pub fn with_tls(mut self, tls: reach_trust::tls::TlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Registers with `token` (see [`AgentConfig::join_token`]).
    pub fn with_join_token(mut self, token: impl Into<String>) -> Self {
        self.join_token = token.into();
        self
    }

    /// Sets the trust domain (see [`AgentConfig::trust_domain`]).
    pub fn with_trust_domain(mut self, domain: impl Into<String>) -> Self {
        self.trust_domain = domain.into();
        self
    }

    /// Sets the identities that may call this agent when it serves TLS (see
    /// [`AgentConfig::router_identities`]).
    pub fn with_router_identities(mut self, identities: Vec<String>) -> Self {
        self.router_identities = identities;
        self
    }

    /// Sets the concurrency limit.
    pub fn with_max_concurrency(mut self, n: usize) -> Self {
        self.max_concurrency = n;
        self
    }

    /// Sets the maximum drain time.
    pub fn with_max_drain(mut self, d: Duration) -> Self {
        self.max_drain = d;
        self
    }

    /// Sets how many model calls run at once ([`AgentConfig::model_slots`]).
    pub fn with_model_slots(mut self, n: u32) -> Self {
        self.model_slots = n;
        self
    }

    /// Sets the requested lease TTL.
    pub fn with_lease_ttl(mut self, d: Duration) -> Self {
        self.lease_ttl = d;
        self
    }

    /// Checks the settings.
    ///
    /// # Errors
    /// The first [`ConfigError`] found, naming the setting to fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.service.is_empty() {
            return Err(ConfigError::NoService);
        }
        if self.max_concurrency == 0 {
            return Err(ConfigError::NoConcurrency);
        }
        if self.lease_ttl.is_zero() {
            return Err(ConfigError::NoLeaseTtl);
        }
        self.server
            .validate(self.max_message_bytes, "agent.max_message_bytes")?;
        self.direct_callers()?;
        Ok(())
    }
}

impl AgentConfig {
    /// Who may call this agent directly when it serves TLS: [`AgentConfig::router_identities`]
    /// and [`AgentConfig::probe_identities`], or their defaults.
    ///
    /// # Errors
    /// [`ConfigError::CallerIdentity`] for an identity that is not a SPIFFE ID of the trust
    /// domain.
    pub fn direct_callers(&self) -> Result<crate::callers::DirectCallers, ConfigError> {
        Ok(crate::callers::DirectCallers::from_config(
            &self.trust_domain,
            &self.router_identities,
            &self.probe_identities,
        )?)
    }
}

/// An agent setting that cannot work, from [`AgentConfig::validate`]; its message names the
/// setting and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `agent.service` is empty.
    #[error("agent.service must be set (for example \"executor.servicing\")")]
    NoService,
    /// `agent.max_concurrency` is 0.
    #[error("agent.max_concurrency must be at least 1")]
    NoConcurrency,
    /// `agent.lease_ttl` is zero.
    #[error("agent.lease_ttl must be above zero")]
    NoLeaseTtl,
    /// An `agent.server.*` setting.
    #[error("agent.{0}")]
    Server(#[from] reach_rpc::limits::LimitsError),
    /// An `agent.router_identities` or `agent.probe_identities` entry (or the trust domain).
    #[error(transparent)]
    CallerIdentity(#[from] crate::callers::CallerIdentityError),
}
