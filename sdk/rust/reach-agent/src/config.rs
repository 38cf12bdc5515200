//! Agent configuration files: the model endpoint ([`ModelConfig`]) and the loop's settings
//! ([`LoopConfig`]), in TOML or YAML, with `${ENV}` substitution so keys never sit in files.
//!
//! ```toml
//! [model]
//! base_url = "https://api.openai.com/v1"
//! api_key = "${OPENAI_API_KEY}"
//! model = "gpt-4o-mini"
//! timeout = "60s"
//! max_retries = 3
//!
//! [agent]
//! system = "You triage consumer complaints."
//! max_turns = 8
//! ```
//!
//! Substitution: in every string value (never in keys), `${NAME}` is replaced by the
//! environment variable `NAME`; `$${` writes a literal `${`. A variable that is not set is a
//! start-up error naming it and the file ([`ConfigError::MissingVariable`]). The format is
//! chosen by the file extension: `.toml`, else YAML (`.yaml`, `.yml`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// An OpenAI-compatible model endpoint.
#[derive(Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// The API base URL; requests go to `{base_url}/chat/completions`.
    pub base_url: String,
    /// The bearer token (`Authorization: Bearer ...`); empty sends none. Write
    /// `"${OPENAI_API_KEY}"` in files. Never serialised (a dumped config leaves it out).
    #[serde(skip_serializing)]
    pub api_key: String,
    /// The model to ask for (`gen_ai.request.model`).
    pub model: String,
    /// The provider name reported as `gen_ai.provider.name` (`openai`, `vllm`, ...).
    pub provider_name: String,
    /// How long one attempt may take, response body (or the whole stream) included.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Retries after the first attempt, on 429, 5xx and connection failures (not on
    /// timeouts, nor on other 4xx).
    pub max_retries: u32,
    /// The first back-off delay (doubling up to `max_backoff`), when the server sent no
    /// `Retry-After`.
    #[serde(with = "humantime_serde")]
    pub initial_backoff: Duration,
    /// The cap on back-off delays and on the `Retry-After` honoured.
    #[serde(with = "humantime_serde")]
    pub max_backoff: Duration,
    /// The largest response body (or streamed response) accepted, in bytes.
    pub max_response_bytes: usize,
    /// Sampling temperature sent with each request, when set.
    pub temperature: Option<f32>,
    /// `max_tokens` sent with each request, when set.
    pub max_output_tokens: Option<u32>,
}

impl std::fmt::Debug for ModelConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelConfig")
            .field("base_url", &self.base_url)
            .field(
                "api_key",
                &if self.api_key.is_empty() {
                    ""
                } else {
                    "<redacted>"
                },
            )
            .field("model", &self.model)
            .field("timeout", &self.timeout)
            .field("max_retries", &self.max_retries)
            .finish_non_exhaustive()
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            base_url: "https://api.openai.com/v1".into(),
            api_key: String::new(),
            model: String::new(),
            provider_name: "openai".into(),
            timeout: Duration::from_secs(120),
            max_retries: 3,
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
            max_response_bytes: 8 << 20,
            temperature: None,
            max_output_tokens: None,
        }
    }
}

impl ModelConfig {
    /// A config for `model` at `base_url`, defaults elsewhere.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            model: model.into(),
            ..Self::default()
        }
    }

    /// Checks the settings.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the setting.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field: &str, message: &str| ConfigError::Invalid {
            field: format!("model.{field}"),
            message: message.to_string(),
        };
        if !(self.base_url.starts_with("http://") || self.base_url.starts_with("https://")) {
            return Err(invalid(
                "base_url",
                "must be an http:// or https:// URL, e.g. https://api.openai.com/v1",
            ));
        }
        if self.model.is_empty() {
            return Err(invalid("model", "must name the model, e.g. gpt-4o-mini"));
        }
        if self.timeout.is_zero() {
            return Err(invalid("timeout", "must be above zero"));
        }
        if self.max_response_bytes == 0 {
            return Err(invalid("max_response_bytes", "must be above zero"));
        }
        Ok(())
    }
}

/// The tool loop's settings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LoopConfig {
    /// The system prompt.
    pub system: Option<String>,
    /// The most model calls per run.
    pub max_turns: u32,
    /// Run one tool call per model step (others are answered "not run").
    pub one_tool_per_step: bool,
    /// Stream model responses.
    pub streaming: bool,
}

impl Default for LoopConfig {
    fn default() -> Self {
        Self {
            system: None,
            max_turns: 8,
            one_tool_per_step: false,
            streaming: false,
        }
    }
}

/// An agent config file.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AgentFileConfig {
    /// `[model]`.
    pub model: ModelConfig,
    /// `[agent]`.
    pub agent: LoopConfig,
    /// `[memory]`.
    pub memory: crate::memory::MemoryConfig,
}

