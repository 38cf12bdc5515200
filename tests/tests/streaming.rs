//! Bidirectional streams through the router: both directions, half-close, final status.

use std::time::Duration;

use futures::StreamExt;
use reach_proto::v1::{Payload, ReachMessage};
use reach_sdk::handler::InboundMessages;
use reach_sdk::{AgentRuntime, CallOptions, HandlerContext};
use reach_tests::Sandbox;
use tonic::{Code, Status};

fn text_of(message: Option<ReachMessage>) -> String {
    message
        .and_then(|m| m.payload)
        .and_then(|p| p.first_text().map(str::to_string))
        .unwrap_or_default()
}

/// Upper-cases every message; when the caller half-closes, sends `done:<count>` and ends OK.
/// On `fail-after-two` it sends two messages and then fails with ABORTED.
fn stream_agent(sandbox: &Sandbox) -> AgentRuntime {
    AgentRuntime::new(sandbox.agent_config("shouter", "shouter-1")).handle_stream(
        "shout",
        "1.0.0",
        |_ctx: HandlerContext, first: ReachMessage, rest: InboundMessages| {
            let first_text = text_of(Some(first));
            async_stream(first_text, rest)
        },
    )
}

fn async_stream(
    first: String,
    rest: InboundMessages,
) -> impl futures::Stream<Item = Result<Payload, Status>> + Send {
    if first == "fail-after-two" {
        return futures::stream::iter(vec![
            Ok(Payload::text("t", "one")),
            Ok(Payload::text("t", "two")),
            Err(Status::aborted("the agent gave up after two messages")),
        ])
        .boxed();
    }
    let head = futures::stream::once(async move { Ok::<_, Status>(first) });
    let all = head.chain(rest.map(|m| m.map(|m| text_of(Some(m)))));
    futures::stream::unfold(
        (all.boxed(), 0usize, false),
        |(mut all, count, done)| async move {
            if done {
                return None;
            }
            match all.next().await {
                Some(Ok(text)) => Some((
                    Ok(Payload::text("t", text.to_uppercase())),
                    (all, count + 1, false),
                )),
                Some(Err(status)) => Some((Err(status), (all, count, true))),
                None => Some((
                    Ok(Payload::text("t", format!("done:{count}"))),
                    (all, count, true),
                )),
            }
        },
    )
    .boxed()
}

#[tokio::test]
async fn messages_flow_both_ways_and_half_close_ends_the_stream_ok() {
    let sandbox = Sandbox::start().await;
    let _agent = sandbox.start_agent(stream_agent(&sandbox)).await;
    let mesh = sandbox.mesh().await;
    let options = CallOptions::default();
    let first = mesh.message_to_capability("shout", Payload::text("t", "a"), &options);
    let trace_id = first.header.as_ref().unwrap().trace_id.clone();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut replies = mesh
        .stream(first, tokio_stream_from(rx), Some(Duration::from_secs(10)))
        .await
        .unwrap();

    // Interleave: each reply arrives before the next message is sent.
    let echo = replies.message().await.unwrap().unwrap();
    assert_eq!(text_of(echo.message.clone()), "A");
    assert_eq!(
        echo.message.unwrap().header.unwrap().trace_id,
        trace_id,
        "the stream keeps its trace"
    );
    for text in ["b", "c"] {
        tx.send(mesh.message_to_capability("shout", Payload::text("t", text), &options))
            .await
            .unwrap();
        let echo = replies.message().await.unwrap().unwrap();
        assert_eq!(text_of(echo.message), text.to_uppercase());
    }
    drop(tx); // half-close
    let done = replies.message().await.unwrap().unwrap();
    assert_eq!(text_of(done.message), "done:3");
    assert!(
        replies.message().await.unwrap().is_none(),
        "then the stream ends with OK"
    );
    sandbox.stop().await;
}

#[tokio::test]
async fn an_error_after_two_messages_reaches_the_caller_as_that_status() {
    let sandbox = Sandbox::start().await;
    let _agent = sandbox.start_agent(stream_agent(&sandbox)).await;
    let mesh = sandbox.mesh().await;
    let first = mesh.message_to_capability(
        "shout",
        Payload::text("t", "fail-after-two"),
        &CallOptions::default(),
    );
    let mut replies = mesh
        .stream(first, futures::stream::pending(), None)
        .await
        .unwrap();
    assert_eq!(
        text_of(replies.message().await.unwrap().unwrap().message),
        "one"
    );
    assert_eq!(
        text_of(replies.message().await.unwrap().unwrap().message),
        "two"
    );
    let err = replies.message().await.unwrap_err();
    assert_eq!(err.code(), Code::Aborted);
    assert_eq!(err.message(), "the agent gave up after two messages");
    sandbox.stop().await;
}

#[tokio::test]
async fn a_stream_to_an_unknown_capability_is_refused() {
    let sandbox = Sandbox::start().await;
    let mesh = sandbox.mesh().await;
    let first =
        mesh.message_to_capability("nobody", Payload::text("t", "x"), &CallOptions::default());
    let err = mesh
        .stream(first, futures::stream::pending(), None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert_eq!(
        reach_rpc::errors::reason_of(&err).as_deref(),
        Some("ROUTE_NOT_FOUND")
    );
    sandbox.stop().await;
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<ReachMessage>,
) -> impl futures::Stream<Item = ReachMessage> + Send + 'static {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
