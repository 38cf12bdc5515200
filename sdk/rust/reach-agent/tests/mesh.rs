//! Mesh tools and handoffs end to end on a real registry and router (127.0.0.1:0): a model's
//! tool call goes through the router to an agent serving the tool, in the task's trace; a
//! supervisor hands questions to worker agents and synthesises their answers.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use reach_agent::handoff::{Assignment, HANDOFF_TYPE, Handoff, Supervisor, handoff_worker};
use reach_agent::mesh::{
    MeshToolSpec, TOOL_RESULT_TYPE, discover, mesh_tool, mesh_tools, serve_tools,
};
use reach_agent::result::ToolResult;
use reach_agent::scripted::{ScriptedProvider, Step};
use reach_agent::serve::{AGENT_ANSWER_TYPE, AgentAnswer, agent_handler};
use reach_agent::tool::{Tool, ToolContext, ToolRegistry, schema_for};
use reach_agent::{Agent, RunContext, Stopped};
use reach_proto::v1::Payload;
use reach_rpc::usage::TokenUsage;
use reach_sdk::{AgentRuntime, CallOptions};
use serde_json::{Value, json};
use support::mesh::Mesh;

#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct ForecastArgs {
    /// The city.
    city: String,
    /// Days ahead.
    days: u32,
}

#[derive(Debug, serde::Serialize, schemars::JsonSchema)]
struct Forecast {
    city: String,
    days: u32,
    sky: String,
}

/// What the serving side saw: (trace id, task id) per call.
type Seen = Arc<Mutex<Vec<(String, String)>>>;

