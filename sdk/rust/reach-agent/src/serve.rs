//! An agent as a capability: [`agent_handler`] runs the tool loop on each message it is sent
//! and answers with an [`AgentAnswer`], and reports what the run's model calls cost in the
//! reply header ([`reach_rpc::usage`]) — so a flow whose task node calls the agent sums the
//! tokens into its task record (`reach task get`, `reach dump`).
//!
//! ```no_run
//! # async fn serve(agent: reach_agent::Agent) -> Result<(), Box<dyn std::error::Error>> {
//! use reach_sdk::{AgentConfig, AgentRuntime};
//!
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! AgentRuntime::new(AgentConfig::new("assistant", "http://127.0.0.1:7070").with_model_slots(4))
//!     .handle("assistant.answer", "1.0.0", reach_agent::serve::agent_handler(agent))
//!     .run(listener, reach_sdk::signal::terminate())
//!     .await?;
//! # Ok(()) }
//! ```

use std::sync::Arc;

use futures::future::BoxFuture;
use reach_proto::v1::{Part, Payload, ReachMessage};
use reach_rpc::usage::TokenUsage;
use reach_sdk::HandlerContext;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tonic::Status;

use crate::agent_loop::{Agent, RunContext, Stopped};

/// The payload type of an agent's answer.
pub const AGENT_ANSWER_TYPE: &str = "reach.agent_answer";

/// The fields of a data payload read as the question, in this order.
const QUESTION_FIELDS: [&str; 4] = ["question", "prompt", "input", "text"];

/// What an agent served by [`agent_handler`] answers (the reply's data part; its text part
/// is `answer`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AgentAnswer {
    /// The final answer, or "could not complete the task within N turns: …".
    pub answer: String,
    /// Whether the model gave a final answer within its turns.
    pub completed: bool,
    /// Model calls made (loop turns).
    pub turns: u32,
    /// Input (prompt) tokens spent.
    pub input_tokens: u64,
    /// Output (completion) tokens spent.
    pub output_tokens: u64,
    /// The tool calls the run made, in order.
    #[serde(default)]
    pub tool_calls: Vec<AgentToolCall>,
}

/// One tool call of an [`AgentAnswer`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AgentToolCall {
    /// The tool (capability name).
    pub name: String,
    /// Whether it succeeded.
    pub ok: bool,
    /// The error the model was given, when it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A handler (for [`reach_sdk::AgentRuntime::handle`]) that runs `agent` on each message:
/// the question is the message's first text part, else the first of the `question`,
/// `prompt`, `input` or `text` string fields of its first data part, else that data part
/// as JSON. The run continues the message's trace, task, deadline and turn, holds one of
/// the runtime's model slots per model call, and keeps per-task memory if the agent has it.
///
/// # Errors
/// The returned handler answers INVALID_ARGUMENT for a message with no text or data, and
/// the model's status ([`crate::ModelError`]) or DEADLINE_EXCEEDED when the run fails.
pub fn agent_handler(
    agent: Agent,
) -> impl Fn(HandlerContext, ReachMessage) -> BoxFuture<'static, Result<Payload, Status>>
+ Send
+ Sync
+ 'static {
    let agent = Arc::new(agent);
    move |ctx: HandlerContext, message: ReachMessage| {
        let agent = agent.clone();
        Box::pin(async move {
            let question = question_of(message.payload.as_ref()).ok_or_else(|| {
                Status::invalid_argument(
                    "the message has no text or data part: send the question as a text part, or as a data part with a `question` field",
                )
            })?;
            let outcome = agent.run(RunContext::from(&ctx), question).await?;
            report_usage(&ctx, outcome.usage);
            let answer = AgentAnswer {
                completed: outcome.stopped == Stopped::Final,
                answer: outcome.answer,
                turns: outcome.turns,
                input_tokens: outcome.usage.input_tokens,
                output_tokens: outcome.usage.output_tokens,
                tool_calls: outcome
                    .tool_calls
                    .iter()
                    .map(|c| AgentToolCall {
                        name: c.name.clone(),
                        ok: c.result.is_ok(),
                        error: c.result.error.as_ref().map(|e| e.message.clone()),
                    })
                    .collect(),
            };
            let mut payload = Payload::json(
                AGENT_ANSWER_TYPE,
                &serde_json::to_value(&answer).unwrap_or(Value::Null),
            );
            payload.parts.push(Part {
                content: Some(reach_proto::v1::part::Content::Text(answer.answer)),
                media_type: "text/plain".into(),
                ..Part::default()
            });
            Ok(payload)
        })
    }
}

/// Puts `usage` into the reply's header metadata (`reach.gen_ai.*`), where the caller —
/// the orchestrator, for a flow's task node — reads it.
pub fn report_usage(ctx: &HandlerContext, usage: TokenUsage) {
    let mut entries = std::collections::HashMap::new();
    usage.write(&mut entries);
    for (key, value) in entries {
        ctx.set_reply_metadata(key, value);
    }
}

/// The question a message asks (see [`agent_handler`]).
fn question_of(payload: Option<&Payload>) -> Option<String> {
    let payload = payload?;
    if let Some(text) = payload.first_text().filter(|t| !t.trim().is_empty()) {
        return Some(text.to_string());
    }
    let data = payload.first_json()?;
    if let Some(object) = data.as_object() {
        for field in QUESTION_FIELDS {
            if let Some(text) = object.get(field).and_then(Value::as_str) {
                let rest: serde_json::Map<String, Value> = object
                    .iter()
                    .filter(|(k, _)| k.as_str() != field)
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                return Some(if rest.is_empty() {
                    text.to_string()
                } else {
                    format!("{text}\n\nContext: {}", Value::Object(rest))
                });
            }
        }
    }
    match data {
        Value::Null => None,
        other => Some(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_question_comes_from_text_then_named_fields_then_json() {
        let text = Payload {
            r#type: "q".into(),
            parts: vec![Part {
                content: Some(reach_proto::v1::part::Content::Text("why?".into())),
                ..Part::default()
            }],
        };
        assert_eq!(question_of(Some(&text)).as_deref(), Some("why?"));
        let named = Payload::json("q", &json!({"question": "how many?", "state": "CA"}));
        assert_eq!(
            question_of(Some(&named)).as_deref(),
            Some("how many?\n\nContext: {\"state\":\"CA\"}")
        );
        let bare = Payload::json("q", &json!({"n": 1}));
        assert_eq!(question_of(Some(&bare)).as_deref(), Some("{\"n\":1}"));
        assert_eq!(question_of(Some(&Payload::default())), None);
        assert_eq!(question_of(None), None);
    }
}
