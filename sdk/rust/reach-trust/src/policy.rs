//! The policy file: who may serve (capabilities, topics, typed gRPC services, from which
//! addresses) and call which capabilities, who may do what with tasks of which flows, who is
//! an operator, who may read the registry's instances, which admin paths are open. YAML,
//! globs over identities and names (`*` matches any run of characters, `?` one, `[a-z]` a
//! class); deny by default.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use globset::{Glob, GlobSet, GlobSetBuilder};
use serde::Deserialize;

use crate::identity::Caller;
use crate::reload::Reloader;

/// The largest policy file read, in bytes.
pub const MAX_POLICY_BYTES: u64 = 1024 * 1024;

/// The most rules of one kind a policy may have.
pub const MAX_RULES: usize = 10_000;

/// What may be done with tasks, named in `tasks[].actions`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskAction {
    /// StartTask of the flow.
    Start,
    /// GetTask, ListTasks, WatchTask, the ledger and the admin task views.
    View,
    /// ResumeTask (a human node's input).
    Resume,
    /// CancelTask.
    Cancel,
    /// RetryTask (a dead letter).
    Retry,
    /// ApplyFlow (and flow files in the watched directory, which need no caller).
    Apply,
}

impl TaskAction {
    /// The action's name in policies and audit events.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Start => "start",
            Self::View => "view",
            Self::Resume => "resume",
            Self::Cancel => "cancel",
            Self::Retry => "retry",
            Self::Apply => "apply",
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServeRuleFile {
    identities: Vec<String>,
    #[serde(default = "everything")]
    services: Vec<String>,
    /// Omitted: `["*"]`.
    #[serde(default)]
    capabilities: Option<Vec<String>>,
    /// Omitted: the rule's capabilities (topics are named like capabilities, and call rules
    /// match them as capabilities).
    #[serde(default)]
    topics: Option<Vec<String>>,
    /// Omitted: `["*"]` when the rule grants every capability, else none.
    #[serde(default)]
    grpc_services: Option<Vec<String>>,
    /// Omitted: none (the registering connection's own address only; see
    /// [`Policy::may_advertise_ip`]).
    #[serde(default)]
    endpoints: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CallRuleFile {
    identities: Vec<String>,
    #[serde(default)]
    capabilities: Vec<String>,
    #[serde(default)]
    services: Vec<String>,
    #[serde(default)]
    pass_authorization: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TaskRuleFile {
    identities: Vec<String>,
    #[serde(default = "everything")]
    flows: Vec<String>,
    actions: Vec<TaskAction>,
}

/// The paths anyone may GET without credentials unless the policy's `admin.open_paths` says
/// otherwise: liveness, readiness and metrics (probes, load balancers' health checks and
/// scrapers present none), the A2A edge's agent cards, which A2A clients read first to learn
/// how to authenticate (A2A v1 §"Agent Discovery"), and the MCP edge's OAuth protected
/// resource metadata, which MCP clients read for the same reason (RFC 9728; MCP
/// authorization spec).
pub const DEFAULT_OPEN_PATHS: &[&str] = &[
    "/health",
    "/ready",
    "/metrics",
    "/.well-known/agent-card.json",
    "/agents/*/.well-known/agent-card.json",
    "/.well-known/oauth-protected-resource",
    "/.well-known/oauth-protected-resource/*",
];

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct AdminFile {
    #[serde(default)]
    open_paths: Option<Vec<String>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RegistryFile {
    #[serde(default)]
    watchers: Option<Vec<String>>,
    #[serde(default)]
    routers: Option<Vec<String>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default)]
    operators: Option<Vec<String>>,
    #[serde(default)]
    serve: Vec<ServeRuleFile>,
    #[serde(default)]
    call: Vec<CallRuleFile>,
    #[serde(default)]
    tasks: Vec<TaskRuleFile>,
    #[serde(default)]
    admin: AdminFile,
    #[serde(default)]
    registry: RegistryFile,
}

fn everything() -> Vec<String> {
    vec!["*".into()]
}

/// Why a policy could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The file could not be read.
    #[error("cannot read the policy {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// It is not a policy (YAML error, unknown key, bad glob); the message says where.
    #[error("the policy {path} is invalid: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong, and where.
        reason: String,
    },
}

