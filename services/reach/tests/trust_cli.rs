//! The trust commands as a user runs them: `reach certs init` (files, modes, identities, a
//! re-run that keeps the CA, `--force`), `reach token` (tokens that verify), and `reach dev`
//! serving TLS with those files — the CLI connecting with an operator certificate, refused
//! without one, the example agents routed over mutual TLS — and the non-loopback rule.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use reach_trust::tls::{TlsConfig, TlsSource};
use reach_trust::token::{JoinGrant, JwtConfig, TokenVerifier};
use tokio::io::{AsyncBufReadExt, BufReader};

const TD: &str = "reach.test";

fn reach() -> Command {
    Command::new(env!("CARGO_BIN_EXE_reach"))
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn certs_init(dir: &Path, extra: &[&str]) -> std::process::Output {
    reach()
        .args(["certs", "init", "--dir"])
        .arg(dir)
        .args([
            "--trust-domain",
            TD,
            "--agents",
            "echo",
            "--operators",
            "ops",
        ])
        .args(extra)
        .output()
        .unwrap()
}

fn identity(dir: &Path, name: &str) -> String {
    let tls = TlsConfig::new(
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}-key.pem")),
        dir.join("ca.pem"),
    );
    TlsSource::load(&tls, TD)
        .unwrap()
        .identity()
        .unwrap()
        .to_string()
}

