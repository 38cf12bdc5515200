//! The tool-calling loop: [`Agent`] sends the conversation and the tools to the model, runs
//! the tool calls it requests, feeds the results back, and stops at a final answer or after
//! `max_turns` model calls.
//!
//! ```
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use reach_agent::agent_loop::{Agent, RunContext, Stopped};
//! use reach_agent::scripted::{ScriptedProvider, Step};
//! use reach_agent::tool::ToolRegistry;
//!
//! let model = ScriptedProvider::new([Step::reply("hello")]).shared();
//! let agent = Agent::new(model, ToolRegistry::new()).system("Be brief.").max_turns(4);
//! let outcome = agent.run(RunContext::default(), "hi").await?;
//! assert_eq!((outcome.answer.as_str(), outcome.stopped), ("hello", Stopped::Final));
//! # Ok(()) }
//! ```
//!
//! A *turn* is one model call. Tool calls of one model message run concurrently, each in its
//! own `tool.call` span (see [`crate::tool::Tool::call`]); with
//! [`Agent::one_tool_per_step`] only the first runs (the request asks the model for one call
//! at a time with `parallel_tool_calls: false`) and the others are answered with an error
//! saying to request them one at a time. A tool's failure — unknown tool, arguments that
//! cannot be repaired, the tool's own error — goes back to the model as the tool message (a
//! normalised [`ToolResult`]), never ends the run. When the model still asks for tools at
//! `max_turns`, the run ends with [`Stopped::MaxTurns`] and an answer saying it could not
//! complete within N turns.
//!
//! Each model call is a GenAI span ([`crate::gen_ai`]); the run is an `agent.run` span that
//! continues the context's trace when it has one.

use std::sync::Arc;

use reach_rpc::errors::{reason, status_with_reason};
use reach_rpc::usage::TokenUsage;
use tokio::time::Instant;
use tracing::Instrument;

use crate::memory::Memory;
use crate::provider::{
    ChatMessage, ChatRequest, ModelError, ModelProvider, Role, ToolCall, ToolChoice,
};
use crate::result::{ToolError, ToolErrorCode, ToolResult};
use crate::tool::{ToolContext, ToolRegistry};

/// The run's trace, task and deadline (from a [`reach_sdk::HandlerContext`] inside an
/// agent, or set by hand).
#[derive(Debug, Clone, Default)]
pub struct RunContext {
    /// The W3C trace id to continue ("" starts none: the current span's trace is used).
    pub trace_id: String,
    /// The task id ("" when none; memory is per task, so none means no memory).
    pub task_id: String,
    /// When the run must end.
    pub deadline: Option<Instant>,
    /// The envelope `turn` of the message that started the run (0 for a run that no
    /// message started). A mesh call made in loop turn `n` carries `turn + n`, so a
    /// conversation that passes from agent to agent keeps counting, and the router's
    /// `max_turn` stops one that loops ([`reach_rpc::errors::reason::TURN_LIMIT_EXCEEDED`]).
    pub turn: u32,
    /// The agent's model slots: each model call holds one, so the registry (and the
    /// router's balancing) sees how many model calls run and how many more could start.
    /// `None`: calls are not counted.
    pub model_slots: Option<reach_sdk::ModelSlots>,
}

impl RunContext {
    /// A context of task `task_id`.
    pub fn task(task_id: impl Into<String>) -> Self {
        Self {
            task_id: task_id.into(),
            ..Self::default()
        }
    }
}

impl From<&reach_sdk::HandlerContext> for RunContext {
    fn from(ctx: &reach_sdk::HandlerContext) -> Self {
        Self {
            trace_id: ctx.trace_id.clone(),
            task_id: ctx.task_id.clone(),
            deadline: ctx.deadline,
            turn: ctx.turn,
            model_slots: Some(ctx.model_slots.clone()),
        }
    }
}

/// Why the run stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stopped {
    /// The model gave a final answer.
    Final,
    /// `max_turns` model calls were made and the model still wanted tools.
    MaxTurns,
}

