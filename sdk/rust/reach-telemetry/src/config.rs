//! Telemetry configuration, read from an environment map so tests can inject it.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `REACH_LOG` | `tracing` filter directives | [`DEFAULT_LOG_FILTER`] |
//! | `REACH_LOG_FORMAT` | `plain` or `json` | `plain` |
//! | `OTEL_EXPORTER_OTLP_ENDPOINT` | OTLP/gRPC collector URL; unset or empty disables export | unset |
//! | `OTEL_SERVICE_NAME` | `service.name` resource attribute | the caller's default |
//! | `OTEL_RESOURCE_ATTRIBUTES` | `k=v,k2=v2` extra resource attributes | none |
//! | `OTEL_TRACES_SAMPLER` | `always_on`, `always_off`, `traceidratio`, `parentbased_*` | `parentbased_always_on` |
//! | `OTEL_TRACES_SAMPLER_ARG` | the ratio for the `*traceidratio` samplers | `1.0` |
//! | `OTEL_EXPORTER_OTLP_TIMEOUT` | export timeout in milliseconds; also the most shutdown spends flushing | `3000` |
//! | `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT` | the same for traces; wins over `OTEL_EXPORTER_OTLP_TIMEOUT` | unset |
//! | `OTEL_BSP_MAX_QUEUE_SIZE` | spans buffered before new ones are dropped | `2048` |

use std::collections::HashMap;
use std::time::Duration;

/// The default `REACH_LOG` filter: warnings from everything, info from Reach, except the
/// per-message spans of the router and of the SDK client.
///
/// `tracing-subscriber` matches a directive's target as a string prefix, so `reach=info`
/// covers every `reach_*` crate (`reach_registry`, `reach_router`, `reach_sdk`, ...) and the
/// `reach::*` span targets this crate uses. The log layer formats every field of every span
/// it sees when the span opens; for the router's span of each routed call
/// (`reach::message::router`) that cost about 9 % of its throughput (`docs/benchmarks.md`),
/// so it and the client's (`reach::message::client`) are left out of log lines unless asked
/// for (`REACH_LOG=warn,reach=info`). The router's own warnings name the message's
/// `trace_id` and `message_id` themselves; an agent's span (`reach::message::agent`) stays, so
/// every line a handler logs carries its message's trace. The log filter never affects
/// tracing: with an OTLP endpoint the spans are exported all the same.
pub const DEFAULT_LOG_FILTER: &str =
    "warn,reach=info,reach::message::router=warn,reach::message::client=warn";

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines, with every enclosing span and its fields (`span{trace_id=..}:`).
    #[default]
    Plain,
    /// One JSON object per line: event fields flattened at the top level, the current span as
    /// `span` and every enclosing span, with its fields, in `spans`.
    Json,
}

/// Which traces are recorded and exported, as `OTEL_TRACES_SAMPLER` names them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SamplerConfig {
    /// Record every trace.
    AlwaysOn,
    /// Record nothing.
    AlwaysOff,
    /// Record this fraction (0.0–1.0) of trace ids.
    TraceIdRatio(f64),
    /// Follow the caller's sampled flag; for new traces, record every trace.
    ParentBasedAlwaysOn,
    /// Follow the caller's sampled flag; for new traces, record none.
    ParentBasedAlwaysOff,
    /// Follow the caller's sampled flag; for new traces, record this fraction.
    ParentBasedTraceIdRatio(f64),
}

/// Everything [`crate::init()`] needs, normally read with [`TelemetryConfig::from_env`].
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryConfig {
    /// `tracing` filter directives (`REACH_LOG`).
    pub log_filter: String,
    /// Log line format (`REACH_LOG_FORMAT`).
    pub log_format: LogFormat,
    /// The OTLP/gRPC collector endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT`); `None` disables
    /// export (spans still get ids and `traceparent` still propagates).
    pub otlp_endpoint: Option<String>,
    /// The `service.name` resource attribute (`OTEL_SERVICE_NAME`).
    pub service_name: String,
    /// Extra resource attributes (`OTEL_RESOURCE_ATTRIBUTES`), in the order given.
    pub resource_attributes: Vec<(String, String)>,
    /// The sampler (`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`).
    pub sampler: SamplerConfig,
    /// How long one export may take before it is abandoned (`OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`,
    /// else `OTEL_EXPORTER_OTLP_TIMEOUT`, ms). Also bounds [`crate::TelemetryGuard::shutdown`]:
    /// a collector that is down or never answers costs the exit at most this.
    pub export_timeout: Duration,
    /// How many finished spans wait for export before new ones are dropped
    /// (`OTEL_BSP_MAX_QUEUE_SIZE`).
    pub max_queue_size: usize,
    /// How long [`crate::TelemetryGuard::shutdown`] may spend flushing, at most (the export
    /// timeout, if shorter, is the limit).
    pub shutdown_timeout: Duration,
}

