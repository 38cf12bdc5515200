//! `reach certs init` and `reach certs issue`: a development CA for a mesh, a certificate for
//! every Reach service, example agent and operator, and the token signing key.
//!
//! Files (all PEM, in `--dir`, default `certs/`, created 0700):
//! - `ca.pem` (the CA certificate, what every process trusts: `trust.tls.ca`) and
//!   `ca-key.pem` (its signing key);
//! - `registry.pem`, `router.pem`, `orchestrator.pem`, `agent-<service>.pem`,
//!   `operator-<name>.pem`, each with its `<name>-key.pem`;
//! - `jwt-key.pem` (signs tokens, `reach token`) and `jwt-public.pem` (verifies them:
//!   `trust.jwt.keys`).
//!
//! Private keys are created 0600, certificates and public keys 0644. Without `--force` nothing
//! is overwritten: an existing CA is reused and only missing certificates are issued, so
//! re-running with more `--agents` adds them.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Subcommand};
use reach_trust::Identity;
use reach_trust::issue::{CertificateAuthority, token_signing_key};

use super::CliError;
use crate::owner_only;

/// How long `reach certs init` makes the CA valid: 10 years.
pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// The default validity of issued certificates: 90 days.
pub const DEFAULT_VALIDITY: &str = "90days";

/// The CA certificate's file name.
pub const CA_CERT: &str = "ca.pem";
/// The CA key's file name.
pub const CA_KEY: &str = "ca-key.pem";
/// The token signing key's file name.
pub const JWT_KEY: &str = "jwt-key.pem";
/// The token verification key's file name.
pub const JWT_PUBLIC: &str = "jwt-public.pem";

/// `reach certs` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum CertsCommand {
    /// Make a CA (or reuse the one in --dir) and issue the mesh's certificates and token key.
    Init(InitArgs),
    /// Issue one more certificate from the CA in --dir.
    Issue(IssueArgs),
}

/// `reach certs init` arguments.
#[derive(Debug, Clone, Args)]
pub struct InitArgs {
    /// The directory to write to (created 0700 when missing).
    #[arg(long, default_value = "certs")]
    pub dir: PathBuf,
    /// The SPIFFE trust domain of the mesh.
    #[arg(long, default_value = reach_trust::DEFAULT_TRUST_DOMAIN)]
    pub trust_domain: String,
    /// The agent services to issue certificates for (spiffe://TD/agent/SERVICE), comma
    /// separated; default: the example agents' services.
    #[arg(long, value_delimiter = ',')]
    pub agents: Option<Vec<String>>,
    /// The operators to issue certificates for (spiffe://TD/operator/NAME), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "admin")]
    pub operators: Vec<String>,
    /// A further DNS name or IP address every certificate carries besides localhost and
    /// 127.0.0.1 (repeatable, or comma separated), such as a Kubernetes service name.
    #[arg(long = "host", value_delimiter = ',')]
    pub hosts: Vec<String>,
    /// How long the issued certificates are valid (the CA: 10 years).
    #[arg(long, default_value = DEFAULT_VALIDITY, value_parser = validity)]
    pub valid_for: Duration,
    /// Make a new CA and token key and reissue every certificate, replacing the files there.
    #[arg(long)]
    pub force: bool,
}

/// `reach certs issue` arguments.
#[derive(Debug, Clone, Args)]
pub struct IssueArgs {
    /// The directory holding the CA (ca.pem, ca-key.pem); the certificate is written there.
    #[arg(long, default_value = "certs")]
    pub dir: PathBuf,
    /// The certificate's SPIFFE ID, such as spiffe://reach.local/agent/billing.
    #[arg(long)]
    pub identity: String,
    /// A further DNS name or IP address (repeatable, or comma separated).
    #[arg(long = "host", value_delimiter = ',')]
    pub hosts: Vec<String>,
    /// The files' name: NAME.pem and NAME-key.pem.
    #[arg(long)]
    pub out: String,
    /// How long the certificate is valid.
    #[arg(long, default_value = DEFAULT_VALIDITY, value_parser = validity)]
    pub valid_for: Duration,
    /// Replace NAME.pem and NAME-key.pem when they exist.
    #[arg(long)]
    pub force: bool,
}

/// Parses a certificate validity (`90days`, `12h`): more than 0 and at most the CA's 10 years.
fn validity(text: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(text)
        .map_err(|e| format!("{text:?} is not a duration ({e}); write it like 90days or 12h"))?;
    if duration.is_zero() {
        return Err("a certificate must be valid for more than 0s".into());
    }
    if duration > CA_VALIDITY {
        return Err(format!(
            "{text} is longer than the CA's 10 years; certificates cannot outlive their CA"
        ));
    }
    Ok(duration)
}

