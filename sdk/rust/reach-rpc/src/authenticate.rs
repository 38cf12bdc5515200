//! TLS on accepted connections and the caller of each request (see
//! [`crate::server::serve_http_with_trust`]).

use std::sync::Arc;
use std::time::Duration;

use axum::response::IntoResponse;
use reach_trust::{AuthError, Caller, PeerIdentity, Trust, tls::TlsSource};
use tokio::net::TcpStream;

use crate::errors::reason;
use crate::limits::CONNECTIONS_REFUSED;

/// Whether two strings are equal, at compile time.
const fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

// The trust crate builds these statuses; the reasons are listed (and documented) here.
const _: () = assert!(same(reason::NOT_AUTHORIZED, reach_trust::NOT_AUTHORIZED));
const _: () = assert!(same(reason::UNAUTHENTICATED, reach_trust::UNAUTHENTICATED));

/// Runs the TLS handshake on `tcp` within `timeout` and reads the client's identity. Returns
/// `None` (the connection is dropped, counted in [`CONNECTIONS_REFUSED`] by reason) when the
/// handshake fails or times out, or the client certificate names no identity of the trust
/// domain.
pub(crate) async fn accept_tls(
    tls: &Arc<TlsSource>,
    tcp: TcpStream,
    timeout: Duration,
    listener_name: &str,
    client_certificates: ClientCertificates,
) -> Option<(tokio_rustls::server::TlsStream<TcpStream>, PeerIdentity)> {
    let refused = |reason: &'static str| {
        metrics::counter!(
            CONNECTIONS_REFUSED,
            "reason" => reason,
            "listener" => listener_name.to_string()
        )
        .increment(1);
    };
    let config = match client_certificates {
        ClientCertificates::AsConfigured => tls.server_config(),
        ClientCertificates::Optional => tls.server_config_optional_client_auth(),
    };
    let config = match config {
        Ok(config) => config,
        Err(error) => {
            tracing::error!(%error, "cannot serve TLS");
            return None;
        }
    };
    let peer = tcp.peer_addr().ok();
    let accept = tokio_rustls::TlsAcceptor::from(config).accept(tcp);
    let stream = match tokio::time::timeout(timeout, accept).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(error)) => {
            // Plaintext clients, wrong CAs and missing client certificates end here.
            tracing::debug!(?peer, %error, "TLS handshake refused");
            refused("tls_handshake");
            return None;
        }
        Err(_) => {
            refused("handshake_timeout");
            return None;
        }
    };
    match reach_trust::tls::peer_identity(
        stream.get_ref().1.peer_certificates(),
        tls.trust_domain(),
    ) {
        Ok(identity) => Some((stream, PeerIdentity(identity))),
        Err(reason) => {
            tracing::info!(?peer, %reason, "refused a client certificate");
            refused("tls_identity");
            None
        }
    }
}

/// The gRPC paths anyone may call without credentials when client certificates are optional:
/// health checks (probes present none), and the registry's Heartbeat and Deregister, whose
/// credential is the lease id (agents that joined with a join token send no other; the
/// registry decides).
fn is_open_grpc(path: &str) -> bool {
    path.starts_with("/grpc.health.v1.Health/")
        || path == "/reach.v1.RegistryService/Heartbeat"
        || path == "/reach.v1.RegistryService/Deregister"
}

/// The state of [`authenticate`]: the trust settings, and the challenges of protected
/// resources.
pub(crate) struct Authentication {
    pub(crate) trust: Arc<Trust>,
    pub(crate) challenges: Vec<Challenge>,
}

