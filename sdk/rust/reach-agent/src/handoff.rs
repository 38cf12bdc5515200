//! Handoffs: a supervisor hands focused questions to worker agents and combines their
//! answers.
//!
//! A handoff is a message of type [`HANDOFF_TYPE`] (`reach.handoff`) whose first data part is
//! a [`Handoff`] (JSON Schema: [`handoff_schema`]). A worker — [`handoff_worker`] around an
//! [`Agent`] — runs its loop on the question with the handoff's `max_turns` and answers with
//! a [`HANDOFF_ANSWER_TYPE`] payload holding a [`HandoffAnswer`]; when it cannot finish in
//! time it says so (`completed: false`, "could not complete ...") instead of looping.
//!
//! A [`Supervisor`] splits a task into questions (through the model, [`Supervisor::plan`],
//! or given), sends them to worker capabilities concurrently through a [`MeshClient`], pairs
//! each reply with its question by correlation (the reply's `correlation_id` is the
//! handoff's `message_id`), and has the model synthesise one answer.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use reach_proto::v1::{Payload, ReachMessage};
use reach_rpc::errors::{reason, status_with_reason};
use reach_rpc::usage::TokenUsage;
use reach_sdk::{CallOptions, HandlerContext, MeshClient};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tonic::{Code, Status};

use crate::agent_loop::{Agent, AgentError, RunContext, Stopped};
use crate::provider::{ChatMessage, ChatRequest, ModelProvider};

/// The payload type of a handoff.
pub const HANDOFF_TYPE: &str = "reach.handoff";
/// The payload type of a worker's answer.
pub const HANDOFF_ANSWER_TYPE: &str = "reach.handoff_answer";

fn default_max_turns() -> u32 {
    4
}

/// A question handed to a worker agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Handoff {
    /// The focused question the worker answers.
    pub question: String,
    /// What the worker needs to know of the larger task (a summary, not the transcript).
    #[serde(default)]
    pub context_summary: String,
    /// The most model calls the worker may make.
    #[serde(default = "default_max_turns")]
    pub max_turns: u32,
    /// Who hands off (the supervisor's service or capability).
    #[serde(default)]
    pub from: String,
    /// The worker capability.
    #[serde(default)]
    pub to: String,
}

/// A worker's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HandoffAnswer {
    /// The answer (or "could not complete ...").
    pub answer: String,
    /// Whether the worker finished within its turns.
    pub completed: bool,
    /// Model calls it made.
    pub turns: u32,
    /// Input tokens it spent.
    pub input_tokens: u64,
    /// Output tokens it spent.
    pub output_tokens: u64,
}

/// The JSON Schema of [`Handoff`].
pub fn handoff_schema() -> Value {
    crate::tool::schema_for::<Handoff>()
}

impl Handoff {
    /// The handoff as a payload.
    pub fn to_payload(&self) -> Payload {
        Payload::json(
            HANDOFF_TYPE,
            &serde_json::to_value(self).unwrap_or(Value::Null),
        )
    }

    /// Reads a handoff from a message's first data part, validated against
    /// [`handoff_schema`].
    ///
    /// # Errors
    /// INVALID_ARGUMENT with reason INVALID_PAYLOAD naming the bad field.
    pub fn from_message(message: &ReachMessage) -> Result<Handoff, Status> {
        let value = message
            .payload
            .as_ref()
            .and_then(Payload::first_json)
            .ok_or_else(|| invalid("", "a handoff needs a data part holding the Handoff"))?;
        let schema = crate::repair::ArgumentSchema::new(handoff_schema())
            .map_err(|e| Status::internal(e.to_string()))?;
        schema.validate(&value).map_err(|e| {
            let first = e.violations.first().cloned();
            invalid(
                first.as_ref().map_or("", |v| v.pointer.as_str()),
                &e.to_string(),
            )
        })?;
        serde_json::from_value(value).map_err(|e| invalid("", &e.to_string()))
    }
}

fn invalid(pointer: &str, message: &str) -> Status {
    status_with_reason(
        Code::InvalidArgument,
        format!("invalid handoff: {message}"),
        reason::INVALID_PAYLOAD,
        [("pointer".to_string(), pointer.to_string())],
    )
}