/// The services of the example fleet (`reach dev`, `reach example-agents`): the executors of
/// every category, the coordinator and ingest.
pub fn example_agent_services() -> Vec<String> {
    reach_agents::classifier::Category::ALL
        .iter()
        .map(|category| format!("executor.{}", category.name()))
        .chain(["coordinator".to_string(), "ingest".to_string()])
        .collect()
}

/// `reach certs init | issue`, writing what it did and how to use it to `out`.
///
/// # Errors
/// [`CliError::Usage`] for a bad name, an existing CA of another trust domain, files that
/// would be overwritten (without `--force`); [`CliError::Io`] when a file cannot be read or
/// written.
pub fn certs(command: CertsCommand, out: &mut dyn Write) -> Result<(), CliError> {
    match command {
        CertsCommand::Init(args) => init(&args, out),
        CertsCommand::Issue(args) => issue(&args, out),
    }
}

/// One certificate `reach certs init` makes: its identity and the files' base name.
struct Planned {
    identity: Identity,
    name: String,
}

fn usage(message: impl Into<String>) -> CliError {
    CliError::Usage(message.into())
}

fn io_error(what: &str, path: &Path, error: std::io::Error) -> CliError {
    usage(format!("cannot {what} {}: {error}", path.display()))
}

fn plan(args: &InitArgs) -> Result<Vec<Planned>, CliError> {
    let td = &args.trust_domain;
    let bad = |e: reach_trust::identity::IdentityError| usage(e.to_string());
    let mut planned = Vec::new();
    for service in ["registry", "router", "orchestrator"] {
        planned.push(Planned {
            identity: Identity::service(td, service).map_err(bad)?,
            name: service.to_string(),
        });
    }
    let agents = args.agents.clone().unwrap_or_else(example_agent_services);
    for service in agents.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        planned.push(Planned {
            identity: Identity::agent(td, service).map_err(bad)?,
            name: format!("agent-{service}"),
        });
    }
    for name in args
        .operators
        .iter()
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
    {
        planned.push(Planned {
            identity: Identity::operator(td, name).map_err(bad)?,
            name: format!("operator-{name}"),
        });
    }
    Ok(planned)
}

/// Reads the CA in `dir`, checking it is a CA of `trust_domain` when one is given.
fn load_ca(dir: &Path, trust_domain: Option<&str>) -> Result<CertificateAuthority, CliError> {
    let cert_path = dir.join(CA_CERT);
    let key_path = dir.join(CA_KEY);
    let cert = std::fs::read_to_string(&cert_path)
        .map_err(|e| io_error("read the CA certificate", &cert_path, e))?;
    let key = std::fs::read_to_string(&key_path)
        .map_err(|e| io_error("read the CA key", &key_path, e))?;
    let ca = CertificateAuthority::from_pem(&cert, &key).map_err(|e| {
        usage(format!(
            "{} and {} are not a CA certificate and its key: {e}",
            cert_path.display(),
            key_path.display()
        ))
    })?;
    let domain = ca_trust_domain(&cert).map_err(|reason| {
        usage(format!(
            "{} is not a Reach CA ({reason}); make one with `reach certs init --force`",
            cert_path.display()
        ))
    })?;
    if let Some(wanted) = trust_domain
        && wanted != domain
    {
        return Err(usage(format!(
            "the CA in {} is for trust domain {domain:?}, not {wanted:?}; pass --trust-domain {domain}, \
             or --force to replace the CA and every certificate",
            dir.display()
        )));
    }
    Ok(ca)
}

/// The trust domain a CA certificate names (its URI SAN `spiffe://<domain>`).
fn ca_trust_domain(cert_pem: &str) -> Result<String, String> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject as _;
    let der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
        .map_err(|e| format!("no PEM certificate: {e}"))?;
    let identity = reach_trust::tls::identity_of(&der)?;
    Ok(identity.trust_domain().to_string())
}

/// Writes a certificate and its key as `<name>.pem` and `<name>-key.pem`.
fn write_issued(
    dir: &Path,
    name: &str,
    issued: &reach_trust::issue::Issued,
) -> Result<(), CliError> {
    let key = dir.join(format!("{name}-key.pem"));
    owner_only::write(&key, issued.key_pem.as_bytes(), owner_only::FILE_MODE)
        .map_err(|e| io_error("write", &key, e))?;
    let cert = dir.join(format!("{name}.pem"));
    owner_only::write(
        &cert,
        issued.cert_pem.as_bytes(),
        owner_only::PUBLIC_FILE_MODE,
    )
    .map_err(|e| io_error("write", &cert, e))
}

