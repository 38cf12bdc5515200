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
    /// With trust on: the most `Watch` streams one identity may hold open on this replica
    /// (routers, `registry.routers` of the policy, are not capped per identity: their
    /// replicas share one). Default 16.
    pub max_watches_per_identity: usize,
    /// With trust on: how many of this replica's
    /// [`MAX_WATCHES`](crate::limits::MAX_WATCHES) Watch slots only routers may take, so
    /// that watchers of other identities never lock routers out. Default 256.
    pub router_watch_slots: usize,
    /// With trust on and `health_probe`: how many registrations one identity may make that
    /// start a health probe, at once (a token bucket's size), before
    /// `probes_per_second_per_identity` paces it. Default 128.
    pub probe_burst_per_identity: u32,
    /// With trust on and `health_probe`: how fast one identity's probe allowance refills,
    /// in registrations a second; beyond it Register answers RESOURCE_EXHAUSTED
    /// (`PROBE_RATE_LIMITED`, with when to retry). Default 8.
    pub probes_per_second_per_identity: u32,
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
    /// How often the HTTP/2 connection to etcd is pinged; at least
    /// [`MIN_KEEP_ALIVE_INTERVAL`], since etcd answers more frequent pings with GOAWAY.
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

/// The shortest `registry.etcd.keep_alive_interval`: etcd's default
/// `--grpc-keepalive-min-time`. A client that pings more often is sent GOAWAY
/// (`too_many_pings`), which breaks the connection and the mirror's watch with it.
pub const MIN_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(5);

/// The shortest `registry.etcd.replica_ttl` (etcd raises shorter leases to its floor, 2 s with
/// its default election timeout).
pub const MIN_REPLICA_TTL: Duration = Duration::from_secs(2);

/// The longest `registry.etcd.replica_ttl`: a dead replica's share of first health probes
/// waits this long to move.
pub const MAX_REPLICA_TTL: Duration = Duration::from_secs(60);

/// The longest lease TTL the registry grants on etcd (`registry.max_lease_ttl` and
/// `default_lease_ttl`): a day. etcd itself refuses leases over about 285 years; a day is
/// longer than any agent should go unheard.
pub const MAX_ETCD_LEASE_TTL: Duration = Duration::from_secs(24 * 3600);

