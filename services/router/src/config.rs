//! Router configuration.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::balance::Policy;
pub use crate::endpoint::EjectionConfig;

/// How the router finds instances, balances, retries and what it accepts.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// The registry to watch, as a URL (`http://127.0.0.1:7070`).
    pub registry_endpoint: String,
    /// The largest message accepted, in bytes (encoded protobuf size), for calls and for every
    /// message of a stream. Default 4 MiB.
    pub max_message_bytes: usize,
    /// The largest message of a typed pass-through call (an agent's own gRPC service, see
    /// [`crate::passthrough`]), in bytes (the gRPC length prefix), in either direction.
    /// Unset: `max_message_bytes`.
    pub passthrough_max_message_bytes: Option<usize>,
    /// The latency an instance is assumed to have before it has answered anything, while no
    /// instance of its route has either (otherwise it is assumed as fast as the route's
    /// median instance, see [`crate::load`]).
    #[serde(with = "humantime_serde")]
    pub default_rtt: Duration,
    /// How fast the peak-EWMA latency estimate forgets a slow response.
    #[serde(with = "humantime_serde")]
    pub rtt_decay: Duration,
    /// How long connecting to an instance may take before the attempt counts as failed.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// How long the router keeps routing to the instances it knew when the registry comes
    /// back without its state (a Watch snapshot of a new epoch: an in-memory registry
    /// restarted), while they register again; one not listed routable by then leaves. Default
    /// 20 s, two of the registry's default 10 s lease TTLs; 0 drops them at once.
    #[serde(with = "humantime_serde")]
    pub registry_restart_grace: Duration,
    /// How many more instances a unary call may try after the first attempt failed in a way
    /// that is safe to retry (see [`crate::retry`]).
    pub max_redeliveries: u32,
    /// Balancing policies: a default and per-capability overrides.
    pub balancing: BalancingConfig,
    /// Outlier ejection (after Envoy's `outlier_detection.consecutive_gateway_failure`).
    pub ejection: EjectionConfig,
    /// Admission: how many calls may wait for an instance with room, and for how long.
    pub admission: AdmissionConfig,
    /// The retry budget (after Finagle's `RetryBudget` and gRPC A6 retry throttling).
    pub retry_budget: RetryBudgetConfig,
    /// The protocol registry file (`protocol-registry.yaml`): capabilities, schemas, version
    /// adapters, idempotency. Unset means no schema validation, no adapters, and no capability
    /// is idempotent.
    pub protocol_registry: Option<PathBuf>,
    /// Whether Call validates payload `data` parts against the capability's input schema.
    pub validate_payloads: bool,
    /// This replica's own RouterService URL as other replicas and agents reach it
    /// (`http://10.0.0.5:7070`). Asynchronous replies name it in `reply_to`; empty disables
    /// asynchronous replies on this replica.
    pub advertise_endpoint: String,
    /// The other router replicas a Reply may be forwarded to, as their `advertise_endpoint`
    /// URLs. Empty (the default): with trust on, any replica that proves the router identity
    /// (`spiffe://<trust domain>/router`) in the TLS handshake, so replicas behind a
    /// Kubernetes Service need no list; with trust off, any `http(s)://host:port`. Set: only
    /// these (and this replica's own endpoint); a Reply naming another `reply_to` is refused
    /// before anything is dialed. See docs/router.md, "Asynchronous replies across replicas".
    pub peers: Vec<String>,
    /// The orchestrator whose message ledger records every routed message of a task
    /// (`OrchestratorService.RecordMessages`); empty disables the ledger. The sink is bounded
    /// and batched: it never slows or fails routing, and counts what it had to drop.
    pub ledger_endpoint: String,
    /// The share of tasks (0..=1, chosen by task id, the same on every replica) whose
    /// messages the ledger records. Default 1.
    pub ledger_sample_rate: f64,
    /// The longest a Call waits for an asynchronous reply after the agent acknowledged it
    /// (and never past the caller's deadline). Default 60 s.
    #[serde(with = "humantime_serde")]
    pub max_async_wait: Duration,
    /// How far in the future a message's `header.created_at` may be, by this router's clock,
    /// when the message has a TTL: a later one is refused INVALID_ARGUMENT, since its TTL
    /// would count from a time that has not come (a caller's clock is off, or the field is
    /// wrong). Within the allowance the message counts as just created. Default 1 min.
    #[serde(with = "humantime_serde")]
    pub max_clock_skew: Duration,
    /// Bytes of partly received replies the router may hold from one instance at once, in
    /// bytes: a reply that would go past it fails its call with `RESOURCE_EXHAUSTED`. Replies
    /// that arrive whole in one read do not count. At least `max_message_bytes`. Default 64 MiB.
    pub max_buffered_reply_bytes_per_instance: usize,
    /// The same across all instances, in bytes. Default 1 GiB.
    pub max_buffered_reply_bytes: usize,
    /// The highest `header.turn` (agent hops of one conversation) a message may carry; one
    /// above it is refused FAILED_PRECONDITION (`TURN_LIMIT_EXCEEDED`) on Call, CallMux,
    /// Stream and Publish — a loop guard across agents. At least 1. Default 64.
    pub max_turn: u32,
}