impl Authentication {
    /// The `WWW-Authenticate` value of a 401 for `path` (RFC 6750 §3): `Bearer`, with the
    /// resource metadata of the challenge whose prefix `path` is under (RFC 9728 §5.1), and
    /// `error="invalid_token"` when a token was sent and refused.
    pub(crate) fn challenge(&self, path: &str, error: &AuthError) -> http::HeaderValue {
        let mut value = String::from("Bearer");
        let mut separator = " ";
        if let Some(challenge) = self.challenges.iter().find(|c| {
            path.strip_prefix(c.path_prefix.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        }) {
            value.push_str(&format!(
                "{separator}resource_metadata=\"{}\"",
                challenge.resource_metadata
            ));
            separator = ", ";
        }
        if !matches!(error, AuthError::Missing) {
            value.push_str(&format!("{separator}error=\"invalid_token\""));
        }
        http::HeaderValue::from_str(&value)
            .unwrap_or_else(|_| http::HeaderValue::from_static("Bearer"))
    }
}

/// The HTTP path prefix whose routes authenticate their callers themselves: the web console
/// (`reach-console`), whose login keeps a bearer token in a cookie and sends it on every
/// call it makes, so the services it calls judge the person; without credentials its
/// requests pass here as anonymous (the console then asks for a login).
pub const SELF_AUTHENTICATED_PREFIX: &str = "/console";

/// Whether `path` is [`SELF_AUTHENTICATED_PREFIX`] or under it.
fn authenticates_itself(path: &str) -> bool {
    path.strip_prefix(SELF_AUTHENTICATED_PREFIX)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// Axum middleware: establishes the request's [`Caller`] and puts it in its extensions, or
/// answers `UNAUTHENTICATED` / 401 for refused credentials.
pub(crate) async fn authenticate(
    axum::extract::State(auth): axum::extract::State<Arc<Authentication>>,
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let trust = &auth.trust;
    let peer = request
        .extensions()
        .get::<PeerIdentity>()
        .and_then(|peer| peer.0.clone());
    let caller = match trust.authenticate(peer.as_ref(), request.headers()) {
        Ok(caller) => caller,
        Err(AuthError::Missing)
            if is_open_grpc(request.uri().path())
                || authenticates_itself(request.uri().path())
                || (request.method() == http::Method::GET
                    && trust.is_open_path(request.uri().path())) =>
        {
            Caller::anonymous()
        }
        Err(error) => {
            reach_trust::audit::record(
                &Caller::anonymous(),
                "authenticate",
                request.uri().path(),
                reach_trust::audit::Decision::Denied,
                &error.to_string(),
            );
            return if crate::limits::is_grpc(request.headers()) {
                error
                    .to_status()
                    .into_http::<axum::body::Body>()
                    .into_response()
            } else {
                (
                    http::StatusCode::UNAUTHORIZED,
                    [(
                        http::header::WWW_AUTHENTICATE,
                        auth.challenge(request.uri().path(), &error),
                    )],
                    format!("{error}\n"),
                )
                    .into_response()
            };
        }
    };
    request.extensions_mut().insert(caller);
    next.run(request).await
}

/// Whether a TLS listener requires client certificates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ClientCertificates {
    /// As `[trust.tls] client_auth` says (gRPC ports).
    #[default]
    AsConfigured,
    /// Optional whatever it says (admin ports: Kubernetes HTTPS probes present none). A
    /// client without one must send a bearer token, except GETs of the policy's open paths.
    Optional,
}

/// What a 401 tells HTTP clients of the resources under `path_prefix`: the URL of their
/// OAuth 2.0 protected resource metadata (RFC 9728 §5.1), sent as the `resource_metadata`
/// parameter of the `WWW-Authenticate: Bearer` challenge, so a client can find the
/// authorization server to get a token from (as the MCP authorization spec requires).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    /// The paths the challenge is for (`/mcp`: `/mcp` and everything under it).
    pub path_prefix: String,
    /// The absolute URL of the metadata document.
    pub resource_metadata: String,
}

#[cfg(test)]
mod tests {
    use super::authenticates_itself;

    #[test]
    fn only_the_console_authenticates_itself() {
        assert!(authenticates_itself("/console"));
        assert!(authenticates_itself("/console/inbox/t1"));
        assert!(!authenticates_itself("/consoles"));
        assert!(!authenticates_itself("/agents"));
        assert!(!authenticates_itself("/tasks/console"));
    }
}
