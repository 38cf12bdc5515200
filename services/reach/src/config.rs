//! Configuration of the `reach` services, layered with figment: built-in defaults, then a
//! TOML file (`--config`), then `REACH_*` environment variables (`__` separates nesting:
//! `REACH_ROUTER__MAX_MESSAGE_BYTES=8388608`), then command-line flags.

use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use reach_agents::model_config::AgentsConfig;
use reach_orchestrator::OrchestratorConfig;
use reach_registry::RegistryConfig;
use reach_router::RouterConfig;
use serde::{Deserialize, Serialize};

/// The top-level keys of [`ReachConfig`], which `REACH_<KEY>` / `REACH_<KEY>__<FIELD>`
/// variables may set.
const SECTIONS: [&str; 12] = [
    "admin",
    "agents",
    "mcp",
    "edge",
    "edge_listen",
    "trust",
    "listen",
    "admin_listen",
    "server",
    "registry",
    "router",
    "orchestrator",
];

/// Every setting of the `reach` services.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReachConfig {
    /// Where the gRPC services listen (`host:port`).
    pub listen: String,
    /// Where the HTTP admin port listens (`host:port`); empty disables it.
    pub admin_listen: String,
    /// Where `reach dev`'s A2A edge serves its JSON-RPC binding and agent cards over HTTP
    /// (`host:port`); empty disables it (the A2A gRPC service stays on `listen`).
    pub edge_listen: String,
    /// The HTTP admin port's hosts and connection limits (`[admin]`).
    pub admin: AdminConfig,
    /// The A2A edge's settings (`docs/edges.md`).
    pub edge: reach_edge::a2a::EdgeConfig,
    /// Limits on the gRPC listener's connections: how many at once, how soon they must start
    /// speaking, how many bytes of partly received messages they may hold.
    pub server: reach_rpc::ConnectionLimits,
    /// The registry's settings.
    pub registry: RegistryConfig,
    /// The router's settings.
    pub router: RouterConfig,
    /// The orchestrator's settings.
    pub orchestrator: OrchestratorConfig,
    /// The example agents' settings (`[agents.model]`: the coordinator's optional model);
    /// used by the commands that start them (`reach dev`).
    pub agents: AgentsConfig,
    /// Identities, TLS, bearer tokens and the policy (`docs/security.md`); none by default,
    /// which is only allowed on loopback.
    pub trust: reach_trust::TrustConfig,
    /// MCP servers attached to the mesh (`[[mcp.attach]]`; `reach mcp attach`, `docs/edges.md`).
    pub mcp: McpConfig,
}

/// The `[mcp]` section.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct McpConfig {
    /// The MCP servers `reach mcp attach` (without `--name`) attaches, each
    /// `{ name, command = [..] | url, headers, prefix, env }`.
    pub attach: Vec<reach_edge::mcp::attach::AttachConfig>,
}

impl Default for ReachConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7070".into(),
            admin_listen: "127.0.0.1:7071".into(),
            edge_listen: "127.0.0.1:7072".into(),
            admin: AdminConfig::default(),
            edge: reach_edge::a2a::EdgeConfig::default(),
            server: reach_rpc::ConnectionLimits::default(),
            registry: RegistryConfig::default(),
            router: RouterConfig::default(),
            orchestrator: OrchestratorConfig::default(),
            agents: AgentsConfig::default(),
            trust: reach_trust::TrustConfig::default(),
            mcp: McpConfig::default(),
        }
    }
}

