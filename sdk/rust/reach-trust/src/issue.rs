//! A certificate authority for a mesh: issues X.509-SVID-style certificates (one SPIFFE ID URI
//! SAN, plus DNS `localhost` and IP `127.0.0.1` and any extra hosts) and token signing keys.
//! For development (`reach certs init`) and tests; production meshes may use any CA that issues
//! certificates of the same shape (cert-manager, SPIRE, Vault).

use std::net::IpAddr;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

use crate::identity::Identity;

/// Why a certificate could not be made.
#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    /// rcgen refused (a bad name, a key that does not parse).
    #[error("cannot make the certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
    /// A host is neither an IP address nor a DNS name.
    #[error("{0:?} is not a DNS name or IP address")]
    Host(String),
}

/// A certificate and its private key, PEM.
#[derive(Debug, Clone)]
pub struct Issued {
    /// The certificate.
    pub cert_pem: String,
    /// Its private key (PKCS#8).
    pub key_pem: String,
}

/// A CA: its certificate and signing key.
pub struct CertificateAuthority {
    cert_pem: String,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority")
            .finish_non_exhaustive()
    }
}

fn validity(params: &mut CertificateParams, valid_for: Duration) {
    let now = time::OffsetDateTime::now_utc();
    // An hour back, for peers whose clocks are a little behind.
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::seconds(valid_for.as_secs() as i64);
}

impl CertificateAuthority {
    /// A new CA (ECDSA P-256) for `trust_domain`, valid for `valid_for`.
    ///
    /// # Errors
    /// [`IssueError`].
    pub fn generate(trust_domain: &str, valid_for: Duration) -> Result<Self, IssueError> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, format!("Reach CA {trust_domain}"));
        params.distinguished_name = name;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.subject_alt_names =
            vec![SanType::URI(format!("spiffe://{trust_domain}").try_into()?)];
        validity(&mut params, valid_for);
        let cert = params.self_signed(&key)?;
        let key_pem = key.serialize_pem();
        Ok(Self {
            cert_pem: cert.pem(),
            key_pem,
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA of an existing certificate and key (PEM).
    ///
    /// # Errors
    /// [`IssueError`] when either does not parse.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, IssueError> {
        let key = KeyPair::from_pem(key_pem)?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key)?;
        Ok(Self {
            cert_pem: cert_pem.to_string(),
            key_pem: key_pem.to_string(),
            issuer,
        })
    }

    /// The CA certificate (what peers trust: `trust.tls.ca`).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA's signing key: keep it off the machines that run the mesh.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// Issues a certificate for `identity` (server and client use), with `localhost`,
    /// `127.0.0.1` and `hosts` (DNS names or IP addresses) as further SANs, valid for
    /// `valid_for`.
    ///
    /// # Errors
    /// [`IssueError`] for a host that is not a name or address.
    pub fn issue(
        &self,
        identity: &Identity,
        hosts: &[String],
        valid_for: Duration,
    ) -> Result<Issued, IssueError> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, identity.to_string());
        params.distinguished_name = name;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let mut sans = vec![SanType::URI(identity.as_str().try_into()?)];
        for host in ["localhost", "127.0.0.1"]
            .into_iter()
            .chain(hosts.iter().map(String::as_str))
        {
            let san = match host.parse::<IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => {
                    rustls::pki_types::DnsName::try_from(host)
                        .map_err(|_| IssueError::Host(host.to_string()))?;
                    SanType::DnsName(
                        host.try_into()
                            .map_err(|_| IssueError::Host(host.to_string()))?,
                    )
                }
            };
            if !sans.contains(&san) {
                sans.push(san);
            }
        }
        params.subject_alt_names = sans;
        validity(&mut params, valid_for);
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// A new Ed25519 key pair for signing bearer and join tokens: (private PEM, public PEM).
///
/// # Errors
/// [`IssueError`] when key generation fails.
pub fn token_signing_key() -> Result<(String, String), IssueError> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ED25519)?;
    Ok((key.serialize_pem(), key.public_key_pem()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

    #[test]
    fn issued_certificates_carry_their_identity_and_chain_to_the_ca() {
        let ca = CertificateAuthority::generate("td", Duration::from_secs(3600)).unwrap();
        let id = Identity::agent("td", "classifier").unwrap();
        let issued = ca
            .issue(
                &id,
                &["agents.example".into(), "10.0.0.7".into()],
                Duration::from_secs(60),
            )
            .unwrap();
        let der = CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).unwrap();
        assert_eq!(crate::tls::identity_of(&der).unwrap(), id);
        let again = CertificateAuthority::from_pem(ca.cert_pem(), ca.key_pem()).unwrap();
        let other = again
            .issue(
                &Identity::service("td", "router").unwrap(),
                &[],
                Duration::from_secs(60),
            )
            .unwrap();
        assert!(other.cert_pem.contains("BEGIN CERTIFICATE"));
        assert!(
            ca.issue(&id, &["not a host".into()], Duration::from_secs(60))
                .is_err()
        );
    }

    #[test]
    fn token_keys_sign_tokens_their_public_half_verifies() {
        let (private, public) = token_signing_key().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jwt.pem");
        std::fs::write(&path, public).unwrap();
        let verifier =
            crate::token::TokenVerifier::load(&crate::token::JwtConfig::new(vec![path]), "td")
                .unwrap();
        let claims = crate::token::claims("alice", "reach", None, Duration::from_secs(60));
        let token = crate::token::sign(private.as_bytes(), &claims.into()).unwrap();
        let (identity, _) = verifier.verify(&token).unwrap();
        assert_eq!(identity.as_str(), "spiffe://td/user/alice");
        let expired = crate::token::claims("alice", "reach", None, Duration::ZERO);
        let mut expired = serde_json::Value::from(expired);
        expired["exp"] = 1.into();
        let token = crate::token::sign(private.as_bytes(), &expired).unwrap();
        assert!(
            verifier
                .verify(&token)
                .unwrap_err()
                .to_string()
                .contains("not valid")
        );
    }
}