/// A handler that answers handoffs with `agent`: the loop runs on the question (with the
/// context summary before it) under the handoff's `max_turns` and the message's trace, task
/// and deadline. Register it with `AgentRuntime::handle(capability, version, ...)`.
///
/// # Errors (of the handler)
/// INVALID_ARGUMENT (`INVALID_PAYLOAD`) for a malformed handoff; the model error's status
/// when a model call fails.
pub fn handoff_worker(
    agent: Agent,
) -> impl Fn(
    HandlerContext,
    ReachMessage,
) -> futures::future::BoxFuture<'static, Result<Payload, Status>>
+ Send
+ Sync
+ 'static {
    let agent = Arc::new(agent);
    move |ctx: HandlerContext, message: ReachMessage| {
        let agent = agent.clone();
        Box::pin(async move {
            let handoff = Handoff::from_message(&message)?;
            let turns = handoff.max_turns.max(1);
            let worker = agent.as_ref().clone().max_turns(turns);
            let mut messages = Vec::new();
            if !handoff.context_summary.trim().is_empty() {
                messages.push(ChatMessage::user(format!(
                    "Context: {}",
                    handoff.context_summary.trim()
                )));
            }
            messages.push(ChatMessage::user(handoff.question.clone()));
            let outcome = worker
                .run_messages(RunContext::from(&ctx), messages)
                .await
                .map_err(Status::from)?;
            crate::serve::report_usage(&ctx, outcome.usage);
            let answer = HandoffAnswer {
                completed: outcome.stopped == Stopped::Final,
                answer: outcome.answer,
                turns: outcome.turns,
                input_tokens: outcome.usage.input_tokens,
                output_tokens: outcome.usage.output_tokens,
            };
            Ok(Payload::json(
                HANDOFF_ANSWER_TYPE,
                &serde_json::to_value(&answer).unwrap_or(Value::Null),
            ))
        })
    }
}

/// One question for one worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// The worker capability.
    pub to: String,
    /// The question.
    pub question: String,
}

/// A worker's reply to one assignment.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerReply {
    /// What was asked.
    pub assignment: Assignment,
    /// The handoff's message id (the reply's correlation id).
    pub message_id: String,
    /// The answer, or why there is none (the call's status, rendered).
    pub answer: Result<HandoffAnswer, String>,
}

/// What a supervised task produced.
#[derive(Debug, Clone)]
pub struct SupervisorOutcome {
    /// The synthesised answer.
    pub answer: String,
    /// Every worker's reply, in assignment order.
    pub replies: Vec<WorkerReply>,
    /// Tokens spent by the supervisor's own model calls and the workers' (as they report).
    pub usage: TokenUsage,
}

/// Splits tasks into handoffs, dispatches them, and synthesises the answers.
#[derive(Clone)]
pub struct Supervisor {
    provider: Arc<dyn ModelProvider>,
    client: MeshClient,
    name: String,
    worker_turns: u32,
    timeout: Duration,
}

impl Supervisor {
    /// A supervisor named `name` (the handoffs' `from`) using `provider` to plan and
    /// synthesise and `client` to reach workers; workers get 4 turns and 120 s each.
    pub fn new(
        provider: Arc<dyn ModelProvider>,
        client: MeshClient,
        name: impl Into<String>,
    ) -> Self {
        Self {
            provider,
            client,
            name: name.into(),
            worker_turns: 4,
            timeout: Duration::from_secs(120),
        }
    }

    /// Sets the workers' `max_turns`.
    pub fn worker_turns(mut self, n: u32) -> Self {
        self.worker_turns = n.max(1);
        self
    }

    /// Sets the per-worker call timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Asks the model to split `task` into questions for `workers` (capability names). The
    /// model answers `{"assignments": [{"to": ..., "question": ...}]}` (read leniently);
    /// assignments to other workers are dropped.
    ///
    /// # Errors
    /// [`AgentError::Model`] when the call fails, or (MODEL_BAD_RESPONSE) when the answer
    /// holds no usable assignment.
    pub async fn plan(
        &self,
        task: &str,
        workers: &[&str],
        usage: &mut TokenUsage,
    ) -> Result<Vec<Assignment>, AgentError> {
        let request = ChatRequest::new(vec![
            ChatMessage::system(format!(
                "You split a task into focused, self-contained questions for worker agents. \
                 The workers are: {}. Reply with only a JSON object \
                 {{\"assignments\": [{{\"to\": \"<worker>\", \"question\": \"...\"}}]}}, at \
                 most one question per worker.",
                workers.join(", ")
            )),
            ChatMessage::user(task.to_string()),
        ]);
        let response = crate::gen_ai::observed_chat(self.provider.as_ref(), request, false).await?;
        usage.add(TokenUsage {
            input_tokens: response.usage.input_tokens,
            output_tokens: response.usage.output_tokens,
            model_calls: 1,
        });
        let text = response.message.text();
        let bad =
            |detail: String| AgentError::Model(crate::provider::ModelError::BadResponse { detail });
        let parsed = crate::arguments::parse_arguments(text, false)
            .map_err(|e| bad(format!("the plan is not JSON: {e}")))?;
        let list = parsed
            .value
            .get("assignments")
            .cloned()
            .unwrap_or(parsed.value);
        let assignments: Vec<Assignment> = serde_json::from_value(list)
            .map_err(|e| bad(format!("the plan has no assignments list: {e}")))?;
        let assignments: Vec<Assignment> = assignments
            .into_iter()
            .filter(|a| workers.contains(&a.to.as_str()) && !a.question.trim().is_empty())
            .collect();
        if assignments.is_empty() {
            return Err(bad("the plan assigns nothing to a known worker".into()));
        }
        Ok(assignments)
    }

