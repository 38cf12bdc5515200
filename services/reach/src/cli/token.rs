//! `reach token join` and `reach token operator`: sign a bearer token (JWT) with the mesh's
//! token key (`certs/jwt-key.pem` from `reach certs init`).
//!
//! The token alone goes to stdout (`TOKEN=$(reach token join ...)`); notes go to stderr.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use reach_trust::Identity;
use reach_trust::token::{JoinGrant, claims, join_claims, sign};

use super::CliError;

/// The longest token lifetime accepted: one year.
pub const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// `reach token` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum TokenCommand {
    /// A join token: lets an agent without a certificate register as the given services.
    Join(JoinArgs),
    /// An operator's token (subject spiffe://TD/operator/NAME), for scripts and the CLI.
    Operator(OperatorArgs),
    /// A person's or a program's token (subject spiffe://TD/user/NAME): what the policy's
    /// `call` and `tasks` rules name for people, at the edges, the console and the CLI.
    User(UserArgs),
}

/// What every token command takes.
#[derive(Debug, Clone, Args)]
pub struct SigningArgs {
    /// The PEM private key to sign with (Ed25519, ECDSA P-256 or RSA).
    #[arg(long, default_value = "certs/jwt-key.pem")]
    pub key: PathBuf,
    /// How long the token is valid (`1h`, `30m`, `7days`): more than 0, at most a year.
    #[arg(long, value_parser = ttl, default_value = "1h")]
    pub ttl: Duration,
    /// The mesh's SPIFFE trust domain.
    #[arg(long, default_value = reach_trust::DEFAULT_TRUST_DOMAIN)]
    pub trust_domain: String,
    /// The token's `aud` (what `trust.jwt.audience` expects).
    #[arg(long, default_value = "reach")]
    pub audience: String,
    /// The token's `iss` (what `trust.jwt.issuer` expects, when set).
    #[arg(long)]
    pub issuer: Option<String>,
}

/// `reach token join` arguments.
#[derive(Debug, Clone, Args)]
pub struct JoinArgs {
    /// A service the bearer may register instances of (repeatable or comma separated; a glob
    /// such as `ingest-*` allowed).
    #[arg(long = "service", value_delimiter = ',', required = true)]
    pub services: Vec<String>,
    /// The token registers once only (the registry records its id as used).
    #[arg(long)]
    pub one_time: bool,
    /// The key, lifetime and audience.
    #[command(flatten)]
    pub signing: SigningArgs,
}

/// `reach token operator` arguments.
#[derive(Debug, Clone, Args)]
pub struct OperatorArgs {
    /// The operator's name: the token's subject is spiffe://TD/operator/NAME.
    #[arg(long)]
    pub name: String,
    /// The key, lifetime and audience.
    #[command(flatten)]
    pub signing: SigningArgs,
}

/// `reach token user` arguments.
#[derive(Debug, Clone, Args)]
pub struct UserArgs {
    /// The user's name: the token's subject is spiffe://TD/user/NAME.
    #[arg(long)]
    pub name: String,
    /// The key, lifetime and audience.
    #[command(flatten)]
    pub signing: SigningArgs,
}

/// Parses a token lifetime: more than 0, at most [`MAX_TTL`].
fn ttl(text: &str) -> Result<Duration, String> {
    let ttl = humantime::parse_duration(text)
        .map_err(|e| format!("{text:?} is not a duration ({e}); write it like 1h, 30m or 7days"))?;
    if ttl.is_zero() {
        return Err("a token must live for more than 0s".into());
    }
    if ttl > MAX_TTL {
        return Err(format!(
            "{text} is over the 1 year a token may live; issue shorter tokens and renew them"
        ));
    }
    Ok(ttl)
}

/// `reach token join | operator | user`: writes the signed token and a newline to `out`, a note of
/// what it grants and when it expires to `notes` (stderr).
///
/// # Errors
/// [`CliError::Usage`] for a bad name or service, a key that cannot be read or signs nothing.
pub fn token(
    command: TokenCommand,
    out: &mut dyn Write,
    notes: &mut dyn Write,
) -> Result<(), CliError> {
    let (signing, claims, note) = match command {
        TokenCommand::Join(args) => {
            let services: Vec<String> = args
                .services
                .iter()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect();
            if services.is_empty() {
                return Err(CliError::Usage(
                    "--service names no service; give one or more, such as --service classifier"
                        .into(),
                ));
            }
            for service in &services {
                // A glob is checked with its wildcards standing in for a name.
                let name = service.replace(['*', '?'], "x");
                Identity::agent(&args.signing.trust_domain, &name).map_err(|_| {
                    CliError::Usage(format!(
                        "--service {service:?} is not a service name: use letters, digits, '.', '-', '_' (and '*' for a glob)"
                    ))
                })?;
            }
            let grant = JoinGrant {
                services,
                one_time: args.one_time,
            };
            Identity::new(&args.signing.trust_domain, "/join")
                .map_err(|e| CliError::Usage(e.to_string()))?;
            let claims = join_claims(
                &args.signing.trust_domain,
                &grant,
                &args.signing.audience,
                args.signing.issuer.as_deref(),
                args.signing.ttl,
            );
            let note = format!(
                "join token {} for services {}{}",
                claims["sub"].as_str().unwrap_or_default(),
                grant.services.join(", "),
                if grant.one_time { " (one time)" } else { "" }
            );
            (args.signing, claims, note)
        }
        TokenCommand::Operator(args) => {
            let identity = Identity::operator(&args.signing.trust_domain, &args.name)
                .map_err(|e| CliError::Usage(format!("--name {:?}: {e}", args.name)))?;
            let claims = claims(
                identity.as_str(),
                &args.signing.audience,
                args.signing.issuer.as_deref(),
                args.signing.ttl,
            );
            (args.signing, claims, format!("operator token {identity}"))
        }
        TokenCommand::User(args) => {
            let identity =
                Identity::new(&args.signing.trust_domain, &format!("/user/{}", args.name))
                    .ok()
                    .filter(|_| !args.name.is_empty() && !args.name.contains('/'))
                    .ok_or_else(|| {
                        CliError::Usage(format!(
                            "--name {:?} is not a user name: use letters, digits, '.', '-', '_'",
                            args.name
                        ))
                    })?;
            let claims = claims(
                identity.as_str(),
                &args.signing.audience,
                args.signing.issuer.as_deref(),
                args.signing.ttl,
            );
            (args.signing, claims, format!("user token {identity}"))
        }
    };
    let key = std::fs::read(&signing.key).map_err(|e| {
        CliError::Usage(format!(
            "cannot read the signing key {}: {e}; make one with `reach certs init`",
            signing.key.display()
        ))
    })?;
    let token = sign(&key, &claims.into())
        .map_err(|e| CliError::Usage(format!("{}: {e}", signing.key.display())))?;
    writeln!(out, "{token}")?;
    // Notes are best effort: a closed stderr must not lose the token already printed.
    let _ = writeln!(
        notes,
        "{note}, audience {:?}, valid for {}",
        signing.audience,
        humantime::format_duration(signing.ttl)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_are_positive_and_at_most_a_year() {
        assert_eq!(ttl("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(ttl("365days").unwrap(), MAX_TTL);
        assert!(ttl("0s").unwrap_err().contains("more than 0s"));
        assert!(ttl("366days").unwrap_err().contains("1 year"));
        assert!(ttl("forever").unwrap_err().contains("not a duration"));
    }
}
