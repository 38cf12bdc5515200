//! The trust settings of a process and the decisions made with them.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::audit;
use crate::identity::{Caller, DEFAULT_TRUST_DOMAIN, Identity};
use crate::policy::{
    CallGrant, CallTarget, Policy, PolicyError, PolicySource, Served, ServedName, TaskAction,
};
use crate::tls::{TlsConfig, TlsError, TlsSource};
use crate::token::{JoinGrant, JwtConfig, TokenError, TokenVerifier};

/// The ErrorInfo domain of trust refusals.
pub const ERROR_DOMAIN: &str = "reach.dev";

/// The ErrorInfo reason of a refused authorization ([`Denied`]); `reach_rpc::errors::reason`
/// lists it with the others (and checks at compile time that the two agree).
pub const NOT_AUTHORIZED: &str = "NOT_AUTHORIZED";

/// The ErrorInfo reason of refused credentials ([`AuthError`]).
pub const UNAUTHENTICATED: &str = "UNAUTHENTICATED";

/// The `[trust]` section of a Reach configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct TrustConfig {
    /// The SPIFFE trust domain of the mesh (default `reach.local`).
    pub trust_domain: String,
    /// Allow listening on a non-loopback address without TLS.
    pub insecure: bool,
    /// A policy file (YAML); once loaded, whatever it does not grant is denied.
    pub policy: Option<PathBuf>,
    /// How often the policy file is checked for changes (default 2 s).
    #[serde(with = "humantime_serde")]
    pub policy_reload_interval: Duration,
    /// Certificates: when set, every port serves TLS and outbound channels present them.
    pub tls: Option<TlsConfig>,
    /// Bearer tokens (JWT) accepted in place of client certificates.
    pub jwt: Option<JwtConfig>,
}

impl Default for TrustConfig {
    fn default() -> Self {
        Self {
            trust_domain: DEFAULT_TRUST_DOMAIN.into(),
            insecure: false,
            policy: None,
            policy_reload_interval: Duration::from_secs(2),
            tls: None,
            jwt: None,
        }
    }
}

/// Why the trust settings could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    /// The certificates did not load.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The token keys did not load.
    #[error(transparent)]
    Token(#[from] TokenError),
    /// The policy did not load.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The trust domain is malformed.
    #[error(
        "trust.trust_domain {0:?} is not a SPIFFE trust domain (lowercase letters, digits, '.', '-', '_')"
    )]
    TrustDomain(String),
    /// A non-loopback listener without TLS, and `insecure` not set.
    #[error(
        "refusing to listen on {address} without TLS: anyone who can reach it could register \
         agents, call every capability and run tasks. Configure [trust.tls] (`reach certs \
         init` makes a development CA and certificates), listen on 127.0.0.1, or pass \
         --insecure if the network is trusted"
    )]
    PlaintextListener {
        /// The listener's address.
        address: String,
    },
}

/// Why a caller could not be authenticated.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The bearer token is refused.
    #[error("{0}")]
    Token(#[from] TokenError),
    /// A bearer token was sent but no keys are configured to verify it.
    #[error(
        "a bearer token was sent but this service verifies none (no [trust.jwt] keys configured)"
    )]
    NoVerifier,
    /// The `authorization` header is not `Bearer <token>`.
    #[error("the authorization header must be `Bearer <token>`")]
    Scheme,
    /// Trust is on, client certificates are optional, and the caller sent neither.
    #[error("this service needs a client certificate or a bearer token (authorization: Bearer …)")]
    Missing,
}

impl AuthError {
    /// `UNAUTHENTICATED` with ErrorInfo reason `UNAUTHENTICATED`.
    pub fn to_status(&self) -> tonic::Status {
        use tonic_types::{ErrorDetails, StatusExt};
        tonic::Status::with_error_details(
            tonic::Code::Unauthenticated,
            self.to_string(),
            ErrorDetails::with_error_info(
                UNAUTHENTICATED,
                ERROR_DOMAIN,
                std::collections::HashMap::new(),
            ),
        )
    }
}

/// A refused authorization: who asked what of which target, and why not.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{identity} may not {action} {target}: {reason}")]
pub struct Denied {
    /// The caller's identity ([`Caller::name`]).
    pub identity: String,
    /// What it asked (`register as`, `call`, `resume`).
    pub action: String,
    /// What it asked it of (`service "classifier"`, `capability complaint.classify`).
    pub target: String,
    /// Why not, and what would allow it.
    pub reason: String,
}

