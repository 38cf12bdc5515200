//! The trust settings of a process and the decisions made with them.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::audit;
use crate::identity::{Caller, DEFAULT_TRUST_DOMAIN, Identity};
use crate::policy::{CallGrant, CallTarget, Policy, PolicyError, PolicySource, TaskAction};
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
            for capability in capabilities {
                if !policy.may_serve(caller, service, capability) {
                    return Err(self.refuse(denied(
                        format!("service {service:?} serving capability {capability}"),
                        "no serve rule of the policy grants it; add one under `serve:`".into(),
                    )));
                }
            }
        }
        Ok(())
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
