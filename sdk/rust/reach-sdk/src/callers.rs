//! Who may call an agent's port directly, when it serves TLS: [`DirectCallers`].
//!
//! The router holds every call to the policy (`call` rules) before it forwards it; an agent
//! that answered anyone holding a certificate of the mesh CA would let a caller skip that by
//! dialing the agent's endpoint (which the registry lists). So an agent serving TLS answers:
//!
//! - `reach.v1.AgentService` (Handle, HandleStream, HandleMux), its own gRPC services (typed
//!   pass-through) and server reflection (which the router asks for those services'
//!   descriptors): only the router identities, by default `spiffe://<trust-domain>/router`;
//! - `grpc.health.v1.Health`: those, and the probe identities, by default
//!   `spiffe://<trust-domain>/registry` (the registry's first health probe).
//!
//! Everyone else — another agent, an operator, a client certificate of any other identity — is
//! refused `PERMISSION_DENIED` with ErrorInfo reason `NOT_AUTHORIZED`, naming the caller's
//! identity and saying to call through the router. The identity is the peer certificate's
//! SPIFFE ID, verified in the TLS handshake; host names play no part. The check reads the
//! identity the handshake put in each request's extensions and compares it with a short list,
//! before the request is routed: on a multiplexed stream (how routers call agents) it runs once
//! per stream, not per message.
//!
//! A plaintext agent (`reach dev` on loopback) checks nothing: it has no peer identities.

use std::sync::Arc;

use reach_trust::{Denied, Identity, PeerIdentity};

/// The path prefix of health checks.
const HEALTH_PREFIX: &str = "/grpc.health.v1.Health/";

/// The most bytes of a refused request's path a refusal repeats.
const MAX_PATH_ECHOED: usize = 128;

/// The identities an agent serving TLS answers (see the [module](self)). Cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectCallers {
    /// May call everything on the port.
    routers: Arc<[Identity]>,
    /// May call `grpc.health.v1` only (besides the routers).
    probes: Arc<[Identity]>,
}

/// A configured caller identity that cannot be used, from [`DirectCallers::from_config`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("agent.{setting}: {value:?} {problem}")]
pub struct CallerIdentityError {
    /// The setting (`router_identities`, `probe_identities`).
    pub setting: &'static str,
    /// The value as configured.
    pub value: String,
    /// What is wrong with it.
    pub problem: String,
}

impl DirectCallers {
    /// Routers `routers` (which may call everything) and probes `probes` (which may call only
    /// `grpc.health.v1`).
    pub fn new(
        routers: impl IntoIterator<Item = Identity>,
        probes: impl IntoIterator<Item = Identity>,
    ) -> Self {
        Self {
            routers: routers.into_iter().collect(),
            probes: probes.into_iter().collect(),
        }
    }

    /// The defaults of `trust_domain`: the router `spiffe://<trust_domain>/router`, and the
    /// registry `spiffe://<trust_domain>/registry` for health checks.
    ///
    /// # Errors
    /// When `trust_domain` is not a SPIFFE trust domain.
    pub fn defaults(trust_domain: &str) -> Result<Self, reach_trust::identity::IdentityError> {
        Ok(Self::new(
            [Identity::service(trust_domain, "router")?],
            [Identity::service(trust_domain, "registry")?],
        ))
    }

