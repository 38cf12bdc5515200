//! An LLM agent on the mesh in a few lines: one local tool, the mesh's described
//! capabilities as tools (discovered from the registry, called through the router), served
//! as the capability `assistant.ask`, then asked one question through the router.
//!
//! ```sh
//! reach dev &                                              # registry, router, example agents
//! cargo run --release -p reach-agent --example assistant -- "My servicer lost my payment."
//! ```
//!
//! `REACH_ENDPOINT` names the mesh (default `http://127.0.0.1:7070`, where `reach dev`
//! serves registry and router).
//!
//! Without a model endpoint a scripted model plays the part (it classifies the complaint
//! with the coordinator's `complaint.classify`, counts the words locally, and answers from
//! the two results). With
//! one: `REACH_MODEL_BASE_URL=https://api.openai.com/v1 REACH_MODEL=gpt-4o-mini
//! OPENAI_API_KEY=... cargo run --release -p reach-agent --example assistant`.

use reach_agent::mesh::{discover, mesh_tools};
use reach_agent::serve::{AgentAnswer, agent_handler};
use reach_agent::{
    Agent, ModelConfig, ModelProvider, OpenAiProvider, ScriptedProvider, Step, Tool, ToolContext,
    ToolRegistry,
};
use reach_proto::v1::Payload;
use reach_sdk::{AgentConfig, AgentRuntime, CallOptions, MeshClient};
use std::sync::Arc;

/// Arguments of `text.word_count`.
#[derive(serde::Deserialize, schemars::JsonSchema)]
struct WordCount {
    /// The text to count the words of.
    text: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mesh = std::env::var("REACH_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:7070".into());
    let question = std::env::args().nth(1).unwrap_or_else(|| {
        "My loan servicer applied my payment to the wrong account and now reports me late.".into()
    });

    // Tools: one local, and every capability the registry describes with a schema.
    let mut tools = ToolRegistry::new().with(Tool::from_fn::<WordCount, usize, _, _>(
        "text.word_count",
        "Counts the words of a text. Use it for lengths; not for meaning.",
        |args: WordCount, _ctx: ToolContext| async move { Ok(args.text.split_whitespace().count()) },
    )?)?;
    let channel = reach_rpc::http2::endpoint(&mesh)?.connect().await?;
    let client = MeshClient::new(channel.clone(), "assistant.main");
    mesh_tools(&client, discover(channel, "complaint.").await?, &mut tools)?;

    let model: Arc<dyn ModelProvider> = match std::env::var("REACH_MODEL_BASE_URL") {
        Ok(base_url) => {
            let mut config = ModelConfig::new(base_url, std::env::var("REACH_MODEL")?);
            config.api_key = std::env::var("OPENAI_API_KEY").unwrap_or_default();
            Arc::new(OpenAiProvider::new(config)?)
        }
        // The scripted model asks both tools at once, then answers from what they returned.
        Err(_) => {
            let question = question.clone();
            ScriptedProvider::from_fn(move |request| {
                let results: Vec<serde_json::Value> = request
                    .messages
                    .iter()
                    .filter(|m| m.role == reach_agent::provider::Role::Tool)
                    .filter_map(|m| serde_json::from_str(m.text()).ok())
                    .collect();
                if results.is_empty() {
                    return Ok(Step::ToolCalls(vec![
                        (
                            "complaint.classify".into(),
                            serde_json::json!({"complaint_id": "example-1", "narrative": question})
                                .to_string(),
                        ),
                        (
                            "text.word_count".into(),
                            serde_json::json!({"text": question}).to_string(),
                        ),
                    ]));
                }
                let category = results
                    .iter()
                    .find_map(|r| r.pointer("/data/category").and_then(|c| c.as_str()))
                    .unwrap_or("unknown");
                let words = results
                    .iter()
                    .find_map(|r| r.get("data").and_then(|d| d.as_u64()))
                    .unwrap_or(0);
                Ok(Step::reply(format!(
                    "The classifier files this {words}-word complaint under `{category}`."
                )))
            })
            .shared()
        }
    };
    let agent = Agent::new(model, tools)
        .system("You help triage consumer complaints. Use the tools; never guess a category.")
        .max_turns(6);

    // Serve the agent as a capability, then ask it through the router like any caller would.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let (running, _) =
        AgentRuntime::new(AgentConfig::new("assistant", mesh.clone()).with_model_slots(4))
            .handle("assistant.ask", "1.0.0", agent_handler(agent))
            .start(listener)
            .await?;
    let mut reply = Err(tonic::Status::unavailable("not asked yet"));
    for _ in 0..50 {
        reply = client
            .call(
                "assistant.ask",
                Payload::text("question", &question),
                CallOptions::default(),
            )
            .await;
        match &reply {
            // The router learns of the new instance within a moment of its first heartbeat.
            Err(status) if status.code() == tonic::Code::NotFound => {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            _ => break,
        }
    }
    let payload = reply?.message.and_then(|m| m.payload).unwrap_or_default();
    let answer: AgentAnswer = serde_json::from_value(payload.first_json().unwrap_or_default())?;
    println!("{}\n", answer.answer);
    for call in &answer.tool_calls {
        println!(
            "  tool {:<20} {}",
            call.name,
            if call.ok { "ok" } else { "failed" }
        );
    }
    println!(
        "  {} model calls, {} tokens in, {} out",
        answer.turns, answer.input_tokens, answer.output_tokens
    );
    running.drain().await?;
    Ok(())
}
