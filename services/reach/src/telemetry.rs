//! Log setup: `REACH_LOG` (an `EnvFilter` directive list; default `warn,reach=info` for
//! every reach crate) and `REACH_LOG_FORMAT` (`plain` or `json`).

use tracing_subscriber::EnvFilter;

/// The default filter: warnings from everything, info from Reach's own crates.
pub const DEFAULT_FILTER: &str = "warn,reach=info,reach_registry=info,reach_router=info,reach_sdk=info,reach_agents=info,reach_orchestrator=info";

/// Installs the global subscriber. Safe to call more than once (later calls do nothing).
///
/// # Errors
/// A message when `REACH_LOG` or `REACH_LOG_FORMAT` is invalid.
pub fn init_logs() -> Result<(), String> {
    let filter = match std::env::var("REACH_LOG") {
        Ok(directives) => EnvFilter::try_new(&directives)
            .map_err(|e| format!("REACH_LOG {directives:?} is invalid: {e}"))?,
        Err(_) => EnvFilter::new(DEFAULT_FILTER),
    };
    let format = std::env::var("REACH_LOG_FORMAT").unwrap_or_else(|_| "plain".into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = match format.as_str() {
        "plain" => builder.try_init(),
        "json" => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .try_init(),
        other => {
            return Err(format!(
                "REACH_LOG_FORMAT {other:?} is invalid: use plain or json"
            ));
        }
    };
    let _ = result;
    Ok(())
}
