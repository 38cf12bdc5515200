//! The PostgreSQL store over TLS: the test starts a PostgreSQL 15 of its own in a temporary
//! directory with `ssl=on` and a server certificate from a test CA (SANs `localhost` and
//! `127.0.0.1`), then opens the store with `sslmode=verify-full`: with the right CA it
//! connects (and the session is encrypted), with another CA it fails naming the certificate.
//!
//! Needs PostgreSQL 15's binaries (`scripts/start-postgres.sh` installs them); without them the
//! test is skipped loudly, and fails under CI=true.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use reach_orchestrator::store::{SqliteDurability, Store};
use reach_trust::Identity;
use reach_trust::issue::CertificateAuthority;

const BIN: &str = "/usr/lib/postgresql/15/bin";
const DAY: Duration = Duration::from_secs(86_400);

/// A PostgreSQL server in a temporary directory, stopped when dropped.
struct TlsPostgres {
    dir: tempfile::TempDir,
    port: u16,
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Runs `program ARGS` as the postgres user when this is root (initdb and the server refuse
/// root), panicking with its output when it fails.
fn as_postgres(program: &str, args: &[&str]) {
    let output = if is_root() {
        Command::new("runuser")
            .args(["-u", "postgres", "--", program])
            .args(args)
            .output()
    } else {
        Command::new(program).args(args).output()
    }
    .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(
        output.status.success(),
        "{program} {args:?}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

fn give_to_postgres(path: &Path) {
    if is_root() {
        let status = Command::new("chown")
            .args(["-R", "postgres"])
            .arg(path)
            .status()
            .unwrap();
        assert!(status.success(), "chown {}", path.display());
    }
}

impl TlsPostgres {
    /// Starts a server presenting `cert_pem` / `key_pem`; `None` (skipped) without PostgreSQL.
    fn start(cert_pem: &str, key_pem: &str) -> Option<Self> {
        if !Path::new(BIN).join("initdb").exists() {
            assert!(
                !std::env::var("CI").is_ok_and(|v| v == "true"),
                "PostgreSQL 15 is not installed but CI=true: run scripts/start-postgres.sh first"
            );
            eprintln!(
                "\n!!!!! SKIPPING PostgreSQL TLS test: {BIN}/initdb is missing (scripts/start-postgres.sh installs it) !!!!!\n"
            );
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        give_to_postgres(dir.path());
        let data = dir.path().join("data");
        let data_str = data.to_str().unwrap();
        as_postgres(
            &format!("{BIN}/initdb"),
            &["-D", data_str, "-A", "trust", "-U", "postgres", "-N"],
        );
        std::fs::write(data.join("server.crt"), cert_pem).unwrap();
        std::fs::write(data.join("server.key"), key_pem).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(
                data.join("server.key"),
                std::fs::Permissions::from_mode(0o600),
            )
            .unwrap();
        }
        give_to_postgres(&data);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {port} -k {} -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key -c fsync=off",
            dir.path().display()
        );
        let log = dir.path().join("log");
        as_postgres(
            &format!("{BIN}/pg_ctl"),
            &[
                "-D",
                data_str,
                "-o",
                &options,
                "-l",
                log.to_str().unwrap(),
                "-w",
                "start",
            ],
        );
        Some(Self { dir, port })
    }

    fn url(&self, ca: &Path) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={}",
            self.port,
            ca.display()
        )
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        let args = [
            "-D",
            data.to_str().unwrap(),
            "-m",
            "immediate",
            "-w",
            "stop",
        ];
        let _ = if is_root() {
            Command::new("runuser")
                .args(["-u", "postgres", "--", &format!("{BIN}/pg_ctl")])
                .args(args)
                .output()
        } else {
            Command::new(format!("{BIN}/pg_ctl")).args(args).output()
        };
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_reaches_postgres_over_verified_tls() {
    let ca = CertificateAuthority::generate("reach.test", DAY).unwrap();
    let server = ca
        .issue(
            &Identity::service("reach.test", "postgres").unwrap(),
            &[],
            DAY,
        )
        .unwrap();
    let Some(postgres) = TlsPostgres::start(&server.cert_pem, &server.key_pem) else {
        return;
    };
    let files = tempfile::tempdir().unwrap();
    let right_ca = write(files.path(), "ca.pem", ca.cert_pem());
    let other = CertificateAuthority::generate("reach.test", DAY).unwrap();
    let wrong_ca = write(files.path(), "other-ca.pem", other.cert_pem());

    // verify-full with the CA that issued the server's certificate: the store opens.
    let url = postgres.url(&right_ca);
    let store = Store::open(&url, SqliteDurability::Full)
        .await
        .expect("the store opens over verified TLS");
    assert_eq!(store.backend_name(), "postgres");
    store.close().await;
    // ... and the session is encrypted.
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    let (ssl,): (bool,) =
        sqlx::query_as("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert!(ssl, "the session is not encrypted");

    // verify-full with a CA that did not issue it: refused, naming the certificate.
    let error = match Store::open(&postgres.url(&wrong_ca), SqliteDurability::Full).await {
        Ok(_) => panic!("the store opened although the server's certificate is not trusted"),
        Err(error) => error.to_string(),
    };
    assert!(
        error.contains("TLS handshake with PostgreSQL")
            && error.contains("invalid peer certificate")
            && error.contains("sslrootcert"),
        "{error}"
    );
}
