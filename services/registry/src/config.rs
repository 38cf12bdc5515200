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
}