impl Denied {
    /// Records the refusal in the audit log and its metric ([`audit::denied`]).
    pub fn audit(&self) {
        audit::denied(&self.identity, &self.action, &self.target, &self.reason);
    }

    /// `PERMISSION_DENIED` with ErrorInfo reason `NOT_AUTHORIZED` and metadata `identity`,
    /// `action` and `target`.
    pub fn to_status(&self) -> tonic::Status {
        use tonic_types::{ErrorDetails, StatusExt};
        let metadata: std::collections::HashMap<String, String> = [
            ("identity".to_string(), self.identity.clone()),
            ("action".to_string(), self.action.clone()),
            ("target".to_string(), self.target.clone()),
        ]
        .into_iter()
        .collect();
        tonic::Status::with_error_details(
            tonic::Code::PermissionDenied,
            self.to_string(),
            ErrorDetails::with_error_info(NOT_AUTHORIZED, ERROR_DOMAIN, metadata),
        )
    }
}

impl From<Denied> for tonic::Status {
    fn from(denied: Denied) -> Self {
        denied.to_status()
    }
}

/// A process's trust: its certificates, token keys and policy, and the decisions made with
/// them. [`Trust::disabled`] (`reach dev` on loopback) authenticates no one and allows
/// everything.
#[derive(Debug)]
pub struct Trust {
    config: TrustConfig,
    tls: Option<Arc<TlsSource>>,
    tokens: Option<TokenVerifier>,
    policy: Option<Arc<PolicySource>>,
    defaults: Policy,
}

impl Trust {
    /// No trust: no TLS, no tokens, no policy; every caller is anonymous and allowed.
    pub fn disabled() -> Arc<Self> {
        Arc::new(Self {
            defaults: Policy::defaults(DEFAULT_TRUST_DOMAIN),
            config: TrustConfig::default(),
            tls: None,
            tokens: None,
            policy: None,
        })
    }

    /// Loads the certificates, token keys and policy of `config`, and (on a tokio runtime)
    /// starts reloading the certificate and policy files when they change.
    ///
    /// # Errors
    /// [`TrustError`] naming the file or setting that does not load.
    pub fn load(config: &TrustConfig) -> Result<Arc<Self>, TrustError> {
        let domain = &config.trust_domain;
        if Identity::new(domain, "").is_err() {
            return Err(TrustError::TrustDomain(domain.clone()));
        }
        let tls = config
            .tls
            .as_ref()
            .map(|tls| TlsSource::load(tls, domain))
            .transpose()?;
        let tokens = config
            .jwt
            .as_ref()
            .map(|jwt| TokenVerifier::load(jwt, domain))
            .transpose()?;
        let policy = config
            .policy
            .as_deref()
            .map(|path| PolicySource::load(path, domain, config.policy_reload_interval))
            .transpose()?;
        if let Some(tls) = &tls {
            tls.watch();
        }
        if let Some(policy) = &policy {
            policy.watch();
        }
        Ok(Arc::new(Self {
            defaults: Policy::defaults(domain),
            config: config.clone(),
            tls,
            tokens,
            policy,
        }))
    }

    /// The settings this was loaded from.
    pub fn config(&self) -> &TrustConfig {
        &self.config
    }

    /// The trust domain.
    pub fn trust_domain(&self) -> &str {
        &self.config.trust_domain
    }

    /// Whether callers are authenticated at all (certificates or tokens configured). When not,
    /// every caller is anonymous and allowed.
    pub fn is_enabled(&self) -> bool {
        self.tls.is_some() || self.tokens.is_some()
    }

    /// The certificates, when TLS is configured.
    pub fn tls(&self) -> Option<&Arc<TlsSource>> {
        self.tls.as_ref()
    }

    /// The policy file, when one is configured.
    pub fn policy_source(&self) -> Option<&Arc<PolicySource>> {
        self.policy.as_ref()
    }

    fn policy(&self) -> Option<Arc<Policy>> {
        self.policy.as_ref().map(|source| source.current())
    }

    /// Refuses to listen on `address` without TLS unless it is a loopback address or
    /// `insecure` is set.
    ///
    /// # Errors
    /// [`TrustError::PlaintextListener`].
    pub fn check_listener(&self, address: std::net::SocketAddr) -> Result<(), TrustError> {
        if self.tls.is_some() || self.config.insecure || address.ip().is_loopback() {
            return Ok(());
        }
        Err(TrustError::PlaintextListener {
            address: address.to_string(),
        })
    }

