//! What the agent kit builds on, through a real registry and router on 127.0.0.1: the turn
//! loop guard (`max_turn`) on every routed path, a handler's reply metadata reaching its
//! caller, capability descriptors registered by an agent and served by ListCapabilities,
//! and model-bound agents seen BUSY.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{
    CallRequest, Capability, DescriptorSource, InstanceSpec, InstanceState,
    ListCapabilitiesRequest, Payload, ReachMessage, RegisterRequest,
};
use reach_registry::RegistryConfig;
use reach_router::RouterConfig;
use reach_rpc::errors::reason;
use reach_rpc::usage::TokenUsage;
use reach_sdk::{AgentRuntime, CallOptions, DescribedCapability, HandlerContext, MeshClient};
use tonic::Code;

fn example_registry() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/protocol-registry.yaml")
}

/// An agent for `capability` that reports token usage in its reply metadata and records the
/// turn and trace id of each message it handles.
fn usage_agent(
    registry: &str,
    capability: &str,
    seen: Arc<Mutex<Vec<(u32, String)>>>,
) -> AgentRuntime {
    AgentRuntime::new(config("kit.usage", "usage-1", registry)).handle(
        capability,
        "1.0.0",
        move |ctx: HandlerContext, _m: ReachMessage| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push((ctx.turn, ctx.trace_id.clone()));
                let mut metadata = std::collections::HashMap::new();
                TokenUsage {
                    input_tokens: 120,
                    output_tokens: 30,
                    model_calls: 1,
                }
                .write(&mut metadata);
                for (key, value) in metadata {
                    assert!(ctx.set_reply_metadata(key, value));
                }
                // Past the bounds: dropped, not sent.
                assert!(!ctx.set_reply_metadata("k".repeat(129), "v"));
                Ok(Payload::text("done", "ok"))
            }
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_sees_the_handlers_reply_metadata_on_call_and_call_mux() {
    let registry = registry().await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (_agent, _) = agent(usage_agent(&registry.url, "kit.work", seen.clone())).await;
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;

    let expected = TokenUsage {
        input_tokens: 120,
        output_tokens: 30,
        model_calls: 1,
    };
    // CallMux (the MeshClient's path), at turn 5.
    let client = router.client().await;
    let options = CallOptions {
        turn: Some(5),
        ..CallOptions::default()
    };
    let reply = client
        .call("kit.work", Payload::text("t", "x"), options)
        .await
        .unwrap();
    let header = reply.message.unwrap().header.unwrap();
    assert_eq!(TokenUsage::read(&header.metadata), Some(expected));
    assert_eq!(header.metadata.len(), 3, "{:?}", header.metadata);
    assert_eq!(header.turn, 6, "the reply is one hop on");

    // Unary Call, as a generated client sends it.
    let message =
        client.message_to_capability("kit.work", Payload::text("t", "y"), &CallOptions::default());
    let mut unary = RouterServiceClient::connect(router.url.clone())
        .await
        .unwrap();
    let reply = unary
        .call(CallRequest {
            message: Some(message),
        })
        .await
        .unwrap()
        .into_inner();
    let header = reply.message.unwrap().header.unwrap();
    assert_eq!(TokenUsage::read(&header.metadata), Some(expected));
    let turns: Vec<u32> = seen.lock().unwrap().iter().map(|(turn, _)| *turn).collect();
    assert_eq!(turns, [5, 0], "the handler sees each message's turn");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn within_continues_the_trace_one_turn_on() {
    let registry = registry().await;
    let router = router(&registry.url, RouterConfig::default()).await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (_inner, _) = agent(usage_agent(&registry.url, "kit.inner", seen.clone())).await;
    let mesh = router.client().await;
    let outer = AgentRuntime::new(config("kit.outer", "outer-1", &registry.url)).handle(
        "kit.outer",
        "1.0.0",
        move |ctx: HandlerContext, _m: ReachMessage| {
            let mesh = mesh.clone();
            async move {
                let options = CallOptions::within(&ctx);
                assert!(
                    options
                        .timeout
                        .is_some_and(|t| t <= Duration::from_secs(5) && t > Duration::ZERO),
                    "{options:?}"
                );
                let reply = mesh
                    .call("kit.inner", Payload::text("t", "inner"), options)
                    .await?;
                Ok(reply
                    .message
                    .unwrap_or_default()
                    .payload
                    .unwrap_or_default())
            }
        },
    );
    let (_outer, _) = agent(outer).await;
    router.wait_routable(2).await;

    let client = router.client().await;
    let options = CallOptions {
        turn: Some(2),
        timeout: Some(Duration::from_secs(5)),
        ..CallOptions::default()
    };
    let reply = client
        .call("kit.outer", Payload::text("t", "x"), options)
        .await
        .unwrap();
    let trace_id = reply.route.unwrap().trace_id;
    assert_eq!(*seen.lock().unwrap(), [(3, trace_id)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_refuses_a_turn_past_max_turn_on_call_call_mux_stream_and_publish() {
    let registry = registry().await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (_agent, _) = agent(usage_agent(&registry.url, "kit.work", seen.clone())).await;
    let router = router(
        &registry.url,
        RouterConfig {
            max_turn: 3,
            ..RouterConfig::default()
        },
    )
    .await;
    router.wait_routable(1).await;
    let client = router.client().await;
    let at = |turn| CallOptions {
        turn: Some(turn),
        ..CallOptions::default()
    };
    let refused = |status: &tonic::Status| {
        assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
        assert_eq!(reason(status), reason::TURN_LIMIT_EXCEEDED);
        let metadata = reach_rpc::errors::metadata_of(status);
        assert_eq!(metadata["turn"], "4");
        assert_eq!(metadata["limit"], "3");
        assert!(
            status.message().contains("turn 4") && status.message().contains("limit of 3"),
            "{}",
            status.message()
        );
    };

    // At the limit it goes through; one past it does not, on every path.
    client
        .call("kit.work", Payload::text("t", "x"), at(3))
        .await
        .unwrap();
    refused(
        &client
            .call("kit.work", Payload::text("t", "x"), at(4))
            .await
            .unwrap_err(),
    );
    let message = client.message_to_capability("kit.work", Payload::text("t", "x"), &at(4));
    let mut unary = RouterServiceClient::connect(router.url.clone())
        .await
        .unwrap();
    refused(
        &unary
            .call(CallRequest {
                message: Some(message.clone()),
            })
            .await
            .unwrap_err(),
    );
    let streamed = match client
        .stream(
            message,
            futures::stream::empty(),
            Some(Duration::from_secs(5)),
        )
        .await
    {
        Err(status) => status,
        Ok(mut replies) => replies.message().await.unwrap_err(),
    };
    refused(&streamed);
    refused(
        &client
            .publish("kit.topic", Payload::text("t", "x"), at(4))
            .await
            .unwrap_err(),
    );
    assert_eq!(
        seen.lock().unwrap().len(),
        1,
        "only the call at the limit ran"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_calling_itself_in_a_loop_is_stopped_at_max_turn() {
    let registry = registry().await;
    let router = router(
        &registry.url,
        RouterConfig {
            max_turn: 3,
            ..RouterConfig::default()
        },
    )
    .await;
    let mesh = router.client().await;
    let handled = Arc::new(AtomicU32::new(0));
    let counter = handled.clone();
    let looping = AgentRuntime::new(config("kit.loop", "loop-1", &registry.url)).handle(
        "kit.loop",
        "1.0.0",
        move |ctx: HandlerContext, m: ReachMessage| {
            let mesh = mesh.clone();
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                let reply = mesh
                    .call(
                        "kit.loop",
                        m.payload.unwrap_or_default(),
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
    let (_agent, _) = agent(looping).await;
    router.wait_routable(1).await;
    let status = router
        .client()
        .await
        .call(
            "kit.loop",
            Payload::text("t", "x"),
            CallOptions {
                timeout: Some(Duration::from_secs(5)),
                ..CallOptions::default()
            },
        )
        .await
        .unwrap_err();
    // Turns 0, 1, 2 and 3 ran; the call at turn 4 was refused, and the refusal came back.
    assert_eq!(handled.load(Ordering::SeqCst), 4);
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("turn 4"), "{}", status.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn described_capabilities_are_served_merged_with_the_protocol_registry() {
    let registry = registry_with(RegistryConfig {
        health_probe: false,
        protocol_registry: Some(example_registry()),
        ..RegistryConfig::default()
    })
    .await;
    let schema = serde_json::json!({
        "type": "object",
        "required": ["query"],
        "properties": {"query": {"type": "string"}}
    });
    let described = DescribedCapability::new("kit.search", "1.2.0")
        .description("search the knowledge base; not for live data")
        .input_schema(schema.clone())
        .output_schema(serde_json::json!({"type": "array"}));
    let runtime = AgentRuntime::new(config("kit.search", "search-1", &registry.url))
        .handle_described(described, |_c: HandlerContext, _m: ReachMessage| async {
            Ok(Payload::text("t", "found"))
        })
        // A declared capability served here too: the protocol registry's words win.
        .handle(
            "complaint.classify",
            "1.0.0",
            |_c: HandlerContext, _m: ReachMessage| async { Ok(Payload::text("t", "x")) },
        );
    let (_agent, _) = agent(runtime).await;
    eventually("the agent registers", || {
        registry.registry.list("", "").instances.len() == 1
    })
    .await;

    let mut client = RegistryServiceClient::connect(registry.url.clone())
        .await
        .unwrap();
    let list = client
        .list_capabilities(ListCapabilitiesRequest::default())
        .await
        .unwrap()
        .into_inner();
    let names: Vec<&str> = list.capabilities.iter().map(|c| c.name.as_str()).collect();
    let mut sorted = names.clone();
    sorted.sort_unstable();
    assert_eq!(names, sorted, "sorted by name");
    assert!(
        names.contains(&"complaint.ingest"),
        "declared, not served: {names:?}"
    );
    let search = list
        .capabilities
        .iter()
        .find(|c| c.name == "kit.search")
        .unwrap();
    assert_eq!(search.source(), DescriptorSource::Registration);
    assert_eq!(
        search.description,
        "search the knowledge base; not for live data"
    );
    let listed: serde_json::Value = serde_json::from_str(&search.input_schema).unwrap();
    assert_eq!(listed, schema);
    assert_eq!(search.output_schema, r#"{"type":"array"}"#);
    assert_eq!(search.versions, ["1.2.0"]);
    assert_eq!((search.routable_instances, search.instances), (1, 1));

    let classify = client
        .list_capabilities(ListCapabilitiesRequest {
            name_prefix: "complaint.class".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    assert_eq!(classify.len(), 1);
    assert_eq!(classify[0].source(), DescriptorSource::ProtocolRegistry);
    assert!(classify[0].idempotent);
    assert!(classify[0].input_schema.contains("narrative"));
    assert_eq!(
        (classify[0].routable_instances, classify[0].instances),
        (1, 1)
    );

    // A schema that is not one is refused at Register, naming the capability and field.
    let bad = RegisterRequest {
        instance: Some(InstanceSpec {
            service: "kit.bad".into(),
            instance_id: "bad-1".into(),
            endpoint: "http://127.0.0.1:9".into(),
            capabilities: vec![Capability {
                name: "kit.bad".into(),
                output_schema: r#"{"type": "no-such-type"}"#.into(),
                ..Default::default()
            }],
            ..Default::default()
        }),
        lease_ttl: None,
    };
    let status = client.register(bad).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains(
            "instance.capabilities[0] (\"kit.bad\") output_schema is not a valid JSON Schema"
        ),
        "{}",
        status.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_with_its_model_slots_full_is_busy_and_work_goes_to_the_other() {
    let registry = registry().await;
    let router = router(&registry.url, RouterConfig::default()).await;
    let mut agents = Vec::new();
    for id in ["model-a", "model-b"] {
        let runtime = echo_agent(
            config("kit.model", id, &registry.url).with_model_slots(1),
            "kit.model",
            Arc::new(AtomicUsize::new(0)),
        );
        agents.push(agent(runtime).await.0);
    }
    router.wait_routable(2).await;

    // Agent a's only model slot is taken (a long model call): its next heartbeat, sent at
    // once, reports BUSY with the model's load.
    let slot = agents[0].model_slots().acquire().await;
    let state_of = |id: &str| {
        registry
            .registry
            .list("", "")
            .instances
            .into_iter()
            .find(|i| i.spec.as_ref().is_some_and(|s| s.instance_id == id))
    };
    eventually("the registry sees model-a BUSY", || {
        state_of("model-a").is_some_and(|i| {
            i.state() == InstanceState::Busy
                && i.model_calls_in_flight == 1
                && i.model_slots_free == 0
        })
    })
    .await;
    eventually("the router sees model-a BUSY", || {
        router
            .router
            .table()
            .instances()
            .iter()
            .any(|i| i.instance_id == "model-a" && i.state == InstanceState::Busy)
    })
    .await;
    let client: MeshClient = router.client().await;
    for _ in 0..20 {
        let reply = client
            .call("kit.model", Payload::text("t", "x"), CallOptions::default())
            .await
            .unwrap();
        assert_eq!(reply.route.unwrap().instance_id, "model-b");
    }

    // The slot frees: READY again, with one slot free.
    drop(slot);
    eventually("model-a READY again", || {
        state_of("model-a")
            .is_some_and(|i| i.state() == InstanceState::Ready && i.model_slots_free == 1)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_stream_reply_carries_the_metadata_set_since_the_previous_one() {
    let registry = registry().await;
    let runtime = AgentRuntime::new(config("kit.talk", "talk-1", &registry.url)).handle_stream(
        "kit.talk",
        "1.0.0",
        |ctx: HandlerContext, first: ReachMessage, _rest: reach_sdk::handler::InboundMessages| {
            assert_eq!(first.header.unwrap_or_default().turn, 7);
            ctx.set_reply_metadata("opened", "yes");
            futures::stream::unfold(0u32, move |step| {
                let ctx = ctx.clone();
                async move {
                    (step < 2).then(|| {
                        ctx.set_reply_metadata("step", step.to_string());
                        (Ok(Payload::text("t", format!("part {step}"))), step + 1)
                    })
                }
            })
        },
    );
    let (_agent, _) = agent(runtime).await;
    let router = router(&registry.url, RouterConfig::default()).await;
    router.wait_routable(1).await;
    let client = router.client().await;
    let options = CallOptions {
        turn: Some(7),
        ..CallOptions::default()
    };
    let first = client.message_to_capability("kit.talk", Payload::text("t", "hi"), &options);
    let mut replies = client
        .stream(
            first,
            futures::stream::empty(),
            Some(Duration::from_secs(5)),
        )
        .await
        .unwrap();
    let mut seen = Vec::new();
    while let Some(reply) = replies.message().await.unwrap() {
        let header = reply.message.unwrap().header.unwrap();
        let mut metadata: Vec<(String, String)> = header.metadata.into_iter().collect();
        metadata.sort();
        seen.push(metadata);
    }
    let pair = |k: &str, v: &str| (k.to_string(), v.to_string());
    assert_eq!(
        seen,
        [
            vec![pair("opened", "yes"), pair("step", "0")],
            vec![pair("step", "1")]
        ]
    );
}
