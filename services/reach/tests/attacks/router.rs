//! Attacks on the router's and orchestrator's internal RPCs (issue 33 item 3):
//! - forging the answer to another caller's call in flight (`RouterService.Reply`) as another
//!   agent, as a user, or by pretending to be a router replica forwarding it;
//! - making the router dial an address of the attacker's choice through `reply_to` (a request
//!   forgery path), or hand a reply to a mesh server that is not a router;
//! - planting ledger entries (`OrchestratorService.RecordMessages`, shown by `reach dump` as
//!   recorded by the router) as an agent or a user.
//!
//! Every attack below was accepted before the fix.

use std::time::Duration;

use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_sdk::HandlerContext;
use tokio::sync::mpsc;
use tonic::{Code, Request};

use crate::Check;
use crate::mesh::{self, TrustedMesh};

/// A reply to `correlation_id` carrying `text`, for the replica `reply_to`.
fn reply(correlation_id: &str, reply_to: &str, text: &str) -> pb::ReplyRequest {
    pb::ReplyRequest {
        message: Some(pb::ReachMessage {
            header: Some(pb::Header {
                message_id: uuid::Uuid::now_v7().to_string(),
                correlation_id: correlation_id.into(),
                ..Default::default()
            }),
            payload: Some(pb::Payload::text("echo.later", text)),
        }),
        reply_to: reply_to.into(),
    }
}

/// A batch of one ledger entry for task `task_id`, claiming to be the router's.
fn planted(task_id: &str) -> pb::RecordMessagesRequest {
    pb::RecordMessagesRequest {
        entries: vec![pb::LedgerEntry {
            header: Some(pb::Header {
                message_id: uuid::Uuid::now_v7().to_string(),
                task_id: task_id.into(),
                ..Default::default()
            }),
            payload_type: "approval.granted".into(),
            recorded_by: "router".into(),
            ..Default::default()
        }],
        dropped: 0,
    }
}