/// Which balancing policy each route uses.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BalancingConfig {
    /// The policy of routes with no override. Default `p2c_peak_ewma`.
    pub default: Policy,
    /// Overrides by capability (or service) name, e.g. `{"complaint.classify" = "weighted"}`.
    pub routes: BTreeMap<String, Policy>,
}

/// How calls wait when every instance of a route is at its concurrency limit.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// How many calls may wait for room at once across the router; one more is shed at once
    /// with UNAVAILABLE (`OVERLOADED`). Default 1024.
    pub max_waiting: usize,
    /// The longest a call waits for room before it is shed. Default 5 s (and never past the
    /// caller's deadline).
    #[serde(with = "humantime_serde")]
    pub max_wait: Duration,
    /// The retry hint sent with a shed call (`retry_after_ms` and `google.rpc.RetryInfo`).
    /// Default 50 ms.
    #[serde(with = "humantime_serde")]
    pub retry_after: Duration,
}

/// How many retries the router may add on top of first attempts.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryBudgetConfig {
    /// Retries allowed as a fraction of first attempts (0.2 = 20 %). Default 0.2.
    pub retry_ratio: f32,
    /// Retries allowed per second regardless of traffic. Default 10.
    pub min_per_second: u32,
    /// The window over which first attempts are counted. Default 10 s.
    #[serde(with = "humantime_serde")]
    pub window: Duration,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            registry_endpoint: "http://127.0.0.1:7070".into(),
            max_message_bytes: 4 * 1024 * 1024,
            passthrough_max_message_bytes: None,
            default_rtt: Duration::from_millis(5),
            rtt_decay: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(1),
            registry_restart_grace: Duration::from_secs(20),
            max_redeliveries: 2,
            balancing: BalancingConfig::default(),
            ejection: EjectionConfig::default(),
            admission: AdmissionConfig::default(),
            retry_budget: RetryBudgetConfig::default(),
            protocol_registry: None,
            validate_payloads: true,
            advertise_endpoint: String::new(),
            peers: Vec::new(),
            ledger_endpoint: String::new(),
            ledger_sample_rate: 1.0,
            max_async_wait: Duration::from_secs(60),
            max_clock_skew: Duration::from_secs(60),
            max_buffered_reply_bytes_per_instance: 64 * 1024 * 1024,
            max_buffered_reply_bytes: 1024 * 1024 * 1024,
            max_turn: 64,
        }
    }
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            max_waiting: 1024,
            max_wait: Duration::from_secs(5),
            retry_after: Duration::from_millis(50),
        }
    }
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        Self {
            retry_ratio: 0.2,
            min_per_second: 10,
            window: Duration::from_secs(10),
        }
    }
}

