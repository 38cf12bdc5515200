//! TLS with certificates from files, reloaded when the files change, and peers verified the
//! SPIFFE way.
//!
//! A peer is trusted when its certificate chains to the configured CA and carries a URI SAN in
//! the trust domain (the X.509-SVID standard, spiffe.io "X509-SVID" §4-5: validators check the
//! SPIFFE ID, not a host name). Host names are not checked: instances are addressed by IP.
//! Servers offer ALPN `h2` and `http/1.1` (gRPC and the admin pages); clients ask for `h2`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use serde::{Deserialize, Serialize};

use crate::identity::{Identity, IdentityError};
use crate::reload::Reloader;

/// The largest certificate, key or CA file read, in bytes.
pub const MAX_PEM_BYTES: u64 = 1024 * 1024;

/// Whether a TLS server asks its clients for certificates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientAuth {
    /// Every client must present a certificate from the CA (mutual TLS).
    #[default]
    Required,
    /// A client may present one; one without may authenticate with a bearer token instead
    /// (browsers, scripts at an edge).
    Optional,
}

/// Where a process's certificate, key and CA are (PEM files), as configured in `[trust.tls]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// This process's certificate chain (leaf first). Required to serve TLS; a client without
    /// one connects without a client certificate.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// The certificate's private key (PKCS#8, PKCS#1 or SEC1).
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// The CA certificates peers must chain to.
    pub ca: PathBuf,
    /// Whether servers require client certificates.
    #[serde(default)]
    pub client_auth: ClientAuth,
    /// How often the files are checked for changes (default 2 s).
    #[serde(default = "default_reload_interval", with = "humantime_serde")]
    pub reload_interval: Duration,
}

fn default_reload_interval() -> Duration {
    Duration::from_secs(2)
}

impl TlsConfig {
    /// A configuration of the three files with required client certificates.
    pub fn new(cert: impl Into<PathBuf>, key: impl Into<PathBuf>, ca: impl Into<PathBuf>) -> Self {
        Self {
            cert: Some(cert.into()),
            key: Some(key.into()),
            ca: ca.into(),
            client_auth: ClientAuth::Required,
            reload_interval: default_reload_interval(),
        }
    }
}

