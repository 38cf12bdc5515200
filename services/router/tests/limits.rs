//! Limits and delivery safety: shedding, TTL, stream message size, and retries that never run
//! a side effect twice.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use reach_proto::v1::{Payload, ReachMessage};
use reach_router::RouterConfig;
use reach_router::config::AdmissionConfig;
use reach_sdk::{AgentConfig, AgentRuntime, CallOptions, HandlerContext};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_shed_with_a_retry_hint_and_bounded_waiting() {
    let metrics = reach_telemetry::metrics::install().unwrap();
    let shed_count = |reason: &str| {
        metric(
            &metrics.render(),
            "reach_router_shed_total",
            &[("capability", "shed.slow"), ("reason", reason)],
        )
    };
    let shed_before = shed_count("max_waiting");
    let registry = registry().await;
    let gate = Arc::new(Semaphore::new(0));
    let handler_gate = gate.clone();
    let (_agent, _) = agent(
        AgentRuntime::new(config("slow", "slow-1", &registry.url).with_max_concurrency(1)).handle(
            "shed.slow",
            "1.0.0",
            move |_c: HandlerContext, _m: ReachMessage| {
                let gate = handler_gate.clone();
                async move {
                    gate.acquire().await.unwrap().forget();
                    Ok(Payload::text("done", ""))
                }
            },
        ),
    )
    .await;
    let config = RouterConfig {
        admission: AdmissionConfig {
            max_waiting: 2,
            max_wait: Duration::from_secs(5),
            retry_after: Duration::from_millis(75),
        },
        ..RouterConfig::default()
    };
    let router = router(&registry.url, config).await;
    router.wait_routable(1).await;
    let client = router.client().await;

    // One call runs (the instance's limit is 1), two wait, the rest are shed at once.
    let calls: Vec<_> = (0..12)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                client
                    .call("shed.slow", Payload::text("t", ""), CallOptions::default())
                    .await
            })
        })
        .collect();
    // Until the gate opens: exactly two wait, and the other nine were shed.
    eventually("two calls waiting and nine shed", || {
        router.router.table().waiting() == 2 && shed_count("max_waiting") - shed_before == 9.0
    })
    .await;
    assert_eq!(router.router.table().waiting(), 2);
    gate.add_permits(100);
    let mut ok = 0;
    let mut shed = 0;
    for call in calls {
        match call.await.unwrap() {
            Ok(_) => ok += 1,
            Err(status) => {
                assert_eq!(status.code(), Code::Unavailable, "{status:?}");
                assert_eq!(reason(&status), "OVERLOADED");
                assert_eq!(
                    reach_rpc::errors::retry_after_of(&status),
                    Some(Duration::from_millis(75))
                );
                assert_eq!(
                    reach_rpc::errors::metadata_of(&status)
                        .get("retry_after_ms")
                        .map(String::as_str),
                    Some("75")
                );
                shed += 1;
            }
        }
    }
    assert_eq!((ok, shed), (3, 9));
    assert_eq!(router.router.table().waiting(), 0);
    // Every one was shed at once, two calls waiting already.
    assert_eq!(shed_count("max_waiting") - shed_before, 9.0);
    assert_eq!(shed_count("max_wait"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_message_is_refused_with_message_expired() {
    let registry = registry().await;
    let (_agent, _) = agent(
        AgentRuntime::new(config("slow", "slow-1", &registry.url)).handle(
            "slow",
            "1.0.0",
            |_c: HandlerContext, m: ReachMessage| async move {
                let millis = m
                    .payload
                    .as_ref()
                    .and_then(|p| p.first_text())
                    .unwrap_or("0");
                tokio::time::sleep(Duration::from_millis(millis.parse().unwrap_or(0))).await;
                Ok(Payload::text("done", ""))
            },
        ),
    )
    .await;
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;
    let client = router.client().await;

    // Already expired when it reaches the router.
    let mut old =
        client.message_to_capability("slow", Payload::text("t", "0"), &CallOptions::default());
    let header = old.header.as_mut().unwrap();
    header.created_at = Some(reach_rpc::time::timestamp(
        std::time::SystemTime::now() - Duration::from_secs(2),
    ));
    header.ttl = Some(reach_rpc::time::proto_duration(Duration::from_secs(1)));
    let status = client.send(old, None).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded);
    assert_eq!(reason(&status), "MESSAGE_EXPIRED");

    // Expires while the instance works on it.
    let mut short =
        client.message_to_capability("slow", Payload::text("t", "2000"), &CallOptions::default());
    short.header.as_mut().unwrap().ttl =
        Some(reach_rpc::time::proto_duration(Duration::from_millis(100)));
    let status = client.send(short, None).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded);
    assert_eq!(reason(&status), "MESSAGE_EXPIRED");

    // A fresh one within its TTL goes through.
    let mut fresh =
        client.message_to_capability("slow", Payload::text("t", "0"), &CallOptions::default());
    fresh.header.as_mut().unwrap().ttl =
        Some(reach_rpc::time::proto_duration(Duration::from_secs(5)));
    client.send(fresh, None).await.unwrap();

    // Created in the future: within the clock-skew allowance (1 min) it counts as just
    // created; beyond it, its TTL would count from a time that has not come.
    for (ahead, accepted) in [
        (Duration::from_secs(5), true),
        (Duration::from_secs(600), false),
    ] {
        let mut early =
            client.message_to_capability("slow", Payload::text("t", "0"), &CallOptions::default());
        let header = early.header.as_mut().unwrap();
        header.created_at = Some(reach_rpc::time::timestamp(
            std::time::SystemTime::now() + ahead,
        ));
        header.ttl = Some(reach_rpc::time::proto_duration(Duration::from_secs(1)));
        let outcome = client.send(early, None).await;
        if accepted {
            outcome.expect("a small clock skew is allowed");
        } else {
            let status = outcome.unwrap_err();
            assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
            assert_eq!(reason(&status), "INVALID_HEADER");
            assert_eq!(
                reach_rpc::errors::metadata_of(&status)["field"],
                "header.created_at"
            );
            assert!(
                status.message().contains("created_at") && status.message().contains("clock"),
                "{}",
                status.message()
            );
        }
    }
}

