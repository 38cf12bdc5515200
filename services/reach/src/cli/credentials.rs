//! The client commands' credentials, from the environment (as `kubectl`, `temporal` and `nats`
//! read theirs): `REACH_TLS_CA` (the mesh CA: connect over TLS), `REACH_TLS_CERT` and
//! `REACH_TLS_KEY` (present a client certificate, such as `operator-admin.pem` from `reach
//! certs init`), `REACH_TRUST_DOMAIN` (default `reach.local`), and `REACH_TOKEN` (a bearer
//! token, such as one from `reach token operator`, sent with every registry and orchestrator
//! call). None set: plaintext, no credentials (`reach dev` on loopback).

use std::sync::{Arc, OnceLock};

use reach_trust::tls::{TlsConfig, TlsSource};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use super::CliError;

/// A channel that sends the bearer token of `REACH_TOKEN` (if any) with every call.
pub type Authorized = InterceptedService<Channel, BearerToken>;

/// Adds `authorization: Bearer …` to every request, when a token is configured.
#[derive(Clone, Debug, Default)]
pub struct BearerToken(Option<MetadataValue<Ascii>>);

impl Interceptor for BearerToken {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", token.clone());
        }
        Ok(request)
    }
}

/// What the environment configures.
struct Credentials {
    tls: Option<Arc<TlsSource>>,
    token: BearerToken,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|value| !value.is_empty())
}

fn load() -> Result<Credentials, String> {
    let tls = match (
        env("REACH_TLS_CA"),
        env("REACH_TLS_CERT"),
        env("REACH_TLS_KEY"),
    ) {
        (None, None, None) => None,
        (None, _, _) => {
            return Err(
                "REACH_TLS_CERT and REACH_TLS_KEY need REACH_TLS_CA (the mesh CA, ca.pem) too"
                    .into(),
            );
        }
        (Some(ca), cert, key) => {
            if cert.is_some() != key.is_some() {
                return Err("set both REACH_TLS_CERT and REACH_TLS_KEY, or neither".into());
            }
            let config = TlsConfig {
                cert: cert.map(Into::into),
                key: key.map(Into::into),
                ..TlsConfig::new("", "", ca)
            };
            let domain = env("REACH_TRUST_DOMAIN")
                .unwrap_or_else(|| reach_trust::DEFAULT_TRUST_DOMAIN.into());
            Some(TlsSource::load(&config, &domain).map_err(|e| e.to_string())?)
        }
    };
    let token = match env("REACH_TOKEN") {
        None => None,
        Some(token) => Some(
            MetadataValue::try_from(format!("Bearer {}", token.trim()))
                .map_err(|_| "REACH_TOKEN is not a valid token (printable ASCII)".to_string())?,
        ),
    };
    Ok(Credentials {
        tls,
        token: BearerToken(token),
    })
}

fn credentials() -> Result<&'static Credentials, CliError> {
    static CREDENTIALS: OnceLock<Result<Credentials, String>> = OnceLock::new();
    CREDENTIALS
        .get_or_init(load)
        .as_ref()
        .map_err(|e| CliError::Usage(e.clone()))
}

/// A channel to `endpoint` with the environment's TLS settings (connect timeout 3 s), not yet
/// sending the token (see [`connect`]).
///
/// # Errors
/// [`CliError::Usage`] for a bad endpoint or bad credentials, [`CliError::Connect`] when
/// nothing answers (or the TLS handshake fails).
pub async fn channel(endpoint: &str) -> Result<Channel, CliError> {
    let credentials = credentials()?;
    if credentials.tls.is_none() {
        // Never send a bearer token, or speak plaintext, where the user asked for TLS.
        if endpoint.starts_with("https://") {
            return Err(CliError::Usage(format!(
                "{endpoint} is https:// but REACH_TLS_CA is not set: set it to the mesh CA (ca.pem) so the CLI speaks TLS"
            )));
        }
        let loopback = http::Uri::try_from(endpoint).ok().and_then(|uri| {
            uri.host().map(|host| {
                host == "localhost"
                    || host
                        .trim_matches(['[', ']'])
                        .parse::<std::net::IpAddr>()
                        .is_ok_and(|ip| ip.is_loopback())
            })
        });
        if credentials.token.0.is_some() && loopback != Some(true) {
            return Err(CliError::Usage(format!(
                "REACH_TOKEN would go in plaintext to {endpoint}: set REACH_TLS_CA (the mesh CA) so it goes over TLS"
            )));
        }
    }
    let ep = tonic::transport::Endpoint::from_shared(endpoint.to_string())
        .map_err(|e| {
            CliError::Usage(format!(
                "--endpoint {endpoint:?} is not a URI: {e}; use http://HOST:PORT"
            ))
        })?
        .connect_timeout(std::time::Duration::from_secs(3));
    reach_rpc::http2::channel(&ep, credentials.tls.as_ref(), None)
        .await
        .map_err(|e| CliError::Connect {
            endpoint: endpoint.to_string(),
            message: reach_rpc::errors::chain(&e),
        })
}

/// [`channel`], sending `REACH_TOKEN` with every call.
///
/// # Errors
/// As [`channel`].
pub async fn connect(endpoint: &str) -> Result<Authorized, CliError> {
    let channel = channel(endpoint).await?;
    Ok(InterceptedService::new(
        channel,
        credentials()?.token.clone(),
    ))
}