/// A compiled set of globs.
#[derive(Debug, Clone)]
struct Names(GlobSet);

impl Names {
    fn compile(patterns: &[String], field: &str) -> Result<Self, String> {
        let mut set = GlobSetBuilder::new();
        for pattern in patterns {
            set.add(Glob::new(pattern).map_err(|e| format!("{field}: {pattern:?}: {e}"))?);
        }
        set.build().map(Self).map_err(|e| format!("{field}: {e}"))
    }

    fn matches(&self, name: &str) -> bool {
        self.0.is_match(name)
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[derive(Debug)]
struct ServeRule {
    identities: Names,
    services: Names,
    capabilities: Names,
    topics: Names,
    grpc_services: Names,
    endpoints: Endpoints,
}

/// What a serve rule's `endpoints` lets an identity advertise: networks (`10.0.0.0/8`, an IP
/// address) matched against IP addresses, and globs (`*.svc.cluster.local`) matched against
/// host names as written in the endpoint.
#[derive(Debug, Default)]
struct Endpoints {
    networks: Vec<(std::net::IpAddr, u8)>,
    hosts: Option<Names>,
}

impl Endpoints {
    fn compile(patterns: &[String], field: &str) -> Result<Self, String> {
        let mut networks = Vec::new();
        let mut hosts = Vec::new();
        for pattern in patterns {
            if let Some(network) = parse_network(pattern)
                .map_err(|reason| format!("{field}: {pattern:?}: {reason}"))?
            {
                networks.push(network);
            } else {
                hosts.push(pattern.to_ascii_lowercase());
            }
        }
        let hosts = if hosts.is_empty() {
            None
        } else {
            Some(Names::compile(&hosts, field)?)
        };
        Ok(Self { networks, hosts })
    }

    fn grants_ip(&self, ip: std::net::IpAddr) -> bool {
        let ip = canonical_ip(ip);
        self.networks
            .iter()
            .any(|&(network, prefix)| in_network(ip, network, prefix))
    }

    fn grants_host(&self, host: &str) -> bool {
        self.hosts
            .as_ref()
            .is_some_and(|hosts| hosts.matches(&host.to_ascii_lowercase()))
    }
}

/// An IPv4-mapped IPv6 address (`::ffff:10.0.0.1`) as the IPv4 address it is.
pub fn canonical_ip(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, std::net::IpAddr::V4),
        v4 => v4,
    }
}

/// `Ok(Some(network))` for `ADDRESS/PREFIX` or a bare IP address, `Ok(None)` for anything
/// else (a host glob), `Err` for a malformed network (`10.0.0.0/33`).
fn parse_network(pattern: &str) -> Result<Option<(std::net::IpAddr, u8)>, String> {
    let (address, prefix) = match pattern.split_once('/') {
        Some((address, prefix)) => (address, Some(prefix)),
        None => (pattern, None),
    };
    let Ok(address) = address.parse::<std::net::IpAddr>() else {
        return match prefix {
            Some(_) => Err("not a network: write ADDRESS/PREFIX, such as 10.0.0.0/8".into()),
            None => Ok(None),
        };
    };
    let address = canonical_ip(address);
    let bits = if address.is_ipv4() { 32 } else { 128 };
    let prefix = match prefix {
        None => bits,
        Some(prefix) => prefix
            .parse::<u8>()
            .ok()
            .filter(|&prefix| prefix <= bits)
            .ok_or_else(|| format!("the prefix length must be 0 to {bits}"))?,
    };
    Ok(Some((address, prefix)))
}

fn in_network(ip: std::net::IpAddr, network: std::net::IpAddr, prefix: u8) -> bool {
    use std::net::IpAddr;
    match (ip, network) {
        (IpAddr::V4(ip), IpAddr::V4(network)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            u32::from(ip) & mask == u32::from(network) & mask
        }
        (IpAddr::V6(ip), IpAddr::V6(network)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            u128::from(ip) & mask == u128::from(network) & mask
        }
        _ => false,
    }
}

/// What an instance asks to be routed for, for [`Policy::not_served`]: everything the
/// router delivers to it by name.
#[derive(Debug, Clone, Copy, Default)]
pub struct Served<'a> {
    /// The capabilities it serves (`complaint.classify`).
    pub capabilities: &'a [&'a str],
    /// The topics it subscribes to (`echo.news`): it receives their publishes.
    pub topics: &'a [&'a str],
    /// The typed gRPC services it serves (`secret.v1.Vault`): it receives their calls.
    pub grpc_services: &'a [&'a str],
}