/// Why the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A layer failed to parse or a value has the wrong type; figment names the key and source.
    #[error("invalid configuration: {0}")]
    Load(#[from] Box<figment::Error>),
    /// A value is out of range; the message names the key.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl ReachConfig {
    /// Loads defaults ← `file` ← `REACH_*` env ← `overrides` (a serializable map of flags
    /// that were given), then validates.
    ///
    /// # Errors
    /// [`ConfigError`] naming the bad key and where it came from.
    pub fn load(file: Option<&Path>, overrides: impl Serialize) -> Result<Self, ConfigError> {
        Self::load_over(ReachConfig::default(), file, overrides)
    }

    /// [`ReachConfig::load`] with other `defaults` (what a command such as `reach dev`
    /// assumes unless the file, the environment or a flag says otherwise).
    ///
    /// # Errors
    /// As [`ReachConfig::load`].
    pub fn load_over(
        defaults: ReachConfig,
        file: Option<&Path>,
        overrides: impl Serialize,
    ) -> Result<Self, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(defaults));
        if let Some(file) = file {
            if !file.is_file() {
                return Err(ConfigError::Invalid(format!(
                    "config file {} does not exist or is not a file; pass a TOML file to --config",
                    file.display()
                )));
            }
            figment = figment.merge(Toml::file_exact(file));
        }
        let config: ReachConfig = figment
            .merge(
                Env::prefixed("REACH_")
                    // Only the sections this file defines: other REACH_* variables (REACH_LOG,
                    // REACH_LOG_FORMAT, REACH_TEST_POSTGRES_URL, ...) are not service settings.
                    .filter(|key| {
                        let key = key.as_str().to_ascii_lowercase();
                        SECTIONS.iter().any(|section| {
                            key == *section || key.starts_with(&format!("{section}__"))
                        })
                    })
                    .split("__"),
            )
            .merge(Serialized::defaults(overrides))
            .extract()
            .map_err(Box::new)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every section.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_address("listen", &self.listen)?;
        if !self.admin_listen.is_empty() {
            check_address("admin_listen", &self.admin_listen)?;
        }
        if !self.edge_listen.is_empty() {
            check_address("edge_listen", &self.edge_listen)?;
        }
        self.server
            .validate(self.router.max_message_bytes, "router.max_message_bytes")
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        self.admin.validate().map_err(ConfigError::Invalid)?;
        self.registry
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        self.router
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        self.orchestrator
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("orchestrator: {e}")))?;
        self.agents
            .model
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let mut names = std::collections::HashSet::new();
        for (i, entry) in self.mcp.attach.iter().enumerate() {
            entry
                .validate()
                .map_err(|e| ConfigError::Invalid(format!("mcp.attach[{i}]: {e}")))?;
            if !names.insert(&entry.name) {
                return Err(ConfigError::Invalid(format!(
                    "mcp.attach[{i}]: name {:?} is used twice; each attached server needs its own name",
                    entry.name
                )));
            }
        }
        // A protocol registry that cannot be read or parsed is a configuration mistake, found
        // here (exit 64) rather than when the service starts.
        for (key, path) in [
            (
                "registry.protocol_registry",
                &self.registry.protocol_registry,
            ),
            ("router.protocol_registry", &self.router.protocol_registry),
        ] {
            if let Some(path) = path {
                if path.as_os_str().is_empty() {
                    return Err(ConfigError::Invalid(format!(
                        "{key} is empty; name the protocol-registry.yaml file, or unset it for none"
                    )));
                }
                reach_protocol::ProtocolRegistry::load(path)
                    .map_err(|e| ConfigError::Invalid(format!("{key}: {e}")))?;
            }
        }
        Ok(())
    }
}

/// Loads the `[agents]` section alone, for the commands that start the example agents
/// without the services (`reach demo`, `reach example-agents`): defaults ←
/// `REACH_AGENTS__*` environment variables ← `overrides` (the flags given), then validates.
///
/// # Errors
/// [`ConfigError`] naming the bad key.
pub fn load_agents(overrides: impl Serialize) -> Result<AgentsConfig, ConfigError> {
    let config: AgentsConfig = Figment::from(Serialized::defaults(AgentsConfig::default()))
        .merge(Env::prefixed("REACH_AGENTS__").split("__"))
        .merge(Serialized::defaults(overrides))
        .extract()
        .map_err(Box::new)?;
    config
        .model
        .validate()
        .map_err(|e| ConfigError::Invalid(e.to_string()))?;
    Ok(config)
}

/// Checks that `value` is `host:port` with a resolvable host (`127.0.0.1:7070`,
/// `localhost:7070`, `[::1]:7070`).
fn check_address(key: &str, value: &str) -> Result<(), ConfigError> {
    use std::net::ToSocketAddrs;
    match value.to_socket_addrs().map(|addrs| addrs.count()) {
        Ok(n) if n > 0 => Ok(()),
        Ok(_) => Err(ConfigError::Invalid(format!(
            "{key} {value:?} resolves to no address"
        ))),
        Err(e) => Err(ConfigError::Invalid(format!(
            "{key} {value:?} is not host:port ({e}); for example 127.0.0.1:7070"
        ))),
    }
}

