//! Routing through the router to real agents: targets, balancing, errors, deadlines,
//! cancellation, drain, trace ids and size limits.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use reach::config::ReachConfig;
use reach_proto::v1::{CallRequest, Header, Payload, ReachMessage, header};
use reach_rpc::errors::{metadata_of, reason_of};
use reach_sdk::{AgentRuntime, CallOptions, HandlerContext};
use reach_tests::{Sandbox, eventually};
use tokio::sync::{Notify, mpsc};
use tonic::Code;

/// An agent whose `echo` capability answers with its instance id and the text it got.
fn echo_agent(sandbox: &Sandbox, service: &str, instance: &str) -> AgentRuntime {
    AgentRuntime::new(sandbox.agent_config(service, instance)).handle(
        "echo",
        "1.0.0",
        |ctx: HandlerContext, message: ReachMessage| async move {
            let text = message
                .payload
                .unwrap_or_default()
                .first_text()
                .unwrap_or_default()
                .to_string();
            Ok(Payload::text(
                "echo.reply",
                format!("{}:{text}", ctx.instance_id),
            ))
        },
    )
}

fn reply_text(response: &reach_proto::v1::CallResponse) -> String {
    response
        .message
        .as_ref()
        .and_then(|m| m.payload.as_ref())
        .and_then(|p| p.first_text())
        .unwrap_or_default()
        .to_string()
}

fn message(target: header::Target, trace_id: &str, text: &str) -> ReachMessage {
    ReachMessage {
        header: Some(Header {
            trace_id: trace_id.into(),
            target: Some(target),
            ..Header::default()
        }),
        payload: Some(Payload::text("echo.request", text)),
    }
}

#[tokio::test]
async fn routes_by_capability_and_by_service_name() {
    let sandbox = Sandbox::start().await;
    let _a = sandbox
        .start_agent(echo_agent(&sandbox, "echoer", "echoer-1"))
        .await;
    let mesh = sandbox.mesh().await;

    let by_capability = mesh
        .call("echo", Payload::text("t", "hi"), CallOptions::default())
        .await
        .unwrap();
    assert_eq!(reply_text(&by_capability), "echoer-1:hi");
    let route = by_capability.route.unwrap();
    assert_eq!(
        (route.instance_id.as_str(), route.service.as_str()),
        ("echoer-1", "echoer")
    );

    let to_service = mesh.message_to_service(
        "echoer",
        Payload::text("echo", "there"),
        &CallOptions::default(),
    );
    let by_service = mesh.send(to_service, None).await.unwrap();
    assert_eq!(reply_text(&by_service), "echoer-1:there");
    sandbox.stop().await;
}

#[tokio::test]
async fn every_instance_of_a_capability_receives_traffic() {
    let sandbox = Sandbox::start().await;
    let mut agents = Vec::new();
    for i in 1..=3 {
        agents.push(
            sandbox
                .start_agent(echo_agent(&sandbox, "echoer", &format!("echoer-{i}")))
                .await,
        );
    }
    let mesh = sandbox.mesh().await;
    let mut counts: HashMap<String, usize> = HashMap::new();
    let calls = (0..90).map(|i| {
        let mesh = mesh.clone();
        async move {
            mesh.call(
                "echo",
                Payload::text("t", i.to_string()),
                CallOptions::default(),
            )
            .await
        }
    });
    for result in futures::future::join_all(calls).await {
        *counts
            .entry(result.unwrap().route.unwrap().instance_id)
            .or_default() += 1;
    }
    assert_eq!(counts.len(), 3, "every instance must be used: {counts:?}");
    assert!(
        counts.values().all(|&n| n >= 5),
        "traffic is spread: {counts:?}"
    );
    sandbox.stop().await;
}