/// One name of a [`Served`] set, as [`Policy::not_served`] reports what no rule grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServedName<'a> {
    /// A capability.
    Capability(&'a str),
    /// A topic.
    Topic(&'a str),
    /// A typed gRPC service.
    GrpcService(&'a str),
}

impl ServedName<'_> {
    /// `capability NAME`, `topic NAME` or `grpc_service NAME`.
    pub fn describe(&self) -> String {
        match self {
            Self::Capability(name) => format!("capability {name}"),
            Self::Topic(name) => format!("topic {name}"),
            Self::GrpcService(name) => format!("grpc_service {name}"),
        }
    }

    /// The serve rule field that grants it: `capabilities`, `topics` or `grpc_services`.
    pub fn field(&self) -> &'static str {
        match self {
            Self::Capability(_) => "capabilities",
            Self::Topic(_) => "topics",
            Self::GrpcService(_) => "grpc_services",
        }
    }
}

#[derive(Debug)]
struct CallRule {
    identities: Names,
    capabilities: Names,
    services: Names,
    pass_authorization: bool,
}

#[derive(Debug)]
struct TaskRule {
    identities: Names,
    flows: Names,
    actions: Vec<TaskAction>,
}

/// What a call rule grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CallGrant {
    /// Forward the caller's `authorization` header to the instance.
    pub pass_authorization: bool,
}