    /// Who a request comes from: the peer certificate's identity (verified by the TLS
    /// handshake) when there is one, else a verified bearer token in `authorization`, else
    /// anonymous (refused when trust is on and client certificates are optional, since the
    /// caller then must have sent one or the other).
    ///
    /// # Errors
    /// [`AuthError`] for a bad token, or no credential where one is needed.
    pub fn authenticate(
        &self,
        peer: Option<&Identity>,
        headers: &http::HeaderMap,
    ) -> Result<Caller, AuthError> {
        if let Some(identity) = peer {
            return Ok(Caller::certified(identity.clone()));
        }
        if let Some(value) = headers.get(http::header::AUTHORIZATION) {
            let value = value.to_str().map_err(|_| AuthError::Scheme)?;
            let token = value
                .strip_prefix("Bearer ")
                .or_else(|| value.strip_prefix("bearer "))
                .ok_or(AuthError::Scheme)?;
            let verifier = self.tokens.as_ref().ok_or(AuthError::NoVerifier)?;
            let (identity, claims) = verifier.verify(token.trim())?;
            return Ok(Caller::bearer(identity, claims));
        }
        if self.is_enabled() {
            return Err(AuthError::Missing);
        }
        Ok(Caller::anonymous())
    }

    /// Whether `caller` is an operator (the policy's `operators`, by default `/operator/*` of
    /// the trust domain). With trust disabled every caller is.
    pub fn is_operator(&self, caller: &Caller) -> bool {
        if !self.is_enabled() {
            return true;
        }
        self.policy()
            .as_deref()
            .unwrap_or(&self.defaults)
            .is_operator(caller)
    }

    /// May `caller` register an instance of `service` serving `capabilities`? Allowed to an
    /// agent certificate naming `service`, a join token granting it, or an operator; and, once
    /// a policy is loaded, only for capabilities a `serve` rule grants.
    ///
    /// # Errors
    /// [`Denied`] naming the identity, the service or capability, and what would allow it.
    pub fn check_register(
        &self,
        caller: &Caller,
        service: &str,
        capabilities: &[&str],
    ) -> Result<(), Denied> {
        self.check_registration(
            caller,
            service,
            Served {
                capabilities,
                ..Served::default()
            },
        )
    }

    /// [`Trust::check_register`] for everything a registration asks to be routed: its
    /// capabilities, the topics it subscribes to and the typed gRPC services it serves. Once a
    /// policy is loaded, `serve` rules must grant each (`capabilities`, `topics`,
    /// `grpc_services`); the refusal names the first not granted, and the others after it.
    ///
    /// # Errors
    /// [`Denied`] naming the identity, the service or name, and what would allow it.
    pub fn check_registration(
        &self,
        caller: &Caller,
        service: &str,
        served: Served<'_>,
    ) -> Result<(), Denied> {
        if !self.is_enabled() {
            return Ok(());
        }
        let denied = |target: String, reason: String| Denied {
            identity: caller.name().to_string(),
            action: "register as".into(),
            target,
            reason,
        };
        let operator = self.is_operator(caller);
        if !operator {
            let join = caller
                .claims()
                .map(JoinGrant::of)
                .transpose()
                .map_err(|reason| denied(format!("service {service:?}"), reason))?
                .flatten();
            let named = caller.identity().and_then(Identity::agent_service);
            let allowed = match (&join, named) {
                (Some(grant), _) => grant.services.iter().any(|pattern| {
                    globset::Glob::new(pattern)
                        .map(|glob| glob.compile_matcher().is_match(service))
                        .unwrap_or(false)
                }),
                (None, Some(named)) => named == service,
                (None, None) => false,
            };
            if !allowed {
                let reason = match (&join, named) {
                    (Some(grant), _) => format!(
                        "its join token grants only {:?}; make one for this service with \
                         `reach token join --service {service}`",
                        grant.services
                    ),
                    (None, Some(named)) => format!(
                        "its certificate names service {named:?}; an agent registers only as the \
                         service its identity names (issue spiffe://{}/agent/{service})",
                        self.trust_domain()
                    ),
                    (None, None) => format!(
                        "registering needs a certificate for spiffe://{}/agent/{service}, a join \
                         token for the service, or an operator identity",
                        self.trust_domain()
                    ),
                };
                return Err(self.refuse(denied(format!("service {service:?}"), reason)));
            }
        }
        if let Some(policy) = self.policy() {
            let refused = policy.not_served(caller, service, served);
            if let Some(first) = refused.first() {
                let verb = match first {
                    ServedName::Capability(_) => "serving",
                    ServedName::Topic(_) => "subscribing to",
                    ServedName::GrpcService(_) => "serving",
                };
                let mut reason = format!(
                    "no serve rule of the policy grants it; add it to the `{}` of a rule under \
                     `serve:` for this identity and service",
                    first.field()
                );
                if refused.len() > 1 {
                    const NAMED: usize = 8;
                    let others: Vec<String> = refused[1..]
                        .iter()
                        .take(NAMED)
                        .map(ServedName::describe)
                        .collect();
                    reason.push_str(&format!(
                        " (not granted either: {}{})",
                        others.join(", "),
                        if refused.len() - 1 > NAMED {
                            format!(" and {} more", refused.len() - 1 - NAMED)
                        } else {
                            String::new()
                        }
                    ));
                }
                return Err(self.refuse(denied(
                    format!("service {service:?} {verb} {}", first.describe()),
                    reason,
                )));
            }
        }
        Ok(())
    }

