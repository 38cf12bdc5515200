//! Orchestrator configuration (serde, with defaults for every field).

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::expr::ExprLimits;

/// The WatchTask streams a caller may have open at once unless configured
/// (`orchestrator.max_watches_per_caller`).
pub const DEFAULT_MAX_WATCHES_PER_CALLER: usize = 64;

/// How the orchestrator runs. Every field has a default, so `{}` (or an empty TOML table)
/// is a working embedded configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct OrchestratorConfig {
    /// The task store: `sqlite://PATH` (embedded, one process) or
    /// `postgres://USER@HOST:PORT/DB` (several replicas). Default `sqlite://.reach/orchestrator.db`.
    pub store_url: String,
    /// SQLite only: `true` fsyncs every commit (`synchronous=FULL`, survives power loss);
    /// `false` (default) uses WAL with `synchronous=NORMAL` (survives process crashes; a power
    /// loss may drop the last commits, never corrupting the file).
    pub sqlite_full_sync: bool,
    /// A directory of flow files (`*.yaml`) loaded at start and watched for changes.
    pub flows_dir: Option<PathBuf>,
    /// Whether to watch `flows_dir` for changes (hot reload). Default true.
    pub watch_flows: bool,
    /// The router that task nodes call through. Default `http://127.0.0.1:7070`.
    pub router_endpoint: String,
    /// Ended tasks (events, context and ledger) are purged this long after they end.
    /// Default 24h.
    #[serde(with = "humantime_serde")]
    pub context_ttl: Duration,
    /// Field names or globs whose values are masked in everything shown, matched
    /// case-insensitively (added to the built-in `*password*`, `*pwd*`, `*secret*`, `*token`,
    /// `*api_key*`, `*authorization*`, `*credential*`, `*private_key*`, `*cookie*`, `*cvv*`,
    /// `ssn`, `iban`, ...; see `mask::DEFAULT_SENSITIVE_FIELDS`).
    pub redact_fields: Vec<String>,
    /// Regular expressions whose matches in any string shown are replaced by `***` (added to
    /// the built-in e-mail, phone, Luhn-valid card, account, bearer-token and
    /// `key=value` / `key: value` secret patterns).
    pub redact_values: Vec<String>,
    /// This replica's id, the owner of its task leases. Default: a random id per process.
    /// Give each replica a stable id to let a restarted replica reclaim its tasks at once.
    pub node_id: Option<String>,
    /// Task lease length (PostgreSQL): a crashed replica's tasks move after this. Default 15s.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// How often other replicas' changes and due timers are polled. Default 500ms.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// Longest a call may take when its node has no `timeout`. Default 5m.
    #[serde(with = "humantime_serde")]
    pub default_call_timeout: Duration,
    /// Tasks driven concurrently. Default 1024.
    pub max_concurrent_tasks: usize,
    /// Longest wait for a pooled store connection before an operation fails. Default 30s.
    #[serde(with = "humantime_serde")]
    pub store_acquire_timeout: Duration,
    /// Node visits a task may make (between retries) before it fails: a flow whose nodes
    /// point at each other ends instead of looping forever. Default 1000.
    pub max_node_visits: usize,
    /// Expression evaluations (conditions, node inputs) run at once, on threads apart from
    /// the ones serving RPCs. Default 4.
    pub max_concurrent_evaluations: usize,
    /// Of those, the most one flow's tasks may hold at once, so a flow with heavy
    /// expressions cannot take every evaluation slot and slow every other flow's conditions.
    /// Default 2 (at most `max_concurrent_evaluations`).
    pub max_evaluations_per_flow: usize,
    /// WatchTask streams one caller (identity; every anonymous caller together) may have
    /// open at once; one more is refused RESOURCE_EXHAUSTED (`TOO_MANY_WATCHES`). Default 64.
    pub max_watches_per_caller: usize,
    /// The limits on every flow expression (`[orchestrator.expressions]`).
    pub expressions: ExprLimits,
    /// How often task webhooks are checked for undelivered events (another replica's
    /// appends are seen this late; this replica's wake the delivery loop at once). Default
    /// 250ms, at least 10ms.
    #[serde(with = "humantime_serde")]
    pub webhook_interval: Duration,
    /// The wait before retrying a webhook after its first failed attempt; it doubles with
    /// each failure in a row (between half and all of it is waited: jitter), up to
    /// `webhook_backoff_max`. Default 1s.
    #[serde(with = "humantime_serde")]
    pub webhook_backoff: Duration,
    /// The longest wait between webhook retries. Default 5m.
    #[serde(with = "humantime_serde")]
    pub webhook_backoff_max: Duration,
    /// Networks (CIDR, such as `10.1.0.0/16` or `fd00:1::/64`) task webhooks may reach
    /// besides public addresses. Without one that holds it, a webhook to a loopback,
    /// private, link-local (cloud metadata), multicast or other special-purpose address is
    /// refused (see [`crate::egress`]); `["0.0.0.0/0", "::/0"]` allows every address.
    /// Default none (`reach dev`: loopback, `127.0.0.0/8` and `::1/128`). A bare address
    /// (`10.1.2.3`) means that address alone.
    #[serde(deserialize_with = "networks")]
    pub webhook_allowed_networks: Vec<ipnet::IpNet>,
}