/// Runs this module's attacks against `mesh`, adding one [`Check`] per attack.
pub async fn run(mesh: &TrustedMesh, checks: &mut Vec<Check>) {
    // An instance of `echo` that answers `echo.later` asynchronously: it acknowledges at once
    // and hands the request to this test, which plays the agent's later Reply (or forges one).
    let (requests, mut delivered) = mpsc::unbounded_channel::<HandlerContext>();
    let (_agent, _) = mesh
        .start_agent("echo", "echo-later", move |runtime| {
            runtime.handle(
                "echo.later",
                "1.0.0",
                move |ctx: HandlerContext, _message: pb::ReachMessage| {
                    let requests = requests.clone();
                    async move {
                        let _ = requests.send(ctx);
                        Ok(HandlerContext::ack())
                    }
                },
            )
        })
        .await;

    // Alice calls echo.later and waits for its asynchronous reply.
    let mut alice = RouterServiceClient::new(
        mesh.channel_with_token(&mesh.router_url, &mesh.token("alice"))
            .await,
    );
    let waiting = tokio::spawn(async move {
        let mut message = mesh::message("echo.later", "what is the answer?");
        message.header.as_mut().unwrap().reply_to = "async".into();
        let mut request = Request::new(pb::CallRequest {
            message: Some(message),
        });
        request.set_timeout(Duration::from_secs(30));
        alice.call(request).await
    });
    let ctx = match tokio::time::timeout(Duration::from_secs(20), delivered.recv()).await {
        Ok(Some(ctx)) => ctx,
        _ => {
            checks.push(Check::new(
                "setup: alice's asynchronous call to echo.later reaches the agent",
                Err(format!(
                    "the call did not arrive; the router's log:\n{}",
                    mesh.log("router")
                )),
            ));
            return;
        }
    };
    let (id, reply_to) = (ctx.message_id.clone(), ctx.reply_to.clone());

    let mut alpha =
        RouterServiceClient::new(mesh.channel(&mesh.router_url, Some("agent-alpha")).await);
    let forged = alpha.reply(reply(&id, &reply_to, "forged by alpha")).await;
    checks.push(Check::new(
        "agent alpha answers alice's call in flight to echo (RouterService.Reply)",
        mesh::refused(forged, Code::PermissionDenied, "NOT_AUTHORIZED"),
    ));

    let mut bob = RouterServiceClient::new(
        mesh.channel_with_token(&mesh.router_url, &mesh.token("bob"))
            .await,
    );
    let forged = bob.reply(reply(&id, &reply_to, "forged by bob")).await;
    checks.push(Check::new(
        "user bob (bearer token) answers alice's call in flight",
        mesh::refused(forged, Code::PermissionDenied, "NOT_AUTHORIZED"),
    ));

    let mut pretending = Request::new(reply(&id, &reply_to, "forged, 'forwarded'"));
    pretending
        .metadata_mut()
        .insert(reach_router::FORWARDED_REPLY_METADATA, "1".parse().unwrap());
    pretending.metadata_mut().insert(
        reach_router::REPLIER_METADATA,
        format!("spiffe://{}/agent/echo", mesh::TD).parse().unwrap(),
    );
    let forged = alpha.reply(pretending).await;
    checks.push(Check::new(
        "agent alpha passes its answer off as a reply forwarded by a router replica for echo",
        mesh::refused(forged, Code::PermissionDenied, "NOT_AUTHORIZED"),
    ));

    let mut echo =
        RouterServiceClient::new(mesh.channel(&mesh.router_url, Some("agent-echo")).await);
    let forgery = echo
        .reply(reply(
            &id,
            "http://169.254.169.254:80/latest/meta-data/",
            "x",
        ))
        .await;
    checks.push(Check::new(
        "an agent makes the router dial an address of its choice through Reply's reply_to",
        mesh::refused(forgery, Code::PermissionDenied, "NOT_AUTHORIZED"),
    ));

    // The registry is a mesh server with a valid certificate, but not a router: the router
    // must not hand it the reply (it would have sent the request; the registry answered
    // UNIMPLEMENTED). Refused as unreachable, without saying which check failed.
    let registry_url = mesh.registry_url.replace("https://", "http://");
    let forgery = echo.reply(reply(&id, &registry_url, "x")).await;
    checks.push(Check::new(
        "an agent has the router forward a reply to a mesh server that is not a router (the registry)",
        mesh::refused(forgery, Code::Unavailable, "REPLY_PEER_UNAVAILABLE"),
    ));

    // Control: the agent the call was delivered to answers it, and alice gets that answer.
    let answered = echo.reply(reply(&id, &reply_to, "42")).await;
    let outcome = match answered {
        Ok(response) if response.get_ref().delivered => {
            match tokio::time::timeout(Duration::from_secs(10), waiting).await {
                Ok(Ok(Ok(response))) => {
                    let text = response
                        .into_inner()
                        .message
                        .and_then(|m| m.payload)
                        .and_then(|p| p.first_text().map(str::to_string));
                    if text.as_deref() == Some("42") {
                        Ok(())
                    } else {
                        Err(format!("alice got {text:?}"))
                    }
                }
                other => Err(format!("alice's call ended with {other:?}")),
            }
        }
        other => Err(format!("the agent's reply: {other:?}")),
    };
    checks.push(Check::new(
        "control: echo, the agent alice's call went to, replies and alice gets its answer",
        outcome,
    ));

    let mut alpha_orchestrator = OrchestratorServiceClient::new(
        mesh.channel(&mesh.orchestrator_url, Some("agent-alpha"))
            .await,
    );
    let planted_by_agent = alpha_orchestrator
        .record_messages(planted("task-of-alice"))
        .await;
    checks.push(Check::new(
        "agent alpha plants a ledger entry recorded_by=router (OrchestratorService.RecordMessages)",
        mesh::refused(planted_by_agent, Code::PermissionDenied, "NOT_AUTHORIZED"),
    ));
    let mut alice_orchestrator = OrchestratorServiceClient::new(
        mesh.channel_with_token(&mesh.orchestrator_url, &mesh.token("alice"))
            .await,
    );
    let planted_by_user = alice_orchestrator
        .record_messages(planted("task-of-bob"))
        .await;
    checks.push(Check::new(
        "user alice plants a ledger entry (RecordMessages with a bearer token)",
        mesh::refused(planted_by_user, Code::PermissionDenied, "NOT_AUTHORIZED"),
    ));
}