    /// Whether `caller` may advertise endpoints on the host name `host` as `service` whatever
    /// it resolves to: with trust off, operators, and a `serve` rule whose `endpoints` globs
    /// match the name. Otherwise the addresses it resolves to are judged
    /// ([`Trust::check_endpoint`]).
    pub fn advertises_by_name(&self, caller: &Caller, service: &str, host: &str) -> bool {
        if !self.is_enabled() || self.is_operator(caller) {
            return true;
        }
        host.parse::<std::net::IpAddr>().is_err()
            && self
                .policy()
                .as_deref()
                .unwrap_or(&self.defaults)
                .may_advertise_host(caller, service, host)
    }

    /// May `caller`, registering `service` over a connection from `peer`, advertise an
    /// endpoint on `host` that resolves to `addresses` (the addresses the registry's health
    /// probe and routers will dial; for an IP address host, that address)?
    ///
    /// With trust off, yes. Operators may advertise any endpoint. Otherwise every address
    /// must be the peer's own (any loopback address when the peer is on loopback: the same
    /// machine), or in a network of a `serve` rule's `endpoints` for the caller and service;
    /// or the host name itself must match one of its globs (`*.svc.cluster.local`), in
    /// which case its addresses are not judged. An unknown peer address grants nothing.
    ///
    /// # Errors
    /// [`Denied`] naming the endpoint and the address not allowed, and what would allow it.
    pub fn check_endpoint(
        &self,
        caller: &Caller,
        service: &str,
        endpoint: &str,
        host: &str,
        addresses: &[std::net::IpAddr],
        peer: Option<std::net::IpAddr>,
    ) -> Result<(), Denied> {
        use crate::policy::canonical_ip;
        if !self.is_enabled() || self.is_operator(caller) {
            return Ok(());
        }
        let policy = self.policy();
        let policy = policy.as_deref().unwrap_or(&self.defaults);
        let is_name = host.parse::<std::net::IpAddr>().is_err();
        if is_name && policy.may_advertise_host(caller, service, host) {
            return Ok(());
        }
        let peer = peer.map(canonical_ip);
        let own = |ip: std::net::IpAddr| {
            peer.is_some_and(|peer| peer == ip || (peer.is_loopback() && ip.is_loopback()))
        };
        let refused = addresses
            .iter()
            .map(|ip| canonical_ip(*ip))
            .find(|&ip| !own(ip) && !policy.may_advertise_ip(caller, service, ip));
        let Some(refused) = refused else {
            if addresses.is_empty() {
                return Err(self.refuse(Denied {
                    identity: caller.name().to_string(),
                    action: "advertise".into(),
                    target: format!("endpoint {endpoint:?}"),
                    reason: format!("its host {host:?} resolves to no address"),
                }));
            }
            return Ok(());
        };
        let from = peer.map_or_else(
            || "an unknown address".to_string(),
            |peer| format!("{peer}"),
        );
        let resolved = if is_name {
            format!(" (its host {host:?} resolves to {refused})")
        } else {
            String::new()
        };
        Err(self.refuse(Denied {
            identity: caller.name().to_string(),
            action: "advertise".into(),
            target: format!("endpoint {endpoint:?}"),
            reason: format!(
                "an instance advertises its own address, and this registration came from \
                 {from}{resolved}; advertise the address the agent registers from, or let this \
                 identity advertise it with `endpoints` (networks such as 10.0.0.0/8, or host \
                 globs such as *.svc.cluster.local) in a `serve:` rule of the policy"
            ),
        }))
    }