/// Why TLS material could not be loaded or a peer not trusted.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file is not PEM of the expected kind.
    #[error("{path} holds no {what} in PEM form (expected -----BEGIN {what}-----)")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What it should hold (`CERTIFICATE`, `PRIVATE KEY`).
        what: &'static str,
    },
    /// A file is over [`MAX_PEM_BYTES`].
    #[error("{path} is over {MAX_PEM_BYTES} bytes; is it the right file?")]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// A server was configured without a certificate or key.
    #[error(
        "serving TLS needs trust.tls.cert and trust.tls.key (make them with `reach certs init`)"
    )]
    MissingCertificate,
    /// The certificate carries no SPIFFE ID in the trust domain.
    #[error("{path}: {reason}")]
    Identity {
        /// The certificate file.
        path: PathBuf,
        /// What is wrong with its identity.
        reason: String,
    },
    /// rustls refused the material (a key that does not match the certificate, a bad CA).
    #[error("TLS configuration refused: {0}")]
    Rustls(#[from] rustls::Error),
    /// The CA could not be used to verify clients.
    #[error("cannot verify clients with the CA: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// The crypto provider Reach uses everywhere (ring).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The SPIFFE ID in a certificate: its one URI SAN starting `spiffe://`.
///
/// # Errors
/// A message saying what is wrong: not X.509, no SPIFFE URI SAN, more than one, malformed.
pub fn identity_of(cert: &CertificateDer<'_>) -> Result<Identity, String> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let (_, parsed) = X509Certificate::from_der(cert.as_ref())
        .map_err(|e| format!("the certificate is not valid X.509: {e}"))?;
    let sans = parsed
        .subject_alternative_name()
        .map_err(|e| format!("the certificate's subject alternative names are malformed: {e}"))?;
    let mut found = None;
    for name in sans.iter().flat_map(|ext| ext.value.general_names.iter()) {
        if let GeneralName::URI(uri) = name
            && uri.starts_with("spiffe://")
        {
            if found.is_some() {
                return Err("the certificate carries more than one SPIFFE ID".into());
            }
            found = Some(Identity::parse(uri).map_err(|e: IdentityError| e.to_string())?);
        }
    }
    found.ok_or_else(|| {
        "the certificate carries no SPIFFE ID (a URI SAN spiffe://…); issue it with `reach certs \
         init` or your CA with one"
            .into()
    })
}

/// The identity of a peer's certificate chain, checked to be in `trust_domain`.
///
/// # Errors
/// Why the peer's certificate names no identity of the trust domain.
pub fn peer_identity(
    chain: Option<&[CertificateDer<'_>]>,
    trust_domain: &str,
) -> Result<Option<Identity>, String> {
    let Some(leaf) = chain.and_then(|chain| chain.first()) else {
        return Ok(None);
    };
    let identity = identity_of(leaf)?;
    if identity.trust_domain() != trust_domain {
        return Err(format!(
            "the peer's identity {identity} is not in the trust domain {trust_domain:?}"
        ));
    }
    Ok(Some(identity))
}

fn read_bounded(path: &Path) -> Result<Vec<u8>, TlsError> {
    let read_error = |source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    };
    let len = std::fs::metadata(path).map_err(read_error)?.len();
    if len > MAX_PEM_BYTES {
        return Err(TlsError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    std::fs::read(path).map_err(read_error)
}

fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .collect();
    if certs.is_empty() {
        return Err(TlsError::Pem {
            path: path.to_path_buf(),
            what: "CERTIFICATE",
        });
    }
    Ok(certs)
}

/// The files' contents, read together so one reload sees one version of each.
#[derive(PartialEq, Eq, Clone)]
struct Files {
    cert: Option<Vec<u8>>,
    key: Option<Vec<u8>>,
    ca: Vec<u8>,
}

fn read_files(config: &TlsConfig) -> Result<Files, TlsError> {
    Ok(Files {
        cert: config.cert.as_deref().map(read_bounded).transpose()?,
        key: config.key.as_deref().map(read_bounded).transpose()?,
        ca: read_bounded(&config.ca)?,
    })
}

/// One loaded version of the material.
struct Loaded {
    files: Files,
    server: Option<Arc<ServerConfig>>,
    /// `server` with client certificates optional whatever `client_auth` says (admin ports).
    server_optional: Option<Arc<ServerConfig>>,
    client: Arc<ClientConfig>,
    identity: Option<Identity>,
}

fn build(config: &TlsConfig, trust_domain: &str, files: Files) -> Result<Loaded, TlsError> {
    let provider = provider();
    let ca_certs = certificates(&config.ca, &files.ca)?;
    let mut roots = RootCertStore::empty();
    for cert in &ca_certs {
        roots.add(cert.clone())?;
    }
    let roots = Arc::new(roots);
    let own = match (&config.cert, &files.cert, &config.key, &files.key) {
        (Some(cert_path), Some(cert_pem), Some(key_path), Some(key_pem)) => {
            let chain = certificates(cert_path, cert_pem)?;
            let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|_| TlsError::Pem {
                path: key_path.clone(),
                what: "PRIVATE KEY",
            })?;
            let identity = peer_identity(Some(&chain), trust_domain)
                .and_then(|identity| identity.ok_or_else(|| "no certificate".to_string()))
                .map_err(|reason| TlsError::Identity {
                    path: cert_path.clone(),
                    reason,
                })?;
            Some((chain, key, identity))
        }
        _ => None,
    };
    let verifier = Arc::new(SpiffeServerVerifier {
        anchors: ca_certs
            .iter()
            .filter_map(|cert| webpki::anchor_from_trusted_cert(cert).ok())
            .map(|anchor| anchor.to_owned())
            .collect(),
        provider: provider.clone(),
        trust_domain: trust_domain.to_string(),
    });
    let client_builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let mut client = match &own {
        Some((chain, key, _)) => {
            client_builder.with_client_auth_cert(chain.clone(), key.clone_key())?
        }
        None => client_builder.with_no_client_auth(),
    };
    client.alpn_protocols = vec![b"h2".to_vec()];
    let server_with = |client_auth: ClientAuth| -> Result<Option<Arc<ServerConfig>>, TlsError> {
        let Some((chain, key, _)) = &own else {
            return Ok(None);
        };
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.clone(),
            provider.clone(),
        );
        let verifier = match client_auth {
            ClientAuth::Required => verifier.build()?,
            ClientAuth::Optional => verifier.allow_unauthenticated().build()?,
        };
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())?;
        server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Some(Arc::new(server)))
    };
    let server = server_with(config.client_auth)?;
    let server_optional = server_with(ClientAuth::Optional)?;
    Ok(Loaded {
        files,
        server,
        server_optional,
        client: Arc::new(client),
        identity: own.map(|(_, _, identity)| identity),
    })
}

/// A process's TLS material: server and client configurations built from the files of a
/// [`TlsConfig`], rebuilt when the files change (checked every `reload_interval`, after
/// [`TlsSource::watch`]). A change that fails to load is logged and the previous material
/// kept. Connections already open keep the material they were made with; new handshakes use
/// the current one.
pub struct TlsSource {
    config: TlsConfig,
    trust_domain: String,
    current: RwLock<Arc<Loaded>>,
    reloads: tokio::sync::watch::Sender<u64>,
}

impl std::fmt::Debug for TlsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSource")
            .field("config", &self.config)
            .field("trust_domain", &self.trust_domain)
            .finish_non_exhaustive()
    }
}

