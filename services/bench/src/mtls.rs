//! The router bench's mutual-TLS mesh: a development CA and a certificate per identity made
//! in a temporary directory, and the side-by-side table of plaintext and mTLS cells.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use reach_trust::issue::CertificateAuthority;
use reach_trust::tls::TlsConfig;
use reach_trust::{Identity, Trust, TrustConfig};

use crate::router::Cell;

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

/// The mTLS cells next to the plaintext ones of the same mode, payload and concurrency, with
/// the ratios mTLS / plaintext of throughput, p50 latency and CPU per request.
pub(crate) fn render_mtls(plaintext: &[Cell], mtls: &[Cell]) -> String {
    let mut out = String::from(
        "\nmutual TLS vs plaintext (every hop TLS 1.3 with client certificates, ECDSA P-256; callers authenticated by certificate, no policy file)\n",
    );
    let _ = writeln!(
        out,
        "{:<11} {:>8} {:>4} | {:>10} {:>10} {:>6} | {:>8} {:>8} {:>6} | {:>8} {:>8} {:>6}",
        "mode",
        "payload",
        "c",
        "rps plain",
        "rps mtls",
        "ratio",
        "p50 pl",
        "p50 mtls",
        "ratio",
        "cpu pl",
        "cpu mtls",
        "ratio"
    );
    for secured in mtls {
        let Some(plain) = plaintext.iter().find(|c| {
            c.mode == secured.mode
                && c.payload == secured.payload
                && c.concurrency == secured.concurrency
        }) else {
            continue;
        };
        let _ = writeln!(
            out,
            "{:<11} {:>8} {:>4} | {:>10.0} {:>10.0} {:>6.2} | {:>6.0}µs {:>6.0}µs {:>6.2} | {:>6.1}µs {:>6.1}µs {:>6.2}{}",
            secured.mode,
            secured.payload,
            secured.concurrency,
            plain.rps,
            secured.rps,
            secured.rps / plain.rps,
            plain.p50_us,
            secured.p50_us,
            secured.p50_us / plain.p50_us,
            plain.cpu_us,
            secured.cpu_us,
            secured.cpu_us / plain.cpu_us,
            if secured.errors > 0 {
                format!("  ({} errors)", secured.errors)
            } else {
                String::new()
            },
        );
    }
    out
}