impl RouterConfig {
    /// Checks the settings.
    ///
    /// # Errors
    /// The first [`ConfigError`] found, naming the setting to fix ([`ConfigError::key`]).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_message_bytes < MIN_MESSAGE_BYTES {
            return Err(ConfigError::MessageLimitTooSmall {
                value: self.max_message_bytes,
            });
        }
        if let Some(value) = self.passthrough_max_message_bytes
            && value < MIN_MESSAGE_BYTES
        {
            return Err(ConfigError::PassthroughMessageLimitTooSmall { value });
        }
        if self.max_buffered_reply_bytes_per_instance < self.max_message_bytes {
            return Err(ConfigError::InstanceReplyBudgetTooSmall {
                value: self.max_buffered_reply_bytes_per_instance,
                max_message_bytes: self.max_message_bytes,
            });
        }
        if self.max_buffered_reply_bytes < self.max_buffered_reply_bytes_per_instance {
            return Err(ConfigError::ReplyBudgetTooSmall {
                value: self.max_buffered_reply_bytes,
                per_instance: self.max_buffered_reply_bytes_per_instance,
            });
        }
        if !(self.registry_endpoint.starts_with("http://")
            || self.registry_endpoint.starts_with("https://"))
        {
            return Err(ConfigError::RegistryEndpointNotHttp {
                value: self.registry_endpoint.clone(),
            });
        }
        if let Some(peer) = self.peers.iter().find(|p| !is_reply_peer_url(p)) {
            return Err(ConfigError::PeerNotUrl {
                value: peer.clone(),
            });
        }
        if self.rtt_decay.is_zero() {
            return Err(ConfigError::ZeroRttDecay);
        }
        if self.max_turn == 0 {
            return Err(ConfigError::ZeroMaxTurn);
        }
        if self.connect_timeout.is_zero() {
            return Err(ConfigError::ZeroConnectTimeout);
        }
        if !(0.0..=1.0).contains(&self.ledger_sample_rate) {
            return Err(ConfigError::LedgerSampleRateOutOfRange {
                value: self.ledger_sample_rate,
            });
        }
        if self.ejection.base_ejection > self.ejection.max_ejection {
            return Err(ConfigError::EjectionBaseAboveMax {
                base: self.ejection.base_ejection,
                max: self.ejection.max_ejection,
            });
        }
        if !(0.0..=1000.0).contains(&self.retry_budget.retry_ratio) {
            return Err(ConfigError::RetryRatioOutOfRange {
                value: self.retry_budget.retry_ratio,
            });
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(60)).contains(&self.retry_budget.window) {
            return Err(ConfigError::RetryWindowOutOfRange {
                value: self.retry_budget.window,
            });
        }
        Ok(())
    }

    /// The policy of the route named `name` (capability or service).
    pub fn policy_for(&self, name: &str) -> Policy {
        self.balancing
            .routes
            .get(name)
            .copied()
            .unwrap_or(self.balancing.default)
    }

    /// The largest typed pass-through message, in bytes: `passthrough_max_message_bytes`, or
    /// `max_message_bytes` when it is unset.
    pub fn passthrough_message_limit(&self) -> usize {
        self.passthrough_max_message_bytes
            .unwrap_or(self.max_message_bytes)
    }

    /// The largest gRPC message of a `RouterService` request (and of an instance's reply), in
    /// bytes, checked against its length prefix before it is read: the decoding limit
    /// ([`RouterConfig::decoding_limit`]). Messages between `max_message_bytes` and it are
    /// read and refused one by one with their envelope's size (see [`crate::envelope`]), so
    /// an oversized call on a shared `CallMux` stream fails alone; larger ones are refused by
    /// the prefix, which ends their request (a whole stream, for a streaming RPC). Both are
    /// `PAYLOAD_TOO_LARGE`.
    pub fn request_message_limit(&self) -> usize {
        self.decoding_limit()
    }

    /// [`RouterConfig::request_message_limit`] as the length-prefix check of requests and
    /// replies: refused above it, the refusal naming `max_message_bytes` (the limit a caller
    /// can act on), as the messages in between are refused with their own sizes.
    pub fn prefix_limit(&self) -> reach_rpc::limits::PrefixLimit {
        reach_rpc::limits::PrefixLimit {
            refuse_above: self.request_message_limit(),
            named: self.max_message_bytes,
        }
    }

    /// The decoding limit handed to tonic: above the routing limit, so that messages a little
    /// over it reach the router and get an error naming both sizes.
    pub fn decoding_limit(&self) -> usize {
        self.max_message_bytes
            .saturating_mul(2)
            .max(self.max_message_bytes + (1 << 20))
    }
}