/// What a call addresses, for [`Policy::may_call`].
#[derive(Debug, Clone, Copy)]
pub enum CallTarget<'a> {
    /// A capability (`complaint.classify`).
    Capability(&'a str),
    /// A service by name (`classifier`).
    Service(&'a str),
    /// A topic (`Publish`), matched as a capability name.
    Topic(&'a str),
}

impl CallTarget<'_> {
    /// `capability NAME`, `service NAME` or `topic NAME`, for messages and audit events.
    pub fn describe(&self) -> String {
        match self {
            Self::Capability(name) => format!("capability {name}"),
            Self::Service(name) => format!("service {name}"),
            Self::Topic(name) => format!("topic {name}"),
        }
    }
}

/// A loaded policy.
#[derive(Debug)]
pub struct Policy {
    operators: Names,
    serve: Vec<ServeRule>,
    call: Vec<CallRule>,
    tasks: Vec<TaskRule>,
    open_paths: Names,
    watchers: Names,
    routers: Names,
}

/// The identities that may `Watch` the registry and `ListInstances` when the policy's
/// `registry.watchers` does not say (besides operators, who always may): routers, edges
/// (agent cards and tool lists) and registries (a control plane running its router alongside
/// presents the registry's certificate). `{td}` is the trust domain.
pub const DEFAULT_WATCHERS: &[&str] = &[
    "spiffe://{td}/router",
    "spiffe://{td}/edge",
    "spiffe://{td}/registry",
];

/// The identities whose `Watch` streams the registry holds slots back for, and does not cap
/// per identity, when the policy's `registry.routers` does not say: routers, and registries
/// (a control plane's router watches with the registry's certificate). `{td}` is the trust
/// domain.
pub const DEFAULT_ROUTERS: &[&str] = &["spiffe://{td}/router", "spiffe://{td}/registry"];

impl Policy {
    /// Parses a policy from YAML; `path` names it in errors.
    ///
    /// # Errors
    /// [`PolicyError::Invalid`] saying what is wrong and where.
    pub fn parse(yaml: &str, path: &Path, trust_domain: &str) -> Result<Self, PolicyError> {
        let invalid = |reason: String| PolicyError::Invalid {
            path: path.to_path_buf(),
            reason,
        };
        let file: PolicyFile = if yaml.trim().is_empty() {
            PolicyFile::default()
        } else {
            serde_norway::from_str(yaml).map_err(|e| invalid(e.to_string()))?
        };
        if [file.serve.len(), file.call.len(), file.tasks.len()]
            .iter()
            .any(|&n| n > MAX_RULES)
        {
            return Err(invalid(format!("more than {MAX_RULES} rules of one kind")));
        }
        let operators = file
            .operators
            .unwrap_or_else(|| vec![format!("spiffe://{trust_domain}/operator/*")]);
        let compile =
            |patterns: &[String], field: String| Names::compile(patterns, &field).map_err(invalid);
        let serve = file
            .serve
            .iter()
            .enumerate()
            .map(|(i, rule)| {
                let capabilities = rule.capabilities.clone().unwrap_or_else(everything);
                let topics = rule.topics.clone().unwrap_or_else(|| capabilities.clone());
                let grpc_services = rule.grpc_services.clone().unwrap_or_else(|| {
                    if capabilities.iter().any(|pattern| pattern == "*") {
                        everything()
                    } else {
                        Vec::new()
                    }
                });
                Ok(ServeRule {
                    identities: compile(&rule.identities, format!("serve[{i}].identities"))?,
                    services: compile(&rule.services, format!("serve[{i}].services"))?,
                    capabilities: compile(&capabilities, format!("serve[{i}].capabilities"))?,
                    topics: compile(&topics, format!("serve[{i}].topics"))?,
                    grpc_services: compile(&grpc_services, format!("serve[{i}].grpc_services"))?,
                    endpoints: Endpoints::compile(
                        &rule.endpoints,
                        &format!("serve[{i}].endpoints"),
                    )
                    .map_err(invalid)?,
                })
            })
            .collect::<Result<_, PolicyError>>()?;
        let call = file
            .call
            .iter()
            .enumerate()
            .map(|(i, rule)| {
                if rule.capabilities.is_empty() && rule.services.is_empty() {
                    return Err(invalid(format!(
                        "call[{i}] grants nothing: give it capabilities or services (globs)"
                    )));
                }
                Ok(CallRule {
                    identities: compile(&rule.identities, format!("call[{i}].identities"))?,
                    capabilities: compile(&rule.capabilities, format!("call[{i}].capabilities"))?,
                    services: compile(&rule.services, format!("call[{i}].services"))?,
                    pass_authorization: rule.pass_authorization,
                })
            })
            .collect::<Result<_, PolicyError>>()?;
        let tasks = file
            .tasks
            .iter()
            .enumerate()
            .map(|(i, rule)| {
                Ok(TaskRule {
                    identities: compile(&rule.identities, format!("tasks[{i}].identities"))?,
                    flows: compile(&rule.flows, format!("tasks[{i}].flows"))?,
                    actions: rule.actions.clone(),
                })
            })
            .collect::<Result<_, PolicyError>>()?;
        let open_paths = file.admin.open_paths.unwrap_or_else(|| {
            DEFAULT_OPEN_PATHS
                .iter()
                .map(|path| (*path).to_string())
                .collect()
        });
        let in_domain = |defaults: &[&str]| -> Vec<String> {
            defaults
                .iter()
                .map(|pattern| pattern.replace("{td}", trust_domain))
                .collect()
        };
        let watchers = file
            .registry
            .watchers
            .unwrap_or_else(|| in_domain(DEFAULT_WATCHERS));
        let routers = file
            .registry
            .routers
            .unwrap_or_else(|| in_domain(DEFAULT_ROUTERS));
        Ok(Self {
            operators: compile(&operators, "operators".into())?,
            serve,
            call,
            tasks,
            open_paths: compile(&open_paths, "admin.open_paths".into())?,
            watchers: compile(&watchers, "registry.watchers".into())?,
            routers: compile(&routers, "registry.routers".into())?,
        })
    }

    /// Reads and parses the policy at `path`.
    ///
    /// # Errors
    /// [`PolicyError`].
    pub fn load(path: &Path, trust_domain: &str) -> Result<Self, PolicyError> {
        let yaml = read_policy(path)?;
        Self::parse(&yaml, path, trust_domain)
    }

    /// The policy without a file: operators are `/operator/*` of the trust domain,
    /// [`DEFAULT_OPEN_PATHS`] are open, and no rule grants anything (callers of the rule kinds use
    /// their defaults instead when no policy is loaded; see [`crate::Trust`]).
    pub fn defaults(trust_domain: &str) -> Self {
        Self::parse("", Path::new("(defaults)"), trust_domain)
            .unwrap_or_else(|e| unreachable!("the default policy compiles: {e}"))
    }

    /// Whether `caller` is an operator.
    pub fn is_operator(&self, caller: &Caller) -> bool {
        caller.identity().is_some() && self.operators.matches(caller.name())
    }

    /// Whether a rule lets `caller` serve `capability` as `service`.
    pub fn may_serve(&self, caller: &Caller, service: &str, capability: &str) -> bool {
        self.serve.iter().any(|rule| {
            rule.identities.matches(caller.name())
                && rule.services.matches(service)
                && rule.capabilities.matches(capability)
        })
    }

    /// What of `served` no serve rule lets `caller` serve as `service`, in the order given
    /// (capabilities, topics, typed gRPC services); empty when all of it is granted. Each name
    /// may be granted by a different rule.
    pub fn not_served<'a>(
        &self,
        caller: &Caller,
        service: &str,
        served: Served<'a>,
    ) -> Vec<ServedName<'a>> {
        let rules: Vec<&ServeRule> = self
            .serve
            .iter()
            .filter(|rule| rule.identities.matches(caller.name()) && rule.services.matches(service))
            .collect();
        let granted = |name: &ServedName<'_>| {
            rules.iter().any(|rule| match *name {
                ServedName::Capability(name) => rule.capabilities.matches(name),
                ServedName::Topic(name) => rule.topics.matches(name),
                ServedName::GrpcService(name) => rule.grpc_services.matches(name),
            })
        };
        served
            .capabilities
            .iter()
            .map(|name| ServedName::Capability(name))
            .chain(served.topics.iter().map(|name| ServedName::Topic(name)))
            .chain(
                served
                    .grpc_services
                    .iter()
                    .map(|name| ServedName::GrpcService(name)),
            )
            .filter(|name| !granted(name))
            .collect()
    }

    /// Whether a serve rule for `caller` as `service` lets it advertise endpoints on the host
    /// named `host` (a DNS name, matched against the rule's `endpoints` globs; IP addresses
    /// are judged by [`Policy::may_advertise_ip`]).
    pub fn may_advertise_host(&self, caller: &Caller, service: &str, host: &str) -> bool {
        self.serve.iter().any(|rule| {
            rule.identities.matches(caller.name())
                && rule.services.matches(service)
                && rule.endpoints.grants_host(host)
        })
    }

    /// Whether a serve rule for `caller` as `service` lets it advertise an endpoint at `ip`
    /// (one of the rule's `endpoints` networks holds it).
    pub fn may_advertise_ip(&self, caller: &Caller, service: &str, ip: std::net::IpAddr) -> bool {
        self.serve.iter().any(|rule| {
            rule.identities.matches(caller.name())
                && rule.services.matches(service)
                && rule.endpoints.grants_ip(ip)
        })
    }

    /// Whether `caller` may `Watch` the registry and `ListInstances` (`registry.watchers`,
    /// by default [`DEFAULT_WATCHERS`]; operators are checked apart).
    pub fn is_watcher(&self, caller: &Caller) -> bool {
        caller.identity().is_some() && self.watchers.matches(caller.name())
    }

    /// Whether `caller` is a router for the registry's Watch slots (`registry.routers`, by
    /// default [`DEFAULT_ROUTERS`]).
    pub fn is_router(&self, caller: &Caller) -> bool {
        caller.identity().is_some() && self.routers.matches(caller.name())
    }

    /// What a rule lets `caller` do calling `target`, if one does (the first that matches).
    pub fn may_call(&self, caller: &Caller, target: CallTarget<'_>) -> Option<CallGrant> {
        self.call
            .iter()
            .find(|rule| {
                rule.identities.matches(caller.name())
                    && match target {
                        CallTarget::Capability(name) | CallTarget::Topic(name) => {
                            !rule.capabilities.is_empty() && rule.capabilities.matches(name)
                        }
                        CallTarget::Service(name) => {
                            !rule.services.is_empty() && rule.services.matches(name)
                        }
                    }
            })
            .map(|rule| CallGrant {
                pass_authorization: rule.pass_authorization,
            })
    }

    /// Whether a rule lets `caller` do `action` with tasks of `flow`.
    pub fn may_task(&self, caller: &Caller, action: TaskAction, flow: &str) -> bool {
        self.tasks.iter().any(|rule| {
            rule.actions.contains(&action)
                && rule.identities.matches(caller.name())
                && rule.flows.matches(flow)
        })
    }

    /// Whether anyone may GET the admin path `path`.
    pub fn is_open_path(&self, path: &str) -> bool {
        self.open_paths.matches(path)
    }
}

