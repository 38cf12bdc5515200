//! Attacks on an agent's own port (issue 33 item 1): a holder of any certificate of the mesh CA
//! — another agent, an operator, the registry, the edge — dials agent `echo`'s endpoint (which
//! the registry lists to anyone) and calls it directly, skipping the router and its call
//! policy. An SDK agent serving TLS answers only router identities (and the registry's health
//! checks): every attack below is refused PERMISSION_DENIED / NOT_AUTHORIZED. Before the fix,
//! each was answered.

use reach_proto::v1 as pb;
use reach_proto::v1::agent_service_client::AgentServiceClient;
use tonic::Code;

use crate::Check;
use crate::mesh::{self, TrustedMesh};

/// The ErrorInfo reason of the refusals.
const NOT_AUTHORIZED: &str = "NOT_AUTHORIZED";

/// Runs this module's attacks against `mesh`, adding one [`Check`] per attack.
pub async fn run(mesh: &TrustedMesh, checks: &mut Vec<Check>) {
    let endpoint = mesh.echo_endpoint.clone();
    let handle = || pb::HandleRequest {
        message: Some(mesh::message("echo.say", "direct")),
    };
    for (certificate, who) in [
        ("agent-alpha", "agent alpha"),
        ("operator-admin", "the operator"),
        ("registry", "the registry"),
        ("edge", "the edge"),
    ] {
        let mut agent = AgentServiceClient::new(mesh.channel(&endpoint, Some(certificate)).await);
        checks.push(Check::new(
            format!("{who}'s certificate calls agent echo's Handle directly, skipping the router"),
            mesh::refused(
                agent.handle(handle()).await,
                Code::PermissionDenied,
                NOT_AUTHORIZED,
            ),
        ));
    }

    let channel = mesh.channel(&endpoint, Some("agent-alpha")).await;
    let mut agent = AgentServiceClient::new(channel);
    checks.push(Check::new(
        "agent alpha opens agent echo's HandleMux stream directly (the router's own path)",
        mesh::refused(
            agent
                .handle_mux(futures::stream::pending::<pb::HandleMuxRequest>())
                .await,
            Code::PermissionDenied,
            NOT_AUTHORIZED,
        ),
    ));
    checks.push(Check::new(
        "agent alpha opens a HandleStream to agent echo directly",
        mesh::refused(
            agent
                .handle_stream(futures::stream::iter([pb::HandleStreamRequest {
                    message: Some(mesh::message("echo.say", "direct")),
                }]))
                .await,
            Code::PermissionDenied,
            NOT_AUTHORIZED,
        ),
    ));
    // A forged x-reach-caller from a non-router is not even read: the call never gets in.
    let mut forged = tonic::Request::new(handle());
    forged.metadata_mut().insert(
        "x-reach-caller",
        "spiffe://reach.local/operator/admin".parse().unwrap(),
    );
    let mut agent = AgentServiceClient::new(mesh.channel(&endpoint, Some("agent-alpha")).await);
    checks.push(Check::new(
        "agent alpha calls agent echo directly claiming to act for the operator (x-reach-caller)",
        mesh::refused(
            agent.handle(forged).await,
            Code::PermissionDenied,
            NOT_AUTHORIZED,
        ),
    ));
}