    /// May `caller` read the registry's instance table: `Watch` it and `ListInstances`
    /// (`action`)? With trust off, yes; otherwise operators and the policy's
    /// `registry.watchers` (by default routers, edges and registries:
    /// [`crate::policy::DEFAULT_WATCHERS`]).
    ///
    /// # Errors
    /// [`Denied`] saying who may.
    pub fn check_watcher(&self, caller: &Caller, action: &str) -> Result<(), Denied> {
        if !self.is_enabled() || self.is_operator(caller) {
            return Ok(());
        }
        let policy = self.policy();
        if policy
            .as_deref()
            .unwrap_or(&self.defaults)
            .is_watcher(caller)
        {
            return Ok(());
        }
        let td = self.trust_domain();
        Err(self.refuse(Denied {
            identity: caller.name().to_string(),
            action: action.into(),
            target: "the registry's instances".into(),
            reason: format!(
                "only routers, edges and operators may (spiffe://{td}/router, \
                 spiffe://{td}/edge, spiffe://{td}/registry and the policy's `operators`, or the \
                 identities of the policy's `registry.watchers`)"
            ),
        }))
    }

    /// Whether `caller` is a router for the registry's Watch slots (the policy's
    /// `registry.routers`, by default [`crate::policy::DEFAULT_ROUTERS`]). With trust off,
    /// no one is: callers are not told apart.
    pub fn is_router(&self, caller: &Caller) -> bool {
        self.is_enabled()
            && self
                .policy()
                .as_deref()
                .unwrap_or(&self.defaults)
                .is_router(caller)
    }

    /// May `caller` call `target`? With no policy, yes; with one, when a `call` rule grants
    /// it. Returns what the rule grants (whether to forward the caller's `authorization`).
    ///
    /// # Errors
    /// [`Denied`] when no rule grants it.
    pub fn check_call(&self, caller: &Caller, target: CallTarget<'_>) -> Result<CallGrant, Denied> {
        let Some(policy) = self.policy() else {
            return Ok(CallGrant::default());
        };
        policy.may_call(caller, target).ok_or_else(|| {
            self.refuse(Denied {
                identity: caller.name().to_string(),
                action: "call".into(),
                target: target.describe(),
                reason: "no call rule of the policy grants it; add one under `call:`".into(),
            })
        })
    }

    /// Whether [`Trust::check_call`] would grant `caller` a call of `target`, without
    /// recording a decision: for listings that show a caller what it may call (the MCP
    /// edge's `tools/list`), where nothing was refused.
    pub fn would_allow_call(&self, caller: &Caller, target: CallTarget<'_>) -> bool {
        self.policy()
            .is_none_or(|policy| policy.may_call(caller, target).is_some())
    }

    /// May `caller` do `action` with a task of `flow` started by `starter` (None: not a
    /// particular task, or started before trust was on)?
    ///
    /// Its starter and operators always may. Otherwise, with a policy, a `tasks` rule must
    /// grant it; without one, starting and viewing are open, and resuming, cancelling,
    /// retrying and applying flows are for operators.
    ///
    /// # Errors
    /// [`Denied`] saying who may.
    pub fn check_task(
        &self,
        caller: &Caller,
        action: TaskAction,
        flow: &str,
        starter: Option<&str>,
    ) -> Result<(), Denied> {
        if self.allows_task(caller, action, flow, starter) {
            return Ok(());
        }
        let reason = match (action, starter) {
            (TaskAction::Resume | TaskAction::Cancel | TaskAction::View, Some(starter)) => format!(
                "the task was started by {starter}; only its starter, an operator, or a \
                 `tasks` rule of the policy granting {} may",
                action.as_str()
            ),
            _ => format!(
                "only operators{} may",
                if self.policy.is_some() {
                    format!(" or a `tasks` rule granting {}", action.as_str())
                } else {
                    String::new()
                }
            ),
        };
        Err(self.refuse(Denied {
            identity: caller.name().to_string(),
            action: action.as_str().into(),
            target: format!("tasks of flow {flow:?}"),
            reason,
        }))
    }

    /// The decision of [`Trust::check_task`] without recording it: for filtering lists (a
    /// task left out of `ListTasks` is not a refusal worth an audit event).
    pub fn allows_task(
        &self,
        caller: &Caller,
        action: TaskAction,
        flow: &str,
        starter: Option<&str>,
    ) -> bool {
        if !self.is_enabled() {
            return true;
        }
        let is_starter = starter.is_some_and(|starter| starter == caller.name());
        if is_starter || self.is_operator(caller) {
            return true;
        }
        match self.policy() {
            Some(policy) => policy.may_task(caller, action, flow),
            None => matches!(action, TaskAction::Start | TaskAction::View),
        }
    }