/// A configuration value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `REACH_LOG_FORMAT` is neither `plain` nor `json`.
    #[error("REACH_LOG_FORMAT must be plain or json, got {0:?}")]
    LogFormat(String),
    /// `OTEL_TRACES_SAMPLER` names an unknown sampler.
    #[error(
        "OTEL_TRACES_SAMPLER {0:?} is not supported: use always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off or parentbased_traceidratio"
    )]
    Sampler(String),
    /// `OTEL_TRACES_SAMPLER_ARG` is not a number between 0 and 1.
    #[error("OTEL_TRACES_SAMPLER_ARG must be a number between 0 and 1, got {0:?}")]
    SamplerArg(String),
    /// A numeric variable is not a non-negative integer.
    #[error("{0} must be a non-negative integer, got {1:?}")]
    Number(&'static str, String),
}

impl TelemetryConfig {
    /// The defaults, with `service_name` as the `service.name` of this process.
    pub fn new(service_name: impl Into<String>) -> Self {
        Self {
            log_filter: DEFAULT_LOG_FILTER.to_string(),
            log_format: LogFormat::Plain,
            otlp_endpoint: None,
            service_name: service_name.into(),
            resource_attributes: Vec::new(),
            sampler: SamplerConfig::ParentBasedAlwaysOn,
            export_timeout: Duration::from_secs(3),
            max_queue_size: 2048,
            shutdown_timeout: Duration::from_secs(5),
        }
    }

    /// Reads the process environment (see the module docs for the variables).
    /// `default_service_name` is used when `OTEL_SERVICE_NAME` is unset.
    ///
    /// # Errors
    /// [`ConfigError`] names the variable with an unusable value.
    pub fn from_env(default_service_name: &str) -> Result<Self, ConfigError> {
        Self::from_vars(default_service_name, std::env::vars())
    }

