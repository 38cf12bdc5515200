//! Multiplexed calls (`RouterService.CallMux`, `AgentService.HandleMux`): many calls on one
//! stream per hop, replies matched to their calls in completion order, per-call deadlines,
//! cancellation and errors, the unary fallback for agents without the stream, and a drain
//! under load that loses no call.

mod common;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use futures::Stream;
use prost::Message as _;
use reach_proto::v1::agent_service_server::AgentService;
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{
    CallFrame, CallMuxRequest, CallMuxResponse, CallRequest, HandleMuxRequest, HandleMuxResponse,
    HandleRequest, HandleResponse, HandleStreamRequest, HandleStreamResponse, Header, Payload,
    ReachMessage, header, reply_frame,
};
use reach_router::RouterConfig;
use reach_sdk::{AgentRuntime, CallOptions, HandlerContext};
use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status, Streaming};

/// An agent serving `fast` (echo), `slow` (echo after 300 ms) and `hang` (waits until
/// cancelled, then notifies `cancelled`).
fn mixed_agent(config: reach_sdk::AgentConfig, cancelled: Arc<Notify>) -> AgentRuntime {
    AgentRuntime::new(config)
        .handle(
            "fast",
            "1.0.0",
            |_c: HandlerContext, m: ReachMessage| async move { Ok(m.payload.unwrap_or_default()) },
        )
        .handle(
            "slow",
            "1.0.0",
            |_c: HandlerContext, m: ReachMessage| async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok(m.payload.unwrap_or_default())
            },
        )
        .handle(
            "small",
            "1.0.0",
            |_c: HandlerContext, _m: ReachMessage| async move { Ok(Payload::text("t", "ok")) },
        )
        .handle(
            "hang",
            "1.0.0",
            move |c: HandlerContext, _m: ReachMessage| {
                let cancelled = cancelled.clone();
                async move {
                    c.cancellation.cancelled().await;
                    cancelled.notify_one();
                    Err(Status::cancelled("cancelled"))
                }
            },
        )
}

async fn next(replies: &mut Streaming<CallMuxResponse>) -> CallMuxResponse {
    tokio::time::timeout(Duration::from_secs(5), replies.message())
        .await
        .expect("a reply within 5 s")
        .expect("the stream stays healthy")
        .expect("a reply frame")
}

/// A `CallMux` stream to the router at `url` from a generated client, as any language would
/// open it: the frame sender and the reply stream.
async fn open_call_mux(url: &str) -> (mpsc::Sender<CallMuxRequest>, Streaming<CallMuxResponse>) {
    let mut client = RouterServiceClient::connect(url.to_string()).await.unwrap();
    let (frames, frames_rx) = mpsc::channel(16);
    let replies = client
        .call_mux(ReceiverStream::new(frames_rx))
        .await
        .unwrap()
        .into_inner();
    (frames, replies)
}

fn call_frame(call_id: u64, capability: &str, text: &str, timeout_ms: u32) -> CallMuxRequest {
    CallMuxRequest {
        frame: Some(CallFrame {
            call_id,
            message: Some(ReachMessage {
                header: Some(Header {
                    target: Some(header::Target::Capability(capability.into())),
                    ..Header::default()
                }),
                payload: Some(Payload::text("t", text)),
            }),
            timeout_ms,
            ..CallFrame::default()
        }),
    }
}

