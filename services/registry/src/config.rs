//! Registry configuration.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How the registry grants leases and probes instances.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegistryConfig {
    /// The lease time to live granted when an instance asks for none.
    #[serde(with = "humantime_serde")]
    pub default_lease_ttl: Duration,
    /// The shortest lease granted; shorter requests are raised to it.
    #[serde(with = "humantime_serde")]
    pub min_lease_ttl: Duration,
    /// The longest lease granted; longer requests are lowered to it.
    #[serde(with = "humantime_serde")]
    pub max_lease_ttl: Duration,
    /// How often expired leases are swept. Expiry is observed within this interval.
    #[serde(with = "humantime_serde")]
    pub sweep_interval: Duration,
    /// Whether a new instance must pass a `grpc.health.v1` probe before it becomes READY.
    /// When false, instances are READY as soon as they register.
    pub health_probe: bool,
    /// How long a single probe attempt may take.
    #[serde(with = "humantime_serde")]
    pub probe_timeout: Duration,
    /// The protocol registry file (`protocol-registry.yaml`) that declares the capabilities.
    /// Loaded whenever set: its descriptions, versions and input/output schemas are served by
    /// ListCapabilities (winning over what instances register), and strict mode checks
    /// registrations against it.
    pub protocol_registry: Option<std::path::PathBuf>,
    /// Strict mode: refuse a registration whose capability (or capability version) is not
    /// declared in `protocol_registry`. Needs `protocol_registry`.
    pub strict: bool,
    /// Where the instance table lives: `memory` (this process; the default, as `reach dev`
    /// runs it) or `etcd` (an etcd v3 cluster, shared by every registry replica).
    pub backend: Backend,
    /// The etcd cluster, when `backend = "etcd"`.
    pub etcd: EtcdConfig,
}

/// Where the registry keeps its instance table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// In this process's memory: lost when it stops; one replica.
    #[default]
    Memory,
    /// In etcd v3: instances are keys bound to etcd leases; any number of replicas.
    Etcd,
}

/// How the registry reaches etcd (`[registry.etcd]`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EtcdConfig {
    /// The etcd members' client URLs, e.g. `["http://127.0.0.1:2379"]` (`https://` with
    /// `tls`).
    pub endpoints: Vec<String>,
    /// The key prefix everything is kept under; registries that share it share one mesh.
    /// Must end with `/`.
    pub prefix: String,
    /// How long connecting to etcd may take (at start-up, the registry fails after it).
    #[serde(with = "humantime_serde")]
    pub dial_timeout: Duration,
    /// How long one etcd request may take.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// How often the HTTP/2 connection to etcd is pinged.
    #[serde(with = "humantime_serde")]
    pub keep_alive_interval: Duration,
    /// How long a ping may go unanswered before the connection is deemed dead.
    #[serde(with = "humantime_serde")]
    pub keep_alive_timeout: Duration,
    /// The TTL of a replica's liveness key: when a replica dies, the others take over its
    /// share of health probing within this (whole seconds, at least 2 s).
    #[serde(with = "humantime_serde")]
    pub replica_ttl: Duration,
    /// TLS to etcd: a CA to verify its members and, for client-certificate auth, a
    /// certificate and key.
    pub tls: Option<EtcdTls>,
}

/// TLS to etcd (`[registry.etcd.tls]`): PEM files.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdTls {
    /// The CA certificate(s) that sign the etcd members' certificates.
    pub ca: std::path::PathBuf,
    /// The client certificate (with `key`), for etcd's `--client-cert-auth`.
    pub cert: Option<std::path::PathBuf>,
    /// The client certificate's private key.
    pub key: Option<std::path::PathBuf>,
    /// The name the members' certificates carry, when it differs from the endpoints' host.
    pub domain: Option<String>,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        Self {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            prefix: "/reach/registry/".into(),
            dial_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(5),
            keep_alive_interval: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(5),
            replica_ttl: Duration::from_secs(3),
            tls: None,
        }
    }
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            default_lease_ttl: Duration::from_secs(10),
            min_lease_ttl: Duration::from_millis(100),
            max_lease_ttl: Duration::from_secs(300),
            sweep_interval: Duration::from_millis(50),
            health_probe: true,
            probe_timeout: Duration::from_secs(1),
            protocol_registry: None,
            strict: false,
            backend: Backend::Memory,
            etcd: EtcdConfig::default(),
        }
    }
}