fn read_policy(path: &Path) -> Result<String, PolicyError> {
    let read_error = |source| PolicyError::Read {
        path: path.to_path_buf(),
        source,
    };
    let len = std::fs::metadata(path).map_err(read_error)?.len();
    if len > MAX_POLICY_BYTES {
        return Err(PolicyError::Invalid {
            path: path.to_path_buf(),
            reason: format!("it is over {MAX_POLICY_BYTES} bytes"),
        });
    }
    std::fs::read_to_string(path).map_err(read_error)
}

/// A policy file kept current: reloaded when it changes (checked every interval after
/// [`PolicySource::watch`]); a change that does not load is logged and the previous policy
/// kept.
#[derive(Debug)]
pub struct PolicySource {
    path: PathBuf,
    trust_domain: String,
    interval: Duration,
    current: RwLock<(String, Arc<Policy>)>,
    reloads: tokio::sync::watch::Sender<u64>,
}

impl PolicySource {
    /// Loads the policy at `path`.
    ///
    /// # Errors
    /// [`PolicyError`].
    pub fn load(
        path: &Path,
        trust_domain: &str,
        interval: Duration,
    ) -> Result<Arc<Self>, PolicyError> {
        let yaml = read_policy(path)?;
        let policy = Policy::parse(&yaml, path, trust_domain)?;
        Ok(Arc::new(Self {
            path: path.to_path_buf(),
            trust_domain: trust_domain.to_string(),
            interval,
            current: RwLock::new((yaml, Arc::new(policy))),
            reloads: tokio::sync::watch::Sender::new(0),
        }))
    }