    /// Plans `task` over `workers`, dispatches, and synthesises.
    ///
    /// # Errors
    /// [`AgentError`] when planning or synthesis fails (a worker's failure is reported in
    /// its reply and to the synthesis, not as an error).
    pub async fn run(
        &self,
        ctx: RunContext,
        task: &str,
        workers: &[&str],
    ) -> Result<SupervisorOutcome, AgentError> {
        let mut usage = TokenUsage::default();
        let assignments = self.plan(task, workers, &mut usage).await?;
        self.run_assignments(ctx, task, assignments, usage).await
    }

    /// Dispatches `assignments` concurrently and synthesises their answers; `usage` is what
    /// was spent already (planning).
    ///
    /// # Errors
    /// [`AgentError`] when synthesis fails.
    pub async fn run_assignments(
        &self,
        ctx: RunContext,
        task: &str,
        assignments: Vec<Assignment>,
        mut usage: TokenUsage,
    ) -> Result<SupervisorOutcome, AgentError> {
        let context_summary: String = task.chars().take(2000).collect();
        let mut sent = HashMap::new();
        let mut calls = Vec::new();
        for (i, assignment) in assignments.iter().enumerate() {
            let handoff = Handoff {
                question: assignment.question.clone(),
                context_summary: context_summary.clone(),
                max_turns: self.worker_turns,
                from: self.name.clone(),
                to: assignment.to.clone(),
            };
            let timeout = match ctx.deadline {
                Some(deadline) => self
                    .timeout
                    .min(deadline.saturating_duration_since(tokio::time::Instant::now())),
                None => self.timeout,
            };
            let options = CallOptions {
                timeout: Some(timeout),
                trace_id: (!ctx.trace_id.is_empty()).then(|| ctx.trace_id.clone()),
                task_id: (!ctx.task_id.is_empty()).then(|| ctx.task_id.clone()),
                turn: Some(ctx.turn.saturating_add(1)),
                ..CallOptions::default()
            };
            let message =
                self.client
                    .message_to_capability(&assignment.to, handoff.to_payload(), &options);
            let message_id = message
                .header
                .as_ref()
                .map(|h| h.message_id.clone())
                .unwrap_or_default();
            sent.insert(message_id.clone(), i);
            let client = self.client.clone();
            calls.push(async move { (message_id, client.send(message, Some(timeout)).await) });
        }
        let outcomes = futures::future::join_all(calls).await;
        let mut replies: Vec<Option<WorkerReply>> = vec![None; assignments.len()];
        for (message_id, outcome) in outcomes {
            let answer = match outcome {
                Ok(response) => {
                    let reply = response.message.unwrap_or_default();
                    let correlation = reply
                        .header
                        .as_ref()
                        .map(|h| h.correlation_id.clone())
                        .unwrap_or_default();
                    if !correlation.is_empty() && correlation != message_id {
                        tracing::warn!(%message_id, %correlation, "a worker's reply answers another message");
                    }
                    reply
                        .payload
                        .as_ref()
                        .and_then(Payload::first_json)
                        .ok_or_else(|| "the worker's reply has no data part".to_string())
                        .and_then(|v| {
                            serde_json::from_value::<HandoffAnswer>(v)
                                .map_err(|e| format!("the worker's answer is malformed: {e}"))
                        })
                }
                Err(status) => Err(format!(
                    "{}: {}",
                    reach_rpc::errors::code_name(status.code()),
                    status.message()
                )),
            };
            if let Ok(answer) = &answer {
                usage.add(TokenUsage {
                    input_tokens: answer.input_tokens,
                    output_tokens: answer.output_tokens,
                    model_calls: u64::from(answer.turns),
                });
            }
            let Some(&index) = sent.get(&message_id) else {
                continue;
            };
            replies[index] = Some(WorkerReply {
                assignment: assignments[index].clone(),
                message_id,
                answer,
            });
        }
        let replies: Vec<WorkerReply> = replies.into_iter().flatten().collect();
        let mut findings = String::new();
        for reply in &replies {
            let text = match &reply.answer {
                Ok(answer) if answer.completed => answer.answer.clone(),
                Ok(answer) => format!("(incomplete) {}", answer.answer),
                Err(error) => format!("(no answer: {error})"),
            };
            findings.push_str(&format!(
                "- {} was asked {:?} and answered: {}\n",
                reply.assignment.to, reply.assignment.question, text
            ));
        }
        let request = ChatRequest::new(vec![
            ChatMessage::system(
                "Combine the workers' answers into one final answer to the task. Say what is \
                 missing when a worker did not answer.",
            ),
            ChatMessage::user(format!("Task: {task}\n\nAnswers:\n{findings}")),
        ]);
        let response = crate::gen_ai::observed_chat(self.provider.as_ref(), request, false).await?;
        usage.add(TokenUsage {
            input_tokens: response.usage.input_tokens,
            output_tokens: response.usage.output_tokens,
            model_calls: 1,
        });
        Ok(SupervisorOutcome {
            answer: response.message.text().to_string(),
            replies,
            usage,
        })
    }
}