impl RegistryConfig {
    /// Checks that the bounds are consistent.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the setting to fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.min_lease_ttl.is_zero() {
            return Err(ConfigError::ZeroMinLeaseTtl);
        }
        if self.min_lease_ttl > self.max_lease_ttl {
            return Err(ConfigError::LeaseBoundsCrossed {
                min: self.min_lease_ttl,
                max: self.max_lease_ttl,
            });
        }
        if self.default_lease_ttl < self.min_lease_ttl
            || self.default_lease_ttl > self.max_lease_ttl
        {
            return Err(ConfigError::DefaultLeaseOutOfBounds {
                default: self.default_lease_ttl,
                min: self.min_lease_ttl,
                max: self.max_lease_ttl,
            });
        }
        if self.strict && self.protocol_registry.is_none() {
            return Err(ConfigError::StrictWithoutProtocolRegistry);
        }
        if self.sweep_interval.is_zero() {
            return Err(ConfigError::ZeroSweepInterval);
        }
        if self.probe_timeout.is_zero() {
            return Err(ConfigError::ZeroProbeTimeout);
        }
        if self.backend == Backend::Etcd {
            self.etcd.validate()?;
        }
        Ok(())
    }

    /// The lease TTL granted for a request of `requested` (`None`: the default).
    pub fn grant(&self, requested: Option<Duration>) -> Duration {
        requested
            .filter(|d| !d.is_zero())
            .unwrap_or(self.default_lease_ttl)
            .clamp(self.min_lease_ttl, self.max_lease_ttl)
    }
}

impl EtcdConfig {
    /// Checks the etcd settings.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the setting to fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.endpoints.is_empty() {
            return Err(ConfigError::Etcd(
                "registry.etcd.endpoints is empty; list the etcd members' client URLs, e.g. [\"http://127.0.0.1:2379\"]".into(),
            ));
        }
        for endpoint in &self.endpoints {
            let scheme_ok = endpoint.starts_with("http://") || endpoint.starts_with("https://");
            if !scheme_ok || endpoint.parse::<http::Uri>().is_err() {
                return Err(ConfigError::Etcd(format!(
                    "registry.etcd.endpoints has {endpoint:?}; each must be an http(s) URL such as \"http://127.0.0.1:2379\""
                )));
            }
        }
        if !self.prefix.starts_with('/') || !self.prefix.ends_with('/') || self.prefix.len() > 256 {
            return Err(ConfigError::Etcd(format!(
                "registry.etcd.prefix {:?} must start and end with '/' (e.g. \"/reach/registry/\") and be at most 256 bytes",
                self.prefix
            )));
        }
        for (key, value) in [
            ("dial_timeout", self.dial_timeout),
            ("request_timeout", self.request_timeout),
            ("keep_alive_interval", self.keep_alive_interval),
            ("keep_alive_timeout", self.keep_alive_timeout),
        ] {
            if value.is_zero() {
                return Err(ConfigError::Etcd(format!(
                    "registry.etcd.{key} must be above zero (for example \"5s\")"
                )));
            }
        }
        if self.replica_ttl < Duration::from_secs(2) {
            return Err(ConfigError::Etcd(format!(
                "registry.etcd.replica_ttl is {:?}; etcd leases are whole seconds, so it must be at least 2s",
                self.replica_ttl
            )));
        }
        if let Some(tls) = &self.tls
            && tls.cert.is_some() != tls.key.is_some()
        {
            return Err(ConfigError::Etcd(
                "registry.etcd.tls needs both cert and key for a client certificate, or neither"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// A registry setting that is out of range; each message names the key and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `min_lease_ttl` is zero: every lease would expire at once.
    #[error("registry.min_lease_ttl must be above zero")]
    ZeroMinLeaseTtl,
    /// The lease bounds are the wrong way round.
    #[error("registry.min_lease_ttl ({min:?}) must not exceed registry.max_lease_ttl ({max:?})")]
    LeaseBoundsCrossed {
        /// `min_lease_ttl`.
        min: Duration,
        /// `max_lease_ttl`.
        max: Duration,
    },
    /// `default_lease_ttl` lies outside the bounds.
    #[error(
        "registry.default_lease_ttl ({default:?}) must lie between registry.min_lease_ttl ({min:?}) and registry.max_lease_ttl ({max:?})"
    )]
    DefaultLeaseOutOfBounds {
        /// `default_lease_ttl`.
        default: Duration,
        /// `min_lease_ttl`.
        min: Duration,
        /// `max_lease_ttl`.
        max: Duration,
    },
    /// Strict mode has nothing to check registrations against.
    #[error(
        "registry.strict needs registry.protocol_registry (the protocol-registry.yaml that declares capabilities)"
    )]
    StrictWithoutProtocolRegistry,
    /// `sweep_interval` is zero.
    #[error("registry.sweep_interval must be above zero")]
    ZeroSweepInterval,
    /// `probe_timeout` is zero: every health probe would fail.
    #[error("registry.probe_timeout must be above zero (for example \"1s\")")]
    ZeroProbeTimeout,
    /// An etcd setting is out of range; the message names it and the fix.
    #[error("{0}")]
    Etcd(String),
}