#[tokio::test]
async fn an_unknown_capability_is_not_found_with_the_known_ones_listed() {
    let sandbox = Sandbox::start().await;
    let _a = sandbox
        .start_agent(echo_agent(&sandbox, "echoer", "echoer-1"))
        .await;
    let err = sandbox
        .mesh()
        .await
        .call(
            "complaint.nothing",
            Payload::text("t", "x"),
            CallOptions::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert_eq!(reason_of(&err).as_deref(), Some("ROUTE_NOT_FOUND"));
    assert!(
        err.message().contains("complaint.nothing"),
        "{}",
        err.message()
    );
    assert!(
        err.message().contains("echo (1)"),
        "known capabilities listed: {}",
        err.message()
    );
    assert_eq!(
        metadata_of(&err).get("capability").map(String::as_str),
        Some("complaint.nothing")
    );
    sandbox.stop().await;
}

#[tokio::test]
async fn a_deadline_shorter_than_the_work_fails_the_caller_and_cancels_the_agent() {
    let sandbox = Sandbox::start().await;
    let (cancelled_tx, mut cancelled_rx) = mpsc::unbounded_channel();
    let slow = AgentRuntime::new(sandbox.agent_config("slow", "slow-1")).handle(
        "slow",
        "1.0.0",
        move |ctx: HandlerContext, _m: ReachMessage| {
            let cancelled_tx = cancelled_tx.clone();
            async move {
                tokio::select! {
                    () = ctx.cancellation.cancelled() => {
                        let _ = cancelled_tx.send(ctx.message_id.clone());
                        Err(tonic::Status::cancelled("stopped"))
                    }
                    () = tokio::time::sleep(Duration::from_secs(30)) => Ok(Payload::text("t", "late")),
                }
            }
        },
    );
    let _agent = sandbox.start_agent(slow).await;
    // The deadline travels as grpc-timeout; router and agent both enforce it.
    let options = CallOptions {
        timeout: Some(Duration::from_millis(200)),
        ..CallOptions::default()
    };
    let err = sandbox
        .mesh()
        .await
        .call("slow", Payload::text("t", "work"), options)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    let seen = tokio::time::timeout(Duration::from_secs(5), cancelled_rx.recv()).await;
    assert!(
        matches!(seen, Ok(Some(_))),
        "the agent's handler observed cancellation"
    );
    sandbox.stop().await;
}

#[tokio::test]
async fn a_draining_instance_finishes_its_call_and_receives_no_new_ones() {
    let sandbox = Sandbox::start().await;
    let release = Arc::new(Notify::new());
    let (started_tx, mut started_rx) = mpsc::unbounded_channel::<String>();
    let make = |id: &str| {
        let release = release.clone();
        let started_tx = started_tx.clone();
        AgentRuntime::new(sandbox.agent_config("worker", id)).handle(
            "work",
            "1.0.0",
            move |ctx: HandlerContext, m: ReachMessage| {
                let release = release.clone();
                let started_tx = started_tx.clone();
                async move {
                    if m.payload.unwrap_or_default().first_text() == Some("slow") {
                        let _ = started_tx.send(ctx.instance_id.to_string());
                        release.notified().await;
                    }
                    Ok(Payload::text("t", ctx.instance_id.to_string()))
                }
            },
        )
    };
    let mut agents = HashMap::new();
    for id in ["worker-a", "worker-b"] {
        agents.insert(id.to_string(), sandbox.start_agent(make(id)).await);
    }
    let mesh = sandbox.mesh().await;
    let slow_call = {
        let mesh = mesh.clone();
        tokio::spawn(async move {
            mesh.call("work", Payload::text("t", "slow"), CallOptions::default())
                .await
        })
    };
    let busy = started_rx.recv().await.unwrap();
    let other = if busy == "worker-a" {
        "worker-b"
    } else {
        "worker-a"
    };
    let busy_endpoint = sandbox
        .plane
        .registry()
        .unwrap()
        .view()
        .list("worker", "")
        .instances
        .into_iter()
        .map(|i| i.spec.unwrap())
        .find(|spec| spec.instance_id == busy)
        .unwrap()
        .endpoint;
    let draining = agents.remove(&busy).unwrap();
    let drain = tokio::spawn(draining.drain());
    // Readiness probes see the drain at once, while the call still runs.
    let health = tonic_health::pb::health_client::HealthClient::new(
        tonic::transport::Endpoint::from_shared(busy_endpoint)
            .unwrap()
            .connect()
            .await
            .unwrap(),
    );
    for service in ["reach.v1.AgentService", ""] {
        eventually(Duration::from_secs(3), || {
            let mut health = health.clone();
            async move {
                let request = tonic_health::pb::HealthCheckRequest {
                    service: service.into(),
                };
                health.check(request).await.unwrap().into_inner().status()
                    == tonic_health::pb::health_check_response::ServingStatus::NotServing
            }
        })
        .await;
    }

    let table = sandbox.plane.router().unwrap().table().clone();
    eventually(Duration::from_secs(3), || {
        let table = table.clone();
        let busy = busy.clone();
        async move { table.instances().iter().all(|i| i.instance_id != busy) }
    })
    .await;
    for _ in 0..20 {
        let reply = mesh
            .call("work", Payload::text("t", "fast"), CallOptions::default())
            .await
            .unwrap();
        assert_eq!(
            reply.route.unwrap().instance_id,
            other,
            "no new work for the draining instance"
        );
    }
    assert!(
        !drain.is_finished(),
        "the drain waits for the in-flight call"
    );
    release.notify_waiters();
    let finished = slow_call.await.unwrap().unwrap();
    assert_eq!(
        reply_text(&finished),
        busy,
        "the in-flight call completed on the draining instance"
    );
    drain.await.unwrap().unwrap();
    let registered = sandbox.plane.registry().unwrap().view().list("worker", "");
    assert_eq!(
        registered.instances.len(),
        1,
        "the drained instance deregistered"
    );
    sandbox.stop().await;
}

#[tokio::test]
async fn trace_ids_are_validated_assigned_fresh_or_taken_from_traceparent() {
    let sandbox = Sandbox::start().await;
    let _a = sandbox
        .start_agent(echo_agent(&sandbox, "echoer", "echoer-1"))
        .await;
    let mut router = sandbox.router_client().await;
    let echo = || header::Target::Capability("echo".into());

    let err = router
        .call(CallRequest {
            message: Some(message(echo(), "NOT-A-TRACE-ID", "x")),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(reason_of(&err).as_deref(), Some("INVALID_TRACE_ID"));

    let mut assigned = Vec::new();
    for _ in 0..2 {
        let reply = router
            .call(CallRequest {
                message: Some(message(echo(), "", "x")),
            })
            .await
            .unwrap()
            .into_inner();
        let route_trace = reply.route.unwrap().trace_id;
        reach_rpc::trace::TraceId::parse(&route_trace).expect("a valid W3C trace id");
        assert_eq!(
            reply.message.unwrap().header.unwrap().trace_id,
            route_trace,
            "the reply carries it"
        );
        assigned.push(route_trace);
    }
    assert_ne!(assigned[0], assigned[1], "ids are never reused");

    let mut with_parent = tonic::Request::new(CallRequest {
        message: Some(message(echo(), "", "x")),
    });
    with_parent.metadata_mut().insert(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            .parse()
            .unwrap(),
    );
    let reply = router.call(with_parent).await.unwrap().into_inner();
    assert_eq!(
        reply.route.unwrap().trace_id,
        "4bf92f3577b34da6a3ce929d0e0e4736"
    );
    sandbox.stop().await;
}

#[tokio::test]
async fn an_oversized_message_is_refused_naming_both_sizes() {
    let mut config = ReachConfig::default();
    config.router.max_message_bytes = 64 * 1024;
    let sandbox = Sandbox::start_with(config).await;
    let _a = sandbox
        .start_agent(echo_agent(&sandbox, "echoer", "echoer-1"))
        .await;
    let big = "x".repeat(100 * 1024);
    let err = sandbox
        .mesh()
        .await
        .call("echo", Payload::text("t", big), CallOptions::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert_eq!(reason_of(&err).as_deref(), Some("PAYLOAD_TOO_LARGE"));
    assert!(err.message().contains("65536"), "{}", err.message());
    let size: usize = metadata_of(&err)["size_bytes"].parse().unwrap();
    assert!(size > 100 * 1024, "{size}");
    sandbox.stop().await;
}

#[tokio::test]
async fn a_message_without_target_is_refused() {
    let sandbox = Sandbox::start().await;
    let err = sandbox
        .router_client()
        .await
        .call(CallRequest {
            message: Some(ReachMessage {
                header: Some(Header::default()),
                payload: None,
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("header.capability"),
        "{}",
        err.message()
    );
    sandbox.stop().await;
}

#[tokio::test]
async fn an_instance_reports_each_running_message_once_in_its_load() {
    let sandbox = Sandbox::start().await;
    let release = Arc::new(Notify::new());
    let (started_tx, mut started_rx) = mpsc::unbounded_channel::<()>();
    let agent = {
        let release = release.clone();
        AgentRuntime::new(sandbox.agent_config("loaded", "loaded-1")).handle(
            "work",
            "1.0.0",
            move |_ctx: HandlerContext, _m: ReachMessage| {
                let release = release.clone();
                let started_tx = started_tx.clone();
                async move {
                    let _ = started_tx.send(());
                    release.notified().await;
                    Ok(Payload::text("t", "done"))
                }
            },
        )
    };
    let running = sandbox.start_agent(agent).await;
    let mesh = sandbox.mesh().await;
    let call = tokio::spawn(async move {
        mesh.call("work", Payload::text("t", "x"), CallOptions::default())
            .await
    });
    started_rx.recv().await.unwrap();
    assert_eq!(
        running.in_flight(),
        1,
        "one message in flight, counted once"
    );
    // The heartbeat (every third of the 1 s lease) reports the same load to the registry.
    let registry = sandbox.plane.registry().unwrap().view().clone();
    eventually(Duration::from_secs(3), || {
        let registry = registry.clone();
        async move {
            registry
                .list("loaded", "")
                .instances
                .first()
                .is_some_and(|i| i.in_flight == 1)
        }
    })
    .await;
    release.notify_waiters();
    call.await.unwrap().unwrap();
    sandbox.stop().await;
}

#[tokio::test]
async fn a_handler_failing_on_its_own_undelivered_call_is_not_taken_for_undelivered() {
    let sandbox = Sandbox::start().await;
    let mesh = sandbox.mesh().await;
    let inner = mesh.clone();
    let runtime = AgentRuntime::new(sandbox.agent_config("relay", "relay-1")).handle(
        "relay.forward",
        "1.0.0",
        move |ctx: HandlerContext, message: ReachMessage| {
            let mesh = inner.clone();
            async move {
                // The natural code: the nested call's error propagates with `?`.
                let reply = mesh
                    .call(
                        "nothing.serves.this",
                        message.payload.unwrap_or_default(),
                        CallOptions::within(&ctx),
                    )
                    .await?;
                Ok(reply
                    .message
                    .unwrap_or_default()
                    .payload
                    .unwrap_or_default())
            }
        },
    );
    let _relay = sandbox.start_agent(runtime).await;
    let err = mesh
        .call(
            "relay.forward",
            Payload::text("t", "x"),
            CallOptions::default(),
        )
        .await
        .unwrap_err();
    // Not ROUTE_NOT_FOUND: relay.forward was routed and ran; what failed was its own call.
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(reason_of(&err), None);
    assert!(
        err.message().starts_with("a call this handler made failed: no routable instance serves capability \"nothing.serves.this\""),
        "{}",
        err.message()
    );
    sandbox.stop().await;
}