/// `duration` as people write it (`2s`, `500ms`, `1m 30s`), to the millisecond.
pub(crate) fn readable(duration: Duration) -> String {
    let millis = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
    humantime::format_duration(Duration::from_millis(millis)).to_string()
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
            max_watches_per_identity: 16,
            router_watch_slots: 256,
            probe_burst_per_identity: 128,
            probes_per_second_per_identity: 8,
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
        if self.max_watches_per_identity == 0 {
            return Err(ConfigError::Limit(
                "registry.max_watches_per_identity must be at least 1 (routers are not capped by it)".into(),
            ));
        }
        if self.router_watch_slots >= crate::limits::MAX_WATCHES {
            return Err(ConfigError::Limit(format!(
                "registry.router_watch_slots ({}) must be below the {} Watch streams a registry serves, leaving room for other watchers",
                self.router_watch_slots,
                crate::limits::MAX_WATCHES
            )));
        }
        if self.probe_burst_per_identity == 0 || self.probes_per_second_per_identity == 0 {
            return Err(ConfigError::Limit(
                "registry.probe_burst_per_identity and registry.probes_per_second_per_identity must be at least 1 (set registry.health_probe = false to probe nothing)".into(),
            ));
        }
        if self.backend == Backend::Etcd {
            // The granted TTLs (the default, and the longest) become etcd leases as they are;
            // shorter requests are raised to etcd's own floor anyway.
            for (key, value) in [
                ("registry.default_lease_ttl", self.default_lease_ttl),
                ("registry.max_lease_ttl", self.max_lease_ttl),
            ] {
                if value.subsec_nanos() != 0 {
                    return Err(ConfigError::NotWholeSeconds { key, value });
                }
                if value > MAX_ETCD_LEASE_TTL {
                    return Err(ConfigError::Etcd(format!(
                        "{key} is {}; on etcd a lease TTL may be at most {} (an agent unheard for longer is gone)",
                        readable(value),
                        readable(MAX_ETCD_LEASE_TTL)
                    )));
                }
            }
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
            let uri = endpoint.parse::<http::Uri>().ok().filter(|_| scheme_ok);
            let Some(uri) = uri.filter(|uri| uri.host().is_some_and(|h| !h.is_empty())) else {
                return Err(ConfigError::Etcd(format!(
                    "registry.etcd.endpoints has {endpoint:?}; each must be an http(s) URL such as \"http://127.0.0.1:2379\""
                )));
            };
            if let Some(port) = port_of(&uri)
                && !port.parse::<u16>().is_ok_and(|port| port != 0)
            {
                return Err(ConfigError::Etcd(format!(
                    "registry.etcd.endpoints has {endpoint:?}, whose port {port:?} is not a port (1 to 65535); etcd's client port is usually 2379"
                )));
            }
            if endpoint.starts_with("https://") && self.tls.is_none() {
                return Err(ConfigError::Etcd(format!(
                    "registry.etcd.endpoints has {endpoint:?}, but registry.etcd.tls is not set: https endpoints need registry.etcd.tls (ca, and cert/key for client certificates), or use http://"
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
        if self.keep_alive_interval < MIN_KEEP_ALIVE_INTERVAL {
            return Err(ConfigError::Etcd(format!(
                "registry.etcd.keep_alive_interval is {}; etcd refuses pings more frequent than its --grpc-keepalive-min-time (5s by default) with GOAWAY too_many_pings, which breaks the watch: give at least {}",
                readable(self.keep_alive_interval),
                readable(MIN_KEEP_ALIVE_INTERVAL)
            )));
        }
        if self.replica_ttl > MAX_REPLICA_TTL {
            return Err(ConfigError::Etcd(format!(
                "registry.etcd.replica_ttl is {}; a dead replica's share of health probing moves only once its key expires, so give at most {} (e.g. \"3s\")",
                readable(self.replica_ttl),
                readable(MAX_REPLICA_TTL)
            )));
        }
        if self.replica_ttl < MIN_REPLICA_TTL || self.replica_ttl.subsec_nanos() != 0 {
            return Err(ConfigError::Etcd(format!(
                "registry.etcd.replica_ttl is {}; etcd leases are whole seconds, so give whole seconds, at least {} (e.g. \"3s\")",
                readable(self.replica_ttl),
                readable(MIN_REPLICA_TTL)
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

/// The port an endpoint URL writes after its host (`None` without one), as written: `http`'s
/// parser takes any digits there, and only says `None` for a port that does not fit.
fn port_of(uri: &http::Uri) -> Option<&str> {
    let authority = uri.authority()?.as_str();
    let host_port = authority
        .rsplit_once('@')
        .map_or(authority, |(_, rest)| rest);
    // After an IPv6 literal's `]`, or the whole name.
    let after_host = host_port
        .rsplit_once(']')
        .map_or(host_port, |(_, rest)| rest);
    after_host.split_once(':').map(|(_, port)| port)
}

/// A registry setting that is out of range; each message names the key and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `min_lease_ttl` is zero: every lease would expire at once.
    #[error("registry.min_lease_ttl must be above zero")]
    ZeroMinLeaseTtl,
    /// The lease bounds are the wrong way round.
    #[error(
        "registry.min_lease_ttl ({}) must not exceed registry.max_lease_ttl ({})",
        readable(*min),
        readable(*max)
    )]
    LeaseBoundsCrossed {
        /// `min_lease_ttl`.
        min: Duration,
        /// `max_lease_ttl`.
        max: Duration,
    },
    /// `default_lease_ttl` lies outside the bounds.
    #[error(
        "registry.default_lease_ttl ({}) must lie between registry.min_lease_ttl ({}) and registry.max_lease_ttl ({})",
        readable(*default),
        readable(*min),
        readable(*max)
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
    /// On etcd, a lease TTL that etcd would round: its leases are whole seconds.
    #[error(
        "{key} is {}; with registry.backend = \"etcd\" it becomes an etcd lease, and etcd leases are whole seconds: give whole seconds (e.g. \"10s\")",
        readable(*value)
    )]
    NotWholeSeconds {
        /// The setting, e.g. `registry.default_lease_ttl`.
        key: &'static str,
        /// Its value.
        value: Duration,
    },
    /// An etcd setting (or a file it names) cannot be used; the message names it and the fix.
    #[error("{0}")]
    Etcd(String),
    /// A Watch or probe limit is out of range; the message names it and the fix.
    #[error("{0}")]
    Limit(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_lease_and_replica_ttls_are_bounded_above() {
        let etcd_with = |replica_ttl: Duration, max_lease_ttl: Duration| RegistryConfig {
            backend: Backend::Etcd,
            max_lease_ttl,
            etcd: EtcdConfig {
                replica_ttl,
                ..EtcdConfig::default()
            },
            ..RegistryConfig::default()
        };
        let year = Duration::from_secs(365 * 24 * 3600);
        let message = etcd_with(year, Duration::from_secs(300))
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("registry.etcd.replica_ttl is"),
            "{message}"
        );
        assert!(message.contains("at most 1m"), "{message}");
        let message = etcd_with(Duration::from_secs(3), year * 1000)
            .validate()
            .unwrap_err()
            .to_string();
        assert!(message.contains("registry.max_lease_ttl is"), "{message}");
        assert!(message.contains("at most 1day"), "{message}");
        etcd_with(Duration::from_secs(3), Duration::from_secs(300))
            .validate()
            .unwrap();
    }

    /// A registry on `etcd`, otherwise the defaults.
    fn on_etcd(etcd: EtcdConfig) -> RegistryConfig {
        RegistryConfig {
            backend: Backend::Etcd,
            etcd,
            ..RegistryConfig::default()
        }
    }

    fn refusal(config: &RegistryConfig) -> String {
        config.validate().expect_err("refused").to_string()
    }

    fn endpoints(endpoints: &[&str]) -> EtcdConfig {
        EtcdConfig {
            endpoints: endpoints.iter().map(|e| e.to_string()).collect(),
            ..EtcdConfig::default()
        }
    }

    #[test]
    fn the_defaults_on_etcd_are_valid() {
        on_etcd(EtcdConfig::default()).validate().unwrap();
        on_etcd(endpoints(&[
            "http://[::1]:2379",
            "http://etcd-0.etcd:2379",
            "http://etcd",
        ]))
        .validate()
        .unwrap();
    }

    #[test]
    fn an_endpoint_whose_port_is_not_a_port_is_refused_naming_it() {
        for bad in [
            "http://127.0.0.1:99999",
            "http://127.0.0.1:0",
            "http://[::1]:65536",
        ] {
            let message = refusal(&on_etcd(endpoints(&["http://127.0.0.1:2379", bad])));
            assert!(
                message.contains("registry.etcd.endpoints") && message.contains(bad),
                "{bad}: {message}"
            );
        }
        on_etcd(endpoints(&["http://127.0.0.1:65535"]))
            .validate()
            .unwrap();
    }

    #[test]
    fn an_https_endpoint_without_tls_says_what_to_set() {
        let message = refusal(&on_etcd(endpoints(&["https://etcd:2379"])));
        assert!(
            message.contains(
                "https endpoints need registry.etcd.tls (ca, and cert/key for client certificates), or use http://"
            ) && message.contains("https://etcd:2379"),
            "{message}"
        );
        on_etcd(EtcdConfig {
            tls: Some(EtcdTls {
                ca: "/etc/etcd/ca.pem".into(),
                cert: None,
                key: None,
                domain: None,
            }),
            ..endpoints(&["https://etcd:2379"])
        })
        .validate()
        .unwrap();
    }

    #[test]
    fn ttls_that_become_etcd_leases_must_be_whole_seconds() {
        let message = refusal(&on_etcd(EtcdConfig {
            replica_ttl: Duration::from_millis(2500),
            ..EtcdConfig::default()
        }));
        assert!(
            message.contains("registry.etcd.replica_ttl is 2s 500ms")
                && message.contains("whole seconds"),
            "{message}"
        );
        let message = refusal(&on_etcd(EtcdConfig {
            replica_ttl: Duration::from_secs(1),
            ..EtcdConfig::default()
        }));
        assert!(message.contains("at least 2s"), "{message}");

        for (config, key) in [
            (
                RegistryConfig {
                    default_lease_ttl: Duration::from_millis(10_500),
                    ..on_etcd(EtcdConfig::default())
                },
                "registry.default_lease_ttl is 10s 500ms",
            ),
            (
                RegistryConfig {
                    max_lease_ttl: Duration::from_millis(60_250),
                    ..on_etcd(EtcdConfig::default())
                },
                "registry.max_lease_ttl is 1m 250ms",
            ),
        ] {
            let message = refusal(&config);
            assert!(
                message.contains(key) && message.contains("whole seconds"),
                "{message}"
            );
            // In memory a lease is any duration.
            RegistryConfig {
                backend: Backend::Memory,
                ..config
            }
            .validate()
            .unwrap();
        }
    }

    #[test]
    fn a_keep_alive_interval_under_etcds_floor_is_refused() {
        let message = refusal(&on_etcd(EtcdConfig {
            keep_alive_interval: Duration::from_secs(1),
            ..EtcdConfig::default()
        }));
        assert!(
            message.contains("registry.etcd.keep_alive_interval is 1s")
                && message.contains("--grpc-keepalive-min-time (5s by default)")
                && message.contains("too_many_pings")
                && message.contains("at least 5s"),
            "{message}"
        );
        on_etcd(EtcdConfig {
            keep_alive_interval: MIN_KEEP_ALIVE_INTERVAL,
            ..EtcdConfig::default()
        })
        .validate()
        .unwrap();
    }

    #[test]
    fn durations_in_messages_read_as_people_write_them() {
        let message = refusal(&RegistryConfig {
            min_lease_ttl: Duration::from_millis(1500),
            max_lease_ttl: Duration::from_millis(500),
            ..RegistryConfig::default()
        });
        assert_eq!(
            message,
            "registry.min_lease_ttl (1s 500ms) must not exceed registry.max_lease_ttl (500ms)"
        );
        let message = refusal(&RegistryConfig {
            default_lease_ttl: Duration::from_secs(600),
            ..RegistryConfig::default()
        });
        assert_eq!(
            message,
            "registry.default_lease_ttl (10m) must lie between registry.min_lease_ttl (100ms) and registry.max_lease_ttl (5m)"
        );
        assert_eq!(readable(Duration::from_nanos(2_000_400_000)), "2s");
    }

    #[test]
    fn watch_and_probe_limits_are_refused_out_of_range_naming_the_key() {
        RegistryConfig::default().validate().unwrap();
        for (config, key) in [
            (
                RegistryConfig {
                    max_watches_per_identity: 0,
                    ..RegistryConfig::default()
                },
                "registry.max_watches_per_identity",
            ),
            (
                RegistryConfig {
                    router_watch_slots: crate::limits::MAX_WATCHES,
                    ..RegistryConfig::default()
                },
                "registry.router_watch_slots (1024)",
            ),
            (
                RegistryConfig {
                    probes_per_second_per_identity: 0,
                    ..RegistryConfig::default()
                },
                "registry.probes_per_second_per_identity",
            ),
            (
                RegistryConfig {
                    probe_burst_per_identity: 0,
                    ..RegistryConfig::default()
                },
                "registry.probe_burst_per_identity",
            ),
        ] {
            let message = config.validate().unwrap_err().to_string();
            assert!(message.contains(key), "{key}: {message}");
        }
    }
}
