//! Publish, asynchronous replies across router replicas, versioned capabilities with
//! adapters, strict registration, payload validation, and registry snapshots sent in parts.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use futures::StreamExt as _;
use reach_proto::v1::{Payload, ReachMessage};
use reach_registry::RegistryConfig;
use reach_router::RouterConfig;
use reach_sdk::{AgentConfig, AgentRuntime, CallOptions, HandlerContext, MeshClient};
use tonic::Code;

fn example_registry() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/protocol-registry.yaml")
}

/// A router that loads the example protocol registry (schemas, versions, adapters).
async fn router_with_protocols(registry_url: &str) -> TestRouter {
    router(
        registry_url,
        RouterConfig {
            protocol_registry: Some(example_registry()),
            ..RouterConfig::default()
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_reaches_every_subscriber_and_counts_failures() {
    let registry = registry().await;
    let seen = Arc::new(AtomicUsize::new(0));
    let mut agents = Vec::new();
    for (id, fail) in [("sub-1", false), ("sub-2", false), ("sub-3", true)] {
        let mut config = config("subscriber", id, &registry.url);
        config.topics = vec!["complaints.new".into()];
        let seen = seen.clone();
        let runtime = AgentRuntime::new(config).handle(
            "notify",
            "1.0.0",
            move |_c: HandlerContext, _m: ReachMessage| {
                let seen = seen.clone();
                async move {
                    seen.fetch_add(1, Ordering::SeqCst);
                    if fail {
                        Err(tonic::Status::internal("subscriber broke"))
                    } else {
                        Ok(Payload::text("ok", ""))
                    }
                }
            },
        );
        agents.push(agent(runtime).await.0);
    }
    // Not subscribed: never sees the message.
    let other = Arc::new(AtomicUsize::new(0));
    agents.push(
        agent(echo_agent(
            config("other", "other-1", &registry.url),
            "notify",
            other.clone(),
        ))
        .await
        .0,
    );
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(4).await;
    let client = router.client().await;
    let response = client
        .publish(
            "complaints.new",
            Payload::text("notify", "hello"),
            CallOptions::default(),
        )
        .await
        .unwrap();
    assert_eq!(
        (response.delivered, response.failed),
        (2, 1),
        "{response:?}"
    );
    assert_eq!(response.failures[0].instance_id, "sub-3");
    // The code is named as the proto documents it: the gRPC code name.
    assert_eq!(response.failures[0].code, "INTERNAL");
    assert_eq!(response.failures[0].message, "subscriber broke");
    assert_eq!(seen.load(Ordering::SeqCst), 3);
    assert_eq!(other.load(Ordering::SeqCst), 0);
    // No subscriber: nothing delivered, nothing failed.
    let none = client
        .publish(
            "nobody.listens",
            Payload::text("notify", ""),
            CallOptions::default(),
        )
        .await
        .unwrap();
    assert_eq!((none.delivered, none.failed), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_reply_sent_to_another_replica_completes_the_waiting_call() {
    let registry = registry().await;
    // Two replicas that share nothing but the registry.
    let first = router(&registry.url, RouterConfig::default()).await;
    let second = router(&registry.url, RouterConfig::default()).await;
    let replier = MeshClient::connect(&second.url, "slowpoke.worker")
        .await
        .unwrap();
    let (_agent, _) = agent(
        AgentRuntime::new(config("slowpoke", "slowpoke-1", &registry.url)).handle(
            "report.build",
            "1.0.0",
            move |ctx: HandlerContext, message: ReachMessage| {
                let replier = replier.clone();
                async move {
                    assert!(!ctx.reply_to.is_empty());
                    let question = message
                        .payload
                        .unwrap_or_default()
                        .first_text()
                        .unwrap_or("")
                        .to_string();
                    // Acknowledge now, answer later through the other replica.
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        let delivered = replier
                            .reply(
                                &ctx,
                                Payload::text("report", format!("report on {question}")),
                            )
                            .await
                            .expect("reply accepted");
                        assert!(delivered, "the waiting call took the reply");
                    });
                    Ok(HandlerContext::ack())
                }
            },
        ),
    )
    .await;
    first.wait_routable(1).await;
    let client = first.client().await;
    let mut message = client.message_to_capability(
        "report.build",
        Payload::text("t", "Q3"),
        &CallOptions::default(),
    );
    message.header.as_mut().unwrap().reply_to = "async".into();
    let reply = client
        .send(message, Some(Duration::from_secs(10)))
        .await
        .unwrap();
    let reply = reply.message.unwrap();
    assert_eq!(reply.payload.unwrap().first_text(), Some("report on Q3"));
    assert!(!reply.header.unwrap().correlation_id.is_empty());
}

/// An agent serving `complaint.summarize` at `version`, echoing its input data back as
/// `{"abstract": <text or narrative>, ...input}` (v2 shape) or `{"summary": ...}` (v1).
fn summarizer(registry: &str, id: &str, version: &'static str) -> AgentRuntime {
    AgentRuntime::new(config("summarizer", id, registry)).handle(
        "complaint.summarize",
        version,
        move |_c: HandlerContext, message: ReachMessage| async move {
            let mut input = message
                .payload
                .unwrap_or_default()
                .first_json()
                .unwrap_or_default();
            let object = input.as_object_mut().expect("object input");
            if version.starts_with('2') {
                let text = object
                    .get("text")
                    .cloned()
                    .ok_or_else(|| tonic::Status::invalid_argument("v2 needs `text`"))?;
                object.insert("abstract".into(), text);
            } else {
                let text = object.get("narrative").cloned().unwrap_or_default();
                object.insert("summary".into(), text);
            }
            object.insert("served_by".into(), serde_json::json!(version));
            Ok(Payload::json("complaint.summary", &input))
        },
    )
}

async fn summarize(
    client: &MeshClient,
    requirement: &str,
    input: serde_json::Value,
) -> Result<serde_json::Value, tonic::Status> {
    let reply = client
        .call(
            "complaint.summarize",
            Payload::json("complaint.summarize_request", &input),
            CallOptions {
                capability_version: Some(requirement.into()),
                ..CallOptions::default()
            },
        )
        .await?;
    Ok(reply
        .message
        .unwrap()
        .payload
        .unwrap()
        .first_json()
        .unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_adapter_bridges_callers_and_keeps_unknown_fields() {
    let registry = registry().await;
    let (_v2, _) = agent(summarizer(&registry.url, "sum-v2", "2.0.0")).await;
    let router = router_with_protocols(&registry.url).await;
    router.wait_routable(1).await;
    let client = router.client().await;

    // A 1.x caller reaches the 2.0.0 instance through the adapter, both ways.
    let out = summarize(
        &client,
        "^1",
        serde_json::json!({"narrative": "late fees", "max_words": 5, "x_trace": {"keep": [1, 2]}}),
    )
    .await
    .unwrap();
    assert_eq!(out["served_by"], "2.0.0");
    assert_eq!(out["summary"], "late fees");
    assert!(out.get("abstract").is_none());
    assert_eq!(out["max_words"], 5);
    assert_eq!(out["x_trace"], serde_json::json!({"keep": [1, 2]}));

    // No instance and no adapter for 3.x.
    let status = summarize(&client, "^3", serde_json::json!({"text": "x"}))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(reason(&status), "VERSION_NOT_SUPPORTED");
    assert!(status.message().contains("2.0.0"), "{}", status.message());

    // Once a compatible 1.0.0 instance exists it is preferred over adapting.
    let (_v1, _) = agent(summarizer(&registry.url, "sum-v1", "1.0.0")).await;
    router.wait_routable(2).await;
    let out = summarize(&client, "^1", serde_json::json!({"narrative": "fees"}))
        .await
        .unwrap();
    assert_eq!(out["served_by"], "1.0.0");
    assert_eq!(out["summary"], "fees");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_adapter_says_which_message_it_could_not_rewrite() {
    let registry = registry().await;
    // A 2.0.0 instance whose reply is not the object the 1.x adapter rewrites.
    let served = Arc::new(AtomicUsize::new(0));
    let seen = served.clone();
    let odd = AgentRuntime::new(config("summarizer", "sum-v2-odd", &registry.url)).handle(
        "complaint.summarize",
        "2.0.0",
        move |_c: HandlerContext, _m: ReachMessage| {
            seen.fetch_add(1, Ordering::SeqCst);
            async move {
                Ok(Payload::json(
                    "complaint.summary",
                    &serde_json::json!(["not", "an", "object"]),
                ))
            }
        },
    );
    let (_odd, _) = agent(odd).await;
    // Without payload validation, nothing stops a request the adapter cannot rewrite
    // before the adapter itself.
    let router = router(
        &registry.url,
        RouterConfig {
            protocol_registry: Some(example_registry()),
            validate_payloads: false,
            ..RouterConfig::default()
        },
    )
    .await;
    router.wait_routable(1).await;
    let client = router.client().await;

    // The caller's payload does not fit the request transform: the caller's mistake.
    let status = summarize(&client, "^1", serde_json::json!(["late fees"]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(reason(&status), "ADAPTER_FAILED");
    let metadata = reach_rpc::errors::metadata_of(&status);
    assert_eq!(metadata["direction"], "request");
    assert!(
        metadata["adapter"].contains("complaint.summarize"),
        "{metadata:?}"
    );
    assert!(status.message().contains("request"), "{}", status.message());
    assert_eq!(served.load(Ordering::SeqCst), 0, "the instance saw it");

    // The instance's reply does not fit the reply transform: not the caller's mistake.
    let status = summarize(&client, "^1", serde_json::json!({"narrative": "fees"}))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    assert_eq!(reason(&status), "ADAPTER_FAILED");
    assert_eq!(
        reach_rpc::errors::metadata_of(&status)["direction"],
        "reply"
    );
    assert_eq!(served.load(Ordering::SeqCst), 1);
}

/// The first data part of a stream reply.
fn json_of(reply: reach_proto::v1::StreamResponse) -> serde_json::Value {
    reply
        .message
        .unwrap()
        .payload
        .unwrap()
        .first_json()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_reply_of_a_routed_stream_names_the_message_it_answers() {
    let registry = registry().await;
    let echo = AgentRuntime::new(config("echoer", "echoer-stream", &registry.url)).handle_stream(
        "stream.echo",
        "1.0.0",
        |_ctx: HandlerContext, first: ReachMessage, rest: reach_sdk::handler::InboundMessages| {
            futures::stream::once(async move { Ok(first) })
                .chain(rest)
                .map(|message| Ok(message?.payload.unwrap_or_default()))
        },
    );
    let (_echo, _) = agent(echo).await;
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;
    let client = router.client().await;
    let message = |id: &str| {
        let mut message = client.message_to_capability(
            "stream.echo",
            Payload::text("t", id),
            &CallOptions::default(),
        );
        message.header.as_mut().unwrap().message_id = id.to_string();
        message
    };
    let rest = futures::stream::iter(vec![message("m-2"), message("m-3")]);
    let mut replies = client
        .stream(message("m-1"), rest, Some(Duration::from_secs(10)))
        .await
        .unwrap();
    let mut answered = Vec::new();
    while let Some(reply) = replies.message().await.unwrap() {
        let message = reply.message.unwrap();
        answered.push((
            message.header.unwrap().correlation_id,
            message.payload.unwrap().first_text().unwrap().to_string(),
        ));
    }
    assert_eq!(
        answered,
        [("m-1", "m-1"), ("m-2", "m-2"), ("m-3", "m-3")]
            .map(|(c, t)| (c.to_string(), t.to_string()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_adapter_rewrites_every_message_of_a_stream_both_ways() {
    let registry = registry().await;
    // A 2.0.0 stream summarizer: wants `text`, answers `abstract`.
    let v2 = AgentRuntime::new(config("summarizer", "sum-v2-stream", &registry.url)).handle_stream(
        "complaint.summarize",
        "2.0.0",
        |_ctx: HandlerContext, first: ReachMessage, rest: reach_sdk::handler::InboundMessages| {
            futures::stream::once(async move { Ok(first) })
                .chain(rest)
                .map(|message| {
                    let mut input = message?
                        .payload
                        .unwrap_or_default()
                        .first_json()
                        .unwrap_or_default();
                    let object = input.as_object_mut().expect("object input");
                    let text = object
                        .get("text")
                        .cloned()
                        .ok_or_else(|| tonic::Status::invalid_argument("v2 needs `text`"))?;
                    object.insert("abstract".into(), text);
                    Ok(Payload::json("complaint.summary", &input))
                })
        },
    );
    let (_v2, _) = agent(v2).await;
    let router = router_with_protocols(&registry.url).await;
    router.wait_routable(1).await;
    let client = router.client().await;
    let v1 = CallOptions {
        capability_version: Some("^1".into()),
        ..CallOptions::default()
    };
    let request = |input: serde_json::Value| {
        client.message_to_capability(
            "complaint.summarize",
            Payload::json("complaint.summarize_request", &input),
            &v1,
        )
    };
    let message =
        |narrative: &str, n: u32| request(serde_json::json!({"narrative": narrative, "x_seq": n}));
    let rest = futures::stream::iter(vec![message("fees", 2), message("escrow", 3)]);
    let mut replies = client
        .stream(message("late fees", 1), rest, Some(Duration::from_secs(10)))
        .await
        .unwrap();
    let mut seen = Vec::new();
    while let Some(reply) = replies.message().await.unwrap() {
        let out = json_of(reply);
        // The 1.x caller sees its own version's fields on every message, and its unknown
        // fields untouched.
        assert!(out.get("abstract").is_none(), "{out}");
        seen.push((out["summary"].clone(), out["x_seq"].clone()));
    }
    assert_eq!(
        seen,
        vec![
            (serde_json::json!("late fees"), serde_json::json!(1)),
            (serde_json::json!("fees"), serde_json::json!(2)),
            (serde_json::json!("escrow"), serde_json::json!(3)),
        ]
    );

    // Every message is checked against the input schema: a bad first message is refused
    // before the stream opens, a bad later one ends the stream with the refusal.
    let bad = |n: u32| request(serde_json::json!({"narrative": 5, "x_seq": n}));
    let status = client
        .stream(bad(1), futures::stream::empty(), None)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(reason(&status), "INVALID_PAYLOAD");
    // The refusal resets the instance's stream; when that happens before the instance
    // answered, it is the answer to opening the stream.
    let opened = client
        .stream(
            message("fine", 1),
            futures::stream::iter(vec![bad(2)]),
            Some(Duration::from_secs(10)),
        )
        .await;
    let status = match opened {
        Err(status) => status,
        Ok(mut replies) => loop {
            match replies.message().await {
                // The reply to the good message may or may not arrive before the refusal.
                Ok(Some(reply)) => {
                    let out = json_of(reply);
                    assert_eq!(
                        out["x_seq"], 1,
                        "the bad message reached the instance: {out}"
                    );
                }
                Ok(None) => panic!("the stream ended without refusing the bad message"),
                Err(status) => break status,
            }
        },
    };
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(reason(&status), "INVALID_PAYLOAD");

    // No adapter to 3.x: the stream is refused before it opens.
    let three = CallOptions {
        capability_version: Some("^3".into()),
        ..CallOptions::default()
    };
    let first = client.message_to_capability(
        "complaint.summarize",
        Payload::json(
            "complaint.summarize_request",
            &serde_json::json!({"text": "x"}),
        ),
        &three,
    );
    let status = client
        .stream(first, futures::stream::empty(), None)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(reason(&status), "VERSION_NOT_SUPPORTED");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_registry_refuses_undeclared_capabilities() {
    let registry = registry_with(RegistryConfig {
        health_probe: false,
        strict: true,
        protocol_registry: Some(example_registry()),
        ..RegistryConfig::default()
    })
    .await;
    let spec = |capability: &str, version: &str| reach_proto::v1::InstanceSpec {
        service: "s".into(),
        instance_id: "s-1".into(),
        endpoint: "http://127.0.0.1:9".into(),
        capabilities: vec![reach_proto::v1::Capability {
            name: capability.into(),
            version: version.into(),
            ..Default::default()
        }],
        ..Default::default()
    };
    let mut client = reach_proto::v1::registry_service_client::RegistryServiceClient::connect(
        registry.url.clone(),
    )
    .await
    .unwrap();
    let status = client
        .register(reach_proto::v1::RegisterRequest {
            instance: Some(spec("complaint.teleport", "1.0.0")),
            lease_ttl: None,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(reason(&status), "CAPABILITY_NOT_DECLARED");
    assert!(
        status.message().contains("complaint.teleport"),
        "{}",
        status.message()
    );
    let status = client
        .register(reach_proto::v1::RegisterRequest {
            instance: Some(spec("complaint.summarize", "9.0.0")),
            lease_ttl: None,
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&status), "CAPABILITY_NOT_DECLARED");
    client
        .register(reach_proto::v1::RegisterRequest {
            instance: Some(spec("complaint.summarize", "2.0.0")),
            lease_ttl: None,
        })
        .await
        .expect("a declared capability registers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_that_breaks_the_input_schema_is_refused_with_its_pointer() {
    let registry = registry().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let (_agent, _) = agent(echo_agent(
        AgentConfig {
            ..config("ingest", "ingest-1", &registry.url)
        },
        "complaint.ingest",
        runs.clone(),
    ))
    .await;
    let router = router_with_protocols(&registry.url).await;
    router.wait_routable(1).await;
    let client = router.client().await;
    let status = client
        .call(
            "complaint.ingest",
            Payload::json(
                "complaint.ingest_request",
                &serde_json::json!({"csv": "Complaint ID\n1\n", "concurrency": "lots"}),
            ),
            CallOptions::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(reason(&status), "INVALID_PAYLOAD");
    assert_eq!(
        reach_rpc::errors::metadata_of(&status)
            .get("pointer")
            .map(String::as_str),
        Some("/concurrency")
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    client
        .call(
            "complaint.ingest",
            Payload::json(
                "complaint.ingest_request",
                &serde_json::json!({"csv": "Complaint ID\n1\n", "concurrency": 4}),
            ),
            CallOptions::default(),
        )
        .await
        .expect("a valid payload goes through");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A protocol registry with one capability, `contact.add`, whose input nests an object with
/// a required `email` (format `email`).
const CONTACT_REGISTRY: &str = r#"
capabilities:
  contact.add:
    versions: ["1.0.0"]
    input: contact.add_request
message_types:
  contact.add_request:
    schema:
      type: object
      required: [customer]
      properties:
        customer:
          type: object
          required: [name, email]
          properties:
            name: {type: string}
            email: {type: string, format: email}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_payload_names_the_nested_property_and_the_keyword() {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), CONTACT_REGISTRY).unwrap();
    let registry = registry().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let (_agent, _) = agent(echo_agent(
        config("contacts", "contacts-1", &registry.url),
        "contact.add",
        runs.clone(),
    ))
    .await;
    let config = RouterConfig {
        protocol_registry: Some(file.path().to_path_buf()),
        ..RouterConfig::default()
    };
    let router = router(&registry.url, config).await;
    router.wait_routable(1).await;
    let client = router.client().await;
    let call = |customer: serde_json::Value| {
        let client = client.clone();
        async move {
            client
                .call(
                    "contact.add",
                    Payload::json(
                        "contact.add_request",
                        &serde_json::json!({ "customer": customer }),
                    ),
                    CallOptions::default(),
                )
                .await
        }
    };
    let refusal = |status: tonic::Status| {
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert_eq!(reason(&status), "INVALID_PAYLOAD");
        let metadata = reach_rpc::errors::metadata_of(&status);
        (metadata["pointer"].clone(), metadata["keyword"].clone())
    };
    for (customer, pointer, keyword) in [
        (
            serde_json::json!({"name": 7, "email": "a@example.com"}),
            "/customer/name",
            "type",
        ),
        (
            serde_json::json!({"name": "Ann"}),
            "/customer/email",
            "required",
        ),
        (
            serde_json::json!({"name": "Ann", "email": "not an email"}),
            "/customer/email",
            "format",
        ),
    ] {
        let status = call(customer.clone()).await.unwrap_err();
        assert_eq!(
            refusal(status),
            (pointer.to_string(), keyword.to_string()),
            "{customer}"
        );
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "no refused payload was delivered"
    );
    call(serde_json::json!({"name": "Ann", "email": "ann@example.com"}))
        .await
        .expect("a valid payload goes through");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_that_has_not_synced_with_its_registry_says_so_and_that_nothing_was_sent() {
    use reach_proto::v1::router_service_client::RouterServiceClient;
    use reach_proto::v1::{CallRequest, Header, header};

    // The registry is not there (yet): the router cannot know who serves anything.
    let (registry, _) = dead_endpoint().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let router = reach_router::Router::new(RouterConfig {
        registry_endpoint: registry.clone(),
        ..RouterConfig::default()
    })
    .unwrap();
    let watch = router.spawn_registry_watch();
    let stop = tokio_util::sync::CancellationToken::new();
    let server = router.add_to(reach_rpc::GrpcServer::new());
    tokio::spawn(server.serve(listener, stop.clone().cancelled_owned()));
    let mut client = RouterServiceClient::connect(url).await.unwrap();
    let refused = client
        .call(CallRequest {
            message: Some(ReachMessage {
                header: Some(Header {
                    target: Some(header::Target::Capability("echo.say".into())),
                    ..Default::default()
                }),
                payload: Some(Payload::text("echo.request", "hi")),
            }),
        })
        .await
        .unwrap_err();
    // UNAVAILABLE with the not-delivered reason: callers retry it, unlike ROUTE_NOT_FOUND.
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert_eq!(reason(&refused), "INSTANCE_UNAVAILABLE");
    assert!(
        refused
            .message()
            .contains("has not synced with the registry")
            && refused.message().contains(&registry),
        "{}",
        refused.message()
    );
    stop.cancel();
    watch.abort();
}

/// A registry snapshot of more than `SNAPSHOT_PART_BYTES` arrives in parts: every part but
/// the last says more follow, all carry one revision, and a router applies their union.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_larger_than_one_part_reaches_a_router_whole() {
    use reach_proto::v1::registry_service_client::RegistryServiceClient;
    use reach_proto::v1::{Capability, InstanceSpec, WatchRequest, watch_response};

    let registry = registry().await;
    // 100 instances of about 15 KiB each: a snapshot of about 1.5 MiB.
    let count = 100;
    for i in 0..count {
        let spec = InstanceSpec {
            service: "svc.wide".into(),
            instance_id: format!("wide-{i}"),
            endpoint: "http://127.0.0.1:9".into(),
            capabilities: vec![Capability {
                name: "wide.echo".into(),
                version: "1.0.0".into(),
                ..Default::default()
            }],
            protocol_version: "1.0".into(),
            weight: 1,
            labels: [("note".to_string(), "x".repeat(15 * 1024))].into(),
            ..InstanceSpec::default()
        };
        registry
            .registry
            .register(spec, Some(Duration::from_secs(60)))
            .unwrap();
    }
    let mut watch = RegistryServiceClient::connect(registry.url.clone())
        .await
        .unwrap()
        .watch(WatchRequest::default())
        .await
        .unwrap()
        .into_inner();
    let mut parts = Vec::new();
    loop {
        let event = watch.message().await.unwrap().unwrap();
        let Some(watch_response::Event::Snapshot(snapshot)) = event.event else {
            panic!("expected a snapshot part, got {event:?}");
        };
        let continues = snapshot.continues;
        parts.push((event.revision, snapshot));
        if !continues {
            break;
        }
    }
    assert!(parts.len() >= 2, "a 1.5 MiB snapshot came in one part");
    let revision = parts[0].0;
    let mut ids = std::collections::BTreeSet::new();
    for (part_revision, snapshot) in &parts {
        assert_eq!(*part_revision, revision);
        assert!(
            prost::Message::encoded_len(snapshot)
                <= reach_registry::service::SNAPSHOT_PART_BYTES + 16 * 1024
        );
        ids.extend(
            snapshot
                .instances
                .iter()
                .map(|i| i.spec.as_ref().unwrap().instance_id.clone()),
        );
    }
    assert_eq!(ids.len(), count);

    let router = router(&registry.url, RouterConfig::default()).await;
    assert_eq!(router.router.table().instances().len(), count);
    assert_eq!(router.router.table().revision(), revision);
}
