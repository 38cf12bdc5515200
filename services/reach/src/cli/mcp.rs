//! `reach mcp attach`: MCP servers (stdio child processes or Streamable HTTP URLs) attached to
//! the mesh, each tool a capability (see [`reach_edge::mcp::attach`] and `docs/edges.md`).

use clap::{Args, Subcommand};
use reach_edge::mcp::attach::{AttachConfig, AttachError, Serving, attach};
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

/// `reach mcp ...`.
#[derive(Subcommand, Debug)]
pub enum McpCommand {
    /// Attach an MCP server: start it (`-- COMMAND ARGS...`) or connect to it (`--url`), and
    /// register each of its tools as a capability `<prefix>.<tool>` until Ctrl-C. Without
    /// --name, attaches every `[[mcp.attach]]` entry of the config.
    Attach(AttachArgs),
}

/// The flags of `reach mcp attach`.
#[derive(Args, Debug, Default)]
pub struct AttachArgs {
    /// The server's name (capabilities `mcp.<name>.<tool>`); a configured entry of that name
    /// is used when neither a command nor --url is given.
    #[arg(long)]
    pub name: Option<String>,
    /// The capability prefix (default `mcp.<name>`).
    #[arg(long)]
    pub prefix: Option<String>,
    /// The registry the capabilities register with.
    #[arg(long, default_value = "http://127.0.0.1:7070")]
    pub registry: String,
    /// Where the capabilities are served for the router (host:port; port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// A Streamable HTTP MCP server's URL, instead of a command.
    #[arg(long, conflicts_with = "command")]
    pub url: Option<String>,
    /// An HTTP header for --url (`'Authorization: Bearer TOKEN'`); repeatable.
    #[arg(long = "header", requires = "url")]
    pub headers: Vec<String>,
    /// How many calls each attached server serves at once; more are refused OVERLOADED (the
    /// router sends them to another instance, if any).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_concurrency: u32,
    /// A join token to register with (a mesh with trust on: see docs/security.md).
    #[arg(long, env = "REACH_JOIN_TOKEN", hide_env_values = true)]
    pub join_token: Option<String>,
    /// The stdio MCP server's program and arguments, after `--`.
    #[arg(last = true)]
    pub command: Vec<String>,
}

impl AttachArgs {
    /// The entries to attach: the one the flags describe, or the configured ones.
    ///
    /// # Errors
    /// A message for stderr (exit 64): a malformed header, no entry to attach.
    pub fn entries(&self, configured: &[AttachConfig]) -> Result<Vec<AttachConfig>, String> {
        let Some(name) = &self.name else {
            if configured.is_empty() {
                return Err("nothing to attach: pass --name NAME with -- COMMAND ARGS... or --url URL, or configure [[mcp.attach]] entries".into());
            }
            return Ok(configured.to_vec());
        };
        let mut entry = if self.command.is_empty() && self.url.is_none() {
            configured
                .iter()
                .find(|c| &c.name == name)
                .cloned()
                .ok_or_else(|| format!("mcp server {name:?} is not configured: pass -- COMMAND ARGS... or --url URL"))?
        } else {
            AttachConfig {
                name: name.clone(),
                command: self.command.clone(),
                url: self.url.clone().unwrap_or_default(),
                ..AttachConfig::default()
            }
        };
        if let Some(prefix) = &self.prefix {
            entry.prefix = prefix.clone();
        }
        for header in &self.headers {
            let (key, value) = header
                .split_once(':')
                .ok_or_else(|| format!("--header {header:?} must be 'Name: value'"))?;
            entry
                .headers
                .insert(key.trim().to_string(), value.trim().to_string());
        }
        entry.validate()?;
        Ok(vec![entry])
    }
}

/// Attaches every entry until `shutdown` resolves or one of them stops; then deregisters all.
/// With `trust`'s `[trust.tls]` set the attachments serve and register over mutual TLS with
/// that certificate (an `/agent/mcp.<name>` identity, or a join token's), in its trust domain.
///
/// # Errors
/// The first attachment's [`AttachError`] (a server that went away, one that could not start).
pub async fn mcp_attach(
    entries: Vec<AttachConfig>,
    args: &AttachArgs,
    trust: &reach_trust::TrustConfig,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), AttachError> {
    let stop = CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    let mut agent = reach_sdk::AgentConfig::new("", &args.registry)
        .with_trust_domain(&trust.trust_domain)
        .with_max_concurrency(args.max_concurrency as usize);
    if let Some(tls) = &trust.tls {
        agent = agent.with_tls(tls.clone());
    }
    if let Some(token) = &args.join_token {
        agent = agent.with_join_token(token);
    }
    for entry in entries {
        let serving = Serving::new(agent.clone(), &args.listen);
        let stop = stop.clone();
        tasks.spawn(async move {
            let name = entry.name.clone();
            let result = attach(entry, serving, stop.cancelled_owned()).await;
            (name, result)
        });
    }
    let mut shutdown = std::pin::pin!(shutdown);
    let mut first_error = None;
    let mut panicked = None;
    loop {
        tokio::select! {
            () = &mut shutdown, if !stop.is_cancelled() => {
                info!("shutting down: deregistering the mcp servers' capabilities");
                stop.cancel();
            }
            joined = tasks.join_next() => match joined {
                None => break,
                Some(Ok((_, Ok(())))) => {}
                Some(Ok((name, Err(e)))) => {
                    error!(server = %name, error = %e, "mcp attachment stopped");
                    stop.cancel();
                    first_error.get_or_insert(e);
                }
                Some(Err(join)) => {
                    error!(error = %join, "mcp attachment panicked");
                    stop.cancel();
                    if join.is_panic() {
                        panicked.get_or_insert(join.into_panic());
                    }
                }
            }
        }
    }
    // The others have drained: a panic is the caller's to see, as if it had happened here.
    if let Some(panic) = panicked {
        std::panic::resume_unwind(panic);
    }
    first_error.map_or(Ok(()), Err)
}
