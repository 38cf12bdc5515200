//! Workload identities: SPIFFE IDs (`spiffe://<trust-domain>/<path>`), and the caller of a
//! request as the trust layer established it.
//!
//! The ID format is the SPIFFE ID standard's (spiffe.io, "The SPIFFE Identity and
//! Verifiable Identity Document", §2): a trust domain of lowercase letters, digits, `.`, `-`
//! and `_`, and a path of `/`-separated segments of letters, digits, `.`, `-` and `_`.

use std::fmt;
use std::sync::Arc;

/// The trust domain Reach uses when none is configured.
pub const DEFAULT_TRUST_DOMAIN: &str = "reach.local";

/// The longest SPIFFE ID accepted, in bytes (the standard's limit).
pub const MAX_ID_BYTES: usize = 2048;

/// A SPIFFE ID, such as `spiffe://reach.local/agent/classifier`. Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    uri: Arc<str>,
    /// Where the path starts in `uri` (the byte after the trust domain).
    path_start: usize,
}

/// Why a string is not a SPIFFE ID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// It does not start with `spiffe://`.
    #[error("{0:?} is not a SPIFFE ID: it must start with spiffe://")]
    Scheme(String),
    /// The trust domain is empty or has characters outside `[a-z0-9._-]`.
    #[error(
        "{0:?} is not a SPIFFE ID: the trust domain must be lowercase letters, digits, '.', '-' or '_'"
    )]
    TrustDomain(String),
    /// A path segment is empty, `.`/`..`, or has characters outside `[A-Za-z0-9._-]`.
    #[error(
        "{0:?} is not a SPIFFE ID: path segments must be non-empty letters, digits, '.', '-' or '_' (and not '.' or '..')"
    )]
    Path(String),
    /// Longer than [`MAX_ID_BYTES`].
    #[error("a SPIFFE ID is at most {MAX_ID_BYTES} bytes; this one has {0}")]
    TooLong(usize),
}

fn trust_domain_ok(domain: &str) -> bool {
    !domain.is_empty()
        && domain.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_')
        })
}

fn segment_ok(segment: &str) -> bool {
    !segment.is_empty()
        && segment != "."
        && segment != ".."
        && segment
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
}

impl Identity {
    /// Parses a SPIFFE ID.
    ///
    /// # Errors
    /// [`IdentityError`] saying which part is malformed.
    pub fn parse(uri: &str) -> Result<Self, IdentityError> {
        if uri.len() > MAX_ID_BYTES {
            return Err(IdentityError::TooLong(uri.len()));
        }
        let rest = uri
            .strip_prefix("spiffe://")
            .ok_or_else(|| IdentityError::Scheme(uri.to_string()))?;
        let (domain, path) = match rest.find('/') {
            Some(slash) => rest.split_at(slash),
            None => (rest, ""),
        };
        if !trust_domain_ok(domain) {
            return Err(IdentityError::TrustDomain(uri.to_string()));
        }
        if !path.is_empty() && !path[1..].split('/').all(segment_ok) {
            return Err(IdentityError::Path(uri.to_string()));
        }
        Ok(Self {
            uri: uri.into(),
            path_start: "spiffe://".len() + domain.len(),
        })
    }

    /// `spiffe://<trust_domain><path>`; `path` starts with `/`.
    ///
    /// # Errors
    /// [`IdentityError`] when the result is not a SPIFFE ID (a bad domain or name).
    pub fn new(trust_domain: &str, path: &str) -> Result<Self, IdentityError> {
        Self::parse(&format!("spiffe://{trust_domain}{path}"))
    }

    /// `spiffe://<trust_domain>/agent/<service>`: an agent serving `service`.
    ///
    /// # Errors
    /// When `service` is not a valid path segment.
    pub fn agent(trust_domain: &str, service: &str) -> Result<Self, IdentityError> {
        Self::new(trust_domain, &format!("/agent/{service}"))
    }

    /// `spiffe://<trust_domain>/operator/<name>`: a person or script administering the mesh.
    ///
    /// # Errors
    /// When `name` is not a valid path segment.
    pub fn operator(trust_domain: &str, name: &str) -> Result<Self, IdentityError> {
        Self::new(trust_domain, &format!("/operator/{name}"))
    }

    /// The SPIFFE ID of a Reach service (`router`, `registry`, `orchestrator`, `edge`,
    /// `console`).
    ///
    /// # Errors
    /// When `name` is not a valid path segment.
    pub fn service(trust_domain: &str, name: &str) -> Result<Self, IdentityError> {
        Self::new(trust_domain, &format!("/{name}"))
    }

    /// The whole ID, `spiffe://…`.
    pub fn as_str(&self) -> &str {
        &self.uri
    }

    /// The trust domain (`reach.local`).
    pub fn trust_domain(&self) -> &str {
        &self.uri["spiffe://".len()..self.path_start]
    }

