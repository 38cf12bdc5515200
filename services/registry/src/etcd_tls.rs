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

use reach_rpc::errors::chain;

use crate::config::{ConfigError, EtcdTls};
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
    /// [`InitError::Config`] naming the setting and the file that cannot be read, holds no
    /// usable PEM, or (certificate and key) do not make a client certificate: a bad setting,
    /// as `reach` reports it (exit 64).
    pub fn new(tls: &EtcdTls) -> Result<Self, InitError> {
        let bad = |key: &str, path: &std::path::Path, what: String| {
            InitError::Config(ConfigError::Etcd(format!(
                "registry.etcd.tls.{key}: cannot use {}: {what}",
                path.display()
            )))
        };
        let mut roots = rustls::RootCertStore::empty();
        let cas: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&tls.ca)
            .map_err(|e| bad("ca", &tls.ca, chain(&e)))?
            .collect::<Result<_, _>>()
            .map_err(|e| bad("ca", &tls.ca, chain(&e)))?;
        if cas.is_empty() {
            return Err(bad("ca", &tls.ca, "it holds no PEM certificate".into()));
        }
        for ca in cas {
            roots.add(ca).map_err(|e| bad("ca", &tls.ca, chain(&e)))?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(reach_trust::tls::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| InitError::Etcd(format!("registry.etcd.tls: {}", chain(&e))))?
            .with_root_certificates(roots);
        let mut config = match (&tls.cert, &tls.key) {
            (Some(cert), Some(key)) => {
                let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
                    .map_err(|e| bad("cert", cert, chain(&e)))?
                    .collect::<Result<_, _>>()
                    .map_err(|e| bad("cert", cert, chain(&e)))?;
                if certs.is_empty() {
                    return Err(bad("cert", cert, "it holds no PEM certificate".into()));
                }
                let private = PrivateKeyDer::from_pem_file(key).map_err(|e| match e {
                    rustls::pki_types::pem::Error::NoItemsFound => {
                        bad("key", key, "it holds no PEM private key".into())
                    }
                    other => bad("key", key, chain(&other)),
                })?;
                builder.with_client_auth_cert(certs, private).map_err(|e| {
                    let why = match e {
                        rustls::Error::InconsistentKeys(_) => {
                            "the key is not the certificate's".to_string()
                        }
                        other => chain(&other),
                    };
                    InitError::Config(ConfigError::Etcd(format!(
                        "registry.etcd.tls.cert and registry.etcd.tls.key: {} and {} do not make a client certificate: {why}",
                        cert.display(),
                        key.display(),
                    )))
                })?
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The refusal of `tls` as `reach` prints it, asserting it is a configuration error.
    fn refusal(tls: &EtcdTls) -> String {
        match EtcdTlsConnector::new(tls) {
            Err(error @ InitError::Config(_)) => error.to_string(),
            Err(other) => panic!("not a configuration error: {other:?}"),
            Ok(_) => panic!("accepted"),
        }
    }

    #[test]
    fn unusable_tls_files_are_configuration_errors_naming_the_setting_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = |name: &str| dir.path().join(name);
        let ca = reach_trust::issue::CertificateAuthority::generate(
            "etcd.test",
            Duration::from_secs(3600),
        )
        .unwrap();
        let identity = reach_trust::Identity::parse("spiffe://etcd.test/registry").unwrap();
        let issued = ca.issue(&identity, &[], Duration::from_secs(3600)).unwrap();
        std::fs::write(path("ca.pem"), ca.cert_pem()).unwrap();
        std::fs::write(path("client.pem"), &issued.cert_pem).unwrap();
        std::fs::write(path("client-key.pem"), &issued.key_pem).unwrap();
        std::fs::write(path("garbage.pem"), "not PEM at all\n").unwrap();
        let other = reach_trust::issue::CertificateAuthority::generate(
            "other.test",
            Duration::from_secs(3600),
        )
        .unwrap()
        .issue(
            &reach_trust::Identity::parse("spiffe://other.test/registry").unwrap(),
            &[],
            Duration::from_secs(3600),
        )
        .unwrap();
        std::fs::write(path("other-key.pem"), &other.key_pem).unwrap();
        let tls = |ca: &str, pair: Option<(&str, &str)>| EtcdTls {
            ca: path(ca),
            cert: pair.map(|(cert, _)| path(cert)),
            key: pair.map(|(_, key)| path(key)),
            domain: None,
        };

        EtcdTlsConnector::new(&tls("ca.pem", Some(("client.pem", "client-key.pem"))))
            .expect("the issued files make a connector");
        for (tls, key, file) in [
            (
                tls("missing.pem", None),
                "registry.etcd.tls.ca",
                "missing.pem",
            ),
            (
                tls("garbage.pem", None),
                "registry.etcd.tls.ca",
                "garbage.pem",
            ),
            (
                tls("ca.pem", Some(("missing.pem", "client-key.pem"))),
                "registry.etcd.tls.cert",
                "missing.pem",
            ),
            (
                tls("ca.pem", Some(("garbage.pem", "client-key.pem"))),
                "registry.etcd.tls.cert",
                "garbage.pem",
            ),
            (
                tls("ca.pem", Some(("client.pem", "garbage.pem"))),
                "registry.etcd.tls.key",
                "garbage.pem",
            ),
            (
                tls("ca.pem", Some(("client.pem", "other-key.pem"))),
                "registry.etcd.tls.key",
                "other-key.pem",
            ),
        ] {
            let message = refusal(&tls);
            assert!(
                message.contains(key) && message.contains(&path(file).display().to_string()),
                "{key} {file}: {message}"
            );
            assert!(
                !message.contains("Os {"),
                "a debug-formatted cause: {message}"
            );
        }
        let message = refusal(&tls("ca.pem", Some(("client.pem", "garbage.pem"))));
        assert!(
            message.ends_with("it holds no PEM private key"),
            "{message}"
        );
        let message = refusal(&tls("ca.pem", Some(("client.pem", "other-key.pem"))));
        assert!(
            message.ends_with("the key is not the certificate's"),
            "{message}"
        );
    }
}
