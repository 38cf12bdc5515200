//! TLS to etcd (`[registry.etcd.tls]`): rustls with the operator's CA, an optional client
//! certificate for etcd's `--client-cert-auth`, and the usual host-name verification (etcd's
//! certificates are ordinary server certificates, not SPIFFE ones).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use crate::config::EtcdTls;
use crate::error::InitError;

/// Connects to an etcd member over TLS: a [`tower::Service`] of the member's URI, for
/// `tonic::transport::Endpoint::connect_with_connector`.
#[derive(Clone)]
pub struct EtcdTlsConnector {
    connector: tokio_rustls::TlsConnector,
    /// The name the members' certificates carry (`tls.domain`); else each endpoint's host.
    domain: Option<String>,
}

impl EtcdTlsConnector {
    /// The connector for `tls`, its files read now.
    ///
    /// # Errors
    /// [`InitError::Etcd`] naming a file that cannot be read or holds no usable PEM.
    pub fn new(tls: &EtcdTls) -> Result<Self, InitError> {
        let bad = |key: &str, path: &std::path::Path, what: String| {
            InitError::Etcd(format!(
                "registry.etcd.tls.{key}: {}: {what}",
                path.display()
            ))
        };
        let mut roots = rustls::RootCertStore::empty();
        let cas: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&tls.ca)
            .map_err(|e| bad("ca", &tls.ca, e.to_string()))?
            .collect::<Result<_, _>>()
            .map_err(|e| bad("ca", &tls.ca, e.to_string()))?;
        if cas.is_empty() {
            return Err(bad("ca", &tls.ca, "holds no PEM certificate".into()));
        }
        for ca in cas {
            roots
                .add(ca)
                .map_err(|e| bad("ca", &tls.ca, e.to_string()))?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(reach_trust::tls::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| InitError::Etcd(format!("registry.etcd.tls: {e}")))?
            .with_root_certificates(roots);
        let mut config = match (&tls.cert, &tls.key) {
            (Some(cert), Some(key)) => {
                let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
                    .map_err(|e| bad("cert", cert, e.to_string()))?
                    .collect::<Result<_, _>>()
                    .map_err(|e| bad("cert", cert, e.to_string()))?;
                let private = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| bad("key", key, e.to_string()))?;
                builder
                    .with_client_auth_cert(chain, private)
                    .map_err(|e| bad("cert", cert, e.to_string()))?
            }
            _ => builder.with_no_client_auth(),
        };
        // etcd serves gRPC over HTTP/2 only.
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Self {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
            domain: tls.domain.clone(),
        })
    }
}

impl tower::Service<http::Uri> for EtcdTlsConnector {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let invalid =
                |what: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
            let host = uri
                .host()
                .ok_or_else(|| invalid(format!("{uri} has no host")))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = uri.port_u16().unwrap_or(2379);
            let name = this.domain.clone().unwrap_or_else(|| host.clone());
            let server_name = ServerName::try_from(name.clone())
                .map_err(|_| invalid(format!("{name:?} is not a host name or address")))?;
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let tls = this.connector.connect(server_name, tcp).await?;
            Ok(TokioIo::new(tls))
        })
    }
}
