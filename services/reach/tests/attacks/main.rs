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
        answer_ahead(&mesh, &mut checks).await;
        probe_errors_stay_with_operators(&mesh, &mut checks).await;
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

/// An agent answers ahead of another principal: agent alpha (allowed to call `echo.*`) calls
/// echo with a message id it expects someone else's call to carry (the orchestrator derives a
/// node's message id from the task id), so that the agent's redelivery memory hands alpha's
/// answer to the later call instead of running the handler on its input. Outcomes are
/// remembered per verified caller, so alice's call with the same id runs the handler.
async fn answer_ahead(mesh: &TrustedMesh, checks: &mut Vec<Check>) {
    let message_id = uuid::Uuid::now_v7().to_string();
    let with_id = |text: &str| {
        let mut message = mesh::message("echo.say", text);
        if let Some(header) = message.header.as_mut() {
            header.message_id.clone_from(&message_id);
        }
        CallRequest {
            message: Some(message),
        }
    };
    let text_of = |response: reach_proto::v1::CallResponse| {
        response
            .message
            .and_then(|m| m.payload)
            .and_then(|p| p.first_text().map(str::to_string))
            .unwrap_or_default()
    };
    let mut alpha =
        RouterServiceClient::new(mesh.channel(&mesh.router_url, Some("agent-alpha")).await);
    let mut alice = RouterServiceClient::new(
        mesh.channel_with_token(&mesh.router_url, &mesh.token("alice"))
            .await,
    );
    let outcome = async {
        let planted = alpha
            .call(with_id("planted by alpha"))
            .await
            .map_err(|s| format!("alpha's own call failed: {s:?}"))?;
        if text_of(planted.into_inner()) != "planted by alpha" {
            return Err("alpha's own call did not echo".to_string());
        }
        let answered = alice
            .call(with_id("alice's input"))
            .await
            .map_err(|s| format!("alice's call failed: {s:?}"))?;
        match text_of(answered.into_inner()).as_str() {
            "alice's input" => Ok(()),
            other => Err(format!(
                "alice got {other:?}: alpha's answer was replayed to her"
            )),
        }
    };
    checks.push(Check::new(
        "agent alpha answers ahead of alice's call by reusing the message id it will carry",
        outcome.await,
    ));
}

/// A route's unroutable instances are named in the refusal its callers get; with trust on the
/// refusal must not carry the registry's health-probe error, which names what answered at the
/// registered endpoint (a refused port, another service's identity): read back by a
/// registrant, that is a port and identity scan of wherever the registry runs. Here agent echo
/// registers an instance of `echo.probe` at the registry's own port; alice, who may call `echo.*`,
/// calls it until the refusal says the probe has not passed.
async fn probe_errors_stay_with_operators(mesh: &TrustedMesh, checks: &mut Vec<Check>) {
    use reach_proto::v1 as pb;
    let mut echo = pb::registry_service_client::RegistryServiceClient::new(
        mesh.channel(&mesh.registry_url, Some("agent-echo")).await,
    );
    let registered = echo
        .register(pb::RegisterRequest {
            instance: Some(pb::InstanceSpec {
                service: "echo".into(),
                instance_id: "echo-probe-1".into(),
                endpoint: mesh.registry_url.clone(),
                capabilities: vec![pb::Capability {
                    name: "echo.probe".into(),
                    version: "1.0.0".into(),
                    ..Default::default()
                }],
                protocol_version: "1.0".into(),
                weight: 1,
                ..Default::default()
            }),
            lease_ttl: Some(reach_rpc::time::proto_duration(
                std::time::Duration::from_secs(60),
            )),
        })
        .await;
    if let Err(status) = registered {
        checks.push(Check::new(
            "the router's refusal keeps the registry's probe errors from callers",
            Err(format!(
                "agent echo could not register the probe target: {status:?}"
            )),
        ));
        return;
    }
    let mut alice = RouterServiceClient::new(
        mesh.channel_with_token(&mesh.router_url, &mesh.token("alice"))
            .await,
    );
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    let outcome = loop {
        let refused = alice
            .call(CallRequest {
                message: Some(mesh::message("echo.probe", "x")),
            })
            .await;
        match refused {
            Ok(_) => break Err("a call to an instance that fails its probe was answered".into()),
            Err(status) if status.message().contains("health probe") => {
                break if status.message().contains("spiffe://")
                    || status.message().contains("refused")
                {
                    Err(format!(
                        "the refusal carries the probe's error: {}",
                        status.message()
                    ))
                } else {
                    Ok(())
                };
            }
            Err(status) if tokio::time::Instant::now() >= deadline => {
                break Err(format!(
                    "the refusal never said the probe had not passed: {}",
                    status.message()
                ));
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
        }
    };
    checks.push(Check::new(
        "alice reads the registry's health-probe error of another's endpoint from a router refusal",
        outcome,
    ));
}