impl TlsSource {
    /// Loads the files of `config` for `trust_domain`; the certificate, when given, must carry
    /// a SPIFFE ID of that domain.
    ///
    /// # Errors
    /// [`TlsError`] naming the file and what is wrong with it.
    pub fn load(config: &TlsConfig, trust_domain: &str) -> Result<Arc<Self>, TlsError> {
        let loaded = build(config, trust_domain, read_files(config)?)?;
        Ok(Arc::new(Self {
            config: config.clone(),
            trust_domain: trust_domain.to_string(),
            current: RwLock::new(Arc::new(loaded)),
            reloads: tokio::sync::watch::Sender::new(0),
        }))
    }

    fn current(&self) -> Arc<Loaded> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The configuration this was loaded from.
    pub fn config(&self) -> &TlsConfig {
        &self.config
    }

    /// The trust domain peers must be in.
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// The current server configuration.
    ///
    /// # Errors
    /// [`TlsError::MissingCertificate`] when no certificate and key are configured.
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        self.current()
            .server
            .clone()
            .ok_or(TlsError::MissingCertificate)
    }

    /// The current server configuration with client certificates optional, whatever
    /// `client_auth` says: for admin ports, whose callers include probes that present none
    /// (Kubernetes HTTPS probes). A certificate a client does present is verified as ever;
    /// one without must authenticate with a bearer token, except for the open paths.
    ///
    /// # Errors
    /// [`TlsError::MissingCertificate`] when no certificate and key are configured.
    pub fn server_config_optional_client_auth(&self) -> Result<Arc<ServerConfig>, TlsError> {
        self.current()
            .server_optional
            .clone()
            .ok_or(TlsError::MissingCertificate)
    }

    /// The current client configuration (presenting the certificate when one is configured).
    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.current().client.clone()
    }

    /// The SPIFFE ID of this process's own certificate, if it has one.
    pub fn identity(&self) -> Option<Identity> {
        self.current().identity.clone()
    }

    /// Counts successful reloads; changes after each one (tests and logs wait on it).
    pub fn reloads(&self) -> tokio::sync::watch::Receiver<u64> {
        self.reloads.subscribe()
    }

    /// Reads the files again and, when they changed and load, makes them current. Returns
    /// whether the material changed.
    ///
    /// # Errors
    /// [`TlsError`] when the changed files do not load; the previous material stays current.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let files = read_files(&self.config)?;
        if files == self.current().files {
            return Ok(false);
        }
        let loaded = build(&self.config, &self.trust_domain, files)?;
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(loaded);
        self.reloads.send_modify(|count| *count += 1);
        Ok(true)
    }

    /// Checks the files every `reload_interval` on the current tokio runtime until the source
    /// is dropped, logging each reload and each failed one.
    pub fn watch(self: &Arc<Self>) {
        let interval = self.config.reload_interval;
        Reloader::spawn(
            Arc::downgrade(self),
            interval,
            |source: &Self| match source.reload() {
                Ok(true) => tracing::info!(
                    cert = ?source.config.cert,
                    identity = ?source.identity().map(|id| id.to_string()),
                    "TLS certificate reloaded; new connections use it"
                ),
                Ok(false) => {}
                Err(error) => tracing::warn!(
                    %error,
                    "TLS files changed but do not load; keeping the previous certificate"
                ),
            },
        );
    }
}

/// Verifies a server's certificate the SPIFFE way: it chains to the CA (with the serverAuth
/// usage) and names a SPIFFE ID in the trust domain; the name dialled is not checked.
#[derive(Debug)]
struct SpiffeServerVerifier {
    anchors: Vec<rustls::pki_types::TrustAnchor<'static>>,
    provider: Arc<CryptoProvider>,
    trust_domain: String,
}

fn certificate_error(error: webpki::Error) -> rustls::Error {
    use rustls::CertificateError;
    let kind = match error {
        webpki::Error::CertExpired { .. } => CertificateError::Expired,
        webpki::Error::CertNotValidYet { .. } => CertificateError::NotValidYet,
        webpki::Error::UnknownIssuer => CertificateError::UnknownIssuer,
        webpki::Error::InvalidSignatureForPublicKey => CertificateError::BadSignature,
        other => CertificateError::Other(rustls::OtherError(Arc::new(other))),
    };
    rustls::Error::InvalidCertificate(kind)
}

impl ServerCertVerifier for SpiffeServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = webpki::EndEntityCert::try_from(end_entity).map_err(certificate_error)?;
        cert.verify_for_usage(
            self.provider.signature_verification_algorithms.all,
            &self.anchors,
            intermediates,
            now,
            webpki::KeyUsage::server_auth(),
            None,
            None,
        )
        .map_err(certificate_error)?;
        peer_identity(Some(std::slice::from_ref(end_entity)), &self.trust_domain)
            .map_err(rustls::Error::General)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