/// The longest `reply_to` (and `peers` entry) accepted, in bytes.
pub const MAX_REPLY_PEER_URL_BYTES: usize = 512;

/// Whether `url` has the shape of a router replica's URL: `http://` or `https://`, a host and
/// a port, nothing else (no user info, path, query or fragment), at most
/// [`MAX_REPLY_PEER_URL_BYTES`].
pub fn is_reply_peer_url(url: &str) -> bool {
    if url.len() > MAX_REPLY_PEER_URL_BYTES {
        return false;
    }
    let Ok(uri) = url.parse::<http::Uri>() else {
        return false;
    };
    let scheme_ok = matches!(uri.scheme_str(), Some("http" | "https"));
    let path_ok = matches!(
        uri.path_and_query().map(|p| p.as_str()),
        None | Some("" | "/")
    );
    let authority_ok = uri.authority().is_some_and(|a| {
        !a.as_str().contains('@') && !a.host().is_empty() && a.port_u16().is_some()
    });
    scheme_ok && path_ok && authority_ok && !url.contains('#')
}

/// The smallest `max_message_bytes` accepted, in bytes.
pub const MIN_MESSAGE_BYTES: usize = 1024;

/// A router setting that cannot work, from [`RouterConfig::validate`]. Each message names the
/// setting (as `router.KEY`) and what to set it to.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// `max_message_bytes` is below [`MIN_MESSAGE_BYTES`].
    #[error("router.max_message_bytes is {value} bytes; it must be at least {MIN_MESSAGE_BYTES}")]
    MessageLimitTooSmall {
        /// The configured value, in bytes.
        value: usize,
    },
    /// `passthrough_max_message_bytes` is below [`MIN_MESSAGE_BYTES`].
    #[error(
        "router.passthrough_max_message_bytes is {value} bytes; it must be at least {MIN_MESSAGE_BYTES} (or unset, to use router.max_message_bytes)"
    )]
    PassthroughMessageLimitTooSmall {
        /// The configured value, in bytes.
        value: usize,
    },
    /// `max_buffered_reply_bytes_per_instance` is below `max_message_bytes`.
    #[error(
        "router.max_buffered_reply_bytes_per_instance is {value} bytes, less than router.max_message_bytes ({max_message_bytes}), so a reply that large could never arrive; raise it to at least {max_message_bytes}"
    )]
    InstanceReplyBudgetTooSmall {
        /// The configured value, in bytes.
        value: usize,
        /// `max_message_bytes`, in bytes.
        max_message_bytes: usize,
    },
    /// `max_buffered_reply_bytes` is below `max_buffered_reply_bytes_per_instance`.
    #[error(
        "router.max_buffered_reply_bytes ({value}) is less than router.max_buffered_reply_bytes_per_instance ({per_instance}); the router-wide budget must be at least one instance's"
    )]
    ReplyBudgetTooSmall {
        /// The configured value, in bytes.
        value: usize,
        /// `max_buffered_reply_bytes_per_instance`, in bytes.
        per_instance: usize,
    },
    /// `registry_endpoint` is not an http(s) URL.
    #[error(
        "router.registry_endpoint {value:?} must be an http(s) URL such as http://127.0.0.1:7070"
    )]
    RegistryEndpointNotHttp {
        /// The configured value.
        value: String,
    },
    /// An entry of `peers` is not a router URL.
    #[error(
        "router.peers entry {value:?} must be a router replica's URL, scheme, host and port only, such as https://10.0.0.5:7070"
    )]
    PeerNotUrl {
        /// The entry.
        value: String,
    },
    /// `rtt_decay` is zero.
    #[error("router.rtt_decay must be above zero")]
    ZeroRttDecay,
    /// `max_turn` is zero: every message an agent sends on would be refused.
    #[error(
        "router.max_turn must be at least 1 (the default, 64, allows 64 agent hops per conversation)"
    )]
    ZeroMaxTurn,
    /// `connect_timeout` is zero: no connection could ever be made.
    #[error("router.connect_timeout must be above zero (for example \"1s\")")]
    ZeroConnectTimeout,
    /// `ledger_sample_rate` is not a share.
    #[error(
        "router.ledger_sample_rate is {value}; it must lie between 0 (keep no messages) and 1 (keep all)"
    )]
    LedgerSampleRateOutOfRange {
        /// The configured value.
        value: f64,
    },
    /// `ejection.base_ejection` is longer than `ejection.max_ejection`.
    #[error(
        "router.ejection.base_ejection ({base:?}) must not exceed router.ejection.max_ejection ({max:?})"
    )]
    EjectionBaseAboveMax {
        /// `ejection.base_ejection`.
        base: Duration,
        /// `ejection.max_ejection`.
        max: Duration,
    },
    /// `retry_budget.retry_ratio` is outside 0..=1000.
    #[error(
        "router.retry_budget.retry_ratio is {value}; it must lie between 0 and 1000 (0.2 = 20 %)"
    )]
    RetryRatioOutOfRange {
        /// The configured ratio.
        value: f32,
    },
    /// `retry_budget.window` is outside 1 s..=60 s.
    #[error("router.retry_budget.window is {value:?}; it must lie between 1 s and 60 s")]
    RetryWindowOutOfRange {
        /// The configured window.
        value: Duration,
    },
}

