//! Outbound TLS for tonic channels: a connector that dials TCP, runs the TLS handshake with the
//! current client configuration of a [`TlsSource`], and optionally checks the server's
//! identity.
//!
//! Use with `tonic::transport::Endpoint::connect_with_connector(_lazy)`; the endpoint's URI may
//! be `http://` or `https://` (the connector does TLS either way).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use crate::identity::Identity;
use crate::tls::{TlsSource, peer_identity};

/// How long a connection (TCP and TLS handshake) may take by default.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A tower service from `Uri` to a TLS connection, for tonic channels (see the module docs).
#[derive(Clone, Debug)]
pub struct TlsConnector {
    source: Arc<TlsSource>,
    expected: Option<Identity>,
    timeout: Duration,
}

/// Why an outbound TLS connection failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URI has no host or port.
    #[error("cannot connect to {0}: the address needs a host and a port")]
    Address(String),
    /// TCP or TLS failed (refused, unreachable, handshake refused).
    #[error("cannot connect to {address}: {source}")]
    Io {
        /// `host:port`.
        address: String,
        /// Why.
        source: std::io::Error,
    },
    /// The server's certificate names another identity than the one expected.
    #[error(
        "the server at {address} is {found}, not {expected}: it is not the instance that \
         registered there (an impostor, or an instance restarted with another certificate)"
    )]
    WrongIdentity {
        /// `host:port`.
        address: String,
        /// The identity it presented.
        found: String,
        /// The identity expected.
        expected: Identity,
    },
    /// Connecting took longer than the timeout.
    #[error("cannot connect to {address}: no TLS connection within {timeout:?}")]
    Timeout {
        /// `host:port`.
        address: String,
        /// The timeout.
        timeout: Duration,
    },
}

impl TlsConnector {
    /// A connector using `source`'s client configuration, checking only that the server is in
    /// the trust domain.
    pub fn new(source: Arc<TlsSource>) -> Self {
        Self {
            source,
            expected: None,
            timeout: DEFAULT_CONNECT_TIMEOUT,
        }
    }

    /// Also requires the server to present exactly `identity` (the router dialling an instance
    /// of service S expects `/agent/S`).
    pub fn expecting(mut self, identity: Identity) -> Self {
        self.expected = Some(identity);
        self
    }

    /// Sets how long TCP connect plus TLS handshake may take.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Connects to `host:port` over TLS.
    ///
    /// # Errors
    /// [`ConnectError`] saying which step failed.
    pub async fn connect(
        &self,
        host: &str,
        port: u16,
    ) -> Result<TlsStream<TcpStream>, ConnectError> {
        let address = format!("{host}:{port}");
        let attempt = async {
            let io = |source| ConnectError::Io {
                address: address.clone(),
                source,
            };
            let tcp = TcpStream::connect((host.trim_matches(['[', ']']), port))
                .await
                .map_err(io)?;
            let _ = tcp.set_nodelay(true);
            let name = ServerName::try_from(host.trim_matches(['[', ']']).to_string())
                .map_err(|_| ConnectError::Address(address.clone()))?;
            let connector = tokio_rustls::TlsConnector::from(self.source.client_config());
            let stream = connector.connect(name, tcp).await.map_err(io)?;
            if let Some(expected) = &self.expected {
                let found = peer_identity(
                    stream.get_ref().1.peer_certificates(),
                    self.source.trust_domain(),
                );
                match found {
                    Ok(Some(found)) if &found == expected => {}
                    Ok(found) => {
                        return Err(ConnectError::WrongIdentity {
                            address: address.clone(),
                            found: found.map_or_else(|| "unidentified".into(), |f| f.to_string()),
                            expected: expected.clone(),
                        });
                    }
                    Err(reason) => {
                        return Err(ConnectError::WrongIdentity {
                            address: address.clone(),
                            found: reason,
                            expected: expected.clone(),
                        });
                    }
                }
            }
            Ok(stream)
        };
        tokio::time::timeout(self.timeout, attempt)
            .await
            .unwrap_or_else(|_| {
                Err(ConnectError::Timeout {
                    address: address.clone(),
                    timeout: self.timeout,
                })
            })
    }
}

impl tower::Service<http::Uri> for TlsConnector {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = ConnectError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ConnectError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connector = self.clone();
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or_else(|| ConnectError::Address(uri.to_string()))?
                .to_string();
            let port = uri
                .port_u16()
                .or_else(|| match uri.scheme_str() {
                    Some("https") => Some(443),
                    Some("http") => Some(80),
                    _ => None,
                })
                .ok_or_else(|| ConnectError::Address(uri.to_string()))?;
            connector.connect(&host, port).await.map(TokioIo::new)
        })
    }
}