    /// From the agent settings: `routers` and `probes` as SPIFFE IDs of `trust_domain`, each
    /// empty meaning its default (see [`DirectCallers::defaults`]).
    ///
    /// # Errors
    /// [`CallerIdentityError`] for a value that is not a SPIFFE ID of the trust domain.
    pub fn from_config(
        trust_domain: &str,
        routers: &[String],
        probes: &[String],
    ) -> Result<Self, CallerIdentityError> {
        let parse = |setting: &'static str, values: &[String], default: &str| {
            if values.is_empty() {
                return Identity::service(trust_domain, default)
                    .map(|id| vec![id])
                    .map_err(|e| CallerIdentityError {
                        setting: "trust_domain",
                        value: trust_domain.to_string(),
                        problem: e.to_string(),
                    });
            }
            values
                .iter()
                .map(|value| {
                    let problem = |problem: String| CallerIdentityError {
                        setting,
                        value: value.clone(),
                        problem,
                    };
                    let id = Identity::parse(value).map_err(|e| {
                        problem(format!(
                            "is not a SPIFFE ID ({e}); give one like spiffe://{trust_domain}/{default}"
                        ))
                    })?;
                    if id.trust_domain() != trust_domain {
                        return Err(problem(format!(
                            "is not of the agent's trust domain {trust_domain:?}; peers of other trust domains never get past the TLS handshake"
                        )));
                    }
                    Ok(id)
                })
                .collect()
        };
        Ok(Self::new(
            parse("router_identities", routers, "router")?,
            parse("probe_identities", probes, "registry")?,
        ))
    }

    /// The router identities: they may call everything, and their `x-reach-caller` is
    /// believed.
    pub fn routers(&self) -> &[Identity] {
        &self.routers
    }

    /// The identities that may call `grpc.health.v1` besides the routers.
    pub fn probes(&self) -> &[Identity] {
        &self.probes
    }

    /// Whether `peer` is one of the router identities.
    pub fn is_router(&self, peer: Option<&Identity>) -> bool {
        peer.is_some_and(|peer| self.routers.iter().any(|router| router == peer))
    }

    /// May `peer` (the client certificate's identity; `None`: it presented none) call `path`
    /// (`/package.Service/Method`)?
    ///
    /// # Errors
    /// [`Denied`] naming the peer, the path and who may call it.
    pub fn check(&self, path: &str, peer: Option<&Identity>) -> Result<(), Denied> {
        if self.is_router(peer) {
            return Ok(());
        }
        let health = path.starts_with(HEALTH_PREFIX);
        if health && peer.is_some_and(|peer| self.probes.iter().any(|probe| probe == peer)) {
            return Ok(());
        }
        let names = |ids: &[Identity]| {
            ids.iter()
                .map(Identity::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut echoed = path;
        if echoed.len() > MAX_PATH_ECHOED {
            let mut end = MAX_PATH_ECHOED;
            while !echoed.is_char_boundary(end) {
                end -= 1;
            }
            echoed = &echoed[..end];
        }
        let reason = if health {
            format!(
                "an agent's health is checked only by the registry ({}) and the routers ({}); ask the registry (`reach agents`) how an instance is doing",
                names(&self.probes),
                names(&self.routers)
            )
        } else {
            format!(
                "an agent answers only the mesh's routers ({}), so that the call policy cannot be skipped; send the call through a router (reach.v1.RouterService), or add the identity to the agent's router_identities if it is a router",
                names(&self.routers)
            )
        };
        Err(Denied {
            identity: peer
                .map_or(reach_trust::Caller::ANONYMOUS, Identity::as_str)
                .to_string(),
            action: "call".into(),
            target: format!("{echoed} on this agent directly"),
            reason,
        })
    }

    /// The check as an admission layer for the agent's server
    /// ([`reach_rpc::GrpcServer::with_admission`]): it reads the peer's identity from the
    /// request's extensions; a refusal is recorded in the audit log.
    pub fn admission(&self) -> reach_rpc::admission::Admission {
        let callers = self.clone();
        reach_rpc::admission::Admission::new(move |request| {
            let peer = request
                .extensions()
                .get::<PeerIdentity>()
                .and_then(|peer| peer.0.as_ref());
            callers.check(request.uri().path(), peer).map_err(|denied| {
                denied.audit();
                denied.to_status()
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TD: &str = "reach.test";

    fn id(path: &str) -> Identity {
        Identity::new(TD, path).unwrap()
    }

    #[test]
    fn routers_call_everything_the_registry_only_health_and_no_one_else_anything() {
        let callers = DirectCallers::defaults(TD).unwrap();
        let handle = "/reach.v1.AgentService/Handle";
        let health = "/grpc.health.v1.Health/Check";
        let reflection = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo";
        for path in [handle, health, reflection, "/examples.v1.Triage/Classify"] {
            assert!(callers.check(path, Some(&id("/router"))).is_ok(), "{path}");
        }
        assert!(callers.check(health, Some(&id("/registry"))).is_ok());
        for path in [handle, reflection] {
            let denied = callers.check(path, Some(&id("/registry"))).unwrap_err();
            assert!(
                denied.reason.contains("only the mesh's routers"),
                "{denied}"
            );
        }
        for peer in [
            Some(id("/agent/other")),
            Some(id("/operator/root")),
            Some(id("/routers")),
            None,
        ] {
            for path in [handle, health, reflection] {
                let denied = callers.check(path, peer.as_ref()).unwrap_err();
                let status = denied.to_status();
                assert_eq!(status.code(), tonic::Code::PermissionDenied);
                assert_eq!(
                    reach_rpc::errors::reason_of(&status).as_deref(),
                    Some("NOT_AUTHORIZED")
                );
                assert_eq!(
                    denied.identity,
                    peer.as_ref().map_or("anonymous", Identity::as_str)
                );
                assert!(denied.target.contains(path), "{denied}");
                assert!(
                    denied.reason.contains("spiffe://reach.test/router"),
                    "{denied}"
                );
            }
        }
    }

    #[test]
    fn configured_identities_replace_the_defaults_and_must_be_of_the_trust_domain() {
        let callers =
            DirectCallers::from_config(TD, &["spiffe://reach.test/router-eu".into()], &[]).unwrap();
        assert_eq!(callers.routers(), [id("/router-eu")]);
        assert_eq!(callers.probes(), [id("/registry")]);
        assert!(!callers.is_router(Some(&id("/router"))));
        let error = DirectCallers::from_config(TD, &["router".into()], &[]).unwrap_err();
        assert_eq!(error.setting, "router_identities");
        assert!(error.to_string().contains("not a SPIFFE ID"), "{error}");
        let error = DirectCallers::from_config(TD, &[], &["spiffe://elsewhere/registry".into()])
            .unwrap_err();
        assert_eq!(error.setting, "probe_identities");
        assert!(error.to_string().contains("trust domain"), "{error}");
    }

    #[test]
    fn a_long_path_is_not_echoed_whole() {
        let callers = DirectCallers::defaults(TD).unwrap();
        let path = format!("/{}", "é".repeat(500));
        let denied = callers.check(&path, None).unwrap_err();
        assert!(
            denied.target.len() < MAX_PATH_ECHOED + 40,
            "{}",
            denied.target
        );
    }
}