    /// Requires an operator for `action` on `target` (admin actions: draining a service,
    /// retrying a dead letter); records the decision either way.
    ///
    /// # Errors
    /// [`Denied`] when `caller` is not an operator.
    pub fn check_operator(
        &self,
        caller: &Caller,
        action: &str,
        target: &str,
    ) -> Result<(), Denied> {
        if self.is_operator(caller) {
            if self.is_enabled() {
                audit::record(caller, action, target, audit::Decision::Allowed, "operator");
            }
            return Ok(());
        }
        Err(self.refuse(Denied {
            identity: caller.name().to_string(),
            action: action.into(),
            target: target.into(),
            reason: format!(
                "it is for operators (identities matching the policy's `operators`, by default \
                 spiffe://{}/operator/*)",
                self.trust_domain()
            ),
        }))
    }

    /// Whether anyone may GET the admin path `path` (by default `/health`, `/ready` and
    /// `/metrics`, among others: [`crate::policy::DEFAULT_OPEN_PATHS`]).
    pub fn is_open_path(&self, path: &str) -> bool {
        !self.is_enabled()
            || self
                .policy()
                .as_deref()
                .unwrap_or(&self.defaults)
                .is_open_path(path)
    }

    /// Records a refusal as an audit event and returns it.
    fn refuse(&self, denied: Denied) -> Denied {
        denied.audit();
        denied
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    const TD: &str = "td";

    /// An Ed25519 public key: enough to turn trust on (tokens verified) for these tests,
    /// which present callers directly.
    const TOKEN_KEY: &str = "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEAwcrOUD1au7vSYk3O16sSh8poJSfBizJVN+eaR6dMr5w=\n-----END PUBLIC KEY-----\n";

    /// Trust on (bearer tokens), with `policy` loaded when given.
    fn trust(policy: Option<&str>) -> (tempfile::TempDir, Arc<Trust>) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("jwt.pem"), TOKEN_KEY).unwrap();
        let policy = policy.map(|yaml| {
            let path = dir.path().join("policy.yaml");
            std::fs::write(&path, yaml).unwrap();
            path
        });
        let trust = Trust::load(&TrustConfig {
            trust_domain: TD.into(),
            policy,
            jwt: Some(JwtConfig::new(vec![dir.path().join("jwt.pem")])),
            ..TrustConfig::default()
        })
        .unwrap();
        assert!(trust.is_enabled());
        (dir, trust)
    }

    fn caller(id: &str) -> Caller {
        Caller::certified(Identity::parse(id).unwrap())
    }

    fn served<'a>(
        capabilities: &'a [&'a str],
        topics: &'a [&'a str],
        grpc_services: &'a [&'a str],
    ) -> Served<'a> {
        Served {
            capabilities,
            topics,
            grpc_services,
        }
    }

    const ALPHA: &str = r#"
serve:
  - identities: ["spiffe://td/agent/alpha"]
    capabilities: ["alpha.*"]