/// CIDR networks, or bare addresses as one-address networks.
fn networks<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<ipnet::IpNet>, D::Error> {
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|s| {
            let s = s.trim();
            s.parse::<ipnet::IpNet>()
                .or_else(|_| s.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                .map_err(|_| {
                    serde::de::Error::custom(format!(
                        "{s:?} is not a network; write one in CIDR form, such as \"10.1.0.0/16\" \
                         or \"fd00:1::/64\", or an address, such as \"10.1.2.3\""
                    ))
                })
        })
        .collect()
}

impl Default for OrchestratorConfig {
    fn default() -> Self {
        Self {
            store_url: "sqlite://.reach/orchestrator.db".into(),
            sqlite_full_sync: false,
            flows_dir: None,
            watch_flows: true,
            router_endpoint: "http://127.0.0.1:7070".into(),
            context_ttl: Duration::from_secs(24 * 3600),
            redact_fields: Vec::new(),
            redact_values: Vec::new(),
            node_id: None,
            lease: Duration::from_secs(15),
            poll_interval: Duration::from_millis(500),
            default_call_timeout: Duration::from_secs(300),
            max_concurrent_tasks: 1024,
            store_acquire_timeout: Duration::from_secs(30),
            max_node_visits: 1000,
            max_concurrent_evaluations: 4,
            max_evaluations_per_flow: 2,
            max_watches_per_caller: DEFAULT_MAX_WATCHES_PER_CALLER,
            expressions: ExprLimits::default(),
            webhook_interval: Duration::from_millis(250),
            webhook_backoff: Duration::from_secs(1),
            webhook_backoff_max: Duration::from_secs(300),
            webhook_allowed_networks: Vec::new(),
        }
    }
}

impl OrchestratorConfig {
    /// The masker of everything shown: the built-in field globs and value patterns plus
    /// `redact_fields` and `redact_values`.
    ///
    /// # Errors
    /// [`ConfigError::Mask`] naming a pattern that does not parse.
    pub fn masker(&self) -> Result<crate::mask::Masker, ConfigError> {
        crate::mask::Masker::with_patterns(
            crate::mask::DEFAULT_SENSITIVE_FIELDS
                .iter()
                .map(|s| (*s).to_string())
                .chain(self.redact_fields.iter().cloned()),
            &self.redact_values,
        )
        .map_err(ConfigError::Mask)
    }

    /// Checks the values.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the bad field and what to write instead.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.store_url.starts_with("sqlite:")
            || self.store_url.starts_with("postgres://")
            || self.store_url.starts_with("postgresql://"))
        {
            return Err(ConfigError::StoreUrl {
                url: self.store_url.clone(),
            });
        }
        if !(self.router_endpoint.starts_with("http://")
            || self.router_endpoint.starts_with("https://"))
        {
            return Err(ConfigError::RouterEndpoint {
                endpoint: self.router_endpoint.clone(),
                detail: "it has no http:// or https:// scheme".into(),
            });
        }
        self.masker()?;
        if self.lease < MIN_LEASE {
            return Err(ConfigError::LeaseTooShort { lease: self.lease });
        }
        if self.max_concurrent_tasks == 0 {
            return Err(ConfigError::NoConcurrentTasks);
        }
        for (field, value) in [
            ("max_node_visits", self.max_node_visits),
            (
                "max_concurrent_evaluations",
                self.max_concurrent_evaluations,
            ),
            ("max_evaluations_per_flow", self.max_evaluations_per_flow),
            ("max_watches_per_caller", self.max_watches_per_caller),
            ("expressions.max_bytes", self.expressions.max_bytes),
            ("expressions.max_depth", self.expressions.max_depth),
            ("expressions.max_value_len", self.expressions.max_value_len),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero { field });
            }
        }
        if self.expressions.max_steps == 0 {
            return Err(ConfigError::Zero {
                field: "expressions.max_steps",
            });
        }
        for (field, value) in [
            ("expressions.max_time", self.expressions.max_time),
            ("default_call_timeout", self.default_call_timeout),
            ("webhook_backoff", self.webhook_backoff),
            ("webhook_backoff_max", self.webhook_backoff_max),
        ] {
            if value.is_zero() {
                return Err(ConfigError::Zero { field });
            }
        }
        // A zero poll interval spins a core polling the store.
        if self.poll_interval < MIN_POLL_INTERVAL {
            return Err(ConfigError::PollIntervalTooShort {
                interval: self.poll_interval,
            });
        }
        if self.webhook_interval < MIN_POLL_INTERVAL {
            return Err(ConfigError::WebhookIntervalTooShort {
                interval: self.webhook_interval,
            });
        }
        Ok(())
    }
}

