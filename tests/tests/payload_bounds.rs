//! Data nesting and size bounds that protect the multiplexed streams calls share: data nesting
//! deeper than `MAX_DATA_DEPTH` is refused at the edge (client and router) and never sent in an
//! agent's reply, and an oversized message fails alone — other calls on the same client's
//! CallMux stream and the same instance's HandleMux stream go on.

use std::sync::Arc;
use std::time::Duration;

use reach_proto::json::MAX_DATA_DEPTH;
use reach_proto::v1::{CallRequest, Header, Payload, ReachMessage, header};
use reach_rpc::errors::{metadata_of, reason_of};
use reach_sdk::{AgentRuntime, CallOptions, HandlerContext};
use reach_tests::Sandbox;
use tokio::sync::Notify;
use tonic::Code;

/// `1` inside `depth` nested lists.
fn nested(depth: usize) -> serde_json::Value {
    let mut value = serde_json::json!(1);
    for _ in 0..depth {
        value = serde_json::Value::Array(vec![value]);
    }
    value
}

/// `1` inside `depth` nested objects (`{"k": {"k": … 1}}`): an object level costs protobuf
/// one more message level than a list level (the map entry).
fn nested_objects(depth: usize) -> serde_json::Value {
    let mut value = serde_json::json!(1);
    for _ in 0..depth {
        value = serde_json::json!({ "k": value });
    }
    value
}

/// An agent whose `deep.echo` answers with the request's payload, `deep.reply` with data 40
/// levels deep, and `deep.slow` once `release` is notified.
fn agent(sandbox: &Sandbox, release: Arc<Notify>) -> AgentRuntime {
    AgentRuntime::new(sandbox.agent_config("deep", "deep-1"))
        .handle(
            "deep.echo",
            "1.0.0",
            |_ctx: HandlerContext, m: ReachMessage| async move { Ok(m.payload.unwrap_or_default()) },
        )
        .handle(
            "deep.reply",
            "1.0.0",
            |_ctx: HandlerContext, _m: ReachMessage| async move {
                Ok(Payload::json("t", &nested(40)))
            },
        )
        .handle("deep.slow", "1.0.0", move |_ctx: HandlerContext, _m| {
            let release = release.clone();
            async move {
                release.notified().await;
                Ok(Payload::text("t", "slow done"))
            }
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_data_is_refused_at_the_edge_and_in_replies_without_breaking_shared_streams() {
    let sandbox = Sandbox::start().await;
    let release = Arc::new(Notify::new());
    let _agent = sandbox.start_agent(agent(&sandbox, release.clone())).await;
    let mesh = sandbox.mesh().await;
    // A call that stays open on both shared streams throughout.
    let slow = {
        let mesh = mesh.clone();
        tokio::spawn(async move {
            mesh.call("deep.slow", Payload::text("t", "x"), CallOptions::default())
                .await
        })
    };

    // At the limit, in lists and in objects: delivered over both multiplexed streams, and
    // answered intact.
    for at_limit in [nested(MAX_DATA_DEPTH), nested_objects(MAX_DATA_DEPTH)] {
        let reply = mesh
            .call(
                "deep.echo",
                Payload::json("t", &at_limit),
                CallOptions::default(),
            )
            .await
            .unwrap();
        let echoed = reply.message.unwrap().payload.unwrap().parts[0]
            .as_json()
            .unwrap();
        assert_eq!(echoed, at_limit);
    }

    // One level deeper: the client refuses it without sending.
    let err = mesh
        .call(
            "deep.echo",
            Payload::json("t", &nested(MAX_DATA_DEPTH + 1)),
            CallOptions::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert_eq!(reason_of(&err).as_deref(), Some("INVALID_PAYLOAD"));

    // Sent anyway (a raw gRPC client): the router refuses it, naming the part and depth.
    let mut router = sandbox.router_client().await;
    let deep = ReachMessage {
        header: Some(Header {
            target: Some(header::Target::Capability("deep.echo".into())),
            ..Header::default()
        }),
        payload: Some(Payload::json("t", &nested(45))),
    };
    let err = router
        .call(CallRequest {
            message: Some(deep),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert_eq!(reason_of(&err).as_deref(), Some("INVALID_PAYLOAD"));
    assert_eq!(metadata_of(&err)["depth"], "45");
    assert!(
        err.message()
            .contains("payload.parts[0] nests 45 levels deep, over the limit of 31"),
        "{}",
        err.message()
    );

    // A handler's reply that deep is not sent: that call fails INTERNAL, the stream lives.
    let err = mesh
        .call(
            "deep.reply",
            Payload::text("t", "x"),
            CallOptions::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Internal, "{err:?}");
    assert!(
        err.message().contains("nests 40 levels deep"),
        "{}",
        err.message()
    );

    // A message over the router's transport limit on CallMux: refused alone.
    let big = "x".repeat(9 << 20);
    let err = mesh
        .call("deep.echo", Payload::text("t", big), CallOptions::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert_eq!(reason_of(&err).as_deref(), Some("PAYLOAD_TOO_LARGE"));

    // The call that was open all along completes, on the stream that carried it.
    release.notify_one();
    let done = tokio::time::timeout(Duration::from_secs(5), slow)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        done.message.unwrap().payload.unwrap().first_text(),
        Some("slow done")
    );
    assert_eq!(
        mesh.mux_streams_opened(),
        1,
        "the client's stream never broke"
    );
    sandbox.stop().await;
}
