//! Traces: each model call is a GenAI span, each tool call a `tool.call` span under the
//! agent's run, and a mesh tool's router call a child of its tool span in the task's trace.
//!
//! Every test here records spans from its first line: `tracing` caches each callsite's
//! interest, so a test binary mixing threads with and without a subscriber may miss spans.

mod support;

use std::time::Duration;

use reach_agent::mesh::{mesh_tool, serve_tools};
use reach_agent::scripted::{ScriptedProvider, Step};
use reach_agent::tool::{ToolRegistry, schema_for};
use reach_agent::{Agent, RunContext};
use reach_sdk::AgentRuntime;

use support::mesh::Mesh;
use support::tools::tools;

#[tokio::test]
async fn model_and_tool_calls_are_traced() {
    let (spans, _guard) = support::spans::record();
    let model = ScriptedProvider::new([
        Step::tool_call("util.echo", "{'text': 'hi',}"),
        Step::reply("hi"),
    ])
    .with_model("scripted-1")
    .with_usage(11, 4);
    let agent = Agent::new(model.shared(), tools());
    agent.run(RunContext::default(), "echo hi").await.unwrap();

    let chats = spans.named("gen_ai.chat");
    assert_eq!(chats.len(), 2);
    let chat = &chats[0];
    for (field, value) in [
        ("gen_ai.operation.name", "chat"),
        ("gen_ai.provider.name", "scripted"),
        ("gen_ai.request.model", "scripted-1"),
        ("gen_ai.response.model", "scripted-1"),
        ("gen_ai.usage.input_tokens", "11"),
        ("gen_ai.usage.output_tokens", "4"),
        ("gen_ai.response.finish_reasons", "[\\\"tool_calls\\\"]"),
    ] {
        let got = chat.fields.get(field).map(String::as_str);
        assert!(
            got == Some(value) || got == Some(&value.replace("\\\"", "\"")),
            "{field}: {got:?} in {chat:?}"
        );
    }
    assert!(chat.fields.contains_key("duration_ms"));
    assert_eq!(chat.parent_name.as_deref(), Some("agent.run"));
    let tools = spans.named("tool.call");
    assert_eq!(tools.len(), 1);
    let tool = &tools[0];
    assert_eq!(
        tool.fields.get("gen_ai.tool.name").map(String::as_str),
        Some("util.echo")
    );
    assert_eq!(
        tool.fields.get("tool.status").map(String::as_str),
        Some("ok")
    );
    assert_eq!(
        tool.fields.get("tool.repairs").map(String::as_str),
        Some("1")
    );
    assert_eq!(tool.parent_name.as_deref(), Some("agent.run"));
}

#[tokio::test]
async fn a_mesh_tools_router_call_is_a_child_of_its_tool_span_in_the_tasks_trace() {
    let (spans, _guard) = support::spans::record();
    let mesh = Mesh::start().await;
    let served = tools();
    let agent = mesh
        .start_agent(
            serve_tools(AgentRuntime::new(mesh.config("echo", "echo-1")), &served),
            "echo-1",
        )
        .await;
    #[derive(serde::Deserialize, schemars::JsonSchema)]
    #[allow(dead_code)]
    struct Args {
        text: String,
    }
    let tool = mesh_tool(
        mesh.client("planner.main").await,
        "util.echo",
        "Echo, on another agent.",
        schema_for::<Args>(),
        None,
    )
    .unwrap();
    let model = ScriptedProvider::new([
        Step::tool_call("util.echo", r#"{"text": "hi"}"#),
        Step::reply("hi"),
    ]);
    let planner = Agent::new(model.shared(), ToolRegistry::new().with(tool).unwrap());
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let ctx = RunContext {
        trace_id: trace.into(),
        task_id: "task-3".into(),
        deadline: Some(tokio::time::Instant::now() + Duration::from_secs(10)),
        ..RunContext::default()
    };
    let outcome = planner.run(ctx, "echo hi").await.unwrap();
    assert!(
        outcome.tool_calls[0].result.is_ok(),
        "{:?}",
        outcome.tool_calls[0].result
    );
    let mesh_calls: Vec<_> = spans
        .named("reach.message")
        .into_iter()
        .filter(|s| s.fields.get("otel.name").map(String::as_str) == Some("mesh.call"))
        .collect();
    assert_eq!(mesh_calls.len(), 1, "{:?}", spans.named("reach.message"));
    assert_eq!(mesh_calls[0].parent_name.as_deref(), Some("tool.call"));
    assert_eq!(
        mesh_calls[0].fields.get("trace_id").map(String::as_str),
        Some(trace)
    );
    assert_eq!(
        mesh_calls[0].fields.get("task_id").map(String::as_str),
        Some("task-3")
    );
    agent.drain().await.unwrap();
}