fn forecast_tool(seen: Seen) -> Tool {
    Tool::from_fn::<ForecastArgs, Forecast, _, _>(
        "weather.forecast",
        "The forecast for a city. Use it for future weather; not for the past.",
        move |args: ForecastArgs, ctx: ToolContext| {
            let seen = seen.clone();
            async move {
                seen.lock()
                    .unwrap()
                    .push((ctx.trace_id.clone(), ctx.task_id.clone()));
                Ok(Forecast {
                    city: args.city,
                    days: args.days,
                    sky: "clear".into(),
                })
            }
        },
    )
    .unwrap()
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

#[tokio::test]
async fn a_mesh_tool_calls_the_capability_through_the_router_in_the_tasks_trace() {
    let mesh = Mesh::start().await;
    let seen: Seen = Arc::default();
    let served = ToolRegistry::new()
        .with(forecast_tool(seen.clone()))
        .unwrap();
    let agent = mesh
        .start_agent(
            serve_tools(
                AgentRuntime::new(mesh.config("weather", "weather-1")),
                &served,
            ),
            "weather-1",
        )
        .await;

    // Served tools are described capabilities: discovery finds them with the tool's
    // description and schemas, ready to be a model's mesh tools.
    let specs = discover(mesh.registry_channel().await, "weather.")
        .await
        .unwrap();
    let forecast = served.get("weather.forecast").unwrap();
    assert_eq!(specs.len(), 1, "{specs:?}");
    assert_eq!(specs[0].capability, "weather.forecast");
    assert_eq!(specs[0].description, forecast.description());
    assert_eq!(&specs[0].input_schema, forecast.input_schema());
    assert_eq!(specs[0].output_schema.as_ref(), forecast.output_schema());
    assert!(
        discover(mesh.registry_channel().await, "nothing.")
            .await
            .unwrap()
            .is_empty()
    );

    let client = mesh.client("planner.main").await;
    let tool = mesh_tool(
        client.clone(),
        "weather.forecast",
        "The forecast for a city, from the weather agent.",
        schema_for::<ForecastArgs>(),
        None,
    )
    .unwrap();
    assert_eq!(tool.function_name(), "weather__forecast");
    let model = ScriptedProvider::new([
        Step::tool_call("weather.forecast", "{'city': 'Paris', 'days': '2',}"),
        Step::reply("Clear in Paris."),
    ]);
    let planner = Agent::new(model.shared(), ToolRegistry::new().with(tool).unwrap());

    let ctx = RunContext {
        trace_id: TRACE.into(),
        task_id: "task-9".into(),
        deadline: Some(tokio::time::Instant::now() + Duration::from_secs(10)),
        ..RunContext::default()
    };
    let outcome = planner
        .run(ctx, "weather in Paris in 2 days?")
        .await
        .unwrap();
    assert_eq!(outcome.stopped, Stopped::Final);
    let result = &outcome.tool_calls[0].result;
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(
        result.data,
        Some(json!({"city": "Paris", "days": 2, "sky": "clear"}))
    );
    assert!(!result.metadata.repairs.is_empty());
    // The serving side continued the agent's trace and task.
    assert_eq!(
        seen.lock().unwrap().clone(),
        [(TRACE.to_string(), "task-9".to_string())]
    );
    // Served tools validate server-side and answer with the normalised result.
    let reply = client
        .call(
            "weather.forecast",
            Payload::json("reach.tool_call", &json!({"days": "soon"})),
            CallOptions::default(),
        )
        .await
        .unwrap();
    let payload = reply.message.unwrap().payload.unwrap();
    assert_eq!(payload.r#type, TOOL_RESULT_TYPE);
    let result: ToolResult = serde_json::from_value(payload.first_json().unwrap()).unwrap();
    let error = result.error.unwrap();
    let mut pointers: Vec<&str> = error
        .violations
        .iter()
        .map(|v| v.pointer.as_str())
        .collect();
    pointers.sort_unstable();
    assert_eq!(pointers, ["/city", "/days"]);

    // A capability nobody serves is a tool error for the model, not a failed run.
    let mut registry = ToolRegistry::new();
    mesh_tools(
        &client,
        [MeshToolSpec::new(
            "weather.history",
            "Past weather.",
            json!({"type": "object"}),
            None,
        )],
        &mut registry,
    )
    .unwrap();
    let missing = registry
        .get("weather.history")
        .unwrap()
        .call("{}", ToolContext::default())
        .await;
    let error = missing.error.unwrap();
    assert!(
        error.message.contains("ROUTE_NOT_FOUND"),
        "{}",
        error.message
    );
    agent.drain().await.unwrap();
}

#[tokio::test]
async fn a_supervisor_hands_questions_to_workers_and_synthesises_their_answers() {
    let mesh = Mesh::start().await;
    // A worker that answers at once.
    let billing_model =
        ScriptedProvider::new([Step::reply("refund issued on 3 March")]).with_usage(20, 5);
    let billing = Agent::new(billing_model.shared(), ToolRegistry::new());
    // A worker whose model never stops calling tools: it must answer "could not complete".
    let echo = Tool::dynamic(
        "util.echo",
        "Echoes.",
        json!({"type": "object"}),
        None,
        |v: Value, _ctx: ToolContext| async move { Ok(v) },
    )
    .unwrap();
    let looping_model =
        ScriptedProvider::from_fn(|_| Ok(Step::tool_call("util.echo", "{}"))).with_usage(3, 1);
    let shipping = Agent::new(
        looping_model.shared(),
        ToolRegistry::new().with(echo).unwrap(),
    )
    .max_turns(50);
    let workers = mesh
        .start_agent(
            AgentRuntime::new(mesh.config("workers", "workers-1"))
                .handle("worker.billing", "1.0.0", handoff_worker(billing))
                .handle("worker.shipping", "1.0.0", handoff_worker(shipping)),
            "workers-1",
        )
        .await;

    let plan = "```json\n{\"assignments\": [\
        {\"to\": \"worker.billing\", \"question\": \"Was the refund issued?\"},\
        {\"to\": \"worker.shipping\", \"question\": \"Where is the parcel?\"},\
        {\"to\": \"worker.unknown\", \"question\": \"dropped\"}]}\n```";
    let synthesis = Arc::new(Mutex::new(String::new()));
    let supervisor_model = {
        let synthesis = synthesis.clone();
        let calls = std::sync::atomic::AtomicUsize::new(0);
        ScriptedProvider::from_fn(move |request| {
            if calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                Ok(Step::reply(plan))
            } else {
                *synthesis.lock().unwrap() = request.messages[1].text().to_string();
                Ok(Step::reply("Refund issued; parcel status unknown."))
            }
        })
        .with_usage(10, 10)
    };
    let supervisor = Supervisor::new(
        supervisor_model.shared(),
        mesh.client("supervisor.main").await,
        "supervisor.main",
    )
    .worker_turns(2)
    .timeout(Duration::from_secs(10));
    let outcome = supervisor
        .run(
            RunContext {
                trace_id: TRACE.into(),
                task_id: "case-7".into(),
                deadline: None,
                ..RunContext::default()
            },
            "A customer asks about their refund and their parcel.",
            &["worker.billing", "worker.shipping"],
        )
        .await
        .unwrap();
    assert_eq!(outcome.answer, "Refund issued; parcel status unknown.");
    assert_eq!(outcome.replies.len(), 2);
    let billing_reply = &outcome.replies[0];
    assert_eq!(billing_reply.assignment.to, "worker.billing");
    let answer = billing_reply.answer.as_ref().unwrap();
    assert!(answer.completed);
    assert_eq!(answer.answer, "refund issued on 3 March");
    let shipping_reply = outcome.replies[1].answer.as_ref().unwrap();
    assert!(!shipping_reply.completed);
    assert_eq!(
        shipping_reply.turns, 2,
        "the handoff's max_turns bounds the worker"
    );
    assert!(
        shipping_reply.answer.contains("could not complete"),
        "{}",
        shipping_reply.answer
    );
    // Answers reached the synthesis; usage sums supervisor and workers.
    let text = synthesis.lock().unwrap().clone();
    assert!(
        text.contains("refund issued on 3 March") && text.contains("(incomplete)"),
        "{text}"
    );
    assert_eq!(outcome.usage.input_tokens, 10 + 10 + 20 + 2 * 3);

    // Given assignments skip planning.
    let given = supervisor
        .run_assignments(
            RunContext::default(),
            "refund?",
            vec![Assignment {
                to: "worker.billing".into(),
                question: "Refund?".into(),
            }],
            Default::default(),
        )
        .await
        .unwrap();
    // The billing worker's script is spent: its failure is reported, not raised.
    let failed = given.replies[0].answer.as_ref().unwrap_err();
    assert!(failed.contains("UNAVAILABLE"), "{failed}");
    // A malformed handoff is refused, naming the field.
    let client = mesh.client("test.client").await;
    let status = client
        .call(
            "worker.billing",
            Payload::json(HANDOFF_TYPE, &json!({"context_summary": "no question"})),
            CallOptions::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        reach_rpc::errors::reason_of(&status).as_deref(),
        Some("INVALID_PAYLOAD")
    );
    assert!(
        status.message().contains("question"),
        "{}",
        status.message()
    );
    let handoff = Handoff {
        question: "q".into(),
        context_summary: String::new(),
        max_turns: 1,
        from: "a".into(),
        to: "b".into(),
    };
    assert_eq!(handoff.to_payload().r#type, HANDOFF_TYPE);
    workers.drain().await.unwrap();
}

#[tokio::test]
async fn an_agent_served_as_a_capability_reports_its_tokens_in_the_reply() {
    let mesh = Mesh::start().await;
    let add = Tool::from_fn::<AddArgs, i64, _, _>(
        "math.add",
        "Adds two integers. Use it for exact sums; not for estimates.",
        |args: AddArgs, _ctx: ToolContext| async move { Ok(args.a + args.b) },
    )
    .unwrap();
    let model = ScriptedProvider::new([
        Step::tool_call("math.add", "{a: 2, b: '3'}"),
        Step::reply("5"),
    ])
    .with_usage(100, 20);
    let agent = Agent::new(model.shared(), ToolRegistry::new().with(add).unwrap());
    let running = mesh
        .start_agent(
            AgentRuntime::new(mesh.config("assistant", "assistant-1")).handle(
                "assistant.answer",
                "1.0.0",
                agent_handler(agent),
            ),
            "assistant-1",
        )
        .await;
    let client = mesh.client("test.client").await;
    let reply = client
        .call(
            "assistant.answer",
            Payload::json("question", &json!({"question": "what is 2 + 3?"})),
            CallOptions::default(),
        )
        .await
        .unwrap()
        .message
        .unwrap();
    let usage = TokenUsage::read(&reply.header.unwrap().metadata);
    assert_eq!(
        usage,
        Some(TokenUsage {
            input_tokens: 200,
            output_tokens: 40,
            model_calls: 2,
        })
    );
    let payload = reply.payload.unwrap();
    assert_eq!(payload.r#type, AGENT_ANSWER_TYPE);
    let answer: AgentAnswer = serde_json::from_value(payload.first_json().unwrap()).unwrap();
    assert_eq!(answer.answer, "5");
    assert!(answer.completed);
    assert_eq!((answer.turns, answer.input_tokens), (2, 200));
    assert_eq!(payload.first_text(), Some("5"));
    running.drain().await.unwrap();
}

#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct AddArgs {
    a: i64,
    b: i64,
}

/// An agent whose model always asks the agent itself (a mesh tool to its own capability):
/// every hop carries the envelope turn further, and the router refuses the hop past its
/// `max_turn`, so the loop ends with a tool error instead of running forever.
#[tokio::test]
async fn agents_that_call_each_other_in_a_loop_are_stopped_by_the_routers_turn_limit() {
    const MAX_TURN: u32 = 5;
    let mesh = Mesh::start_with(|router| router.max_turn = MAX_TURN).await;
    let client = mesh.client("looper.main").await;
    let ask_myself = mesh_tool(
        client.clone(),
        "looper.ask",
        "Asks the looper agent. Use it always.",
        json!({"type": "object", "properties": {"question": {"type": "string"}}}),
        None,
    )
    .unwrap();
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let model = {
        let seen = seen.clone();
        ScriptedProvider::from_fn(move |request| {
            let tool_results: Vec<String> = request
                .messages
                .iter()
                .filter(|m| m.role == reach_agent::provider::Role::Tool)
                .map(|m| m.text().to_string())
                .collect();
            seen.lock().unwrap().extend(tool_results.clone());
            Ok(if tool_results.is_empty() {
                Step::tool_call("looper.ask", "{\"question\": \"again\"}")
            } else {
                Step::reply("stopped")
            })
        })
    };
    let looper = Agent::new(
        model.shared(),
        ToolRegistry::new().with(ask_myself).unwrap(),
    )
    .max_turns(2);
    let running = mesh
        .start_agent(
            AgentRuntime::new(mesh.config("looper", "looper-1")).handle(
                "looper.ask",
                "1.0.0",
                agent_handler(looper),
            ),
            "looper-1",
        )
        .await;
    let reply = client
        .call(
            "looper.ask",
            Payload::json("question", &json!({"question": "start"})),
            CallOptions {
                timeout: Some(Duration::from_secs(20)),
                ..CallOptions::default()
            },
        )
        .await
        .unwrap();
    let answer: AgentAnswer = serde_json::from_value(
        reply
            .message
            .unwrap()
            .payload
            .unwrap()
            .first_json()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(answer.answer, "stopped");
    let seen = seen.lock().unwrap().clone();
    // Hops 0..=MAX_TURN ran (each asked once); the next hop was refused.
    assert_eq!(seen.len(), MAX_TURN as usize + 1, "{seen:#?}");
    // Only the last hop's own call was refused (the hops above it see its answer, which
    // names the refusal among its tool calls).
    let refused: Vec<&String> = seen
        .iter()
        .filter(|t| {
            let result: Value = serde_json::from_str(t).unwrap();
            result["status"] == "error"
                && result["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("TURN_LIMIT_EXCEEDED"))
        })
        .collect();
    assert_eq!(refused.len(), 1, "{seen:#?}");
    running.drain().await.unwrap();
}

/// An instance registered by hand, serving `capabilities` (each with an input schema).
fn described_instance(id: &str, capabilities: &[String]) -> reach_proto::v1::InstanceSpec {
    reach_proto::v1::InstanceSpec {
        service: "weather.other".into(),
        instance_id: id.into(),
        endpoint: "http://127.0.0.1:9".into(),
        capabilities: capabilities
            .iter()
            .map(|name| reach_proto::v1::Capability {
                name: name.clone(),
                version: "1.0.0".into(),
                description: format!("{name}, by hand"),
                input_schema: r#"{"type":"object"}"#.into(),
                output_schema: String::new(),
            })
            .collect(),
        ..Default::default()
    }
}

#[tokio::test]
async fn discovery_skips_capabilities_that_cannot_be_tools_and_reads_every_page() {
    let mesh = Mesh::start().await;
    let served = ToolRegistry::new()
        .with(forecast_tool(Seen::default()))
        .unwrap();
    let agent = mesh
        .start_agent(
            serve_tools(
                AgentRuntime::new(mesh.config("weather", "weather-1")),
                &served,
            ),
            "weather-1",
        )
        .await;
    let registry = mesh.registry();
    // Valid to the registry, but `__` cannot map back to a function name.
    registry
        .register(
            described_instance("odd-1", &["weather.x__y".to_string()]),
            None,
        )
        .unwrap();
    // Served only by a draining instance: nothing could take the call.
    let lease = registry
        .register(
            described_instance("idle-1", &["weather.idle".to_string()]),
            None,
        )
        .unwrap()
        .lease_id;
    registry
        .heartbeat(
            "idle-1",
            &lease,
            reach_proto::v1::InstanceState::Draining,
            0,
        )
        .unwrap();

    let specs = discover(mesh.registry_channel().await, "weather.")
        .await
        .unwrap();
    let names: Vec<&str> = specs.iter().map(|s| s.capability.as_str()).collect();
    assert_eq!(names, ["weather.forecast"]);
    let client = mesh.client("planner.main").await;
    let mut tools = ToolRegistry::new();
    mesh_tools(&client, specs, &mut tools).unwrap();
    assert!(tools.get("weather.forecast").is_some());

    // More capabilities than one page of ListCapabilities (500): discovery reads them all.
    for (id, range) in [("many-1", 0..256), ("many-2", 256..512)] {
        let names: Vec<String> = range.map(|i| format!("many.c{i:03}")).collect();
        registry
            .register(described_instance(id, &names), None)
            .unwrap();
    }
    let specs = discover(mesh.registry_channel().await, "many.")
        .await
        .unwrap();
    assert_eq!(specs.len(), 512);
    let expected: Vec<String> = (0..512).map(|i| format!("many.c{i:03}")).collect();
    let names: Vec<String> = specs.into_iter().map(|s| s.capability).collect();
    assert_eq!(names, expected);
    agent.drain().await.unwrap();
}
