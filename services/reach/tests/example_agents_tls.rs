//! `reach example-agents` takes the mesh's TLS settings from the environment the helm chart
//! sets (`REACH_TLS_DIR`, `REACH_TRUST_DOMAIN`): with a directory that lacks the fleet's
//! certificates it stops at once, naming the missing file, instead of dialling the mesh in
//! plaintext.

use std::process::Command;
use std::time::Duration;

#[test]
fn example_agents_read_their_certificates_from_reach_tls_dir() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_reach"))
        .args(["example-agents", "--registry", "https://127.0.0.1:1"])
        .env("REACH_TLS_DIR", dir.path())
        .env("REACH_TRUST_DOMAIN", "mesh.example.com")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("reach example-agents kept running without its certificates");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    let missing = dir.path().join("agent-executor.servicing.pem");
    assert!(
        stderr.contains(&missing.display().to_string()) && stderr.contains("reach certs init"),
        "the error names the missing certificate and how to make it: {stderr}"
    );
}