/// One tool call the run made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallRecord {
    /// The model's call id.
    pub id: String,
    /// The tool's name (dotted form).
    pub name: String,
    /// The arguments as the model wrote them.
    pub arguments: String,
    /// What it returned.
    pub result: ToolResult,
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct AgentOutcome {
    /// The final answer; for [`Stopped::MaxTurns`], "could not complete within N turns"
    /// (with the model's last text, if any).
    pub answer: String,
    /// Model calls made in the loop (memory folding excluded).
    pub turns: u32,
    /// Tokens spent by every model call of the run (folding included), and their count.
    pub usage: TokenUsage,
    /// Every tool call, in order.
    pub tool_calls: Vec<ToolCallRecord>,
    /// Why it stopped.
    pub stopped: Stopped,
    /// The conversation at the end (system messages included).
    pub messages: Vec<ChatMessage>,
}

/// Why a run failed (tool failures do not fail runs; they go back to the model).
#[derive(Debug, Clone, thiserror::Error)]
pub enum AgentError {
    /// A model call failed (after the provider's retries).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The run's deadline passed.
    #[error("the agent's deadline passed after {turns} turns")]
    DeadlineExceeded {
        /// Model calls made.
        turns: u32,
    },
}

impl From<AgentError> for tonic::Status {
    fn from(error: AgentError) -> Self {
        match error {
            AgentError::Model(e) => e.into(),
            AgentError::DeadlineExceeded { turns } => status_with_reason(
                tonic::Code::DeadlineExceeded,
                format!("the agent's deadline passed after {turns} model calls; allow more time"),
                reason::DEADLINE_EXCEEDED,
                [("turns".to_string(), turns.to_string())],
            ),
        }
    }
}

/// An LLM agent: a model, tools, and the loop's settings. Cheap to clone.
#[derive(Clone)]
pub struct Agent {
    provider: Arc<dyn ModelProvider>,
    tools: Arc<ToolRegistry>,
    system: Option<String>,
    max_turns: u32,
    one_tool_per_step: bool,
    streaming: bool,
    memory: Option<Arc<Memory>>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("model", &self.provider.model())
            .field("tools", &self.tools.len())
            .field("max_turns", &self.max_turns)
            .finish_non_exhaustive()
    }
}

impl Agent {
    /// An agent over `provider` with `tools`: no system prompt, 8 turns, concurrent tool
    /// calls, no streaming, no memory.
    pub fn new(provider: Arc<dyn ModelProvider>, tools: ToolRegistry) -> Self {
        Self {
            provider,
            tools: Arc::new(tools),
            system: None,
            max_turns: 8,
            one_tool_per_step: false,
            streaming: false,
            memory: None,
        }
    }

    /// An agent from a config file's `[agent]` section.
    pub fn from_config(
        provider: Arc<dyn ModelProvider>,
        tools: ToolRegistry,
        config: &crate::config::LoopConfig,
    ) -> Self {
        let mut agent = Self::new(provider, tools)
            .max_turns(config.max_turns)
            .one_tool_per_step(config.one_tool_per_step)
            .streaming(config.streaming);
        agent.system = config.system.clone();
        agent
    }

    /// Sets the system prompt.
    pub fn system(mut self, text: impl Into<String>) -> Self {
        self.system = Some(text.into());
        self
    }

    /// Sets the most model calls per run (at least 1).
    pub fn max_turns(mut self, n: u32) -> Self {
        self.max_turns = n.max(1);
        self
    }

    /// Runs one tool call per model step.
    pub fn one_tool_per_step(mut self, on: bool) -> Self {
        self.one_tool_per_step = on;
        self
    }

    /// Streams model responses (assembled before tools run).
    pub fn streaming(mut self, on: bool) -> Self {
        self.streaming = on;
        self
    }

    /// Keeps per-task memory (folded after tool rounds).
    pub fn memory(mut self, memory: Arc<Memory>) -> Self {
        self.memory = Some(memory);
        self
    }

    /// The model provider.
    pub fn provider(&self) -> &Arc<dyn ModelProvider> {
        &self.provider
    }

    /// The tools.
    pub fn tools(&self) -> &ToolRegistry {
        &self.tools
    }

    /// The turn limit.
    pub fn turn_limit(&self) -> u32 {
        self.max_turns
    }