fn state(made: bool) -> &'static str {
    if made { "new" } else { "kept" }
}

fn init(args: &InitArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let planned = plan(args)?;
    let dir = args.dir.as_path();
    if dir.exists() && !dir.is_dir() {
        return Err(usage(format!("--dir {} is not a directory", dir.display())));
    }
    let created =
        owner_only::create_dir(dir).map_err(|e| io_error("create the directory", dir, e))?;
    if !created && owner_only::is_shared(dir) {
        eprintln!(
            "warning: {} is readable by other users; the keys in it are not (0600), but consider chmod 700",
            dir.display()
        );
    }
    let (ca_cert, ca_key) = (dir.join(CA_CERT), dir.join(CA_KEY));
    let reuse = !args.force && (ca_cert.exists() || ca_key.exists());
    let ca = if reuse {
        if !(ca_cert.exists() && ca_key.exists()) {
            let (there, missing) = if ca_cert.exists() {
                (&ca_cert, &ca_key)
            } else {
                (&ca_key, &ca_cert)
            };
            return Err(usage(format!(
                "{} exists but {} does not; restore it, or pass --force to make a new CA and reissue every certificate",
                there.display(),
                missing.display()
            )));
        }
        load_ca(dir, Some(&args.trust_domain))?
    } else {
        let ca = CertificateAuthority::generate(&args.trust_domain, CA_VALIDITY)
            .map_err(|e| usage(e.to_string()))?;
        owner_only::write(&ca_key, ca.key_pem().as_bytes(), owner_only::FILE_MODE)
            .map_err(|e| io_error("write", &ca_key, e))?;
        owner_only::write(
            &ca_cert,
            ca.cert_pem().as_bytes(),
            owner_only::PUBLIC_FILE_MODE,
        )
        .map_err(|e| io_error("write", &ca_cert, e))?;
        ca
    };

    let (jwt_key, jwt_public) = (dir.join(JWT_KEY), dir.join(JWT_PUBLIC));
    let jwt_made = match (args.force, jwt_key.exists(), jwt_public.exists()) {
        (false, true, true) => false,
        (false, true, false) | (false, false, true) => {
            return Err(usage(format!(
                "only one of {} and {} exists; restore the other, or pass --force to make a new token key (tokens signed with the old one stop verifying)",
                jwt_key.display(),
                jwt_public.display()
            )));
        }
        _ => {
            let (private, public) = token_signing_key().map_err(|e| usage(e.to_string()))?;
            owner_only::write(&jwt_key, private.as_bytes(), owner_only::FILE_MODE)
                .map_err(|e| io_error("write", &jwt_key, e))?;
            owner_only::write(&jwt_public, public.as_bytes(), owner_only::PUBLIC_FILE_MODE)
                .map_err(|e| io_error("write", &jwt_public, e))?;
            true
        }
    };

    let mut rows = Vec::new();
    for Planned { identity, name } in &planned {
        let cert = dir.join(format!("{name}.pem"));
        let key = dir.join(format!("{name}-key.pem"));
        let made = args.force || !(cert.exists() && key.exists());
        if made {
            let issued = ca
                .issue(identity, &args.hosts, args.valid_for)
                .map_err(|e| usage(format!("cannot issue {identity}: {e}")))?;
            write_issued(dir, name, &issued)?;
        }
        rows.push((format!("{name}.pem"), identity.to_string(), made));
    }

    let d = dir.display();
    let ca_state = if reuse { "kept" } else { "new" };
    writeln!(
        out,
        "certificates in {d} (trust domain {})",
        args.trust_domain
    )?;
    writeln!(
        out,
        "  {:<32} {ca_state:<4}  the CA: every process's trust.tls.ca",
        CA_CERT
    )?;
    writeln!(
        out,
        "  {:<32} {ca_state:<4}  the CA's signing key: keep it off the machines that run the mesh",
        CA_KEY
    )?;
    for (file, identity, made) in &rows {
        writeln!(out, "  {file:<32} {:<4}  {identity}", state(*made))?;
    }
    writeln!(
        out,
        "  {:<32} {:<4}  signs tokens (reach token join | operator); keep it with the CA key",
        JWT_KEY,
        state(jwt_made)
    )?;
    writeln!(
        out,
        "  {:<32} {:<4}  verifies tokens: trust.jwt.keys",
        JWT_PUBLIC,
        state(jwt_made)
    )?;
    writeln!(
        out,
        "each certificate's key is beside it as NAME-key.pem (0600); valid for {}, also for localhost, 127.0.0.1{}",
        humantime::format_duration(args.valid_for),
        args.hosts
            .iter()
            .map(|h| format!(", {h}"))
            .collect::<String>()
    )?;
    if reuse && rows.iter().any(|(_, _, made)| !made) {
        writeln!(
            out,
            "kept files were left as they were; --force makes a new CA and reissues everything"
        )?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "how to use: give each process its own certificate; for the router, in its reach.toml:"
    )?;
    writeln!(out)?;
    writeln!(out, "[trust]")?;
    writeln!(out, "trust_domain = {:?}", args.trust_domain)?;
    writeln!(out, "[trust.tls]")?;
    writeln!(out, "cert = \"{d}/router.pem\"")?;
    writeln!(out, "key = \"{d}/router-key.pem\"")?;
    writeln!(out, "ca = \"{d}/{CA_CERT}\"")?;
    writeln!(out, "[trust.jwt]")?;
    writeln!(out, "keys = [\"{d}/{JWT_PUBLIC}\"]")?;
    writeln!(out)?;
    writeln!(out, "or in its environment:")?;
    writeln!(out)?;
    writeln!(out, "REACH_TRUST__TRUST_DOMAIN={}", args.trust_domain)?;
    writeln!(out, "REACH_TRUST__TLS__CERT={d}/router.pem")?;
    writeln!(out, "REACH_TRUST__TLS__KEY={d}/router-key.pem")?;
    writeln!(out, "REACH_TRUST__TLS__CA={d}/{CA_CERT}")?;
    writeln!(out, "REACH_TRUST__JWT__KEYS='[\"{d}/{JWT_PUBLIC}\"]'")?;
    writeln!(out)?;
    writeln!(
        out,
        "join tokens for agents without a certificate: reach token join --key {d}/{JWT_KEY} --service NAME --ttl 1h"
    )?;
    Ok(())
}