/// An agent `id` whose `talk` streams echo every message's payload.
fn stream_echo(registry: &str, id: &str) -> AgentRuntime {
    stream_echo_with(config("talk", id, registry))
}

/// A `talk` stream echo agent with `config`.
fn stream_echo_with(config: reach_sdk::AgentConfig) -> AgentRuntime {
    AgentRuntime::new(config).handle_stream(
        "talk",
        "1.0.0",
        |_c: HandlerContext, first: ReachMessage, rest: reach_sdk::handler::InboundMessages| {
            use futures::StreamExt;
            futures::stream::once(async move { Ok(first) })
                .chain(rest)
                .map(|m| m.map(|m| m.payload.unwrap_or_default()))
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_stream_message_ends_the_stream_with_payload_too_large() {
    let registry = registry().await;
    let (_agent, _) = agent(stream_echo(&registry.url, "talk-1")).await;
    let config = RouterConfig {
        max_message_bytes: 2048,
        ..RouterConfig::default()
    };
    let router = router(&registry.url, config).await;
    router.wait_routable(1).await;
    let client = router.client().await;
    let small =
        client.message_to_capability("talk", Payload::text("t", "hi"), &CallOptions::default());
    let big = client.message_to_capability(
        "talk",
        Payload::text("t", "x".repeat(4000)),
        &CallOptions::default(),
    );
    let next_small =
        client.message_to_capability("talk", Payload::text("t", "again"), &CallOptions::default());
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut replies = client
        .stream(small, tokio_stream_from(rx), Some(Duration::from_secs(10)))
        .await
        .unwrap();
    let first = replies.message().await.unwrap().unwrap();
    assert_eq!(
        first.message.unwrap().payload.unwrap().first_text(),
        Some("hi")
    );
    tx.send(big).await.unwrap();
    let _ = tx.send(next_small).await;
    let status = loop {
        match replies.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended without an error"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(reason(&status), "PAYLOAD_TOO_LARGE");
    let meta = reach_rpc::errors::metadata_of(&status);
    assert_eq!(meta.get("limit_bytes").map(String::as_str), Some("2048"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_of_a_stream_is_held_to_its_ttl() {
    let registry = registry().await;
    let (_agent, _) = agent(stream_echo(&registry.url, "talk-2")).await;
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;
    let client = router.client().await;
    // A later message created 100 s ago with a 1 s TTL, or 2 min ahead of the router's clock.
    for (created, code, why) in [
        (
            std::time::SystemTime::now() - Duration::from_secs(100),
            Code::DeadlineExceeded,
            "MESSAGE_EXPIRED",
        ),
        (
            std::time::SystemTime::now() + Duration::from_secs(120),
            Code::InvalidArgument,
            "INVALID_HEADER",
        ),
    ] {
        let first =
            client.message_to_capability("talk", Payload::text("t", "hi"), &CallOptions::default());
        let mut late = client.message_to_capability(
            "talk",
            Payload::text("t", "late"),
            &CallOptions::default(),
        );
        let header = late.header.as_mut().unwrap();
        header.created_at = Some(reach_rpc::time::timestamp(created));
        header.ttl = Some(reach_rpc::time::proto_duration(Duration::from_secs(1)));
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut replies = client
            .stream(first, tokio_stream_from(rx), Some(Duration::from_secs(10)))
            .await
            .unwrap();
        replies.message().await.unwrap().unwrap();
        tx.send(late).await.unwrap();
        let status = match replies.message().await {
            Ok(Some(reply)) => panic!("the late message was delivered: {reply:?}"),
            Ok(None) => panic!("the stream ended without an error"),
            Err(status) => status,
        };
        assert_eq!(status.code(), code, "{status:?}");
        assert_eq!(reason(&status), why);
    }
}

fn tokio_stream_from(
    rx: tokio::sync::mpsc::Receiver<ReachMessage>,
) -> impl futures::Stream<Item = ReachMessage> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) })
}

/// A TCP proxy in front of an agent that can cut every connection it carries.
struct Proxy {
    endpoint: String,
    cut: Arc<Notify>,
}

async fn proxy(target: String) -> Proxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let cut = Arc::new(Notify::new());
    let cut_all = cut.clone();
    tokio::spawn(async move {
        loop {
            let Ok((inbound, _)) = listener.accept().await else {
                return;
            };
            let target = target.trim_start_matches("http://").to_string();
            let cut = cut_all.clone();
            tokio::spawn(async move {
                let Ok(outbound) = TcpStream::connect(target).await else {
                    return;
                };
                let (mut ri, mut wi) = inbound.into_split();
                let (mut ro, mut wo) = outbound.into_split();
                tokio::select! {
                    _ = tokio::io::copy(&mut ri, &mut wo) => {}
                    _ = tokio::io::copy(&mut ro, &mut wi) => {}
                    _ = cut.notified() => {}
                }
                // Dropping both halves resets the connections.
            });
        }
    });
    Proxy { endpoint, cut }
}

/// An agent reached only through a proxy: it registers nowhere; the test registers the
/// proxy's address for it.
async fn agent_behind_proxy(
    registry: &TestRegistry,
    capability: &str,
    runs: Arc<AtomicUsize>,
    started: Arc<Notify>,
) -> (reach_sdk::runtime::RunningAgent, Proxy) {
    let config = AgentConfig {
        registry_endpoint: "http://127.0.0.1:1".into(),
        ..config("pay", "pay-1", &registry.url)
    };
    let (agent, endpoint) = agent(AgentRuntime::new(config).handle(
        capability,
        "1.0.0",
        move |_c: HandlerContext, _m: ReachMessage| {
            let runs = runs.clone();
            let started = started.clone();
            async move {
                // The side effect happens, then the reply takes a while.
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                started.notify_one();
                tokio::time::sleep(Duration::from_millis(200)).await;
                Ok(Payload::text("charged", n.to_string()))
            }
        },
    ))
    .await;
    let proxy = proxy(endpoint).await;
    register(
        &registry.registry,
        "pay",
        "pay-1",
        &proxy.endpoint,
        &[(capability, "1.0.0")],
    );
    (agent, proxy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_after_delivery_is_not_retried_and_redelivery_is_deduplicated() {
    let registry = registry().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(Notify::new());
    let (_agent, proxy) =
        agent_behind_proxy(&registry, "payment.charge", runs.clone(), started.clone()).await;
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;
    let client = router.client().await;

    let options = CallOptions {
        message_id: Some(reach_rpc::trace::new_message_id()),
        ..CallOptions::default()
    };
    let call = {
        let client = client.clone();
        let options = options.clone();
        tokio::spawn(async move {
            client
                .call("payment.charge", Payload::text("t", "10 EUR"), options)
                .await
        })
    };
    started.notified().await;
    proxy.cut.notify_waiters();
    let status = call.await.unwrap().unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(reason(&status), "INSTANCE_LOST", "{status:?}");
    assert!(
        status
            .message()
            .contains("may or may not have been handled"),
        "the caller learns the instance failed mid-call: {status:?}"
    );
    // Not idempotent and possibly delivered: the router did not send it again.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // The caller resends the same message id: the agent answers from its dedupe window.
    let reply = client
        .call("payment.charge", Payload::text("t", "10 EUR"), options)
        .await
        .unwrap();
    assert_eq!(
        reply.message.unwrap().payload.unwrap().first_text(),
        Some("1")
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_capability_is_retried_after_a_reset_without_running_twice() {
    // Removed when dropped at the end of the test, passed or not.
    let dir = tempfile::Builder::new()
        .prefix("reach-idem-")
        .tempdir()
        .unwrap();
    let file = dir.path().join("protocol-registry.yaml");
    std::fs::write(
        &file,
        "capabilities:\n  balance.read:\n    idempotent: true\n",
    )
    .unwrap();
    let registry = registry().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(Notify::new());
    let (_agent, proxy) =
        agent_behind_proxy(&registry, "balance.read", runs.clone(), started.clone()).await;
    let router = router(
        &registry.url,
        RouterConfig {
            protocol_registry: Some(file),
            ..RouterConfig::default()
        },
    )
    .await;
    router.wait_routable(1).await;
    let client = router.client().await;
    let call = {
        let client = client.clone();
        tokio::spawn(async move {
            client
                .call(
                    "balance.read",
                    Payload::text("t", ""),
                    CallOptions::default(),
                )
                .await
        })
    };
    started.notified().await;
    proxy.cut.notify_waiters();
    // The router retried on its own; the agent's dedupe window answered the redelivery.
    let reply = call.await.unwrap().expect("the idempotent call is retried");
    assert_eq!(
        reply.message.unwrap().payload.unwrap().first_text(),
        Some("1")
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// An agent `id` with one handler slot serving `capability`: each run counts itself in `runs`,
/// then waits for a permit of `gate` before echoing.
fn gated_agent(
    registry: &str,
    id: &str,
    capability: &str,
    gate: Arc<Semaphore>,
    runs: Arc<AtomicUsize>,
) -> AgentRuntime {
    AgentRuntime::new(config("queue", id, registry).with_max_concurrency(1)).handle(
        capability,
        "1.0.0",
        move |_c: HandlerContext, m: ReachMessage| {
            let (gate, runs) = (gate.clone(), runs.clone());
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                gate.acquire().await.unwrap().forget();
                Ok(m.payload.unwrap_or_default())
            }
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_waiting_for_a_handler_slot_are_counted_until_they_get_one() {
    let metrics = reach_telemetry::metrics::install().unwrap();
    let waiting = || -> f64 {
        metrics
            .render()
            .lines()
            .find(|l| {
                l.starts_with("reach_sdk_queue_depth{") && l.contains("capability=\"queue.hold\"")
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    let registry = registry().await;
    let release = Arc::new(Semaphore::new(0));
    let runs = Arc::new(AtomicUsize::new(0));
    let (_agent, url) = agent(gated_agent(
        &registry.url,
        "queue-1",
        "queue.hold",
        release.clone(),
        runs,
    ))
    .await;
    // Callers that reach the instance directly (not through a router, which would hold
    // them back at the instance's limit): one runs, two wait for its slot.
    let client = reach_proto::v1::agent_service_client::AgentServiceClient::connect(url)
        .await
        .unwrap();
    let calls: Vec<_> = (0..3)
        .map(|n| {
            let mut client = client.clone();
            tokio::spawn(async move {
                client
                    .handle(reach_proto::v1::HandleRequest {
                        message: Some(ReachMessage {
                            header: Some(reach_proto::v1::Header {
                                target: Some(reach_proto::v1::header::Target::Capability(
                                    "queue.hold".into(),
                                )),
                                message_id: format!("queue-{n}"),
                                ..Default::default()
                            }),
                            payload: Some(Payload::text("t", n.to_string())),
                        }),
                    })
                    .await
            })
        })
        .collect();
    let started = tokio::time::Instant::now();
    while waiting() != 2.0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "reach_sdk_queue_depth is {}, not 2",
            waiting()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    release.add_permits(3);
    for call in calls {
        call.await.unwrap().expect("each call is handled in turn");
    }
    assert_eq!(waiting(), 0.0, "nothing waits once every call got its slot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_whose_caller_gave_up_while_waiting_for_a_slot_is_not_handled() {
    let registry = registry().await;
    let release = Arc::new(Semaphore::new(0));
    let runs = Arc::new(AtomicUsize::new(0));
    let (_agent, url) = agent(gated_agent(
        &registry.url,
        "queue-2",
        "queue.abandon",
        release.clone(),
        runs.clone(),
    ))
    .await;
    let client = reach_proto::v1::agent_service_client::AgentServiceClient::connect(url)
        .await
        .unwrap();
    let request = |n: usize, timeout: Option<Duration>| {
        let mut request = tonic::Request::new(reach_proto::v1::HandleRequest {
            message: Some(ReachMessage {
                header: Some(reach_proto::v1::Header {
                    target: Some(reach_proto::v1::header::Target::Capability(
                        "queue.abandon".into(),
                    )),
                    message_id: format!("abandon-{n}"),
                    ..Default::default()
                }),
                payload: Some(Payload::text("t", n.to_string())),
            }),
        });
        if let Some(timeout) = timeout {
            request.set_timeout(timeout);
        }
        request
    };
    // The first call holds the only slot; three more wait for it and give up after 200 ms.
    let holder = {
        let mut client = client.clone();
        let first = request(0, None);
        tokio::spawn(async move { client.handle(first).await })
    };
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for n in 1..=3 {
        let status = client
            .clone()
            .handle(request(n, Some(Duration::from_millis(200))))
            .await
            .unwrap_err();
        // tonic's client gives up on its own timer (CANCELLED) or the agent's answers first.
        assert!(
            matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
            "{status:?}"
        );
    }
    // The agent's own deadline for each (200 ms from when it read the call) has passed too.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Freed, the slot goes to a fresh call at once, not to the abandoned ones.
    release.add_permits(1);
    holder.await.unwrap().expect("the first call finishes");
    release.add_permits(1);
    tokio::time::timeout(
        Duration::from_secs(2),
        client.clone().handle(request(4, None)),
    )
    .await
    .expect("the fresh call is not queued behind abandoned ones")
    .expect("the fresh call is handled");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "only the first and the fresh call ran their handler"
    );
    // An abandoned message was not handled, so a redelivery of its id runs it.
    release.add_permits(1);
    client
        .clone()
        .handle(request(1, None))
        .await
        .expect("the redelivered message is handled");
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_callers_make_up_do_not_make_metric_series() {
    let metrics = reach_telemetry::metrics::install().unwrap();
    let registry = registry().await;
    let router = router(&registry.url, RouterConfig::default()).await;
    let client = router.client().await;
    // Unknown capabilities, each with a payload type of its own: every call fails, none
    // adds a series named after what the caller sent.
    for n in 0..300 {
        let status = client
            .call(
                &format!("made-up-{n}"),
                Payload::text(format!("type-{n}-{}", "x".repeat(n % 200)), "x"),
                CallOptions::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::NotFound);
    }
    let text = metrics.render();
    assert!(
        !text.contains("made-up-"),
        "a made-up capability became a label"
    );
    assert!(
        text.contains("capability=\"(unrouted)\""),
        "unroutable calls are still counted"
    );
    let failure_series = text
        .lines()
        .filter(|l| l.starts_with("reach_router_message_failures_total{"))
        .count();
    assert!(
        failure_series <= 257,
        "{failure_series} message_type series"
    );
    // An absurdly long name is refused before it is echoed anywhere.
    let status = client
        .call(
            &"n".repeat(20_000),
            Payload::text("t", "x"),
            CallOptions::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(reason(&status), "INVALID_TARGET");
    assert!(status.message().len() < 1024, "{}", status.message());
}

/// A boxed stream of replies, as a hand-written `AgentService` returns them.
type Replies<T> = std::pin::Pin<Box<dyn futures::Stream<Item = Result<T, tonic::Status>> + Send>>;

/// An agent without the SDK whose streams answer their headers only after 600 ms.
struct SlowToAnswerAgent;

#[tonic::async_trait]
impl reach_proto::v1::agent_service_server::AgentService for SlowToAnswerAgent {
    async fn handle(
        &self,
        _request: tonic::Request<reach_proto::v1::HandleRequest>,
    ) -> Result<tonic::Response<reach_proto::v1::HandleResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("streams only"))
    }

    type HandleStreamStream = Replies<reach_proto::v1::HandleStreamResponse>;

    async fn handle_stream(
        &self,
        _request: tonic::Request<tonic::Streaming<reach_proto::v1::HandleStreamRequest>>,
    ) -> Result<tonic::Response<Self::HandleStreamStream>, tonic::Status> {
        tokio::time::sleep(Duration::from_millis(600)).await;
        Ok(tonic::Response::new(Box::pin(futures::stream::empty())))
    }

    type HandleMuxStream = Replies<reach_proto::v1::HandleMuxResponse>;

    async fn handle_mux(
        &self,
        _request: tonic::Request<tonic::Streaming<reach_proto::v1::HandleMuxRequest>>,
    ) -> Result<tonic::Response<Self::HandleMuxStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("streams only"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_counts_as_open_while_its_instance_has_not_answered() {
    let metrics = reach_telemetry::metrics::install().unwrap();
    let open = || -> f64 {
        metrics
            .render()
            .lines()
            .find(|l| {
                l.starts_with("reach_router_open_streams{")
                    && l.contains("capability=\"slow.answer\"")
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    let registry = registry().await;
    serve_bare_agent(
        &registry,
        "slow",
        "slow-1",
        "slow.answer",
        SlowToAnswerAgent,
    )
    .await;
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;
    let client = router.client().await;
    let first = client.message_to_capability(
        "slow.answer",
        Payload::text("t", "x"),
        &CallOptions::default(),
    );
    let stream = tokio::spawn(async move {
        let mut replies = client
            .stream(first, futures::stream::pending(), None)
            .await
            .expect("the stream opens");
        while replies.message().await.transpose().is_some() {}
    });
    // The instance answers after 600 ms and the stream then ends, so the gauge can read 1
    // only while the stream waits for it.
    eventually(
        "the stream counts as open before its instance answered",
        || open() == 1.0,
    )
    .await;
    tokio::time::timeout(Duration::from_secs(5), stream)
        .await
        .expect("the stream ends")
        .unwrap();
    assert_eq!(open(), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_to_an_instance_that_refuses_connections_says_it_was_not_delivered() {
    let registry = registry().await;
    let (dead, _) = dead_endpoint().await;
    register(
        &registry.registry,
        "gone",
        "gone-1",
        &dead,
        &[("gone.echo", "1.0.0")],
    );
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;
    let client = router.client().await;
    let status = client
        .call("gone.echo", Payload::text("t", "x"), CallOptions::default())
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(reason(&status), "INSTANCE_UNAVAILABLE");
    assert!(
        status.message().contains("was not delivered")
            && !status.message().contains("may or may not"),
        "{}",
        status.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_instance_goes_away_ends_with_an_error() {
    let registry = registry().await;
    let (running, _) = agent(stream_echo_with(
        config("talk", "talk-gone", &registry.url).with_max_drain(Duration::from_millis(100)),
    ))
    .await;
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;
    let client = router.client().await;
    let first =
        client.message_to_capability("talk", Payload::text("t", "hi"), &CallOptions::default());
    let (_tx, rx) = tokio::sync::mpsc::channel(4);
    let mut replies = client
        .stream(first, tokio_stream_from(rx), None)
        .await
        .unwrap();
    replies.message().await.unwrap().unwrap();
    // The instance stops while the stream is open (its drain gives up after 100 ms, its
    // server's grace after 1 s): the caller's stream ends with an error, not hanging.
    let drained = tokio::spawn(running.drain());
    let outcome = tokio::time::timeout(Duration::from_secs(8), async {
        loop {
            match replies.message().await {
                Ok(Some(_)) => continue,
                other => break other,
            }
        }
    })
    .await
    .expect("the caller's stream was still open 8 s after its instance went away");
    let status = outcome.expect_err("the stream ended as if it had finished");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(reason(&status), "INSTANCE_LOST");
    assert_eq!(
        reach_rpc::errors::metadata_of(&status)["instance_id"],
        "talk-gone"
    );
    drained.await.unwrap().unwrap();
}

/// Serves an `AgentService` on 127.0.0.1:0 that does not implement `HandleMux` (so the router
/// falls back to unary `Handle`) and answers every `Handle` with the first `sent` bytes of a
/// reply declaring `declared` bytes, then nothing more: a broken or hostile instance.
/// Returns its URL.
async fn serve_unfinished_replies(declared: u32, sent: usize) -> String {
    use axum::response::IntoResponse;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let routes = axum::Router::new()
        .route(
            "/reach.v1.AgentService/HandleMux",
            axum::routing::post(|| async {
                (
                    [("content-type", "application/grpc"), ("grpc-status", "12")],
                    "",
                )
                    .into_response()
            }),
        )
        .route(
            "/reach.v1.AgentService/Handle",
            axum::routing::post(move || async move {
                let mut start = vec![0];
                start.extend_from_slice(&declared.to_be_bytes());
                start.resize(5 + sent, b' ');
                let body = futures::StreamExt::chain(
                    futures::stream::once(async move {
                        Ok::<_, std::convert::Infallible>(bytes::Bytes::from(start))
                    }),
                    futures::stream::pending(),
                );
                (
                    [("content-type", "application/grpc")],
                    axum::body::Body::from_stream(body),
                )
                    .into_response()
            }),
        );
    tokio::spawn(reach_rpc::server::serve_http(
        listener,
        routes,
        futures::future::pending(),
        Duration::from_secs(1),
        reach_rpc::ConnectionLimits::default(),
    ));
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_an_instance_starts_and_never_finishes_hold_only_its_reply_budget() {
    const MIB: usize = 1024 * 1024;
    let registry = registry().await;
    let endpoint = serve_unfinished_replies(1_000_000, 900_000).await;
    register(
        &registry.registry,
        "stalling",
        "stalling-1",
        &endpoint,
        &[("stalling.echo", "1.0.0")],
    );
    let router = router(
        &registry.url,
        RouterConfig {
            max_message_bytes: MIB,
            max_buffered_reply_bytes_per_instance: MIB,
            ..RouterConfig::default()
        },
    )
    .await;
    router.wait_routable(1).await;
    let client = router.client().await;
    let call = || {
        let client = client.clone();
        async move {
            client
                .call(
                    "stalling.echo",
                    Payload::text("t", "x"),
                    CallOptions {
                        timeout: Some(Duration::from_secs(3)),
                        ..CallOptions::default()
                    },
                )
                .await
        }
    };
    // The first call's 900 KB fit the 1 MiB budget and wait for a rest that never comes; the
    // second's would not, so it fails at once instead of pinning another 900 KB.
    let first = tokio::spawn(call());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = call().await.unwrap_err();
    assert_eq!(second.code(), Code::ResourceExhausted, "{second:?}");
    assert!(
        second
            .message()
            .contains("router.max_buffered_reply_bytes_per_instance"),
        "the refusal names its setting: {second:?}"
    );
    let first = first.await.unwrap().unwrap_err();
    assert_eq!(first.code(), Code::DeadlineExceeded, "{first:?}");

    // The first call's bytes were given back at its deadline: a new call fits again (and
    // waits out its own deadline). The router's deadline is the caller's plus the transit
    // time, so a call sent the instant the previous one timed out may find its bytes held
    // for that moment longer: refused at once, it fits when tried again.
    for _ in 0..2 {
        let mut outcome = call().await;
        for _ in 0..50 {
            match &outcome {
                Err(status) if status.code() == Code::ResourceExhausted => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    outcome = call().await;
                }
                _ => break,
            }
        }
        assert_eq!(
            outcome.unwrap_err().code(),
            Code::DeadlineExceeded,
            "a call one at a time fits once the previous one's bytes are released"
        );
    }
}