    /// The path, starting with `/` (empty for the trust domain's own ID).
    pub fn path(&self) -> &str {
        &self.uri[self.path_start..]
    }

    /// The service an agent identity names (`classifier` of `/agent/classifier`).
    pub fn agent_service(&self) -> Option<&str> {
        self.path()
            .strip_prefix("/agent/")
            .filter(|rest| !rest.contains('/'))
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.uri)
    }
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Identity({})", self.uri)
    }
}

/// The identity in the client certificate of the TLS connection a request came on (`None`:
/// the client presented none), in the request's extensions when the listener serves TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIdentity(pub Option<Identity>);

/// How a caller proved who it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// A client certificate verified in the TLS handshake.
    Certificate,
    /// A bearer token (JWT) verified against the configured keys.
    Bearer,
    /// Nothing: no certificate, no token.
    Anonymous,
}

/// Who made a request, as the trust layer established it: put in the request's extensions by
/// the server, read by the services that authorize. A request without one is anonymous.
#[derive(Debug, Clone)]
pub struct Caller {
    identity: Option<Identity>,
    via: Via,
    claims: Option<Arc<serde_json::Map<String, serde_json::Value>>>,
}

impl Caller {
    /// The name policies match for a caller without an identity.
    pub const ANONYMOUS: &'static str = "anonymous";

    /// A caller that proved nothing.
    pub fn anonymous() -> Self {
        Self {
            identity: None,
            via: Via::Anonymous,
            claims: None,
        }
    }

    /// A caller whose client certificate names `identity`.
    pub fn certified(identity: Identity) -> Self {
        Self {
            identity: Some(identity),
            via: Via::Certificate,
            claims: None,
        }
    }

    /// A caller whose bearer token maps to `identity`, with the token's claims.
    pub fn bearer(identity: Identity, claims: serde_json::Map<String, serde_json::Value>) -> Self {
        Self {
            identity: Some(identity),
            via: Via::Bearer,
            claims: Some(Arc::new(claims)),
        }
    }

    /// The caller in `extensions` (put there by the server), anonymous when there is none.
    pub fn of(extensions: &http::Extensions) -> Self {
        extensions
            .get::<Caller>()
            .cloned()
            .unwrap_or_else(Self::anonymous)
    }

    /// The verified identity, if any.
    pub fn identity(&self) -> Option<&Identity> {
        self.identity.as_ref()
    }

    /// How the caller proved it.
    pub fn via(&self) -> Via {
        self.via
    }

    /// The bearer token's claims (`None` for certificates and anonymous callers).
    pub fn claims(&self) -> Option<&serde_json::Map<String, serde_json::Value>> {
        self.claims.as_deref()
    }

    /// The identity's SPIFFE ID, or [`Caller::ANONYMOUS`]: what policies match and audit
    /// events name.
    pub fn name(&self) -> &str {
        self.identity
            .as_ref()
            .map_or(Self::ANONYMOUS, Identity::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_takes_apart_spiffe_ids() {
        let id = Identity::parse("spiffe://reach.local/agent/classifier").unwrap();
        assert_eq!(id.trust_domain(), "reach.local");
        assert_eq!(id.path(), "/agent/classifier");
        assert_eq!(id.agent_service(), Some("classifier"));
        assert_eq!(Identity::agent("reach.local", "classifier").unwrap(), id);
        let router = Identity::service("reach.local", "router").unwrap();
        assert_eq!(router.agent_service(), None);
        assert_eq!(Identity::parse("spiffe://td").unwrap().path(), "");
    }

    #[test]
    fn refuses_what_is_not_a_spiffe_id() {
        for (bad, what) in [
            ("https://reach.local/x", "spiffe://"),
            ("spiffe://Reach.Local/x", "trust domain"),
            ("spiffe:///x", "trust domain"),
            ("spiffe://td/a//b", "path segments"),
            ("spiffe://td/a/../b", "path segments"),
            ("spiffe://td/a b", "path segments"),
            ("spiffe://td/", "path segments"),
        ] {
            let error = Identity::parse(bad).unwrap_err().to_string();
            assert!(error.contains(what), "{bad}: {error}");
        }
        assert!(matches!(
            Identity::parse(&format!("spiffe://td/{}", "a".repeat(MAX_ID_BYTES))),
            Err(IdentityError::TooLong(_))
        ));
    }

    #[test]
    fn a_caller_without_an_identity_is_anonymous() {
        assert_eq!(Caller::of(&http::Extensions::new()).name(), "anonymous");
        let mut extensions = http::Extensions::new();
        extensions.insert(Caller::certified(
            Identity::parse("spiffe://td/router").unwrap(),
        ));
        assert_eq!(Caller::of(&extensions).name(), "spiffe://td/router");
        assert_eq!(Caller::of(&extensions).via(), Via::Certificate);
    }
}
