//! Attacks on a mesh deployed with trust on, as `docs/security.md` describes for a shared
//! network: registry, router, orchestrator and edge as separate `reach` processes on
//! 127.0.0.1, certificates from `reach certs init`, JWT bearer tokens and a policy (see
//! [`mesh::POLICY`]). Each check is an attack by an outsider, by an agent exceeding its rights
//! or by a user, and passes when the mesh refuses it with the documented code and reason.
//!
//! Run it alone with `cargo test -p reach --test attacks`. It prints one line per attack and
//! ends with `attacks: N passed, M failed`.

mod agent;
mod http;
mod mesh;
mod registry;
mod router;
mod tasks;

use std::process::ExitCode;

use reach_proto::v1::CallRequest;
use reach_proto::v1::router_service_client::RouterServiceClient;
use tonic::Code;

use mesh::TrustedMesh;

/// One attack and how it ended: `Ok` when it was refused as documented, else what happened.
pub struct Check {
    /// The attack, in a few words.
    pub attack: String,
    /// `Ok` when it held; otherwise what went wrong.
    pub outcome: Result<(), String>,
}

impl Check {
    /// A check named `attack` with `outcome`.
    pub fn new(attack: impl Into<String>, outcome: Result<(), String>) -> Self {
        Self {
            attack: attack.into(),
            outcome,
        }
    }
}

fn main() -> ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (checks, logs) = runtime.block_on(async {
        let mesh = TrustedMesh::start().await;
        let mut checks = Vec::new();
        baseline(&mesh, &mut checks).await;
        agent::run(&mesh, &mut checks).await;
        registry::run(&mesh, &mut checks).await;
        router::run(&mesh, &mut checks).await;
        tasks::run(&mesh, &mut checks).await;
        http::run(&mesh, &mut checks).await;
        let logs =
            ["registry", "router", "orchestrator", "edge"].map(|name| (name, mesh.log(name)));
        (checks, logs)
    });
    let mut out = String::from("\nattacks on a mesh with trust on\n");
    for check in &checks {
        match &check.outcome {
            Ok(()) => out.push_str(&format!("  [held]   {}\n", check.attack)),
            Err(what) => out.push_str(&format!("  [FAILED] {}: {what}\n", check.attack)),
        }
    }
    let failed = checks.iter().filter(|c| c.outcome.is_err()).count();
    let passed = checks.len() - failed;
    out.push_str(&format!("attacks: {passed} passed, {failed} failed\n"));
    if failed > 0 {
        for (name, log) in logs {
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            out.push_str(&format!("\n--- the last lines of {name}'s log\n"));
            for line in tail.into_iter().rev() {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    print!("{out}");
    if failed == 0 && passed > 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// What the policy already held before these attacks were written: a call the policy does not
/// grant is refused at the router, and one it grants goes through.
async fn baseline(mesh: &TrustedMesh, checks: &mut Vec<Check>) {
    let mut mallory = RouterServiceClient::new(
        mesh.channel_with_token(&mesh.router_url, &mesh.token("mallory"))
            .await,
    );
    let refused = mallory
        .call(CallRequest {
            message: Some(mesh::message("echo.say", "hello")),
        })
        .await;
    checks.push(Check::new(
        "a user with no call rule calls echo.say through the router",
        mesh::refused(refused, Code::PermissionDenied, "NOT_AUTHORIZED"),
    ));
    let mut alice = RouterServiceClient::new(
        mesh.channel_with_token(&mesh.router_url, &mesh.token("alice"))
            .await,
    );
    let answered = alice
        .call(CallRequest {
            message: Some(mesh::message("echo.say", "hello")),
        })
        .await;
    checks.push(Check::new(
        "control: alice, granted echo.*, calls echo.say through the router",
        answered
            .map(|_| ())
            .map_err(|status| format!("refused: {status:?}")),
    ));
}