/// Why a config file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read agent config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file does not parse or has unknown keys.
    #[error("{path}: {message}")]
    Syntax {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A `${NAME}` names an unset variable.
    #[error(
        "{path}: environment variable {name} is not set (referenced as ${{{name}}} at {at}); set it or edit the file"
    )]
    MissingVariable {
        /// The file.
        path: PathBuf,
        /// The variable.
        name: String,
        /// Where in the document (`model.api_key`).
        at: String,
    },
    /// A setting is invalid.
    #[error("invalid {field}: {message}")]
    Invalid {
        /// The setting.
        field: String,
        /// What is wrong.
        message: String,
    },
}

impl AgentFileConfig {
    /// Loads `path`, substituting `${NAME}` from the process environment, and validates the
    /// model settings.
    ///
    /// # Errors
    /// [`ConfigError`].
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::load_with(path, |name| std::env::var(name).ok())
    }

    /// Like [`AgentFileConfig::load`] with variables from `env` (tests pass a map).
    ///
    /// # Errors
    /// [`ConfigError`].
    pub fn load_with(
        path: &Path,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(path, &text, env)
    }

    /// Parses `text` (read from `path`, whose extension picks the format).
    ///
    /// # Errors
    /// [`ConfigError`].
    pub fn parse(
        path: &Path,
        text: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let syntax = |message: String| ConfigError::Syntax {
            path: path.to_path_buf(),
            message,
        };
        let is_toml = path.extension().is_some_and(|e| e == "toml");
        let mut value: Value = if is_toml {
            toml::from_str(text).map_err(|e| syntax(e.to_string()))?
        } else {
            serde_norway::from_str(text).map_err(|e| syntax(e.to_string()))?
        };
        if value.is_null() {
            value = Value::Object(serde_json::Map::new());
        }
        substitute(&mut value, "", &env).map_err(|(name, at)| ConfigError::MissingVariable {
            path: path.to_path_buf(),
            name,
            at,
        })?;
        let config: AgentFileConfig =
            serde_json::from_value(value).map_err(|e| syntax(e.to_string()))?;
        config.model.validate()?;
        Ok(config)
    }
}

/// Replaces `${NAME}` in every string of `value`; `Err((name, at))` for an unset one.
fn substitute(
    value: &mut Value,
    at: &str,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<(), (String, String)> {
    match value {
        Value::String(text) => {
            *text = substitute_str(text, env).map_err(|name| (name, at.to_string()))?;
        }
        Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                substitute(item, &format!("{at}[{i}]"), env)?;
            }
        }
        Value::Object(map) => {
            for (key, item) in map.iter_mut() {
                let path = if at.is_empty() {
                    key.clone()
                } else {
                    format!("{at}.{key}")
                };
                substitute(item, &path, env)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// `text` with `${NAME}` replaced; `Err(name)` for an unset variable.
pub fn substitute_str(text: &str, env: &impl Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i..];
        if let Some(tail) = after.strip_prefix("$${") {
            out.push_str("${");
            rest = tail;
        } else if let Some(tail) = after.strip_prefix("${")
            && let Some(end) = tail.find('}')
        {
            let name = &tail[..end];
            out.push_str(&env(name).ok_or_else(|| name.to_string())?);
            rest = &tail[end + 1..];
        } else {
            out.push('$');
            rest = &after[1..];
        }
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_are_substituted_and_a_missing_one_is_named() {
        let text = "[model]\nbase_url = \"http://127.0.0.1:1/v1\"\napi_key = \"${KEY}\"\nmodel = \"m\"\ntimeout = \"5s\"\n[agent]\nmax_turns = 3\n";
        let env = |name: &str| (name == "KEY").then(|| "sk-test".to_string());
        let config = AgentFileConfig::parse(Path::new("a.toml"), text, env).unwrap();
        assert_eq!(config.model.api_key, "sk-test");
        assert_eq!(config.model.timeout, Duration::from_secs(5));
        assert_eq!(config.agent.max_turns, 3);
        assert!(!format!("{:?}", config.model).contains("sk-test"));
        let error = AgentFileConfig::parse(Path::new("a.toml"), text, |_| None).unwrap_err();
        let message = error.to_string();
        assert!(
            message.contains("KEY") && message.contains("model.api_key"),
            "{message}"
        );
        let yaml = "model:\n  base_url: http://x/v1\n  model: m\n  api_key: \"$${literal}\"\n";
        let config = AgentFileConfig::parse(Path::new("a.yaml"), yaml, |_| None).unwrap();
        assert_eq!(config.model.api_key, "${literal}");
    }
}