    /// Runs the loop on a user message.
    ///
    /// # Errors
    /// [`AgentError`] when a model call fails or the deadline passes.
    pub async fn run(
        &self,
        ctx: RunContext,
        input: impl Into<String>,
    ) -> Result<AgentOutcome, AgentError> {
        self.run_messages(ctx, vec![ChatMessage::user(input)]).await
    }

    /// Runs the loop on `messages` appended to the task's memory (when kept).
    ///
    /// # Errors
    /// [`AgentError`] when a model call fails or the deadline passes.
    pub async fn run_messages(
        &self,
        ctx: RunContext,
        messages: Vec<ChatMessage>,
    ) -> Result<AgentOutcome, AgentError> {
        let span = tracing::info_span!(
            "agent.run",
            otel.name = "invoke_agent",
            gen_ai.operation.name = "invoke_agent",
            gen_ai.request.model = %self.provider.model(),
            task_id = %ctx.task_id,
            agent.turns = tracing::field::Empty,
            agent.stopped = tracing::field::Empty,
        );
        if let Ok(trace_id) = reach_rpc::trace::TraceId::parse(&ctx.trace_id) {
            reach_telemetry::adopt_trace_id(&span, trace_id);
        }
        let outcome = self.run_inner(ctx, messages).instrument(span.clone()).await;
        if let Ok(outcome) = &outcome {
            span.record("agent.turns", outcome.turns);
            span.record(
                "agent.stopped",
                match outcome.stopped {
                    Stopped::Final => "final",
                    Stopped::MaxTurns => "max_turns",
                },
            );
        }
        outcome
    }