    /// The current policy.
    pub fn current(&self) -> Arc<Policy> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .1
            .clone()
    }

    /// Counts successful reloads.
    pub fn reloads(&self) -> tokio::sync::watch::Receiver<u64> {
        self.reloads.subscribe()
    }

    /// Reads the file again; makes it current when it changed and loads. Returns whether it
    /// changed.
    ///
    /// # Errors
    /// [`PolicyError`] when the changed file does not load; the previous policy stays.
    pub fn reload(&self) -> Result<bool, PolicyError> {
        let yaml = read_policy(&self.path)?;
        if yaml
            == self
                .current
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0
        {
            return Ok(false);
        }
        let policy = Policy::parse(&yaml, &self.path, &self.trust_domain)?;
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = (yaml, Arc::new(policy));
        self.reloads.send_modify(|count| *count += 1);
        Ok(true)
    }

    /// Checks the file every interval until the source is dropped, logging each reload.
    pub fn watch(self: &Arc<Self>) {
        Reloader::spawn(
            Arc::downgrade(self),
            self.interval,
            |source: &Self| match source.reload() {
                Ok(true) => tracing::info!(path = %source.path.display(), "policy reloaded"),
                Ok(false) => {}
                Err(error) => tracing::warn!(
                    %error,
                    "the policy changed but does not load; keeping the previous policy"
                ),
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::Identity;

    fn caller(id: &str) -> Caller {
        Caller::certified(Identity::parse(id).unwrap())
    }

    const POLICY: &str = r#"
serve:
  - identities: ["spiffe://td/agent/classifier"]
    capabilities: ["complaint.classify"]
call:
  - identities: ["*"]
    capabilities: ["echo.*"]
  - identities: ["spiffe://td/orchestrator"]
    capabilities: ["*"]
    services: ["*"]
    pass_authorization: true
tasks:
  - identities: ["spiffe://td/operator/*", "spiffe://td/user/*"]
    flows: ["complaint-*"]
    actions: [start, view]
"#;

    #[test]
    fn rules_grant_what_they_name_and_nothing_else() {
        let policy = Policy::parse(POLICY, Path::new("p.yaml"), "td").unwrap();
        let classifier = caller("spiffe://td/agent/classifier");
        assert!(policy.may_serve(&classifier, "classifier", "complaint.classify"));
        assert!(!policy.may_serve(&classifier, "classifier", "complaint.extract"));
        let anonymous = Caller::anonymous();
        assert_eq!(
            policy.may_call(&anonymous, CallTarget::Capability("echo.say")),
            Some(CallGrant::default())
        );
        assert_eq!(
            policy.may_call(&anonymous, CallTarget::Capability("complaint.classify")),
            None
        );
        assert_eq!(
            policy.may_call(&anonymous, CallTarget::Service("echo")),
            None
        );
        let orchestrator = caller("spiffe://td/orchestrator");
        assert!(
            policy
                .may_call(&orchestrator, CallTarget::Service("classifier"))
                .unwrap()
                .pass_authorization
        );
        let alice = caller("spiffe://td/user/alice");
        assert!(policy.may_task(&alice, TaskAction::Start, "complaint-triage"));
        assert!(!policy.may_task(&alice, TaskAction::Cancel, "complaint-triage"));
        assert!(!policy.may_task(&alice, TaskAction::Start, "other"));
        assert!(policy.is_operator(&caller("spiffe://td/operator/bob")));
        assert!(!policy.is_operator(&alice));
        assert!(policy.is_open_path("/metrics"));
        assert!(!policy.is_open_path("/agents"));
        let defaults = Policy::defaults("td");
        for probe in ["/health", "/ready", "/metrics"] {
            assert!(defaults.is_open_path(probe), "{probe}");
        }
        assert!(defaults.is_open_path("/.well-known/agent-card.json"));
        assert!(defaults.is_open_path("/agents/coordinator/.well-known/agent-card.json"));
        assert!(!defaults.is_open_path("/agents/coordinator/"));
    }

    #[test]
    fn a_bad_policy_says_what_and_where() {
        for (yaml, expected) in [
            ("call:\n  - identities: ['*']\n", "call[0] grants nothing"),
            ("serve:\n  - identities: ['[']\n", "serve[0].identities"),
            (
                "tasks:\n  - identities: ['*']\n    actions: [fly]\n",
                "unknown variant",
            ),
            ("callers: []\n", "unknown field"),
            (
                "serve:\n  - identities: ['*']\n    endpoints: ['10.0.0.0/33']\n",
                "serve[0].endpoints: \"10.0.0.0/33\": the prefix length must be 0 to 32",
            ),
            (
                "serve:\n  - identities: ['*']\n    endpoints: ['pods/24']\n",
                "serve[0].endpoints: \"pods/24\": not a network",
            ),
            (
                "serve:\n  - identities: ['*']\n    topics: ['[']\n",
                "serve[0].topics",
            ),
            ("registry:\n  watch: []\n", "unknown field"),
        ] {
            let error = Policy::parse(yaml, Path::new("p.yaml"), "td")
                .unwrap_err()
                .to_string();
            assert!(error.contains(expected), "{yaml}: {error}");
            assert!(error.contains("p.yaml"), "{error}");
        }
    }

    #[test]
    fn endpoint_networks_hold_the_addresses_they_name() {
        let endpoints = Endpoints::compile(&["10.0.0.0/8".into()], "e").unwrap();
        assert!(endpoints.grants_ip("10.255.0.1".parse().unwrap()));
        assert!(endpoints.grants_ip("::ffff:10.0.0.1".parse().unwrap()));
        assert!(!endpoints.grants_ip("11.0.0.1".parse().unwrap()));
        assert!(!endpoints.grants_host("10.0.0.1"), "networks are not globs");
        let endpoints = Endpoints::compile(
            &[
                "192.0.2.7".into(),
                "2001:db8::/32".into(),
                "*.svc.cluster.local".into(),
            ],
            "e",
        )
        .unwrap();
        assert!(endpoints.grants_ip("192.0.2.7".parse().unwrap()));
        assert!(!endpoints.grants_ip("192.0.2.8".parse().unwrap()));
        assert!(endpoints.grants_ip("2001:db8:1::1".parse().unwrap()));
        assert!(!endpoints.grants_ip("2001:db9::1".parse().unwrap()));
        assert!(endpoints.grants_host("a.ns.svc.cluster.local"));
        assert!(!endpoints.grants_host("svc.cluster.local.evil.example"));
        let everything = Endpoints::compile(&["0.0.0.0/0".into(), "::/0".into()], "e").unwrap();
        assert!(everything.grants_ip("203.0.113.1".parse().unwrap()));
        assert!(everything.grants_ip("2001:db8::1".parse().unwrap()));
        assert!(!Endpoints::default().grants_ip("127.0.0.1".parse().unwrap()));
    }
}
