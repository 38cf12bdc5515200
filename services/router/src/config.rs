//! Router configuration.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How the router finds instances and what it accepts.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// The registry to watch, as a URL (`http://127.0.0.1:7070`).
    pub registry_endpoint: String,
    /// The largest message accepted, in bytes (encoded protobuf size), for calls and for every
    /// message of a stream. Default 4 MiB.
    pub max_message_bytes: usize,
    /// How long a call waits for a route to get a ready instance when its instances are all
    /// momentarily unready (for example, one just replaced). Bounded by the caller's deadline.
    #[serde(with = "humantime_serde")]
    pub route_wait: Duration,
    /// The latency an instance is assumed to have before it has answered anything.
    #[serde(with = "humantime_serde")]
    pub default_rtt: Duration,
    /// How fast the peak-EWMA latency estimate forgets a slow response.
    #[serde(with = "humantime_serde")]
    pub rtt_decay: Duration,
    /// How long connecting to an instance may take before the attempt counts as failed.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// How many more instances a unary call may try when the first provably did not take it
    /// (connection refused, or the instance answered that it is draining).
    pub max_redeliveries: u32,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            registry_endpoint: "http://127.0.0.1:7070".into(),
            max_message_bytes: 4 * 1024 * 1024,
            route_wait: Duration::from_secs(1),
            default_rtt: Duration::from_millis(5),
            rtt_decay: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(1),
            max_redeliveries: 2,
        }
    }
}

impl RouterConfig {
    /// Checks the settings.
    ///
    /// # Errors
    /// A message naming the setting to fix.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_message_bytes < 1024 {
            return Err(format!(
                "router.max_message_bytes is {} bytes; it must be at least 1024",
                self.max_message_bytes
            ));
        }
        if !(self.registry_endpoint.starts_with("http://")
            || self.registry_endpoint.starts_with("https://"))
        {
            return Err(format!(
                "router.registry_endpoint {:?} must be an http(s) URL such as http://127.0.0.1:7070",
                self.registry_endpoint
            ));
        }
        if self.rtt_decay.is_zero() {
            return Err("router.rtt_decay must be above zero".into());
        }
        Ok(())
    }

    /// The decoding limit handed to tonic: above the routing limit, so that messages a little
    /// over it reach the router and get an error naming both sizes.
    pub fn decoding_limit(&self) -> usize {
        self.max_message_bytes
            .saturating_mul(2)
            .max(self.max_message_bytes + (1 << 20))
    }
}