    async fn run_inner(
        &self,
        ctx: RunContext,
        input: Vec<ChatMessage>,
    ) -> Result<AgentOutcome, AgentError> {
        let mut messages = Vec::new();
        if let Some(system) = &self.system {
            messages.push(ChatMessage::system(system.clone()));
        }
        let memory = self.memory.as_ref().filter(|_| !ctx.task_id.is_empty());
        if let Some(memory) = memory {
            messages.extend(memory.load(&ctx.task_id));
        }
        messages.extend(input);
        let trace_id = if ctx.trace_id.is_empty() {
            reach_telemetry::current_trace_id()
                .map(|t| t.to_string())
                .unwrap_or_default()
        } else {
            ctx.trace_id.clone()
        };
        let mut usage = TokenUsage::default();
        let mut records = Vec::new();
        let mut turns = 0u32;
        let specs = self.tools.specs();
        loop {
            if turns >= self.max_turns {
                let last = messages
                    .iter()
                    .rev()
                    .find(|m| m.role == Role::Assistant)
                    .map(|m| m.text().trim().to_string())
                    .unwrap_or_default();
                let mut answer = format!(
                    "could not complete the task within {} turns",
                    self.max_turns
                );
                if !last.is_empty() {
                    answer.push_str(": ");
                    answer.push_str(&last);
                }
                return Ok(self.finish(
                    &ctx,
                    answer,
                    turns,
                    usage,
                    records,
                    Stopped::MaxTurns,
                    messages,
                ));
            }
            turns += 1;
            let request = ChatRequest {
                messages: crate::memory::strip_repeated_system(&messages),
                tools: specs.clone(),
                tool_choice: if specs.is_empty() {
                    ToolChoice::None
                } else {
                    ToolChoice::Auto
                },
                parallel_tool_calls: (self.one_tool_per_step && !specs.is_empty()).then_some(false),
                ..ChatRequest::default()
            };
            let call = async {
                // Waiting for a free slot is part of the call (and of its deadline).
                let _slot = match &ctx.model_slots {
                    Some(slots) => Some(slots.acquire().await),
                    None => None,
                };
                crate::gen_ai::observed_chat(self.provider.as_ref(), request, self.streaming).await
            };
            let response = match ctx.deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, call)
                    .await
                    .map_err(|_| AgentError::DeadlineExceeded { turns })??,
                None => call.await?,
            };
            usage.add(TokenUsage {
                input_tokens: response.usage.input_tokens,
                output_tokens: response.usage.output_tokens,
                model_calls: 1,
            });
            let message = response.message;
            if message.tool_calls.is_empty() {
                let answer = message.text().to_string();
                messages.push(message);
                return Ok(self.finish(
                    &ctx,
                    answer,
                    turns,
                    usage,
                    records,
                    Stopped::Final,
                    messages,
                ));
            }
            let calls = message.tool_calls.clone();
            messages.push(message);
            let results = self.run_tools(&ctx, &trace_id, turns, &calls).await;
            for (call, result) in calls.into_iter().zip(results) {
                messages.push(ChatMessage::tool(
                    call.id.clone(),
                    call.name.clone(),
                    result.to_model_text(),
                ));
                records.push(ToolCallRecord {
                    id: call.id,
                    name: crate::tool::capability_name(&call.name),
                    arguments: call.arguments,
                    result,
                });
            }
            if let Some(memory) = memory {
                match memory.fold(self.provider.as_ref(), &mut messages).await {
                    Ok(Some(spent)) => usage.add(TokenUsage {
                        input_tokens: spent.input_tokens,
                        output_tokens: spent.output_tokens,
                        model_calls: 1,
                    }),
                    Ok(None) => {}
                    Err(error) => {
                        tracing::warn!(error = %error, "memory folding failed; the conversation is kept whole");
                    }
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        ctx: &RunContext,
        answer: String,
        turns: u32,
        usage: TokenUsage,
        tool_calls: Vec<ToolCallRecord>,
        stopped: Stopped,
        messages: Vec<ChatMessage>,
    ) -> AgentOutcome {
        if let Some(memory) = self.memory.as_ref().filter(|_| !ctx.task_id.is_empty()) {
            let kept: Vec<ChatMessage> = messages
                .iter()
                .filter(|m| !(m.role == Role::System && Some(m.text()) == self.system.as_deref()))
                .cloned()
                .collect();
            memory.store(&ctx.task_id, kept);
        }
        AgentOutcome {
            answer,
            turns,
            usage,
            tool_calls,
            stopped,
            messages,
        }
    }

    async fn run_tools(
        &self,
        ctx: &RunContext,
        trace_id: &str,
        turn: u32,
        calls: &[ToolCall],
    ) -> Vec<ToolResult> {
        let run_one = |call: &ToolCall| {
            let tool_ctx = ToolContext {
                trace_id: trace_id.to_string(),
                task_id: ctx.task_id.clone(),
                deadline: ctx.deadline,
                turn: ctx.turn.saturating_add(turn),
                call_id: call.id.clone(),
                tool: crate::tool::capability_name(&call.name),
            };
            let tool = self.tools.get(&call.name).cloned();
            let arguments = call.arguments.clone();
            let available: Vec<String> = self
                .tools
                .iter()
                .map(|t| t.function_name().to_string())
                .collect();
            let name = call.name.clone();
            // Labels stay bounded: a name the model invented is counted as `unknown`.
            let label = tool
                .as_ref()
                .map_or_else(|| "unknown".to_string(), |t| t.name().to_string());
            async move {
                let result = match tool {
                    Some(tool) => tool.call(&arguments, tool_ctx).await,
                    None => ToolResult::error(
                        ToolError::new(
                            ToolErrorCode::UnknownTool,
                            format!(
                                "there is no tool named {name:?}; the tools are: {}",
                                available.join(", ")
                            ),
                        ),
                        0,
                    ),
                };
                metrics::counter!(
                    reach_telemetry::metrics::names::AGENT_TOOL_CALLS,
                    "tool" => label,
                    "status" => if result.is_ok() { "ok" } else { "error" }
                )
                .increment(1);
                result
            }
        };
        if self.one_tool_per_step {
            let mut results = Vec::with_capacity(calls.len());
            for (i, call) in calls.iter().enumerate() {
                if i == 0 {
                    results.push(run_one(call).await);
                } else {
                    results.push(ToolResult::error(
                        ToolError::new(
                            ToolErrorCode::Failed,
                            "not run: this agent runs one tool call per step; request it again after reading the first result",
                        ),
                        0,
                    ));
                }
            }
            results
        } else {
            futures::future::join_all(calls.iter().map(run_one)).await
        }
    }
}
