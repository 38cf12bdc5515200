//! The example agents' settings: the `[agents]` section of the `reach` config, today the
//! coordinator's optional model endpoint (`[agents.model]`).
//!
//! ```toml
//! [agents.model]
//! base_url = "https://api.openai.com/v1"  # "" (the default): no model, the rules classify
//! model = "gpt-4o-mini"
//! api_key_env = "OPENAI_API_KEY"           # the variable holding the key; "": send no key
//! timeout = "30s"
//! max_retries = 2
//! ```
//!
//! The key itself is never in the file: [`ModelSettings::resolve`] reads the variable that
//! `api_key_env` names when the agents start, and a variable that is not set is an error
//! naming it ([`ModelSettingsError::MissingKey`]).

use std::time::Duration;

use reach_agent::{ModelConfig, OpenAiProvider};
use serde::{Deserialize, Serialize};

use crate::decision::ComplaintClassifier;
use crate::model_classifier::ModelClassifier;

/// The `[agents]` section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentsConfig {
    /// The coordinator's model (`[agents.model]`); an empty `base_url` means none.
    pub model: ModelSettings,
}

/// An OpenAI-compatible chat-completions endpoint for the coordinator's classifier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSettings {
    /// The API base URL (requests go to `{base_url}/chat/completions`); "" disables the model.
    pub base_url: String,
    /// The model to ask for; required when `base_url` is set.
    pub model: String,
    /// The environment variable holding the API key (sent as `Authorization: Bearer`); ""
    /// sends no key (a local server that needs none).
    pub api_key_env: String,
    /// How long one attempt may take, the response body included.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Retries after the first attempt on 429, 5xx and connection failures.
    pub max_retries: u32,
}

/// The variable `api_key_env` names unless set otherwise.
pub const DEFAULT_API_KEY_ENV: &str = "OPENAI_API_KEY";

impl Default for ModelSettings {
    fn default() -> Self {
        Self {
            base_url: String::new(),
            model: String::new(),
            api_key_env: DEFAULT_API_KEY_ENV.into(),
            timeout: Duration::from_secs(30),
            max_retries: 2,
        }
    }
}

/// Why the model settings cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelSettingsError {
    /// A setting is invalid; `field` is its dotted key (`agents.model.model`).
    #[error("invalid {field}: {message}")]
    Invalid {
        /// The key.
        field: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// The variable `api_key_env` names is not set.
    #[error(
        "environment variable {variable} (agents.model.api_key_env, --model-api-key-env) is not set; \
         export the API key in it, or pass --model-api-key-env '' for a server that needs no key"
    )]
    MissingKey {
        /// The variable.
        variable: String,
    },
}

impl ModelSettings {
    /// Whether a model is configured (`base_url` is not empty).
    pub fn is_enabled(&self) -> bool {
        !self.base_url.is_empty()
    }

    /// Checks the settings (not the key variable, read at start by
    /// [`ModelSettings::resolve`]). Nothing is checked when no model is configured.
    ///
    /// # Errors
    /// [`ModelSettingsError::Invalid`] naming the key.
    pub fn validate(&self) -> Result<(), ModelSettingsError> {
        if !self.is_enabled() {
            return Ok(());
        }
        self.model_config(String::new())
            .validate()
            .map_err(|e| match e {
                reach_agent::config::ConfigError::Invalid { field, message } => {
                    ModelSettingsError::Invalid {
                        field: format!("agents.{field}"),
                        message,
                    }
                }
                other => ModelSettingsError::Invalid {
                    field: "agents.model".into(),
                    message: other.to_string(),
                },
            })
    }

    /// The agent kit's [`ModelConfig`], the key read from the variable `api_key_env` names
    /// through `env` (the process uses `|name| std::env::var(name).ok()`); `None` when no
    /// model is configured.
    ///
    /// # Errors
    /// [`ModelSettingsError`]: invalid settings, or the key variable is not set.
    pub fn resolve(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<ModelConfig>, ModelSettingsError> {
        if !self.is_enabled() {
            return Ok(None);
        }
        self.validate()?;
        let api_key = if self.api_key_env.is_empty() {
            String::new()
        } else {
            env(&self.api_key_env).ok_or_else(|| ModelSettingsError::MissingKey {
                variable: self.api_key_env.clone(),
            })?
        };
        Ok(Some(self.model_config(api_key)))
    }

    /// The coordinator's classifier: the model (an [`OpenAiProvider`]) when configured, else
    /// the rules.
    ///
    /// # Errors
    /// As [`ModelSettings::resolve`].
    pub fn classifier(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<ComplaintClassifier, ModelSettingsError> {
        let Some(config) = self.resolve(env)? else {
            return Ok(ComplaintClassifier::rules());
        };
        let provider = OpenAiProvider::new(config).map_err(|e| ModelSettingsError::Invalid {
            field: "agents.model".into(),
            message: e.to_string(),
        })?;
        Ok(ComplaintClassifier::with_model(ModelClassifier::new(
            std::sync::Arc::new(provider),
        )))
    }

    fn model_config(&self, api_key: String) -> ModelConfig {
        ModelConfig {
            api_key,
            timeout: self.timeout,
            max_retries: self.max_retries,
            ..ModelConfig::new(&self.base_url, &self.model)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_base_url_means_no_model_and_a_missing_key_is_named() {
        let settings = ModelSettings::default();
        assert_eq!(settings.resolve(|_| None), Ok(None));
        let settings = ModelSettings {
            base_url: "http://127.0.0.1:1/v1".into(),
            model: "m".into(),
            ..ModelSettings::default()
        };
        let error = settings.resolve(|_| None).unwrap_err();
        assert!(error.to_string().contains("OPENAI_API_KEY"), "{error}");
        let config = settings
            .resolve(|name| (name == "OPENAI_API_KEY").then(|| "sk-1".to_string()))
            .unwrap()
            .unwrap();
        assert_eq!(
            (config.api_key.as_str(), config.model.as_str()),
            ("sk-1", "m")
        );
        let keyless = ModelSettings {
            api_key_env: String::new(),
            ..settings.clone()
        };
        assert_eq!(keyless.resolve(|_| None).unwrap().unwrap().api_key, "");
        let unnamed = ModelSettings {
            model: String::new(),
            ..settings
        };
        let error = unnamed.validate().unwrap_err().to_string();
        assert!(error.contains("agents.model.model"), "{error}");
    }
}