/// The `[admin]` section: what the HTTP admin port (`admin_listen`) answers and how many
/// connections it holds (`docs/configuration.md`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// Host names (`host` or `host:port`) the operator routes and the console answer besides
    /// loopback ([`reach_rpc::hosts::LOOPBACK_HOSTS`]): the names browsers and operators use
    /// to reach the port (a Kubernetes service's DNS names, an ingress host). `/health`,
    /// `/ready` and `/metrics` answer any name.
    pub allowed_hosts: Vec<String>,
    /// Connections served at once (see [`reach_rpc::ConnectionLimits::max_connections`]).
    pub max_connections: usize,
    /// Connections one peer address holds at once; 0 for no limit of its own (see
    /// [`reach_rpc::ConnectionLimits::max_connections_per_peer`]). Kubernetes probes all come
    /// from the node's kubelet: keep room for them.
    pub max_connections_per_peer: usize,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            allowed_hosts: Vec::new(),
            max_connections: reach_telemetry::ADMIN_MAX_CONNECTIONS,
            max_connections_per_peer: reach_telemetry::ADMIN_MAX_CONNECTIONS_PER_PEER,
        }
    }
}

impl AdminConfig {
    /// The admin port's connection limits: these, with `server`'s handshake and header
    /// timeouts and shutdown grace (the admin port's header timeout is at most 10 s).
    pub fn limits(&self, server: &reach_rpc::ConnectionLimits) -> reach_rpc::ConnectionLimits {
        let admin = reach_telemetry::admin_limits(server.shutdown_grace);
        reach_rpc::ConnectionLimits {
            max_connections: self.max_connections,
            max_connections_per_peer: self.max_connections_per_peer,
            handshake_timeout: server.handshake_timeout,
            header_read_timeout: server.header_read_timeout.min(admin.header_read_timeout),
            ..admin
        }
    }

    /// Checks the settings.
    ///
    /// # Errors
    /// A message naming the `admin.*` setting to fix.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_connections == 0 {
            return Err("admin.max_connections is 0; it must be at least 1, such as 256".into());
        }
        if let Some(bad) = self
            .allowed_hosts
            .iter()
            .find(|h| h.trim().is_empty() || h.contains(['/', '@', ' ', '\\']))
        {
            return Err(format!(
                "admin.allowed_hosts has {bad:?}, which is no host name; give `host` or `host:port`, such as \"reach-registry.reach.svc\""
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_then_overrides_apply_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("reach.toml");
        std::fs::write(
            &file,
            "listen = \"127.0.0.1:9000\"\n[router]\nmax_message_bytes = 2048\n",
        )
        .unwrap();
        let config = ReachConfig::load(
            Some(&file),
            serde_json::json!({"router": {"max_message_bytes": 4096}}),
        )
        .unwrap();
        assert_eq!(config.listen, "127.0.0.1:9000");
        assert_eq!(config.router.max_message_bytes, 4096);
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("reach.toml");
        std::fs::write(&file, "[router]\nmax_mesage_bytes = 1\n").unwrap();
        let err = ReachConfig::load(Some(&file), serde_json::json!({}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_mesage_bytes"), "{err}");
        let err = ReachConfig::load(None, serde_json::json!({"listen": "nowhere"}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("listen"), "{err}");
    }

    #[test]
    fn the_agents_model_section_loads_and_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("reach.toml");
        std::fs::write(
            &file,
            "[agents.model]\nbase_url = \"http://127.0.0.1:1/v1\"\nmodel = \"m\"\ntimeout = \"5s\"\n",
        )
        .unwrap();
        let config = ReachConfig::load(Some(&file), serde_json::json!({})).unwrap();
        assert_eq!(config.agents.model.model, "m");
        assert_eq!(config.agents.model.api_key_env, "OPENAI_API_KEY");
        assert_eq!(
            config.agents.model.timeout,
            std::time::Duration::from_secs(5)
        );
        let err = ReachConfig::load(
            Some(&file),
            serde_json::json!({"agents": {"model": {"model": ""}}}),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("agents.model.model"), "{err}");
        let agents =
            load_agents(serde_json::json!({"model": {"base_url": "http://x/v1", "model": "n"}}))
                .unwrap();
        assert!(agents.model.is_enabled());
        assert!(
            !load_agents(serde_json::json!({}))
                .unwrap()
                .model
                .is_enabled()
        );
    }
}