/// The shortest `poll_interval` [`OrchestratorConfig::validate`] accepts.
pub const MIN_POLL_INTERVAL: Duration = Duration::from_millis(10);

/// The shortest task lease [`OrchestratorConfig::validate`] accepts.
pub const MIN_LEASE: Duration = Duration::from_millis(300);

/// A configuration value the orchestrator cannot run with. Messages name the field and what
/// to write instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A masking pattern does not parse.
    #[error("{0}")]
    Mask(crate::mask::MaskError),
    /// `store_url` has a scheme other than `sqlite:` or `postgres://`.
    #[error("store_url {url:?} must start with sqlite:// or postgres://")]
    StoreUrl {
        /// The URL given.
        url: String,
    },
    /// `router_endpoint` is not an `http(s)://HOST:PORT` URI.
    #[error("router_endpoint {endpoint:?} is not valid ({detail}); use http://HOST:PORT")]
    RouterEndpoint {
        /// The endpoint given.
        endpoint: String,
        /// What is wrong with it.
        detail: String,
    },
    /// `lease` is under [`MIN_LEASE`].
    #[error("lease must be at least 300ms, not {}", humantime::format_duration(*lease))]
    LeaseTooShort {
        /// The lease given.
        lease: Duration,
    },
    /// `max_concurrent_tasks` is 0.
    #[error("max_concurrent_tasks must be at least 1")]
    NoConcurrentTasks,
    /// `poll_interval` is below [`MIN_POLL_INTERVAL`].
    #[error("poll_interval is {interval:?}; it must be at least 10ms (the default is 500ms)")]
    PollIntervalTooShort {
        /// The configured interval.
        interval: Duration,
    },
    /// `webhook_interval` is below [`MIN_POLL_INTERVAL`].
    #[error("webhook_interval is {interval:?}; it must be at least 10ms (the default is 250ms)")]
    WebhookIntervalTooShort {
        /// The configured interval.
        interval: Duration,
    },
    /// A count or duration that must be positive is 0.
    #[error("{field} must be more than 0")]
    Zero {
        /// The field (`max_node_visits`, `expressions.max_steps`, ...).
        field: &'static str,
    },
    /// The HTTP client that delivers task webhooks cannot be made.
    #[error("cannot make the webhook HTTP client ({detail}); check the system's TLS setup")]
    WebhookClient {
        /// The client builder's error.
        detail: String,
    },
    /// `flows_dir` is not a directory.
    #[error("flows_dir {} is not a directory; create it or point flows_dir at one", path.display())]
    FlowsDirNotADirectory {
        /// The path given.
        path: PathBuf,
    },
    /// `flows_dir` cannot be watched for changes.
    #[error("cannot watch flows_dir {} ({detail}); check its permissions, or set watch_flows = false", path.display())]
    FlowsDirUnwatchable {
        /// The directory.
        path: PathBuf,
        /// The watcher's error.
        detail: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowed_networks_are_cidr_or_bare_addresses() {
        let config: OrchestratorConfig = serde_json::from_value(serde_json::json!({
            "webhook_allowed_networks": ["10.1.0.0/16", "10.2.3.4", "::1"]
        }))
        .unwrap();
        let shown: Vec<String> = config
            .webhook_allowed_networks
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(shown, ["10.1.0.0/16", "10.2.3.4/32", "::1/128"]);
        let e = serde_json::from_value::<OrchestratorConfig>(serde_json::json!({
            "webhook_allowed_networks": ["10.0.0.0/33"]
        }))
        .unwrap_err();
        assert!(
            e.to_string().starts_with(
                "\"10.0.0.0/33\" is not a network; write one in CIDR form, such as \"10.1.0.0/16\""
            ),
            "{e}"
        );
    }

    #[test]
    fn validate_names_the_field() {
        let ok = OrchestratorConfig::default();
        assert_eq!(ok.validate(), Ok(()));
        let cases = [
            (
                OrchestratorConfig {
                    store_url: "mysql://x".into(),
                    ..ok.clone()
                },
                "store_url \"mysql://x\" must start with sqlite:// or postgres://",
            ),
            (
                OrchestratorConfig {
                    router_endpoint: "127.0.0.1:7070".into(),
                    ..ok.clone()
                },
                "router_endpoint \"127.0.0.1:7070\" is not valid (it has no http:// or https:// scheme); use http://HOST:PORT",
            ),
            (
                OrchestratorConfig {
                    lease: Duration::from_millis(100),
                    ..ok.clone()
                },
                "lease must be at least 300ms, not 100ms",
            ),
            (
                OrchestratorConfig {
                    max_concurrent_tasks: 0,
                    ..ok.clone()
                },
                "max_concurrent_tasks must be at least 1",
            ),
        ];
        for (config, message) in cases {
            assert_eq!(config.validate().unwrap_err().to_string(), message);
        }
    }
}