/// A frame cancelling call `call_id`.
fn cancel_frame(call_id: u64) -> CallMuxRequest {
    CallMuxRequest {
        frame: Some(CallFrame {
            call_id,
            cancel: true,
            ..CallFrame::default()
        }),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_share_one_stream_per_hop_and_each_gets_its_own_reply() {
    let registry = registry().await;
    let (_agent, _) = agent(
        AgentRuntime::new(config("echo", "echo-1", &registry.url).with_max_concurrency(256))
            .handle(
                "echo",
                "1.0.0",
                |_c: HandlerContext, m: ReachMessage| async move {
                    let text = m
                        .payload
                        .as_ref()
                        .and_then(|p| p.first_text())
                        .unwrap_or_default()
                        .to_string();
                    // Later calls finish first, so replies come back out of order.
                    let n: u64 = text.parse().unwrap_or(0);
                    tokio::time::sleep(Duration::from_millis(200 - n)).await;
                    Ok(Payload::text("echo", text))
                },
            ),
    )
    .await;
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;
    let client = router.client().await;

    let calls = (0..200u64).map(|n| {
        let client = client.clone();
        async move {
            let reply = client
                .call(
                    "echo",
                    Payload::text("t", n.to_string()),
                    CallOptions::default(),
                )
                .await
                .expect("call");
            let text = reply
                .message
                .and_then(|m| m.payload)
                .and_then(|p| p.first_text().map(str::to_string));
            (n, text, reply.route.map(|r| r.instance_id))
        }
    });
    for (n, text, instance) in futures::future::join_all(calls).await {
        assert_eq!(text.as_deref(), Some(n.to_string().as_str()));
        assert_eq!(instance.as_deref(), Some("echo-1"));
    }
    assert_eq!(
        client.mux_streams_opened(),
        1,
        "caller → router: one stream"
    );
    let endpoint = router.router.table().endpoint("echo-1").unwrap();
    assert_eq!(
        endpoint.link().streams_opened(),
        1,
        "router → instance: one stream"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_mux_stream_answers_in_completion_order_with_deadlines_errors_and_cancels() {
    let registry = registry().await;
    let cancelled = Arc::new(Notify::new());
    let (_agent, _) = agent(mixed_agent(
        config("mixed", "mixed-1", &registry.url),
        cancelled.clone(),
    ))
    .await;
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;

    // A generated client, as any language would use it.
    let (frames, mut replies) = open_call_mux(&router.url).await;
    frames.send(call_frame(1, "slow", "one", 0)).await.unwrap();
    frames.send(call_frame(2, "fast", "two", 0)).await.unwrap();
    frames
        .send(call_frame(3, "nope", "three", 0))
        .await
        .unwrap();
    frames
        .send(call_frame(4, "slow", "four", 50))
        .await
        .unwrap();
    frames.send(call_frame(5, "hang", "five", 0)).await.unwrap();

    let mut order = Vec::new();
    // fast (2), unknown (3) and the expired one (4) come back before slow (1).
    for _ in 0..3 {
        let reply = next(&mut replies).await;
        let frame = reply.frame.unwrap();
        order.push(frame.call_id);
        match frame.call_id {
            2 => {
                let Some(reply_frame::Result::Reply(message)) = frame.result else {
                    panic!("call 2 failed: {frame:?}");
                };
                assert_eq!(message.payload.unwrap().first_text(), Some("two"));
                let route = reply.route.expect("a successful call names its route");
                assert_eq!(route.instance_id, "mixed-1");
                assert!(!route.trace_id.is_empty());
            }
            3 => {
                let Some(reply_frame::Result::Error(error)) = frame.result else {
                    panic!("call 3 should fail: {frame:?}");
                };
                let status = reach_rpc::mux::status_of(error);
                assert_eq!(status.code(), Code::NotFound, "{status:?}");
                assert_eq!(
                    reason(&status),
                    "ROUTE_NOT_FOUND",
                    "details survive the frame"
                );
                assert!(status.message().contains("nope"), "{status:?}");
            }
            4 => {
                let Some(reply_frame::Result::Error(error)) = frame.result else {
                    panic!("call 4 should time out: {frame:?}");
                };
                assert_eq!(error.code, Code::DeadlineExceeded as i32, "{error:?}");
            }
            other => panic!("unexpected early reply to call {other}"),
        }
    }
    order.sort_unstable();
    assert_eq!(order, vec![2, 3, 4]);

    // Cancelling call 5 reaches the agent's handler; once the call has stopped, the cancel is
    // acknowledged with CANCELLED.
    frames.send(cancel_frame(5)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), cancelled.notified())
        .await
        .expect("the handler of call 5 was cancelled");

    let mut rest = Vec::new();
    for _ in 0..2 {
        let frame = next(&mut replies).await.frame.unwrap();
        match frame.call_id {
            1 => assert!(matches!(frame.result, Some(reply_frame::Result::Reply(_)))),
            5 => {
                let Some(reply_frame::Result::Error(error)) = frame.result else {
                    panic!("call 5's cancel is acknowledged with an error: {frame:?}");
                };
                assert_eq!(error.code, Code::Cancelled as i32, "{error:?}");
            }
            other => panic!("unexpected reply to call {other}"),
        }
        rest.push(frame.call_id);
    }
    rest.sort_unstable();
    assert_eq!(rest, vec![1, 5]);

    // Half-close: the stream ends cleanly.
    drop(frames);
    let end = tokio::time::timeout(Duration::from_secs(5), replies.message())
        .await
        .expect("the stream ends");
    assert!(matches!(end, Ok(None)), "{end:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_over_the_size_limit_fails_only_its_call() {
    let registry = registry().await;
    // The agent's limit is the router's: a message at the limit still fits its frame.
    let mut agent_config = config("mixed", "mixed-1", &registry.url);
    agent_config.max_message_bytes = 4096;
    let (_agent, _) = agent(mixed_agent(agent_config, Arc::new(Notify::new()))).await;
    let router = router(
        &registry.url,
        RouterConfig {
            max_message_bytes: 4096,
            ..RouterConfig::default()
        },
    )
    .await;
    router.wait_routable(1).await;
    let client = router.client().await;
    let status = client
        .call(
            "fast",
            Payload::text("t", "x".repeat(6000)),
            CallOptions::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(reason(&status), "PAYLOAD_TOO_LARGE");
    // The stream survives: the next call on it succeeds.
    client
        .call("fast", Payload::text("t", "ok"), CallOptions::default())
        .await
        .expect("the stream is still usable");
    assert_eq!(client.mux_streams_opened(), 1);

    // A message of exactly the limit is delivered: its frame's own fields do not push it
    // over the instance's limit and break the stream other calls share.
    let mut text = "x".repeat(3900);
    let mut message = client.message_to_capability(
        "small",
        Payload::text("t", text.clone()),
        &CallOptions::default(),
    );
    while message.encoded_len() < 4096 {
        text.push('x');
        message = client.message_to_capability(
            "small",
            Payload::text("t", text.clone()),
            &CallOptions::default(),
        );
    }
    assert_eq!(message.encoded_len(), 4096, "built to the limit exactly");
    client
        .send(message, None)
        .await
        .expect("a message at the limit is delivered");
    let endpoint = router.router.table().endpoint("mixed-1").unwrap();
    assert_eq!(
        endpoint.link().streams_opened(),
        1,
        "the instance link never broke"
    );
    assert_eq!(endpoint.ejections(), 0);
}

/// An agent written without the SDK that serves only unary Handle, and keeps the metadata of
/// every request it handles.
#[derive(Default)]
struct UnaryOnlyAgent {
    handled: Arc<AtomicUsize>,
    metadata: Arc<std::sync::Mutex<Vec<tonic::metadata::MetadataMap>>>,
}

#[tonic::async_trait]
impl AgentService for UnaryOnlyAgent {
    async fn handle(
        &self,
        request: Request<HandleRequest>,
    ) -> Result<Response<HandleResponse>, Status> {
        self.handled.fetch_add(1, Ordering::SeqCst);
        self.metadata
            .lock()
            .unwrap()
            .push(request.metadata().clone());
        let message = request.into_inner().message.unwrap_or_default();
        Ok(Response::new(HandleResponse {
            message: Some(ReachMessage {
                header: None,
                payload: message.payload,
            }),
        }))
    }

    type HandleStreamStream =
        Pin<Box<dyn Stream<Item = Result<HandleStreamResponse, Status>> + Send>>;

    async fn handle_stream(
        &self,
        _request: Request<Streaming<HandleStreamRequest>>,
    ) -> Result<Response<Self::HandleStreamStream>, Status> {
        Err(Status::unimplemented("no streams here"))
    }

    type HandleMuxStream = Pin<Box<dyn Stream<Item = Result<HandleMuxResponse, Status>> + Send>>;

    async fn handle_mux(
        &self,
        _request: Request<Streaming<HandleMuxRequest>>,
    ) -> Result<Response<Self::HandleMuxStream>, Status> {
        Err(Status::unimplemented("no multiplexed calls here"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_without_handle_mux_is_called_with_unary_handle() {
    let registry = registry().await;
    let handled = Arc::new(AtomicUsize::new(0));
    let agent = UnaryOnlyAgent {
        handled: handled.clone(),
        ..UnaryOnlyAgent::default()
    };
    serve_bare_agent(&registry, "legacy", "legacy-1", "legacy.echo", agent).await;
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;
    let client = router.client().await;
    for n in 0..3 {
        let reply = client
            .call(
                "legacy.echo",
                Payload::text("t", n.to_string()),
                CallOptions::default(),
            )
            .await
            .expect("the call falls back to Handle");
        assert_eq!(
            reply.message.unwrap().payload.unwrap().first_text(),
            Some(n.to_string().as_str())
        );
    }
    assert_eq!(handled.load(Ordering::SeqCst), 3);
    let link = router.router.table().endpoint("legacy-1").unwrap();
    assert!(link.link().is_unsupported());
    assert_eq!(link.link().streams_opened(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_forwards_end_to_end_metadata_but_not_hop_by_hop_fields_or_a_bad_traceparent() {
    let registry = registry().await;
    let agent = UnaryOnlyAgent::default();
    let seen = agent.metadata.clone();
    serve_bare_agent(&registry, "legacy", "legacy-1", "legacy.echo", agent).await;
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;
    let (frames, mut replies) = open_call_mux(&router.url).await;
    let valid_parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let padded_parent = format!(" {valid_parent} ");
    for (call_id, traceparent) in [
        (1, "00-4bf92f3577b34da6a3ce929d0e0e4736-not-a-parent-id-01"),
        (2, valid_parent),
        (3, padded_parent.as_str()),
    ] {
        let mut frame = call_frame(call_id, "legacy.echo", "hi", 0);
        let metadata = &mut frame.frame.as_mut().unwrap().metadata;
        for (key, value) in [
            ("authorization", "Bearer end-user-token"),
            ("x-tenant", "acme"),
            ("traceparent", traceparent),
            ("tracestate", "vendor=1"),
            ("host", "router.example"),
            ("connection", "close"),
            ("proxy-authorization", "Basic cm91dGVy"),
        ] {
            metadata.insert(key.into(), value.into());
        }
        frames.send(frame).await.unwrap();
        let reply = next(&mut replies).await;
        let frame = reply.frame.unwrap();
        assert!(
            matches!(frame.result, Some(reply_frame::Result::Reply(_))),
            "call {call_id}: {frame:?}"
        );
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3);
    for (metadata, parent_valid) in seen.iter().zip([false, true, true]) {
        assert_eq!(
            metadata.get("authorization").unwrap(),
            "Bearer end-user-token"
        );
        assert_eq!(metadata.get("x-tenant").unwrap(), "acme");
        for hop_by_hop in ["host", "connection", "proxy-authorization"] {
            assert!(metadata.get(hop_by_hop).is_none(), "{hop_by_hop} forwarded");
        }
        if parent_valid {
            assert_eq!(metadata.get("traceparent").unwrap(), valid_parent);
            assert_eq!(metadata.get("tracestate").unwrap(), "vendor=1");
        } else {
            assert!(
                metadata.get("traceparent").is_none(),
                "bad traceparent forwarded"
            );
            assert!(
                metadata.get("tracestate").is_none(),
                "orphan tracestate forwarded"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_an_instance_under_multiplexed_load_loses_no_call() {
    let registry = registry().await;
    let served = [Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0))];
    let mut agents = Vec::new();
    for (i, count) in served.iter().enumerate() {
        let count = count.clone();
        let (running, _) = agent(
            AgentRuntime::new(
                config("work", &format!("work-{i}"), &registry.url)
                    .with_max_drain(Duration::from_secs(5)),
            )
            .handle(
                "work",
                "1.0.0",
                move |_c: HandlerContext, m: ReachMessage| {
                    let count = count.clone();
                    async move {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        count.fetch_add(1, Ordering::SeqCst);
                        Ok(m.payload.unwrap_or_default())
                    }
                },
            ),
        )
        .await;
        agents.push(running);
    }
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(2).await;
    let client = router.client().await;

    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..16)
        .map(|_| {
            let client = client.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let (mut ok, mut failed) = (0usize, Vec::new());
                while !stop.load(Ordering::Relaxed) {
                    match client
                        .call("work", Payload::text("t", "x"), CallOptions::default())
                        .await
                    {
                        Ok(_) => ok += 1,
                        Err(status) => failed.push(status),
                    }
                }
                (ok, failed)
            })
        })
        .collect();
    eventually("both instances taking work before the drain", || {
        served.iter().all(|n| n.load(Ordering::SeqCst) >= 10)
    })
    .await;
    let draining = agents.remove(0);
    draining.drain().await.expect("drain");
    // The load goes on after the drain until the other instance has served 50 more calls.
    let after_drain = served[1].load(Ordering::SeqCst);
    eventually("the remaining instance serving the load", || {
        served[1].load(Ordering::SeqCst) >= after_drain + 50
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let (mut ok, mut failed) = (0, Vec::new());
    for worker in workers {
        let (o, f) = worker.await.unwrap();
        ok += o;
        failed.extend(f);
    }
    assert!(
        failed.is_empty(),
        "calls failed during the drain: {failed:?}"
    );
    // At least 10 + 10 calls before the drain and 50 after it were served and answered
    // (how many more depends on the machine's speed, not on the router).
    assert!(ok >= 70, "{ok} calls completed");
    assert!(served[1].load(Ordering::SeqCst) > 0);
}

/// A message to `capability` with a text payload.
fn message_to(capability: &str, text: &str) -> ReachMessage {
    ReachMessage {
        header: Some(Header {
            target: Some(header::Target::Capability(capability.into())),
            ..Header::default()
        }),
        payload: Some(Payload::text("t", text)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_calls_are_timed_per_instance_and_cancelled_calls_are_counted() {
    let metrics = reach_telemetry::metrics::install().unwrap();
    let registry = registry().await;
    let started = Arc::new(Notify::new());
    let cancelled = Arc::new(Notify::new());
    let (on_start, on_cancel) = (started.clone(), cancelled.clone());
    let (_agent, _) =
        agent(
            AgentRuntime::new(config("metered", "metered-1", &registry.url))
                .handle(
                    "metered.fast",
                    "1.0.0",
                    |_c: HandlerContext, m: ReachMessage| async move {
                        Ok(m.payload.unwrap_or_default())
                    },
                )
                .handle(
                    "metered.hang",
                    "1.0.0",
                    move |c: HandlerContext, _m: ReachMessage| {
                        let (on_start, on_cancel) = (on_start.clone(), on_cancel.clone());
                        async move {
                            on_start.notify_one();
                            c.cancellation.cancelled().await;
                            on_cancel.notify_one();
                            Err(Status::cancelled("cancelled"))
                        }
                    },
                ),
        )
        .await;
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;
    let timed = || {
        metric(
            &metrics.render(),
            "reach_router_instance_duration_seconds_count",
            &[("service", "metered"), ("instance", "metered-1")],
        )
    };
    let requests = |capability: &str, code: &str| {
        metric(
            &metrics.render(),
            "reach_router_requests_total",
            &[("capability", capability), ("code", code)],
        )
    };
    let in_flight = || {
        metric(
            &metrics.render(),
            "reach_router_in_flight",
            &[("capability", "metered.hang")],
        )
    };
    assert_eq!(timed(), 0.0);

    // Unary calls and multiplexed calls each give the instance that served them a sample.
    let mut client = RouterServiceClient::connect(router.url.clone())
        .await
        .unwrap();
    for n in 0..3 {
        let response = client
            .call(CallRequest {
                message: Some(message_to("metered.fast", &n.to_string())),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(response.route.unwrap().instance_id, "metered-1");
    }
    assert_eq!(timed(), 3.0, "one sample per unary call");
    let (frames, mut replies) = open_call_mux(&router.url).await;
    for call_id in 1..=2 {
        frames
            .send(call_frame(call_id, "metered.fast", "x", 0))
            .await
            .unwrap();
    }
    for _ in 0..2 {
        let reply = next(&mut replies).await;
        assert!(
            matches!(
                reply.frame.unwrap().result,
                Some(reply_frame::Result::Reply(_))
            ),
            "a multiplexed call failed"
        );
    }
    assert_eq!(timed(), 5.0, "one sample per multiplexed call");
    assert_eq!(requests("metered.fast", "OK"), 5.0);

    // A unary call whose caller goes away is counted CANCELLED and leaves nothing in flight.
    let call = {
        let mut client = client.clone();
        tokio::spawn(async move {
            client
                .call(CallRequest {
                    message: Some(message_to("metered.hang", "x")),
                })
                .await
        })
    };
    tokio::time::timeout(Duration::from_secs(5), started.notified())
        .await
        .expect("the hanging call reached its handler");
    assert_eq!(in_flight(), 1.0);
    assert_eq!(requests("metered.hang", "CANCELLED"), 0.0);
    call.abort();
    tokio::time::timeout(Duration::from_secs(5), cancelled.notified())
        .await
        .expect("the router cancelled the abandoned call at the instance");
    eventually("the cancelled unary call being counted", || {
        requests("metered.hang", "CANCELLED") == 1.0
    })
    .await;
    eventually("the in-flight gauge going back to 0", || in_flight() == 0.0).await;

    // So is a multiplexed call its caller cancels.
    frames
        .send(call_frame(10, "metered.hang", "x", 0))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), started.notified())
        .await
        .expect("the hanging multiplexed call reached its handler");
    assert_eq!(in_flight(), 1.0);
    frames.send(cancel_frame(10)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), cancelled.notified())
        .await
        .expect("the cancel reached the handler");
    eventually("the cancelled multiplexed call being counted", || {
        requests("metered.hang", "CANCELLED") == 2.0
    })
    .await;
    eventually("the in-flight gauge going back to 0", || in_flight() == 0.0).await;
    // An abandoned attempt is not a latency sample, and nothing else was counted.
    assert_eq!(timed(), 5.0);
    assert_eq!(
        metric(
            &metrics.render(),
            "reach_router_requests_total",
            &[("capability", "metered.hang")]
        ),
        2.0
    );
}