"#;

    #[test]
    fn topics_and_grpc_services_need_a_serve_rule_like_capabilities() {
        let (_dir, trust) = trust(Some(ALPHA));
        let alpha = caller("spiffe://td/agent/alpha");
        trust
            .check_registration(
                &alpha,
                "alpha",
                served(&["alpha.ask"], &["alpha.news"], &[]),
            )
            .unwrap();
        let denied = trust
            .check_registration(&alpha, "alpha", served(&["alpha.ask"], &["echo.news"], &[]))
            .unwrap_err();
        assert_eq!(denied.action, "register as");
        assert_eq!(
            denied.target,
            "service \"alpha\" subscribing to topic echo.news"
        );
        assert!(denied.reason.contains("`topics`"), "{}", denied.reason);
        let status = denied.to_status();
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        assert!(
            status.message().contains("topic echo.news"),
            "{}",
            status.message()
        );
        // A rule that narrows capabilities grants no typed service unless it lists some.
        let denied = trust
            .check_registration(&alpha, "alpha", served(&[], &[], &["secret.v1.Vault"]))
            .unwrap_err();
        assert_eq!(
            denied.target,
            "service \"alpha\" serving grpc_service secret.v1.Vault"
        );
        assert!(
            denied.reason.contains("`grpc_services`"),
            "{}",
            denied.reason
        );
        // Every refused name is said, the first as the target.
        let denied = trust
            .check_registration(
                &alpha,
                "alpha",
                served(&["beta.x"], &["echo.news"], &["secret.v1.Vault"]),
            )
            .unwrap_err();
        assert_eq!(denied.target, "service \"alpha\" serving capability beta.x");
        assert!(
            denied
                .reason
                .contains("not granted either: topic echo.news, grpc_service secret.v1.Vault"),
            "{}",
            denied.reason
        );
        // The old entry point still checks capabilities.
        assert!(trust.check_register(&alpha, "alpha", &["beta.x"]).is_err());
        assert!(trust.check_register(&alpha, "alpha", &["alpha.x"]).is_ok());
    }

    #[test]
    fn a_rule_granting_every_capability_grants_every_topic_and_grpc_service() {
        let (_dir, trust) = trust(Some(
            r#"
serve:
  - identities: ["spiffe://td/agent/open"]
  - identities: ["spiffe://td/agent/star"]
    capabilities: ["*"]
  - identities: ["spiffe://td/agent/typed"]
    capabilities: ["typed.*"]
    topics: []
    grpc_services: ["typed.v1.*"]
"#,
        ));
        for name in ["open", "star"] {
            trust
                .check_registration(
                    &caller(&format!("spiffe://td/agent/{name}")),
                    name,
                    served(&["any.thing"], &["echo.news"], &["secret.v1.Vault"]),
                )
                .unwrap();
        }
        let typed = caller("spiffe://td/agent/typed");
        trust
            .check_registration(
                &typed,
                "typed",
                served(&["typed.a"], &[], &["typed.v1.Svc"]),
            )
            .unwrap();
        assert!(
            trust
                .check_registration(&typed, "typed", served(&[], &["typed.news"], &[]))
                .is_err(),
            "topics: [] grants no topic"
        );
        assert!(
            trust
                .check_registration(&typed, "typed", served(&[], &[], &["typed.v2.Svc"]))
                .is_err()
        );
    }

    #[test]
    fn without_a_policy_or_with_trust_off_every_name_is_served() {
        let (_dir, trust) = trust(None);
        trust
            .check_registration(
                &caller("spiffe://td/agent/alpha"),
                "alpha",
                served(&["x"], &["echo.news"], &["secret.v1.Vault"]),
            )
            .unwrap();
        Trust::disabled()
            .check_registration(
                &Caller::anonymous(),
                "alpha",
                served(&["x"], &["echo.news"], &["secret.v1.Vault"]),
            )
            .unwrap();
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn an_endpoint_must_be_the_registrants_own_address_or_granted() {
        let (_dir, trust) = trust(Some(
            r#"
serve:
  - identities: ["spiffe://td/agent/alpha"]
  - identities: ["spiffe://td/agent/pods"]
    endpoints: ["10.0.0.0/8", "fd00::/8", "*.svc.cluster.local"]
"#,
        ));
        let alpha = caller("spiffe://td/agent/alpha");
        let check = |who: &Caller, service: &str, host: &str, addresses: &[&str], peer: &str| {
            let addresses: Vec<IpAddr> = addresses.iter().map(|a| ip(a)).collect();
            trust.check_endpoint(
                who,
                service,
                &format!("http://{host}:8080"),
                host,
                &addresses,
                Some(ip(peer)),
            )
        };
        check(&alpha, "alpha", "10.1.2.3", &["10.1.2.3"], "10.1.2.3").unwrap();
        // An IPv4-mapped peer address is the IPv4 address.
        check(
            &alpha,
            "alpha",
            "10.1.2.3",
            &["10.1.2.3"],
            "::ffff:10.1.2.3",
        )
        .unwrap();
        let denied = check(&alpha, "alpha", "10.9.9.9", &["10.9.9.9"], "10.1.2.3").unwrap_err();
        assert_eq!(denied.action, "advertise");
        assert_eq!(denied.target, "endpoint \"http://10.9.9.9:8080\"");
        assert!(
            denied.reason.contains("came from 10.1.2.3"),
            "{}",
            denied.reason
        );
        assert!(denied.reason.contains("`endpoints`"), "{}", denied.reason);
        // On loopback, every loopback address is the registrant's machine; nothing else is.
        check(&alpha, "alpha", "127.0.0.2", &["127.0.0.2"], "127.0.0.1").unwrap();
        check(
            &alpha,
            "alpha",
            "localhost",
            &["127.0.0.1", "::1"],
            "127.0.0.1",
        )
        .unwrap();
        assert!(check(&alpha, "alpha", "192.0.2.7", &["192.0.2.7"], "127.0.0.1").is_err());
        // A name is judged by every address it resolves to.
        let denied = check(
            &alpha,
            "alpha",
            "sneaky.example",
            &["127.0.0.1", "192.0.2.7"],
            "127.0.0.1",
        )
        .unwrap_err();
        assert!(
            denied.reason.contains("resolves to 192.0.2.7"),
            "{}",
            denied.reason
        );
        let denied = check(&alpha, "alpha", "nowhere.invalid", &[], "127.0.0.1").unwrap_err();
        assert!(
            denied.reason.contains("resolves to no address"),
            "{}",
            denied.reason
        );
        // Granted networks and names.
        let pods = caller("spiffe://td/agent/pods");
        check(&pods, "pods", "10.200.0.1", &["10.200.0.1"], "10.1.2.3").unwrap();
        check(&pods, "pods", "fd00::7", &["fd00::7"], "10.1.2.3").unwrap();
        assert!(check(&pods, "pods", "11.0.0.1", &["11.0.0.1"], "10.1.2.3").is_err());
        assert!(trust.advertises_by_name(&pods, "pods", "pods.ns.SVC.cluster.local"));
        assert!(!trust.advertises_by_name(&pods, "pods", "pods.example.com"));
        assert!(!trust.advertises_by_name(&alpha, "alpha", "pods.ns.svc.cluster.local"));
        // The grant is alpha's rule's, not pods': alpha may not use pods' networks.
        assert!(check(&alpha, "alpha", "10.200.0.1", &["10.200.0.1"], "10.1.2.3").is_err());
        // An unknown peer address grants nothing; operators may advertise anything.
        assert!(
            trust
                .check_endpoint(
                    &alpha,
                    "alpha",
                    "http://10.1.2.3:1",
                    "10.1.2.3",
                    &[ip("10.1.2.3")],
                    None
                )
                .unwrap_err()
                .reason
                .contains("an unknown address")
        );
        let operator = caller("spiffe://td/operator/ops");
        check(&operator, "alpha", "192.0.2.7", &["192.0.2.7"], "127.0.0.1").unwrap();
        assert!(trust.advertises_by_name(&operator, "alpha", "anything.example"));
        // Trust off: anything goes.
        Trust::disabled()
            .check_endpoint(
                &Caller::anonymous(),
                "alpha",
                "http://192.0.2.7:22",
                "192.0.2.7",
                &[ip("192.0.2.7")],
                None,
            )
            .unwrap();
    }

    #[test]
    fn only_routers_edges_registries_and_operators_read_the_registry_by_default() {
        for policy in [None, Some(ALPHA)] {
            let (_dir, trust) = trust(policy);
            for allowed in [
                "spiffe://td/router",
                "spiffe://td/edge",
                "spiffe://td/registry",
                "spiffe://td/operator/ops",
            ] {
                trust.check_watcher(&caller(allowed), "watch").unwrap();
            }
            for refused in ["spiffe://td/agent/alpha", "spiffe://td/user/mallory"] {
                let denied = trust.check_watcher(&caller(refused), "watch").unwrap_err();
                assert_eq!(denied.target, "the registry's instances");
                assert!(
                    denied.reason.contains("registry.watchers"),
                    "{}",
                    denied.reason
                );
            }
            assert!(trust.is_router(&caller("spiffe://td/router")));
            assert!(trust.is_router(&caller("spiffe://td/registry")));
            assert!(!trust.is_router(&caller("spiffe://td/edge")));
            assert!(!trust.is_router(&caller("spiffe://td/operator/ops")));
        }
        let (_dir, trust) = trust(Some(
            r#"
registry:
  watchers: ["spiffe://td/agent/monitor"]
  routers: ["spiffe://td/router", "spiffe://td/router-canary"]
"#,
        ));
        trust
            .check_watcher(&caller("spiffe://td/agent/monitor"), "list")
            .unwrap();
        assert!(
            trust
                .check_watcher(&caller("spiffe://td/edge"), "list")
                .is_err(),
            "the policy's list replaces the default"
        );
        trust
            .check_watcher(&caller("spiffe://td/operator/ops"), "list")
            .unwrap();
        assert!(trust.is_router(&caller("spiffe://td/router-canary")));
        assert!(!trust.is_router(&caller("spiffe://td/registry")));
        // Trust off: anyone reads, and no one is told apart as a router.
        Trust::disabled()
            .check_watcher(&Caller::anonymous(), "watch")
            .unwrap();
        assert!(!Trust::disabled().is_router(&Caller::anonymous()));
    }
}
