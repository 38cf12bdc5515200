//! The router bench's mutual-TLS mesh: a development CA and a certificate per identity made
//! in a temporary directory (the side-by-side table is [`crate::router`]'s).

use std::sync::Arc;
use std::time::Duration;

use reach_trust::issue::CertificateAuthority;
use reach_trust::tls::TlsConfig;
use reach_trust::{Identity, Trust, TrustConfig};

/// Certificates for the bench's processes, made at start in a temporary directory.
pub(crate) struct BenchPki {
    dir: tempfile::TempDir,
    ca: CertificateAuthority,
}

impl BenchPki {
    /// The bench mesh's trust domain.
    pub(crate) const TRUST_DOMAIN: &'static str = "bench.reach";

    /// A new CA (valid a day) in a new temporary directory.
    pub(crate) fn new() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let ca = CertificateAuthority::generate(Self::TRUST_DOMAIN, Duration::from_secs(86_400))?;
        std::fs::write(dir.path().join("ca.pem"), ca.cert_pem())?;
        Ok(Self { dir, ca })
    }

    /// Certificate files for `spiffe://bench.reach/<path>` (`router`, `agent/bench.echo`).
    pub(crate) fn tls(&self, path: &str) -> anyhow::Result<TlsConfig> {
        let identity = Identity::new(Self::TRUST_DOMAIN, &format!("/{path}"))?;
        let issued = self.ca.issue(&identity, &[], Duration::from_secs(86_400))?;
        let name = path.replace('/', "-");
        let (cert, key) = (
            self.dir.path().join(format!("{name}.pem")),
            self.dir.path().join(format!("{name}-key.pem")),
        );
        std::fs::write(&cert, issued.cert_pem)?;
        std::fs::write(&key, issued.key_pem)?;
        Ok(TlsConfig::new(cert, key, self.dir.path().join("ca.pem")))
    }

    /// The trust of a process with the identity `path` (see [`BenchPki::tls`]).
    pub(crate) fn trust(&self, path: &str) -> anyhow::Result<Arc<Trust>> {
        Ok(Trust::load(&TrustConfig {
            trust_domain: Self::TRUST_DOMAIN.into(),
            tls: Some(self.tls(path)?),
            ..TrustConfig::default()
        })?)
    }
}