/// Whether `name` is a file base name `reach certs issue` writes: letters, digits, `.`, `-`
/// and `_`, not starting with `.`.
fn file_name_ok(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
}

fn issue(args: &IssueArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let identity = Identity::parse(&args.identity).map_err(|e| usage(e.to_string()))?;
    let name = args.out.strip_suffix(".pem").unwrap_or(&args.out);
    if !file_name_ok(name) {
        return Err(usage(format!(
            "--out {:?} is not a file name: use letters, digits, '.', '-' or '_' (the files are NAME.pem and NAME-key.pem in --dir)",
            args.out
        )));
    }
    let dir = args.dir.as_path();
    if !(dir.join(CA_CERT).exists() && dir.join(CA_KEY).exists()) {
        return Err(usage(format!(
            "no CA in {} ({CA_CERT} and {CA_KEY}); make one with `reach certs init --dir {}`",
            dir.display(),
            dir.display()
        )));
    }
    let ca = load_ca(dir, Some(identity.trust_domain()))?;
    let cert = dir.join(format!("{name}.pem"));
    let key = dir.join(format!("{name}-key.pem"));
    if !args.force
        && let Some(existing) = [&cert, &key].into_iter().find(|p| p.exists())
    {
        return Err(usage(format!(
            "{} exists; pass --force to replace it, or choose another --out",
            existing.display()
        )));
    }
    let issued = ca
        .issue(&identity, &args.hosts, args.valid_for)
        .map_err(|e| usage(format!("cannot issue {identity}: {e}")))?;
    write_issued(dir, name, &issued)?;
    writeln!(
        out,
        "{} and {} ({identity}, valid for {})",
        cert.display(),
        key.display(),
        humantime::format_duration(args.valid_for)
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validity_is_positive_and_within_the_ca() {
        assert_eq!(validity("90days").unwrap(), Duration::from_secs(90 * 86400));
        assert!(validity("0s").unwrap_err().contains("more than 0s"));
        assert!(validity("11years").unwrap_err().contains("10 years"));
        assert!(validity("soon").unwrap_err().contains("not a duration"));
    }

    #[test]
    fn the_example_agents_have_a_certificate_each() {
        let services = example_agent_services();
        assert!(services.contains(&"coordinator".to_string()));
        assert!(services.contains(&"ingest".to_string()));
        assert!(services.contains(&"executor.servicing".to_string()));
        for service in &services {
            Identity::agent("reach.local", service).unwrap();
        }
    }

    #[test]
    fn out_names_stay_in_the_directory() {
        for bad in ["", "../x", "a/b", ".hidden", "a b"] {
            assert!(!file_name_ok(bad), "{bad}");
        }
        assert!(file_name_ok("agent-billing"));
    }
}