    /// Reads the variables from `vars` instead of the process environment (for tests).
    ///
    /// # Errors
    /// [`ConfigError`] names the variable with an unusable value.
    pub fn from_vars<K, V>(
        default_service_name: &str,
        vars: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Self, ConfigError>
    where
        K: Into<String>,
        V: Into<String>,
    {
        let vars: HashMap<String, String> = vars
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        let get = |key: &str| {
            vars.get(key)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let mut config = Self::new(default_service_name);
        if let Some(filter) = get("REACH_LOG") {
            config.log_filter = filter;
        }
        if let Some(format) = get("REACH_LOG_FORMAT") {
            config.log_format = match format.to_ascii_lowercase().as_str() {
                "plain" | "text" => LogFormat::Plain,
                "json" => LogFormat::Json,
                _ => return Err(ConfigError::LogFormat(format)),
            };
        }
        config.otlp_endpoint = get("OTEL_EXPORTER_OTLP_ENDPOINT");
        if let Some(name) = get("OTEL_SERVICE_NAME") {
            config.service_name = name;
        }
        if let Some(attributes) = get("OTEL_RESOURCE_ATTRIBUTES") {
            config.resource_attributes = parse_resource_attributes(&attributes);
        }
        let sampler_arg = get("OTEL_TRACES_SAMPLER_ARG");
        if let Some(sampler) = get("OTEL_TRACES_SAMPLER") {
            config.sampler = parse_sampler(&sampler, sampler_arg.as_deref())?;
        }
        // The signal-specific variable wins, as the OTLP exporter specification says.
        for name in [
            "OTEL_EXPORTER_OTLP_TIMEOUT",
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        ] {
            if let Some(ms) = get(name) {
                let ms: u64 = ms
                    .parse()
                    .map_err(|_| ConfigError::Number(name, ms.clone()))?;
                config.export_timeout = Duration::from_millis(ms);
            }
        }
        if let Some(size) = get("OTEL_BSP_MAX_QUEUE_SIZE") {
            config.max_queue_size = size
                .parse()
                .map_err(|_| ConfigError::Number("OTEL_BSP_MAX_QUEUE_SIZE", size.clone()))?;
        }
        Ok(config)
    }
}

/// Parses `OTEL_RESOURCE_ATTRIBUTES` (`key=value` pairs separated by commas, values
/// percent-encoded per the OpenTelemetry spec); malformed pairs are skipped.
pub fn parse_resource_attributes(text: &str) -> Vec<(String, String)> {
    text.split(',')
        .filter_map(|pair| {
            let (key, value) = pair.split_once('=')?;
            let key = key.trim();
            if key.is_empty() {
                return None;
            }
            Some((key.to_string(), percent_decode(value.trim())))
        })
        .collect()
}

/// Decodes `%XX` escapes (as in `OTEL_RESOURCE_ATTRIBUTES` and `grpc-message`); invalid
/// escapes stay as they are, invalid UTF-8 is replaced.
pub(crate) fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Ok(b) = u8::from_str_radix(&text[i + 1..i + 3], 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_sampler(name: &str, arg: Option<&str>) -> Result<SamplerConfig, ConfigError> {
    let ratio = || -> Result<f64, ConfigError> {
        match arg {
            None => Ok(1.0),
            Some(text) => text
                .parse::<f64>()
                .ok()
                .filter(|r| (0.0..=1.0).contains(r))
                .ok_or_else(|| ConfigError::SamplerArg(text.to_string())),
        }
    };
    Ok(match name.to_ascii_lowercase().as_str() {
        "always_on" => SamplerConfig::AlwaysOn,
        "always_off" => SamplerConfig::AlwaysOff,
        "traceidratio" => SamplerConfig::TraceIdRatio(ratio()?),
        "parentbased_always_on" => SamplerConfig::ParentBasedAlwaysOn,
        "parentbased_always_off" => SamplerConfig::ParentBasedAlwaysOff,
        "parentbased_traceidratio" => SamplerConfig::ParentBasedTraceIdRatio(ratio()?),
        _ => return Err(ConfigError::Sampler(name.to_string())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_without_variables() {
        let config =
            TelemetryConfig::from_vars("reach-router", Vec::<(String, String)>::new()).unwrap();
        assert_eq!(config, TelemetryConfig::new("reach-router"));
        assert_eq!(config.log_filter, DEFAULT_LOG_FILTER);
        assert!(config.otlp_endpoint.is_none());
    }

    #[test]
    fn reads_every_variable() {
        let config = TelemetryConfig::from_vars(
            "x",
            [
                ("REACH_LOG", "debug"),
                ("REACH_LOG_FORMAT", "json"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317"),
                ("OTEL_SERVICE_NAME", "router"),
                (
                    "OTEL_RESOURCE_ATTRIBUTES",
                    "deployment.environment=dev,team=a%2Cb,bad",
                ),
                ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "500"),
            ],
        )
        .unwrap();
        assert_eq!(config.log_filter, "debug");
        assert_eq!(config.log_format, LogFormat::Json);
        assert_eq!(
            config.otlp_endpoint.as_deref(),
            Some("http://127.0.0.1:4317")
        );
        assert_eq!(config.service_name, "router");
        assert_eq!(
            config.resource_attributes,
            vec![
                ("deployment.environment".to_string(), "dev".to_string()),
                ("team".to_string(), "a,b".to_string())
            ]
        );
        assert_eq!(config.sampler, SamplerConfig::ParentBasedTraceIdRatio(0.25));
        assert_eq!(config.export_timeout, Duration::from_millis(500));
    }

    #[test]
    fn the_traces_timeout_wins_over_the_general_one() {
        let config = TelemetryConfig::from_vars(
            "x",
            [
                ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "250"),
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "500"),
            ],
        )
        .unwrap();
        assert_eq!(config.export_timeout, Duration::from_millis(250));
    }

    #[test]
    fn refuses_bad_values() {
        assert!(matches!(
            TelemetryConfig::from_vars("x", [("REACH_LOG_FORMAT", "xml")]),
            Err(ConfigError::LogFormat(_))
        ));
        assert!(matches!(
            TelemetryConfig::from_vars("x", [("OTEL_TRACES_SAMPLER", "sometimes")]),
            Err(ConfigError::Sampler(_))
        ));
        assert!(matches!(
            TelemetryConfig::from_vars(
                "x",
                [
                    ("OTEL_TRACES_SAMPLER", "traceidratio"),
                    ("OTEL_TRACES_SAMPLER_ARG", "2")
                ]
            ),
            Err(ConfigError::SamplerArg(_))
        ));
    }
}