impl ConfigError {
    /// The setting to fix, as its key in the `[router]` section (`max_message_bytes`,
    /// `ejection.base_ejection`, ...).
    pub fn key(&self) -> &'static str {
        match self {
            ConfigError::MessageLimitTooSmall { .. } => "max_message_bytes",
            ConfigError::PassthroughMessageLimitTooSmall { .. } => "passthrough_max_message_bytes",
            ConfigError::InstanceReplyBudgetTooSmall { .. } => {
                "max_buffered_reply_bytes_per_instance"
            }
            ConfigError::ReplyBudgetTooSmall { .. } => "max_buffered_reply_bytes",
            ConfigError::RegistryEndpointNotHttp { .. } => "registry_endpoint",
            ConfigError::PeerNotUrl { .. } => "peers",
            ConfigError::ZeroRttDecay => "rtt_decay",
            ConfigError::ZeroMaxTurn => "max_turn",
            ConfigError::ZeroConnectTimeout => "connect_timeout",
            ConfigError::LedgerSampleRateOutOfRange { .. } => "ledger_sample_rate",
            ConfigError::EjectionBaseAboveMax { .. } => "ejection.base_ejection",
            ConfigError::RetryRatioOutOfRange { .. } => "retry_budget.retry_ratio",
            ConfigError::RetryWindowOutOfRange { .. } => "retry_budget.window",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_peer_urls_are_scheme_host_and_port_only() {
        for good in [
            "http://127.0.0.1:7070",
            "https://10.0.0.5:7070/",
            "https://router-0.reach:7070",
        ] {
            assert!(is_reply_peer_url(good), "{good}");
        }
        for bad in [
            "",
            "async",
            "10.0.0.5:7070",
            "ftp://10.0.0.5:21",
            "http://10.0.0.5",
            "http://user:pw@10.0.0.5:7070",
            "http://10.0.0.5:7070/admin",
            "http://10.0.0.5:7070/?q=1",
            "http://10.0.0.5:7070#x",
        ] {
            assert!(!is_reply_peer_url(bad), "{bad}");
        }
        let long = format!(
            "http://{}.example:7070",
            "a".repeat(MAX_REPLY_PEER_URL_BYTES)
        );
        assert!(!is_reply_peer_url(&long));
    }

    #[test]
    fn the_defaults_are_valid() {
        RouterConfig::default().validate().unwrap();
    }

    #[test]
    fn each_invalid_setting_is_named_with_its_value() {
        let cases: Vec<(RouterConfig, &str, &str)> = vec![
            (
                RouterConfig {
                    max_message_bytes: 100,
                    ..RouterConfig::default()
                },
                "max_message_bytes",
                "router.max_message_bytes is 100 bytes; it must be at least 1024",
            ),
            (
                RouterConfig {
                    max_buffered_reply_bytes_per_instance: 1024 * 1024,
                    ..RouterConfig::default()
                },
                "max_buffered_reply_bytes_per_instance",
                "raise it to at least 4194304",
            ),
            (
                RouterConfig {
                    max_buffered_reply_bytes: 1024 * 1024,
                    ..RouterConfig::default()
                },
                "max_buffered_reply_bytes",
                "router.max_buffered_reply_bytes (1048576) is less than",
            ),
            (
                RouterConfig {
                    registry_endpoint: "127.0.0.1:7070".into(),
                    ..RouterConfig::default()
                },
                "registry_endpoint",
                "router.registry_endpoint \"127.0.0.1:7070\" must be an http(s) URL",
            ),
            (
                RouterConfig {
                    rtt_decay: Duration::ZERO,
                    ..RouterConfig::default()
                },
                "rtt_decay",
                "router.rtt_decay must be above zero",
            ),
            (
                RouterConfig {
                    peers: vec!["https://10.0.0.5:7070/admin?x=1".into()],
                    ..RouterConfig::default()
                },
                "peers",
                "router.peers entry \"https://10.0.0.5:7070/admin?x=1\" must be a router replica's URL",
            ),
            (
                RouterConfig {
                    max_turn: 0,
                    ..RouterConfig::default()
                },
                "max_turn",
                "router.max_turn must be at least 1",
            ),
            (
                RouterConfig {
                    ejection: EjectionConfig {
                        base_ejection: Duration::from_secs(60),
                        ..EjectionConfig::default()
                    },
                    ..RouterConfig::default()
                },
                "ejection.base_ejection",
                "router.ejection.base_ejection (60s) must not exceed",
            ),
            (
                RouterConfig {
                    retry_budget: RetryBudgetConfig {
                        retry_ratio: -1.0,
                        ..RetryBudgetConfig::default()
                    },
                    ..RouterConfig::default()
                },
                "retry_budget.retry_ratio",
                "router.retry_budget.retry_ratio is -1;",
            ),
            (
                RouterConfig {
                    retry_budget: RetryBudgetConfig {
                        window: Duration::from_secs(120),
                        ..RetryBudgetConfig::default()
                    },
                    ..RouterConfig::default()
                },
                "retry_budget.window",
                "router.retry_budget.window is 120s;",
            ),
        ];
        for (config, key, message) in cases {
            let error = config.validate().unwrap_err();
            assert_eq!(error.key(), key, "{error}");
            let text = error.to_string();
            assert!(text.contains(message), "{key}: {text}");
            assert!(!text.ends_with('.'), "{key}: {text}");
        }
    }
}