#[cfg(unix)]
fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn certs_init_makes_owner_only_keys_and_certificates_naming_each_identity() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("certs");
    let out = certs_init(&dir, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(printed.contains("[trust.tls]"), "{printed}");
    for (name, expected) in [
        ("registry", "spiffe://reach.test/registry"),
        ("router", "spiffe://reach.test/router"),
        ("orchestrator", "spiffe://reach.test/orchestrator"),
        ("agent-echo", "spiffe://reach.test/agent/echo"),
        ("operator-ops", "spiffe://reach.test/operator/ops"),
    ] {
        assert_eq!(identity(&dir, name), expected);
        #[cfg(unix)]
        assert_eq!(mode(&dir.join(format!("{name}-key.pem"))), 0o600, "{name}");
    }
    #[cfg(unix)]
    {
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("ca-key.pem")), 0o600);
        assert_eq!(mode(&dir.join("jwt-key.pem")), 0o600);
    }
    // Again without --force: the CA stays, a new agent is added.
    let ca = std::fs::read(dir.join("ca.pem")).unwrap();
    let out = reach()
        .args(["certs", "init", "--dir"])
        .arg(&dir)
        .args([
            "--trust-domain",
            TD,
            "--agents",
            "echo,other",
            "--operators",
            "ops",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read(dir.join("ca.pem")).unwrap(), ca);
    assert_eq!(
        identity(&dir, "agent-other"),
        "spiffe://reach.test/agent/other"
    );
    // --force: a new CA.
    let out = certs_init(&dir, &["--force"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_ne!(std::fs::read(dir.join("ca.pem")).unwrap(), ca);
}

#[test]
fn tokens_verify_against_the_public_key_and_carry_their_grant() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("certs");
    assert!(certs_init(&dir, &[]).status.success());
    let verifier =
        TokenVerifier::load(&JwtConfig::new(vec![dir.join("jwt-public.pem")]), TD).unwrap();
    let token = |args: &[&str]| {
        let out = reach()
            .args(["token"])
            .args(args)
            .arg("--key")
            .arg(dir.join("jwt-key.pem"))
            .args(["--trust-domain", TD])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };
    let (ok, stdout, stderr) = token(&["operator", "--name", "alice", "--ttl", "1h"]);
    assert!(ok, "{stderr}");
    let (id, _) = verifier.verify(stdout.trim()).unwrap();
    assert_eq!(id.as_str(), "spiffe://reach.test/operator/alice");
    let (ok, stdout, stderr) = token(&["join", "--service", "echo", "--ttl", "10m", "--one-time"]);
    assert!(ok, "{stderr}");
    let (id, claims) = verifier.verify(stdout.trim()).unwrap();
    assert!(id.path().starts_with("/join/"), "{id}");
    let grant = JoinGrant::of(&claims).unwrap().unwrap();
    assert_eq!(grant.services, ["echo"]);
    assert!(grant.one_time);
    let (ok, _, stderr) = token(&["operator", "--name", "alice", "--ttl", "0s"]);
    assert!(!ok);
    assert!(stderr.contains("ttl"), "{stderr}");
    // A person's token, for call and tasks rules that name users.
    let (ok, stdout, stderr) = token(&["user", "--name", "alice"]);
    assert!(ok, "{stderr}");
    let (id, _) = verifier.verify(stdout.trim()).unwrap();
    assert_eq!(id.as_str(), "spiffe://reach.test/user/alice");
    let (ok, _, stderr) = token(&["user", "--name", "a/b"]);
    assert!(!ok && stderr.contains("not a user name"), "{stderr}");
    // As docs/security.md writes it: no --ttl, a token for an hour.
    let (ok, stdout, stderr) = token(&["operator", "--name", "alice"]);
    assert!(ok, "{stderr}");
    let (_, claims) = verifier.verify(stdout.trim()).unwrap();
    assert_eq!(
        claims["exp"].as_u64().unwrap() - claims["iat"].as_u64().unwrap(),
        3600
    );
    let help = reach()
        .args(["token", "operator", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    let usage = help.lines().find(|l| l.starts_with("Usage:")).unwrap();
    assert_eq!(
        usage, "Usage: reach token operator [OPTIONS] --name <NAME>",
        "{help}"
    );
}

#[test]
fn a_service_refuses_a_non_loopback_listener_without_tls() {
    let out = reach()
        .args(["registry", "--listen", "0.0.0.0:0", "--admin-listen", ""])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("without TLS") && stderr.contains("--insecure"),
        "{stderr}"
    );
}

/// `reach dev` with TLS from `certs`, once it printed its `try:` line; its gRPC address.
async fn start_dev_with_tls(
    config: &Path,
    data: &Path,
) -> (tokio::process::Child, String, Vec<String>) {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_reach"))
        .args([
            "dev",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--edge-listen",
            "",
            "--config",
        ])
        .arg(config)
        .arg("--data-dir")
        .arg(data)
        .current_dir(repo_root())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut printed = Vec::new();
    let mut grpc = None;
    while let Ok(Some(line)) = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .unwrap()
    {
        if let Some(rest) = line.strip_prefix("grpc") {
            grpc = rest.split_whitespace().next().map(str::to_string);
        }
        let done = line.starts_with("try:");
        printed.push(line);
        if done {
            break;
        }
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (
        child,
        grpc.expect("reach dev printed its gRPC address"),
        printed,
    )
}

#[tokio::test]
async fn dev_serves_tls_and_the_cli_connects_with_an_operator_certificate() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("certs");
    let out = reach()
        .args(["certs", "init", "--dir"])
        .arg(&dir)
        .args(["--trust-domain", TD])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let config = root.path().join("reach.toml");
    std::fs::write(
        &config,
        format!(
            "[trust]\ntrust_domain = \"{TD}\"\n[trust.tls]\ncert = \"{0}/router.pem\"\nkey = \"{0}/router-key.pem\"\nca = \"{0}/ca.pem\"\n",
            dir.display()
        ),
    )
    .unwrap();
    let data = root.path().join("data");
    let (mut child, grpc, printed) = start_dev_with_tls(&config, &data).await;
    let banner = printed.join("\n");
    assert!(banner.contains("admin http   https://"), "{banner}");
    assert!(banner.contains("-cacert"), "the hint speaks TLS: {banner}");

    let cli = |with_certificate: bool, args: &[&str]| {
        let mut command = reach();
        command.args(args).args(["--endpoint", grpc.as_str()]);
        if with_certificate {
            command
                .env("REACH_TLS_CA", dir.join("ca.pem"))
                .env("REACH_TLS_CERT", dir.join("operator-admin.pem"))
                .env("REACH_TLS_KEY", dir.join("operator-admin-key.pem"))
                .env("REACH_TRUST_DOMAIN", TD);
        }
        command.output().unwrap()
    };
    // The example agents registered with their certificates and are READY (probed over TLS).
    let agents = cli(true, &["agents"]);
    let listed = String::from_utf8_lossy(&agents.stdout);
    assert!(
        agents.status.success(),
        "{}",
        String::from_utf8_lossy(&agents.stderr)
    );
    assert!(
        listed.contains("coordinator-1") && listed.contains("READY"),
        "{listed}"
    );
    // A call through the router to an agent, over mutual TLS on both hops.
    let call = cli(
        true,
        &[
            "call",
            "complaint.classify",
            "--json",
            r#"{"complaint_id": "1", "narrative": "late fee on my autopay"}"#,
        ],
    );
    assert!(
        call.status.success(),
        "{}",
        String::from_utf8_lossy(&call.stderr)
    );
    // Without credentials the CLI is refused, and told what to set.
    let refused = cli(false, &["agents"]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("REACH_TLS_CA"), "{stderr}");
    // The store directory is owner-only.
    #[cfg(unix)]
    assert_eq!(mode(&data), 0o700);
    child.kill().await.unwrap();
}
